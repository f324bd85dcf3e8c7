"""Triton split-KV attention with the combine inside: one launch per call (`paged_decode`'s short path).

The same programs as `paged_decode_split_kernel`, one per (row, KV head, split), each serving the whole GQA
group of its KV head for every query of the row and walking its share of the live keys [0, L_b) through the
page table. Each writes an unnormalised partial result of its live [query, head] rows, then takes a ticket from
the (row, KV head)'s counter; the program that takes the last ticket (the last split of that row and head to
finish, whichever it is) merges every split of it and writes the output, and sets the counter back to 0 for the
next call (or CUDA-graph replay). No second launch, no combine kernel.

Ordering: a CTA barrier, then the ticket (one thread's atomic, acq_rel at GPU scope) orders this program's
partial stores before it; the last ticket's acquire orders the merge's loads after every other program's
release, and the merge reads the partials from L2 (.cg), never a stale L1 line.
Loads are masked by L_b: no page, page-table column or key past a row's length is read.
"""

import triton
import triton.language as tl


@triton.jit
def paged_decode_short_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, lens_ptr, acc_ptr, ml_ptr, cnt_ptr, out_ptr,
    q_sb, q_ss, q_sh,
    o_sb, o_ss, o_sh,
    k_sp, k_ss, k_sh,
    v_sp, v_ss, v_sh,
    pt_sb, pt_sw,
    width, page_size, scale, num_queries, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(lens_ptr + b).to(tl.int64)
    # Keys that the table cannot address do not exist for this kernel.
    length = tl.minimum(tl.maximum(length, 0), width * page_size)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, length)

    rows = tl.arange(0, BLOCK_M)
    query = rows // GROUP
    head = h * GROUP + rows % GROUP
    live_rows = num_queries * GROUP
    row_ok = rows < live_rows
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
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page = tl.load(pt_row + (t // page_size) * pt_sw, mask=t_ok, other=0).to(tl.int64)
        slot = t % page_size
        kv_mask = t_ok[:, None] & dim_ok[None, :]
        # K and V of the block are both requested before the first dot: two tiles in flight, not a chain.
        k = tl.load(k_ptr + (page * k_sp + slot * k_ss + h * k_sh)[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(v_ptr + (page * v_sp + slot * v_ss + h * v_sh)[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale
        visible = t_ok[None, :] & (t[None, :] <= last_key[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # This split's partial result: only the live [query, head] rows (Sq = 1, GQA group 4: 4 of BLOCK_M = 16).
    group_id = b * tl.num_programs(1) + h
    part = group_id * num_splits + s
    tl.store(acc_ptr + part * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + dims[None, :], acc,
             mask=row_ok[:, None])
    tl.store(ml_ptr + (part * 2) * BLOCK_M + rows, m_i, mask=row_ok)
    tl.store(ml_ptr + (part * 2 + 1) * BLOCK_M + rows, l_i, mask=row_ok)

    # Every thread's stores above happen before the ticket (released at GPU scope by the one thread taking it).
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + group_id, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        # The last split of (row, KV head) to finish: every other split's partial is visible. Reset the counter
        # for the next call first (no other program of this call touches it again), then merge.
        tl.atomic_xchg(cnt_ptr + group_id, 0, sem="relaxed", scope="gpu")
        first = group_id * num_splits
        for r in range(0, live_rows):
            m_run = tl.full([1], float("-inf"), tl.float32)
            den = tl.zeros([1], tl.float32)
            num = tl.zeros([BLOCK_D], tl.float32)
            for s0 in range(0, num_splits, BLOCK_S):
                splits = s0 + tl.arange(0, BLOCK_S)
                ok = splits < num_splits
                sp = first + splits
                m = tl.load(ml_ptr + (sp * 2) * BLOCK_M + r, mask=ok, other=float("-inf"), cache_modifier=".cg")
                l = tl.load(ml_ptr + (sp * 2 + 1) * BLOCK_M + r, mask=ok, other=0.0, cache_modifier=".cg")
                a = tl.load(acc_ptr + (sp * BLOCK_M + r)[:, None] * BLOCK_D + dims[None, :], mask=ok[:, None],
                            other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_run, tl.max(m, 0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                keep = tl.exp(m_run - m_safe)
                w = tl.exp(m - m_safe)  # 0 for a split that saw no key (m = -inf)
                den = den * keep + tl.sum(l * w, 0)
                num = num * keep + tl.sum(a * w[:, None], 0)
                m_run = m_new
            # A query that sees no key (L_b = 0, or L_b < Sq) gets zeros.
            o = num / tl.where(den == 0.0, 1.0, den)
            qi = r // GROUP
            hd = h * GROUP + r % GROUP
            tl.store(out_ptr + b * o_sb + qi * o_ss + hd * o_sh + dims, o.to(out_ptr.dtype.element_ty),
                     mask=dim_ok)
