"""The canonical vocabulary: the many ways Dynamo spells one thing, each mapped to one small form.

Rules (find_sync_points, rules/*) match on these forms only, never on raw spellings. Filed by concept, not by the
rule that reads them; a spelling only one rule uses lives in that rule. Each spelling names the torch versions
known to emit it where that matters (Dynamo moves them between releases):

  reductions and host reads
    full max      t.max() | t.amax() | torch.max(t) | torch.amax(t) | t.max(dim=0).values (1-D) | numpy a.max()
    full sum      t.sum() | torch.sum(t) | t.sum(0) (1-D)                             (REDUCTIONS["sum"])
    host read     t.item() | int(t) | numpy int(a)                                   (wrapped_item)
    host copy     t.cpu() | t.to("cpu") | t.numpy()
  values and casts
    value kept    widening or identity casts: t.long() | t.to(int64) | t.type(..) | .contiguous() | .clone()
                  (+ device copies); narrowing ones (int64 -> int32) only where a range is known (lengths);
                  x[:n] with n the rows of x (identity slice)
    x + k         x + k | k + x | x.add(k) | torch.add(x, k) | x - k | x.sub(k)           (int tensor, int k)
    floor at 0    x.clamp(min=0) | x.clamp(0) | x.clamp_min(0) | torch.clamp(x, min=0) | torch.clamp_min(x, 0)
  host-int arithmetic (the max as a host int m)
    m + c         m + c | c + m | m - c | torch.sym_sum([m, c, ..]) (Dynamo's `m + 63` on 2.13+) -> +c / -c
    page count    (m + c + ps - 1) // ps                                              -> ps, c
    min clamp     min(m, T) | torch.sym_min(m, T) (T an int)                          -> T
    compare       m op k | k op m (op in < <= > >= == !=; k an int)                   -> (op, k), m on the left
    asserted      a compare whose only users are asserts (torch._check, _assert_scalar) -> ("upper"|"lower", k)
    width check   such a compare that holds for every width in [0, most]              -> Dynamo's bookkeeping
    row stride    torch.sym_max(1, n) | max(1, n) (Dynamo's `t.stride(0)` of a [B, n] tensor) -> n
  views and gathers
    gather        X[rows, :m:s] | X[rows, 0:m:s] | X[rows][:, :m:s] | X[:B, :m]       -> Gather(X, rows, s, extra)
    column step   T[:, ::s] | T[:, torch.arange(0, T.shape[1], s)]                    -> s
    floor div     T // c | T.floor_divide(c) | torch.div(T, c, rounding_mode="floor") -> c
  allocations (any rank)
    allocation    torch.empty(*sizes) | torch.empty(sizes) | torch.zeros(..) | torch.full(sizes, fill)
                  | x.new_empty(sizes) | x.new_zeros(sizes) | size= as a keyword           -> Allocation
  indptrs
    indptr        F.pad(cumsum(L, 0), (1, 0)) | torch.cat([zeros(1), cumsum(L, 0)])  -> L
                  (cumsum: torch.cumsum(L, 0) | torch.cumsum(L, dim=0) | L.cumsum(0), an int dtype= allowed)
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from ._compat import example_value, known_equal
from .kernels._triton import cdiv as ceil_div  # noqa: F401  (re-exported: the rules use ceil_div)

INT_DTYPES = (torch.int32, torch.int64)
_INT_BITS = {torch.int32: 32, torch.int64: 64}
# Dynamo's names for its numpy wrappers (torch 2.11-2.15): `wrapped_<numpy function or ndarray method>`.
NUMPY_MAX_NAMES = ("wrapped_max", "wrapped_amax")
NUMPY_ITEM_NAME = "wrapped_item"
# Comparisons and asserts as Dynamo records them; a user's torch._check is itself a graph target on 2.11/2.12.
COMPARES = frozenset({operator.ge, operator.le, operator.gt, operator.lt, operator.eq, operator.ne})
ASSERTS = frozenset({torch.ops.aten._assert_scalar.default, torch._check})
ARITHMETIC = frozenset({operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
                        operator.neg, operator.add, operator.sub, torch.sym_max, torch.sym_min})
SYM_SIZE = torch.ops.aten.sym_size.int
DEVICE_COPY_METHODS = ("to", "cuda")
_KEEP_VALUE_METHODS = {"to", "type", "int", "long", "contiguous", "clone", "cuda", "cpu"}


def callable_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def dtype_of(node):
    return getattr(example_value(node), "dtype", None)


def device_of(node):
    return getattr(example_value(node), "device", None)


def is_int_constant(value) -> bool:
    """A Python int (not a bool): a constant of the graph, as opposed to a node or a SymInt."""
    return isinstance(value, int) and not isinstance(value, bool)


# -- reductions and host reads ----------------------------------------------------------------------------
def _is_max_call(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("max", "amax")
    return node.op == "call_function" and node.target in (torch.max, torch.amax)


def max_source(node):
    """The tensor whose every element a max node reduces, or None (see the module docstring)."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        inner = node.args[0]
        if not isinstance(inner, torch.fx.Node) or not _is_max_call(inner):
            return None
        dims = [d for d in list(inner.args[1:]) + [inner.kwargs.get("dim")] if d is not None]
        source = inner.args[0]
        shape = getattr(example_value(source), "shape", None)
        if len(dims) == 1 and dims[0] in (0, -1) and shape is not None and len(shape) == 1 \
                and not inner.kwargs.get("keepdim", False):
            return source
        return None
    if len(node.args) != 1 or any(v is not None for v in node.kwargs.values()):
        return None
    if _is_max_call(node) or callable_name(node) in NUMPY_MAX_NAMES:
        source = node.args[0]
        # numpy: Dynamo reads a CPU tensor as an array through `t.view_as(t)`
        if isinstance(source, torch.fx.Node) and source.op == "call_method" and source.target == "view_as":
            source = source.args[0]
        return source if isinstance(source, torch.fx.Node) else None
    return None


def is_full_max(node) -> bool:
    return max_source(node) is not None


def max_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes a full max is made of (the max itself, numpy's view, dim-max's getitem)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return [node.args[0], node]
    if callable_name(node) in NUMPY_MAX_NAMES and node.args[0] is not max_source(node):
        return [node.args[0], node]
    return [node]


def is_item(node) -> bool:
    """`t.item()`, `int(t)` and a numpy scalar read (Dynamo's `wrapped_item`): a host read of one value."""
    if not isinstance(node, torch.fx.Node):
        return False
    return (node.op == "call_method" and node.target == "item") or callable_name(node) == NUMPY_ITEM_NAME


def _full_dim(node: torch.fx.Node, source) -> bool:
    """A reduction's dim arguments reduce every element: none, or dim 0 / -1 of a 1-D tensor (no keepdim)."""
    dims = list(node.args[1:]) + [node.kwargs.get("dim")]
    dims = [d for d in dims if d is not None]
    if node.kwargs.get("keepdim", False) or any(k not in ("dim", "keepdim") for k in node.kwargs):
        return False
    if not dims:
        return True
    shape = getattr(example_value(source), "shape", None)
    return len(dims) == 1 and dims[0] in (0, -1, (0,), (-1,), [0], [-1]) and shape is not None and len(shape) == 1


def sum_source(node):
    """The tensor whose every element a sum node adds up (`t.sum()`, `torch.sum(t)`, `t.sum(0)` of a 1-D t), or
    None. `int(t.sum())` and `t.sum().item()` both reach the host through the item that reads this node."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    is_sum = (node.op == "call_method" and node.target == "sum") \
        or (node.op == "call_function" and node.target is torch.sum)
    source = node.args[0]
    if not is_sum or not isinstance(source, torch.fx.Node) or not _full_dim(node, source):
        return None
    return source


# The reductions a host read may be taken over, by kind: each returns the reduced tensor (or None).
REDUCTIONS = {"max": max_source, "sum": sum_source}


# The reductions a host read may be taken over, by kind: each returns the reduced tensor (or None).
REDUCTIONS = {"max": max_source, "sum": sum_source}


def reduction_of(node):
    """(kind, source) of the reduction a host read reads, e.g. ("max", seq_lens); (None, None) for another."""
    for kind, source_of in REDUCTIONS.items():
        source = source_of(node)
        if source is not None:
            return kind, source
    return None, None


def _is_cpu_device(value) -> bool:
    try:
        return torch.device(value).type == "cpu"
    except (TypeError, RuntimeError):
        return False


def is_host_copy(node: torch.fx.Node) -> bool:
    if node.op != "call_method":
        return False
    if node.target in ("cpu", "numpy"):
        return True
    if node.target == "to":
        values = list(node.args[1:]) + [node.kwargs.get("device")]
        return any(isinstance(v, (str, torch.device)) and _is_cpu_device(v) for v in values)
    return False


# -- values and casts ---------------------------------------------------------------------------------------
def value_kept_input(node, allow_moves: bool = False, allow_narrowing: bool = False):
    """If `node` keeps every value of its input (an identity or widening int cast, contiguous, clone, and with
    allow_moves a device copy), that input; else None. A narrowing cast (int64 -> int32) keeps values only in
    a known range: allow_narrowing says the caller knows one (lengths within the bound)."""
    if is_identity_slice(node):
        return node.args[0]
    if not isinstance(node, torch.fx.Node) or node.op != "call_method" or node.target not in _KEEP_VALUE_METHODS:
        return None
    source = node.args[0]
    if not isinstance(source, torch.fx.Node):
        return None
    if dtype_of(node) not in INT_DTYPES or dtype_of(source) not in INT_DTYPES:
        return None
    if _INT_BITS[dtype_of(node)] < _INT_BITS[dtype_of(source)] and not allow_narrowing:
        return None
    if getattr(example_value(node), "shape", None) != getattr(example_value(source), "shape", None):
        return None
    if not allow_moves and device_of(node) != device_of(source):
        return None
    return source


def is_identity_slice(node) -> bool:
    """`x[:n]` / `x[0:n]` / `x[:]` of an int tensor where n is x's first size for every value of its symbols
    (SGLang's `seq_lens_cpu[:bs]`, `block_kv_indices[:bs]`): the same tensor, a view of all of it."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and len(node.args) == 2 and isinstance(node.args[0], torch.fx.Node) and isinstance(node.args[1], slice)):
        return False
    source, index = node.args
    if index.start not in (None, 0) or index.step not in (None, 1) or dtype_of(source) not in INT_DTYPES:
        return False
    shape = getattr(example_value(source), "shape", None)
    if not shape:
        return False
    stop = example_value(index.stop) if isinstance(index.stop, torch.fx.Node) else index.stop
    return stop is None or (isinstance(stop, (int, torch.SymInt)) and known_equal(stop, shape[0]))


def is_value_cast(node) -> bool:
    """A cast-like method, whatever it does to values (value_kept_input says whether it keeps them)."""
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in _KEEP_VALUE_METHODS


def is_narrowing(node) -> bool:
    """An int cast to fewer bits than its input has."""
    source = node.args[0] if isinstance(node, torch.fx.Node) and node.args else None
    a, b = dtype_of(node), dtype_of(source)
    return a in _INT_BITS and b in _INT_BITS and _INT_BITS[a] < _INT_BITS[b]


def is_final_truncation(cast: torch.fx.Node, table: torch.fx.Node) -> bool:
    """`(X[rpi, :m:ps] // ps).to(int32)` on an int64 X: the op computes in int64 and truncates to int32 at the
    end, exactly this cast; a division after such a cast would differ (and is refused)."""
    return value_kept_input(cast, allow_narrowing=True) is table and is_narrowing(cast) \
        and dtype_of(cast) == torch.int32


def strip_kept_values(node, allow_moves: bool = False, allow_narrowing: bool = False) -> tuple:
    """(root, nodes passed through): follow value-keeping ops down to the tensor they copy."""
    passed = []
    while True:
        inner = value_kept_input(node, allow_moves, allow_narrowing)
        if inner is None:
            return node, passed
        passed.append(node)
        node = inner


def constant_add(node):
    """`x + k` or `x - k` on an int tensor with an int k: (x, k) or (x, -k), else None (`k - x` too)."""
    if not isinstance(node, torch.fx.Node) or dtype_of(node) not in INT_DTYPES:
        return None
    adds = (node.op == "call_function" and node.target in (operator.add, torch.add)) \
        or (node.op == "call_method" and node.target in ("add", "__add__", "__radd__"))
    subs = (node.op == "call_function" and node.target in (operator.sub, torch.sub)) \
        or (node.op == "call_method" and node.target in ("sub", "__sub__"))
    if not (adds or subs):
        return None
    if node.kwargs and node.kwargs != {"alpha": 1}:
        return None
    a, b = (tuple(node.args) + (None,))[:2]
    if subs:
        return (a, -b) if isinstance(a, torch.fx.Node) and is_int_constant(b) else None
    for x, k in ((a, b), (b, a)):
        if isinstance(x, torch.fx.Node) and is_int_constant(k):
            return x, k
    return None


def tensor_sub(node):
    """`x - y` of two int tensors of the graph (no alpha): (x, y), else None."""
    if not isinstance(node, torch.fx.Node) or dtype_of(node) not in INT_DTYPES or node.kwargs:
        return None
    subs = (node.op == "call_function" and node.target in (operator.sub, torch.sub)) \
        or (node.op == "call_method" and node.target in ("sub", "__sub__"))
    if not subs or len(node.args) != 2:
        return None
    x, y = node.args
    if not all(isinstance(a, torch.fx.Node) and dtype_of(a) in INT_DTYPES for a in (x, y)):
        return None
    shapes = [getattr(example_value(n), "shape", None) for n in (node, x)]
    if shapes[0] is None or [str(s) for s in shapes[0]] != [str(s) for s in shapes[1]]:
        return None  # y may broadcast over x, never x over y: each length is one x's value minus a y
    return x, y


def floored_at_zero(node):
    """x for `x.clamp(min=0)`, `x.clamp(0)`, `x.clamp_min(0)`, `torch.clamp(x, min=0)`, `torch.clamp_min(x, 0)`
    on an int tensor (no upper clamp): max(x, 0), SGLang's `(seq_lens - k).clamp_min(0)`; else None."""
    if not isinstance(node, torch.fx.Node) or dtype_of(node) not in INT_DTYPES or not node.args:
        return None
    method = node.op == "call_method" and node.target in ("clamp", "clamp_min")
    function = node.op == "call_function" and node.target in (torch.clamp, torch.clamp_min)
    if not (method or function):
        return None
    name = node.target if method else node.target.__name__
    rest = list(node.args[1:])
    low = rest[0] if rest else node.kwargs.get("min")
    high = rest[1] if len(rest) > 1 else node.kwargs.get("max")
    if name == "clamp_min" and not rest:
        low = node.kwargs.get("min")
    if low != 0 or not is_int_constant(low) or high is not None or any(k not in ("min", "max") for k in node.kwargs):
        return None
    source = node.args[0]
    return source if isinstance(source, torch.fx.Node) else None


# -- host-int arithmetic: the max as a host int m -------------------------------------------------------------
def plus_constant(user: torch.fx.Node, m: torch.fx.Node):
    """c for `m + c` in any spelling (`m + c`, `c + m`, `torch.sym_sum([m, c1, c2, ..])` with int constants),
    -c for `m - c`; None for anything else (`c - m` included)."""
    if user.op != "call_function":
        return None
    if user.target is operator.sub:
        return -user.args[1] if user.args[0] is m and is_int_constant(user.args[1]) else None
    if user.target is operator.add:
        other = user.args[1] if user.args[0] is m else user.args[0]
        return other if is_int_constant(other) else None
    if user.target is not torch.sym_sum or len(user.args) != 1 or user.kwargs:
        return None
    terms = user.args[0]
    if not isinstance(terms, (list, tuple)) or sum(1 for t in terms if t is m) != 1:
        return None
    rest = [t for t in terms if t is not m]
    return sum(rest) if all(is_int_constant(t) for t in rest) else None


def page_count(user: torch.fx.Node, m: torch.fx.Node):
    """k for `m // k` on the host int (the tail of a page count `(m + k - 1) // k`); None otherwise."""
    if user.op != "call_function" or user.target is not operator.floordiv or user.args[0] is not m:
        return None
    return user.args[1] if is_int_constant(user.args[1]) else None


def min_clamp(user: torch.fx.Node, m: torch.fx.Node):
    """T for `min(m, T)` / `torch.sym_min(m, T)` with an int T; None otherwise."""
    if user.op != "call_function" or user.target not in (min, torch.sym_min) or len(user.args) != 2:
        return None
    other = user.args[1] if user.args[0] is m else user.args[0]
    return other if is_int_constant(other) else None


# `k op x` is `x op' k`: how a comparison reads with its operands swapped.
FLIPPED = {operator.le: operator.ge, operator.ge: operator.le, operator.lt: operator.gt, operator.gt: operator.lt,
           operator.eq: operator.eq, operator.ne: operator.ne}


def compared_constant(compare, node, constants=None):
    """(op, k) for a comparison of `node` with an int constant k, read as `node op k` (`k < node` gives
    (operator.gt, k)); None for anything else. `constants`: nodes that stand for an int (a width the proof
    has shown constant), read as that int."""
    if not (isinstance(compare, torch.fx.Node) and compare.op == "call_function" and compare.target in FLIPPED
            and len(compare.args) == 2 and not compare.kwargs):
        return None
    a, b = compare.args
    if a is node and b is not node:
        op, k = compare.target, b
    elif b is node and a is not node:
        op, k = FLIPPED[compare.target], a
    else:
        return None
    k = (constants or {}).get(k, k) if isinstance(k, torch.fx.Node) else k
    return (op, k) if is_int_constant(k) else None


def only_asserted(compare: torch.fx.Node) -> bool:
    """Every user of `compare` is an assert (`torch._check`, Dynamo's `_assert_scalar`), and there is one."""
    return bool(compare.users) and all(u.op == "call_function" and u.target in ASSERTS for u in compare.users)


def asserted_bound(compare, node):
    """For a comparison of `node` with an int constant whose only users are asserts (`torch._check`, Dynamo's
    `_assert_scalar`): ("upper", T) for node <= T (node < T gives T - 1, T >= node the same), ("lower", k) for
    node >= k (node > k gives k + 1); None for anything else (== and != included)."""
    compared = compared_constant(compare, node)
    if compared is None or compared[0] in (operator.eq, operator.ne) or not only_asserted(compare):
        return None
    op, k = compared
    return {operator.le: ("upper", k), operator.lt: ("upper", k - 1),
            operator.ge: ("lower", k), operator.gt: ("lower", k + 1)}[op]


def holds_for_every_value(compare: torch.fx.Node, node: torch.fx.Node, most: int, constants=None) -> bool:
    """Is `compare` (on a value known to lie in [0, most], e.g. a table's width) true whatever the value? Only
    such checks are Dynamo's own bookkeeping; a user's check on the width must keep its meaning."""
    compared = compared_constant(compare, node, constants)
    if compared is None:
        return False
    op, k = compared
    return ((op is operator.ge and k <= 0) or (op is operator.gt and k < 0)
            or (op is operator.le and k >= most) or (op is operator.lt and k > most))


def row_stride_of(node, n: torch.fx.Node) -> bool:
    """`torch.sym_max(1, n)` / `max(1, n)`: Dynamo's `t.stride(0)` of a contiguous [B, n] tensor."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" \
            or node.target not in (torch.sym_max, max) or len(node.args) != 2 or node.kwargs:
        return False
    a, b = node.args
    return (is_int_constant(a) and a == 1 and b is n) or (is_int_constant(b) and b == 1 and a is n)


# -- views and gathers --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Gather:
    table: torch.fx.Node  # the [R, T] token table
    rows: torch.fx.Node | None  # the request indices (None: rows [0, row_stop) by a slice, gpt-fast's `[:B, :n]`)
    step: int | None  # the slice's step
    extra: list[torch.fx.Node]  # nodes of the spelling besides the gather itself (a chained row gather)
    row_stop: object = None  # with rows None: the slice's stop (an int, a SymInt node, or None for all rows)


def _stop_slice(index, m) -> bool:
    return (isinstance(index, slice) and index.start in (None, 0) and index.stop is m and index.step is not m
            and (index.step is None or is_int_constant(index.step)))


def as_gather(user: torch.fx.Node, m: torch.fx.Node) -> Gather | None:
    """`X[rows, :m:s]`, or `X[rows][:, :m:s]` when the row gather has no other use."""
    if user.op != "call_function" or user.target is not operator.getitem:
        return None
    base, index = user.args
    if not (isinstance(index, tuple) and len(index) == 2 and _stop_slice(index[1], m)):
        return None
    step = index[1].step
    if isinstance(index[0], torch.fx.Node) and index[0] is not m:
        return Gather(base, index[0], step, [])
    rows = index[0]
    if isinstance(rows, slice) and rows.start in (None, 0) and rows.step in (None, 1) and rows.stop is not m \
            and isinstance(base, torch.fx.Node) and base.target is not operator.getitem:
        return Gather(base, None, step, [], rows.stop)
    if index[0] == slice(None) and isinstance(base, torch.fx.Node) and base.op == "call_function" \
            and base.target is operator.getitem and isinstance(base.args[1], torch.fx.Node) \
            and len(base.users) == 1:
        return Gather(base.args[0], base.args[1], step, [base])
    return None


def arange_step(node, of: torch.fx.Node):
    """s for `torch.arange(0, sym_size(of, 1), s)` (the strided column index SGLang builds); else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target is not torch.arange:
        return None
    args = list(node.args)
    if len(args) == 2:
        args.append(node.kwargs.get("step", 1))
    if len(args) != 3 or args[0] != 0 or not is_int_constant(args[2]) or args[2] < 1:
        return None
    stop = args[1]
    if not (isinstance(stop, torch.fx.Node) and stop.op == "call_function"
            and stop.target is torch.ops.aten.sym_size.int and stop.args[0] is of and stop.args[1] in (1, -1)):
        return None
    if any(k not in ("device", "dtype", "step") for k in node.kwargs):
        return None
    return args[2]


def column_step(nxt: torch.fx.Node, node: torch.fx.Node):
    """The step of `node[:, ::step]` or `node[:, torch.arange(0, node.shape[1], step)]`, or None."""
    if nxt.op != "call_function" or nxt.target is not operator.getitem or nxt.args[0] is not node:
        return None
    index = nxt.args[1]
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)):
        return None
    cols = index[1]
    if isinstance(cols, slice) and cols.start in (None, 0) and cols.stop is None and is_int_constant(cols.step):
        return cols.step
    return arange_step(cols, node)


def floor_divisor(nxt: torch.fx.Node, node: torch.fx.Node):
    """The constant c of `node // c` in any of its spellings, or None."""
    if tuple(nxt.args[:1]) != (node,):
        return None
    value = nxt.args[1] if len(nxt.args) > 1 else None
    if not is_int_constant(value):
        return None
    if nxt.op == "call_function" and nxt.target is operator.floordiv:
        return value
    if nxt.op == "call_method" and nxt.target in ("__floordiv__", "floor_divide"):
        return value
    if nxt.op in ("call_method", "call_function") and nxt.target in ("div", torch.div) \
            and nxt.kwargs.get("rounding_mode") == "floor":
        return value
    return None


_ALLOC_KWARGS = {"dtype", "device", "layout", "pin_memory", "requires_grad"}  # of a zeros(1) allocation


# -- indptrs --------------------------------------------------------------------------------------------------
def cumsum_source(node):
    """L for `torch.cumsum(L, 0)`, `torch.cumsum(L, dim=0)`, `L.cumsum(0)` of a 1-D int L (an int dtype= too)."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    if not ((node.op == "call_function" and node.target is torch.cumsum)
            or (node.op == "call_method" and node.target == "cumsum")):
        return None
    source = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(source, torch.fx.Node) or dim not in (0, -1) or len(node.args) > 2 \
            or any(k not in ("dim", "dtype") for k in node.kwargs):
        return None
    shape = getattr(example_value(source), "shape", None)
    if shape is None or len(shape) != 1 or dtype_of(source) not in INT_DTYPES or dtype_of(node) not in INT_DTYPES:
        return None
    return source


def _is_zero_vector(node) -> bool:
    """`torch.zeros(1, ..)`, `torch.zeros((1,), ..)` or `x.new_zeros(1)` of an int dtype."""
    if not isinstance(node, torch.fx.Node) or dtype_of(node) not in INT_DTYPES:
        return False
    value = example_value(node)
    if tuple(getattr(value, "shape", ())) != (1,):
        return False
    if node.op == "call_function" and node.target is torch.zeros:
        return all(k in _ALLOC_KWARGS for k in node.kwargs)
    return node.op == "call_method" and node.target == "new_zeros" and all(k in _ALLOC_KWARGS for k in node.kwargs)


def indptr_of(node):
    """(L, the nodes of the spelling) for an indptr of lengths L: the cumulative sum with a leading 0,
    `F.pad(cumsum(L, 0), (1, 0))` or `torch.cat([zeros(1), cumsum(L, 0)])`, through value-keeping casts
    (widening only). None for any other spelling."""
    root, passed = strip_kept_values(node, allow_moves=False, allow_narrowing=False)
    if not isinstance(root, torch.fx.Node) or root.op != "call_function":
        return None
    pads = (torch.nn.functional.pad, getattr(torch._C._nn, "pad", None))
    if root.target in pads and len(root.args) >= 2:
        widths = root.args[1]
        mode = root.args[2] if len(root.args) > 2 else root.kwargs.get("mode", "constant")
        value = root.args[3] if len(root.args) > 3 else root.kwargs.get("value")
        if (tuple(widths) if isinstance(widths, (tuple, list)) else None) != (1, 0) or mode != "constant" \
                or value not in (None, 0) or any(k not in ("mode", "value") for k in root.kwargs):
            return None
        cumsum = root.args[0]
    elif root.target is torch.cat and root.args:
        parts = root.args[0]
        dim = root.args[1] if len(root.args) > 1 else root.kwargs.get("dim", 0)
        if not isinstance(parts, (tuple, list)) or len(parts) != 2 or dim not in (0, -1) \
                or not _is_zero_vector(parts[0]) or any(k != "dim" for k in root.kwargs):
            return None
        cumsum = parts[1]
    else:
        return None
    lengths = cumsum_source(cumsum)
    if lengths is None:
        return None
    return lengths, [*passed, root, cumsum]


# -- checks on a host int -----------------------------------------------------------------------------------
_FLIPPED = {operator.le: operator.ge, operator.ge: operator.le, operator.lt: operator.gt, operator.gt: operator.lt}
