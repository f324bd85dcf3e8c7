"""The post-grad check (proof 1): what it finds, that a cached artifact never skips it, that strict agrees with
it, that it composes with a user's post-grad pass, and that CUDA graphs are dropped for graphs it flags."""

import pytest
import torch

import compile_pass
from compile_pass import SyncRemainsError, _compat
from compile_pass.backend import CUDAGRAPHS_OFF, _account_post_grad
from compile_pass.post_grad_check import SyncFreeCheck, collecting, post_grad_syncs
from compile_pass.report import SyncItem, SyncReport
from passlib import make_fb

pytestmark = pytest.mark.inductor


def _graph_with_a_host_read():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    top = graph.call_function(torch.ops.aten.max.default, (x,))
    read = graph.call_function(torch.ops.aten._local_scalar_dense.default, (top,))
    read.meta["stack_trace"] = '  File "/src/engine.py", line 42, in step\n    m = lens.max().item()\n'
    graph.output(read)
    return graph


def test_check_finds_a_host_read_with_its_line():
    findings = {}
    with collecting(findings):
        SyncFreeCheck("fingerprint")(_graph_with_a_host_read())
    assert findings["local_scalar_dense"] == 1 and findings["reads"] == ["engine.py:42"]
    empty = torch.fx.Graph()
    empty.output(empty.placeholder("x"))
    assert post_grad_syncs(empty) == {"local_scalar_dense": 0, "reads": [], "assert_scalar": 0,
                                      "unbacked_symbols": []}


def test_unrecognised_post_grad_reads_join_the_report():
    report = SyncReport(kept=[SyncItem("item", "a.py:1", "kept: known")])
    _account_post_grad(report, {"reads": ["a.py:1", "b.py:7"], "unbacked_symbols": ["u0"],
                                "local_scalar_dense": 2})
    assert [(i.kind, i.location) for i in report.kept] == [("item", "a.py:1"), ("post_grad", "b.py:7")]
    assert report.syncs_remaining == 2 and "does not recognise" in report.kept[1].reason
    assert report.kept[1].reason_code == "post_grad"
    unbacked = SyncReport()
    _account_post_grad(unbacked, {"reads": [], "unbacked_symbols": ["u0"], "local_scalar_dense": 0})
    assert [i.reason_code for i in unbacked.kept] == ["post_grad"] and "u0" in unbacked.kept[0].reason


def _decode(fb):
    m = fb.seq_lens.max().item()
    return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)


def _mirror_kept(fb):
    m = fb.seq_lens_cpu.max().item()  # a CPU mirror: no device sync, but a host read all the same
    return fb.req_to_token[fb.req_pool_indices, :m].sum(1)


import consumers_for_tests  # noqa: E402,F401


def test_cache_hit_still_reports_the_check(monkeypatch):
    import compile_pass.backend as backend

    loaded = []
    real_load = backend.load_findings
    monkeypatch.setattr(backend, "load_findings", lambda key: loaded.append(real_load(key)) or loaded[-1])
    fb = make_fb([3, 9, 5])
    runs = []
    for _ in range(2):  # the second compile is an FX-graph-cache hit: the check does not run in Inductor
        torch._dynamo.reset()
        compiled = compile_pass.compile(_mirror_kept, max_context_len=64, fullgraph=True)
        torch.testing.assert_close(compiled(fb), _mirror_kept(fb))
        runs.append(compile_pass.last_report().post_grad)
    assert runs[0] is not None and runs[0] == runs[1]
    assert runs[1]["local_scalar_dense"] == 1
    assert loaded and loaded[-1] == runs[1]  # the second compile was a cache hit, answered by the store


def test_cache_hit_without_stored_findings_compiles_again(monkeypatch):
    import compile_pass.backend as backend

    fb = make_fb([3, 9, 5])
    compile_pass.compile(_mirror_kept, max_context_len=64, fullgraph=True)(fb)
    torch._dynamo.reset()
    monkeypatch.setattr(backend, "load_findings", lambda key: None)  # the store lost its file
    calls = []
    real = _compat.compile_fx
    monkeypatch.setattr(_compat, "compile_fx", lambda gm, ex, p: calls.append(dict(p)) or real(gm, ex, p))
    compile_pass.compile(_mirror_kept, max_context_len=64, fullgraph=True)(fb)
    assert compile_pass.last_report().post_grad["local_scalar_dense"] == 1
    assert calls[-1].get("fx_graph_cache") is False


def test_strict_agrees_with_the_post_grad_check():
    """The pass keeps the mirror read as 'no device sync'; the post-grad graph still reads the host: strict
    raises, naming it."""
    compiled = compile_pass.compile(_mirror_kept, max_context_len=64, fullgraph=True, strict=True)
    with pytest.raises(SyncRemainsError, match="post-grad graph still reads the host"):
        compiled(make_fb([3, 9, 5]))


def test_a_users_post_grad_pass_still_runs(monkeypatch):
    class Counting(_compat.CustomGraphPass):
        calls = 0

        def __call__(self, graph):
            Counting.calls += 1

        def uuid(self):
            return "counting-pass-v1"

    from torch._inductor import config

    fb = make_fb([3, 9, 5])
    with config.patch(post_grad_custom_post_pass=Counting(), fx_graph_cache=False):
        compiled = compile_pass.compile(_decode, max_context_len=64, fullgraph=True)
        torch.testing.assert_close(compiled(fb), _decode(fb))
    assert Counting.calls >= 1
    assert compile_pass.last_report().post_grad["local_scalar_dense"] == 0


@pytest.mark.parametrize("fn,cudagraphs_kept", [(_decode, True), (_mirror_kept, False)])
def test_cudagraphs_dropped_for_a_graph_that_keeps_a_host_read(monkeypatch, fn, cudagraphs_kept):
    calls = []
    real = _compat.compile_fx
    monkeypatch.setattr(_compat, "compile_fx", lambda gm, ex, p: calls.append(dict(p)) or real(gm, ex, p))
    fb = make_fb([3, 9, 5])
    torch.testing.assert_close(compile_pass.compile(fn, max_context_len=64, cudagraphs=True, fullgraph=True)(fb),
                               fn(fb))
    assert bool(calls[-1].get("triton.cudagraphs")) == cudagraphs_kept
    assert (CUDAGRAPHS_OFF in compile_pass.last_report().notes) == (not cudagraphs_kept)
    with pytest.raises(SyncRemainsError):  # strict: raise rather than run without CUDA graphs
        torch._dynamo.reset()
        compile_pass.compile(_mirror_kept, max_context_len=64, cudagraphs=True, strict=True, fullgraph=True)(fb)


def test_inductor_failure_on_a_kept_host_read_runs_the_graph_as_captured(monkeypatch):
    """torch 2.11/2.12 fail to lower CPU SDPA over an unbacked width (GuardOnDataDependentSymNode); stock
    torch.compile fails the same way with capture on. The backend then runs that graph as captured, says so,
    and strict raises instead."""
    real = _compat.compile_fx

    def failing(gm, example_inputs, patches):
        if any(_compat.free_unbacked_symbols(_compat.example_value(n)) for n in gm.graph.nodes
               if _compat.example_value(n) is not None):
            raise RuntimeError("GuardOnDataDependentSymNode: Could not guard on data-dependent expression")
        return real(gm, example_inputs, patches)

    monkeypatch.setattr(_compat, "compile_fx", failing)
    fb = make_fb([3, 9, 5])
    with pytest.warns(UserWarning, match="runs as captured"):
        got = compile_pass.compile(_mirror_kept, max_context_len=64, fullgraph=True)(fb)
    torch.testing.assert_close(got, _mirror_kept(fb))
    assert any("GuardOnDataDependentSymNode" in n for n in compile_pass.last_report().notes)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="GuardOnDataDependentSymNode"):
        compile_pass.compile(_mirror_kept, max_context_len=64, fullgraph=True, strict=True)(fb)
    torch._dynamo.reset()  # a graph with no host read left is not hidden: its failure is the user's to see
    with pytest.raises(Exception, match="boom"):
        monkeypatch.setattr(_compat, "compile_fx", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        compile_pass.compile(_decode, max_context_len=64, fullgraph=True)(fb)
