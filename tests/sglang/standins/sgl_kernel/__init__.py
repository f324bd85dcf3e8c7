"""Stand-in for the sgl_kernel package (sglang-kernel 0.4.10) on CPU, for tests/sglang only.

The real package loads CUDA extensions at import. This one provides what SGLang's FlashAttention backend
reaches: `sgl_kernel.flash_attn` (flash_attn_with_kvcache, flash_attn_varlen_func, get_scheduler_metadata over
the stand-in ops `sgl_kernel::fwd` / `sgl_kernel::get_scheduler_metadata`, see flash_ops.py) and
`merge_state_v2` (the cascade merge, exact). Any other name SGLang imports at module level is a placeholder that
raises NotImplementedError when called, so a path that needs a missing kernel fails loudly.
"""

from __future__ import annotations

import torch

from sgl_kernel import flash_ops  # noqa: F401

__version__ = "0.4.10+cpu-stand-in"


def merge_state_v2(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None):
    """Merge two partial attention results by their log-sum-exp: v [T, H, D], s [T, H] (natural log)."""
    s_a32, s_b32 = s_a.float(), s_b.float()
    s_max = torch.maximum(s_a32, s_b32)
    w_a = torch.exp(s_a32 - s_max)
    w_b = torch.exp(s_b32 - s_max)
    total = w_a + w_b
    v = (v_a.float() * (w_a / total).unsqueeze(-1) + v_b.float() * (w_b / total).unsqueeze(-1)).to(v_a.dtype)
    s = (s_max + torch.log(total)).to(s_a.dtype)
    if v_merged is not None:
        v_merged.copy_(v)
        v = v_merged
    if s_merged is not None:
        s_merged.copy_(s)
        s = s_merged
    return v, s


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not implemented on CPU")

    _missing.__name__ = name
    return _missing
