"""CPU stand-ins for SGLang 0.5.23's own Triton kernels (sglang.kernels.ops.attention.*), for tests/sglang only.

SGLang's Triton kernels need a GPU (or TRITON_INTERPRET=1, far too slow for attention at test sizes and decided
at import for the whole process). The harness (harness_backends.py) puts these in their place, with the real
kernels' Python signatures and contracts:

decode_attention_fwd (decode_attention.py)  --  the function TritonAttnBackend wraps in torch.compiler.disable
    q [B, H, Lk], k_buffer/v_buffer [slots, Hk, Lk|Lv] (page_size 1), o [B, H, Lv] written in place. Row b
    attends the keys at slots kv_indices[kv_indptr[b] : kv_indptr[b + 1]] (no causal mask: decode), scaled by
    sm_scale * k_scale, tanh-capped by logit_cap, values scaled by v_scale. Split-KV: num_kv_splits[b] programs
    per row write attn_logits[b, :, s] / attn_lse[b, :, s]; the stand-in computes in one pass and writes the
    scratch as if with one split (the caller never reads it).
    Raises where the kernel would read or write out of bounds: kv_indptr[b + 1] past kv_indices' end, a slot
    outside k_buffer, num_kv_splits[b] outside [1, max_kv_splits] (the split loop would write past attn_logits),
    and the real wrapper's own asserts (max_kv_splits == attn_logits.shape[2], B <= kv_indptr rows - 1).
extend_attention_fwd (extend_attention.py)  --  also wrapped in torch.compiler.disable by the backend
    Row b's queries and new K/V are q_extend/k_extend/v_extend[qo_indptr[b] : qo_indptr[b + 1]]; its prefix keys
    are at slots kv_indices[kv_indptr[b] : kv_indptr[b + 1]]. Query i sees every prefix key and the extend keys
    j <= i (is_causal), or what custom_mask[mask_indptr[b] + i * (prefix + extend) + j] allows (prefix keys
    unmasked when skip_prefix_custom_mask). The kernel is launched on the grid
    (B, H, cdiv(max_len_extend, BLOCK_M)): program (b, h, m) computes queries [m * BLOCK_M, (m + 1) * BLOCK_M) of
    row b, so only the first cdiv(max_len_extend, BLOCK_M) * BLOCK_M queries of each row are written; the rest
    of o_extend keeps what it held (torch.empty: garbage). So max_len_extend is an upper-bound argument: any
    value >= max_b(qo_indptr[b + 1] - qo_indptr[b]) gives the same output, a smaller one gives wrong values.
    BLOCK_M is 16..128 on GPUs (_get_block_sizes_for_extend_attention, by arch); the stand-in uses
    STANDIN_BLOCK_M = 1, the strictest instance: a max_len_extend below any row's length drops that row's tail.
    Raises on reads past q_extend, kv_indices, k_buffer or custom_mask.
create_flashinfer_kv_indices_triton (kv_indices.py)  --  launched by KVIndexTranslator.pack_read_stream
    `StandInKernel`: `kernel[grid](...)` as the real launch, running torch.ops.sglang_standin.
    create_flashinfer_kv_indices (an op, so that it stays in the graph): program b writes
    kv_indices[kv_indptr[b] + t] = req_to_token.flat[rpi[b] * stride + kv_start[b] + t] for t < lengths[b]
    (ENTRY_PAGE_SIZE 1, no token_mapping), nothing else. Raises where the kernel would write past kv_indices'
    end or read past req_to_token's row (stricter than the kernel, which reads into the next row).
create_flashmla_kv_indices_triton (kv_indices.py)  --  launched by FlashMLA / TRTLLM-MLA
    `StandInKernel` over torch.ops.sglang_standin.create_flashmla_kv_indices: program b (any grid axis 1, as the
    real kernel guards its page-block programs by the row's length) writes block table row b's first
    cdiv(lengths[b], PAGED_SIZE) columns with req_to_token[rpi[b], j * PAGED_SIZE] // PAGED_SIZE; nothing else.
    Like the real kernel it addresses the table through kv_indices_ptr_stride and does not clamp to the table's
    width: the stand-in raises where a row needs more columns than the stride (the write would land in the next
    row, or past the buffer).

pad_draft_extend_query / unpad_draft_extend_output (pad.py)  --  TRTLLM-MLA's draft extend with ragged extends
    pad: padded_q[b, j] = q[cu_seqlens_q[b] + j] for j < seq_lens_q[b], written in place (the rest of padded_q
    keeps what it held; the backend zeroes it first); returns padded_q. unpad: output[cu_seqlens_q[b] + j] =
    raw_out[b, j] for j < seq_lens_q[b], the first sum_seq_lens_q rows (into unpad_output_buffer when given).
    In torch with static shapes (a gather by a computed index), so that they stay in the graph.

Anything the stand-ins do not implement (sinks, score_mod, sliding windows, lean decode, page_size > 1, an LSE
output, skip_prefix/skip_extend, xai temperature) raises NotImplementedError naming it.
"""

from __future__ import annotations

import torch

STANDIN_BLOCK_M = 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unsupported(name: str, value, default=None) -> None:
    if value is not default and not (default is not None and value == default):
        raise NotImplementedError(f"stand-in: {name}={value!r} is not implemented")


def _attend(q, keys, values, scale: float, logit_cap: float, v_scale: float, allowed=None):
    """q [Sq, H, D], keys/values [Sk, Hk, D]; GQA by head groups; float32. allowed: [Sq, Sk] bool or None."""
    h, hk = q.shape[1], keys.shape[1]
    keys = keys.float().repeat_interleave(h // hk, 1)
    values = values.float().repeat_interleave(h // hk, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if logit_cap and logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if allowed is not None:
        s = s.masked_fill(~allowed[None], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, Sq]
    p = torch.exp(s - lse[..., None])
    return torch.einsum("hqk,khd->qhd", p, values) * v_scale, lse


def _slots(kv_indices, start: int, end: int, num_slots: int, who: str, b: int):
    if start < 0 or end < start:
        raise IndexError(f"{who}: row {b} has kv_indptr [{start}, {end})")
    if end > kv_indices.numel():
        raise IndexError(f"{who}: row {b} reads kv_indices[{start}:{end}] past its end ({kv_indices.numel()}): the "
                         "kernel would read out of bounds")
    idx = kv_indices[start:end].to(torch.int64)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_slots):
        raise IndexError(f"{who}: row {b} reads KV slot {int(idx.min())}..{int(idx.max())}, outside the "
                         f"{num_slots} slots of the KV buffer")
    return idx


# ------------------------------------------------------------------------------------------------ decode
def decode_attention_impl(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits,
                          max_kv_splits: int, sm_scale: float, k_scale: float, v_scale: float, logit_cap: float,
                          page_size: int) -> None:
    if page_size != 1:
        raise NotImplementedError(f"stand-in decode_attention_fwd: page_size={page_size}")
    # the real wrapper's asserts (decode_attention.py: decode_attention_fwd)
    if max_kv_splits != attn_logits.shape[2]:
        raise AssertionError(f"max_kv_splits {max_kv_splits} != attn_logits.shape[2] {attn_logits.shape[2]}")
    bs = q.shape[0]
    if bs > kv_indptr.shape[0] - 1 or bs > attn_logits.shape[0]:
        raise AssertionError(f"batch {bs} exceeds kv_indptr ({kv_indptr.shape[0] - 1}) or attn_logits "
                             f"({attn_logits.shape[0]}) rows")
    if num_kv_splits.numel() < bs:
        raise IndexError(f"num_kv_splits has {num_kv_splits.numel()} rows, batch {bs}")
    for b in range(bs):
        splits = int(num_kv_splits[b])
        if not 1 <= splits <= max_kv_splits:
            raise IndexError(f"decode_attention_fwd: row {b} plans {splits} KV splits, attn_logits holds "
                             f"{max_kv_splits}: the split loop would write out of bounds")
        idx = _slots(kv_indices, int(kv_indptr[b]), int(kv_indptr[b + 1]), k_buffer.shape[0],
                     "decode_attention_fwd", b)
        if idx.numel() == 0:
            raise RuntimeError(f"decode_attention_fwd: row {b} has no keys")
        out, lse = _attend(q[b:b + 1], k_buffer[idx], v_buffer[idx], sm_scale * k_scale, logit_cap, v_scale)
        o[b].copy_(out[0].to(o.dtype))
        attn_logits[b, :, 0].copy_(out[0].to(attn_logits.dtype))
        attn_lse[b, :, 0].copy_(lse[:, 0].to(attn_lse.dtype))


def decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits,
                         max_kv_splits, sm_scale, k_scale, v_scale, logit_cap=0.0, sinks=None, xai_temperature_len=-1,
                         has_mla=False, use_pdl=False, page_size: int = 1, score_mod=None, aux_tensors=None,
                         enable_lean=None, lean_Mp=None, lean_Lp=None, lean_Op=None, lean_locks=None,
                         uneven_batch=None):
    """sglang.kernels.ops.attention.decode_attention.decode_attention_fwd's signature, on CPU. `has_mla`,
    `use_pdl`, `uneven_batch` and the lean buffers only select or tune kernels (lean decode runs on HIP only)."""
    _unsupported("sinks", sinks)
    _unsupported("score_mod", score_mod)
    _unsupported("aux_tensors", aux_tensors)
    _unsupported("xai_temperature_len", xai_temperature_len, -1)
    decode_attention_impl(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits,
                          int(max_kv_splits), float(sm_scale), float(k_scale), float(v_scale), float(logit_cap),
                          int(page_size))


# ------------------------------------------------------------------------------------------------ extend
def extend_attention_impl(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                          kv_indices, custom_mask, is_causal: bool, mask_indptr, max_len_extend: int, k_scale: float,
                          v_scale: float, sm_scale, logit_cap: float, skip_prefix_custom_mask: bool,
                          sliding_window_size: int, page_size: int) -> None:
    if page_size != 1:
        raise NotImplementedError(f"stand-in extend_attention_fwd: page_size={page_size}")
    _unsupported("sliding_window_size", sliding_window_size, -1)
    scale = (sm_scale or q_extend.shape[-1] ** -0.5) * k_scale
    covered = _cdiv(max(int(max_len_extend), 0), STANDIN_BLOCK_M) * STANDIN_BLOCK_M  # queries the grid reaches
    bs = qo_indptr.shape[0] - 1
    for b in range(bs):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if qs < 0 or qe < qs or qe > q_extend.shape[0] or qe > k_extend.shape[0]:
            raise IndexError(f"extend_attention_fwd: row {b} has qo_indptr [{qs}, {qe}), past the "
                             f"{q_extend.shape[0]} extend tokens")
        idx = _slots(kv_indices, int(kv_indptr[b]), int(kv_indptr[b + 1]), k_buffer.shape[0],
                     "extend_attention_fwd", b)
        ext, prefix = qe - qs, idx.numel()
        n = min(ext, covered)
        if n == 0:
            continue
        keys = torch.cat([k_buffer[idx], k_extend[qs:qe]], 0)
        vals = torch.cat([v_buffer[idx], v_extend[qs:qe]], 0)
        i = torch.arange(n)[:, None]
        j = torch.arange(prefix + ext)[None, :]
        if custom_mask is not None:
            if mask_indptr is None:
                raise RuntimeError("extend_attention_fwd: custom_mask without mask_indptr")
            start = int(mask_indptr[b])
            need = start + ext * (prefix + ext)
            if need > custom_mask.numel():
                raise IndexError(f"extend_attention_fwd: row {b} reads custom_mask up to {need}, past its end "
                                 f"({custom_mask.numel()})")
            allowed = custom_mask[start:need].view(ext, prefix + ext)[:n].bool()
            if skip_prefix_custom_mask:
                allowed = allowed | (j < prefix)
        elif is_causal:
            allowed = (j < prefix) | (j - prefix <= i)
        else:
            allowed = torch.ones(n, prefix + ext, dtype=torch.bool)
        out, _ = _attend(q_extend[qs:qs + n], keys, vals, scale, logit_cap, v_scale, allowed)
        o_extend[qs:qs + n].copy_(out.to(o_extend.dtype))


def extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                         kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                         sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True, sliding_window_size=-1,
                         sinks=None, window_kv_offsets=None, xai_temperature_len=-1, lse_extend=None,
                         skip_prefix=False, skip_extend=False, page_size: int = 1, score_mod=None, aux_tensors=None,
                         extend_seq_lens_cpu=None, identity_kv_indices: bool = False):
    """sglang.kernels.ops.attention.extend_attention.extend_attention_fwd's signature, on CPU.
    `extend_seq_lens_cpu` only sizes HIP's compact grid; `identity_kv_indices` is a promise the stand-in does
    not need (it reads kv_indices either way, which is what the promise makes equal)."""
    for name, value, default in (("sinks", sinks, None), ("window_kv_offsets", window_kv_offsets, None),
                                 ("xai_temperature_len", xai_temperature_len, -1), ("lse_extend", lse_extend, None),
                                 ("skip_prefix", skip_prefix, False), ("skip_extend", skip_extend, False),
                                 ("score_mod", score_mod, None), ("aux_tensors", aux_tensors, None)):
        _unsupported(name, value, default)
    extend_attention_impl(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                          kv_indices, custom_mask, bool(is_causal), mask_indptr, int(max_len_extend), float(k_scale),
                          float(v_scale), sm_scale, float(logit_cap), bool(skip_prefix_custom_mask),
                          int(sliding_window_size), int(page_size))


# ------------------------------------------------------------------------------------------------ index builders
_LIB = torch.library.Library("sglang_standin", "DEF")
_LIB.define("create_flashinfer_kv_indices(Tensor req_to_token, Tensor req_pool_indices, Tensor page_kernel_lens, "
            "Tensor kv_indptr, Tensor? kv_start_idx, Tensor(a!) kv_indices, int req_to_token_stride) -> ()")
_LIB.define("create_flashmla_kv_indices(Tensor req_to_token, Tensor req_pool_indices, Tensor page_kernel_lens, "
            "Tensor? kv_start_idx, Tensor(a!) kv_indices, int req_to_token_stride, SymInt kv_indices_stride, "
            "int paged_size) -> ()")


def _row(req_to_token, rpi_b: int, stride: int, start: int, length: int, who: str, b: int):
    flat = req_to_token.reshape(-1) if req_to_token.is_contiguous() else req_to_token.contiguous().reshape(-1)
    rows = req_to_token.shape[0]
    if not 0 <= rpi_b < rows:
        raise IndexError(f"{who}: row {b} reads request {rpi_b}, outside the token table's {rows} rows")
    if start < 0 or start + length > req_to_token.shape[1]:
        raise IndexError(f"{who}: row {b} reads tokens [{start}, {start + length}) of a row of "
                         f"{req_to_token.shape[1]}")
    base = rpi_b * stride + start
    return flat[base:base + length]


def _flashinfer_kv_indices_cpu(req_to_token, req_pool_indices, page_kernel_lens, kv_indptr, kv_start_idx, kv_indices,
                               req_to_token_stride):
    for b in range(page_kernel_lens.shape[0]):
        start = int(kv_start_idx[b]) if kv_start_idx is not None else 0
        length = max(int(page_kernel_lens[b]), 0)
        out = int(kv_indptr[b])
        if out < 0 or out + length > kv_indices.numel():
            raise IndexError(f"create_flashinfer_kv_indices_triton: row {b} writes kv_indices[{out}:{out + length}] "
                             f"past its end ({kv_indices.numel()})")
        kv_indices[out:out + length] = _row(req_to_token, int(req_pool_indices[b]), req_to_token_stride, start, length,
                                            "create_flashinfer_kv_indices_triton", b).to(kv_indices.dtype)


def _flashmla_kv_indices_cpu(req_to_token, req_pool_indices, page_kernel_lens, kv_start_idx, kv_indices,
                             req_to_token_stride, kv_indices_stride, paged_size):
    # The kernel writes kv_indices_ptr + b * kv_indices_ptr_stride + j: through the table's storage, which may be
    # wider than the view it was handed (SGLang slices persistent buffers).
    if kv_indices.dim() != 2 or kv_indices.stride(1) != 1 or kv_indices.stride(0) != kv_indices_stride:
        raise NotImplementedError(f"stand-in create_flashmla_kv_indices_triton: a [rows, n] table with row stride "
                                  f"{kv_indices_stride} (got strides {kv_indices.stride()})")
    room = kv_indices.untyped_storage().nbytes() // kv_indices.element_size() - kv_indices.storage_offset()
    for b in range(page_kernel_lens.shape[0]):
        start = int(kv_start_idx[b]) if kv_start_idx is not None else 0
        length = max(int(page_kernel_lens[b]), 0)
        pages = _cdiv(length, paged_size)
        if pages > kv_indices_stride or b * kv_indices_stride + pages > room:
            raise IndexError(f"create_flashmla_kv_indices_triton: row {b} needs {pages} block-table columns, the "
                             f"table's row stride is {kv_indices_stride} (the kernel would write past the row)")
        if not pages:
            continue
        tokens = _row(req_to_token, int(req_pool_indices[b]), req_to_token_stride, start, pages * paged_size,
                      "create_flashmla_kv_indices_triton", b)
        row = kv_indices.as_strided((pages,), (1,), kv_indices.storage_offset() + b * kv_indices_stride)
        row.copy_((tokens[::paged_size] // paged_size).to(kv_indices.dtype))


_LIB.impl("create_flashinfer_kv_indices", _flashinfer_kv_indices_cpu, "CPU")
_LIB.impl("create_flashmla_kv_indices", _flashmla_kv_indices_cpu, "CPU")
torch.library.register_fake("sglang_standin::create_flashinfer_kv_indices", lambda *a: None, lib=_LIB)
torch.library.register_fake("sglang_standin::create_flashmla_kv_indices", lambda *a: None, lib=_LIB)


class StandInKernel:
    """`kernel[grid](*args, **kwargs)` as a @triton.jit kernel is launched; `launch` maps the call to the op."""

    def __init__(self, name: str, launch):
        self.__name__ = name
        self._launch = launch

    def __getitem__(self, grid):
        def launcher(*args, **kwargs):
            return self._launch(grid, *args, **kwargs)

        return launcher


def _launch_flashinfer(grid, req_to_token_ptr, req_pool_indices_ptr, page_kernel_lens_ptr, kv_indptr, kv_start_idx,
                       kv_indices_ptr, req_to_token_ptr_stride, ENTRY_PAGE_SIZE=1, TOKEN_BLOCK_PARALLEL=False,
                       token_mapping=None):
    _unsupported("ENTRY_PAGE_SIZE", ENTRY_PAGE_SIZE, 1)
    _unsupported("token_mapping", token_mapping)
    torch.ops.sglang_standin.create_flashinfer_kv_indices(req_to_token_ptr, req_pool_indices_ptr,
                                                          page_kernel_lens_ptr, kv_indptr, kv_start_idx,
                                                          kv_indices_ptr, req_to_token_ptr_stride)


def _launch_flashmla(grid, req_to_token_ptr, req_pool_indices_ptr, page_kernel_lens_ptr, kv_start_idx, kv_indices_ptr,
                     req_to_token_ptr_stride, kv_indices_ptr_stride, PAGED_SIZE=64):
    torch.ops.sglang_standin.create_flashmla_kv_indices(req_to_token_ptr, req_pool_indices_ptr, page_kernel_lens_ptr,
                                                        kv_start_idx, kv_indices_ptr, req_to_token_ptr_stride,
                                                        kv_indices_ptr_stride, PAGED_SIZE)


create_flashinfer_kv_indices_triton = StandInKernel("create_flashinfer_kv_indices_triton", _launch_flashinfer)
create_flashmla_kv_indices_triton = StandInKernel("create_flashmla_kv_indices_triton", _launch_flashmla)


# -- pad.py: TRTLLM-MLA's draft-extend query padding and output unpadding ----------------------------------------
def pad_draft_extend_query(q, padded_q, seq_lens_q, cu_seqlens_q):
    bs, width = padded_q.shape[0], padded_q.shape[1]
    j = torch.arange(width, device=q.device)
    source = cu_seqlens_q[:bs, None].to(torch.int64) + j[None, :]  # [bs, width]
    valid = j[None, :] < seq_lens_q[:bs, None]
    rows = q[source.clamp(0, q.shape[0] - 1)].to(padded_q.dtype)  # [bs, width, H, D]
    padded_q.copy_(torch.where(valid[:, :, None, None], rows, padded_q))
    return padded_q


def unpad_draft_extend_output(raw_out, cu_seqlens_q, seq_lens_q, sum_seq_lens_q, unpad_output_buffer=None):
    bs, width = raw_out.shape[0], raw_out.shape[1]
    t = torch.arange(sum_seq_lens_q, device=raw_out.device)
    row = torch.searchsorted(cu_seqlens_q[1: bs + 1].to(torch.int64), t, right=True).clamp(max=bs - 1)
    col = t - cu_seqlens_q[row].to(torch.int64)
    if not torch.compiler.is_compiling() and bool((col >= seq_lens_q[row]).any()):
        raise IndexError("unpad_draft_extend_output: a token outside its row's extend")
    out = raw_out[row, col.clamp(0, width - 1)]
    if unpad_output_buffer is not None:
        target = unpad_output_buffer[:sum_seq_lens_q]
        target.copy_(out.to(target.dtype))
        return target
    return out
