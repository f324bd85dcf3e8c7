"""The graph-time half of the trace-time ranges: what the backend reads and settles on the Dynamo graph.

compile_pass.tracing (the Dynamo-time half) gives a max of declared lengths its range while Dynamo traces and marks
the `.item()` node with the keys below; this module works on the graph Dynamo handed the backend (the pipeline's
steps, compile_pass/pipeline.py) and holds what the rules may read (`META`, `admitted_values`). Rules import this
module, never the Dynamo-time one. compile_pass.tracing's docstring says why each step is sound.

    strip_range_asserts   the range's two asserts out before the pass (the backend's bookkeeping, not the user's)
    respell_widths        a width Dynamo spelled as an expression of the max, read back as `sym_size`
    traced_at_bound       which maxima were traced with a branch at the bound (recorded before the pass)
    settle_at_bound       after the pass: Retrace for a kept max of the root frame, and for a rewritten one
                          traced at the bound until both outcomes' rewritten graphs are compared
    recheck_kept          a kept max's range checked again on the host, right after its `.item()`
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from . import _compat

from .fx_util import insert_device_assert, insert_lower_assert, node_location
from .normalize import ASSERTS, asserted_bound, max_source

META = "syncfree_range"  # node.meta key on an `.item()` node given a range: (bound, text)
AT_BOUND = "syncfree_at_bound"  # node.meta key on such an `.item()`: [(assert text, guard), ...]
FIRST = "syncfree_first"  # on a ranged `.item()` of the compiled function's frame, first attempt: its line
UNRANGED = "syncfree_unranged"  # on an `.item()` traced without the range, to compare: its line
OTHER = "syncfree_other"  # on a ranged `.item()` traced with the other outcome: the first trace's rewritten graph


def lengths_of(item: torch.fx.Node) -> torch.fx.Node | None:
    """The graph input an `.item()` takes the full max of, or None."""
    source = max_source(item.args[0]) if item.args else None
    return source if isinstance(source, torch.fx.Node) and source.op == "placeholder" else None


class Retrace(Exception):
    """Raised by the backend where the frame of the compiled function must be traced again (nothing of the call has
    run): `modes` maps an `.item()` line to the next way to trace it (tracing.TracingPolicy.modes), `evidence` a
    line to what the next trace is compared with (the bound's outcome's TraceSignature, for mode "other"), `why`
    a line to why a branch on its max is left to Dynamo (mode "final"), for the report."""

    def __init__(self, modes: dict, evidence: dict | None = None, why: dict | None = None):
        super().__init__("syncfree: the max at " + ", ".join(f"{line} (next: {mode})" for line, mode in
                                                             sorted(modes.items())) + " is traced again")
        self.modes = dict(modes)
        self.evidence = dict(evidence or {})
        self.why = dict(why or {})  # line -> why a branch on its max is not decided (mode "final"): for the report


def ranged_items(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if META in n.meta]


def strip_range_asserts(graph: torch.fx.Graph, checked: bool = False) -> int:
    """Erase the `_assert_scalar(u0 >= 0)` / `(u0 <= bound)` that the range put in the graph (and their
    comparisons), so that the pass sees the graph a user's code gives; a max that only they used goes as well,
    as Dynamo drops an unused one. Returns how many asserts went."""
    erased = 0
    for item in ranged_items(graph):
        bound = item.meta[META][0]
        texts = [text for text, _ in item.meta.get(AT_BOUND, ())]
        for compare in list(item.users):
            if asserted_bound(compare, item) not in (("lower", 0), ("upper", bound)):
                erased += _strip_at_bound(graph, compare, texts)
                continue
            for check in list(compare.users):
                if check.op == "call_function" and check.target in ASSERTS and not check.users:
                    graph.erase_node(check)
                    erased += 1
            if not compare.users:
                graph.erase_node(compare)
        if not item.users:  # only the range used it: Dynamo drops an unused max, and so does this
            receiver = item.args[0]
            lengths = lengths_of(item)
            if checked and lengths is not None and isinstance(receiver, torch.fx.Node):
                # the trace assumed the range (a branch decided by it): under checked, a max outside it raises,
                # on the values the max read (no host read), as a rewritten max's lengths do
                text = f"syncfree: the max of the lengths is outside [0, {bound}] ({item.meta[META][1]}), the " \
                       f"range the step was traced with, at {node_location(item)}"
                insert_device_assert(graph, receiver, lengths, bound, text)
                insert_lower_assert(graph, receiver, lengths, 0, text)
            graph.erase_node(item)
            if isinstance(receiver, torch.fx.Node) and not receiver.users:
                graph.erase_node(receiver)
    return erased


def _strip_at_bound(graph: torch.fx.Graph, node: torch.fx.Node, texts: list[str]) -> int:
    """Erase the asserts of a branch traced at the bound (their text names the guard) that `node` leads to, and
    the arithmetic left dead by it."""
    if not texts:
        return 0
    erased = 0
    for user in list(node.users):
        if user.op == "call_function" and user.target in ASSERTS and len(user.args) > 1 \
                and any(f"expression {_spelled(t)} on node" in _spelled(str(user.args[1])) for t in texts):
            graph.erase_node(user)
            erased += 1
        elif user.op == "call_function":
            erased += _strip_at_bound(graph, user, texts)
    if erased and not node.users and node.op == "call_function" and not _is_item(node):
        graph.erase_node(node)
    return erased


def _spelled(text: str) -> str:
    """A guard's text as either of its spellings: Dynamo records one condition as `PythonMod` before the range
    is known and as `Mod` after (the same value for the non-negative operands the range gives)."""
    return text.replace("PythonMod(", "Mod(")


def _is_item(node: torch.fx.Node) -> bool:
    return META in node.meta


def respell_widths(graph: torch.fx.Graph) -> int:
    """With the range, Dynamo spells a table's width as an expression of the max (`u0`, or
    `torch.sym_min(256, u0 + 2)` where it clamps) instead of a fresh symbol read back with `sym_size(t, 1)`.
    The rules read SGLang's strided column index `t[:, torch.arange(0, t.shape[1], ps)]` in that spelling: an
    `arange` end that equals a dimension of the tensor it indexes (for every value of its symbols) becomes that
    `aten.sym_size.int(t, dim)`, the same value. Returns how many were respelled."""
    ranged = {_compat.symbol_of(_compat.example_value(n)) for n in ranged_items(graph)}
    if not ranged:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    count = 0
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is torch.arange and len(node.args) >= 2):
            continue
        end = node.args[1]
        value = _compat.example_value(end)
        if not isinstance(value, torch.SymInt) or not _compat.free_unbacked_symbols(value) & ranged:
            continue
        indexed = [u.args[0] for u in node.users if u.op == "call_function" and u.target is operator.getitem
                   and isinstance(u.args[0], torch.fx.Node) and order[u.args[0]] < order[node]]
        found = next(((t, d) for t in indexed for d, size in enumerate(_compat.example_value(t).shape)
                      if _compat.known_equal(size, value)), None)
        if found is None:
            continue
        with graph.inserting_before(node):
            size = graph.call_function(torch.ops.aten.sym_size.int, found)
        size.meta["example_value"] = value
        node.args = (node.args[0], size, *node.args[2:])
        if isinstance(end, torch.fx.Node) and not end.users and end.target in (torch.sym_min, torch.sym_max):
            graph.erase_node(end)
        count += 1
    return count


def traced_at_bound(graph: torch.fx.Graph) -> list[tuple]:
    """(item, guards) of every ranged `.item()` whose frame was traced with a branch at the bound's outcome (or,
    in the second trace, the other one), read before the pass erases a rewritten `.item()`."""
    return [(item, [g for _, g in item.meta[AT_BOUND]]) for item in ranged_items(graph) if item.meta.get(AT_BOUND)]


def settle_at_bound(graph: torch.fx.Graph, assumed: list[tuple]) -> int:
    """After the pass, for the maxima of the compiled function's own frame (nothing of the call has run, so the
    frame may be traced again: Retrace):
      - a kept max is traced again without the range where it is passed into a compiled region, and with the
        range only (no branch decided at the bound: Dynamo breaks there as without the backend) where a branch
        was traced at the bound;
      - a rewritten max whose frame was traced with one branch at the bound's outcome is traced again with the
        other outcome (mode "other"); the second trace must cover the first (TraceSignature.same_computation:
        the same rewritten graph over the same inputs, the same code after it, every guard of the first among its
        own; a graph that ends at a graph break is never compared), and then its graph computes eager's values
        for every max in [0, bound] (each trace is eager's computation for the maxima that take its outcome, and
        each rewrite is proven for them), with no assertion on the outcome: a valid length never raises. Traces
        that differ, several branches, or several such maxima (their combinations are not all traced) are traced
        again with the range only, with why (Retrace.why).
    Nothing is inserted: returns 0."""
    retrace, evidence, why = {}, {}, {}
    for item in ranged_items(graph):  # kept: still in the graph
        if FIRST not in item.meta:
            continue
        if _passed_into_a_region(item):
            retrace[item.meta[FIRST]] = "unranged"
        elif item.meta.get(AT_BOUND):
            retrace[item.meta[FIRST]] = "final"
            why[item.meta[FIRST]] = "the pass kept the max (its own reason says why)"
    retrace.update({n.meta[UNRANGED]: "final" for n in graph.nodes if UNRANGED in n.meta})
    if retrace:
        raise Retrace(retrace, why=why)
    signature = frame_signature(graph) if assumed else None
    for item, guards in assumed:
        line = item.meta[FIRST]
        if len(assumed) > 1 or len(guards) != 1:
            retrace[line], why[line] = "final", "more than one branch on the max differs inside [0, bound]; only " \
                                                 "one is traced with both outcomes"
        elif signature is None:
            retrace[line], why[line] = "final", "the code Dynamo runs after the graph cannot be read (the graph " \
                                                 "ends at a graph break, or another torch), so the two outcomes " \
                                                 "cannot be compared"
        elif OTHER not in item.meta:
            retrace[line], evidence[line] = "other", signature
        elif item.meta[OTHER] is None:
            retrace[line], why[line] = "final", "the bound's outcome was not recorded"
        elif not signature.same_computation(item.meta[OTHER]):
            retrace[line], why[line] = "final", outcomes_differ(item.meta[OTHER], signature)
    if retrace:
        raise Retrace(retrace, evidence, why)
    return 0


@dataclasses.dataclass(frozen=True)
class TraceSignature:
    """What one trace of the frame computes (the rewritten graph, each placeholder by its source; the code Dynamo
    runs after it: side effects, returned constants, where each output goes) and the guards it runs under."""

    graph: str
    after: str
    guards: frozenset

    def same_computation(self, first: "TraceSignature") -> bool:
        """This trace (the other outcome's: its compiled code is what runs) computes what `first` (the bound's
        outcome's) computes wherever its guards hold: the same graph and code, and every guard of `first` among
        its own (a guard only `first` made, on a value only that outcome read, would not be checked)."""
        return self.graph == first.graph and self.after == first.after and first.guards <= self.guards


def outcomes_differ(first: TraceSignature, second: TraceSignature) -> str:
    """Why two traces of a branch's outcomes are not one computation, and what would make them one."""
    if first.graph != second.graph:
        return ("its two outcomes compute different graphs (a width, an op or an input that depends on the "
                "outcome); the rewrite is proven when both outcomes size and fill the table alike (a round-up to a "
                "multiple that the bound's width is one of, a scratch already as wide as the bound's pages)")
    if first.after != second.after:
        return ("its two outcomes differ outside the graph (an attribute stored, a constant returned); the rewrite "
                "is proven when they do not")
    missing = sorted(first.guards - second.guards)
    return (f"the bound's outcome depends on a value the other outcome does not read ({missing[0]}): its compiled "
            "code would not be guarded by it")


def frame_signature(graph: torch.fx.Graph) -> TraceSignature | None:
    """The TraceSignature of the trace being compiled (graph_signature, _compat.frame_residual). None where the
    code after the graph cannot be read (a graph that ends at a graph break among them): the trace is then never
    called the same as another (an attribute store, a returned constant or a guard that differs between the
    outcomes is not in the graph)."""
    residual = _compat.frame_residual()
    if residual is None:
        return None
    after, guards = residual
    return TraceSignature(graph_signature(graph), after, guards)


def graph_signature(graph: torch.fx.Graph) -> str:
    """The graph as text with nothing but what it computes: each node's op, target, and arguments (other nodes by
    position, constants by repr), compiled regions' bodies included; no names, no meta. Two traces of one frame
    compute the same thing where their signatures are equal."""
    index: dict = {}

    def arg(a) -> str:
        if isinstance(a, torch.fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return type(a).__name__ + "(" + ", ".join(arg(x) for x in a) + ")"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({arg(a.start)}, {arg(a.stop)}, {arg(a.step)})"
        return repr(a)

    lines = []
    owner = graph.owning_module
    for node in graph.nodes:
        index[node] = len(index)
        target = node.target if isinstance(node.target, str) else \
            f"{getattr(node.target, '__module__', '')}.{getattr(node.target, '__qualname__', node.target)}"
        line = f"{node.op} {target} {arg(node.args)} {arg(node.kwargs)}"
        if node.op == "placeholder":  # where it comes from: two traces may lift other inputs in its place
            line = f"placeholder {index[node]} {_compat.placeholder_source_name(node)}"
        if node.op == "get_attr" and owner is not None:
            body = getattr(owner, str(node.target), None)
            if isinstance(body, torch.fx.GraphModule):
                line = "get_attr {" + graph_signature(body.graph).replace("\n", "; ") + "}"
        lines.append(line)
    return "\n".join(lines)


ADMITTED_LIMIT = 1 << 22  # past this many values the domain is not enumerated (None)


def admitted_values(item: torch.fx.Node, bound: int) -> torch.Tensor | None:
    """The values in [0, bound] that the max read by `item` can take in a step that runs: those where every branch
    it was traced with has that outcome (each trace's proof covers the maxima that take its outcome; settle_at_bound
    keeps a rewrite only where the other outcome's trace gives the same graph; a max with none: every value). A guard that cannot be evaluated here (not of
    this one symbol, an operator this file does not spell) narrows nothing: the answer is then a superset of the
    values, which is what a proof taking a minimum over them may use. None for a bound past ADMITTED_LIMIT."""
    if bound + 1 > ADMITTED_LIMIT:
        return None
    values = torch.arange(0, bound + 1, dtype=torch.int64)
    for _, guard in item.meta.get(AT_BOUND) or ():
        symbols = list(getattr(guard, "free_symbols", None) or ())
        if len(symbols) != 1:
            continue
        try:
            holds = _host_value(guard, values)
        except (NotImplementedError, TypeError, ValueError, RuntimeError):
            continue
        if isinstance(holds, torch.Tensor) and holds.dtype == torch.bool:
            values = values[holds.expand(values.shape)]
    return values


def implied_outcome(item: torch.fx.Node, expr, bound: int):
    """The value (sympy true/false) a branch condition `expr` on the max read by `item` has for EVERY value the
    max can take in this trace (admitted_values: [0, bound] less those its earlier outcomes exclude), or None
    where it differs among them or cannot be evaluated. Such a branch adds no assumption: it is decided by the
    outcomes already traced (FlashInfer's `blocks % 2 == 0` check after TRTLLM-MLA's round-up to a multiple of
    64 pages holds in both outcomes of the round-up)."""
    import sympy

    if not item.meta.get(AT_BOUND):
        return None  # nothing assumed yet: the range alone decides (or not) before this is asked
    values = admitted_values(item, bound)
    if values is None or values.numel() == 0 or len(getattr(expr, "free_symbols", ()) or ()) != 1:
        return None
    try:
        holds = _host_value(expr, values)
    except (NotImplementedError, TypeError, ValueError, RuntimeError):
        return None
    if not (isinstance(holds, torch.Tensor) and holds.dtype == torch.bool):
        return None
    holds = holds.expand(values.shape)
    return sympy.true if bool(holds.all()) else sympy.false if not bool(holds.any()) else None


def _host_value(expr, values: torch.Tensor):
    """The sympy expression `expr` of one symbol, evaluated at each of `values` (its ints as tensors)."""
    def call(op, *args):
        return op(*(a if isinstance(a, torch.Tensor) else torch.tensor(a) for a in args))

    return _evaluate(expr, values, call, lambda x: isinstance(x, torch.Tensor))


def _passed_into_a_region(item: torch.fx.Node) -> bool:
    """With the range, Dynamo hands a compiled region (`invoke_subgraph`) the max itself where the width of a table
    is an expression of it; without it, a fresh width symbol the rules read. Such a max is traced again without
    the range."""
    region = _compat.invoke_subgraph_op()
    return region is not None and any(u.op == "call_function" and u.target is region for u in item.users)


_SYMPY_OPS = {"Add": operator.add, "Mul": operator.mul, "FloorDiv": operator.floordiv, "Mod": operator.mod,
              "PythonMod": operator.mod, "Ne": operator.ne, "Equality": operator.eq, "Unequality": operator.ne,
              "StrictLessThan": operator.lt, "LessThan": operator.le, "StrictGreaterThan": operator.gt,
              "GreaterThan": operator.ge, "And": torch.logical_and, "Or": torch.logical_or, "Max": torch.maximum,
              "Min": torch.minimum}


def _evaluate(expr, value, call, is_value):
    """The sympy expression `expr` of one symbol, `value` standing for it: operations on Python ints folded, every
    other one made by `call(op, *args)` (a graph node, or a tensor op on the host); `is_value` tells what `call`
    made from a folded int. The one spelling of the guards, for the proof's domain."""
    import sympy

    if expr is sympy.true or expr is sympy.false:
        return bool(expr)
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return value
    name = type(expr).__name__
    if name == "Not":
        return call(torch.logical_not, _evaluate(expr.args[0], value, call, is_value))
    if name not in _SYMPY_OPS:
        raise NotImplementedError(f"no spelling for {name} in {expr}")
    args = [_evaluate(a, value, call, is_value) for a in expr.args]
    result = args[0]
    for other in args[1:]:
        if not is_value(result) and not is_value(other):
            result = _SYMPY_OPS[name](result, other)
            continue
        if not is_value(result) and name in ("Add", "Mul"):
            result, other = other, result
        result = call(_SYMPY_OPS[name], result, other)
    return result


def recheck_kept(graph: torch.fx.Graph) -> int:
    """Every ranged `.item()` still in the graph after the pass (a kept max) gets its range checked again, on
    the host, right after it. Returns how many were re-checked."""
    count = 0
    for item in ranged_items(graph):
        bound, text = item.meta[META]
        anchor = item.next
        for op, limit, words in ((operator.ge, 0, "is negative"), (operator.le, bound, f"exceeds {text}")):
            with graph.inserting_before(anchor):
                compare = graph.call_function(op, (item, limit))
                graph.call_function(torch.ops.aten._assert_scalar.default,
                                    (compare, f"syncfree: the max of the lengths {words}, the range it was "
                                              f"traced with"))
        count += 1
    return count
