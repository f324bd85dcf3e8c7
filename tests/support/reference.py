"""Independent references: a plain loop for page tables, float64 loops for attention."""

import math

import torch


def page_table_cells(req_to_token, req_pool_indices, seq_lens, page_size, width):
    """{(b, j): page} for every live cell of the contract, nothing else."""
    cells = {}
    num_tokens = req_to_token.shape[1]
    for b in range(req_pool_indices.shape[0]):
        length = max(int(seq_lens[b]), 0)
        n = min(-(-length // page_size), width, -(-num_tokens // page_size))
        for j in range(n):
            cells[(b, j)] = int(req_to_token[int(req_pool_indices[b]), j * page_size]) // page_size
    return cells


def attention_f64(q, k_cache, v_cache, page_table, cache_seqlens, scale=None):
    q, k_cache, v_cache = q.double(), k_cache.double(), v_cache.double()
    bsz, sq, hq, dim = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    out = torch.zeros(bsz, sq, hq, dim, dtype=torch.float64)
    for b in range(bsz):
        length = int(cache_seqlens[b])
        for i in range(sq):
            visible = min(length - sq + i + 1, length)
            if visible <= 0:
                continue
            where = [(int(page_table[b, t // page_size]), t % page_size) for t in range(visible)]
            for h in range(hq):
                keys = torch.stack([k_cache[p, s, h // group] for p, s in where])
                values = torch.stack([v_cache[p, s, h // group] for p, s in where])
                weights = torch.softmax(keys @ q[b, i, h] * scale, 0)
                out[b, i, h] = weights @ values
    return out


def read_through_indptr(values, indices, indptr, lens):
    """A reader through an indptr (FlashInfer's flat kv_indices layout): row b reads only
    indices[indptr[b] : indptr[b] + lens[b]] and sums values there with weights 1..n; raises where a real kernel
    would read out of bounds."""
    rows = []
    for b in range(lens.shape[0]):
        start, n = int(indptr[b]), max(int(lens[b]), 0)
        if start < 0 or start + n > indices.numel():
            raise RuntimeError(f"row {b} reads indices[{start}:{start + n}] of {indices.numel()}")
        idx = indices[start : start + n].to(torch.int64)
        rows.append((values[idx] * torch.arange(1, n + 1, dtype=values.dtype)).sum())
    return torch.stack(rows) if rows else values.new_zeros(0)

