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
  * only the max of the lengths as the call passed them in (the contract is on the inputs): in the call's first
    frame (FrameEntry.first: entered by torch.compile's wrapper, not by code of the call: a frame resumed after a
    graph break, a function Dynamo compiles on its own, a recursive call of the compiled function get none), and
    only where no node of the graph built so far before the `.item()` may write the lengths, an alias of them, the
    max's result, another graph input (Dynamo does not guard on aliasing between inputs) or memory the write log
    cannot place (_written_before: compile_pass.mutations' default-deny log, the graph side's allow-list). A max
    refused there is traced as without the backend; the log and the report of the graph break say why
    (undecided_branches);
  * `torch._check` on the fake value makes Dynamo record two deferred runtime asserts, which it puts in the graph
    as `_assert_scalar(u0 >= 0)` / `_assert_scalar(u0 <= bound)`. The backend takes them out before the pass
    (`strip_range_asserts`: they are the backend's bookkeeping, not the user's) and, after the pass:
      - a max the pass rewrote is gone from the graph, and the rewrite's own device assertion (`checked=True`:
        every length in [0, bound]) covers the range; with `checked=False` the range is the user's promise, as
        the rewrite itself is;
      - a max the pass kept that Dynamo passed into a compiled region (with the range it hands the region the
        max itself, not a fresh width symbol the rules read), in the call's first frame (nothing of the call ran)
        on the first attempt, has the frame traced again without the range (`Retrace`), as Dynamo traces it by
        itself; kept there too, it is traced a third time with the range only, for good;
      - any other kept max gets the two asserts back, right after its
        `.item()` (`recheck_kept`): a host check of a value already on the host, so the kept graph never runs on
        an assumption it did not check.
A branch of the user's code whose outcome differs inside the range (TRTLLM-MLA's `if blocks % lcm != 0`, False at
m = 0 only) is traced with the outcome it has at the bound, where all of this holds: `checked=True`, the frame
Dynamo traces is the call's first frame, of the compiled function's own code (FrameEntry.retraceable: nothing of
the call has run yet, and a Retrace re-runs exactly that call), and the condition's one symbol is
such a ranged max. Dynamo records the outcome as a runtime assertion; the backend takes it out before the pass
and never puts it back (a valid length must not raise: issue 45), then (traced_ranges.settle_at_bound):
  - the pass rewrote the max: the frame is traced again with the branch's other outcome (mode "other", where no
    second branch is decided); where both traces are one computation (the same rewritten graph over the same
    inputs, the same code before and after it, no Python random calls: trace_signature.frame_signature), that
    graph gives eager's values for every max in the range (each trace is eager's computation for the maxima that
    take its outcome, and each rewrite is proven for them) and is kept with no assertion;
  - under static_escapes, where the bound's outcome regrows the scratch that the other outcome slices as it is
    (trace_signature.regrown_scratch), the frame is traced a third time at the bound's outcome (mode "regrown")
    and that graph, the bound's outcome's again, is kept with no assertion: for every max it computes what eager
    computes, the scratch stored at the static width;
  - otherwise (the graphs differ, several branches or maxima, the max kept): the frame is traced again with the
    range only (nothing ran, so nothing runs twice): Dynamo breaks at the branch as it does without the backend,
    and the kept max runs exactly as eager.
Dynamo narrows the max's range by the outcome it was traced with (`2 < cdiv(u0, 64)`: u0 >= 129) and asserts that
range in the graph: those asserts are the outcome's too, and go with it (traced_ranges.NARROWED).
A branch that compares input sizes with a value of ranged maxima (`buf.shape[1] < cdiv(m, 64)` once Dynamo made the
scratch's width a dynamic size) is decided for every value of the maxima where a guard on the sizes alone makes it
so (decided_by_sizes: `s >= 64`), a shape guard Dynamo checks before the graph runs: nothing is assumed.
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
import os

import torch
import torch.fx

from . import _compat, bounds, traceable
from .find_sync_points import attribute_name
from .fx_util import node_location
from .log import log
from .mutations import WriteLog
from .normalize import max_nodes
from .traced_ranges import (AT_BOUND, FIRST, META, NARROWED, OTHER, REGROWN, UNRANGED, Retrace, implied_outcome,
                             lengths_of)


class TracingPolicy:
    """The bounds the backend may give while Dynamo traces one compiled function, from the backend's options.

    `root_code`: the code object of the compiled function. Where Dynamo compiles the call's first frame
    (FrameEntry.retraceable: nothing of the call has run yet) and that frame has this code, the backend may have
    it traced again (Retrace); a nested frame of the same code (a recursive call after a graph break) is not it.
    `modes` is where each `.item()` line is on the way there: absent (the range, and a differing branch traced at
    the bound under `checked=True`), "other" (the same, with that branch's other outcome: `evidence[line]` is the
    first trace's rewritten graph), "regrown" (the bound's outcome again, after the other outcome was found to slice
    the scratch the bound's outcome regrows: `evidence[line]` is the bound's outcome's trace, which this one must
    be), "unranged" (the frame as Dynamo traces it without the backend), "final" (the range only, for good)."""

    def __init__(self, opts, root_code=None):
        self.options = opts
        self.checked = opts.checked
        self.root_code = root_code
        self.modes: dict[str, str] = {}
        self.evidence: dict = {}  # line -> the TraceSignature of the bound's outcome (modes "other", "regrown")
        self.why: dict[str, str] = {}  # line -> why a branch on its max breaks the graph (mode "final")
        self.denied: dict[str, str] = {}  # line -> why its max was traced without the range (_range_refusal)
        self.decided: set = set()  # the lines whose branch this attempt traced at an outcome (_on_guard)
        self.failed = None  # the exception this attempt's compile of the call's first frame raised (_recorded)

    @classmethod
    def from_options(cls, opts, fn=None) -> "TracingPolicy":
        return cls(opts, getattr(getattr(fn, "__func__", fn), "__code__", None))

    def bound_of(self, name: str | None) -> tuple[int, str] | None:
        """(bound, how it was set) for a lengths input called `name`, or None when it is not one: only inputs
        named as lengths get a range while Dynamo traces (compile_pass.bounds says why)."""
        found = bounds.lengths_bound(self.options, name, named_lengths_only=True)
        return None if found is None else (found.value, found.text)


_ACTIVE: list[TracingPolicy] = []
_RANGEABLE: dict = {}  # (id(shape_env), symbol) -> what _give_range takes: a lengths max not yet given its range
_AT_BOUND: dict = {}  # (id(shape_env), symbol) -> (bound, item node): guards on it are traced at the bound


def lengths_bound(item: torch.fx.Node, policy: TracingPolicy) -> tuple[int, str] | None:
    """The bound of a captured `.item()` whose receiver is a full max of a lengths graph input, else None."""
    source = lengths_of(item)
    if source is None or str(getattr(_compat.example_value(source), "dtype", "")) not in ("torch.int32",
                                                                                          "torch.int64"):
        return None
    return policy.bound_of(attribute_name(_compat.placeholder_source_name(source)))


class FrameEntry:
    """How the frame Dynamo is compiling was entered, recorded where Dynamo starts compiling it (_on_frame_record).

    `first`: the frame is the outermost frame of a call of the compiled function, entered by torch.compile's own
    wrapper (its caller is no frame of the user's code): nothing of that call has run, so its inputs are the call's
    arguments as they came in, which is all the contract speaks of. A frame resumed after a graph break, a function
    Dynamo compiles on its own because the caller could not inline it, a recursive call of the compiled function:
    code of the call ran before each (it may have written the lengths, or passed other values under their name),
    so none is first. `retraceable`: first, and the call is the innermost `call_retracing`'s own (its caller is
    that frame): a Retrace raised while it compiles re-runs exactly that call, of which nothing has run."""

    __slots__ = ("first", "retraceable", "why")

    def __init__(self, first: bool, retraceable: bool, why: str = ""):
        self.first, self.retraceable, self.why = first, retraceable, why


_FRAMES: list[FrameEntry] = []  # one per frame Dynamo is compiling while a call traces (the innermost last)
_ENTERED: list = []  # the frames that entered an active bounded_maxima themselves (they call the compiled function)


def _frame_entry() -> FrameEntry:
    """The FrameEntry of the frame Dynamo is about to compile (called from the frame-compile hook)."""
    found = _compat.compiling_frame_entry()
    if found is None:
        return FrameEntry(False, False, "where Dynamo compiles this frame could not be read on this torch")
    through_wrapper, outer = found
    where = "the top of the stack" if outer is None else \
        f"{outer.f_code.co_name} ({os.path.basename(outer.f_code.co_filename)}:{outer.f_lineno})"
    if not through_wrapper:
        return FrameEntry(False, False, f"Dynamo traces a frame that {where} called (resumed after a graph break, "
                                        "not inlined, or a recursive call), not the compiled function's call "
                                        "itself: code of the call ran before it, so the lengths it reads need "
                                        "not be the call's inputs as they came in")
    if outer is not None and outer.f_code is call_retracing.__code__:
        return FrameEntry(True, True)
    if outer is not None and any(outer is entered for entered in _ENTERED):
        return FrameEntry(True, False)
    return FrameEntry(False, False, f"Dynamo traces a compiled function that {where} called inside the call, not "
                                    "the call itself: its inputs need not be the call's inputs as they came in")


@contextlib.contextmanager
def _recorded(entry: FrameEntry):
    _FRAMES.append(entry)
    try:
        yield
    except BaseException as e:
        if entry.retraceable and _ACTIVE:  # nothing of the call ran: call_retracing may trace it again
            _ACTIVE[-1].failed = e
        raise
    finally:
        _FRAMES.pop()


def _on_frame_record():
    """A frame-compile hook: while a call traces, the FrameEntry of each frame Dynamo compiles, for its whole
    compile (computed here, where the frame-compile wrapper is on the stack)."""
    if not (_CALLS or _ACTIVE):
        return None
    return _recorded(_frame_entry())


def _storage_keys(nodes) -> set:
    keys = set()
    for node in nodes:
        value = _compat.example_value(node)
        if isinstance(value, torch.Tensor):
            keys.add(_compat.storage_id(value))
    return keys


def _written_before(item: torch.fx.Node, source: torch.fx.Node) -> str | None:
    """Why the value `item` reads may not be the max of the lengths input `source` as the call passed it in, or
    None. The graph Dynamo has built so far holds everything the frame did before this `.item()` (a tensor op
    Dynamo cannot put in the graph breaks it, ending the frame's graph); each of its nodes is judged by
    compile_pass.mutations' default-deny write log (the graph side's one allow-list). A node before the `.item()`
    may write only memory the graph allocated itself: a write that may reach the lengths (a view of them, another
    input sharing their storage), the max's result, another graph input (Dynamo does not guard on aliasing between
    inputs: it may be the lengths' memory in a later call) or memory the log cannot place refuses the range."""
    graph = item.graph
    writes = WriteLog(graph)
    protected = _storage_keys([source])
    receiver = item.args[0] if item.args else None
    if isinstance(receiver, torch.fx.Node):
        protected |= _storage_keys([receiver, *max_nodes(receiver)])
    inputs: dict = {}
    unplaced = None  # a get_attr of the graph whose memory is not known (not a tensor, not a region's body)
    for node in graph.nodes:
        if node.op == "placeholder":
            for key in _storage_keys([node]):
                inputs.setdefault(key, node)
        elif node.op == "get_attr":
            keys = _storage_keys([node])
            for key in keys:
                inputs.setdefault(key, node)
            if not keys and not all(isinstance(u.target, torch._ops.HigherOrderOperator) for u in node.users):
                unplaced = unplaced or node
    position = writes.order.get(item)
    if position is None:
        return "the .item() is not in the graph Dynamo is building"
    for at, writer, keys in writes.writes:
        if at >= position:
            break
        what = f"{writer.op} {getattr(writer.target, '__name__', writer.target)} at {node_location(writer)}"
        for key in keys:
            if key is None:
                return f"{what} may write memory that the write log cannot place (default deny: it may be the " \
                       "lengths), before the max"
            if key in protected:
                return f"{what} may write the lengths (or a view of them, or the max's result) before the max: " \
                       "the max is then not the max of the lengths the call passed in"
            if key in inputs:
                return f"{what} writes the graph input {inputs[key].name} before the max, which may share memory " \
                       "with the lengths when the step runs (Dynamo does not guard on aliasing between inputs)"
            if unplaced is not None:
                return f"{what} writes memory before the max, and the graph reads {unplaced.name} whose memory " \
                       "is not known (it may be the lengths)"
    return None


def _range_refusal(item: torch.fx.Node, source: torch.fx.Node) -> str | None:
    """Why the max read by `item` gets no range while Dynamo traces (it is traced as without the backend), or
    None: the frame must be the first of the call (FrameEntry) and nothing before the `.item()` may have written
    the lengths (_written_before). Default deny: a frame whose entry was not recorded gets none."""
    entry = _FRAMES[-1] if _FRAMES else None
    if entry is None:
        return "the frame Dynamo traces was not recorded where its compile started (no frame-compile hook)"
    if not entry.first:
        return entry.why
    return _written_before(item, source)


def _on_item(item: torch.fx.Node, value, root_code) -> None:
    """A captured `.item()`: a full max of declared lengths becomes rangeable (the range itself is given only
    where a branch of the user's code needs it: `_on_guard`), in the first frame of the call and only where
    nothing before it may have written the lengths (_range_refusal); otherwise it is traced as without the
    backend, and the reason is kept for the report (undecided_branches) and the log."""
    if not _ACTIVE or _compat.symbol_of(value) is None or not isinstance(value, torch.SymInt):
        return
    policy = _ACTIVE[-1]
    found = lengths_bound(item, policy)
    if found is None:
        return
    line = node_location(item)
    refused = _range_refusal(item, lengths_of(item))
    if refused is not None:
        policy.denied[line] = refused
        log.info("syncfree: the max at %s is traced without its range [0, %d]: %s", line, found[0], refused)
        return
    policy.denied.pop(line, None)
    entry = _FRAMES[-1]
    root = entry.retraceable and root_code is not None and root_code is policy.root_code
    mode = policy.modes.get(line)
    if mode == "unranged":
        if root:
            item.meta[UNRANGED] = line
        return
    if mode == "other" and root:
        item.meta[OTHER] = policy.evidence.get(line)
    if mode == "regrown" and root:  # the bound's outcome again: it must be the trace compared (settle_at_bound)
        item.meta[REGROWN] = policy.evidence.get(line)
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
    if root and mode in (None, "other", "regrown"):
        item.meta[FIRST] = node_location(item)
        if checked:
            item.meta[AT_BOUND] = []
            _AT_BOUND[(id(_compat.shape_env_of(value)), _compat.symbol_of(value))] = (bound, item)


def _on_guard(shape_env, expr):
    """A branch of the user's code on maxima that Dynamo cannot decide. A rangeable max in it gets its range
    first, and the branch is evaluated again (`_compat.RETRY`): a branch that holds, or fails, for every value in
    [0, bound] is then decided without a guard. A branch that still differs inside the range is traced with its
    outcome at the bound (mode "other": the first such branch with the other outcome), which a runtime
    assertion records; the backend never keeps that assertion (traced_ranges.settle_at_bound: the two outcomes'
    rewritten graphs must be one graph, or the frame is traced again without deciding the branch)."""
    import sympy

    symbols = list(getattr(expr, "free_symbols", None) or ())
    pending = [_RANGEABLE.pop((id(shape_env), s)) for s in symbols if (id(shape_env), s) in _RANGEABLE]
    if pending:
        for entry in pending:
            _give_range(*entry)
        return _compat.RETRY
    decided = decided_by_sizes(shape_env, expr) if _ACTIVE else None  # only while a call of ours traces
    if decided is not None:
        return decided
    entries = [_AT_BOUND.get((id(shape_env), s)) for s in symbols]
    if len(entries) != 1 or entries[0] is None:  # one ranged max: its device assertion computes that max
        return None
    value = expr.xreplace({s: sympy.Integer(e[0]) for s, e in zip(symbols, entries)})
    if value not in (sympy.true, sympy.false):
        return None
    (bound, item), = entries
    implied = implied_outcome(item, expr, bound)
    if implied is not None:  # the same for every value the outcomes traced so far admit: no new assumption
        return implied
    if OTHER in item.meta:  # the second trace: the first branch's other outcome; no other branch is decided
        if item.meta[AT_BOUND]:  # here (their combinations would not all be traced): Dynamo breaks there
            return None
        value = sympy.false if value is sympy.true else sympy.true
    guard = expr if value is sympy.true else sympy.Not(expr)
    before = [_compat.symbol_range(shape_env, symbol) for symbol in symbols]
    text = _compat.assert_at_runtime(shape_env, guard, f"syncfree: traced at the bound: {guard}")
    for symbol, was, (_, item) in zip(symbols, before, entries):
        item.meta[AT_BOUND].append((text, guard))
        if _ACTIVE and FIRST in item.meta:
            _ACTIVE[-1].decided.add(item.meta[FIRST])
        # Dynamo narrows the max's range by the outcome (`2 < cdiv(u0, 64)`: u0 >= 129) and asserts that range
        # in the graph: part of the outcome's assumption, taken out with it (strip_range_asserts). Only the ends
        # this assertion moved: an end the user's own check set before it stays the user's (found by a helper's
        # programs, 2026-12-05: `torch._check(m >= 129)` before a parity branch was taken out with it).
        now = _compat.symbol_range(shape_env, symbol)
        if was is not None and now is not None and now != was:
            item.meta[NARROWED] = (now[0] if now[0] != was[0] else None, now[1] if now[1] != was[1] else None)
    return value


_RELATIONS = None  # sympy's four order relations, as (class, the relation with its sides swapped)


def decided_by_sizes(shape_env, expr):
    """A branch comparing input sizes with a value of ranged maxima, `s < f(u)` (FlashMLA's `buf.shape[1] <
    cdiv(m, 64)` once Dynamo made the scratch's width a dynamic size s): decided for every value of the maxima by
    a guard on the sizes alone, where the sizes of this call give one outcome for the whole range. With f(u) in
    [lo, hi] over the maxima's ranges (bound_sympy: never narrower than the values), `s < f(u)` is False for every
    u where s >= hi and True where s < lo (and alike for <=, >, >=); the guard (`s >= hi`) is one of Dynamo's
    shape guards, checked on the host before the graph runs (a call where it fails compiles again). Only an order
    relation whose one side holds input sizes only and whose other side holds ranged maxima only; anything else
    (an equality, a mixed side, a value without a finite range) is not decided here (None)."""
    import sympy
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    global _RELATIONS
    if _RELATIONS is None:
        _RELATIONS = {sympy.StrictLessThan: sympy.StrictGreaterThan, sympy.LessThan: sympy.GreaterThan,
                      sympy.StrictGreaterThan: sympy.StrictLessThan, sympy.GreaterThan: sympy.LessThan}
    relation = type(expr)
    if relation not in _RELATIONS:
        return None
    facts = _compat.size_facts(shape_env, expr)
    if facts is None:
        return None
    hints, ranges = facts
    lhs, rhs = expr.lhs, expr.rhs
    if lhs.free_symbols and lhs.free_symbols <= set(hints) and rhs.free_symbols and rhs.free_symbols <= set(ranges):
        sizes, maxima = lhs, rhs
    elif rhs.free_symbols and rhs.free_symbols <= set(hints) and lhs.free_symbols and lhs.free_symbols <= set(ranges):
        sizes, maxima, relation = rhs, lhs, _RELATIONS[relation]  # read as `sizes <relation> maxima`
    else:
        return None
    try:
        found = bound_sympy(maxima, {s: ValueRanges(lo, hi) for s, (lo, hi) in ranges.items()})
        lo, hi, now = int(found.lower), int(found.upper), int(sizes.xreplace(hints))
    except (TypeError, ValueError, AttributeError):  # an infinite or symbolic end: not decided
        return None
    # sizes R f(u) for every f in [lo, hi]: (True where ..., False where ...), each a condition on the sizes
    always = {sympy.StrictLessThan: (sympy.Lt(sizes, lo), sympy.Ge(sizes, hi)),
              sympy.LessThan: (sympy.Le(sizes, lo), sympy.Gt(sizes, hi)),
              sympy.StrictGreaterThan: (sympy.Gt(sizes, hi), sympy.Le(sizes, lo)),
              sympy.GreaterThan: (sympy.Ge(sizes, hi), sympy.Lt(sizes, lo))}[relation]
    for value, condition in zip((sympy.true, sympy.false), always):
        if condition.xreplace(hints) is sympy.true and _compat.guard_sizes(shape_env, condition):
            log.debug("syncfree: %s decided %s for every value of the maxima by the guard %s (now %s)", expr, value,
                      condition, now)
            return value
    return None


@contextlib.contextmanager
def bounded_maxima(policy: TracingPolicy):
    """While Dynamo traces inside this block, a max of declared lengths read with `.item()` lies in [0, bound]
    (the module docstring says when, and why that is sound)."""
    _compat.on_captured_item(_on_item)
    _compat.on_data_dependent_guard(_on_guard)
    _compat.on_user_class_call(_on_class_call)
    _compat.on_disabled_call(_on_disabled_call)
    _compat.on_frame_compile(_on_frame_record)
    _ACTIVE.append(policy)
    _ENTERED.append(_entering_frame())
    try:
        yield
    finally:
        _ENTERED.pop()
        _ACTIVE.pop()
        if not _ACTIVE:
            _AT_BOUND.clear()
            _RANGEABLE.clear()


# The calls of compile_pass.compile in progress, innermost last: each one's tracing context (a callable making the
# context manager), entered where Dynamo compiles a frame during that call (issue 43), not around every call.
_CALLS: list = []
_HOOKED: list = []  # [True] once the frame-compile hook is installed


def _on_frame_compile():
    return _CALLS[-1]() if _CALLS else None


def hook_frame_compiles() -> bool:
    """Install (once) the hook that enters the innermost call's tracing context where Dynamo compiles a frame,
    after the one that records how that frame was entered (_on_frame_record); False on a torch where they cannot
    be installed (call_traced then enters the context around every call, and no frame gets a range)."""
    if not _HOOKED and _compat.on_frame_compile(_on_frame_record) and _compat.on_frame_compile(_on_frame_compile):
        _HOOKED.append(True)
    return bool(_HOOKED)


def _entering_frame():
    """The frame whose `with` statement entered bounded_maxima (past contextlib's frames), or None."""
    import sys

    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == contextlib.__file__:
        frame = frame.f_back
    return frame


def call_traced(compiled, policy: TracingPolicy, context, /, *args, **kwargs):
    """`call_retracing(compiled, policy, ...)` as compile_pass.compile calls it: `context()` (capture_scalar_outputs,
    bounded_maxima, the report collector: what the call gives Dynamo) is entered around each frame Dynamo compiles
    during the call, the refused traces of a Retrace included. A call whose frames Dynamo's cache serves enters
    nothing: none of it is read outside a compile (Dynamo does not guard on capture_scalar_outputs; the hooks act
    only while it traces, the collector only when the backend reports). Without the hook (hook_frame_compiles()
    False) the context is entered around the whole call."""
    if not _HOOKED:
        with context():
            return call_retracing(compiled, policy, *args, **kwargs)
    _CALLS.append(context)
    try:
        return call_retracing(compiled, policy, *args, **kwargs)
    finally:
        _CALLS.pop()


def call_retracing(compiled, policy: TracingPolicy, *args, **kwargs):
    """`compiled(*args, **kwargs)`; where the backend asks for it (Retrace, raised while Dynamo compiles the
    call's first frame, FrameEntry.retraceable: nothing of the call has run), the call again with those lines' next
    mode. A line goes from the range (with a differing branch at the bound) to the range only, or to no range (a max
    passed into a compiled region: what Dynamo traces by itself, which the pass may rewrite) and then, if kept
    there too, to the range only, for good."""
    try:
        while True:
            seen = _compat.graph_break_count()
            policy.decided, policy.failed = set(), None
            try:
                return compiled(*args, **kwargs)
            except Exception as e:
                inner = e if isinstance(e, Retrace) else getattr(e, "inner_exception", None)
                if not isinstance(inner, Retrace):
                    inner = _outcome_failed(policy, e)
                if not isinstance(inner, Retrace) or all(policy.modes.get(k) == v for k, v in inner.modes.items()):
                    raise
                policy.modes.update(inner.modes)
                policy.evidence.update(inner.evidence)
                policy.why.update(inner.why)
                _compat.discard_graph_breaks(seen)  # the refused trace's breaks: its graph never runs
    finally:
        # A bound's outcome's evidence belongs to this call's compile only, returned or raised (as eager raises):
        # a recompile (another batch size under dynamic=False, other guards) traces both outcomes again and
        # compares them with each other, not with this compile's graph, which has other constants.
        for line in [line for line, mode in policy.modes.items() if mode in ("other", "regrown")]:
            del policy.modes[line]
            policy.evidence.pop(line, None)


def _outcome_failed(policy: TracingPolicy, error: Exception) -> Retrace | None:
    """Where the compile of the call's first frame failed (nothing of the call ran) while a branch on a bounded max
    was traced at an outcome (this attempt decided it, or it is the other outcome's or the regrown scratch's trace):
    the user's code need not hold for that outcome's maxima alone (`torch._check(m > 128)` after a branch whose
    other outcome is m <= 128; found by a helper's programs, 2026-12-05). Those lines are traced again with the
    range only (Dynamo breaks at the branch, eager's values); an error that does not come from the outcome is
    raised again by that trace."""
    failed, chain = policy.failed, []
    seen = error
    while seen is not None and len(chain) < 16:
        chain.append(seen)
        seen = getattr(seen, "inner_exception", None) or seen.__cause__ or seen.__context__
    lines = policy.decided | {line for line, mode in policy.modes.items() if mode in ("other", "regrown")}
    if failed is None or not lines or not any(e is failed for e in chain):
        return None
    text = (str(failed).strip().splitlines() or [type(failed).__name__])[0][:200]
    return Retrace({line: "final" for line in lines},
                   why={line: f"tracing with the branch's outcome decided failed ({type(failed).__name__}: {text})"
                        for line in lines})


def undecided_branches() -> list[str]:
    """Why each branch on a bounded max of the call being traced breaks the graph (mode "final"), as
    "the max at LINE has a branch ...": what the backend adds to such a graph break's report."""
    if not _ACTIVE:
        return []
    policy = _ACTIVE[-1]
    return [f"the max at {line} has a branch whose outcome differs inside [0, bound], not decided: {why}"
            for line, why in sorted(policy.why.items()) if policy.modes.get(line) == "final"] + \
           [f"the max at {line} was traced without its range [0, bound]: {why}"
            for line, why in sorted(policy.denied.items())]


def _on_class_call(tx, cls, args, kwargs):
    return traceable.on_class_call(tx, cls, args, kwargs) if _ACTIVE else None


def _on_disabled_call(tx, fn, args, kwargs):
    return traceable.on_disabled_call(tx, fn, args, kwargs) if _ACTIVE else None
