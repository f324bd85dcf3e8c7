"""Where the backend may give a max its range while Dynamo traces, and where it may trace a frame again
(compile_pass.tracing), at realistic parameters: compiled against eager, values and side effects (a Python log,
the inputs as the step leaves them), every valid length vector, `checked` True and False.

F1. The range [0, bound] belongs to the max of the lengths AS THE CALL PASSED THEM IN (the contract is on the
    inputs). A step that writes the lengths before its max (`seq_lens.add_(1)`: one more token this step) makes
    the max bound + 1 for valid input; with the range, `if m > bound` was decided False (a wrong value under
    checked=False) or the range assertion fired (checked=True). Every way of writing them counts: in place, through
    a view, `setitem`, `copy_`, `out=`, another argument that views them, a write to the max's result, a write
    before a graph break (the max in the resumed frame), a compiled module's forward pre-hook. So does a write to
    another graph input (Dynamo does not guard on aliasing between inputs: it may be the lengths in another call).
    Such a max is traced as without the backend (the branch breaks the graph) and the report says why.
F7. A Retrace re-runs the whole call, so it may be raised only while Dynamo compiles the call's first frame, before
    anything ran. A step that calls itself after a graph break had its nested frame (the same code object) taken
    for the root: the Retrace ran the outer level twice (its log entry and its in-place write).

Controls that must still get the range and be rewritten: a write to memory the step allocated before the max, the
lengths written only after the consumer, a plain step, TRTLLM-MLA's round-up (tests/relations/test_branch_outcomes)
and a compiled module without hooks.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch._dynamo

import compile_pass
from consumers_for_tests import WRITE_ROWS
from paged_steps import padded_blocks, paged_inputs
from passlib import compile_traced

WRITER = WRITE_ROWS  # tests/support/consumers_for_tests.py: a registered bounded writer
ATTN = torch.ops.syncfree.paged_decode

# (max_context_len, page size, batch): realistic bounds, page sizes 16-64, batches 1-64
CONFIGS = [(4096, 16, 1), (32768, 64, 64), (131072, 32, 8), (4096, 64, 4)]
CHECKED = [False, True]


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def maxima(bound: int, seed: int, *extra: int) -> list[int]:
    """0, 1, the bound and its neighbour, the predicate's edges (`extra`), random values."""
    rng = random.Random(seed)
    values = {0, 1, bound - 1, bound, *extra, rng.randint(0, bound), rng.randint(0, bound)}
    return sorted(m for m in values if 0 <= m <= bound)


def lengths_for(m: int, batch: int, seed: int) -> list[int]:
    """`batch` lengths in [0, m], the max m in row 0 (where the row writes below land)."""
    rng = random.Random(seed)
    return [m] + [rng.randint(0, m) for _ in range(batch - 1)]


def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _assert_same(got, want, what):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype, what
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{what}[{i}]")
    else:
        assert got == want, f"{what}: compiled {got!r}, eager {want!r}"


LOG: list = []


def compare(call, step, make, values, label=""):
    """compiled against eager for each max in `values`: the output, LOG and every input as the step leaves it;
    a valid length never raises."""
    for n, m in enumerate(values):
        LOG.clear()
        inputs = make(m, n)
        got = call(*inputs)  # raises on a valid length: the test fails here
        got_state = (_snapshot(got), list(LOG), _snapshot(inputs))
        LOG.clear()
        inputs = make(m, n)
        want = step(*inputs)
        want_state = (_snapshot(want), list(LOG), _snapshot(inputs))
        _assert_same(got_state, want_state, f"{label} max={m}")


# -- F1: the lengths written before the max ----------------------------------------------------------------------
def _add_(seq_lens, q):
    seq_lens.add_(1)


def _iadd_view(seq_lens, q):
    seq_lens[:1] += 1


def _setitem(seq_lens, q):
    seq_lens[0] = seq_lens[0] + 1


def _copy_(seq_lens, q):
    seq_lens.copy_(seq_lens * 2)


def _out(seq_lens, q):
    torch.add(seq_lens, 1, out=seq_lens)


WRITES = {"add_": _add_, "iadd_view": _iadd_view, "setitem": _setitem, "copy_": _copy_, "out=": _out}


def branch_step(write, bound: int):
    """The reviewer's program: the lengths written, then a branch that the range alone decides."""
    def step(q, k, v, r2t, rpi, seq_lens):
        LOG.append("step")
        write(seq_lens, q)
        m = seq_lens.max().item()
        if m > bound:  # valid input lengths reach bound + 1 (bound * 2 for copy_) here
            return torch.zeros(1)
        return torch.ones(1) * m
    return step


def paged_step(write, page_size: int, bound: int):
    """A decode step that counts this step's token before sizing its table: `seq_lens.add_(1)`, then the table
    at cdiv(m, page_size) and the attention, and the branch on the new max."""
    def step(q, k, v, r2t, rpi, seq_lens):
        write(seq_lens, q)
        m = seq_lens.max().item()
        blocks = (m + page_size - 1) // page_size
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, seq_lens, table, blocks, page_size)
        out = ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
        return out * (2.0 if m > bound else 1.0)
    return step


def _maker(bound, page_size, batch):
    return lambda m, n: paged_inputs(lengths_for(m, batch, n), bound, page_size, n, reqs=batch)


@pytest.mark.parametrize("checked", CHECKED)
@pytest.mark.parametrize("form", sorted(WRITES))
def test_a_max_of_lengths_written_before_it_gets_no_range(form, checked):
    bound, page_size, batch = CONFIGS[sorted(WRITES).index(form) % len(CONFIGS)]
    step = branch_step(WRITES[form], bound)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    compare(call, step, _maker(bound, page_size, batch), maxima(bound, 0, bound // 2, bound // 2 + 1), form)


@pytest.mark.parametrize("checked", CHECKED)
@pytest.mark.parametrize("bound,page_size,batch", CONFIGS[:3])
def test_a_decode_step_that_counts_its_token_first_gives_eager_s_values(bound, page_size, batch, checked):
    step = paged_step(_add_, page_size, bound)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    compare(call, step, _maker(bound, page_size, batch), maxima(bound, 1, bound - page_size, bound - page_size + 1))
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]


@pytest.mark.parametrize("checked", CHECKED)
def test_another_argument_that_views_the_lengths_written_before_the_max(checked):
    bound, page_size, batch = 32768, 64, 16

    def step(q, k, v, r2t, rpi, seq_lens, lens_view):
        LOG.append("step")
        lens_view.add_(1)  # the same memory as seq_lens
        m = seq_lens.max().item()
        if m > bound:
            return torch.zeros(1)
        return torch.ones(1) * m

    def make(m, n):
        inputs = paged_inputs(lengths_for(m, batch, n), bound, page_size, n, reqs=batch)
        return (*inputs, inputs[-1][:])

    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    compare(call, step, make, maxima(bound, 2))


@pytest.mark.parametrize("checked", CHECKED)
def test_a_write_to_the_max_s_result_before_its_item(checked):
    bound, page_size, batch = 4096, 16, 8

    def step(q, k, v, r2t, rpi, seq_lens):
        top = seq_lens.max()
        top.add_(1)
        m = top.item()
        if m > bound:
            return torch.zeros(1)
        return torch.ones(1) * m

    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    compare(call, step, _maker(bound, page_size, batch), maxima(bound, 3))


@pytest.mark.parametrize("checked", CHECKED)
@pytest.mark.parametrize("bound,page_size,batch", [(4096, 32, 2), (131072, 64, 32)])
def test_lengths_written_before_a_graph_break_give_the_resumed_frame_no_range(bound, page_size, batch, checked):
    def step(q, k, v, r2t, rpi, seq_lens):
        LOG.append("before")
        seq_lens.add_(1)
        torch._dynamo.graph_break()
        LOG.append("after")
        m = seq_lens.max().item()  # in the frame resumed after the break: code of the call ran before it
        if m > bound:
            return torch.zeros(1)
        return torch.ones(1) * m

    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    compare(call, step, _maker(bound, page_size, batch), maxima(bound, 4))


class Decode(torch.nn.Module):
    def __init__(self, bound: int):
        super().__init__()
        self.bound = bound

    def forward(self, q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        if m > self.bound:
            return torch.zeros(1)
        return torch.ones(1) * m


def _count_token(module, args):
    LOG.append("pre-hook")
    args[-1].add_(1)  # user code that nn.Module runs before forward


@pytest.mark.parametrize("checked", CHECKED)
def test_a_compiled_module_whose_pre_hook_writes_the_lengths(checked):
    bound, page_size, batch = 32768, 16, 4
    module = Decode(bound)
    module.register_forward_pre_hook(_count_token)
    call, backend = compile_traced(module, dynamic=False, max_context_len=bound, checked=checked)
    compare(call, module, _maker(bound, page_size, batch), maxima(bound, 5))


@pytest.mark.parametrize("checked", CHECKED)
def test_a_write_to_another_input_before_the_max_gives_no_range_and_eager_s_values(checked):
    """Another input written before the max (q here; the KV pool in an engine): Dynamo does not guard on aliasing
    between inputs, so it may be the lengths' memory in a later call. No range; the step keeps eager's values."""
    bound, page_size, batch = 4096, 64, 4

    def step(q, k, v, r2t, rpi, seq_lens):
        q.mul_(2)
        m = seq_lens.max().item()
        if m > bound:
            return torch.zeros(1)
        return q.sum() * 0 + m

    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    compare(call, step, _maker(bound, page_size, batch), maxima(bound, 6))


@pytest.mark.parametrize("form,says", [
    ("add_", "may write the lengths"),
    ("other", "writes the graph input"),
])
def test_the_report_says_why_the_max_had_no_range(form, says):
    bound, page_size = 4096, 64
    write = _add_ if form == "add_" else (lambda seq_lens, q: q.mul_(2))
    step = branch_step(write, bound)
    compiled = compile_pass.compile(step, max_context_len=bound, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kept host read's warning
        compare(compiled, step, _maker(bound, page_size, 3), [bound, 5])
    reasons = [i.reason for r in compile_pass.reports(compiled) for i in r.kept]
    assert any("was traced without its range" in r and says in r for r in reasons), reasons


# -- F7: a Retrace only from the call's first frame ----------------------------------------------------------------
def recursive_step(page_size: int, depth: int, round_up: bool = False, count_token: bool = False):
    """The step calls itself after a graph break (Dynamo compiles the nested call as a frame of the same code);
    each level logs and writes an input in place; the innermost sizes a table with a branch whose outcome differs
    inside [0, bound] (parity, or TRTLLM-MLA's round-up to a multiple of 4096 / page_size pages)."""
    lcm = 4096 // page_size

    def step(q, k, v, r2t, rpi, seq_lens, level=depth):
        LOG.append(level)
        q.mul_(2)
        if level > 0:
            if count_token:
                seq_lens.add_(1)
            torch._dynamo.graph_break()
            return step(q, k, v, r2t, rpi, seq_lens, level - 1)
        m = seq_lens.max().item()
        blocks = (m + page_size - 1) // page_size
        if round_up:
            if blocks % lcm != 0:
                blocks = (blocks + lcm - 1) // lcm * lcm
        elif blocks % 2 == 1:
            blocks += 1
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, seq_lens, table, blocks, page_size)
        return ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)

    return step


@pytest.mark.parametrize("checked", CHECKED)
@pytest.mark.parametrize("bound,page_size,batch,depth,round_up", [
    (4096, 64, 3, 1, False),
    (32768, 32, 16, 2, True),
    (131072, 64, 1, 1, True),
])
def test_a_nested_frame_of_the_compiled_function_s_code_never_re_runs_the_call(bound, page_size, batch, depth,
                                                                                round_up, checked):
    step = recursive_step(page_size, depth, round_up)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    span = 4096
    edges = [span * k + d for k in range(1, bound // span + 1) for d in (-page_size, -1, 0, 1)][:8]
    compare(call, step, _maker(bound, page_size, batch), maxima(bound, 7, page_size, page_size + 1, *edges))


@pytest.mark.parametrize("checked", CHECKED)
def test_a_nested_frame_after_the_outer_level_counted_its_token(checked):
    bound, page_size, batch = 4096, 16, 4
    step = recursive_step(page_size, 1, count_token=True)
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    compare(call, step, _maker(bound, page_size, batch), maxima(bound, 8, page_size, page_size + 1))


# -- controls: the range is given and the step rewritten ----------------------------------------------------------
def round_up_step(page_size: int, bound: int, before=None, after=None, round_up: bool = True):
    """A decode step whose branches the range decides: an engine's overflow check `m > bound` (False over the
    range), and with `round_up` TRTLLM-MLA's round-up (its outcome differs inside the range: traced with both
    outcomes under checked=True; under checked=False it breaks the graph, as without the backend)."""
    def step(q, k, v, r2t, rpi, seq_lens):
        LOG.append("step")
        if before is not None:
            before(seq_lens)
        m = seq_lens.max().item()
        blocks = padded_blocks(m, page_size) if round_up else (m + page_size - 1) // page_size
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        WRITER(r2t, rpi, seq_lens, table, blocks, page_size)
        out = ATTN(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
        if m > bound:
            LOG.append("overflow")
        if after is not None:
            after(seq_lens)
        return out
    return step


def _fresh_write(seq_lens):
    scratch = torch.zeros_like(seq_lens)
    scratch.add_(seq_lens)  # memory the step allocated: never the lengths
    LOG.append("scratch")


def _count_after(seq_lens):
    seq_lens.add_(1)  # the next step's token, after the consumer read them


CONTROLS = {"plain": {}, "fresh_write_before": {"before": _fresh_write},
            "lengths_written_after": {"after": _count_after}}


def _round_up_maxima(bound: int, page_size: int, seed: int) -> list[int]:
    span = 4096
    edges = [span * k + d for k in range(1, bound // span + 1) for d in (-page_size, -1, 0, 1)]
    rng = random.Random(seed)
    return maxima(bound, seed, *rng.sample(edges, min(6, len(edges))))


@pytest.mark.parametrize("checked", CHECKED)
@pytest.mark.parametrize("control,bound,page_size,batch", [
    *[(control, 4096, 64, 4) for control in sorted(CONTROLS)],
    ("plain", 32768, 32, 64),
    ("fresh_write_before", 131072, 64, 8),
    ("lengths_written_after", 32768, 16, 2),
])
def test_controls_get_the_range_and_are_rewritten(control, bound, page_size, batch, checked):
    step = round_up_step(page_size, bound, round_up=checked, **CONTROLS[control])
    call, backend = compile_traced(step, dynamic=False, max_context_len=bound, checked=checked)
    compare(call, step, _maker(bound, page_size, batch), _round_up_maxima(bound, page_size, 9), control)
    reports = backend.reports
    assert reports and all(r.rewritten and not r.kept for r in reports), [str(r) for r in reports]
    if checked:  # the round-up traced with both outcomes, compared: one rewrite at the bound's width
        assert f"width {bound // page_size}" in reports[0].rewritten[0].reason, reports[0].rewritten[0].reason


class RoundUp(torch.nn.Module):
    def __init__(self, page_size: int, bound: int):
        super().__init__()
        self.step = round_up_step(page_size, bound, round_up=False)  # a module has no root code: no Retrace

    def forward(self, q, k, v, r2t, rpi, seq_lens):
        return self.step(q, k, v, r2t, rpi, seq_lens)


def test_a_compiled_module_without_hooks_gets_the_range():
    bound, page_size, batch = 32768, 64, 8
    module = RoundUp(page_size, bound)
    call, backend = compile_traced(module, dynamic=False, max_context_len=bound, checked=False)
    compare(call, module, _maker(bound, page_size, batch), _round_up_maxima(bound, page_size, 10))
    assert backend.reports and all(r.rewritten and not r.kept for r in backend.reports), \
        [str(r) for r in backend.reports]


def test_a_branch_the_range_decides_stays_one_graph_through_the_backend():
    """The range given through compile_pass.compile (the frame-compile hook, call_traced): `if m > bound` is
    decided by the range, no graph break, the max rewritten (TRTLLM's round-up under checked=True)."""
    bound, page_size = 32768, 64
    step = round_up_step(page_size, bound, before=_fresh_write, after=_count_after)
    compiled = compile_pass.compile(step, max_context_len=bound, dynamic=False, checked=True)
    compare(compiled, step, _maker(bound, page_size, 4), _round_up_maxima(bound, page_size, 11))
    reports = compile_pass.reports(compiled)
    assert reports and all(r.rewritten and not r.kept for r in reports), [str(r) for r in reports]
