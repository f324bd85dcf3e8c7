"""The pieces of FlashInfer that SGLang's MLA backends reach on their decode, verify and draft-extend paths, on CPU.

SGLang imports flashinfer only where `is_flashinfer_available()` (CUDA), so on CPU the names are simply absent
from flashinfer_mla_backend / trtllm_mla_backend; `install()` puts these in their module namespaces:

- BatchMLAPagedAttentionWrapper, BatchPrefillWithRaggedKVCacheWrapper: FlashInferMLAAttnBackend.__init__ builds
  them; FlashMLA and TRTLLM-MLA never use them on these paths. Inert: constructing one stores its arguments,
  anything else raises.
- flashinfer.utils.get_device_sm_count / get_trtllm_gen_multi_ctas_kv_counter_bytes (TRTLLMMLABackend's
  persistent counter buffer): 132 SMs, 8 bytes per (request, head).
- flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla, over the stand-in op
  flashinfer_standin::trtllm_batch_decode_mla. Its contract (trtllm-gen's MLA decode):
    query [B, q_len, H, kv_lora_rank + rope]; kv_cache [num_pages, 1, page_size, kv_lora_rank + rope];
    block_tables [B, W] int32; seq_lens [B] int32. Row b attends keys t < seq_lens[b] at page
    block_tables[b, t // page_size]; causal: query i sits at position L - q_len + i; values are the first
    kv_lora_rank channels; logits scaled by bmm1_scale, output by bmm2_scale; out [B, q_len, H, kv_lora_rank].
    It reads block_tables[b, j] only for j < cdiv(seq_lens[b], page_size). max_seq_len is an upper bound
    (it sizes the multi-CTA split of the key range): any value >= max(seq_lens) gives the same result.
  Checks, as the real one: the Python wrapper's shape check (flashinfer.decode._check_trtllm_gen_mla_shape:
  block_num % (128 / page_size) == 0, else ValueError); and in the kernel, where it would read out of bounds,
  IndexError: a row longer than its table (cdiv(L, page) > W), a page id outside the cache. Stricter than the
  kernel: max_seq_len below a row's length raises (the kernel's split plan would not cover the row).
- flashinfer.prefill.trtllm_ragged_attention_deepseek: the prefill kernel, not on these paths (raises).
"""

from __future__ import annotations

import types

import torch

TRTLLM_BLOCK_CONSTRAINT = 128
NUM_SMS = 132

_LIB = torch.library.Library("flashinfer_standin", "DEF")
_LIB.define("trtllm_batch_decode_mla(Tensor query, Tensor kv_cache, int kv_lora_rank, Tensor block_tables, "
            "Tensor seq_lens, SymInt max_seq_len, float bmm1_scale, float bmm2_scale) -> Tensor")


def _cdiv(a, b):
    return -(-a // b)


def _decode_cpu(query, kv_cache, kv_lora_rank, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale):
    b, q_len, h, d = query.shape
    pages, _, page, dk = kv_cache.shape
    if dk != d or block_tables.shape[0] < b or seq_lens.numel() < b:
        raise RuntimeError(f"trtllm_batch_decode_mla: shapes query {tuple(query.shape)}, kv_cache "
                           f"{tuple(kv_cache.shape)}, block_tables {tuple(block_tables.shape)} do not agree")
    cache = kv_cache[:, 0]
    out = query.new_empty(b, q_len, h, kv_lora_rank)
    for row in range(b):
        length = int(seq_lens[row])
        if length > max_seq_len:
            raise RuntimeError(f"trtllm_batch_decode_mla: row {row} has {length} keys, max_seq_len is {max_seq_len}")
        needed = _cdiv(max(length, 0), page)
        if needed > block_tables.shape[1]:
            raise IndexError(f"trtllm_batch_decode_mla: row {row} needs {needed} pages, the block table has "
                             f"{block_tables.shape[1]} columns (the kernel would read past the row)")
        ids = block_tables[row, :needed].to(torch.int64)
        if needed and (int(ids.min()) < 0 or int(ids.max()) >= pages):
            raise IndexError(f"trtllm_batch_decode_mla: row {row} reads page {int(ids.min())}..{int(ids.max())}, "
                             f"outside the cache's {pages} pages")
        keys = cache[ids].reshape(-1, d)[:length].float()
        s = torch.einsum("qhd,kd->hqk", query[row].float(), keys) * bmm1_scale
        pos = torch.arange(q_len)[:, None] + length - q_len
        s = s.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
        out[row] = (torch.einsum("hqk,kd->qhd", s.softmax(-1), keys[:, :kv_lora_rank]) * bmm2_scale).to(out.dtype)
    return out


def _decode_fake(query, kv_cache, kv_lora_rank, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale):
    b, q_len, h, _ = query.shape
    return query.new_empty(b, q_len, h, kv_lora_rank)


_LIB.impl("trtllm_batch_decode_mla", _decode_cpu, "CPU")
torch.library.register_fake("flashinfer_standin::trtllm_batch_decode_mla", _decode_fake, lib=_LIB)


def trtllm_batch_decode_with_kv_cache_mla(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank,
                                          qk_rope_head_dim, block_tables, seq_lens, max_seq_len, out=None,
                                          bmm1_scale=1.0, bmm2_scale=1.0, sinks=None, enable_pdl=None,
                                          backend="auto", return_lse=False, multi_ctas_kv_counter_buffer=None,
                                          skip_softmax_threshold_scale_factor=None, **unsupported):
    if unsupported or sinks is not None or out is not None or return_lse or backend not in ("auto", "trtllm-gen"):
        raise NotImplementedError(f"stand-in trtllm_batch_decode_with_kv_cache_mla: {sorted(unsupported)} "
                                  f"sinks={sinks is not None} out={out is not None} return_lse={return_lse} "
                                  f"backend={backend}")
    if skip_softmax_threshold_scale_factor not in (None, 0, 0.0):
        raise NotImplementedError("stand-in trtllm_batch_decode_with_kv_cache_mla: skip-softmax")
    page = kv_cache.shape[-2]
    if query.shape[-1] != kv_lora_rank + qk_rope_head_dim:
        raise ValueError(f"query head dim {query.shape[-1]} != kv_lora_rank + qk_rope_head_dim")
    if block_tables.shape[-1] % (TRTLLM_BLOCK_CONSTRAINT // page) != 0:  # _check_trtllm_gen_mla_shape
        raise ValueError(f"block_num ({block_tables.shape[-1]}) must be a multiple of 128 / block_size ({page})")
    return torch.ops.flashinfer_standin.trtllm_batch_decode_mla(query, kv_cache, kv_lora_rank, block_tables,
                                                                seq_lens, max_seq_len, float(bmm1_scale),
                                                                float(bmm2_scale))


class _InertWrapper:
    """A FlashInfer wrapper the decode/verify/draft-extend paths build but never use."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __getattr__(self, name):
        def unavailable(*args, **kwargs):
            raise NotImplementedError(f"stand-in FlashInfer wrapper: {type(self).__name__}.{name}")

        return unavailable


class BatchMLAPagedAttentionWrapper(_InertWrapper):
    pass


class BatchPrefillWithRaggedKVCacheWrapper(_InertWrapper):
    pass


def _prefill_unavailable(*args, **kwargs):
    raise NotImplementedError("stand-in flashinfer.prefill.trtllm_ragged_attention_deepseek")


flashinfer = types.SimpleNamespace(
    decode=types.SimpleNamespace(trtllm_batch_decode_with_kv_cache_mla=trtllm_batch_decode_with_kv_cache_mla),
    prefill=types.SimpleNamespace(trtllm_ragged_attention_deepseek=_prefill_unavailable),
    utils=types.SimpleNamespace(
        get_device_sm_count=lambda device: NUM_SMS,
        get_trtllm_gen_multi_ctas_kv_counter_bytes=lambda batch, heads, sms: 8 * batch * heads),
)


def install(flashinfer_mla_backend, trtllm_mla_backend) -> None:
    flashinfer_mla_backend.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    flashinfer_mla_backend.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    trtllm_mla_backend.flashinfer = flashinfer
