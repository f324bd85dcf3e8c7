"""`syncfree::page_table` and `syncfree::page_table_`: device page-table builders with a static width.

The functional op returns int32 [B, max_pages]; the in-place op writes rows [0, B) of an int32 [>= B, W]
buffer and nothing else (the sentinel invariant). Both are bounded per row by `seq_lens` and never read or
write out of bounds, whatever the lengths. With `checked=True`, a length past the static bound trips a
device-side assertion (`torch._assert_async`): no host sync either way.
"""

from __future__ import annotations

import torch

from ._checks import check_page_table_args, check_positive_int, check_same_device
from ._triton import cdiv, device_programs, use_triton

# Launch configuration; benchmarks/tune.py sweeps it on a GPU (BENCHMARKS.md records the choice).
# Swept on an H200 (BENCHMARKS.md): 8 warps, 4 programs per SM.
TUNING = {"block": 1024, "programs_per_sm": 4, "num_warps": 8}


def _launch(out, req_to_token, req_pool_indices, seq_lens, page_size):
    from .page_table_kernel import page_table_kernel

    batch, width = out.shape[0], out.shape[1]
    if batch == 0 or width == 0:
        return
    block = TUNING["block"]
    # Enough programs per row to fill the device at small batch; never more than the row has blocks.
    programs = device_programs(out, per_sm=TUNING["programs_per_sm"])
    per_row = max(1, min(cdiv(width, block), cdiv(programs, batch)))
    page_table_kernel[(batch, per_row)](
        out, out.stride(0), out.stride(1),
        req_to_token, req_to_token.stride(0), req_to_token.stride(1),
        req_pool_indices, seq_lens,
        req_to_token.shape[1], page_size, width,
        BLOCK=block, num_warps=TUNING["num_warps"],
    )


def live_pages(seq_lens: torch.Tensor, page_size: int, width: int, num_tokens: int) -> torch.Tensor:
    """n_b of the contract, as a tensor: the number of columns row b must hold."""
    n = (seq_lens.to(torch.int64).clamp(min=0) + page_size - 1) // page_size
    return n.clamp(max=min(width, cdiv(num_tokens, page_size)))


def _fill_torch(out, req_to_token, req_pool_indices, seq_lens, page_size):
    """The same semantics with vectorized torch ops (CPU without the Triton interpreter)."""
    batch, width = out.shape[0], out.shape[1]
    if batch == 0 or width == 0:
        return
    n = live_pages(seq_lens, page_size, width, req_to_token.shape[1])
    cols = torch.arange(width, device=out.device)
    live = cols[None, :] < n[:, None]
    # Dead cells gather from a safe address; padded rows may hold any request index, so clamp it too.
    rows = torch.where(n > 0, req_pool_indices.to(torch.int64), 0)
    tok_idx = torch.where(live, cols[None, :] * page_size, 0)
    tokens = req_to_token[rows[:, None], tok_idx].to(torch.int64)
    pages = torch.div(tokens, page_size, rounding_mode="floor").to(torch.int32)
    out.copy_(torch.where(live, pages, out))


def _fill(out, req_to_token, req_pool_indices, seq_lens, page_size):
    if use_triton(out):
        _launch(out, req_to_token, req_pool_indices, seq_lens, page_size)
    else:
        _fill_torch(out, req_to_token, req_pool_indices, seq_lens, page_size)


def _assert_within(seq_lens: torch.Tensor, capacity: int) -> None:
    # Device-side: an async assertion, no host read of the lengths.
    torch._assert_async(
        torch.all(seq_lens <= capacity),
        "syncfree: a sequence length exceeds the page table's static bound (max_context_len)",
    )


@torch.library.custom_op("syncfree::page_table", mutates_args=())
def page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    max_pages: int,
    checked: bool = False,
) -> torch.Tensor:
    check_page_table_args(req_to_token, req_pool_indices, seq_lens, page_size)
    check_positive_int("max_pages", max_pages)
    # Columns past n_b are unspecified: nothing pays for filling them.
    out = torch.empty((req_pool_indices.shape[0], max_pages), dtype=torch.int32, device=req_to_token.device)
    if not use_triton(out):
        out.zero_()  # keep CPU results deterministic; the torch path writes with torch.where
    _fill(out, req_to_token, req_pool_indices, seq_lens, page_size)
    if checked:
        _assert_within(seq_lens, max_pages * page_size)
    return out


@page_table.register_fake
def _page_table_fake(req_to_token, req_pool_indices, seq_lens, page_size, max_pages, checked=False):
    check_page_table_args(req_to_token, req_pool_indices, seq_lens, page_size)
    check_positive_int("max_pages", max_pages)
    return req_to_token.new_empty((req_pool_indices.shape[0], max_pages), dtype=torch.int32)


def _check_buffer(page_table, req_to_token, req_pool_indices, seq_lens, page_size):
    check_page_table_args(req_to_token, req_pool_indices, seq_lens, page_size)
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(f"page_table must be a torch.Tensor, got {type(page_table).__name__}")
    if page_table.dtype != torch.int32:
        raise TypeError(f"page_table must be int32, got {page_table.dtype}")
    if page_table.dim() != 2:
        raise ValueError(f"page_table must have 2 dimensions, got shape {tuple(page_table.shape)}")
    if page_table.shape[0] < req_pool_indices.shape[0]:
        raise ValueError(
            f"page_table has {page_table.shape[0]} rows but the batch (req_pool_indices) has "
            f"{req_pool_indices.shape[0]}"
        )
    check_same_device("page_table", page_table, req_to_token=req_to_token)


@torch.library.custom_op("syncfree::page_table_", mutates_args=("page_table",))
def page_table_(
    page_table: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    checked: bool = False,
) -> None:
    _check_buffer(page_table, req_to_token, req_pool_indices, seq_lens, page_size)
    rows = page_table[: req_pool_indices.shape[0]]
    _fill(rows, req_to_token, req_pool_indices, seq_lens, page_size)
    if checked:
        _assert_within(seq_lens, page_table.shape[1] * page_size)


@page_table_.register_fake
def _page_table__fake(page_table, req_to_token, req_pool_indices, seq_lens, page_size, checked=False):
    _check_buffer(page_table, req_to_token, req_pool_indices, seq_lens, page_size)


__all__ = ["page_table", "page_table_", "live_pages"]
