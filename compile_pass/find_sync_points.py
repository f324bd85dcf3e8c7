"""Find host-sync points in a Dynamo FX graph, each with its kind and the user's source line.

Shapes matched (Dynamo with capture_scalar_outputs on):
    max_1 = seq_lens.max();  item = max_1.item()                         kind "item"   (also int(t), torch.max(t), .amax(),
                                                                                       .max(dim=0).values)
    wrapped_max(a); wrapped_item(...)   (numpy: int(t.numpy().max()))    kind "numpy"
    getitem_i = seq_lens[i]; item_i = getitem_i.item(); sym_max(...)     kind "tolist" (max(seq_lens.tolist()))
    x.cpu() / x.to("cpu") / x.numpy()                                    kind "cpu_copy"
    placeholder with source L['fb'].seq_lens_cpu                         kind "cpu_mirror"
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from ._compat import example_value, placeholder_source_name
from .fx_util import code_line, node_location
from .normalize import INT_DTYPES, NUMPY_ITEM_NAME, callable_name, is_host_copy, is_item, max_nodes, reduction_of


@dataclasses.dataclass
class SyncPoint:
    kind: str
    value: torch.fx.Node  # the node whose result is the host value
    nodes: list[torch.fx.Node]  # the nodes that make up the read, in graph order
    source: torch.fx.Node | None = None  # the tensor the reduction is taken over (None: no known reduction)
    host_sync: bool = True
    location: str = "<unknown>"
    code: str = ""
    reduction: str | None = None  # "max", ... (normalize.REDUCTIONS); rules match on it
    # Why keeping it costs no sync, said in the report (host_sync False): a rule that finds its own points says it
    kept_note: str = "a host read of a CPU mirror: no device sync"

    @property
    def is_max(self) -> bool:
        return self.reduction == "max"


def _where(node: torch.fx.Node) -> tuple[str, str]:
    return node_location(node), code_line(node)


def attribute_name(source_name: str | None) -> str | None:
    """The last attribute or key of a Dynamo source name: L['fb'].seq_lens_cpu -> seq_lens_cpu."""
    if not source_name:
        return None
    tail = source_name.rsplit(".", 1)[-1]
    if tail.endswith("']") and "['" in tail:
        tail = tail[tail.rindex("['") + 2 : -2]
    return tail


def find_cpu_mirrors(graph: torch.fx.Graph, mirrors: dict[str, str]) -> dict[torch.fx.Node, torch.fx.Node | None]:
    """CPU-mirror placeholders mapped to their device twins (None when the twin does not reach the graph).

    A mirror is an input on the CPU whose attribute name ends in `_cpu` or is named in `mirrors` (mirror ->
    twin); a name alone is not enough. Its twin is the input of the paired name when that has the same shape
    and an integer dtype like the mirror's; otherwise the mirror has no twin (None).
    """
    by_source = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            name = placeholder_source_name(node)
            if name:
                by_source[name] = node
    found = {}
    for source, node in by_source.items():
        attr = attribute_name(source)
        if attr is None:
            continue
        if attr in mirrors:
            twin_attr = mirrors[attr]
        elif attr.endswith("_cpu"):
            twin_attr = attr[: -len("_cpu")]
        else:
            continue
        value = example_value(node)
        if getattr(getattr(value, "device", None), "type", None) != "cpu":
            continue  # named like a mirror, but not on the host: reading it is a device sync
        if source.endswith(f"['{attr}']"):  # L['seq_lens_cpu'], L['fb']['seq_lens_cpu']
            twin_source = source[: -len(attr) - 2] + twin_attr + "']"
        else:  # L['fb'].seq_lens_cpu
            twin_source = source[: -len(attr)] + twin_attr
        twin = by_source.get(twin_source)
        twin_value = example_value(twin)
        if twin is not None and (getattr(twin_value, "shape", None) != value.shape
                                 or value.dtype not in INT_DTYPES
                                 or getattr(twin_value, "dtype", None) not in INT_DTYPES):
            twin = None
        found[node] = twin
    return found


def _tolist_max(node: torch.fx.Node):
    """For the last sym_max of max(t.tolist()): (t, nodes of the pattern), else None."""
    chain, leaves, stack = [], [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in (torch.sym_max, max):
            chain.append(n)
            stack.extend(reversed(n.args))
        else:
            leaves.append(n)
    if not chain or not all(is_item(leaf) for leaf in leaves):
        return None
    elements = [leaf.args[0] for leaf in leaves]
    if not all(isinstance(e, torch.fx.Node) and e.target is operator.getitem and isinstance(e.args[1], int)
               for e in elements):
        return None
    sources = {e.args[0] for e in elements}
    if len(sources) != 1:
        return None
    source = sources.pop()
    size = getattr(example_value(source), "shape", None)
    if size is None or len(size) != 1 or sorted(e.args[1] for e in elements) != list(range(int(size[0]))):
        return None
    return source, chain + leaves + elements


def find_sync_points(graph: torch.fx.Graph, mirrors: dict[torch.fx.Node, torch.fx.Node | None]) -> list[SyncPoint]:
    """Every host read in the graph, in graph order. Nodes of one read are reported once."""
    points: list[SyncPoint] = []
    claimed: set[torch.fx.Node] = set()
    nodes = list(graph.nodes)

    def host_resident(t: torch.fx.Node) -> bool:
        return t in mirrors

    # max(t.tolist()) first: its items would otherwise be reported one by one.
    for node in reversed(nodes):
        if node in claimed or node.op != "call_function" or node.target not in (torch.sym_max, max):
            continue
        if any(u.op == "call_function" and u.target in (torch.sym_max, max) for u in node.users):
            continue  # not the last of its chain
        match = _tolist_max(node)
        if match is None:
            continue
        source, members = match
        claimed.update(members)
        loc, code = _where(node)
        points.append(SyncPoint("tolist", node, members, source, not host_resident(source), loc, code, "max"))

    for node in nodes:
        if node in claimed:
            continue
        if is_item(node):
            inner = node.args[0]
            members = [node]
            reduction, source = reduction_of(inner)
            if source is not None:
                members = max_nodes(inner) + [node]
            base = source if source is not None else inner
            if base in mirrors:
                kind = "cpu_mirror"
            elif callable_name(node) == NUMPY_ITEM_NAME:
                kind = "numpy"
            else:
                kind = "item"
            loc, code = _where(node)
            points.append(SyncPoint(kind, node, members, source, not host_resident(base), loc, code, reduction))
            claimed.update(members)
        elif is_host_copy(node) and isinstance(node.args[0], torch.fx.Node):
            loc, code = _where(node)
            points.append(SyncPoint("cpu_copy", node, [node], None, not host_resident(node.args[0]), loc, code))
            claimed.add(node)
    order = {n: i for i, n in enumerate(nodes)}
    points.sort(key=lambda p: order[p.value])
    return points
