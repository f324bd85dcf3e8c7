"""Stand-in for the `flash_mla` package (the sgl-flash-mla wheel) on CPU, for tests/sglang only: the legacy dense
paged decode that SGLang's FlashMLABackend reaches through sglang.kernels.ops.attention.flash_mla_interface.

    get_mla_decoding_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
                              is_fp8_kvcache=False, topk=None, use_legacy=True)
        -> (tile_scheduler_metadata [num_sm_parts, 8] int32, num_splits [B + 1] int32)
    flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, ...)
        -> (out [B, s_q, h_q, head_dim_v], lse [B, h_q, s_q])

over the stand-in ops flash_mla_standin::get_mla_decoding_metadata and flash_mla_standin::fwd_kvcache_mla
(argument order of sgl-kernel's former fwd_kvcache_mla). Contract of the decode (FlashMLA's):
- k_cache [num_blocks, page_block_size, h_k, D] (SGLang: page 64, h_k 1, D = kv_lora_rank + rope), q
  [B, s_q, h_q, D]; values are the first head_dim_v channels of each cached key (MLA's absorbed layout).
- row b attends keys t < cache_seqlens[b] at block_table[b, t // page_block_size], slot t % page_block_size;
  causal: query i of s_q sits at position L - s_q + i and sees keys up to it.
- it reads block_table[b, j] only for j < cdiv(cache_seqlens[b], page_block_size): a wider table is fine, and
  where a row needs more columns than the table has, or a block id is outside k_cache, the stand-in raises
  (the real kernel would read out of bounds).
- the tile schedule (get_mla_decoding_metadata) is computed from cache_seqlens alone (never from the table's
  width): num_sm_parts = 132 // h_k // cdiv(s_q * h_q / h_k, 64) parts split the batch's blocks
  (cdiv(L_b, page) each, plus FlashMLA's fixed per-row cost of 5 blocks) into equal payloads; a part's row
  [begin_req, begin_block, end_req, end_block, begin_split, 0, 0, 0]; num_splits[b + 1] - num_splits[b] is how
  many parts touch row b. fwd raises when the schedule does not cover this call's rows exactly (a stale plan,
  or one made for another batch: the split-KV combine would read out of bounds).
Anything else (fp8 caches, sparse indices, attention sinks, extra caches, the MegaAttention ops) raises
NotImplementedError.
"""

from __future__ import annotations

import types

import torch

from .flash_mla_interface import FlashMLASchedMeta  # noqa: F401

__version__ = "0.0.0+cpu-stand-in"

NUM_SMS = 132
BLOCK_M = 64
FIXED_OVERHEAD_BLOCKS = 5
PAGE_BLOCK = 64

_LIB = torch.library.Library("flash_mla_standin", "DEF")
_LIB.define("get_mla_decoding_metadata(Tensor cache_seqlens, int num_q_tokens_per_head_k, int num_heads_k) "
            "-> (Tensor, Tensor)")
_LIB.define("fwd_kvcache_mla(Tensor q, Tensor k_cache, int head_dim_v, Tensor cache_seqlens, Tensor block_table, "
            "float softmax_scale, bool causal, Tensor tile_scheduler_metadata, Tensor num_splits) "
            "-> (Tensor, Tensor)")


def _cdiv(a, b):
    return -(-a // b)


def num_sm_parts(num_q_tokens_per_head_k: int, num_heads_k: int) -> int:
    return max(1, NUM_SMS // num_heads_k // _cdiv(num_q_tokens_per_head_k, BLOCK_M))


def _schedule(lens: list[int], parts: int):
    """FlashMLA's legacy get_mla_metadata, reduced to what decides coverage: rows' blocks laid end to end and cut
    into `parts` equal payloads."""
    blocks = [_cdiv(max(x, 0), PAGE_BLOCK) for x in lens]
    total = sum(blocks) + FIXED_OVERHEAD_BLOCKS * len(lens)
    payload = max(1, _cdiv(total, parts))
    md = torch.zeros(parts, 8, dtype=torch.int32)
    splits = [0] * len(lens)
    row, block = 0, 0
    for p in range(parts):
        md[p, 0], md[p, 1], md[p, 4] = row, block, sum(splits[:row])
        budget, touched = payload, set()
        while row < len(lens) and budget > 0:
            take = min(blocks[row] - block, budget)
            touched.add(row)
            block += take
            budget -= take
            if block >= blocks[row]:
                budget -= FIXED_OVERHEAD_BLOCKS
                row, block = row + 1, 0
        for r in touched:
            splits[r] += 1
        md[p, 2], md[p, 3] = row, block
    num_splits = torch.zeros(len(lens) + 1, dtype=torch.int32)
    num_splits[1:] = torch.cumsum(torch.tensor(splits, dtype=torch.int32), 0)
    return md, num_splits


def _metadata_cpu(cache_seqlens, num_q_tokens_per_head_k, num_heads_k):
    parts = num_sm_parts(num_q_tokens_per_head_k, num_heads_k)
    md, splits = _schedule([int(x) for x in cache_seqlens], parts)
    return md.to(cache_seqlens.device), splits.to(cache_seqlens.device)


def _metadata_fake(cache_seqlens, num_q_tokens_per_head_k, num_heads_k):
    parts = num_sm_parts(num_q_tokens_per_head_k, num_heads_k)
    return (cache_seqlens.new_empty(parts, 8, dtype=torch.int32),
            cache_seqlens.new_empty(cache_seqlens.shape[0] + 1, dtype=torch.int32))


def _fwd_cpu(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal, tile_scheduler_metadata,
             num_splits):
    b, s_q, h_q, d = q.shape
    num_blocks, page, h_k, dk = k_cache.shape
    if dk != d or block_table.dim() != 2 or block_table.shape[0] < b or cache_seqlens.numel() < b:
        raise RuntimeError(f"fwd_kvcache_mla: shapes q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, block_table "
                           f"{tuple(block_table.shape)}, cache_seqlens {tuple(cache_seqlens.shape)} do not agree")
    lens = [int(x) for x in cache_seqlens[:b]]
    want_md, want_splits = _schedule(lens, tile_scheduler_metadata.shape[0])
    if num_splits.numel() != b + 1 or not torch.equal(num_splits.cpu(), want_splits) \
            or not torch.equal(tile_scheduler_metadata.cpu(), want_md):
        raise RuntimeError("fwd_kvcache_mla: the tile scheduler metadata was not computed for these cache_seqlens "
                           "(a stale or foreign schedule: the split-KV combine would read out of bounds)")
    out = q.new_empty(b, s_q, h_q, head_dim_v)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32)
    for row, length in enumerate(lens):
        needed = _cdiv(max(length, 0), page)
        if needed > block_table.shape[1]:
            raise IndexError(f"fwd_kvcache_mla: row {row} needs {needed} blocks, the block table has "
                             f"{block_table.shape[1]} columns (the kernel would read past the row)")
        ids = block_table[row, :needed].to(torch.int64)
        if needed and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise IndexError(f"fwd_kvcache_mla: row {row} reads block {int(ids.min())}..{int(ids.max())}, outside "
                             f"the cache's {num_blocks} blocks")
        keys = k_cache[ids].reshape(-1, h_k, d)[:length].float().repeat_interleave(h_q // h_k, 1)
        vals = keys[..., :head_dim_v]
        s = torch.einsum("qhd,khd->hqk", q[row].float(), keys) * softmax_scale
        if causal:
            pos = torch.arange(s_q)[:, None] + length - s_q
            s = s.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
        row_lse = torch.logsumexp(s, -1)
        out[row] = torch.einsum("hqk,khd->qhd", torch.exp(s - row_lse[..., None]), vals).to(out.dtype)
        lse[row] = row_lse
    return out, lse


def _fwd_fake(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal, tile_scheduler_metadata,
              num_splits):
    b, s_q, h_q, _ = q.shape
    return q.new_empty(b, s_q, h_q, head_dim_v), q.new_empty(b, h_q, s_q, dtype=torch.float32)


_LIB.impl("get_mla_decoding_metadata", _metadata_cpu, "CPU")
_LIB.impl("fwd_kvcache_mla", _fwd_cpu, "CPU")
torch.library.register_fake("flash_mla_standin::get_mla_decoding_metadata", _metadata_fake, lib=_LIB)
torch.library.register_fake("flash_mla_standin::fwd_kvcache_mla", _fwd_fake, lib=_LIB)


def get_mla_metadata(*args, **kwargs):
    """The tensor-less form (an empty schedule the first decode fills): the stand-in has no such path."""
    if args or kwargs:
        raise NotImplementedError("stand-in flash_mla.get_mla_metadata with arguments")
    return (FlashMLASchedMeta(), None)


def get_mla_decoding_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
                              is_fp8_kvcache=False, topk=None, use_legacy=True):
    if is_fp8_kvcache or topk is not None or not use_legacy:
        raise NotImplementedError("stand-in flash_mla: fp8 / sparse / current-kernel scheduling")
    return torch.ops.flash_mla_standin.get_mla_decoding_metadata(cache_seqlens, num_q_tokens_per_head_k,
                                                                  num_heads_k)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                           extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, use_legacy=True, kv_format=None, descale_q=None, descale_k=None,
                           num_splits=None):
    for name, value in (("indices", indices), ("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
                        ("extra_indices_in_kvcache", extra_indices_in_kvcache), ("topk_length", topk_length),
                        ("extra_topk_length", extra_topk_length), ("kv_format", kv_format),
                        ("descale_q", descale_q), ("descale_k", descale_k)):
        if value is not None:
            raise NotImplementedError(f"stand-in flash_mla_with_kvcache: {name}")
    if is_fp8_kvcache or not use_legacy:
        raise NotImplementedError("stand-in flash_mla_with_kvcache: fp8 cache / current kernels")
    meta = tile_scheduler_metadata
    if meta.tile_scheduler_metadata is None or meta.num_splits is None:
        raise NotImplementedError("stand-in flash_mla_with_kvcache: a schedule the first call fills")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return torch.ops.flash_mla_standin.fwd_kvcache_mla(q, k_cache, head_dim_v, cache_seqlens, block_table, scale,
                                                        causal, meta.tile_scheduler_metadata, meta.num_splits)


def _missing(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"stand-in flash_mla: {name} is not implemented")

    fn.__name__ = name
    return fn


flash_mla_sparse_fwd = _missing("flash_mla_sparse_fwd")
fused_norm_rope_attn_rope_cast = types.SimpleNamespace(prefill=_missing("fused_norm_rope_attn_rope_cast.prefill"),
                                                       decode=_missing("fused_norm_rope_attn_rope_cast.decode"))


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
