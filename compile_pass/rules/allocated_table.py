"""The allocated table: a page count `cdiv(max, ps)` sizes a table that a bounded user kernel fills per row.

This is recipe 2 of issue 20 (FlashMLA, TRTLLM-MLA and aiter build their page tables this way): the width of an
allocation comes from the host max, a user Triton kernel with registered facts fills each row only as far as
that row's length, and self-guarding consumers read it by the same lengths. The width becomes static; the kernel,
its inputs and the consumers stay where they are.

Register a writer (facts scoped to this rule, keyed by the kernel's `module:qualname`):

    register_bounded_writer(my_kernel, table="kv_indices_ptr", lengths="page_kernel_lens_ptr",
                            page_size="PAGED_SIZE", req_pool_indices="req_pool_indices_ptr",
                            req_to_token="req_to_token_ptr", table_stride="kv_indices_ptr_stride")

The example kernel in kernels/flashmla_kv_indices.py is registered when this module is imported.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator

import torch
import torch.fx

from .. import _compat
from .._compat import example_value, fake_mode_of
from ..consumers import (bind_arguments, facts_of, load_facts, lookup_consumer, overload_name, register_facts,
                         unregister_facts)
from ..find_sync_points import SyncPoint
from ..mutations import written_by
from ..fx_util import node_location, replace_uses
from ..normalize import (ASSERTS, INT_DTYPES, as_allocation, ceil_div, holds_for_every_value, row_stride_of,
                         page_count, plus_constant, with_size)
from ..proof import ProofContext, Unsafe, check_outputs_keep, check_page_size, declare_reasons, describe_use
from . import register_rule
from .host_max import HostMaxRule, HostMaxWalk, assert_lengths, erase_read, rewrite_escapes, rewrite_host_checks

RULE = "allocated_table"

REASONS = declare_reasons(RULE, {
    "writer_unknown": "the allocated table is written by a kernel with no bounded-writer facts",
    "table_written": "the allocated table is written by something other than its bounded writer before a reader",
    "width_use": "the allocated table's width is used by something other than the allocation and the writer's "
                 "row stride",
    "writer_grid": "the bounded writer's launch grid is not (rows of the table, 1, 1)",
})


# -- facts: bounded writers -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BoundedWriter:
    """A user Triton kernel that, launched on a grid (rows of the table, 1, 1), has program b write row b's first
    cdiv(max(lengths[b], 0), page_size) columns of `table` and nothing else; every other tensor it receives it only
    reads. Its writes depend on the table only through `table_stride` (the table's row stride), never its width."""

    name: str  # "module:qualname" of the kernel's Python function
    table: str  # the parameter that takes the [rows, n] table (written in place)
    lengths: str  # the parameter that takes the per-row lengths, in tokens
    page_size: int | str  # tokens per page: an int, or the parameter (constexpr or int) that holds it
    req_pool_indices: str | None = None  # the request indices it reads (checked like the lengths)
    req_to_token: str | None = None  # the token table it reads
    table_stride: str | None = None  # the parameter that takes table.stride(0), if any


def kernel_name(kernel) -> str:
    """`module:qualname` of a @triton.jit kernel (through autotuners/heuristics) or of a Python function."""
    obj, seen = kernel, 0
    while not inspect.isfunction(obj) and hasattr(obj, "fn") and seen < 8:
        obj, seen = obj.fn, seen + 1
    if not inspect.isfunction(obj):
        raise TypeError(f"not a @triton.jit kernel or a function: {type(kernel).__name__}")
    return f"{obj.__module__}:{obj.__qualname__}"


def _key(name: str) -> str:
    return overload_name("triton::" + name)


def _kernel_arg_names(kernel):
    obj, seen = kernel, 0
    while getattr(obj, "arg_names", None) is None and hasattr(obj, "fn") and seen < 8:
        obj, seen = obj.fn, seen + 1
    return getattr(obj, "arg_names", None)


def register_bounded_writer(kernel, *, table: str, lengths: str, page_size: int | str,
                            req_pool_indices: str | None = None, req_to_token: str | None = None,
                            table_stride: str | None = None) -> BoundedWriter:
    """Declare that `kernel` (a @triton.jit kernel, or its `module:qualname`) is a bounded writer (BoundedWriter).
    With the kernel object, the names are checked against its parameters. Registering again replaces."""
    name = kernel if isinstance(kernel, str) else kernel_name(kernel)
    arg_names = None if isinstance(kernel, str) else _kernel_arg_names(kernel)
    if isinstance(page_size, bool) or not (isinstance(page_size, str) or (isinstance(page_size, int)
                                                                          and page_size >= 1)):
        raise ValueError(f"page_size must be an int >= 1 or a parameter name, got {page_size!r}")
    named = {"table": table, "lengths": lengths, "req_pool_indices": req_pool_indices,
             "req_to_token": req_to_token, "table_stride": table_stride,
             "page_size": page_size if isinstance(page_size, str) else None}
    for label, value in named.items():
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{label} must be a parameter name, got {value!r}")
        if value is not None and arg_names is not None and value not in arg_names:
            raise ValueError(f"{label}={value!r} is not a parameter of {name} (parameters: {list(arg_names)})")
    facts = BoundedWriter(name, table, lengths, page_size, req_pool_indices, req_to_token, table_stride)
    register_facts(RULE, _key(name), facts)
    return facts


def unregister_bounded_writer(kernel) -> None:
    unregister_facts(RULE, _key(kernel if isinstance(kernel, str) else kernel_name(kernel)))


def bounded_writer_of(kernel) -> BoundedWriter | None:
    try:
        name = kernel if isinstance(kernel, str) else kernel_name(kernel)
    except TypeError:
        return None
    return facts_of(RULE).get(_key(name))


def _builtin_writers() -> dict:
    from ..kernels import flashmla_kv_indices  # it defines a Triton kernel: imported with this rule, not the ops

    return flashmla_kv_indices.BOUNDED_WRITERS


load_facts(_builtin_writers(), register_bounded_writer)


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


# -- the proof --------------------------------------------------------------------------------------------
def _in_grid(writer: torch.fx.Node, node: torch.fx.Node) -> bool:
    found = []
    torch.fx.node.map_arg(writer.kwargs.get("grid"), lambda n: found.append(n is node))
    return any(found)


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


class _Walk(HostMaxWalk):
    """One max's proof: the family's walk, with a page count sizing one allocated table as its use."""

    page_counts = True

    def __init__(self, point: SyncPoint, ctx: ProofContext, bound: int):
        super().__init__(point, ctx, bound)
        self.tables, self.bounds, self.pending = [], [], []

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
        allocations, strides, bookkeeping, writers = [], [], [], []
        for user in count.users:
            alloc = as_allocation(user)
            if alloc is not None and _is_table_of(alloc, count):
                allocations.append(user)
                continue
            if _compat.user_triton_kernel(user) is not None:
                if _in_grid(user, count):
                    raise Unsafe("writer_grid", f"the launch grid of the kernel at {node_location(user)} depends on "
                                                "the page count: its writes would follow the static width")
                writers.append(user)  # as its table_stride: follow_writer checks
                continue
            if row_stride_of(user, count):
                strides.append(user)
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
        if len(allocations) != 1:
            raise Unsafe("width_use", f"the page count at {node_location(count)} sizes {len(allocations)} "
                                      "allocations; one table, one writer")
        (allocation,) = allocations
        for stride in strides:
            for user in stride.users:
                if _compat.user_triton_kernel(user) is None:
                    raise Unsafe("width_use", f"the table's row stride (`max(1, n)`) is used by {describe_use(user)}")
                if _in_grid(user, stride):
                    raise Unsafe("writer_grid", f"the launch grid at {node_location(user)} depends on the width")
        self.follow_table(count, page_size, extra, pages, allocation, tuple(strides), tuple(bookkeeping),
                          set(writers) | {u for s in strides for u in s.users})

    def follow_table(self, count, page_size, extra, pages, allocation, strides, bookkeeping, width_readers):
        alloc = as_allocation(allocation)
        tv = example_value(allocation)
        if getattr(tv, "dtype", None) not in INT_DTYPES:
            raise Unsafe("not_a_table", f"the allocation at {node_location(allocation)} is {getattr(tv, 'dtype', None)}"
                                        ", not an int32/int64 page table")
        users = sorted(allocation.users, key=self.ctx.index)
        if not users:
            raise Unsafe("no_consumer", "the allocated table is never read")
        writer = users[0]
        if _compat.user_triton_kernel(writer) is None:
            if writer.op == "call_function" and lookup_consumer(writer) is not None:
                raise Unsafe("no_writer", f"{describe_use(writer)} reads the allocated table before any kernel "
                                          "writes it")
            raise self.table_use(writer)
        facts = self.follow_writer(writer, allocation, alloc, count, page_size, extra, strides)
        consumers = []
        for user in users[1:]:
            if _compat.user_triton_kernel(user) is not None:
                raise Unsafe("table_written", f"the allocated table is also written by the kernel at "
                                              f"{node_location(user)}")
            entry = lookup_consumer(user) if user.op == "call_function" else None
            if entry is None:
                if allocation in written_by(user):
                    raise Unsafe("table_written", f"the allocated table is written by {describe_use(user)} after its "
                                                  "bounded writer")
                raise self.table_use(user)
            names = [a for a, v in bind_arguments(entry.name, user.args, user.kwargs).items() if v is allocation]
            if entry.page_table is None or names != [entry.page_table]:
                raise Unsafe("table_argument", f"the allocated table is passed to {entry.name} as {names}, not as its "
                                               "page-table argument")
            check_page_size(user, entry, page_size)
            try:
                self.ctx.check_no_writes(user, [allocation], "the allocated table", writer, self.disjoint)
            except Unsafe as e:
                raise Unsafe("table_written", e.message) from None
            lengths = bind_arguments(entry.name, user.args, user.kwargs).get(entry.lengths)
            self.relate(user, lengths, f"{entry.name}'s {entry.lengths}", extra, allowed=(writer,))
            lv = example_value(lengths)
            if getattr(lv, "ndim", 0) != 1 or not _same_size(lv.shape[0], tv.shape[0]):
                raise Unsafe("mismatch", f"{entry.name}'s {entry.lengths} do not have one value per table row")
            self.check_outputs_keep(user, entry, allocation, pages)
            consumers.append(user)
        if not consumers:
            raise Unsafe("no_consumer", "the allocated table reaches no self-guarding consumer")
        if width_readers - {writer}:
            other = min(width_readers - {writer}, key=self.ctx.index)
            raise Unsafe("width_use", f"the table's width reaches {describe_use(other)}, which is not its writer")
        self.tables.append(TablePlan(count, pages, page_size, allocation, strides, writer, facts.name, bookkeeping,
                                     tuple(consumers)))

    @staticmethod
    def table_use(user: torch.fx.Node) -> Unsafe:
        if user.op == "output":
            return Unsafe("escapes", "the allocated table reaches the graph output (returned or stored)")
        return Unsafe("table_use", f"the allocated table reaches {describe_use(user)}, which is neither its bounded "
                                   "writer nor a self-guarding consumer")

    def follow_writer(self, writer, allocation, alloc, count, page_size, extra, strides) -> BoundedWriter:
        kernel, constants = _compat.user_triton_kernel(writer)
        facts = bounded_writer_of(kernel)
        try:
            name = kernel_name(kernel)
        except TypeError:
            name = type(kernel).__name__
        if facts is None:
            raise Unsafe("writer_unknown", f"the kernel {name} at {node_location(writer)} writes the allocated table "
                                           "and has no bounded-writer facts (register_bounded_writer)")
        if writer.kwargs.get("tma_descriptor_metadata"):
            raise Unsafe("writer_unknown", f"{name} is launched with TMA descriptors, which its facts do not cover")
        kw = dict(writer.kwargs.get("kwargs", {}))
        args = {**constants, **kw}
        for param, value in kw.items():
            held = []
            torch.fx.node.map_arg(value, lambda n: held.append(n))
            if allocation in held and (param != facts.table or value is not allocation):
                raise Unsafe("table_argument", f"the allocated table is passed to {name} as {param!r}, not only as "
                                               f"its table {facts.table!r}")
            width = [n for n in held if n is count or n in strides]
            if width and (param != facts.table_stride or value not in (count, *strides)):
                raise Unsafe("width_use", f"the table's width is passed to {name} as {param!r}, not as its row "
                                          f"stride {facts.table_stride!r}")
        if kw.get(facts.table) is not allocation:
            raise Unsafe("table_argument", f"the allocated table is not {name}'s table {facts.table!r}")
        if facts.table_stride is not None:
            stride = args.get(facts.table_stride)
            if stride not in (count, *strides):
                raise Unsafe("width_use", f"{name}'s {facts.table_stride!r} is not the table's row stride "
                                          f"({stride!r})")
        grid = writer.kwargs.get("grid")
        if not isinstance(grid, (list, tuple)) or not grid or not all(
                isinstance(g, (list, tuple)) and len(g) == 3 and _same_size(g[0], alloc.sizes[0])
                and all(isinstance(d, int) and d == 1 for d in g[1:]) for g in grid):
            raise Unsafe("writer_grid", f"{name} is launched on the grid {grid!r}, not (rows of the table, 1, 1): "
                                        "its facts cover one program per row")
        ps = facts.page_size if isinstance(facts.page_size, int) else args.get(facts.page_size)
        if not isinstance(ps, int) or isinstance(ps, bool) or ps != page_size:
            raise Unsafe("page_size", f"{name} writes pages of {ps!r} tokens but the table's width counts pages of "
                                      f"{page_size}")
        rows = example_value(allocation).shape[0]
        lengths = kw.get(facts.lengths)
        self.relate(writer, lengths, f"{name}'s {facts.lengths}", extra)
        inputs = []
        for label, param, ndim in (("lengths", facts.lengths, 1), ("request indices", facts.req_pool_indices, 1),
                                   ("token table", facts.req_to_token, 2)):
            if param is None:
                continue
            value = kw.get(param)
            v = example_value(value)
            # The request indices need only be 1-D ints: program b reads entry b whatever the table's width, in the
            # step as in eager, so their length (a size Dynamo may give its own symbol) does not bear on the rewrite.
            if getattr(v, "dtype", None) not in INT_DTYPES or v.ndim != ndim or (
                    param == facts.lengths and not _same_size(v.shape[0], rows)):
                raise Unsafe("mismatch", f"{name}'s {label} {param!r} is not an int tensor with one value per row "
                                         "of the table" if ndim == 1 else f"{name}'s {label} is not a 2-D int tensor")
            if param != facts.lengths:
                inputs.append(value)
        self.ctx.check_no_writes(writer, inputs, "the token table or the request indices", self.first, self.disjoint)
        return facts

    def check_outputs_keep(self, consumer, entry, table: torch.fx.Node, pages: int):
        """The consumer on fake tensors with the static-width table must return the same shapes and dtypes."""
        tv = example_value(table)
        rows = tv.shape[0] if isinstance(tv, torch.Tensor) else None
        check_outputs_keep(consumer, {table: (rows, pages)}, entry.name, "the static table")

    def plan(self, bound_source: str) -> AllocatedTablePlan:
        touches = self.shared_touches()
        for t in self.tables:
            touches |= {t.count, t.allocation, t.writer, *t.strides, *t.bookkeeping, *t.consumers}
        touches |= {c for c, _, _ in self.bounds}
        return AllocatedTablePlan(self.point, self.bound, bound_source, tuple(self.tables), tuple(self.bounds),
                                  tuple(self.checks), tuple(self.escapes), tuple(self.lengths_uses), tuple(self.offsets), frozenset(touches),
                                  frozenset(self.disjoint))


def _is_table_of(alloc, count: torch.fx.Node) -> bool:
    """A 2-D allocation `(B, n)` whose width is the page count and whose rows are not."""
    return alloc.rank == 2 and alloc.sizes[1] is count and alloc.sizes[0] is not count


def _sizes_an_allocation(node: torch.fx.Node, depth: int = 0) -> bool:
    """m (through constant adds) -> a page count -> the width of a 2-D allocation: this rule's shape."""
    for user in node.users:
        if depth < 8 and plus_constant(user, node) is not None and _sizes_an_allocation(user, depth + 1):
            return True
        if page_count(user, node) is not None:
            for alloc in user.users:
                spelled = as_allocation(alloc)
                if spelled is not None and _is_table_of(spelled, user):
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
            _widen(t)
            for stride in t.strides:
                replace_uses(t.writer, stride, max(1, t.pages))
            replace_uses(t.writer, t.count, t.pages)
            dead += [*t.bookkeeping, *t.strides]
            parts.append(f"allocated table -> width {t.pages} (page_size {t.page_size}), written by {t.writer_name}")
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
    """The allocation gets the static width; its example value follows (Inductor's pre-grad passes read it)."""
    node = table.allocation
    node.args, node.kwargs = with_size(as_allocation(node), 1, table.pages)
    mode = fake_mode_of([node])
    if mode is not None:
        args = torch.fx.node.map_arg(node.args, example_value)
        kwargs = torch.fx.node.map_arg(node.kwargs, example_value)
        with mode:
            node.meta["example_value"] = node.target(*args, **kwargs)
