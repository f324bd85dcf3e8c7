"""In-place writes in a Dynamo FX graph, and which tensors they may change (by storage, so aliases count).

The safety proof reasons about values: a page table built from `req_to_token` just before its consumer equals
the one eager gathered earlier only if nothing wrote to `req_to_token` (or an alias of it) in between. This
module answers "which node between here and there may write to this tensor's memory?".

Aliasing is decided by storage, from the fake tensors Dynamo traced with: views, no-op casts
(`x.to(x.dtype)`, `.contiguous()` of a contiguous tensor) and graph inputs that alias each other share one fake
storage. A tensor without a fake value is assumed to alias everything.

    t = req_to_token[rpi, :m]                 # eager reads req_to_token here
    v = req_to_token[0:2]; v.add_(1)          # writes req_to_token's storage (through a view)
    torch.add(lens, 1, out=lens)              # out= writes lens
    store_kv(k_pool, v_pool, ...)             # the op's schema says it writes k_pool, v_pool
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ._compat import example_value, storage_id

_INPLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul,
}
# Higher-order ops and wrappers whose effect on their tensor arguments is not visible from the node.
_OPAQUE_NAMES = ("triton_kernel_wrapper", "auto_functionalized", "with_effects", "invoke_subgraph")


def _tensors_in(value) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, lambda n: found.append(n))
    return found


def _schema_writes(node: torch.fx.Node, op) -> list[torch.fx.Node] | None:
    schema = getattr(op, "_schema", None)
    if schema is None:
        return None
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) and not arg.kwarg_only else None)
        written.extend(_tensors_in(value))
    return written


def written_by(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph values whose memory `node` may write in place (empty for a pure node)."""
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.startswith("__"):
            return _tensors_in(node.args[0])
        return _tensors_in(node.kwargs.get("out"))
    if node.op != "call_function":
        return []
    target = node.target
    if target in _INPLACE_OPERATORS:
        return _tensors_in(node.args[0])
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    if isinstance(target, torch._ops.OpOverload):
        return _schema_writes(node, target) or []
    name = getattr(target, "__name__", "") or ""
    if isinstance(target, torch._ops.HigherOrderOperator) or any(s in name for s in _OPAQUE_NAMES):
        return _tensors_in((node.args, node.kwargs))  # unknown: every tensor argument may be written
    written = _tensors_in(node.kwargs.get("out"))
    if name.endswith("_") and not name.startswith("__") and node.args:
        written += _tensors_in(node.args[0])  # torch.relu_(x), torch.Tensor.add_(x, 1)
    return written


def storages(nodes) -> set:
    """Storage ids of the tensors behind `nodes`; None in the set stands for "unknown, may alias anything"."""
    ids = set()
    for node in nodes:
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            ids.add(storage_id(value))
    return ids


def first_write(graph: torch.fx.Graph, protected: list[torch.fx.Node], start: torch.fx.Node,
                end: torch.fx.Node) -> torch.fx.Node | None:
    """The first node strictly after `start` and strictly before `end` (graph order) that may write the memory
    of any of `protected`, or None."""
    watched = storages(protected)
    if not watched:
        return None
    inside = False
    for node in graph.nodes:
        if node is end:
            return None
        if inside:
            for target in written_by(node):
                value = example_value(target)
                key = storage_id(value) if isinstance(value, torch.Tensor) else None
                if key is None or key in watched or None in watched:
                    return node
        if node is start:
            inside = True
    return None


def written_inputs(graph: torch.fx.Graph, start: torch.fx.Node, end: torch.fx.Node) -> set:
    """Graph inputs (placeholders) whose memory a node strictly between `start` and `end` may write. A proof that
    found no write to its tensors still assumes these inputs do not alias them when the step runs."""
    owner = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            value = example_value(node)
            if isinstance(value, torch.Tensor):
                owner.setdefault(storage_id(value), node)
    found, inside = set(), False
    for node in graph.nodes:
        if node is end:
            break
        if inside:
            for target in written_by(node):
                value = example_value(target)
                if isinstance(value, torch.Tensor) and storage_id(value) in owner:
                    found.add(owner[storage_id(value)])
        if node is start:
            inside = True
    return found


def input_of(graph: torch.fx.Graph, node: torch.fx.Node):
    """The graph input whose memory `node` views (itself, a view, a no-op cast), or None for fresh memory."""
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        return None
    key = storage_id(value)
    for candidate in graph.nodes:
        if candidate.op == "placeholder":
            other = example_value(candidate)
            if isinstance(other, torch.Tensor) and storage_id(other) == key:
                return candidate
    return None
