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


class WriteLog:
    """Every in-place write of a graph, read once: which node writes which storage, in graph order.

    The proof asks many questions of one graph ("does anything write these tensors between here and there?",
    "which graph inputs are written there?"); each is a walk over the few writing nodes, not over the graph.
    Build it again after the graph changes.
    """

    def __init__(self, graph: torch.fx.Graph):
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.writes = []  # (position, writer, storage keys; None = unknown memory)
        self.inputs = {}  # storage key -> the first graph input (placeholder) with that memory
        for node, i in self.order.items():
            if node.op == "placeholder":
                value = example_value(node)
                if isinstance(value, torch.Tensor):
                    self.inputs.setdefault(storage_id(value), node)
            targets = written_by(node)
            if targets:
                self.writes.append((i, node, [_key(example_value(t)) for t in targets]))

    def _between(self, start: torch.fx.Node, end: torch.fx.Node):
        lo, hi = self.order[start], self.order[end]
        return ((node, keys) for i, node, keys in self.writes if lo < i < hi)

    def first_write(self, protected: list[torch.fx.Node], start: torch.fx.Node,
                    end: torch.fx.Node) -> torch.fx.Node | None:
        """The first node strictly between `start` and `end` that may write the memory of any of `protected`."""
        watched = {_key(example_value(p)) for p in protected if isinstance(example_value(p), torch.Tensor)}
        if not watched:
            return None
        for node, keys in self._between(start, end):
            if any(key is None or key in watched for key in keys) or None in watched:
                return node
        return None

    def written_inputs(self, start: torch.fx.Node, end: torch.fx.Node) -> set:
        """Graph inputs whose memory a node strictly between `start` and `end` writes. A proof that found no write
        to its own tensors still assumes these inputs do not alias them when the step runs."""
        return {self.inputs[key] for _, keys in self._between(start, end) for key in keys if key in self.inputs}

    def input_of(self, node: torch.fx.Node):
        """The graph input whose memory `node` views (itself, a view, a no-op cast), or None for fresh memory."""
        value = example_value(node)
        return self.inputs.get(storage_id(value)) if isinstance(value, torch.Tensor) else None


def _key(value):
    return storage_id(value) if isinstance(value, torch.Tensor) else None
