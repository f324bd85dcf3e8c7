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

import operator

import torch
import torch.fx

from . import _compat

from .fx_util import insert_device_assert, insert_lower_assert, node_location
from .normalize import ASSERTS, asserted_bound, max_source
from .trace_signature import frame_signature, outcomes_differ, regrown_scratch, uncompared_reason

META = "syncfree_range"  # node.meta key on an `.item()` node given a range: (bound, text)
AT_BOUND = "syncfree_at_bound"  # node.meta key on such an `.item()`: [(assert text, guard), ...]
FIRST = "syncfree_first"  # on a ranged `.item()` of the compiled function's frame, first attempt: its line
UNRANGED = "syncfree_unranged"  # on an `.item()` traced without the range, to compare: its line
NARROWED = "syncfree_narrowed"  # on such an `.item()`: the ends of its range a branch traced at the bound moved:
#                                 (low or None, high or None)
REGROWN = "syncfree_regrown"  # traced again at the bound's outcome, which regrows the scratch the other slices:
#                               the bound's outcome's TraceSignature (trace_signature.regrown_scratch)
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
        guards = [guard for _, guard in item.meta.get(AT_BOUND, ())]
        ranges = {("lower", 0), ("upper", bound)}
        if texts and NARROWED in item.meta:  # the ends the branch's outcome moved (`2 < cdiv(u0, 64)`: u0 >=
            low, high = item.meta[NARROWED]  # 129), asserted as the range: the outcome's bookkeeping too
            ranges |= {("lower", low)} if low is not None else set()
            ranges |= {("upper", high)} if high is not None else set()
        for compare in list(item.users):
            if asserted_bound(compare, item) not in ranges:
                erased += _strip_at_bound(graph, compare, texts, guards)
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


def _strip_at_bound(graph: torch.fx.Graph, node: torch.fx.Node, texts: list[str], guards=()) -> int:
    """Erase the asserts of a branch traced at the bound (their text names the guard) that `node` leads to, and
    the arithmetic left dead by it."""
    if not texts:
        return 0
    erased = 0
    for user in list(node.users):
        if user.op == "call_function" and user.target in ASSERTS and len(user.args) > 1 \
                and (any(f"expression {_spelled(t)} on node" in _spelled(str(user.args[1])) for t in texts)
                     or _asserts_one_of(user, guards)):
            graph.erase_node(user)
            erased += 1
        elif user.op == "call_function":
            erased += _strip_at_bound(graph, user, texts, guards)
    if erased and not node.users and node.op == "call_function" and not _is_item(node):
        graph.erase_node(node)
    return erased


def _asserts_one_of(check: torch.fx.Node, guards) -> bool:
    """Does the assert `check` assert one of `guards` (sympy conditions), its condition's expression equal to one
    of them up to the side it is written from (`2 < n` for `n > 2`: Relational.canonical)?"""
    condition = _compat.example_value(check.args[0]) if isinstance(check.args[0], torch.fx.Node) else None
    expr = getattr(getattr(condition, "node", None), "expr", None)
    if expr is None:
        return False
    spelled = getattr(expr, "canonical", expr)
    return any(expr == g or spelled == getattr(g, "canonical", g) for g in guards)


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


def settle_at_bound(graph: torch.fx.Graph, assumed: list[tuple], scratch_tables=(), static_escapes=False) -> int:
    """After the pass, for the maxima of the compiled function's own frame (nothing of the call has run, so the
    frame may be traced again: Retrace):
      - a kept max is traced again without the range where it is passed into a compiled region, and with the
        range only (no branch decided at the bound: Dynamo breaks there as without the backend) where a branch
        was traced at the bound;
      - a rewritten max whose frame was traced with one branch at the bound's outcome is traced again with the
        other outcome (mode "other"); the second trace must cover the first (TraceSignature.same_computation:
        the same rewritten graph over the same inputs, the same code before and after it, every guard of the
        first among its own; a graph that ends at a graph break, or a trace that replays Python random calls, is
        never compared: refused at once, in either trace), and then its graph computes eager's values
        for every max in [0, bound] (each trace is eager's computation for the maxima that take its outcome, and
        each rewrite is proven for them), with no assertion on the outcome: a valid length never raises. Traces
        that differ, several branches, or several such maxima (their combinations are not all traced) are traced
        again with the range only, with why (Retrace.why);
      - one exception, under static_escapes: where the bound's outcome regrows the scratch that the other
        outcome slices as it is (trace_signature.regrown_scratch: one computation but for where the scratch's
        cells live and its width), the frame is traced a third time at the bound's outcome (mode "regrown"),
        whose graph is kept, with no assertion on the outcome, where its signature is the bound's outcome's
        (the same computation, every guard of it among its own): it computes eager's values for every max, the
        scratch stored at the static width (what static_escapes allows).
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
    signature = frame_signature(graph, scratch_tables) if assumed else None
    for item, guards in assumed:
        line = item.meta[FIRST]
        if len(assumed) > 1 or len(guards) != 1:
            retrace[line], why[line] = "final", "more than one branch on the max differs inside [0, bound]; only " \
                                                 "one is traced with both outcomes"
        elif signature is None:
            retrace[line], why[line] = "final", "the code Dynamo runs around the graph cannot be read (the graph " \
                                                 "ends at a graph break, or another torch), so the two outcomes " \
                                                 "cannot be compared"
        elif signature.uncompared:  # either outcome's: its own trace refuses before the other is compared
            retrace[line], why[line] = "final", uncompared_reason(signature)
        elif REGROWN in item.meta:  # the third trace: the bound's outcome again, which must be what was compared
            if item.meta[REGROWN] is None or not signature.same_computation(item.meta[REGROWN]):
                retrace[line], why[line] = "final", "traced again at the bound's outcome, which regrows the " \
                                                     "scratch, it is not the trace compared with the other outcome"
        elif OTHER not in item.meta:
            retrace[line], evidence[line] = "other", signature
        elif item.meta[OTHER] is None:
            retrace[line], why[line] = "final", "the bound's outcome was not recorded"
        elif signature.same_computation(item.meta[OTHER]):
            continue
        elif static_escapes and regrown_scratch(item.meta[OTHER], signature):
            retrace[line], evidence[line] = "regrown", item.meta[OTHER]
        else:
            retrace[line], why[line] = "final", outcomes_differ(item.meta[OTHER], signature)
    if retrace:
        raise Retrace(retrace, evidence, why)
    return 0


ADMITTED_LIMIT = 1 << 22  # past this many values the domain is not enumerated (None)


def admitted_values(item: torch.fx.Node, bound: int) -> torch.Tensor | None:
    """The values in [0, bound] that the max read by `item` can take in a step that runs: those where every branch
    it was traced with has that outcome (each trace's proof covers the maxima that take its outcome; settle_at_bound
    keeps a rewrite only where the other outcome's trace gives the same graph; a max with none: every value). A
    guard that cannot be evaluated exactly here (not of this one symbol, an operator this file does not spell, a
    value past what int64 holds exactly: _host_value) narrows nothing: the answer is then a superset of the
    values, which is what a proof taking a minimum over them may use. None for a bound past ADMITTED_LIMIT."""
    if bound + 1 > ADMITTED_LIMIT:
        return None
    values = torch.arange(0, bound + 1, dtype=torch.int64)
    for _, guard in item.meta.get(AT_BOUND) or ():
        symbols = list(getattr(guard, "free_symbols", None) or ())
        if len(symbols) != 1 or values.numel() == 0:
            continue
        try:
            holds = _truth_at(_host_value(guard, values), values)
        except _HOST_ERRORS:
            continue
        if holds is not None:
            values = values[holds]
    return values


def implied_outcome(item: torch.fx.Node, expr, bound: int):
    """The value (sympy true/false) a branch condition `expr` on the max read by `item` has for EVERY value the
    max can take in this trace (admitted_values: [0, bound] less those its earlier outcomes exclude), or None
    where it differs among them or cannot be evaluated exactly (_host_value). Such a branch adds no assumption:
    it is decided by the outcomes already traced (FlashInfer's `blocks % 2 == 0` check after TRTLLM-MLA's
    round-up to a multiple of 64 pages holds in both outcomes of the round-up)."""
    import sympy

    if not item.meta.get(AT_BOUND):
        return None  # nothing assumed yet: the range alone decides (or not) before this is asked
    values = admitted_values(item, bound)
    if values is None or values.numel() == 0 or len(getattr(expr, "free_symbols", ()) or ()) != 1:
        return None
    try:
        holds = _truth_at(_host_value(expr, values), values)
    except _HOST_ERRORS:
        return None
    if holds is None:
        return None
    return sympy.true if bool(holds.all()) else sympy.false if not bool(holds.any()) else None


class _Inexact(ArithmeticError):
    """The host cannot evaluate a guard exactly: an operator with no spelling here, an operand of the wrong kind,
    an integer that int64 may not hold exactly, a division by zero, a `Mod` outside the operands it is defined on."""


# A broken evaluation narrows nothing (admitted_values) and decides nothing (implied_outcome): these are what a
# guard this file cannot evaluate exactly raises (_Inexact), or what torch raises on an operand it refuses.
_HOST_ERRORS = (_Inexact, ArithmeticError, TypeError, ValueError, RuntimeError)

_EXACT_BELOW = 1 << 62  # every integer a tensor holds, operand or result, stays strictly inside +-this: int64 then
#                         computes what Python ints do (no wrap, and -2**63 // -1 never arises)


def _host_value(expr, values: torch.Tensor):
    """The sympy expression `expr` of one symbol at each of `values` (an int64 tensor), exactly as Python ints
    give it: a bool (or int64) tensor over `values`, or a Python bool or int where the symbol drops out. The
    values are evaluated together, as int64 tensors, only where that is exact: before each operation, the
    least and greatest value of its result are computed from its operands' in Python ints, and an operation
    whose result (or operand) could leave (-2**62, 2**62) raises _Inexact instead of wrapping as int64 does.
    Division and modulus by zero, and torch's `Mod` (defined on a non-negative dividend and a positive divisor
    only) outside its domain, raise _Inexact as well."""
    import sympy

    if expr is sympy.true or expr is sympy.false:
        return bool(expr)
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return values
    name = type(expr).__name__
    operands = [_host_value(a, values) for a in expr.args]
    if name == "Not":
        (operand,) = operands
        return not operand if type(_truth(operand)) is bool else torch.logical_not(operand)
    operation = _EXACT_OPS.get(name)
    if operation is None:
        raise _Inexact(f"no exact spelling for {name} in {expr}")
    result = operands[0]
    for other in operands[1:]:
        result = operation(result, other)
    return result


def _truth_at(holds, values: torch.Tensor) -> torch.Tensor | None:
    """A condition's value at each of `values` as a bool tensor of their shape; None where it is not a truth."""
    if type(holds) is bool:
        return torch.full(values.shape, holds, dtype=torch.bool)
    if isinstance(holds, torch.Tensor) and holds.dtype == torch.bool:
        return holds.expand(values.shape)
    return None


def _is_truth(x) -> bool:
    return type(x) is bool or (isinstance(x, torch.Tensor) and x.dtype == torch.bool)


def _truth(x):
    """`x` where it is a truth value (a Python bool, or a bool tensor), else _Inexact (sympy's And, Or and Not
    take truths only; an integer here is a spelling this file does not know)."""
    if _is_truth(x):
        return x
    raise _Inexact(f"not a truth value: {x!r}")


def _extremes(x) -> tuple[int, int]:
    """The least and greatest value of an integer operand (a Python int, or an int64 tensor), exactly; a bool is
    not an integer here (int64 arithmetic on it is not Python's)."""
    if type(x) is int:
        return x, x
    if isinstance(x, torch.Tensor) and x.dtype == torch.int64:
        return (int(x.min()), int(x.max())) if x.numel() else (0, 0)
    raise _Inexact(f"not an integer: {x!r}")


def _integer_op(operation, result_extremes):
    """An operation on two integers, exact: on two Python ints, Python's; with a tensor among them, int64's, where
    both operands and every value the result can take (`result_extremes(a_low, a_high, b_low, b_high)`, a
    (least, greatest) pair that also raises _Inexact where the operation is not defined) lie strictly inside
    +-_EXACT_BELOW."""
    def apply(a, b):
        bounds = (*_extremes(a), *_extremes(b))
        low, high = result_extremes(*bounds)
        if type(a) is int and type(b) is int:
            return operation(a, b)
        if any(not -_EXACT_BELOW < v < _EXACT_BELOW for v in (*bounds, low, high)):
            raise _Inexact("a value int64 may not hold exactly")
        return operation(torch.as_tensor(a, dtype=torch.int64), torch.as_tensor(b, dtype=torch.int64))
    return apply


def _sum_extremes(al, ah, bl, bh):
    return al + bl, ah + bh


def _product_extremes(al, ah, bl, bh):
    products = (al * bl, al * bh, ah * bl, ah * bh)
    return min(products), max(products)


def _nonzero_divisor(low: int, high: int) -> None:
    if low <= 0 <= high:
        raise _Inexact("a divisor that may be zero")


def _quotient_extremes(al, ah, bl, bh):
    """|a // b| <= |a| for every divisor b with |b| >= 1 (floor division, Python's)."""
    _nonzero_divisor(bl, bh)
    most = max(abs(al), abs(ah))
    return -most, most


def _python_mod_extremes(al, ah, bl, bh):
    """Python's a % b has the divisor's sign and |a % b| < |b|."""
    _nonzero_divisor(bl, bh)
    most = max(abs(bl), abs(bh))
    return -most, most


def _mod_extremes(al, ah, bl, bh):
    """torch.utils._sympy's `Mod` is defined for a >= 0 and b >= 1 only (there it equals Python's)."""
    if al < 0 or bl < 1:
        raise _Inexact("Mod outside a >= 0, b >= 1")
    return 0, bh


def _operands_extremes(al, ah, bl, bh):
    """A comparison, a max or a min: its result is one of its operands' values (or a truth)."""
    return min(al, bl), max(ah, bh)


def _equal(want_equal: bool):
    """sympy's Eq / Ne: on two integers (exact: _integer_op), or on two truths."""
    integers = _integer_op(operator.eq if want_equal else operator.ne, _operands_extremes)

    def apply(a, b):
        if not (_is_truth(a) or _is_truth(b)):
            return integers(a, b)
        a, b = _truth(a), _truth(b)
        if type(a) is bool and type(b) is bool:
            return a == b if want_equal else a != b
        return (torch.eq if want_equal else torch.ne)(torch.as_tensor(a), torch.as_tensor(b))
    return apply


def _logical(python, tensor):
    """sympy's And / Or on two truths."""
    def apply(a, b):
        a, b = _truth(a), _truth(b)
        if type(a) is bool and type(b) is bool:
            return python(a, b)
        return tensor(torch.as_tensor(a), torch.as_tensor(b))
    return apply


_EXACT_OPS = {
    "Add": _integer_op(operator.add, _sum_extremes),
    "Mul": _integer_op(operator.mul, _product_extremes),
    "FloorDiv": _integer_op(operator.floordiv, _quotient_extremes),  # torch.floor_divide: floor, as Python's
    "PythonMod": _integer_op(operator.mod, _python_mod_extremes),  # torch.remainder: the divisor's sign
    "Mod": _integer_op(operator.mod, _mod_extremes),
    "Max": _integer_op(lambda a, b: max(a, b) if type(a) is int else torch.maximum(a, b), _operands_extremes),
    "Min": _integer_op(lambda a, b: min(a, b) if type(a) is int else torch.minimum(a, b), _operands_extremes),
    "StrictLessThan": _integer_op(operator.lt, _operands_extremes),
    "LessThan": _integer_op(operator.le, _operands_extremes),
    "StrictGreaterThan": _integer_op(operator.gt, _operands_extremes),
    "GreaterThan": _integer_op(operator.ge, _operands_extremes),
    "Equality": _equal(True),
    "Unequality": _equal(False),
    "And": _logical(lambda a, b: a and b, torch.logical_and),
    "Or": _logical(lambda a, b: a or b, torch.logical_or),
}


def _passed_into_a_region(item: torch.fx.Node) -> bool:
    """With the range, Dynamo hands a compiled region (`invoke_subgraph`) the max itself where the width of a table
    is an expression of it; without it, a fresh width symbol the rules read. Such a max is traced again without
    the range."""
    region = _compat.invoke_subgraph_op()
    return region is not None and any(u.op == "call_function" and u.target is region for u in item.users)


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
