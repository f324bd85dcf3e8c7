"""One path for every entry point (issue 44, item 1): syncfree-inspect, assert_sync_free (and so the pytest plugin)
trace as compile_pass.compile does, so they decide alike; the inspector's graph-break counts are what Dynamo
recorded; depyf's failure is one line, in report.json too.

The inspector is compared with compile_pass.compile over the project's own steps (tests/support/
entry_point_steps.py: the built-in examples, the engine steps, two steps that branch on the max). The decisions
are the pass's, made before Inductor, so these comparisons run with Inductor's compile_fx replaced by the graph
itself (`no_inductor`): what each entry point decided is the same, and each step costs a Dynamo trace, not a
compile. The `inductor` tests run the real thing once.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import compile_pass
import entry_point_steps
from entry_point_steps import MCL, TARGETS


@pytest.fixture(autouse=True)
def _fresh_break_memory():
    """The backend tells the graph breaks of a graph from those it saw before by comparing Dynamo's list with the
    last break it saw, which an identical break after torch._dynamo.reset() (the same step compiled again, as each
    entry point here does) defeats: the break would be missed. Each compile here starts from no memory, as in a
    fresh process (the backend fix is proposed in /tmp/issue44_backend.patch)."""
    import compile_pass.backend as backend

    memory = getattr(backend, "_BREAKS_SEEN", None)
    if isinstance(memory, list):
        original = list(memory)
        memory[:] = [0, None]
        yield
        memory[:] = original
    else:
        yield


def _forget_breaks() -> None:
    import compile_pass.backend as backend

    memory = getattr(backend, "_BREAKS_SEEN", None)
    if isinstance(memory, list):
        memory[:] = [0, None]


@pytest.fixture
def no_inductor(monkeypatch):
    """Inductor's compile_fx returns the graph it is given (both sides of the inspector, and the backend)."""
    import torch._inductor.compile_fx as inductor_compile_fx

    def graph_itself(gm, example_inputs, *args, **kwargs):
        return gm.forward

    monkeypatch.setattr(inductor_compile_fx, "compile_fx", graph_itself)


def decisions(report: dict | compile_pass.SyncReport) -> dict:
    data = report if isinstance(report, dict) else report.to_dict()
    return {side: [(i["kind"], i["location"], i["reason_code"], i["rule"]) for i in data[side]]
            for side in ("rewritten", "kept")}


def inspect_json(tmp_path, capsys, *argv) -> tuple[int, dict]:
    from compile_pass.tools.inspect_cli import main

    code = main([*argv, "--out", str(tmp_path / "dump"), "--json"])
    printed = capsys.readouterr()
    assert printed.out.strip(), printed.err[-3000:]
    data = json.loads(printed.out)
    assert json.loads((tmp_path / "dump" / "report.json").read_text()) == data
    return code, data


def line_of(fn, text: str) -> str:
    """'file.py:LINE' of the line of `fn` that holds `text`."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    (n,) = [first + i for i, line in enumerate(lines) if text in line]
    return f"{fn.__code__.co_filename.rsplit('/', 1)[-1]}:{n}"


def compiled_decisions(name: str) -> dict:
    factory, bound = TARGETS[name]
    fn, args = factory()
    torch._dynamo.reset()
    _forget_breaks()
    step = compile_pass.compile(fn, max_context_len=bound)
    with torch.no_grad():
        step(*args)
    return decisions(compile_pass.SyncReport.merge(compile_pass.reports(step)))


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_inspector_decides_as_compile_does(name, tmp_path, capsys, no_inductor, monkeypatch):
    monkeypatch.setitem(sys.modules, "depyf", None)  # its dumps are not what is compared (and cost a second)
    _, bound = TARGETS[name]
    code, data = inspect_json(tmp_path, capsys, f"entry_point_steps:{name}", "--max-context-len", str(bound))
    want = compiled_decisions(name)
    assert decisions(data) == want
    assert code == (1 if data["syncs_remaining"] else 0)


def test_the_suite_holds_steps_that_only_compile_s_trace_rewrites(no_inductor):
    """What makes the comparison above bite: through torch.compile(backend="syncfree") (the inspector's old path)
    the branch on the max breaks the graph and the max is kept; compile_pass.compile rewrites both steps."""
    assert len(TARGETS) >= 12
    for name in ("grow", "round_up"):
        fn, args = TARGETS[name][0]()
        torch._dynamo.reset()
        before = len(compile_pass.reports())
        with compile_pass._compat.capture_scalar_outputs(), torch.no_grad():
            torch.compile(fn, backend="syncfree", options={"max_context_len": MCL})(*args)
        stock_path = decisions(compile_pass.SyncReport.merge(compile_pass.reports()[before:]))
        ours = compiled_decisions(name)
        assert ours["rewritten"] and not ours["kept"], ours
        assert stock_path["kept"] and stock_path != ours, stock_path


def test_graph_breaks_are_counted_from_what_dynamo_recorded(tmp_path, capsys, no_inductor):
    code, data = inspect_json(tmp_path, capsys, "entry_point_steps:broken", "--max-context-len", str(MCL))
    breaks = data["graph_breaks"]
    assert (breaks["before"], breaks["after"]) == (1, 1), breaks
    assert [b["location"] for b in breaks["at"]["after"]] == [line_of(entry_point_steps.broken_step, "graph_break()")]
    assert data["graphs"] == {"after": 2}
    assert code == 0  # the break is no host read: the max before it is rewritten


def test_a_branch_on_the_max_is_no_break_when_inspected(tmp_path, capsys, no_inductor):
    """The issue's FlashMLA-like case: the stock side breaks at the branch (Dynamo cannot decide it), the syncfree
    side traces it with the max's range, rewrites, and exits 0."""
    code, data = inspect_json(tmp_path, capsys, "entry_point_steps:grow", "--max-context-len", str(MCL))
    assert code == 0 and data["syncs_remaining"] == 0
    assert data["graph_breaks"]["before"] == 1 and data["graph_breaks"]["after"] == 0
    assert [b["location"] for b in data["graph_breaks"]["at"]["before"]] == [line_of(entry_point_steps.grow_step,
                                                                                     "if m > GROW_BOUND")]


def test_without_a_bound_the_break_is_counted_and_the_max_kept(tmp_path, capsys, no_inductor):
    code, data = inspect_json(tmp_path, capsys, "entry_point_steps:grow")
    assert code == 1
    assert data["graph_breaks"]["after"] == 1 and data["graph_breaks"]["before"] == 1
    assert "graph_break" in [i["kind"] for i in data["kept"]]
    assert data["graphs"]["after"] == 2


_FAKE_DEPYF_TRACEBACK = """Traceback (most recent call last):
  File "/site-packages/depyf/decompiler.py", line 1120, in decompile_range
    output = method(self, inst)
IndexError: list index out of range

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/site-packages/depyf/explain/enable_debugging.py", line 50, in __call__
    decompiled_and_compiled_back_code = Decompiler.decompile_and_compile_like(code_to_decompile=new_code)
depyf.decompiler.DecompilationError: DecompilationError: Failed to decompile instruction Instruction(opcode=99, \
opname='SWAP', arg=2, argval=2, argrepr='', offset=418, starts_line=8, is_jump_target=False) in step
"""


def _fake_depyf(monkeypatch):
    """depyf as 0.20 behaves where it cannot decompile a function Dynamo transformed: no exception, a warning
    and a traceback printed to stderr, from inside the compile."""
    import contextlib
    import warnings

    module = types.ModuleType("depyf")

    @contextlib.contextmanager
    def prepare_debug(path):
        yield
        warnings.warn("There is a problem when decompiling and compiling the following code:\n  0 SWAP")
        print(_FAKE_DEPYF_TRACEBACK, end="", file=sys.stderr)

    module.prepare_debug = prepare_debug
    monkeypatch.setitem(sys.modules, "depyf", module)


def test_depyf_s_failure_is_one_line_and_in_report_json(tmp_path, capsys, monkeypatch, no_inductor):
    from compile_pass.tools.inspect_cli import main

    _fake_depyf(monkeypatch)
    out = tmp_path / "dump"
    assert main(["entry_point_steps:grow", "--max-context-len", str(MCL), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err and "Traceback" not in printed.out
    data = json.loads((out / "report.json").read_text())
    problem = data["depyf"]["problem"]
    assert problem == ("depyf could not decompile step (DecompilationError: Failed to decompile instruction SWAP "
                       "in step); that function's source is missing from depyf's dump"), problem
    assert data["depyf"]["used"] is True
    notes = [line for line in printed.out.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {problem}"]


def test_the_real_depyf_prints_no_traceback(tmp_path, capsys, no_inductor):
    """The issue's case: a resume function depyf 0.20 cannot decompile (the stock side breaks at the branch)."""
    pytest.importorskip("depyf")
    from compile_pass.tools.inspect_cli import main

    out = tmp_path / "dump"
    main(["entry_point_steps:grow", "--max-context-len", str(MCL), "--out", str(out)])
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err, printed.err[-2000:]
    problem = json.loads((out / "report.json").read_text())["depyf"]["problem"]
    assert problem is None or "\n" not in problem


def test_an_already_compiled_target_is_inspected_through_compile_with_one_line(tmp_path, capsys, no_inductor):
    code, data = inspect_json(tmp_path, capsys, "entry_point_steps:already_compiled", "--max-context-len",
                              str(MCL))
    assert code == 0 and data["rewritten"] and not data["kept"]
    assert data["note"] == ("TARGET's function was already compiled by torch.compile, which keeps the backend it "
                            "was given: its original function is traced through compile_pass.compile instead")


def test_assert_sync_free_checks_an_already_compiled_step_with_one_line(no_inductor, monkeypatch):
    """Its decisions are compile's; the check itself is not made (Inductor is replaced here)."""
    from compile_pass import testing

    fn, by = testing.uncompiled(entry_point_steps.already_compiled()[0])
    assert fn is entry_point_steps.grow_step and by == "torch.compile"
    step = compile_pass.compile(entry_point_steps.grow_step, max_context_len=MCL)
    assert testing.uncompiled(step) == (entry_point_steps.grow_step, "compile_pass.compile")
    assert testing.uncompiled(entry_point_steps.grow_step) == (entry_point_steps.grow_step, None)


def test_assert_sync_free_traces_the_user_s_own_frame():
    """The fresh function assert_sync_free compiles is a copy of the user's (its own code object, the same file,
    lines and name): Dynamo's first frame is the user's, as with compile_pass.compile (a branch on the max is
    traced at the bound only there), and the report's stacks start at the user's code."""
    from compile_pass.testing import _fresh_function

    fresh = _fresh_function(entry_point_steps.round_up_step)
    original = entry_point_steps.round_up_step.__code__
    assert fresh.__code__ is not original and fresh.__code__ == original
    assert fresh.__name__ == "round_up_step" and fresh.__code__.co_filename == original.co_filename

    class Holder:
        def step(self, x):
            return x + 1

    holder = Holder()
    bound = _fresh_function(holder.step)
    assert bound.__self__ is holder and bound.__func__.__code__ is not Holder.step.__code__ and bound(1) == 2


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["round_up", "grow"])
def test_assert_sync_free_decides_as_compile_does(name):
    """Through Inductor: the round-up's branch is traced at the bound (compile_pass.compile's own frame rule), the
    check passes, and its decisions are compile's."""
    from compile_pass.testing import assert_sync_free

    fn, args = TARGETS[name][0]()
    result = assert_sync_free(fn, *args, max_context_len=MCL)
    assert decisions(result.report) == compiled_decisions(name)
    assert all(frame.startswith("entry_point_steps.py:") for i in result.report.rewritten for frame in i.stack)


@pytest.mark.inductor
def test_the_inspector_through_inductor_rewrites_the_branching_step(tmp_path, capsys):
    code, data = inspect_json(tmp_path, capsys, "entry_point_steps:round_up", "--max-context-len", str(MCL))
    assert code == 0, data["table"]
    assert data["host_syncs_in_inductor_code"]["after"] == 0 and data["graph_breaks"]["after"] == 0
    assert decisions(data) == compiled_decisions("round_up")
