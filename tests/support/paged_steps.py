"""Inputs and steps the realistic-bound tests share: a token table and a small paged KV pool at any bound and page
size, FlashMLA's grow-on-demand scratch (SGLang's `_eager_block_kv_indices`) over a registered writer, and
TRTLLM-MLA's round-up with the maxima that cover each of its residue classes."""

from __future__ import annotations

import random

import torch

ATTN = torch.ops.syncfree.paged_decode


def paged_inputs(lengths, bound: int, page_size: int, seed: int = 0, *, reqs: int = 4, heads: int = 2,
                 kv_heads: int = 1, dim: int = 4):
    """(q, k, v, r2t, rpi, seq_lens): a token table of more than `bound` tokens per request (a whole number of
    pages, a request row for every length), a KV pool of small heads, random request rows."""
    width = (-(-bound // page_size) + 1) * page_size
    reqs = max(reqs, len(lengths))
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(reqs * width // page_size, generator=gen).view(reqs, -1)
    tok = torch.arange(width)
    r2t = (pages[:, tok // page_size] * page_size + tok % page_size).to(torch.int32)
    rpi = torch.randperm(reqs, generator=gen)[: len(lengths)]
    q = torch.randn(len(lengths), 1, heads, dim, generator=gen)
    k = torch.randn(reqs * width // page_size, page_size, kv_heads, dim, generator=gen)
    v = torch.randn(reqs * width // page_size, page_size, kv_heads, dim, generator=gen)
    return q, k, v, r2t, rpi, torch.tensor(lengths, dtype=torch.int64)


class Scratch:
    """What the backend keeps between steps: the grown scratch (FlashMLA's `_eager_kv_indices_buf`) and the table
    the step stored (FlashMLADecodeMetadata's)."""

    def __init__(self):
        self.buf = None
        self.stored = None


def grown_scratch_step(state: Scratch, writer, page_size: int):
    """FlashMLA's decode metadata over `writer` (a registered bounded writer `(r2t, rpi, lengths, table, stride,
    page_size)`): the scratch grown to the running max shape, sliced `buf[:bs, :n]`, filled, stored, read."""
    def step(q, k, v, r2t, rpi, seq_lens):
        bs = seq_lens.shape[0]
        n = (seq_lens.max().item() + page_size - 1) // page_size
        buf = state.buf
        if buf is None or buf.shape[0] < bs or buf.shape[1] < n:
            rows = bs if buf is None else max(bs, buf.shape[0])
            cols = n if buf is None else max(n, buf.shape[1])
            buf = torch.full((rows, cols), -1, dtype=torch.int32)
            state.buf = buf
        table = buf[:bs, :n]
        writer(r2t, rpi, seq_lens, table, table.stride(0), page_size)
        state.stored = table
        return ATTN(q, k, v, table[:bs], seq_lens.to(torch.int32))

    return step


def padded_blocks(m: int, page_size: int) -> int:
    """TRTLLM-MLA's `_calc_padded_blocks` (trtllm_mla_backend.py:340): cdiv(m, page_size) pages, rounded up to a
    multiple of `lcm = 4096 // page_size` when it is not one (a branch whose outcome differs inside any realistic
    [0, bound])."""
    lcm = 4096 // page_size
    blocks = (m + page_size - 1) // page_size
    if blocks % lcm != 0:
        blocks = (blocks + lcm - 1) // lcm * lcm
    return blocks


def maxima(bound: int, page_size: int, seed: int) -> list[int]:
    """0, 1, the bound and its neighbours, every multiple of the round-up's tokens and its neighbours (each
    residue class of `blocks % lcm` at its edges), and random values: at most 24, sorted."""
    rng = random.Random(seed)
    span = 4096
    edges = {0, 1, bound - 1, bound}
    for k in range(1, bound // span + 1):
        edges |= {k * span - page_size, k * span - 1, k * span, k * span + 1}
    edges |= {rng.randint(0, bound) for _ in range(6)}
    return sorted(m for m in edges if 0 <= m <= bound)[:24]
