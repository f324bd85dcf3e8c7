"""Compile this package's Triton kernels before their first launch.

An op's own implementation is run on fake tensors (no memory, no device work) with every launch turned into
Triton's compile of that launch (`_triton.compiling_only`): the same wrapper code picks the grid, the block sizes and
the arguments, so the compiled specialization is the one the real first launch asks for and finds in Triton's cache.
compile_pass/kernel_warmup.py does this in a background thread while Inductor compiles the graph that calls the op.
"""

from __future__ import annotations

from typing import Callable

from ._triton import compiling_only

# op name -> its implementation (the function under torch.library.custom_op), for the ops that launch a kernel of
# this package.
IMPLEMENTATIONS: dict[str, Callable] = {}


def warmable(name: str) -> Callable:
    """Decorator, under @torch.library.custom_op(name): record the implementation for compile_launches."""

    def record(fn: Callable) -> Callable:
        IMPLEMENTATIONS[name] = fn
        return fn

    return record


def compile_launches(name: str, args: tuple, kwargs: dict) -> bool:
    """Run op `name`'s implementation on `args` (fake tensors, inside an active FakeTensorMode) so that each launch
    it makes compiles its kernel instead of running. False for an op with no kernel of this package."""
    implementation = IMPLEMENTATIONS.get(name)
    if implementation is None:
        return False
    with compiling_only():
        implementation(*args, **kwargs)
    return True
