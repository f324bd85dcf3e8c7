"""The vocabulary of allocations: one allocation form of any rank, and the recognisers of the tables a page count
sizes (the shapes the allocated-table rule matches, filed by concept, not by rule). Each takes FX nodes and returns
a shape (or None / False where the node is not of it); none proves anything.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from . import _compat
from .normalize import SYM_SIZE, ceil_div, only_asserted, page_count, plus_constant


# -- allocations (any rank) -------------------------------------------------------------------------------------
_ALLOC_FUNCTIONS = {torch.full: "full", torch.empty: "empty", torch.zeros: "zeros"}
_ALLOC_METHODS = {"new_empty": "empty", "new_zeros": "zeros"}
_ALLOC_KWARGS = {"dtype", "device", "layout", "pin_memory", "requires_grad"}


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A fresh tensor: `kind` "full", "empty" or "zeros", its `sizes` (ints or graph nodes: SymInts), the fill
    (None for empty) and where the sizes are spelled, so that `with_size` can respell them."""

    node: torch.fx.Node
    kind: str
    sizes: tuple
    fill: object
    spelled: str  # "spread" (empty(B, n)), "tuple" (empty((B, n))), "keyword" (size=(B, n)), "keyword one" (size=n)
    first: int  # the position of the first size argument (1 for a method: its receiver is args[0])

    @property
    def rank(self) -> int:
        return len(self.sizes)


def as_allocation(node) -> Allocation | None:
    """`torch.full` / `torch.empty` / `torch.zeros` / `x.new_empty` / `x.new_zeros` of any rank with plain keyword
    arguments (dtype, device, layout, pin_memory) and no gradient, else None (out= or a memory format: None)."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_function" and node.target in _ALLOC_FUNCTIONS:
        kind, first = _ALLOC_FUNCTIONS[node.target], 0
    elif node.op == "call_method" and node.target in _ALLOC_METHODS and node.args:
        kind, first = _ALLOC_METHODS[node.target], 1
    else:
        return None
    allowed = _ALLOC_KWARGS | {"size"} | ({"fill_value"} if kind == "full" else set())
    if any(k not in allowed for k in node.kwargs) or node.kwargs.get("requires_grad", False):
        return None
    args = list(node.args[first:])
    fill = 0 if kind == "zeros" else None
    if kind == "full":  # torch.full(size, fill_value): one size argument, the fill after it or by keyword
        if "fill_value" in node.kwargs:
            fill, rest = node.kwargs["fill_value"], args
        elif len(args) == 2 or (len(args) == 1 and "size" in node.kwargs):
            fill, rest = args[-1], args[:-1]
        else:
            return None
        args = rest
    if "size" in node.kwargs:
        if args:
            return None
        sizes = node.kwargs["size"]
        sizes, spelled = (sizes, "keyword") if isinstance(sizes, (tuple, list)) else ((sizes,), "keyword one")
    elif len(args) == 1 and isinstance(args[0], (tuple, list)):
        sizes, spelled = args[0], "tuple"
    elif kind != "full":
        sizes, spelled = args, "spread"
    else:
        return None
    if not isinstance(sizes, (tuple, list)) or any(isinstance(s, (tuple, list)) for s in sizes):
        return None
    return Allocation(node, kind, tuple(sizes), fill, spelled, first)


def with_size(alloc: Allocation, dim: int, value) -> tuple[tuple, dict]:
    """The allocation's (args, kwargs) with size `dim` replaced by `value`, spelled as it was."""
    node = alloc.node
    sizes = list(alloc.sizes)
    sizes[dim] = value
    args, kwargs = list(node.args), dict(node.kwargs)
    if alloc.spelled == "keyword":
        kwargs["size"] = type(node.kwargs["size"])(sizes)
    elif alloc.spelled == "keyword one":
        kwargs["size"] = value
    elif alloc.spelled == "tuple":
        args[alloc.first] = type(args[alloc.first])(sizes)
    else:
        args[alloc.first:alloc.first + len(sizes)] = sizes
    return tuple(args), kwargs


def in_grid(writer: torch.fx.Node, node: torch.fx.Node) -> bool:
    found = []
    torch.fx.node.map_arg(writer.kwargs.get("grid"), lambda n: found.append(n is node))
    return any(found)


# -- tables sized by a page count ---------------------------------------------------------------------------
def rounded_width(m, extra: int, page_size: int, add: int, multiple: int):
    """Eager's rounded-up width at max m (an int, or a tensor of values): `(cdiv(m + extra, ps) + a) // L * L`."""
    return (ceil_div(m + extra, page_size) + add) // multiple * multiple


def is_table_of(alloc, count: torch.fx.Node) -> bool:
    """A 2-D allocation `(B, n)` whose width is the page count and whose rows are not."""
    return alloc.rank == 2 and alloc.sizes[1] is count and alloc.sizes[0] is not count


def slice_of(node: torch.fx.Node, count: torch.fx.Node):
    """`buf[:B, :n]` (starts 0 or None, steps 1 or None) of a 2-D tensor with the page count as its column stop:
    the column slice, else None."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return None
    base, index = node.args
    if not (isinstance(base, torch.fx.Node) and isinstance(index, tuple) and len(index) == 2
            and all(isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) for i in index)):
        return None
    rows, cols = index
    if cols.stop is not count or rows.stop is count or rows.stop is None:
        return None
    return cols


def size_checks(user: torch.fx.Node, table: torch.fx.Node):
    """`sym_size(table, 1)` used only by comparisons that feed only asserts: those nodes (comparisons, then their
    asserts), else None."""
    if not (user.op == "call_function" and user.target is SYM_SIZE and user.args[0] is table
            and user.args[1:] in ((1,), (-1,)) and user.users):
        return None
    found = []
    for compare in user.users:
        if not (compare.op == "call_function" and compare.target in (operator.ge, operator.gt, operator.le,
                                                                      operator.lt) and only_asserted(compare)):
            return None
        found += [compare, *compare.users]
    return found


def constant_chain(node: torch.fx.Node):
    """(last, total, chain): `node + c1 + c2 ...` through single uses."""
    total, chain = 0, []
    while len(node.users) == 1:
        (user,) = node.users
        add = plus_constant(user, node)
        if add is None:
            break
        total, node = total + add, user
        chain.append(user)
    return node, total, chain


def times(user: torch.fx.Node, node: torch.fx.Node):
    """k for `node * k` / `k * node` with an int k; None otherwise."""
    if user.op != "call_function" or user.target is not operator.mul or len(user.args) != 2:
        return None
    a, b = user.args
    other = b if a is node else a if b is node else None
    return other if other is not None and other is not node and isinstance(other, int) \
        and not isinstance(other, bool) else None


def round_up(count: torch.fx.Node):
    """`(n + a) // L * K` with n's one use starting it (TRTLLM-MLA's `cdiv(blocks, lcm) * lcm`, and Dynamo's
    `torch.sym_sum([a, n])` spelling): (result, nodes, a, L, K); None when n's use is not that shape."""
    if len(count.users) != 1:
        return None
    last, add, chain = constant_chain(count)
    users = list(last.users)
    if len(users) != 1:
        return None
    divisor = page_count(users[0], last)
    if divisor is None or divisor < 1:
        return None
    checks = [u for u in users[0].users if u.op == "call_function" and u.target in (
        operator.ge, operator.gt, operator.le, operator.lt) and only_asserted(u)]
    rest = [u for u in users[0].users if u not in checks]
    if len(rest) != 1:
        return None
    (mul,) = rest
    factor = times(mul, users[0])
    if factor is None:
        return None
    return mul, (*chain, users[0], mul), add, divisor, factor, tuple(checks)


def block_count(user: torch.fx.Node, count: torch.fx.Node):
    """`(n + p - 1) // p` used only in launch grids (SGLang's get_num_kv_index_blocks_flashmla): (nodes, p, the
    block count), else None."""
    add = plus_constant(user, count)
    if add is not None:
        last, more, chain = constant_chain(user)
        add, chain = add + more, [user, *chain]
        users = list(last.users)
    else:
        last, add, chain, users = count, 0, [], [user]
    if len(users) != 1:
        return None
    divisor = page_count(users[0], last)
    if divisor is None or divisor < 1 or add != divisor - 1 or not users[0].users:
        return None
    if not all(_compat.user_triton_kernel(u) is not None and in_grid(u, users[0]) for u in users[0].users):
        return None
    return (*chain, users[0]), divisor, users[0]


def reads_of(users, table: torch.fx.Node):
    """(user, the table or its row view) for each later user; a view `t[:k]` / `t[:k, :]` (rows from 0, every
    column) stands for the table it views, for each of its own users."""
    for user in users:
        if user.op == "call_function" and user.target is operator.getitem and len(user.args) == 2 \
                and user.args[0] is table and is_row_view(user.args[1]):
            for inner in sorted(user.users, key=lambda n: list(table.graph.nodes).index(n)):
                yield inner, user
            continue
        yield user, table


def is_row_view(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    if not parts or len(parts) > 2 or not all(isinstance(i, slice) for i in parts):
        return False
    rows = parts[0]
    cols_full = len(parts) == 1 or parts[1] == slice(None)
    return rows.start in (None, 0) and rows.step in (None, 1) and cols_full


def table_users(table: torch.fx.Node):
    """A table node's users, a row view's users in its place."""
    return [u for u, _ in reads_of(list(table.users), table)]


def width_of(count: torch.fx.Node) -> torch.fx.Node:
    rounded = round_up(count)
    return rounded[0] if rounded is not None else count
