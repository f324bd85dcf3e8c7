"""What a user reads in a report (issue 44, item 6): to_dict() carries every field (disjoint_inputs too), the table
folds a reason's parts repeated once per layer (`max_seqlen_k -> 64 x4`) while to_dict() keeps them, reasons name
the user's arguments instead of Dynamo's placeholders, and docs/api.md lists every SyncItem.kind the code makes.

Steps are compiled through compile_pass.compile with Inductor's compile_fx replaced by the graph itself: the
report is made before Inductor runs."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest
import torch

import compile_pass
from compile_pass.report import SyncItem, SyncReport, fold_repeated_parts, readable_source

ROOT = pathlib.Path(__file__).resolve().parent.parent
PS = 4


@pytest.fixture
def no_inductor(monkeypatch):
    import torch._inductor.compile_fx as inductor_compile_fx

    monkeypatch.setattr(inductor_compile_fx, "compile_fx", lambda gm, example_inputs, *a, **k: gm.forward)


def _compiled_report(fn, *args, **options) -> SyncReport:
    step = compile_pass.compile(fn, **options)
    with torch.no_grad():
        step(*args)
    return SyncReport.merge(compile_pass.reports(step))


def _paged(lengths=(5, 9)):
    g = torch.Generator().manual_seed(0)
    r2t = torch.randperm(4 * 64, generator=g).to(torch.int32).view(4, 64)
    b = len(lengths)
    return (torch.randn(b, 1, 4, 8, generator=g), torch.randn(64, PS, 2, 8, generator=g),
            torch.randn(64, PS, 2, 8, generator=g), r2t, torch.tensor([1, 3][:b]), torch.tensor(lengths))


# -- to_dict ---------------------------------------------------------------------------------------------------
def test_to_dict_carries_every_field_of_the_report():
    report = SyncReport(rewritten=[SyncItem("item", "a.py:1", "rewritten: x")], disjoint_inputs=[(0, 3), (1, 3)],
                        notes=["n"], options={"max_context_len": 8}, fell_back=False)
    data = report.to_dict()
    fields = {f.name for f in dataclasses.fields(SyncReport)}
    assert fields <= set(data), fields - set(data)
    assert data["disjoint_inputs"] == [[0, 3], [1, 3]]
    import json

    assert json.loads(json.dumps(data))["disjoint_inputs"] == [[0, 3], [1, 3]]


def _writes_other(q, k, v, r2t, rpi, lens, other):
    m = lens.max().item()
    table = r2t[rpi, :m:PS] // PS
    other.add_(1)  # the proof assumes `other` is none of lens, r2t, rpi (a per-call guard checks it)
    return torch.ops.syncfree.paged_decode(q, k, v, table, lens, max_seqlen_k=m)


def test_a_compiled_report_s_disjoint_inputs_reach_to_dict(no_inductor):
    step = compile_pass.compile(_writes_other, max_context_len=64)
    with torch.no_grad():
        step(*_paged(), torch.zeros(3))
    (report,) = compile_pass.reports(step)
    assert report.rewritten and report.disjoint_inputs
    assert report.to_dict()["disjoint_inputs"] == [list(p) for p in report.disjoint_inputs]
    merged = SyncReport.merge([report, report])  # a merged report carries them too (each pair once)
    assert merged.to_dict()["disjoint_inputs"] == report.to_dict()["disjoint_inputs"]


# -- folding ---------------------------------------------------------------------------------------------------
REASON = ("rewritten: page table -> syncfree.page_table width 16 (page_size 4); max_seqlen_k -> 64; "
          "max_seqlen_k -> 64; max_seqlen_k -> 64; max_seqlen_k -> 64; bound 64 (max_context_len=64); lengths "
          "asserted on the device")


def test_parts_repeated_in_a_row_fold_in_the_table_and_stay_whole_in_to_dict():
    assert fold_repeated_parts(REASON) == ("rewritten: page table -> syncfree.page_table width 16 (page_size 4); "
                                           "max_seqlen_k -> 64 x4; bound 64 (max_context_len=64); lengths asserted "
                                           "on the device")
    assert fold_repeated_parts("kept: a; b; a") == "kept: a; b; a"  # only runs fold
    report = SyncReport(rewritten=[SyncItem("item", "step.py:7", REASON)])
    table = str(report)
    assert "max_seqlen_k -> 64 x4; bound 64" in table and table.count("max_seqlen_k") == 1
    assert report.to_dict()["rewritten"][0]["reason"] == REASON  # nothing lost


def _layers_step(q, k, v, r2t, rpi, lens):
    m = lens.max().item()
    table = r2t[rpi, :m:PS] // PS
    out = q
    for _ in range(4):  # four layers, one consumer each
        out = torch.ops.syncfree.paged_decode(out, k, v, table, lens, max_seqlen_k=m)
    return out


def test_a_four_layer_step_reads_max_seqlen_k_x4(no_inductor):
    report = _compiled_report(_layers_step, *_paged(), max_context_len=64)
    (item,) = report.rewritten
    assert item.reason.count("max_seqlen_k -> 64") == 4
    assert "max_seqlen_k -> 64 x4" in str(report) and str(report).count("max_seqlen_k -> 64") == 1


# -- names -----------------------------------------------------------------------------------------------------
def test_readable_sources():
    assert readable_source("L['verify_lens']") == "verify_lens"
    assert readable_source("L['fb'].seq_lens") == "fb.seq_lens"
    assert readable_source("L['kv'][0]") == "kv[0]"
    assert readable_source("G['table']") == "table"


def _other_lengths(q, k, v, r2t, rpi, seq_lens, verify_lens):
    m = seq_lens.max().item()
    table = r2t[rpi, :m:PS] // PS
    return torch.ops.syncfree.paged_decode(q, k, v, table, verify_lens, max_seqlen_k=m)


def test_a_kept_reason_names_the_user_s_arguments(no_inductor):
    report = _compiled_report(_other_lengths, *_paged(), torch.tensor([6, 9]), max_context_len=64)
    (item,) = report.kept
    assert item.reason_code == "lengths_differ", item.reason
    assert "(verify_lens)" in item.reason and "(seq_lens)" in item.reason, item.reason
    assert not re.search(r"\bl_\w+_\b", item.reason), item.reason  # no Dynamo placeholder
    assert item.node  # the graph's own name stays where it is the graph's


def test_an_object_s_attribute_is_named_as_written(no_inductor):
    class FB:
        pass

    def step(q, k, v, r2t, rpi, fb):
        m = fb.seq_lens.max().item()
        table = r2t[rpi, :m:PS] // PS
        return torch.ops.syncfree.paged_decode(q, k, v, table, fb.verify_lens, max_seqlen_k=m)

    *args, lens = _paged()
    fb = FB()
    fb.seq_lens, fb.verify_lens = lens, torch.tensor([6, 9])
    (item,) = _compiled_report(step, *args, fb, max_context_len=64).kept
    assert "(fb.verify_lens)" in item.reason and "(fb.seq_lens)" in item.reason, item.reason


# -- kinds -----------------------------------------------------------------------------------------------------
def kinds_in_the_code() -> set[str]:
    """Every kind the package gives a SyncPoint or SyncItem: a string literal as their first argument, or assigned
    to a variable named `kind`."""
    found = set()
    for path in (ROOT / "compile_pass").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "SyncPoint", "SyncItem") and node.args and isinstance(node.args[0], ast.Constant):
                found.add(node.args[0].value)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "kind" for t in node.targets) \
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                found.add(node.value.value)
    return found


def test_api_md_lists_every_kind():
    kinds = kinds_in_the_code()
    assert {"item", "tolist", "numpy", "cpu_copy", "cpu_mirror", "host_sum", "post_grad", "graph_break"} <= kinds
    api = (ROOT / "docs" / "api.md").read_text()
    section = api[api.index("### `compile_pass.SyncItem`"):]
    section = section[:section.index("\n### ", 1)]
    listed = set(re.findall(r"`(\w+)`", section[section.index("`kind`"):section.index("`location`")]))
    assert kinds <= listed, kinds - listed
