"""Diagnostics (issue 21): TORCH_LOGS=syncfree, the structured-trace artifact, warnings at the user's line, the
report readable at engine size, and compile_pass.testing failures that start with the report."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import compile_pass
from compile_pass import _compat, log
from compile_pass.report import SyncItem, SyncReport, format_disjoint_note
from passlib import make_fb

ROOT = Path(__file__).resolve().parent.parent

STEP = textwrap.dedent("""\
    import torch, compile_pass
    from passlib import make_fb

    def kept(fb):
        m = fb.seq_lens.max().item()
        return fb.req_to_token[fb.req_pool_indices, :m:4] // 4   # the table is returned: kept

    compile_pass.compile(kept, max_context_len=64, fullgraph=True)(make_fb([3, 9]))
    print("DONE")
    """)


def run_script(tmp_path, env_extra: dict, script: str = STEP):
    (tmp_path / "step_script.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE")}
    env.update({"PYTHONPATH": str(ROOT / "tests" / "support"), **env_extra})
    return subprocess.run([sys.executable, "step_script.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def kept_step(fb):
    m = fb.seq_lens.max().item()
    return fb.req_to_token[fb.req_pool_indices, :m:4] // 4  # the table is returned: kept


# -- TORCH_LOGS -----------------------------------------------------------------------------------------------------
@pytest.mark.inductor
@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="torch < 2.13 parses TORCH_LOGS before plugins can register a name (use compile_pass)")
def test_torch_logs_syncfree_shows_each_decision(tmp_path):
    info = run_script(tmp_path, {"TORCH_LOGS": "syncfree"})
    assert info.returncode == 0 and "DONE" in info.stdout, info.stderr[-3000:]
    err = info.stderr
    assert "found 1 sync point(s): 0 rewritten, 1 kept" in err
    assert "kept item at step_script.py:5: kept:" in err  # the decision, its line and why
    assert "post-grad check: still reads the host" in err
    assert "graph after the pass" not in err and "options:" not in err  # DEBUG details stay off at INFO

    debug = run_script(tmp_path, {"TORCH_LOGS": "+syncfree"})
    assert debug.returncode == 0, debug.stderr[-3000:]
    assert "graph after the pass" in debug.stderr and "options: {" in debug.stderr

    quiet = run_script(tmp_path, {})
    assert "found 1 sync point" not in quiet.stderr


def test_the_log_is_registered_with_torch_logging():
    from torch._logging._internal import log_registry

    assert log_registry.is_log("syncfree")
    assert "compile_pass" in log_registry.log_alias_to_log_qnames["syncfree"]


def test_decision_lines_name_every_item_and_the_post_grad_check():
    report = SyncReport(rewritten=[SyncItem("item", "a.py:3", "rewritten: page table")],
                        kept=[SyncItem("tolist", "a.py:9", "kept: used in arithmetic")], notes=["a note"],
                        post_grad={"local_scalar_dense": 0, "reads": [], "assert_scalar": 0, "unbacked_symbols": []})
    lines = log.decision_lines(report)
    assert lines[0] == "found 2 sync point(s): 1 rewritten, 1 kept (1 still a host sync)"
    assert "rewritten item at a.py:3: rewritten: page table" in lines
    assert "kept tolist at a.py:9: kept: used in arithmetic" in lines
    assert "note: a note" in lines
    assert lines[-1].startswith("post-grad check: sync-free")
    assert log.post_grad_line(None).startswith("post-grad check: did not run")


# -- TORCH_TRACE ------------------------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_each_report_is_a_structured_trace_artifact(tmp_path):
    trace = tmp_path / "trace"
    proc = run_script(tmp_path, {"TORCH_TRACE": str(trace)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = "".join(p.read_text() for p in trace.iterdir())
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if '"name": "syncfree_report"' in line]
    assert starts, "no syncfree_report artifact in the trace"
    # The payload follows its metadata line, as tab-indented lines.
    body = []
    for line in lines[starts[0] + 1:]:
        if not line.startswith("\t"):
            break
        body.append(line[1:])
    payload = json.loads("\n".join(body))
    assert payload["syncs_remaining"] == 1 and payload["kept"][0]["location"] == "step_script.py:5"


# -- warnings at the user's line -----------------------------------------------------------------------------------
@pytest.mark.inductor
def test_the_kept_sync_warning_points_at_the_users_line():
    compiled = compile_pass.compile(kept_step, max_context_len=64, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(make_fb([3, 9]))
    ours = [w for w in caught if "host sync point(s) kept" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].filename == __file__  # not torch/__init__.py
    assert ours[0].lineno == kept_step.__code__.co_firstlineno + 1  # the .item() line


def test_warn_without_a_location_points_at_the_caller_outside_the_library():
    def library_call():
        log.warn("syncfree: something")  # this file is not library code: the warning lands here

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library_call()
    assert caught[0].filename == __file__


def test_source_line_resolves_a_location_through_the_graphs_stack_traces():
    class Node:
        meta = {"stack_trace": 'File "/some/where/model.py", line 12, in step\n    m = x.max().item()\n'}

    class Graph:
        nodes = [Node()]

    assert log.source_line("model.py:12", Graph()) == ("/some/where/model.py", 12)
    assert log.source_line("model.py:13", Graph()) is None
    assert log.source_line("<unknown>", Graph()) is None


# -- the report at engine size --------------------------------------------------------------------------------------
def engine_pairs(layers=8):
    tables = ["L['fb'].req_to_token", "L['fb'].req_pool_indices", "L['fb'].seq_lens"]
    pools = [f"L['k_pool_{i}']" for i in range(layers)] + [f"L['v_pool_{i}']" for i in range(layers)]
    return [(t, p) for t in tables for p in pools]


def test_disjoint_note_is_grouped_by_tensor_in_source_names():
    pairs = engine_pairs()
    assert len(pairs) == 48
    note = format_disjoint_note(pairs)
    assert note.startswith("assumes these graph inputs never share memory: ")
    assert "L['fb'].req_to_token vs L['k_pool_0'] .. L['k_pool_7'], L['v_pool_0'] .. L['v_pool_7'] (16 inputs)" in note
    assert note.count(" vs ") == 3  # one group per table, not 48 pairs
    assert note.endswith("runs the graph as captured, without the rewrite")
    assert len(note) < 500


def test_disjoint_note_small_cases():
    assert format_disjoint_note([]) == ""
    note = format_disjoint_note([("b", "a"), ("a", "b"), ("a", "c")])  # a repeat, in either order, counts once
    assert "a vs b, c;" in note
    many = format_disjoint_note([("t", f"x{i}") for i in (1, 3, 5, 7, 9, 11, 13, 15)])
    assert "..." in many and "(8 inputs)" in many


def test_a_repeated_reason_is_said_once():
    reason = "kept: the max is used in arithmetic"
    report = SyncReport(kept=[SyncItem("item", "model.py:40", reason) for _ in range(8)]
                        + [SyncItem("item", "model.py:52", reason), SyncItem("item", "model.py:60", "kept: other")])
    text = str(report)
    assert text.count(reason) == 1
    assert "model.py:40 x8" in text
    assert "(same reason as above)" in text and "kept: other" in text
    assert "kept: 10 (10 still a host sync)" in text  # the counts are of every item


# -- compile_pass.testing failures --------------------------------------------------------------------------------
FAILING_TEST = '''
import torch
from compile_pass.testing import assert_sync_free

def bad(x, lens):
    m = lens.max().item()
    return x[:, :m].sum()

def test_bad():
    assert_sync_free(bad, torch.ones(2, 8), torch.tensor([3, 5]), max_context_len=8)

def test_bad_fixture(syncfree):
    syncfree(bad, torch.ones(2, 8), torch.tensor([3, 5]), max_context_len=8)
'''


@pytest.mark.inductor
def test_testing_failures_start_with_the_report_not_library_source(pytester):
    pytester.makepyfile(test_failing=FAILING_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "def assert_sync_free" not in out and "def check(" not in out  # helper frames are hidden
    assert "problems.append" not in out
    for name in ("test_bad", "test_bad_fixture"):
        section = out.split(f"_ {name} _", 1)[1]
        first_error = next(line for line in section.splitlines() if line.startswith("E "))
        assert "SyncCheckFailed: the compiled step is not sync-free" in first_error
        assert len(section.split("E   ", 1)[0].splitlines()) < 20  # the test's own lines, then the report
    assert "test_failing.py:5" in out  # the report's table, with the .item() line (makepyfile drops the first newline)


def test_torch_autoload_hook_registers_the_name_without_importing_the_package():
    """The `torch.backends` entry point runs on every `import torch`: it must stay light."""
    code = ("import sys, torch\n"
            "from torch._logging._internal import log_registry\n"
            "print(sorted(m for m in sys.modules if m.startswith('compile_pass')), log_registry.is_log('syncfree'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules, registered = proc.stdout.strip().rsplit(" ", 1)
    assert modules == "[]"  # nothing of the package stays imported (no ops, no kernels, no triton)
    newer = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)
    assert registered == str(newer) or registered == "True"
