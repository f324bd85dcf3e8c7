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

The proof (docs/design.md, "The safety rule"): the family's walk over the uses of `m` (rules/host_max.py: `m + c`,
`min(m + c, T)`, the user's checks kept on the device, escapes) with this rule's hooks:
  1. the stop of a page-table gather `X[rpi, :m:ps] // ps` (widening casts allowed) whose result reaches only the
     page-table argument of self-guarding consumers (facts: self_guarding.SelfGuardingConsumer, per overload), or a
     page count `(m + ps - 1) // ps` slicing a page-level table `P[rpi, :n]`;
  2. an upper-bound argument of a self-guarding consumer (max_seqlen_k), or of a scheduler-metadata producer
     whose result reaches only consumers of the same max (FA3's get_scheduler_metadata: a joint rewrite).
Each consumer's lengths must hold the values the max was taken over (HostMaxWalk.relate), nothing may write the
lengths, the token table or the indices between their first read and the consumer, and the consumer's outputs
must keep their shapes and dtypes with the static table (checked on fake tensors). The bound is per site
(host_max.site_bound).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from .._compat import example_value
from ..consumers import bind_arguments
from ..find_sync_points import SyncPoint
from ..fx_util import drop_constant_region_inputs, insert_call, node_location, replace_in_output, set_argument, \
    size_node
from ..mutations import WriteLog, region_body
from ..normalize import (ASSERTS, COMPARES, DEVICE_COPY_METHODS, INT_DTYPES, SYM_SIZE, arange_step, as_gather,
                         ceil_div, column_step, constant_add, device_of, dtype_of, floor_divisor,
                         holds_for_every_value, is_final_truncation, is_identity_slice, is_value_cast,
                         strip_kept_values, value_kept_input)
from ..proof import (LengthsRelation, ProofContext, Unsafe, check_outputs_keep, check_page_size, declare_reasons,
                     describe_use, why_not)
from . import register_rule
from .host_max import HostMaxRule, HostMaxWalk, assert_lengths, erase_read, rewrite_escapes, rewrite_host_checks
from .self_guarding import SelfGuardingConsumer, lookup_consumer

REASONS = declare_reasons("page_table", {
    "table_size_read": "the page table's size is read",
    "strided_index": "the strided column index is used by something else",
    "table_cast": "the page table is cast in a way that changes values",
    "wide_table": "the consumer receives an int64 table, and the page-table op builds int32 (values would truncate)",
    "dynamic_width": "the token table's width is dynamic; a static width would specialize it",
    "metadata_use": "scheduler metadata from the max reaches something other than consumers of the same max",
})


def static_pages(bound: int, offset: int, page_size: int, table_pages: int) -> int:
    """The static page table's width: the pages of the bound (+ offset), no more than the token table holds."""
    return max(1, min(ceil_div(bound + offset, page_size), table_pages))


# -- plans (frozen: the rewrite reads them, never edits them) ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ConsumerUse:
    node: torch.fx.Node  # the consumer (inside a region: a node of the region's body)
    entry: SelfGuardingConsumer
    via: torch.fx.Node  # what it received: the table, a cast of it, or the region's input
    call: torch.fx.Node | None = None  # the compiled-region call it sits in


@dataclasses.dataclass(frozen=True)
class ConsumerGroup:
    """Consumers of one page table that guard by the same lengths node: one rebuilt table serves them."""

    lengths: torch.fx.Node
    consumers: tuple  # ConsumerUse, ...
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
    table_pages: int  # the pages the token table holds: the static width never exceeds them
    page_level: bool = False  # the table holds page ids, sliced by a page count (m + ps - 1) // ps
    # (compiled-region call, width node) where Dynamo passes the table's width into a region (unused there): the
    # width becomes the static one, and the input leaves the region once every call of its body passes a constant
    width_operands: tuple = ()


@dataclasses.dataclass(frozen=True)
class BoundPlan:
    consumer: torch.fx.Node
    argument: str
    value: int  # the static value the argument gets


@dataclasses.dataclass(frozen=True)
class MirrorSwap:
    """The consumer's lengths are a device copy of the CPU mirror: read the device twin instead."""

    consumer: torch.fx.Node
    argument: str
    copy: torch.fx.Node
    twin: torch.fx.Node


@dataclasses.dataclass(frozen=True)
class TableEscape:
    """Under options['static_escapes']: the finished table ("table") or its strided column index ("columns")
    leaves the graph, at the static width."""

    node: torch.fx.Node
    what: str
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
    checks: tuple  # host_max.HostCheck
    escapes: tuple  # (node, offset): the max itself leaves
    table_escapes: tuple
    lengths_uses: tuple  # host_max.LengthsUse
    touches: frozenset
    disjoint: frozenset


@dataclasses.dataclass
class _Chain:
    """What follows a gather up to its consumers (the walk's result, not a plan)."""

    nodes: list
    bookkeeping: list
    consumers: list
    terminal: torch.fx.Node
    step: int | None
    divisor: int | None
    escapes: bool
    width_operands: list


def _consumer_of(node: torch.fx.Node):
    return lookup_consumer(node) if node.op == "call_function" else None


class _Walk(HostMaxWalk):
    """One max's proof: the family's walk, with page tables, page counts and upper bounds as its uses."""

    page_counts = True
    # A user's `torch._check(m >= k)` says a row must be long enough: this rule keeps the max for it (the soundness
    # suite's user_check_lower_bound); an upper check stays, as a device assertion.
    host_checks = frozenset({"upper"})

    def __init__(self, point: SyncPoint, ctx: ProofContext, bound: int):
        super().__init__(point, ctx, bound)
        self.page_size_option = ctx.options.page_size
        self.static_escapes = ctx.options.static_escapes
        self.gathers, self.bounds, self.swaps, self.table_escapes = [], [], [], []
        self.producers = []  # (producer node, entry, [argument names], offset)
        self.body_logs: dict = {}  # compiled-region body -> its WriteLog

    # -- hooks of the family's walk ---------------------------------------------------------------------
    def on_page_count(self, count: torch.fx.Node, page_size: int, extra: int) -> None:
        """`n = (m + c + ps - 1) // ps` pages slicing a page-level table `P[rpi, :n]` (page ids, no division)."""
        for user in list(count.users):
            gather = as_gather(user, count)
            if gather is None or gather.step is not None:
                raise Unsafe("page_count", f"the page count reaches {describe_use(user)}, not the end of a "
                                           "page-level table slice")
            self.follow_gather(user, gather, extra, page_level=page_size)

    def on_use(self, user: torch.fx.Node, node: torch.fx.Node, offset: int) -> bool:
        gather = as_gather(user, node)
        if gather is not None:
            self.follow_gather(user, gather, offset)
            return True
        entry = _consumer_of(user)
        if entry is None:
            return False
        names = self.upper_bound_names(user, entry, node)
        self.relate_consumer(user, entry, offset)
        if entry.feeds_metadata is not None:
            self.producers.append((user, entry, names, offset))
        else:
            self.bounds.extend(BoundPlan(user, name, self.bound + offset) for name in names)
        return True

    # -- lengths: the values a consumer guards by ---------------------------------------------------------
    def relate_consumer(self, consumer_node, entry: SelfGuardingConsumer, offset: int) -> tuple[torch.fx.Node, int]:
        if entry.lengths is None:
            raise Unsafe("no_lengths_fact",
                         f"{entry.name} is registered without a lengths argument: the bound cannot be tied to it")
        lengths = bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs).get(entry.lengths)
        rel = self.relate(consumer_node, lengths, f"{entry.name}'s {entry.lengths}", offset)
        self.maybe_swap_mirror_copy(consumer_node, entry.lengths, rel)
        return lengths, rel.offset

    def maybe_swap_mirror_copy(self, consumer_node, argument, rel: LengthsRelation):
        """`cache_seqlens = seq_lens_cpu.to(dev)`: the rewrite may read the device twin instead of copying."""
        if rel.clamped or rel.subtracted or any(constant_add(n) for n in rel.chain):
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

    # -- the page table's width: Dynamo's bookkeeping ---------------------------------------------------------
    def bookkeeping_of(self, sym: torch.fx.Node, most: int, of: torch.fx.Node, width_operands: list) -> list:
        found = [sym]
        for user in sym.users:
            region = region_body(user)
            if region is not None:  # Dynamo passes the dynamic width into the region: unused there, it goes
                self.width_into_region(user, sym, region, width_operands)
                continue
            if arange_step(user, of) is not None:
                for index in user.users:  # the strided column index must serve only `of[:, index]`
                    if column_step(index, of) is None and not (index.op == "output" and self.static_escapes):
                        raise Unsafe("strided_index", f"the strided column index reaches {describe_use(index)}")
                    if index.op == "output":
                        self.table_escapes.append(TableEscape(user, "columns", arange_step(user, of)))
                found.append(user)
                continue
            if user.op != "call_function" or user.target not in COMPARES:
                raise Unsafe("table_size_read", f"the page table's width is used by {describe_use(user)}")
            if not holds_for_every_value(user, sym, most):
                raise Unsafe("width_check", f"the page table's width is checked at {node_location(user)} (a user "
                                            "assertion, or another check that does not hold for every width), "
                                            "which must keep its meaning")
            found.append(user)
            for check in user.users:
                if check.op != "call_function" or check.target not in ASSERTS:
                    raise Unsafe("table_size_read", f"the page table's width is used by {describe_use(check)}")
                found.append(check)
        return found

    @staticmethod
    def width_into_region(call, sym, region, width_operands: list) -> None:
        body, operands = region
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for i, operand in enumerate(operands):
            if operand is sym:
                if i >= len(placeholders) or placeholders[i].users:
                    raise Unsafe("table_size_read", f"the page table's width is used inside the compiled "
                                                    f"region {describe_use(call)}")
                width_operands.append((call, sym))

    # -- the gather and what follows it --------------------------------------------------------------------
    def follow_gather(self, gather: torch.fx.Node, spelled, offset: int, page_level: int | None = None):
        table, rpi = spelled.table, spelled.rows
        rows, row_device, width = self.table_rows(spelled)
        step = spelled.step  # a constant >= 1: torch refuses a slice step below 1 while Dynamo traces
        chain = self.follow_chain(gather, spelled, width if step is None else ceil_div(width, step), page_level)
        step, table_pages = self.page_size_of(chain, page_level, width)
        node = chain.terminal
        # What leaves is the finished table; a consumer must get that very table, or an identity view of it
        # (SGLang's `block_kv_indices[:bs]`): the rewrite gives both the static table.
        if chain.escapes and any(use.via is not node and not (is_identity_slice(use.via) and use.via.args[0] is node)
                                 for use in chain.consumers if use.call is None):
            raise Unsafe("table_use", "the page table leaves the graph in another form than its consumers get it")
        if chain.escapes:
            self.table_escapes.append(TableEscape(node, "table", step))
        self.table_escapes = [dataclasses.replace(e, table=node) if e.what == "columns" and e.table is None else e
                              for e in self.table_escapes]
        max_pages = static_pages(self.bound, offset, step, table_pages)
        groups = self.prove_consumers(chain, spelled, rows, row_device, offset, page_level, max_pages)
        self.gathers.append(GatherPlan(
            tuple(chain.nodes), groups, table, rpi, step, offset, tuple(chain.bookkeeping), node, table_pages,
            page_level is not None, tuple(chain.width_operands)))

    @staticmethod
    def table_rows(spelled) -> tuple:
        """(rows, device of the row indices, width) of a gather from a static-width 2-D int token table."""
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
        return rows, row_device, width

    def follow_chain(self, gather: torch.fx.Node, spelled, most: int, page_level) -> _Chain:
        """From the gather through its step slice, division and casts to the consumers."""
        chain = _Chain([*spelled.extra, gather], [], [], gather, spelled.step, None, False, [])
        narrowed = False  # the chain passed an int64 -> int32 cast
        node = gather
        while True:
            nexts, consumers = self.split_users(node, most, chain)
            nxt = nexts[0] if len(nexts) == 1 and not consumers and not chain.escapes else None
            cols = column_step(nxt, node) if nxt is not None else None
            div = floor_divisor(nxt, node) if nxt is not None else None
            if page_level is not None and (cols is not None or div is not None):
                raise Unsafe("page_count", f"the page-level table is strided or divided again at "
                                           f"{node_location(nxt)}")
            if div is not None and narrowed:
                raise Unsafe("table_cast", f"the page table is divided at {node_location(nxt)} after an int64 -> int32 "
                                           "cast, which truncated its values first")
            if cols is not None and chain.step is None and cols >= 1:
                chain.step = cols
                most = ceil_div(most, cols)
            elif div is not None and chain.divisor is None and div >= 1:
                chain.divisor = div
            elif nxt is not None and (value_kept_input(nxt) is node or is_final_truncation(nxt, node)) \
                    and any(_consumer_of(u) is None for u in nxt.users):
                narrowed = narrowed or is_final_truncation(nxt, node)  # a cast on the way (not the last one)
            else:
                # The table is complete: what remains are consumers, directly or each through its own
                # value-keeping cast (one per layer, say).
                for user in nexts:
                    consumers += self.cast_branch(user, node)
                    chain.nodes.append(user)
                if not consumers:
                    raise Unsafe("no_consumer", "the page table reaches no self-guarding consumer")
                chain.consumers, chain.terminal = consumers, node
                return chain
            chain.nodes.append(nxt)
            node = nxt

    def split_users(self, node: torch.fx.Node, most: int, chain: _Chain) -> tuple[list, list]:
        """A chain node's users: (the ones the chain may continue through, consumers); bookkeeping and an
        escape under static_escapes are recorded on `chain`."""
        nexts, consumers = [], []
        for user in node.users:
            if user.op == "call_function" and user.target is SYM_SIZE:
                if user.args[1:] not in ((1,), (-1,)):
                    raise Unsafe("table_size_read", f"the page table's size is read by {describe_use(user)}")
                chain.bookkeeping.extend(self.bookkeeping_of(user, most, node, chain.width_operands))
                continue
            if user.op == "output" and self.static_escapes:
                chain.escapes = True
                continue
            entry = _consumer_of(user)
            if entry is not None:
                consumers.append(ConsumerUse(user, entry, node))
            elif region_body(user) is not None:
                consumers += self.region_consumers(user, node)
            else:
                nexts.append(user)
        return nexts, consumers

    def page_size_of(self, chain: _Chain, page_level, width: int) -> tuple[int, int]:
        """(the page size, the pages the token table holds): the gather's step and divisor must agree."""
        step, divisor = chain.step or 1, chain.divisor or 1
        if page_level is not None:  # page ids already: the page size is the count's divisor
            step = divisor = page_level
        if step != divisor:
            raise Unsafe("page_size", f"the gather takes every {step}th token but divides by {divisor}: not a page "
                                      "table of one page size")
        if self.page_size_option is not None and step != self.page_size_option:
            raise Unsafe("page_size", f"the gather's page size {step} differs from "
                                      f"options['page_size']={self.page_size_option}")
        return step, (width if page_level is not None else ceil_div(width, step))

    def prove_consumers(self, chain: _Chain, spelled, rows, row_device, offset, page_level, max_pages) -> tuple:
        """Each consumer: its table argument, page size, lengths, the token table's write window, the table's
        dtype and its outputs with the static table. Grouped by lengths: one rebuilt table per group."""
        table, rpi = spelled.table, spelled.rows
        tv = example_value(table)
        # Eager reads the token table and the indices at the first node of the gather (the row gather of a
        # chained spelling); the rebuilt table reads them just before each consumer: nothing may write them
        # in between.
        window_start = self.ctx.first(chain.nodes)
        groups: dict[torch.fx.Node, list] = {}
        offsets: dict[torch.fx.Node, int] = {}
        for use in sorted(chain.consumers, key=lambda c: self.ctx.index(c.call or c.node)):
            entry = use.entry
            args = bind_arguments(entry.name, use.node.args, use.node.kwargs)
            names = [k for k, v in args.items() if v is use.via]
            if entry.page_table is None or names != [entry.page_table]:
                raise Unsafe("table_argument", f"the page table is passed to {entry.name} as {names}, not as its "
                                               "page-table argument")
            if page_level is not None:
                check_page_size(use.node, entry, page_level)
            if use.call is None:
                lengths, k = self.relate_consumer(use.node, entry, offset)
            else:
                lengths, k = self.relate_in_region(use, offset)
            lv = example_value(lengths)
            if getattr(lv, "ndim", 0) != 1 or lv.shape[0] != rows or lv.device != tv.device \
                    or row_device != tv.device:
                raise Unsafe("mismatch", f"{entry.name}'s {entry.lengths} {tuple(getattr(lv, 'shape', ()))} on "
                                         f"{getattr(lv, 'device', '?')} does not match the {rows} rows of the token "
                                         f"table on {tv.device}")
            self.ctx.check_no_writes(use.call or use.node, [table, rpi], "the token table or the request indices",
                                     window_start, self.disjoint)
            if dtype_of(use.via) != torch.int32 and (dtype_of(table) != torch.int32 or use.call is not None):
                raise Unsafe("wide_table", f"{entry.name} receives an {dtype_of(use.via)} page table of an "
                                           f"{dtype_of(table)} token table; the page-table op builds int32, which "
                                           "would truncate values of 2**31 and more")
            self.check_outputs_keep(use, max_pages)
            groups.setdefault(lengths, []).append(use)
            offsets[lengths] = k
        return tuple(ConsumerGroup(lengths, tuple(members), offsets[lengths]) for lengths, members in groups.items())

    # -- compiled regions (nested_compile_region -> invoke_subgraph): seen through, as if inlined ---------------
    def region_consumers(self, call: torch.fx.Node, table: torch.fx.Node) -> list:
        """The consumers inside a region that the table reaches, as ConsumerUse with the region call."""
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
                    found.append(ConsumerUse(user, entry, inner, call))
                    continue
                if user.op == "call_method" and value_kept_input(user) is inner:
                    for consumer in user.users:
                        entry = _consumer_of(consumer)
                        if entry is None:
                            raise why_not(consumer, "the page table (inside a compiled region)")
                        found.append(ConsumerUse(consumer, entry, user, call))
                    continue
                raise why_not(user, "the page table (inside a compiled region)")
        if not found:
            raise Unsafe("table_use", f"the page table reaches {describe_use(call)} and no consumer inside it")
        return found

    def relate_in_region(self, use: ConsumerUse, offset: int) -> tuple[torch.fx.Node, int]:
        """Lengths of a consumer inside a region: value-keeping casts of a body input, which is an operand of
        the call; related to the max outside. Writes inside the body before the consumer count too."""
        entry, call = use.entry, use.call
        body, operands = region_body(call)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        inner_lengths = bind_arguments(entry.name, use.node.args, use.node.kwargs).get(entry.lengths)
        root, _ = strip_kept_values(inner_lengths, allow_moves=True, allow_narrowing=True) \
            if isinstance(inner_lengths, torch.fx.Node) else (None, [])
        if root is None or root not in placeholders:
            raise Unsafe("lengths_differ", f"{entry.name}'s {entry.lengths} inside the compiled region "
                                           f"{describe_use(call)} is not an input of the region (through casts)")
        outer = operands[placeholders.index(root)]
        inner_log = self.body_logs.get(body)
        if inner_log is None:  # one body serves every layer's call: read its writes once
            inner_log = self.body_logs[body] = WriteLog(body.graph)
        table_input = use.via if use.via in placeholders else use.via.args[0]
        writer = inner_log.first_write([root, table_input], next(iter(body.graph.nodes)), use.node)
        if writer is not None:
            raise Unsafe("written", f"the lengths or the page table may be written in place by "
                                    f"{describe_use(writer)} inside the compiled region, before its consumer")
        rel = self.relate(call, outer, f"{entry.name}'s {entry.lengths}", offset)
        return outer, rel.offset

    def check_outputs_keep(self, use: ConsumerUse, max_pages: int):
        """The consumer, run on fake tensors with the static table (in the dtype eager gave it) and its upper bounds
        at the bound, must return what it returned in the trace. A per-column output would widen: keep."""
        names = bind_arguments(use.entry.name, use.node.args, use.node.kwargs)
        table_value = example_value(use.via)
        rows = table_value.shape[0] if isinstance(table_value, torch.Tensor) else None
        check_outputs_keep(use.node, {use.via: (rows, max_pages)}, use.entry.name, "the static page table",
                           {name: self.bound for name in use.entry.upper_bounds
                            if isinstance(names.get(name), torch.fx.Node)})

    def cast_branch(self, cast: torch.fx.Node, table: torch.fx.Node) -> list:
        """The consumers behind a value-keeping cast of the finished table; Unsafe for any other use."""
        if value_kept_input(cast) is not table and not is_final_truncation(cast, table):
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
            found.append(ConsumerUse(user, entry, cast))
        return found

    def join_metadata(self):
        """A scheduler-metadata producer fed by the max: its result must reach only consumers of this max (as
        their metadata argument), all with one static table capacity, which becomes the producer's bound and
        theirs: FA3's split-KV combine reads out of bounds when the two disagree."""
        consumers = {use.node: (use.entry, plan) for plan in self.gathers for group in plan.groups
                     for use in group.consumers if use.call is None}
        stores_table = any(e.what in ("table", "columns") for e in self.table_escapes)
        for producer, entry, names, offset in self.producers:
            capacities = set()
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
                pages = static_pages(self.bound, plan.offset, plan.page_size, plan.table_pages)
                capacities.add(pages * plan.page_size)
            if len(capacities) != 1:
                raise Unsafe("metadata_use", f"the scheduler metadata of {entry.name} reaches "
                                             f"{'no consumer' if not capacities else 'tables of different widths'}")
            capacity = capacities.pop()
            self.bounds.extend(BoundPlan(producer, name, capacity) for name in names)
            # A consumer whose upper bound was the max sees the same bound the metadata was made for; one whose
            # bound is unset derives it from its table's width, which is the capacity.
            users = {u for u in producer.users if u.op != "output"}
            self.bounds = [dataclasses.replace(b, value=capacity) if b.consumer in users else b for b in self.bounds]

    def plan(self, bound_source: str) -> PageTablePlan:
        touches = self.shared_touches()
        for g in self.gathers:
            touches |= set(g.chain) | set(g.bookkeeping)
            touches |= {use.call or use.node for group in g.groups for use in group.consumers}
            touches |= {call for call, _ in g.width_operands}
        touches |= {b.consumer for b in self.bounds}
        return PageTablePlan(self.point, self.bound, bound_source, tuple(self.gathers), tuple(self.bounds),
                             tuple(self.offsets), tuple(self.swaps), tuple(self.checks), tuple(self.escapes),
                             tuple(self.table_escapes), tuple(self.lengths_uses), frozenset(touches),
                             frozenset(self.disjoint))


@register_rule
class PageTableMax(HostMaxRule):
    """A max over lengths sizing a page table, an upper bound, or scheduler metadata: the static bound."""

    name = "page_table"
    walk = _Walk
    defer_unbounded = True  # a use the rule refuses says more than a missing bound

    def finish(self, walk: _Walk) -> PageTablePlan:
        if walk.producers:
            walk.join_metadata()
        if not walk.gathers and not walk.bounds:
            raise Unsafe("nothing_to_rewrite", "the max feeds no page table and no upper bound: nothing to rewrite")
        return walk.plan(walk.bound_source)

    # -- the rewrite --------------------------------------------------------------------------------------
    def rewrite(self, plan: PageTablePlan, graph: torch.fx.Graph, options) -> str:
        parts = []
        lengths_of = _swap_mirror_copies(graph, plan, parts)
        # The lengths' device assertions come first, before each table: the bound's own message speaks before
        # the page-table op's capacity check.
        uses = [dataclasses.replace(u, lengths=lengths_of.get((u.before, u.lengths), u.lengths))
                for u in plan.lengths_uses]
        checked = assert_lengths(graph, uses, options.checked, plan.bound_source)
        dead = rewrite_host_checks(graph, plan.checks)
        tables: dict[torch.fx.Node, torch.fx.Node] = {}  # a plan's old terminal -> its first rebuilt table
        for gather in plan.gathers:
            max_pages = static_pages(plan.bound, gather.offset, gather.page_size, gather.table_pages)
            for group in gather.groups:
                _rebuild_table(graph, gather, group, max_pages, lengths_of, tables, options)
            for call, width in gather.width_operands:  # the width Dynamo passed in is static now
                call.args = tuple(max_pages if a is width else a for a in call.args)
            drop_constant_region_inputs(graph)
            dead += list(gather.bookkeeping) + list(gather.chain)
            level = ", from a page-level table" if gather.page_level else ""
            parts.append(f"page table -> syncfree.page_table width {max_pages} (page_size "
                         f"{gather.page_size}{level})")
        for b in plan.bounds:
            set_argument(b.consumer, b.argument, b.value)
            parts.append(f"{b.argument} -> {b.value}")
        parts.append(f"bound {plan.bound} ({plan.bound_source})")
        if checked:
            parts.append("lengths asserted on the device")
        parts += [f"the check at {node_location(c.compare)} runs on the device" for c in plan.checks]
        if plan.escapes or plan.table_escapes:
            rewrite_escapes(graph, plan.escapes, plan.bound)
            _static_table_escapes(graph, plan, tables)
            parts.append("escaping metadata leaves at the static bound (options['static_escapes'])")
        erase_read(graph, plan, dead + [s.copy for s in plan.swaps])
        return "rewritten: " + "; ".join(parts)


def _swap_mirror_copies(graph, plan: PageTablePlan, parts: list) -> dict:
    """Consumers whose lengths were a device copy of a CPU mirror read the device twin; returns
    (consumer, old lengths) -> the lengths it reads now."""
    lengths_of: dict[tuple, torch.fx.Node] = {}
    for swap in plan.swaps:
        replacement = swap.twin
        want = dtype_of(swap.copy)
        if dtype_of(swap.twin) != want:
            replacement = insert_call(graph, swap.consumer, torch.ops.aten._to_copy.default, (swap.twin,),
                                      swap.copy, dtype=want)
        set_argument(swap.consumer, swap.argument, replacement)
        lengths_of[(swap.consumer, swap.copy)] = replacement
        parts.append(f"lengths read from the device twin {swap.twin.name}")
    return lengths_of


def _rebuild_table(graph, gather: GatherPlan, group: ConsumerGroup, max_pages: int, lengths_of, tables, options):
    """One static table for a group of consumers, built on the device just before the first of them."""
    first_use = group.consumers[0]
    first = first_use.call or first_use.node  # the region call, for a consumer inside one
    lengths = lengths_of.get((first, group.lengths), group.lengths)
    page_size = gather.page_size
    if gather.page_level:  # page ids already: copy ceil(length / ps) of them per row
        rounded = insert_call(graph, first, torch.ops.aten.add.Tensor, (lengths, page_size - 1), first)
        lengths = insert_call(graph, first, torch.ops.aten.div.Tensor_mode, (rounded, page_size), first,
                              rounding_mode="floor")
        page_size = 1
    rows = gather.req_pool_indices
    if rows is None:  # rows [0, B) by a slice: index them as a tensor
        rows = insert_call(graph, first, torch.ops.aten.arange.default, (size_node(graph, first, group.lengths, 0),),
                           first, dtype=torch.int64, device=device_of(gather.req_to_token))
    # checked: the op also asserts on the device that every request index is in range (eager raises IndexError
    # for one that is not, even on a zero-length row)
    table = insert_call(graph, first, torch.ops.syncfree.page_table.default,
                        (gather.req_to_token, rows, lengths, page_size, max_pages, bool(options.checked)),
                        gather.chain[0])
    tables.setdefault(gather.terminal, table)
    cast_to: dict = {}
    for use in group.consumers:
        given = table
        if use.call is None and dtype_of(use.via) != torch.int32:
            # An int32 token table widened on the way: the consumer gets the dtype eager gave it (the values
            # fit, proven above).
            if use.via not in cast_to:
                cast_to[use.via] = insert_call(graph, use.node, torch.ops.aten._to_copy.default, (table,), use.via,
                                               dtype=dtype_of(use.via))
            given = cast_to[use.via]
        if use.call is None:
            set_argument(use.node, use.entry.page_table, given)
        else:  # inside a region: the call's operand becomes the static table
            use.call.args = tuple(table if a is gather.terminal else a for a in use.call.args)


def _static_table_escapes(graph, plan: PageTablePlan, tables) -> None:
    """options['static_escapes']: a table or its column index leaves the graph at the static width."""
    output = graph.output_node()
    replace: dict[torch.fx.Node, object] = {}
    for escape in plan.table_escapes:
        if escape.what == "table":
            replace[escape.node] = tables[escape.node]
        else:
            pages = tables[escape.table].meta["example_value"].shape[1]
            replace[escape.node] = insert_call(graph, output, torch.arange, (0, pages * escape.page_size,
                                                                            escape.page_size), escape.node,
                                               device=example_value(escape.node).device)
    replace_in_output(graph, replace)
