"""The proof context every rule calls: the default-deny write log, the lengths relations, the inputs assumed
distinct, and the reason codes a kept host read carries.

Rules never copy these: a rule asks `ctx.check_no_writes(...)` and `ctx.relate_lengths(...)`, and raises
`Unsafe(code, message)` for a use the safety rule does not allow. The graph does not change while any rule
proves: every plan is proven on the untouched graph, then the driver applies them.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from ._compat import example_value, fake_mode_of
from .consumers import bind_arguments
from .fx_util import argument_names, flat_tensors, node_location
from .mutations import WriteLog
from .normalize import ARITHMETIC, COMPARES, INT_DTYPES, constant_add, dtype_of, floored_at_zero, \
    is_identity_slice, is_narrowing, strip_kept_values, tensor_sub

class DuplicateReason(RuntimeError):
    """Two owners declare the same reason code: raised at import, so a copied code never ships."""


# Every reason a host read is kept, by code: the merged view of what every owner declared (tests assert codes;
# the message beside a code says the particulars). An owner is the pass itself (here), the max family
# (rules/host_max.py) or one rule (its own file).
REASONS: dict[str, str] = {}
REASON_OWNERS: dict[str, str] = {}


def declare_reasons(owner: str, reasons: dict[str, str]) -> dict[str, str]:
    """Add `owner`'s reason codes to the registry; a code another owner (or this one) declared already raises
    DuplicateReason. Returns `reasons`, so a rule can keep its table beside it: `REASONS = declare_reasons(...)`."""
    for code, text in reasons.items():
        if not (isinstance(code, str) and code.isidentifier() and isinstance(text, str) and text):
            raise ValueError(f"{owner}: a reason code is an identifier with a text, got {code!r}: {text!r}")
        if code in REASONS:
            raise DuplicateReason(f"reason code {code!r} of {owner} is already declared by {REASON_OWNERS[code]}")
    for code, text in reasons.items():
        REASONS[code] = text
        REASON_OWNERS[code] = owner
    return reasons


# The pass's own codes, and those that rules of more than one family share.
declare_reasons("pass", {
    "no_bound": "no static bound was given (max_context_len)",
    "no_rule": "no rule recognises this host read (not a reduction over a lengths tensor)",
    "not_int_lengths": "the reduction is over a tensor that is not int32/int64 lengths",
    "escapes": "the value leaves the step (returned or stored on an object) and static_escapes is off",
    "arithmetic": "the value is used in arithmetic that is not a bound",
    "compared": "the value is compared, and the comparison must keep its meaning",
    "not_a_consumer": "the value reaches an op with no facts for this rule",
    "lengths_not_tensor": "the consumer's lengths are not an int32/int64 tensor of the graph",
    "lengths_differ": "the consumer's lengths are not the values the max was taken over",
    "lengths_exceed": "the consumer's lengths exceed what the bound covers",
    "written": "something may write the lengths, the token table or the indices in between",
    "page_size": "page sizes disagree",
    "table_use": "the page table reaches something that is not a self-guarding consumer",
    "output_changes": "the consumer's output would change shape or dtype with the static table",
    "nothing_to_rewrite": "the max feeds no page table and no upper bound",
    "no_writer": "the buffer or table is read before a bounded writer fills it",
    "indptr_differs": "the indptr is not the cumulative sum, with a leading 0, of the lengths that were summed",
    "overlap": "two rewrites would edit the same nodes",
    "still_in_graph": "the host read is still in the graph after the rewrite",
    "host_copy_used": "the host copy is used (the caller or host code needs it)",
    "mirror_upload": "a CPU mirror is copied to the device",
    "graph_break": "Dynamo broke the graph at a host read",
    "post_grad": "a host read found in the post-grad graph",
    "copy_not_a_view": "the lengths are copied through an index that is not a view (a tensor or list index "
                       "writes a temporary, not the buffer)",
    "narrowing_copy": "the lengths are copied into a narrower int dtype, whose values may wrap past what the "
                      "device check sees",
})


class Unsafe(Exception):
    """A use that the safety rule does not allow: `code` (a key of REASONS) and the report's message."""

    def __init__(self, code: str, message: str):
        if code not in REASONS:  # not an assert: `python -O` must not let an undeclared code through
            raise ValueError(f"undeclared reason code {code!r} (declare it with proof.declare_reasons)")
        super().__init__(message)
        self.code = code
        self.message = message


def describe_use(user: torch.fx.Node) -> str:
    if user.op == "output":
        return "the graph output (returned to the caller, or stored on an object such as self.forward_metadata)"
    what = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", str(user.target))
    return f"`{what}` at {node_location(user)}"


def registration_call(user: torch.fx.Node) -> str:
    """The call that would give an op the page-table rule's facts, with its own argument names to choose from."""
    names = ", ".join(argument_names(user)) or "..."
    return (f"compile_pass.register_self_guarding_consumer({user.target}, page_table=..., lengths=..., "
            f"upper_bounds=(...)) with arguments among ({names})")


def why_not(user: torch.fx.Node, what: str) -> Unsafe:
    """The reason a use of the max (what="the max") or of its page table is not allowed."""
    where = describe_use(user)
    if user.op == "output":
        return Unsafe("escapes", f"{what} reaches {where}; options['static_escapes'] would let it leave at the "
                                 "static bound")
    if user.op == "call_function" and user.target in ARITHMETIC:
        return Unsafe("arithmetic", f"{what} is used in arithmetic that is not a bound ({where})")
    if user.op == "call_function" and user.target in COMPARES:
        return Unsafe("compared", f"{what} is compared ({where}), and the comparison must keep its value")
    if user.op == "call_function" and isinstance(user.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return Unsafe("not_a_consumer", f"{what} reaches {where}, which is not a registered self-guarding consumer "
                                        f"(if it reads no key past its lengths, register it: "
                                        f"{registration_call(user)})")
    if what == "the max":
        return Unsafe("not_a_consumer",
                      f"{what} reaches {where}, neither a page-table bound nor an upper-bound argument")
    return Unsafe("table_use", f"{what} reaches {where}, not a self-guarding consumer")


@dataclasses.dataclass(frozen=True)
class LengthsRelation:
    """lengths = (values the reduction was taken over) + offset, through `chain` (casts, constant adds)."""

    lengths: torch.fx.Node  # the consumer's argument
    root: torch.fx.Node  # what the chain strips down to: the reduction's source, or its mirror / twin
    chain: tuple[torch.fx.Node, ...]
    offset: int
    via_mirror: bool  # root is the CPU mirror / device twin of the reduction's source, not the source
    # lengths = max(exact, 0) where exact = values + exact_offset (`(seq_lens - 1).clamp_min(0)`): then `offset`
    # (max(exact_offset, 0)) is only an upper bound, each length at most its value + offset and at least 0
    clamped: bool = False
    exact: torch.fx.Node | None = None  # the clamp's input (None: the lengths are exact)
    exact_offset: int = 0
    # lengths = values - y1 - ... + offset (SGLang's draft extend: `seq_lens - extend_seq_lens + 4`): `offset` is
    # then an upper bound only where every y >= 0, the premise the rule asserts on the device (`premise`)
    subtracted: tuple[torch.fx.Node, ...] = ()
    source_offset: int = 0  # the max is over (root's values) + source_offset: `seq_lens_cpu[:bs] + 4`
    # `buf[:bs].copy_(values)` then lengths `buf[:bs]` (FlashMLA's replay draft extend): the copies the chain went
    # through; they write the lengths' memory, which is the relation itself (the caller allows them as writers)
    copies: tuple[torch.fx.Node, ...] = ()


class ProofContext:
    """What all rules share while they prove plans on one untouched graph."""

    def __init__(self, graph: torch.fx.Graph, mirrors: dict, options):
        self.graph = graph
        self.mirrors = mirrors  # CPU mirror placeholder -> its device twin (or None)
        self.options = options
        self.writes = WriteLog(graph)  # read once: the graph does not change while rules prove

    def index(self, node) -> int:
        return self.writes.order.get(node, -1)

    def first(self, nodes):
        return min(nodes, key=self.index)

    def check_no_writes(self, end: torch.fx.Node, protected, what: str, start, disjoint: set,
                        allowed_writers=()) -> None:
        """Nothing strictly between `start` (None: the graph's start) and `end` may write any of `protected`
        or an alias of them. Graph inputs written in that window are added to `disjoint` as pairs with the
        protected inputs: the proof assumes they never share memory, and the backend checks it per call.
        `allowed_writers`: nodes the caller has proven write none of `protected` (a rule's facts say more than
        the default-deny log, e.g. a registered bounded writer writes only its table); they are skipped."""
        protected = [p for p in protected if isinstance(p, torch.fx.Node)]
        start = start if start is not None else next(iter(self.graph.nodes))
        writer = self.writes.first_write(protected, start, end)
        while writer is not None and writer in allowed_writers:
            writer = self.writes.first_write(protected, writer, end)
        if writer is not None:
            raise Unsafe("written",
                         f"{what} may be written in place by {describe_use(writer)} between the max and the consumer "
                         f"at {node_location(end)}: the values would differ from what eager read")
        inputs = {self.writes.input_of(p) for p in protected} - {None}
        cuts = [start, *sorted((w for w in allowed_writers if self.index(start) < self.index(w) < self.index(end)),
                               key=self.index), end]
        for written in set().union(*(self.writes.written_inputs(a, b) for a, b in zip(cuts, cuts[1:]))):
            disjoint |= {(p, written) for p in inputs if p is not written}

    def relate_lengths(self, source: torch.fx.Node, lengths, who: str,
                       max_family: bool = False) -> LengthsRelation:
        """How the consumer's `lengths` relate to the values `source` holds: the same values through value-keeping
        casts (narrowing included: lengths are within the bound, which the device check verifies on the wide
        values), constant adds (on either side: a max over `seq_lens_cpu[:bs] + 4` and lengths `seq_lens + 4` hold
        the same values), one floor at 0 outside them (an upper-bound relation: `clamped`), or the declared
        mirror pair. With `max_family` (the rules that need only an upper bound and check writes with the
        relation's copies allowed), also minus int tensors of the graph (`x - y + c`: an upper-bound relation that
        holds where each y >= 0, which the caller must have asserted) and a copy into a buffer view
        (`copied_into`; a view of the whole buffer too, `_copied_into_whole_view`). Unsafe otherwise. Writes are
        the caller's to check."""
        if not isinstance(lengths, torch.fx.Node) or dtype_of(lengths) not in INT_DTYPES:
            raise Unsafe("lengths_not_tensor", f"{who} is not an int32/int64 tensor of the graph")
        source_root, source_offset = _strip_adds(source)
        node, k, chain, subtracted, copies = lengths, 0, [], [], []
        top, passed = strip_kept_values(node, allow_moves=True, allow_narrowing=True)
        exact = floored_at_zero(top)
        if exact is not None:  # one floor at 0, outside the constant adds: max(values + k, 0)
            chain += [*passed, top]
            node = exact
        while True:
            root, passed = strip_kept_values(node, allow_moves=True, allow_narrowing=True)
            if copies and any(is_narrowing(n) for n in passed):  # a cast below a copy: no assertion sees it
                raise Unsafe("narrowing_copy", f"{who} ({lengths.name}) are copied into their buffer at "
                                               f"{node_location(copies[-1])} from values narrowed at "
                                               f"{node_location(next(n for n in passed if is_narrowing(n)))}: "
                                               "a wrapped value would pass the device check on the buffer")
            chain += passed
            add = constant_add(root)
            minus = tensor_sub(root) if max_family and exact is None else None
            copy = self.copied_into(root) if max_family and add is None and minus is None else None
            if add is None and minus is None and copy is None:
                whole = self._copied_into_whole_view(root, passed, source_root) if max_family else None
                if whole is None:
                    break
                writer, node = whole  # the view (passed[-1]) is in the chain already
                copies.append(writer)
                continue
            chain.append(root)
            if add is not None:
                node, step = add
                k += step
            elif minus is not None:
                node, y = minus
                subtracted.append(y)
            else:
                writer, node = copy
                copies.append(writer)
        via_mirror = False
        if root is not source_root:
            if self._mirror_pair(root, source_root):
                via_mirror = True  # the max over the CPU mirror, the lengths from its device twin (or back)
            else:
                raise Unsafe("lengths_differ",
                             f"{who} ({lengths.name}) does not hold the values the max was taken over "
                             f"({source.name}): the bound would not guard it")
        k -= source_offset  # relative to the values the max was taken over
        if exact is not None:
            if source_offset:  # max(x + k, 0) against a max over x + s: not an offset of those values
                raise Unsafe("lengths_differ", f"{who} ({lengths.name}) is floored at 0 and the max is over "
                                               f"{source.name} + {source_offset}: the bound would not guard it")
            return LengthsRelation(lengths, root, tuple(chain), max(k, 0), via_mirror, True, exact, k)
        return LengthsRelation(lengths, root, tuple(chain), k, via_mirror, subtracted=tuple(subtracted),
                               source_offset=source_offset, copies=tuple(copies))

    def _mirror_pair(self, a: torch.fx.Node, b: torch.fx.Node) -> bool:
        return self.mirrors.get(b) is a or self.mirrors.get(a) is b

    def _copied_into_whole_view(self, root: torch.fx.Node, passed, source_root: torch.fx.Node):
        """copied_into for a view that covers its whole buffer (issue 45, a full batch: `buf[:bs]` at
        bs == buf.size(0), FlashMLA's `cuda_graph_draft_extend_seq_lens_k[:bs]` at bs == max_bs): the view is
        the last node strip_kept_values passed (an identity slice, normalize.is_identity_slice: its stop equals
        the buffer's first size for every value of the symbols), and `root` is the buffer it stripped down to,
        which copied_into cannot relate (it is not `buf[index]`). Only where the chain would otherwise end
        unrelated to the max's values (`root` neither `source_root` nor its mirror pair), so that no relation
        proven without the copy changes. The slice is a node of the graph: the copy relation is proven on it
        exactly as on a slice of part of the buffer (the same view, the same index, the last copy before it,
        nothing writing the buffer after it, which the caller checks). None otherwise."""
        if root is source_root or self._mirror_pair(root, source_root):
            return None
        if not passed or not is_identity_slice(passed[-1]) or passed[-1].args[0] is not root:
            return None
        return self.copied_into(passed[-1])

    def copied_into(self, view: torch.fx.Node):
        """(the copy, its source) where `view` is `buf[index]` of a graph input and the last copy before it into
        the same view of the same buffer, `buf[index].copy_(source)` of a source of the same shape and an int
        dtype, writes exactly its cells: `view` then holds the source's values (cast to the buffer's dtype), as
        long as nothing else writes the buffer after the copy, which the caller checks. None otherwise.

        Default deny (issue 45): only a basic-indexing view relates (`index` of ints, slices of ints / SymInts,
        None, Ellipsis; `_is_view_index`). A tensor or list index (advanced indexing) makes a temporary: the copy
        writes that, never buf, and a later `buf[index]` holds buf's own values: Unsafe("copy_not_a_view"). A copy
        into a narrower int dtype (int64 into int32) holds the values modulo 2**32: it relates here, and the
        caller (host_max.guard_lengths, the one user of the copy relation) keeps it only where the bound fits the
        narrow dtype, with the copy's wide source asserted within the bound under `checked` (a wrapped value
        would pass a check on the buffer); see narrowed_by_copy. Same-dtype and widening copies keep every
        value."""
        if not (view.op == "call_function" and view.target is operator.getitem and len(view.args) == 2):
            return None
        base, index = view.args
        if not isinstance(base, torch.fx.Node) or base.op != "placeholder":
            return None
        found = None
        for node in self.writes.writers_before(view):  # a copy writes in place: the write log has every one
            dest = _copy_destination(node)
            if dest is not None and dest.op == "call_function" and dest.target is operator.getitem \
                    and len(dest.args) == 2 and dest.args[0] is base and _same_index(dest.args[1], index):
                found = node
        if found is None:
            return None
        if not _is_view_index(index):
            raise Unsafe("copy_not_a_view",
                         f"{view.name} = {base.name}[...] is read through an index that is not a view (a tensor or "
                         f"list index): the copy at {node_location(found)} wrote a temporary, not {base.name}, "
                         "and the read holds the buffer's own values")
        source = found.args[1] if len(found.args) > 1 else found.kwargs.get("src")
        sv, dv = example_value(source) if isinstance(source, torch.fx.Node) else None, example_value(view)
        if not isinstance(sv, torch.Tensor) or not isinstance(dv, torch.Tensor) or sv.dtype not in INT_DTYPES \
                or dv.dtype not in INT_DTYPES or [str(d) for d in sv.shape] != [str(d) for d in dv.shape]:
            return None
        return found, source


def _copy_destination(node: torch.fx.Node):
    """`dest` of `dest.copy_(src)` (the method or aten.copy_), else None."""
    if node.op == "call_method" and node.target == "copy_" and node.args:
        return node.args[0]
    if node.op == "call_function" and node.target in (torch.ops.aten.copy_.default, torch.Tensor.copy_) and node.args:
        return node.args[0]
    return None


def narrowed_by_copy(copy: torch.fx.Node):
    """(source dtype, destination dtype) of `dest.copy_(source)` where the destination's int dtype is narrower,
    else None."""
    dest, source = _copy_destination(copy), copy.args[1] if len(copy.args) > 1 else copy.kwargs.get("src")
    sv, dv = example_value(source), example_value(dest)
    if isinstance(sv, torch.Tensor) and isinstance(dv, torch.Tensor) and sv.dtype.itemsize > dv.dtype.itemsize:
        return sv.dtype, dv.dtype
    return None


def _is_view_index(index) -> bool:
    """Basic indexing only (a view of the buffer): an int (not a bool), None, Ellipsis, a slice of ints / SymInts /
    None, or a tuple of those; an FX node counts only where its traced value is an int or SymInt (a size such as
    `bs`), never a tensor (advanced indexing: a copy)."""
    if isinstance(index, tuple):
        return all(_is_view_index(i) for i in index)
    if isinstance(index, slice):
        return all(part is None or _is_int_index(part) for part in (index.start, index.stop, index.step))
    return index is None or index is Ellipsis or _is_int_index(index)


def _is_int_index(part) -> bool:
    if isinstance(part, torch.fx.Node):
        value = example_value(part)
        return isinstance(value, torch.SymInt) or (type(value) is int)
    return type(part) is int


def _same_index(a, b) -> bool:
    """The same indexing expression: slices, ints and graph nodes compared element by element (nodes by identity)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_index(x, y) for x, y in zip(a, b))
    if isinstance(a, slice) and isinstance(b, slice):
        return all(_same_index(x, y) for x, y in ((a.start, b.start), (a.stop, b.stop), (a.step, b.step)))
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return a is b
    return type(a) is type(b) and a == b


def _strip_adds(node: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """(root, c): `node` holds root's values + c, through value-keeping casts and constant adds."""
    offset = 0
    while True:
        node, _ = strip_kept_values(node, allow_moves=True, allow_narrowing=True)
        add = constant_add(node)
        if add is None:
            return node, offset
        node, step = add
        offset += step


def _shapes(tensors) -> str:
    return ", ".join(f"{[str(s) for s in t.shape]} {str(t.dtype).replace('torch.', '')}" for t in tensors)


def check_outputs_keep(node: torch.fx.Node, swap: dict, who: str, what: str, overrides: dict | None = None,
                       may_return_nothing: bool = False) -> None:
    """A rewrite never changes what a consumer returns: `node`'s op, run on fake tensors with each node of `swap`
    replaced by a fresh tensor of the given shape (its dtype and device kept) and the arguments named in
    `overrides` set to their values (by keyword or by position), must return the traced shapes and dtypes. Unsafe
    ("output_changes") otherwise, or when it cannot be run. A node without a traced value counts as not checkable,
    unless `may_return_nothing` (an op that writes its out argument and returns nothing)."""
    before = example_value(node)
    values = {n: example_value(n) for n in swap}
    mode = fake_mode_of([*swap, node, *node.all_input_nodes])  # an in-place op's node has no value: its inputs do
    if (before is None and not may_return_nothing) or mode is None or any(v is None for v in values.values()):
        raise Unsafe("output_changes", f"{who}'s outputs could not be checked on fake tensors")
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), example_value)
    try:
        with mode:
            fresh = {n: torch.empty(shape, dtype=values[n].dtype, device=values[n].device) for n, shape in swap.items()}
            args = tuple(fresh.get(a, v) if isinstance(a, torch.fx.Node) else v for a, v in zip(node.args, args))
            kwargs = {k: (fresh.get(node.kwargs[k], v) if isinstance(node.kwargs[k], torch.fx.Node) else v)
                      for k, v in kwargs.items()}
            if overrides:  # by name, wherever the call passes the argument (a positional one too)
                names = argument_names(node)
                args = tuple(overrides.get(names[i], a) if i < len(names) else a for i, a in enumerate(args))
                kwargs.update({k: v for k, v in overrides.items() if k in kwargs})
            after = node.target(*args, **kwargs)
    except Exception as e:  # the op rejects the static value: it is not what its facts say
        raise Unsafe("output_changes", f"{who} rejects {what} on fake tensors ({type(e).__name__}: {e})") from None
    flat_before, flat_after = flat_tensors(before), flat_tensors(after)
    same = len(flat_before) == len(flat_after) and all(
        [str(s) for s in a.shape] == [str(s) for s in b.shape] and a.dtype == b.dtype
        for a, b in zip(flat_before, flat_after))
    if not same:
        raise Unsafe("output_changes", f"{who} at {node_location(node)} returns {_shapes(flat_before)} as traced and "
                                       f"{_shapes(flat_after)} with {what}: its output depends on the dynamic size")


def check_page_size(consumer: torch.fx.Node, entry, page_size: int) -> None:
    """A page count is only a bound for a consumer whose pages hold exactly `page_size` keys (`page_size_of`)."""
    if entry.page_size_of is None:
        raise Unsafe("page_size", f"{entry.name} does not declare where its page size is (page_size_of): a page "
                                  "count cannot be tied to it")
    argument, dim = entry.page_size_of
    value = example_value(bind_arguments(entry.name, consumer.args, consumer.kwargs).get(argument))
    have = value.shape[dim] if isinstance(value, torch.Tensor) and value.ndim > dim else None
    if have != page_size:
        raise Unsafe("page_size", f"the page count uses pages of {page_size} but {entry.name}'s {argument} has "
                                  f"pages of {have}")
