"""A tiny Llama-style decoder over a paged KV pool, written the way engines write their decode step.

RMSNorm, RoPE, GQA attention through a page table, SwiGLU MLP; random weights (seeded), no downloads.
The KV pool uses the engines' layout: `req_to_token[req, t]` is the KV slot of token t of request `req`;
slot s lives at page s // page_size, offset s % page_size of k_cache/v_cache [num_pages, page_size, Hkv, D].

The attention-metadata step is written like SGLang's, host sync included:

    max_len = fb.seq_lens.max().item()                                  # the sync the pass removes
    page_table = fb.req_to_token[fb.req_pool_indices, :max_len:ps] // ps
    cache_seqlens = fb.seq_lens.to(torch.int32)

Modes: "decode" (Sq = 1), "verify" (target-verify, Sq = draft tokens), and "extend_cold" (a cold path whose
attention is a dense gather + SDPA that is not self-guarding: its host max comes from the published
seq_lens_cpu mirror, and the pass must keep and report it).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from compile_pass.kernels import flash_attn as _flash_attn  # noqa: F401  (adapter ops)


@dataclasses.dataclass
class TinyLlamaConfig:
    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    page_size: int = 4
    num_pages: int = 256
    max_context_len: int = 128
    max_requests: int = 8
    attention: str = "paged_decode"  # or "fa4", "fa_kvcache"
    # How the metadata step sizes the page table: "item" (seq_lens.max().item(), a strided slice) or "sglang"
    # (the host mirror seq_lens_cpu, and a strided column index built in the step, as SGLang's FA backend does)
    metadata: str = "item"
    dtype: torch.dtype = torch.float32
    rope_theta: float = 10000.0
    # Regional compilation, as a user writes it: each layer's work runs in two compiled regions
    # (torch.compiler.nested_compile_region), so that Dynamo traces one layer body and stamps it out for every
    # layer. The KV write (store_kv, a mutating custom op) sits between them, outside: AOT functionalization
    # refuses a mutating custom op inside a region. Only for tp_size == 1 and attention == "paged_decode".
    regional: bool = False


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, Sq]
    positions: torch.Tensor  # [B, Sq]
    out_cache_loc: torch.Tensor  # [B, Sq] KV slots of the new tokens
    req_to_token: torch.Tensor  # [max_requests, max_context_len] int32
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, new tokens included
    seq_lens_cpu: torch.Tensor | None  # the host mirror engines publish


def _rms_norm(x, weight, eps=1e-6):
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def _rope(x, positions, theta):
    # x [B, Sq, H, D]; rotate pairs (first half, second half)
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * freqs  # [B, Sq, half]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _attn_in(x, attn_norm, wqkv, positions, heads: int, kv_heads: int, head_dim: int, theta: float):
    """A layer's first half up to the KV write: RMSNorm, the QKV projection, RoPE -> q, k, v [B, Sq, H, D]."""
    bsz, sq = x.shape[0], x.shape[1]
    h = _rms_norm(x, attn_norm)
    qkv = h @ wqkv.t()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = _rope(q.view(bsz, sq, heads, head_dim), positions, theta)
    k = _rope(k.view(bsz, sq, kv_heads, head_dim), positions, theta)
    v = v.view(bsz, sq, kv_heads, head_dim)
    return q, k, v


def _attn_out_mlp(x, q, k_cache, v_cache, page_table, cache_seqlens, wo, mlp_norm, w_gate_up, w_down):
    """A layer's second half after the KV write (one rank, paged_decode): attention through the page table,
    o_proj, the residual, the SwiGLU MLP and its residual."""
    bsz, sq = x.shape[0], x.shape[1]
    o = torch.ops.syncfree.paged_decode(q, k_cache, v_cache, page_table, cache_seqlens)
    x = x + o.reshape(bsz, sq, -1) @ wo.t()
    gate, up = (_rms_norm(x, mlp_norm) @ w_gate_up.t()).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ w_down.t()


# The same two functions as compiled regions. Module-level and fed only tensors and per-model constants (the
# weights are arguments, the layer index stays outside), so every layer's call matches the first one's and
# Dynamo traces each body once: two subgraphs, 2 x layers invoke_subgraph calls. In eager they are plain calls.
attn_in_region = torch.compiler.nested_compile_region(_attn_in)
attn_out_mlp_region = torch.compiler.nested_compile_region(_attn_out_mlp)


class TinyLlama(torch.nn.Module):
    """With tp_size > 1 this is one rank's shard (Megatron-style tensor parallelism): the rank holds
    heads / tp_size query heads and kv_heads / tp_size KV heads (QKV column-parallel, o_proj row-parallel), and
    intermediate / tp_size of the MLP (gate/up column-parallel, down row-parallel); embedding, norms and lm_head
    are replicated. The row-parallel outputs are summed with a functional all_reduce, which Dynamo traces into
    the graph. Every rank draws the full weights from the same seed and keeps its slice, so tp_size=1 is the
    whole model, with the same numbers."""

    def __init__(self, config: TinyLlamaConfig, device="cpu", seed: int = 0, tp_rank: int = 0, tp_size: int = 1,
                 tp_group=None):
        super().__init__()
        self.config = c = config
        for name, total in (("heads", c.heads), ("kv_heads", c.kv_heads), ("intermediate", c.intermediate)):
            if tp_size < 1 or total % tp_size:
                raise ValueError(f"config.{name}={total} must divide evenly over tp_size={tp_size}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        if c.regional and (tp_size != 1 or c.attention != "paged_decode"):
            raise ValueError(f"config.regional=True needs tp_size=1 and attention='paged_decode', got "
                             f"tp_size={tp_size}, attention={c.attention!r}")
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.local_heads, self.local_kv_heads = c.heads // tp_size, c.kv_heads // tp_size
        self.local_intermediate = c.intermediate // tp_size
        gen = torch.Generator(device=device).manual_seed(seed)

        def w(*shape, scale=None):
            scale = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
            data = torch.randn(*shape, generator=gen, device=device) * scale
            return torch.nn.Parameter(data.to(c.dtype), requires_grad=False)

        def ones():
            return torch.nn.Parameter(torch.ones(c.hidden, device=device, dtype=c.dtype), requires_grad=False)

        self.embed = w(c.vocab, c.hidden, scale=1.0)
        self.layers = torch.nn.ModuleList()
        def rows(t, *sizes):
            """This rank's slice of each block of rows (sizes: the blocks, each split over the ranks)."""
            parts, start = [], 0
            for size in sizes:
                per = size // tp_size
                parts.append(t[start + tp_rank * per: start + (tp_rank + 1) * per])
                start += size
            return torch.nn.Parameter(torch.cat(parts).contiguous(), requires_grad=False)

        def cols(t):
            per = t.shape[1] // tp_size
            return torch.nn.Parameter(t[:, tp_rank * per: (tp_rank + 1) * per].contiguous(), requires_grad=False)

        q_rows, kv_rows = c.heads * c.head_dim, c.kv_heads * c.head_dim
        for _ in range(c.layers):
            layer = torch.nn.Module()
            layer.attn_norm = ones()
            layer.wqkv = rows(w(q_rows + 2 * kv_rows, c.hidden), q_rows, kv_rows, kv_rows)
            layer.wo = cols(w(c.hidden, q_rows))
            layer.mlp_norm = ones()
            layer.w_gate_up = rows(w(2 * c.intermediate, c.hidden), c.intermediate, c.intermediate)
            layer.w_down = cols(w(c.hidden, c.intermediate))
            self.layers.append(layer)
        self.final_norm = torch.nn.Parameter(torch.ones(c.hidden, device=device, dtype=c.dtype), requires_grad=False)
        self.lm_head = w(c.vocab, c.hidden)

    def new_kv_pool(self, device="cpu", per_layer: bool = False):
        """The KV pool: two [layers, num_pages, page_size, Hkv, D] tensors, or with per_layer=True two lists of
        one [1, num_pages, page_size, Hkv, D] tensor per layer, as SGLang keeps a buffer per layer. Why per layer: a
        compiled region's body (the user's nested_compile_region, or the backend's outline_repeats) is shared by the
        calls whose inputs have the same metadata, and the storage offset counts, so the views `k_pool[i]` of one
        stacked pool make a body per layer (each lowered by Inductor again); per-layer tensors all start at offset
        0."""
        c = self.config
        layers = 1 if per_layer else c.layers
        shape = (layers, c.num_pages, c.page_size, self.local_kv_heads, c.head_dim)

        def pool():
            return torch.zeros(shape, device=device, dtype=c.dtype)

        if per_layer:
            return [pool() for _ in range(c.layers)], [pool() for _ in range(c.layers)]
        return pool(), pool()

    # -- the attention-metadata step, engine style ------------------------------------------------------
    def attention_metadata(self, fb: ForwardBatch):
        ps = self.config.page_size
        if self.config.metadata == "sglang":
            max_len = fb.seq_lens_cpu.max().item()  # the host mirror: a sync where the engine published it
            page_table = fb.req_to_token[fb.req_pool_indices, :max_len]
            if ps > 1:
                strided_indices = torch.arange(0, page_table.shape[1], ps, device=page_table.device)
                page_table = page_table[:, strided_indices] // ps
            return page_table.to(torch.int32), fb.seq_lens.to(torch.int32), max_len
        max_len = fb.seq_lens.max().item()  # host sync: what the pass removes
        page_table = fb.req_to_token[fb.req_pool_indices, :max_len:ps] // ps
        return page_table.to(torch.int32), fb.seq_lens.to(torch.int32), max_len

    def attend(self, q, k_cache, v_cache, page_table, cache_seqlens, max_len):
        c = self.config
        if c.attention == "paged_decode":
            return torch.ops.syncfree.paged_decode(q, k_cache, v_cache, page_table, cache_seqlens)
        if c.attention == "fa4":
            return torch.ops.syncfree.fa4_paged(q, k_cache, v_cache, page_table, cache_seqlens,
                                                max_seqlen_k=max_len, causal=True)
        if c.attention == "fa_kvcache":
            return torch.ops.syncfree.fa_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table,
                                                      max_seqlen_k=max_len, causal=True)
        raise ValueError(f"attention must be paged_decode, fa4 or fa_kvcache, got {c.attention!r}")

    def all_reduce(self, x):
        """Sum a row-parallel partial result over the ranks (a no-op for one rank)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.tp_group if self.tp_group is not None else dist.group.WORLD)

    def attend_cold(self, q, k_cache, v_cache, fb: ForwardBatch):
        """Extend/tree-verify style cold path: a dense gather sized by a host max. Not self-guarding."""
        c = self.config
        if fb.seq_lens_cpu is not None:
            max_len = fb.seq_lens_cpu.max().item()  # an already published host value: no device sync
        else:
            max_len = c.max_context_len
        slots = fb.req_to_token[fb.req_pool_indices, :max_len].to(torch.int64)  # [B, T]
        torch._check(slots.shape[1] > 0)  # lets the compiler trace a width it cannot see (unbacked)
        k = k_cache.view(-1, self.local_kv_heads, c.head_dim)[slots]  # [B, T, Hkv, D]
        v = v_cache.view(-1, self.local_kv_heads, c.head_dim)[slots]
        sq = q.shape[1]
        t = torch.arange(slots.shape[1], device=q.device)  # the gathered width, not max_len: one symbol
        pos = fb.seq_lens[:, None] - sq + torch.arange(sq, device=q.device)[None, :]
        mask = t[None, None, :] <= pos[:, :, None]  # [B, Sq, T]
        group = c.heads // c.kv_heads
        k = k.repeat_interleave(group, dim=2).transpose(1, 2)
        v = v.repeat_interleave(group, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
        return out.transpose(1, 2)

    def static_metadata(self, fb: ForwardBatch, page_buffer: torch.Tensor):
        """What engines write by hand: a static-width table filled on the device, no host read."""
        torch.ops.syncfree.page_table_(page_buffer, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                       self.config.page_size)
        return page_buffer[: fb.seq_lens.shape[0]], fb.seq_lens.to(torch.int32), self.config.max_context_len

    def forward(self, fb: ForwardBatch, k_pool: torch.Tensor, v_pool: torch.Tensor, cold: bool = False,
                page_buffer: torch.Tensor | None = None):
        c = self.config
        x = self.embed[fb.input_ids]  # [B, Sq, hidden]
        bsz, sq = fb.input_ids.shape
        if page_buffer is not None:
            page_table, cache_seqlens, max_len = self.static_metadata(fb, page_buffer)
        elif not cold:
            page_table, cache_seqlens, max_len = self.attention_metadata(fb)
        loc = fb.out_cache_loc.reshape(-1)
        if c.regional:
            if cold:
                raise ValueError("config.regional=True runs the paged decode step only (cold=False)")
            return self.regional_layers(x, fb, k_pool, v_pool, loc, page_table, cache_seqlens)
        stacked = isinstance(k_pool, torch.Tensor)  # else new_kv_pool(per_layer=True): a tensor per layer
        for i, layer in enumerate(self.layers):
            q, k, v = _attn_in(x, layer.attn_norm, layer.wqkv, fb.positions, self.local_heads, self.local_kv_heads,
                               c.head_dim, c.rope_theta)
            k_cache, v_cache = self.write_kv(k_pool, v_pool, i, loc, k, v, stacked)
            if cold:
                o = self.attend_cold(q, k_cache, v_cache, fb)
            else:
                o = self.attend(q, k_cache, v_cache, page_table, cache_seqlens, max_len)
            x = x + self.all_reduce(o.reshape(bsz, sq, -1) @ layer.wo.t())
            gate, up = (_rms_norm(x, layer.mlp_norm) @ layer.w_gate_up.t()).chunk(2, dim=-1)
            x = x + self.all_reduce((F.silu(gate) * up) @ layer.w_down.t())
        return _rms_norm(x, self.final_norm) @ self.lm_head.t()  # logits [B, Sq, vocab]

    @staticmethod
    def write_kv(k_pool, v_pool, i: int, loc, k, v, stacked: bool):
        """Layer i's KV write, and that layer's [num_pages, page_size, Hkv, D] caches: a stacked pool or a list of
        one tensor per layer."""
        if stacked:
            torch.ops.syncfree.store_kv(k_pool, v_pool, i, loc, k, v)
            return k_pool[i], v_pool[i]
        torch.ops.syncfree.store_kv(k_pool[i], v_pool[i], 0, loc, k, v)
        return k_pool[i][0], v_pool[i][0]

    def regional_layers(self, x, fb, k_pool, v_pool, loc, page_table, cache_seqlens):
        """config.regional: the same layers (the same ops, in the same order) as two compiled regions each, the
        KV write between them."""
        c = self.config
        stacked = isinstance(k_pool, torch.Tensor)  # else new_kv_pool(per_layer=True): a tensor per layer
        for i, layer in enumerate(self.layers):
            q, k, v = attn_in_region(x, layer.attn_norm, layer.wqkv, fb.positions, self.local_heads,
                                     self.local_kv_heads, c.head_dim, c.rope_theta)
            k_cache, v_cache = self.write_kv(k_pool, v_pool, i, loc, k, v, stacked)
            x = attn_out_mlp_region(x, q, k_cache, v_cache, page_table, cache_seqlens, layer.wo, layer.mlp_norm,
                                    layer.w_gate_up, layer.w_down)
        return _rms_norm(x, self.final_norm) @ self.lm_head.t()


def make_batch(config: TinyLlamaConfig, lengths: list[int], draft: int = 1, device="cpu", seed: int = 0,
               with_cpu_mirror: bool = True) -> ForwardBatch:
    """A batch whose requests already hold `lengths[b] - draft` tokens and append `draft` new ones.

    Each request owns whole pages, scattered through the pool, so page ids differ from request order.
    """
    c = config
    gen = torch.Generator().manual_seed(seed)
    bsz = len(lengths)
    pages_per_req = -(-c.max_context_len // c.page_size)
    if bsz * pages_per_req > c.num_pages or bsz > c.max_requests:
        raise ValueError(f"{bsz} requests of {c.max_context_len} tokens do not fit the pool's {c.num_pages} pages")
    if max(lengths) > c.max_context_len:
        raise ValueError(f"a length exceeds max_context_len={c.max_context_len}")
    page_order = torch.randperm(c.num_pages, generator=gen)[: bsz * pages_per_req].view(bsz, pages_per_req)
    req_ids = torch.randperm(c.max_requests, generator=gen)[:bsz]
    req_to_token = torch.zeros(c.max_requests, c.max_context_len, dtype=torch.int32)
    tok = torch.arange(c.max_context_len)
    for b in range(bsz):
        req_to_token[req_ids[b]] = (page_order[b][tok // c.page_size] * c.page_size + tok % c.page_size).int()
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    positions = seq_lens[:, None] - draft + torch.arange(draft)[None, :]
    out_cache_loc = torch.stack([req_to_token[req_ids[b], positions[b]] for b in range(bsz)]).to(torch.int64)
    input_ids = torch.randint(0, c.vocab, (bsz, draft), generator=gen)
    to = dict(device=device)
    return ForwardBatch(
        input_ids=input_ids.to(**to), positions=positions.to(**to), out_cache_loc=out_cache_loc.to(**to),
        req_to_token=req_to_token.to(**to), req_pool_indices=req_ids.to(**to), seq_lens=seq_lens.to(**to),
        seq_lens_cpu=seq_lens.clone() if with_cpu_mirror else None,
    )


def decode_example(cold: bool = False, draft: int = 1):
    """(fn, example_args) for syncfree-inspect: one decode step of the tiny model on CPU."""
    config = TinyLlamaConfig()
    model = TinyLlama(config)
    k_pool, v_pool = model.new_kv_pool()
    batch = make_batch(config, [5, 17, 9], draft=draft)

    def step(fb, k_pool, v_pool):
        return model(fb, k_pool, v_pool, cold=cold)

    return step, (batch, k_pool, v_pool)


BUILTIN_EXAMPLES = {
    "decode": ("one decode step (Sq=1) of the tiny Llama; the max is rewritten", lambda: decode_example()),
    "verify": ("target-verify (Sq=3 draft tokens); the max is rewritten", lambda: decode_example(draft=3)),
    "extend_cold": ("a cold path with a dense gather: the host max is kept and reported",
                    lambda: decode_example(cold=True, draft=2)),
}
