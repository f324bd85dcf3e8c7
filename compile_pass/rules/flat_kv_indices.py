"""The flat kv_indices sum: `n = sum(seq_lens)` read on the host to size a flat kv_indices buffer becomes a static
size, B x max_context_len (SGLang's DCP path and FlashInfer fallbacks; issue 20, recipe 3).

Before (Dynamo, capture_scalar_outputs on; B requests, a [R, T] token table):

    cumsum = torch.cumsum(l_fb_seq_lens, 0)                                 # [B] int64
    kv_indptr = torch._C._nn.pad(cumsum, (1, 0), 'constant', None)         # [B + 1]: 0, l0, l0 + l1, ...
    sum_1 = l_fb_seq_lens.sum()                                             # [] int64
    item = sum_1.item()                                                     # Sym(u0): device-to-host sync
    ge = item >= 0                                                          # Dynamo's own check of the size
    _assert_scalar_default = torch.ops.aten._assert_scalar.default(ge, "Runtime assertion failed for ... u0 >= 0")
    kv_indices = torch.empty(item, dtype=torch.int32, device=device(type='cuda'))        # [u0]
    torch.ops.syncfree.kv_indices(kv_indices, l_fb_req_to_token, l_fb_req_pool_indices, l_fb_seq_lens, kv_indptr)
    out = torch.ops.mylib.flat_attention(q, k, v, kv_indices, kv_indptr, l_fb_seq_lens)

After (max_context_len=4096, B = 8 static; under dynamic shapes the size is `sym_size(seq_lens, 0) * 4096`):

    cumsum = torch.cumsum(l_fb_seq_lens, 0)
    kv_indptr = torch._C._nn.pad(cumsum, (1, 0), 'constant', None)
    kv_indices = torch.empty(32768, dtype=torch.int32, device=device(type='cuda'))       # [B * 4096]
    le_scalar = torch.ops.aten.le.Scalar(l_fb_seq_lens, 4096)               # checked: 0 <= every length <= 4096,
    ge_scalar = torch.ops.aten.ge.Scalar(l_fb_seq_lens, 0)                  # on the device (it implies Dynamo's
    ...                                                                     # `u0 >= 0`, which goes)
    _assert_async_msg = torch.ops.aten._assert_async.msg(all_default, 'syncfree: a sequence length is outside ...')
    torch.ops.syncfree.kv_indices(kv_indices, l_fb_req_to_token, l_fb_req_pool_indices, l_fb_seq_lens, kv_indptr)
    out = torch.ops.mylib.flat_attention(q, k, v, kv_indices, kv_indptr, l_fb_seq_lens)

A check on n that is not implied (a user's `torch._check(n <= 100)`, or Dynamo's `n >= 0` with checked=False)
stays exact, as `_assert_async(aten.ge.Scalar(aten.sum(seq_lens), 0))`: no host read.

The proof (docs/design.md, "The safety rule"; REVIEW.md section 1) follows every use of `n`:
  1. each use is the size of a 1-D allocation (normalize.as_alloc: torch.empty / zeros / new_empty / new_zeros),
     or a comparison that only feeds asserts (Dynamo's `n >= 0`, a user's `torch._check(n <= N)`): kept exactly,
     as a device assertion on `sum(lengths)`, unless the lengths' device check implies it;
  2. each buffer reaches exactly one registered bounded writer (as its `out` argument), and after it only
     registered readers through an indptr (as their `indices` argument); nothing else, not the graph output;
  3. the writer's and the readers' lengths hold the summed values (ProofContext.relate_lengths; `x - k` is
     fine, `x + k` is not: it adds B*k to the total), and every indptr is the cumulative sum with a leading 0
     (normalize.indptr_of) of exactly the summed values;
  4. nothing writes the lengths, the indptr's lengths or the indptr between the first of their reads and each
     writer and reader, and nothing writes the buffer between the writer and a reader
     (ProofContext.check_no_writes);
  5. the writer's and the readers' outputs keep their shapes and dtypes with the static buffer (fake tensors).
Then the writer fills [indptr[b], indptr[b] + len_b) of a buffer of any size >= indptr[B] = n with the values eager
gives, and the readers read only those positions: the buffer's contents past indptr[B] are unspecified and never
read. The static size is a TOTAL: B x max_context_len covers n when every length is within [0, max_context_len],
which `checked` (the default) asserts on the device; with checked=False a length past the bound gives
unspecified values, and while the writer still writes nothing outside the buffer, a reader through the indptr
then reads past the buffer's end, as any reader given an indptr beyond its buffer does. The token table and the
request indices need no window: the writer is not moved, so it reads them where eager does.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from .. import kernels
from .._compat import example_value, fake_mode_of
from ..consumers import bind_arguments, facts_of, load_facts, lookup_facts, overload_name, register_facts, \
    schema_argument_names, unregister_facts, _resolve
from ..find_sync_points import SyncPoint
from ..fx_util import erase_if_dead, insert_call, insert_device_assert, node_location
from ..mutations import written_by
from ..normalize import (ARITHMETIC, COMPARES, INT_DTYPES, SYM_SIZE, as_allocation, compared_constant, constant_add,
                         dtype_of, indptr_of, only_asserted, strip_kept_values)
from ..proof import LengthsRelation, ProofContext, Unsafe, check_outputs_keep, declare_reasons, describe_use
from . import register_rule

RULE = "flat_kv_indices"

REASONS = declare_reasons(RULE, {
    "not_lengths": "the sum is over a tensor that is not a lengths input (a 1-D int32/int64 graph input)",
    "sum_use": "the sum is used as something other than the size of an allocation",
    "buffer_use": "the buffer sized by the sum reaches something other than one bounded writer (as its out) and "
                  "readers through an indptr of the same lengths",
})


# -- facts (per overload, scoped by this rule; the kernels' own are in kernels/kv_indices.py) ------------------
@dataclasses.dataclass(frozen=True)
class IndptrWriter:
    """An overload that writes only out[indptr[b] : indptr[b] + lengths[b]] (and nothing outside `out`)."""

    name: str
    out: str
    indptr: str
    lengths: str


@dataclasses.dataclass(frozen=True)
class IndptrReader:
    """An overload that reads only indices[indptr[b] : indptr[b] + lengths[b]] and writes none of them."""

    name: str
    indices: str
    indptr: str
    lengths: str


def _schema_of(name: str):
    try:
        return _resolve(name)._schema
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"op {name!r} is not a registered torch op overload: {e}") from None


def _check_names(name: str, **arguments) -> None:
    names = schema_argument_names(name)
    for label, value in arguments.items():
        if value not in names:
            raise ValueError(f"{label}={value!r} is not an argument of {name} (arguments: {names})")


def register_indptr_writer(op, *, out: str, indptr: str, lengths: str) -> IndptrWriter:
    """Declare that `op` (one overload) writes only out[indptr[b] : indptr[b] + lengths[b]] of its `out` argument,
    which its schema must mark written (`Tensor(a!)`)."""
    name = overload_name(op)
    schema = _schema_of(name)
    _check_names(name, out=out, indptr=indptr, lengths=lengths)
    arg = next(a for a in schema.arguments if a.name == out)
    if arg.alias_info is None or not arg.alias_info.is_write:
        raise ValueError(f"{name}'s {out} is not written by its schema (mutates_args must name it)")
    return register_facts(RULE, name, IndptrWriter(name, out, indptr, lengths))


def register_indptr_reader(op, *, indices: str, indptr: str, lengths: str) -> IndptrReader:
    """Declare that `op` (one overload) reads only indices[indptr[b] : indptr[b] + lengths[b]] (an attention op
    over a flat kv_indices buffer, FlashInfer's layout); its schema must write none of the three."""
    name = overload_name(op)
    schema = _schema_of(name)
    _check_names(name, indices=indices, indptr=indptr, lengths=lengths)
    for a in schema.arguments:
        if a.name in (indices, indptr, lengths) and a.alias_info is not None and a.alias_info.is_write:
            raise ValueError(f"{name} writes its {a.name}: a reader through an indptr must not")
    return register_facts(RULE, name, IndptrReader(name, indices, indptr, lengths))


def unregister_flat_kv_facts(op) -> None:
    unregister_facts(RULE, op)


def registered_flat_kv_facts() -> dict:
    return facts_of(RULE)


load_facts(kernels.FLAT_KV_INDICES["writers"], register_indptr_writer)
load_facts(kernels.FLAT_KV_INDICES["readers"], register_indptr_reader)


# -- plans (frozen: the rewrite reads them, never edits them) ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BufferPlan:
    alloc: torch.fx.Node  # torch.empty(n, ..) and its spellings: its size becomes the static total
    writer: torch.fx.Node | None
    readers: tuple
    writer_lengths: torch.fx.Node | None  # the writer's lengths, before any narrowing cast (the device check)


@dataclasses.dataclass(frozen=True)
class SumCheck:
    """`n op k` feeding only asserts (Dynamo's `n >= 0`, a user's torch._check): `sum(lengths) op k` on the device."""

    compare: torch.fx.Node
    asserts: tuple
    op: object  # operator.ge / gt / le / lt / eq / ne, with n on the left
    constant: int


@dataclasses.dataclass(frozen=True)
class FlatKvPlan:
    point: SyncPoint
    bound: int  # max_context_len: every length is within [0, bound], so n <= B * bound
    lengths: torch.fx.Node  # the summed values' root (a graph input): B is its size(0)
    buffers: tuple
    checks: tuple
    touches: frozenset
    disjoint: frozenset


_DEVICE_COMPARE = {operator.ge: torch.ops.aten.ge.Scalar, operator.gt: torch.ops.aten.gt.Scalar,
                   operator.le: torch.ops.aten.le.Scalar, operator.lt: torch.ops.aten.lt.Scalar,
                   operator.eq: torch.ops.aten.eq.Scalar, operator.ne: torch.ops.aten.ne.Scalar}


def _is_op(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (
        isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        or getattr(node.target, "_opoverload", None) is not None)


class _Walk:
    """One sum's proof: the walk over its uses and over each buffer's uses."""

    def __init__(self, point: SyncPoint, ctx: ProofContext, bound: int):
        self.point, self.ctx, self.bound = point, ctx, bound
        self.root, self.chain = strip_kept_values(point.source, allow_moves=True, allow_narrowing=True)
        self.first = ctx.first(point.nodes)
        self.buffers, self.checks = [], []
        self.disjoint: set = set()

    # -- uses of n ----------------------------------------------------------------------------------------
    def follow_value(self, n: torch.fx.Node) -> None:
        for user in list(n.users):
            alloc = as_allocation(user)
            if alloc is not None and alloc.kind in ("empty", "zeros") and len(alloc.sizes) == 1 and alloc.sizes[0] is n:
                self.buffers.append(self.follow_buffer(user))
                continue
            if self.is_check(user, n):
                continue
            if user.op == "output":
                raise Unsafe("escapes", f"the sum reaches {describe_use(user)}: it would leave at another value")
            if user.op == "call_function" and user.target in ARITHMETIC:
                raise Unsafe("arithmetic", f"the sum is used in arithmetic ({describe_use(user)}), not as the size "
                                           "of an allocation")
            if user.op == "call_function" and user.target in COMPARES:
                raise Unsafe("compared", f"the sum is compared ({describe_use(user)}), and the comparison must keep "
                                         "its value")
            raise Unsafe("sum_use", f"the sum reaches {describe_use(user)}, which is not the size of a 1-D "
                                    "allocation (torch.empty(n), torch.zeros(n), x.new_empty(n))")

    def is_check(self, compare: torch.fx.Node, n: torch.fx.Node) -> bool:
        compared = compared_constant(compare, n)
        if compared is None or not only_asserted(compare):
            return False
        self.checks.append(SumCheck(compare, tuple(compare.users), *compared))
        return True

    # -- the buffer -----------------------------------------------------------------------------------------
    def follow_buffer(self, buf: torch.fx.Node) -> BufferPlan:
        writers, readers = [], []
        for user in buf.users:
            facts = lookup_facts(RULE, user) if user.op == "call_function" else None
            if isinstance(facts, (IndptrWriter, IndptrReader)):
                args = bind_arguments(facts.name, user.args, user.kwargs)
                names = [k for k, v in args.items() if v is buf]
                want = facts.out if isinstance(facts, IndptrWriter) else facts.indices
                if names != [want]:
                    raise Unsafe("buffer_use", f"the buffer is passed to {facts.name} as {names}, not as its {want}")
                (writers if isinstance(facts, IndptrWriter) else readers).append((user, facts, args))
                continue
            if user.op == "output":
                raise Unsafe("escapes", f"the buffer sized by the sum reaches {describe_use(user)}: it would leave "
                                        "at the static size")
            if _is_op(user):
                raise Unsafe("not_a_consumer", f"the buffer reaches {describe_use(user)}, which has no facts as a "
                                               "bounded writer or a reader through an indptr")
            if buf in written_by(user):
                raise Unsafe("written", f"the buffer is written by {describe_use(user)}, which is not a bounded "
                                        "writer: the writes past the lengths would land elsewhere")
            raise Unsafe("buffer_use", f"the buffer sized by the sum reaches {describe_use(user)}")
        if len(writers) > 1:
            raise Unsafe("buffer_use", "the buffer has more than one writer")
        if readers and not writers:
            raise Unsafe("no_writer", "the buffer is read through an indptr but nothing registered fills it")
        writer = writers[0] if writers else None
        wide = self.prove_writer(*writer) if writer is not None else None
        for reader in readers:
            self.prove_reader(*reader, writer)
        return BufferPlan(buf, writer[0] if writer else None, tuple(r[0] for r in readers), wide)

    def relate(self, node, facts, args, offset_ok) -> LengthsRelation:
        lengths = args.get(facts.lengths)
        rel = self.ctx.relate_lengths(self.point.source, lengths, f"{facts.name}'s {facts.lengths}")
        if rel.offset > 0 or (rel.offset < 0 and not offset_ok):
            raise Unsafe("lengths_exceed", f"{facts.name}'s {facts.lengths} are the summed values + {rel.offset}: a "
                                           f"constant k added to every length adds B*k to the total, which the "
                                           "size does not cover")
        return rel

    def indptr_relation(self, node, facts, args) -> tuple[LengthsRelation, list]:
        """The indptr argument must be the cumulative sum, with a leading 0, of exactly the summed values."""
        indptr = args.get(facts.indptr)
        spelled = indptr_of(indptr) if isinstance(indptr, torch.fx.Node) else None
        if spelled is None:
            raise Unsafe("indptr_differs", f"{facts.name}'s {facts.indptr} is not recognised as an indptr of the "
                                           "summed lengths (F.pad(torch.cumsum(lens, 0), (1, 0)) or "
                                           "torch.cat([zeros(1), cumsum(lens)]))")
        lengths, nodes = spelled
        try:
            rel = self.ctx.relate_lengths(self.point.source, lengths, f"the cumsum of {facts.name}'s {facts.indptr}")
        except Unsafe as e:
            raise Unsafe("indptr_differs", e.message) from None
        if rel.offset != 0:
            raise Unsafe("indptr_differs", f"{facts.name}'s {facts.indptr} is the cumulative sum of the summed "
                                           f"lengths + {rel.offset}: it does not end at the sum")
        return rel, [indptr, *nodes]

    def check_windows(self, node, facts, rels, indptr_nodes) -> None:
        """Nothing may write the lengths or the indptr between their first read and this writer or reader."""
        protected = [self.root, *self.chain, *indptr_nodes]
        chains = []
        for rel in rels:
            protected += [rel.root, *rel.chain, rel.lengths]
            chains += rel.chain
        start = self.ctx.first([self.first, *self.chain, *chains, *indptr_nodes])
        self.ctx.check_no_writes(node, protected, "the lengths or the indptr", start, self.disjoint)
        for rel in rels:
            if rel.via_mirror:
                mirror = rel.root if rel.root in self.ctx.mirrors else self.root
                self.ctx.check_no_writes(node, [mirror, self.ctx.mirrors.get(mirror)], "the CPU mirror or its twin",
                                         None, self.disjoint)

    def prove_writer(self, node, facts: IndptrWriter, args) -> torch.fx.Node:
        rel = self.relate(node, facts, args, offset_ok=True)
        indptr_rel, indptr_nodes = self.indptr_relation(node, facts, args)
        self.check_windows(node, facts, [rel, indptr_rel], indptr_nodes)
        self.check_outputs_keep(node, facts, facts.out, args)
        # The summed values as the writer's device holds them: before narrowing casts and constant adds.
        wide, _ = strip_kept_values(rel.lengths, allow_moves=False, allow_narrowing=True)
        while constant_add(wide) is not None:
            wide, _ = strip_kept_values(constant_add(wide)[0], allow_moves=False, allow_narrowing=True)
        return wide

    def prove_reader(self, node, facts: IndptrReader, args, writer) -> None:
        buf = args[facts.indices]
        if self.ctx.index(node) < self.ctx.index(writer[0]):
            raise Unsafe("no_writer", f"{facts.name} at {node_location(node)} reads the buffer before its writer at "
                                      f"{node_location(writer[0])} fills it")
        if buf in written_by(node):
            raise Unsafe("written", f"{facts.name} writes the buffer it is registered to read")
        rel = self.relate(node, facts, args, offset_ok=True)
        writer_indptr = writer[2].get(writer[1].indptr)
        mine = args.get(facts.indptr)
        if isinstance(mine, torch.fx.Node) and isinstance(writer_indptr, torch.fx.Node) and \
                strip_kept_values(mine)[0] is strip_kept_values(writer_indptr)[0]:
            indptr_rel, indptr_nodes = self.indptr_relation(writer[0], writer[1], writer[2])
            indptr_nodes = [mine, *indptr_nodes]
        else:  # another indptr node: fine only if it holds the same values (the cumsum of the same lengths)
            try:
                indptr_rel, indptr_nodes = self.indptr_relation(node, facts, args)
            except Unsafe as e:
                raise Unsafe("indptr_differs", f"{facts.name} at {node_location(node)} reads through another indptr "
                                               f"than its writer's ({e.message})") from None
        self.check_windows(node, facts, [rel, indptr_rel], indptr_nodes)
        self.ctx.check_no_writes(node, [buf], "the kv_indices buffer", writer[0], self.disjoint)
        self.check_outputs_keep(node, facts, facts.indices, args)

    def check_outputs_keep(self, node, facts, argument: str, args) -> None:
        """The op, run on fake tensors with the buffer at its static size, must return what it returned in the
        trace (same shapes, same dtypes): an output shaped by n would change."""
        check_outputs_keep(node, {args[argument]: (self.static_size(),)}, facts.name, "the static buffer",
                           may_return_nothing=True)

    def static_size(self):
        return example_value(self.root).shape[0] * self.bound

    def plan(self) -> FlatKvPlan:
        touches = set(self.point.nodes) | {b.alloc for b in self.buffers}
        for check in self.checks:
            touches |= {check.compare, *check.asserts}
        return FlatKvPlan(self.point, self.bound, self.root, tuple(self.buffers), tuple(self.checks),
                          frozenset(touches), frozenset(self.disjoint))


@register_rule
class FlatKvIndices:
    """A sum over lengths sizing a flat kv_indices buffer that a bounded writer fills through an indptr of the
    same lengths and readers read through it: the static total B x max_context_len."""

    name = RULE
    options: dict = {}

    def match(self, read: SyncPoint) -> bool:
        return read.reduction == "sum"

    def prove(self, read: SyncPoint, ctx: ProofContext) -> FlatKvPlan:
        if dtype_of(read.source) not in INT_DTYPES:
            raise Unsafe("not_int_lengths", f"the sum is taken over a {dtype_of(read.source)} tensor, not int32/int64 "
                                            "lengths")
        root, _ = strip_kept_values(read.source, allow_moves=True, allow_narrowing=True)
        value = example_value(root)
        if root.op != "placeholder" or getattr(value, "ndim", 0) != 1:
            raise Unsafe("not_lengths", f"the sum is over {root.name} ({describe_use(root)}), not a 1-D lengths "
                                        "input: no bound is known for its elements")
        if ctx.options.max_context_len is None:
            raise Unsafe("no_bound", "options['max_context_len'] is missing, so no static size exists (pass "
                                     "options={'max_context_len': N}, or compile_pass.compile(fn, max_context_len=N))")
        walk = _Walk(read, ctx, ctx.options.max_context_len)
        walk.follow_value(read.value)
        if not walk.buffers:
            raise Unsafe("nothing_to_rewrite", "the sum sizes no allocation: nothing to rewrite")
        return walk.plan()

    # -- the rewrite --------------------------------------------------------------------------------------
    def rewrite(self, plan: FlatKvPlan, graph: torch.fx.Graph, options) -> str:
        parts, dead = [], []
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min((b.alloc for b in plan.buffers), key=order.get)
        batch = example_value(plan.lengths).shape[0]
        kept_checks = 0
        for check in plan.checks:  # the check keeps its meaning, on the device: sum(lengths) op k
            dead += [*check.asserts, check.compare]
            if options.checked and _implied(check, batch, plan.bound):
                continue  # 0 <= every length <= bound, asserted below, implies it (Dynamo's own `n >= 0`)
            kept_checks += 1
            total = insert_call(graph, check.compare, torch.ops.aten.sum.default, (plan.point.source,), check.compare)
            holds = insert_call(graph, check.compare, _DEVICE_COMPARE[check.op], (total, check.constant),
                                check.compare)
            insert_call(graph, check.compare, torch.ops.aten._assert_async.msg,
                        (holds, f"syncfree: the check on the sum at {node_location(check.compare)} failed"),
                        check.compare)
        if options.checked:  # every length within [0, bound]: then n <= B * bound, the static size
            # On the device, where the first writer reads its lengths (before a narrowing cast); else the input.
            written = sorted((b for b in plan.buffers if b.writer is not None), key=lambda b: order[b.writer])
            wide, before = (written[0].writer_lengths, written[0].writer) if written else (plan.lengths, first)
            insert_device_assert(graph, before, wide, plan.bound,
                                 f"syncfree: a sequence length is outside [0, max_context_len={plan.bound}], so the "
                                 f"sum at {plan.point.location} may exceed the static kv_indices size",
                                 low=0)
        size = _static_size(graph, first, plan.lengths, plan.bound)
        for buffer in plan.buffers:
            alloc = buffer.alloc
            alloc.replace_input_with(plan.point.value, size)
            _refresh_example_value(alloc, size)
            rows = "B" if isinstance(size, torch.fx.Node) else str(size // plan.bound)
            readers = f", {len(buffer.readers)} reader(s)" if buffer.readers else ""
            parts.append(f"{alloc.name} -> size {rows} x {plan.bound} (B x max_context_len{readers})")
        if kept_checks:
            parts.append("checks on the sum run on the device")
        if options.checked:
            parts.append("lengths asserted on the device")
        dead += [plan.point.value, *plan.point.nodes]
        erase_if_dead(graph, dead)
        return "rewritten: " + "; ".join(parts)


def _implied(check: SumCheck, batch, bound: int) -> bool:
    """Does `0 <= every length <= bound` make `sum op k` true whatever the lengths?"""
    k, op = check.constant, check.op
    if (op is operator.ge and k <= 0) or (op is operator.gt and k < 0):
        return True
    if not isinstance(batch, int):
        return False
    return (op is operator.le and k >= batch * bound) or (op is operator.lt and k > batch * bound)


def _static_size(graph, before, lengths, bound):
    """B * bound as a graph value: an int, or `sym_size(lengths, 0) * bound` (a backed SymInt) when B is dynamic."""
    batch = example_value(lengths).shape[0]
    if isinstance(batch, int):
        return batch * bound
    with graph.inserting_before(before):
        size = graph.call_function(SYM_SIZE, (lengths, 0))
        total = graph.call_function(operator.mul, (size, bound))
    size.meta["example_value"] = batch
    total.meta["example_value"] = batch * bound
    return total


def _refresh_example_value(alloc: torch.fx.Node, size) -> None:
    old = example_value(alloc)
    mode = fake_mode_of([alloc])
    if old is None or mode is None:
        return
    n = size.meta["example_value"] if isinstance(size, torch.fx.Node) else size
    with mode:
        alloc.meta["example_value"] = torch.empty((n,), dtype=old.dtype, device=old.device)
