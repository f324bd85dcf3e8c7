"""Generated programs for the trace-time layer, part 1: branches on the max (issue 45, item 3).

Generator: tests/support/trace_program_generator.py (its docstring says what each family is). This file runs the
`branch` family (random Python branches on `m = seq_lens.max().item()` and on values derived from it, at small and
realistic bounds: width, value, mixed, early exit, clamp, page-size, round-up and allocated-table forms) and the
`grow` family (FlashMLA's grow-on-demand scratch) and the `hidden` family (outcomes that differ where the graph's
text does not show it: what a step leaves outside its result is compared too). tests/suites/
test_trace_time_constructs.py runs the struct, launcher and copy families; the two files are separate so that
xdist's loadfile gives them to different workers.

Each program is compiled once through the backend's trace-time path without Inductor (passlib.compile_traced, with
the program's max_context_len and checked option) and compared with eager on length vectors that sweep [0, bound]
(every outcome of every predicate and every residue class of every modulus in the program, m = 0 and m = bound
included), plus, under checked=True, lengths outside the contract. Expected: 0 divergences. A failure names the
program (its source), the lengths, eager's result and the compiled one (value or exception); nothing here is
marked xfail or skipped for a divergence.

`python tests/support/trace_program_generator.py --run --family branch` prints the per-category table and one
reproducer per failing category without pytest.
"""

from __future__ import annotations

import collections

import pytest

import trace_program_generator as tg

PROGRAMS = tg.generated_programs("branch", "grow", "hidden")
RESULTS: dict = {}


def test_corpus_size_and_spread():
    """At least 1000 programs over both files; here every branch form, small and realistic bounds, both checked
    settings, every spelling of the max, and the SGLang round-up at its realistic multiple."""
    assert sum(len(make()) for make in tg.FAMILIES.values()) >= 1000
    forms = collections.Counter(p.category.split("/")[1].split("@")[0] for p in PROGRAMS if p.family == "branch")
    assert set(forms) == {form for form, _ in tg.BRANCH_FORMS}, forms
    assert {p.bound for p in PROGRAMS} >= {4096, 8192, 32768, 131072}
    assert {p.checked for p in PROGRAMS} == {True, False}
    sources = "\n".join(p.source for p in PROGRAMS)
    for spelling, _, _, _, _ in tg.MAX_FORMS:
        assert spelling in sources, spelling
    assert "blocks += 64 - blocks % 64" in sources  # trtllm_mla_backend.py's _calc_padded_blocks
    assert any(p.scratch and p.scratch < -(-p.bound // p.ps) for p in PROGRAMS)  # a scratch that grows
    hidden = collections.Counter(p.category for p in PROGRAMS if p.family == "hidden")
    assert set(hidden) == {f"hidden/{kind}" for kind in tg.HIDDEN_KINDS} and min(hidden.values()) >= 10, hidden


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_trace_time_program_equals_eager(program):
    result = tg.run_program(program)
    RESULTS[program.name] = result
    if result.divergences:
        pytest.fail(result.message(), pytrace=False)


def test_zz_summary():
    """The per-category table of what ran above (printed with -s)."""
    if not RESULTS:
        pytest.skip("no trace-time program ran in this session")
    print("\n" + tg.summarize(list(RESULTS.values())))
