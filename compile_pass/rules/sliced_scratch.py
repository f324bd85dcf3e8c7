"""The scratch a page table slices, `buf[:B, :n]` (SGLang's FlashMLA `_eager_block_kv_indices`): a persistent buffer
(check_buffer, base_width), or one regrown for later steps, `torch.full((rows, max(n, C)), -1)[:B, :n]` with n the
page count and C the width the scratch had (covering_constant, covering_size, check_regrown); where its writer's
row stride is (stride_at: trace_signature.ScratchTable). Used by the allocated-table rule only
(rules/allocated_table.py); a module of its own to keep that rule's file readable.

Three forms of C, and what the rule rewrites `max(n, C)` to (W: the static width, the page count at the bound):
  * an int C >= W (the scratch already as wide as the bound's pages): C, the value it has for every n in [0, W];
  * an int C < W (a scratch an earlier step left narrower): W, at least `max(n, C)` for every n in [0, W];
  * a size s of the graph's inputs (the scratch's width, dynamic once it changed): `max(W, s)`, likewise.
In the last two the value changes (eager's scratch would be `max(n, C)` wide, the step's is wider), so the node
may only be the allocation's width, the writer's row stride and Dynamo's checks that hold for every width, and the
allocation may only be sliced as the table and leave the step (stored for later steps; at the new width only under
static_escapes): check_regrown.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import _compat, traced_ranges
from .._compat import example_value
from ..allocations import as_allocation
from ..consumers import schema_of
from ..fx_util import node_location
from ..normalize import INT_DTYPES, ceil_div, is_int_constant
from ..proof import Unsafe, describe_use
from .bounded_writers import launch_of


def covering_constant(node, count: torch.fx.Node):
    """C for `torch.sym_max(n, C)` / `max(C, n)` of the page count n and an int C, else None: the width of a
    scratch regrown for more rows (`max(n, buf.shape[1])`), C wherever n <= C."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" \
            or node.target not in (torch.sym_max, max) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    other = b if a is count else a if b is count else None
    return other if other is not None and is_int_constant(other) else None


def covering_size(node, count: torch.fx.Node):
    """s for `torch.sym_max(n, s)` / `max(s, n)` of the page count n and a size s computed from the graph's input
    sizes only (backed symbols: the scratch's own width once Dynamo made it dynamic, `max(1, s)` in its row
    stride), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" \
            or node.target not in (torch.sym_max, max) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    other = b if a is count else a if b is count else None
    value = example_value(other) if isinstance(other, torch.fx.Node) else None
    if not isinstance(value, torch.SymInt) or _compat.free_unbacked_symbols(value):
        return None
    return other


def sized_equal(a: torch.fx.Node, b: torch.fx.Node, count: torch.fx.Node, pages: int) -> bool:
    """Do two `max(n, s)` nodes give one value once n is the static width W (`max(W, max(1, s))`, Dynamo's row
    stride, is `max(W, s)`, the width, for W >= 1)? Decided on their sizes' expressions (sympy folds the
    constants of a Max)."""
    import sympy

    try:
        ea, eb = (example_value(covering_size(x, count)).node.expr for x in (a, b))
        return bool(sympy.Max(pages, ea) == sympy.Max(pages, eb))
    except Exception:  # noqa: BLE001 -- not decided: not equal
        return False


def within_sized(compare: torch.fx.Node, width: torch.fx.Node, sized) -> bool:
    """Dynamo's `width <= max(n, s)` on a slice of the regrown scratch: once rewritten, `W <= max(W, s)` for
    every s (only this direction: nothing else is known of s)."""
    if not (compare.op == "call_function" and len(compare.args) == 2 and not compare.kwargs):
        return False
    a, b = compare.args
    return (compare.target is operator.le and a is width and b in sized) or \
        (compare.target is operator.ge and b is width and a in sized)


def holds(node: torch.fx.Node, value: torch.fx.Node) -> int:
    """How many times `node`'s arguments hold `value`."""
    held = []
    torch.fx.node.map_arg((node.args, node.kwargs), held.append)
    return held.count(value)


def check_regrown(widened, table: torch.fx.Node, writer: torch.fx.Node, table_stride: str, bookkeeping,
                  static_escapes: bool) -> None:
    """The `max(n, C)` nodes whose value the rewrite changes (`widened`: C below W, or a size) and the scratch
    allocation they size: see the module docstring. Raises Unsafe where anything else uses them."""
    if not widened:
        return
    base = table.args[0] if table.op == "call_function" and table.target is operator.getitem else None
    spelled = as_allocation(base)
    if spelled is None or spelled.rank != 2:
        raise Unsafe("width_use", "the regrown width `max(n, C)` does not size the allocation the table slices")
    for cover in widened:
        for user in cover.users:
            if user is base and spelled.sizes[1] is cover and holds(base, cover) == 1:
                continue
            launch = launch_of(user) if user is writer else None
            if launch is not None and launch.args.get(table_stride) is cover and holds(user, cover) == 1:
                continue
            if user in bookkeeping:
                continue
            raise Unsafe("width_use", f"the regrown width `max(n, C)` at {node_location(cover)} is used by "
                                      f"{describe_use(user)}, not only as the width of the scratch allocation and "
                                      "its writer's row stride: below the bound's pages it changes value when "
                                      "widened")
    for user in base.users:
        if user is table or (user.op == "output" and static_escapes):
            continue
        if user.op == "output":
            raise Unsafe("escapes", "the regrown scratch leaves the step (stored for later steps) and would leave "
                                    "at the static width; options['static_escapes'] allows that")
        raise Unsafe("table_use", f"the regrown scratch at {node_location(base)} is also used by "
                                  f"{describe_use(user)}, not only sliced as the table")


def check_buffer(table: torch.fx.Node, pages: int, covers: dict, sized: set, item: torch.fx.Node, bound: int,
             extra: int = 0, page_size: int = 1, rounded: bool = False) -> int:
    """`buf[:B, :n]`: a persistent int buffer (a graph input or attribute) already as wide as the bound's
    pages, statically, so that `buf[:B, :pages]` holds the same cells eager's slice holds, and more. Returns
    the static width: the bound's pages; or, for a buffer narrower than them in a trace of a branch's other
    outcome (a scratch an earlier step left narrower, not regrown in this outcome: `buf.shape[1] < n` False),
    the pages of the largest max that outcome admits (traced_ranges.admitted_values), where they fit. That
    trace's graph never runs for a larger max: it is kept only where it is the bound's outcome's graph
    (settle_at_bound), whose width is the bound's pages, or compared as the scratch the bound's outcome
    regrows (trace_signature.regrown_scratch), where the bound's outcome's graph is the one that runs."""
    base = table.args[0]
    bv = example_value(base)
    spelled = as_allocation(base)
    if (base.op not in ("placeholder", "get_attr") and (spelled is None or spelled.rank != 2)) \
            or getattr(bv, "ndim", 0) != 2 or bv.dtype not in INT_DTYPES:
        raise Unsafe("not_a_table", f"the page count slices {describe_use(base)}, not a persistent 2-D int "
                                    "buffer (a graph input or attribute) nor a 2-D int allocation")
    width = base_width(base, covers, sized)
    if isinstance(width, torch.fx.Node) and width in sized:  # max(pages, s) once rewritten: >= pages
        return pages
    if _compat.known_at_least(width, pages):  # an int, or a size its guards keep at least that wide
        return pages
    admitted = traced_ranges.admitted_values(item, bound) \
        if traced_ranges.OTHER in item.meta and not rounded else None
    if admitted is not None and admitted.numel():
        top = ceil_div(int(admitted.max()) + extra, page_size)
        if _compat.known_at_least(width, top):
            return top
    raise Unsafe("buffer_narrow", f"the buffer {base.name} sliced at {node_location(table)} is {width} "
                                  f"columns wide, not statically as wide as the bound's {pages} pages: the "
                                  "static width would not fit in it")

def base_width(base: torch.fx.Node, covers: dict, sized: set):
    """The width of a sliced buffer: a graph input's static one, or an allocation's (SGLang's regrown scratch
    `torch.full((rows, max(n, W)), -1)`: W, a covering width, for every n within the bound)."""
    spelled = as_allocation(base)
    if spelled is None or spelled.rank != 2:
        return example_value(base).shape[1]
    width = spelled.sizes[1]
    if isinstance(width, torch.fx.Node) and width in sized:
        return width
    return covers.get(width) if isinstance(width, torch.fx.Node) else width


def stride_at(writer: torch.fx.Node, name: str, param: str | None):
    """Where the writer's row stride `param` is in its call (trace_signature.ScratchTable.stride), or None."""
    if param is None:
        return None
    if _compat.user_triton_kernel(writer) is not None:
        return ("kernel", param)
    if param in writer.kwargs:
        return ("kwarg", param)
    try:
        names = [a.name for a in schema_of(name).arguments]
    except Exception:  # noqa: BLE001 -- no schema: not located
        return None
    if param in names and names.index(param) < len(writer.args):
        return ("arg", names.index(param))
    return None
