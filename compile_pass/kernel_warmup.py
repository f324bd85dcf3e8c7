"""Compile this package's Triton kernels while Inductor compiles the graph that launches them.

The first call of a compiled step runs the step once before CUDA graphs record it, and that run is where this
package's own kernels (the page table, paged decode's split and combine kernels) would be compiled by Triton, one
after another, with the process waiting: 1.1-1.6 s of the regional 8B step's cold first call on the H200
(BENCHMARKS.md, ninth session). Instead, as soon as the pass has rewritten the graph, the backend records the
compiles those launches will ask for, from the fake values the graph's nodes carry, and has them done while
AOTAutograd and Inductor compile the graph; the first launch of each kernel then finds it in Triton's cache.

Where they compile (SYNCFREE_PREWARM_KERNELS): by default in a helper process (kernels/compile_ahead.py), which
the backend starts at its entry so that its start overlaps the pass. A thread of this process (=thread) was the
first way: Triton's compiler holds the GIL for much of its work, so there the same compiles took 2.4-3.7 s
against 1.1-1.6 s alone and slowed the backend by 0.4-0.8 s (ninth session). =0 turns warm-ups off.

    graph (after the pass):  %pt = syncfree.page_table(%req_to_token, %rpi, %lens, 1, 4096)
                             %o  = syncfree.paged_decode(%q, %k, %v, %pt, %lens, ...)   (in every layer's body)
    record (here, ms):       page_table_kernel, paged_decode_split_kernel, paged_decode_combine_kernel: one compile
                             request each, for the shapes, strides and dtypes of those calls
    helper process:          triton.compile of each request into Triton's on-disk cache
    warm-up thread:          waits for the helper, then loads each kernel into its in-memory JIT cache

Nothing here changes the graph or the report; a warm-up that fails is logged at debug level and the kernel compiles
at its first launch, as without it. A real launch waits for the warm-up thread first (kernels/_triton.py), so a
kernel is never compiled twice at once.
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


def record_calls(calls: list[KernelCall]) -> tuple[int, list]:
    """Run each call's op implementation on fake tensors of the calls' layouts with its launches turned into
    Triton warm-ups (kernels/warmup.py), and keep the compiles those ask Triton for instead of doing them
    (kernels/compile_ahead.recording). (calls that ran through, [CompileJob]); a call that raises is logged and
    skipped. Milliseconds: nothing compiles here."""
    from .kernels.compile_ahead import recording
    from .kernels.warmup import compile_launches

    done = 0
    with recording() as jobs:
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
    return done, list(jobs)


def _compile_and_load(jobs: list, use_helper: bool) -> None:
    from .kernels.compile_ahead import compile_and_load

    outcome = compile_and_load(jobs, use_helper)
    log.debug("syncfree: kernels compiled ahead: %d job(s), %d by the helper process, %d loaded; not: %s",
              len(jobs), outcome.helper_compiled, outcome.loaded, outcome.errors or "none")


def _device_context(device: torch.device | None):
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)  # a new thread starts on device 0; Triton compiles for the current one
    return contextlib.nullcontext()


def mode() -> str | None:
    """Where kernels compile ahead: "process" (a helper process, the default), "thread" (SYNCFREE_PREWARM_KERNELS=
    thread: a thread of this process, which competes with Inductor for the GIL) or None (=0, or not on a CUDA
    machine with Triton compiling rather than interpreting)."""
    from .kernels._triton import interpreting, triton_importable

    setting = os.environ.get("SYNCFREE_PREWARM_KERNELS", "1").strip().lower()
    if setting == "0" or not (torch.cuda.is_available() and triton_importable() and not interpreting()):
        return None
    return "thread" if setting == "thread" else "process"


def enabled() -> bool:
    return mode() is not None


def prepare() -> None:
    """Start the helper process now (the backend's entry), so that its start overlaps the pass. Never raises."""
    try:
        if mode() == "process":
            from .kernels.compile_ahead import helper

            helper.start()
    except Exception as e:  # noqa: BLE001 - the kernels then compile in a thread, or at their first launch
        log.debug("syncfree: compile helper not started: %s: %s", type(e).__name__, e)


def start(gm: torch.fx.GraphModule) -> threading.Thread | None:
    """Compile ahead the kernels of this package that `gm` launches on a CUDA device: their compiles are recorded
    here (milliseconds), then a background thread has the helper process compile them and loads them into
    Triton's in-memory caches, which a launch waits for. The thread, or None when there is nothing to compile or
    warm-ups are off. Never raises."""
    try:
        where = mode()
        if where is None:
            return None
        from .kernels._triton import add_warmup
        from .kernels.warmup import IMPLEMENTATIONS

        calls = [c for c in kernel_calls(gm, IMPLEMENTATIONS) if any(d.type == "cuda" for d in c.devices())]
        _, jobs = record_calls(calls)
        if not jobs:
            return None
        thread = threading.Thread(target=_compile_and_load, args=(jobs, where == "process"), name=THREAD_NAME,
                                  daemon=True)
        thread.start()
        add_warmup(thread)  # after start: a launch joins it, and a thread not started cannot be joined
        log.debug("syncfree: compiling %d kernel(s) ahead (%s)", len(jobs), where)
        return thread
    except Exception as e:  # noqa: BLE001 - never fail a compile over a warm-up
        log.debug("syncfree: kernel warm-up not started: %s: %s", type(e).__name__, e)
        return None
