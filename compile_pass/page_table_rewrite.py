"""PageTableRewrite: the sync-removal pass over a Dynamo FX graph.

Before (Dynamo, capture_scalar_outputs on):

    max_1 = l_fb_seq_lens.max()
    item = max_1.item()                                              # device-to-host sync
    getitem = l_fb_req_to_token[(l_fb_req_pool_indices, slice(None, item, 16))]
    sym_size_int = torch.ops.aten.sym_size.int(getitem, 1)            # bounds of the unbacked width
    _assert_scalar_default = torch.ops.aten._assert_scalar.default(sym_size_int >= 0, ...)
    floordiv = getitem // 16
    page_table = floordiv.to(torch.int32)
    cache_seqlens = l_fb_seq_lens.to(torch.int32)
    out = torch.ops.syncfree.paged_decode(q, k, v, page_table, cache_seqlens)

After (max_context_len=4096):

    cache_seqlens = l_fb_seq_lens.to(torch.int32)
    page_table = torch.ops.syncfree.page_table.default(
        l_fb_req_to_token, l_fb_req_pool_indices, cache_seqlens, 16, 256)   # static width, device-built
    out = torch.ops.syncfree.paged_decode(q, k, v, page_table, cache_seqlens)

A max is rewritten only when `prove_static_bound` accepts every use. Upper-bound arguments
(`max_seqlen_k=item`) become the static bound. A kept max stays exactly as eager computes it.
Also: `X_cpu.to(device)` becomes the device twin `X`, and unused host copies are erased.
"""

from __future__ import annotations

import torch
import torch.fx

from ._compat import example_value, fake_mode_of
from .consumers import bind_arguments, lookup_consumer, schema_argument_names
from .find_sync_points import SyncPoint, find_cpu_mirrors, find_sync_points
from .options import SyncfreeOptions
from .prove_static_bound import GatherPlan, Proof, prove_static_bound
from .report import SyncItem, SyncReport, user_location


def _erase_if_dead(graph: torch.fx.Graph, nodes) -> None:
    for node in sorted(set(nodes), key=_order(graph), reverse=True):
        if node.graph is graph and not node.users:
            graph.erase_node(node)


def _order(graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index.get(n, -1)


def _insert_page_table(graph: torch.fx.Graph, plan: GatherPlan, lengths_of, max_pages: int, checked: bool):
    first = min((c for c, _ in plan.consumers), key=_order(graph))
    lengths = lengths_of(first, plan.consumers[0][1])
    with graph.inserting_before(first):
        node = graph.call_function(
            torch.ops.syncfree.page_table.default,
            (plan.req_to_token, plan.req_pool_indices, lengths, plan.page_size, max_pages, checked),
        )
    node.meta["stack_trace"] = plan.chain[0].meta.get("stack_trace")
    mode = fake_mode_of([plan.req_to_token, plan.req_pool_indices, lengths])
    if mode is not None:
        args = [example_value(a) for a in (plan.req_to_token, plan.req_pool_indices, lengths)]
        with mode:
            node.meta["example_value"] = torch.ops.syncfree.page_table.default(
                *args, plan.page_size, max_pages, checked
            )
    return node


def _set_argument(node: torch.fx.Node, name: str, value) -> None:
    if name in node.kwargs:
        node.update_kwarg(name, value)
        return
    index = schema_argument_names(lookup_consumer(node.target).name).index(name)
    node.update_arg(index, value)


class PageTableRewrite:
    """Find sync points, prove each dynamic max safe, rewrite the safe ones; report everything."""

    def __init__(self, options: SyncfreeOptions):
        self.options = options

    def __call__(self, gm: torch.fx.GraphModule) -> SyncReport:
        graph = gm.graph
        report = SyncReport(options=self.options.to_dict())
        mirrors = find_cpu_mirrors(graph, dict(self.options.cpu_mirrors))
        points = find_sync_points(graph, mirrors)

        def lengths_of(consumer_node, entry):
            return bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs)[entry.lengths]

        for point in points:
            if point.kind == "cpu_copy":
                continue  # handled below, after the maxes are gone
            item = SyncItem(point.kind, point.location, "", point.host_sync, point.code)
            if self.options.max_context_len is None:
                item.reason = ("kept: options['max_context_len'] is missing, so no static bound exists "
                               "(pass options={'max_context_len': N})")
                report.kept.append(item)
                continue
            proof = prove_static_bound(point, mirrors, self.options.page_size)
            if not proof.safe:
                item.reason = "kept: " + proof.reason
                if not point.host_sync:
                    item.reason += " (a host read of a CPU mirror: no device sync)"
                report.kept.append(item)
                continue
            item.reason = self._rewrite(graph, point, proof, lengths_of)
            report.rewritten.append(item)

        self._move_mirror_reads(graph, mirrors, report)
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
        # No graph-wide DCE: FX does not know in-place methods (index_copy_ into the KV pool) are impure.
        graph.lint()
        gm.recompile()
        return report

    def _rewrite(self, graph, point: SyncPoint, proof: Proof, lengths_of) -> str:
        bound = self.options.max_context_len
        parts = []
        for plan in proof.gathers:
            limit = bound + plan.offset
            max_pages = max(1, -(-limit // plan.page_size))
            new = _insert_page_table(graph, plan, lengths_of, max_pages, self.options.checked)
            plan.terminal.replace_all_uses_with(new)
            _erase_if_dead(graph, plan.bookkeeping)
            _erase_if_dead(graph, plan.chain)
            parts.append(f"page table -> syncfree.page_table width {max_pages} (page_size {plan.page_size})")
        for b in proof.bounds:
            value = bound + b.offset
            _set_argument(b.consumer, b.argument, value)
            parts.append(f"{b.argument} -> {value}")
        _erase_if_dead(graph, proof.offsets)
        _erase_if_dead(graph, [point.value] + point.nodes)
        return "rewritten: " + "; ".join(parts)

    @staticmethod
    def _move_mirror_reads(graph, mirrors, report: SyncReport) -> None:
        """`X_cpu.to(device)` / `X_cpu.cuda()` become the device twin X (with X's dtype cast if needed)."""
        for mirror, twin in mirrors.items():
            for user in list(mirror.users):
                if user.op != "call_method" or user.target not in ("to", "cuda"):
                    continue
                moved = [a for a in list(user.args[1:]) + list(user.kwargs.values())
                         if isinstance(a, (str, torch.device)) and torch.device(a).type != "cpu"]
                if user.target == "to" and not moved:
                    continue
                loc = user_location(user.meta.get("stack_trace"))
                if twin is None:
                    report.kept.append(SyncItem("cpu_mirror", loc,
                                                "kept: a CPU mirror copied to the device, and its device twin "
                                                "does not reach the graph (name it in options['cpu_mirrors'])",
                                                False))
                    continue
                want, have = example_value(user), example_value(twin)
                if getattr(want, "device", None) != getattr(have, "device", None):
                    report.kept.append(SyncItem("cpu_mirror", loc,
                                                f"kept: the device twin {twin.name} is on {getattr(have, 'device', '?')}, "
                                                f"not on {getattr(want, 'device', '?')} where the copy goes", False))
                    continue
                replacement = twin
                if getattr(want, "dtype", None) is not None and getattr(have, "dtype", None) != want.dtype:
                    with graph.inserting_before(user):
                        replacement = graph.call_method("to", (twin, want.dtype))
                    replacement.meta.update(user.meta)
                user.replace_all_uses_with(replacement)
                graph.erase_node(user)
                report.rewritten.append(SyncItem("cpu_mirror", loc, f"rewritten: read from the device twin {twin.name}",
                                                 True))
