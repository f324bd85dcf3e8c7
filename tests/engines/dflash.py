"""SGLang dflash style: the target model verifies a block of draft tokens per request. The host max comes
through a helper that falls back to the engine's max_context_len when no CPU mirror was published; the mirror
arrives as its own CPU argument beside the device lengths."""

from __future__ import annotations

import torch

from .common import MAX_CONTEXT, EngineCase, Layers, make_batch, make_pool

BLOCK = 4  # draft tokens per request


def host_max_seq_len(seq_lens_cpu):
    if seq_lens_cpu is None:
        return MAX_CONTEXT
    return seq_lens_cpu.max().item()


def _builder(with_mirror: bool):
    def build(device, page_size):
        k, v = make_pool(page_size, device)
        layers = Layers(device)

        def step(req_to_token, req_pool_indices, seq_lens, seq_lens_cpu, hidden):
            cache_seqlens = (seq_lens + BLOCK).to(torch.int32)
            max_seq_len_k = min(host_max_seq_len(seq_lens_cpu) + BLOCK, MAX_CONTEXT + BLOCK)
            page_table = req_to_token[req_pool_indices, :max_seq_len_k:page_size] // page_size
            return layers.run(hidden, lambda q: torch.ops.syncfree.paged_decode(
                q, k, v, page_table.to(torch.int32), cache_seqlens, max_seqlen_k=max_seq_len_k))

        def make_args(lengths, seed=0):
            fb = make_batch([max(0, n - BLOCK) for n in lengths], page_size, device, queries=BLOCK, seed=seed)
            return (fb.req_to_token, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu if with_mirror else None,
                    fb.hidden)

        return step, make_args

    return build


CASES = {
    "dflash_verify_mirror_argument": EngineCase(_builder(with_mirror=True), "rewritten", page_size=16,
                                                queries=BLOCK),
    "dflash_verify_without_mirror": EngineCase(_builder(with_mirror=False), "none", page_size=16, queries=BLOCK),
}
