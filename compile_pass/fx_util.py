"""Small helpers over torch.fx graphs that every rule uses: where a node came from, and how to edit a graph."""

from __future__ import annotations

import torch
import torch.fx

from ._compat import example_value, fake_mode_of
from .report import node_location, user_location  # noqa: F401  (re-exported: one home for locations)


def code_line(node: torch.fx.Node) -> str:
    """The user's source line that made `node` (the last frame of its stack trace), or ''."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    # The last frame's code line follows its "File ..." line; caret lines are dropped.
    code = [ln for ln in lines if ln and not ln.startswith("File ") and set(ln) - set("^~ ")]
    return code[-1] if code else ""


def insert_call(graph: torch.fx.Graph, before: torch.fx.Node, target, args: tuple, like: torch.fx.Node, **kwargs):
    """Insert `target(*args, **kwargs)` before `before`, with `like`'s stack trace and a fake example value
    (Inductor's pre-grad passes read it)."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    node.meta["stack_trace"] = like.meta.get("stack_trace")
    inputs = [a for a in args if isinstance(a, torch.fx.Node)]
    # the mode from the inputs, else from the nodes around (a call with only ints, before a node whose value is a
    # tuple, finds it in that node's own inputs)
    mode = fake_mode_of(inputs + [like, before]) or fake_mode_of([*like.all_input_nodes, *before.all_input_nodes])
    if mode is not None:
        values = tuple(example_value(a) if isinstance(a, torch.fx.Node) else a for a in args)
        with mode:
            node.meta["example_value"] = target(*values, **kwargs)
    return node


def erase_if_dead(graph: torch.fx.Graph, nodes) -> None:
    """Erase those of `nodes` that nothing uses any more, last first (so a chain goes whole)."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=lambda n: index.get(n, -1), reverse=True):
        if node.graph is graph and not node.users:
            graph.erase_node(node)


def insert_device_assert(graph, before: torch.fx.Node, lengths: torch.fx.Node, limit: int | None, message: str,
                         low: int | None = None) -> None:
    """Device-side: every length <= limit (so their max is too), and >= low when given. An async assertion: no
    host read."""
    within = None
    if limit is not None:
        within = insert_call(graph, before, torch.ops.aten.le.Scalar, (lengths, limit), before)
    if low is not None:
        above = insert_call(graph, before, torch.ops.aten.ge.Scalar, (lengths, low), before)
        within = above if within is None else insert_call(graph, before, torch.ops.aten.logical_and.default,
                                                          (within, above), before)
    every = insert_call(graph, before, torch.ops.aten.all.default, (within,), before)
    insert_call(graph, before, torch.ops.aten._assert_async.msg, (every, message), before)


def insert_value_assert(graph, before: torch.fx.Node, lengths: torch.fx.Node, wide: torch.fx.Node,
                        message: str) -> None:
    """Device-side: every value of `lengths` <= max(wide). An async assertion: no host read."""
    most = insert_call(graph, before, torch.ops.aten.amax.default, (wide,), before)
    within = insert_call(graph, before, torch.ops.aten.le.Tensor, (lengths, most), before)
    every = insert_call(graph, before, torch.ops.aten.all.default, (within,), before)
    insert_call(graph, before, torch.ops.aten._assert_async.msg, (every, message), before)


def flat_tensors(value) -> list:
    """The tensors in a (nested) tuple/list value, in order: a node's outputs, for comparing shapes."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat_tensors(v)]
    return []
