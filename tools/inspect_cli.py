"""syncfree-inspect: compile a decode step stock and through `syncfree`, show what the pass did.

    syncfree-inspect TARGET [--max-context-len N] [--page-size N] [--out DIR] [--json] [--strict]
    syncfree-inspect --example NAME

TARGET is `module:function`; the function returns (fn, example_args). Exit status: 0 when no host sync remains
after the pass, 1 when some remain (or --strict refused one), 2 on a usage error, 3 when compiling the target
failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

EXIT_OK, EXIT_SYNCS, EXIT_USAGE, EXIT_COMPILE = 0, 1, 2, 3

LEGEND = ("legend: 'rewritten' = the host read is gone from the compiled step; 'kept' = it stays, as eager "
          "computes it, for the reason given;\n        'still a host sync' counts the kept ones that cost a "
          "device-to-host sync every step (a read of an existing CPU mirror does not).")


class UsageError(Exception):
    pass


class Progress:
    """One line per step on a terminal (stderr); nothing when piped."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.perf_counter()

    def step(self, text: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.start:6.1f}s] {text}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="syncfree-inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", help="module:function returning (fn, example_args)")
    p.add_argument("--example", help="a built-in reference model instead of TARGET (see --list-examples)")
    p.add_argument("--list-examples", action="store_true", help="list the built-in examples and exit")
    p.add_argument("--max-context-len", type=int, help="the static bound (required for TARGET)")
    p.add_argument("--page-size", type=int, help="the page size the gathers must use (default: inferred)")
    p.add_argument("--out", default="syncfree-inspect-out", help="where dumps and reports go")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="compile with strict=True (a kept sync fails)")
    return p


def load_target(spec: str):
    if ":" not in spec:
        raise UsageError(f"TARGET must be module:function, got {spec!r}")
    module_name, func_name = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise UsageError(f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    factory = getattr(module, func_name, None)
    if factory is None:
        raise UsageError(f"module {module_name!r} has no attribute {func_name!r}")
    if not callable(factory):
        raise UsageError(f"{spec} is not callable")
    try:
        result = factory()
    except Exception as e:
        raise UsageError(f"{spec}() raised {type(e).__name__}: {e}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and callable(result[0])
            and isinstance(result[1], (tuple, list))):
        raise UsageError(f"{spec}() must return (fn, example_args), got {type(result).__name__}")
    return result[0], tuple(result[1])


def load_example(name: str):
    from compile_pass.examples import BUILTIN_EXAMPLES, TinyLlamaConfig

    if name not in BUILTIN_EXAMPLES:
        raise UsageError(f"unknown example {name!r}; choose from {', '.join(sorted(BUILTIN_EXAMPLES))}")
    fn, args = BUILTIN_EXAMPLES[name][1]()
    c = TinyLlamaConfig()
    what = (f"example {name!r}: {BUILTIN_EXAMPLES[name][0]} - the built-in tiny Llama ({c.layers} layers, hidden "
            f"{c.hidden}, {c.heads} heads / {c.kv_heads} KV heads, page size {c.page_size}, random weights) on the CPU")
    return fn, args, c.max_context_len, what


def _compile_and_run(fn, args, backend, options, directory: Path, progress: Progress, label: str):
    import torch

    from compile_pass import _compat
    from compile_pass.tools.dump import depyf_context, recording_backend, write_dump

    graphs: list[str] = []
    counters = _compat.graph_counters()

    def fresh_compile():
        torch._dynamo.reset()
        graphs.clear()
        extra = {"options": options} if options else {}  # a plain backend takes no options keyword
        return torch.compile(fn, backend=recording_backend(backend, graphs), **extra)

    compiled = fresh_compile()
    counters.clear()
    ctx, problem = depyf_context(directory)
    progress.step(f"compiling {label} ...")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with ctx, _compat.capture_scalar_outputs():
                _, codes = _compat.run_and_get_code(compiled, *args)
        except Exception as e:
            if problem is not None:
                raise
            problem = f"depyf failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            compiled = fresh_compile()
            with _compat.capture_scalar_outputs():
                _, codes = _compat.run_and_get_code(compiled, *args)
    write_dump(directory, graphs, codes)
    breaks = sum(counters["graph_break"].values())
    return graphs, codes, breaks, problem


def inspect(fn, args, max_context_len, page_size, out: Path, strict: bool, progress: Progress) -> dict:
    from torch._inductor.compile_fx import compile_fx

    import compile_pass
    from compile_pass.backend import syncfree_backend
    from compile_pass.testing import host_reads_in_code as count_host_syncs

    def stock(gm, example_inputs):
        return compile_fx(gm, example_inputs)

    _, before_codes, before_breaks, problem = _compile_and_run(fn, args, stock, None, out / "before", progress,
                                                                "stock Inductor (capture_scalar_outputs)")
    options = {"max_context_len": max_context_len, "page_size": page_size, "strict": strict}
    options = {k: v for k, v in options.items() if v is not None}
    seen = len(compile_pass.reports())
    _, after_codes, after_breaks, _ = _compile_and_run(fn, args, syncfree_backend, options, out / "after",
                                                       progress, "backend='syncfree'")
    # Every graph's report (a step split by graph breaks has several), merged.
    report = compile_pass.SyncReport.merge(compile_pass.reports()[seen:])
    data = report.to_dict()
    data["host_syncs_in_inductor_code"] = {"before": count_host_syncs(before_codes),
                                           "after": count_host_syncs(after_codes)}
    data["graph_breaks"] = {"before": before_breaks, "after": after_breaks}
    data["dump_dir"] = str(out)
    data["dumps"] = {"before": str(out / "before"), "after": str(out / "after")}
    data["depyf"] = {"used": problem is None, "problem": problem}
    data["table"] = str(report)
    return data


def _first_cause(e: BaseException) -> str:
    """'Type: first line' of the error, and of its innermost cause (Dynamo wraps what the user's code raised)."""
    def line(x):
        text = str(x).strip()
        return f"{type(x).__name__}: {text.splitlines()[0] if text else ''}"

    inner = e
    while inner.__cause__ is not None and inner.__cause__ is not inner:
        inner = inner.__cause__
    if inner is not e:
        return f"{line(e)} (caused by {line(inner)})"
    # Dynamo reports a failed fake-tensor call as text: "...: got ValueError('page_size must be >= 1, got 0')"
    got = re.search(r"got (\w+(?:Error|Exception)\(.*\))", str(e))
    return f"{line(e)} ({got.group(1)})" if got else line(e)


def render(data: dict) -> str:
    syncs, breaks = data["host_syncs_in_inductor_code"], data["graph_breaks"]
    lines = [f"compiled: {data['compiled']}", "", data["table"], LEGEND, "",
             f"host syncs in Inductor code:  before {syncs['before']}  ->  after {syncs['after']}",
             f"graph breaks:                 before {breaks['before']}  ->  after {breaks['after']}",
             f"dumps: {data['dumps']['before']} (stock), {data['dumps']['after']} (syncfree); "
             f"report: {data['dump_dir']}/report.md, report.json"]
    if not data["depyf"]["used"]:
        lines.append(f"note: {data['depyf']['problem']}; the FX graphs and Inductor code were dumped without it")
    lines.append("what it buys on a GPU (an H200, a Llama-3-8B-shaped model: the step as one CUDA graph, 3.2x "
                 "the tokens/s of stock torch.compile at batch 1): BENCHMARKS.md")
    return "\n".join(lines)


def remaining(data: dict) -> int:
    return data["syncs_remaining"] + data["host_syncs_in_inductor_code"]["after"]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    progress = Progress(sys.stderr.isatty() and not ns.json)
    try:
        if ns.list_examples:
            from compile_pass.examples import BUILTIN_EXAMPLES

            for name, (text, _) in sorted(BUILTIN_EXAMPLES.items()):
                print(f"{name:12s} {text}")
            return EXIT_OK
        if (ns.target is None) == (ns.example is None):
            raise UsageError("give exactly one of TARGET (module:function) or --example NAME")
        for flag, value in (("--max-context-len", ns.max_context_len), ("--page-size", ns.page_size)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be >= 1, got {value}")
        progress.step("loading the target")
        if ns.example:
            fn, args, default_bound, what = load_example(ns.example)
        else:
            fn, args = load_target(ns.target)
            default_bound, what = None, f"target {ns.target}"
        max_context_len = ns.max_context_len or default_bound
    except UsageError as e:
        print(f"syncfree-inspect: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    from compile_pass import SyncRemainsError

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        data = inspect(fn, args, max_context_len, ns.page_size, out, ns.strict, progress)
    except Exception as e:
        strict_error = e if isinstance(e, SyncRemainsError) else getattr(e, "inner_exception", None)
        if isinstance(strict_error, SyncRemainsError):
            print(f"syncfree-inspect: {strict_error}", file=sys.stderr)
            return EXIT_SYNCS
        print(f"syncfree-inspect: error: compiling the target failed: {_first_cause(e)}", file=sys.stderr)
        return EXIT_COMPILE
    data["exit_status"] = EXIT_SYNCS if remaining(data) else EXIT_OK
    data["compiled"] = what
    (out / "report.json").write_text(json.dumps(data, indent=2, default=str))
    (out / "report.md").write_text("# syncfree-inspect report\n\n```\n" + render(data) + "\n```\n")
    print(json.dumps(data, indent=2, default=str) if ns.json else render(data))
    return data["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
