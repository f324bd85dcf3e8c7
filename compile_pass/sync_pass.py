"""The driver: find the host reads, prove a plan for each on the untouched graph, then apply the plans.

    reads = find_sync_points(graph, mirrors)                   # neutral: kind, value, nodes, reduction, source
    reads += rule.find(graph, ctx) for a rule that finds its own (optional)
    plans = [rule.prove(read, ctx) for read in reads]          # every proof on the untouched graph, one WriteLog
    for plan in plans: rule.rewrite(plan, graph, options)      # then every rewrite
    return PassResult(rewritten, kept, disjoint_inputs, notes) # the backend decides from this, and reports it

Plans that would edit the same nodes are not both applied: the later one is kept with the reason `overlap`. A new
rule is a file in rules/ and is not an edit here.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from ._compat import example_value, placeholder_source_name
from .find_sync_points import SyncPoint, find_cpu_mirrors, find_sync_points
from .fx_util import node_location
from .normalize import DEVICE_COPY_METHODS
from .options import SyncfreeOptions
from .proof import ProofContext, Unsafe
from .report import SyncItem, escape_location, name_inputs_as_written, occurrence_fields
from .rules import registered_rules


@dataclasses.dataclass
class PassResult:
    """What the pass did to one graph: the backend reads this for its decisions and builds the report from it."""

    rewritten: list[SyncItem] = dataclasses.field(default_factory=list)
    kept: list[SyncItem] = dataclasses.field(default_factory=list)
    # Pairs of graph-input positions the rewrites assume never share memory (checked on every call), and the
    # same pairs by their sources' names, for the report.
    disjoint_inputs: list = dataclasses.field(default_factory=list)
    disjoint_names: list = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    # Positions of the graph inputs that applied rewrites proved to be persistent buffers written in place by a
    # registered bounded writer (a plan's `static_inputs`), and their sources' names: the backend makes them static
    # inputs of the CUDA graph when it keeps CUDA graphs on.
    static_inputs: list = dataclasses.field(default_factory=list)
    static_names: list = dataclasses.field(default_factory=list)
    # An applied rewrite allocates a scratch that the step stores for later steps (a plan's `allocated_scratch`):
    # the backend runs this graph without CUDA graphs, whose memory pool the next replay would reuse under it.
    allocated_scratch: bool = False
    # The applied rewrites' sliced scratch tables (traced_ranges.ScratchTable), for settle_at_bound.
    scratch_tables: list = dataclasses.field(default_factory=list)


def _item(point: SyncPoint, reason: str, code: str = "", rule: str = "") -> SyncItem:
    item = SyncItem(point.kind, point.location, reason, point.host_sync, point.code, code, rule,
                    **occurrence_fields(point.value))
    if code == "escapes":
        item.escape_location = escape_location(point.value)
    return item


def _input_name(node: torch.fx.Node) -> str:
    return placeholder_source_name(node) or node.name


class SyncPass:
    """Find sync points, prove each with the first rule that matches it, rewrite the proven ones."""

    def __init__(self, options: SyncfreeOptions):
        self.options = options

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        graph = gm.graph
        result = PassResult()
        mirrors = find_cpu_mirrors(graph, dict(self.options.cpu_mirrors))
        ctx = ProofContext(graph, mirrors, self.options)
        rules = registered_rules()
        points = find_sync_points(graph, mirrors)
        # A rule whose host value is not a reduction read on the host (a host int declared equal to one, say)
        # finds its own points; each is proven by the first rule that matches it, like every other point.
        points += [point for rule in rules if hasattr(rule, "find") for point in rule.find(graph, ctx)]
        proven: list[tuple] = []
        kept_values = set()
        touched: set = set()
        for point in points:
            if point.kind == "cpu_copy":
                continue  # handled below, after the rewrites
            rule = next((r for r in rules if r.match(point)), None)
            if rule is None:
                self._keep(result, point, "not a max over a lengths tensor: no rule applies", "no_rule", "")
                kept_values.add(point.value)
                continue
            try:
                plan = rule.prove(point, ctx)
                if plan.touches & touched:
                    raise Unsafe("overlap", "another rewrite in this graph edits the same nodes")
            except Unsafe as e:
                self._keep(result, point, e.message, e.code, rule.name)
                kept_values.add(point.value)
                continue
            touched |= plan.touches
            proven.append((point, rule, plan))
        disjoint: set = set()
        static: set = set()
        for point, rule, plan in proven:  # every proof was made on the untouched graph; now edit it
            reason = rule.rewrite(plan, graph, self.options)
            result.rewritten.append(_item(point, reason, "", rule.name))
            disjoint |= plan.disjoint
            static |= getattr(plan, "static_inputs", frozenset())
            result.allocated_scratch |= getattr(plan, "allocated_scratch", False)
            result.scratch_tables += getattr(plan, "scratch_tables", ())
        self._host_copies(graph, points, mirrors, result)
        # What is really left: a rewrite that left a host read behind must not be counted as removed.
        for point in find_sync_points(graph, mirrors):
            if point.kind != "cpu_copy" and point.value not in kept_values:
                result.kept.append(_item(point, "kept: still in the graph after the rewrite", "still_in_graph"))
        positions = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
        pairs = sorted({(positions[a], positions[b]) for a, b in disjoint if a in positions and b in positions})
        result.disjoint_inputs = pairs
        result.disjoint_names = sorted({(_input_name(a), _input_name(b)) for a, b in disjoint
                                        if a in positions and b in positions})
        result.static_inputs = sorted(positions[n] for n in static if n in positions)
        result.static_names = [_input_name(n) for n in sorted((n for n in static if n in positions),
                                                              key=positions.__getitem__)]
        # Reasons name the graph's inputs as the user's code does (`verify_lens`, not `l_verify_lens_`), for every
        # caller of the pass (the backend's number_occurrences does it too, for the items it adds).
        name_inputs_as_written(result.rewritten + result.kept, graph)
        # No graph-wide DCE: FX does not know that every in-place op is impure.
        graph.lint()
        gm.recompile()
        return result

    @staticmethod
    def _keep(result: PassResult, point: SyncPoint, message: str, code: str, rule: str) -> None:
        reason = "kept: " + message
        if not point.host_sync:
            reason += f" ({point.kept_note})"
        result.kept.append(_item(point, reason, code, rule))

    @staticmethod
    def _host_copies(graph, points, mirrors, result: PassResult) -> None:
        """Unused host copies are erased; used ones, and uploads of a CPU mirror, are kept and reported."""
        for point in points:
            if point.kind != "cpu_copy" or point.value.graph is not graph:
                continue
            if not point.value.users:
                graph.erase_node(point.value)
                result.rewritten.append(_item(point, "erased: the host copy is unused"))
            else:
                result.kept.append(_item(point, "kept: the host copy is used (the caller or host code needs it)",
                                         "host_copy_used"))
        for mirror in mirrors:
            for user in mirror.users:
                device = getattr(example_value(user), "device", None)
                if user.op != "call_method" or user.target not in DEVICE_COPY_METHODS or device is None \
                        or device.type == "cpu":
                    continue
                result.kept.append(SyncItem(
                    "cpu_mirror", node_location(user),
                    f"kept: {mirror.name} (a CPU tensor) is copied to {device}; only a rewritten consumer's lengths "
                    "read the device twin instead", device.type == "cuda", "", "mirror_upload"))
