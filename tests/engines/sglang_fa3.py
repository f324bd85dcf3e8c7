"""SGLang FlashAttention-backend style: init_forward_metadata per forward mode, then forward_decode per layer.

The metadata step reads the host mirror (`seq_lens_cpu.max().item()`), gathers `req_to_token[rpi, :max]`, and
for page_size > 1 converts it to a page table with a strided column index built in the step
(`torch.arange(0, page_table.shape[1], page_size)`) and `// page_size`. Speculative modes add a constant to
the lengths and to the max. The backend may keep the metadata on itself (`self.forward_metadata = ...`), which
makes it leave the compiled step.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .common import MAX_CONTEXT, EngineCase, Layers, make_batch, make_pool


@dataclasses.dataclass
class AttentionMetadata:
    cache_seqlens_int32: torch.Tensor = None
    max_seq_len_q: int = 1
    max_seq_len_k: int = 0
    cu_seqlens_k: torch.Tensor = None
    page_table: torch.Tensor = None


class FlashAttentionStyleBackend:
    def __init__(self, k_cache, v_cache, page_size: int, mode: str = "decode", step_id: int = 0,
                 draft_tokens: int = 0, keep_on_self: bool = False, page_level: bool = False):
        self.page_level = page_level  # slice a persistent page-level table by a page count instead
        self.k_cache, self.v_cache = k_cache, v_cache
        self.page_size = page_size
        self.mode = mode
        self.step_id = step_id
        self.draft_tokens = draft_tokens
        self.keep_on_self = keep_on_self
        self.forward_metadata = None

    def init_forward_metadata(self, fb) -> AttentionMetadata:
        md = AttentionMetadata()
        if self.mode == "decode":
            md.cache_seqlens_int32 = fb.seq_lens.to(torch.int32)
            md.max_seq_len_k = fb.seq_lens_cpu.max().item()
        elif self.mode == "draft_decode":
            md.cache_seqlens_int32 = (fb.seq_lens + (self.step_id + 1)).to(torch.int32)
            md.max_seq_len_k = fb.seq_lens_cpu.max().item() + (self.step_id + 1)
        elif self.mode == "target_verify":
            md.cache_seqlens_int32 = (fb.seq_lens + self.draft_tokens).to(torch.int32)
            md.max_seq_len_q = self.draft_tokens
            md.max_seq_len_k = fb.seq_lens_cpu.max().item() + self.draft_tokens
        elif self.mode == "draft_extend":  # the lengths already count the extended tokens
            md.cache_seqlens_int32 = fb.seq_lens.to(torch.int32)
            md.max_seq_len_q = fb.hidden.shape[1]
            md.max_seq_len_k = fb.seq_lens_cpu.max().item()
        else:
            raise ValueError(f"unknown forward mode {self.mode!r}")
        md.cu_seqlens_k = F.pad(torch.cumsum(md.cache_seqlens_int32, dim=0, dtype=torch.int32), (1, 0))
        if self.page_level:  # the CUDA-graph path's spelling: a page count over the page-level table
            max_seq_pages = (md.max_seq_len_k + self.page_size - 1) // self.page_size
            md.page_table = fb.req_to_page[fb.req_pool_indices, :max_seq_pages]
            return md
        md.page_table = fb.req_to_token[fb.req_pool_indices, : md.max_seq_len_k]
        if self.page_size > 1:
            strided_indices = torch.arange(0, md.page_table.shape[1], self.page_size, device=fb.seq_lens.device)
            md.page_table = md.page_table[:, strided_indices] // self.page_size
            if self.keep_on_self:
                self.strided_indices = strided_indices
        if self.keep_on_self:
            self.forward_metadata = md
        return md

    def forward_decode(self, q, md: AttentionMetadata):
        return torch.ops.syncfree.paged_decode(q, self.k_cache, self.v_cache, md.page_table, md.cache_seqlens_int32,
                                               max_seqlen_k=md.max_seq_len_k)


def _builder(mode: str, step_id: int = 0, draft_tokens: int = 0, keep_on_self: bool = False,
             page_level: bool = False):
    def build(device, page_size):
        k, v = make_pool(page_size, device)
        backend = FlashAttentionStyleBackend(k, v, page_size, mode, step_id, draft_tokens, keep_on_self, page_level)
        layers = Layers(device)
        queries = draft_tokens or 1

        def step(fb):
            md = backend.init_forward_metadata(fb)
            if keep_on_self:
                md = backend.forward_metadata  # layers read what the backend kept
            return layers.run(fb.hidden, lambda q: backend.forward_decode(q, md))

        def make_args(lengths, seed=0):
            # target verify: the cache holds `lengths` tokens before this step's draft tokens are appended
            fb = make_batch(lengths, page_size, device, queries=queries, seed=seed)
            # The engine's persistent page-level table (page ids of each request), beside req_to_token.
            fb.req_to_page = (fb.req_to_token[:, ::page_size] // page_size).to(torch.int32).contiguous()
            return (fb,)

        return step, make_args

    return build


CASES = {
    "sglang_decode_ps1": EngineCase(_builder("decode"), "rewritten", page_size=1),
    "sglang_decode_ps16": EngineCase(_builder("decode"), "rewritten", page_size=16),
    "sglang_decode_ps64": EngineCase(_builder("decode"), "rewritten", page_size=64),
    "sglang_draft_decode": EngineCase(_builder("draft_decode", step_id=2), "rewritten", page_size=16, headroom=2),
    "sglang_target_verify": EngineCase(_builder("target_verify", draft_tokens=4), "rewritten", page_size=16,
                                       queries=4),
    "sglang_draft_extend": EngineCase(_builder("draft_extend"), "rewritten", page_size=16),
    "sglang_page_count_page_level_table": EngineCase(_builder("decode", page_level=True), "rewritten",
                                                     page_size=16),
    "sglang_stored_metadata_kept": EngineCase(_builder("decode", keep_on_self=True), "kept",
                                              words=("returned to the caller",), page_size=16),
    "sglang_stored_metadata_static": EngineCase(_builder("decode", keep_on_self=True), "rewritten",
                                                options={"static_escapes": True}, page_size=16),
}
MAX_CONTEXT_LEN = MAX_CONTEXT
