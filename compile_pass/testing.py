"""Gate your own compiled decode code on sync-freedom, in your tests.

    from compile_pass.testing import assert_sync_free

    def test_decode_step_is_sync_free():
        result = assert_sync_free(decode_step, batch, k_pool, v_pool, max_context_len=32768, cudagraphs=True)
        assert result.report.rewritten

`assert_sync_free` compiles `fn` through `compile_pass.compile` (fullgraph: the same trace, so the same decisions:
a max of declared lengths gets its range while Dynamo traces, registered launchers and Structs are modelled) and
proves the step sync-free the
three ways of docs/design.md: (1) the post-grad graph holds no `_local_scalar_dense`, `_assert_scalar` or free
unbacked symbol (also on an FX-graph-cache hit), (2) Inductor's code holds no `.item()`, (3) on CUDA, replays
run under `torch.cuda.set_sync_debug_mode("error")` and, with cudagraphs, Inductor made one cudagraphable
partition. On failure it raises `SyncCheckFailed` (an AssertionError) whose message is the report's table: each
kept sync with its file:line and reason. It leaves no global state changed: capture_scalar_outputs and the
sync debug mode are restored, and it compiles a fresh code object (a copy of `fn`'s own, same body, file and
lines), so Dynamo's caches of your functions (and `fn`'s own) are untouched. A step that is already compiled (by
torch.compile, which keeps the backend it was given) is checked through its original function, with a one-line
warning saying so.

The pytest plugin (`compile_pass.pytest_plugin`, registered through the `pytest11` entry point) gives a
`syncfree` fixture that calls this and `--syncfree-report PATH` to write every checked step's report as JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import types
import warnings
from typing import Any, Callable

import torch

from . import _compat
from .backend import compile as _compile
from .report import SyncReport, reports

HOST_READ = re.compile(r"\.item\(\)|_local_scalar_dense")
_FRESH = itertools.count()
WRAPPER_PREFIX = "syncfree_check_"  # the name of the wrapper _fresh_function puts around a callable object


class SyncCheckFailed(AssertionError):
    """A compiled step is not sync-free; the message says which proof failed and shows the report."""

    def __init__(self, message: str, result: "SyncCheck"):
        super().__init__(message)
        self.result = result


@dataclasses.dataclass
class SyncCheck:
    """What assert_sync_free established about one step."""

    report: SyncReport  # every graph's report, merged
    output: Any  # the compiled step's output (of the last call)
    inductor_code: list[str]
    host_reads_in_code: int
    replays_checked: int  # CUDA replays run under sync debug mode "error" (0 on the CPU)
    cudagraph_log: list[str]

    def to_dict(self) -> dict:
        return {"report": self.report.to_dict(), "host_reads_in_code": self.host_reads_in_code,
                "replays_checked": self.replays_checked, "cudagraph_log": list(self.cudagraph_log)}


def host_reads_in_code(codes: list[str]) -> int:
    """Host reads (`.item()`, `_local_scalar_dense`) in Inductor's generated code."""
    return sum(len(HOST_READ.findall(code)) for code in codes)


def _fresh_function(fn: Callable) -> Callable:
    """`fn` with a code object of its own: Dynamo caches per code object, so checking never touches the caches of
    `fn` or of anything else, and many checks never pile up recompiles on one code object.

    A plain function (or a bound method) is copied with the same body, file, lines and name: the frame Dynamo
    traces first is the user's own, as when compile_pass.compile gets `fn` itself (the trace-time range of a
    max in that frame, a branch traced at the bound), and the report's stacks start at the user's code. Another
    callable (an nn.Module, an object with __call__) is called from a fresh wrapper, as compile_pass.compile
    traces such a callable from torch's own frame; the wrapper's frame is taken out of the report's stacks."""
    target = getattr(fn, "__func__", fn)
    if isinstance(target, types.FunctionType):
        fresh = types.FunctionType(target.__code__.replace(), target.__globals__, target.__name__,
                                   target.__defaults__, target.__closure__)
        fresh.__kwdefaults__ = dict(target.__kwdefaults__) if target.__kwdefaults__ else None
        fresh.__dict__.update(target.__dict__)
        fresh.__qualname__, fresh.__module__, fresh.__doc__ = target.__qualname__, target.__module__, target.__doc__
        self = getattr(fn, "__self__", None)
        return types.MethodType(fresh, self) if target is not fn and self is not None else fresh

    def check_target(*args, **kwargs):
        return fn(*args, **kwargs)

    code = check_target.__code__.replace(co_name=f"{WRAPPER_PREFIX}{next(_FRESH)}")
    fresh = types.FunctionType(code, check_target.__globals__, code.co_name, None, check_target.__closure__)
    return functools.wraps(fn)(fresh)


def uncompiled(fn: Callable) -> tuple[Callable, str | None]:
    """(fn, None), or for a step that is already compiled its original function and what compiled it
    ("torch.compile" or "compile_pass.compile"). A compiled step keeps the backend and the tracing it was given,
    so the entry points (assert_sync_free, the plugin, syncfree-inspect) trace its original function through
    compile_pass.compile, and say so in one line."""
    if getattr(fn, "_syncfree_compiled", None) is not None and getattr(fn, "__wrapped__", None) is not None:
        return fn.__wrapped__, "compile_pass.compile"
    original = getattr(fn, "_orig_mod", None) if isinstance(fn, torch.nn.Module) else None
    if original is None:
        original = getattr(fn, "_torchdynamo_orig_callable", None)
    if original is not None:
        return original, "torch.compile"
    return fn, None


ALREADY_COMPILED = ("{what} was already compiled by {by}, which keeps the backend it was given: its original "
                    "function is traced through compile_pass.compile instead")


def _user_frames_only(report: SyncReport) -> None:
    """The fresh wrapper of a callable that is not a function is no frame of the user's: out of every stack."""
    for item in report.rewritten + report.kept:
        item.stack = [frame for frame in item.stack if f" in {WRAPPER_PREFIX}" not in frame]


def _on_cuda(value, depth: int = 4) -> bool:
    """Does any tensor reachable from the arguments live on CUDA (containers, dataclasses, plain objects such
    as an engine's batch)?"""
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if depth == 0:
        return False
    if isinstance(value, dict):
        return any(_on_cuda(v, depth - 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_on_cuda(v, depth - 1) for v in value)
    fields = getattr(value, "__dict__", None)
    return isinstance(fields, dict) and any(_on_cuda(v, depth - 1) for v in fields.values())


def replay_without_sync(fn: Callable, *args, replays: int = 3):
    """Proof 3: call `fn(*args)` `replays` times under torch.cuda.set_sync_debug_mode("error") (the mode is
    restored). Returns (last output, replays done, None or what synchronised)."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    output, done = None, 0
    try:
        for _ in range(replays):
            output = fn(*args)
            done += 1
    except RuntimeError as e:
        import traceback

        where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)]
        return output, done, (f"a replay synchronised the host ({str(e).splitlines()[0]}; at "
                              f"{' <- '.join(reversed(where[-4:]))})")
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return output, done, None


def assert_sync_free(fn: Callable, *args, max_context_len: int, replays: int = 3, **options) -> SyncCheck:
    """Compile `fn(*args)` through the backend and prove it sync-free three ways; raise SyncCheckFailed if not.

    `options` are compile_pass.compile's (page_size, checked, cudagraphs, cpu_mirrors, static_escapes, Inductor
    patches). Arguments are passed as they are: use copies if the step writes its inputs (a KV pool).
    """
    __tracebackhide__ = True  # pytest shows the failure (the report), not this function's source
    fn, by = uncompiled(fn)
    if by is not None:
        warnings.warn("syncfree: assert_sync_free: " + ALREADY_COMPILED.format(what="the step", by=by), stacklevel=2)
    compiled = _compile(_fresh_function(fn), max_context_len=max_context_len, fullgraph=True, **options)
    cuda = _on_cuda(args)
    log: list[str] = []
    with _compat.CudagraphSkips() as skips:
        output, codes = _compat.run_and_get_code(compiled, *args)
        if not codes:  # served whole from a cache that bypassed code generation: compile once more without it
            compiled = _compile(_fresh_function(fn), max_context_len=max_context_len, fullgraph=True,
                                **{**options, "fx_graph_cache": False})
            output, codes = _compat.run_and_get_code(compiled, *args)
        replayed, failure = 0, None
        if cuda:
            for _ in range(2):  # CUDA-graph recording and warm-up may synchronise; replays may not
                output = compiled(*args)
            output, replayed, failure = replay_without_sync(compiled, *args, replays=replays)
        log, partitions = list(skips.messages), skips.partitions()
    report = SyncReport.merge(reports(compiled))
    _user_frames_only(report)
    result = SyncCheck(report, output, codes, host_reads_in_code(codes), replayed, log)
    problems = []
    if report.syncs_remaining:
        problems.append(f"{report.syncs_remaining} host sync point(s) kept by the pass")
    post_grad = report.post_grad
    if post_grad is None:
        problems.append("the post-grad check did not run (the graph was compiled outside Inductor)")
    elif post_grad["local_scalar_dense"] or post_grad["assert_scalar"] or post_grad["unbacked_symbols"]:
        problems.append(f"the post-grad graph reads the host or holds data-dependent sizes: "
                        f"{post_grad['local_scalar_dense']} _local_scalar_dense, {post_grad['assert_scalar']} "
                        f"_assert_scalar, unbacked symbols {post_grad['unbacked_symbols']} at "
                        f"{', '.join(post_grad['reads']) or 'no recorded line'}")
    if result.host_reads_in_code:
        problems.append(f"Inductor's code reads the host {result.host_reads_in_code} time(s) (.item())")
    if failure:
        problems.append(failure)
    if cuda and options.get("cudagraphs"):
        if any(not p.startswith("Created 1 graph partition") or "0 cudagraphable" in p for p in partitions) \
                or any("skipping cudagraphs" in text for text in log):
            problems.append(f"not one CUDA-graph partition: {partitions or log[-3:]}")
    if problems:
        raise SyncCheckFailed("the compiled step is not sync-free:\n  - " + "\n  - ".join(problems)
                              + "\n\n" + str(report), result)
    return result
