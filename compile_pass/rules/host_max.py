"""The max family's home: what every rule that replaces a max of lengths read on the host shares.

Three rules replace such a max `m = max(L)` by a static bound: the page table (`rules/page_table.py`), the
allocated table (`rules/allocated_table.py`) and the indptr bound (`rules/indptr_bound.py`). They differ in what
`m` sizes; they share everything else, here, once:

    check_max_of_lengths(read, ctx)        int lengths, not empty, a bound exists
    site_bound(source, ctx)                the static bound per site: max_context_len, length_bounds[name], sums
    HostMaxWalk.follow_value(m, offset)    the one walk over the uses of m:
        m + c, min(m + c, T)                 followed (net c >= 0; T at or above the bound)
        m - c, c - m                         refused: "subtracted"
        (m + c + ps - 1) // ps               a page count: the rule's `on_page_count` (rules without one refuse)
        torch._check(m + c <= T / >= k)      kept exactly, as a device assertion over the lengths (HostCheck)
        the graph output                     under static_escapes, leaves as the static bound
        anything else                        the rule's `on_use`, else `why_not` (its reason code)
    HostMaxWalk.relate(user, lengths, ..)  the consumer's lengths hold the max's values + k (k <= offset), and
                                           nothing writes them, their casts or a mirror pair in between
    rewrite helpers                        the host checks, the escapes, the lengths' device assertion

A rule subclasses HostMaxWalk for its proof and fills only its hooks; rules import from here, never from each
other. The `length_bounds` option is declared here and offered by every rule of the family.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from .._compat import example_value, placeholder_source_name
from ..consumers import bind_arguments
from ..find_sync_points import SyncPoint, attribute_name
from ..fx_util import erase_if_dead, insert_device_assert, insert_lower_assert, insert_value_assert, \
    node_location, replace_in_output
from ..normalize import (INT_DTYPES, asserted_bound, constant_add, dtype_of, is_narrowing, min_clamp, page_count,
                         plus_constant, strip_kept_values)
from ..proof import LengthsRelation, ProofContext, Unsafe, declare_reasons, describe_use, narrowed_by_copy, why_not
from . import Option
from ..bounds import lengths_bound, require_bound
from ..traced_ranges import META as TRACED_RANGE

REASONS = declare_reasons("host_max", {
    "empty_lengths": "the lengths are empty, and eager raises at the max",
    "subtracted": "the max minus a constant is no upper bound",
    "page_count": "a page count that rounds the bound down, or is used as something else",
    "not_an_upper_bound": "the value is passed to an argument that is not an upper bound",
    "no_lengths_fact": "the consumer has no lengths argument to tie the bound to",
    "unbounded_operand": "the max is over a sum with an operand that has no declared bound",
    "mismatch": "the lengths, the indices and the token table do not match in shape or device",
    "not_a_table": "the sliced tensor or the indices are not a token table and its request indices",
    "table_argument": "the page table is passed as something other than the page-table argument",
    "no_consumer": "the page table reaches no self-guarding consumer",
    "width_check": "the page table's width is checked by a check that must keep its meaning",
    "element_use": "an element of the list is used elsewhere, so its host read would stay",
})


def _check_length_bounds(name, value):
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in value.items()):
        raise TypeError(f"options['{name}'] must map lengths input names to non-negative ints, e.g. "
                        "{'verify_lens': 8}, got " + repr(value))
    return tuple(sorted(value.items()))


# Offered by every rule of the family (the same Option object: rules.declared_options accepts it once).
OPTIONS = {"length_bounds": Option(None, _check_length_bounds,
                                   "{lengths input name: bound}: per-site bounds for inputs other than the "
                                   "sequence lengths, e.g. {'verify_lens': 8}; a max over seq_lens + verify_lens "
                                   "is then bounded by max_context_len + 8")}


def check_max_of_lengths(read: SyncPoint, ctx: ProofContext) -> None:
    """What every rule for a max needs before its walk: int lengths, not empty (eager raises at the max of empty
    lengths, and so must the step), and a static bound to replace it with (max_context_len)."""
    if dtype_of(read.source) not in INT_DTYPES:
        raise Unsafe("not_int_lengths", f"the max is taken over a {dtype_of(read.source)} tensor, not int32/int64 "
                                        "lengths")
    numel = getattr(example_value(read.source), "numel", lambda: None)()
    if isinstance(numel, int) and numel == 0:
        raise Unsafe("empty_lengths", "the lengths are empty: eager raises at the max, and so must the step")
    require_bound(ctx.options)
    if read.kind == "tolist":
        check_list_elements(read)


def check_list_elements(read: SyncPoint) -> None:
    """max(t.tolist()): every element read must feed only the max chain, or an `.item()` stays."""
    members = set(read.nodes)
    for node in read.nodes:
        for user in (node.users if node is not read.value else ()):
            if user not in members:
                raise Unsafe("element_use", f"an element of the list is also used by {describe_use(user)}, so its "
                                            "host read would stay")


def site_bound(source: torch.fx.Node, ctx: ProofContext) -> tuple[int, str]:
    """The static bound of the values a max is taken over, per site: max_context_len for a lengths input,
    options['length_bounds'][name] for a declared input, the sum for a sum of inputs (at most one of them
    undeclared), plus constants added. Unsafe when no bound is known."""
    mcl = ctx.options.max_context_len

    def name_of(node):
        name = attribute_name(placeholder_source_name(node)) if node.op == "placeholder" else None
        twin = ctx.mirrors.get(node)
        return name, (attribute_name(placeholder_source_name(twin)) if twin is not None else None)

    def walk(node, defaults_left):
        root, _ = strip_kept_values(node, allow_moves=True, allow_narrowing=True)
        add = constant_add(root)
        if add is not None:
            inner, c = add
            value, text, left = walk(inner, defaults_left)
            return value + c, f"{text} {'+' if c >= 0 else '-'} {abs(c)}", left
        if root.op == "placeholder":
            bound = lengths_bound(ctx.options, *name_of(root))
            if bound is not None and bound.declared:
                return bound.value, bound.text, defaults_left
            if defaults_left < 1:
                raise Unsafe("unbounded_operand",
                             f"the max is over a sum whose operand {root.name} has no declared bound: give one with "
                             f"options['length_bounds']={{'{name_of(root)[0] or root.name}': N}}")
            return mcl, f"max_context_len={mcl}", defaults_left - 1
        if root.op == "call_function" and root.target in (operator.add, torch.add) and len(root.args) == 2 \
                and all(isinstance(a, torch.fx.Node) for a in root.args) and not root.kwargs:
            a_value, a_text, left = walk(root.args[0], defaults_left)
            b_value, b_text, left = walk(root.args[1], left)
            return a_value + b_value, f"{a_text} + {b_text}", left
        raise Unsafe("unbounded_operand",
                     f"the max is over {root.name}, computed by {describe_use(root)}; no bound is known for it "
                     "(a bound holds for lengths inputs, declared ones and their sums)")

    value, text, _ = walk(source, 1)
    return value, text


# -- plan parts every rule of the family shares (frozen: the rewrite reads them) ------------------------------
@dataclasses.dataclass(frozen=True)
class HostCheck:
    """`torch._check(m + c <= T)` or `(m + c >= k)` (a user's, or Dynamo's own) on the max: kept exactly, as a
    device assertion over the values the max was taken over (no host read)."""

    compare: torch.fx.Node
    asserts: tuple
    kind: str  # "upper": every value <= limit; "lower": the largest value >= limit
    limit: int
    values: torch.fx.Node  # where to assert: the max's source, or the device twin of a CPU mirror


@dataclasses.dataclass(frozen=True)
class LengthsUse:
    """A consumer (or writer) whose lengths the proof tied to the max, lengths = values + offset: under
    `checked`, they are asserted on the device to lie within [offset, bound + offset] (the values within
    [0, bound]) before `before` reads them."""

    lengths: torch.fx.Node
    offset: int  # the lengths' offset from the values the max was taken over
    bound: int  # the static bound that replaced the max
    before: torch.fx.Node
    ranged: bool = True  # under `checked`, asserted within [offset, bound + offset]
    # the proof's premise where the lengths subtract tensors (`seq_lens - extend_seq_lens + 4`): every length is
    # at most max(values) + c, asserted on the device checked or not (it says each subtracted value is >= 0)
    upto: tuple | None = None  # (values node, c)


def walk_the_max(walk_type, read: SyncPoint, ctx: ProofContext, defer_unbounded: bool = False):
    """The start of every proof in the family: the entry checks, the per-site bound, the walk over the max's
    uses (`walk_type`: the rule's HostMaxWalk). With `defer_unbounded`, a missing bound is raised after the walk:
    a use the rule refuses says more than the missing bound."""
    check_max_of_lengths(read, ctx)
    try:
        bound, bound_source = site_bound(read.source, ctx)
        traced = read.value.meta.get(TRACED_RANGE)
        if traced is not None and traced[0] < bound:
            # Dynamo traced the max within a narrower range (the mirror's own bound where the twin's is declared):
            # what it decided holds only there, so that is the bound, and what `checked` asserts
            bound, bound_source = traced
        unbounded = None
    except Unsafe as e:
        if not defer_unbounded:
            raise
        bound, bound_source, unbounded = ctx.options.max_context_len, "", e
    walk = walk_type(read, ctx, bound)
    walk.bound_source = bound_source
    walk.follow_value(read.value, 0)
    if unbounded is not None:
        raise unbounded
    return walk


class HostMaxRule:
    """The family's rule skeleton (rules.Rule): a rule of the family names itself, its walk (a HostMaxWalk with
    its hooks), which maxes it takes (`takes`, on the max's host value) and how a finished walk becomes its plan
    (`finish`). It offers the family's options."""

    name: str
    options = OPTIONS
    walk: type
    defer_unbounded = False

    def takes(self, value: torch.fx.Node) -> bool:
        return True

    def match(self, read: SyncPoint) -> bool:
        return read.is_max and self.takes(read.value)

    def prove(self, read: SyncPoint, ctx: ProofContext):
        return self.finish(walk_the_max(self.walk, read, ctx, self.defer_unbounded))

    def finish(self, walk):
        return walk.plan(walk.bound_source)


class HostMaxWalk:
    """One max's proof: the walk over its uses (shared) with the hooks a rule fills in.

    Hooks (override in a rule's walk):
        page_counts = False               whether `(m + c + ps - 1) // ps` is a use this rule understands
        host_checks = {"upper", "lower"}  which asserted checks on m it keeps on the device (others: kept max)
        on_page_count(count, ps, extra)   a page count with `extra` = the net offset past it (>= 0)
        on_use(user, node, offset)        any other use; True when the rule accepts it, else False
    """

    page_counts = False
    host_checks = frozenset({"upper", "lower"})

    def __init__(self, point: SyncPoint, ctx: ProofContext, bound: int):
        self.point, self.ctx, self.bound = point, ctx, bound
        self.source_root, self.source_chain = strip_kept_values(point.source, allow_moves=True,
                                                                allow_narrowing=True)
        self.first = ctx.first(point.nodes)
        self.bound_source = ""  # how the bound was found, for the report (walk_the_max sets it)
        self.offsets: list[torch.fx.Node] = []  # m + c, clamps and page counts: erased by the rewrite
        self.checks: list[HostCheck] = []
        self.escapes: list[tuple] = []  # (node, offset): the max (+ offset) leaves the graph (static_escapes)
        self.lengths_uses: list[LengthsUse] = []
        self.disjoint: set = set()

    # -- hooks --------------------------------------------------------------------------------------------
    def on_page_count(self, count: torch.fx.Node, page_size: int, extra: int) -> None:
        raise why_not(count, "the max")

    def on_use(self, user: torch.fx.Node, node: torch.fx.Node, offset: int) -> bool:
        return False

    # -- the one walk over the uses of the max ------------------------------------------------------------
    def follow_value(self, node: torch.fx.Node, offset: int, clamped: bool = False) -> None:
        for user in list(node.users):
            add = plus_constant(user, node)
            if add is not None and not clamped:
                if offset + add < 0:  # the net offset must stay >= 0: `m + 16 - 1` is fine, `m - 1` is not
                    raise Unsafe("subtracted",
                                 f"the max minus {-(offset + add)} ({describe_use(user)}) is not an upper bound")
                self.offsets.append(user)
                self.follow_value(user, offset + add)
                continue
            clamp = min_clamp(user, node)
            if clamp is not None:
                if clamp < self.bound + offset:
                    raise Unsafe("compared", f"the clamp at {node_location(user)} to {clamp} is below the static "
                                             f"bound {self.bound + offset}: it would change the value")
                self.offsets.append(user)  # min(m + c, T) == m + c for every m within the bound
                self.follow_value(user, offset, clamped=True)
                continue
            if user.op == "call_function" and user.target is operator.sub:
                raise Unsafe("subtracted", f"the max is used in a subtraction ({describe_use(user)}): not an upper "
                                           "bound")
            per_page = page_count(user, node) if self.page_counts else None
            if per_page is not None:
                if per_page < 1 or offset < per_page - 1:
                    raise Unsafe("page_count", f"`// {per_page}` at {node_location(user)} is not a page count "
                                               f"(m + {per_page - 1}) // {per_page}: it rounds the bound down")
                self.offsets.append(user)
                self.on_page_count(user, per_page, offset - (per_page - 1))
                continue
            if self.is_host_check(user, node, offset):
                continue
            if user.op == "output" and self.ctx.options.static_escapes:
                self.escapes.append((node, offset))
                continue
            if self.on_use(user, node, offset):
                continue
            raise why_not(user, "the max")

    def is_host_check(self, compare: torch.fx.Node, node: torch.fx.Node, offset: int) -> bool:
        """`m + c <= T` / `m + c >= k` feeding only asserts: kept, exactly, over the values of the max."""
        bound = asserted_bound(compare, node)
        if bound is None or bound[0] not in self.host_checks:
            return False
        kind, k = bound
        values = self.source_root
        twin = self.ctx.mirrors.get(values)
        if twin is not None:  # assert on the device, where the step runs
            self.ctx.check_no_writes(compare, [values, twin], "the CPU mirror or its twin", None, self.disjoint)
            values = twin
        self.ctx.check_no_writes(compare, [self.source_root, *self.source_chain], "the lengths",
                                 self.ctx.first([self.first, *self.source_chain]), self.disjoint)
        self.checks.append(HostCheck(compare, tuple(compare.users), kind, k - offset, values))
        return True

    @staticmethod
    def upper_bound_names(user: torch.fx.Node, entry, node: torch.fx.Node) -> list[str]:
        """The arguments of a consumer call that receive `node`; Unsafe unless every one is an upper bound."""
        names = [k for k, v in bind_arguments(entry.name, user.args, user.kwargs).items() if v is node]
        if not names or not all(k in entry.upper_bounds for k in names):
            raise Unsafe("not_an_upper_bound",
                         f"passed to {entry.name} as {names}, which is not an upper-bound argument")
        return names

    # -- lengths: the values a consumer guards by -----------------------------------------------------------
    def relate(self, user: torch.fx.Node, lengths, who: str, offset: int, allowed=(), extra=(),
               what: str = "the lengths") -> LengthsRelation:
        """The lengths `user` reads hold the max's values + k (k <= offset), unwritten since the max (`extra`:
        more nodes to protect from the same start, e.g. an indptr; `allowed`: writers whose facts say they write
        none of them). The use is recorded for the lengths' device assertion."""
        rel = self.ctx.relate_lengths(self.point.source, lengths, who, max_family=True)
        self.require_covered(rel, offset, f"{who} exceed the max by {rel.offset}")
        self.guard_lengths(user, rel, allowed, extra, what)
        return rel

    def require_covered(self, rel: LengthsRelation, offset: int, head: str) -> None:
        if rel.offset > offset:
            raise Unsafe("lengths_exceed", f"{head} but the bound adds only {offset}")

    def guard_lengths(self, user, rel: LengthsRelation, allowed=(), extra=(), what: str = "the lengths",
                      start_from=()) -> None:
        """Nothing writes the lengths (their casts, the max's values, `extra`) from their first read (or the
        first of `start_from`) to `user`; a mirror pair not from the graph's start on. Records the use."""
        start = self.ctx.first([self.first, *rel.chain, *self.source_chain, *extra, *start_from])
        for copy in rel.copies:  # the copy is the relation: it must come after the max, where the checks start
            if self.ctx.index(copy) < self.ctx.index(start):
                raise Unsafe("written", f"{what} are copied into their buffer at {node_location(copy)} before the "
                                        "max: what the buffer holds when the consumer reads it is not checked")
        self.ctx.check_no_writes(user, [self.source_root, *self.source_chain, rel.root, *rel.chain, rel.lengths,
                                        *extra], what, start, self.disjoint,
                                 allowed_writers=(*allowed, *rel.copies))
        for copy in rel.copies:  # a narrowing copy (int64 lengths into an int32 buffer): values wrap past the dtype
            narrowed = narrowed_by_copy(copy)
            if narrowed is None:
                continue
            if self.bound + max(rel.offset, 0) > torch.iinfo(narrowed[1]).max:
                raise Unsafe("narrowing_copy", f"{what} are copied from {narrowed[0]} into a {narrowed[1]} buffer at "
                                               f"{node_location(copy)} and the bound {self.bound} does not fit "
                                               f"{narrowed[1]}: a value would wrap")
            # under checked, the copy's wide source is asserted within the bound (the check on the buffer alone
            # would let a wrapped value through); within it, every value fits and the copy keeps it
            self.lengths_uses.append(LengthsUse(rel.root, -rel.source_offset, self.bound, user))
        if rel.via_mirror:
            mirror = rel.root if rel.root in self.ctx.mirrors else self.source_root
            self.ctx.check_no_writes(user, [mirror, self.ctx.mirrors.get(mirror)], "the CPU mirror or its twin",
                                     None, self.disjoint, allowed_writers=allowed)
        if rel.clamped:  # max(values + k, 0): the values are asserted through the clamp's input
            self.lengths_uses.append(LengthsUse(rel.exact, rel.exact_offset, self.bound, user))
        elif rel.subtracted:  # values - y + k: the premise y >= 0 on the lengths, the bound on the values
            self.lengths_uses.append(LengthsUse(rel.lengths, rel.offset, self.bound, user, ranged=False,
                                                upto=(rel.root, rel.offset + rel.source_offset)))
            self.lengths_uses.append(LengthsUse(rel.root, -rel.source_offset, self.bound, user))
        else:
            self.lengths_uses.append(LengthsUse(rel.lengths, rel.offset, self.bound, user))

    # -- what every plan of the family touches ---------------------------------------------------------------
    def shared_touches(self) -> set:
        return set(self.point.nodes) | set(self.offsets) | {c.compare for c in self.checks}


# -- the rewrite's shared parts ----------------------------------------------------------------------------------
def rewrite_host_checks(graph: torch.fx.Graph, checks) -> list[torch.fx.Node]:
    """Each host check runs on the device, exactly; returns the nodes it replaces (erased when dead)."""
    dead = []
    for check in checks:
        where = node_location(check.compare)
        if check.kind == "upper":
            insert_device_assert(graph, check.compare, check.values, check.limit,
                                 f"syncfree: the check at {where} failed: a length exceeds {check.limit}")
        else:
            insert_lower_assert(graph, check.compare, check.values, check.limit,
                                f"syncfree: the check at {where} failed: the max is below {check.limit}")
        dead += [*check.asserts, check.compare]
    return dead


def rewrite_escapes(graph: torch.fx.Graph, escapes, bound: int) -> None:
    """options['static_escapes']: the max (+ offset) leaves the graph as the static bound (+ offset)."""
    replace_in_output(graph, {node: bound + offset for node, offset in escapes})


def assert_lengths(graph: torch.fx.Graph, uses, checked: bool, bound_source: str) -> bool:
    """The lengths' device assertions (no host read), one per (lengths, window), before the first reader:
    - checked: the values the max was taken over lie in [0, bound] (a length past the static bound, or a negative
      one, raises), asserted where the consumer reads them: lengths = values + offset within
      [offset, bound + offset]; on the values before an int64 -> int32 narrowing, where the lengths pass one (a
      wide value that wraps into the range, -2**32 + 5, is outside it);
    - lengths narrowed (int64 -> int32) keep the relation the proof rests on, that no consumer length exceeds
      what eager's max covered, only while they fit: that is asserted too, checked or not (the proof's premise,
      not a bound check), against the max of the wide values. Returns whether a bound check was made."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    firsts: dict[tuple, torch.fx.Node] = {}
    for use in uses:
        key = (use.lengths, use.offset, use.bound, use.ranged, use.upto)
        firsts[key] = min(firsts.get(key, use.before), use.before, key=lambda n: order.get(n, -1))
    for (lengths, low, bound, ranged, upto), before in firsts.items():
        where = node_location(before)
        wide, passed = strip_kept_values(lengths, allow_moves=False, allow_narrowing=True)
        narrowing = min((n for n in passed if is_narrowing(n)), key=order.get, default=None)  # the first
        if narrowing is not None:
            insert_value_assert(graph, before, lengths, wide,
                                f"syncfree: lengths narrowed to int32 at {where} exceed the max of the values they "
                                "were narrowed from (they do not fit int32)")
        if upto is not None:
            values, extra = upto
            insert_value_assert(graph, before, lengths, values,
                                f"syncfree: lengths at {where} exceed the max they were sized by + {extra}: a value "
                                "they subtract is negative", offset=extra)
        if checked and ranged:
            # on the values the first narrowing reads, where it reads them (int32 values of the range can come
            # from int64 values outside it); else on the lengths, where the consumer reads them
            values, at = (narrowing.args[0], narrowing) if narrowing is not None else (lengths, before)
            insert_device_assert(graph, at, values, bound + low,
                                 f"syncfree: a sequence length exceeds the static bound that replaced its max, or is "
                                 f"negative: outside [0, {bound}] ({bound_source}) at {where}", low=low)
    return checked and bool(firsts)


def erase_read(graph: torch.fx.Graph, plan, dead=()) -> None:
    """The host read, its offsets and page counts, and what else the plan made dead (`dead`), last first."""
    erase_if_dead(graph, [*dead, *plan.offsets, plan.point.value, *plan.point.nodes])
