"""`syncfree::page_table` and `syncfree::page_table_`: device page-table builders with a static width.

The functional op returns int32 [B, max_pages]; the in-place op writes rows [0, B) of an int32 [>= B, W]
buffer and nothing else (the sentinel invariant). Both are bounded per row by `seq_lens` and never read or
write out of bounds, whatever the lengths and the request indices.

Indexing is eager's: every tensor may have any strides (a column of a metadata matrix, an expanded or a sliced
tensor is read in place), and a request index idx with -R <= idx < 0 (R = req_to_token.size(0)) reads row
idx + R. An index outside [-R, R) makes eager raise IndexError; here its row reads nothing and writes nothing
(n_b is taken as 0): page_table leaves that row's columns unspecified, page_table_ leaves the buffer row as it
was. With `checked=True`, device-side assertions (`torch._assert_async`) fire on a length past the static bound and
on any request index outside [-R, R) (any row, whatever its length, as eager checks every index): no host sync
either way. A negative length is an empty row (n_b = 0), as eager reads it, and is not asserted here. On CPU
such an assertion raises RuntimeError at once; on CUDA it is a device-side assert.
"""

from __future__ import annotations

import torch

from ._checks import check_page_table_args, check_positive_int, check_same_device
from ._triton import cdiv, device_programs, launch, use_triton
from .warmup import warmable

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
    launch(
        page_table_kernel, (batch, per_row),
        out, out.stride(0), out.stride(1),
        req_to_token, req_to_token.stride(0), req_to_token.stride(1),
        req_pool_indices, req_pool_indices.stride(0), seq_lens, seq_lens.stride(0),
        req_to_token.shape[0], req_to_token.shape[1], page_size, width,
        BLOCK=block, num_warps=TUNING["num_warps"],
    )


def live_pages(seq_lens: torch.Tensor, page_size: int, width: int, num_tokens: int) -> torch.Tensor:
    """n_b of the contract, as a tensor: the number of columns row b must hold."""
    n = (seq_lens.to(torch.int64).clamp(min=0) + page_size - 1) // page_size
    return n.clamp(max=min(width, cdiv(num_tokens, page_size)))


def wrapped_requests(req_pool_indices: torch.Tensor, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, in_range): the req_to_token row each index reads as eager indexing reads it (idx + R for
    -R <= idx < 0), and whether it names a row at all (eager raises IndexError where it does not)."""
    idx = req_pool_indices.to(torch.int64)
    rows = torch.where(idx < 0, idx + num_reqs, idx)
    in_range = (rows >= 0) & (rows < num_reqs)
    return rows, in_range


def _fill_torch(out, req_to_token, req_pool_indices, seq_lens, page_size):
    """The same semantics with vectorized torch ops (CPU without the Triton interpreter)."""
    batch, width = out.shape[0], out.shape[1]
    num_reqs, num_tokens = req_to_token.shape
    if batch == 0 or width == 0 or num_reqs == 0 or num_tokens == 0:
        return  # no row has a live column (n_b = 0, or no index is in range)
    rows, in_range = wrapped_requests(req_pool_indices, num_reqs)
    n = torch.where(in_range, live_pages(seq_lens, page_size, width, num_tokens), 0)
    cols = torch.arange(width, device=out.device)
    live = cols[None, :] < n[:, None]
    # Dead cells gather from a safe address (row 0, token 0): out-of-range and padded rows never index.
    rows = torch.where(n > 0, rows, 0)
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
    # Device-side: an async assertion, no host read of the lengths. Only the upper end: the lengths a rule passes
    # here are the consumer's (`seq_lens - k` may be negative for a padded row, an empty row as eager reads it);
    # the rules assert the lengths their max covers within [0, bound] themselves (the "Bad lengths" contract).
    torch._assert_async(
        torch.all(seq_lens <= capacity),
        "syncfree: a sequence length exceeds the page table's static bound (max_context_len)",
    )


def _assert_requests_in_range(req_pool_indices: torch.Tensor, num_reqs: int) -> None:
    # Every index, whatever its row's length: eager indexing checks them all. Device-side, no host sync.
    _, in_range = wrapped_requests(req_pool_indices, num_reqs)
    torch._assert_async(
        torch.all(in_range),
        "syncfree: a request index (req_pool_indices) is out of range for req_to_token's rows",
    )


def _check_run(req_to_token, req_pool_indices, seq_lens, capacity: int) -> None:
    _assert_requests_in_range(req_pool_indices, req_to_token.shape[0])
    _assert_within(seq_lens, capacity)


@torch.library.custom_op("syncfree::page_table", mutates_args=())
@warmable("syncfree::page_table")
def page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    max_pages: int,
    checked: bool = False,
) -> torch.Tensor:
    """int32 [B, max_pages]: row b, column j < n_b holds req_to_token[req_pool_indices[b], j * page_size] //
    page_size, n_b = min(ceil(max(seq_lens[b], 0) / page_size), max_pages, ceil(req_to_token.size(1) / page_size)).
    Columns >= n_b are unspecified. Any strides; a negative index idx >= -R reads row idx + R as eager does. A
    row whose index is outside [-R, R) reads nothing and its columns are unspecified (eager would raise
    IndexError); `checked=True` asserts on the device that every index is in range and every length at most
    max_pages * page_size (a negative length is an empty row)."""
    check_page_table_args(req_to_token, req_pool_indices, seq_lens, page_size)
    check_positive_int("max_pages", max_pages)
    # Columns past n_b are unspecified: nothing pays for filling them.
    out = torch.empty((req_pool_indices.shape[0], max_pages), dtype=torch.int32, device=req_to_token.device)
    if not use_triton(out):
        out.zero_()  # keep CPU results deterministic; the torch path writes with torch.where
    _fill(out, req_to_token, req_pool_indices, seq_lens, page_size)
    if checked:
        _check_run(req_to_token, req_pool_indices, seq_lens, max_pages * page_size)
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
@warmable("syncfree::page_table_")
def page_table_(
    page_table: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    checked: bool = False,
) -> None:
    """page_table, written in place into rows [0, B) of an int32 [>= B, W] buffer, n_b clamped to W; nothing
    else in the buffer is written (the sentinel invariant). A row whose index is outside [-R, R) reads and
    writes nothing (the buffer row keeps its contents). `checked=True` asserts as page_table does, with the
    bound W * page_size."""
    _check_buffer(page_table, req_to_token, req_pool_indices, seq_lens, page_size)
    rows = page_table[: req_pool_indices.shape[0]]
    _fill(rows, req_to_token, req_pool_indices, seq_lens, page_size)
    if checked:
        _check_run(req_to_token, req_pool_indices, seq_lens, page_table.shape[1] * page_size)


@page_table_.register_fake
def _page_table__fake(page_table, req_to_token, req_pool_indices, seq_lens, page_size, checked=False):
    _check_buffer(page_table, req_to_token, req_pool_indices, seq_lens, page_size)


__all__ = ["page_table", "page_table_", "live_pages", "wrapped_requests"]
