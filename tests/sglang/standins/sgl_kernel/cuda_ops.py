"""CUDA implementations of the stand-in ops `sgl_kernel::fwd` and `sgl_kernel::get_scheduler_metadata`, for
running SGLang's FA3 decode path on a GPU without the real kernel library (benchmarks/sglang_fa3_gpu.py).

Registered for the "CUDA" dispatch key by flash_ops.register() (the CPU key keeps flash_ops' implementations,
unless SGL_KERNEL_STANDIN_CPU=paged_decode asks for these on the CPU too: a dry run of the GPU script's path).
Both run without a host read (no .item(), .tolist(), int(tensor), no Python loop over tensor values), so a
compiled step that calls them can replay under torch.cuda.set_sync_debug_mode("error") and sit in a CUDA graph:

- fwd: the paged decode case only (page_table and seqused_k given; q [B, Sq, H, D], or [B, H, D] with
  cu_seqlens_q and max_seqlen_q == 1, SGLang's decode layout), computed by torch.ops.syncfree.paged_decode
  (this project's Triton kernel; its torch fallback on the CPU). softmax_lse is NOT computed: it comes back
  filled with NaN (SGLang's plain decode does not read it; the cascade path, which does, is not supported here).
  Anything else raises NotImplementedError naming the argument.
- get_scheduler_metadata: flash_ops' encoding (see flash_ops.py), computed with tensor ops on the device.

The contract checks of flash_ops' CPU implementations that depend on tensor values are kept, on the device, as
torch._assert_async (a device-side assert: no host read; a failure surfaces at the next synchronisation as a CUDA
device-side assertion, on the CPU at once as a RuntimeError): a row longer than its page table, a page id out of
the KV cache's range, cu_seqlens_q other than 0..B, scheduler metadata that plans more splits than this call
allocates for or fewer key blocks than it needs. The checks on shapes, dtypes and the static plan raise at once,
as on the CPU.
"""

from __future__ import annotations

import torch

from sgl_kernel import flash_ops as F


def _assert(cond: torch.Tensor, message: str) -> None:
    torch._assert_async(cond, message)


def get_scheduler_metadata_device(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim,
                                  headdim_v, qkv_dtype, seqused_k, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
                                  seqused_q, leftpad_k, page_size, max_seqlen_k_new=0, is_causal=False,
                                  window_size_left=-1, window_size_right=-1, attention_chunk=0, has_softcap=False,
                                  num_splits=0, pack_gqa=None, sm_margin=0):
    """flash_ops.get_scheduler_metadata_impl with _row_splits' host sum replaced by tensor ops (same values)."""
    if seqused_k.dim() != 1 or seqused_k.numel() < batch_size:
        raise IndexError(f"get_scheduler_metadata: seqused_k has {seqused_k.numel()} rows, batch_size {batch_size}")
    static_splits, n_blocks = F._plan(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, page_size,
                                      num_splits)
    bn = F.block_n(page_size)
    lens = seqused_k[:batch_size].to(torch.int64)
    rows = -(-lens // bn)
    # _row_splits: per_sm = max(1, ceil(total * 1.1 * heads_k / NUM_SMS)), in float64 as Python computes it
    total = rows.sum().to(torch.float64)
    per_sm = torch.ceil(total * 1.1 * num_heads_k / F.NUM_SMS).clamp(min=1).to(torch.int64)
    splits = torch.clamp(-(-rows // per_sm), 1, static_splits)
    br = -(-batch_size // 4) * 4
    # Built from device tensors only: `md[0] = int` would copy a host scalar to the device (a sync).
    dev, i32 = seqused_k.device, torch.int32
    parts = [torch.full((1,), static_splits, dtype=i32, device=dev), splits.to(i32),
             torch.zeros(br - batch_size, dtype=i32, device=dev), torch.full((batch_size,), n_blocks, dtype=i32,
                                                                             device=dev)]
    md = torch.cat(parts)
    return torch.cat([md, torch.zeros(F.metadata_size(batch_size) - md.numel(), dtype=i32, device=dev)])


def _check_metadata_device(md, batch, static_splits, n_blocks, row_blocks):
    if md.dtype != torch.int32 or md.dim() != 1 or md.numel() != F.metadata_size(batch):
        raise RuntimeError(f"scheduler_metadata must be int32 of shape [{F.metadata_size(batch)}] for batch {batch}, "
                           f"got {md.dtype} {tuple(md.shape)}")
    br = -(-batch // 4) * 4
    planned_splits = md[1:1 + batch].to(torch.int64)
    planned_blocks = md[1 + br:1 + br + batch].to(torch.int64)
    _assert((planned_splits <= static_splits).all(),
            f"scheduler_metadata plans more splits per row than this call allocates out_accum for "
            f"({static_splits}): the split-KV combine would read out of bounds")
    _assert(((planned_blocks >= n_blocks) & (planned_blocks >= row_blocks)).all(),
            f"scheduler_metadata is stale: it was built for fewer key blocks than this call needs ({n_blocks} "
            "from the page table, or a row's seqused_k)")


def fwd_paged_decode(q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                     seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                     rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, is_causal,
                     window_size_left, window_size_right, attention_chunk, softcap, is_rotary_interleaved,
                     scheduler_metadata, num_splits, pack_gqa, sm_margin, sinks, sparse_mask_fine, only_qv):
    for name, value in (("k_new", k_new), ("v_new", v_new), ("q_v", q_v), ("seqused_q", seqused_q),
                        ("kv_batch_idx", kv_batch_idx), ("leftpad_k", leftpad_k), ("rotary_cos", rotary_cos),
                        ("rotary_sin", rotary_sin), ("seqlens_rotary", seqlens_rotary), ("q_descale", q_descale),
                        ("k_descale", k_descale), ("v_descale", v_descale), ("sinks", sinks),
                        ("sparse_mask_fine", sparse_mask_fine)):
        if value is not None:
            raise NotImplementedError(f"sgl_kernel::fwd CUDA stand-in: {name} is not implemented")
    if only_qv or attention_chunk:
        raise NotImplementedError("sgl_kernel::fwd CUDA stand-in: only_qv / attention_chunk are not implemented")
    if page_table is None or seqused_k is None:
        raise NotImplementedError("sgl_kernel::fwd CUDA stand-in: only the paged decode case (page_table and "
                                  "seqused_k) is implemented")
    if softcap:
        raise NotImplementedError("sgl_kernel::fwd CUDA stand-in: softcap is not implemented")
    if window_size_left >= 0 or not (window_size_right < 0 or (is_causal and window_size_right == 0)):
        raise NotImplementedError("sgl_kernel::fwd CUDA stand-in: a sliding window is not implemented")
    h, d = q.shape[-2], q.shape[-1]
    hk = k.shape[-2]
    if v.shape[-1] != d:
        raise NotImplementedError("sgl_kernel::fwd CUDA stand-in: a value head dim other than q's")
    if h % hk:
        raise RuntimeError(f"number of heads in q ({h}) must be divisible by the key heads ({hk})")
    if cu_seqlens_q is not None:
        if q.dim() != 3:
            raise RuntimeError("with cu_seqlens_q, q must be [total_q, H, D]")
        batch = cu_seqlens_q.numel() - 1
        if max_seqlen_q != 1 or q.shape[0] != batch:
            raise NotImplementedError("sgl_kernel::fwd CUDA stand-in: varlen q is implemented for one query per "
                                      f"row only (max_seqlen_q={max_seqlen_q}, {q.shape[0]} queries, {batch} rows)")
        _assert((cu_seqlens_q == torch.arange(batch + 1, device=cu_seqlens_q.device,
                                              dtype=cu_seqlens_q.dtype)).all(),
                "cu_seqlens_q must be 0..B (one query per row)")
        q4 = q.unsqueeze(1)
    else:
        if q.dim() != 4:
            raise RuntimeError("without cu_seqlens_q, q must be [B, Sq, H, D]")
        batch = q.shape[0]
        if q.shape[1] > 1 and not is_causal:
            raise NotImplementedError("sgl_kernel::fwd CUDA stand-in: several queries per row need is_causal")
        q4 = q
    if page_table.dtype != torch.int32:
        raise RuntimeError(f"page_table must have dtype int32, got {page_table.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] < batch:
        raise IndexError(f"page_table {tuple(page_table.shape)} has fewer rows than the batch ({batch})")
    if seqused_k.dtype != torch.int32:
        raise RuntimeError(f"seqused_k (cache_seqlens) must have dtype int32, got {seqused_k.dtype}")
    if seqused_k.numel() < batch:
        raise IndexError(f"seqused_k has {seqused_k.numel()} rows, the batch has {batch}")
    page_size, num_pages, width = k.shape[1], k.shape[0], page_table.shape[1]
    seqlen_k = width * page_size  # FA3 sizes the key loop from the page table
    table = page_table[:batch]
    lens = seqused_k[:batch]
    # Device-side contract checks (flash_ops.fwd_impl raises on these on the CPU).
    lens64 = lens.to(torch.int64)
    _assert(((lens64 >= 0) & (lens64 <= seqlen_k)).all(),
            f"a row's cache_seqlens needs more pages than the page table's {width} columns (or is negative): "
            "the kernel would read past the row")
    needed = -(-lens64 // page_size)  # [B]
    live = torch.arange(width, device=table.device)[None, :] < needed[:, None]
    _assert((~live | ((table >= 0) & (table < num_pages))).all(),
            f"a page id the kernel must read is out of range of the KV cache's {num_pages} pages")
    if scheduler_metadata is not None:
        sq_max = (max_seqlen_q or 1) if cu_seqlens_q is not None else q.shape[1]
        static_splits, n_blocks = F._plan(batch, sq_max, seqlen_k, h, hk, page_size, num_splits)
        _check_metadata_device(scheduler_metadata, batch, static_splits, n_blocks,
                               -(-lens64 // F.block_n(page_size)))
    import compile_pass  # noqa: F401  (registers torch.ops.syncfree.paged_decode)

    o4 = torch.ops.syncfree.paged_decode(q4, k, v, table, lens, softmax_scale)
    o = o4.reshape(q.shape)
    if cu_seqlens_q is not None:
        lse = torch.full((h, q.shape[0]), float("nan"), dtype=torch.float32, device=q.device)
    else:
        lse = torch.full((q.shape[0], h, q.shape[1]), float("nan"), dtype=torch.float32, device=q.device)
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse, q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)
