"""Triton split-KV attention over FA's paged KV layout: one program per (row, KV head, split).

Each program serves the whole GQA group of its KV head for every query of the row (BLOCK_M rows of
[query, head] pairs) and walks its share of the row's live keys [0, L_b) through the page table. With one
split (DIRECT) it normalises and writes the output itself; with several it writes an unnormalised partial
result of its live rows and `paged_decode_combine_kernel` merges the splits, one program per output row.
Splits divide L_b, read on the device, so the work follows the live keys and a small batch still fills the GPU.
Loads are masked by L_b: no page, page-table column or key past a row's length is read. A key whose page id is
outside [0, num_pages) is skipped: it adds nothing to the output, and its loads are clamped to a page of the pool
(never out of bounds; a finite pool gives exactly the output without that key).
"""

import triton
import triton.language as tl


@triton.jit
def paged_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, lens_ptr, acc_ptr, ml_ptr, out_ptr,
    q_sb, q_ss, q_sh,
    o_sb, o_ss, o_sh,
    k_sp, k_ss, k_sh,
    v_sp, v_ss, v_sh,
    pt_sb, pt_sw, lens_sb,
    width, page_size, scale, num_queries, num_splits, num_pages,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    DIRECT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(lens_ptr + b * lens_sb).to(tl.int64)  # any stride: a column of a metadata matrix
    # Keys that the table cannot address do not exist for this kernel.
    length = tl.minimum(tl.maximum(length, 0), width * page_size)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, length)

    rows = tl.arange(0, BLOCK_M)
    query = rows // GROUP
    head = h * GROUP + rows % GROUP
    row_ok = rows < num_queries * GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + b * q_sb + query[:, None] * q_ss + head[:, None] * q_sh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    # Query i sits at position L - Sq + i and sees keys up to there.
    last_key = length - num_queries + query

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pt_row = pt_ptr + b * pt_sb
    # An empty pool has no page to clamp to: no key is read. A block, not the scalar `num_pages > 0`: triton 3.9's
    # interpreter makes a scalar comparison's `&` with a block an int32 tensor, which tl.load refuses as a mask
    # (3.6's and 3.8's compilers and 3.8's interpreter take either; this form is one compare per program).
    pool_ok = tl.zeros([BLOCK_N], tl.int64) < num_pages
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = (t < end) & pool_ok
        page = tl.load(pt_row + (t // page_size) * pt_sw, mask=t_ok, other=0).to(tl.int64)
        # A key whose page id is not a page of the pool is skipped: its score is masked out (it adds nothing) and
        # its loads are clamped into the pool. Masking the loads by the id instead (42eb061) made the kernel 59%
        # slower at B=1, 32K, pages of 16 on the H200 (benchmarks/paged_decode_ab.py, BENCHMARKS.md).
        page_ok = (page >= 0) & (page < num_pages)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        slot = t % page_size
        k = tl.load(
            k_ptr + (page * k_sp + slot * k_ss + h * k_sh)[:, None] + dims[None, :],
            mask=t_ok[:, None] & dim_ok[None, :], other=0.0,
        )
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale
        visible = (t_ok & page_ok)[None, :] & (t[None, :] <= last_key[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + (page * v_sp + slot * v_ss + h * v_sh)[:, None] + dims[None, :],
            mask=t_ok[:, None] & dim_ok[None, :], other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if DIRECT:
        # One split: this program saw every key of the row. A query that sees no key gets zeros.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * o_sb + query[:, None] * o_ss + head[:, None] * o_sh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # Only the live [query, head] rows: with Sq = 1 and a GQA group of 4, 4 of BLOCK_M = 16.
        part = (b * tl.num_programs(1) + h) * num_splits + s
        tl.store(acc_ptr + part * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + dims[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(ml_ptr + (part * 2) * BLOCK_M + rows, m_i, mask=row_ok)
        tl.store(ml_ptr + (part * 2 + 1) * BLOCK_M + rows, l_i, mask=row_ok)


@triton.jit
def paged_decode_combine_kernel(
    acc_ptr, ml_ptr, out_ptr,
    o_sb, o_ss, o_sh,
    num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per output row (b, KV head, [query, head] row r): merges the row's splits, BLOCK_S at a
    time with a running max, so every program reads its partials in a few wide loads rather than a long chain
    (a small batch has few rows and many splits)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    r = tl.program_id(2)
    dims = tl.arange(0, BLOCK_D)
    first = (b * tl.num_programs(1) + h) * num_splits
    m_run = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    num = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        splits = s0 + tl.arange(0, BLOCK_S)
        ok = splits < num_splits
        part = first + splits
        m = tl.load(ml_ptr + (part * 2) * BLOCK_M + r, mask=ok, other=float("-inf"))
        l = tl.load(ml_ptr + (part * 2 + 1) * BLOCK_M + r, mask=ok, other=0.0)
        acc = tl.load(acc_ptr + (part * BLOCK_M + r)[:, None] * BLOCK_D + dims[None, :], mask=ok[:, None],
                      other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        keep = tl.exp(m_run - m_safe)
        w = tl.exp(m - m_safe)  # 0 for a split that saw no key (m = -inf)
        den = den * keep + tl.sum(l * w, 0)
        num = num * keep + tl.sum(acc * w[:, None], 0)
        m_run = m_new
    # A query that sees no key (L_b = 0, or L_b < Sq) gets zeros.
    out = num / tl.where(den == 0.0, 1.0, den)
    query = r // GROUP
    head = h * GROUP + r % GROUP
    tl.store(out_ptr + b * o_sb + query * o_ss + head * o_sh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)
