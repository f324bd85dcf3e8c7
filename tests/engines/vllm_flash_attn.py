"""vLLM FlashAttention-backend style: a metadata builder fills a dataclass from the persistent block table
(page-level, static width) and the device lengths; the max length comes from the host (`seq_lens_cpu`, or a
host copy `seq_lens.cpu().numpy()` made in the step) and feeds only `max_seqlen_k`."""

from __future__ import annotations

import dataclasses

import torch

from .common import EngineCase, Layers, make_batch, make_pool


@dataclasses.dataclass
class FlashAttentionMetadata:
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_seq_len: int


class MetadataBuilder:
    def __init__(self, host_copy: bool):
        self.host_copy = host_copy

    def build(self, block_table, seq_lens, seq_lens_cpu) -> FlashAttentionMetadata:
        if self.host_copy:
            seq_lens_np = seq_lens.cpu().numpy()  # a device-to-host copy made for this max alone
            max_seq_len = int(seq_lens_np.max())
        else:
            max_seq_len = int(seq_lens_cpu.max())
        return FlashAttentionMetadata(seq_lens=seq_lens, block_table=block_table, max_seq_len=max_seq_len)


def _builder(host_copy: bool):
    def build(device, page_size):
        k, v = make_pool(page_size, device)
        builder = MetadataBuilder(host_copy)
        layers = Layers(device)

        def step(block_table, seq_lens, seq_lens_cpu, hidden):
            md = builder.build(block_table, seq_lens, seq_lens_cpu)
            return layers.run(hidden, lambda q: torch.ops.syncfree.paged_decode(
                q, k, v, md.block_table, md.seq_lens, max_seqlen_k=md.max_seq_len))

        def make_args(lengths, seed=0):
            fb = make_batch(lengths, page_size, device, seed=seed)
            # The persistent, static-width block table of the requests in the batch (page ids).
            block_table = (fb.req_to_token[fb.req_pool_indices, ::page_size] // page_size).contiguous()
            return block_table, fb.seq_lens.to(torch.int32), fb.seq_lens_cpu.to(torch.int32), fb.hidden

        return step, make_args

    return build


CASES = {
    "vllm_host_upper_bound": EngineCase(_builder(host_copy=False), "rewritten", page_size=16),
    "vllm_host_copy_upper_bound": EngineCase(_builder(host_copy=True), "rewritten", page_size=16),
}
