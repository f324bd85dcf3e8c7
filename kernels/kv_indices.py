"""`syncfree::kv_indices`: the flat kv_indices writer (SGLang's `create_flashinfer_kv_indices_triton` shape).

    kv_indices(out, req_to_token, req_pool_indices, lengths, indptr) -> None      (writes `out` in place)

Row b copies L_b = min(max(lengths[b], 0), req_to_token.size(1)) token slots, req_to_token[req_pool_indices[b],
:L_b], into out[indptr[b] : indptr[b] + L_b]. Nothing else of `out` is written, and no destination outside
[0, out.numel()) is written whatever the lengths and the indptr hold: the writer is bounded by its lengths and
by the buffer. Request indices are read as eager indexing reads them (negative ones wrap; a row whose index is
out of range reads and writes nothing). Any strides; out int32 or int64 (values are cast to out's dtype).

Its facts (INDPTR_WRITERS, read by compile_pass/rules/flat_kv_indices.py) let the compile pass size `out` with a
static bound: writes stay in [indptr[b], indptr[b] + lengths[b]), so a buffer of any size >= indptr[B] gets the
same values there.
"""

from __future__ import annotations

import torch

from ._checks import check_index_tensor, check_same_device
from ._triton import cdiv, device_programs, launch, use_triton
from .warmup import warmable

# The facts the compile pass relies on, by overload: the written buffer, the indptr and the lengths that bound
# every write (rules/flat_kv_indices.py registers them). No op of this project reads through an indptr; a reader
# declares {"indices": ..., "indptr": ..., "lengths": ...} with rules.flat_kv_indices.register_indptr_reader (a
# writer of another library: register_indptr_writer).
INDPTR_WRITERS = {"syncfree::kv_indices": dict(out="out", indptr="indptr", lengths="lengths")}
INDPTR_READERS: dict = {}

# Launch configuration (not tuned on a GPU): programs per row split a long row.
TUNING = {"block": 512, "programs_per_sm": 4, "num_warps": 4}


def check_kv_indices_args(out, req_to_token, req_pool_indices, lengths, indptr) -> None:
    check_index_tensor("out", out, 1)
    check_index_tensor("req_to_token", req_to_token, 2)
    check_index_tensor("req_pool_indices", req_pool_indices, 1)
    check_index_tensor("lengths", lengths, 1)
    check_index_tensor("indptr", indptr, 1)
    check_same_device("out", out, req_to_token=req_to_token, req_pool_indices=req_pool_indices, lengths=lengths,
                      indptr=indptr)
    batch = req_pool_indices.shape[0]
    if lengths.shape[0] != batch:
        raise ValueError(f"lengths has {lengths.shape[0]} rows but req_pool_indices has {batch}")
    if indptr.shape[0] < batch:
        raise ValueError(f"indptr has {indptr.shape[0]} entries but the batch (req_pool_indices) has {batch}")


def _launch(out, req_to_token, req_pool_indices, lengths, indptr):
    from .kv_indices_kernel import kv_indices_kernel

    batch = req_pool_indices.shape[0]
    if batch == 0 or out.numel() == 0:
        return
    block = TUNING["block"]
    per_row = max(1, min(cdiv(req_to_token.shape[1], block),
                         cdiv(device_programs(out, per_sm=TUNING["programs_per_sm"]), batch)))
    launch(
        kv_indices_kernel, (batch, per_row),
        out, out.stride(0), out.numel(),
        req_to_token, req_to_token.stride(0), req_to_token.stride(1),
        req_pool_indices, req_pool_indices.stride(0), lengths, lengths.stride(0), indptr, indptr.stride(0),
        req_to_token.shape[0], req_to_token.shape[1],
        BLOCK=block, num_warps=TUNING["num_warps"],
    )


def _fill_torch(out, req_to_token, req_pool_indices, lengths, indptr):
    """The same semantics with vectorized torch ops (CPU without the Triton interpreter)."""
    batch = req_pool_indices.shape[0]
    num_reqs, num_tokens = req_to_token.shape
    if batch == 0 or out.numel() == 0 or num_reqs == 0 or num_tokens == 0:
        return
    idx = req_pool_indices.to(torch.int64)
    rows = torch.where(idx < 0, idx + num_reqs, idx)
    in_range = (rows >= 0) & (rows < num_reqs)
    n = torch.where(in_range, lengths.to(torch.int64).clamp(min=0, max=num_tokens), 0)
    cols = torch.arange(num_tokens, device=out.device)
    dst = indptr[:batch].to(torch.int64)[:, None] + cols[None, :]
    live = (cols[None, :] < n[:, None]) & (dst >= 0) & (dst < out.numel())
    tokens = req_to_token[torch.where(in_range, rows, 0)[:, None], cols[None, :]]
    out.index_put_((dst[live],), tokens[live].to(out.dtype))


@torch.library.custom_op("syncfree::kv_indices", mutates_args=("out",))
@warmable("syncfree::kv_indices")
def kv_indices(out: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               lengths: torch.Tensor, indptr: torch.Tensor) -> None:
    """out[indptr[b] : indptr[b] + L_b] = req_to_token[req_pool_indices[b], :L_b], L_b = clamp(lengths[b], 0,
    req_to_token.size(1)); nothing else is written, nothing outside [0, out.numel()) ever."""
    check_kv_indices_args(out, req_to_token, req_pool_indices, lengths, indptr)
    if use_triton(out):
        _launch(out, req_to_token, req_pool_indices, lengths, indptr)
    else:
        _fill_torch(out, req_to_token, req_pool_indices, lengths, indptr)


@kv_indices.register_fake
def _kv_indices_fake(out, req_to_token, req_pool_indices, lengths, indptr):
    check_kv_indices_args(out, req_to_token, req_pool_indices, lengths, indptr)


__all__ = ["kv_indices", "INDPTR_WRITERS", "INDPTR_READERS"]
