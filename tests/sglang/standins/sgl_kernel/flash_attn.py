"""Stand-in for sgl_kernel/flash_attn.py (sglang-kernel 0.4.10): the same Python signatures, the same argument
preparation and the same op calls, `torch.ops.sgl_kernel.fwd.default(...)` and
`torch.ops.sgl_kernel.get_scheduler_metadata(...)`, into the CPU stand-in ops of sgl_kernel.flash_ops.

The wrappers call the `OPS_NAMESPACE` profile (default `sgl_kernel`, see flash_ops.py). Like the real wrapper, flash_attn_with_kvcache passes `cache_seqlens` as fwd's `seqused_k`, `page_table` as
`page_table` and None as `max_seqlen_k` (FA3 derives the key extent from the page table), and
get_scheduler_metadata passes `cache_seqlens` as `seqused_k` and `max_seqlen_k` as `max_seqlen_k`.
Written for the test harness; the real wrapper's is_fa3_supported asks CUDA, this one says True (CPU).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from sgl_kernel import flash_ops  # noqa: F401  (registers the stand-in ops)


# Which profile of the stand-in ops the wrappers call (see flash_ops.py): "sgl_kernel" (traceable annotations) or
# "sgl_kernel_exact" (the .so's schemas verbatim; test_exact_schemas.py).
OPS_NAMESPACE = "sgl_kernel"


def is_fa3_supported(device=None) -> bool:
    return True


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk: Optional[int] = None,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    only_qv=False,
    sm_margin=0,
    return_softmax_lse=False,
    sinks=None,
    score_mod=None,
    aux_tensors=None,
    ver=3,
    out=None,
):
    if v_cache is None:
        raise ValueError("v_cache must be provided")
    assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
    if k_cache is None or q is None or only_qv:
        raise NotImplementedError("sgl_kernel stand-in: only_qv (k_cache or q None) is not implemented")
    assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    if score_mod is not None or aux_tensors is not None:
        raise NotImplementedError("sgl_kernel stand-in: score_mod / aux_tensors are FA4 features")
    if softmax_scale is None:
        softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** (-0.5)
    if cache_seqlens is not None and isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=v_cache.device)
        cache_seqlens = maybe_contiguous(cache_seqlens)
    q, k_cache, k, v = [maybe_contiguous(x) for x in (q, k_cache, k, v)]
    v_cache = v_cache.contiguous() if v_cache.stride(-1) != 1 and v_cache.stride(-3) != 1 else v_cache
    cu_seqlens_q, cu_seqlens_k_new = [maybe_contiguous(x) for x in (cu_seqlens_q, cu_seqlens_k_new)]
    page_table, cache_batch_idx, cache_leftpad = [
        maybe_contiguous(x) for x in (page_table, cache_batch_idx, cache_leftpad)
    ]
    rotary_cos, rotary_sin = [maybe_contiguous(x) for x in (rotary_cos, rotary_sin)]
    rotary_seqlens = maybe_contiguous(rotary_seqlens)
    attention_chunk = 0 if attention_chunk is None else int(attention_chunk)

    out, softmax_lse, *rest = getattr(torch.ops, OPS_NAMESPACE).fwd.default(
        q, k_cache, v_cache, k, v, qv,
        out,
        cu_seqlens_q,
        None,  # cu_seqlens_k
        cu_seqlens_k_new,
        None,  # seqused_q
        cache_seqlens,  # -> seqused_k
        max_seqlen_q,
        None,  # max_seqlen_k: FA3 takes the key extent from the page table
        page_table,
        cache_batch_idx,
        cache_leftpad,
        rotary_cos, rotary_sin, rotary_seqlens,
        q_descale, k_descale, v_descale,
        softmax_scale,
        causal,
        window_size[0], window_size[1],
        attention_chunk,
        softcap,
        rotary_interleaved,
        scheduler_metadata,
        num_splits,
        pack_gqa,
        sm_margin,
        sinks,
        None,  # sparse_mask_fine
        only_qv,
    )
    return (out, softmax_lse, *rest) if return_softmax_lse else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    only_qv=False,
    sm_margin=0,
    return_softmax_lse=False,
    sinks=None,
    score_mod=None,
    aux_tensors=None,
    ver=3,
    out=None,
):
    if max_seqlen_q is None or max_seqlen_k is None:
        raise ValueError("max_seqlen_q and max_seqlen_k are required for FA3")
    if softmax_scale is None:
        softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** (-0.5)
    attention_chunk = 0 if attention_chunk is None else int(attention_chunk)
    out, softmax_lse, *rest = getattr(torch.ops, OPS_NAMESPACE).fwd.default(
        q, k, v,
        None, None,  # k_new, v_new
        qv,
        out,
        cu_seqlens_q, cu_seqlens_k,
        None,  # cu_seqlens_k_new
        seqused_q, seqused_k,
        max_seqlen_q, max_seqlen_k,
        None, None, None,  # page_table, kv_batch_idx, leftpad_k
        None, None, None,  # rotary
        q_descale, k_descale, v_descale,
        softmax_scale,
        causal,
        window_size[0], window_size[1],
        attention_chunk,
        softcap,
        is_rotary_interleaved=False,
        scheduler_metadata=None,
        num_splits=num_splits,
        pack_gqa=pack_gqa,
        sm_margin=sm_margin,
        sinks=sinks,
        sparse_mask_fine=None,
        only_qv=only_qv,
    )
    return (out, softmax_lse, *rest) if return_softmax_lse else out


def get_scheduler_metadata(
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_heads: int,
    num_heads_k: int,
    headdim: int,
    cache_seqlens: torch.Tensor,
    qkv_dtype=torch.bfloat16,
    headdim_v: Optional[int] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    page_size: Optional[int] = None,
    max_seqlen_k_new: int = 0,
    causal: bool = False,
    window_size=(-1, -1),
    attention_chunk: int = 0,
    has_softcap: bool = False,
    num_splits: int = 0,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
):
    cache_seqlens = maybe_contiguous(cache_seqlens)
    if headdim_v is None:
        headdim_v = headdim
    return getattr(torch.ops, OPS_NAMESPACE).get_scheduler_metadata(
        batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v, qkv_dtype,
        cache_seqlens,  # -> seqused_k
        cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, leftpad_k, page_size, max_seqlen_k_new,
        causal, window_size[0], window_size[1], attention_chunk, has_softcap, num_splits, pack_gqa, sm_margin,
    )
