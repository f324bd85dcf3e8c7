"""Small helpers over torch.fx graphs that every rule uses: where a node came from, and how to edit a graph."""

from __future__ import annotations

import torch
import torch.fx

from ._compat import example_value, fake_mode_of
from .consumers import resolved_overload
from .mutations import region_body
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


def insert_lower_assert(graph, before: torch.fx.Node, values: torch.fx.Node, low: int, message: str) -> None:
    """Device-side: max(values) >= low (a user's or Dynamo's `m >= k` on a max, kept exactly). As amax, not
    any(values >= low): Inductor (torch 2.11, CUDA) stores a bool reduction as int8 and then fails to compile the
    device assert on it ('tt.assert' wants i1; seen on the H200)."""
    most = insert_call(graph, before, torch.ops.aten.amax.default, (values,), before)
    holds = insert_call(graph, before, torch.ops.aten.ge.Scalar, (most, low), before)
    insert_call(graph, before, torch.ops.aten._assert_async.msg, (holds, message), before)


def insert_value_assert(graph, before: torch.fx.Node, lengths: torch.fx.Node, wide: torch.fx.Node,
                        message: str, offset: int = 0) -> None:
    """Device-side: every value of `lengths` <= max(wide) + offset. An async assertion: no host read. Compared in
    the wider of the two dtypes: the max is 0-dim, and type promotion casts a 0-dim tensor to the other operand's
    dtype, so an int64 max against int32 lengths would wrap to int32, exactly the values this checks for."""
    most = insert_call(graph, before, torch.ops.aten.amax.default, (wide,), before)
    if offset:
        most = insert_call(graph, before, torch.ops.aten.add.Scalar, (most, offset), before)
    have, most_value = example_value(lengths), example_value(most)
    dtype = most_value.dtype if most_value is not None else torch.int64  # lengths are integers: int64 holds any
    if have is None or torch.promote_types(have.dtype, dtype) != have.dtype:
        lengths = insert_call(graph, before, torch.ops.aten._to_copy.default, (lengths,), before, dtype=dtype)
    within = insert_call(graph, before, torch.ops.aten.le.Tensor, (lengths, most), before)
    every = insert_call(graph, before, torch.ops.aten.all.default, (within,), before)
    insert_call(graph, before, torch.ops.aten._assert_async.msg, (every, message), before)


def argument_names(node: torch.fx.Node) -> list[str]:
    """The schema's argument names of the overload a call runs (empty when it has none)."""
    overload = resolved_overload(node)
    return [a.name for a in overload._schema.arguments] if overload is not None else []


def set_argument(node: torch.fx.Node, name: str, value) -> None:
    """Give the op call `node` the argument `name` (by its schema): where the call passes it, by position or by
    keyword; as a keyword when it does not pass it."""
    if name in node.kwargs:
        node.update_kwarg(name, value)
        return
    names = argument_names(node)
    index = names.index(name) if name in names else len(node.args)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def replace_uses(node: torch.fx.Node, old: torch.fx.Node, new) -> None:
    """Every occurrence of `old` in `node`'s arguments, however deeply nested (a Triton launch's kwargs), becomes
    `new` (a node or a constant)."""
    swap = lambda a: new if a is old else a  # noqa: E731
    node.args = torch.fx.node.map_aggregate(node.args, swap)
    node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)


def replace_in_output(graph: torch.fx.Graph, replace: dict) -> None:
    """What the graph returns: each node of `replace` becomes its value (a node or a constant)."""
    output = graph.output_node()
    output.args = torch.fx.node.map_aggregate(output.args, lambda a: replace.get(a, a) if isinstance(
        a, torch.fx.Node) else a)


def drop_constant_region_inputs(graph: torch.fx.Graph) -> None:
    """A region's input that its body never reads and that every call of that body now passes as a constant
    (the static width, where Dynamo passed the dynamic one) leaves the body and the calls: Inductor wants every
    operand of invoke_subgraph to be a node. An input some call still passes as a node stays (another plan may
    still rewrite it; unused, it costs nothing)."""
    calls: dict[int, tuple] = {}
    for node in graph.nodes:
        region = region_body(node)
        if region is not None:
            calls.setdefault(id(region[0]), (region[0], []))[1].append(node)
    for body, users in calls.values():
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        drop = [i for i, ph in enumerate(placeholders)
                if not ph.users and all(len(c.args) == 2 + len(placeholders) for c in users)
                and all(not isinstance(c.args[2 + i], torch.fx.Node) for c in users)]
        if not drop:
            continue
        for c in users:
            c.args = tuple(a for j, a in enumerate(c.args) if j - 2 not in drop)
        for i in reversed(drop):
            body.graph.erase_node(placeholders[i])
        body.recompile()


def size_node(graph: torch.fx.Graph, before: torch.fx.Node, tensor: torch.fx.Node, dim: int):
    """`tensor.size(dim)` as a graph value: an int when static, else a `sym_size` node (a SymInt)."""
    size = example_value(tensor).shape[dim]
    if isinstance(size, int):
        return size
    with graph.inserting_before(before):
        node = graph.call_function(torch.ops.aten.sym_size.int, (tensor, dim))
    node.meta["example_value"] = size
    return node


def flat_tensors(value) -> list:
    """The tensors in a (nested) tuple/list value, in order: a node's outputs, for comparing shapes."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat_tensors(v)]
    return []
