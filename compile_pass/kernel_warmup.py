"""Compile this package's Triton kernels while Inductor compiles the graph that launches them.

The first call of a compiled step runs the step once before CUDA graphs record it, and that run is where this
package's own kernels (the page table, paged decode's split and combine kernels) would be compiled by Triton, one
after another, with the process waiting: 1.1-1.6 s of the regional 8B step's cold first call on the H200
(BENCHMARKS.md, ninth session). The backend instead starts their compiles in a background thread as soon as the
pass has rewritten the graph, from the fake values the graph's nodes carry, so they run while AOTAutograd and
Inductor compile the graph; the first launch of each kernel then finds it in Triton's cache.

Why only part of that time is won: Triton's compiler holds the GIL for much of its work, so in a thread it competes
with AOTAutograd's and Inductor's Python work (on the H200 the same compile takes 2.4-3.7 s in the thread, and the
backend is 0.4-0.8 s slower while it runs; the first call's time outside the compile falls from 2.7 to 1.35 s).
A helper process would not compete; it would need Triton's cache key to come out equal in both processes.

    graph (after the pass):  %pt = syncfree.page_table(%req_to_token, %rpi, %lens, 1, 4096)
                             %o  = syncfree.paged_decode(%q, %k, %v, %pt, %lens, ...)   (in every layer's body)
    warm-up thread:          page_table_kernel, paged_decode_split_kernel, paged_decode_combine_kernel compiled
                             once each, for the shapes, strides and dtypes of those calls

Nothing here changes the graph or the report; a warm-up that fails is logged at debug level and the kernel compiles
at its first launch, as without it. The compile of the same kernel is never run twice at once: a real launch waits
for the warm-up thread first (kernels/_triton.py). SYNCFREE_PREWARM_KERNELS=0 turns it off.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, NamedTuple

import torch
import torch.fx

from . import _compat
from .consumers import resolved_overload
from .log import log
from .mutations import region_body

THREAD_NAME = "syncfree-kernel-warmup"


class TensorSpec(NamedTuple):
    """What a kernel launch can depend on of a tensor argument: its layout, dtype and device (not its values)."""

    shape: tuple
    stride: tuple
    storage_offset: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec | None":
        """None for a tensor with a symbolic size, stride or offset (its launch is not known before it runs)."""
        values = (*t.shape, *t.stride(), t.storage_offset())
        if not all(isinstance(v, int) for v in values):
            return None
        return cls(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype, t.device)

    def fake(self) -> torch.Tensor:
        """A tensor of this layout in the active fake mode (no memory is allocated)."""
        empty = any(n == 0 for n in self.shape)
        extent = 0 if empty else 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        base = torch.empty(self.storage_offset + extent, dtype=self.dtype, device=self.device)
        return base.as_strided(self.shape, self.stride, self.storage_offset)


class KernelCall(NamedTuple):
    """One call of an op that launches a kernel of this package, its tensors as TensorSpecs."""

    op: str
    args: tuple
    kwargs: tuple  # sorted (name, value) pairs

    def devices(self) -> set:
        return {a.device for a in (*self.args, *(v for _, v in self.kwargs)) if isinstance(a, TensorSpec)}


def _value(node: torch.fx.Node, values: dict):
    """A node's value here: the operand's at this region call for a body input (`values`), else its example value."""
    return values[node] if node in values else _compat.example_value(node)


def _spec_of(value: Any, values: dict) -> tuple[bool, Any]:
    """(known, spec) of a node's argument: a TensorSpec for a tensor, the value for a constant; known is False for
    what a launch could depend on but is not a constant here (a symbolic int, a list holding one). `values`: the
    values of a region body's placeholders at this call (their own example values are the body's first trace)."""
    if isinstance(value, torch.fx.Node):
        value = _value(value, values)
        if isinstance(value, torch.Tensor):
            spec = TensorSpec.of(value)
            return spec is not None, spec
    if isinstance(value, torch.Tensor):
        return False, None  # a constant tensor in the graph's arguments: not seen in this package's ops
    if isinstance(value, (list, tuple)):
        specs = [_spec_of(v, values) for v in value]
        return all(k for k, _ in specs), type(value)(s for _, s in specs)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return True, value
    return False, None


def op_name(node: torch.fx.Node) -> str | None:
    """The qualified name ("syncfree::page_table") of the op a node calls, or None."""
    overload = resolved_overload(node)
    return overload._schema.name if overload is not None else None


def kernel_calls(gm: torch.fx.GraphModule, implementations) -> list[KernelCall]:
    """The calls in `gm`, and in the bodies of the compiled regions it calls, of the ops named in `implementations`:
    one per distinct op and arguments. Inside a body, an argument that is a body input takes the value of the
    operand at the region's call (after the pass, a static-width table where the body was traced with a symbolic
    one). A call whose arguments are not all known (a symbolic size) is left out."""
    calls: dict[KernelCall, None] = {}
    _collect(gm.graph, {}, implementations, calls, set())
    return list(calls)


def _collect(graph: torch.fx.Graph, values: dict, implementations, calls: dict, seen: set) -> None:
    for node in graph.nodes:
        region = region_body(node)
        if region is not None:
            body, operands = region
            inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
            inner = {p: _value(o, values) if isinstance(o, torch.fx.Node) else o for p, o in zip(inputs, operands)}
            key = (id(body), repr([_spec_of(o, values) for o in operands]))
            if key not in seen:  # 32 calls of one layer body with the same operands: walked once
                seen.add(key)
                _collect(body.graph, inner, implementations, calls, seen)
            continue
        name = op_name(node)
        if name not in implementations:
            continue
        known = [_spec_of(a, values) for a in node.args]
        known_kwargs = [(k, _spec_of(v, values)) for k, v in sorted(node.kwargs.items())]
        if all(k for k, _ in known) and all(k for _, (k, _) in known_kwargs):
            calls[KernelCall(name, tuple(s for _, s in known), tuple((k, s) for k, (_, s) in known_kwargs))] = None


def _materialize(value: Any) -> Any:
    if isinstance(value, TensorSpec):
        return value.fake()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v) for v in value)
    return value


def compile_calls(calls: list[KernelCall]) -> int:
    """Compile the kernels of `calls` now, in this thread: each op's implementation runs on fake tensors of the
    calls' layouts with its launches turned into compiles (kernels/warmup.py). The number of calls that ran
    through; a call that raises is logged and skipped."""
    from .kernels.warmup import compile_launches

    done = 0
    for call in calls:
        devices = call.devices()
        device = next(iter(devices)) if len(devices) == 1 else None
        try:
            with _compat.fresh_fake_mode(), _device_context(device):
                args = _materialize(call.args)
                kwargs = {k: _materialize(v) for k, v in call.kwargs}
                done += compile_launches(call.op, args, kwargs)
        except Exception as e:  # noqa: BLE001 - the kernel then compiles at its first launch, as without this
            log.debug("syncfree: kernel warm-up of %s failed: %s: %s", call.op, type(e).__name__, e)
    return done


def _device_context(device: torch.device | None):
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)  # a new thread starts on device 0; Triton compiles for the current one
    return contextlib.nullcontext()


def enabled() -> bool:
    """Warm-ups run on a CUDA machine, with Triton compiling (not interpreting), unless SYNCFREE_PREWARM_KERNELS=0."""
    from .kernels._triton import interpreting, triton_importable

    return (os.environ.get("SYNCFREE_PREWARM_KERNELS", "1") != "0" and torch.cuda.is_available()
            and triton_importable() and not interpreting())


def start(gm: torch.fx.GraphModule) -> threading.Thread | None:
    """Start compiling, in a background thread, the kernels of this package that `gm` launches on a CUDA device;
    the thread, or None when there is nothing to compile or warm-ups are off. Never raises."""
    try:
        if not enabled():
            return None
        from .kernels._triton import add_warmup
        from .kernels.warmup import IMPLEMENTATIONS

        calls = [c for c in kernel_calls(gm, IMPLEMENTATIONS) if any(d.type == "cuda" for d in c.devices())]
        if not calls:
            return None
        thread = threading.Thread(target=compile_calls, args=(calls,), name=THREAD_NAME, daemon=True)
        thread.start()
        add_warmup(thread)  # after start: a launch joins it, and a thread not started cannot be joined
        log.debug("syncfree: compiling %d kernel call(s) ahead in %s", len(calls), THREAD_NAME)
        return thread
    except Exception as e:  # noqa: BLE001 - never fail a compile over a warm-up
        log.debug("syncfree: kernel warm-up not started: %s: %s", type(e).__name__, e)
        return None
