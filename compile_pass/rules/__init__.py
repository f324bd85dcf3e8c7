"""The rules of the pass: each recognises one kind of host read, proves its rewrite safe, and rewrites it.

    class Rule(Protocol):
        name: str                        # the report's rule name, part of the uuid, the namespace of its facts
        options: dict[str, Option]       # the backend options this rule declares (validated with the rest)
        def match(self, read: SyncPoint) -> bool
        def prove(self, read, ctx: ProofContext) -> Plan        # raises proof.Unsafe(code, message)
        def rewrite(self, plan, graph, options) -> str          # edits the graph; returns the report line
        def find(self, graph, ctx) -> list[SyncPoint]           # optional: points of its own (not a host read
                                                                # of a reduction, which find_sync_points finds)

A new sync pattern is one file here with `@register_rule` on its class, plus one line in RULE_ORDER below, plus
its facts next to their ops in kernels/, its reason codes beside it (`proof.declare_reasons`), its tests in
tests/rules/ and its docs. The driver (sync_pass.SyncPass) is not edited: it finds every host read, asks the first
matching rule (in RULE_ORDER) to prove a plan for each on the untouched graph, and then applies the plans.

Rules never import each other: what a family shares has a module of its own (the rules that replace a max:
`host_max.py`), which is not a rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import pathlib
from typing import Any, Callable, Protocol

from ..find_sync_points import SyncPoint
from ..proof import ProofContext


@dataclasses.dataclass(frozen=True)
class Option:
    """A backend option a rule declares: its default and a check that raises naming the option."""

    default: Any
    check: Callable[[str, Any], Any]  # (name, value) -> the normalised value; raises TypeError/ValueError
    doc: str = ""


class Plan(Protocol):
    """A proven rewrite: frozen, holding the nodes it will edit (`touches`) and the disjointness it assumes.
    Optionally `static_inputs`: placeholders the rule proved to be persistent buffers that the step writes in place
    through a registered bounded writer; the backend makes them static inputs when it keeps CUDA graphs on."""

    touches: frozenset
    disjoint: frozenset


class Rule(Protocol):
    name: str
    options: dict[str, Option]

    def match(self, read: SyncPoint) -> bool: ...

    def prove(self, read: SyncPoint, ctx: ProofContext) -> Plan: ...

    def rewrite(self, plan: Plan, graph, options) -> str: ...


# The rules, in the order the driver asks them (the first whose `match` accepts a host read proves it): the
# narrower rules of a family before the one that takes any max. One line per rule; its module is rules/<name>.py.
RULE_ORDER = (
    "allocated_table",  # a max whose page count sizes an allocated table that a bounded writer fills
    "indptr_bound",  # a max passed as the upper bound of a reader through an indptr of the lengths
    "page_table",  # any other max over lengths: a page-table gather, an upper bound, scheduler metadata
    "flat_kv_indices",  # a sum over lengths sizing a flat kv_indices buffer
    "host_sums",  # a host int declared equal to such a sum (options['host_sums']) sizing the same buffer
)

_RULES: dict[str, Any] = {}


def register_rule(cls):
    """Class decorator: one instance of the rule joins the registry; its place is its line in RULE_ORDER."""
    if cls.name not in RULE_ORDER:
        raise RuntimeError(f"rule {cls.name!r} is not listed in compile_pass.rules.RULE_ORDER")
    if cls.name in _RULES:
        raise RuntimeError(f"rule {cls.name!r} is registered twice")
    _RULES[cls.name] = cls()
    return cls


def registered_rules() -> list:
    """The rules in RULE_ORDER."""
    return [_RULES[name] for name in RULE_ORDER if name in _RULES]


def declared_options() -> dict[str, Option]:
    """Every option the rules declare; a family's option (the same Option object) may be offered by each of its
    rules, but two different options of one name are an error."""
    found: dict[str, Option] = {}
    for rule in registered_rules():
        for name, option in rule.options.items():
            if name in found and found[name] is not option:
                raise RuntimeError(f"option {name!r} is declared by two rules")
            found[name] = option
    return found


def rules_fingerprint() -> str:
    """Part of the post-grad check's uuid (an FX graph cache hit must never be stale): the rule order, the source
    of every module in this folder (the rules and what they share) and every reason code with its owner."""
    from ..proof import REASON_OWNERS

    h = hashlib.sha256()
    h.update(repr(RULE_ORDER).encode())
    folder = pathlib.Path(__file__).parent
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(repr(sorted(REASON_OWNERS.items())).encode())
    return h.hexdigest()


for _name in RULE_ORDER:  # each module registers its rule (and its reason codes and facts) on import
    importlib.import_module(f"{__name__}.{_name}")
