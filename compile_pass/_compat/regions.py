"""Compiled regions (`torch.compiler.nested_compile_region` -> `invoke_subgraph`): the one-schema-per-body cache.

Patches here (each dated: the torch versions it was checked on, what would remove it):
  * region_schema_cache: replaces torch._higher_order_ops.invoke_subgraph.HopInstance while the backend's
    compile_fx runs. Checked on torch 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0 (2026-12-04: tests/test_compat.py's
    region tests). Installed only where torch does not cache the schema itself
    (InvokeSubgraphCache.get_functionalize_schema_entry); removed when the lowest supported torch has that method.
"""

from __future__ import annotations

import contextlib
import torch


# -- one schema per compiled region body (issue 29) ---------------------------------------------------------------
# AOTAutograd functionalizes every invoke_subgraph call (a nested_compile_region's call) twice, once to collect
# metadata and once to trace, and each time torch 2.11 derives the call's schema (which operands the body mutates,
# what it returns) by tracing the body again with make_fx (`HopInstance.create` -> `gen_schema` ->
# `materialize_as_graph`): 128 traces of 2 bodies for the 32-layer regional step, the largest part of its cold
# AOTAutograd time on the H200 (benchmarks/results/profile_*). Later torch caches that schema itself, per tracing
# context, keyed by (id(subgraph), identifier, operand types) (`InvokeSubgraphCache.get_functionalize_schema_entry`);
# where it does not, the same cache, with the same key, is kept here while the backend's compile_fx runs. The
# schema is derived from the body alone (its mutations and outputs), so a body with the same identifier and
# operand types has the same schema; the cached entry holds the body itself, so an id reused after the body is
# freed never matches.
_SCHEMAS = "_syncfree_functionalize_schemas"  # the attribute of torch's per-compile InvokeSubgraphCache


def torch_caches_region_schemas() -> bool:
    from torch._guards import InvokeSubgraphCache

    return hasattr(InvokeSubgraphCache, "get_functionalize_schema_entry")


@contextlib.contextmanager
def region_schema_cache(force: bool = False):
    """While inside: invoke_subgraph's functionalization derives a body's schema once per tracing context, where
    torch does not cache it itself (force=True installs it anyway: for tests). Yields whether it is installed.
    SYNCFREE_REGION_SCHEMA_CACHE=0 in the environment turns it off (torch's own behaviour, for comparison)."""
    import os

    if os.environ.get("SYNCFREE_REGION_SCHEMA_CACHE", "1") == "0":
        yield False
        return
    region = _invoke_subgraph_module()
    base = getattr(region, "HopInstance", None)
    if base is None or getattr(base, "_syncfree_schema_cache", False) or (
            torch_caches_region_schemas() and not force):
        yield False
        return

    class CachedSchemaHopInstance(base):  # type: ignore[misc,valid-type]
        _syncfree_schema_cache = True

        @staticmethod
        def create(hop, *args, **kwargs):
            cache = region.get_invoke_subgraph_cache()
            if hop is not region.invoke_subgraph or kwargs or cache is None or len(args) < 2 or not isinstance(
                    args[1], str):
                return base.create(hop, *args, **kwargs)
            subgraph, identifier, *operands = args
            store = cache.__dict__.setdefault(_SCHEMAS, {})
            key = (id(subgraph), identifier, tuple(type(o) for o in operands))
            hit = store.get(key)
            if hit is not None and hit[0] is subgraph:
                return base(hop, hit[1])
            made = base.create(hop, *args)
            store[key] = (subgraph, made._schema)
            return made

    region.HopInstance = CachedSchemaHopInstance
    try:
        yield True
    finally:
        region.HopInstance = base


def _invoke_subgraph_module():
    """The module torch._higher_order_ops.invoke_subgraph (the package's attribute of that name is the op)."""
    import importlib

    try:
        return importlib.import_module("torch._higher_order_ops.invoke_subgraph")
    except ImportError:  # pragma: no cover - every supported torch has it
        return None


def region_schema_entries() -> int | None:
    """How many schemas region_schema_cache holds in the current tracing context (None outside one)."""
    region = _invoke_subgraph_module()
    cache = None if region is None else region.get_invoke_subgraph_cache()
    return None if cache is None else len(cache.__dict__.get(_SCHEMAS, {}))
