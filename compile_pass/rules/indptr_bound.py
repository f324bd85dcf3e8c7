"""The max over lengths a consumer reads through an indptr: `m = int(extend_seq_lens.max())` passed as an upper
bound to a kernel that reads row b's entries at [indptr[b], indptr[b + 1]) becomes a static bound (issue 20,
recipe 1: SGLang's Triton draft extend, where `max_extend_len` sizes the extend kernel's grid of query blocks).

Before (Dynamo, capture_scalar_outputs on; B = 3 requests; qo_indptr a persistent [max_bs + 1] buffer):

    cumsum = torch.cumsum(l_fb_extend_seq_lens, dim=0)                      # [B]
    setitem = operator.setitem(l_self_qo_indptr, slice(1, 4, None), cumsum) # qo_indptr[1:B+1] = cumsum
    qo_indptr = operator.getitem(l_self_qo_indptr, slice(None, 4, None))   # [B + 1]
    max_1 = l_fb_extend_seq_lens.max()
    item = max_1.item()                                                     # Sym(u0): device-to-host sync
    torch.ops.sgl::extend_attention(q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, ..., item)

After (length_bounds={'extend_seq_lens': 8}; without it the bound is max_context_len):

    cumsum = torch.cumsum(l_fb_extend_seq_lens, dim=0)
    setitem = operator.setitem(l_self_qo_indptr, slice(1, 4, None), cumsum)
    qo_indptr = operator.getitem(l_self_qo_indptr, slice(None, 4, None))
    select = torch.ops.aten.select.int(qo_indptr, 0, 0)                    # the premise of a buffer indptr:
    _assert_async = torch.ops.aten._assert_async.msg(eq(select, 0), ...)   #   qo_indptr[0] == 0, on the device
    _assert_async_1 = ...(all(0 <= l_fb_extend_seq_lens <= 8), ...)        # checked: every length within the bound
    torch.ops.sgl::extend_attention(q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, ..., 8)

The proof (docs/design.md, "The safety rule") follows every use of `m`:
  1. an argument of a registered consumer (IndptrBoundConsumer: `indptr`, `upper_bounds`) named in its
     upper_bounds, which accepts any value >= max_b (indptr[b + 1] - indptr[b]); `m + c` (c >= 0) likewise;
  2. the graph output under options['static_escapes'] (SGLang stores max_extend_len on forward_metadata);
  3. a compare that only feeds asserts (`torch._check(m <= T)`, Dynamo's `m >= 0`): kept, on the device.
Each consumer's indptr must be the cumulative sum with a leading 0 of the values the max was taken over (+ c no
larger than the use's offset): `F.pad(cumsum(L), (1, 0))`, `cat([zeros(1), cumsum(L)])` (normalize.indptr_of), or a
buffer written `buf[1:B + 1] = cumsum(L)` and read `buf[:B + 1]` (also where B + 1 is the buffer's whole size, a
full batch: the slice is still the read, `_whole_buffer_read`; the buffer read without a slice is not recognised),
whose entry 0 the graph does not show: the rewrite asserts `buf[0] == 0` on the device (always: it is the proof's
premise, as the narrowing check is).
Nothing may write the lengths or the indptr (the buffer) between their first read and the consumer. Then every
row's entry count is L_b + c <= bound + c, the static value. The bound is per site (page_table.site_bound):
max_context_len, or options['length_bounds'][name] for a declared lengths input.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from .. import kernels
from .._compat import example_value, known_equal
from ..consumers import (INT, TENSOR, FactKind, argument, arguments, bind_arguments, facts_of, load_facts,
                         lookup_facts, register_facts, unregister_facts)
from ..find_sync_points import SyncPoint
from ..fx_util import insert_call, node_location, set_argument
from ..normalize import INT_DTYPES, cumsum_source, dtype_of, indptr_of, is_identity_slice, plus_constant, \
    strip_kept_values
from ..proof import ProofContext, Unsafe, check_outputs_keep
from . import register_rule
from .host_max import HostMaxRule, HostMaxWalk, assert_lengths, erase_read, rewrite_escapes, rewrite_host_checks

RULE = "indptr_bound"


# -- facts (per overload, scoped by this rule) ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class IndptrBoundConsumer:
    """An overload that reads, for each row b, only entries [indptr[b], indptr[b + 1]) of its ragged inputs, and
    whose `upper_bounds` arguments accept any int >= max_b (indptr[b + 1] - indptr[b])."""

    name: str
    indptr: str = argument(TENSOR)
    upper_bounds: tuple = arguments(INT)


def _check(entry: IndptrBoundConsumer, signature) -> None:
    if not entry.upper_bounds:
        raise ValueError("upper_bounds must name at least one argument of " + entry.name)
    if entry.indptr in entry.upper_bounds:
        raise ValueError(f"{entry.indptr!r} cannot be both the indptr and an upper bound")


INDPTR_BOUND_CONSUMER = FactKind(RULE, IndptrBoundConsumer, "an indptr-bound consumer", check=_check)


def register_indptr_bound_consumer(op, *, indptr: str, upper_bounds) -> IndptrBoundConsumer:
    """Declare that the overload `op` reads row b's entries [indptr[b], indptr[b + 1]) and nothing else of its
    ragged inputs, and that each argument named in `upper_bounds` (e.g. SGLang's max_len_extend) accepts any int
    at or above the longest row. `op` is one overload; a packet, a custom_op or 'ns::name' means `.default`."""
    return register_facts(INDPTR_BOUND_CONSUMER, op, dict(indptr=indptr, upper_bounds=upper_bounds))


def unregister_indptr_bound_consumer(op) -> None:
    unregister_facts(INDPTR_BOUND_CONSUMER, op)


def registered_indptr_bound_consumers() -> dict:
    return facts_of(INDPTR_BOUND_CONSUMER)


load_facts(kernels.INDPTR_BOUND, register_indptr_bound_consumer)


# -- plans ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class UpperBound:
    consumer: torch.fx.Node
    argument: str
    value: int  # the static bound + the use's offset


@dataclasses.dataclass(frozen=True)
class IndptrBoundPlan:
    point: SyncPoint
    bound: int
    bound_source: str
    bounds: tuple
    offsets: tuple  # `m + c` nodes
    escapes: tuple  # (node, offset) leaving through the graph output
    checks: tuple  # host_max.HostCheck
    lengths_uses: tuple  # host_max.LengthsUse
    zero_heads: tuple  # (indptr node, first consumer): buffer indptrs whose entry 0 is asserted 0
    touches: frozenset
    disjoint: frozenset


def _is_setitem_slice(node, buf) -> bool:
    return node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3 \
        and node.args[0] is buf and isinstance(node.args[1], slice)


def _slice_bounds(node):
    """(start, stop) of `x[start:stop]` (step None or 1) as getitem on a node, else None."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2 \
            or not isinstance(node.args[1], slice):
        return None
    s = node.args[1]
    if s.step not in (None, 1):
        return None
    return s.start, s.stop


def _whole_buffer_read(stripped, passed: list):
    """(the read, the nodes above it): `buf[:B + 1]` where B + 1 is the buffer's whole first size (a full batch,
    issue 45: SGLang's `qo_indptr[:bs + 1]` at bs == max_bs) is an identity slice, which strip_kept_values passes
    (normalize.is_identity_slice), reaching the buffer itself: the read is that slice, a node of the graph, and
    the proof runs on it as on a slice of part of the buffer (the same stop checked against the rows written).
    Only where the stripped node is not a slice already (no read recognised before); else unchanged."""
    if isinstance(stripped, torch.fx.Node) and _slice_bounds(stripped) is None and passed \
            and is_identity_slice(passed[-1]) and passed[-1].args[0] is stripped:
        return passed[-1], passed[:-1]
    return stripped, passed


def _value(x):
    return example_value(x) if isinstance(x, torch.fx.Node) else x


class _Walk(HostMaxWalk):
    """One max's proof: the family's walk, with the upper bounds of readers through an indptr as its uses."""

    def __init__(self, point: SyncPoint, ctx: ProofContext, bound: int):
        super().__init__(point, ctx, bound)
        self.bounds, self.zero_heads = [], []

    def on_use(self, user: torch.fx.Node, node: torch.fx.Node, offset: int) -> bool:
        facts = lookup_facts(INDPTR_BOUND_CONSUMER, user) if user.op == "call_function" else None
        if not isinstance(facts, IndptrBoundConsumer):
            return False
        names = self.upper_bound_names(user, facts, node)
        self.prove_consumer(user, facts, bind_arguments(facts.name, user.args, user.kwargs), offset)
        self.bounds.extend(UpperBound(user, k, self.bound + offset) for k in names)
        return True

    def prove_consumer(self, node, facts: IndptrBoundConsumer, args, offset: int) -> None:
        indptr = args.get(facts.indptr)
        if not isinstance(indptr, torch.fx.Node):
            raise Unsafe("indptr_differs", f"{facts.name}'s {facts.indptr} is not a tensor of the graph")
        spelled = indptr_of(indptr)
        write = buf = None
        if spelled is not None:
            lengths, nodes = spelled
            protected = [indptr, *nodes]
        else:  # the buffer and its view are checked from their write on, below; the cumsum from the start
            lengths, nodes, write, buf = self.buffer_indptr(node, facts, indptr)
            protected = [nodes[-1]]
        try:
            rel = self.ctx.relate_lengths(self.point.source, lengths, f"the cumsum of {facts.name}'s {facts.indptr}")
        except Unsafe as e:
            raise Unsafe("indptr_differs", e.message) from None
        self.require_covered(rel, offset, f"{facts.name}'s {facts.indptr} counts the max's values + {rel.offset} "
                                          "per row,")
        # The lengths and the indptr as they were read: nothing writes them before the consumer reads.
        self.guard_lengths(node, rel, extra=protected, what="the lengths or the indptr", start_from=nodes)
        if buf is not None:  # the buffer: its cumsum write fills it, nothing may write it after
            self.ctx.check_no_writes(node, [buf, *nodes[:-2]], "the indptr buffer", write, self.disjoint)
            self.zero_heads.append((indptr, node))
        check_outputs_keep(node, {}, facts.name, "the static bound",
                           overrides={k: self.bound + offset for k in facts.upper_bounds},
                           may_return_nothing=True)

    def buffer_indptr(self, consumer, facts, indptr):
        """`buf[1:B + 1] = cumsum(L)` then `buf[:B + 1]` (SGLang's qo_indptr): (L, nodes, the write, buf)."""
        stripped, passed = strip_kept_values(indptr, allow_moves=False, allow_narrowing=False)
        stripped, passed = _whole_buffer_read(stripped, passed)
        span = _slice_bounds(stripped) if isinstance(stripped, torch.fx.Node) else None
        buf = stripped.args[0] if span is not None else None
        if span is None or span[0] not in (None, 0) or not isinstance(buf, torch.fx.Node) \
                or dtype_of(buf) not in INT_DTYPES or getattr(example_value(buf), "ndim", 0) != 1:
            raise Unsafe("indptr_differs", f"{facts.name}'s {facts.indptr} ({indptr.name}) is not recognised as an "
                                           "indptr (F.pad(torch.cumsum(L, 0), (1, 0)), torch.cat([zeros(1), "
                                           "cumsum(L)]) or buf[1:B + 1] = cumsum(L) read as buf[:B + 1])")
        writes = [n for n in buf.users if _is_setitem_slice(n, buf) and self.ctx.index(n) < self.ctx.index(stripped)]
        if not writes:
            raise Unsafe("indptr_differs", f"{facts.name}'s {facts.indptr} is a slice of {buf.name}, which the graph "
                                           "does not fill with a cumulative sum")
        write = max(writes, key=self.ctx.index)
        target, value = write.args[1], write.args[2]
        lengths = cumsum_source(strip_kept_values(value)[0]) if isinstance(value, torch.fx.Node) else None
        if lengths is None or target.start != 1 or target.step not in (None, 1):
            raise Unsafe("indptr_differs", f"{buf.name} is last written at {node_location(write)} by something other "
                                           "than buf[1:B + 1] = cumsum(lengths)")
        rows = example_value(lengths).shape[0]
        if not (known_equal(_value(target.stop), rows + 1) and known_equal(_value(span[1]), rows + 1)):
            raise Unsafe("indptr_differs", f"{facts.name}'s {facts.indptr} spans other rows than the {rows} lengths "
                                           f"written into {buf.name} at {node_location(write)}: rows past them hold "
                                           "whatever the buffer held")
        return lengths, [*passed, stripped, write, value], write, buf  # nodes: the view chain, the write, the cumsum

    def plan(self, bound_source: str) -> IndptrBoundPlan:
        touches = self.shared_touches() | {b.consumer for b in self.bounds}
        return IndptrBoundPlan(self.point, self.bound, bound_source, tuple(self.bounds), tuple(self.offsets),
                               tuple(self.escapes), tuple(self.checks), tuple(self.lengths_uses),
                               tuple(self.zero_heads), frozenset(touches), frozenset(self.disjoint))


def _reaches_consumer(value: torch.fx.Node, depth: int = 3) -> bool:
    for user in value.users:
        if user.op == "call_function" and isinstance(lookup_facts(INDPTR_BOUND_CONSUMER, user), IndptrBoundConsumer):
            return True
        if depth and plus_constant(user, value) is not None and _reaches_consumer(user, depth - 1):
            return True
    return False


@register_rule
class IndptrBoundMax(HostMaxRule):
    """A max over lengths that a consumer reads through an indptr of them, passed as its upper bound: the static
    bound (max_context_len, or the declared per-site bound)."""

    name = RULE
    walk = _Walk

    def takes(self, value: torch.fx.Node) -> bool:
        return _reaches_consumer(value)

    def rewrite(self, plan: IndptrBoundPlan, graph: torch.fx.Graph, options) -> str:
        parts = []
        for indptr, consumer in dict.fromkeys(plan.zero_heads):
            head = insert_call(graph, consumer, torch.ops.aten.select.int, (indptr, 0, 0), consumer)
            zero = insert_call(graph, consumer, torch.ops.aten.eq.Scalar, (head, 0), consumer)
            insert_call(graph, consumer, torch.ops.aten._assert_async.msg,
                        (zero, f"syncfree: {indptr.name}[0] is not 0 at {node_location(consumer)}: the indptr "
                               "buffer's first entry is the premise of the static bound"), consumer)
            parts.append(f"{indptr.name}[0] == 0 asserted on the device")
        dead = rewrite_host_checks(graph, plan.checks)
        checked = assert_lengths(graph, plan.lengths_uses, options.checked, plan.bound_source)
        for b in plan.bounds:
            set_argument(b.consumer, b.argument, b.value)
            parts.append(f"{b.argument} -> {b.value}")
        if plan.escapes:
            rewrite_escapes(graph, plan.escapes, plan.bound)
            parts.append("escaping values leave at the static bound (options['static_escapes'])")
        parts.append(f"bound {plan.bound} ({plan.bound_source})")
        if checked:
            parts.append("lengths asserted on the device")
        erase_read(graph, plan, dead)
        return "rewritten: " + "; ".join(parts)
