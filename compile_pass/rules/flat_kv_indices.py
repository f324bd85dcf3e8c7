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

The proof (docs/design.md, "The safety rule"; the flat-buffer family's, rules/flat_buffer.py) follows every use
of `n`:
  1. each use is the size of a 1-D allocation (normalize.as_allocation: torch.empty / zeros / new_empty / new_zeros),
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

from .._compat import example_value
from ..find_sync_points import SyncPoint
from ..fx_util import erase_if_dead, insert_call, node_location
from ..normalize import INT_DTYPES, compared_constant, dtype_of, only_asserted, strip_kept_values
from ..proof import ProofContext, Unsafe, describe_use
from . import register_rule
from .flat_buffer import (IndptrReader, IndptrWriter, BufferWalk, assert_lengths_within,  # noqa: F401 (the facts'
                          register_indptr_reader, register_indptr_writer, registered_flat_kv_facts,  # public home
                          resize_buffers, unregister_flat_kv_facts,  # stays importable from here)
                          walk_the_total)

RULE = "flat_kv_indices"


# -- plans (frozen: the rewrite reads them, never edits them) ------------------------------------------------
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


class _Walk(BufferWalk):
    """One sum's proof: the walk over its uses (the family's, with checks on n kept on the device) and over each
    buffer's uses (the family's)."""

    def __init__(self, point: SyncPoint, ctx: ProofContext, bound: int):
        super().__init__(point, ctx, bound)
        self.checks = []

    def is_check(self, compare: torch.fx.Node, n: torch.fx.Node) -> bool:
        compared = compared_constant(compare, n)
        if compared is None or not only_asserted(compare):
            return False
        self.checks.append(SumCheck(compare, tuple(compare.users), *compared))
        return True

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
        return walk_the_total(_Walk, read, ctx, "the sum").plan()

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
        if options.checked:
            assert_lengths_within(graph, plan, first, "the sum")
        parts += resize_buffers(graph, plan, first, plan.point.value)
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


