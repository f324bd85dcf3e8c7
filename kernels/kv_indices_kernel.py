"""Triton kernel that writes a flat kv_indices buffer (FlashInfer's layout), bounded by the lengths and the buffer.

Row b copies its first L_b token slots, L_b = min(max(lengths[b], 0), num_tokens), from req_to_token's row
req_pool_indices[b] to out[indptr[b] : indptr[b] + L_b]; a destination outside [0, out_numel) is never written.
The grid depends only on the batch (and a fixed split of each row): every program strides over its row's live
slots, so the launch can sit inside a CUDA graph. A request index is read as eager indexing reads it (-R <= idx < 0
wraps to idx + R); an index outside [-R, R) gives its row L_b = 0.
"""

import triton
import triton.language as tl


@triton.jit
def kv_indices_kernel(
    out_ptr,
    out_stride,
    out_numel,
    r2t_ptr,
    r2t_row_stride,
    r2t_col_stride,
    rpi_ptr,
    rpi_stride,
    lens_ptr,
    lens_stride,
    indptr_ptr,
    indptr_stride,
    num_reqs,
    num_tokens,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    nprog = tl.num_programs(1)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + row * lens_stride).to(tl.int64), 0), num_tokens)
    if n > 0:
        req = tl.load(rpi_ptr + row * rpi_stride).to(tl.int64)
        req = tl.where(req < 0, req + num_reqs, req)
        n = tl.where((req >= 0) & (req < num_reqs), n, 0)
        start = tl.load(indptr_ptr + row * indptr_stride).to(tl.int64)
        src = r2t_ptr + req * r2t_row_stride
        for first in range(pid.to(tl.int64) * BLOCK, n, nprog.to(tl.int64) * BLOCK):
            cols = first + tl.arange(0, BLOCK).to(tl.int64)
            dst = start + cols
            mask = (cols < n) & (dst >= 0) & (dst < out_numel)
            token = tl.load(src + cols * r2t_col_stride, mask=mask, other=0)
            tl.store(out_ptr + dst * out_stride, token, mask=mask)
