"""In-place writes in a Dynamo FX graph, and which tensors they may change (by storage, so aliases count).

The safety proof reasons about values: a page table built from `req_to_token` just before its consumer equals
the one eager gathered earlier only if nothing wrote to `req_to_token` (or an alias of it) in between. This
module answers "which node between here and there may write to this tensor's memory?".

Default deny: a node is write-free only when it is KNOWN to be. Known means one of
  - a torch op whose schema (every overload the call may resolve to, `out=` included) marks no argument written;
  - a torch builtin function or Tensor method named like an aten op: judged by that op's schemas, the same way;
  - an entry of the short allow-lists below (pure methods, Python operators, pure Python-level functions, each
    with an `extra_check` on its arguments where an argument can turn a write on, e.g. `inplace=True`).
Anything else (an unknown method, a wrapped numpy function, an `allow_in_graph` callable, a user function, a
module call, a higher-order op whose body is not analysed) writes every tensor it receives, and all their aliases.

Aliasing is decided by storage, from the fake tensors Dynamo traced with: views, no-op casts and graph inputs
that alias each other share one fake storage. A tensor without a fake value is assumed to alias everything.

    t = req_to_token[rpi, :m]                 # eager reads req_to_token here
    v = req_to_token[0:2]; v.add_(1)          # writes req_to_token's storage (through a view)
    torch.add(lens, 1, out=lens)              # out= writes lens
    store_kv(k_pool, v_pool, ...)             # the op's schema says it writes k_pool, v_pool
    helper(lens)                              # unknown: assumed to write lens
"""

from __future__ import annotations

import builtins
import functools
import math
import operator
import types
import weakref
from typing import Callable

import torch
import torch.fx

from . import _compat
from ._compat import example_value, storage_id

# Python operators: pure ones, and the in-place ones (which write their first argument).
PURE_OPERATORS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.pos, operator.abs, operator.and_, operator.or_, operator.xor, operator.lshift,
    operator.rshift, operator.invert, operator.not_, operator.eq, operator.ne, operator.lt, operator.le,
    operator.gt, operator.ge, operator.getitem, operator.matmul, operator.truth, operator.index,
})
INPLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul, operator.delitem,
})
# Host-side functions on Python numbers and symbolic sizes: no tensor reaches them, or they only read.
PURE_HOST_FUNCTIONS = frozenset({
    builtins.max, builtins.min, builtins.int, builtins.float, builtins.bool, builtins.len, builtins.abs,
    builtins.getattr, builtins.isinstance, math.ceil, math.floor, math.sqrt,
    torch.sym_max, torch.sym_min, torch.sym_int, torch.sym_float, torch.sym_not, torch.sym_ite,
    torch._check, torch._check_is_size, torch.sym_sum,
})
# Tensor methods that read only and have no aten op of the same name to judge them by.
PURE_METHODS = frozenset({
    "item", "tolist", "numpy", "size", "dim", "stride", "numel", "nelement", "element_size", "type", "int",
    "long", "float", "double", "half", "bfloat16", "bool", "byte", "short", "char", "cuda", "cpu",
    "is_contiguous", "get_device", "storage_offset", "type_as", "view_as", "expand_as", "reshape_as",
    "__getitem__", "__len__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
    "__rpow__", "__matmul__", "__rmatmul__", "__neg__", "__pos__", "__abs__", "__invert__", "__and__",
    "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__", "__rshift__",
    "__rrshift__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
})


def _not_inplace(node: torch.fx.Node) -> bool:
    return not node.kwargs.get("inplace", False) and not (len(node.args) > 2 and node.args[2] is True)


def _no_max_norm(node: torch.fx.Node) -> bool:
    # F.embedding(input, weight, padding_idx, max_norm): a max_norm renormalises rows of `weight` in place.
    return node.kwargs.get("max_norm") is None and not (len(node.args) > 3 and node.args[3] is not None)


def _always(node: torch.fx.Node) -> bool:
    return True


# Python-level torch functions (not builtins, so no schema to read) known to be pure, each with the check that its
# arguments keep it pure. Everything else at Python level writes all it receives.
PURE_FUNCTIONS: dict[Callable, Callable[[torch.fx.Node], bool]] = {
    torch.nn.functional.silu: _not_inplace, torch.nn.functional.relu: _not_inplace,
    torch.nn.functional.gelu: _always, torch.nn.functional.softmax: _always,
    torch.nn.functional.log_softmax: _always, torch.nn.functional.rms_norm: _always,
    torch.nn.functional.layer_norm: _always, torch.nn.functional.pad: _always,
    torch.nn.functional.embedding: _no_max_norm, torch.nn.functional.dropout: _not_inplace,
    torch.einsum: _always, torch.split: _always, torch.functional.split: _always,
}
# Dynamo's wrappers of numpy functions and ndarray methods (`wrapped_<name>`) that only read.
PURE_NUMPY = frozenset({"max", "amax", "min", "amin", "item"})
# Builtin torch function namespaces whose functions are aten ops of the same name (torch.add -> aten.add).
_ATEN_BUILTIN_MODULES = ("torch", "torch._C._nn", "torch._C._linalg", "torch._C._fft", "torch._C._special",
                         "torch.nn.functional")


def _tensors_in(value) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, lambda n: found.append(n))
    return found


def _all_received(node: torch.fx.Node) -> list[torch.fx.Node]:
    return _tensors_in((node.args, node.kwargs))


def _overload_writes(node: torch.fx.Node, schema) -> list[torch.fx.Node]:
    """The nodes that `node`'s arguments bind to written (`Tensor(a!)`) parameters of one schema."""
    written = []
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.name in node.kwargs:
            written.extend(_tensors_in(node.kwargs[arg.name]))
        elif not arg.kwarg_only and positional.index(arg) < len(node.args):
            written.extend(_tensors_in(node.args[positional.index(arg)]))
    return written


@functools.lru_cache(maxsize=None)
def _packet_schemas(packet) -> tuple:
    return tuple(schema for _, schema in _compat.overload_schemas(packet))


def _packet_writes(node: torch.fx.Node, packet) -> list[torch.fx.Node]:
    """Any overload the call may resolve to counts: the union of their written arguments, plus `out=`."""
    written = list(_tensors_in(node.kwargs.get("out")))
    for schema in _packet_schemas(packet):
        written.extend(_overload_writes(node, schema))
    return written


def _aten_packet(name: str):
    packet = getattr(torch.ops.aten, name, None) if name else None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def region_body(node: torch.fx.Node):
    """For a call of a compiled region (`torch.compiler.nested_compile_region` -> invoke_subgraph): (its body's
    GraphModule, the operands in the order of the body's placeholders); else None."""
    if node.op != "call_function" or node.target is not _compat.invoke_subgraph_op():
        return None
    attr = node.args[0] if node.args else None
    owner = node.graph.owning_module
    if not isinstance(attr, torch.fx.Node) or attr.op != "get_attr" or owner is None:
        return None
    body = getattr(owner, attr.target, None)
    if not isinstance(body, torch.fx.GraphModule):
        return None
    return body, list(node.args[2:])


# body -> (its nodes when analysed, the body inputs it writes or None for "any"): a stack of identical layers calls
# one body many times, and each call's writes are the body's, so the body is read once (again only if it changed).
_BODY_WRITES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _body_writes(body: torch.fx.GraphModule) -> frozenset | None:
    """Positions of the body's inputs whose memory a node of the body may write; None when it writes memory that
    cannot be placed (then every input counts as written)."""
    nodes = tuple(body.graph.nodes)
    cached = _BODY_WRITES.get(body)
    if cached is not None and cached[0] == nodes:
        return cached[1]
    keys: dict = {}
    for i, placeholder in enumerate(n for n in nodes if n.op == "placeholder"):
        value = example_value(placeholder)
        if isinstance(value, torch.Tensor):
            keys.setdefault(storage_id(value), []).append(i)
    written: set | None = set()
    for inner in nodes:
        for target in written_by(inner):
            if not _may_hold_memory(target):
                continue
            key = _key(example_value(target))
            if key is None:
                written = None  # a write to memory we cannot place: every input
                break
            written.update(keys.get(key, []))
        if written is None:
            break
    result = None if written is None else frozenset(written)
    _BODY_WRITES[body] = (nodes, result)
    return result


def _region_writes(node: torch.fx.Node, region) -> list[torch.fx.Node]:
    """A region's writes seen through: the operands whose memory a node of the body writes (as if inlined)."""
    body, operands = region
    if sum(1 for n in body.graph.nodes if n.op == "placeholder") != len(operands):
        return _all_received(node)
    positions = _body_writes(body)
    if positions is None:
        return _all_received(node)
    return [operands[i] for i in sorted(positions) if isinstance(operands[i], torch.fx.Node)]


def written_by(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph values whose memory `node` may write in place (empty only for a node known to be pure)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return []
    if node.op == "call_module":
        return _all_received(node)
    if node.op == "call_method":
        name = str(node.target)
        if name in PURE_METHODS:
            return _tensors_in(node.kwargs.get("out"))
        packet = _aten_packet(name)
        if packet is not None:  # x.add(y), x.add_(y), x.index_put_(...): the aten op's schemas decide
            return _packet_writes(node, packet)
        return _all_received(node)  # unknown: __iadd__, __setitem__, anything not known to be pure
    if node.op != "call_function":
        return _all_received(node)
    target = node.target
    if target in PURE_OPERATORS or target in PURE_HOST_FUNCTIONS:
        return []
    if target in INPLACE_OPERATORS:
        return _tensors_in(node.args[0]) if node.args else _all_received(node)
    if isinstance(target, torch._ops.OpOverload):
        return _overload_writes(node, target._schema) + _tensors_in(node.kwargs.get("out"))
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _packet_writes(node, target)
    region = region_body(node)
    if region is not None:
        return _region_writes(node, region)
    check = PURE_FUNCTIONS.get(target)
    if check is not None:
        return [] if check(node) else _all_received(node)
    name = getattr(target, "__name__", "") or ""
    if isinstance(target, types.BuiltinFunctionType) and getattr(target, "__module__", None) \
            in _ATEN_BUILTIN_MODULES:
        packet = _aten_packet(name)
        if packet is not None:  # torch.add(x, y, out=z), torch.relu_(x): the aten op's schemas decide
            return _packet_writes(node, packet)
    if name.startswith("wrapped_") and name[len("wrapped_"):] in PURE_NUMPY:
        return []
    return _all_received(node)  # unknown: numpy wrappers, allow_in_graph helpers, higher-order ops, ...


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
            targets = [t for t in written_by(node) if _may_hold_memory(t)]
            if targets:
                self.writes.append((i, node, [_key(example_value(t)) for t in targets]))

    def _between(self, start: torch.fx.Node, end: torch.fx.Node):
        lo, hi = self.order[start], self.order[end]
        return ((node, keys) for i, node, keys in self.writes if lo < i < hi)

    def _writes_of(self, protected: list[torch.fx.Node], start: torch.fx.Node, end: torch.fx.Node):
        """The nodes strictly between `start` and `end` that may write the memory of any of `protected`, in order."""
        watched = {_key(example_value(p)) for p in protected if isinstance(example_value(p), torch.Tensor)}
        if not watched:
            return
        for node, keys in self._between(start, end):
            if any(key is None or key in watched for key in keys) or None in watched:
                yield node

    def first_write(self, protected: list[torch.fx.Node], start: torch.fx.Node,
                    end: torch.fx.Node) -> torch.fx.Node | None:
        """The first node strictly between `start` and `end` that may write the memory of any of `protected`."""
        return next(self._writes_of(protected, start, end), None)

    def last_write(self, protected: list[torch.fx.Node], start: torch.fx.Node,
                   end: torch.fx.Node) -> torch.fx.Node | None:
        """The last node strictly between `start` and `end` that may write the memory of any of `protected`."""
        last = None
        for last in self._writes_of(protected, start, end):
            pass
        return last

    def writers_before(self, end: torch.fx.Node) -> list[torch.fx.Node]:
        """Every node before `end` that may write in place, in graph order."""
        return [node for i, node, _ in self.writes if i < self.order[end]]

    def written_inputs(self, start: torch.fx.Node, end: torch.fx.Node) -> set:
        """Graph inputs whose memory a node strictly between `start` and `end` writes. A proof that found no write
        to its own tensors still assumes these inputs do not alias them when the step runs."""
        return {self.inputs[key] for _, keys in self._between(start, end) for key in keys if key in self.inputs}

    def input_of(self, node: torch.fx.Node):
        """The graph input whose memory `node` views (itself, a view, a no-op cast), or None for fresh memory."""
        value = example_value(node)
        return self.inputs.get(storage_id(value)) if isinstance(value, torch.Tensor) else None


def _may_hold_memory(node: torch.fx.Node) -> bool:
    """A written value that is no tensor (a SymInt, a Python number, None) holds no memory anyone reads."""
    value = example_value(node)
    if isinstance(value, torch.Tensor):
        return True
    if value is None:  # unknown: a tensor we have no fake value for
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return False


def _key(value):
    return storage_id(value) if isinstance(value, torch.Tensor) else None
