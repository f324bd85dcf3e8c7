"""The safety proof: may a dynamic max be replaced by the static bound? (docs/design.md, "The safety rule")

It reasons about values, not graph nodes. Every use of the max `m` must be one of
  1. the stop of a page-table gather `X[rpi, :m:ps] // ps` (value-keeping int32/int64 casts allowed) whose
     result reaches only the page-table argument of self-guarding consumers;
  2. an upper-bound argument of a self-guarding consumer (max_seqlen_k, ...);
  3. `m + c` for a constant c >= 0, feeding 1 or 2 (never `m - c`: that is no upper bound);
every such consumer's lengths must hold the values the max was taken over (value-keeping casts and device
copies of the same tensor, `x + k` with 0 <= k <= c, or the declared CPU mirror <-> device twin pair), and
nothing may write in place to the lengths, the token table, the request indices or an alias of them between
the max, the gather and the consumers. Anything else keeps the max, with the reason.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from ._compat import example_value
from .consumers import SelfGuardingConsumer, bind_arguments, lookup_consumer
from .find_sync_points import SyncPoint
from .mutations import WriteLog
from .normalize import (INT_DTYPES, arange_step, as_gather, ceil_div, column_step, constant_add, device_of,
                        dtype_of, page_count,
                        floor_divisor, is_value_cast, min_clamp, scalar_add, strip_kept_values, value_kept_input)
from .report import node_location

_INT = INT_DTYPES
_COMPARES = {operator.ge, operator.le, operator.gt, operator.lt, operator.eq, operator.ne}
# Dynamo spells runtime asserts as aten._assert_scalar, and (torch 2.11/2.12) a user's torch._check as itself.
_ASSERTS = {torch.ops.aten._assert_scalar.default, torch._check}
_ARITHMETIC = {operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow, operator.neg,
               operator.add, operator.sub, torch.sym_max, torch.sym_min}


@dataclasses.dataclass
class ConsumerGroup:
    """Consumers of one page table that guard by the same lengths node: one rebuilt table serves them."""

    lengths: torch.fx.Node
    consumers: list[tuple[torch.fx.Node, SelfGuardingConsumer]]
    length_offset: int  # lengths = (values the max was taken over) + length_offset


@dataclasses.dataclass
class GatherPlan:
    chain: list[torch.fx.Node]  # gather, step slice, floordiv, casts (graph order); the last feeds consumers
    groups: list[ConsumerGroup]
    req_to_token: torch.fx.Node
    req_pool_indices: torch.fx.Node
    page_size: int
    offset: int
    bookkeeping: list[torch.fx.Node]  # Dynamo's own sym_size / compare / _assert_scalar nodes on the width
    terminal: torch.fx.Node  # the finished table (consumers get it, or a value-keeping cast of it)
    token_width: int  # req_to_token's width (in pages for a page-level table): no gather is wider
    page_level: bool = False  # the table holds page ids, sliced by a page count (m + ps - 1) // ps


@dataclasses.dataclass
class BoundPlan:
    consumer: torch.fx.Node
    argument: str
    offset: int
    lengths: torch.fx.Node
    length_offset: int


@dataclasses.dataclass
class MirrorSwap:
    """The consumer's lengths are a device copy of the CPU mirror: read the device twin instead."""

    consumer: torch.fx.Node
    argument: str
    copy: torch.fx.Node  # the consumer's lengths argument (the copy, or a value-keeping cast of it)
    twin: torch.fx.Node


@dataclasses.dataclass
class CheckPlan:
    """A user's `torch._check(m + c <= T)`: kept as a device assertion that every length is <= limit."""

    compare: torch.fx.Node
    asserts: list[torch.fx.Node]
    lengths: torch.fx.Node  # the values the max was taken over, on the device where possible
    limit: int


@dataclasses.dataclass
class Escape:
    """Under options['static_escapes']: the max (+ offset) or a value sized by it leaves the graph."""

    node: torch.fx.Node  # the escaping node (the max, m + c, the page table, the strided column index)
    offset: int
    what: str  # "max", "table" or "columns"
    page_size: int = 1
    table: torch.fx.Node | None = None  # for "columns": the finished table whose width the index spans


@dataclasses.dataclass
class Proof:
    safe: bool
    reason: str
    gathers: list[GatherPlan] = dataclasses.field(default_factory=list)
    bounds: list[BoundPlan] = dataclasses.field(default_factory=list)
    offsets: list[torch.fx.Node] = dataclasses.field(default_factory=list)  # the m + c, min(m, T) nodes
    swaps: list[MirrorSwap] = dataclasses.field(default_factory=list)
    checks: list[CheckPlan] = dataclasses.field(default_factory=list)
    escapes: list[Escape] = dataclasses.field(default_factory=list)
    # (protected input, written input): graph inputs that were distinct when traced and must stay distinct at
    # run time for the proof to hold (Dynamo does not guard on it); the backend checks them on every call.
    disjoint: set = dataclasses.field(default_factory=set)


class Unsafe(Exception):
    """A use that the safety rule does not allow; its message is the report's reason."""


def describe_use(user: torch.fx.Node) -> str:
    if user.op == "output":
        return "the graph output (returned to the caller)"
    what = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", str(user.target))
    return f"`{what}` at {node_location(user)}"


def why_not(user: torch.fx.Node, what: str) -> str:
    """The reason a use of the max (what="the max") or of its page table is not allowed."""
    where = describe_use(user)
    if user.op == "output":
        return f"{what} reaches {where}"
    if user.op == "call_function" and user.target in _ARITHMETIC:
        return f"{what} is used in arithmetic that is not a bound ({where})"
    if user.op == "call_function" and user.target in _COMPARES:
        return f"{what} is compared ({where}), e.g. in a user assertion, which must keep its value"
    if user.op == "call_function" and isinstance(user.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"{what} reaches {where}, which is not a registered self-guarding consumer"
    if what == "the max":
        return f"{what} reaches {where}, neither a page-table bound nor an upper-bound argument"
    return f"{what} reaches {where}, not a self-guarding consumer"


def _true_for_any_width(compare: torch.fx.Node, sym: torch.fx.Node, most: int) -> bool:
    """Is `compare` (on a width known to lie in [0, most]) true whatever the width? Only such checks are
    Dynamo's own bookkeeping; a user's check on the width must keep its meaning."""
    a, b = compare.args[:2]
    if b is sym and a is not sym:  # normalise `k op w` to `w op' k`
        flip = {operator.ge: operator.le, operator.le: operator.ge, operator.gt: operator.lt, operator.lt: operator.gt}
        if compare.target not in flip:
            return False
        op, k = flip[compare.target], a
    elif a is sym:
        op, k = compare.target, b
    else:
        return False
    if not isinstance(k, int) or isinstance(k, bool):
        return False
    return ((op is operator.ge and k <= 0) or (op is operator.gt and k < 0)
            or (op is operator.le and k >= most) or (op is operator.lt and k > most))


class _Prover:
    def __init__(self, graph: torch.fx.Graph, point: SyncPoint, mirrors, page_size_option: int | None,
                 bound: int, static_escapes: bool):
        self.graph = graph
        self.point = point
        self.mirrors = mirrors
        self.page_size_option = page_size_option
        self.bound = bound
        self.static_escapes = static_escapes
        self.proof = Proof(True, "")
        self.source_root, self.source_chain = strip_kept_values(point.source, allow_moves=True)
        self.writes = WriteLog(graph)  # the graph does not change while it is proven
        self.first = min(point.nodes, key=self._index)

    def _index(self, node):
        return self.writes.order.get(node, -1)

    # -- lengths: the values a consumer guards by ---------------------------------------------------------
    def relate_lengths(self, consumer_node, entry: SelfGuardingConsumer, offset: int):
        """(lengths node, k) with lengths = values the max was taken over + k, 0 <= k <= offset; else Unsafe."""
        if entry.lengths is None:
            raise Unsafe(f"{entry.name} is registered without a lengths argument: the bound cannot be tied to it")
        lengths = bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs).get(entry.lengths)
        if not isinstance(lengths, torch.fx.Node) or dtype_of(lengths) not in _INT:
            raise Unsafe(f"{entry.name}'s {entry.lengths} is not an int32/int64 tensor of the graph")
        node, k, chain = lengths, 0, []
        while True:
            root, passed = strip_kept_values(node, allow_moves=True)
            chain += passed
            add = constant_add(root)
            if add is None:
                break
            chain.append(root)
            node, step = add
            if step < 0:
                raise Unsafe(f"{entry.name}'s {entry.lengths} is the lengths minus {-step}: not what the max bounds")
            k += step
        twin_used = None
        if root is not self.source_root:
            if self.mirrors.get(self.source_root) is root:
                twin_used = root  # max over the CPU mirror, lengths from its device twin
            elif self.mirrors.get(root) is self.source_root:
                twin_used = root  # max over the twin, lengths from the mirror
            else:
                raise Unsafe(
                    f"{entry.name}'s {entry.lengths} ({lengths.name}) does not hold the values the max was taken "
                    f"over ({self.point.source.name}): the bound would not guard it"
                )
        if k > offset:
            raise Unsafe(f"{entry.name}'s {entry.lengths} exceed the max by {k} but the bound adds only {offset}")
        self.check_no_writes(consumer_node, [self.source_root, *self.source_chain, root, *chain, lengths],
                             "the lengths", start=min([self.first, *chain, *self.source_chain], key=self._index))
        if twin_used is not None:
            mirror = root if root in self.mirrors else self.source_root
            self.check_no_writes(consumer_node, [mirror, self.mirrors.get(mirror)], "the CPU mirror or its twin",
                                 start=None)
        self.maybe_swap_mirror_copy(consumer_node, entry.lengths, lengths, chain)
        return lengths, k

    def maybe_swap_mirror_copy(self, consumer_node, argument, lengths, chain):
        """`cache_seqlens = seq_lens_cpu.to(dev)`: the rewrite may read the device twin instead of copying."""
        if any(constant_add(n) for n in chain):
            return
        for node in chain:
            inner = node.args[0]
            if node.target in ("to", "cuda") and inner in self.mirrors and self.mirrors[inner] is not None \
                    and device_of(self.mirrors[inner]) == device_of(lengths) and device_of(inner) != device_of(lengths):
                self.check_no_writes(consumer_node, [inner, self.mirrors[inner]], "the CPU mirror or its twin",
                                     start=None)
                self.proof.swaps.append(MirrorSwap(consumer_node, argument, lengths, self.mirrors[inner]))
                return

    def check_no_writes(self, end: torch.fx.Node, protected, what: str, start):
        protected = [p for p in protected if isinstance(p, torch.fx.Node)]
        start = start if start is not None else next(iter(self.graph.nodes))
        writer = self.writes.first_write(protected, start, end)
        if writer is not None:
            raise Unsafe(
                f"{what} may be written in place by {describe_use(writer)} between the max and the consumer at "
                f"{node_location(end)}: the values would differ from what eager read"
            )
        inputs = {self.writes.input_of(p) for p in protected} - {None}
        for written in self.writes.written_inputs(start, end):
            self.proof.disjoint |= {(p, written) for p in inputs if p is not written}

    # -- uses of the max --------------------------------------------------------------------------------
    def follow_value(self, node: torch.fx.Node, offset: int, clamped: bool = False):
        for user in list(node.users):
            add = scalar_add(user, node)
            if add is not None and not clamped:
                if offset + add < 0:  # the net offset must stay >= 0: `m + 16 - 1` is fine, `m - 1` is not
                    raise Unsafe(f"the max minus {-(offset + add)} ({describe_use(user)}) is not an upper bound")
                self.proof.offsets.append(user)
                self.follow_value(user, offset + add)
                continue
            clamp = min_clamp(user, node)
            if clamp is not None:
                if clamp < self.bound + offset:
                    raise Unsafe(f"the clamp at {node_location(user)} to {clamp} is below the static bound "
                                 f"{self.bound + offset}: it would change the value")
                self.proof.offsets.append(user)  # min(m + c, T) == m + c for every m within the bound
                self.follow_value(user, offset, clamped=True)
                continue
            if user.op == "call_function" and user.target is operator.sub:
                raise Unsafe(f"the max is used in a subtraction ({describe_use(user)}): not an upper bound")
            per_page = page_count(user, node)
            if per_page is not None:
                if per_page < 1 or offset < per_page - 1:
                    raise Unsafe(f"`// {per_page}` at {node_location(user)} is not a page count "
                                 f"(m + {per_page - 1}) // {per_page}: it rounds the bound down")
                self.follow_page_count(user, per_page, offset - (per_page - 1))
                continue
            gather = as_gather(user, node)
            if gather is not None:
                self.follow_gather(user, gather, offset)
                continue
            if self.is_user_check(user, node, offset):
                continue
            if user.op == "output" and self.static_escapes:
                self.proof.escapes.append(Escape(node, offset, "max"))
                continue
            entry = _consumer_of(user)
            if entry is not None:
                args = bind_arguments(entry.name, user.args, user.kwargs)
                names = [k for k, v in args.items() if v is node]
                if names and all(k in entry.upper_bounds for k in names):
                    lengths, k = self.relate_lengths(user, entry, offset)
                    self.proof.bounds.extend(BoundPlan(user, name, offset, lengths, k) for name in names)
                    continue
                raise Unsafe(f"passed to {entry.name} as {names}, which is not an upper-bound argument")
            raise Unsafe(why_not(user, "the max"))

    def follow_page_count(self, count: torch.fx.Node, page_size: int, offset: int):
        """`n = (m + c + ps - 1) // ps` pages slicing a page-level table `P[rpi, :n]` (page ids, no division)."""
        self.proof.offsets.append(count)
        for user in list(count.users):
            gather = as_gather(user, count)
            if gather is None or gather.step is not None:
                raise Unsafe(f"the page count reaches {describe_use(user)}, not the end of a page-level table slice")
            self.follow_gather(user, gather, offset, page_level=page_size)

    def is_user_check(self, compare: torch.fx.Node, node: torch.fx.Node, offset: int) -> bool:
        """`torch._check(m + c <= T)` (or `<`): kept, as a device assertion on the lengths (no host read)."""
        if compare.op != "call_function" or compare.target not in _COMPARES or len(compare.args) != 2:
            return False
        a, b = compare.args
        limits = {(operator.le, 0): b, (operator.lt, 0): b, (operator.ge, 1): a, (operator.gt, 1): a}
        side = 0 if a is node else 1 if b is node else None
        limit = limits.get((compare.target, side))
        if not isinstance(limit, int) or isinstance(limit, bool):
            return False
        if not compare.users or not all(u.op == "call_function" and u.target in _ASSERTS for u in compare.users):
            return False
        strict = compare.target in (operator.lt, operator.gt)
        lengths = self.source_root
        if lengths in self.mirrors and self.mirrors[lengths] is not None:
            lengths = self.mirrors[lengths]  # assert on the device, where the step runs
            self.check_no_writes(compare, [self.source_root, lengths], "the CPU mirror or its twin", start=None)
        self.check_no_writes(compare, [self.source_root, *self.source_chain], "the lengths",
                             start=min([self.first, *self.source_chain], key=self._index))
        self.proof.checks.append(CheckPlan(compare, list(compare.users), lengths,
                                           limit - offset - (1 if strict else 0)))
        return True

    def bookkeeping_of(self, sym: torch.fx.Node, most: int, of: torch.fx.Node) -> list[torch.fx.Node]:
        found = [sym]
        for user in sym.users:
            if arange_step(user, of) is not None:
                for index in user.users:  # the strided column index must serve only `of[:, index]`
                    if column_step(index, of) is None and not (index.op == "output" and self.static_escapes):
                        raise Unsafe(f"the strided column index reaches {describe_use(index)}")
                    if index.op == "output":
                        self.proof.escapes.append(Escape(user, 0, "columns", arange_step(user, of)))
                found.append(user)
                continue
            if user.op != "call_function" or user.target not in _COMPARES:
                raise Unsafe(f"the page table's width is used by {describe_use(user)}")
            if not _true_for_any_width(user, sym, most):
                raise Unsafe(f"the page table's width is checked at {node_location(user)} (a user assertion), "
                             "which must keep its meaning")
            found.append(user)
            for check in user.users:
                if check.op != "call_function" or check.target not in _ASSERTS:
                    raise Unsafe(f"the page table's width is used by {describe_use(check)}")
                found.append(check)
        return found

    def follow_gather(self, gather: torch.fx.Node, spelled, offset: int, page_level: int | None = None):
        table, rpi = spelled.table, spelled.rows
        tv, rv = example_value(table), example_value(rpi)
        if getattr(tv, "dtype", None) not in _INT or getattr(tv, "ndim", 0) != 2:
            raise Unsafe(f"the sliced tensor {table.name} is not a 2-D int32/int64 token table "
                         f"({getattr(tv, 'dtype', None)})")
        if getattr(rv, "dtype", None) not in _INT or getattr(rv, "ndim", 0) != 1:
            raise Unsafe(f"the request indices {rpi.name} are {getattr(rv, 'dtype', None)} "
                         f"{tuple(getattr(rv, 'shape', ()))}, not a 1-D int32/int64 tensor")
        step = spelled.step
        if step is not None and step < 1:
            raise Unsafe(f"the page-table slice step {step!r} is not a constant page size")
        width = int(tv.shape[1])
        most = width if step is None else ceil_div(width, step)
        chain, bookkeeping, divisor, escapes = [*spelled.extra, gather], [], None, False
        node = gather
        while True:
            nexts, consumers = [], []
            for user in node.users:
                if user.op == "call_function" and user.target is torch.ops.aten.sym_size.int:
                    if user.args[1:] not in ((1,), (-1,)):
                        raise Unsafe(f"the page table's size is read by {describe_use(user)}")
                    bookkeeping.extend(self.bookkeeping_of(user, most, node))
                    continue
                if user.op == "output" and self.static_escapes:
                    escapes = True
                    continue
                entry = _consumer_of(user)
                if entry is not None:
                    consumers.append((user, entry, node))
                else:
                    nexts.append(user)
            nxt = nexts[0] if len(nexts) == 1 and not consumers and not escapes else None
            cols = column_step(nxt, node) if nxt is not None else None
            div = floor_divisor(nxt, node) if nxt is not None else None
            if page_level is not None and (cols is not None or div is not None):
                raise Unsafe(f"the page-level table is strided or divided again at {node_location(nxt)}")
            if cols is not None and step is None and cols >= 1:
                step = cols
                most = ceil_div(most, step)
            elif div is not None and divisor is None and div >= 1:
                divisor = div
            elif nxt is not None and value_kept_input(nxt) is node and any(
                    _consumer_of(u) is None for u in nxt.users):
                pass  # a cast on the way (not the last one before the consumers)
            else:
                # The table is complete: what remains are consumers, directly or each through its own
                # value-keeping cast (one per layer, say).
                for user in nexts:
                    consumers += self.cast_branch(user, node)
                    chain.append(user)
                if not consumers:
                    raise Unsafe("the page table reaches no self-guarding consumer")
                break
            chain.append(nxt)
            node = nxt
        step = step or 1
        divisor = divisor or 1
        if page_level is not None:  # page ids already: the page size is the count's divisor
            step = divisor = page_level
        if step != divisor:
            raise Unsafe(
                f"the gather takes every {step}th token but divides by {divisor}: not a page table of one page size"
            )
        if self.page_size_option is not None and step != self.page_size_option:
            raise Unsafe(f"the gather's page size {step} differs from options['page_size']={self.page_size_option}")
        if escapes and any(via is not node for _, _, via in consumers):
            raise Unsafe("the page table leaves the graph in another form than its consumers get it")
        if escapes:
            self.proof.escapes.append(Escape(node, offset, "table", step))
        for escape in self.proof.escapes:
            if escape.what == "columns" and escape.table is None:
                escape.table = node
        groups: dict[torch.fx.Node, ConsumerGroup] = {}
        for consumer_node, entry, via in sorted(consumers, key=lambda c: self._index(c[0])):
            args = bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs)
            names = [k for k, v in args.items() if v is via]
            if entry.page_table is None or names != [entry.page_table]:
                raise Unsafe(f"the page table is passed to {entry.name} as {names}, not as its page-table argument")
            if page_level is not None:
                self.check_page_size(consumer_node, entry, page_level)
            lengths, k = self.relate_lengths(consumer_node, entry, offset)
            lv = example_value(lengths)
            if getattr(lv, "ndim", 0) != 1 or lv.shape[0] != rv.shape[0] or lv.device != tv.device \
                    or rv.device != tv.device:
                raise Unsafe(f"{entry.name}'s {entry.lengths} {tuple(getattr(lv, 'shape', ()))} on "
                             f"{getattr(lv, 'device', '?')} does not match the request indices "
                             f"{tuple(rv.shape)} and the token table on {tv.device}")
            # The rebuilt table reads the token table and the indices just before the consumer: nothing may
            # write them after the gather read them.
            self.check_no_writes(consumer_node, [table, rpi], "the token table or the request indices",
                                 start=gather)
            group = groups.setdefault(lengths, ConsumerGroup(lengths, [], k))
            group.consumers.append((consumer_node, entry))
        self.proof.gathers.append(GatherPlan(chain, list(groups.values()), table, rpi, step, offset, bookkeeping,
                                             node, width, page_level is not None))

    @staticmethod
    def check_page_size(consumer_node, entry: SelfGuardingConsumer, page_size: int):
        """A page count is only a bound for a consumer whose pages hold exactly `page_size` keys."""
        if entry.page_size_of is None:
            raise Unsafe(f"{entry.name} does not declare where its page size is (page_size_of): a page count "
                         f"cannot be tied to it")
        argument, dim = entry.page_size_of
        value = example_value(bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs).get(argument))
        have = getattr(value, "shape", (None,) * (dim + 1))[dim] if value is not None else None
        if have != page_size:
            raise Unsafe(f"the page count uses pages of {page_size} but {entry.name}'s {argument} has pages of {have}")

    def cast_branch(self, cast: torch.fx.Node, table: torch.fx.Node) -> list[tuple]:
        """The consumers behind a value-keeping cast of the finished table; Unsafe for any other use."""
        if value_kept_input(cast) is not table:
            if is_value_cast(cast):
                raise Unsafe(f"the page table is cast to {dtype_of(cast)} at {node_location(cast)}, which changes "
                             "values (only int32/int64 casts keep them)")
            raise Unsafe(why_not(cast, "the page table"))
        found = []
        for user in cast.users:
            entry = _consumer_of(user)
            if entry is None:
                raise Unsafe(why_not(user, "the page table"))
            found.append((user, entry, cast))
        return found

    def check_tolist_elements(self):
        """max(t.tolist()): every element read must feed only the max chain, or an `.item()` stays."""
        members = set(self.point.nodes)
        for node in self.point.nodes:
            if node is self.point.value:
                continue
            for user in node.users:
                if user not in members:
                    raise Unsafe(f"an element of the list is also used by {describe_use(user)}, so its host read "
                                 "would stay")


def _consumer_of(node: torch.fx.Node):
    if node.op != "call_function":
        return None
    return lookup_consumer(node.target)


def prove_static_bound(graph: torch.fx.Graph, point: SyncPoint, mirrors, page_size_option: int | None,
                       bound: int, static_escapes: bool = False) -> Proof:
    """Apply the safety rule to one dynamic max; Proof.safe says whether it may become the static bound."""
    if not point.is_max:
        return Proof(False, "not a max over a lengths tensor: no static bound applies")
    if dtype_of(point.source) not in _INT:
        return Proof(False, f"the max is taken over a {dtype_of(point.source)} tensor, not int32/int64 lengths")
    prover = _Prover(graph, point, mirrors, page_size_option, bound, static_escapes)
    try:
        if point.kind == "tolist":
            prover.check_tolist_elements()
        prover.follow_value(point.value, 0)
    except Unsafe as e:
        return Proof(False, str(e))
    if not prover.proof.gathers and not prover.proof.bounds:
        return Proof(False, "the max feeds no page table and no upper bound: nothing to rewrite")
    return prover.proof
