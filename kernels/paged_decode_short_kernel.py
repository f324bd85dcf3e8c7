"""Triton split-KV attention for small batches: one program per (row, group of KV heads, split of the keys).

`paged_decode`'s short path. A decode step of one to a few rows has too few (row, KV head) pairs to fill the GPU,
so the keys are split; the split kernel (paged_decode_kernel.py) then runs one program per (row, KV head, split),
and each of them is a chain of dependent DRAM loads (the length, then q and its page-table entries, then K, then
V) over a couple of key blocks: at B=1 the time goes to latency, not bandwidth. This kernel reshapes the work:

* A program serves HEADS_PER_PROGRAM KV heads of one key range (grid (B, cdiv(Hkv, HEADS_PER_PROGRAM), splits)).
  It loads each key block's page-table entries once for all its heads, then reads the block's K and V for every
  head in one 3-D tile each, [heads, keys, D]: with page size 16 and all 8 KV heads, a page's keys are one
  contiguous 16 x Hkv x D run, read by one program in wide loads instead of by 8 programs.
* The heads stay independent: a batched dot over the head dimension, each head with its own GQA group of
  queries and its own running max, sum and accumulator ([heads, BLOCK_M] and [heads, BLOCK_M, BLOCK_D]).
* K and V of a block are both requested before the first dot (two tiles in flight, not K -> dot -> V), and the
  loop over key blocks is software-pipelined (num_stages), so the next blocks' loads overlap this block's math.

With one split (DIRECT) a program normalises and writes the output itself; with several it writes the same
unnormalised partials as paged_decode_split_kernel (acc [B, Hkv, splits, BLOCK_M, BLOCK_D] f32, m and l in
ml [B, Hkv, splits, 2, BLOCK_M]) and the split path's paged_decode_combine_kernel merges them unchanged.
Splits divide L_b, read on the device, as the split kernel's do. Loads are masked by L_b: no page, page-table
column or key past a row's length is read.
"""

import triton
import triton.language as tl


# Integers that change from shape to shape (the table width, the page size, the split count, the head count) are
# not specialised, so that one compiled kernel serves them all (a benchmark sweep times 6 shapes per launch
# setting); the strides are (divisibility by 16 gives vectorised loads), and so is Sq (1 folds away).
@triton.jit(do_not_specialize=["width", "page_size", "num_splits", "kv_heads", "num_pages"])
def paged_decode_short_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, lens_ptr, acc_ptr, ml_ptr, out_ptr,
    q_sb, q_ss, q_sh,
    o_sb, o_ss, o_sh,
    k_sp, k_ss, k_sh,
    v_sp, v_ss, v_sh,
    pt_sb, pt_sw, lens_sb,
    width, page_size, scale, num_queries, num_splits, kv_heads, num_pages,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    DIRECT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(lens_ptr + b * lens_sb).to(tl.int64)
    # Keys that the table cannot address do not exist for this kernel.
    length = tl.minimum(tl.maximum(length, 0), width * page_size)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, length)

    # HEADS lanes (a power of two) for HEADS_PER_PROGRAM KV heads; lanes past them or past Hkv are masked.
    lane = tl.arange(0, HEADS)
    kvh = g * HEADS_PER_PROGRAM + lane
    head_ok = (lane < HEADS_PER_PROGRAM) & (kvh < kv_heads)
    # Row r of a head is query r // GROUP and query head kvh * GROUP + r % GROUP, as in the split kernel.
    rows = tl.arange(0, BLOCK_M)
    query = rows // GROUP
    row_ok = rows < num_queries * GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    qhead = kvh[:, None] * GROUP + (rows % GROUP)[None, :]  # [HEADS, BLOCK_M]
    q_mask = head_ok[:, None, None] & row_ok[None, :, None] & dim_ok[None, None, :]
    q = tl.load(q_ptr + b * q_sb + query[None, :, None] * q_ss + qhead[:, :, None] * q_sh + dims[None, None, :],
                mask=q_mask, other=0.0)
    # Query i sits at position L - Sq + i and sees keys up to there.
    last_key = length - num_queries + query

    m_i = tl.full([HEADS, BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS, BLOCK_M], tl.float32)
    acc = tl.zeros([HEADS, BLOCK_M, BLOCK_D], tl.float32)
    k_head = (kvh * k_sh)[:, None, None] + dims[None, None, :]
    v_head = (kvh * v_sh)[:, None, None] + dims[None, None, :]
    lane_ok = head_ok[:, None, None] & dim_ok[None, None, :]
    pt_row = pt_ptr + b * pt_sb
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        # One load of the block's page-table entries serves every head of the program.
        page = tl.load(pt_row + (t // page_size) * pt_sw, mask=t_ok, other=0).to(tl.int64)
        # A key whose page id is not a page of the pool is never read: it is skipped.
        t_ok = t_ok & (page >= 0) & (page < num_pages)
        slot = t % page_size
        kv_mask = t_ok[None, :, None] & lane_ok
        # K and V of the block for all the heads, both requested before the first dot.
        k = tl.load(k_ptr + (page * k_sp + slot * k_ss)[None, :, None] + k_head, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (page * v_sp + slot * v_ss)[None, :, None] + v_head, mask=kv_mask, other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.permute(k, (0, 2, 1)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.permute(k, (0, 2, 1)))
        qk = qk * scale
        visible = t_ok[None, :] & (t[None, :] <= last_key[:, None])  # [BLOCK_M, BLOCK_N], the same for each head
        qk = tl.where(visible[None, :, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        if IEEE:
            acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if DIRECT:
        # One split: this program saw every key of its heads. A query that sees no key gets zeros.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, :, None]
        tl.store(out_ptr + b * o_sb + query[None, :, None] * o_ss + qhead[:, :, None] * o_sh + dims[None, None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # The split kernel's partial layout, only the live [query, head] rows of the live heads.
        part = (b * kv_heads + kvh) * num_splits + s  # [HEADS]
        live = head_ok[:, None] & row_ok[None, :]
        tl.store(acc_ptr + (part * BLOCK_M)[:, None, None] * BLOCK_D + rows[None, :, None] * BLOCK_D
                 + dims[None, None, :], acc, mask=live[:, :, None])
        ml = ml_ptr + (part * 2 * BLOCK_M)[:, None] + rows[None, :]
        tl.store(ml, m_i, mask=live)
        tl.store(ml + BLOCK_M, l_i, mask=live)
