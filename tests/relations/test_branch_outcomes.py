"""A branch on the max whose outcome differs inside [0, bound] (issue 45, item 1), at realistic parameters.

TRTLLM-MLA's `_calc_padded_blocks`: `blocks = cdiv(m, ps)`, rounded up to a multiple of `lcm = 4096 / ps` under
`if blocks % lcm != 0`. At a max_context_len that is a multiple of 4096 the branch is not taken at the bound and
is taken for most maxima below it. The backend traces the frame with each outcome; both rewrites give the same
graph (the allocated table at the bound's width), so the step is rewritten with no assertion on the outcome and
every max in [0, bound] (each residue class of `blocks % lcm`, 0 and the bound included) gives eager's values.
At a bound that is not such a multiple the two rewrites differ (widths), and the branch breaks the graph as
without the backend: kept, still eager's values.
"""

from __future__ import annotations

import random

import pytest
import torch

from consumers_for_tests import WRITE_ROWS
from paged_steps import maxima, padded_blocks
from passlib import compile_traced

WRITER = WRITE_ROWS  # tests/support/consumers_for_tests.py: a registered bounded writer

ATTN = torch.ops.syncfree.paged_decode
REQS = 5


def make_step(page_size: int):
    def decode_step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        blocks = padded_blocks(m, page_size)
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, seq_lens, table, blocks, page_size)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
    return decode_step


def make_inputs(lengths, width: int, page_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(REQS * width // page_size, generator=gen).view(REQS, -1)
    tok = torch.arange(width)
    r2t = (pages[:, tok // page_size] * page_size + tok % page_size).to(torch.int32)
    rpi = torch.randperm(REQS, generator=gen)[: len(lengths)]
    q = torch.randn(len(lengths), 1, 2, 4, generator=gen)
    k = torch.randn(REQS * width // page_size, page_size, 1, 4, generator=gen)
    v = torch.randn(REQS * width // page_size, page_size, 1, 4, generator=gen)
    return q, k, v, r2t, rpi, torch.tensor(lengths, dtype=torch.int64)


@pytest.mark.parametrize("bound,page_size", [(4096, 64), (8192, 32), (32768, 64), (131072, 64), (32768, 32)])
def test_the_round_up_at_a_multiple_of_its_span_is_rewritten_and_no_max_raises(bound, page_size):
    step = make_step(page_size)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    width = bound + page_size
    rng = random.Random(bound + page_size)
    for n, m in enumerate(maxima(bound, page_size, 0)):
        lengths = [m, rng.randint(0, m), rng.randint(0, m)]
        inputs = make_inputs(lengths, width, page_size, seed=n)
        torch.testing.assert_close(call(*inputs), step(*inputs))
    reports = backend.reports
    assert reports and all(r.rewritten and not r.kept for r in reports), [str(r) for r in reports]
    assert f"width {bound // page_size}" in reports[0].rewritten[0].reason, reports[0].rewritten[0].reason


def test_a_bound_off_the_round_up_s_span_breaks_at_the_branch_and_gives_eager_s_values():
    bound, page_size = 6000, 64  # not a multiple of 4096: the two outcomes' widths differ (128 against 94)
    step = make_step(page_size)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    width = 8192 + page_size
    rng = random.Random(1)
    for n, m in enumerate([0, 1, 4095, 4096, 4097, 5999, 6000, 300]):
        lengths = [m, rng.randint(0, m), rng.randint(0, m)]
        inputs = make_inputs(lengths, width, page_size, seed=n)
        torch.testing.assert_close(call(*inputs), step(*inputs))
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]


# -- what the two outcomes do outside the graph ----------------------------------------------------------------
# Two traces with the same FX graph are one computation only where the code Dynamo runs around the graph is the
# same too: an attribute store, a returned constant, a local handed across a graph break, or the input a branch
# picks lives in that code or in the graph's inputs, not in its nodes. Each outcome of these branches differs
# there only: the step breaks at the branch (the max kept), with eager's values and eager's side effects for
# maxima of either outcome. A store that is the same in both outcomes (TRTLLM-MLA stores its metadata) does not
# stop the rewrite.
class Holder:
    pass


HOLDER = Holder()
BOUND, PS = 4096, 64


def _table(r2t, rpi, seq_lens):
    """The table at cdiv(m, PS): no branch of its own, so the parity below is the step's one branch."""
    m = seq_lens.max().item()
    blocks = (m + PS - 1) // PS
    table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
    WRITER(r2t, rpi, seq_lens, table, blocks, PS)
    return m, table


def parity_store(q, k, v, r2t, rpi, seq_lens):
    m, table = _table(r2t, rpi, seq_lens)
    HOLDER.parity = "even" if m % 2 == 0 else "odd"
    return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


def parity_returned(q, k, v, r2t, rpi, seq_lens):
    m, table = _table(r2t, rpi, seq_lens)
    return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m), ("even" if m % 2 == 0 else "odd")


def parity_across_a_break(q, k, v, r2t, rpi, seq_lens):
    m, table = _table(r2t, rpi, seq_lens)
    scale = 2.0 if m % 2 == 0 else 3.0
    out = ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
    torch._dynamo.graph_break()
    return out * scale


def parity_picks_an_input(q, k, v, r2t, rpi, seq_lens):
    m, table = _table(r2t, rpi, seq_lens)
    keys = k if m % 2 == 0 else v
    return ATTN(q, keys, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


def same_store(q, k, v, r2t, rpi, seq_lens):
    m, table = _table(r2t, rpi, seq_lens)
    HOLDER.table = table  # in both outcomes: the metadata TRTLLM-MLA stores
    return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


def _observed(out):
    return (out, getattr(HOLDER, "parity", None))


@pytest.mark.parametrize("step", [parity_store, parity_returned, parity_across_a_break, parity_picks_an_input])
def test_outcomes_that_differ_outside_the_graph_keep_eager_s_values_and_side_effects(step):
    call, backend = compile_traced(step, dynamic=False, max_context_len=BOUND)
    for n, m in enumerate([BOUND, BOUND - 1, 7, 8, 100, 101, 0, 1]):
        inputs = make_inputs([m, 3, min(m, 2)], BOUND + PS, PS, seed=n)
        got = _observed(call(*inputs))
        want = _observed(step(*inputs))
        (got_out, got_side), (want_out, want_side) = got, want
        if isinstance(want_out, tuple):  # the returned constant
            (got_out, got_const), (want_out, want_const) = got_out, want_out
            assert got_const == want_const, m
        torch.testing.assert_close(got_out, want_out)
        assert got_side == want_side, m
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]


def test_a_store_the_same_in_both_outcomes_is_still_rewritten():
    call, backend = compile_traced(same_store, dynamic=False, max_context_len=BOUND, static_escapes=True)
    for n, m in enumerate([BOUND, 4000, 1, 0, 4033]):
        inputs = make_inputs([m, 3, min(m, 2)], BOUND + PS, PS, seed=n)
        got = call(*inputs)
        got_table = HOLDER.table
        want = same_store(*inputs)
        torch.testing.assert_close(got, want)
        assert got_table.shape[1] == BOUND // PS  # the table leaves at the static width
        for b, length in enumerate([m, 3, min(m, 2)]):
            used = -(-length // PS)
            assert torch.equal(got_table[b, :used], HOLDER.table[b, :used])
    assert backend.reports and all(r.rewritten and not r.kept for r in backend.reports), \
        [str(r) for r in backend.reports]


@pytest.mark.parametrize("step,bound,why", [
    (parity_store, BOUND, "its two outcomes differ outside the graph"),
    (make_step(64), 6000, "its two outcomes compute different graphs"),
])
def test_the_report_says_why_a_branch_breaks_and_what_would_prove_it(step, bound, why):
    import compile_pass

    compiled = compile_pass.compile(step, max_context_len=bound, dynamic=False)
    for n, m in enumerate([bound, 7]):
        inputs = make_inputs([m, 3, 2], 8192 + PS, PS, seed=n)
        got, want = compiled(*inputs), step(*inputs)
        torch.testing.assert_close(got, want)
    breaks = [i for r in compile_pass.reports(compiled) for i in r.kept if i.kind == "graph_break"]
    assert breaks and all("has a branch whose outcome differs inside [0, bound], not decided" in i.reason
                          and why in i.reason and "proven when" in i.reason for i in breaks), [i.reason for i in breaks]


def test_each_batch_size_of_a_static_compile_traces_both_outcomes_again():
    """dynamic=False: a new batch size recompiles the frame; its two outcomes are compared with each other (the
    first batch's graph has other constants), so every batch size is rewritten: 3, then 2 and 5 (issue 45's
    independent harness), maxima on both sides of the round-up's span."""
    bound, page_size = 8192, 64
    step = make_step(page_size)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    rng = random.Random(7)
    for n, (batch, m) in enumerate([(3, 1), (3, 4097), (2, bound), (2, 4095), (5, 4096), (5, 1), (3, 8191)]):
        lengths = [m] + [rng.randint(0, m) for _ in range(batch - 1)]
        inputs = make_inputs(lengths, bound + page_size, page_size, seed=n)
        torch.testing.assert_close(call(*inputs), step(*inputs))
    reports = backend.reports
    assert len(reports) == 3 and all(r.rewritten and not r.kept for r in reports), [str(r) for r in reports]


# -- a second branch that the first one's outcomes decide ----------------------------------------------------------
# FlashInfer's `_check_trtllm_gen_mla_shape` checks `block_num % (128 / page_size) == 0` after TRTLLM-MLA's
# round-up: in both outcomes of the round-up the blocks are a multiple of 64 pages, so the check holds for every
# max each outcome admits and adds no assumption (traced_ranges.implied_outcome). A second branch that differs
# within one outcome is still not decided: the step breaks there.
def checked_round_up(page_size: int, check: int):
    def decode_step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        blocks = padded_blocks(m, page_size)
        if blocks % check != 0:
            raise ValueError(f"block_num {blocks} is not a multiple of {check}")
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, seq_lens, table, blocks, page_size)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
    return decode_step


@pytest.mark.parametrize("bound,page_size", [(4096, 32), (32768, 64), (131072, 64)])
def test_a_check_both_outcomes_satisfy_adds_no_assumption(bound, page_size):
    step = checked_round_up(page_size, 128 // page_size)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    rng = random.Random(bound)
    for n, m in enumerate(maxima(bound, page_size, 3)):
        if m == 0:
            continue  # blocks 0: eager's own check passes too, but the decode needs a length
        lengths = [m, rng.randint(0, m), rng.randint(0, m)]
        inputs = make_inputs(lengths, bound + page_size, page_size, seed=n)
        torch.testing.assert_close(call(*inputs), step(*inputs))
    assert backend.reports and all(r.rewritten and not r.kept for r in backend.reports), \
        [str(r) for r in backend.reports]


def test_a_second_branch_that_differs_within_an_outcome_still_breaks():
    bound, page_size = 8192, 64

    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        blocks = padded_blocks(m, page_size)
        scale = 2.0 if m % 3 == 0 else 1.0  # differs within each outcome of the round-up
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, seq_lens, table, blocks, page_size)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m) * scale

    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    for n, m in enumerate([bound, 8190, 4096, 4095, 3, 1]):
        inputs = make_inputs([m, 1, 2], bound + page_size, page_size, seed=n)
        torch.testing.assert_close(call(*inputs), step(*inputs))
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]
