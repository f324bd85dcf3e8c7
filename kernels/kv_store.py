"""`syncfree::store_kv`: write a step's new keys and values into the paged KV pool, in place.

k_pool, v_pool [layers, num_pages, page_size, Hkv, D]; k, v [N, Hkv, D] (or any shape ending in [Hkv, D]);
loc int [N] KV slots (slot s is page s // page_size, offset s % page_size). An opaque mutating op, as engines
use for their cache writes: traced code that wrote into a view of the pool (`k_pool[i].view(...).index_copy_`)
is functionalized into a copy of the whole pool per step; this op mutates the pool where it lies.
"""

from __future__ import annotations

import torch

from ._checks import check_index_tensor, check_same_device


def _check(k_pool, v_pool, layer, loc, k, v):
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dim() != 5:
            raise ValueError(f"{name} must be [layers, num_pages, page_size, Hkv, D], got shape {tuple(t.shape)}")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ in shape")
    if not 0 <= layer < k_pool.shape[0]:
        raise ValueError(f"layer must be in [0, {k_pool.shape[0]}), got {layer}")
    check_index_tensor("loc", loc, 1)
    check_same_device("k_pool", k_pool, v_pool=v_pool, loc=loc, k=k, v=v)
    hkv, dim = k_pool.shape[3], k_pool.shape[4]
    for name, t in (("k", k), ("v", v)):
        if t.shape[-2:] != (hkv, dim) or t.numel() != loc.shape[0] * hkv * dim:
            raise ValueError(f"{name} must hold {loc.shape[0]} rows of [{hkv}, {dim}], got shape {tuple(t.shape)}")


@torch.library.custom_op("syncfree::store_kv", mutates_args=("k_pool", "v_pool"))
def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    _check(k_pool, v_pool, layer, loc, k, v)
    hkv, dim = k_pool.shape[3], k_pool.shape[4]
    k_pool[layer].view(-1, hkv, dim).index_copy_(0, loc.to(torch.int64), k.reshape(-1, hkv, dim).to(k_pool.dtype))
    v_pool[layer].view(-1, hkv, dim).index_copy_(0, loc.to(torch.int64), v.reshape(-1, hkv, dim).to(v_pool.dtype))


@store_kv.register_fake
def _store_kv_fake(k_pool, v_pool, layer, loc, k, v):
    _check(k_pool, v_pool, layer, loc, k, v)
