"""`syncfree::paged_decode`: attention over FA's paged KV layout, reading only the live keys of each row.

q [B, Sq, Hq, D]; k_cache, v_cache [num_pages, page_size, Hkv, D]; page_table int [B, W]; cache_seqlens [B].
Row b attends keys t < L_b = cache_seqlens[b]; key t is slot t % page_size of page page_table[b, t // page_size].
Query i sits at position L_b - Sq + i and sees keys up to that position. Output [B, Sq, Hq, D] in q's dtype.
This is a self-guarding consumer: page-table columns and pages past a row's length are never read, so the
compile pass may hand it a static-width page table whose tail holds anything (SELF_GUARDING below).
Two kernel shapes: paged_decode_kernel.py runs one program per (row, KV head, split of the keys) and, with
several splits, a combine kernel merges them (TUNING, num_splits_for); paged_decode_short_kernel.py, for a small
batch over a short table, runs one program per (row, group of KV heads, split), reading each key block's page-table
entries once for all the heads of its group and their K and V in one tile each, then the same combine kernel
(SHORT_TUNING, use_short_path).
"""

from __future__ import annotations

import functools
import math

import torch

from ._checks import ATTN_DTYPES, check_index_tensor, check_same_device
from ._triton import cdiv, launch, sm_count, use_triton
from .warmup import warmable

# The facts the compile pass relies on (compile_pass.rules.self_guarding registers them): the argument that holds
# the page table, the lengths the op guards every row by, and the arguments that accept any upper bound.
SELF_GUARDING = {"syncfree::paged_decode": dict(page_table="page_table", lengths="cache_seqlens",
                                                upper_bounds=("max_seqlen_k",), page_size_of=("k_cache", 1))}

MIN_BLOCK_M = 16  # tl.dot needs M >= 16
# Launch configuration; benchmarks/tune.py sweeps it on a GPU (BENCHMARKS.md records the sweep and the choice).
# H200, 2026-11-30: BLOCK_N 64, 2 stages, 4 warps; a batch of fewer than 2 (row, KV head) programs per SM splits
# its keys toward 8 programs per SM, at most 64 splits of at least 2 key blocks. Uncapped (132 splits at B=1)
# lost 13-16% at 16K-32K keys; aiming at 4 programs per SM lost 26-40% at B=4 and 64K-128K; at least 4 blocks
# per split lost 13% at B=1 and 8K.
TUNING = {"block_n": 64, "programs_per_sm": 8, "max_splits": 64, "min_blocks_per_split": 2,
          "split_below_rows_per_sm": 2, "num_warps": 4, "num_stages": 2, "combine_block_s": 64, "combine_warps": 4}

# The short path (kernels/paged_decode_short_kernel.py): one program per (row, group of `heads_per_program` KV
# heads, split), for batches that split (fewer than TUNING["split_below_rows_per_sm"] (row, KV head) programs per
# SM) over a table of at most `max_keys` keys (width x page_size, a static shape: under the compile pass the table
# is max_context_len wide). `path`: "auto" (by shape, as just said), "short" or "split" (forced, for tests and
# benchmarks). Large batches never take it: their launch is TUNING's. H200, 2026-12-01 (`run_h200.sh short`,
# benchmarks/results/paged_decode_short.json): at every shape it targets it is slower than the split path, the
# best of 26 settings included (B=1 4K: 16.1-16.4 us against 13.3-15.4; B=1 8K: 22.8-23.5 against 16.2-18.5; B=4
# 8K: 56-61 against 42.5-47.4), so nothing selects it (path "split"); "auto" keeps the shape rule for experiments:
#   block_n            keys per tile (the pipelined loop's step), for every head of the program at once;
#   heads_per_program  KV heads per program (clamped to Hkv: 8 or more is all of them at Hkv 8). A program loads
#                      a block's page-table entries once for all of them; fewer heads give more programs;
#   programs_per_sm, min_keys_per_split, max_splits
#                      the split count: programs_per_sm x SMs programs over the (row, head group) pairs, at
#                      least min_keys_per_split keys per split (over the widest row the table allows), at most
#                      max_splits (short_splits_for);
#   num_warps, num_stages    the main kernel's launch; combine_block_s, combine_warps: the combine kernel's.
# The previous short path (split-KV with an in-kernel merge behind an atomic ticket, one program per KV head) lost
# to the split path at every shape it targeted on the H200 (BENCHMARKS.md) and is gone.
SHORT_TUNING = {"path": "split", "max_keys": 16384, "block_n": 16, "heads_per_program": 8, "programs_per_sm": 1,
                "min_keys_per_split": 32, "max_splits": 128, "num_warps": 8, "num_stages": 2,
                "combine_block_s": 64, "combine_warps": 4}
# Shared memory one program of the short kernel may use when the device does not say (H100/H200: 227 KB).
SHORT_SMEM_BYTES = 227 << 10


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def check_paged_decode_args(q, k_cache, v_cache, page_table, cache_seqlens, scale, max_seqlen_k=None) -> None:
    if max_seqlen_k is not None and (isinstance(max_seqlen_k, bool)
                                     or not isinstance(max_seqlen_k, (int, torch.SymInt))):
        raise TypeError(f"max_seqlen_k must be an int or None, got {type(max_seqlen_k).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in ATTN_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(t.shape)}")
    check_index_tensor("page_table", page_table, 2)
    check_index_tensor("cache_seqlens", cache_seqlens, 1)
    check_same_device("q", q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cache_seqlens=cache_seqlens)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"k_cache and v_cache must have q's dtype {q.dtype}, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    batch, _, hq, dim = q.shape
    hkv, kdim = k_cache.shape[2], k_cache.shape[3]
    if kdim != dim:
        raise ValueError(f"k_cache head dim {kdim} differs from q's {dim}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q's {hq} heads must be a multiple of k_cache's {hkv} KV heads")
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table has {page_table.shape[0]} rows but q has batch {batch}")
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} rows but q has batch {batch}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("q", q)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension")


def num_splits_for(batch: int, kv_heads: int, max_keys: int, sms: int) -> int:
    """Splits along the keys, from static shapes only: enough programs to keep every SM streaming keys.

    `sms` is the device's SM count (0: no splitting, e.g. the interpreter). A batch whose (row, KV head)
    programs already give every SM `split_below_rows_per_sm` of them is not split: the combine would only cost.
    Otherwise the split count aims at `programs_per_sm` programs per SM (about what one SM holds at once: a
    second, partly filled wave of programs costs more than longer splits), with at least `min_blocks_per_split`
    key blocks in each split (over the widest row the table allows) and at most `max_splits`.
    """
    rows = batch * kv_heads
    if sms <= 0 or rows >= TUNING["split_below_rows_per_sm"] * sms:
        return 1
    want = math.ceil(TUNING["programs_per_sm"] * sms / max(1, rows))  # programs_per_sm may be fractional
    most = max(1, cdiv(max_keys, TUNING["block_n"] * TUNING["min_blocks_per_split"]))
    return max(1, min(want, most, TUNING["max_splits"]))


def short_heads_and_block(kv_heads: int, block_m: int, block_d: int, itemsize: int,
                          smem_bytes: int = SHORT_SMEM_BYTES) -> tuple[int, int]:
    """The short kernel's (heads per program, block_n): SHORT_TUNING's, shrunk (block_n first, down to 16, then
    the heads) until its tiles fit in `smem_bytes` of shared memory less a margin: a launch past the device's
    limit fails. Triton 3.8 gives its pipelined K and V tiles and q next_pow2(heads) x (2 block_n + block_m)
    x block_d elements at 2 or 3 stages, one block_n more for fp32 (IEEE dots): bf16, D 128, 8 heads x 16 keys
    take 96 KB, x 32 keys 160 KB, x 64 keys 288 KB (no GPU gives that); fp32, 8 heads x 16 keys 256 KB."""
    heads = max(1, min(int(SHORT_TUNING["heads_per_program"]), kv_heads))
    block_n = max(16, _next_pow2(int(SHORT_TUNING["block_n"])))  # tl.dot needs N >= 16

    def need():
        rows = 2 * block_n + block_m + (block_n if itemsize >= 4 else 0)
        return _next_pow2(heads) * rows * block_d * itemsize

    budget = smem_bytes - (16 << 10)  # a margin for layout conversions and the allocator's alignment
    while need() > budget and block_n > 16:
        block_n //= 2
    while need() > budget and heads > 1:
        heads = cdiv(heads, 2)
    return heads, block_n


def short_splits_for(batch: int, kv_heads: int, max_keys: int, sms: int, heads_per_program: int | None = None) -> int:
    """The short path's split count, from static shapes only (1 when sms is 0): `programs_per_sm` programs per SM
    over the batch's (row, head group) pairs, with at least `min_keys_per_split` keys per split over the widest row
    the table allows, at most `max_splits`. `heads_per_program`: the launch's (SHORT_TUNING's, clamped to Hkv, when
    not given)."""
    heads = heads_per_program or max(1, min(int(SHORT_TUNING["heads_per_program"]), kv_heads))
    programs = max(1, batch * cdiv(kv_heads, heads))
    want = math.ceil(SHORT_TUNING["programs_per_sm"] * max(0, sms) / programs)  # programs_per_sm may be fractional
    most = max(1, cdiv(max_keys, SHORT_TUNING["min_keys_per_split"]))
    return max(1, min(want, most, SHORT_TUNING["max_splits"]))


def use_short_path(batch: int, kv_heads: int, max_keys: int, sms: int) -> bool:
    """Static shapes only: the short path for a batch that splits its keys, over a table of <= max_keys keys."""
    path = SHORT_TUNING["path"]
    if path in ("short", "split"):
        return path == "short"
    return (sms > 0 and max_keys <= SHORT_TUNING["max_keys"]
            and batch * kv_heads < TUNING["split_below_rows_per_sm"] * sms)


@functools.cache
def _smem_optin(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or SHORT_SMEM_BYTES)


def _smem_bytes(t: torch.Tensor) -> int:
    if t.is_cuda:
        return _smem_optin(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return SHORT_SMEM_BYTES


def _launch_short(q, k_cache, v_cache, page_table, cache_seqlens, scale, out):
    from .paged_decode_kernel import paged_decode_combine_kernel
    from .paged_decode_short_kernel import paged_decode_short_kernel

    batch, sq, hq, dim = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    width = page_table.shape[1]
    block_m = max(MIN_BLOCK_M, _next_pow2(sq * group))
    block_d = max(16, _next_pow2(dim))
    heads, block_n = short_heads_and_block(hkv, block_m, block_d, q.element_size(), _smem_bytes(q))
    splits = short_splits_for(batch, hkv, width * page_size, sm_count(q), heads)
    direct = splits == 1
    # With one split the kernel writes `out` itself and these partial buffers are not touched.
    acc = torch.empty((batch, hkv, splits, block_m, block_d) if not direct else (1,), dtype=torch.float32,
                      device=q.device)
    ml = torch.empty((batch, hkv, splits, 2, block_m) if not direct else (1,), dtype=torch.float32, device=q.device)
    launch(
        paged_decode_short_kernel, (batch, cdiv(hkv, heads), splits),
        q, k_cache, v_cache, page_table, cache_seqlens, acc, ml, out,
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), page_table.stride(1), cache_seqlens.stride(0),
        width, page_size, scale, sq, splits, hkv, k_cache.shape[0],
        GROUP=group, HEAD_DIM=dim, HEADS_PER_PROGRAM=heads, HEADS=_next_pow2(heads), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d, IEEE=q.dtype == torch.float32, DIRECT=direct,
        num_warps=SHORT_TUNING["num_warps"], num_stages=SHORT_TUNING["num_stages"],
    )
    if not direct:
        launch(
            paged_decode_combine_kernel, (batch, hkv, sq * group),
            acc, ml, out, out.stride(0), out.stride(1), out.stride(2), splits,
            GROUP=group, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_D=block_d,
            BLOCK_S=min(SHORT_TUNING["combine_block_s"], _next_pow2(splits)),
            num_warps=SHORT_TUNING["combine_warps"],
        )


def _launch(q, k_cache, v_cache, page_table, cache_seqlens, scale, out):
    from .paged_decode_kernel import paged_decode_combine_kernel, paged_decode_split_kernel

    batch, sq, hq, dim = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    width = page_table.shape[1]
    block_m = max(MIN_BLOCK_M, _next_pow2(sq * group))
    block_d = max(16, _next_pow2(dim))
    splits = num_splits_for(batch, hkv, width * page_size, sm_count(q))
    direct = splits == 1
    # With one split the kernel writes `out` itself and these partial buffers are not touched.
    acc = torch.empty((batch, hkv, splits, block_m, block_d) if not direct else (1,), dtype=torch.float32,
                      device=q.device)
    ml = torch.empty((batch, hkv, splits, 2, block_m) if not direct else (1,), dtype=torch.float32, device=q.device)
    launch(
        paged_decode_split_kernel, (batch, hkv, splits),
        q, k_cache, v_cache, page_table, cache_seqlens, acc, ml, out,
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), page_table.stride(1), cache_seqlens.stride(0),
        width, page_size, scale, sq, splits, k_cache.shape[0],
        GROUP=group, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=TUNING["block_n"], BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32, DIRECT=direct,
        num_warps=TUNING["num_warps"], num_stages=TUNING["num_stages"],
    )
    if not direct:
        launch(
            paged_decode_combine_kernel, (batch, hkv, sq * group),
            acc, ml, out, out.stride(0), out.stride(1), out.stride(2), splits,
            GROUP=group, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_D=block_d,
            BLOCK_S=min(TUNING["combine_block_s"], _next_pow2(splits)), num_warps=TUNING["combine_warps"],
        )


def _attend_torch(q, k_cache, v_cache, page_table, cache_seqlens, scale):
    """Vectorized torch version of the same semantics (CPU without the Triton interpreter)."""
    batch, sq, hq, dim = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    width = page_table.shape[1]
    lengths = cache_seqlens.to(torch.int64).clamp(min=0, max=width * page_size)
    keys = int(lengths.max()) if batch and k_cache.shape[0] else 0  # a host read of a CPU tensor: no device sync
    t = torch.arange(keys, device=q.device)
    live = t[None, :] < lengths[:, None]  # [B, T]
    # Dead keys address page 0 so that no table column or page past L_b is used; their values are masked.
    cols = torch.where(live, t[None, :] // page_size, 0)
    pages = torch.where(live, torch.gather(page_table.to(torch.int64), 1, cols), 0)
    # A key whose page id is not a page of the pool is skipped, as the kernels skip it (it adds nothing).
    live = live & (pages >= 0) & (pages < k_cache.shape[0])
    pages = torch.where(live, pages, 0)
    slots = (t % page_size)[None, :].expand_as(pages)
    k = torch.where(live[..., None, None], k_cache[pages, slots], 0).float()  # [B, T, Hkv, D]
    v = torch.where(live[..., None, None], v_cache[pages, slots], 0).float()
    group = hq // hkv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bthd->bhqt", q.float(), k) * scale
    pos = lengths[:, None] - sq + torch.arange(sq, device=q.device)[None, :]  # [B, Sq]
    visible = live[:, None, :] & (t[None, None, :] <= pos[:, :, None])  # [B, Sq, T]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees nothing gets zeros
    out = torch.einsum("bhqt,bthd->bqhd", probs, v)
    return out.to(q.dtype)


@torch.library.custom_op("syncfree::paged_decode", mutates_args=())
@warmable("syncfree::paged_decode")
def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    # max_seqlen_k: an upper bound of cache_seqlens, accepted like FA's and not needed (the kernel reads the
    # lengths on the device); engines pass it, and the compile pass may replace it by a static bound.
    check_paged_decode_args(q, k_cache, v_cache, page_table, cache_seqlens, scale, max_seqlen_k)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.numel() == 0:
        return torch.empty_like(q)
    if use_triton(q):
        out = torch.empty_like(q)
        if use_short_path(q.shape[0], k_cache.shape[2], page_table.shape[1] * k_cache.shape[1], sm_count(q)):
            _launch_short(q, k_cache, v_cache, page_table, cache_seqlens, scale, out)
        else:
            _launch(q, k_cache, v_cache, page_table, cache_seqlens, scale, out)
        return out
    # Same layout as the fake implementation (empty_like(q)), whatever the einsum produced.
    return torch.empty_like(q).copy_(_attend_torch(q, k_cache, v_cache, page_table, cache_seqlens, scale))


@paged_decode.register_fake
def _paged_decode_fake(q, k_cache, v_cache, page_table, cache_seqlens, scale=None, max_seqlen_k=None):
    check_paged_decode_args(q, k_cache, v_cache, page_table, cache_seqlens, scale, max_seqlen_k)
    return torch.empty_like(q)
