"""Issue 43: what a call of compile_pass.compile gives Dynamo (capture_scalar_outputs, the bounded maxima, the
report collector) is entered where Dynamo compiles a frame during the call, not around every call; a call that
Dynamo's cache serves runs none of it. The decisions are those of the context entered around the whole call."""

import contextlib

import pytest
import torch

import compile_pass
from compile_pass import _compat, tracing


def _step(x, seq_lens):
    m = seq_lens.max().item()
    return x[:, :m].sum(-1) + m


@pytest.fixture
def entered(monkeypatch):
    """How many times compile_pass.compile's call context was entered (counted at capture_scalar_outputs)."""
    count = [0]
    original = _compat.capture_scalar_outputs

    @contextlib.contextmanager
    def counting():
        count[0] += 1
        with original():
            yield

    monkeypatch.setattr(_compat, "capture_scalar_outputs", counting)
    return count


def test_a_call_the_cache_serves_enters_nothing_and_a_recompile_enters_the_context(entered):
    step = compile_pass.compile(_step, max_context_len=16, dynamic=False)
    x, lens = torch.randn(3, 16), torch.tensor([3, 9, 5])
    assert torch.allclose(step(x, lens), _step(x, lens))
    first = entered[0]
    assert first >= 1 and len(compile_pass.reports(step)) == 1
    for _ in range(3):
        step(x, lens + 1)
    assert entered[0] == first  # served by Dynamo's cache: nothing entered
    assert not _compat.capture_scalar_outputs_enabled()
    y = torch.randn(4, 16)  # a new shape: a recompile, traced with the call's context as the first compile
    assert torch.allclose(step(y, torch.tensor([1, 2, 3, 4])), _step(y, torch.tensor([1, 2, 3, 4])))
    assert entered[0] > first
    assert len(compile_pass.reports(step)) == 2
    assert not _compat.capture_scalar_outputs_enabled()


def test_the_decisions_are_those_of_the_context_around_the_whole_call(monkeypatch):
    x, lens = torch.randn(3, 16), torch.tensor([3, 9, 5])
    torch._dynamo.reset()
    hooked = compile_pass.compile(_step, max_context_len=16, dynamic=False)
    first = hooked(x, lens)
    torch._dynamo.reset()  # the same frame compiled again, not served from the first compile's cache entry
    monkeypatch.setattr(tracing, "_HOOKED", [])  # as on a torch without the hook: around every call
    around = compile_pass.compile(_step, max_context_len=16, dynamic=False)
    assert torch.allclose(first, around(x, lens))
    a, b = compile_pass.reports(hooked), compile_pass.reports(around)
    assert len(a) == len(b) == 1
    assert [r.to_dict()["rewritten"] for r in a] == [r.to_dict()["rewritten"] for r in b]
    assert [r.to_dict()["kept"] for r in a] == [r.to_dict()["kept"] for r in b]
    assert [r.notes for r in a] == [r.notes for r in b]


def test_a_torch_compile_step_called_inside_the_call_is_traced_in_the_callers_context():
    """As before issue 43: a frame Dynamo compiles while a compile_pass.compile call runs (here a stock compiled
    function called from a disabled helper after a graph break) is traced with that call's context."""
    flags = []

    def record(gm, example_inputs):
        flags.append(_compat.capture_scalar_outputs_enabled())
        return gm.forward

    inner = torch.compile(lambda x: x * 2, backend=record)

    @torch.compiler.disable
    def helper(x):
        return inner(x)

    def outer(x, seq_lens):
        return helper(x + seq_lens.sum())

    step = compile_pass.compile(outer, max_context_len=16)
    x, lens = torch.randn(3), torch.tensor([1, 2])
    assert torch.allclose(step(x, lens), outer(x, lens))
    assert flags == [True]
    assert not _compat.capture_scalar_outputs_enabled()
    inner(torch.randn(5, 2))  # outside any call: a stock compile sees the flag as it is
    assert flags[-1] is False


def test_graph_break_count_is_the_number_of_recorded_reasons():
    torch._dynamo.reset()
    assert _compat.graph_break_count() == len(_compat.graph_break_reasons()) == 0

    def broken(x):
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2

    torch.compile(broken, backend="eager")(torch.randn(2))
    assert _compat.graph_break_count() == len(_compat.graph_break_reasons()) >= 1


def test_the_frame_compile_hook_is_installed_once_and_passes_through_without_a_call():
    from torch._dynamo.convert_frame import ConvertFrameAssert

    assert tracing.hook_frame_compiles() and tracing.hook_frame_compiles()
    assert getattr(ConvertFrameAssert.__call__, "_syncfree_compile_hook", False)
    assert _compat._FRAME_COMPILE_HOOKS.count(tracing._on_frame_compile) == 1
    assert tracing._on_frame_compile() is None  # no compile_pass.compile call in progress: nothing entered
    assert torch.equal(torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2)), torch.zeros(2))
