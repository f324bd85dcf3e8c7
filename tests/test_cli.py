"""syncfree-inspect: exit codes, files, JSON, clear errors; the console script in a fresh process where that is what
is tested (it is installed, the exit status a shell sees, the built-in example, depyf missing or broken), main() in
this process for the rest."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "syncfree-inspect"

UNSAFE = textwrap.dedent("""\
    import torch

    def step(lens, r2t, rpi):
        m = lens.max().item()
        return r2t[rpi, :m].float().sum(1)

    def target():
        return step, (torch.tensor([3, 5]), torch.arange(40).view(4, 10), torch.tensor([1, 2]))

    NOT_CALLABLE = 3

    def wrong():
        return 5

    def raises():
        raise RuntimeError("no model here")

    def does_not_compile():
        def bad(x):
            return torch.ops.syncfree.page_table(x, x[:, 0], x[:, 0], 0, 4)  # page_size 0: rejected when traced
        return bad, (torch.zeros(2, 3, dtype=torch.int32),)
    """)


def inspect(*args, cwd=None):
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "compile_pass.tools.inspect_cli"]
    env = {**os.environ, "PYTHONPATH": str(cwd) if cwd else ""}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


@pytest.fixture
def target_dir(tmp_path):
    (tmp_path / "unsafe_target.py").write_text(UNSAFE)
    return tmp_path


def test_console_script_is_installed():
    assert SCRIPT.exists(), "pip install should create the syncfree-inspect console script"


@pytest.mark.inductor
def test_builtin_example_exits_0_and_writes_files(tmp_path):
    out = tmp_path / "dump"
    proc = inspect("--example", "decode", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["syncs_remaining"] == 0 and data["exit_status"] == 0
    assert "tiny Llama" in data["compiled"] and "on the CPU" in data["compiled"]
    assert data["depyf"] == {"used": True, "problem": None}  # installed by the [inspect] extra
    assert data["host_syncs_in_inductor_code"]["before"] >= 1 and data["host_syncs_in_inductor_code"]["after"] == 0
    assert [i["kind"] for i in data["rewritten"]] == ["item"]
    assert "tiny_llama.py:" in data["rewritten"][0]["location"]
    assert json.loads((out / "report.json").read_text())["exit_status"] == 0
    assert "rewritten" in (out / "report.md").read_text()
    assert any((out / "before").iterdir()) and any((out / "after").iterdir())
    assert "compiling" not in proc.stderr  # no progress lines when piped


def test_progress_only_on_a_terminal(capsys):
    from compile_pass.tools.inspect_cli import Progress

    Progress(enabled=True).step("compiling stock")
    Progress(enabled=False).step("compiling syncfree")
    err = capsys.readouterr().err
    assert "compiling stock" in err and "compiling syncfree" not in err


BAD_USAGE = [
    (["nope_module:fn"], "cannot import module 'nope_module'"),
    (["unsafe_target"], "TARGET must be module:function"),
    (["unsafe_target:missing"], "has no attribute 'missing'"),
    (["unsafe_target:NOT_CALLABLE"], "is not callable"),
    (["unsafe_target:wrong"], "must return (fn, example_args)"),
    (["unsafe_target:raises"], "raised RuntimeError: no model here"),
    (["--example", "nope"], "unknown example 'nope'"),
    ([], "give exactly one of TARGET"),
    (["--example", "decode", "--max-context-len", "0"], "--max-context-len must be >= 1"),
]


def test_bad_usage_from_the_console_script_exits_2_with_one_clear_line(target_dir):
    """One case through the installed script in a fresh process (the exit status a shell sees); the others call
    main() in this process (test_bad_usage_exits_2_with_one_clear_line), each a torch import cheaper."""
    proc = inspect("unsafe_target:raises", cwd=target_dir)
    assert proc.returncode == 2
    assert "raised RuntimeError: no model here" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_list_examples(capsys):
    assert run_main("--list-examples") == 0
    out = capsys.readouterr().out
    assert "decode" in out and "extend_cold" in out


@pytest.mark.inductor
@pytest.mark.parametrize("fake_depyf,note", [
    (None, "depyf is not installed"),  # None in sys.modules: `import depyf` raises ImportError
    ("import contextlib\n"
     "@contextlib.contextmanager\n"
     "def prepare_debug(path):\n"
     "    raise RuntimeError('patched function is gone')\n"
     "    yield\n", "depyf failed (RuntimeError: patched function is gone)"),
])
def test_without_a_working_depyf_the_dump_still_happens(tmp_path, monkeypatch, capsys, fake_depyf, note):
    import types

    module = None
    if fake_depyf is not None:
        module = types.ModuleType("depyf")
        exec(fake_depyf, module.__dict__)
    monkeypatch.setitem(sys.modules, "depyf", module)
    out = tmp_path / "dump"
    assert run_main("--example", "decode", "--out", str(out)) == 0
    assert f"note: {note}; the FX graphs and Inductor code were dumped without it" in capsys.readouterr().out
    for side in ("before", "after"):
        assert (out / side / "dynamo_graph_0.py").exists() and (out / side / "inductor_code_0.py").exists()
    assert "_local_scalar_dense" in (out / "before" / "inductor_code_0.py").read_text() or \
        ".item()" in (out / "before" / "inductor_code_0.py").read_text()


# -- in-process: main(argv) ---------------------------------------------------------------------------------------
@pytest.fixture
def in_target_dir(target_dir, monkeypatch):
    monkeypatch.chdir(target_dir)
    monkeypatch.syspath_prepend(str(target_dir))
    yield target_dir
    sys.modules.pop("unsafe_target", None)


def run_main(*argv) -> int:
    from compile_pass.tools.inspect_cli import main

    return main(list(argv))


@pytest.mark.inductor
def test_unsafe_target_exits_1_naming_the_line(in_target_dir, capsys):
    assert run_main("unsafe_target:target", "--max-context-len", "10", "--out", "dump") == 1
    out = capsys.readouterr().out
    assert "unsafe_target.py:4" in out and "kept" in out
    assert "host syncs in Inductor code" in out
    assert "legend:" in out and "compiled: target unsafe_target:target" in out
    assert "H200" not in out  # the GPU pitch is for the built-in example only


@pytest.mark.inductor
def test_strict_exits_1(in_target_dir, capsys):
    assert run_main("unsafe_target:target", "--max-context-len", "10", "--strict", "--out", "dump") == 1
    err = capsys.readouterr().err
    assert "strict" in err and "unsafe_target.py:4" in err
    assert "Traceback" not in err


def test_a_target_that_fails_to_compile_exits_3(in_target_dir, capsys):
    assert run_main("unsafe_target:does_not_compile", "--max-context-len", "10", "--out", "dump") == 3
    err = capsys.readouterr().err
    assert "compiling the target failed" in err and "page_size" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args,message", BAD_USAGE)
def test_bad_usage_exits_2_with_one_clear_line(in_target_dir, capsys, args, message):
    assert run_main(*args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.inductor
def test_after_holds_the_rewritten_graph_and_a_diff(tmp_path, capsys):
    out = tmp_path / "dump"
    assert run_main("--example", "decode", "--out", str(out)) == 0
    captured = (out / "after" / "dynamo_graph_0.py").read_text()
    rewritten = (out / "after" / "rewritten_graph_0.py").read_text()
    assert ".item()" in captured and ".item()" not in rewritten
    assert "torch.ops.syncfree.page_table" in rewritten and "torch.ops.syncfree.page_table" not in captured
    diff = (out / "rewrite.diff").read_text()
    assert diff == (out / "after" / "rewrite_0.diff").read_text()
    assert diff.startswith("--- dynamo_graph_0.py") and "\n+    page_table" in diff and "\n-    item = " in diff
    printed = capsys.readouterr().out
    assert "rewrite.diff" in printed
    # README.md's quick-start sample is this output (make demo's, whose --out is syncfree-inspect-out)
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    sample = readme.split("    compiled: example 'decode'", 1)[1].split("\n\n(", 1)[0]
    sample = textwrap.dedent("    compiled: example 'decode'" + sample).strip()
    assert printed.replace(str(out), "syncfree-inspect-out").strip() == sample


@pytest.mark.inductor
def test_each_run_starts_clean_and_counts_both_sides_alike(in_target_dir, capsys):
    out = in_target_dir / "dump"
    (out / "after").mkdir(parents=True)
    (out / "after" / "inductor_code_7.py").write_text("stale .item() .item()")  # from an earlier run
    (out / "notes.txt").write_text("mine")  # not the tool's: kept
    counts = []
    for _ in range(2):  # the second run meets warm caches (Dynamo's, Inductor's FX graph cache, AOT's)
        assert run_main("unsafe_target:target", "--max-context-len", "10", "--out", str(out), "--json") == 1
        data = json.loads(capsys.readouterr().out)
        counts.append(data["host_syncs_in_inductor_code"])
        assert not (out / "after" / "inductor_code_7.py").exists()
        assert sorted(p.name for p in (out / "after").glob("inductor_code_*.py")) == ["inductor_code_0.py"]
    assert counts == [{"before": 1, "after": 1}] * 2
    assert (out / "notes.txt").read_text() == "mine"


def test_a_folder_the_tool_did_not_write_is_left_alone(in_target_dir, capsys):
    out = in_target_dir / "dump"
    (out / "before").mkdir(parents=True)
    (out / "before" / "thesis.tex").write_text("precious")
    assert run_main("unsafe_target:target", "--out", str(out)) == 2
    assert "was not written by syncfree-inspect" in capsys.readouterr().err
    assert (out / "before" / "thesis.tex").read_text() == "precious"


def test_a_backend_failure_prints_its_cause(in_target_dir, capsys, monkeypatch):
    import torch._inductor.compile_fx as inductor_compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded on purpose")

    monkeypatch.setattr(inductor_compile_fx, "compile_fx", broken)
    assert run_main("unsafe_target:target", "--max-context-len", "10", "--out", "dump") == 3
    err = capsys.readouterr().err
    assert "compiling the target failed" in err and "RuntimeError: inductor exploded on purpose" in err
    assert "backend='inductor'" in err  # the backend is named, not 'backend'


def test_help_and_behaviour_agree_on_max_context_len(in_target_dir, capsys):
    with pytest.raises(SystemExit) as info:
        run_main("--help")
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "required" not in text and "every max is kept and the report says so" in text
    assert run_main("unsafe_target:target", "--out", "dump") == 1  # no bound: a report, not a usage error
    assert "max_context_len'] is missing" in capsys.readouterr().out


def test_the_gpu_pitch_points_at_benchmarks_only_where_the_file_is(monkeypatch, tmp_path):
    import compile_pass
    from compile_pass.tools.inspect_cli import benchmarks_pointer

    assert benchmarks_pointer() == "BENCHMARKS.md"  # the source tree
    monkeypatch.setattr(compile_pass, "__file__", str(tmp_path / "site-packages" / "compile_pass" / "__init__.py"))
    assert "not installed with the package" in benchmarks_pointer()  # a wheel has no BENCHMARKS.md


PARAMETERS = textwrap.dedent("""\
    import torch

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)   # parameters that require grad, as a loaded model's do

        def forward(self, q, k, v, r2t, rpi, lens):
            m = lens.max().item()
            table = r2t[rpi, :m:4] // 4
            out = torch.ops.syncfree.paged_decode(self.proj(q), k, v, table, lens, max_seqlen_k=m)
            return out

    def target():
        g = torch.Generator().manual_seed(0)
        r2t = torch.arange(4 * 32, dtype=torch.int32).view(4, 32)
        return Step(), (torch.randn(2, 1, 4, 8, generator=g), torch.randn(32, 4, 2, 8, generator=g),
                        torch.randn(32, 4, 2, 8, generator=g), r2t, torch.tensor([1, 3]), torch.tensor([5, 9]))
    """)


@pytest.mark.inductor
def test_a_model_with_parameters_runs_as_decode_runs(tmp_path, monkeypatch, capsys):
    """Without autograd (torch.no_grad(), as decode runs): the stock side would otherwise fail with "no autograd
    formula" for the custom op before the pass runs."""
    (tmp_path / "param_target.py").write_text(PARAMETERS)
    monkeypatch.chdir(tmp_path)
    code = run_main("param_target:target", "--max-context-len", "32", "--out", "dump")
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "rewritten" in printed.out
