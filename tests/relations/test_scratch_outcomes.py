"""Two trace-time decisions of issue 45 item 5 (a scratch an earlier step left narrower than the bound), held to
eager's values by programs and by the pieces they rest on:

* tracing.decided_by_sizes: a branch comparing input sizes with a value of a ranged max (`if x.shape[0] < n`) is
  decided for every max by a shape guard on the sizes, where this call's sizes give one outcome for the whole range;
  a call whose sizes fail the guard is traced again (eager's values either way);
* trace_signature._one_store_inserted: the code after the graph of the outcome that regrows the scratch is the
  other outcome's with one block that stores the new scratch, and nothing else (regrown_scratch's last check).

The programs of the relation itself (the grow branch with every other difference between its outcomes) are in
tests/rules/test_allocated_table.py, beside the rule whose rewrite they rest on.
"""

from __future__ import annotations

import operator
import random

import pytest
import torch

import compile_pass
from compile_pass.trace_signature import _one_store_inserted
from passlib import compile_traced

PS = 64
BOUND = 4096  # 64 pages
RELATIONS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _program(relation: str, sizes_left: bool, shift: int):
    compare = RELATIONS[relation]

    def step(x, seq_lens):
        n = (seq_lens.max().item() + PS - 1) // PS
        size = x.shape[0] + shift
        if compare(size, n) if sizes_left else compare(n, size):
            return x.sum() + seq_lens.sum()
        return x.sum() - seq_lens.sum()

    return step


PROGRAMS = [(r, left, shift) for r in RELATIONS for left in (True, False) for shift in (0, 3)]


@pytest.mark.parametrize("relation,sizes_left,shift", PROGRAMS)
def test_a_branch_of_sizes_against_a_ranged_max_gives_eager_values(relation, sizes_left, shift):
    """Sizes on both sides of the page count's range [0, 64] (below it: one outcome for every max; inside it: the
    outcome depends on the max, nothing decided; past it: the other outcome for every max), in an order that makes
    the guards fail and hold, with maxima over the whole range: eager's values every time; and the first call,
    whose size lies past the range, traced with no graph break (decided by a guard on the size)."""
    step = _program(relation, sizes_left, shift)
    compiled, _ = compile_traced(step, dynamic=None, max_context_len=BOUND)
    rng = random.Random(hash((relation, sizes_left, shift)) & 0xFFFF)
    seen = len(compile_pass._compat.graph_break_reasons())
    for n, size in enumerate([100, 120, 2, 30, 100, 64, 65, 3]):
        x = torch.arange(size, dtype=torch.float32)
        if n == 0:
            torch._dynamo.mark_dynamic(x, 0)
        for m in sorted({0, 1, 63, 64, 65, 2048, BOUND - 1, BOUND, rng.randint(0, BOUND)}):
            lengths = torch.tensor([m, rng.randint(0, m)])
            torch.testing.assert_close(compiled(x, lengths), step(x, lengths), msg=f"size {size}, max {m}")
        if n == 0:
            assert compile_pass._compat.graph_break_reasons()[seen:] == [], "the first call's branch was not decided"


def test_a_size_inside_the_range_is_not_decided():
    """A size whose outcome depends on the max (30 against [0, 64]) is not decided by a guard: Dynamo breaks at
    the branch as without the backend (eager's values)."""
    step = _program("<", True, 0)
    compiled, _ = compile_traced(step, dynamic=None, max_context_len=BOUND)
    x = torch.arange(30, dtype=torch.float32)
    torch._dynamo.mark_dynamic(x, 0)
    seen = len(compile_pass._compat.graph_break_reasons())
    for m in (0, 1000, BOUND):
        lengths = torch.tensor([m, 1])
        torch.testing.assert_close(compiled(x, lengths), step(x, lengths))
    assert compile_pass._compat.graph_break_reasons()[seen:], "a branch that differs inside the range was decided"


def test_a_plain_torch_compile_is_not_decided_by_the_backend():
    """The hooks stay installed once compile_pass has traced in this process; outside its own calls they decide
    nothing: a plain torch.compile of the same branch (no range given: Dynamo breaks there) is as without us."""
    step = _program("<", True, 0)
    compiled, _ = compile_traced(step, dynamic=None, max_context_len=BOUND)
    x = torch.arange(100, dtype=torch.float32)
    torch._dynamo.mark_dynamic(x, 0)
    compiled(x, torch.tensor([5, 1]))  # our call: decided by a guard on the size
    torch._dynamo.reset()
    seen = len(compile_pass._compat.graph_break_reasons())

    def ranged(x, seq_lens):  # the user's own range on the max: a size guard could decide the branch
        n = (seq_lens.max().item() + PS - 1) // PS
        torch._check(n >= 0)
        torch._check(n <= BOUND // PS)
        return x.sum() + 1 if x.shape[0] < n else x.sum() - 1

    step = ranged
    plain = torch.compile(step, backend="eager")
    with compile_pass._compat.capture_scalar_outputs():
        torch.testing.assert_close(plain(x, torch.tensor([5, 1])), step(x, torch.tensor([5, 1])))
    assert compile_pass._compat.graph_break_reasons()[seen:], "a plain torch.compile's branch was decided"


# -- the code after the graph: one store inserted -------------------------------------------------------------
OTHER = ["LOAD_FAST 'graph_out_0'", "LOAD_CONST 0", "BINARY_SUBSCR", "PUSH_NULL", "LOAD_FAST 'tmp_2'",
         "LOAD_DEREF 'state'", "LOAD_CONST 'stored'", "LOAD_FAST 'graph_out_0'", "LOAD_CONST 1", "BINARY_SUBSCR",
         "PRECALL arg=3", "CALL arg=3", "POP_TOP", "RETURN_VALUE"]
STORE = ["PUSH_NULL", "LOAD_FAST 'tmp_2'", "LOAD_DEREF 'state'", "LOAD_CONST 'buf'", "LOAD_FAST 'graph_out_0'",
         "LOAD_CONST 2", "BINARY_SUBSCR", "PRECALL arg=3", "CALL arg=3", "POP_TOP"]


@pytest.mark.parametrize("at", [3, 13])
def test_one_store_of_the_new_scratch_inserted_anywhere_is_recognised(at):
    bound = OTHER[:at] + STORE + OTHER[at:]
    assert _one_store_inserted(OTHER, bound, "L['state'].buf", 2)


def test_a_store_whose_owner_is_kept_in_a_fresh_local_first_is_recognised():
    """As Dynamo writes it where it rebuilds the owner for another reason: the owner kept in a local of its own
    (`COPY; STORE_FAST tmp_7`) there, the store later."""
    kept = ["COPY arg=1", "STORE_FAST 'tmp_7'"]
    store = [line.replace("LOAD_DEREF 'state'", "LOAD_FAST 'tmp_7'") for line in STORE]
    bound = OTHER[:1] + kept + OTHER[1:5] + store + OTHER[5:]
    assert _one_store_inserted(OTHER, bound, "L['state'].buf", 2)


@pytest.mark.parametrize("change", ["another_attribute", "another_output", "two_calls", "a_global", "removed",
                                    "a_used_local", "nothing"])
def test_anything_else_after_the_graph_is_not_one_store(change):
    store = list(STORE)
    bound = OTHER[:3] + store + OTHER[3:]
    if change == "another_attribute":
        bound[3 + 3] = "LOAD_CONST 'spare'"
    elif change == "another_output":
        bound[3 + 5] = "LOAD_CONST 1"
    elif change == "two_calls":
        bound = OTHER[:3] + store + store[-3:] + OTHER[3:]
    elif change == "a_global":
        bound[3 + 1] = "LOAD_GLOBAL 'setattr' = <builtins.setattr id 0x1>"
    elif change == "removed":
        bound = OTHER[:1] + OTHER[2:3] + store + OTHER[3:]  # a line of the other code gone
    elif change == "a_used_local":  # a local the other code reads, overwritten
        bound = OTHER[:3] + ["LOAD_CONST None", "STORE_FAST 'tmp_2'"] + store + OTHER[3:]
    else:
        bound = list(OTHER)
    assert not _one_store_inserted(OTHER, bound, "L['state'].buf", 2)


# -- a branch traced at the bound never takes a user's check with it ------------------------------------------
def _checked_step(check: str, branch: str):
    from consumers_for_tests import paged_sum  # noqa: F401  (registers the test ops)

    writer = torch.ops.syncfree_test.write_rows
    attention = torch.ops.syncfree.paged_decode

    def step(q, k, v, r2t, rpi, seq_lens):
        m = seq_lens.max().item()
        if check == "at_least":
            torch._check(m >= 2 * PS + 1, lambda: "the caller's check")
        else:
            torch._check(m <= 2000, lambda: "the caller's check")
        blocks = (m + PS - 1) // PS
        table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
        writer(r2t, rpi, seq_lens, table, blocks, PS)
        out = attention(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)
        if branch == "parity":  # one computation either way: traced at the bound, narrowing nothing
            scale = 1.0 if m % 2 == 1 else 1.0
        else:  # narrows the max's range by the outcome: m >= 129 at the bound's
            scale = 1.0 if blocks > 2 else 1.0
        return out * scale

    return step


@pytest.mark.parametrize("branch", ["parity", "pages"])
@pytest.mark.parametrize("check", ["at_least", "at_most"])
def test_a_check_of_the_caller_before_a_branch_traced_at_the_bound_stays(check, branch):
    """Found by a helper's programs (2026-12-05): the range asserts an outcome narrows are taken out with the
    outcome, and the caller's own `torch._check` on the max before the branch (which had set the same end of
    the range) went with them: lengths that eager refuses ran. Only the ends the outcome moved go now: every
    length the caller's check refuses raises, every other gives eager's values."""
    from paged_steps import paged_inputs

    step = _checked_step(check, branch)
    compiled, _ = compile_traced(step, dynamic=False, max_context_len=BOUND, checked=True, static_escapes=True)
    for n, top in enumerate([BOUND, 2 * PS + 1, 2 * PS, 50, 0, 2000, 2001, 3000]):
        lengths = [top, min(top, 7), 0]
        refused = top < 2 * PS + 1 if check == "at_least" else top > 2000
        if refused:
            with pytest.raises(RuntimeError):
                step(*paged_inputs(lengths, BOUND, PS, n, reqs=4))
            with pytest.raises(RuntimeError):
                compiled(*paged_inputs(lengths, BOUND, PS, n, reqs=4))
        else:
            torch.testing.assert_close(compiled(*paged_inputs(lengths, BOUND, PS, n, reqs=4)),
                                       step(*paged_inputs(lengths, BOUND, PS, n, reqs=4)))
