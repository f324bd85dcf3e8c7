"""The allocated table: a page count `cdiv(max, ps)` sizes a table that a bounded user kernel fills per row.

This is recipe 2 of issue 20 (FlashMLA, TRTLLM-MLA and aiter build their page tables this way): the width of an
allocation comes from the host max, a user Triton kernel with registered facts fills each row only as far as
that row's length, and self-guarding consumers read it by the same lengths. The width becomes static; the kernel,
its inputs and the consumers stay where they are.

Register a writer (facts scoped to this rule, keyed by the kernel's `module:qualname`):

    register_bounded_writer(my_kernel, table="kv_indices_ptr", lengths="page_kernel_lens_ptr",
                            page_size="PAGED_SIZE", req_pool_indices="req_pool_indices_ptr",
                            req_to_token="req_to_token_ptr", table_stride="kv_indices_ptr_stride")

The example kernel in kernels/flashmla_kv_indices.py is registered when this module is imported. A torch op can be a
writer too (`register_bounded_writer(torch.ops.ns.op, ...)`: its schema must write only the table); a kernel
launched on SGLang's 2-D grid `(bs, cdiv(n, P))`, program (b, j) writing only pages [j * P, (j + 1) * P) of row
b's own, declares `pages_per_program=P`.

The table's forms (issue 30: SGLang's FlashMLA and TRTLLM-MLA with the CPU mirror published):
    torch.full((B, n), -1) / empty / zeros    an allocation of width n
    buf[:B, :n]                               a slice of a persistent buffer (a graph input or attribute) whose
                                              width is statically >= the bound's pages (FlashMLA's grown scratch);
                                              the writer's stride is then the buffer's own, unchanged
    t = torch.full((B, n), -1); t[:B, :n]     a full view of such an allocation (FlashMLA's scratch grown from
                                              None: allocated, stored, and sliced whole): the same table, both
                                              widened together
    torch.full((R, max(n, C)), -1)[:B, :n]    the scratch regrown (C the width it had: an int, or its size once
                                              Dynamo made it dynamic): a buffer max(C, W) wide, sliced
                                              (rules/sliced_scratch.py)
with n the page count `cdiv(m + c, ps)`, or its round-up `cdiv(cdiv(m + c, ps), L) * L` (TRTLLM-MLA's
`_calc_padded_blocks`): the static width is the same expression at m = bound. Under static_escapes the table may
also leave the step (stored on the backend's metadata), at the static width.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from .. import _compat, traced_ranges
from .._compat import example_value, fake_mode_of
from ..allocations import (block_count, in_grid, is_row_view, is_table_of, reads_of, round_up, rounded_width, size_checks,
                           slice_of, width_of)
from ..consumers import bind_arguments
from ..find_sync_points import SyncPoint
from ..mutations import written_by
from ..fx_util import node_location, replace_uses
from ..allocations import as_allocation, with_size
from ..normalize import (ASSERTS, INT_DTYPES, ceil_div, holds_for_every_value, page_count,
                         plus_constant, row_stride_of)
from ..trace_signature import ScratchTable
from ..proof import ProofContext, Unsafe, check_outputs_keep, check_page_size, declare_reasons, describe_use
from . import register_rule
from .bounded_writers import BoundedWriter, Launch, launch_of
from .sliced_scratch import (base_width, check_buffer, check_regrown, covering_constant, covering_size, sized_equal,
                             stride_at, within_sized)
from .self_guarding import lookup_consumer
from .host_max import HostMaxRule, HostMaxWalk, assert_lengths, erase_read, rewrite_escapes, rewrite_host_checks

RULE = "allocated_table"

REASONS = declare_reasons(RULE, {
    "writer_unknown": "the allocated table is written by a kernel with no bounded-writer facts",
    "table_written": "the allocated table is written by something other than its bounded writer before a reader",
    "width_use": "the allocated table's width is used by something other than the allocation and the writer's "
                 "row stride",
    "writer_grid": "the bounded writer's launch grid is not (rows of the table, 1, 1)",
    "buffer_narrow": "the persistent buffer the page count slices is not statically as wide as the bound's pages",
    "round_up": "the page count is rounded up by arithmetic that is not a multiple-of round-up",
})


# -- plans ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TablePlan:
    count: torch.fx.Node  # n = (m + c + ps - 1) // ps
    pages: int  # the static width
    page_size: int
    allocation: torch.fx.Node
    strides: tuple  # sym_max(1, n) nodes (the table's row stride) that reach only the writer
    writer: torch.fx.Node
    writer_name: str
    bookkeeping: tuple  # Dynamo's own checks on n (true for every n in [0, pages]) and their asserts
    consumers: tuple
    sliced: bool = False  # the table is `buf[:B, :n]` of a persistent buffer, not an allocation
    rounding: tuple = ()  # the round-up `(n + a) // L * L` of the page count (erased; its result is `count`)
    grids: tuple = ()  # (node, pages_per_program): a grid's axis-1 block count `cdiv(n, ppp)` -> cdiv(pages, ppp)
    escapes: bool = False  # the table itself reaches the graph output (static_escapes): it leaves at the width
    slack: int = 0  # the tokens past the max that eager's table covers for every value of it (the round-up's)
    aliases: tuple = ()  # full views `t[:B, :n]` of the allocation `t` (B, n): the table itself, widened with it
    covers: tuple = ()  # (node, C): `max(n, C)`, C an int: max(C, static width) for every n within it
    sized: tuple = ()  # `max(n, s)` nodes, s an input's size: `max(static width, s)` (the scratch's own width)
    stride_param: str | None = None  # the writer's row-stride parameter (its facts' table_stride)


@dataclasses.dataclass(frozen=True)
class AllocatedTablePlan:
    point: SyncPoint
    bound: int
    bound_source: str
    tables: tuple
    bounds: tuple  # (consumer, node, value): an upper-bound argument gets the static value
    checks: tuple  # host_max.HostCheck: `m + c >= k` / `<= T`, kept exactly on the device
    escapes: tuple  # (node, offset): the max itself leaves (static_escapes)
    lengths_uses: tuple  # host_max.LengthsUse: under options.checked, every length within [0, limit]
    offsets: tuple
    touches: frozenset
    disjoint: frozenset
    # The placeholders of the persistent buffers sliced `buf[:B, :n]` (FlashMLA's scratch): graph inputs the step
    # writes in place, only through their bounded writer. Under CUDA graphs the backend makes them static inputs,
    # so that the graph writes the caller's buffer as eager does (sync_pass.PassResult.static_inputs).
    static_inputs: frozenset = frozenset()
    # A scratch allocated in the graph and stored for later steps (grown from None, or regrown: the table leaves
    # as a full view of its allocation or through a covering width). Under CUDA graphs such an output would live
    # in the graph's memory pool, which the next replay reuses; the backend runs this graph without CUDA graphs
    # (sync_pass.PassResult.allocated_scratch), and the later steps' graph, which takes the scratch as an input,
    # with them.
    allocated_scratch: bool = False
    # The sliced tables `buf[:B, :n]` of a persistent scratch, a graph input, or an allocation the step stores
    # (traced_ranges.ScratchTable): what settle_at_bound compares where the bound's outcome regrows the scratch
    # that the other outcome slices (trace_signature.regrown_scratch).
    scratch_tables: tuple = ()


# -- the proof --------------------------------------------------------------------------------------------
def _same_size(a, b) -> bool:
    if a is b:
        return True
    va = example_value(a) if isinstance(a, torch.fx.Node) else a
    vb = example_value(b) if isinstance(b, torch.fx.Node) else b
    if isinstance(va, int) and isinstance(vb, int):
        return va == vb
    if isinstance(va, torch.SymInt) and isinstance(vb, torch.SymInt):
        return va.node.expr == vb.node.expr
    return False


def _rows_agree(a, b) -> bool:
    """The lengths' size and the table's rows: the same, or sizes of their own symbols (SGLang's `batch_size`
    beside `seq_lens.shape[0]` once the batch is dynamic). Either way the rewrite keeps every access of a step
    that stays in bounds: row b of the table lies at b * width, for its writer and its readers alike, and only
    columns below cdiv(lengths[b], page_size) of a row are written or read, so where rows and lengths disagree
    a step touches the same cells in both (fewer lengths than rows: the rows past them are neither written nor
    read), or reads or writes out of bounds in eager already (a kernel launched on more rows than there are
    lengths, a reader of more rows than the table has). Two different plain ints are a mismatch."""
    if _same_size(a, b):
        return True
    va = example_value(a) if isinstance(a, torch.fx.Node) else a
    vb = example_value(b) if isinstance(b, torch.fx.Node) else b
    return isinstance(va, (int, torch.SymInt)) and isinstance(vb, (int, torch.SymInt)) \
        and not (type(va) is int and type(vb) is int)


class _Walk(HostMaxWalk):
    """One max's proof: the family's walk, with a page count sizing one allocated table as its use."""

    page_counts = True

    def __init__(self, point: SyncPoint, ctx: ProofContext, bound: int):
        super().__init__(point, ctx, bound)
        self.tables, self.bounds, self.pending = [], [], []
        self.covers: dict = {}  # the current page count's `max(n, C)` nodes -> max(C, static width) (on_page_count)
        self.widened: list = []  # those with C below the static width (check_widened_covers)
        self.sized: set = set()  # `max(n, s)` nodes, s an input's size: rewritten to `max(static width, s)`
        self.static_width = 0  # the current page count's (on_page_count)

    def on_use(self, user: torch.fx.Node, node: torch.fx.Node, offset: int) -> bool:
        entry = lookup_consumer(user) if user.op == "call_function" else None
        if entry is None:
            return False
        self.upper_bound_names(user, entry, node)
        if entry.lengths is None or entry.feeds_metadata is not None:
            raise Unsafe("no_lengths_fact", f"{entry.name} has no lengths argument to tie the bound to")
        self.pending.append((user, entry, node, offset))  # once every writer is known
        return True

    def join_bounds(self):
        """Upper-bound arguments: their consumers' lengths are related with every proven writer excluded."""
        writers = tuple(t.writer for t in self.tables)
        for user, entry, node, offset in self.pending:
            lengths = bind_arguments(entry.name, user.args, user.kwargs).get(entry.lengths)
            self.relate(user, lengths, f"{entry.name}'s {entry.lengths}", offset, allowed=writers)
            self.bounds.append((user, node, self.bound + offset))

    # -- the page count ---------------------------------------------------------------------------------
    def on_page_count(self, count: torch.fx.Node, page_size: int, extra: int):
        pages = ceil_div(self.bound + extra, page_size)  # the count at m = bound: covers every row within it
        rounding = ()
        rounded = round_up(count)
        if rounded is not None:  # `(n + a) // L * L`: eager's width is a multiple of L, and so is the static one
            width, rounding, add, multiple, factor, checks = rounded
            if add < multiple - 1 or factor != multiple:
                raise Unsafe("round_up", f"the page count at {node_location(count)} is rounded by `(n + {add}) // "
                                         f"{multiple} * {factor}`, not up to a multiple of {multiple}: it may be "
                                         "narrower than the pages of a row")
            pages = rounded_width(self.bound, extra, page_size, add, multiple)  # monotone: >= eager's for every m
            for check in checks:  # Dynamo's own, on the multiples: true for every count in [0, pages / L]
                if not holds_for_every_value(check, check.args[0] if check.args[0] in rounding else check.args[1],
                                             pages // multiple):
                    raise Unsafe("width_check", f"the rounded page count is checked at {node_location(check)} by "
                                                "a check that does not hold for every width")
                rounding = (*rounding, check, *check.users)
            count = width
            extra = self.round_up_slack(extra, page_size, add, multiple)
        allocations, slices, strides, bookkeeping, writers, grids, covers, widened = [], [], [], [], [], [], {}, []
        for user in count.users:
            alloc = as_allocation(user)
            if alloc is not None and is_table_of(alloc, count):
                allocations.append(user)
                continue
            if slice_of(user, count) is not None:
                slices.append(user)
                continue
            blocks = block_count(user, count)
            if blocks is not None:
                grids.append(blocks)  # a launch grid's axis 1: follow_writer checks it against the facts
                continue
            if _compat.user_triton_kernel(user) is not None or launch_of(user) is not None:
                if in_grid(user, count):
                    raise Unsafe("writer_grid", f"the launch grid of the kernel at {node_location(user)} depends on "
                                                "the page count: its writes would follow the static width")
                writers.append(user)  # as its table_stride: follow_writer checks
                continue
            if row_stride_of(user, count):
                strides.append(user)
                continue
            covered = covering_constant(user, count)
            if covered is not None:  # `max(n, C)`: C for every n in [0, pages] where C >= pages; else at most pages
                covers[user] = max(covered, pages)
                if covered < pages:
                    widened.append(user)
                continue
            if covering_size(user, count) is not None:  # `max(n, s)`, s a size of an input: at most max(pages, s)
                widened.append(user)
                continue
            if user.op == "call_function" and user.target in (operator.ge, operator.gt, operator.le, operator.lt) \
                    and user.users and all(u.op == "call_function" and u.target in ASSERTS for u in user.users):
                if not holds_for_every_value(user, count, pages):
                    raise Unsafe("width_check", f"the table's width is checked at {node_location(user)} by a check "
                                                "that does not hold for every width, which must keep its meaning")
                bookkeeping += [user, *user.users]
                continue
            raise Unsafe("width_use", f"the page count at {node_location(count)} is used by {describe_use(user)}, "
                                      "not only as an allocation's width and its writer's row stride")
        # A full view `t[:B, :n]` of an allocation `t` of (B, n) (a scratch grown from None: FlashMLA allocates
        # `(bs, n)` and returns `buf[:bs, :n]`) is that table, not a second one.
        aliases = [s for s in slices if len(allocations) == 1 and _full_view(s, allocations[0])]
        slices = [s for s in slices if s not in aliases]
        if len(allocations) + len(slices) != 1:
            raise Unsafe("width_use", f"the page count at {node_location(count)} sizes "
                                      f"{len(allocations) + len(slices)} tables; one table, one writer")
        (allocation,) = allocations or slices
        self.covers, self.widened, self.static_width = covers, widened, pages
        self.sized = {w for w in widened if w not in covers}  # `max(n, s)`: max(pages, s) once rewritten
        if slices:
            pages = check_buffer(allocation, pages, self.covers, self.sized, self.point.value, self.bound, extra,
                                 page_size, bool(rounding))
            self.static_width = pages
        for stride in strides:
            for user in stride.users:
                if _compat.user_triton_kernel(user) is None and launch_of(user) is None:
                    raise Unsafe("width_use", f"the table's row stride (`max(1, n)`) is used by {describe_use(user)}")
                if in_grid(user, stride):
                    raise Unsafe("writer_grid", f"the launch grid at {node_location(user)} depends on the width")
        grid_users = {u for _, _, node in grids for u in node.users}
        self.follow_table(count, page_size, extra, pages, allocation, tuple(strides), tuple(bookkeeping),
                          set(writers) | {u for s in strides for u in s.users} | grid_users, bool(slices),
                          tuple(rounding), tuple(grids), tuple(aliases))

    def round_up_slack(self, extra: int, page_size: int, add: int, multiple: int) -> int:
        """How many tokens past the max eager's rounded-up table covers at least, over every value the max can
        take: min over m of `((m + extra + ps - 1) // ps + add) // L * L * ps - m`. The values are [0, bound]
        less those where a branch traced at the bound fails (traced_ranges.admitted_values: each outcome is asserted on
        the device when the max is rewritten). TRTLLM-MLA's `cdiv(cdiv(m, 64), 64) * 64` pages of 64 cover 4096
        tokens for every m in [1, 256]: lengths up to m + 3840 stay in eager's table, and so in the static one,
        which is at least as wide for every m. At least `extra` (the rounding only widens)."""
        values = traced_ranges.admitted_values(self.point.value, self.bound)
        if values is None or values.numel() == 0:  # not enumerated (a bound past 4M), or no value runs
            return extra
        width = rounded_width(values, extra, page_size, add, multiple)
        return max(extra, int((width * page_size - values).min()))

    def follow_table(self, count, page_size, extra, pages, allocation, strides, bookkeeping, width_readers,
                     sliced=False, rounding=(), grids=(), aliases=()):
        tv = example_value(allocation)
        if getattr(tv, "dtype", None) not in INT_DTYPES:
            raise Unsafe("not_a_table", f"the allocation at {node_location(allocation)} is {getattr(tv, 'dtype', None)}"
                                        ", not an int32/int64 page table")
        rows = allocation.args[1][0].stop if sliced else as_allocation(allocation).sizes[0]
        # (user, the node it reaches the table through): the allocation, or a full view of it standing for it
        pairs = sorted([(u, allocation) for u in allocation.users if u not in aliases]
                       + [(u, a) for a in aliases for u in a.users], key=lambda p: self.ctx.index(p[0]))
        users = [u for u, _ in pairs]
        through = dict(pairs)
        checks = [size_checks(u, through[u]) for u in users]
        for user, found in zip(users, checks):
            if found is not None:  # Dynamo's bookkeeping for a slice's width (true for any width in [0, pages])
                if not all(holds_for_every_value(c, user, pages, self.covers) or within_sized(c, user, self.sized)
                           for c in found if c.target not in ASSERTS):
                    raise Unsafe("width_check", f"the table's width is checked at {node_location(user)} by a "
                                                "check that does not hold for every width, which must keep its "
                                                "meaning")
                bookkeeping = (*bookkeeping, *found, user)
        users = [u for u, found in zip(users, checks) if found is None]
        if not users:
            raise Unsafe("no_consumer", "the allocated table is never read")
        writer = users[0]
        launch = launch_of(writer)
        if launch is None:
            if writer.op == "call_function" and lookup_consumer(writer) is not None:
                raise Unsafe("no_writer", f"{describe_use(writer)} reads the allocated table before any kernel "
                                          "writes it")
            raise self.table_use(writer)
        if aliases and any(allocation in held for held in _held_by(launch)):
            raise Unsafe("table_argument", f"the allocated table is passed to {launch.name} beside its view")
        facts = self.follow_writer(launch, through[writer], rows, count, page_size, extra, strides, sliced, grids)
        consumers, escapes = [], False
        for user, table in (pair for u in users[1:] for pair in reads_of([u], through[u])):
            if user.op == "output" and self.ctx.options.static_escapes and table in (allocation, *aliases):
                escapes = True  # the table leaves at the static width (options['static_escapes'])
                continue
            if launch_of(user) is not None or _compat.user_triton_kernel(user) is not None:
                raise Unsafe("table_written", f"the allocated table is also written by the kernel at "
                                              f"{node_location(user)}")
            entry = lookup_consumer(user) if user.op == "call_function" else None
            if entry is None:
                if allocation in written_by(user) or table in written_by(user):
                    raise Unsafe("table_written", f"the allocated table is written by {describe_use(user)} after its "
                                                  "bounded writer")
                raise self.table_use(user)
            names = [a for a, v in bind_arguments(entry.name, user.args, user.kwargs).items() if v is table]
            if entry.page_table is None or names != [entry.page_table]:
                raise Unsafe("table_argument", f"the allocated table is passed to {entry.name} as {names}, not as its "
                                               "page-table argument")
            check_page_size(user, entry, page_size)
            protected = [allocation, table, *aliases, *([allocation.args[0]] if sliced else [])]
            try:
                self.ctx.check_no_writes(user, protected, "the allocated table", writer, self.disjoint)
            except Unsafe as e:
                raise Unsafe("table_written", e.message) from None
            lengths = bind_arguments(entry.name, user.args, user.kwargs).get(entry.lengths)
            self.relate(user, lengths, f"{entry.name}'s {entry.lengths}", extra, allowed=(writer,))
            lv, view = example_value(lengths), example_value(table)
            # A slice of a persistent buffer is addressed through the buffer's own pointer and row stride at any
            # width: whatever the rows, every cell read is the cell eager read. An allocation's rows must match.
            if getattr(lv, "ndim", 0) != 1 or not (sliced or _rows_agree(lv.shape[0], view.shape[0])):
                raise Unsafe("mismatch", f"{entry.name}'s {entry.lengths} do not have one value per table row")
            self.check_outputs_keep(user, entry, table, pages)
            consumers.append(user)
        if not consumers:
            raise Unsafe("no_consumer", "the allocated table reaches no self-guarding consumer")
        if width_readers - {writer}:
            other = min(width_readers - {writer}, key=self.ctx.index)
            raise Unsafe("width_use", f"the table's width reaches {describe_use(other)}, which is not its writer")
        grid_nodes = tuple((node, ppp) for _, ppp, node in grids)
        check_regrown(self.widened, allocation, writer, facts.table_stride, bookkeeping,
                      self.ctx.options.static_escapes)
        self.tables.append(TablePlan(count, pages, page_size, allocation, strides, writer, facts.name,
                                     (*bookkeeping, *(n for chain, _, _ in grids for n in chain)),
                                     tuple(consumers), sliced, tuple(rounding), grid_nodes, escapes, extra,
                                     tuple(aliases), tuple(self.covers.items()), tuple(self.sized),
                                     facts.table_stride))

    @staticmethod
    def table_use(user: torch.fx.Node) -> Unsafe:
        if user.op == "output":
            return Unsafe("escapes", "the allocated table reaches the graph output (returned or stored); "
                                     "options['static_escapes'] would let it leave at the static width")
        return Unsafe("table_use", f"the allocated table reaches {describe_use(user)}, which is neither its bounded "
                                   "writer nor a self-guarding consumer")

    def follow_writer(self, launch: Launch, allocation, rows, count, page_size, extra, strides, sliced=False,
                      grids=()) -> BoundedWriter:
        writer, facts, name = launch.node, launch.facts, launch.name
        if facts is None:
            raise Unsafe("writer_unknown", f"the kernel {name} at {node_location(writer)} writes the allocated table "
                                           "and has no bounded-writer facts (register_bounded_writer)")
        if writer.kwargs.get("tma_descriptor_metadata"):
            raise Unsafe("writer_unknown", f"{name} is launched with TMA descriptors, which its facts do not cover")
        args = launch.args
        width_nodes = (count, *strides)
        for param, value in args.items():
            held = []
            torch.fx.node.map_arg(value, lambda n: held.append(n))
            if allocation in held and (param != facts.table or value is not allocation):
                raise Unsafe("table_argument", f"the allocated table is passed to {name} as {param!r}, not only as "
                                               f"its table {facts.table!r}")
            width = [n for n in held if n in width_nodes]
            if width and (sliced or param != facts.table_stride or value not in width_nodes):
                raise Unsafe("width_use", f"the table's width is passed to {name} as {param!r}, not as its row "
                                          f"stride {facts.table_stride!r}")
        if args.get(facts.table) is not allocation:
            raise Unsafe("table_argument", f"the allocated table is not {name}'s table {facts.table!r}")
        if facts.table_stride is not None:
            stride = args.get(facts.table_stride)
            if sliced:  # the buffer's own row stride: the same for the slice at any width
                base = allocation.args[0]
                real = base_width(base, self.covers, self.sized) if as_allocation(base) is not None \
                    else example_value(allocation).stride(0)
                stride = self.covers.get(stride, stride) if isinstance(stride, torch.fx.Node) else stride
                if stride in self.sized and real in self.sized and sized_equal(stride, real, count, self.static_width):
                    pass  # the regrown allocation's own width, max(W, s), spelled either way
                elif not (isinstance(stride, int) and isinstance(real, int) and stride == real) and not (
                        isinstance(stride, torch.fx.Node) and not isinstance(real, torch.fx.Node)
                        and _compat.known_equal(example_value(stride), real)):  # a dynamic width: one size
                    raise Unsafe("width_use", f"{name}'s {facts.table_stride!r} ({stride!r}) is not the buffer's row "
                                              f"stride ({real})")
            elif stride not in width_nodes:
                raise Unsafe("width_use", f"{name}'s {facts.table_stride!r} is not the table's row stride "
                                          f"({stride!r})")
        if not facts.op:
            self.check_grid(launch, rows, grids)
        elif grids:
            raise Unsafe("width_use", f"the page count's block count reaches {describe_use(grids[0][2])}")
        ps = facts.page_size if isinstance(facts.page_size, int) else args.get(facts.page_size)
        if not isinstance(ps, int) or isinstance(ps, bool) or ps != page_size:
            raise Unsafe("page_size", f"{name} writes pages of {ps!r} tokens but the table's width counts pages of "
                                      f"{page_size}")
        table_rows = example_value(allocation).shape[0]
        lengths = args.get(facts.lengths)
        self.relate(writer, lengths, f"{name}'s {facts.lengths}", extra)
        inputs = []
        for label, param, ndim in (("lengths", facts.lengths, 1), ("request indices", facts.req_pool_indices, 1),
                                   ("token table", facts.req_to_token, 2)):
            if param is None:
                continue
            value = args.get(param)
            v = example_value(value)
            # The request indices need only be 1-D ints: program b reads entry b whatever the table's width, in the
            # step as in eager, so their length (a size Dynamo may give its own symbol) does not bear on the rewrite.
            if getattr(v, "dtype", None) not in INT_DTYPES or v.ndim != ndim or (
                    param == facts.lengths and not sliced and not _rows_agree(v.shape[0], table_rows)):
                raise Unsafe("mismatch", f"{name}'s {label} {param!r} is not an int tensor with one value per row "
                                         "of the table" if ndim == 1 else f"{name}'s {label} is not a 2-D int tensor")
            if param != facts.lengths:
                inputs.append(value)
        self.ctx.check_no_writes(writer, inputs, "the token table or the request indices", self.first, self.disjoint)
        return facts

    def check_grid(self, launch: Launch, rows, grids) -> None:
        """(rows, 1, 1); with `pages_per_program` p, (rows, cdiv(n, p), 1) too: program (b, j) writes only pages
        [j * p, (j + 1) * p) of row b's own, so cdiv(static width, p) programs write what cdiv(n, p) wrote."""
        grid, facts = launch.grid, launch.facts
        blocks = {node: ppp for _, ppp, node in grids}

        def axis1_ok(d):
            if isinstance(d, int) and not isinstance(d, bool) and d == 1:
                return True
            return d in blocks and facts.pages_per_program is not None and blocks[d] == facts.pages_per_program

        if not isinstance(grid, (list, tuple)) or not grid or not all(
                isinstance(g, (list, tuple)) and len(g) == 3 and _same_size(g[0], rows) and axis1_ok(g[1])
                and isinstance(g[2], int) and g[2] == 1 for g in grid):
            raise Unsafe("writer_grid", f"{launch.name} is launched on the grid {grid!r}, not (rows of the table, 1, "
                                        "1) nor (rows, cdiv(width, pages_per_program), 1) of its facts: its facts "
                                        "cover one program per row (or per block of a row's pages)")

    def check_outputs_keep(self, consumer, entry, table: torch.fx.Node, pages: int):
        """The consumer on fake tensors with the static-width table must return the same shapes and dtypes."""
        tv = example_value(table)
        rows = tv.shape[0] if isinstance(tv, torch.Tensor) else None
        check_outputs_keep(consumer, {table: (rows, pages)}, entry.name, "the static table")

    def plan(self, bound_source: str) -> AllocatedTablePlan:
        touches = self.shared_touches()
        for t in self.tables:
            touches |= {t.count, t.allocation, *t.aliases, t.writer, *t.strides, *t.bookkeeping, *t.consumers,
                        *t.rounding, *(node for node, _ in t.covers), *t.sized,
                        *(t.allocation.args[:1] if t.sliced else ()),
                        *(node for node, _ in t.grids)}
        touches |= {c for c, _, _ in self.bounds}
        scratch = frozenset(t.allocation.args[0] for t in self.tables
                            if t.sliced and t.allocation.args[0].op == "placeholder")
        allocated_scratch = any(t.escapes and (t.aliases or t.covers or t.sized) for t in self.tables)
        tables = tuple(ScratchTable(t.allocation.args[0], t.allocation, t.writer,
                                    stride_at(t.writer, t.writer_name, t.stride_param))
                       for t in self.tables if t.sliced)
        return AllocatedTablePlan(self.point, self.bound, bound_source, tuple(self.tables), tuple(self.bounds),
                                  tuple(self.checks), tuple(self.escapes), tuple(self.lengths_uses), tuple(self.offsets), frozenset(touches),
                                  frozenset(self.disjoint), scratch, allocated_scratch, tables)


def _full_view(view: torch.fx.Node, allocation: torch.fx.Node) -> bool:
    """`t[:B, :n]` of the allocation `t` of (B, n) (slice_of already holds: starts 0, steps 1, column stop n):
    every cell of `t`, at `t`'s own strides."""
    spelled = as_allocation(allocation)
    return view.args[0] is allocation and spelled is not None and _same_size(view.args[1][0].stop, spelled.sizes[0])


def _held_by(launch: Launch):
    """The nodes each argument of a launch holds."""
    for value in launch.args.values():
        held = []
        torch.fx.node.map_arg(value, held.append)
        yield held


def _sizes_an_allocation(node: torch.fx.Node, depth: int = 0) -> bool:
    """m (through constant adds) -> a page count (rounded up or not) -> the width of a 2-D allocation, or the
    column stop of a slice `buf[:B, :n]` that a Triton kernel or a registered bounded writer writes: this rule's
    shape."""
    for user in node.users:
        if depth < 8 and plus_constant(user, node) is not None and _sizes_an_allocation(user, depth + 1):
            return True
        if page_count(user, node) is not None:
            width = width_of(user)
            for alloc in width.users:
                spelled = as_allocation(alloc)
                if spelled is not None and is_table_of(spelled, width):
                    return True
                if slice_of(alloc, width) is not None and any(
                        _compat.user_triton_kernel(w) is not None or launch_of(w) is not None
                        for w in alloc.users):
                    return True
    return False


@register_rule
class AllocatedTableMax(HostMaxRule):
    """A max whose page count sizes an allocated table that a registered bounded writer fills: the static width.

    Before (Dynamo, capture_scalar_outputs on; bs = 3, PAGED_SIZE = 64):

        max_1 = l_seq_lens_.max()
        item = max_1.item()                                                   # Sym(u0): device-to-host sync
        ge = item >= -63                                                      # Dynamo: the width is >= 0
        _assert_scalar_default = torch.ops.aten._assert_scalar.default(ge, "... u0 >= -63 ...")
        sym_sum = torch.sym_sum([63, item])
        floordiv_1 = sym_sum // 64                                            # n = cdiv(m, 64)
        ge_1 = floordiv_1 >= 0
        _assert_scalar_default_1 = torch.ops.aten._assert_scalar.default(ge_1, "... 0 <= ((u0 + 63)//64) ...")
        table = torch.full((3, floordiv_1), -1, dtype=torch.int32, device=device(type='cpu'))
        sym_max = torch.sym_max(1, floordiv_1)                                # table.stride(0)
        triton_kernel_wrapper_mutation = torch.ops.higher_order.triton_kernel_wrapper_mutation(
            kernel_idx=0, constant_args_idx=0, grid=[(3, 1, 1)], tma_descriptor_metadata={},
            kwargs={'req_to_token_ptr': l_r2t_, 'req_pool_indices_ptr': l_rpi_, 'page_kernel_lens_ptr': l_seq_lens_,
                    'kv_indices_ptr': table, 'kv_indices_ptr_stride': sym_max})
        paged_decode = torch.ops.syncfree.paged_decode(q, k, v, table, cache_seqlens, max_seqlen_k=item)

    After (max_context_len=4096; checked):

        amax = torch.ops.aten.amax.default(l_seq_lens_)                      # Dynamo's check, on the device:
        ge_scalar = torch.ops.aten.ge.Scalar(amax, -63)                       #   max >= -63
        _assert_async = torch.ops.aten._assert_async.msg(ge_scalar, '...')
        table = torch.full((3, 64), -1, dtype=torch.int32, device=device(type='cpu'))   # ceil(4096 / 64) pages
        le = torch.ops.aten.le.Scalar(l_seq_lens_, 4096); ...; _assert_async_1 = ...   # lengths <= the bound
        triton_kernel_wrapper_mutation = torch.ops.higher_order.triton_kernel_wrapper_mutation(
            kernel_idx=0, constant_args_idx=0, grid=[(3, 1, 1)], tma_descriptor_metadata={},
            kwargs={..., 'kv_indices_ptr': table, 'kv_indices_ptr_stride': 64})
        paged_decode = torch.ops.syncfree.paged_decode(q, k, v, table, cache_seqlens, max_seqlen_k=4096)

    The proof: the family's walk over the uses of `m` (rules/host_max.py: `m + c`, `min(m + c, T)`, checks kept
    exactly as device assertions, escapes), with a page count `(m + c + ps - 1) // ps` or an upper-bound argument
    of a self-guarding consumer as this rule's uses. Every
    use of the count is the width of ONE allocation `(B, n)`, the row stride `max(1, n)` passed to the writer as
    its declared `table_stride`, or Dynamo's own checks that hold for every width in [0, static width] (removed).
    The table's first user is a `triton_kernel_wrapper_mutation` whose kernel has BoundedWriter facts: it gets
    the table only as its `table`, its grid is (B, 1, 1) with B the table's rows (nothing from the width), its
    page size is the count's, its lengths hold the max's values + k (k <= c) and nothing writes them, the token
    table or the request indices between the max and the launch. Every later user is a self-guarding consumer
    taking the table as its page table, with pages of the same size, lengths related the same way (the writer is
    excluded from the write check: its facts say it writes only the table), nothing else writing the table in
    between, and outputs of the same shapes with the static width (fake tensors). Columns past a row's
    cdiv(length, ps) hold the fill in both (or are unread), and no consumer reads them.

    The sliced scratch `buf[:B, :n]` (FlashMLA): buf a persistent 2-D int buffer, statically at least as wide as
    the static width W, the column slice from 0. The writer's stride is buf's own row stride (a constant), so the
    writer and the consumers address every cell of row b exactly as in eager at any width: the widened slice
    `buf[:B, :W]` holds the cells eager's held, the writer writes the same cells of buf (row b's first
    cdiv(len_b, ps)), and the consumers read no further on row b with the same lengths: the stale tail of the
    scratch is never read (SGLang's own argument, flashmla_backend.py:145). Row views `t[:B']` reaching the
    consumers stand for the table; Dynamo's checks on the slice's width (`0 <= w <= buf.shape[1]`) hold for W.
    A full view `t[:B, :n]` of the allocation `t` of (B, n) (the scratch grown from None, issue 45) is every cell
    of `t` at `t`'s strides: it stands for the table wherever it is used (the writer's table, a consumer's page
    table, an escape), and is widened with the allocation, so it stays all of it; the writer may not get `t`
    beside it. A scratch regrown for more rows, `torch.full((rows, max(n, C)), -1)[:B, :n]` with the int C at
    least the static width W (the width the last step stored): `max(n, C)` is C for every n in [0, W], so every
    use of it gets C (under `checked` the lengths are asserted, as for every rewrite), the allocation is then a
    buffer statically C >= W wide, and its slice is the sliced scratch above (the writer's stride is the
    allocation's own row stride, C). Where C is below W (a scratch an earlier step left narrower) or a size of an
    input (its width once Dynamo made it dynamic), `max(n, C)` becomes `max(W, C)`: at least eager's width for
    every n, and no longer its value, so it may only be the allocation's width, the writer's row stride and checks
    that hold for every width, and the allocation may only be the table's base and leave the step, under
    static_escapes (rules/sliced_scratch.py: the scratch is stored wider than eager's). In a trace of a branch's
    other outcome (traced_ranges.OTHER) a persistent scratch narrower than W is sliced at the pages of the largest
    max that outcome admits, where they fit (check_buffer): that graph is only compared, never run for a larger
    max (trace_signature.regrown_scratch). The round-up `(n + a) // L * L` (a >= L - 1, TRTLLM-MLA): never below
    n, a multiple of L; W is the round-up of the bound's page count, at least eager's width for every m within
    the bound (monotone), and a multiple of L as the consumer may require. Dynamo's `blocks % L != 0` branch is the tracing side's (compile_pass/tracing.py):
    either outcome gives the same round-up.
    """

    name = RULE
    walk = _Walk

    def takes(self, value: torch.fx.Node) -> bool:
        return _sizes_an_allocation(value)

    def finish(self, walk: _Walk) -> AllocatedTablePlan:
        if not walk.tables:
            raise Unsafe("nothing_to_rewrite", "the max sizes no allocated table")
        walk.join_bounds()
        return walk.plan(walk.bound_source)

    def rewrite(self, plan: AllocatedTablePlan, graph: torch.fx.Graph, options) -> str:
        parts = []
        dead = rewrite_host_checks(graph, plan.checks)
        for t in plan.tables:
            for cover, constant in t.covers:  # `max(n, C)` is max(C, W) within the bound: every use gets it
                for user in list(cover.users):
                    replace_uses(user, cover, constant)
                dead.append(cover)
            for cover in t.sized:  # `max(n, s)` -> `max(W, s)`: the regrown scratch's width, at least W
                replace_uses(cover, t.count, t.pages)
                _refresh(cover)
            _widen(t)
            for stride in t.strides:
                replace_uses(t.writer, stride, max(1, t.pages))
            replace_uses(t.writer, t.count, t.pages)
            for node, per_program in t.grids:
                replace_uses(t.writer, node, ceil_div(t.pages, per_program))
            dead += [*t.bookkeeping, *t.strides, *(node for node, _ in t.grids), *reversed(t.rounding)]
            what = "sliced table" if t.sliced else "allocated table"
            regrown = "".join(f"; the regrown width max(n, {covering_constant(n, t.count)}) is {c} within the bound"
                              for n, c in t.covers) + (f"; the regrown width max(n, s) is max({t.pages}, s)"
                                                       if t.sized else "")
            parts.append(f"{what} -> width {t.pages} (page_size {t.page_size}"
                         f"{', rounded up' if t.rounding else ''}), written by {t.writer_name}"
                         f"{f'; the round-up covers the max + {t.slack} for every value of it' if t.rounding else ''}"
                         f"{'; the table leaves at that width (static_escapes)' if t.escapes else ''}{regrown}")
        for consumer, node, value in plan.bounds:
            replace_uses(consumer, node, value)
            parts.append(f"upper bound -> {value}")
        parts.append(f"bound {plan.bound} ({plan.bound_source})")
        if assert_lengths(graph, plan.lengths_uses, options.checked, plan.bound_source):
            parts.append("lengths asserted on the device")
        if plan.escapes:
            rewrite_escapes(graph, plan.escapes, plan.bound)
            parts.append("escaping values leave at the static bound (options['static_escapes'])")
        erase_read(graph, plan, dead)
        return "rewritten: " + "; ".join(parts)


def _widen(table: TablePlan) -> None:
    """The allocation (or the slice) gets the static width; its example value follows (Inductor's pre-grad passes
    read it), and so do those of its row views `t[:B']`, which have the same width: a stale view would still hold
    the dynamic width's unbacked symbol, and the backend would turn CUDA graphs off for a graph that holds none."""
    node = table.allocation
    if table.sliced and (table.covers or table.sized):  # a regrown allocation sliced: its width is now the cover's
        _refresh(node.args[0])
    if table.sliced:
        base, (rows, cols) = node.args
        node.args = (base, (rows, slice(cols.start, table.pages, cols.step)))
    else:
        node.args, node.kwargs = with_size(as_allocation(node), 1, table.pages)
    for alias in table.aliases:  # a full view of the allocation: the whole widened table
        base, (rows, cols) = alias.args
        alias.args = (base, (rows, slice(cols.start, table.pages, cols.step)))
    mode = fake_mode_of([node])
    if mode is None:
        return
    views = [u for t in (node, *table.aliases) for u in t.users if u.op == "call_function"
             and u.target is operator.getitem and len(u.args) == 2 and u.args[0] is t and is_row_view(u.args[1])]
    for each in (node, *table.aliases, *views):
        _refresh(each, mode)


def _refresh(node: torch.fx.Node, mode=None) -> None:
    """The node's example value computed again from its (rewritten) arguments' own."""
    mode = mode or fake_mode_of([node])
    if mode is None:
        return
    args = torch.fx.node.map_arg(node.args, example_value)
    kwargs = torch.fx.node.map_arg(node.kwargs, example_value)
    with mode:
        node.meta["example_value"] = node.target(*args, **kwargs)
