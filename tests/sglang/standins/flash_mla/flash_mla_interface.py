"""flash_mla.flash_mla_interface (stand-in): the scheduler-metadata container, as the real package defines it."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The tile scheduler metadata of FlashMLA (the real package's dataclass, same fields)."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None  # (num_sm_parts, 8) int32
    num_splits: Optional[torch.Tensor] = None  # (batch_size + 1) int32
