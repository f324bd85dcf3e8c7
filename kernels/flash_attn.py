"""flash-attn adapters as torch ops, so paged decode through FA traces under torch.compile(fullgraph=True).

FA4 itself graph-breaks under Dynamo (logging calls, autograd.Function); wrapped in a custom op with a fake
implementation it is one opaque node, which the compile pass treats as a self-guarding consumer (FA reads
only `seqused_k` / `cache_seqlens` keys per row; `max_seqlen_k` is an upper bound).

    torch.ops.syncfree.fa4_paged(q, k_cache, v_cache, page_table, cache_seqlens, max_seqlen_k=None,
                                 causal=True, softmax_scale=None)
        -> flash_attn.cute.flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=, page_table=, max_seqlen_k=,
                                                   causal=, softmax_scale=)
    torch.ops.syncfree.fa_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, max_seqlen_k=None,
                                       causal=True, softmax_scale=None)
        -> FA3 flash_attn_interface.flash_attn_with_kvcache(..., page_table=) or
           FA2 flash_attn.flash_attn_with_kvcache(..., block_table=)

Where the package is missing the op raises at call time, naming the package; it never substitutes another kernel.
"""

from __future__ import annotations

import importlib

import torch

from .paged_decode import check_paged_decode_args


# Self-guarding facts (see paged_decode.SELF_GUARDING): FA reads ceil(cache_seqlens[b] / page_size) pages of
# row b, and max_seqlen_k is an upper bound.
SELF_GUARDING = {name: dict(page_table="page_table", lengths="cache_seqlens", upper_bounds=("max_seqlen_k",),
                            page_size_of=("k_cache", 1))
                 for name in ("syncfree::fa4_paged", "syncfree::fa_with_kvcache")}


# Facts for ops this project does not define: registered when the op first appears in a graph (the library that
# defines it may be imported after compile_pass), checked then against the op's own schema.
# FA3's paged decode as sgl_kernel and flash_attn_interface register it: fwd reads seqused_k[b] keys of row b through
# page_table (max_seqlen_k is None there: FA3 derives the key range from page_table.size(1) * page_size), and
# get_scheduler_metadata plans the split-KV for a max_seqlen_k; the plan is valid only for the key range the fwd
# call sees, so the two are rewritten together (rules/page_table.py, join_metadata).
EXTERNAL_SELF_GUARDING = {
    **{f"{ns}::fwd": dict(page_table="page_table", lengths="seqused_k", upper_bounds=("max_seqlen_k",),
                          page_size_of=("k", 1), metadata="scheduler_metadata")
       for ns in ("sgl_kernel", "flash_attn_3")},
    **{f"{ns}::get_scheduler_metadata": dict(lengths="seqused_k", upper_bounds=("max_seqlen_k",),
                                             feeds_metadata="scheduler_metadata")
       for ns in ("sgl_kernel", "flash_attn_3")},
}


class FlashAttentionUnavailable(RuntimeError):
    pass


def _fa4_varlen_func():
    try:
        module = importlib.import_module("flash_attn.cute")
        return module.flash_attn_varlen_func
    except (ImportError, AttributeError) as e:
        raise FlashAttentionUnavailable(
            "syncfree.fa4_paged needs FA4 (PyPI flash-attn-4, module flash_attn.cute), which is not importable "
            f"here ({e}); use torch.ops.syncfree.paged_decode instead"
        ) from None


def _fa_kvcache_func():
    """(function, name of its page-table keyword): FA3 first, then FA2."""
    try:
        return importlib.import_module("flash_attn_interface").flash_attn_with_kvcache, "page_table"
    except (ImportError, AttributeError):
        pass
    try:
        return importlib.import_module("flash_attn").flash_attn_with_kvcache, "block_table"
    except (ImportError, AttributeError) as e:
        raise FlashAttentionUnavailable(
            "syncfree.fa_with_kvcache needs FA3 (flash_attn_interface) or FA2 (flash_attn), neither is importable "
            f"here ({e}); use torch.ops.syncfree.paged_decode instead"
        ) from None


def _first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


@torch.library.custom_op("syncfree::fa4_paged", mutates_args=())
def fa4_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_k: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    check_paged_decode_args(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale)
    fn = _fa4_varlen_func()
    out = fn(q, k_cache, v_cache, seqused_k=cache_seqlens.to(torch.int32), page_table=page_table.to(torch.int32),
             max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale)
    return torch.empty_like(q).copy_(_first(out))


@fa4_paged.register_fake
def _fa4_paged_fake(q, k_cache, v_cache, page_table, cache_seqlens, max_seqlen_k=None, causal=True,
                    softmax_scale=None):
    check_paged_decode_args(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale)
    return torch.empty_like(q)


@torch.library.custom_op("syncfree::fa_with_kvcache", mutates_args=())
def fa_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    max_seqlen_k: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    check_paged_decode_args(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale)
    fn, table_kw = _fa_kvcache_func()
    # max_seqlen_k is an upper bound FA2/FA3 derive themselves from the page table; it is accepted for symmetry.
    out = fn(q, k_cache, v_cache, cache_seqlens=cache_seqlens.to(torch.int32),
             **{table_kw: page_table.to(torch.int32)}, causal=causal, softmax_scale=softmax_scale)
    return torch.empty_like(q).copy_(_first(out))


@fa_with_kvcache.register_fake
def _fa_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, page_table, max_seqlen_k=None, causal=True,
                          softmax_scale=None):
    check_paged_decode_args(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale)
    return torch.empty_like(q)
