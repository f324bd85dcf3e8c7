"""Outline the repeated stretches of a whole-model graph into one compiled region, so that AOTAutograd and Inductor
compile a layer's work once and call it for every layer (option `outline_repeats`).

A user who compiles the whole model, with no `torch.compiler.nested_compile_region` of their own, gives Dynamo a
flat graph of 32 identical layers, and Inductor lowers and schedules every one of them (17.6 of the 8B step's 35.7 s
cold first call on the H200). This pass finds the stretches that repeat and turns each into a call of one shared
body, the graph Dynamo itself builds for a `nested_compile_region`:

    before (the whole model; the KV write, an op that writes its arguments, cuts the graph into stretches)

        x1 = <layer 0's attention and MLP, layer 1's norm, QKV, RoPE>(x0, q0, k_cache0, wo0, ..., wqkv1)
        q1, k1, v1 = ...
        store_kv(k_pool1, v_pool1, 0, loc, k1, v1)
        k_cache1 = k_pool1[0]
        x2 = <the same ops on layer 1's and 2's weights>(x1, q1, k_cache1, wo1, ..., wqkv2)

    after

        k_cache1 = k_pool1[0]                                   # a view of a graph input stays outside
        repeat_0 = self.syncfree_repeat_0
        out = invoke_subgraph(repeat_0, 'syncfree_repeat_0', x1, q1, k_cache1, wo1, ..., wqkv2)
        x2, q2, k2, v2 = out[0], out[1], out[2], out[3]

What may go into a body (everything else cuts the graph, and stays where it is):
  - a call known to write nothing (compile_pass.mutations.written_by: default deny) and not random;
  - whose value is a tensor or a tuple of tensors with static sizes, strides and offsets (a graph with symbolic or
    data-dependent sizes is not outlined);
  - not a higher-order op (a graph that already has regions is left alone).
A stretch becomes a body only when invoke_subgraph's own rules hold for it: nothing it returns shares memory with
an operand or with another thing it returns, and no two operands share memory (a view of an operand is computed
outside, before the call). Stretches outline together only when they are the same ops in the same order on
operands of the same sizes, strides, offsets, dtypes and devices, at least two of them, of at least
`MIN_BODY_NODES` nodes. Values are unchanged: the same ops run on the same operands, in an order that only moves
write-free ops.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from . import _compat
from ._compat import example_value, storage_id
from .mutations import written_by

# A body smaller than this is not worth a region: the call and its outputs cost more compile time than it saves.
MIN_BODY_NODES = 8
BODY_PREFIX = "syncfree_repeat_"
# Methods that leave the device or give a host value: never inside a body.
_HOST_METHODS = frozenset({"item", "tolist", "numpy", "cpu", "cuda", "pin_memory", "data_ptr", "untyped_storage"})


@dataclasses.dataclass
class OutlineResult:
    """What the pass did: the graph to compile (a new GraphModule when anything was outlined, else the one given),
    the bodies and the calls of each."""

    gm: torch.fx.GraphModule
    bodies: int = 0
    calls: int = 0
    body_nodes: int = 0

    def note(self) -> str:
        return (f"outline_repeats: {self.calls} repeated stretches of the graph run as calls of {self.bodies} "
                f"compiled region(s) ({self.body_nodes} nodes in the bodies), each body compiled once")


class _NotCanonical(Exception):
    """An argument the signature cannot compare by value: its stretch is not outlined."""


def _static_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and all(isinstance(s, int) for s in (*t.shape, *t.stride())) \
        and isinstance(t.storage_offset(), int)


def _tensors_of(value) -> list | None:
    """The tensors of a node's value, when it is a static tensor or a non-empty tuple/list of them; else None."""
    if isinstance(value, torch.Tensor):
        return [value] if _static_tensor(value) else None
    if isinstance(value, (tuple, list)) and value and all(_static_tensor(v) for v in value):
        return list(value)
    return None


def _random(node: torch.fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    packet = getattr(torch.ops.aten, name, None) if name else None
    if isinstance(packet, torch._ops.OpOverloadPacket):
        return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())
    return False


def outlinable(node: torch.fx.Node) -> bool:
    """May this node run inside an outlined body? (Write-free, not random, static tensor values, no HOP.)"""
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return False
    if node.op == "call_method" and node.target in _HOST_METHODS:
        return False
    if _tensors_of(example_value(node)) is None:
        return False
    for arg in node.all_input_nodes:
        if _tensors_of(example_value(arg)) is None:
            return False
    if _random(node):
        return False
    return not written_by(node)


def runs_of_outlinable(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """Maximal runs of consecutive outlinable nodes. A run of consecutive nodes of a topologically ordered graph is
    convex: no path leaves it and comes back, so it can be replaced by one call."""
    runs, run = [], []
    for node in graph.nodes:
        if outlinable(node):
            run.append(node)
        else:
            if run:
                runs.append(run)
            run = []
    if run:
        runs.append(run)
    return runs


def _storages(node: torch.fx.Node) -> set:
    return {storage_id(t) for t in (_tensors_of(example_value(node)) or [])}


@dataclasses.dataclass
class _Stretch:
    body: list  # the nodes that go into the body, in graph order
    inputs: list  # the operands, in first-use order
    live_out: list  # positions (in body) of the nodes used after the stretch
    signature: tuple


def _split_off_input_views(run: list) -> list:
    """The run less the nodes that must run before the call, in the outer graph: those used after the run whose
    value shares memory with an operand (a view of an input: invoke_subgraph may not return an alias of an
    operand), those that select from a tuple operand (operands are tensors), and every node of the run these
    depend on. A view of an operand used only inside the run stays in the body."""
    members = set(run)
    operand_storages: set = set()
    for node in run:
        for arg in node.all_input_nodes:
            if arg not in members:
                operand_storages |= _storages(arg)
    hoist = []
    for node in run:
        live_out = any(u not in members for u in node.users)
        tuple_operand = any(a not in members and not isinstance(example_value(a), torch.Tensor)
                            for a in node.all_input_nodes)
        if tuple_operand or (live_out and _storages(node) & operand_storages):
            hoist.append(node)
    outside: set = set()
    while hoist:  # and what they depend on in the run: the set is closed under inputs, so it can run first
        node = hoist.pop()
        if node not in outside:
            outside.add(node)
            hoist.extend(a for a in node.all_input_nodes if a in members)
    return [n for n in run if n not in outside]


def _canon(value, index: dict, slots: dict):
    if isinstance(value, torch.fx.Node):
        if value in index:
            return ("n", index[value])
        return ("in", slots.setdefault(value, len(slots)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canon(v, index, slots) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _canon(v, index, slots)) for k, v in sorted(value.items())))
    if isinstance(value, slice):
        return ("slice", _canon(value.start, index, slots), _canon(value.stop, index, slots),
                _canon(value.step, index, slots))
    if isinstance(value, float):
        return ("float", repr(value))  # -0.0 and nan compare as themselves
    if value is None or value is Ellipsis or isinstance(value, (bool, int, str, torch.dtype, torch.device,
                                                                 torch.memory_format, torch.layout)):
        return (type(value).__name__, value)
    raise _NotCanonical(type(value).__name__)


def _operand_layout(node: torch.fx.Node) -> tuple:
    t = example_value(node)
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device, t.requires_grad)


def _stretch(run: list) -> _Stretch | None:
    body = _split_off_input_views(run)
    if len(body) < MIN_BODY_NODES:
        return None
    members = set(body)
    index = {n: i for i, n in enumerate(body)}
    slots: dict = {}
    try:
        ops = tuple((n.op, n.target, _canon(n.args, index, slots), _canon(dict(n.kwargs), index, slots))
                    for n in body)
    except _NotCanonical:
        return None
    inputs = list(slots)
    if any(not isinstance(example_value(a), torch.Tensor) for a in inputs):
        return None
    operand_storages = [storage_id(example_value(a)) for a in inputs]
    if None in operand_storages or len(set(operand_storages)) != len(operand_storages):
        return None  # operands that share memory (or of unknown memory)
    live_out = [i for i, n in enumerate(body) if any(u not in members for u in n.users)]
    if not live_out or any(not isinstance(example_value(body[i]), torch.Tensor) for i in live_out):
        return None
    out_storages = [storage_id(example_value(body[i])) for i in live_out]
    if None in out_storages or len(set(out_storages)) != len(out_storages) or set(out_storages) & set(operand_storages):
        return None  # outputs that alias each other or an operand
    signature = (ops, tuple(_operand_layout(a) for a in inputs))
    return _Stretch(body, inputs, live_out, signature)


def _fresh_name(gm: torch.fx.GraphModule, k: int) -> str:
    while hasattr(gm, f"{BODY_PREFIX}{k}"):
        k += 1
    return f"{BODY_PREFIX}{k}"


def _body_module(first: _Stretch, outputs: list) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict = {}
    for slot, operand in enumerate(first.inputs):
        placeholder = graph.placeholder(f"arg{slot}_{operand.name}")
        placeholder.meta["example_value"] = example_value(operand)
        env[operand] = placeholder
    for node in first.body:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[first.body[i]] for i in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _replace_with_call(gm: torch.fx.GraphModule, stretch: _Stretch, name: str, outputs: list,
                       replaced: dict) -> None:
    """Replace the stretch by a call of the body `name`; `replaced` maps the nodes earlier replacements took out
    of the graph (an earlier stretch's outputs, this one's operands) to what stands for them now."""
    graph = gm.graph
    last = stretch.body[-1]
    with graph.inserting_after(last):
        attr = graph.get_attr(name)
    operands = [replaced.get(a, a) for a in stretch.inputs]
    with graph.inserting_after(attr):
        call = graph.call_function(_compat.invoke_subgraph_op(), (attr, name, *operands))
    call.meta["example_value"] = tuple(example_value(stretch.body[i]) for i in outputs)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in last.meta:
            call.meta[key] = last.meta[key]
    members = set(stretch.body)
    anchor = call
    for position, i in enumerate(outputs):
        node = stretch.body[i]
        if all(u in members for u in node.users):
            continue  # an output another call of this body needs, not this one
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, position))
        item.meta.update(node.meta)
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        replaced[node] = item
        anchor = item
    for node in reversed(stretch.body):
        graph.erase_node(node)


def outline_repeats(gm: torch.fx.GraphModule) -> OutlineResult:
    """The repeated stretches of `gm` as calls of shared bodies, on a copy (gm itself is not changed)."""
    if _compat.invoke_subgraph_op() is None:
        return OutlineResult(gm)
    if any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in gm.graph.nodes if n.op == "call_function"):
        return OutlineResult(gm)  # the user's own regions (or other higher-order ops): left as traced
    copy = _compat.copy_dynamo_graph_module(gm)
    groups: dict = {}
    for run in runs_of_outlinable(copy.graph):
        stretch = _stretch(run)
        if stretch is not None:
            groups.setdefault(stretch.signature, []).append(stretch)
    repeated = [members for members in groups.values() if len(members) >= 2]
    if not repeated:
        return OutlineResult(gm)
    result = OutlineResult(copy)
    plans = []
    for k, members in enumerate(repeated):  # every body first: a replacement rewires the later stretches' nodes
        outputs = sorted({i for m in members for i in m.live_out})
        name = _fresh_name(copy, k)
        copy.register_module(name, _body_module(members[0], outputs))
        plans.append((name, members, outputs))
    replaced: dict = {}
    for name, members, outputs in plans:
        for member in members:
            _replace_with_call(copy, member, name, outputs, replaced)
        result.bodies += 1
        result.calls += len(members)
        result.body_nodes += len(members[0].body)
    copy.graph.lint()
    copy.recompile()
    return result
