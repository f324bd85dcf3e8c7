"""What the backend gives Dynamo while it traces (issue 30): the value range of a max of declared lengths.

The FX pass sees only what Dynamo traced. An engine that branches on a host max before it sizes a table
(SGLang's FlashMLA grows a scratch table `if buf.shape[1] < cdiv(m, 64)`) breaks the graph there: with `m` an
unbacked symbol of unknown range, Dynamo cannot decide the branch. The rules already assume that such a max lies
in `[0, bound]` (bound = max_context_len, or options['length_bounds'][name]) when they rewrite it, and
`checked=True` asserts it on the device. So while Dynamo traces, the `.item()` of a full max of a lengths graph
input gets that range:

    max_1 = l_fb_seq_lens_cpu.max();  item = max_1.item()        # Sym(u0)
    torch._check(u0 >= 0); torch._check(u0 <= 256)                 # applied here, on the fake value: the
                                                                   # ShapeEnv knows u0 in [0, 256]
    if buf.shape[1] < (u0 + 63) // 64:   # buf 4 wide: False for every u0 in [0, 256], no guard, no break

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
      - a max the pass kept gets the two asserts back, right after its `.item()` (`recheck_kept`): a host check
        of a value already on the host, so the kept graph never runs on an assumption it did not check.
A guard whose outcome differs inside the range (TRTLLM-MLA's `if blocks % lcm != 0`, False at m = 0) is not
decided by the range: Dynamo still breaks there, and the report names the line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator

import torch
import torch.fx

from . import _compat
from .find_sync_points import attribute_name
from .normalize import ASSERTS, asserted_bound, max_source

LENGTHS_NAMES = frozenset({"seq_lens", "seq_lens_cpu"})
META = "syncfree_range"  # node.meta key on an `.item()` node given a range: (bound, text)


@dataclasses.dataclass(frozen=True)
class TracingPolicy:
    """The bounds the backend may give while Dynamo traces, from the backend's options."""

    max_context_len: int | None
    length_bounds: tuple = ()  # ((name, bound), ...)
    mirror_names: frozenset = frozenset()

    @classmethod
    def from_options(cls, opts) -> "TracingPolicy":
        bounds = dict(opts.rule_option("length_bounds") or ())
        mirrors = frozenset(n for pair in opts.cpu_mirrors for n in pair)
        return cls(opts.max_context_len, tuple(sorted(bounds.items())), mirrors)

    def bound_of(self, name: str | None) -> tuple[int, str] | None:
        """(bound, how it was set) for a lengths input called `name`, or None when it is not one."""
        declared = dict(self.length_bounds)
        if name in declared:
            return declared[name], f"length_bounds['{name}']={declared[name]}"
        if self.max_context_len is not None and (name in LENGTHS_NAMES or name in self.mirror_names):
            return self.max_context_len, f"max_context_len={self.max_context_len}"
        return None


_ACTIVE: list[TracingPolicy] = []


def lengths_bound(item: torch.fx.Node, policy: TracingPolicy) -> tuple[int, str] | None:
    """The bound of a captured `.item()` whose receiver is a full max of a lengths graph input, else None."""
    if not item.args:
        return None
    source = max_source(item.args[0])
    if not isinstance(source, torch.fx.Node) or source.op != "placeholder":
        return None
    if str(getattr(_compat.example_value(source), "dtype", "")) not in ("torch.int32", "torch.int64"):
        return None
    return policy.bound_of(attribute_name(_compat.placeholder_source_name(source)))


def _on_item(item: torch.fx.Node, value) -> None:
    if not _ACTIVE or _compat.symbol_of(value) is None or not isinstance(value, torch.SymInt):
        return
    found = lengths_bound(item, _ACTIVE[-1])
    if found is None:
        return
    bound, text = found
    torch._check(value >= 0)
    torch._check(value <= bound)
    item.meta[META] = (bound, text)


@contextlib.contextmanager
def bounded_maxima(opts):
    """While Dynamo traces inside this block, a max of declared lengths read with `.item()` lies in [0, bound]
    (the module docstring says when, and why that is sound)."""
    _compat.on_captured_item(_on_item)
    _ACTIVE.append(TracingPolicy.from_options(opts))
    try:
        yield
    finally:
        _ACTIVE.pop()


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
        for compare in list(item.users):
            if asserted_bound(compare, item) not in (("lower", 0), ("upper", bound)):
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
    ("user-defined class construction",
     "to make this line traceable: Dynamo cannot allocate this class with object.__new__ (an extension type such "
     "as a msgspec.Struct); define it as a dataclass or NamedTuple with the same fields"),
    ("torch.compiler.disable",
     "to keep the step in one graph: call the kernel through a torch.library.custom_op (mutates_args= what it "
     "writes, with register_fake) instead of a torch.compiler.disable()d wrapper; its facts can then be "
     "registered (register_self_guarding_consumer / register_indptr_bound_consumer)"),
)


def fix_for(reason: str) -> str | None:
    """The one change that makes the line traceable, for a graph break Dynamo reported with `reason`."""
    return next((fix for words, fix in TRACEABILITY_FIXES if words in reason), None)
