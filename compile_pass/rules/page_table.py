"""The page-table max: `m = max(seq_lens)` read on the host to size a page table becomes a static bound.

Before (Dynamo, capture_scalar_outputs on; B requests, a [R, T] token table, page size 16):

    max_1 = l_fb_seq_lens.max()                                             # [] int64
    item = max_1.item()                                                     # Sym(u0): device-to-host sync
    getitem = l_fb_req_to_token[(l_fb_req_pool_indices, slice(None, item, 16))]   # [B, u1] int32
    sym_size_int = torch.ops.aten.sym_size.int(getitem, 1)                  # Dynamo's bounds on u1:
    _assert_scalar_default = torch.ops.aten._assert_scalar.default(sym_size_int >= 0, ...)   # 0 <= u1 <= T/16
    floordiv = getitem // 16                                                # [B, u1]
    cache_seqlens = l_fb_seq_lens.to(torch.int32)                           # [B]
    out = torch.ops.syncfree.paged_decode(q, k, v, floordiv, cache_seqlens, max_seqlen_k=item)

After (max_context_len=4096):

    cache_seqlens = l_fb_seq_lens.to(torch.int32)
    page_table = torch.ops.syncfree.page_table.default(
        l_fb_req_to_token, l_fb_req_pool_indices, cache_seqlens, 16, 256)   # [B, 256] int32, built on the device
    out = torch.ops.syncfree.paged_decode(q, k, v, page_table, cache_seqlens, max_seqlen_k=4096)

The proof (docs/design.md, "The safety rule") follows every use of `m`:
  1. the stop of a page-table gather `X[rpi, :m:ps] // ps` (widening casts allowed) whose result reaches only the
     page-table argument of self-guarding consumers (facts: consumers.SelfGuardingConsumer, per overload);
  2. an upper-bound argument of a self-guarding consumer (max_seqlen_k), or of a scheduler-metadata producer
     whose result reaches only consumers of the same max (FA3's get_scheduler_metadata: a joint rewrite);
  3. `m + c` (net c >= 0), `min(m + c, T)` with T at or above the bound, a page count `(m + ps - 1) // ps`;
  4. the user's `torch._check(m <= T)`, which stays, as a device assertion.
Each consumer's lengths must hold the values the max was taken over (ProofContext.relate_lengths), nothing may
write the lengths, the token table or the indices between their first read and the consumer, and the consumer's
outputs must keep their shapes and dtypes with the static table (checked on fake tensors). The bound is per site:
max_context_len for a lengths input, `length_bounds[name]` for a declared one, their sum for a sum of inputs.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from .._compat import example_value, placeholder_source_name
from ..consumers import SelfGuardingConsumer, bind_arguments, lookup_consumer, schema_argument_names
from ..find_sync_points import SyncPoint, attribute_name
from ..fx_util import (erase_if_dead, insert_call, insert_device_assert, insert_value_assert,
                       node_location)
from ..mutations import WriteLog, region_body
from ..normalize import (ASSERTS, COMPARES, DEVICE_COPY_METHODS, INT_DTYPES, SYM_SIZE, arange_step, as_gather,
                         asserted_bound, ceil_div, column_step, constant_add, device_of, dtype_of, floor_divisor,
                         is_identity_slice, is_narrowing, is_value_cast, min_clamp, page_count, scalar_add, strip_kept_values,
                         value_kept_input)
from ..proof import (LengthsRelation, ProofContext, Unsafe, check_max_of_lengths, check_outputs_keep, check_page_size,
                     describe_use, why_not)
from . import Option, register_rule


def _check_length_bounds(name, value):
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in value.items()):
        raise TypeError(f"options['{name}'] must map lengths input names to non-negative ints, e.g. "
                        "{'verify_lens': 8}, got " + repr(value))
    return tuple(sorted(value.items()))


# -- plans (frozen: the rewrite reads them, never edits them) ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ConsumerGroup:
    """Consumers of one page table that guard by the same lengths node: one rebuilt table serves them."""

    lengths: torch.fx.Node
    # ((consumer node, SelfGuardingConsumer, the node it received: table or a cast of it, the compiled-region
    # call it sits in or None), ...); a consumer in a region is a node of the region's body
    consumers: tuple
    length_offset: int  # lengths = (values the max was taken over) + length_offset


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    chain: tuple  # gather, step slice, floordiv, casts (graph order); the last feeds consumers
    groups: tuple
    req_to_token: torch.fx.Node
    req_pool_indices: torch.fx.Node | None  # None: rows [0, B) by a slice
    page_size: int
    offset: int
    bookkeeping: tuple  # Dynamo's own sym_size / compare / _assert_scalar nodes on the width
    terminal: torch.fx.Node  # the finished table (consumers get it, or a value-keeping cast of it)
    max_pages: int
    page_level: bool = False  # the table holds page ids, sliced by a page count (m + ps - 1) // ps
    # (compiled-region call, width node) where Dynamo passes the table's width into a region (unused there): the
    # width becomes max_pages, and the input leaves the region once every call of its body passes a constant
    width_operands: tuple = ()


@dataclasses.dataclass(frozen=True)
class BoundPlan:
    consumer: torch.fx.Node
    argument: str
    value: int  # the static value the argument gets
    lengths: torch.fx.Node | None
    length_offset: int


@dataclasses.dataclass(frozen=True)
class MirrorSwap:
    """The consumer's lengths are a device copy of the CPU mirror: read the device twin instead."""

    consumer: torch.fx.Node
    argument: str
    copy: torch.fx.Node
    twin: torch.fx.Node


@dataclasses.dataclass(frozen=True)
class CheckPlan:
    """A user's `torch._check(m + c <= T)`: kept as a device assertion that every length is <= limit."""

    compare: torch.fx.Node
    asserts: tuple
    lengths: torch.fx.Node
    limit: int


@dataclasses.dataclass(frozen=True)
class Escape:
    """Under options['static_escapes']: the max (+ offset) or a value sized by it leaves the graph."""

    node: torch.fx.Node
    offset: int
    what: str  # "max", "table" or "columns"
    page_size: int = 1
    table: torch.fx.Node | None = None  # for "columns": the finished table whose width the index spans


@dataclasses.dataclass(frozen=True)
class PageTablePlan:
    point: SyncPoint
    bound: int  # the static bound of the values the max was taken over (per site)
    bound_source: str  # how the bound was found, for the report
    gathers: tuple
    bounds: tuple
    offsets: tuple
    swaps: tuple
    checks: tuple
    escapes: tuple
    touches: frozenset
    disjoint: frozenset


# -- the proof --------------------------------------------------------------------------------------------
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


def _consumer_of(node: torch.fx.Node):
    return lookup_consumer(node) if node.op == "call_function" else None


class _Walk:
    """One max's proof: the walk over its uses, collecting the plan's parts."""

    def __init__(self, point: SyncPoint, ctx: ProofContext, bound: int):
        self.point, self.ctx, self.bound = point, ctx, bound
        opts = ctx.options
        self.page_size_option = opts.page_size
        self.static_escapes = opts.static_escapes
        self.source_root, self.source_chain = strip_kept_values(point.source, allow_moves=True,
                                                                allow_narrowing=True)
        self.first = ctx.first(point.nodes)
        self.gathers, self.bounds, self.offsets, self.swaps, self.checks, self.escapes = [], [], [], [], [], []
        self.producers = []  # (producer node, entry, [argument names], offset, relation)
        self.narrowed = False  # the table chain passed an int64 -> int32 cast
        self.width_operands: list = []  # (region call, the width node it receives as an operand)
        self.body_logs: dict = {}  # compiled-region body -> its WriteLog
        self.disjoint: set = set()

    # -- lengths: the values a consumer guards by ---------------------------------------------------------
    def relate(self, consumer_node, entry: SelfGuardingConsumer, offset: int) -> tuple[torch.fx.Node, int]:
        if entry.lengths is None:
            raise Unsafe("no_lengths_fact",
                         f"{entry.name} is registered without a lengths argument: the bound cannot be tied to it")
        lengths = bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs).get(entry.lengths)
        rel = self.ctx.relate_lengths(self.point.source, lengths, f"{entry.name}'s {entry.lengths}")
        if rel.offset > offset:
            raise Unsafe("lengths_exceed", f"{entry.name}'s {entry.lengths} exceed the max by {rel.offset} but the "
                                           f"bound adds only {offset}")
        start = self.ctx.first([self.first, *rel.chain, *self.source_chain])
        self.ctx.check_no_writes(consumer_node, [self.source_root, *self.source_chain, rel.root, *rel.chain,
                                                 lengths], "the lengths", start, self.disjoint)
        if rel.via_mirror:
            mirror = rel.root if rel.root in self.ctx.mirrors else self.source_root
            self.ctx.check_no_writes(consumer_node, [mirror, self.ctx.mirrors.get(mirror)],
                                     "the CPU mirror or its twin", None, self.disjoint)
        self.maybe_swap_mirror_copy(consumer_node, entry.lengths, rel)
        return lengths, rel.offset

    def maybe_swap_mirror_copy(self, consumer_node, argument, rel: LengthsRelation):
        """`cache_seqlens = seq_lens_cpu.to(dev)`: the rewrite may read the device twin instead of copying."""
        if any(constant_add(n) for n in rel.chain):
            return
        mirrors = self.ctx.mirrors
        for node in rel.chain:
            inner = node.args[0]
            if node.target in DEVICE_COPY_METHODS and inner in mirrors and mirrors[inner] is not None \
                    and device_of(mirrors[inner]) == device_of(rel.lengths) \
                    and device_of(inner) != device_of(rel.lengths):
                self.ctx.check_no_writes(consumer_node, [inner, mirrors[inner]], "the CPU mirror or its twin",
                                         None, self.disjoint)
                self.swaps.append(MirrorSwap(consumer_node, argument, rel.lengths, mirrors[inner]))
                return

    # -- uses of the max ----------------------------------------------------------------------------------
    def follow_value(self, node: torch.fx.Node, offset: int, clamped: bool = False):
        for user in list(node.users):
            add = scalar_add(user, node)
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
            per_page = page_count(user, node)
            if per_page is not None:
                if per_page < 1 or offset < per_page - 1:
                    raise Unsafe("page_count", f"`// {per_page}` at {node_location(user)} is not a page count "
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
                self.escapes.append(Escape(node, offset, "max"))
                continue
            entry = _consumer_of(user)
            if entry is not None:
                args = bind_arguments(entry.name, user.args, user.kwargs)
                names = [k for k, v in args.items() if v is node]
                if names and all(k in entry.upper_bounds for k in names):
                    lengths, k = self.relate(user, entry, offset)
                    if entry.feeds_metadata is not None:
                        self.producers.append((user, entry, names, offset, lengths, k))
                    else:
                        self.bounds.extend(BoundPlan(user, name, self.bound + offset, lengths, k) for name in names)
                    continue
                raise Unsafe("not_an_upper_bound",
                             f"passed to {entry.name} as {names}, which is not an upper-bound argument")
            raise why_not(user, "the max")

    def follow_page_count(self, count: torch.fx.Node, page_size: int, offset: int):
        """`n = (m + c + ps - 1) // ps` pages slicing a page-level table `P[rpi, :n]` (page ids, no division)."""
        self.offsets.append(count)
        for user in list(count.users):
            gather = as_gather(user, count)
            if gather is None or gather.step is not None:
                raise Unsafe("page_count", f"the page count reaches {describe_use(user)}, not the end of a "
                                           "page-level table slice")
            self.follow_gather(user, gather, offset, page_level=page_size)

    def is_user_check(self, compare: torch.fx.Node, node: torch.fx.Node, offset: int) -> bool:
        """`torch._check(m + c <= T)` (or `<`): kept, as a device assertion on the lengths (no host read)."""
        bound = asserted_bound(compare, node)
        if bound is None or bound[0] != "upper":
            return False
        lengths = self.source_root
        mirrors = self.ctx.mirrors
        if lengths in mirrors and mirrors[lengths] is not None:
            lengths = mirrors[lengths]  # assert on the device, where the step runs
            self.ctx.check_no_writes(compare, [self.source_root, lengths], "the CPU mirror or its twin", None,
                                     self.disjoint)
        self.ctx.check_no_writes(compare, [self.source_root, *self.source_chain], "the lengths",
                                 self.ctx.first([self.first, *self.source_chain]), self.disjoint)
        self.checks.append(CheckPlan(compare, tuple(compare.users), lengths, bound[1] - offset))
        return True

    def bookkeeping_of(self, sym: torch.fx.Node, most: int, of: torch.fx.Node) -> list[torch.fx.Node]:
        found = [sym]
        for user in sym.users:
            region = region_body(user)
            if region is not None:  # Dynamo passes the dynamic width into the region: unused there, it goes
                body, operands = region
                placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
                for i, operand in enumerate(operands):
                    if operand is sym:
                        if i >= len(placeholders) or placeholders[i].users:
                            raise Unsafe("table_size_read", f"the page table's width is used inside the compiled "
                                                            f"region {describe_use(user)}")
                        self.width_operands.append((user, sym))
                continue
            if arange_step(user, of) is not None:
                for index in user.users:  # the strided column index must serve only `of[:, index]`
                    if column_step(index, of) is None and not (index.op == "output" and self.static_escapes):
                        raise Unsafe("strided_index", f"the strided column index reaches {describe_use(index)}")
                    if index.op == "output":
                        self.escapes.append(Escape(user, 0, "columns", arange_step(user, of)))
                found.append(user)
                continue
            if user.op != "call_function" or user.target not in COMPARES:
                raise Unsafe("table_size_read", f"the page table's width is used by {describe_use(user)}")
            if not _true_for_any_width(user, sym, most):
                raise Unsafe("width_check", f"the page table's width is checked at {node_location(user)} (a user "
                                            "assertion, or another check that does not hold for every width), "
                                            "which must keep its meaning")
            found.append(user)
            for check in user.users:
                if check.op != "call_function" or check.target not in ASSERTS:
                    raise Unsafe("table_size_read", f"the page table's width is used by {describe_use(check)}")
                found.append(check)
        return found

    def follow_gather(self, gather: torch.fx.Node, spelled, offset: int, page_level: int | None = None):
        table, rpi = spelled.table, spelled.rows
        tv = example_value(table)
        if getattr(tv, "dtype", None) not in INT_DTYPES or getattr(tv, "ndim", 0) != 2:
            raise Unsafe("not_a_table", f"the sliced tensor {table.name} is not a 2-D int32/int64 token table "
                                        f"({getattr(tv, 'dtype', None)})")
        if rpi is not None:
            rv = example_value(rpi)
            if getattr(rv, "dtype", None) not in INT_DTYPES or getattr(rv, "ndim", 0) != 1:
                raise Unsafe("not_a_table", f"the request indices {rpi.name} are {getattr(rv, 'dtype', None)} "
                                            f"{tuple(getattr(rv, 'shape', ()))}, not a 1-D int32/int64 tensor")
            rows, row_device = rv.shape[0], rv.device
        else:  # rows [0, stop) by a slice: the rebuilt table indexes them with arange
            stop = spelled.row_stop
            stop_value = example_value(stop) if isinstance(stop, torch.fx.Node) else stop
            if stop is not None and not isinstance(stop_value, (int, torch.SymInt)):
                raise Unsafe("not_a_table", f"the row slice of {table.name} does not end at a batch size")
            rows, row_device = (tv.shape[0] if stop is None else stop_value), tv.device
        width = tv.shape[1]
        if not isinstance(width, int):
            raise Unsafe("dynamic_width", f"the width of the token table {table.name} is dynamic ({width}); a static "
                                          "page-table width would specialize a dimension marked dynamic")
        step = spelled.step
        if step is not None and step < 1:
            raise Unsafe("slice_step", f"the page-table slice step {step!r} is not a constant page size")
        most = width if step is None else ceil_div(width, step)
        chain, bookkeeping, divisor, escapes = [*spelled.extra, gather], [], None, False
        self.narrowed = False
        node = gather
        while True:
            nexts, consumers = [], []
            for user in node.users:
                if user.op == "call_function" and user.target is SYM_SIZE:
                    if user.args[1:] not in ((1,), (-1,)):
                        raise Unsafe("table_size_read", f"the page table's size is read by {describe_use(user)}")
                    bookkeeping.extend(self.bookkeeping_of(user, most, node))
                    continue
                if user.op == "output" and self.static_escapes:
                    escapes = True
                    continue
                entry = _consumer_of(user)
                if entry is not None:
                    consumers.append((user, entry, node, None))
                elif region_body(user) is not None:
                    consumers += self.region_consumers(user, node)
                else:
                    nexts.append(user)
            nxt = nexts[0] if len(nexts) == 1 and not consumers and not escapes else None
            cols = column_step(nxt, node) if nxt is not None else None
            div = floor_divisor(nxt, node) if nxt is not None else None
            if page_level is not None and (cols is not None or div is not None):
                raise Unsafe("page_count", f"the page-level table is strided or divided again at "
                                           f"{node_location(nxt)}")
            if div is not None and self.narrowed:
                raise Unsafe("table_cast", f"the page table is divided at {node_location(nxt)} after an int64 -> int32 "
                                           "cast, which truncated its values first")
            if cols is not None and step is None and cols >= 1:
                step = cols
                most = ceil_div(most, step)
            elif div is not None and divisor is None and div >= 1:
                divisor = div
            elif nxt is not None and (value_kept_input(nxt) is node or self.is_final_truncation(nxt, node)) \
                    and any(_consumer_of(u) is None for u in nxt.users):
                pass  # a cast on the way (not the last one before the consumers)
            else:
                # The table is complete: what remains are consumers, directly or each through its own
                # value-keeping cast (one per layer, say).
                for user in nexts:
                    consumers += self.cast_branch(user, node)
                    chain.append(user)
                if not consumers:
                    raise Unsafe("no_consumer", "the page table reaches no self-guarding consumer")
                break
            chain.append(nxt)
            node = nxt
        step = step or 1
        divisor = divisor or 1
        if page_level is not None:  # page ids already: the page size is the count's divisor
            step = divisor = page_level
        if step != divisor:
            raise Unsafe("page_size", f"the gather takes every {step}th token but divides by {divisor}: not a page "
                                      "table of one page size")
        if self.page_size_option is not None and step != self.page_size_option:
            raise Unsafe("page_size", f"the gather's page size {step} differs from "
                                      f"options['page_size']={self.page_size_option}")
        # What leaves is the finished table; a consumer must get that very table, or an identity view of it
        # (SGLang's `block_kv_indices[:bs]`): the rewrite gives both the static table.
        if escapes and any(via is not node and not (is_identity_slice(via) and via.args[0] is node)
                           for _, _, via, call in consumers if call is None):
            raise Unsafe("table_use", "the page table leaves the graph in another form than its consumers get it")
        table_pages = width if page_level is not None else ceil_div(width, step)
        max_pages = max(1, min(ceil_div(self.bound + offset, step), table_pages))
        if escapes:
            self.escapes.append(Escape(node, offset, "table", step))
        self.escapes = [dataclasses.replace(e, table=node) if e.what == "columns" and e.table is None else e
                        for e in self.escapes]
        # Eager reads the token table and the indices at the first node of the gather (the row gather of a
        # chained spelling); the rebuilt table reads them just before each consumer: nothing may write them
        # in between.
        window_start = self.ctx.first(chain)
        groups: dict[torch.fx.Node, list] = {}
        offsets: dict[torch.fx.Node, int] = {}
        for consumer_node, entry, via, call in sorted(consumers, key=lambda c: self.ctx.index(c[3] or c[0])):
            args = bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs)
            names = [k for k, v in args.items() if v is via]
            if entry.page_table is None or names != [entry.page_table]:
                raise Unsafe("table_argument", f"the page table is passed to {entry.name} as {names}, not as its "
                                               "page-table argument")
            if page_level is not None:
                check_page_size(consumer_node, entry, page_level)
            if call is None:
                lengths, k = self.relate(consumer_node, entry, offset)
            else:
                lengths, k = self.relate_in_region(consumer_node, entry, offset, call, via)
            lv = example_value(lengths)
            if getattr(lv, "ndim", 0) != 1 or lv.shape[0] != rows or lv.device != tv.device \
                    or row_device != tv.device:
                raise Unsafe("mismatch", f"{entry.name}'s {entry.lengths} {tuple(getattr(lv, 'shape', ()))} on "
                                         f"{getattr(lv, 'device', '?')} does not match the {rows} rows of the token "
                                         f"table on {tv.device}")
            self.ctx.check_no_writes(call or consumer_node, [table, rpi], "the token table or the request indices",
                                     window_start, self.disjoint)
            if dtype_of(via) != torch.int32 and (dtype_of(table) != torch.int32 or call is not None):
                raise Unsafe("wide_table", f"{entry.name} receives an {dtype_of(via)} page table of an "
                                           f"{dtype_of(table)} token table; the page-table op builds int32, which "
                                           "would truncate values of 2**31 and more")
            self.check_outputs_keep(consumer_node, entry, via, max_pages)
            groups.setdefault(lengths, []).append((consumer_node, entry, via, call))
            offsets[lengths] = k
        self.gathers.append(GatherPlan(
            tuple(chain), tuple(ConsumerGroup(lengths, tuple(members), offsets[lengths])
                                for lengths, members in groups.items()),
            table, rpi, step, offset, tuple(bookkeeping), node, max_pages, page_level is not None,
            tuple(self.width_operands)))
        self.width_operands = []

    # -- compiled regions (nested_compile_region -> invoke_subgraph): seen through, as if inlined ---------------
    def region_consumers(self, call: torch.fx.Node, table: torch.fx.Node) -> list[tuple]:
        """The consumers inside a region that the table reaches: (inner consumer, facts, inner value, call)."""
        body, operands = region_body(call)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        found = []
        for i, operand in enumerate(operands):
            if operand is not table:
                continue
            if i >= len(placeholders):
                raise Unsafe("table_use", f"the page table reaches {describe_use(call)}, whose body does not match")
            inner = placeholders[i]
            for user in inner.users:
                entry = _consumer_of(user)
                if entry is not None:
                    found.append((user, entry, inner, call))
                    continue
                if user.op == "call_method" and value_kept_input(user) is inner:
                    for consumer in user.users:
                        entry = _consumer_of(consumer)
                        if entry is None:
                            raise why_not(consumer, "the page table (inside a compiled region)")
                        found.append((consumer, entry, user, call))
                    continue
                raise why_not(user, "the page table (inside a compiled region)")
        if not found:
            raise Unsafe("table_use", f"the page table reaches {describe_use(call)} and no consumer inside it")
        return found

    def relate_in_region(self, inner_consumer, entry: SelfGuardingConsumer, offset: int, call, inner_table):
        """Lengths of a consumer inside a region: value-keeping casts of a body input, which is an operand of
        the call; related to the max outside. Writes inside the body before the consumer count too."""
        body, operands = region_body(call)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        inner_lengths = bind_arguments(entry.name, inner_consumer.args, inner_consumer.kwargs).get(entry.lengths)
        root, _ = strip_kept_values(inner_lengths, allow_moves=True, allow_narrowing=True) \
            if isinstance(inner_lengths, torch.fx.Node) else (None, [])
        if root is None or root not in placeholders:
            raise Unsafe("lengths_differ", f"{entry.name}'s {entry.lengths} inside the compiled region "
                                           f"{describe_use(call)} is not an input of the region (through casts)")
        outer = operands[placeholders.index(root)]
        inner_log = self.body_logs.get(body)
        if inner_log is None:  # one body serves every layer's call: read its writes once
            inner_log = self.body_logs[body] = WriteLog(body.graph)
        table_input = inner_table if inner_table in placeholders else inner_table.args[0]
        writer = inner_log.first_write([root, table_input], next(iter(body.graph.nodes)), inner_consumer)
        if writer is not None:
            raise Unsafe("written", f"the lengths or the page table may be written in place by "
                                    f"{describe_use(writer)} inside the compiled region, before its consumer")
        rel = self.ctx.relate_lengths(self.point.source, outer, f"{entry.name}'s {entry.lengths}")
        if rel.offset > offset:
            raise Unsafe("lengths_exceed", f"{entry.name}'s {entry.lengths} exceed the max by {rel.offset} but "
                                           f"the bound adds only {offset}")
        self.ctx.check_no_writes(call, [self.source_root, *self.source_chain, rel.root, *rel.chain, outer],
                                 "the lengths", self.ctx.first([self.first, *rel.chain, *self.source_chain]),
                                 self.disjoint)
        return outer, rel.offset

    def check_outputs_keep(self, consumer_node, entry: SelfGuardingConsumer, via: torch.fx.Node, max_pages: int):
        """The consumer, run on fake tensors with the static table (in the dtype eager gave it) and its upper bounds
        at the bound, must return what it returned in the trace. A per-column output would widen: keep."""
        names = bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs)
        table_value = example_value(via)
        rows = table_value.shape[0] if isinstance(table_value, torch.Tensor) else None
        check_outputs_keep(consumer_node, {via: (rows, max_pages)}, entry.name, "the static page table",
                           {name: self.bound for name in entry.upper_bounds
                            if isinstance(names.get(name), torch.fx.Node)})

    def cast_branch(self, cast: torch.fx.Node, table: torch.fx.Node) -> list[tuple]:
        """The consumers behind a value-keeping cast of the finished table; Unsafe for any other use."""
        if value_kept_input(cast) is not table and not self.is_final_truncation(cast, table):
            if is_value_cast(cast):
                raise Unsafe("table_cast", f"the page table is cast to {dtype_of(cast)} at {node_location(cast)}, "
                                           "which changes values (only widening int casts keep them, and an int64 -> "
                                           "int32 cast after the division, which the page-table op makes itself)")
            raise why_not(cast, "the page table")
        found = []
        for user in cast.users:
            entry = _consumer_of(user)
            if entry is None:
                raise why_not(user, "the page table")
            found.append((user, entry, cast, None))
        return found

    def is_final_truncation(self, cast: torch.fx.Node, table: torch.fx.Node) -> bool:
        """`(X[rpi, :m:ps] // ps).to(int32)` on an int64 X: the op computes in int64 and truncates to int32 at
        the end, exactly this cast; a division after such a cast would differ (and is refused)."""
        if value_kept_input(cast, allow_narrowing=True) is table and is_narrowing(cast) \
                and dtype_of(cast) == torch.int32:
            self.narrowed = True
            return True
        return False

    def check_tolist_elements(self):
        """max(t.tolist()): every element read must feed only the max chain, or an `.item()` stays."""
        members = set(self.point.nodes)
        for node in self.point.nodes:
            if node is self.point.value:
                continue
            for user in node.users:
                if user not in members:
                    raise Unsafe("element_use", f"an element of the list is also used by {describe_use(user)}, so its "
                                                "host read would stay")

    def join_metadata(self):
        """A scheduler-metadata producer fed by the max: its result must reach only consumers of this max (as
        their metadata argument), all with one static table capacity, which becomes the producer's bound and
        theirs: FA3's split-KV combine reads out of bounds when the two disagree."""
        consumers = {c: (entry, plan) for plan in self.gathers for group in plan.groups
                     for c, entry, _, call in group.consumers if call is None}
        for producer, entry, names, offset, lengths, k in self.producers:
            capacities = set()
            stores_table = any(e.what in ("table", "columns") for e in self.escapes)
            for user in producer.users:
                if user.op == "output" and self.static_escapes and stores_table:
                    continue  # stored beside the static table it was made for (static_escapes)
                target = consumers.get(user)
                if target is None:
                    raise Unsafe("metadata_use", f"the scheduler metadata of {entry.name} at {node_location(producer)} "
                                                 f"reaches {describe_use(user)}, which is not a consumer of the same "
                                                 "max's page table")
                consumer_entry, plan = target
                args = bind_arguments(consumer_entry.name, user.args, user.kwargs)
                if consumer_entry.metadata is None or [n for n, v in args.items() if v is producer] \
                        != [consumer_entry.metadata]:
                    raise Unsafe("metadata_use", f"the scheduler metadata reaches {consumer_entry.name} as something "
                                                 "other than its metadata argument")
                capacities.add(plan.max_pages * plan.page_size)
            if len(capacities) != 1:
                raise Unsafe("metadata_use", f"the scheduler metadata of {entry.name} reaches "
                                             f"{'no consumer' if not capacities else 'tables of different widths'}")
            capacity = capacities.pop()
            self.bounds.extend(BoundPlan(producer, name, capacity, lengths, k) for name in names)
            # A consumer whose upper bound was the max sees the same bound the metadata was made for; one whose
            # bound is unset derives it from its table's width, which is the capacity.
            users = {u for u in producer.users if u.op != "output"}
            self.bounds = [dataclasses.replace(b, value=capacity) if b.consumer in users else b for b in self.bounds]

    def plan(self, bound_source: str) -> PageTablePlan:
        touches = set(self.point.nodes) | set(self.offsets)
        for g in self.gathers:
            touches |= set(g.chain) | set(g.bookkeeping)
            touches |= {call or c for group in g.groups for c, _, _, call in group.consumers}
            touches |= {call for call, _ in g.width_operands}
        touches |= {b.consumer for b in self.bounds} | {c.compare for c in self.checks}
        return PageTablePlan(self.point, self.bound, bound_source, tuple(self.gathers), tuple(self.bounds),
                             tuple(self.offsets), tuple(self.swaps), tuple(self.checks), tuple(self.escapes),
                             frozenset(touches), frozenset(self.disjoint))


def site_bound(source: torch.fx.Node, ctx: ProofContext) -> tuple[int, str]:
    """The static bound of the values a max is taken over, per site: max_context_len for a lengths input,
    options['length_bounds'][name] for a declared input, the sum for a sum of inputs (at most one of them
    undeclared), plus constants added. Unsafe when no bound is known."""
    declared = dict(ctx.options.rule_option("length_bounds") or ())
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
            for name in name_of(root):
                if name is not None and name in declared:
                    return declared[name], f"length_bounds['{name}']={declared[name]}", defaults_left
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


@register_rule
class PageTableMax:
    """A max over lengths sizing a page table, an upper bound, or scheduler metadata: the static bound."""

    name = "page_table"
    options = {"length_bounds": Option(None, _check_length_bounds,
                                       "{lengths input name: bound}: per-site bounds for inputs other than the "
                                       "sequence lengths, e.g. {'verify_lens': 8}; a max over seq_lens + verify_lens "
                                       "is then bounded by max_context_len + 8")}

    def match(self, read: SyncPoint) -> bool:
        return read.is_max

    def prove(self, read: SyncPoint, ctx: ProofContext) -> PageTablePlan:
        check_max_of_lengths(read, ctx)
        try:
            bound, bound_source = site_bound(read.source, ctx)
            unbounded = None
        except Unsafe as e:  # a use the rule refuses says more than the missing bound: look for one first
            bound, bound_source, unbounded = ctx.options.max_context_len, "", e
        walk = _Walk(read, ctx, bound)
        if read.kind == "tolist":
            walk.check_tolist_elements()
        walk.follow_value(read.value, 0)
        if unbounded is not None:
            raise unbounded
        if walk.producers:
            walk.join_metadata()
        if not walk.gathers and not walk.bounds:
            raise Unsafe("nothing_to_rewrite", "the max feeds no page table and no upper bound: nothing to rewrite")
        return walk.plan(bound_source)

    # -- the rewrite --------------------------------------------------------------------------------------
    def rewrite(self, plan: PageTablePlan, graph: torch.fx.Graph, options) -> str:
        parts = []
        lengths_of: dict[tuple, torch.fx.Node] = {}  # (consumer, old lengths) -> lengths to use after swaps
        for swap in plan.swaps:
            replacement = swap.twin
            want = dtype_of(swap.copy)
            if dtype_of(swap.twin) != want:
                replacement = insert_call(graph, swap.consumer, torch.ops.aten._to_copy.default, (swap.twin,),
                                          swap.copy, dtype=want)
            _set_argument(swap.consumer, swap.argument, replacement)
            lengths_of[(swap.consumer, swap.copy)] = replacement
            parts.append(f"lengths read from the device twin {swap.twin.name}")
        checks: dict[tuple, torch.fx.Node] = {}
        dead: list[torch.fx.Node] = []  # erased at the end, once nothing uses them
        tables: dict[torch.fx.Node, torch.fx.Node] = {}  # a plan's old terminal -> its first rebuilt table
        for gather in plan.gathers:
            for group in gather.groups:
                first = group.consumers[0][3] or group.consumers[0][0]  # the region call, for one inside
                lengths = lengths_of.get((first, group.lengths), group.lengths)
                page_size = gather.page_size
                if gather.page_level:  # page ids already: copy ceil(length / ps) of them per row
                    rounded = insert_call(graph, first, torch.ops.aten.add.Tensor, (lengths, page_size - 1), first)
                    lengths = insert_call(graph, first, torch.ops.aten.div.Tensor_mode, (rounded, page_size), first,
                                          rounding_mode="floor")
                    page_size = 1
                rows = gather.req_pool_indices
                if rows is None:  # rows [0, B) by a slice: index them as a tensor
                    rows = insert_call(graph, first, torch.ops.aten.arange.default,
                                       (_size_node(graph, first, group.lengths),), first, dtype=torch.int64,
                                       device=device_of(gather.req_to_token))
                # checked: the op also asserts on the device that every request index is in range (eager raises
                # IndexError for one that is not, even on a zero-length row)
                table = insert_call(graph, first, torch.ops.syncfree.page_table.default,
                                    (gather.req_to_token, rows, lengths, page_size, gather.max_pages,
                                     bool(options.checked)), gather.chain[0])
                tables.setdefault(gather.terminal, table)
                cast_to: dict = {}
                for consumer, entry, via, call in group.consumers:
                    given = table
                    if call is None and dtype_of(via) != torch.int32:
                        # An int32 token table widened on the way: the consumer gets the dtype eager gave it
                        # (the values fit, proven above).
                        if via not in cast_to:
                            cast_to[via] = insert_call(graph, consumer, torch.ops.aten._to_copy.default, (table,),
                                                       via, dtype=dtype_of(via))
                        given = cast_to[via]
                    if call is None:
                        _set_argument(consumer, entry.page_table, given)
                    else:  # inside a region: the call's operand becomes the static table
                        call.args = tuple(table if a is gather.terminal else a for a in call.args)
                # before the table: the bound's own assertion speaks first (the op checks its capacity too)
                checks.setdefault((lengths_of.get((first, group.lengths), group.lengths),
                                   plan.bound + group.length_offset), table)
            for call, width in gather.width_operands:  # the width Dynamo passed in is static now
                call.args = tuple(gather.max_pages if a is width else a for a in call.args)
            _drop_constant_region_inputs(graph)
            dead += list(gather.bookkeeping) + list(gather.chain)
            level = ", from a page-level table" if gather.page_level else ""
            parts.append(f"page table -> syncfree.page_table width {gather.max_pages} (page_size "
                         f"{gather.page_size}{level})")
        for b in plan.bounds:
            _set_argument(b.consumer, b.argument, b.value)
            if b.lengths is not None:
                checks.setdefault((lengths_of.get((b.consumer, b.lengths), b.lengths), plan.bound + b.length_offset),
                                  b.consumer)
            parts.append(f"{b.argument} -> {b.value}")
        parts.append(f"bound {plan.bound} ({plan.bound_source})")
        for (lengths, limit), before in checks.items():
            wide, passed = strip_kept_values(lengths, allow_moves=False, allow_narrowing=True)
            if any(is_narrowing(n) for n in passed):
                # Lengths narrowed (int64 -> int32) keep the relation the proof rests on, that no consumer length
                # exceeds what eager's max covered, only while they fit: assert it on the device (always: it is
                # the proof's premise, not a bound check), against the max of the wide values (no host read).
                insert_value_assert(graph, before, lengths, wide,
                                    f"syncfree: lengths narrowed to int32 at {node_location(before)} exceed the max "
                                    "of the values they were narrowed from (they do not fit int32)")
            if options.checked:
                insert_device_assert(graph, before, lengths, limit,
                                     f"syncfree: a sequence length exceeds the static bound that replaced its max "
                                     f"({plan.bound_source}) at {node_location(before)}")
        if options.checked and checks:
            parts.append("lengths asserted on the device")
        for check in plan.checks:
            insert_device_assert(graph, check.compare, check.lengths, check.limit,
                                 f"syncfree: the check at {node_location(check.compare)} failed: a length exceeds "
                                 f"{check.limit}")
            dead += list(check.asserts) + [check.compare]
            parts.append(f"the check at {node_location(check.compare)} runs on the device")
        if plan.escapes:
            parts.append(_static_escapes(graph, plan, tables))
        dead += list(plan.offsets) + [plan.point.value] + list(plan.point.nodes) + [s.copy for s in plan.swaps]
        erase_if_dead(graph, dead)
        return "rewritten: " + "; ".join(parts)


def _drop_constant_region_inputs(graph: torch.fx.Graph) -> None:
    """A region's input that its body never reads and that every call of that body now passes as a constant
    (the static width, where Dynamo passed the dynamic one) leaves the body and the calls: Inductor wants every
    operand of invoke_subgraph to be a node. An input some call still passes as a node stays (another plan may
    still rewrite it; unused, it costs nothing)."""
    calls: dict[int, tuple] = {}
    for node in graph.nodes:
        region = region_body(node)
        if region is not None:
            calls.setdefault(id(region[0]), (region[0], []))[1].append(node)
    for body, users in calls.values():
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        drop = [i for i, ph in enumerate(placeholders)
                if not ph.users and all(len(c.args) == 2 + len(placeholders) for c in users)
                and all(not isinstance(c.args[2 + i], torch.fx.Node) for c in users)]
        if not drop:
            continue
        for c in users:
            c.args = tuple(a for j, a in enumerate(c.args) if j - 2 not in drop)
        for i in reversed(drop):
            body.graph.erase_node(placeholders[i])
        body.recompile()


def _size_node(graph, before, lengths):
    """`lengths.size(0)` as a graph value (a SymInt under dynamic shapes, else an int)."""
    size = example_value(lengths).shape[0]
    if isinstance(size, int):
        return size
    with graph.inserting_before(before):
        node = graph.call_function(SYM_SIZE, (lengths, 0))
    node.meta["example_value"] = size
    return node


def _set_argument(node: torch.fx.Node, name: str, value) -> None:
    if name in node.kwargs:
        node.update_kwarg(name, value)
        return
    index = schema_argument_names(lookup_consumer(node).name).index(name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def _static_escapes(graph, plan: PageTablePlan, tables) -> str:
    """options['static_escapes']: what leaves the graph leaves at the static width / as the static bound."""
    output = graph.output_node()
    replace: dict[torch.fx.Node, object] = {}
    for escape in plan.escapes:
        limit = plan.bound + escape.offset
        if escape.what == "max":
            replace[escape.node] = limit
        elif escape.what == "table":
            replace[escape.node] = tables[escape.node]
        else:
            pages = tables[escape.table].meta["example_value"].shape[1]
            replace[escape.node] = insert_call(graph, output, torch.arange, (0, pages * escape.page_size,
                                                                            escape.page_size), escape.node,
                                               device=example_value(escape.node).device)
    output.args = torch.fx.node.map_aggregate(output.args, lambda a: replace.get(a, a) if isinstance(
        a, torch.fx.Node) else a)
    return "escaping metadata leaves at the static bound (options['static_escapes'])"
