"""SyncFreeCheck: a post-grad CustomGraphPass that only verifies (proof 1 of DESIGN.md).

It counts `_local_scalar_dense` (a host read), `_assert_scalar` and free unbacked symbols in the post-grad
graph. Its uuid covers every option and the consumer registry, so the FX graph cache stays on and never
serves an artifact compiled under another configuration.
"""

from __future__ import annotations

import contextvars
import hashlib
from pathlib import Path

import torch

from ._compat import CustomGraphPass, free_unbacked_symbols
from .consumers import registry_fingerprint

_FINDINGS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("syncfree_post_grad", default=None)

_SOURCE_HASH = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))
).hexdigest()


def post_grad_syncs(graph: torch.fx.Graph) -> dict:
    local_scalar = sum(1 for n in graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default)
    asserts = sum(1 for n in graph.nodes if n.target is torch.ops.aten._assert_scalar.default)
    unbacked = set()
    for n in graph.nodes:
        value = n.meta.get("val")
        if value is not None:
            try:
                unbacked |= {str(s) for s in free_unbacked_symbols(value)}
            except Exception:
                pass
    return {"local_scalar_dense": local_scalar, "assert_scalar": asserts, "unbacked_symbols": sorted(unbacked)}


class SyncFreeCheck(CustomGraphPass):
    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint

    def __call__(self, graph: torch.fx.Graph) -> None:
        findings = _FINDINGS.get()
        if findings is not None:
            findings.update(post_grad_syncs(graph))

    def uuid(self) -> str:
        h = hashlib.sha256()
        for part in (self.fingerprint, registry_fingerprint(), _SOURCE_HASH):
            h.update(part.encode())
        return h.hexdigest()


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
