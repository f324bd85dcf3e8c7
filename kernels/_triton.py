"""Where Triton kernels run: on CUDA tensors always; on CPU tensors only under TRITON_INTERPRET=1."""

from __future__ import annotations

import contextlib
import functools
import os
import threading

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


# --- Launching, and compiling ahead of the first launch -------------------------------------------------------
#
# Every wrapper launches its kernel through `launch`. Inside `compiling_only()` (kernels/warmup.py runs an op's
# implementation there, on fake tensors) a launch compiles the kernel for those arguments instead of running it:
# Triton's `warmup` takes the same arguments, with a dtype and an address alignment standing in for each tensor,
# and fills the same in-process (and on-disk) kernel cache that the real first launch then finds.

_compiling_only = threading.local()
_warmups: list[threading.Thread] = []
_warmups_lock = threading.Lock()


class PointerArg:
    """What a Triton launch reads of a tensor argument that has no memory (a fake tensor): its dtype and whether
    its address is a multiple of 16 (Triton specializes on that). The address is taken as its storage's (16-byte
    aligned, as the caching allocator's are) plus its storage offset."""

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self.shape = tuple(t.shape)
        self._strides = tuple(t.stride())
        self._address = (t.storage_offset() * t.element_size()) % 16

    def data_ptr(self) -> int:
        return self._address

    def stride(self) -> tuple:  # as triton's MockTensor has (Triton reads only dtype and data_ptr here)
        return self._strides


@contextlib.contextmanager
def compiling_only():
    """Launches in this thread compile their kernel for the given arguments and do not run it."""
    before = getattr(_compiling_only, "on", False)
    _compiling_only.on = True
    try:
        yield
    finally:
        _compiling_only.on = before


def add_warmup(thread: threading.Thread) -> None:
    """A thread compiling kernels ahead (kernels/warmup.py): the next real launch waits for it, so that one kernel
    is never compiled twice at once, and a kernel it compiled is found in the cache."""
    with _warmups_lock:
        _warmups.append(thread)


def wait_for_warmups() -> None:
    """Join the warm-up threads started so far (their errors were caught where they ran)."""
    with _warmups_lock:
        pending, _warmups[:] = list(_warmups), []
    for thread in pending:
        thread.join()


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), or in `compiling_only()`, Triton's compile of it for these arguments."""
    if getattr(_compiling_only, "on", False):
        kernel.warmup(*(PointerArg(a) if isinstance(a, torch.Tensor) else a for a in args), grid=grid, **kwargs)
        return
    if _warmups:
        wait_for_warmups()
    kernel[grid](*args, **kwargs)
