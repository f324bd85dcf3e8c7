"""Argument checks shared by the ops' real and fake implementations.

Every check names the offending argument, so a bad call fails the same way in eager and at trace time.
"""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_index_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != reference.device:
            raise ValueError(
                f"{name} is on {t.device} but {reference_name} is on {reference.device}; "
                "all tensors must be on one device"
            )


def check_batch(name: str, t: torch.Tensor, batch: int, batch_from: str) -> None:
    if t.shape[0] != batch:
        raise ValueError(f"{name} has {t.shape[0]} rows but {batch_from} has {batch}")


def check_page_table_args(req_to_token, req_pool_indices, seq_lens, page_size) -> None:
    check_index_tensor("req_to_token", req_to_token, 2)
    check_index_tensor("req_pool_indices", req_pool_indices, 1)
    check_index_tensor("seq_lens", seq_lens, 1)
    check_positive_int("page_size", page_size)
    check_same_device("req_to_token", req_to_token, req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    check_batch("seq_lens", seq_lens, req_pool_indices.shape[0], "req_pool_indices")
