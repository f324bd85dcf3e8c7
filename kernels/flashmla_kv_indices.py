"""An example bounded writer: a user Triton kernel shaped like SGLang's `create_flashmla_kv_indices_triton`.

    n = cdiv(seq_lens.max().item(), 64)
    table = torch.full((bs, n), -1, dtype=torch.int32, device=dev)
    flashmla_kv_indices_kernel[(bs,)](req_to_token, req_pool_indices, seq_lens, None, table,
                                      req_to_token.stride(0), table.stride(0), PAGED_SIZE=64)

Program b writes row b's first cdiv(seq_lens[b], PAGED_SIZE) columns of the [bs, n] table, column j holding
req_to_token[req_pool_indices[b], j * PAGED_SIZE] // PAGED_SIZE (the page id); nothing else is written. Like
SGLang's kernel it does not clamp to the table's width: the caller sizes the table to cover every row (eager's
n covers the max; the rewritten static width covers the bound, which `checked` asserts on the device).

Its facts (`BOUNDED_WRITERS`, below) are registered by compile_pass.rules.allocated_table when it is imported;
another kernel is trusted only once registered with `register_bounded_writer`.

`kv_indices_ptr_stride` is an ordinary argument here, where SGLang declares it `tl.constexpr`: Dynamo specializes
constexprs to ints, and the stride of a [bs, cdiv(m, 64)] table is data-dependent (`Max(1, (u0 + 63) // 64)`),
so Dynamo cannot trace SGLang's launch with the width from `.item()` at all ("Could not extract specialized
integer from data-dependent expression").
"""

from __future__ import annotations

from ._triton import triton_importable

flashmla_kv_indices_kernel = None

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def flashmla_kv_indices_kernel(
        req_to_token_ptr,  # [R, T] token slots
        req_pool_indices_ptr,  # [bs]
        page_kernel_lens_ptr,  # [bs] lengths in tokens
        kv_start_idx,  # None (kept for SGLang's signature; a start offset is not supported here)
        kv_indices_ptr,  # [bs, n] page table, written in place
        req_to_token_ptr_stride: tl.constexpr,
        kv_indices_ptr_stride,  # not constexpr (see the module docstring)
        PAGED_SIZE: tl.constexpr = 64,
    ):
        BLOCK: tl.constexpr = 64  # pages per iteration
        pid = tl.program_id(axis=0)
        row = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
        length = tl.load(page_kernel_lens_ptr + pid).to(tl.int64)
        length = tl.maximum(length, 0)
        pages = (length + PAGED_SIZE - 1) // PAGED_SIZE
        for start in range(0, tl.cdiv(pages, BLOCK)):
            page = start * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            live = page < pages
            token = tl.load(req_to_token_ptr + row * req_to_token_ptr_stride + page * PAGED_SIZE, mask=live)
            tl.store(kv_indices_ptr + pid * kv_indices_ptr_stride + page, token // PAGED_SIZE, mask=live)


# Facts for the allocated-table rule (rules/allocated_table.py registers them), by the kernel's module:qualname.
BOUNDED_WRITERS = {
    f"{__name__}:flashmla_kv_indices_kernel": dict(
        table="kv_indices_ptr", lengths="page_kernel_lens_ptr", page_size="PAGED_SIZE",
        req_pool_indices="req_pool_indices_ptr", req_to_token="req_to_token_ptr",
        table_stride="kv_indices_ptr_stride"),
}


def reference(req_to_token, req_pool_indices, seq_lens, table, page_size: int = 64):
    """What the kernel writes, in torch (tests compare against it)."""
    for b in range(table.shape[0]):
        pages = -(-max(int(seq_lens[b]), 0) // page_size)
        cols = req_to_token[req_pool_indices[b], : pages * page_size : page_size] // page_size
        table[b, :pages] = cols.to(table.dtype)
    return table
