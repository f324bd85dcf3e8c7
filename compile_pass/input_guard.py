"""The per-call guard on a compiled step: inputs the proof assumed distinct, and static inputs still aligned.

Dynamo does not guard on aliasing between inputs, and Inductor does not check a static input's alignment again at
run time; a call where either assumption fails runs the untouched Dynamo graph as captured (eager semantics, its
host read included). Host-side checks only: no sync. Under torch's AOT precompile the guard is an object torch can
save with the graph (GuardedSerializableStep; compile_pass.cache).

The backend wraps every compiled graph here; `_compat` (below it) knows nothing of the guard.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.fx
from torch import Tensor

from . import _compat
from ._compat import SerializableCallable, picklable_fallback


def flat_inputs(args) -> tuple | list:
    """The inputs of a call of a compiled function: boxed (one list of inputs) or not."""
    return args[0] if len(args) == 1 and isinstance(args[0], list) else args


def _shares_memory(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    address = a.untyped_storage().data_ptr()
    return address != 0 and address == b.untyped_storage().data_ptr()


def inputs_share_memory(args, pairs) -> bool:
    """Do any of the input pairs the proof assumed distinct share memory in this call (host-side, no sync)?
    The same answer as checking each pair with `_shares_memory`, in the same order, but each input's storage
    address is read at most once per call (an input is in several pairs: a KV pool against each index tensor)."""
    flat = flat_inputs(args)
    addresses: dict = {}
    for i, j in pairs:
        a, b = flat[i], flat[j]
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            continue
        address = addresses.get(i)
        if address is None:
            address = addresses[i] = a.untyped_storage().data_ptr()
        if address == 0:
            continue
        other = addresses.get(j)
        if other is None:
            other = addresses[j] = b.untyped_storage().data_ptr()
        if address == other:
            return True
    return False


@functools.cache
def _alignment() -> int:
    return _compat.input_alignment()  # a constant of the installed Inductor: asked once, not per call


def inputs_misaligned(args, positions) -> bool:
    """Is any input the backend made static for CUDA graphs (mark_static_scratch) no longer aligned as it was when
    Inductor compiled the graph? Inductor does not check a static input's alignment again at run time (host-side:
    its storage offset; no sync)."""
    if not positions:
        return False
    flat, align = flat_inputs(args), _alignment()
    return any(isinstance(flat[i], torch.Tensor) and (flat[i].storage_offset() * flat[i].element_size()) % align
               for i in positions)


def guard_disjoint_inputs(compiled: Callable, original: torch.fx.GraphModule, pairs, aligned=()) -> Callable:
    """Run `compiled` only while the graph inputs the proof assumed distinct are: Dynamo does not guard on
    aliasing between inputs, so a call in which two of them share memory runs the untouched graph as captured
    (eager semantics, its host read included). The check compares storage addresses on the host: no sync.
    `aligned`: positions of inputs the backend made static (mark_static_scratch); a call where one of them is not
    aligned as at compile time runs the untouched graph too.
    Under torch's AOT precompile the guard is an object torch can save with the graph (compile_pass.cache)."""
    pairs, aligned = tuple(pairs), tuple(aligned)
    if not pairs and not aligned:
        return _compat.serializable_step(compiled)
    boxed = getattr(compiled, "_boxed_call", False)
    if _compat.precompiling() and hasattr(compiled, "serialize"):
        try:
            return GuardedSerializableStep(compiled, original, pairs, boxed, aligned)
        except TypeError:  # a torch whose SerializableCallable asks for other methods: the closure below
            pass

    def guarded(*args):
        # Called as the compiled function is (boxed: one list of inputs; else the inputs): pass that through.
        if inputs_share_memory(args, pairs) or (aligned and inputs_misaligned(args, aligned)):
            return original.forward(*flat_inputs(args))
        return compiled(*args)

    guarded._boxed_call = boxed  # type: ignore[attr-defined]
    return guarded


class GuardedSerializableStep(SerializableCallable):  # type: ignore[misc,valid-type]
    """The backend's per-call guard (backend.guard_disjoint_inputs) in a form torch's AOT precompile can save: the
    compiled graph (AOT autograd's bundled entry), the untouched Dynamo graph it falls back to, the input pairs the
    proof assumed distinct and the positions of the inputs made static that must stay aligned."""

    def __init__(self, compiled, original, pairs: tuple, boxed: bool, aligned: tuple = ()):
        self.compiled, self.original, self.pairs, self._boxed_call = compiled, original, pairs, boxed
        self.aligned = aligned

    def __call__(self, *args):
        if inputs_share_memory(args, self.pairs) or inputs_misaligned(args, self.aligned):
            return self.original(*flat_inputs(args))
        return self.compiled(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "GuardedSerializableStep") -> bytes:
        import pickle

        from torch._dynamo.aot_compile_types import (BundledAOTAutogradSerializableCallable as Bundled,
                                                     GraphModuleSerializableCallable as Graph)

        compiled = fn.compiled if isinstance(fn.compiled, Bundled) else Bundled(fn.compiled)
        if isinstance(fn.original, Graph):
            original = Graph.serialize_compile_artifacts(fn.original)
        else:
            original = Graph.serialize_compile_artifacts(Graph(picklable_fallback(fn.original)))
        return pickle.dumps((Bundled.serialize_compile_artifacts(compiled), original, fn.pairs, fn._boxed_call,
                             tuple(fn.aligned)))

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "GuardedSerializableStep":
        import pickle

        from torch._dynamo.aot_compile_types import (BundledAOTAutogradSerializableCallable as Bundled,
                                                     GraphModuleSerializableCallable as Graph)

        compiled, original, pairs, boxed, *rest = pickle.loads(data)  # saved before `aligned` existed: 4 fields
        return cls(Bundled.deserialize_compile_artifacts(compiled), Graph.deserialize_compile_artifacts(original),
                   pairs, boxed, tuple(rest[0]) if rest else ())
