"""The rules of the pass: each recognises one kind of host read, proves its rewrite safe, and rewrites it.

    class Rule(Protocol):
        name: str                        # the report's rule name, part of the uuid, the namespace of its facts
        options: dict[str, Option]       # the backend options this rule declares (validated with the rest)
        def match(self, read: SyncPoint) -> bool
        def prove(self, read, ctx: ProofContext) -> Plan        # raises proof.Unsafe(code, message)
        def rewrite(self, plan, graph, options) -> str          # edits the graph; returns the report line

A new sync pattern is one file here with `@register_rule` on its class, plus one import line below, plus its facts
next to their ops in kernels/. The driver (sync_pass.SyncPass) is not edited: it finds every host read, asks the
first matching rule to prove a plan for each on the untouched graph, and then applies the plans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
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
    """A proven rewrite: frozen, holding the nodes it will edit (`touches`) and the disjointness it assumes."""

    touches: frozenset
    disjoint: frozenset


class Rule(Protocol):
    name: str
    options: dict[str, Option]

    def match(self, read: SyncPoint) -> bool: ...

    def prove(self, read: SyncPoint, ctx: ProofContext) -> Plan: ...

    def rewrite(self, plan: Plan, graph, options) -> str: ...


_RULES: list = []


def register_rule(cls):
    """Class decorator: one instance of the rule joins the registry (in import order)."""
    _RULES.append(cls())
    return cls


def registered_rules() -> list:
    return list(_RULES)


def declared_options() -> dict[str, Option]:
    found: dict[str, Option] = {}
    for rule in _RULES:
        for name, option in rule.options.items():
            if name in found:
                raise RuntimeError(f"option {name!r} is declared by two rules")
            found[name] = option
    return found


def rules_fingerprint() -> str:
    """Part of the post-grad check's uuid: which rules ran, in which order, from which source."""
    h = hashlib.sha256()
    for rule in _RULES:
        h.update(rule.name.encode())
        h.update(inspect.getsource(type(rule)).encode())
    return h.hexdigest()


from . import allocated_table  # noqa: E402,F401  (the allocated-table rule; first: the first match wins)
from . import indptr_bound  # noqa: E402,F401  (a max read through an indptr; before page_table, which takes any max)
from . import page_table  # noqa: E402,F401  (registers the page-table max rule)
from . import flat_kv_indices  # noqa: E402,F401  (registers the flat kv_indices sum rule)
