"""The differential safety suite: compiled vs eager on many random length vectors, for every case in
soundness_cases.py and for generated ones (Hypothesis composes a decode step with an in-place write, a cast, an
offset and an escape). Any difference in values, shapes, dtypes, raised errors or the inputs a call leaves
behind fails. The pass runs on the Dynamo graph, which then runs without Inductor (fast); a representative few
go through the full backend and Inductor too.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compile_pass
import soundness_cases as cases
from passlib import Rewriting, host_reads, length_vectors, run

VECTORS = 6  # random length vectors per case, after the one it compiles on


def outcome(fn, inputs: cases.Inputs):
    """(result or the exception's type, the inputs as the call left them)."""
    try:
        result = fn(inputs)
    except Exception as e:  # noqa: BLE001 - compared by type
        result = type(e)
    return result, inputs.tensors()


def assert_same(got, want, where: str):
    if isinstance(want, type):
        assert isinstance(got, type) and (issubclass(got, want) or issubclass(want, got)), \
            f"{where}: eager raised {want.__name__}, compiled gave {got!r}"
        return
    assert not isinstance(got, type), f"{where}: compiled raised {got.__name__}, eager returned a value"
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} is not a tensor"
        assert got.shape == want.shape and got.dtype == want.dtype, \
            f"{where}: {tuple(got.shape)} {got.dtype} vs eager {tuple(want.shape)} {want.dtype}"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=where)
    else:
        assert got == want, f"{where}: {got!r} vs eager {want!r}"


def differential(fn, batch: int = 3, seed: int = 0, **options):
    """Compile once, then compare compiled and eager on several length vectors; return the pass's report."""
    # checked=False: the generated writes may push a length past the bound (seq_lens += 1 before the max), where
    # the default device assertion would fire; this suite compares the values of the unchecked rewrite.
    backend = Rewriting(max_context_len=cases.MCL, **{"checked": False, **options})
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for n, lengths in enumerate(length_vectors(batch, VECTORS, seed, top=cases.MCL)):
        inputs = cases.make_inputs(lengths, seed=seed + n)
        want = outcome(fn, inputs.clone())
        with compile_pass._compat.capture_scalar_outputs():
            got = outcome(compiled, inputs.clone())
        assert_same(got, want, f"{fn.__name__}{lengths}")
    # One graph for every vector: nothing recompiled, nothing fell back to eager.
    assert len(backend.graphs) == 1, f"{len(backend.graphs)} graphs"
    return backend.report, backend


@pytest.mark.parametrize("name", sorted(cases.REWRITTEN))
def test_safe_case_is_rewritten_and_equals_eager(name):
    report, backend = differential(cases.REWRITTEN[name])
    assert report.rewritten and not report.kept, str(report)
    assert host_reads(backend) == []


@pytest.mark.parametrize("name", sorted(cases.KEPT))
def test_unsafe_case_is_kept_with_its_reason_and_equals_eager(name):
    fn, words = cases.KEPT[name]
    report, _ = differential(fn)
    assert report.kept, str(report)
    reasons = " | ".join(i.reason for i in report.kept)
    assert all(i.reason.startswith("kept: ") and len(i.reason) > 12 for i in report.kept)
    assert any(all(w in i.reason for w in words) for i in report.kept), reasons


def test_suite_size():
    assert len(cases.REWRITTEN) + len(cases.KEPT) >= 50


# -- generated cases -------------------------------------------------------------------------------------
WRITE_TARGETS = ("req_to_token", "req_pool_indices", "seq_lens", "pool", "none")
WRITE_PLACES = ("before_max", "after_max", "after_gather", "after_consumer")


def composed_step(write_target, write_place, offset, page_size, cast, escape):
    def write(x):
        if write_target == "req_to_token":
            x.req_to_token[:, :8].add_(1)
        elif write_target == "req_pool_indices":
            x.req_pool_indices.copy_(x.req_pool_indices.flip(0))
        elif write_target == "seq_lens":
            x.seq_lens.add_(1)
        elif write_target == "pool":
            x.pool.mul_(2)

    def step(x):
        if write_place == "before_max":
            write(x)
        m = x.seq_lens.max().item()
        if write_place == "after_max":
            write(x)
        t = x.req_to_token[x.req_pool_indices, : m + offset : page_size]
        if page_size > 1:
            t = t // page_size
        if cast == "int":
            t = t.int()
        elif cast == "long":
            t = t.long()
        elif cast == "float":
            t = t.float().int()
        if write_place == "after_gather":
            write(x)
        out = cases.SUM(t, x.seq_lens, page_size, m + offset)
        if write_place == "after_consumer":
            write(x)
        return (out, t) if escape else out

    return step


def expected_safe(write_target, write_place, offset, cast, escape) -> bool:
    if escape or cast == "float" or offset < 0:
        return False
    if write_target in ("pool", "none") or write_place in ("before_max", "after_consumer"):
        return True
    if write_target == "seq_lens":
        return False  # after the max, before the consumer
    return write_place == "after_max"  # the table and indices are read at the gather


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(write_target=st.sampled_from(WRITE_TARGETS), write_place=st.sampled_from(WRITE_PLACES),
       offset=st.sampled_from([0, 1, 3, -1]), page_size=st.sampled_from([1, 4]),
       cast=st.sampled_from(["none", "int", "long", "float"]), escape=st.booleans(),
       seed=st.integers(0, 1000))
def test_generated_steps_equal_eager(write_target, write_place, offset, page_size, cast, escape, seed):
    torch._dynamo.reset()
    step = composed_step(write_target, write_place, offset, page_size, cast, escape)
    report, backend = differential(step, batch=4, seed=seed)
    safe = expected_safe(write_target, write_place, offset, cast, escape)
    assert bool(report.rewritten) == safe, (safe, str(report))
    assert bool(host_reads(backend)) == (not safe)
    assert all(i.reason.startswith("kept: ") for i in report.kept)


# -- lengths past the static bound, checked mode -----------------------------------------------------------
@pytest.mark.parametrize("name", ["plain_gather", "strided_gather_ps4", "bound_only", "speculative_lengths"])
def test_lengths_past_the_bound_read_nothing_out_of_bounds_and_checked_mode_asserts(name):
    fn = cases.REWRITTEN[name]
    beyond = cases.make_inputs([3, cases.MCL + 20, 9])  # within req_to_token (96 wide), past the bound (64)
    _, _, compiled = run(fn, cases.make_inputs([3, 9, 5]), max_context_len=cases.MCL, checked=False)
    with compile_pass._compat.capture_scalar_outputs():
        try:  # unspecified values, but no out-of-bounds access
            compiled(beyond.clone())
        except RuntimeError as e:  # the test consumer checks that its max_seqlen_k bounds its lengths
            assert "max_seqlen_k is not an upper bound" in str(e)
    torch._dynamo.reset()
    _, backend, checked = run(fn, cases.make_inputs([3, 9, 5]), max_context_len=cases.MCL,
                              checked=True)
    assert "lengths asserted on the device" in backend.report.rewritten[0].reason
    with compile_pass._compat.capture_scalar_outputs():
        at_bound = cases.make_inputs([3, cases.MCL, 0])
        assert_same(outcome(checked, at_bound.clone()), outcome(fn, at_bound.clone()), name)
        with pytest.raises(RuntimeError, match="exceeds the static bound that replaced its max"):
            checked(beyond.clone())


def test_checked_bound_is_the_replaced_bound_not_the_table_capacity():
    """page size 16, bound 20: the table holds 2 pages (32 keys) but a length of 25 exceeds the bound."""

    def step(x):
        m = x.seq_lens.max().item()
        return cases.SUM(x.req_to_token[x.req_pool_indices, :m:16] // 16, x.seq_lens, 16, m)

    _, _, checked = run(step, cases.make_inputs([3, 9, 5]), max_context_len=20, checked=True)
    with compile_pass._compat.capture_scalar_outputs():
        checked(cases.make_inputs([3, 20, 5]))
        with pytest.raises(RuntimeError, match="max_context_len=20"):
            checked(cases.make_inputs([3, 25, 5]))


# -- the representative few, through the full backend and Inductor ----------------------------------------
# compile_pass.compile gives a max its range [0, max_context_len] only at a branch of the user's code that needs it
# (compile_pass.tracing), so a step without such a branch is traced as pass-only: the user's check on the width,
# `torch._check(t.shape[1] <= 40)`, stays a check on a width symbol of its own and the max is kept (equal to eager,
# exceptions included). It was rewritten while the range was given at every `.item()` (Dynamo then spelled the
# width `m` itself); that range made a regional step be traced twice (BENCHMARKS.md, start-up time).
REWRITTEN_WITH_THE_RANGE: set = set()


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["plain_gather", "speculative_lengths", "table_written_between_gather_and_consumer",
                                  "lengths_grow_after_the_max", "user_check_on_the_width",
                                  "mirror_max_device_lengths"])
def test_through_inductor(name):
    fn = cases.REWRITTEN.get(name) or cases.KEPT[name][0]
    compiled = compile_pass.compile(fn, max_context_len=cases.MCL, fullgraph=True)
    for n, lengths in enumerate(length_vectors(3, 4, 7, top=cases.MCL)):
        inputs = cases.make_inputs(lengths, seed=n)
        want = outcome(fn, inputs.clone())
        got = outcome(compiled, inputs.clone())
        assert_same(got, want, f"{name}{lengths}")
    report = compile_pass.last_report()
    rewritten = name in cases.REWRITTEN or name in REWRITTEN_WITH_THE_RANGE
    assert bool(report.rewritten) == rewritten
    assert report.post_grad is not None
    assert (report.post_grad["local_scalar_dense"] == 0) == rewritten


def test_empty_batch_raises_like_eager():
    """B=0: eager's seq_lens.max() raises; the compiled step retraces for the new shape and raises the same."""
    fn = cases.REWRITTEN["plain_gather"]
    _, _, compiled = run(fn, cases.make_inputs([3, 9, 5]), max_context_len=cases.MCL)
    empty = cases.make_inputs([])
    with pytest.raises(RuntimeError, match="numel"):
        fn(empty.clone())
    with compile_pass._compat.capture_scalar_outputs(), pytest.raises(RuntimeError, match="numel"):
        compiled(empty.clone())


def test_control_flow_on_the_max_is_kept_and_equals_eager():
    """`if m > 30:` on the host int: Dynamo breaks the graph there; the max is kept and both branches match."""

    def step(x):
        m = x.seq_lens.max().item()
        if m > 30:
            return cases.SUM(cases.table(x, m), x.seq_lens, 1, m) * 2
        return cases.SUM(cases.table(x, m), x.seq_lens, 1, m)

    backend = Rewriting(max_context_len=cases.MCL)
    compiled = torch.compile(step, backend=backend)
    for n, lengths in enumerate([[3, 40, 5], [3, 9, 5], [64, 0, 31]]):
        inputs = cases.make_inputs(lengths, seed=n)
        with compile_pass._compat.capture_scalar_outputs():
            got = outcome(compiled, inputs.clone())
        assert_same(got, outcome(step, inputs.clone()), f"control flow {lengths}")
    reasons = [i.reason for r in backend.reports for i in r.kept]
    assert reasons and not any(r.rewritten for r in backend.reports), reasons


def test_inputs_that_alias_each_other_count_as_one_memory():
    """`other_lens` passed as a view of `seq_lens`: writing it after the max writes the consumer's lengths."""

    def step(x):
        m = x.seq_lens.max().item()
        t = cases.table(x, m)
        x.other_lens.add_(1)  # the same memory as seq_lens here
        return cases.SUM(t, x.seq_lens, 1, m + 1)

    inputs = cases.make_inputs([3, 40, 5])
    inputs.other_lens = inputs.seq_lens[:]
    want_inputs = cases.make_inputs([3, 40, 5])
    want_inputs.other_lens = want_inputs.seq_lens[:]
    got, backend, _ = run(step, inputs, max_context_len=cases.MCL)
    torch.testing.assert_close(got, step(want_inputs))
    torch.testing.assert_close(inputs.seq_lens, want_inputs.seq_lens)
    assert backend.report.kept and "written in place" in backend.report.kept[0].reason


def test_inputs_traced_apart_but_aliased_at_run_time_run_as_captured():
    """Dynamo does not guard on aliasing between inputs: traced with distinct tensors, called with `other_lens` a
    view of `seq_lens`, the rewritten graph would read lengths that eager had already changed. The backend checks
    the inputs its proof assumed distinct on every call and runs the untouched graph when they alias."""

    def step(x):
        m = x.seq_lens.max().item()
        t = cases.table(x, m)
        x.other_lens.add_(1)
        return cases.SUM(t, x.seq_lens, 1, m + 1)

    def aliased():
        x = cases.make_inputs([3, 40, 5])
        x.other_lens = x.seq_lens[:]
        return x

    for compile_with in ("pass only", "inductor"):
        torch._dynamo.reset()
        if compile_with == "pass only":
            backend = Rewriting(max_context_len=cases.MCL)
            compiled = torch.compile(step, backend=backend, fullgraph=True)
        else:
            compiled = compile_pass.compile(step, max_context_len=cases.MCL, fullgraph=True)
        with compile_pass._compat.capture_scalar_outputs():
            apart = cases.make_inputs([3, 40, 5])
            torch.testing.assert_close(compiled(apart), step(cases.make_inputs([3, 40, 5])))
            report = backend.report if compile_with == "pass only" else compile_pass.last_report()
            assert report.rewritten and report.disjoint_inputs, str(report)
            assert any("never share memory" in n for n in report.notes)
            got, want = aliased(), aliased()
            assert_same(outcome(compiled, got), outcome(step, want), f"aliased at run time ({compile_with})")
