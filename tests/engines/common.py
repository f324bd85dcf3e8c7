"""What the engine-shaped steps share: a paged KV pool, a request-to-token table, a batch object, a tiny
decoder layer stack that calls the attention backend, and the case record."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 16, 32
MAX_CONTEXT = 256  # the engine's max_context_len: the static bound handed to the backend
MAX_REQUESTS = 6


@dataclasses.dataclass
class EngineCase:
    build: Callable  # build(device, page_size) -> (step, make_args(lengths) -> tuple)
    expect: str  # "rewritten" or "kept"
    words: tuple = ()  # for "kept": words the reason must contain
    options: dict = dataclasses.field(default_factory=dict)
    page_size: int = 1
    queries: int = 1  # Sq: new tokens per request in this step
    headroom: int = 0  # tokens the step adds to the lengths past the new ones (draft decode's step_id)


@dataclasses.dataclass
class ForwardBatch:
    """The engine's per-step batch (SGLang's ForwardBatch, reduced)."""

    req_to_token: torch.Tensor  # [MAX_REQUESTS, MAX_CONTEXT] int32: KV slot of token t of request r
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64 on the device: tokens already in the cache (new ones included)
    seq_lens_cpu: torch.Tensor | None  # [B] int64 on the host: the mirror engines publish
    hidden: torch.Tensor  # [B, Sq, HIDDEN]: this step's hidden states


def make_pool(page_size: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pages = MAX_REQUESTS * MAX_CONTEXT // page_size
    k = torch.randn(pages, page_size, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(pages, page_size, KV_HEADS, HEAD_DIM, generator=gen)
    return k.to(device), v.to(device)


def make_batch(lengths, page_size: int, device, queries: int = 1, seed: int = 0, mirror: bool = True):
    """Each request owns whole pages scattered through the pool, so page ids differ from request order."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    pages_per_req = MAX_CONTEXT // page_size
    order = torch.randperm(MAX_REQUESTS * pages_per_req, generator=gen).view(MAX_REQUESTS, pages_per_req)
    tok = torch.arange(MAX_CONTEXT)
    req_to_token = (order[:, tok // page_size] * page_size + tok % page_size).to(torch.int32)
    rpi = torch.randperm(MAX_REQUESTS, generator=gen)[:batch]
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    hidden = torch.randn(batch, queries, HIDDEN, generator=gen)
    return ForwardBatch(req_to_token.to(device), rpi.to(device), seq_lens.to(device),
                        seq_lens.clone() if mirror else None, hidden.to(device))


class Layers(torch.nn.Module):
    """Two decoder layers' attention: q from the hidden states, paged attention through `attend`, o-proj."""

    def __init__(self, device, layers: int = 2, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.wq = [(torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(device)
                   for _ in range(layers)]
        self.wo = [(torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=gen) / HIDDEN ** 0.5).to(device)
                   for _ in range(layers)]

    def run(self, hidden, attend):
        bsz, sq, _ = hidden.shape
        for wq, wo in zip(self.wq, self.wo):
            q = (hidden @ wq.t()).view(bsz, sq, HEADS, HEAD_DIM)
            hidden = hidden + attend(q).reshape(bsz, sq, -1) @ wo.t()
        return hidden
