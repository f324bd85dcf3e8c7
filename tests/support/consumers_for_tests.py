"""Test consumers: self-guarding ops with an upper-bound argument (registered), an unregistered twin, an indptr
reader and a bounded writer."""

import torch

import compile_pass

SEEN_BOUNDS: list[int] = []


def _bounded_sum(page_table, lens, page_size, max_seqlen_k):
    # Self-guarding: row b reads only its ceil(lens[b] / page_size) live columns.
    SEEN_BOUNDS.append(max_seqlen_k)
    if int(lens.max()) > max_seqlen_k:
        raise RuntimeError("max_seqlen_k is not an upper bound of lens")
    n = (lens.clamp(min=0) + page_size - 1) // page_size
    cols = torch.arange(page_table.shape[1])
    live = cols[None, :] < n[:, None]
    return torch.where(live, page_table.to(torch.int64), 0).sum(1).to(torch.float32)


@torch.library.custom_op("syncfree_test::bounded_sum", mutates_args=())
def bounded_sum(page_table: torch.Tensor, lens: torch.Tensor, page_size: int, max_seqlen_k: int) -> torch.Tensor:
    return _bounded_sum(page_table, lens, page_size, max_seqlen_k)


@bounded_sum.register_fake
def _(page_table, lens, page_size, max_seqlen_k):
    return page_table.new_empty((page_table.shape[0],), dtype=torch.float32)


@torch.library.custom_op("syncfree_test::unguarded_sum", mutates_args=())
def unguarded_sum(page_table: torch.Tensor, lens: torch.Tensor, page_size: int, max_seqlen_k: int) -> torch.Tensor:
    return _bounded_sum(page_table, lens, page_size, max_seqlen_k)


@unguarded_sum.register_fake
def _(page_table, lens, page_size, max_seqlen_k):
    return page_table.new_empty((page_table.shape[0],), dtype=torch.float32)


compile_pass.register_self_guarding_consumer(
    "syncfree_test::bounded_sum", page_table="page_table", lengths="lens", upper_bounds=("max_seqlen_k",)
)


# The same reader over a paged KV cache, its page size the cache's dim 1 (as syncfree::paged_decode declares it):
# the cheap stand-in for the attention where the tests run at realistic bounds under the Triton interpreter.
@torch.library.custom_op("syncfree_test::paged_sum", mutates_args=())
def paged_sum(page_table: torch.Tensor, lens: torch.Tensor, k_cache: torch.Tensor, max_seqlen_k: int) -> torch.Tensor:
    return _bounded_sum(page_table, lens, k_cache.shape[1], max_seqlen_k)


@paged_sum.register_fake
def _(page_table, lens, k_cache, max_seqlen_k):
    return page_table.new_empty((page_table.shape[0],), dtype=torch.float32)


compile_pass.register_self_guarding_consumer(
    "syncfree_test::paged_sum", page_table="page_table", lengths="lens", upper_bounds=("max_seqlen_k",),
    page_size_of=("k_cache", 1)
)


# A reader through an indptr (registered with the flat-buffer family's facts): row b reads only
# indices[indptr[b] : indptr[b] + lens[b]] (reference.read_through_indptr, which raises past the buffer).
@torch.library.custom_op("syncfree_test::indptr_read", mutates_args=())
def indptr_read(values: torch.Tensor, indices: torch.Tensor, indptr: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    from reference import read_through_indptr

    return read_through_indptr(values, indices, indptr, lens)


@indptr_read.register_fake
def _(values, indices, indptr, lens):
    return values.new_empty((lens.shape[0],))


compile_pass.register_indptr_reader("syncfree_test::indptr_read", indices="indices", indptr="indptr", lengths="lens")


# A bounded writer (registered with the allocated-table family's facts): row b's first cdiv(lengths[b], page_size)
# page ids of req_to_token, written through `table_stride`; it raises where eager's table is too narrow for a row.
_WRITER_LIB = torch.library.Library("syncfree_test", "FRAGMENT")
_WRITER_LIB.define("write_rows(Tensor req_to_token, Tensor req_pool_indices, Tensor lengths, Tensor(a!) table, "
                   "SymInt table_stride, int page_size) -> ()")


def _write_rows(req_to_token, req_pool_indices, lengths, table, table_stride, page_size):
    for b in range(lengths.shape[0]):
        pages = -(-max(int(lengths[b]), 0) // page_size)
        if pages > table_stride:
            raise IndexError(f"row {b} needs {pages} columns, the row stride is {table_stride}")
        cols = req_to_token[req_pool_indices[b], : pages * page_size : page_size] // page_size
        table.as_strided((pages,), (1,), table.storage_offset() + b * table_stride).copy_(cols.to(table.dtype))


_WRITER_LIB.impl("write_rows", _write_rows, "CPU")
torch.library.register_fake("syncfree_test::write_rows", lambda *a: None, lib=_WRITER_LIB)
WRITE_ROWS = torch.ops.syncfree_test.write_rows
compile_pass.register_bounded_writer(WRITE_ROWS, table="table", lengths="lengths", page_size="page_size",
                                     req_pool_indices="req_pool_indices", req_to_token="req_to_token",
                                     table_stride="table_stride")
