"""CPU stand-in for sgl_kernel's FA3 extension (flash_ops.abi3.so of sglang-kernel 0.4.10).

Registers, with the exact schemas the .so declares (read from the 0.4.10 wheel):

    sgl_kernel::fwd(Tensor q, Tensor k, Tensor v, Tensor? k_new, Tensor? v_new, Tensor? q_v, Tensor(a!)? out,
        Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? seqused_k,
        int? max_seqlen_q, int? max_seqlen_k, Tensor? page_table, Tensor? kv_batch_idx, Tensor? leftpad_k,
        Tensor? rotary_cos, Tensor? rotary_sin, Tensor? seqlens_rotary, Tensor? q_descale, Tensor? k_descale,
        Tensor? v_descale, float? softmax_scale, bool is_causal, int window_size_left, int window_size_right,
        int attention_chunk, float softcap, bool is_rotary_interleaved, Tensor? scheduler_metadata, int num_splits,
        bool? pack_gqa, int sm_margin, Tensor? sinks, Tensor? sparse_mask_fine, bool only_qv)
        -> (Tensor(a!), Tensor, Tensor, Tensor)
    sgl_kernel::get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, int num_heads,
        int num_heads_k, int headdim, int headdim_v, ScalarType qkv_dtype, Tensor seqused_k, Tensor? cu_seqlens_q,
        Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? leftpad_k, int? page_size,
        int max_seqlen_k_new=0, bool is_causal=False, int window_size_left=-1, int window_size_right=-1,
        int attention_chunk=0, bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, int sm_margin=0)
        -> Tensor

What the stand-in implements (in float32, on CPU), following FA3's contract:
- paged KV (`page_table` [B, max_pages] int32, k/v [num_pages, page_size, Hk, D]) with per-row lengths
  `seqused_k` (what the wrapper's `cache_seqlens` becomes); and the varlen layout without a page table
  (k/v [total_k, Hk, D] with cu_seqlens_k). q is [B, Sq, H, D] or, with cu_seqlens_q, [total_q, H, D]. GQA.
- causal masks are bottom-right aligned (query i of a row of Sq queries sits at position L - Sq + i); the sliding
  window (left, right), softcap and softmax_scale as FA3 defines them; softmax_lse as FA3 returns it
  ([H, total_q] varlen, [B, H, Sq] batched).
- Row b reads exactly keys [0, seqused_k[b]): through `page_table[b, t // page_size]`, never a column or a page it
  does not need. Like the real kernel, FA3 sizes the key loop from the page table, seqlen_k = page_table.size(1) *
  page_size, when there is no cu_seqlens_k. Where the real kernel would read out of bounds the stand-in raises:
  a row longer than its page table (seqused_k[b] > page_table.size(1) * page_size) -> IndexError; a page id it must
  read outside [0, num_pages) -> IndexError; cu_seqlens_q/seqused_k shorter than the batch -> IndexError.
- split-KV and scheduler_metadata, the way the combine kernel depends on them: see `_plan` and `_check_metadata`.
  The metadata buffer has FA3's size (round_up(B, 4) * 2 + 1 int32, checked like CHECK_SHAPE); its contents are
  the stand-in's own encoding (the real buffer is opaque to callers): [0] = the static split count the plan was
  made with, [1:1+B] = per-row split counts, [1+round_up(B,4) : 1+round_up(B,4)+B] = the number of key blocks per
  row the plan covers (from max_seqlen_k for all rows). fwd raises when (a) the batch differs (shape), (b) a row's
  planned splits exceed the split count this fwd allocates its accumulators for (the combine would read past
  out_accum: the out-of-bounds read SGLang's flashattention_backend.py comment cites), or (c) this call's own
  seqlen_k or a row's seqused_k needs more key blocks than the plan was built for (a stale plan; stricter than
  the kernel, which would silently use it).
Anything else the stand-in does not implement (k_new/v_new append, rotary, descales, q_v/MLA, leftpad,
kv_batch_idx, attention_chunk, sinks, sparse masks) raises NotImplementedError naming the argument.
"""

from __future__ import annotations

import math

import torch

FWD_SCHEMA = (
    "fwd(Tensor q, Tensor k, Tensor v, Tensor? k_new, Tensor? v_new, Tensor? q_v, Tensor(a!)? out, "
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? seqused_k, "
    "int? max_seqlen_q, int? max_seqlen_k, Tensor? page_table, Tensor? kv_batch_idx, Tensor? leftpad_k, "
    "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? seqlens_rotary, Tensor? q_descale, Tensor? k_descale, "
    "Tensor? v_descale, float? softmax_scale, bool is_causal, int window_size_left, int window_size_right, "
    "int attention_chunk, float softcap, bool is_rotary_interleaved, Tensor? scheduler_metadata, int num_splits, "
    "bool? pack_gqa, int sm_margin, Tensor? sinks, Tensor? sparse_mask_fine, bool only_qv) "
    "-> (Tensor(a!), Tensor, Tensor, Tensor)"
)
SCHEDULER_SCHEMA = (
    "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, int num_heads, int num_heads_k, "
    "int headdim, int headdim_v, ScalarType qkv_dtype, Tensor seqused_k, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? leftpad_k, int? page_size, "
    "int max_seqlen_k_new=0, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
    "int attention_chunk=0, bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, int sm_margin=0) "
    "-> Tensor"
)

# FA3's split-KV planning, reduced to what decides buffer sizes. The real key-block size is 128 or 176 keys
# (hdim-dependent) and the H100/H200 have 132 SMs; the stand-in uses a smaller block so that test-sized contexts
# (a few hundred keys) split, and rounds the block to a multiple of the page size (FA3's paged blocks never
# straddle a page boundary in a way that changes the block count).
NUM_SMS = 132
BLOCK_M = 64
BLOCK_N_KEYS = 32
MAX_SPLITS = 128


def block_n(page_size: int | None) -> int:
    ps = page_size or 1
    return ps * max(1, -(-BLOCK_N_KEYS // ps))


def num_splits_heuristic(total_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """FA3's hopper/heuristics.h num_splits_heuristic."""
    if total_mblocks >= 0.8 * num_sms:
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    efficiency = []
    for s in range(1, max_splits + 1):
        n_waves = total_mblocks * s / num_sms
        efficiency.append(n_waves / math.ceil(n_waves))
    best = max(efficiency)
    for s in range(1, max_splits + 1):
        if efficiency[s - 1] >= 0.85 * best:
            return s
    return 1


def _plan(batch: int, seqlen_q: int, seqlen_k: int, num_heads: int, num_heads_k: int, page_size: int | None,
          num_splits: int) -> tuple[int, int]:
    """(static split count, key blocks) FA3 sizes out_accum / softmax_lse_accum with for this problem."""
    n_blocks = -(-max(seqlen_k, 0) // block_n(page_size))
    if num_splits > 0:
        return min(num_splits, MAX_SPLITS), n_blocks
    qhead_per_khead = max(1, num_heads // max(num_heads_k, 1))  # pack_gqa for decode
    m_blocks = -(-(seqlen_q * qhead_per_khead) // BLOCK_M)
    return num_splits_heuristic(batch * num_heads_k * m_blocks, NUM_SMS, n_blocks, MAX_SPLITS), n_blocks


def _row_splits(static_splits: int, row_blocks: torch.Tensor, num_heads_k: int) -> torch.Tensor:
    """prepare_varlen_num_blocks (FA3 flash_prepare_scheduler.cu): spread the batch's key blocks over the SMs,
    blocks_per_sm = ceil(total_blocks * 1.1 * heads_k / num_SMs); a row gets ceil(its blocks / blocks_per_sm)
    splits, clamped to [1, the static split count planned from max_seqlen_k]."""
    total = int(row_blocks.sum())
    per_sm = max(1, math.ceil(total * 1.1 * num_heads_k / NUM_SMS))
    return torch.clamp(-(-row_blocks // per_sm), 1, static_splits)


def metadata_size(batch: int) -> int:
    return (-(-batch // 4) * 4) * 2 + 1


# ---------------------------------------------------------------------------------------------- scheduler metadata
def get_scheduler_metadata_impl(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v,
                                qkv_dtype, seqused_k, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                                leftpad_k, page_size, max_seqlen_k_new=0, is_causal=False, window_size_left=-1,
                                window_size_right=-1, attention_chunk=0, has_softcap=False, num_splits=0,
                                pack_gqa=None, sm_margin=0):
    if seqused_k.dim() != 1 or seqused_k.numel() < batch_size:
        raise IndexError(f"get_scheduler_metadata: seqused_k has {seqused_k.numel()} rows, batch_size {batch_size}")
    static_splits, n_blocks = _plan(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, page_size,
                                    num_splits)
    bn = block_n(page_size)
    lens = seqused_k[:batch_size].to(torch.int64)
    rows = -(-lens // bn)
    md = torch.zeros(metadata_size(batch_size), dtype=torch.int32, device=seqused_k.device)
    br = -(-batch_size // 4) * 4
    md[0] = static_splits
    md[1:1 + batch_size] = _row_splits(static_splits, rows, num_heads_k).to(torch.int32)
    md[1 + br:1 + br + batch_size] = n_blocks
    return md


def get_scheduler_metadata_fake(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v,
                                qkv_dtype, seqused_k, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                                leftpad_k, page_size, max_seqlen_k_new=0, is_causal=False, window_size_left=-1,
                                window_size_right=-1, attention_chunk=0, has_softcap=False, num_splits=0,
                                pack_gqa=None, sm_margin=0):
    return seqused_k.new_empty(metadata_size(batch_size), dtype=torch.int32)


def _check_metadata(md: torch.Tensor, batch: int, static_splits: int, n_blocks: int, row_blocks: torch.Tensor):
    if md.dtype != torch.int32 or md.dim() != 1 or md.numel() != metadata_size(batch):
        raise RuntimeError(f"scheduler_metadata must be int32 of shape [{metadata_size(batch)}] for batch {batch}, "
                           f"got {md.dtype} {tuple(md.shape)}")
    br = -(-batch // 4) * 4
    planned_splits = md[1:1 + batch].to(torch.int64)
    planned_blocks = md[1 + br:1 + br + batch].to(torch.int64)
    if bool((planned_splits > static_splits).any()):
        raise IndexError(
            f"scheduler_metadata plans up to {int(planned_splits.max())} splits per row (built for {int(md[0])}), "
            f"this call allocates out_accum for {static_splits}: the split-KV combine would read out of bounds")
    if n_blocks > int(planned_blocks.max()) or bool((row_blocks > planned_blocks).any()):
        raise RuntimeError(
            f"scheduler_metadata is stale: built for {int(planned_blocks.max())} key blocks, this call needs "
            f"{max(n_blocks, int(row_blocks.max()))} (its seqlen_k from the page table or a row's seqused_k is "
            "larger than the max_seqlen_k / cache_seqlens the metadata was computed for)")


# ---------------------------------------------------------------------------------------------- attention
def _unsupported(name, value, default=None):
    if value is not default and not (isinstance(value, bool) and value == default):
        raise NotImplementedError(f"sgl_kernel::fwd stand-in: {name} is not implemented on CPU")


def _attend_row(qr, keys, vals, scale, causal, wl, wr, softcap):
    """qr [Sq, H, D], keys/vals [L, Hk, D] -> out [Sq, H, Dv], lse [H, Sq] (float32)."""
    sq, h, _ = qr.shape
    length, hk = keys.shape[0], keys.shape[1]
    g = h // hk
    k = keys.float().repeat_interleave(g, dim=1)  # [L, H, D]
    v = vals.float().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", qr.float(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    pos_q = torch.arange(sq).unsqueeze(1) + (length - sq)  # bottom-right aligned
    pos_k = torch.arange(length).unsqueeze(0)
    allowed = torch.ones(sq, length, dtype=torch.bool)
    if causal:
        allowed &= pos_k <= pos_q
    if wl >= 0:
        allowed &= pos_k >= pos_q - wl
    if wr >= 0 and not causal:
        allowed &= pos_k <= pos_q + wr
    s = s.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Sq]
    p = torch.where(torch.isfinite(lse).unsqueeze(-1), torch.exp(s - lse.unsqueeze(-1)), torch.zeros_like(s))
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse


def fwd_impl(q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
             max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
             q_descale, k_descale, v_descale, softmax_scale, is_causal, window_size_left, window_size_right,
             attention_chunk, softcap, is_rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin,
             sinks, sparse_mask_fine, only_qv):
    for name, value in (("k_new", k_new), ("v_new", v_new), ("q_v", q_v), ("seqused_q", seqused_q),
                        ("kv_batch_idx", kv_batch_idx), ("leftpad_k", leftpad_k), ("rotary_cos", rotary_cos),
                        ("rotary_sin", rotary_sin), ("seqlens_rotary", seqlens_rotary), ("q_descale", q_descale),
                        ("k_descale", k_descale), ("v_descale", v_descale), ("sinks", sinks),
                        ("sparse_mask_fine", sparse_mask_fine)):
        _unsupported(name, value)
    # cu_seqlens_k_new describes k_new/v_new (FA3 reads it only when they are given; SGLang's extend passes its
    # cu_seqlens_k there with k_new=None): unused here, as in the kernel.
    if only_qv:
        raise NotImplementedError("sgl_kernel::fwd stand-in: only_qv is not implemented on CPU")
    if attention_chunk:
        raise NotImplementedError("sgl_kernel::fwd stand-in: attention_chunk is not implemented on CPU")
    varlen_q = cu_seqlens_q is not None
    paged = page_table is not None
    h, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    hk = k.shape[-2]
    if h % hk:
        raise RuntimeError(f"number of heads in q ({h}) must be divisible by the key heads ({hk})")
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    if varlen_q:
        if q.dim() != 3:
            raise RuntimeError("with cu_seqlens_q, q must be [total_q, H, D]")
        batch = cu_seqlens_q.numel() - 1
        starts = [int(x) for x in cu_seqlens_q.tolist()]
    else:
        if q.dim() != 4:
            raise RuntimeError("without cu_seqlens_q, q must be [B, Sq, H, D]")
        batch = q.shape[0]
    if paged:
        if page_table.dtype != torch.int32:
            raise RuntimeError(f"page_table must have dtype int32, got {page_table.dtype}")
        if page_table.dim() != 2 or page_table.shape[0] < batch:
            raise IndexError(f"page_table {tuple(page_table.shape)} has fewer rows than the batch ({batch})")
        if seqused_k is None:
            raise NotImplementedError("sgl_kernel::fwd stand-in: a paged KV cache needs seqused_k (cache_seqlens)")
        page_size, num_pages = k.shape[1], k.shape[0]
        seqlen_k = page_table.shape[1] * page_size  # FA3: the key loop is sized from the page table
    else:
        if cu_seqlens_k is None:
            raise NotImplementedError("sgl_kernel::fwd stand-in: a dense (non-varlen, unpaged) K is not implemented")
        page_size = None
        seqlen_k = max_seqlen_k if max_seqlen_k is not None else 0
    if seqused_k is not None:
        if seqused_k.dtype != torch.int32:
            raise RuntimeError(f"seqused_k (cache_seqlens) must have dtype int32, got {seqused_k.dtype}")
        if seqused_k.numel() < batch:
            raise IndexError(f"seqused_k has {seqused_k.numel()} rows, the batch has {batch}")
        lens = [int(x) for x in seqused_k[:batch].tolist()]
    else:
        ck = [int(x) for x in cu_seqlens_k.tolist()]
        if len(ck) < batch + 1:
            raise IndexError(f"cu_seqlens_k has {len(ck)} entries, the batch needs {batch + 1}")
        lens = [ck[b + 1] - ck[b] for b in range(batch)]
    sq_max = (max_seqlen_q or 1) if varlen_q else q.shape[1]
    static_splits, n_blocks = _plan(batch, sq_max, seqlen_k, h, hk, page_size, num_splits)
    bn = block_n(page_size)
    row_blocks = torch.tensor([-(-max(L, 0) // bn) for L in lens], dtype=torch.int64)
    if scheduler_metadata is not None:
        _check_metadata(scheduler_metadata, batch, static_splits, n_blocks, row_blocks)

    outs, lses = [], []
    for b in range(batch):
        qr = q[starts[b]:starts[b + 1]] if varlen_q else q[b]
        length = lens[b]
        if length < 0:
            raise RuntimeError(f"row {b}: negative key length {length}")
        if paged:
            needed = -(-length // page_size)
            if needed > page_table.shape[1]:
                raise IndexError(f"row {b}: cache_seqlens {length} needs {needed} pages, the page table has "
                                 f"{page_table.shape[1]} columns (the kernel would read past the row)")
            pages = page_table[b, :needed].to(torch.int64)
            if needed and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
                raise IndexError(f"row {b}: page id {int(pages.min())}..{int(pages.max())} out of range of the "
                                 f"KV cache's {num_pages} pages")
            keys = k[pages].reshape(-1, hk, d)[:length]
            vals = v[pages].reshape(-1, hk, dv)[:length]
        else:
            keys = k[ck[b]:ck[b] + length]
            vals = v[ck[b]:ck[b] + length]
        o, lse = _attend_row(qr, keys, vals, scale, is_causal, window_size_left, window_size_right, softcap)
        outs.append(o)
        lses.append(lse)
    if varlen_q:
        o_all = torch.cat(outs, 0) if outs else q.new_zeros(0, h, dv, dtype=torch.float32)
        lse_all = torch.cat(lses, 1) if lses else torch.zeros(h, 0)
    else:
        o_all = torch.stack(outs, 0)
        lse_all = torch.stack(lses, 0)
    o_all = o_all.to(q.dtype)
    if out is not None:
        out.copy_(o_all)
        result = out
    else:
        result = o_all
    return result, lse_all, q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)


def fwd_fake(q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
             max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
             q_descale, k_descale, v_descale, softmax_scale, is_causal, window_size_left, window_size_right,
             attention_chunk, softcap, is_rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin,
             sinks, sparse_mask_fine, only_qv):
    h, dv = q.shape[-2], v.shape[-1]
    if cu_seqlens_q is not None:
        o = q.new_empty(q.shape[0], h, dv)
        lse = q.new_empty(h, q.shape[0], dtype=torch.float32)
    else:
        o = q.new_empty(q.shape[0], q.shape[1], h, dv)
        lse = q.new_empty(q.shape[0], h, q.shape[1], dtype=torch.float32)
    if out is not None:
        o = out
    return o, lse, q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)


# Two profiles of the same ops, the same argument names and implementations:
#   sgl_kernel::*        (what the harness runs) the schemas above with two type annotations changed:
#                        get_scheduler_metadata takes `SymInt max_seqlen_k` (the .so says `int`), and fwd returns
#                        `(Tensor, Tensor, Tensor, Tensor)` (the .so says `(Tensor(a!), ...)`, an alias of `out`).
#   sgl_kernel_exact::*  the .so's schemas verbatim (FWD_SCHEMA, SCHEDULER_SCHEMA), for test_exact_schemas.py.
# Why: with the exact schemas (1) Dynamo cannot pass the unbacked `seq_lens_cpu.max().item()` into an `int`
# argument (TorchRuntimeError at trace time: it must specialize u0 and cannot), and (2) Inductor refuses a custom
# op whose output carries an alias annotation ("Found a custom (non-ATen) operator whose output has alias
# annotations"). SGLang never exposes these ops to Inductor itself (its compiled region calls attention through
# its own opaque custom op); compiling the backend's builder and forward does. SGLang passes out=None here.
FWD_SCHEMA_TRACEABLE = FWD_SCHEMA.replace("-> (Tensor(a!), Tensor, Tensor, Tensor)", "-> (Tensor, Tensor, Tensor, Tensor)")
SCHEDULER_SCHEMA_TRACEABLE = SCHEDULER_SCHEMA.replace("int max_seqlen_k,", "SymInt max_seqlen_k,")
assert FWD_SCHEMA_TRACEABLE != FWD_SCHEMA and SCHEDULER_SCHEMA_TRACEABLE != SCHEDULER_SCHEMA
EXACT_NAMESPACE = "sgl_kernel_exact"

_LIB = None


def register() -> None:
    """Define the two ops (once per process) with their CPU, CUDA and fake (meta) implementations.

    CUDA: cuda_ops.py's (paged decode through torch.ops.syncfree.paged_decode, scheduler metadata computed on
    the device, contract checks as device-side asserts). SGL_KERNEL_STANDIN_CPU=paged_decode registers those for
    the CPU key too, in place of this file's (a CPU dry run of the GPU path: benchmarks/sglang_fa3_gpu.py
    --device cpu)."""
    global _LIB
    if _LIB is not None or hasattr(torch.ops.sgl_kernel, "fwd"):
        return
    import os

    from sgl_kernel import cuda_ops

    cpu_fwd, cpu_sched = fwd_impl, get_scheduler_metadata_impl
    if os.environ.get("SGL_KERNEL_STANDIN_CPU") == "paged_decode":
        cpu_fwd, cpu_sched = cuda_ops.fwd_paged_decode, cuda_ops.get_scheduler_metadata_device
    libs = []
    for ns, fwd_schema, sched_schema in (("sgl_kernel", FWD_SCHEMA_TRACEABLE, SCHEDULER_SCHEMA_TRACEABLE),
                                         (EXACT_NAMESPACE, FWD_SCHEMA, SCHEDULER_SCHEMA)):
        lib = torch.library.Library(ns, "DEF")
        lib.define(fwd_schema)
        lib.define(sched_schema)
        lib.impl("fwd", cpu_fwd, "CPU")
        lib.impl("get_scheduler_metadata", cpu_sched, "CPU")
        lib.impl("fwd", cuda_ops.fwd_paged_decode, "CUDA")
        lib.impl("get_scheduler_metadata", cuda_ops.get_scheduler_metadata_device, "CUDA")
        torch.library.register_fake(f"{ns}::fwd", fwd_fake, lib=lib)
        torch.library.register_fake(f"{ns}::get_scheduler_metadata", get_scheduler_metadata_fake, lib=lib)
        libs.append(lib)
    _LIB = libs


register()
