"""What the pass found, rewrote and kept: `SyncReport`, `last_report()` and `SyncRemainsError`."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import re
import threading
from typing import Any

_LAST: dict[str, "SyncReport"] = {}
_ALL: collections.deque = collections.deque(maxlen=1000)  # every graph's report in this process, oldest first
_LOCK = threading.Lock()
# The list that the reports of the graphs compiled during one call of a compile_pass.compile function go to.
_COLLECTOR: contextvars.ContextVar[list | None] = contextvars.ContextVar("syncfree_reports", default=None)

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def user_location(stack_trace: str | None) -> str:
    """'file.py:LINE' of the innermost frame of a node's stack trace (the user's code)."""
    if not stack_trace:
        return "<unknown>"
    frames = _FRAME.findall(stack_trace)
    if not frames:
        return "<unknown>"
    path, line = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def node_location(node) -> str:
    """'file.py:LINE' of the user's code that made an FX node."""
    return user_location(getattr(node, "meta", {}).get("stack_trace"))


_FRAME_IN = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)')
_ROOT_SOURCE = re.compile(r"^[LG]\[[^\]]*\]\.?")


def user_stack(stack_trace: str | None) -> list[str]:
    """The user's call stack of a node, outermost first: ["model.py:88 in forward", "step.py:7 in attend"]."""
    return [f"{path.rsplit('/', 1)[-1]}:{line} in {fn.strip()}" for path, line, fn in _FRAME_IN.findall(stack_trace or "")]


def module_path(node) -> str:
    """The nn.Module the node was traced in, as a dotted path from the compiled module ("layers.3.self_attn"),
    from Dynamo's nn_module_stack; "" outside modules (or for the compiled module itself)."""
    stack = getattr(node, "meta", {}).get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _ROOT_SOURCE.sub("", str(path))


def occurrence_fields(node) -> dict[str, Any]:
    """The fields that tell items at one source line apart: the graph node, the module, the user's call stack."""
    if node is None:
        return {}
    return {"node": node.name, "module": module_path(node),
            "stack": user_stack(getattr(node, "meta", {}).get("stack_trace"))}


def _symbols(node) -> set:
    from ._compat import example_value, free_unbacked_symbols

    try:
        return set(free_unbacked_symbols(example_value(node)))
    except Exception:
        return set()


def escape_location(node) -> str:
    """Where the host value `node` leaves the graph (returned, or stored on an object: Dynamo makes both a graph
    output): "file.py:LINE" of the first value that carries it (the value itself, or a tensor sized by it) and is
    a graph output; "" if none is found. Only values with a data-dependent size or value are followed (a slice by
    the max gets a size symbol of its own): an attention output that took the max as an upper bound is not."""
    seen, frontier = {node}, [node]
    while frontier:
        current = frontier.pop(0)
        for user in current.users:
            if user.op == "output":
                return node_location(current)
            if user not in seen and _symbols(user):
                seen.add(user)
                frontier.append(user)
    return ""


def readable_source(source: str) -> str:
    """A Dynamo source name as the user's code spells it: L['fb'].seq_lens -> fb.seq_lens, L['verify_lens'] ->
    verify_lens, L['kv'][0] -> kv[0]."""
    return _ROOT_NAME.sub(r"\1", source)


_ROOT_NAME = re.compile(r"^[LG]\['([^']*)'\]")


def user_input_names(graph) -> dict[str, str]:
    """{the graph's name of an input (Dynamo's placeholder, `l_verify_lens_`): the user's (`verify_lens`)}."""
    from ._compat import placeholder_source_name

    names = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            source = placeholder_source_name(node)
            if source:
                names[node.name] = readable_source(source)
    return names


def name_inputs_as_written(items: list["SyncItem"], graph) -> None:
    """The reasons name the graph's inputs as the user's code does (`verify_lens`), not by Dynamo's placeholder
    (`l_verify_lens_`); the item's `node` field keeps the graph's own name."""
    names = user_input_names(graph)
    if not names:
        return
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")\b")
    for item in items:
        item.reason = pattern.sub(lambda m: names[m.group(1)], item.reason)


def number_occurrences(items: list["SyncItem"], graph=None) -> None:
    """Items that share a location get `occurrence` = "k of n at LOCATION", numbered in the order of their nodes
    in `graph` when given (else in the order given); others get "". Given the graph, their reasons also name its
    inputs as the user's code does (name_inputs_as_written)."""
    if graph is not None:
        name_inputs_as_written(items, graph)
    order = {n.name: i for i, n in enumerate(graph.nodes)} if graph is not None else {}
    counts = collections.Counter(i.location for i in items)
    seen: collections.Counter = collections.Counter()
    for _, item in sorted(enumerate(items), key=lambda p: (order.get(p[1].node, len(order)), p[0])):
        seen[item.location] += 1
        n = counts[item.location]
        item.occurrence = f"{seen[item.location]} of {n} at {item.location}" if n > 1 else ""


@dataclasses.dataclass
class SyncItem:
    """One sync point: its kind (item, tolist, numpy, cpu_copy, cpu_mirror, host_sum, post_grad, graph_break), where
    it is and what happened to it."""

    kind: str
    location: str
    reason: str
    # False for a host read that costs no device sync (e.g. a max over an already published CPU mirror).
    host_sync: bool = True
    code: str = ""
    # Why it was kept, as a code (compile_pass.proof.REASONS); "" for a rewritten item.
    reason_code: str = ""
    rule: str = ""  # the rule that proved (or refused) it
    # Which one of several items at one location it is: "2 of 10 at step.py:7" ("" when it is the only one), the
    # graph node, the nn.Module it was traced in ("layers.1.attn"), the user's call stack (outermost first).
    occurrence: str = ""
    node: str = ""
    module: str = ""
    stack: list[str] = dataclasses.field(default_factory=list)
    # For a max kept because a value made from it leaves the graph (returned or stored): where that value is made.
    escape_location: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def where(self) -> str:
        """The location and, when several items share it, which one: "step.py:7 #2/10 layers.1.attn"."""
        shown = self.location
        if self.occurrence:
            shown += " #" + self.occurrence.split(" at ", 1)[0].replace(" of ", "/")
            if self.module:
                shown += " " + self.module
        return shown

    def what_happened(self) -> str:
        return self.reason + (f" (the value that leaves is made at {self.escape_location})"
                              if self.escape_location else "")

    def shown(self) -> str:
        """What happened, as the table shows it: parts repeated in a row (one per layer) folded, `max_seqlen_k
        -> 64 x4` (to_dict() keeps the reason whole)."""
        return fold_repeated_parts(self.what_happened())


@dataclasses.dataclass
class SyncReport:
    rewritten: list[SyncItem] = dataclasses.field(default_factory=list)
    kept: list[SyncItem] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Filled by the post-grad check; None when Inductor served the graph from its cache (the check ran then).
    post_grad: dict[str, Any] | None = None
    fell_back: bool = False
    # Pairs of graph-input positions the rewrite assumes never share memory (checked on every call).
    disjoint_inputs: list = dataclasses.field(default_factory=list)
    # Where compile time went: the FX pass plus the post-grad check (pass_seconds), and the whole backend call,
    # the pass, Inductor and the check included (backend_seconds). Dynamo's tracing is before the backend.
    pass_seconds: float = 0.0
    backend_seconds: float = 0.0

    @property
    def syncs_remaining(self) -> int:
        """Kept sync points that still cost a device-to-host sync per call."""
        return sum(1 for item in self.kept if item.host_sync)

    @classmethod
    def merge(cls, reports: list["SyncReport"]) -> "SyncReport":
        """One report for several graphs (a step split by graph breaks): every item and note, in order."""
        merged = cls()
        for r in reports:
            merged.rewritten += r.rewritten
            merged.kept += r.kept
            merged.notes += [n for n in r.notes if n not in merged.notes]
            merged.options = merged.options or dict(r.options)
            merged.fell_back = merged.fell_back or r.fell_back
            # positions in each graph's own inputs (notes name them): every graph's pairs, once
            merged.disjoint_inputs += [p for p in r.disjoint_inputs if p not in merged.disjoint_inputs]
            merged.pass_seconds += r.pass_seconds
            merged.backend_seconds += r.backend_seconds
            if r.post_grad is not None:
                pg = merged.post_grad or {"local_scalar_dense": 0, "reads": [], "assert_scalar": 0,
                                          "unbacked_symbols": []}
                merged.post_grad = {
                    "local_scalar_dense": pg["local_scalar_dense"] + r.post_grad.get("local_scalar_dense", 0),
                    "reads": pg["reads"] + list(r.post_grad.get("reads", [])),
                    "assert_scalar": pg["assert_scalar"] + r.post_grad.get("assert_scalar", 0),
                    "unbacked_symbols": sorted(set(pg["unbacked_symbols"]) | set(r.post_grad.get("unbacked_symbols", []))),
                }
        merged.rewritten = [dataclasses.replace(i) for i in merged.rewritten]
        merged.kept = [dataclasses.replace(i) for i in merged.kept]
        number_occurrences(merged.rewritten + merged.kept)  # across the graphs: the merged report's own count
        return merged

    def to_dict(self) -> dict[str, Any]:
        return {
            "rewritten": [i.to_dict() for i in self.rewritten],
            "kept": [i.to_dict() for i in self.kept],
            "syncs_remaining": self.syncs_remaining,
            "notes": list(self.notes),
            "options": dict(self.options),
            "post_grad": self.post_grad,
            "fell_back": self.fell_back,
            "disjoint_inputs": [list(pair) for pair in self.disjoint_inputs],
            "pass_seconds": self.pass_seconds,
            "backend_seconds": self.backend_seconds,
        }

    def __str__(self) -> str:
        rows = [("status", "kind", "location", "what happened")]
        body = [("rewritten", i) for i in self.rewritten]
        body += [("kept" if i.host_sync else "kept (no sync)", i) for i in self.kept]
        rows += collapse_repeated_rows([(status, i.kind, i.location, i.shown()) for status, i in body],
                                       [i.where() for _, i in body])
        if len(rows) == 1:
            rows.append(("-", "-", "-", "no sync point found"))
        widths = [max(len(r[c]) for r in rows) for c in range(3)]
        lines = []
        for n, r in enumerate(rows):
            lines.append("  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3])
            if n == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 13)
        lines.append(f"sync points rewritten: {len(self.rewritten)}, kept: {len(self.kept)} "
                     f"({self.syncs_remaining} still a host sync)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


SAME_REASON = "(same reason as above)"


def fold_repeated_parts(reason: str) -> str:
    """A reason's "; "-separated parts, each run of identical ones as one part with "xN": "rewritten: page table
    -> ...; max_seqlen_k -> 64; max_seqlen_k -> 64; bound 64" -> "...; max_seqlen_k -> 64 x2; bound 64"."""
    parts = reason.split("; ")
    runs: list[list] = []
    for part in parts:
        if runs and runs[-1][0] == part:
            runs[-1][1] += 1
        else:
            runs.append([part, 1])
    return "; ".join(f"{part} x{n}" if n > 1 else part for part, n in runs)


def collapse_repeated_rows(rows: list[tuple[str, str, str, str]],
                           shown_locations: list[str] | None = None) -> list[tuple[str, str, str, str]]:
    """Table rows, readable at engine size: identical rows (one per layer, from one line in a loop) become one
    row with "x N" after its location, and a reason repeated from the row above reads "(same reason as above)".
    `shown_locations` (one per row): what a row that stays alone shows as its location (which occurrence it is)."""
    shown_locations = shown_locations or [row[2] for row in rows]
    counted: list[list] = []
    for row, shown_location in zip(rows, shown_locations):
        if counted and tuple(counted[-1][0]) == row:
            counted[-1][1] += 1
        else:
            counted.append([row, 1, shown_location])
    out = []
    previous_reason = None
    for (status, kind, location, reason), n, shown_location in counted:
        shown = SAME_REASON if reason == previous_reason else reason
        out.append((status, kind, f"{location} x{n}" if n > 1 else shown_location, shown))
        previous_reason = reason
    return out


DISJOINT_PREFIX = "assumes these graph inputs never share memory: "
DISJOINT_SUFFIX = "; a call in which they do runs the graph as captured, without the rewrite"


def format_disjoint_note(pairs: list[tuple[str, str]], limit: int = 6) -> str:
    """The note on graph inputs a proof assumed distinct, grouped by tensor and in source names, e.g.

        assumes these graph inputs never share memory: L['fb'].req_to_token vs L['k_pool_0'], L['k_pool_1'], ...
        (8 inputs); ...

    `pairs` holds (name, name) pairs, best as Dynamo source names (`_compat.placeholder_source_name`). The tensor
    in most pairs leads a group with every input it was compared with; repeats are dropped; a group lists at most
    `limit` names and then says how many there are. Empty when there are no pairs."""
    remaining = {tuple(sorted((str(a), str(b)))) for a, b in pairs if a != b}
    groups = []
    while remaining:
        counts = collections.Counter(name for pair in remaining for name in pair)
        lead = min(counts, key=lambda name: (-counts[name], _natural_key(name)))
        others = sorted((b if a == lead else a for a, b in remaining if lead in (a, b)), key=_natural_key)
        remaining = {pair for pair in remaining if lead not in pair}
        shown = _numbered_runs(others)
        if len(shown) > limit:
            shown = shown[:limit - 1] + ["...", shown[-1]]
        group = f"{lead} vs {', '.join(shown)}"
        if len(others) > 1 and len(shown) < len(others):
            group += f" ({len(others)} inputs)"
        groups.append(group)
    if not groups:
        return ""
    return DISJOINT_PREFIX + "; ".join(groups) + DISJOINT_SUFFIX


def _numbered_runs(names: list[str]) -> list[str]:
    """Names that differ only in their last number, consecutive and 3 or more, as one "first .. last" entry:
    L['k_pool_0'] .. L['k_pool_7']."""
    series: dict[tuple[str, str], list[int]] = {}
    for name in names:
        m = re.match(r"^(.*?)(\d+)(\D*)$", name)
        if m:
            series.setdefault((m.group(1), m.group(3)), []).append(int(m.group(2)))
    out, done = [], set()
    for name in names:
        m = re.match(r"^(.*?)(\d+)(\D*)$", name)
        key = (m.group(1), m.group(3)) if m else None
        numbers = sorted(series.get(key, [])) if key else []
        if len(numbers) >= 3 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            if key not in done:
                done.add(key)
                out.append(f"{key[0]}{numbers[0]}{key[1]} .. {key[0]}{numbers[-1]}{key[1]}")
            continue
        out.append(name)
    return out


def _natural_key(name: str):
    """k_pool_2 before k_pool_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class SyncRemainsError(RuntimeError):
    """Raised under strict=True when a sync point is kept; lists each one with its line."""

    def __init__(self, items: list[SyncItem], extra: str = ""):
        self.items = list(items)
        lines = [f"  {i.kind} at {i.where()}: {i.what_happened()}" for i in self.items]
        msg = "syncfree (strict): host sync points remain after the pass:\n" + "\n".join(lines)
        if extra:
            msg += "\n" + extra
        super().__init__(msg)


def set_last_report(report: SyncReport) -> None:
    with _LOCK:
        _LAST["report"] = report
        _ALL.append(report)
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.append(report)


@contextlib.contextmanager
def collecting_reports(into: list):
    """Every report made while active (one per graph) is appended to `into`."""
    token = _COLLECTOR.set(into)
    try:
        yield into
    finally:
        _COLLECTOR.reset(token)


def reports(fn=None) -> list[SyncReport]:
    """Every graph's report: of one function made by compile_pass.compile (in compile order, graph breaks
    included), or without `fn`, of every compile in this process (the latest 1000)."""
    if fn is None:
        with _LOCK:
            return list(_ALL)
    found = getattr(fn, "_syncfree_reports", None)
    if found is None:
        raise TypeError("reports(fn) takes a function made by compile_pass.compile; for torch.compile(..., "
                        "backend='syncfree') call reports() with no argument")
    return list(found)


def last_report() -> SyncReport | None:
    """The SyncReport of the latest compile in this process (None before the first)."""
    with _LOCK:
        return _LAST.get("report")
