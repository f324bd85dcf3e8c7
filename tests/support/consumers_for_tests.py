"""Test consumers: one self-guarding op with an upper-bound argument (registered), and its unregistered twin."""

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
