"""Soundness review of the trace-time branch outcomes (283c393) and the allocated table's full view / covering
width (2796c9e, ec7005b): programs on which the compiled step must give eager's values and side effects for every
length in [0, bound].

A branch on a bounded max whose outcome differs inside the range is traced with each outcome, and the two traces
are called one computation where trace_signature.frame_signature is equal: the rewritten FX graph (placeholders by
source) and the residual bytecode after the graph (_compat.frame_residual: `pass2` of compile_subgraph). The
accepted compile then runs, for every max, the code of the trace with the OTHER outcome (the second one). Three
things decided what that code does and were in neither part of the signature; each broke the equality below
until its fix (the signature refuses a graph that ends at a graph break and compares the guards; the evidence is
cleared however the call ends):

  1. where the frame resumes after a graph break: the resume function (and the locals it is handed) is built by
     symbolic_convert.create_call_resume_at AFTER compile_subgraph returns, so it is not in `pass2`;
  2. the guards: the accepted code is guarded by the second trace's guards only; what only the first outcome read
     (an attribute, a size under dynamic shapes) is never guarded;
  3. the evidence a recompile is compared with: tracing.TracingPolicy keeps mode "other" and the first compile's
     signature for the line until call_retracing clears them when the call returns; a call that raises after the
     accepted compile (eager raises too) skips that, and the next recompile of the frame (a guard failed: new
     state, new input shapes) traces only the other outcome and compares it with the first compile's
     bound-outcome trace, made for other inputs. (Without the clearing, any recompile did: the two passing
     tests `test_a_recompile_*` guard it.)

The tests that pass guard what held: side effects that do reach the residual (dict, list, global, cell stores, a
list handed across a break), and the covering width / full view at realistic bounds, batches and page sizes.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch._dynamo

import compile_pass
from consumers_for_tests import WRITE_ROWS
from paged_steps import Scratch, grown_scratch_step, paged_inputs
from passlib import compile_traced

WRITER = WRITE_ROWS  # tests/support/consumers_for_tests.py: a registered bounded writer
ATTN = torch.ops.syncfree.paged_decode
REQS = 4


def make_inputs(lengths, bound: int, page_size: int, seed: int, heads: int = 2, reqs: int = REQS):
    return paged_inputs(lengths, bound, page_size, seed, reqs=reqs, heads=heads)


def parity_maxima(bound: int, seed: int) -> list[int]:
    """The branch below is on `m % 2`: both residues at 0, 1, the bound and its neighbour, and random values."""
    rng = random.Random(seed)
    values = [bound, bound - 1, 0, 1, 2, 3] + [rng.randint(0, bound) for _ in range(4)]
    return [m for m in values if 0 <= m <= bound]


def lengths_for(m: int, batch: int, rng: random.Random) -> list[int]:
    lengths = [rng.randint(0, m) for _ in range(batch)]
    lengths[rng.randrange(batch)] = m
    return lengths


def step_table(r2t, rpi, seq_lens, page_size):
    """The allocated table at cdiv(m, page_size), no branch of its own: the parity is the step's one branch."""
    m = seq_lens.max().item()
    blocks = (m + page_size - 1) // page_size
    table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
    WRITER(r2t, rpi, seq_lens, table, blocks, page_size)
    return m, table


def mismatches(call, step, cases):
    """The cases (label, inputs) where the compiled call's output differs from eager's."""
    bad = []
    for label, make in cases:
        got, want = call(*make()), step(*make())
        if got.shape != want.shape or not torch.allclose(got, want):
            bad.append(label)
    return bad


# -- 1. where the frame resumes after a graph break ----------------------------------------------------------------
def make_break_in_each_outcome(page_size):
    def step(q, k, v, r2t, rpi, seq_lens):
        m, table = step_table(r2t, rpi, seq_lens, page_size)
        out = ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
        if m % 2 == 0:
            torch._dynamo.graph_break()  # the same break, the same live tensor: only the resume point differs
            return out * 2
        else:
            torch._dynamo.graph_break()
            return out * 3
    return step


@pytest.mark.parametrize("bound,page_size,batch", [(4096, 64, 3), (32768, 16, 8), (8191, 32, 1)])
def test_a_graph_break_inside_each_outcome_resumes_in_that_outcome(bound, page_size, batch):
    step = make_break_in_each_outcome(page_size)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    rng = random.Random(bound)
    cases = [(m, lambda m=m, n=n: make_inputs(lengths_for(m, batch, random.Random(n)), bound, page_size, n))
             for n, m in enumerate(parity_maxima(bound, rng.randint(0, 99)))]
    assert mismatches(call, step, cases) == []


def unbound_in_one_outcome(q, k, v, r2t, rpi, seq_lens):
    m, table = step_table(r2t, rpi, seq_lens, 64)
    out = ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
    if m % 2 == 0:
        even = out
    else:
        odd = out
    torch._dynamo.graph_break()  # one live tensor in both: the residual is the same, the resume's locals are not
    try:
        return even * 2
    except NameError:
        return odd * 3


def test_a_local_bound_in_one_outcome_only_keeps_its_name_across_a_break():
    bound = 4096
    call, backend = compile_traced(unbound_in_one_outcome, dynamic=False, max_context_len=bound)
    cases = [(m, lambda m=m, n=n: make_inputs([m, min(m, 3), 1][: 2 + n % 2], bound, 64, n))
             for n, m in enumerate(parity_maxima(bound, 1))]
    assert mismatches(call, unbound_in_one_outcome, cases) == []


@pytest.mark.inductor
def test_the_resume_point_through_the_backend():
    step = make_break_in_each_outcome(64)
    compiled = compile_pass.compile(step, max_context_len=4096)
    bad = [m for n, m in enumerate([4096, 7, 8, 0])
           if not torch.allclose(compiled(*make_inputs([m, 3, 1], 4096, 64, n)), step(*make_inputs([m, 3, 1], 4096,
                                                                                                     64, n)))]
    assert bad == []


# -- 2. the guards of the first outcome ----------------------------------------------------------------------------
class Config:
    def __init__(self):
        self.even_scale = 1
        self.odd_scale = 1


def make_config_step(config: Config):
    def step(q, k, v, r2t, rpi, seq_lens):
        m, table = step_table(r2t, rpi, seq_lens, 64)
        scale = config.even_scale if m % 2 == 0 else config.odd_scale  # equal when traced: the same graph
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m) * scale
    return step


def test_state_only_one_outcome_reads_is_guarded():
    bound, config = 4096, Config()
    step = make_config_step(config)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    for n, m in enumerate([bound, 7]):  # compiled, both scales 1
        torch.testing.assert_close(call(*make_inputs([m, 3, 1], bound, 64, n)), step(*make_inputs([m, 3, 1], bound,
                                                                                                     64, n)))
    config.even_scale = 5  # the engine's config changes between steps
    cases = [(m, lambda m=m, n=n: make_inputs([m, 3, 1], bound, 64, n)) for n, m in enumerate(parity_maxima(bound, 2))]
    assert mismatches(call, step, cases) == []


def shape_in_one_outcome(q, k, v, r2t, rpi, seq_lens):
    m, table = step_table(r2t, rpi, seq_lens, 64)
    out = ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
    if m % 2 == 0:
        scale = 1 if seq_lens.shape[0] > 2 else 2  # a guard on the batch, in this outcome only
    else:
        scale = 1
    return out * scale


@pytest.mark.parametrize("bound,page_size", [(4096, 64), (32768, 64)])
def test_a_size_guard_of_one_outcome_holds_for_later_batches(bound, page_size):
    call, backend = compile_traced(shape_in_one_outcome, dynamic=True, max_context_len=bound)
    rng = random.Random(bound)
    even = [bound, bound - 2, 0, 2, 2 * rng.randint(0, bound // 2)]  # the bound's outcome: the guard's side
    runs = [(3, bound), (3, bound - 1), (2, even[0]), (1, even[1]), (2, even[2]), (1, even[3]), (2, even[4]),
            (16, bound), (64, rng.randint(0, bound)), (2, 7)]
    cases = [((batch, m), lambda m=m, n=n, batch=batch: make_inputs(lengths_for(m, batch, random.Random(n)),
                                                                     bound, page_size, n, reqs=64))
             for n, (batch, m) in enumerate(runs)]
    assert mismatches(call, shape_in_one_outcome, cases) == []


# -- 3. the evidence a recompile is compared with ------------------------------------------------------------------
def heads_in_one_outcome(q, k, v, r2t, rpi, seq_lens):
    m, table = step_table(r2t, rpi, seq_lens, 64)
    out = ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
    if m % 2 == 0:
        scale = 1 if q.shape[2] == 2 else 2  # static under dynamic=False: a constant, no new guard
    else:
        scale = 1
    return out * scale


def test_a_recompile_traces_both_outcomes_again():
    """A recompile (new query heads) must trace both outcomes again, not compare the other outcome with the first
    compile's bound-outcome trace (made for other inputs). Guards call_retracing's reset of mode "other"."""
    bound = 4096
    call, backend = compile_traced(heads_in_one_outcome, dynamic=False, max_context_len=bound)
    for n, m in enumerate([bound, 7, 8]):  # two heads: both outcomes scale by 1
        inputs = make_inputs([m, 3, 1], bound, 64, n, heads=2)
        torch.testing.assert_close(call(*inputs), heads_in_one_outcome(*inputs))
    cases = [(m, lambda m=m, n=n: make_inputs([m, 3, 1], bound, 64, n, heads=4))  # four heads: a recompile
             for n, m in enumerate(parity_maxima(bound, 3))]
    assert mismatches(call, heads_in_one_outcome, cases) == []


def test_a_recompile_for_new_state_traces_both_outcomes_again():
    """The same after a recompile for new state: the other outcome under the new state equals the bound's outcome
    under the old one, which is no evidence for the new state."""
    bound = 4096

    class State:
        scale = 2

    state = State()

    def step(q, k, v, r2t, rpi, seq_lens):
        m, table = step_table(r2t, rpi, seq_lens, 64)
        scale = state.scale if m % 2 == 0 else (2 if state.scale > 0 else 0)  # both outcomes read it: guarded
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m) * scale

    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    for n, m in enumerate([bound, 7]):
        torch.testing.assert_close(call(*make_inputs([m, 3, 1], bound, 64, n)), step(*make_inputs([m, 3, 1], bound,
                                                                                                     64, n)))
    state.scale = 3  # the guard fails: a recompile
    cases = [(m, lambda m=m, n=n: make_inputs([m, 3, 1], bound, 64, n)) for n, m in enumerate(parity_maxima(bound, 4))]
    assert mismatches(call, step, cases) == []


class Engine:
    fail = False


ENGINE = Engine()


def raising_after_a_break(q, k, v, r2t, rpi, seq_lens):
    m, table = step_table(r2t, rpi, seq_lens, 64)
    out = ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
    scale = (1 if q.shape[2] == 2 else 2) if m % 2 == 0 else 1  # 1 in both outcomes at two heads
    torch._dynamo.graph_break()  # the same place in both outcomes, `scale` the same constant at two heads
    if ENGINE.fail:  # the engine's own check, in the resume function: eager raises too
        raise ValueError("the engine refused this step")
    return out * scale


def test_a_call_that_raises_leaves_no_evidence_for_the_next_recompile():
    bound = 4096
    call, backend = compile_traced(raising_after_a_break, dynamic=False, max_context_len=bound)
    ENGINE.fail = True
    try:
        for fn in (call, raising_after_a_break):  # compiled and eager both raise
            with pytest.raises(ValueError):
                fn(*make_inputs([bound, 3, 1], bound, 64, 0, heads=2))
    finally:
        ENGINE.fail = False
    cases = [(m, lambda m=m, n=n: make_inputs([m, 3, 1], bound, 64, n, heads=4))  # four heads: a recompile
             for n, m in enumerate(parity_maxima(bound, 6))]
    assert mismatches(call, raising_after_a_break, cases) == []


# -- what held: side effects that reach the residual ---------------------------------------------------------------
class Holder:
    pass


HOLDER = Holder()
STORE: dict = {}
GLOBAL_TAG = None


def dict_store(q, k, v, r2t, rpi, seq_lens):
    m, table = step_table(r2t, rpi, seq_lens, 64)
    STORE["parity"] = "even" if m % 2 == 0 else "odd"
    return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


def list_append(q, k, v, r2t, rpi, seq_lens):
    m, table = step_table(r2t, rpi, seq_lens, 64)
    HOLDER.log.append(2 if m % 2 == 0 else 3)
    return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


def global_store(q, k, v, r2t, rpi, seq_lens):
    global GLOBAL_TAG
    m, table = step_table(r2t, rpi, seq_lens, 64)
    GLOBAL_TAG = "even" if m % 2 == 0 else "odd"
    return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


def list_across_a_break(q, k, v, r2t, rpi, seq_lens):
    m, table = step_table(r2t, rpi, seq_lens, 64)
    factors = []
    factors.append(2.0 if m % 2 == 0 else 3.0)
    out = ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
    torch._dynamo.graph_break()
    return out * factors[0]


def make_cell_store():
    tag = None

    def cell_store(q, k, v, r2t, rpi, seq_lens):
        nonlocal tag
        m, table = step_table(r2t, rpi, seq_lens, 64)
        tag = "even" if m % 2 == 0 else "odd"
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)

    return cell_store, lambda: tag


@pytest.mark.parametrize("name", ["dict", "list", "global", "list_across_a_break", "cell"])
def test_side_effects_in_the_residual_keep_eager_s_values_and_effects(name):
    bound = 4096
    HOLDER.log = []
    STORE.clear()
    if name == "cell":
        step, observed = make_cell_store()
    else:
        step = {"dict": dict_store, "list": list_append, "global": global_store,
                "list_across_a_break": list_across_a_break}[name]
        observed = {"dict": lambda: STORE.get("parity"), "list": lambda: HOLDER.log[-1:],
                    "global": lambda: GLOBAL_TAG, "list_across_a_break": lambda: None}[name]
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound)
    for n, m in enumerate(parity_maxima(bound, 5)):
        inputs = make_inputs([m, 3, min(m, 2)], bound, 64, n)
        got = call(*inputs)
        got_effect = observed()
        want = step(*inputs)
        torch.testing.assert_close(got, want)
        assert got_effect == observed(), m


# -- what held: the covering width and the full view at realistic parameters ---------------------------------------
def make_regrown(page_size: int, covering: int):
    """SGLang's regrown scratch, allocated fresh: `torch.full((bs, max(n, C)), -1)[:bs, :n]`, C >= the bound's
    pages; the whole buffer (its -1 tail included) is returned beside the output."""
    def step(q, k, v, r2t, rpi, seq_lens):
        bs = seq_lens.shape[0]
        n = (seq_lens.max().item() + page_size - 1) // page_size
        buf = torch.full((bs, max(n, covering)), -1, dtype=torch.int32)
        table = buf[:bs, :n]
        WRITER(r2t, rpi, seq_lens, table, table.stride(0), page_size)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32)), buf
    return step


@pytest.mark.parametrize("bound,page_size,slack,checked", [(4096, 64, 0, True), (32768, 16, 5, False),
                                                           (131072, 64, 0, True)])
def test_a_regrown_scratch_at_realistic_bounds_keeps_eager_s_values(bound, page_size, slack, checked):
    pages = -(-bound // page_size)
    step = make_regrown(page_size, pages + slack)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    rng = random.Random(bound + page_size)
    batches = (1, 7, 16) if bound > 32768 else (1, 7, 64)
    reqs = max(batches)
    for n, batch in enumerate(batches * 2):
        m = rng.choice([0, 1, page_size - 1, page_size, page_size + 1, bound - 1, bound, rng.randint(0, bound)])
        inputs = make_inputs(lengths_for(m, batch, rng), bound, page_size, n, reqs=reqs)
        (got, got_buf), (want, want_buf) = call(*inputs), step(*inputs)
        torch.testing.assert_close(got, want)
        assert torch.equal(got_buf, want_buf), (batch, m)
    assert all(r.rewritten and not r.kept for r in backend.reports), [str(r) for r in backend.reports]


def grown_from_none(state: Scratch, page_size: int):
    return grown_scratch_step(state, WRITER, page_size)


@pytest.mark.parametrize("bound,page_size", [(8192, 16), (65536, 64)])
def test_a_scratch_grown_from_none_keeps_eager_s_rows_over_growing_batches(bound, page_size):
    compiled_state, eager_state = Scratch(), Scratch()
    call, backend = compile_traced(grown_from_none(compiled_state, page_size), dynamic=False, max_context_len=bound,
                                   static_escapes=True)
    eager = grown_from_none(eager_state, page_size)
    rng = random.Random(bound)
    for n, batch in enumerate([1, 1, 4, 2, 9, 9, 3]):
        m = rng.choice([0, 1, page_size, page_size + 1, bound - 1, bound, rng.randint(0, bound)])
        lengths = lengths_for(m, batch, rng)
        got = call(*make_inputs(lengths, bound, page_size, n, reqs=16))
        want = eager(*make_inputs(lengths, bound, page_size, n, reqs=16))
        torch.testing.assert_close(got, want)
        for b, length in enumerate(lengths):
            used = -(-length // page_size)
            assert torch.equal(compiled_state.stored[b, :used], eager_state.stored[b, :used]), (batch, m, b)
    assert all(r.rewritten and not r.kept for r in backend.reports), [str(r) for r in backend.reports]
