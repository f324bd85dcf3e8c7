"""compile_pass.tracing: the range [0, bound] a max of declared lengths gets while Dynamo traces (issue 30).

A grow-on-demand scratch table (SGLang's FlashMLA idiom) branches on the max before it sizes the table; with the
range, a branch that is False for every value in [0, bound] no longer breaks the graph. What the range may be
given to, and that a kept max still checks it, is what these tests pin.
"""

from __future__ import annotations

import pytest
import torch

import compile_pass
from compile_pass import _compat, tracing
from compile_pass.backend import run_sync_pass
from compile_pass.options import SyncfreeOptions

PS = 4


class Scratch:
    """A persistent table grown to the running max, as SGLang's `_eager_block_kv_indices`."""

    def __init__(self, width):
        self.buf = torch.full((4, width), -1, dtype=torch.int32)


def grow_step(scratch, seq_lens_cpu, r2t):
    m = seq_lens_cpu.max().item()
    n = (m + PS - 1) // PS
    buf = scratch.buf
    if buf.shape[1] < n:  # grow on demand: never taken once the buffer is as wide as the bound
        buf = torch.full((4, n), -1, dtype=torch.int32)
        scratch.buf = buf
    table = buf[:2, :n]
    table.copy_(r2t[:2, :n])
    return table.sum(), m


class Recorder:
    """A backend: the pass (run_sync_pass, as the syncfree backend runs it) on Dynamo's graph, then the graph."""

    def __init__(self, **options):
        self.options = SyncfreeOptions.from_dict({"max_context_len": 16, **options})
        self.graphs, self.results = [], []

    def __call__(self, gm, example_inputs):
        self.results.append(run_sync_pass(gm, self.options))
        self.graphs.append(gm)
        return gm.forward


def _run(fn, backend, *args, traced=True):
    compiled = torch.compile(fn, backend=backend)
    with _compat.capture_scalar_outputs(), (tracing.bounded_maxima(tracing.TracingPolicy(backend.options)) if traced
                                             else _nullcontext()):
        return compiled(*args)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _breaks(before: int) -> list[str]:
    return [reason for reason, _ in _compat.graph_break_reasons()[before:]]


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_grow_on_demand_branch_false_over_the_range_does_not_break():
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    lens = torch.tensor([9, 3])
    backend = Recorder()
    before = len(_compat.graph_break_reasons())
    got = _run(grow_step, backend, Scratch(16 // PS), lens, r2t)
    assert _breaks(before) == [] and len(backend.graphs) == 1
    assert got[1] == 9 and got[0] == grow_step(Scratch(4), lens, r2t)[0]


def test_without_the_range_the_branch_breaks():
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    backend = Recorder()
    before = len(_compat.graph_break_reasons())
    _run(grow_step, backend, Scratch(16 // PS), torch.tensor([9, 3]), r2t, traced=False)
    assert any("data-dependent" in r for r in _breaks(before))


def test_a_kept_max_checks_its_range_on_the_host():
    """The max escapes (returned): the pass keeps it, and the range it was traced with is asserted again."""
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    backend = Recorder()
    scratch = Scratch(16 // PS)
    compiled = torch.compile(grow_step, backend=backend)
    with _compat.capture_scalar_outputs(), tracing.bounded_maxima(tracing.TracingPolicy(backend.options)):
        compiled(scratch, torch.tensor([9, 3]), r2t)
        assert backend.results[0].kept
        code = backend.graphs[0].code
        assert "exceeds max_context_len=16" in code and "is negative" in code
        with pytest.raises(RuntimeError, match="exceeds max_context_len=16"):
            compiled(scratch, torch.tensor([17, 3]), r2t)


def test_the_pass_does_not_see_the_range_asserts():
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    seen = []

    class Look(Recorder):
        def __call__(self, gm, example_inputs):
            ranged = tracing.ranged_items(gm.graph)
            before = sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten._assert_scalar.default)
            tracing.strip_range_asserts(gm.graph)
            after = sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten._assert_scalar.default)
            seen.append((len(ranged), before, after, ranged[0].meta[tracing.META] if ranged else None))
            return gm.forward

    _run(grow_step, Look(), Scratch(4), torch.tensor([9, 3]), r2t)
    assert seen == [(1, 2, 0, (16, "max_context_len=16"))]


def _max_of(x, r2t):
    m = x.max().item()
    if m > r2t.shape[1]:  # False for every value in [0, 16]: decided by the range where it is given one
        m = r2t.shape[1]
    return r2t[:, :m].sum()


@pytest.mark.parametrize("name, options, bound", [
    ("seq_lens", {}, 16),
    ("verify_lens", {"length_bounds": {"verify_lens": 3}}, 3),
    ("lens_host", {"cpu_mirrors": {"lens_host": "lens"}}, 16),
    ("widths", {}, None),  # not a lengths name: no range
])
def test_which_inputs_get_a_range(name, options, bound):
    backend = Recorder(**options)
    r2t = torch.ones(2, 16, dtype=torch.int32)

    def step(fb):
        return _max_of(getattr(fb, name), r2t)

    class FB:
        pass

    fb = FB()
    setattr(fb, name, torch.tensor([2, 3]))
    _run(step, backend, fb)
    ranged = [n.meta[tracing.META][0] for g in backend.graphs for n in g.graph.nodes if tracing.META in n.meta]
    assert ranged == ([bound] if bound is not None else [])


def test_a_max_of_an_intermediate_gets_no_range():
    backend = Recorder()
    r2t = torch.ones(2, 16, dtype=torch.int32)

    def step(seq_lens):
        return _max_of(seq_lens * 2, r2t)

    _run(step, backend, torch.tensor([2, 3]))
    assert not any(tracing.META in n.meta for g in backend.graphs for n in g.graph.nodes)


def test_compile_gives_the_range_while_dynamo_traces():
    """compile_pass.compile (Inductor) traces the grow-on-demand step as one graph."""
    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    before = len(_compat.graph_break_reasons())
    step = compile_pass.compile(grow_step, max_context_len=16)
    scratch = Scratch(4)
    got = step(scratch, torch.tensor([9, 3]), r2t)
    assert _breaks(before) == [] and int(got[1]) == 9
    assert len(compile_pass.reports(step)) == 1


# -- constructs that break the trace before any max: the report names the one change ---------------------------
def test_a_disabled_kernel_wrapper_is_reported_with_the_change_that_keeps_one_graph():
    @torch.compiler.disable
    def kernel(x):
        return x * 2

    def step(x):
        return kernel(x + 1) - 1

    compiled = compile_pass.compile(step, max_context_len=16)
    compiled(torch.ones(3))
    notes = [n for r in compile_pass.reports(compiled) for n in r.notes]
    assert any("torch.library.custom_op" in n and "test_tracing.py:" in n for n in notes), notes


try:  # SGLang's KVIndexTable and RaggedTargetVerifyGeometry are msgspec.Structs
    import msgspec

    class StructTable(msgspec.Struct):
        ids: torch.Tensor
        stride: int
except ImportError:  # pragma: no cover - msgspec comes with the test extras' SGLang set
    StructTable = None


@pytest.mark.skipif(StructTable is None, reason="msgspec is not installed")
def test_a_msgspec_struct_is_reported_with_the_change_that_makes_it_traceable():
    Table = StructTable

    def step(x):
        t = Table(x + 1, 4)
        return t.ids * t.stride

    compiled = compile_pass.compile(step, max_context_len=16)
    torch.testing.assert_close(compiled(torch.ones(3)), step(torch.ones(3)))
    notes = [n for r in compile_pass.reports(compiled) for n in r.notes]
    assert any("dataclass or NamedTuple" in n for n in notes), notes


# -- a branch that differs inside the range: traced at the bound, asserted on the device, or traced again ------
def _branch_step(fb):
    m = fb.seq_lens.max().item()
    n = m + 4 if m < 8 else m  # False at the bound (64): the branch differs inside [0, 64]
    table = fb.req_to_token[fb.req_pool_indices, :n]
    return torch.ops.syncfree_test.bounded_sum(table, fb.seq_lens, 1, n)


def test_a_branch_that_differs_is_traced_at_the_bound_and_asserted_on_the_device():
    import consumers_for_tests  # noqa: F401  (syncfree_test::bounded_sum, a self-guarding consumer)
    from passlib import make_fb

    before = len(_compat.graph_break_reasons())
    step = compile_pass.compile(_branch_step, max_context_len=64, dynamic=False)
    for lengths in ([3, 9, 60], [8, 1, 2]):
        fb = make_fb(lengths)
        torch.testing.assert_close(step(fb), _branch_step(fb))
    assert _breaks(before) == []
    reports = compile_pass.reports(step)
    assert reports and all(r.rewritten and not r.kept for r in reports), [str(r) for r in reports]
    with pytest.raises(RuntimeError, match="traced with the outcome it has at the bound"):
        step(make_fb([3, 5, 7]))  # max 7 < 8: eager takes the other branch; the step raises instead of guessing


def test_a_kept_max_is_traced_again_without_the_branch_at_the_bound():
    import consumers_for_tests  # noqa: F401
    from passlib import make_fb

    def step(fb):
        return _branch_step(fb), fb.seq_lens.max().item() + 0  # the max also escapes: kept

    def escaping(fb):
        m = fb.seq_lens.max().item()
        n = m + 4 if m < 8 else m
        return fb.req_to_token[fb.req_pool_indices, :n].sum(), m  # no consumer: the pass keeps the max

    before = len(_compat.graph_break_reasons())
    compiled = compile_pass.compile(escaping, max_context_len=64)
    for lengths in ([3, 9, 60], [3, 5, 7]):
        fb = make_fb(lengths)
        got, want = compiled(fb), escaping(fb)
        assert int(got[0]) == int(want[0]) and int(got[1]) == want[1]
    assert any("data-dependent" in r for r in _breaks(before))  # traced again: the branch breaks, as eager
