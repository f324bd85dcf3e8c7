"""`syncfree::ragged_extend_attention`: attention for ragged query rows given by an indptr (a draft extend, a target
verify of varying lengths), over FA's paged KV layout.

q [T, Hq, D] holds the rows back to back: row b's e_b = qo_indptr[b + 1] - qo_indptr[b] queries are
q[qo_indptr[b] : qo_indptr[b + 1]], the last e_b positions of its L_b = cache_seqlens[b] keys (query i at position
L_b - e_b + i, causal). `max_extend_len` sizes the launch, as in SGLang's extend kernel (its grid of query blocks):
only the last `max_extend_len` queries of a row are computed, and a row with more gets zeros for the rest, so any
value >= max_b e_b gives the same output. That is the fact the compile pass relies on (INDPTR_BOUND below): the
rows are read through qo_indptr, and max_extend_len is an upper bound.

The queries are laid into [B, max_extend_len, Hq, D] right-aligned, so that slot j of row b is the query at
position L_b - max_extend_len + j, which is paged_decode's Sq = max_extend_len convention; the outputs go back
through the same index. Device ops only: no host read, whatever the lengths.
"""

from __future__ import annotations

import torch

from ._checks import check_index_tensor
from .paged_decode import check_paged_decode_args

# The facts of the indptr-bound rule (compile_pass/rules/indptr_bound.py).
INDPTR_BOUND = {"syncfree::ragged_extend_attention": dict(indptr="qo_indptr", upper_bounds=("max_extend_len",))}


def _check(q, k_cache, v_cache, page_table, cache_seqlens, qo_indptr, max_extend_len, scale):
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [T, Hq, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if isinstance(max_extend_len, bool) or not isinstance(max_extend_len, (int, torch.SymInt)):
        raise TypeError(f"max_extend_len must be an int, got {type(max_extend_len).__name__}")
    check_index_tensor("qo_indptr", qo_indptr, 1)
    if qo_indptr.shape[0] != cache_seqlens.shape[0] + 1:
        raise ValueError(f"qo_indptr has {qo_indptr.shape[0]} entries; {cache_seqlens.shape[0]} rows need "
                         f"{cache_seqlens.shape[0] + 1}")
    if qo_indptr.device != q.device:
        raise ValueError(f"qo_indptr is on {qo_indptr.device}, q on {q.device}")
    rows = q.unsqueeze(0).expand(cache_seqlens.shape[0], -1, -1, -1)[:, :1]  # [B, 1, Hq, D]: the per-row checks
    check_paged_decode_args(rows, k_cache, v_cache, page_table, cache_seqlens, scale)


@torch.library.custom_op("syncfree::ragged_extend_attention", mutates_args=())
def ragged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_extend_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    _check(q, k_cache, v_cache, page_table, cache_seqlens, qo_indptr, max_extend_len, scale)
    tokens, heads, dim = q.shape
    batch, width = cache_seqlens.shape[0], max(0, int(max_extend_len))
    out = torch.zeros((tokens + 1, heads, dim), dtype=q.dtype, device=q.device)  # row `tokens`: a sink
    if batch == 0 or width == 0 or tokens == 0:
        return out[:tokens].clone()
    starts, ends = qo_indptr[:-1].long(), qo_indptr[1:].long()
    slot = ends[:, None] - width + torch.arange(width, device=q.device)[None, :]  # [B, W] token of slot j
    live = (slot >= starts[:, None]) & (slot >= 0) & (slot < tokens)
    index = torch.where(live, slot, tokens)
    padded = torch.where(live[..., None, None], q[index.clamp(max=tokens - 1)], 0)  # [B, W, Hq, D]
    attended = torch.ops.syncfree.paged_decode(padded, k_cache, v_cache, page_table, cache_seqlens, scale)
    out.index_copy_(0, index.reshape(-1), attended.reshape(-1, heads, dim))
    return out[:tokens].clone()


@ragged_extend_attention.register_fake
def _ragged_extend_attention_fake(q, k_cache, v_cache, page_table, cache_seqlens, qo_indptr, max_extend_len,
                                  scale=None):
    _check(q, k_cache, v_cache, page_table, cache_seqlens, qo_indptr, max_extend_len, scale)
    return torch.empty_like(q)
