"""Triton kernel that fills a page table on the device, bounded per row by the lengths tensor.

Row b gets n_b = min(ceil(max(L_b, 0) / page_size), width, ceil(num_tokens / page_size)) columns:
column j holds floor(req_to_token[req_pool_indices[b], j * page_size] / page_size). Nothing past n_b is read
or written. The grid depends only on the buffer shape; each program strides over its row's live columns, so
the work follows the live pages, not the static width, and the launch can sit inside a CUDA graph.

Every tensor is addressed through its strides (a column of a metadata matrix, an expanded or a sliced tensor
is read in place, with no copy). A request index is read as eager indexing reads it: -R <= idx < 0 wraps to
idx + R (R = num_reqs, the rows of req_to_token); an index outside [-R, R) gives its row n_b = 0, so nothing
is read through it and nothing is written in that row (the wrapper asserts on such indices when checked).
"""

import triton
import triton.language as tl


@triton.jit
def page_table_kernel(
    out_ptr,
    out_row_stride,
    out_col_stride,
    r2t_ptr,
    r2t_row_stride,
    r2t_col_stride,
    rpi_ptr,
    rpi_stride,
    lens_ptr,
    lens_stride,
    num_reqs,
    num_tokens,
    page_size,
    width,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    nprog = tl.num_programs(1)
    # Offsets are int64 products (row, req and cols are int64): strides may be 0 (expanded) or large.
    length = tl.maximum(tl.load(lens_ptr + row * lens_stride).to(tl.int64), 0)
    n = (length + page_size - 1) // page_size
    n = tl.minimum(n, width)
    n = tl.minimum(n, (num_tokens + page_size - 1) // page_size)
    if n > 0:
        # The request index is read only for rows that have pages: padded rows may hold any index.
        req = tl.load(rpi_ptr + row * rpi_stride).to(tl.int64)
        req = tl.where(req < 0, req + num_reqs, req)  # eager's wrap of negative indices
        # Out of range even after the wrap: eager raises; this row reads (and writes) nothing.
        n = tl.where((req >= 0) & (req < num_reqs), n, 0)
        src = r2t_ptr + req * r2t_row_stride
        dst = out_ptr + row * out_row_stride
        for start in range(pid.to(tl.int64) * BLOCK, n, nprog.to(tl.int64) * BLOCK):
            cols = start + tl.arange(0, BLOCK).to(tl.int64)
            mask = cols < n
            token = tl.load(src + cols * page_size * r2t_col_stride, mask=mask, other=0).to(tl.int64)
            page = token // page_size
            # Floor division whatever the backend's integer-division convention (C truncates).
            page = tl.where(token - page * page_size < 0, page - 1, page)
            tl.store(dst + cols * out_col_stride, page.to(tl.int32), mask=mask)
