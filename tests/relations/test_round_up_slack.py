"""The allocated-table rule credits a round-up's slack (issue 30, TRTLLM-MLA's draft extend).

TRTLLM-MLA sizes its block table by `_calc_padded_blocks(m)`: `blocks = cdiv(m, 64)`, then, `if blocks % L != 0`,
rounded up to a multiple of L. Its draft-extend lengths are `seq_lens - extend_seq_lens + K` (K the widest
extend): up to m + K - 1, more than the max itself. Eager stays inside its table only because the round-up covers
more than m: `L * 64 * ceil(cdiv(m, 64) / L)` tokens. The rule takes that slack, the minimum over every value the
max can take, as what the lengths may exceed the max by. Those values are [0, bound] less the ones where a branch
traced at the bound fails (compile_pass.traced_ranges.admitted_values; each outcome is asserted on the device).

Compiled through the backend's tracing (the range while Dynamo traces, the pass, the graph as captured) against
eager over ragged extends; eager's writer raises where a row would need more columns than its table has.
"""

from __future__ import annotations

import inspect

import pytest
import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, PythonMod

from compile_pass import _compat, traced_ranges
from consumers_for_tests import WRITE_ROWS
from passlib import compile_traced

PS = 64
LCM = 4  # the round-up's multiple (SGLang: lcm(128 / page_size, pages per Triton block) = 64 at pages of 64)
REQS = 6
WIDTH = 640  # tokens per row of the token table: past every length below
K = 4  # the widest extend (max(extend_seq_lens_cpu)): a Python int, as SGLang's host list gives it

WRITER = WRITE_ROWS  # tests/support/consumers_for_tests.py: a registered bounded writer (it raises where a row
# needs more columns than the stride: eager's table too narrow for its lengths)
ATTN = torch.ops.syncfree.paged_decode


def padded_blocks(m: int) -> int:  # trtllm_mla_backend.py's _calc_padded_blocks, with L = LCM
    blocks = (m + PS - 1) // PS
    if blocks % LCM != 0:
        blocks = (blocks + LCM - 1) // LCM * LCM
    return blocks


def draft_extend_step(q, k, v, r2t, rpi, seq_lens, extend_seq_lens, widest=K):
    m = seq_lens.max().item()
    lengths = seq_lens - extend_seq_lens + widest  # trtllm_mla_backend.py:862
    blocks = padded_blocks(m)
    table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
    WRITER(r2t, rpi, lengths, table, blocks, PS)
    return ATTN(q, k, v, table, lengths.to(torch.int32), max_seqlen_k=m + widest)


def wide_extend_step(q, k, v, r2t, rpi, seq_lens, extend_seq_lens):
    return draft_extend_step(q, k, v, r2t, rpi, seq_lens, extend_seq_lens, widest=100)


def make_inputs(lengths, extends, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(REQS * WIDTH // PS, generator=gen).view(REQS, -1)
    tok = torch.arange(WIDTH)
    r2t = (pages[:, tok // PS] * PS + tok % PS).to(torch.int32)
    rpi = torch.randperm(REQS, generator=gen)[: len(lengths)]
    q = torch.randn(len(lengths), 1, 4, 16, generator=gen)
    k = torch.randn(REQS * WIDTH // PS, PS, 2, 16, generator=gen)
    v = torch.randn(REQS * WIDTH // PS, PS, 2, 16, generator=gen)
    return (q, k, v, r2t, rpi, torch.tensor(lengths, dtype=torch.int64),
            torch.tensor(extends, dtype=torch.int64))


def traced(step, **options):
    """(call, backend): `step` compiled as compile_pass.compile traces it (the range, the retrace), no Inductor."""
    return compile_traced(step, dynamic=False, **options)


def ragged(n, seed):
    """Batch vectors of n rows: lengths >= K, extends in [1, K] (the row with the max length gets extend 1, so
    that its length reaches m + K - 1: past the max)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for m in (64, 100, 190, 192, 260, 300):
        lengths = torch.randint(K, m + 1, (n,), generator=gen)
        lengths[0] = m
        extends = torch.randint(1, K + 1, (n,), generator=gen)
        extends[0] = 1
        out.append((lengths.tolist(), extends.tolist()))
    return out


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- the values a max can take --------------------------------------------------------------------------------
def _item_with(guards):
    graph = torch.fx.Graph()
    node = graph.placeholder("m")
    node.meta[traced_ranges.AT_BOUND] = [(f"traced: {g}", g) for g in guards]
    return node


def _blocks_not_a_multiple(s):
    return sympy.Ne(PythonMod(FloorDiv(s + PS - 1, PS), LCM), 0)


def test_admitted_values_are_the_range_less_where_a_traced_branch_fails():
    s = sympy.Symbol("u0", integer=True)
    got = traced_ranges.admitted_values(_item_with([_blocks_not_a_multiple(s)]), 300).tolist()
    want = [m for m in range(301) if ((m + PS - 1) // PS) % LCM != 0]  # a plain loop
    assert got == want and 0 not in got and 256 not in got and 257 in got


def test_admitted_values_with_two_guards_and_a_negated_one():
    s = sympy.Symbol("u0", integer=True)
    guards = [_blocks_not_a_multiple(s), sympy.Not(sympy.StrictLessThan(s, 10))]
    got = traced_ranges.admitted_values(_item_with(guards), 300).tolist()
    assert got == [m for m in range(10, 301) if ((m + PS - 1) // PS) % LCM != 0]


def test_a_bound_too_large_to_enumerate_gives_no_values():
    assert traced_ranges.admitted_values(_item_with([]), traced_ranges.ADMITTED_LIMIT) is None
    assert traced_ranges.admitted_values(_item_with([]), traced_ranges.ADMITTED_LIMIT - 1).numel() == traced_ranges.ADMITTED_LIMIT


def test_a_guard_it_cannot_evaluate_narrows_nothing():
    s, t = sympy.Symbol("u0", integer=True), sympy.Symbol("u1", integer=True)
    full = list(range(301))
    assert traced_ranges.admitted_values(_item_with([]), 300).tolist() == full
    assert traced_ranges.admitted_values(_item_with([sympy.Ne(s, t)]), 300).tolist() == full  # two symbols
    assert traced_ranges.admitted_values(_item_with([sympy.Ne(sympy.sin(s), 0)]), 300).tolist() == full  # no spelling


# -- the rule ------------------------------------------------------------------------------------------------
def _run(step, vectors, **options):
    call, backend = traced(step, **options)
    for n, (lengths, extends) in enumerate(vectors):
        got = call(*make_inputs(lengths, extends, seed=n))
        want = step(*make_inputs(lengths, extends, seed=n))
        torch.testing.assert_close(got, want)
    return backend


def test_a_round_up_taken_at_the_bound_but_not_below_breaks_and_gives_eager_s_values():
    """Bound 180: `blocks % 4 != 0` holds at the bound and fails at m = 0 only. Traced with each outcome, the
    rewrites differ (width 4 with the round-up's slack; at m = 0 the lengths, m + K - 1, would exceed an
    unrounded table), so the frame is traced again with the range only: the branch breaks the graph as without
    the backend, and every vector gives eager's values; no length within the bound raises (issue 45: the
    outcome is never asserted on the device)."""
    vectors = [v for v in ragged(3, 0) if v[0][0] <= 180]
    backend = _run(draft_extend_step, vectors, max_context_len=180)
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]


def test_maxima_whose_branch_differs_from_the_bound_s_give_eager_s_values():
    """Bound 300: the branch holds at the bound and fails for m in [193, 256] (4 blocks, already a multiple).
    Those maxima once raised a device assertion; now the step breaks at the branch and gives eager's values for
    every vector, those in [193, 256] included."""
    vectors = ragged(4, 1) + [([200, 7, 9, 11], [1, 2, 4, 1]), ([230, 7, 9, 11], [1, 2, 4, 1])]
    backend = _run(draft_extend_step, vectors, max_context_len=300)
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]


def _recording(monkeypatch):
    import compile_pass.pipeline as pipeline_module
    from compile_pass.sync_pass import SyncPass

    decisions = []

    class Recording(SyncPass):
        def __call__(self, gm):
            result = super().__call__(gm)
            decisions.append([(i.reason_code, i.location) for i in result.kept])
            return result

    monkeypatch.setattr(pipeline_module, "SyncPass", Recording)
    return decisions


def test_lengths_past_the_slack_keep_the_max(monkeypatch):
    """widest = 100: the lengths may exceed the max by 99, the slack at bound 180 is 76: kept (lengths_exceed) on
    the trace at the bound, which is refused; traced again without the branch's outcome, the branch breaks the
    graph, and the step equals eager where eager's table holds the lengths."""
    decisions = _recording(monkeypatch)
    before = len(_compat.graph_break_reasons())
    vectors = [([64, 5, 9], [1, 100, 100]), ([150, 120, 7], [100, 100, 1])]  # m + 99 within eager's 256 tokens
    _run(wide_extend_step, vectors, max_context_len=180)
    lines, first = inspect.getsourcelines(draft_extend_step)
    item_line = first + next(i for i, line in enumerate(lines) if ".item()" in line)
    assert decisions[0] == [("lengths_exceed", f"test_round_up_slack.py:{item_line}")], decisions
    assert any("data-dependent" in r for r, _ in _compat.graph_break_reasons()[before:])


def test_without_a_traced_branch_there_is_no_slack_at_zero():
    """checked=False: no branch is traced at the bound (and none asserted), so m = 0 stays a value of the max,
    where the round-up covers nothing: no slack; the branch breaks the graph as Dynamo traces it."""
    before = len(_compat.graph_break_reasons())
    _run(draft_extend_step, [([64, 5, 9], [1, 2, 4])], max_context_len=180, checked=False)
    assert any("data-dependent" in r for r, _ in _compat.graph_break_reasons()[before:])


def test_a_credited_round_up_that_only_one_outcome_has_is_not_rewritten():
    """The round-up's slack exists only where the branch rounds up: the other outcome's trace keeps the max
    (lengths_exceed), so the frame is traced with the range only and nothing is rewritten."""
    call, backend = traced(draft_extend_step, max_context_len=180)
    torch.testing.assert_close(call(*make_inputs([64, 5, 9], [1, 2, 4])),
                               draft_extend_step(*make_inputs([64, 5, 9], [1, 2, 4])))
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]


# -- what the review of the credit found (each failed before its fix, or pins a mutant) ------------------------
def test_the_slack_is_the_minimum_over_every_value_not_at_the_bound(monkeypatch):
    """Bound 300, lengths up to the max + 99: the slack at the bound is 212 but 64 at m = 192 (4 pages exactly):
    kept, as eager's table does not hold them at m = 192."""
    decisions = _recording(monkeypatch)
    call, _ = traced(wide_extend_step, max_context_len=300)
    call(*make_inputs([100, 5, 9], [1, 100, 100]))
    assert [code for code, _ in decisions[0]] == ["lengths_exceed"], decisions


def test_an_unconditional_round_up_covers_nothing_at_zero(monkeypatch):
    """`cdiv(cdiv(m, 64), 4) * 4` without a branch: m = 0 stays a value of the max, where the table has no column,
    so the lengths (the max + 3) are not covered: kept."""
    def unconditional(q, k, v, r2t, rpi, seq_lens, extend_seq_lens):
        m = seq_lens.max().item()
        lengths = seq_lens - extend_seq_lens + K
        blocks = ((m + PS - 1) // PS + LCM - 1) // LCM * LCM
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, lengths, table, blocks, PS)
        return ATTN(q, k, v, table, lengths.to(torch.int32), max_seqlen_k=m + K)

    decisions = _recording(monkeypatch)
    call, _ = traced(unconditional, max_context_len=180)
    want = unconditional(*make_inputs([64, 5, 9], [1, 2, 4]))
    torch.testing.assert_close(call(*make_inputs([64, 5, 9], [1, 2, 4])), want)
    assert [code for code, _ in decisions[0]] == ["lengths_exceed"], decisions


def test_the_traced_outcome_is_checked_on_the_lengths_as_the_max_read_them():
    """The lengths written in place before the max (once: the outcome was asserted after that write, on the
    values the max was taken over), not at the graph's start. Pre-write max 190 passes the branch, the max 254
    does not (4 pages exactly, eager's table then too narrow): the step raises where eager does."""
    def shifted(q, k, v, r2t, rpi, seq_lens, extend_seq_lens, shift):
        seq_lens.add_(shift)
        return draft_extend_step(q, k, v, r2t, rpi, seq_lens, extend_seq_lens)

    call, backend = traced(shifted, max_context_len=300)
    call(*make_inputs([100, 7, 9], [1, 2, 4]), torch.tensor(0))
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]
    with pytest.raises(IndexError):
        shifted(*make_inputs([190, 7, 9], [1, 2, 4]), torch.tensor(64))
    with pytest.raises(IndexError):  # as eager: the step breaks at the branch and runs eager's table
        call(*make_inputs([190, 7, 9], [1, 2, 4]), torch.tensor(64))


def test_the_bound_is_never_wider_than_the_range_dynamo_traced_with():
    """max_context_len 180 gives the mirror's max its range while Dynamo traces; the twin's declared 320 would
    let the rule assume values Dynamo never traced for (`blocks <= 3` was decided without a guard): the bound is
    the traced 180, and a mirror past it raises under checked (eager fails there)."""
    def step(q, k, v, r2t, rpi, seq_lens, seq_lens_cpu, extend_seq_lens):
        m = seq_lens_cpu.max().item()
        lengths = seq_lens - extend_seq_lens + K
        blocks = (m + PS - 1) // PS
        if blocks % LCM != 0 and blocks <= 3:
            blocks = (blocks + LCM - 1) // LCM * LCM
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, lengths, table, blocks, PS)
        return ATTN(q, k, v, table, lengths.to(torch.int32), max_seqlen_k=m + K)

    def inputs(lengths, extends):
        q, k, v, r2t, rpi, seq_lens, ext = make_inputs(lengths, extends)
        return q, k, v, r2t, rpi, seq_lens, seq_lens.clone(), ext

    call, backend = traced(step, max_context_len=180, length_bounds={"seq_lens": 320})
    torch.testing.assert_close(call(*inputs([100, 7, 9], [1, 2, 4])), step(*inputs([100, 7, 9], [1, 2, 4])))
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]
    with pytest.raises(IndexError):
        step(*inputs([319, 7, 9], [1, 2, 4]))
    with pytest.raises(RuntimeError, match="exceeds max_context_len=180"):  # outside the contract: the kept
        call(*inputs([319, 7, 9], [1, 2, 4]))  # max's range is checked again on the host (recheck_kept)
