"""The host sum: a host int that equals sum(lengths) (SGLang's `forward_batch.seq_lens_sum`) sizing a flat
kv_indices buffer becomes the static size B x max_context_len, once the user declares the relation.

There is no sync here: the int is already on the host. But it changes every step, so Dynamo first specialises the
graph on it, then (at the next value) makes it a dynamic input, and the buffer's size follows it: no single CUDA
graph per batch size. Declared with `options={"host_sums": {"seq_lens_sum": "seq_lens"}}` (like `cpu_mirrors`),
the size no longer depends on it.

Before (Dynamo, the second value of seq_lens_sum: automatic dynamic shapes made it an input):

    l_fb_seq_lens_sum : torch.SymInt = placeholder[target=L_fb_seq_lens_sum]      # s0, a host int
    cumsum = torch.cumsum(l_fb_seq_lens, 0)
    kv_indptr = torch._C._nn.pad(cumsum, (1, 0), 'constant', None)
    kv_indices = torch.empty(l_fb_seq_lens_sum, dtype=torch.int32, device=device(type='cuda'))   # [s0]
    torch.ops.syncfree.kv_indices(kv_indices, l_fb_req_to_token, l_fb_req_pool_indices, l_fb_seq_lens, kv_indptr)
    out = torch.ops.mylib.flat_attention(q, k, v, kv_indices, kv_indptr, l_fb_seq_lens)

After (max_context_len=4096, B = 8):

    kv_indices = torch.empty(32768, dtype=torch.int32, device=device(type='cuda'))   # [B * 4096]
    _assert_async_msg = ...(all(0 <= l_fb_seq_lens <= 4096), ...)                    # checked
    _assert_async_msg_1 = ...(sum(l_fb_seq_lens) == l_fb_seq_lens_sum, ...)          # checked: the declaration
    torch.ops.syncfree.kv_indices(kv_indices, ...)                                  # unchanged
    out = torch.ops.mylib.flat_attention(q, k, v, kv_indices, kv_indptr, l_fb_seq_lens)

The proof is the flat-buffer family's (rules/flat_buffer.py): every use of the int is the size of a 1-D buffer
that one registered writer fills through an indptr of the declared lengths and only registered readers read
through it. The writer writes [indptr[b], indptr[b] + len_b) whatever the buffer's size, so a buffer at least as
large as the sum holds what eager's held; the declaration says which lengths the sum is of. Eager sizes its buffer
by the int: where the int is not that sum, eager's buffer differs (too small: the writer stops at its end and the
readers read other entries), so the rewrite equals eager only under the declaration. `checked=True` asserts it on
the device (`sum(lengths) == int`, the int a scalar input of the graph: no host read), with the lengths' range,
except under CUDA graphs: an int the graph reads keys Inductor's recorded CUDA graphs, one per value (on the H200:
a recording per step), which is what this rule removes; there the declaration is the user's promise, as under
`checked=False`, and the report says so. Anything else keeps the int.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from .._compat import example_value, placeholder_source_name
from ..find_sync_points import SyncPoint, attribute_name
from ..fx_util import code_line, insert_call, node_location
from ..normalize import INT_DTYPES, dtype_of
from ..proof import ProofContext, Unsafe, declare_reasons
from ..report import readable_source
from . import Option, register_rule
from .flat_buffer import BufferWalk, assert_lengths_within, resize_buffers, walk_the_total

RULE = "host_sums"

REASONS = declare_reasons(RULE, {
    "host_sum_lengths": "the lengths a declared host sum adds up are not a 1-D int input of the graph beside it",
})


def _check_host_sums(name, value):
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError(f"options['{name}'] must map a host int's attribute name to the lengths it sums, e.g. "
                        "{'seq_lens_sum': 'seq_lens'}, got " + repr(value))
    return tuple(sorted(value.items()))


def _sibling(source: str, attr: str, other: str) -> list[str]:
    """The source names of `other` on the object that holds `attr` (`L['fb'].x` -> `L['fb'].other`)."""
    if source.endswith(f".{attr}"):
        return [source[: -len(attr)] + other]
    if source.endswith(f"['{attr}']"):
        return [source[: -len(attr) - 4] + f"['{other}']"]
    return []


@dataclasses.dataclass(frozen=True)
class HostSumPlan:
    point: SyncPoint
    bound: int  # max_context_len: every length within [0, bound], so the sum <= B * bound
    lengths: torch.fx.Node  # the declared lengths (a graph input): B is its size(0)
    buffers: tuple
    touches: frozenset
    disjoint: frozenset


@register_rule
class HostSums:
    """A declared host sum of lengths sizing a flat buffer that registered writers and readers use through an
    indptr of those lengths: the static total B x max_context_len."""

    name = RULE
    options = {"host_sums": Option(None, _check_host_sums,
                                   "{host int attribute: lengths attribute}: the int equals the sum of those "
                                   "lengths (SGLang's {'seq_lens_sum': 'seq_lens'}); a flat buffer it sizes gets "
                                   "the static size B x max_context_len")}

    def find(self, graph: torch.fx.Graph, ctx: ProofContext) -> list[SyncPoint]:
        declared = dict(ctx.options.rule_option("host_sums") or ())
        if not declared:
            return []
        inputs = {placeholder_source_name(n): n for n in graph.nodes if n.op == "placeholder"}
        points = []
        for source, node in inputs.items():
            attr = attribute_name(source)
            if attr not in declared or not isinstance(example_value(node), torch.SymInt) or not node.users:
                continue  # a specialised int is a constant of the graph: nothing depends on it at run time
            lengths = next((inputs[s] for s in _sibling(source, attr, declared[attr]) if s in inputs), None)
            first = min(node.users, key=ctx.index)
            points.append(SyncPoint("host_sum", node, [node], lengths, False, node_location(first), code_line(first),
                                    "host_sum", kept_note="a host int: no device sync"))
        return points

    def match(self, read: SyncPoint) -> bool:
        return read.reduction == "host_sum"

    def prove(self, read: SyncPoint, ctx: ProofContext) -> HostSumPlan:
        attr = attribute_name(placeholder_source_name(read.value))
        lengths = read.source
        value = example_value(lengths) if lengths is not None else None
        if lengths is None or dtype_of(lengths) not in INT_DTYPES or getattr(value, "ndim", 0) != 1:
            wanted = dict(ctx.options.rule_option("host_sums"))[attr]
            raise Unsafe("host_sum_lengths", f"options['host_sums'] declares {attr} = sum({wanted}), but {wanted} "
                                             "is not a 1-D int32/int64 input of this graph on the same object")
        walk = walk_the_total(BufferWalk, read, ctx, attr)
        touches = {read.value} | {b.alloc for b in walk.buffers}
        return HostSumPlan(read, walk.bound, walk.root, tuple(walk.buffers), frozenset(touches),
                           frozenset(walk.disjoint))

    def rewrite(self, plan: HostSumPlan, graph: torch.fx.Graph, options) -> str:
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min((b.alloc for b in plan.buffers), key=order.get)
        declared = f"{_user_name(plan.point.value)} == sum({_user_name(plan.lengths)})"
        if options.checked:
            assert_lengths_within(graph, plan, first, "the declared host sum")
            if not _cuda_graphs(options):
                assert_declared_sum(graph, plan, first)
        parts = resize_buffers(graph, plan, first, plan.point.value)
        if options.checked:
            parts.append("lengths asserted on the device")
            parts.append(f"{declared} asserted on the device" if not _cuda_graphs(options) else
                         f"{declared} not asserted under cudagraphs (a CUDA graph would be recorded per value of "
                         "the int): the declaration is your promise there")
        # The int stays a graph input: a host value, no sync (under checked without CUDA graphs, the assertion
        # reads it; else nothing does).
        return "rewritten: " + "; ".join(parts)


def _cuda_graphs(options) -> bool:
    """CUDA graphs asked for (cudagraphs=True, mode="reduce-overhead", or Inductor's triton.cudagraphs): there an int
    the graph reads is part of the key of the recorded CUDA graphs (Inductor records one per value), so asserting
    the declaration would record a graph per step (measured on the H200: 8 recordings for 8 sums, against one)."""
    return bool(options.cudagraphs or dict(options.inductor).get("triton.cudagraphs"))


def _user_name(node: torch.fx.Node) -> str:
    """A graph input as the user's code names it (`fb.seq_lens_sum`), not as Dynamo does (`l_fb_seq_lens_sum`)."""
    source = placeholder_source_name(node)
    return readable_source(source) if source else node.name


def assert_declared_sum(graph: torch.fx.Graph, plan: HostSumPlan, first: torch.fx.Node) -> None:
    """checked: the declared premise, on the device: sum(lengths) equals the host int (the int goes in as a
    scalar: no host read). A step whose scheduler published another sum raises instead of running with a buffer
    eager would have sized otherwise; any step whose int is the sum, as declared, passes."""
    total = insert_call(graph, first, torch.ops.aten.sum.default, (plan.lengths,), first)
    same = insert_call(graph, first, torch.ops.aten.eq.Scalar, (total, plan.point.value), first)
    host, lengths = _user_name(plan.point.value), _user_name(plan.lengths)
    insert_call(graph, first, torch.ops.aten._assert_async.msg,
                (same, f"syncfree: {host} is not sum({lengths}) at {plan.point.location}: options['host_sums'] "
                       f"declares it equal, and the flat buffer it sized is rewritten on that premise"), first)
