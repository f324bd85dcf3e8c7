"""The `syncfree` torch.compile backend and `compile_pass.compile`.

    user fn --Dynamo--> FX graph --PageTableRewrite--> rewritten graph --compile_fx + SyncFreeCheck--> callable
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
import torch.fx

from . import _compat
from .find_sync_points import is_full_max
from .options import SyncfreeOptions
from .page_table_rewrite import PageTableRewrite
from .post_grad_check import SyncFreeCheck, collecting
from .report import SyncItem, SyncRemainsError, SyncReport, set_last_report, user_location

CAPTURE_FIX = ("Dynamo breaks the graph at .item() because torch._dynamo.config.capture_scalar_outputs is off; "
               "use compile_pass.compile(...) or set it to True before the first call")


def _graph_break_items(gm: torch.fx.GraphModule) -> list[SyncItem]:
    """Without capture_scalar_outputs, a graph that returns a full max ends where `.item()` broke it."""
    items = []
    for node in gm.graph.nodes:
        if node.op == "output":
            outputs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            for value in outputs:
                if is_full_max(value):
                    items.append(SyncItem("item", user_location(value.meta.get("stack_trace")),
                                          "kept: graph break at .item(): " + CAPTURE_FIX))
    return items


def _mode_options(mode: str | None) -> dict[str, Any]:
    if mode in (None, "default"):
        return {}
    if mode == "reduce-overhead":
        return {"cudagraphs": True}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def syncfree_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                     mode: str | None = None, **unexpected):
    """torch.compile(fn, backend="syncfree", options={"max_context_len": 4096, ...})."""
    if unexpected:
        raise TypeError(f"syncfree backend got unexpected arguments {sorted(unexpected)}; pass options={{...}}")
    opts = SyncfreeOptions.from_dict({**_mode_options(mode), **(options or {})})
    try:
        rewritten = _compat.copy_dynamo_graph_module(gm)
        report = PageTableRewrite(opts)(rewritten)
    except Exception as e:  # an internal error never breaks the user's compile
        if opts.strict:
            raise
        warnings.warn(f"syncfree: the pass failed ({type(e).__name__}: {e}); compiling the graph untouched",
                      stacklevel=2)
        rewritten = gm
        report = SyncReport(options=opts.to_dict(), fell_back=True,
                            notes=[f"the pass failed ({type(e).__name__}: {e}); the graph was compiled untouched"])
    if not _compat.capture_scalar_outputs_enabled():
        report.kept.extend(_graph_break_items(gm))
        report.notes.append(CAPTURE_FIX)
    set_last_report(report)
    if opts.strict and report.syncs_remaining:
        raise SyncRemainsError([i for i in report.kept if i.host_sync])
    if report.syncs_remaining:
        lines = "; ".join(f"{i.kind} at {i.location}" for i in report.kept if i.host_sync)
        warnings.warn(f"syncfree: {report.syncs_remaining} host sync point(s) kept: {lines} "
                      "(compile_pass.last_report() says why)", stacklevel=2)

    patches = opts.config_patches()
    patches["post_grad_custom_post_pass"] = SyncFreeCheck(opts.fingerprint())
    findings: dict = {}
    with collecting(findings):
        compiled = _compat.compile_fx(rewritten, example_inputs, patches)
    report.post_grad = dict(findings) if findings else None
    if opts.strict and findings and (findings["local_scalar_dense"] or findings["unbacked_symbols"]):
        raise SyncRemainsError([], extra=f"the post-grad graph still reads the host: {findings}")
    return compiled


_TORCH_COMPILE_KWARGS = {"fullgraph", "dynamic", "disable"}


def compile(fn: Callable, *, max_context_len: int, page_size: int | None = None, strict: bool = False,
            cudagraphs: bool = False, **kw) -> Callable:
    """Like torch.compile(fn, backend="syncfree", options=...), with capture_scalar_outputs on while Dynamo
    traces (it is read at the first call, not at torch.compile()).

    Keyword arguments fullgraph/dynamic/disable go to torch.compile; any other goes into the backend's
    options (checked, cpu_mirrors, Inductor config patches).
    """
    compile_kwargs = {k: kw.pop(k) for k in list(kw) if k in _TORCH_COMPILE_KWARGS}
    options = {"max_context_len": max_context_len, "page_size": page_size, "strict": strict,
               "cudagraphs": cudagraphs, **kw}
    SyncfreeOptions.from_dict(options)  # fail now, naming the bad option
    compiled = torch.compile(fn, backend=syncfree_backend, options=options, **compile_kwargs)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _compat.capture_scalar_outputs():
            try:
                return compiled(*args, **kwargs)
            except Exception as e:  # Dynamo wraps backend errors; a strict failure should read as itself
                inner = getattr(e, "inner_exception", None)
                if isinstance(inner, SyncRemainsError):
                    raise inner from None
                raise

    run._syncfree_compiled = compiled  # type: ignore[attr-defined]
    return run
