"""Drive SGLang 0.5.23's own FlashAttentionBackend (installed from PyPI, unmodified) on CPU.

What is ours (tests/sglang/): the CPU stand-ins for the native kernels (standins/sgl_kernel, following the
sglang-kernel 0.4.10 op schemas), import-time placeholders for packages the backends never use
(placeholders.py), a small fake ModelRunner carrying what FlashAttentionBackend.__init__ reads, and the step
functions. What is SGLang's: FlashAttentionBackend, FlashAttentionMetadata, ForwardBatch/ForwardMode,
ReqToTokenPool, MHATokenToKVPool, RadixAttention (as the layer description), the runtime context and the
server-args override, the FA3 dispatcher (sglang.kernels.ops.attention.flash_attention[_v3]).

Two documented patches, both applied by `setup()`:
  * `flash_attention_v3._is_fa3_supported` asks CUDA for an sm80/sm90 device; on CPU it is False and SGLang
    raises before reaching the kernel. The harness replaces it with `lambda *a, **k: True`.
  * `SGLANG_USE_SGL_FA3_KERNEL=1`, so `_load_fa3_kernels` takes the sgl_kernel wrappers instead of asking the
    Hugging Face kernel hub (no network, and PyPI's `kernels` is not installed).
On a CUDA machine (`setup(device="cuda")`, benchmarks/sglang_fa3_gpu.py), one more:
  * `memory_pool.can_use_store_cache` -> False: on CUDA, MHATokenToKVPool.set_kv_buffer would JIT-build SGLang's
    store_cache kernel (sglang.kernels.jit, tvm_ffi); the patch makes it take its own plain indexed-write
    fallback (`k_cache[loc] = k`), which it uses wherever that kernel does not apply.
  and the packages that placeholders.py stands in for may be installed for real there (torchvision and aiohttp
  are, on the H200 image): the real ones are used, placeholders only for the others.
SGLang's `build_ragged_target_verify_geometry` returns a msgspec.Struct: through compile_pass.compile Dynamo
traces it as the plain container it is (issue 30), so the ragged verify needs no shim.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import sys
from types import SimpleNamespace
from typing import Callable

import torch

HERE = pathlib.Path(__file__).resolve().parent
STANDINS = HERE / "standins"

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 16, 32
MAX_CONTEXT = 256  # model_config.context_len: SGLang's max_context_len, the static bound handed to the pass
MAX_REQUESTS = 6
LAYERS = 2

_SETUP = {}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """An engine's sizes. `max_context` is model_config.context_len: SGLang's max_context_len, the static bound
    handed to the pass. `max_requests` is the token table's rows (the largest batch). `pool_tokens`: None (every
    request owns a whole row's pages, max_context tokens each, in a pool of (max_requests + 1) * max_context
    tokens: the suite's default), or the KV pool's size in tokens, each request then owning only the pages its
    length needs (`make_batch` raises where a batch needs more): what keeps realistic bounds cheap, with the
    attention dimensions small (`Sizes.realistic`). DEFAULT is the suite's 256-token engine."""

    max_context: int = MAX_CONTEXT
    max_requests: int = MAX_REQUESTS
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    hidden: int = HIDDEN
    layers: int = LAYERS
    pool_tokens: int | None = None

    @classmethod
    def realistic(cls, max_context: int, max_requests: int = 64, pool_tokens: int | None = None, **kw):
        """A bound such as 131072, cheap on CPU: one KV head of dimension 4, one layer, and a KV pool of
        `pool_tokens` (default: four rows at the bound) shared by up to `max_requests` requests, each owning only
        the pages its length needs."""
        kw = dict(heads=2, kv_heads=1, head_dim=4, hidden=8, layers=1) | kw
        return cls(max_context=max_context, max_requests=max_requests, pool_tokens=pool_tokens or 4 * max_context,
                   **kw)

    @property
    def kv_pool_size(self) -> int:
        if self.pool_tokens is None:
            return (self.max_requests + 1) * self.max_context
        return self.pool_tokens


DEFAULT = Sizes()
ROOM = 8  # tokens a row may write past its length in one step (the most draft tokens of any path: dflash's 8)


def fill_token_table(req_to_token, lengths, page_size: int, sizes: Sizes, rng: random.Random):
    """Writes the token table's rows for one batch into SGLang's `req_to_token` (in place) and returns (the table
    on the CPU, the batch's request rows). Each request owns whole pages scattered through the pool (page ids differ
    from request order); page 0 holds slot 0, SGLang's padding slot. With `sizes.pool_tokens` None, every request
    row is rebuilt, max_context tokens of pages each (the suite's default, unchanged); else each request of the
    batch gets the pages of min(length + ROOM, max_context) tokens, distinct across the batch; its other columns
    keep what an earlier batch wrote there (never read: kernels read a row up to its length)."""
    ps, batch = page_size, len(lengths)
    if sizes.pool_tokens is None:
        pages_per_req = sizes.max_context // ps
        total_pages = (sizes.max_requests + 1) * sizes.max_context // ps
        page_ids = list(range(1, total_pages))
        rng.shuffle(page_ids)
        r2t = torch.zeros(req_to_token.shape, dtype=req_to_token.dtype)  # built on the CPU, copied below
        rows = rng.sample(range(1, sizes.max_requests + 1), batch)
        for n, r in enumerate(rows):
            mine = torch.tensor(page_ids[n * pages_per_req:(n + 1) * pages_per_req], dtype=torch.int64)
            t = torch.arange(sizes.max_context)
            r2t[r] = (mine[t // ps] * ps + t % ps).to(torch.int32)
        req_to_token.copy_(r2t)
        return r2t, rows
    if req_to_token.device.type != "cpu":
        raise NotImplementedError("a compact pool (Sizes.pool_tokens) is built on CPU engines only")
    need = [-(-min(max(int(x), 0) + ROOM, sizes.max_context) // ps) for x in lengths]
    total_pages = sizes.pool_tokens // ps
    if sum(need) > total_pages - 1:
        raise ValueError(f"lengths {list(lengths)} need {sum(need)} pages of {ps}; the pool has {total_pages - 1}")
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    page_ids = torch.randperm(total_pages - 1, generator=gen)[:sum(need)] + 1
    rows = rng.sample(range(1, sizes.max_requests + 1), batch)
    start = 0
    for r, n in zip(rows, need):  # past its pages a row keeps what earlier batches left there, as SGLang's does
        t = torch.arange(n * ps)
        req_to_token[r, :n * ps] = (page_ids[start:start + n][t // ps] * ps + t % ps).to(req_to_token.dtype)
        start += n
    return req_to_token, rows


def sglang_available() -> str | None:
    """None when SGLang 0.5.23 is importable, else why not (the tests skip with it)."""
    try:
        import importlib.metadata as md

        version = md.version("sglang")
    except Exception as e:  # noqa: BLE001
        return f"sglang is not installed ({e}); `make sglang-deps` installs it"
    if version != "0.5.23":
        return f"sglang {version} is installed, the harness is written for 0.5.23"
    return None


def setup(device: str = "cpu"):
    """Idempotent: stand-ins on sys.path, placeholders, the two patches, SGLang's single-rank runtime context.
    `device="cuda"` (the first call decides): the CUDA patch above, and real packages where placeholders.py has
    stand-ins for them."""
    if _SETUP:
        return _SETUP["modules"]
    cuda = str(device).startswith("cuda")
    os.environ.setdefault("SGLANG_USE_SGL_FA3_KERNEL", "1")
    if str(STANDINS) not in sys.path:
        sys.path.insert(0, str(STANDINS))
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import placeholders

    placeholders.install(allow_installed=cuda)
    import sgl_kernel  # the stand-in

    if not str(getattr(sgl_kernel, "__file__", "")).startswith(str(STANDINS)):
        raise RuntimeError(f"sgl_kernel resolved to {sgl_kernel.__file__}, not the CPU stand-in")

    from sglang.kernels.ops.attention import flash_attention_v3
    from sglang.srt.layers.attention import flashattention_backend as fab
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.speculative import ragged_verify
    from sglang.srt.configs.model_config import AttentionArch

    flash_attention_v3._is_fa3_supported = lambda *a, **k: True  # patch 1 (documented above)
    if cuda:
        from sglang.srt.mem_cache import memory_pool

        memory_pool.can_use_store_cache = lambda *a, **k: False  # the CUDA patch (documented above)
    get_parallel().override(attn_tp_size=1, attn_dcp_rank=0).__enter__()  # single rank, no torch.distributed
    modules = SimpleNamespace(fab=fab, fa3=flash_attention_v3, RadixAttention=RadixAttention,
                              MHATokenToKVPool=MHATokenToKVPool, ReqToTokenPool=ReqToTokenPool,
                              ForwardBatch=ForwardBatch, ForwardMode=ForwardMode, get_context=get_context,
                              ragged_verify=ragged_verify, AttentionArch=AttentionArch)
    _SETUP["modules"] = modules
    _SETUP["override"] = None
    _SETUP["device"] = device
    return modules


def install_server_args(**fields):
    """Publish a dummy ServerArgs with `fields` (SGLang's own override_server_args), replacing the previous one."""
    m = setup()
    if _SETUP["override"] is not None:
        _SETUP["override"].restore()
    base = dict(attention_backend="fa3", chunked_prefill_size=-1, disable_radix_cache=False, dp_size=1,
                enable_deterministic_inference=False, is_embedding=False, kv_cache_dtype="auto", pp_size=1,
                tp_size=1, speculative_algorithm=None, speculative_eagle_topk=0, speculative_num_draft_tokens=0,
                speculative_num_steps=0)
    base.update(fields)
    override = m.get_context().override_server_args(**base)
    override.install()
    _SETUP["override"] = override
    return override


# ------------------------------------------------------------------------------------------ the fake ModelRunner
class TinyModelConfig:
    """What FlashAttentionBackend.__init__ reads from model_runner.model_config."""

    def __init__(self, arch, sizes: Sizes = DEFAULT):
        self.attention_arch = arch
        self.context_len = sizes.max_context
        self.hidden_size = sizes.hidden
        self.num_attention_heads = sizes.heads
        self.num_key_value_heads = sizes.kv_heads
        self.head_dim = sizes.head_dim
        self.v_head_dim = sizes.head_dim
        self.is_encoder_decoder = False
        self.is_local_attention_model = False
        self.attention_chunk_size = None
        self.hf_text_config = SimpleNamespace(num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads)
        self.hf_config = self.hf_text_config

    def get_num_kv_heads(self, tp_size: int, dcp_size: int = 1) -> int:
        return self.num_key_value_heads // max(1, tp_size // dcp_size)


class FakeModelRunner:
    """The attributes FlashAttentionBackend reads; the pools are SGLang's own (ReqToTokenPool, MHATokenToKVPool)."""

    def __init__(self, page_size: int, is_draft_worker: bool = False, device: str = "cpu", sizes: Sizes = DEFAULT):
        m = setup()
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        self.device = device
        self.page_size = page_size
        self.dtype = self.kv_cache_dtype = torch.float32
        self.kv_cache_dtype_str = "auto"
        self.model_config = TinyModelConfig(m.AttentionArch.MHA, sizes)
        self.sliding_window_size = None
        self.attention_chunk_size = None
        self.is_draft_worker = is_draft_worker
        self.req_to_token_pool = m.ReqToTokenPool(size=sizes.max_requests, max_context_len=sizes.max_context,
                                                  device=device, enable_memory_saver=False)
        self.token_to_kv_pool = m.MHATokenToKVPool(
            size=sizes.kv_pool_size + page_size, page_size=page_size, dtype=torch.float32,
            head_num=sizes.kv_heads, head_dim=sizes.head_dim, layer_num=sizes.layers, device=device,
            enable_memory_saver=False, enable_alt_stream=False)
        self.token_to_kv_pool_allocator = SimpleNamespace(page_size=page_size,
                                                          get_kvcache=lambda: self.token_to_kv_pool)
        self.kv_index_translator = KVIndexTranslator(
            req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, token_to_kv_pool=self.token_to_kv_pool,
            page_size=page_size, device=device, is_draft_worker=is_draft_worker)


# ------------------------------------------------------------------------------------------ the paths
@dataclasses.dataclass(frozen=True)
class Path:
    name: str
    mode: str  # decode | draft_decode | target_verify | draft_extend | dflash_verify | ragged_verify
    page_size: int = 16
    spec: dict = dataclasses.field(default_factory=dict)  # server-args fields
    step_id: int = 0  # draft decode: speculative_step_id
    num_steps: int = 0  # draft decode: speculative_num_steps
    draft_tokens: int = 0  # verify / draft extend: tokens per request
    mirror: bool = True  # publish forward_batch.seq_lens_cpu (FA3's default decode path reads it)
    options: dict = dataclasses.field(default_factory=dict)  # backend options besides max_context_len

    @property
    def queries(self) -> int:
        return self.draft_tokens or 1


class Engine:
    """One FlashAttentionBackend over SGLang's pools, 2 layers of q/k/v/o projections, and the compiled step.
    `sizes`: the bound (max_context_len), the pools and the attention shapes (Sizes; DEFAULT: the suite's 256)."""

    def __init__(self, path: Path, seed: int = 0, device: str = "cpu", sizes: Sizes = DEFAULT):
        m = self.m = setup(device)
        self.path = path
        self.device = device
        self.sizes = z = sizes
        install_server_args(**path.spec)
        is_draft = path.mode in ("draft_decode", "draft_extend")
        self.runner = FakeModelRunner(path.page_size, is_draft_worker=is_draft, device=device, sizes=sizes)
        kwargs = {}
        if path.mode == "draft_decode":
            kwargs = dict(speculative_step_id=path.step_id, speculative_num_steps=path.num_steps)
        self.backend = m.fab.FlashAttentionBackend(self.runner, **kwargs)
        gen = torch.Generator().manual_seed(1000 + seed)
        self.layers = [m.RadixAttention(num_heads=z.heads, head_dim=z.head_dim, scaling=z.head_dim ** -0.5,
                                        num_kv_heads=z.kv_heads, layer_id=i) for i in range(z.layers)]
        self.w = [{n: torch.randn(z.hidden, o, generator=gen) / z.hidden ** 0.5
                   for n, o in (("q", z.heads * z.head_dim), ("k", z.kv_heads * z.head_dim),
                                ("v", z.kv_heads * z.head_dim))}
                  | {"o": torch.randn(z.heads * z.head_dim, z.hidden, generator=gen) / z.hidden ** 0.5}
                  for _ in range(z.layers)]
        self.w = [{n: t.to(device) for n, t in w.items()} for w in self.w]
        self._fill_pool(gen)

    @property
    def max_context(self) -> int:
        return self.sizes.max_context

    def _fill_pool(self, gen):
        pool = self.runner.token_to_kv_pool
        for i in range(self.sizes.layers):
            k, v = pool.get_kv_buffer(i)
            k.copy_(torch.randn(k.shape, generator=gen))  # drawn on the CPU, the same values on any device
            v.copy_(torch.randn(v.shape, generator=gen))

    # -- the function that is compiled: SGLang's metadata builder, then each layer's attention
    def step(self, fb, hidden):
        backend = self.backend
        backend.init_forward_metadata(fb)
        h = hidden
        extend = not fb.forward_mode.is_decode_or_idle()
        for layer, w in zip(self.layers, self.w):
            # as RadixAttention.forward hands them over: q [T, H*D], k/v [T, Hk, D]
            q = h @ w["q"]
            k = (h @ w["k"]).view(-1, self.sizes.kv_heads, self.sizes.head_dim)
            v = (h @ w["v"]).view(-1, self.sizes.kv_heads, self.sizes.head_dim)
            if extend:
                o = backend.forward_extend(q, k, v, layer, fb)
            else:
                o = backend.forward_decode(q, k, v, layer, fb)
            h = h + o.view(h.shape[0], -1) @ w["o"]
        return h

    # -- a batch for one length vector
    def make_batch(self, lengths, seed: int = 0):
        """`lengths`: per request, the tokens in the cache before this step's new ones (decode: including the
        new token, as SGLang counts them)."""
        m, path, ps = self.m, self.path, self.path.page_size
        rng = random.Random(seed)
        batch = len(lengths)
        q_per_req = path.queries
        dev = self.device
        r2t_dev = self.runner.req_to_token_pool.req_to_token
        r2t, rows = fill_token_table(r2t_dev, lengths, ps, self.sizes, rng)
        rpi = torch.tensor(rows, dtype=torch.int64)
        seq = torch.tensor(lengths, dtype=torch.int64)
        mode = path.mode
        if mode in ("decode", "draft_decode"):
            fm = m.ForwardMode.DECODE
            positions = seq - 1
            out_loc = r2t[rpi, positions].to(torch.int64)
            tokens = batch
            if mode == "draft_decode":  # this draft step's token sits after seq_lens + step_id
                positions = seq + path.step_id
                out_loc = r2t[rpi, positions].to(torch.int64)
        elif mode == "draft_extend":  # the lengths already count the extended tokens
            fm = m.ForwardMode.DRAFT_EXTEND_V2
            pos = torch.stack([seq - q_per_req + j for j in range(q_per_req)], 1)
            positions = pos.reshape(-1)
            out_loc = r2t[rpi.repeat_interleave(q_per_req), positions].to(torch.int64)
            tokens = batch * q_per_req
        elif mode == "ragged_verify":  # row b verifies verify_lens[b] <= draft_tokens tokens after seq_lens
            fm = m.ForwardMode.TARGET_VERIFY
            verify = [rng.randint(1, q_per_req) for _ in range(batch)]
            positions = torch.cat([seq[b] + torch.arange(verify[b]) for b in range(batch)])
            out_loc = r2t[rpi.repeat_interleave(torch.tensor(verify)), positions].to(torch.int64)
            tokens = sum(verify)
        else:  # verify: the draft tokens go after seq_lens
            fm = m.ForwardMode.TARGET_VERIFY
            pos = torch.stack([seq + j for j in range(q_per_req)], 1)
            positions = pos.reshape(-1)
            out_loc = r2t[rpi.repeat_interleave(q_per_req), positions].to(torch.int64)
            tokens = batch * q_per_req
        fb = m.ForwardBatch(
            forward_mode=fm, batch_size=batch, input_ids=torch.zeros(tokens, dtype=torch.int64, device=dev),
            req_pool_indices=rpi.to(dev), seq_lens=seq.to(dev), out_cache_loc=out_loc.to(dev),
            seq_lens_sum=int(seq.sum()), seq_lens_cpu=seq.clone() if path.mirror else None,
            positions=positions.to(dev))
        self.runner.kv_index_translator.bind_own_plan(fb)
        fb.spec_info = self._spec_info(fb, batch, verify if mode == "ragged_verify" else None)
        if mode == "draft_extend":
            fb.extend_seq_lens = torch.full((batch,), q_per_req, dtype=torch.int32, device=self.device)
            fb.extend_seq_lens_cpu = [q_per_req] * batch
            fb.extend_prefix_lens = (seq - q_per_req).to(torch.int32).to(self.device)
            fb.extend_prefix_lens_cpu = [int(x) - q_per_req for x in lengths]
            fb.extend_num_tokens = tokens
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(tokens, self.sizes.hidden, generator=gen).to(dev)
        return fb, hidden

    def _spec_info(self, fb, batch, verify):
        mode = self.path.mode
        if mode == "decode":
            return None
        if mode == "ragged_verify":
            vl = torch.tensor(verify, dtype=torch.int64)
            qo = torch.nn.functional.pad(torch.cumsum(vl, 0), (1, 0))
            layout = self.m.ragged_verify.RaggedVerifyLayout(
                verify_lens=vl, graph_num_tokens=int(vl.sum()), extend_start_loc=qo[:-1],
                qo_indptr_device=qo)  # a device-only layout: no host lens, as on SGLang's GPU-only spec path
            return SimpleNamespace(ragged_verify_layout=layout)
        return SimpleNamespace(ragged_verify_layout=None)


def length_range(path: Path, max_context: int = MAX_CONTEXT) -> tuple[int, int]:
    """[low, top]: the committed lengths a step of this path takes at this bound (the rows the step writes past
    its length stay within the token table's max_context columns; a draft extend's lengths count its tokens)."""
    extra = path.queries if path.mode in ("target_verify", "dflash_verify", "ragged_verify") else 0
    extra = max(extra, path.step_id + 1 if path.mode == "draft_decode" else 0)
    low = path.queries if path.mode == "draft_extend" else 1
    return low, max_context - extra


def length_vectors(path: Path, count: int, batches=(3, 2, 4, 1), seed: int = 0, max_context: int = MAX_CONTEXT):
    """Length vectors over changing batch sizes; the first row of the first vector sits at the bound."""
    from passlib import length_vectors as vectors

    low, top = length_range(path, max_context)
    return vectors(batches, count, seed, top, low=low, edge=False, top_first=True)


# ------------------------------------------------------------------------------------------ running a path
def register_fwd_consumer():
    """The FA3 kernel's self-guarding fact, through the public API: row b of sgl_kernel::fwd reads
    ceil(seqused_k[b] / page_size) pages of page_table row b (page size = k's dim 1), nothing past them. It says
    nothing about scheduler_metadata (that is the rule the pass does not have yet)."""
    import compile_pass

    return compile_pass.register_self_guarding_consumer(
        "sgl_kernel::fwd", page_table="page_table", lengths="seqused_k", upper_bounds=("max_seqlen_k",),
        page_size_of=("k", 1))


@dataclasses.dataclass
class Outcome:
    errors: list  # max |compiled - eager| per length vector
    reports: list  # compile_pass.reports(fn)
    graphs: int
    status: str  # "rewritten" | "kept" | "graph_break" | "nothing"
    reasons: list
    graph_breaks: list  # Dynamo's graph-break reasons while compiling this path


def classify(reports) -> tuple[str, list]:
    import compile_pass

    if not reports:
        return "nothing", []
    merged = compile_pass.SyncReport.merge(reports)
    reasons = [i.reason for i in merged.kept]
    if merged.kept:
        return "kept", reasons
    return ("rewritten" if merged.rewritten else "nothing"), reasons


def run_path(path: Path, vectors: int = 3, seed: int = 0, sizes: Sizes = DEFAULT, **compile_kw) -> Outcome:
    """Compile Engine.step through compile_pass.compile, run it over changing lengths and batch sizes, compare
    each result with the same step run eagerly on an identical batch (same pools, same inputs)."""
    import compile_pass

    engine = Engine(path, seed=seed, sizes=sizes)
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    step = compile_pass.compile(engine.step, max_context_len=sizes.max_context, **path.options, **compile_kw)
    errors = []
    for n, lengths in enumerate(length_vectors(path, vectors, seed=seed, max_context=sizes.max_context)):
        fb, hidden = engine.make_batch(lengths, seed=n)
        want = engine.step(fb, hidden)
        fb, hidden = engine.make_batch(lengths, seed=n)
        got = step(fb, hidden)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{path.name} {lengths}: {m}")
        errors.append(float((got - want).abs().max()))
    reports = list(compile_pass.reports(step))
    breaks = [k for k, v in counters["graph_break"].items() if v > before.get(k, 0)]
    status, reasons = classify(reports)
    if breaks:  # the step is split: what each piece reports is in `reports`
        status = "graph_break"
    return Outcome(errors, reports, len(reports), status, reasons, breaks)
