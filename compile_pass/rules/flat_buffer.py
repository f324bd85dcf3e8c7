"""The flat-buffer family's home: what every rule that replaces a total sizing a flat buffer shares.

Two rules replace a total `n = sum(L)` that sizes a 1-D buffer (SGLang's and FlashInfer's flat kv_indices) by the
static B x max_context_len: the flat kv_indices rule (`rules/flat_kv_indices.py`: the sum read on the host with
`.item()`) and the host-sum rule (`rules/host_sums.py`: a host int the user declares equal to the sum). They
differ in how `n` reaches the graph; the buffer's proof is the same, here, once:

    facts       IndptrWriter (writes only out[indptr[b] : indptr[b] + lengths[b]]) and IndptrReader (reads only
                indices[indptr[b] : indptr[b] + lengths[b]]), per overload; register_indptr_writer / _reader
    BufferWalk  follow_buffer(buf): one registered writer (as its out), after it only registered readers (as
                their indices) through an indptr of the same lengths; nothing writes the lengths, the indptr or
                the buffer in between; outputs keep their shapes with the static buffer (fake tensors)
    rewrite     resize_buffers: each buffer gets B x bound (a SymInt product under dynamic B);
                assert_lengths_within: 0 <= every length <= bound on the device (checked)

Then the writer fills [indptr[b], indptr[b] + len_b) of a buffer of any size >= indptr[B] = n with the values eager
gives, and the readers read only those positions: the buffer's contents past indptr[B] are unspecified and never
read. B x max_context_len covers n when every length is within [0, max_context_len], which `checked` asserts.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from .. import kernels
from ..bounds import require_bound
from .._compat import example_value, fake_mode_of
from ..consumers import (TENSOR, FactKind, argument, bind_arguments, facts_of, load_facts, lookup_facts, register_facts,
                         unregister_facts)
from ..find_sync_points import SyncPoint
from ..fx_util import insert_device_assert, node_location
from ..mutations import written_by
from ..allocations import as_allocation
from ..normalize import ARITHMETIC, COMPARES, SYM_SIZE, constant_add, indptr_of, strip_kept_values
from ..proof import LengthsRelation, ProofContext, Unsafe, check_outputs_keep, declare_reasons, describe_use

FACTS = "flat_kv_indices"  # the facts' namespace (the rule that first read them); both rules read them

REASONS = declare_reasons("flat_buffer", {
    "not_lengths": "the sum is over a tensor that is not a lengths input (a 1-D int32/int64 graph input)",
    "sum_use": "the sum is used as something other than the size of an allocation",
    "buffer_use": "the buffer sized by the sum reaches something other than one bounded writer (as its out) and "
                  "readers through an indptr of the same lengths",
})


# -- facts (per overload; the kernels' own are in kernels/kv_indices.py) ---------------------------------------
@dataclasses.dataclass(frozen=True)
class IndptrWriter:
    """An overload that writes only out[indptr[b] : indptr[b] + lengths[b]] (and nothing outside `out`)."""

    name: str
    out: str = argument(TENSOR, written=True)
    indptr: str = argument(TENSOR)
    lengths: str = argument(TENSOR)


@dataclasses.dataclass(frozen=True)
class IndptrReader:
    """An overload that reads only indices[indptr[b] : indptr[b] + lengths[b]] and writes none of them."""

    name: str
    indices: str = argument(TENSOR, written=False)
    indptr: str = argument(TENSOR, written=False)
    lengths: str = argument(TENSOR, written=False)


INDPTR_WRITER = FactKind(FACTS, IndptrWriter, "an indptr writer")
INDPTR_READER = FactKind(FACTS, IndptrReader, "a reader through an indptr")


def register_indptr_writer(op, *, out: str, indptr: str, lengths: str) -> IndptrWriter:
    """Declare that `op` (one overload) writes only out[indptr[b] : indptr[b] + lengths[b]] of its `out` argument,
    which its schema must mark written (`Tensor(a!)`)."""
    return register_facts(INDPTR_WRITER, op, dict(out=out, indptr=indptr, lengths=lengths))


def register_indptr_reader(op, *, indices: str, indptr: str, lengths: str) -> IndptrReader:
    """Declare that `op` (one overload) reads only indices[indptr[b] : indptr[b] + lengths[b]] (an attention op
    over a flat kv_indices buffer, FlashInfer's layout); its schema must write none of the three."""
    return register_facts(INDPTR_READER, op, dict(indices=indices, indptr=indptr, lengths=lengths))


def unregister_flat_kv_facts(op) -> None:
    unregister_facts(FACTS, op)


def registered_flat_kv_facts() -> dict:
    return facts_of(FACTS)


load_facts(kernels.FLAT_KV_INDICES["writers"], register_indptr_writer)
load_facts(kernels.FLAT_KV_INDICES["readers"], register_indptr_reader)


# -- the buffer's proof ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BufferPlan:
    alloc: torch.fx.Node  # torch.empty(n, ..) and its spellings: its size becomes the static total
    writer: torch.fx.Node | None
    readers: tuple
    writer_lengths: torch.fx.Node | None  # the writer's lengths, before any narrowing cast (the device check)


def _is_op(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (
        isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        or getattr(node.target, "_opoverload", None) is not None)


def walk_the_total(walk_type, read: SyncPoint, ctx: ProofContext, what: str):
    """The start of every proof in the family: a static bound exists, the walk over the total's uses, and at
    least one buffer it sizes (`what` names the total in the reason)."""
    walk = walk_type(read, ctx, require_bound(ctx.options))
    walk.follow_total(read.value)
    if not walk.buffers:
        raise Unsafe("nothing_to_rewrite", f"{what} sizes no allocation: nothing to rewrite")
    return walk


class BufferWalk:
    """A total's proof, from the buffers it sizes: `point.source` holds the summed lengths (a 1-D input)."""

    def __init__(self, point: SyncPoint, ctx: ProofContext, bound: int):
        self.point, self.ctx, self.bound = point, ctx, bound
        self.root, self.chain = strip_kept_values(point.source, allow_moves=True, allow_narrowing=True)
        self.first = ctx.first(point.nodes)
        self.buffers = []
        self.disjoint: set = set()

    # -- uses of n ----------------------------------------------------------------------------------------
    def is_check(self, compare: torch.fx.Node, n: torch.fx.Node) -> bool:
        """A rule's hook: a check on n that it keeps (True), or not one (False)."""
        return False

    def follow_total(self, n: torch.fx.Node) -> None:
        """Every use of the total is the size of a 1-D allocation (a buffer), or a check the rule keeps."""
        for user in list(n.users):
            alloc = as_allocation(user)
            if alloc is not None and alloc.kind in ("empty", "zeros") and len(alloc.sizes) == 1 \
                    and alloc.sizes[0] is n:
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

    # -- the buffer -----------------------------------------------------------------------------------------
    def follow_buffer(self, buf: torch.fx.Node) -> BufferPlan:
        writers, readers = [], []
        for user in buf.users:
            facts = lookup_facts(FACTS, user) if user.op == "call_function" else None
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
                                               "bounded writer or a reader through an indptr (register it: "
                                               f"compile_pass.register_indptr_reader({user.target}, indices=..., "
                                               "indptr=..., lengths=...) for a reader of indices[indptr[b] : "
                                               "indptr[b] + lengths[b]], or compile_pass.register_indptr_writer("
                                               f"{user.target}, out=..., indptr=..., lengths=...) for a writer)")
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
        if rel.offset != 0 or rel.clamped:
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
        wide, _ = strip_kept_values(rel.exact if rel.clamped else rel.lengths, allow_moves=False,
                                    allow_narrowing=True)
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



# -- the rewrite's shared parts ----------------------------------------------------------------------------------
def assert_lengths_within(graph, plan, first: torch.fx.Node, what: str) -> None:
    """checked: every length within [0, bound] on the device, where the first writer reads its lengths (before a
    narrowing cast); else before the first allocation. Then n <= B * bound, the static size."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    written = sorted((b for b in plan.buffers if b.writer is not None), key=lambda b: order[b.writer])
    wide, before = (written[0].writer_lengths, written[0].writer) if written else (plan.lengths, first)
    insert_device_assert(graph, before, wide, plan.bound,
                         f"syncfree: a sequence length is outside [0, max_context_len={plan.bound}], so {what} at "
                         f"{plan.point.location} may exceed the static kv_indices size", low=0)


def resize_buffers(graph, plan, first: torch.fx.Node, old) -> list[str]:
    """Each buffer's size `old` becomes B x bound; returns the report's parts."""
    size = _static_size(graph, first, plan.lengths, plan.bound)
    parts = []
    for buffer in plan.buffers:
        alloc = buffer.alloc
        alloc.replace_input_with(old, size)
        _refresh_example_value(alloc, size)
        rows = "B" if isinstance(size, torch.fx.Node) else str(size // plan.bound)
        readers = f", {len(buffer.readers)} reader(s)" if buffer.readers else ""
        parts.append(f"{alloc.name} -> size {rows} x {plan.bound} (B x max_context_len{readers})")
    return parts


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
