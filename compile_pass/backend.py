"""The `syncfree` torch.compile backend and `compile_pass.compile`.

    user fn --Dynamo--> FX graph --SyncPass (rules/)--> rewritten graph --compile_fx + SyncFreeCheck--> callable
                                                    while compile_fx runs: kernel_warmup (this package's kernels)

The pass returns a typed PassResult; the backend decides from it (strict, CUDA graphs, the per-call guard on
inputs assumed distinct) and builds the report once.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable

import torch
import torch.fx

from . import _compat, kernel_warmup, log, pipeline, tracing
from .input_guard import guard_disjoint_inputs
from .normalize import is_full_max
from .options import OptionError, SyncfreeOptions
from .sync_pass import PassResult
from .traced_ranges import Retrace
from .post_grad_check import (SyncFreeCheck, collecting, findings_key, has_host_reads, load_findings,
                              save_findings, with_existing_pass)
from .traceable import fix_for
from .report import (SyncItem, SyncRemainsError, SyncReport, collecting_reports, format_disjoint_note, node_location,
                     number_occurrences, set_last_report)

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
                    items.append(SyncItem("item", node_location(value),
                                          "kept: graph break at .item(): " + CAPTURE_FIX))
    return items


def _mode_options(mode: str | None) -> dict[str, Any]:
    if mode in (None, "default"):
        return {}
    if mode == "reduce-overhead":
        return {"cudagraphs": True}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def run_sync_pass(gm: torch.fx.GraphModule, opts: SyncfreeOptions) -> PassResult:
    """The pipeline's steps on a Dynamo graph (compile_pass.pipeline); the pass's typed result."""
    return pipeline.run(gm, opts).result


def syncfree_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                     mode: str | None = None, **unexpected):
    """torch.compile(fn, backend="syncfree", options={"max_context_len": 4096, ...})."""
    if unexpected:
        raise TypeError(f"syncfree backend got unexpected arguments {sorted(unexpected)}; pass options={{...}}")
    opts = SyncfreeOptions.from_dict({**_mode_options(mode), **(options or {})})
    start = time.perf_counter()
    kernel_warmup.prepare()  # the kernel compile helper starts while the pass runs
    try:
        rewritten = _compat.copy_dynamo_graph_module(gm)
        state = pipeline.run(rewritten, opts)
        report = report_of(state.result, opts)
        log.graph_rewritten(gm, rewritten)
    except Retrace:
        raise  # compile_pass.compile traces the frame again, without assuming a branch at the bound
    except Exception as e:  # an internal error never breaks the user's compile
        if opts.strict:
            raise
        log.warn(f"syncfree: the pass failed ({type(e).__name__}: {e}); compiling the graph untouched")
        rewritten = gm
        state = pipeline.run(gm, opts, pipeline.DECISIONS)  # the untouched graph: only the compile's decisions
        report = SyncReport(options=opts.to_dict(), fell_back=True,
                            notes=[f"the pass failed ({type(e).__name__}: {e}); the graph was compiled untouched"])
    report.pass_seconds = time.perf_counter() - start
    kernel_warmup.start(rewritten)  # this package's kernels compile in the background while Inductor runs
    explain_missing_bound(report, mode, opts)
    try:
        return _compile_rewritten(gm, rewritten, example_inputs, report, state)
    finally:
        report.backend_seconds = time.perf_counter() - start
        number_occurrences(report.rewritten + report.kept, gm.graph)  # the post-grad check's items too
        log.report_finished(report)


def missing_bound_hint(mode: str) -> str:
    return (f"mode={mode!r} was given without max_context_len, and torch.compile takes no options= together "
            f"with mode=: use compile_pass.compile(fn, max_context_len=N, cudagraphs=True) (what "
            f"mode='reduce-overhead' maps to), or torch.compile(fn, backend='syncfree', "
            f"options={{'max_context_len': N, 'cudagraphs': True}})")


def explain_missing_bound(report: SyncReport, mode: str | None, opts: SyncfreeOptions) -> None:
    """A bound is missing because `mode=` went to torch.compile (which then refuses options=): say how to give
    both, in the report's notes and on each item kept for want of a bound."""
    if mode in (None, "default") or opts.max_context_len is not None:
        return
    hint = missing_bound_hint(mode)
    for item in report.kept:
        if item.reason_code == "no_bound":
            item.reason += "; " + hint
    if report.kept:
        report.notes.append(hint)


def report_of(result: PassResult, opts: SyncfreeOptions) -> SyncReport:
    """The report of one graph, built once from the pass's result."""
    report = SyncReport(rewritten=list(result.rewritten), kept=list(result.kept), notes=list(result.notes),
                        options=opts.to_dict(), disjoint_inputs=list(result.disjoint_inputs))
    if result.disjoint_names:
        report.notes.append(format_disjoint_note(result.disjoint_names))
    number_occurrences(report.rewritten + report.kept)
    return report


def _new_graph_breaks() -> list[SyncItem]:
    """Graph breaks Dynamo recorded since the last graph it handed us: those at a host read cost a sync. Each
    break Dynamo records is returned once (marked on Dynamo's own record): after torch._dynamo.reset() an
    identical break of the same step compiled again is a new one (a count and the last break's text were not
    enough to tell)."""
    new = _compat.unseen_graph_break_reasons()
    items = []
    for reason, location in new:
        host = any(word in reason for word in ("generic_jump", "item()", ".item", "tolist", "numpy",
                                               "data-dependent", "Data-dependent", "__bool__"))
        first = reason.strip().splitlines()[0][:160] if reason.strip() else "unknown reason"
        why = (f"kept: Dynamo broke the graph here ({first}); the Python code after the break reads the value on "
               "the host" if host else f"graph break here ({first}); no host read is known to be involved")
        if "capture_scalar_outputs" in reason:
            why = "kept: graph break at .item(): " + CAPTURE_FIX
        fix = fix_for(reason)
        if fix is not None:
            why += "; " + fix
        if host and "data-dependent" in reason:  # a branch the backend traced both ways and could not decide
            why += "".join("; " + text for text in tracing.undecided_branches())
        items.append(SyncItem("graph_break", location, why, host, "", "graph_break" if host else ""))
    return items


def _compile_rewritten(gm, rewritten, example_inputs, report: SyncReport, state: pipeline.PipelineState):
    opts = state.options
    static_inputs = list(zip(state.result.static_inputs, state.result.static_names)) if state.result else []
    breaks = _new_graph_breaks()
    report.kept.extend(item for item in breaks if item.host_sync)
    report.notes.extend(item.location + ": " + item.reason for item in breaks if not item.host_sync)
    if not _compat.capture_scalar_outputs_enabled():
        if not any(i.kind == "graph_break" and i.host_sync for i in report.kept):
            report.kept.extend(_graph_break_items(gm))
        if any(CAPTURE_FIX in i.reason for i in report.kept):  # only where Dynamo did break at a host read
            report.notes.append(CAPTURE_FIX)
    number_occurrences(report.rewritten + report.kept, gm.graph)
    set_last_report(report)
    if opts.strict and report.syncs_remaining:
        raise SyncRemainsError([i for i in report.kept if i.host_sync])
    empty = [i for i in report.kept if i.reason_code == "empty_lengths"]
    if empty:
        # An empty batch (B = 0): eager raises at the max of empty lengths, and so does this graph, run as
        # captured (Inductor cannot lower a max over zero elements): one message, no Inductor failure.
        report.notes.append(EMPTY_BATCH)
        log.warn(f"syncfree: {EMPTY_BATCH} ({empty[0].where()})", location=empty[0].location, graph=gm)
        report.post_grad = None
        return guard_disjoint_inputs(rewritten.forward, gm, report.disjoint_inputs)
    if report.syncs_remaining:
        kept = [i for i in report.kept if i.host_sync]
        lines = "; ".join(f"{i.kind} at {i.where()}" for i in kept)
        hint = next((n for n in report.notes if "without max_context_len" in n), None)
        log.warn(f"syncfree: {report.syncs_remaining} host sync point(s) kept: {lines} "
                 + f"({hint or where_to_read(report)})", location=kept[0].location, graph=gm)

    patches, keeps_host_read, outlined = state.patches, state.keeps_host_read, state.outlined
    report.notes.extend(state.notes)
    if outlined is not None:
        try:
            compiled = _compile_final(gm, outlined.gm, example_inputs, report, opts, static_inputs,
                                      dict(patches), keeps_host_read)
            report.notes.append(outlined.note())
            return compiled
        except SyncRemainsError:
            raise
        except Exception as e:  # never fail a compile that would succeed without the option
            first = log.first_line(e)
            note = (f"outline_repeats: the outlined graph failed to compile ({type(e).__name__}: {first}); "
                    "compiled as traced instead")
            log.warn(f"syncfree: {note}")
            report.notes.append(note)
    return _compile_final(gm, rewritten, example_inputs, report, opts, static_inputs, patches, keeps_host_read)


def _compile_final(gm, rewritten, example_inputs, report: SyncReport, opts: SyncfreeOptions, static_inputs,
                   patches: dict, keeps_host_read: bool):
    """compile_fx of the graph to run, the post-grad check, CUDA graphs where they can run: the compiled callable,
    guarded for the inputs the rewrites assume disjoint."""
    marked, static_notes = mark_static_scratch(rewritten, static_inputs) if patches.get("triton.cudagraphs") \
        else ([], [])
    try:
        compiled, findings, check_seconds = _compile_checked(rewritten, example_inputs, patches, opts)
    except Exception as e:
        if opts.strict or not keeps_host_read:
            raise
        # Inductor could not compile a graph that keeps a host read (torch 2.11/2.12 fail lowering CPU SDPA
        # over an unbacked width, as stock torch.compile does with capture_scalar_outputs on): run this graph
        # as captured, without Inductor, rather than fail a compile that stock torch.compile would finish.
        first = log.first_line(e)
        note = (f"inductor failed on this graph, which keeps a host read ({type(e).__name__}: {first}); "
                "it runs as captured, without Inductor, with its host read")
        log.warn(f"syncfree: {note}")
        report.notes.append(note)
        report.post_grad = None
        return guard_disjoint_inputs(rewritten.forward, gm, report.disjoint_inputs)
    if has_host_reads(findings) and patches.get("triton.cudagraphs"):
        patches.pop("triton.cudagraphs")
        report.notes.append(CUDAGRAPHS_OFF)
        unmark_static_scratch(rewritten, marked)
        marked, static_notes = [], []
        report.pass_seconds += check_seconds
        compiled, findings, check_seconds = _compile_checked(rewritten, example_inputs, patches, opts)
    report.notes.extend(static_notes)
    report.post_grad = findings
    report.pass_seconds += check_seconds
    _account_post_grad(report, findings)
    if opts.strict and has_host_reads(findings):
        raise SyncRemainsError([i for i in report.kept if i.host_sync],
                               extra=f"the post-grad graph still reads the host: {findings}")
    return guard_disjoint_inputs(compiled, gm, report.disjoint_inputs, marked)


STATIC_SCRATCH = ("cudagraphs: {names}: the persistent buffer the step writes in place through its bounded writer "
                  "(the allocated table's scratch) is a static input of the CUDA graph, written in place as in "
                  "eager; a new address re-records the graph")
STATIC_SCRATCH_KEPT = ("cudagraphs: {names}: the persistent buffer the step writes in place is not made a static "
                       "input ({why}); CUDA graphs skip a graph that writes an input that is not static")


def mark_static_scratch(gm: torch.fx.GraphModule, static_inputs) -> tuple[list[int], list[str]]:
    """Under CUDA graphs, the graph inputs the pass proved to be persistent buffers written in place by a
    registered bounded writer (PassResult.static_inputs: the allocated-table rule's sliced scratch) become static
    inputs of the graph, as mark_static_address would make them: CUDA graph trees otherwise skip a graph that
    writes an input in place ("mutated inputs"). Nothing else is marked. Only where a new address re-records the
    graph, and only for an input aligned at compile time (Inductor then assumes it stays so; the per-call guard
    runs the untouched graph where it does not). Returns the positions marked here and the report's notes."""
    if not static_inputs:
        return [], []
    names = ", ".join(name for _, name in static_inputs)
    if not _compat.static_inputs_rerecord():
        return [], [STATIC_SCRATCH_KEPT.format(names=names, why="CUDA graph trees would fail, not re-record, on "
                                                                "a new address")]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    marked, done, unaligned = [], [], []
    for position, name in static_inputs:
        node = placeholders[position] if position < len(placeholders) else None
        value = _compat.example_value(node)
        if node is None or not isinstance(value, torch.Tensor):
            continue
        if not _compat.statically_aligned(value):
            unaligned.append(name)
        elif _compat.mark_static_placeholder(node):
            marked.append(position)
            done.append(name)
    notes = [STATIC_SCRATCH.format(names=", ".join(done))] if done else []
    if unaligned:
        notes.append(STATIC_SCRATCH_KEPT.format(names=", ".join(unaligned), why="its storage offset is not known "
                                                "to be aligned"))
    return marked, notes


def unmark_static_scratch(gm: torch.fx.GraphModule, marked) -> None:
    """The graph is compiled again without CUDA graphs: the scratch marked for them is an ordinary input again."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position in marked:
        _compat.unmark_static_placeholder(placeholders[position])


EMPTY_BATCH = ("an empty batch (no lengths): eager raises at the max of empty lengths, and so does this step; its "
               "graph runs as captured, without Inductor (a batch of at least one row compiles as usual)")


MERGED_REPORTS_HINT = ("the step has more than one graph (a graph break): compile_pass.reports(step) holds every "
                       "graph's report (reports() for torch.compile), SyncReport.merge(...) joins them; "
                       "last_report() is only the latest graph's")


def where_to_read(report: SyncReport) -> str:
    """Which call shows why: the merged reports after a graph break (the graph compiled last is the one after the
    break, not this one), else last_report()."""
    if any(i.kind == "graph_break" or CAPTURE_FIX in i.reason for i in report.kept):
        return MERGED_REPORTS_HINT
    return "compile_pass.last_report() says why"


CUDAGRAPHS_OFF = pipeline.CUDAGRAPHS_OFF


def _compile_checked(gm, example_inputs, patches: dict, opts: SyncfreeOptions):
    """compile_fx with the post-grad check; its findings come from the check, or from the store on an
    FX-graph-cache hit, or from one more compile without the cache. Returns (compiled, findings, seconds the
    check took)."""
    check = SyncFreeCheck(opts.fingerprint())
    patches = {**patches, "post_grad_custom_post_pass": with_existing_pass(check, patches)}
    key = findings_key(check, gm, example_inputs, patches)
    findings: dict = {}
    with collecting(findings):
        compiled = _compat.compile_fx(gm, example_inputs, patches)
    if not findings:
        stored = load_findings(key)
        if stored is not None:
            return compiled, stored, 0.0  # a cache hit: the check did not run for this compile
        with collecting(findings):
            compiled = _compat.compile_fx(gm, example_inputs, {**patches, "fx_graph_cache": False})
    check_seconds = findings.pop("check_seconds", 0.0)
    save_findings(key, findings)
    return compiled, dict(findings), check_seconds


def _account_post_grad(report: SyncReport, findings: dict) -> None:
    """Every host read the post-grad check finds is in the report, whether or not the pass recognised it."""
    known = {i.location for i in report.kept}
    for location in findings.get("reads", []):
        if location not in known:
            report.kept.append(SyncItem("post_grad", location,
                                        "kept: a host read (_local_scalar_dense) found in the post-grad graph, in "
                                        "a form the pass does not recognise", reason_code="post_grad"))
            known.add(location)
    if findings.get("unbacked_symbols") and not any(i.host_sync for i in report.kept) \
            and not findings.get("reads"):
        report.kept.append(SyncItem("post_grad", "<unknown>",
                                    "kept: data-dependent sizes remain in the post-grad graph "
                                    f"({', '.join(findings['unbacked_symbols'])})", reason_code="post_grad"))


_TORCH_COMPILE_KWARGS = {"fullgraph", "dynamic", "disable"}


def warm_compile_workers() -> bool:
    """On a GPU machine, start Inductor's compile workers when a step is compiled rather than when its first graph
    reaches Inductor: they come up during Dynamo's trace (the regional 8B step's cold call on the H200: 21.0 ->
    17.1 s, benchmarks' `prewarm-pool` knob). SYNCFREE_PREWARM_WORKERS=0 leaves them to Inductor. Never raises."""
    import os

    if os.environ.get("SYNCFREE_PREWARM_WORKERS", "1") == "0" or not torch.cuda.is_available():
        return False
    try:
        return _compat.warm_compile_workers()
    except Exception as e:  # noqa: BLE001 - a pool that cannot start now starts (or fails) as Inductor's own
        log.log.debug("compile workers not started early: %s", e)
        return False


def compile(fn: Callable, *, max_context_len: int | None = None, page_size: int | None = None,
            strict: bool = False, cudagraphs: bool | None = None, mode: str | None = None, **kw) -> Callable:
    """Like torch.compile(fn, backend="syncfree", options=...), with capture_scalar_outputs on while Dynamo
    traces (it is read at the first call, not at torch.compile()).

    `max_context_len` is the static bound; without it (None) every max is kept and the report says so, as
    through torch.compile(backend="syncfree"). `mode` is mapped as the backend maps it ("reduce-overhead" ->
    cudagraphs=True, "max-autotune" -> its Inductor patches); `cudagraphs`, when given, wins over the mode.
    Keyword arguments fullgraph/dynamic/disable go to torch.compile; any other goes into the backend's options
    (checked, cpu_mirrors, static_escapes, Inductor config patches) and an unknown one raises here, naming it.
    """
    if "backend" in kw:
        raise TypeError("compile_pass.compile's backend is fixed (syncfree); drop backend=, or call "
                        "torch.compile(fn, backend=...) for another backend")
    if "options" in kw:  # torch.compile's spelling: the same options, as a dict
        given = kw.pop("options")
        if not isinstance(given, dict):
            raise OptionError(f"options must be a dict, got {type(given).__name__}")
        named = {"max_context_len": max_context_len, "page_size": page_size, "strict": strict,
                 "cudagraphs": cudagraphs, "mode": mode}
        both = sorted(k for k in given if k in kw or named.get(k) not in (None, False))
        if both:
            raise OptionError(f"option(s) {both} given both as keywords and in options=")
        kw.update({k: v for k, v in given.items() if k not in named})
        max_context_len = given.get("max_context_len", max_context_len)
        page_size = given.get("page_size", page_size)
        strict = given.get("strict", strict)
        cudagraphs = given.get("cudagraphs", cudagraphs)
        mode = given.get("mode", mode)
    compile_kwargs = {k: kw.pop(k) for k in list(kw) if k in _TORCH_COMPILE_KWARGS}
    options = {**_mode_options(mode), "max_context_len": max_context_len, "page_size": page_size,
               "strict": strict, **kw}
    if cudagraphs is not None:
        options["cudagraphs"] = cudagraphs
    opts = SyncfreeOptions.from_dict(options)  # fail now, naming the bad option
    policy = tracing.TracingPolicy.from_options(opts, fn)
    compiled = torch.compile(fn, backend=syncfree_backend, options=options, **compile_kwargs)
    warm_compile_workers()
    graph_reports: list[SyncReport] = []
    tracing.hook_frame_compiles()

    @contextlib.contextmanager
    def while_compiling():
        """What a call gives Dynamo where it compiles a frame of it (tracing.call_traced): entered per frame
        compile, not per call (issue 43: a call Dynamo's cache serves runs none of it)."""
        with _compat.capture_scalar_outputs(), tracing.bounded_maxima(policy), collecting_reports(graph_reports):
            yield

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return tracing.call_traced(compiled, policy, while_compiling, *args, **kwargs)
        except Exception as e:  # Dynamo wraps backend errors; a strict failure should read as itself
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, SyncRemainsError):
                raise inner from None
            raise

    run._syncfree_compiled = compiled  # type: ignore[attr-defined]
    run._syncfree_reports = graph_reports  # type: ignore[attr-defined]  (compile_pass.reports(run))
    run._syncfree_options = opts  # type: ignore[attr-defined]  (compile_pass.cache.options_of: load_compiled)
    return run
