"""SyncFreeCheck: a post-grad CustomGraphPass that only verifies (proof 1 of docs/design.md).

It records every `_local_scalar_dense` (a host read, with its source line), `_assert_scalar` and free unbacked
symbol in the post-grad graph. Its uuid covers every option and the consumer registry, so the FX graph cache
stays on and never serves an artifact compiled under another configuration.

On an FX-graph-cache hit Inductor skips post-grad passes, so the findings of each compile are also kept in a
small store beside Inductor's cache, under a key of the same inputs (uuid, the graph's code, the example
inputs' metadata, the Inductor config); a hit reads them back there. Where they are missing too, the caller
compiles once more with the FX graph cache off: a cached artifact never skips the check.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from . import _compat
from ._compat import CustomGraphPass, free_unbacked_symbols
from .consumers import registry_fingerprint
from .report import node_location

_FINDINGS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("syncfree_post_grad", default=None)

_SOURCE_HASH = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("**/*.py")))
).hexdigest()


def post_grad_syncs(graph: torch.fx.Graph) -> dict:
    reads = [node_location(n) for n in graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]
    asserts = sum(1 for n in graph.nodes if n.target is torch.ops.aten._assert_scalar.default)
    unbacked = set()
    for n in graph.nodes:
        value = n.meta.get("val")
        if value is not None:
            try:
                unbacked |= {str(s) for s in free_unbacked_symbols(value)}
            except Exception:
                pass
    return {"local_scalar_dense": len(reads), "reads": reads, "assert_scalar": asserts,
            "unbacked_symbols": sorted(unbacked)}


def has_host_reads(findings: dict | None) -> bool:
    return bool(findings) and bool(findings["local_scalar_dense"] or findings["unbacked_symbols"])


class SyncFreeCheck(CustomGraphPass):
    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint

    def __call__(self, graph: torch.fx.Graph) -> None:
        findings = _FINDINGS.get()
        if findings is not None:
            start = time.perf_counter()
            findings.update(post_grad_syncs(graph))
            findings["check_seconds"] = time.perf_counter() - start

    def uuid(self) -> str:
        h = hashlib.sha256()
        for part in (self.fingerprint, registry_fingerprint(), _SOURCE_HASH):
            h.update(part.encode())
        return h.hexdigest()


class ComposedPostGradPass(CustomGraphPass):
    """The user's (or an engine's) post-grad pass first, then the check on what it left."""

    def __init__(self, first, check: SyncFreeCheck):
        self.first = first
        self.check = check

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.first(graph)
        self.check(graph)

    def uuid(self):
        first = self.first.uuid() if hasattr(self.first, "uuid") else None
        if first is None:
            return None  # the user's pass cannot be keyed: Inductor bypasses the FX graph cache, as it would
        return hashlib.sha256(f"{first}|{self.check.uuid()}".encode()).hexdigest()


def with_existing_pass(check: SyncFreeCheck, patches: dict):
    """The post-grad pass to install: the check, composed with one already set in `patches` or the config."""
    existing = patches.get("post_grad_custom_post_pass", _compat.inductor_config_value("post_grad_custom_post_pass"))
    return check if existing is None else ComposedPostGradPass(existing, check)


def collecting(findings: dict):
    """Context: the check writes what it finds into `findings` (left empty on an FX-graph-cache hit)."""
    token = _FINDINGS.set(findings)

    class _Ctx:
        def __enter__(self):
            return findings

        def __exit__(self, *exc):
            _FINDINGS.reset(token)
            return False

    return _Ctx()


def findings_key(check: SyncFreeCheck, gm: torch.fx.GraphModule, example_inputs, patches: dict) -> str:
    h = hashlib.sha256()
    inputs = [(tuple(t.shape), t.dtype, t.device, t.stride()) if isinstance(t, torch.Tensor) else t
              for t in example_inputs]
    # The installed pass is covered by its uuid; its repr holds an address.
    settings = sorted((k, v) for k, v in patches.items() if k != "post_grad_custom_post_pass")
    for part in (check.uuid(), gm.code, repr(inputs), repr(settings),
                 _compat.inductor_config_fingerprint(), torch.__version__):
        h.update(str(part).encode())
    return h.hexdigest()


def _store_path(key: str) -> Path:
    return Path(_compat.inductor_cache_dir()) / "syncfree_post_grad" / f"{key}.json"


def save_findings(key: str, findings: dict) -> None:
    path = _store_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(findings))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: the next hit compiles once more without the cache


def load_findings(key: str) -> dict | None:
    try:
        return json.loads(_store_path(key).read_text())
    except (OSError, ValueError):
        return None
