"""What a newcomer trips on (issue 28): Inductor keys type-checked as stock torch.compile checks them, the two entry
points alike (no bound, a typo, backend=), reports that say which occurrence each row is, and notes and warnings
that point at the right report."""

from __future__ import annotations

import warnings

import pytest
import torch

import compile_pass
from compile_pass import _compat
from compile_pass.options import OptionError, SyncfreeOptions
from passlib import make_fb, make_qkv, run

PAGED = torch.ops.syncfree.paged_decode


def step(fb, q, k, v):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
    return PAGED(q, k, v, table, fb.seq_lens, max_seqlen_k=m)


def args(lengths=(3, 9, 5)):
    return (make_fb(list(lengths)), *make_qkv(len(lengths)))


# -- item 2: Inductor keys are type-checked as stock torch.compile(options=...) checks them --------------------
@pytest.mark.parametrize("key,value", [("max_autotune", "yes"), ("triton.cudagraph_trees", 3),
                                       ("max_autotune", 1), ("fx_graph_cache", None)])
def test_an_inductor_key_of_the_wrong_type_raises_naming_it(key, value):
    with pytest.raises(OptionError, match=rf"options\['{key}'\].*must be bool"):
        SyncfreeOptions.from_dict({"max_context_len": 8, key: value})
    with pytest.raises(OptionError, match=key):
        compile_pass.compile(step, max_context_len=8, **{key: value})


def test_the_backend_checks_inductor_types_at_its_first_call():
    compiled = torch.compile(step, backend="syncfree", fullgraph=True,
                             options={"max_context_len": 32, "max_autotune": "yes"})
    with _compat.capture_scalar_outputs(), pytest.raises(Exception, match="max_autotune"):
        compiled(*args())


@pytest.mark.parametrize("key,value", [("max_autotune", True), ("max_autotune", "yes"), ("compile_threads", 2),
                                       ("compile_threads", "2"), ("triton.cudagraph_trees", 3),
                                       ("triton.cudagraph_trees", False), ("compile_threads", None),
                                       ("cpp.threads", 1.5), ("fallback_random", 0)])
def test_what_stock_torch_compile_refuses_we_refuse(key, value):
    try:
        torch._TorchCompileInductorWrapper("default", {key: value}, False)
        stock_refuses = False
    except RuntimeError:
        stock_refuses = True
    try:
        SyncfreeOptions.from_dict({key: value})
        we_refuse = False
    except OptionError:
        we_refuse = True
    assert we_refuse == stock_refuses, (key, value)


# -- item 3: compile_pass.compile and torch.compile(backend="syncfree") alike ----------------------------------
def test_a_typo_in_compile_says_did_you_mean():
    with pytest.raises(OptionError, match="unknown syncfree option 'max_contxt_len'; did you mean 'max_context_len'"):
        compile_pass.compile(step, max_contxt_len=64)


def test_backend_given_to_compile_says_the_backend_is_fixed():
    with pytest.raises(TypeError, match="backend is fixed"):
        compile_pass.compile(step, max_context_len=64, backend="inductor")


def test_options_dict_is_accepted_by_compile_and_clashes_are_named():
    compile_pass.compile(step, options={"max_context_len": 64, "checked": False})
    with pytest.raises(OptionError, match="max_context_len"):
        compile_pass.compile(step, max_context_len=64, options={"max_context_len": 32})


def test_without_a_bound_both_entry_points_keep_every_max_and_say_so():
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        through_compile = compile_pass.compile(step, fullgraph=True)
        through_compile(*args())
    (report,) = compile_pass.reports(through_compile)
    assert not report.rewritten and [i.reason_code for i in report.kept] == ["no_bound"], str(report)
    assert "max_context_len" in report.kept[0].reason
    assert any("host sync point(s) kept" in str(w.message) for w in caught)
    torch._dynamo.reset()
    by_name = torch.compile(step, backend="syncfree", fullgraph=True)
    with _compat.capture_scalar_outputs():
        by_name(*args())
    assert [(i.reason_code, i.reason) for i in compile_pass.last_report().kept] == \
        [(i.reason_code, i.reason) for i in report.kept]


# -- item 5: which occurrence each row is ------------------------------------------------------------------------
class Attend(torch.nn.Module):
    def forward(self, fb, q, k, v):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
        return PAGED(q, k, v, table, fb.seq_lens, max_seqlen_k=m - 1)  # m - 1: kept, at this one line


class Stack(torch.nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList([Attend() for _ in range(layers)])

    def forward(self, fb, q, k, v):
        for layer in self.layers:
            q = q + layer(fb, q, k, v)
        return q


def test_rows_at_one_line_say_which_occurrence_module_node_and_stack():
    torch._dynamo.reset()
    _, backend, _ = run(Stack(3), *args(), max_context_len=32)
    kept = backend.report.kept
    assert [i.occurrence for i in kept] == [f"{n} of 3 at {kept[0].location}" for n in (1, 2, 3)]
    assert [i.module for i in kept] == ["layers.0", "layers.1", "layers.2"]
    assert len({i.node for i in kept}) == 3 and all(i.node for i in kept)
    assert all(len(i.stack) == 2 and "in forward" in i.stack[0] for i in kept), kept[0].stack
    assert kept[0].stack[-1].startswith(kept[0].location)
    assert f"{kept[0].location} x3" in str(backend.report)  # identical rows: one row, counted
    apart = [compile_pass.SyncItem(i.kind, i.location, f"kept: reason {n}", occurrence=i.occurrence,
                                   module=i.module) for n, i in enumerate(kept)]
    text = str(compile_pass.SyncReport(kept=apart))  # rows that differ say which occurrence each is
    assert f"{kept[0].location} #1/3 layers.0" in text and f"{kept[0].location} #3/3 layers.2" in text
    assert backend.report.to_dict()["kept"][1]["occurrence"] == kept[1].occurrence
    merged = compile_pass.SyncReport.merge([backend.report, backend.report])
    assert merged.kept[5].occurrence.startswith("6 of 6") and kept[2].occurrence.startswith("3 of 3")


def test_identical_rows_still_collapse():
    item = compile_pass.SyncItem("item", "m.py:4", "kept: x", occurrence="1 of 2 at m.py:4")
    again = compile_pass.SyncItem("item", "m.py:4", "kept: x", occurrence="2 of 2 at m.py:4")
    assert "m.py:4 x2" in str(compile_pass.SyncReport(kept=[item, again]))


def test_an_escape_says_where_the_value_that_leaves_is_made():
    def leaks(fb, q, k, v):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
        out = PAGED(q, k, v, table, fb.seq_lens, max_seqlen_k=m)
        return out, table  # the table leaves

    torch._dynamo.reset()
    _, backend, _ = run(leaks, *args(), max_context_len=32)
    (item,) = backend.report.kept
    assert item.reason_code == "escapes" and item.escape_location.startswith("test_newcomer_api.py:")
    assert int(item.escape_location.rsplit(":", 1)[1]) == int(item.location.rsplit(":", 1)[1]) + 1  # table
    assert item.escape_location in str(backend.report)


# -- item 5: the capture note only where a break happened; the warning names the merged reports ----------------
def test_no_capture_note_without_a_break():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, backend="syncfree", options={"max_context_len": 8})
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        compiled(torch.ones(3))
    assert not any("capture_scalar_outputs" in n for n in compile_pass.last_report().notes)


def test_after_a_graph_break_the_warning_points_at_the_merged_reports():
    def broken(fb, q, k, v):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
        return PAGED(q, k, v, table, fb.seq_lens, max_seqlen_k=m) * 2

    torch._dynamo.reset()
    compiled = torch.compile(broken, backend="syncfree", options={"max_context_len": 32})
    before = len(compile_pass.reports())
    with torch._dynamo.config.patch(capture_scalar_outputs=False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(*args())
    graphs = compile_pass.reports()[before:]
    assert len(graphs) >= 2
    kept = [w for w in caught if "host sync point(s) kept" in str(w.message)]
    assert kept and "compile_pass.reports(" in str(kept[0].message)
    merged = compile_pass.SyncReport.merge(graphs)
    assert any(i.kind in ("graph_break", "item") for i in merged.kept)
    assert any("capture_scalar_outputs" in n for n in merged.notes)


# -- item 1: every name and signature docs/api.md documents is the real one -----------------------------------
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
API = (ROOT / "docs" / "api.md").read_text()


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _documented_calls(text: str, prefix: str):
    """(dotted name, parameter text or None) of each backticked `PREFIXname(params) -> ...` in `text`."""
    import re

    for match in re.finditer(r"`" + re.escape(prefix) + r"([\w.]+)(\(|`| ->)", text):
        name = match.group(1)
        if match.group(2) != "(":
            yield name, None
            continue
        depth, i = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield name, text[match.end():i - 1]


def _parameters(params: str):
    import ast

    args = ast.parse(f"def f({params}): pass").body[0].args
    out = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    for a, d in zip(positional, defaults):
        out.append((a.arg, "positional", None if d is None else ast.literal_eval(d)))
    if args.vararg:
        out.append((args.vararg.arg, "*", None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, "keyword", None if d is None else ast.literal_eval(d)))
    if args.kwarg:
        out.append((args.kwarg.arg, "**", None))
    return out


def _real_parameters(obj):
    import inspect

    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional", inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
             inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.KEYWORD_ONLY: "keyword",
             inspect.Parameter.VAR_KEYWORD: "**"}
    return [(p.name, kinds[p.kind], None if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(obj).parameters.values()]


def _resolve(root, dotted: str):
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_documented_function_has_the_documented_signature():
    import compile_pass.options  # noqa: F401
    import compile_pass.report  # noqa: F401
    import compile_pass.testing  # noqa: F401

    checked = 0
    for heading in [line for line in API.splitlines() if line.startswith("### ")]:
        for name, params in _documented_calls(heading, "compile_pass."):
            obj = _resolve(compile_pass, name)  # the documented name exists
            if params is None:
                continue
            real = _real_parameters(obj)
            if name == "syncfree_backend":  # documented as "any other keyword raises"
                real = [p for p in real if p[1] != "**"]
            assert _parameters(params) == real, name
            checked += 1
    testing = _section(API, "Testing helpers")
    for name, params in _documented_calls(testing, ""):
        if params is not None and hasattr(compile_pass.testing, name):
            assert _parameters(params) == _real_parameters(getattr(compile_pass.testing, name)), name
            checked += 1
    assert checked >= 18
    for name in ("register_indptr_reader", "register_indptr_writer", "unregister_flat_kv_facts",
                 "register_bounded_writer", "unregister_bounded_writer"):
        assert f"### `compile_pass.{name}(" in API and name in compile_pass.__all__, name


def test_every_documented_op_has_its_schema():
    ops = _section(API, "Ops (`torch.ops.syncfree`)")
    documented = {name: params for name, params in _documented_calls(ops, "") if params is not None}
    for name in ("page_table", "page_table_", "paged_decode", "fa4_paged", "fa_with_kvcache",
                 "ragged_extend_attention", "store_kv", "kv_indices"):
        schema = getattr(torch.ops.syncfree, name).default._schema
        real = [(a.name, "positional", a.default_value) for a in schema.arguments]
        assert _parameters(documented[name]) == real, name
        assert "[" in ops.split(f"`{name}(", 1)[1].split("\n- ", 1)[0], f"{name}: no shapes"  # shapes given


def test_every_option_in_the_table_is_real_and_every_real_one_is_in_it():
    import re

    from compile_pass.options import _ours

    table = _section(API, "Backend options")
    names = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert names == _ours(), names ^ _ours()


def test_the_bad_lengths_table_is_one_table_in_readme_and_api():
    readme = (ROOT / "README.md").read_text()

    def table(text):
        section = _section(text, "Bad lengths")
        return [line for line in section.splitlines() if line.startswith("|")]

    assert table(readme) == table(API) and len(table(API)) >= 8


# -- item 7: TORCH_LOGS records name the caller's file, relative, as torch's records do -----------------------
def test_log_records_name_the_calling_file_relative_to_the_package_root():
    import unittest

    from torch._logging._internal import TorchLogsFormatter

    torch._dynamo.reset()
    with unittest.TestCase().assertLogs("compile_pass", level="INFO") as captured:
        torch.compile(lambda x: x + 1, backend="syncfree", options={"max_context_len": 8})(torch.ones(2))
    for record in captured.records:
        assert record.filename == "backend.py", record.pathname  # the caller, not log.py
        shown = TorchLogsFormatter().format(record)
        assert "compile_pass/backend.py:" in shown and str(ROOT) not in shown, shown


# -- item 8: make test-fast leaves out the slow suites and make test runs everything ---------------------------
def test_make_test_fast_skips_the_slow_suites_and_make_test_runs_all():
    makefile = (ROOT / "Makefile").read_text()
    fast = makefile.split("FAST_SKIP :=", 1)[1].split("\ntest-fast:", 1)[0]
    for suite in ("tests/suites", "tests/sglang", "tests/relations/test_branch_outcomes.py"):
        assert f"--ignore={suite}" in fast, suite
    recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "--ignore" not in recipe and "-m \"" not in recipe and " -k " not in recipe and recipe.endswith(" tests")
    assert "make test-fast" in (ROOT / "README.md").read_text()


# Ops without facts, defined once at import (an op defined in a test body would be dropped with its CustomOpDef).
@torch.library.custom_op("syncfree_newcomer_test::unregistered_sum", mutates_args=())
def unregistered_sum(table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return table.sum(1).to(torch.float32) + lens


@unregistered_sum.register_fake
def _(table, lens):
    return lens.new_empty(lens.shape, dtype=torch.float32)


@torch.library.custom_op("syncfree_newcomer_test::flat_sum", mutates_args=())
def flat_sum(indices: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return indices.sum().to(torch.float32) + lens


@flat_sum.register_fake
def _(indices, lens):
    return lens.new_empty(lens.shape, dtype=torch.float32)


def test_a_kept_reason_that_needs_a_registration_names_the_call():
    """An op without facts keeps the max, and the reason says which registration would give it facts."""
    import torch.nn.functional as F
    from passlib import make_fb, run

    def step(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_newcomer_test.unregistered_sum(fb.req_to_token[fb.req_pool_indices, :m],
                                                                 fb.seq_lens)

    _, backend, _ = run(step, make_fb([3, 9, 5]), max_context_len=64)
    (item,) = backend.report.kept
    assert item.reason_code == "not_a_consumer"
    assert "compile_pass.register_self_guarding_consumer(" in item.reason and "table, lens" in item.reason

    def flat(fb):
        indptr = F.pad(torch.cumsum(fb.seq_lens, 0), (1, 0))
        kv = torch.empty(fb.seq_lens.sum().item(), dtype=torch.int32)
        torch.ops.syncfree.kv_indices(kv, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, indptr)
        return torch.ops.syncfree_newcomer_test.flat_sum(kv, fb.seq_lens)

    _, backend, _ = run(flat, make_fb([3, 9, 5]), max_context_len=64)
    (item,) = backend.report.kept
    assert item.reason_code == "not_a_consumer"
    assert "compile_pass.register_indptr_reader(" in item.reason and "register_indptr_writer(" in item.reason
