"""Stand-in for the sgl_kernel package (sglang-kernel 0.4.10) on CPU, for tests/sglang only.

The real package loads CUDA extensions at import. This one provides what SGLang's FlashAttention backend
reaches: `sgl_kernel.flash_attn` (flash_attn_with_kvcache, flash_attn_varlen_func, get_scheduler_metadata over
the stand-in ops `sgl_kernel::fwd` / `sgl_kernel::get_scheduler_metadata`, see flash_ops.py) and
`merge_state_v2` (the cascade merge, exact). Any other name SGLang imports at module level is a placeholder that
raises NotImplementedError when called, so a path that needs a missing kernel fails loudly.

On a CUDA machine SGLang takes its CUDA import branches (`from sgl_kernel.quantization import ...` and the
like, at module level): there every `sgl_kernel.<sub>` that this package does not have is a placeholder module
whose attributes raise NotImplementedError when called (`_SubmoduleFinder`, installed only where
torch.cuda.is_available(); on CPU such an import stays an ImportError, as before). The CUDA implementations of
the two FA3 ops are in cuda_ops.py.
"""

from __future__ import annotations

import torch

import importlib.abc
import importlib.machinery
import sys
import types

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


class _MissingType(type):
    """A placeholder kernel: calling it raises; its attributes are placeholders too (`scalar_types.uint4b8`)."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _missing_kernel(f"{cls._qualname}.{name}")

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {cls._qualname} is not implemented")


def _missing_kernel(qualname):
    return _MissingType(qualname.rsplit(".", 1)[-1], (), {"_qualname": qualname})


class _PlaceholderSubmodule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing_kernel(f"{self.__name__}.{name}")


class _SubmoduleLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _PlaceholderSubmodule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


class _SubmoduleFinder(importlib.abc.MetaPathFinder):
    """`sgl_kernel.<anything>` not in this package: a placeholder module (after the real finders)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _SubmoduleLoader(), is_package=True)
        spec.origin = "sgl_kernel stand-in placeholder"
        return spec


if torch.cuda.is_available() and not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())
