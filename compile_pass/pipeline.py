"""The compile's graph steps, in order: what the backend does to a Dynamo graph before Inductor compiles it.

Read top to bottom (as vLLM's pass manager and Inductor's `post_grad_passes` are). Each step takes the graph and
the pipeline's state and returns how many changes it made (0: the graph is as it was):

    STEPS = (
        record_traced_at_bound   which maxima were traced with a branch at the bound, with the last write of their
                                 lengths before the max (read before anything moves)
        strip_range_asserts      the asserts of the range given while Dynamo traced (the backend's bookkeeping)
        respell_widths           a width Dynamo spelled as an expression of the ranged max, read back as sym_size
        rules                    SyncPass: find the host reads, prove every plan on the untouched graph, rewrite
        settle_at_bound          a kept max of the root frame: trace again (Retrace); a rewritten one traced at
                                 the bound: traced again with the other outcome, kept only where the two traces
                                 are one computation (no outcome is asserted)
        recheck_kept             a kept ranged max: its range checked again on the host, after its `.item()`
        decide_cudagraphs        CUDA graphs off for a graph that keeps a host read or a data-dependent size, or
                                 that allocates a scratch it stores for later steps
        outline_repeats          an outlined twin of the graph (option outline_repeats), compiled first
    )

The runner recompiles the graph once after the steps, when any changed it, and emits a structured-trace artifact
(TORCH_TRACE, tlparse: `syncfree_step_<name>`) with the graph after each step that changed it. After the list, the
backend's Inductor stage (compile_pass.backend): the CUDA-graph static scratch, compile_fx with the post-grad check
(compiled again without CUDA graphs where that check finds a host read), the per-call input guard.

Steps read graph-time facts only (compile_pass.traced_ranges), never the module that patches Dynamo.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch
import torch.fx

from . import _compat, traced_ranges
from .options import SyncfreeOptions
from .outline_repeats import OutlineResult, outline_repeats
from .sync_pass import PassResult, SyncPass

CUDAGRAPHS_OFF = ("cudagraphs: off for this graph, which keeps a host read or a data-dependent size "
                  "(CUDA graphs cannot hold one); it runs without CUDA graphs")
CUDAGRAPHS_SCRATCH = ("cudagraphs: off for this graph, which allocates a scratch the step stores for later steps "
                      "(grown from None or regrown): under CUDA graphs it would live in the graph's memory pool, "
                      "which the next replay reuses; the later steps' graph, which takes the scratch as an input, "
                      "keeps CUDA graphs")
CUDAGRAPHS_ON_CPU = ("cudagraphs: no effect on this graph, whose tensors are all on the CPU (CUDA graphs record "
                     "CUDA work only)")
OUTLINED_NOTHING = ("outline_repeats: no effect on this graph: no stretch of it repeats with the same ops on "
                    "arguments of the same kind (layers that index one stacked KV pool by layer differ in their "
                    "index: give each layer its own tensor), so it compiles as traced")
OUTLINE_NOT_TRIED = ("outline_repeats: not tried on this graph, which keeps a host read or a data-dependent size; it "
                     "compiles as traced")


@dataclasses.dataclass
class PipelineState:
    """What the steps hand on: the options, the maxima traced at the bound,
    the pass's typed result, the Inductor config patches, and the decisions the Inductor stage reads."""

    options: SyncfreeOptions
    patches: dict[str, Any]
    assumed: list = dataclasses.field(default_factory=list)
    result: PassResult | None = None
    keeps_host_read: bool = False
    outlined: OutlineResult | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    changed: list[str] = dataclasses.field(default_factory=list)  # the names of the steps that changed the graph


class Step(NamedTuple):
    name: str
    run: Callable[[torch.fx.GraphModule, PipelineState], int]


def record_traced_at_bound(gm: torch.fx.GraphModule, state: PipelineState) -> int:
    state.assumed = traced_ranges.traced_at_bound(gm.graph)
    return 0


def strip_range_asserts(gm: torch.fx.GraphModule, state: PipelineState) -> int:
    return traced_ranges.strip_range_asserts(gm.graph, state.options.checked)


def respell_widths(gm: torch.fx.GraphModule, state: PipelineState) -> int:
    return traced_ranges.respell_widths(gm.graph)


def rules(gm: torch.fx.GraphModule, state: PipelineState) -> int:
    if state.changed:
        gm.recompile()  # the graph's code matches the graph before the rules run (as it did before the pipeline)
    state.result = SyncPass(state.options)(gm)
    return len(state.result.rewritten)


def settle_at_bound(gm: torch.fx.GraphModule, state: PipelineState) -> int:
    scratch = state.result.scratch_tables if state.result is not None else ()
    return traced_ranges.settle_at_bound(gm.graph, state.assumed, scratch, state.options.static_escapes)


def recheck_kept(gm: torch.fx.GraphModule, state: PipelineState) -> int:
    return traced_ranges.recheck_kept(gm.graph)


def decide_cudagraphs(gm: torch.fx.GraphModule, state: PipelineState) -> int:
    state.keeps_host_read = holds_unbacked_symbols(gm)
    if state.options.cudagraphs and state.keeps_host_read:
        # A host read or a data-dependent size left in the graph: CUDA graphs would crash on it (torch's
        # reduce-overhead does, with `NameError: buf2`), so this graph runs without them.
        state.patches.pop("triton.cudagraphs", None)
        state.notes.append(CUDAGRAPHS_OFF)
    elif state.options.cudagraphs and state.result is not None and state.result.allocated_scratch:
        # Found on the H200 (2026-12-05): the scratch stored from the first call's graph was that graph's output in
        # the CUDA-graph pool, overwritten by the next replay ("accessing tensor output of CUDAGraphs that has been
        # overwritten by a subsequent run"). This graph runs once per growth, so without CUDA graphs costs little.
        state.patches.pop("triton.cudagraphs", None)
        state.notes.append(CUDAGRAPHS_SCRATCH)
    elif state.options.cudagraphs and not _on_cuda(gm):
        state.notes.append(CUDAGRAPHS_ON_CPU)
    return 0


def plan_outline(gm: torch.fx.GraphModule, state: PipelineState) -> int:
    if not state.options.outline_repeats:
        return 0
    if state.keeps_host_read:
        state.notes.append(OUTLINE_NOT_TRIED)
        return 0
    outlined = outline_repeats(gm)  # a copy: gm itself is not changed
    if outlined.gm is not gm:
        state.outlined = outlined
    else:
        state.notes.append(OUTLINED_NOTHING)
    return 0


def _on_cuda(gm: torch.fx.GraphModule) -> bool:
    """Does any tensor of the graph (its inputs, its intermediate values) live on a CUDA device?"""
    for node in gm.graph.nodes:
        value = _compat.example_value(node)
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values):
            return True
    return False


DECISIONS: tuple[Step, ...] = (  # also all that runs on a graph the pass failed on (compiled untouched)
    Step("decide_cudagraphs", decide_cudagraphs),
    Step("outline_repeats", plan_outline),
)

STEPS: tuple[Step, ...] = (
    Step("record_traced_at_bound", record_traced_at_bound),
    Step("strip_range_asserts", strip_range_asserts),
    Step("respell_widths", respell_widths),
    Step("rules", rules),
    Step("settle_at_bound", settle_at_bound),
    Step("recheck_kept", recheck_kept),
    *DECISIONS,
)


def run(gm: torch.fx.GraphModule, options: SyncfreeOptions, steps: tuple[Step, ...] = STEPS) -> PipelineState:
    """Every step in order on `gm` (changed in place); the graph recompiled once at the end if any step changed
    it. Raises traced_ranges.Retrace where a kept max asks for its frame to be traced again."""
    state = PipelineState(options, options.config_patches())
    for step in steps:
        if step.run(gm, state):
            state.changed.append(step.name)
            _compat.trace_artifact(f"syncfree_step_{step.name}", lambda: {"graph": str(gm.graph)})
    if state.changed:
        gm.recompile()
    return state


def holds_unbacked_symbols(gm: torch.fx.GraphModule) -> bool:
    """Does any node of the graph still hold a data-dependent size (an unbacked symbol)?"""
    for node in gm.graph.nodes:
        value = _compat.example_value(node)
        if value is not None:
            try:
                if _compat.free_unbacked_symbols(value):
                    return True
            except Exception:
                return True  # cannot tell: assume the worst
    return False
