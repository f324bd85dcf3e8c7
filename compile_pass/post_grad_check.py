"""SyncFreeCheck: a post-grad CustomGraphPass that only verifies (proof 1 of docs/design.md).

It records every `_local_scalar_dense` (a host read, with its source line), `_assert_scalar` and free unbacked
symbol in the post-grad graph. Its uuid covers every option, every rule's facts (the consumer, writer and reader
registries), the rules themselves (`rules.rules_fingerprint()`: names, order, source, reason codes) and the source
of the whole package (kernels included), so the FX graph cache and AOT autograd's cache stay on and never serve an
artifact compiled under another configuration or by other code.

On an FX-graph-cache hit Inductor skips post-grad passes, so the findings of each compile are also kept in a
small store beside Inductor's cache, under a key of the same inputs (uuid, the graph's code, the example
inputs' metadata, the Inductor config); a hit reads them back there. Where they are missing too, the caller
compiles once more with the FX graph cache off: a cached artifact never skips the check.
"""

from __future__ import annotations

import contextvars
import functools
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


def _package_dirs() -> list[Path]:
    """compile_pass/ and the folders mapped under it (kernels/ lives beside it in the source tree)."""
    import importlib.util

    dirs = [Path(__file__).parent]
    for name in ("compile_pass.kernels",):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += [Path(d) for d in spec.submodule_search_locations]
    return sorted(set(dirs))


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """A hash of every .py file of the package, computed once per process (at the first uuid)."""
    h = hashlib.sha256()
    for root in _package_dirs():
        for path in sorted(root.glob("**/*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def rules_fingerprint() -> str:
    """The rules' own fingerprint; imported here, at the first uuid, so that the import order stays as it is."""
    from .rules import rules_fingerprint as fingerprint

    return fingerprint()


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
        for part in (self.fingerprint, registry_fingerprint(), rules_fingerprint(), source_hash()):
            h.update(part.encode())
            h.update(b"\0")
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
    # Inductor's config as its own cache key sees it: machine-dependent settings (compile_threads) left out, so
    # that shipped caches (compile_pass.cache) find their findings on another machine of the same kind.
    # Every graph's code: a regional step's bodies (invoke_subgraph) are submodules its own code only names.
    code = "".join(f"{name}\n{m.code}" for name, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule))
    # The findings name the user's lines (node locations): two programs whose graphs are the same code but come
    # from other lines must not share them (a stale location would be reported as a new host read).
    lines = [node_location(n) for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    for part in (check.uuid(), code, repr(lines), repr(inputs), repr(settings),
                 _compat.inductor_cache_config_fingerprint(), torch.__version__):
        h.update(str(part).encode())
    return h.hexdigest()


def _store_path(key: str) -> Path:
    return Path(_compat.inductor_cache_dir()) / "syncfree_post_grad" / f"{key}.json"


# key -> findings saved or read back in this process: what compile_pass.cache.save_artifacts ships beside torch's
# artifacts (torch's mega-cache does not know this store; without it a loaded FX-graph-cache hit compiles again).
_SEEN: dict[str, dict] = {}


def findings_seen() -> dict[str, dict]:
    return dict(_SEEN)


def save_findings(key: str, findings: dict) -> None:
    _SEEN[key] = dict(findings)
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
        findings = json.loads(_store_path(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(findings, dict):
        return None
    _SEEN[key] = findings
    return findings
