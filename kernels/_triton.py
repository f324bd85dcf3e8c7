"""Where Triton kernels run: on CUDA tensors always; on CPU tensors only under TRITON_INTERPRET=1."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    # triton.jit reads TRITON_INTERPRET when a kernel is defined, i.e. when the kernel module is imported.
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and triton_importable()


def use_triton(t: torch.Tensor) -> bool:
    if t.is_cuda:
        if not triton_importable():
            raise RuntimeError("torch-syncfree needs triton for CUDA tensors; install triton")
        return True
    return t.device.type == "cpu" and interpreting()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints (the one helper the project uses for it)."""
    return -(-a // b)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """The streaming multiprocessors of a CUDA tensor's device; 0 elsewhere (the interpreter runs one program
    at a time)."""
    if t.is_cuda:
        return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 0


def device_programs(t: torch.Tensor, per_sm: int = 4) -> int:
    """A grid size that fills the device: a few programs per SM on CUDA, one under the interpreter."""
    return per_sm * sm_count(t) if t.is_cuda else 1
