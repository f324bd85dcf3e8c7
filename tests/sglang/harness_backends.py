"""Drive SGLang 0.5.23's TritonAttnBackend, FlashMLABackend and TRTLLMMLABackend (the PyPI wheel, unmodified) on CPU.

The same approach as harness.py (FA3): SGLang's backend, ForwardBatch/ForwardMode, ReqToTokenPool, the KV pools
(MHATokenToKVPool for Triton, MLATokenToKVPool for the MLA backends), KVIndexTranslator, RadixAttention and the
runtime context are SGLang's own; a fake ModelRunner carries what the backends' __init__ read; native kernels are
CPU stand-ins (standins/) with the real kernels' signatures and contracts.

What is patched, and why (all by `setup()`, in module namespaces; no SGLang file is modified):
  * the Triton kernels (standins/sglang_triton_ops.py): `decode_attention.decode_attention_fwd` and
    `extend_attention.extend_attention_fwd` (TritonAttnBackend imports them in __init__ and wraps them in
    torch.compiler.disable itself, so the unmodified backend still sees opaque kernels), and the launchers
    `create_flashinfer_kv_indices_triton` (kv_index_translator) and `create_flashmla_kv_indices_triton`
    (flashmla_backend, trtllm_mla_backend): a Triton launch cannot run on CPU tensors.
  * FlashMLA's kernels: the `flash_mla` package (the sgl-flash-mla wheel) is standins/flash_mla.
  * FlashInfer (standins/flashinfer_mla.py): SGLang imports it only where `is_flashinfer_available()`, i.e. on
    CUDA; FlashInferMLAAttnBackend.__init__ (the MLA backends' parent) constructs its wrappers by module-level
    name, and TRTLLMMLABackend calls `flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`. The stand-in
    wrappers are inert (never used on these paths: plan/run raise); the decode kernel is a stand-in op.
  * the MLA pool's row scatter `memory_pool.set_mla_kv_buffer_triton` (and its DCP variant, one rank here):
    `_set_mla_rows`, the kernel's contract in tensor ops (TRTLLMMLABackend writes through set_mla_kv_buffer).
  * `fixup_zero_kv._jit_fixup_module` (TRTLLMMLABackend.__init__ prebuilds a JIT kernel) -> a no-op.
  * the parallel state: `get_parallel().override_permanently(attn_tp_size=1, attn_dcp_rank=0)` (the scoped
    override in harness.setup is undone as soon as its context manager is garbage-collected; Triton reads
    attn_dcp_rank in __init__).

What a user does to get the kernels into one graph (`Path.kernels == "custom_op"`, the fix the report tables
recommend): the backend's torch.compiler.disable'd kernels `backend.decode_attention_fwd` /
`backend.extend_attention_fwd` are replaced by thin Python functions with the same signature that call a
torch.library.custom_op of the same contract (`register_user_ops()`: sglang_user::decode_attention_fwd, and
sglang_user::extend_attention (functional, returns the output) or sglang_user::extend_attention_fwd (in place,
`kernels == "custom_op_inplace"`), fake implementations registered). The unmodified paths
(`kernels == "sglang"`) run too, so both outcomes are shown.

What a user does instead with SGLang's own backend object (`Path.kernels == "registered"`, issue 30): register
the launchers that TritonAttnBackend wraps in torch.compiler.disable with compile_pass.register_disabled_launcher,
each with the schema of the op it is (`register_launchers()`); compile_pass.compile then traces each call as that
op. Nothing of the backend is replaced. KVIndexTranslator's `KVIndexTable(msgspec.Struct)` needs no shim: through
compile_pass.compile Dynamo traces a msgspec.Struct as the plain container it is.

MLA CUDA-graph state on CPU (`Path.replay=True`): FlashMLABackend.init_cuda_graph_state hard-codes
device="cuda" and asks torch.cuda for the SM count; `_cuda_graph_state_on_cpu` allocates the same buffers
(flashmla_backend.py, init_cuda_graph_state) on the CPU, with FlashMLA's 132-SM metadata size.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace
from typing import Optional

import torch

import harness as H

MAX_CONTEXT = H.MAX_CONTEXT  # 256
MAX_REQUESTS = H.MAX_REQUESTS
LAYERS = H.LAYERS
HIDDEN = H.HIDDEN
# Triton (MHA, GQA 2:1): the FA3 harness's shapes
HEADS, KV_HEADS, HEAD_DIM = H.HEADS, H.KV_HEADS, H.HEAD_DIM
# MLA (absorbed): the latent cache holds kv_lora_rank + qk_rope_head_dim per token, one KV head
KV_LORA_RANK, QK_ROPE, QK_NOPE, MLA_HEADS = 32, 16, 16, 4
MLA_HEAD_DIM = KV_LORA_RANK + QK_ROPE
MLA_PAGE = 64  # FlashMLA's PAGE_SIZE; TRTLLM-MLA pages of 64 too
FLASHMLA_SM_PARTS = 132


@dataclasses.dataclass(frozen=True)
class Sizes(H.Sizes):
    """harness.Sizes (the bound, the pools, the MHA shapes: Triton's) and the MLA shapes."""

    kv_lora_rank: int = KV_LORA_RANK
    qk_rope: int = QK_ROPE
    qk_nope: int = QK_NOPE
    mla_heads: int = MLA_HEADS

    @classmethod
    def realistic(cls, max_context: int, max_requests: int = 64, pool_tokens: int | None = None, **kw):
        kw = dict(kv_lora_rank=8, qk_rope=4, qk_nope=4, mla_heads=2) | kw
        return super().realistic(max_context, max_requests, pool_tokens, **kw)

    @property
    def mla_head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope


DEFAULT = Sizes()

_STATE: dict = {}


# ------------------------------------------------------------------------------------------------ setup
def setup():
    """Idempotent: harness.setup() (stand-ins on sys.path, placeholders, the runtime context), then the patches
    listed in the module docstring."""
    m = H.setup()
    if _STATE:
        return _STATE["m"]
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_tp_size=1, attn_dcp_rank=0)
    import flashinfer_mla
    import sglang_triton_ops as ops
    from sglang.kernels.ops.attention import decode_attention, extend_attention, fixup_zero_kv
    from sglang.srt.layers.attention import flashinfer_mla_backend, flashmla_backend, trtllm_mla_backend
    from sglang.srt.layers.attention import triton_backend
    from sglang.srt.mem_cache import kv_index_translator
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    decode_attention.decode_attention_fwd = ops.decode_attention_fwd
    extend_attention.extend_attention_fwd = ops.extend_attention_fwd
    kv_index_translator.create_flashinfer_kv_indices_triton = ops.create_flashinfer_kv_indices_triton
    flashmla_backend.create_flashmla_kv_indices_triton = ops.create_flashmla_kv_indices_triton
    trtllm_mla_backend.create_flashmla_kv_indices_triton = ops.create_flashmla_kv_indices_triton
    trtllm_mla_backend.pad_draft_extend_query_triton = ops.pad_draft_extend_query
    trtllm_mla_backend.unpad_draft_extend_output_triton = ops.unpad_draft_extend_output
    flashinfer_mla.install(flashinfer_mla_backend, trtllm_mla_backend)
    trtllm_mla_backend._jit_fixup_module = lambda *a, **k: None
    from sglang.srt.mem_cache import memory_pool

    memory_pool.set_mla_kv_buffer_triton = _set_mla_rows
    memory_pool.set_mla_kv_buffer_dcp_sharded_triton = _set_mla_rows  # one rank: the same rows
    fixup_zero_kv._jit_fixup_module = lambda *a, **k: None
    _STATE.update(m=m, kv_index_translator=kv_index_translator)
    m.triton_backend, m.flashmla_backend, m.trtllm_mla_backend = triton_backend, flashmla_backend, trtllm_mla_backend
    m.MLATokenToKVPool = MLATokenToKVPool
    m.ops = ops
    _STATE["m"] = m
    return m


# ------------------------------------------------------------------------------------------------ the user's ops
_USER_OPS: dict = {}


def register_user_ops():
    """What a user writes to get the Triton backend's kernels into the graph: the kernels as
    torch.library.custom_op (the same contracts as the kernels, standins/sglang_triton_ops.py), instead of
    torch.compiler.disable, with thin functions of the backend's call signatures to assign to
    backend.decode_attention_fwd / backend.extend_attention_fwd.

    Returns {"decode", "extend", "extend_inplace"} (those functions) and the ops {"decode_op", "extend_op",
    "extend_inplace_op"}. Two spellings of the extend op:
      sglang_user::extend_attention          functional: takes o_extend, returns it with row b's computed queries
                                             written (the rest as o_extend held them); the shim copies it into
                                             o_extend. The form to recommend: the pass can check what it returns.
      sglang_user::extend_attention_fwd      SGLang's own convention: writes o_extend in place, returns nothing.
    sglang_user::decode_attention_fwd writes o (and the split scratch) in place, like the kernel."""
    if _USER_OPS:
        return _USER_OPS
    import sglang_triton_ops as ops

    @torch.library.custom_op("sglang_user::decode_attention_fwd", mutates_args=("o", "attn_logits", "attn_lse"))
    def decode_op(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                  kv_indptr: torch.Tensor, kv_indices: torch.Tensor, attn_logits: torch.Tensor,
                  attn_lse: torch.Tensor, num_kv_splits: torch.Tensor, max_kv_splits: int, sm_scale: float,
                  k_scale: float, v_scale: float, logit_cap: float, page_size: int) -> None:
        ops.decode_attention_impl(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse,
                                  num_kv_splits, max_kv_splits, sm_scale, k_scale, v_scale, logit_cap, page_size)

    @decode_op.register_fake
    def _(*args, **kwargs):
        return None

    @torch.library.custom_op("sglang_user::extend_attention_fwd", mutates_args=("o_extend",))
    def extend_inplace_op(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                          o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                          qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                          custom_mask: Optional[torch.Tensor], is_causal: bool, mask_indptr: Optional[torch.Tensor],
                          max_len_extend: int, k_scale: float, v_scale: float, sm_scale: Optional[float],
                          logit_cap: float, skip_prefix_custom_mask: bool, sliding_window_size: int,
                          page_size: int) -> None:
        ops.extend_attention_impl(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                                  kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                                  sm_scale, logit_cap, skip_prefix_custom_mask, sliding_window_size, page_size)

    @extend_inplace_op.register_fake
    def _(*args, **kwargs):
        return None

    @torch.library.custom_op("sglang_user::extend_attention", mutates_args=())
    def extend_op(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor, o_extend: torch.Tensor,
                  k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, custom_mask: Optional[torch.Tensor], is_causal: bool,
                  mask_indptr: Optional[torch.Tensor], max_len_extend: int, k_scale: float, v_scale: float,
                  sm_scale: Optional[float], logit_cap: float, skip_prefix_custom_mask: bool,
                  sliding_window_size: int, page_size: int) -> torch.Tensor:
        out = o_extend.clone()
        ops.extend_attention_impl(q_extend, k_extend, v_extend, out, k_buffer, v_buffer, qo_indptr, kv_indptr,
                                  kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                                  sm_scale, logit_cap, skip_prefix_custom_mask, sliding_window_size, page_size)
        return out

    @extend_op.register_fake
    def _(q_extend, k_extend, v_extend, o_extend, *args, **kwargs):
        return torch.empty_like(o_extend)

    def decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits,
                             max_kv_splits, sm_scale, k_scale, v_scale, logit_cap=0.0, sinks=None,
                             xai_temperature_len=-1, has_mla=False, use_pdl=False, page_size=1, score_mod=None,
                             aux_tensors=None, enable_lean=None, lean_Mp=None, lean_Lp=None, lean_Op=None,
                             lean_locks=None, uneven_batch=None):
        if sinks is not None or score_mod is not None or aux_tensors is not None or xai_temperature_len != -1:
            raise NotImplementedError("sglang_user::decode_attention_fwd: sinks/score_mod/xai not covered")
        decode_op(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits,
                  max_kv_splits, sm_scale, k_scale, v_scale, logit_cap, page_size)

    def extend_shim(op, functional):
        def extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                                 kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                                 sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True, sliding_window_size=-1,
                                 sinks=None, window_kv_offsets=None, xai_temperature_len=-1, lse_extend=None,
                                 skip_prefix=False, skip_extend=False, page_size=1, score_mod=None,
                                 aux_tensors=None, extend_seq_lens_cpu=None, identity_kv_indices=False):
            if (sinks is not None or window_kv_offsets is not None or lse_extend is not None
                    or score_mod is not None or aux_tensors is not None or skip_prefix or skip_extend
                    or xai_temperature_len != -1):
                raise NotImplementedError("sglang_user extend attention: an option the op does not cover")
            # extend_seq_lens_cpu only sizes HIP's compact grid: the op does not take it
            out = op(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                     custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale, logit_cap,
                     skip_prefix_custom_mask, sliding_window_size, page_size)
            if functional:
                o_extend.copy_(out)

        return extend_attention_fwd

    _USER_OPS.update(decode=decode_attention_fwd, extend=extend_shim(extend_op, True),
                     extend_inplace=extend_shim(extend_inplace_op, False), decode_op=decode_op, extend_op=extend_op,
                     extend_inplace_op=extend_inplace_op)
    return _USER_OPS


DECODE_SCHEMA = ("(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor(a!) o, Tensor kv_indptr, Tensor kv_indices, "
                 "Tensor(b!) attn_logits, Tensor(c!) attn_lse, Tensor num_kv_splits, SymInt max_kv_splits, "
                 "float sm_scale, float k_scale, float v_scale, float logit_cap, bool has_mla, bool use_pdl, "
                 "SymInt page_size, bool? enable_lean, Tensor(d!)? lean_Mp, Tensor(e!)? lean_Lp, Tensor(f!)? lean_Op, "
                 "Tensor(g!)? lean_locks, Tensor? uneven_batch) -> ()")
EXTEND_SCHEMA = ("(Tensor q_extend, Tensor k_extend, Tensor v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
                 "Tensor v_buffer, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, Tensor? custom_mask, "
                 "bool is_causal, Tensor? mask_indptr, SymInt max_len_extend, float k_scale, float v_scale, "
                 "float? sm_scale, float logit_cap, bool skip_prefix_custom_mask, SymInt sliding_window_size, "
                 "SymInt page_size, SymInt[]? extend_seq_lens_cpu) -> ()")
_LAUNCHERS: dict = {}


def register_launchers():
    """What a user writes to get SGLang's own torch.compiler.disable'd kernel wrappers into the graph, with the
    backend unmodified: the launchers TritonAttnBackend.__init__ wraps (decode_attention.decode_attention_fwd,
    extend_attention.extend_attention_fwd; here the stand-ins that setup() put in those modules), registered
    with compile_pass.register_disabled_launcher and the schemas of the kernels (what each writes is
    `Tensor(a!)`). Every other parameter (sinks, score_mod, lean buffers, ...) must be at its default where
    the backend calls them. Returns {"decode_op", "extend_op"} (OpOverloadPackets)."""
    setup()
    import compile_pass
    from sglang.kernels.ops.attention import decode_attention, extend_attention

    for key, launcher, name, schema in (
            ("decode_op", decode_attention.decode_attention_fwd, "decode_attention_fwd", DECODE_SCHEMA),
            ("extend_op", extend_attention.extend_attention_fwd, "extend_attention_fwd", EXTEND_SCHEMA)):
        if key in _LAUNCHERS:  # the op is defined once per process; registering it again takes it as op=
            compile_pass.register_disabled_launcher(launcher, _LAUNCHERS[key])
        else:
            _LAUNCHERS[key] = compile_pass.register_disabled_launcher(launcher, name="sglang_launch::" + name,
                                                                      schema=schema)
    return dict(_LAUNCHERS)


def unregister_launchers():
    import compile_pass
    from sglang.kernels.ops.attention import decode_attention, extend_attention

    for launcher in (decode_attention.decode_attention_fwd, extend_attention.extend_attention_fwd):
        compile_pass.unregister_disabled_launcher(launcher)


# ------------------------------------------------------------------------------------------------ model runner
class BackendModelConfig:
    """What the three backends' __init__ read from model_runner.model_config."""

    def __init__(self, mla: bool, sizes: Sizes = DEFAULT):
        from transformers import PretrainedConfig

        m = setup()
        z = sizes
        self.attention_arch = m.AttentionArch.MLA if mla else m.AttentionArch.MHA
        self.context_len = z.max_context
        self.hidden_size = z.hidden
        heads = z.mla_heads if mla else z.heads
        self.num_attention_heads = heads
        self.num_key_value_heads = 1 if mla else z.kv_heads
        self.head_dim = z.mla_head_dim if mla else z.head_dim
        self.v_head_dim = z.kv_lora_rank if mla else z.head_dim
        self.swa_v_head_dim = None
        self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim = z.kv_lora_rank, z.qk_rope, z.qk_nope
        self.scaling = self.head_dim ** -0.5
        self.is_encoder_decoder = False
        self.is_local_attention_model = False
        self.attention_chunk_size = None
        self.linear_attn_registry_result = None
        self.hf_config = PretrainedConfig(num_attention_heads=heads, num_key_value_heads=self.num_key_value_heads,
                                          architectures=["DeepseekV3ForCausalLM" if mla else "LlamaForCausalLM"])
        self.hf_text_config = self.hf_config

    def get_num_kv_heads(self, tp_size: int, dcp_size: int = 1) -> int:
        return self.num_key_value_heads

    def get_max_num_attention_heads(self) -> int:
        return self.num_attention_heads


class BackendModelRunner:
    """The attributes the backends read; the pools and the index translator are SGLang's own."""

    def __init__(self, page_size: int, mla: bool, is_draft_worker: bool = False, draft_tokens: int = 0,
                 sizes: Sizes = DEFAULT):
        m = setup()
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.device = "cpu"
        self.gpu_id = 0
        self.page_size = page_size
        self.dtype = self.kv_cache_dtype = torch.float32
        self.kv_cache_dtype_str = "auto"
        self.model_config = BackendModelConfig(mla, sizes)
        self.sliding_window_size = None
        self.attention_chunk_size = None
        self.is_draft_worker = is_draft_worker
        self.max_running_requests = sizes.max_requests
        self.spec_algorithm = SpeculativeAlgorithm.EAGLE if draft_tokens else SpeculativeAlgorithm.NONE
        self._draft_tokens = draft_tokens
        self.req_to_token_pool = m.ReqToTokenPool(size=sizes.max_requests, max_context_len=sizes.max_context,
                                                  device="cpu", enable_memory_saver=False)
        size = sizes.kv_pool_size + page_size
        if mla:
            self.token_to_kv_pool = m.MLATokenToKVPool(
                size=size, page_size=page_size, dtype=torch.float32, kv_lora_rank=sizes.kv_lora_rank,
                qk_rope_head_dim=sizes.qk_rope, layer_num=sizes.layers, device="cpu", enable_memory_saver=False)
        else:
            self.token_to_kv_pool = m.MHATokenToKVPool(
                size=size, page_size=page_size, dtype=torch.float32, head_num=sizes.kv_heads,
                head_dim=sizes.head_dim, layer_num=sizes.layers, device="cpu", enable_memory_saver=False,
                enable_alt_stream=False)
        self.token_to_kv_pool_allocator = SimpleNamespace(page_size=page_size,
                                                          get_kvcache=lambda: self.token_to_kv_pool)
        self.kv_index_translator = KVIndexTranslator(
            req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, token_to_kv_pool=self.token_to_kv_pool,
            page_size=page_size, device="cpu", is_draft_worker=is_draft_worker)

    def decode_num_tokens_per_req(self, *, num_draft_tokens=None) -> int:
        """ModelRunner.decode_num_tokens_per_req for EAGLE (topk 1): the draft tokens, else 1."""
        return int(num_draft_tokens or self._draft_tokens or 1)


def _set_mla_rows(kv_buffer, loc, cache_k_nope, cache_k_rope, *, reserved_skip_index: int = 0):
    """sglang.kernels.ops.kvcache.mla_buffer.set_mla_kv_buffer_triton's contract on CPU (single rank): row loc[i]
    of the [slots, 1, kv_lora_rank + rope] buffer gets nope then rope; a loc equal to reserved_skip_index keeps
    its row. Pure tensor ops (Dynamo traces it; SGLang's own torch fallback masks with a data-dependent shape)."""
    rows = kv_buffer.view(kv_buffer.shape[0], -1)
    new = cache_k_nope.reshape(cache_k_nope.shape[0], -1)
    if cache_k_rope is not None and cache_k_rope.numel() > 0:
        new = torch.cat([new, cache_k_rope.reshape(cache_k_rope.shape[0], -1)], -1)
    loc = loc.to(torch.int64)
    old = rows[loc, :new.shape[-1]]
    rows[loc, :new.shape[-1]] = torch.where((loc == reserved_skip_index)[:, None], old, new.to(rows.dtype))


# ------------------------------------------------------------------------------------------------ paths
@dataclasses.dataclass(frozen=True)
class Path:
    name: str
    backend: str  # triton | flashmla | trtllm_mla
    mode: str  # decode | target_verify | draft_extend
    draft_tokens: int = 0
    # triton: "sglang" (the backend's torch.compiler.disable'd kernels) | "custom_op" (register_user_ops, the
    # functional extend op) | "custom_op_inplace" (the extend op writing o_extend in place, SGLang's convention)
    # | "registered" (the backend's own disabled wrappers, their launchers registered: register_launchers)
    kernels: str = "sglang"
    seq_lens_sum: bool = True  # publish forward_batch.seq_lens_sum (a host int the scheduler computes)
    host_lists: bool = True  # draft extend: publish extend_seq_lens_cpu / extend_prefix_lens_cpu
    mirror: bool = False  # publish forward_batch.seq_lens_cpu
    replay: bool = False  # MLA: init_forward_metadata_out_graph over the CUDA-graph buffers
    ragged: bool = False  # draft extend: per-row extend lengths in [1, draft_tokens] (else all draft_tokens)
    options: dict = dataclasses.field(default_factory=dict)
    inductor: bool = False  # True: compile_pass.compile (Inductor); False: the pass, then the graph as captured
    # torch.compile's `dynamic`: None (automatic dynamic: a second batch size compiles a dynamic graph), False
    # (one static graph per batch size, as a CUDA-graph runner captures one graph per batch size)
    dynamic: bool | None = None
    seed: int = 0
    page: int = 0  # the page size; 0: the backend's default here (MLA 64, Triton 1, the stand-ins' one)

    @property
    def mla(self) -> bool:
        return self.backend != "triton"

    @property
    def page_size(self) -> int:
        return self.page or (MLA_PAGE if self.mla else 1)


EAGLE = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=3,
             speculative_num_draft_tokens=4)


class Engine:
    """One backend over SGLang's pools, 2 layers of projections around its attention, and the step compiled.
    `sizes`: the bound (max_context_len), the pools and the attention shapes (Sizes; DEFAULT: the suite's 256)."""

    def __init__(self, path: Path, sizes: Sizes = DEFAULT):
        m = self.m = setup()
        self.path = path
        self.sizes = z = sizes
        spec = EAGLE if path.draft_tokens else {}
        H.install_server_args(attention_backend=path.backend, **spec)
        is_draft = path.mode == "draft_extend"
        self.runner = BackendModelRunner(path.page_size, path.mla, is_draft_worker=is_draft,
                                         draft_tokens=path.draft_tokens, sizes=sizes)
        if path.backend == "triton":
            self.backend = m.triton_backend.TritonAttnBackend(self.runner)
            if path.kernels in ("custom_op", "custom_op_inplace"):
                ops = register_user_ops()
                self.backend.decode_attention_fwd = ops["decode"]
                self.backend.extend_attention_fwd = ops["extend" if path.kernels == "custom_op" else "extend_inplace"]
        elif path.backend == "flashmla":
            self.backend = m.flashmla_backend.FlashMLABackend(self.runner, skip_prefill=True)
        elif path.backend == "trtllm_mla":
            self.backend = m.trtllm_mla_backend.TRTLLMMLABackend(self.runner, skip_prefill=True)
        else:
            raise ValueError(path.backend)
        if path.replay:
            self._cuda_graph_state_on_cpu()
        gen = torch.Generator().manual_seed(1000 + path.seed)
        if path.mla:
            d = z.mla_head_dim
            self.layers = [m.RadixAttention(num_heads=z.mla_heads, head_dim=d, scaling=d ** -0.5,
                                            num_kv_heads=1, layer_id=i, v_head_dim=z.kv_lora_rank)
                           for i in range(z.layers)]
            shapes = (("q", z.mla_heads * d), ("k", d), ("o", None))
            out = z.mla_heads * z.kv_lora_rank
        else:
            self.layers = [m.RadixAttention(num_heads=z.heads, head_dim=z.head_dim, scaling=z.head_dim ** -0.5,
                                            num_kv_heads=z.kv_heads, layer_id=i) for i in range(z.layers)]
            shapes = (("q", z.heads * z.head_dim), ("k", z.kv_heads * z.head_dim), ("v", z.kv_heads * z.head_dim),
                      ("o", None))
            out = z.heads * z.head_dim
        self.w = [{n: (torch.randn(z.hidden, o, generator=gen) / z.hidden ** 0.5 if o else
                       torch.randn(out, z.hidden, generator=gen) / out ** 0.5) for n, o in shapes}
                  for _ in range(z.layers)]
        pool = self.runner.token_to_kv_pool
        for i in range(z.layers):
            for buf in ((pool.get_key_buffer(i),) if path.mla else pool.get_kv_buffer(i)):
                buf.copy_(torch.randn(buf.shape, generator=gen))

    def _cuda_graph_state_on_cpu(self):
        """FlashMLABackend.init_cuda_graph_state's buffers (flashmla_backend.py), on the CPU: it hard-codes
        device="cuda" and reads the SM count from torch.cuda (here: FlashMLA's 132-part metadata)."""
        b = self.backend
        if self.path.backend != "flashmla":
            raise NotImplementedError("replay paths: FlashMLA only")
        max_bs = self.sizes.max_requests
        b.cuda_graph_kv_indices = torch.full((max_bs, (b.max_context_len + MLA_PAGE) // MLA_PAGE), 1,
                                             dtype=torch.int32)
        b.cuda_graph_mla_metadata = torch.empty((FLASHMLA_SM_PARTS, 8), dtype=torch.int32)
        b.cuda_graph_num_splits = torch.empty(max_bs + 1, dtype=torch.int32)
        b.cuda_graph_mla_metadata_view = None
        b.cuda_graph_num_splits_view = None
        if b.num_draft_tokens:
            b.cuda_graph_draft_extend_seq_lens_k = torch.ones(max_bs, dtype=torch.int32)

    # -- the function that is compiled
    def step(self, fb, hidden):
        backend = self.backend
        if self.path.replay:
            backend.init_forward_metadata_out_graph(fb)
        else:
            backend.init_forward_metadata(fb)
        h = hidden
        decode = fb.forward_mode.is_decode_or_idle()
        for layer, w in zip(self.layers, self.w):
            o = self._attend(backend, layer, w, h, fb, decode)
            h = h + o.reshape(h.shape[0], -1) @ w["o"]
        return h

    def _attend(self, backend, layer, w, h, fb, decode):
        forward = backend.forward_decode if decode else backend.forward_extend
        if self.path.backend == "triton":
            q = h @ w["q"]
            k = (h @ w["k"]).view(-1, self.sizes.kv_heads, self.sizes.head_dim)
            v = (h @ w["v"]).view(-1, self.sizes.kv_heads, self.sizes.head_dim)
            return forward(q, k, v, layer, fb)
        q = h @ w["q"]  # [T, H * (kv_lora_rank + rope)]: the absorbed query, rope part included
        rank = self.sizes.kv_lora_rank
        latent = (h @ w["k"]).view(-1, 1, self.sizes.mla_head_dim)  # the latent KV + its rope part, one KV head
        if self.path.backend == "flashmla":
            return forward(q, latent, latent[..., :rank], layer, fb)
        k_nope, k_rope = latent[..., :rank], latent[..., rank:]
        return forward(q, k_nope, None, layer, fb, k_rope=k_rope)

    # -- a batch for one length vector
    def make_batch(self, lengths, seed: int = 0):
        """`lengths`: per request, the tokens in the cache before this step's new ones (decode: including the new
        token, as SGLang counts them; draft extend: including the extended tokens)."""
        m, path, ps = self.m, self.path, self.path.page_size
        rng = random.Random(seed)
        batch = len(lengths)
        r2t, rows = H.fill_token_table(self.runner.req_to_token_pool.req_to_token, lengths, ps, self.sizes, rng)
        rpi = torch.tensor(rows, dtype=torch.int64)
        seq = torch.tensor(lengths, dtype=torch.int64)
        k = path.draft_tokens
        extend = None
        if path.mode == "decode":
            fm = m.ForwardMode.DECODE
            positions = seq - 1
            q_rows = torch.ones(batch, dtype=torch.int64)
        elif path.mode == "target_verify":  # the draft tokens go after seq_lens
            fm = m.ForwardMode.TARGET_VERIFY
            positions = torch.stack([seq + j for j in range(k)], 1).reshape(-1)
            q_rows = torch.full((batch,), k, dtype=torch.int64)
        elif path.mode == "draft_extend":  # the lengths already count the extended tokens
            fm = m.ForwardMode.DRAFT_EXTEND_V2
            extend = [rng.randint(1, k) if path.ragged else k for _ in range(batch)]
            positions = torch.cat([seq[b] - extend[b] + torch.arange(extend[b]) for b in range(batch)])
            q_rows = torch.tensor(extend, dtype=torch.int64)
        else:
            raise ValueError(path.mode)
        out_loc = r2t[rpi.repeat_interleave(q_rows), positions].to(torch.int64)
        tokens = int(q_rows.sum())
        fb = m.ForwardBatch(
            forward_mode=fm, batch_size=batch, input_ids=torch.zeros(tokens, dtype=torch.int64),
            req_pool_indices=rpi, seq_lens=seq, out_cache_loc=out_loc,
            seq_lens_sum=int(seq.sum()) if path.seq_lens_sum else None,
            seq_lens_cpu=seq.clone() if path.mirror else None, positions=positions)
        self.runner.kv_index_translator.bind_own_plan(fb)
        if path.mode == "target_verify":
            fb.spec_info = SimpleNamespace(num_tokens_per_req=k, draft_token_num=k, custom_mask=None,
                                           ragged_verify_layout=None, kv_indptr=None)
        if extend is not None:
            ext = torch.tensor(extend, dtype=torch.int32)
            fb.extend_seq_lens = ext
            fb.extend_prefix_lens = (seq - ext).to(torch.int32)
            fb.extend_seq_lens_cpu = list(extend) if path.host_lists else None
            fb.extend_prefix_lens_cpu = [int(x) - e for x, e in zip(lengths, extend)] if path.host_lists else None
            fb.extend_num_tokens = tokens
        gen = torch.Generator().manual_seed(seed)
        return fb, torch.randn(tokens, self.sizes.hidden, generator=gen)


def length_range(path: Path, max_context: int = MAX_CONTEXT) -> tuple[int, int]:
    """[low, top]: the committed lengths a step of this path takes at this bound (a verify's draft tokens stay
    within the token table's max_context columns; a draft extend's lengths count its tokens)."""
    extra = path.draft_tokens if path.mode == "target_verify" else 0
    low = path.draft_tokens if path.mode == "draft_extend" else 1
    return low, max_context - extra


def length_vectors(path: Path, count: int, batches=(3, 2, 4, 1), seed: int = 0, max_context: int = MAX_CONTEXT):
    """Length vectors over changing batch sizes; the first row of the first vector sits at the bound."""
    from passlib import length_vectors as vectors

    low, top = length_range(path, max_context)
    return vectors(batches, count, seed, top, low=low, edge=False, top_first=True)


# ------------------------------------------------------------------------------------------------ running a path
def compile_step(path: Path, fn, max_context: int = MAX_CONTEXT):
    """(compiled fn, reports()) for the path: compile_pass.compile (Inductor) or passlib.TracedPassOnly."""
    import compile_pass

    if path.inductor:
        step = compile_pass.compile(fn, max_context_len=max_context, dynamic=path.dynamic, **path.options)
        return step, lambda: list(compile_pass.reports(step))
    from passlib import compile_traced

    run, backend = compile_traced(fn, dynamic=path.dynamic, max_context_len=max_context, **path.options)
    return run, lambda: list(backend.reports)


def graph_breaks_since(seen: int) -> list[str]:
    """Dynamo's graph breaks recorded after the first `seen`, each as `file.py:LINE: first line of the reason`
    (torch.compiler.disable skips and data-dependent branches included), without repeats."""
    from compile_pass import _compat

    out = []
    for reason, where in _compat.graph_break_reasons()[seen:]:
        text = f"{where}: {reason.strip().splitlines()[0] if reason.strip() else '?'}"
        if text not in out:
            out.append(text)
    return out


def run_path(path: Path, vectors: int = 2, sizes: Sizes = DEFAULT) -> H.Outcome:
    """Compile Engine.step, run it over changing lengths and batch sizes, compare each result with the same step
    run eagerly on an identical batch (same pools, same inputs)."""
    from compile_pass import _compat

    engine = Engine(path, sizes=sizes)
    if path.kernels == "registered":
        register_launchers()  # the user's registration (module docstring); the backend stays as SGLang built it
    seen = len(_compat.graph_break_reasons())
    try:
        step, reports = compile_step(path, engine.step, sizes.max_context)
        errors = []
        for n, lengths in enumerate(length_vectors(path, vectors, seed=path.seed, max_context=sizes.max_context)):
            fb, hidden = engine.make_batch(lengths, seed=n)
            want = engine.step(fb, hidden)
            fb, hidden = engine.make_batch(lengths, seed=n)
            got = step(fb, hidden)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                       msg=lambda s: f"{path.name} {lengths}: {s}")
            errors.append(float((got - want).abs().max()))
        graph_reports = reports()
    finally:
        if path.kernels == "registered":
            unregister_launchers()
    breaks = graph_breaks_since(seen)
    status, reasons = H.classify(graph_reports)
    if breaks:
        status = "graph_break"
    return H.Outcome(errors, graph_reports, len(graph_reports), status, reasons, breaks)


# ------------------------------------------------------------------------------------------------ checking a status
def shown(result) -> str:
    return "\n".join(str(r) for r in result.reports) + "\ngraph breaks:\n  " + "\n  ".join(result.graph_breaks)


def check_status(result, status: str, detail) -> None:
    """`status` and its detail: a reason code among the kept items (kept), words each of which some graph break
    shows (graph_break: a tuple), words of a rewritten item (rewritten), or no break, kept or rewritten item at all
    (nothing)."""
    text = shown(result)
    assert result.status == status, text
    if status == "kept":
        assert detail in [i.reason_code for r in result.reports for i in r.kept], text
    elif status == "graph_break":
        for words in detail:
            assert any(words in b for b in result.graph_breaks), f"missing graph break {words!r}\n{text}"
    elif status == "rewritten":
        assert all(r.syncs_remaining == 0 and not r.kept for r in result.reports), text
        if detail:
            assert any(detail in i.reason for r in result.reports for i in r.rewritten), text
    else:
        assert not result.graph_breaks and all(not r.kept and not r.rewritten for r in result.reports), text


class Outcomes:
    """Each path run once per test session (torch._dynamo reset first), shared by the tests that look at it: two
    length vectors (two batch sizes: a recompile, then a dynamic graph) where the pass rewrites or keeps a max,
    one where there is nothing to rewrite or Dynamo breaks the graph first (CI time)."""

    def __init__(self, paths: dict, expected: dict, vectors: dict | None = None):
        self.paths, self.expected, self.done = paths, expected, {}
        self.counts = dict(vectors or {})  # a path whose break shows only at the second batch size: 2

    def vectors(self, name) -> int:
        return self.counts.get(name, 2 if self.expected[name][0] in ("rewritten", "kept") else 1)

    def __call__(self, name):
        if name not in self.done:
            torch._dynamo.reset()
            self.done[name] = run_path(self.paths[name], vectors=self.vectors(name))
        return self.done[name]
