"""What the backend gives Dynamo while it traces (issue 30): the value range of a max of declared lengths.

The FX pass sees only what Dynamo traced. An engine that branches on a host max before it sizes a table
(SGLang's FlashMLA grows a scratch table `if buf.shape[1] < cdiv(m, 64)`) breaks the graph there: with `m` an
unbacked symbol of unknown range, Dynamo cannot decide the branch. The rules already assume that such a max lies
in `[0, bound]` (bound = max_context_len, or options['length_bounds'][name]) when they rewrite it, and
`checked=True` asserts it on the device. So while Dynamo traces, the `.item()` of a full max of a lengths graph
input gets that range, at the first branch of the user's code that needs it (a max no branch decides is traced
exactly as Dynamo traces it by itself: its graph, and so its compile, is the one without the backend):

    max_1 = l_fb_seq_lens_cpu.max();  item = max_1.item()        # Sym(u0)
    if buf.shape[1] < (u0 + 63) // 64:   # undecidable: torch._check(u0 >= 0), torch._check(u0 <= 256) on the
                                         # fake value, then evaluated again: buf 4 wide, False for every u0 in
                                         # [0, 256], no guard, no break

What gets a range, and why it is sound:
  * only an `.item()` whose receiver is a full max (normalize.max_source) of a graph input whose name is a
    lengths name: `seq_lens`, `seq_lens_cpu`, a name of `cpu_mirrors`, or a key of `length_bounds`; the bound is
    `length_bounds[name]` when declared, else max_context_len. Nothing else (a max of an intermediate, of a sum,
    of another input) gets one;
  * `torch._check` on the fake value makes Dynamo record two deferred runtime asserts, which it puts in the graph
    as `_assert_scalar(u0 >= 0)` / `_assert_scalar(u0 <= bound)`. The backend takes them out before the pass
    (`strip_range_asserts`: they are the backend's bookkeeping, not the user's) and, after the pass:
      - a max the pass rewrote is gone from the graph, and the rewrite's own device assertion (`checked=True`:
        every length in [0, bound]) covers the range; with `checked=False` the range is the user's promise, as
        the rewrite itself is;
      - a max the pass kept that Dynamo passed into a compiled region (with the range it hands the region the
        max itself, not a fresh width symbol the rules read), in the compiled function's own frame on the first
        attempt, has the frame traced again without the range (`Retrace`), as Dynamo traces it by itself; kept
        there too, it is traced a third time with the range only, for good;
      - any other kept max gets the two asserts back, right after its
        `.item()` (`recheck_kept`): a host check of a value already on the host, so the kept graph never runs on
        an assumption it did not check.
A branch of the user's code whose outcome differs inside the range (TRTLLM-MLA's `if blocks % lcm != 0`, False at
m = 0 only) is traced with the outcome it has at the bound, the width a rewrite gives, where all of this holds:
`checked=True`, the frame Dynamo traces is the compiled function's own (nothing of the call has run yet), and
the condition's one symbol is such a ranged max. Dynamo records the outcome as a runtime assertion; the
backend takes it out before the pass and then:
  - the pass rewrote the max (its proof: the result does not depend on the max within the bound, for the code
    traced): the outcome is asserted on the device, on the max of the lengths (`_assert_async`, no host read),
    so a step whose max would take the other branch raises instead of running code that was not traced for it;
  - the pass kept the max: the frame is traced again as above (nothing ran, so nothing runs twice), never at
    the bound again: Dynamo breaks at the branch as it does without the backend, and the kept max runs exactly
    as eager.
Only the user's branches (Dynamo's `SymNodeVariable.evaluate_expr`) are decided this way, never a guard torch
evaluates internally (those fall back to a general path by themselves).

Two side effects of the range, undone before the pass (`run_sync_pass`): Dynamo spells a table's width as an
expression of the max (`u0`, `sym_min(256, u0 + 2)`) where it allocated a fresh symbol before
(`respell_widths` reads it back as `sym_size`, the same value), and a max that only the range asserts used stays
in the graph (`strip_range_asserts` drops it, as Dynamo drops an unused one).

Only `compile_pass.compile` (and the callers that enter `bounded_maxima`) give the range:
`torch.compile(fn, backend="syncfree")` hands the backend a graph Dynamo has already traced.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx

from . import _compat
from .find_sync_points import attribute_name
from .fx_util import insert_call, node_location
from .normalize import ASSERTS, asserted_bound, max_source

LENGTHS_NAMES = frozenset({"seq_lens", "seq_lens_cpu"})
META = "syncfree_range"  # node.meta key on an `.item()` node given a range: (bound, text)


class TracingPolicy:
    """The bounds the backend may give while Dynamo traces one compiled function, from the backend's options.

    `root_code`: the code object of the compiled function. While Dynamo compiles that frame nothing of the call
    has run yet, so the backend may have it traced again (Retrace). `modes` is where each `.item()` line is on
    the way there: absent (the range, and a differing branch traced at the bound under `checked=True`),
    "unranged" (the frame as Dynamo traces it without the backend), "final" (the range only, for good)."""

    def __init__(self, opts, root_code=None):
        self.max_context_len = opts.max_context_len
        self.length_bounds = dict(opts.rule_option("length_bounds") or ())
        self.mirror_names = frozenset(n for pair in opts.cpu_mirrors for n in pair)
        self.mirrors = dict(opts.cpu_mirrors)
        self.checked = opts.checked
        self.root_code = root_code
        self.modes: dict[str, str] = {}

    @classmethod
    def from_options(cls, opts, fn=None) -> "TracingPolicy":
        return cls(opts, getattr(getattr(fn, "__func__", fn), "__code__", None))

    def bound_of(self, name: str | None) -> tuple[int, str] | None:
        """(bound, how it was set) for a lengths input called `name`, or None when it is not one."""
        if name in self.length_bounds:
            return self.length_bounds[name], f"length_bounds['{name}']={self.length_bounds[name]}"
        if self.max_context_len is not None and (name in LENGTHS_NAMES or name in self.mirror_names):
            return self.max_context_len, f"max_context_len={self.max_context_len}"
        return None


_ACTIVE: list[TracingPolicy] = []
_RANGEABLE: dict = {}  # (id(shape_env), symbol) -> what _give_range takes: a lengths max not yet given its range
_AT_BOUND: dict = {}  # (id(shape_env), symbol) -> (bound, item node): guards on it are traced at the bound
AT_BOUND = "syncfree_at_bound"  # node.meta key on such an `.item()`: [(assert text, guard), ...]
FIRST = "syncfree_first"  # on a ranged `.item()` of the compiled function's frame, first attempt: its line
UNRANGED = "syncfree_unranged"  # on an `.item()` traced without the range, to compare: its line


def lengths_bound(item: torch.fx.Node, policy: TracingPolicy) -> tuple[int, str] | None:
    """The bound of a captured `.item()` whose receiver is a full max of a lengths graph input, else None."""
    source = lengths_of(item)
    if source is None or str(getattr(_compat.example_value(source), "dtype", "")) not in ("torch.int32",
                                                                                          "torch.int64"):
        return None
    return policy.bound_of(attribute_name(_compat.placeholder_source_name(source)))


def lengths_of(item: torch.fx.Node) -> torch.fx.Node | None:
    """The graph input an `.item()` takes the full max of, or None."""
    source = max_source(item.args[0]) if item.args else None
    return source if isinstance(source, torch.fx.Node) and source.op == "placeholder" else None


def _on_item(item: torch.fx.Node, value, root_code) -> None:
    """A captured `.item()`: a full max of declared lengths becomes rangeable (the range itself is given only
    where a branch of the user's code needs it: `_on_guard`)."""
    if not _ACTIVE or _compat.symbol_of(value) is None or not isinstance(value, torch.SymInt):
        return
    policy = _ACTIVE[-1]
    found = lengths_bound(item, policy)
    if found is None:
        return
    root = root_code is not None and root_code is policy.root_code
    line = node_location(item)
    mode = policy.modes.get(line)
    if mode == "unranged":
        if root:
            item.meta[UNRANGED] = line
        return
    _RANGEABLE[(id(_compat.shape_env_of(value)), _compat.symbol_of(value))] = (value, item, found, root, mode,
                                                                                policy.checked)


def _give_range(value, item: torch.fx.Node, found: tuple[int, str], root: bool, mode: str | None,
                checked: bool) -> None:
    """The range [0, bound] on the max's symbol, from here on in the trace (Dynamo records the two checks as
    runtime assertions right after the `.item()`)."""
    bound, text = found
    torch._check(value >= 0)
    torch._check(value <= bound)
    item.meta[META] = (bound, text)
    if root and mode is None:
        item.meta[FIRST] = node_location(item)
        if checked:
            item.meta[AT_BOUND] = []
            _AT_BOUND[(id(_compat.shape_env_of(value)), _compat.symbol_of(value))] = (bound, item)


def _on_guard(shape_env, expr):
    """A branch of the user's code on maxima that Dynamo cannot decide. A rangeable max in it gets its range
    first, and the branch is evaluated again (`_compat.RETRY`): a branch that holds, or fails, for every value in
    [0, bound] is then decided without a guard. A branch that still differs inside the range is traced with its
    outcome at the bound, which a runtime assertion records (the backend turns it into a device assertion when
    the max is rewritten, and has the frame traced again without it when the max is kept)."""
    import sympy

    symbols = list(getattr(expr, "free_symbols", None) or ())
    pending = [_RANGEABLE.pop((id(shape_env), s)) for s in symbols if (id(shape_env), s) in _RANGEABLE]
    if pending:
        for entry in pending:
            _give_range(*entry)
        return _compat.RETRY
    entries = [_AT_BOUND.get((id(shape_env), s)) for s in symbols]
    if len(entries) != 1 or entries[0] is None:  # one ranged max: its device assertion computes that max
        return None
    value = expr.xreplace({s: sympy.Integer(e[0]) for s, e in zip(symbols, entries)})
    if value not in (sympy.true, sympy.false):
        return None
    guard = expr if value is sympy.true else sympy.Not(expr)
    text = _compat.assert_at_runtime(shape_env, guard, f"syncfree: traced at the bound: {guard}")
    for _, item in entries:
        item.meta[AT_BOUND].append((text, guard))
    return value


@contextlib.contextmanager
def bounded_maxima(policy: TracingPolicy):
    """While Dynamo traces inside this block, a max of declared lengths read with `.item()` lies in [0, bound]
    (the module docstring says when, and why that is sound)."""
    _compat.on_captured_item(_on_item)
    _compat.on_data_dependent_guard(_on_guard)
    _compat.on_user_class_call(_on_class_call)
    _compat.on_disabled_call(_on_disabled_call)
    _ACTIVE.append(policy)
    try:
        yield
    finally:
        _ACTIVE.pop()
        if not _ACTIVE:
            _AT_BOUND.clear()
            _RANGEABLE.clear()


class Retrace(Exception):
    """Raised by the backend where the pass kept a max of the compiled function's own frame that a retrace may
    still get rewritten: `modes` maps its line to the next way to trace it (TracingPolicy.modes)."""

    def __init__(self, modes: dict):
        super().__init__("syncfree: the max at " + ", ".join(f"{line} (next: {mode})" for line, mode in
                                                             sorted(modes.items())) + " is kept; tracing again")
        self.modes = dict(modes)


def call_retracing(compiled, policy: TracingPolicy, *args, **kwargs):
    """`compiled(*args, **kwargs)`; where the backend asks for it (Retrace, raised while Dynamo compiles the
    compiled function's own frame: nothing of the call has run), the call again with those lines' next mode.
    A line goes from the range (with a differing branch at the bound) to the range only, or to no range (a max
    passed into a compiled region: what Dynamo traces by itself, which the pass may rewrite) and then, if kept
    there too, to the range only, for good."""
    while True:
        seen = len(_compat.graph_break_reasons())
        try:
            return compiled(*args, **kwargs)
        except Exception as e:
            inner = e if isinstance(e, Retrace) else getattr(e, "inner_exception", None)
            if not isinstance(inner, Retrace) or all(policy.modes.get(k) == v for k, v in inner.modes.items()):
                raise
            policy.modes.update(inner.modes)
            _compat.discard_graph_breaks(seen)  # the refused trace's breaks: its graph never runs


# -- the backend's side: before and after the pass ------------------------------------------------------------
def ranged_items(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if META in n.meta]


def strip_range_asserts(graph: torch.fx.Graph) -> int:
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


def traced_at_bound(graph: torch.fx.Graph, mirrors: dict | None = None) -> list[tuple]:
    """(item, lengths input, guards, after) of every ranged `.item()` whose frame was traced at the bound. `after`
    is the last node before the `.item()` that may write the lengths (or, for a CPU mirror in `mirrors`, its
    device twin) in place, None when none does: the device assertion of the outcomes is made after it, on the
    values the max was taken over."""
    from .mutations import WriteLog

    found = [n for n in ranged_items(graph) if n.meta.get(AT_BOUND)]
    if not found:
        return []
    log, first = WriteLog(graph), next(iter(graph.nodes))
    return [(item, lengths_of(item), [g for _, g in item.meta[AT_BOUND]],
             log.last_write([lengths_of(item), (mirrors or {}).get(lengths_of(item))], first, item)) for item in found]


def settle_at_bound(graph: torch.fx.Graph, assumed: list[tuple], mirrors: dict) -> int:
    """After the pass: a max of the compiled function's frame that the pass kept asks for the frame to be traced
    again (Retrace) where that may change the outcome: without the range where the max is passed into a
    compiled region, with the range only where a branch was traced at the bound; a rewritten one
    traced at the bound gets each branch outcome it was traced with asserted on the device, on the max of its
    lengths (the device twin of a CPU mirror). Returns how many device assertions were inserted."""
    retrace = {}
    for item in ranged_items(graph):  # kept: still in the graph
        if FIRST not in item.meta:
            continue
        if _passed_into_a_region(item):
            retrace[item.meta[FIRST]] = "unranged"
        elif item.meta.get(AT_BOUND):
            retrace[item.meta[FIRST]] = "final"
    retrace.update({n.meta[UNRANGED]: "final" for n in graph.nodes if UNRANGED in n.meta})
    if retrace:
        raise Retrace(retrace)
    count = 0
    first = next(n for n in graph.nodes if n.op != "placeholder")
    present = set(graph.nodes)
    for item, lengths, guards, after in assumed:
        lengths = mirrors.get(lengths) or lengths
        # after the last in-place write of the lengths before the max: the values the max was taken over
        anchor = after.next if after is not None and after in present else first
        top = insert_call(graph, anchor, torch.amax, (lengths,), lengths)
        for guard in guards:
            holds = _device_value(graph, anchor, guard, top, lengths)
            insert_call(graph, anchor, torch.ops.aten._assert_async.msg,
                        (holds, f"syncfree: a branch at {node_location(item)} was traced with the outcome it "
                                f"has at the bound ({guard}), and this step's max of the lengths does not give it"),
                        lengths)
            count += 1
    return count


ADMITTED_LIMIT = 1 << 22  # past this many values the domain is not enumerated (None)


def admitted_values(item: torch.fx.Node, bound: int) -> torch.Tensor | None:
    """The values in [0, bound] that the max read by `item` can take in a step that runs: those where every branch
    it was traced with at the bound has that outcome (settle_at_bound asserts each on the device when the max is
    rewritten; a max with none gets no assertion and every value). A guard that cannot be evaluated here (not of
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


def _device_value(graph, anchor, expr, value: torch.fx.Node, like: torch.fx.Node):
    """The sympy expression `expr` of one symbol, computed with tensor ops on the device tensor `value`."""
    return _evaluate(expr, value, lambda op, *args: insert_call(graph, anchor, op, args, like),
                     lambda x: isinstance(x, torch.fx.Node))


def _evaluate(expr, value, call, is_value):
    """The sympy expression `expr` of one symbol, `value` standing for it: operations on Python ints folded, every
    other one made by `call(op, *args)` (a graph node, or a tensor op on the host); `is_value` tells what `call`
    made from a folded int. The one spelling of the guards, for the device assertion and the proof's domain."""
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


# -- constructs that break the trace before any max: the one change that makes the line traceable -----------
# Neither is rewritten for the user: a torch.compiler.disable()d wrapper may write anything it receives (a
# custom op needs its mutated arguments declared), and an extension type's constructor is native code. The
# report says, at the line Dynamo broke, what the user changes.
TRACEABILITY_FIXES = (
    ("syncfree: msgspec.Struct not modelled",
     "to make this line traceable: build the object without running code at construction (no __post_init__, "
     "no default_factory for a field left out, msgspec's own metaclass), or define it as a dataclass or "
     "NamedTuple with the same fields"),
    ("syncfree: registered launcher not traced",
     "to trace this call as its registered op: add that argument to the op's schema "
     "(register_disabled_launcher), or call the launcher with it at its default"),
    ("user-defined class construction",
     "to make this line traceable: Dynamo cannot allocate this class with object.__new__ (an extension type such "
     "as a msgspec.Struct); compile through compile_pass.compile (a msgspec.Struct is then traced as the plain "
     "container it is), or define it as a dataclass or NamedTuple with the same fields"),
    ("torch.compiler.disable",
     "to keep the step in one graph: register the launcher with compile_pass.register_disabled_launcher (the "
     "schema of the op it is, `Tensor(a!)` for what it writes) and compile through compile_pass.compile, or call "
     "the kernel through a torch.library.custom_op (mutates_args= what it writes, with register_fake) instead of "
     "a torch.compiler.disable()d wrapper; its facts can then be registered (register_self_guarding_consumer / "
     "register_indptr_bound_consumer)"),
)


def fix_for(reason: str) -> str | None:
    """The one change that makes the line traceable, for a graph break Dynamo reported with `reason`."""
    return next((fix for words, fix in TRACEABILITY_FIXES if words in reason), None)


# -- constructs that break the trace before any max: traced where that is sound --------------------------------
# While compile_pass.compile traces (bounded_maxima), two constructs that Dynamo breaks at are traced:
#
#   * a msgspec.Struct built by the user's code (SGLang's KVIndexTable, RaggedTargetVerifyGeometry): a Struct is a
#     plain attribute container whose constructor (native code) stores each argument in its field and runs nothing
#     else. Modelled as that container (_compat.struct_variable): fields read as the values given, methods and
#     properties inlined, anything else breaks the graph where Python builds the object as eager does; wherever it
#     leaves the graph it is built with `cls(**fields)`, which stores the same values. Refused (Dynamo breaks as
#     before, and the report names the one change) where construction runs more than the stores: a
#     `__post_init__`, a default_factory for a field not given, a metaclass other than msgspec's, a class that
#     overrides __new__ / __init__, or arguments that do not bind to the fields (eager raises there).
#   * a torch.compiler.disable()d launcher registered with register_disabled_launcher: its call is traced as a call
#     of the op it was registered with (the schema declares what it writes), where every argument the op does not
#     take is at the launcher's default; else the break stands and the report names the argument.
def struct_refusal(cls) -> str | None:
    """None when `cls` is a msgspec.Struct class whose construction only stores its arguments; else why not.
    Raises LookupError for a class that is not a msgspec.Struct."""
    meta = type(cls)
    if not (hasattr(cls, "__struct_fields__") and hasattr(cls, "__struct_config__")
            and any(m.__module__.startswith("msgspec") and m.__name__ == "StructMeta" for m in meta.__mro__)):
        raise LookupError(cls)
    if meta.__module__.split(".")[0] != "msgspec":
        return f"its metaclass {meta.__name__} is not msgspec's (it may run code at construction)"
    if getattr(cls, "__post_init__", None) is not None:
        return "it defines __post_init__, which runs the class's own code after the fields are stored"
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "msgspec":
            break
        if "__new__" in vars(klass) or "__init__" in vars(klass):
            return f"{klass.__name__} overrides __new__ / __init__"
    return None


def _struct_fields(cls, args, kwargs) -> tuple[dict | None, str | None]:
    """({field: VariableTracker}, None) for a construction that only stores its arguments, or (None, why not)."""
    import inspect

    try:
        bound = inspect.signature(cls).bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        return None, f"its arguments do not bind to the fields ({e}); eager raises there"
    fields = {}
    for name in cls.__struct_fields__:
        if name in bound.arguments:
            fields[name] = bound.arguments[name]
            continue
        default = inspect.signature(cls).parameters[name].default
        if type(default).__name__ == "Factory" or not _is_plain_default(default):
            return None, f"field {name!r} is not given and its default is built at construction (default_factory)"
        fields[name] = _compat.constant_variable(default)
    return fields, None


def _is_plain_default(value) -> bool:
    return value is None or type(value) in (bool, int, float, str, bytes) or (
        type(value) is tuple and all(_is_plain_default(v) for v in value))


STRUCT_REFUSED = "syncfree: msgspec.Struct not modelled"


def _on_class_call(tx, cls, args, kwargs):
    if not _ACTIVE:
        return None
    try:
        why = struct_refusal(cls)
    except LookupError:
        return None
    fields = None
    if why is None:
        fields, why = _struct_fields(cls, args, kwargs)
    if why is not None:
        _compat.unsupported(f"{STRUCT_REFUSED} ({cls.__qualname__})", f"{cls.__qualname__} cannot be traced as a plain container: {why}")
    try:
        return _compat.struct_variable(cls, fields)
    except (ImportError, AttributeError):  # a torch whose Dynamo lacks what the model needs: break as before
        return None


# -- registered torch.compiler.disable()d launchers ------------------------------------------------------------
_LAUNCHERS: dict = {}  # the launcher function -> the op its calls are traced as


def register_disabled_launcher(launcher, op=None, *, name: str | None = None, schema: str | None = None):
    """Trace calls of `launcher` made through a torch.compiler.disable() wrapper (where Dynamo breaks the graph)
    as calls of a torch op with declared facts, while compile_pass.compile traces. Returns the op (its
    OpOverloadPacket), on which facts are registered as on any op (register_indptr_bound_consumer, ...).

    Either `op=`: your torch.library op whose arguments are parameters of `launcher` by name; or `name=` and
    `schema=`: the op is defined here, `torch.library.define(name, schema)`, with the launcher as its
    implementation and a fake that returns nothing. The schema must return nothing (`-> ()`: a launcher that
    writes its outputs in place) and mark every tensor the launcher writes `Tensor(a!)`: that is your
    declaration, as `mutates_args` is for torch.library.custom_op. At run time the op calls `launcher` with the
    schema's arguments by name and raises if it returns a value.

    A call is traced as the op only where every argument that the op does not take is at the launcher's default
    (a constant equal to it, or not passed); else Dynamo breaks there as before and the report names the
    argument. Calls through `torch.compile(fn, backend="syncfree")` are not changed (the backend sees the graph
    after Dynamo traced it): compile through compile_pass.compile."""
    import inspect

    if not callable(launcher):
        raise TypeError(f"register_disabled_launcher: launcher must be a function, got {type(launcher).__name__}")
    launcher = _compat.disabled_target(launcher) or launcher
    if (op is None) == (schema is None):
        raise TypeError("register_disabled_launcher: give op= (your op) or name= and schema= (defined here)")
    params = inspect.signature(launcher).parameters
    if op is None:
        if not name or "::" not in name:
            raise TypeError(f"register_disabled_launcher: name= must be 'namespace::op', got {name!r}")
        op = _define_launcher_op(launcher, name, schema)
    packet = getattr(op, "_qualified_op_name", None) and (op if hasattr(op, "overloads") else op.overloadpacket)
    if packet is None:
        raise TypeError(f"register_disabled_launcher: op must be a torch op, got {op!r}")
    schemas = _compat.overload_schemas(packet)
    if len(schemas) != 1:
        raise TypeError(f"register_disabled_launcher: {packet._qualified_op_name} must have one overload")
    missing = [a.name for a in schemas[0][1].arguments if a.name not in params]
    if missing:
        raise TypeError(f"register_disabled_launcher: {packet._qualified_op_name} takes {missing}, which "
                        f"{launcher.__qualname__} has no parameter of that name for")
    _LAUNCHERS[launcher] = packet
    return packet


def unregister_disabled_launcher(launcher) -> None:
    _LAUNCHERS.pop(_compat.disabled_target(launcher) or launcher, None)


def registered_launchers() -> dict:
    """{launcher: op} registered with register_disabled_launcher."""
    return dict(_LAUNCHERS)


def _define_launcher_op(launcher, name: str, schema: str):
    if not isinstance(schema, str) or not schema.replace(" ", "").endswith("->()"):
        raise TypeError(f"register_disabled_launcher: schema must return nothing ('... -> ()'), got {schema!r}")
    namespace, opname = name.split("::", 1)
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define(opname + schema)
    packet = getattr(getattr(torch.ops, namespace), opname)
    argument_names = [a.name for a in _compat.overload_schemas(packet)[0][1].arguments]

    def run(*args, **kwargs):
        given = dict(zip(argument_names, args))
        given.update(kwargs)
        result = launcher(**given)
        if result is not None:
            raise RuntimeError(f"{name}: {launcher.__qualname__} returned a value; its schema returns nothing")

    def fake(*args, **kwargs):
        return None

    lib.impl(opname, run, "CompositeExplicitAutograd")
    torch.library.register_fake(name, fake, lib=lib)
    _LIBRARIES.append(lib)
    return packet


_LIBRARIES: list = []  # kept alive: a Library's definitions go with it


LAUNCHER_REFUSED = "syncfree: registered launcher not traced"


def _on_disabled_call(tx, fn, args, kwargs):
    if not _ACTIVE or fn not in _LAUNCHERS:
        return None
    import inspect

    packet = _LAUNCHERS[fn]
    schema = _compat.overload_schemas(packet)[0][1]
    signature = inspect.signature(fn)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        return None  # eager raises there: the break stands
    taken = {a.name for a in schema.arguments}
    for pname, vt in bound.arguments.items():
        if pname in taken:
            continue
        param = signature.parameters[pname]
        known, value = _compat.constant_of(vt)
        default = param.default
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or default is inspect.Parameter.empty \
                or not known or not _same_default(value, default):
            _compat.unsupported(f"{LAUNCHER_REFUSED} ({pname}=)",
                                f"{fn.__qualname__} is called with {pname}= other than its default, and "
                                f"{packet._qualified_op_name} does not take {pname}")
    positional, keywords = [], {}
    for argument in schema.arguments:
        if argument.name in bound.arguments:
            vt = bound.arguments[argument.name]
        else:
            vt = _compat.constant_variable(signature.parameters[argument.name].default)
        if not _fits(argument, vt):
            _compat.unsupported(f"{LAUNCHER_REFUSED} ({argument.name}=)",
                                f"{fn.__qualname__} is called with {argument.name}= of a kind its op's schema "
                                f"does not take ({argument.type})")
        (keywords.__setitem__(argument.name, vt) if argument.kwarg_only else positional.append(vt))
    return _compat.trace_call(tx, packet, positional, keywords)


def _fits(argument, vt) -> bool:
    """Does the traced value `vt` fit the schema argument's kind (a tensor for a tensor, None only where
    optional, no tensor for a scalar)? torch checks the rest when the op is traced."""
    text = str(argument.type)
    optional = text.startswith("Optional[")
    known, value = _compat.constant_of(vt)
    if known and value is None:
        return optional
    if text in ("Tensor", "Optional[Tensor]"):
        return _compat.is_tensor_variable(vt)
    return not _compat.is_tensor_variable(vt)


def _same_default(value, default) -> bool:
    if value is None or default is None or isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return type(value) is type(default) and _is_plain_default(value) and value == default
