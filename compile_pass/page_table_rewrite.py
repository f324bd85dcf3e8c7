"""PageTableRewrite: the sync-removal pass over a Dynamo FX graph.

Before (Dynamo, capture_scalar_outputs on; B requests, a [R, T] token table, page size 16):

    max_1 = l_fb_seq_lens.max()                                             # [] int64
    item = max_1.item()                                                     # Sym(u0): device-to-host sync
    getitem = l_fb_req_to_token[(l_fb_req_pool_indices, slice(None, item, 16))]   # [B, u1] int32
    sym_size_int = torch.ops.aten.sym_size.int(getitem, 1)                  # Dynamo's bounds on u1:
    _assert_scalar_default = torch.ops.aten._assert_scalar.default(sym_size_int >= 0, ...)   # 0 <= u1 <= T/16
    floordiv = getitem // 16                                                # [B, u1]
    page_table = floordiv.to(torch.int32)
    cache_seqlens = l_fb_seq_lens.to(torch.int32)                           # [B]
    out = torch.ops.syncfree.paged_decode(q, k, v, page_table, cache_seqlens)

After (max_context_len=4096):

    cache_seqlens = l_fb_seq_lens.to(torch.int32)
    page_table = torch.ops.syncfree.page_table.default(
        l_fb_req_to_token, l_fb_req_pool_indices, cache_seqlens, 16, 256)   # [B, 256] int32, built on the device
    out = torch.ops.syncfree.paged_decode(q, k, v, page_table, cache_seqlens)

A max is rewritten only when `prove_static_bound` accepts every use. Upper-bound arguments
(`max_seqlen_k=item`) become the static bound. Consumers of one table that guard by different lengths get a
table each. A kept max stays exactly as eager computes it. With checked=True each rewrite asserts on the device
that every length is within the bound that replaced the max (`aten._assert_async`, no host sync).
"""

from __future__ import annotations

import torch
import torch.fx

from ._compat import example_value, fake_mode_of
from .consumers import lookup_consumer, schema_argument_names
from .find_sync_points import SyncPoint, find_cpu_mirrors, find_sync_points
from .normalize import ceil_div
from .options import SyncfreeOptions
from .prove_static_bound import Proof, prove_static_bound
from .report import SyncItem, SyncReport, node_location


def _erase_if_dead(graph: torch.fx.Graph, nodes) -> None:
    index = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=lambda n: index.get(n, -1), reverse=True):
        if node.graph is graph and not node.users:
            graph.erase_node(node)


def _call(graph: torch.fx.Graph, before: torch.fx.Node, target, args: tuple, like: torch.fx.Node, **kwargs):
    """Insert `target(*args, **kwargs)` before `before`, with a fake example value (Inductor's pre-grad passes
    read it)."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    node.meta["stack_trace"] = like.meta.get("stack_trace")
    inputs = [a for a in args if isinstance(a, torch.fx.Node)]
    mode = fake_mode_of(inputs)
    if mode is not None:
        values = tuple(example_value(a) if isinstance(a, torch.fx.Node) else a for a in args)
        with mode:
            node.meta["example_value"] = target(*values, **kwargs)
    return node


def _set_argument(node: torch.fx.Node, name: str, value) -> None:
    if name in node.kwargs:
        node.update_kwarg(name, value)
        return
    index = schema_argument_names(lookup_consumer(node.target).name).index(name)
    node.update_arg(index, value)


def _insert_bound_check(graph, before: torch.fx.Node, lengths: torch.fx.Node, limit: int, message: str) -> None:
    """Device-side: every length <= limit (so their max is too). An async assertion: no host read."""
    within = _call(graph, before, torch.ops.aten.le.Scalar, (lengths, limit), before)
    every = _call(graph, before, torch.ops.aten.all.default, (within,), before)
    _call(graph, before, torch.ops.aten._assert_async.msg, (every, message), before)


class PageTableRewrite:
    """Find sync points, prove each dynamic max safe, rewrite the safe ones; report everything."""

    def __init__(self, options: SyncfreeOptions):
        self.options = options

    def __call__(self, gm: torch.fx.GraphModule) -> SyncReport:
        graph = gm.graph
        report = SyncReport(options=self.options.to_dict())
        mirrors = find_cpu_mirrors(graph, dict(self.options.cpu_mirrors))
        points = find_sync_points(graph, mirrors)
        kept_values = set()
        disjoint: set = set()

        for point in points:
            if point.kind == "cpu_copy":
                continue  # handled below, after the maxes are gone
            item = SyncItem(point.kind, point.location, "", point.host_sync, point.code)
            if self.options.max_context_len is None:
                item.reason = ("kept: options['max_context_len'] is missing, so no static bound exists "
                               "(pass options={'max_context_len': N})")
            else:
                proof = prove_static_bound(graph, point, mirrors, self.options.page_size,
                                           self.options.max_context_len, self.options.static_escapes)
                if proof.safe:
                    disjoint |= proof.disjoint
                    item.reason = self._rewrite(graph, point, proof)
                    report.rewritten.append(item)
                    continue
                item.reason = "kept: " + proof.reason
            if not point.host_sync:
                item.reason += " (a host read of a CPU mirror: no device sync)"
            report.kept.append(item)
            kept_values.add(point.value)

        self._report_host_copies(graph, points, mirrors, report)
        # What is really left: a rewrite that left a host read behind must not be counted as removed.
        for point in find_sync_points(graph, mirrors):
            if point.kind != "cpu_copy" and point.value not in kept_values:
                report.kept.append(SyncItem(point.kind, point.location,
                                            "kept: still in the graph after the rewrite", point.host_sync,
                                            point.code))
        # Inputs the proofs assumed distinct, as placeholder positions: the backend checks them on every call.
        positions = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
        report.disjoint_inputs = sorted({(positions[a], positions[b]) for a, b in disjoint
                                         if a in positions and b in positions})
        if report.disjoint_inputs:
            names = sorted({f"{a.name} / {b.name}" for a, b in disjoint})
            report.notes.append("assumes these graph inputs never share memory: " + ", ".join(names)
                                + "; a call in which they do runs the graph as captured, without the rewrite")
        # No graph-wide DCE: FX does not know that every in-place op is impure.
        graph.lint()
        gm.recompile()
        return report

    def _rewrite(self, graph, point: SyncPoint, proof: Proof) -> str:
        bound = self.options.max_context_len
        parts = []
        for swap in proof.swaps:
            replacement = swap.twin
            want = getattr(example_value(swap.copy), "dtype", None)
            if getattr(example_value(swap.twin), "dtype", None) != want:
                replacement = _call(graph, swap.consumer, torch.ops.aten._to_copy.default, (swap.twin,), swap.copy,
                                    dtype=want)
            _set_argument(swap.consumer, swap.argument, replacement)
            for plan in proof.gathers:
                for group in plan.groups:
                    if group.lengths is swap.copy and any(c is swap.consumer for c, _ in group.consumers):
                        group.lengths = replacement
            for b in proof.bounds:
                if b.consumer is swap.consumer and b.lengths is swap.copy:
                    b.lengths = replacement
            parts.append(f"lengths read from the device twin {swap.twin.name}")
        checks: dict[tuple, torch.fx.Node] = {}
        dead: list[torch.fx.Node] = []  # erased at the end, once nothing uses them
        tables: dict[torch.fx.Node, torch.fx.Node] = {}  # a plan's old terminal -> its first rebuilt table
        for plan in proof.gathers:
            # As wide as the bound needs, and never wider than the token table (eager's gather is not either).
            table_pages = plan.token_width if plan.page_level else ceil_div(plan.token_width, plan.page_size)
            max_pages = max(1, min(ceil_div(bound + plan.offset, plan.page_size), table_pages))
            for group in plan.groups:
                first = group.consumers[0][0]
                lengths, page_size = group.lengths, plan.page_size
                if plan.page_level:  # page ids already: copy ceil(length / ps) of them per row
                    rounded = _call(graph, first, torch.ops.aten.add.Tensor, (lengths, page_size - 1), first)
                    lengths = _call(graph, first, torch.ops.aten.div.Tensor_mode, (rounded, page_size), first,
                                    rounding_mode="floor")
                    page_size = 1
                table = _call(graph, first, torch.ops.syncfree.page_table.default,
                              (plan.req_to_token, plan.req_pool_indices, lengths, page_size, max_pages,
                               False), plan.chain[0])
                tables.setdefault(plan.terminal, table)
                for consumer, entry in group.consumers:
                    _set_argument(consumer, entry.page_table, table)
                checks.setdefault((group.lengths, bound + group.length_offset), first)
            dead += plan.bookkeeping + plan.chain
            level = ", from a page-level table" if plan.page_level else ""
            parts.append(f"page table -> syncfree.page_table width {max_pages} (page_size {plan.page_size}{level})")
        for b in proof.bounds:
            value = bound + b.offset
            _set_argument(b.consumer, b.argument, value)
            checks.setdefault((b.lengths, bound + b.length_offset), b.consumer)
            parts.append(f"{b.argument} -> {value}")
        if self.options.checked:
            for (lengths, limit), before in checks.items():
                _insert_bound_check(graph, before, lengths, limit,
                                    f"syncfree: a sequence length exceeds the static bound that replaced its max "
                                    f"(max_context_len={bound}) at {node_location(before)}")
            parts.append("lengths asserted on the device")
        for check in proof.checks:
            _insert_bound_check(graph, check.compare, check.lengths, check.limit,
                                f"syncfree: the check at {node_location(check.compare)} failed: a length exceeds "
                                f"{check.limit}")
            dead += check.asserts + [check.compare]
            parts.append(f"the check at {node_location(check.compare)} runs on the device")
        if proof.escapes:
            parts.append(self._static_escapes(graph, proof, tables))
        dead += proof.offsets + [point.value] + point.nodes + [swap.copy for swap in proof.swaps]
        _erase_if_dead(graph, dead)
        return "rewritten: " + "; ".join(parts)

    def _static_escapes(self, graph, proof: Proof, tables) -> str:
        """options['static_escapes']: what leaves the graph leaves at the static width / as the static bound."""
        output = graph.output_node()
        replace: dict[torch.fx.Node, object] = {}
        for escape in proof.escapes:
            limit = self.options.max_context_len + escape.offset
            if escape.what == "max":
                replace[escape.node] = limit
            elif escape.what == "table":
                replace[escape.node] = tables[escape.node]
            else:
                pages = tables[escape.table].meta["example_value"].shape[1]
                replace[escape.node] = _call(graph, output, torch.arange, (0, pages * escape.page_size,
                                                                          escape.page_size), escape.node,
                                             device=example_value(escape.node).device)
        output.args = torch.fx.node.map_aggregate(output.args, lambda a: replace.get(a, a) if isinstance(
            a, torch.fx.Node) else a)
        return "escaping metadata leaves at the static bound (options['static_escapes'])"

    @staticmethod
    def _report_host_copies(graph, points, mirrors, report: SyncReport) -> None:
        """Unused host copies are erased; used ones, and uploads of a CPU mirror, are kept and reported."""
        for point in points:
            if point.kind != "cpu_copy" or point.value.graph is not graph:
                continue
            if not point.value.users:
                graph.erase_node(point.value)
                report.rewritten.append(SyncItem("cpu_copy", point.location, "erased: the host copy is unused",
                                                 point.host_sync, point.code))
            else:
                report.kept.append(SyncItem("cpu_copy", point.location,
                                            "kept: the host copy is used (the caller or host code needs it)",
                                            point.host_sync, point.code))
        for mirror in mirrors:
            for user in mirror.users:
                device = getattr(example_value(user), "device", None)
                if user.op != "call_method" or user.target not in ("to", "cuda") or device is None \
                        or device.type == "cpu":
                    continue
                report.kept.append(SyncItem(
                    "cpu_mirror", node_location(user),
                    f"kept: {mirror.name} (a CPU tensor) is copied to {device}; only a rewritten consumer's lengths "
                    "read the device twin instead", device.type == "cuda"))
