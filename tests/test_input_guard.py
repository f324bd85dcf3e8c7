"""The per-call input guard (compile_pass/input_guard.py, issue 43): reading each input's storage address once per
call gives the answer of checking every pair on its own."""

import random

import torch

from compile_pass import input_guard


def _pairwise(args, pairs) -> bool:
    flat = input_guard.flat_inputs(args)
    return any(input_guard._shares_memory(flat[i], flat[j]) for i, j in pairs)


def test_the_guard_answers_as_each_pair_checked_on_its_own():
    rng = random.Random(0)
    base = torch.arange(64, dtype=torch.int64)
    other = torch.arange(32, dtype=torch.int32)
    empty = torch.empty(0)
    pool = [base, base[3:9], base.view(8, 8)[:, 1], other, other[5:], torch.ones(4), empty, empty.view(0, 3),
            None, 7, "x"]
    for _ in range(500):
        flat = [rng.choice(pool) for _ in range(rng.randint(2, 6))]
        pairs = tuple((rng.randrange(len(flat)), rng.randrange(len(flat))) for _ in range(rng.randint(0, 7)))
        expected = _pairwise((flat,), pairs)
        assert input_guard.inputs_share_memory((flat,), pairs) is expected  # boxed: one list of inputs
        assert input_guard.inputs_share_memory(tuple(flat), pairs) is expected


def test_the_guard_runs_the_untouched_graph_only_for_aliased_inputs():
    calls = []

    def compiled(*args):
        calls.append("compiled")
        return args[0] + 1

    class Original:
        @staticmethod
        def forward(*args):
            calls.append("original")
            return args[0] + 1

    guarded = input_guard.guard_disjoint_inputs(compiled, Original, [(0, 1)])
    a, b = torch.zeros(4), torch.zeros(4)
    guarded(a, b)
    guarded(a, a[1:])
    guarded(a, torch.zeros(0))
    assert calls == ["compiled", "original", "compiled"]
    assert input_guard.guard_disjoint_inputs(compiled, Original, []) is compiled
