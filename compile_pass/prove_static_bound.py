"""The safety proof: may a dynamic max be replaced by the static bound? (DESIGN.md, "The safety rule")

Every use of the max `m` must be one of
  1. the stop of a page-table gather `X[rpi, :m:ps] // ps` (casts allowed) whose result reaches only the
     page-table argument of self-guarding consumers;
  2. an upper-bound argument of a self-guarding consumer (max_seqlen_k, ...);
  3. `m + c` / `m - c` for a constant c, feeding 1 or 2.
and every such consumer's lengths argument must be the very tensor whose max `m` is (through casts, or the
CPU mirror <-> device twin pair), so the bound holds for exactly what the consumer reads. Anything else keeps
the max, with the reason.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from ._compat import example_value
from .consumers import SelfGuardingConsumer, bind_arguments, lookup_consumer
from .find_sync_points import SyncPoint
from .report import user_location

_CASTS = {"to", "int", "long", "type", "contiguous"}
_COMPARES = {operator.ge, operator.le, operator.gt, operator.lt, operator.eq, operator.ne}
_ASSERTS = {torch.ops.aten._assert_scalar.default}
try:
    _ASSERTS.add(torch._check)  # some versions spell runtime asserts as torch._check in Dynamo graphs
except AttributeError:  # pragma: no cover
    pass


@dataclasses.dataclass
class GatherPlan:
    chain: list[torch.fx.Node]  # gather, step slice, floordiv, casts (graph order); the last feeds consumers
    consumers: list[tuple[torch.fx.Node, SelfGuardingConsumer]]
    req_to_token: torch.fx.Node
    req_pool_indices: torch.fx.Node
    page_size: int
    offset: int
    bookkeeping: list[torch.fx.Node]  # sym_size / compare / _assert_scalar nodes about the dynamic width

    @property
    def terminal(self) -> torch.fx.Node:
        return self.chain[-1]


@dataclasses.dataclass
class BoundPlan:
    consumer: torch.fx.Node
    argument: str
    offset: int


@dataclasses.dataclass
class Proof:
    safe: bool
    reason: str
    gathers: list[GatherPlan] = dataclasses.field(default_factory=list)
    bounds: list[BoundPlan] = dataclasses.field(default_factory=list)
    offsets: list[torch.fx.Node] = dataclasses.field(default_factory=list)  # the m + c nodes


class Unsafe(Exception):
    """A use that the safety rule does not allow; its message is the report's reason."""


_ARITHMETIC = {operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow, operator.neg,
               operator.add, operator.sub, torch.sym_max, torch.sym_min}


def why_not(user: torch.fx.Node, what: str) -> str:
    """The reason a use of the max (what="the max") or of its page table is not allowed."""
    where = describe_use(user)
    if user.op == "output":
        return f"{what} reaches {where}"
    if user.op == "call_function" and user.target in _ARITHMETIC:
        return f"{what} is used in arithmetic that is not a bound ({where})"
    if user.op == "call_function" and isinstance(user.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"{what} reaches {where}, which is not a registered self-guarding consumer"
    if what == "the max":
        return f"{what} reaches {where}, neither a page-table bound nor an upper-bound argument"
    return f"{what} reaches {where}, not a self-guarding consumer"


def describe_use(user: torch.fx.Node) -> str:
    if user.op == "output":
        return "the graph output (returned to the caller)"
    what = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", str(user.target))
    return f"`{what}` at {user_location(user.meta.get('stack_trace'))}"


def strip_casts(node):
    while isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in _CASTS:
        if any(isinstance(a, (str, torch.device)) for a in list(node.args[1:]) + list(node.kwargs.values())):
            break  # a device move is not a cast
        node = node.args[0]
    return node


def same_lengths(lengths, source, mirrors) -> bool:
    """Is the consumer's lengths tensor the tensor whose max was taken (casts, mirror/twin aside)?"""
    a = strip_casts(lengths)
    b = strip_casts(source)
    if a is b:
        return True
    # seq_lens_cpu.to(device) reads the mirror through a copy
    for x, y in ((a, b), (b, a)):
        if isinstance(x, torch.fx.Node) and x.op == "call_method" and x.target in ("to", "cuda"):
            x = x.args[0]
        if x is y or mirrors.get(x) is y or mirrors.get(y) is x:
            return True
    return False


def _consumer_of(node: torch.fx.Node):
    if node.op != "call_function":
        return None
    return lookup_consumer(node.target)


def _bookkeeping(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """Nodes that only bound a dynamic width (sym_size -> compare -> _assert_scalar), or None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.sym_size.int:
        return None
    found = [node]
    for cmp in node.users:
        if cmp.op != "call_function" or cmp.target not in _COMPARES:
            return None
        found.append(cmp)
        for check in cmp.users:
            if check.op != "call_function" or check.target not in _ASSERTS:
                return None
            found.append(check)
    return found


def _int_arg(node: torch.fx.Node, index: int):
    value = node.args[index] if len(node.args) > index else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Prover:
    def __init__(self, point: SyncPoint, mirrors, page_size_option: int | None):
        self.point = point
        self.mirrors = mirrors
        self.page_size_option = page_size_option
        self.proof = Proof(True, "")

    def check_lengths(self, consumer_node, entry: SelfGuardingConsumer):
        if entry.lengths is None:
            # Without a lengths argument nothing ties this max to what the consumer reads.
            raise Unsafe(f"{entry.name} is registered without a lengths argument: the bound cannot be tied to it")
        args = bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs)
        lengths = args.get(entry.lengths)
        if not same_lengths(lengths, self.point.source, self.mirrors):
            raise Unsafe(
                f"{entry.name}'s {entry.lengths} is not the tensor whose max was taken "
                f"({getattr(lengths, 'name', lengths)} vs {self.point.source.name}): the bound would not guard it"
            )

    def follow_value(self, node: torch.fx.Node, offset: int):
        for user in list(node.users):
            if user.op == "call_function" and user.target in (operator.add, operator.sub):
                other = user.args[1] if user.args[0] is node else user.args[0]
                if isinstance(other, int) and not isinstance(other, bool) and not (
                    user.target is operator.sub and user.args[1] is node
                ):
                    self.proof.offsets.append(user)
                    self.follow_value(user, offset + (other if user.target is operator.add else -other))
                    continue
                raise Unsafe(why_not(user, "the max"))
            if self.is_gather(user, node):
                self.follow_gather(user, node, offset)
                continue
            entry = _consumer_of(user)
            if entry is not None:
                args = bind_arguments(entry.name, user.args, user.kwargs)
                names = [k for k, v in args.items() if v is node]
                if names and all(k in entry.upper_bounds for k in names):
                    self.check_lengths(user, entry)
                    self.proof.bounds.extend(BoundPlan(user, k, offset) for k in names)
                    continue
                raise Unsafe(f"passed to {entry.name} as {names}, which is not an upper-bound argument")
            raise Unsafe(why_not(user, "the max"))

    @staticmethod
    def is_gather(user: torch.fx.Node, m: torch.fx.Node) -> bool:
        if user.op != "call_function" or user.target is not operator.getitem:
            return False
        index = user.args[1]
        return (
            isinstance(index, tuple) and len(index) == 2 and isinstance(index[0], torch.fx.Node)
            and isinstance(index[1], slice) and index[1].start is None and index[1].stop is m
            and m not in (index[1].step,) and index[0] is not m
        )

    def follow_gather(self, gather: torch.fx.Node, m: torch.fx.Node, offset: int):
        table, (rpi, sl) = gather.args[0], gather.args[1]
        dtype = getattr(example_value(table), "dtype", None)
        if dtype not in (torch.int32, torch.int64):
            raise Unsafe(f"the sliced tensor {table.name} is {dtype}, not an int32/int64 token table")
        step = sl.step if sl.step is not None else None
        if step is not None and (not isinstance(step, int) or step < 1):
            raise Unsafe(f"the page-table slice step {step!r} is not a constant page size")
        chain, bookkeeping, divisor = [gather], [], None
        node = gather
        while True:
            nexts, consumers = [], []
            for user in node.users:
                book = _bookkeeping(user)
                if book is not None:
                    bookkeeping.extend(book)
                    continue
                entry = _consumer_of(user)
                if entry is not None:
                    consumers.append((user, entry))
                else:
                    nexts.append(user)
            if consumers and nexts:
                raise Unsafe(why_not(nexts[0], "the page table also"))
            if consumers:
                break
            if len(nexts) != 1:
                uses = ", ".join(sorted({describe_use(u) for u in nexts})) or "nothing"
                raise Unsafe(f"the page table reaches {uses}: not only self-guarding consumers")
            nxt = nexts[0]
            if (nxt.op == "call_function" and nxt.target is operator.getitem and step is None
                    and isinstance(nxt.args[1], tuple) and len(nxt.args[1]) == 2
                    and nxt.args[1][0] == slice(None) and isinstance(nxt.args[1][1], slice)
                    and nxt.args[1][1].start is None and nxt.args[1][1].stop is None
                    and isinstance(nxt.args[1][1].step, int)):
                step = nxt.args[1][1].step
            elif nxt.op == "call_function" and nxt.target is operator.floordiv and divisor is None \
                    and nxt.args[0] is node and isinstance(nxt.args[1], int):
                divisor = nxt.args[1]
            elif nxt.op == "call_method" and nxt.target in ("__floordiv__", "floor_divide") and divisor is None \
                    and isinstance(_int_arg(nxt, 1), int):
                divisor = _int_arg(nxt, 1)
            elif (nxt.op in ("call_method", "call_function") and nxt.target in ("div", torch.div)
                  and nxt.kwargs.get("rounding_mode") == "floor" and divisor is None
                  and isinstance(_int_arg(nxt, 1), int)):
                divisor = _int_arg(nxt, 1)
            elif strip_casts(nxt) is node:
                pass
            else:
                raise Unsafe(why_not(nxt, "the page table"))
            chain.append(nxt)
            node = nxt
        step = step or 1
        divisor = divisor or 1
        if step != divisor:
            raise Unsafe(
                f"the gather takes every {step}th token but divides by {divisor}: not a page table of one page size"
            )
        if self.page_size_option is not None and step != self.page_size_option:
            raise Unsafe(f"the gather's page size {step} differs from options['page_size']={self.page_size_option}")
        for consumer_node, entry in consumers:
            args = bind_arguments(entry.name, consumer_node.args, consumer_node.kwargs)
            names = [k for k, v in args.items() if v is node]
            if entry.page_table is None or names != [entry.page_table]:
                raise Unsafe(f"the page table is passed to {entry.name} as {names}, not as its page-table argument")
            self.check_lengths(consumer_node, entry)
        self.proof.gathers.append(GatherPlan(chain, consumers, table, rpi, step, offset, bookkeeping))


def prove_static_bound(point: SyncPoint, mirrors, page_size_option: int | None = None) -> Proof:
    """Apply the safety rule to one dynamic max; Proof.safe says whether it may become the static bound."""
    if not point.is_max:
        return Proof(False, "not a max over a lengths tensor: no static bound applies")
    prover = _Prover(point, mirrors, page_size_option)
    try:
        prover.follow_value(point.value, 0)
    except Unsafe as e:
        return Proof(False, str(e))
    if not prover.proof.gathers and not prover.proof.bounds:
        return Proof(False, "the max has no use")
    return prover.proof
