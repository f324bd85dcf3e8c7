"""Diagnostics: the `syncfree` log, the structured-trace artifact of each graph's report, warnings at the user's line.

    TORCH_LOGS=syncfree       each decision at INFO: what was found, rewritten, kept and why, the post-grad check
    TORCH_LOGS=+syncfree      the details at DEBUG as well: options, inputs assumed distinct, timing, the
                              rewritten graph's code
    TORCH_TRACE=/tmp/trace    each graph's report as the artifact `syncfree_report` (JSON), shown by tlparse

The logger is `compile_pass` (so `TORCH_LOGS=compile_pass`, the module name, works on every torch); the setting
name `syncfree` is registered with torch._logging on `import compile_pass`, and, through the `torch.backends`
entry point, while torch itself is imported (torch >= 2.13 parses TORCH_LOGS after that; on older torch a
setting it does not know yet fails `import torch`, so use TORCH_LOGS=compile_pass there).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import sys
import warnings
from typing import Any, Callable

LOGGER_NAME = "compile_pass"
SETTING_NAME = "syncfree"
REPORT_ARTIFACT = "syncfree_report"

log = logging.getLogger(LOGGER_NAME)

# Callbacks (Dynamo graph, rewritten graph) while a `observing_rewrites` block is active (syncfree-inspect).
_OBSERVERS: contextvars.ContextVar[tuple[Callable, ...]] = contextvars.ContextVar("syncfree_observers", default=())
# Per-location registries for warnings.warn_explicit, so the "default" filter shows a warning once per line.
_WARNING_REGISTRIES: dict[tuple[str, int], dict] = {}
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


class _PackagePaths(logging.Filter):
    """Records name this package's files as torch's records name torch's (`torch/_dynamo/guards.py:NN`): torch's
    TORCH_LOGS formatter prints a path relative to the sys.path entry it lies under, and a source-tree (editable)
    install is under none, so its records would carry the checkout's absolute path. Such a record's path is
    given as it would lie in an installed copy (`compile_pass/backend.py` under a sys.path directory)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.pathname = installed_path(record.pathname)
        return True


def installed_path(path: str) -> str:
    package = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package)
    if not os.path.abspath(path).startswith(package + os.sep):
        return path
    entries = [p for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p) and os.path.realpath(p) == p]
    if any(root == e or root.startswith(e + os.sep) for e in entries) or not entries:
        return path  # an installed copy: torch already prints it relative
    site = next((e for e in entries if os.path.basename(e) in ("site-packages", "dist-packages")), entries[-1])
    return os.path.join(site, os.path.relpath(os.path.abspath(path), root))


log.addFilter(_PackagePaths())


def register_with_torch() -> bool:
    """TORCH_LOGS=syncfree and torch._logging.set_logs(modules={"syncfree": logging.INFO}) control this log."""
    from . import _compat

    return _compat.register_torch_log(SETTING_NAME, LOGGER_NAME)


# -- decisions ---------------------------------------------------------------------------------------------------
def graph_rewritten(original, rewritten) -> None:
    """After the pass: the rewritten graph's code at DEBUG, and to every observer."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("graph after the pass:\n%s", getattr(rewritten, "code", rewritten), stacklevel=2)
    for observer in _OBSERVERS.get():
        observer(original, rewritten)


def report_finished(report) -> None:
    """Each item of a finished report at INFO (with the post-grad check), the details at DEBUG, and the report
    as a structured-trace artifact."""
    if log.isEnabledFor(logging.INFO):
        for line in decision_lines(report):
            log.info("%s", line, stacklevel=2)  # the record names the caller (the backend), not this file
    if log.isEnabledFor(logging.DEBUG):
        for line in detail_lines(report):
            log.debug("%s", line, stacklevel=2)
    from . import _compat

    try:
        _compat.trace_artifact(REPORT_ARTIFACT, lambda: json.dumps(report.to_dict(), indent=1, default=str))
    except Exception as e:  # diagnostics never break a compile
        log.debug("could not write the structured-trace artifact: %s", e)


def decision_lines(report) -> list[str]:
    lines = []
    found = len(report.rewritten) + len(report.kept)
    lines.append(f"found {found} sync point(s): {len(report.rewritten)} rewritten, {len(report.kept)} kept "
                 f"({report.syncs_remaining} still a host sync)")
    for item in report.rewritten:
        lines.append(f"rewritten {item.kind} at {item.where()}: {item.what_happened()}")
    for item in report.kept:
        sync = "" if item.host_sync else " (no device sync)"
        lines.append(f"kept {item.kind} at {item.where()}{sync}: {item.what_happened()}")
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append(post_grad_line(report.post_grad))
    if report.fell_back:
        lines.append("the pass failed on this graph; it was compiled untouched")
    return lines


def post_grad_line(post_grad: dict | None) -> str:
    if post_grad is None:
        return "post-grad check: did not run (the graph was not compiled by Inductor)"
    reads = post_grad.get("local_scalar_dense", 0)
    asserts = post_grad.get("assert_scalar", 0)
    symbols = post_grad.get("unbacked_symbols", [])
    verdict = "sync-free" if not (reads or asserts or symbols) else "still reads the host"
    where = f" at {', '.join(post_grad['reads'])}" if post_grad.get("reads") else ""
    return (f"post-grad check: {verdict}: {reads} _local_scalar_dense{where}, {asserts} _assert_scalar, "
            f"unbacked symbols {list(symbols) or 'none'}")


def detail_lines(report) -> list[str]:
    lines = [f"options: {json.dumps(report.options, sort_keys=True, default=repr)}"]
    if report.disjoint_inputs:
        lines.append(f"graph-input positions assumed never to share memory: {report.disjoint_inputs}")
    lines.append(f"time: pass and check {report.pass_seconds:.3f}s, backend call {report.backend_seconds:.3f}s")
    return lines


@contextlib.contextmanager
def observing_rewrites(callback: Callable[[Any, Any], None]):
    """Call `callback(dynamo_graph, rewritten_graph)` for each graph the backend rewrites while active."""
    token = _OBSERVERS.set(_OBSERVERS.get() + (callback,))
    try:
        yield
    finally:
        _OBSERVERS.reset(token)


# -- warnings at the user's line -----------------------------------------------------------------------------------
def first_line(error: BaseException, limit: int = 200) -> str:
    """An exception's message, first line only and at most `limit` characters: for a note or warning."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else ""


def warn(message: str, location: str | None = None, graph=None) -> None:
    """A UserWarning attributed to the user's source line: `location` ("file.py:LINE", resolved to its full path
    through the stack traces of `graph`'s nodes), else the innermost calling frame outside torch and this
    package (the line that called the compiled function)."""
    target = source_line(location, graph)
    if target is not None:
        filename, lineno = target
        registry = _WARNING_REGISTRIES.setdefault(target, {})
        warnings.warn_explicit(message, UserWarning, filename, lineno, registry=registry)
        return
    frame, level = sys._getframe(1), 2
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level if frame is not None else 2)


def source_line(location: str | None, graph=None) -> tuple[str, int] | None:
    """(full path, line) of a "file.py:LINE" location, from the stack traces recorded on the graph's nodes."""
    if not location or ":" not in location or graph is None:
        return None
    name, _, line = location.rpartition(":")
    if not line.isdigit():
        return None
    for node in getattr(getattr(graph, "graph", graph), "nodes", ()):
        trace = getattr(node, "meta", {}).get("stack_trace")
        for path, lineno in _FRAME.findall(trace or ""):
            if lineno == line and os.path.basename(path) == name:
                return path, int(line)
    return None


def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in ("torch", "compile_pass", "compile_pass.kernels", "compile_pass.tools", "compile_pass.examples"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def _is_library(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_library_dirs()):
        return True
    stdlib = os.path.dirname(os.path.abspath(contextlib.__file__))
    return os.path.dirname(path) == stdlib  # contextlib, functools: the wrappers between the user and torch
