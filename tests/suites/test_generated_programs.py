"""Generated decode programs aimed at the write analysis (issue 18; generator: program_generator.py).

Each program is the canonical step plus one edit (a writer from the tables x a protected tensor or a view of it
x a position), or a metadata variant (strided / expanded lengths, negative / duplicate request indices), or a
cast chain (int32 <-> int64 on the lengths and on the table, narrowing included), or the chained-gather window.
Every one runs through the pass-only backend and eager on several length vectors: 0 divergences expected (values,
shapes, dtypes, raised error type, the inputs left behind); a write where default deny must see it keeps the max.
A representative few run through the full `syncfree` backend with Inductor.

`python tests/support/program_generator.py` prints the per-category table (rewritten / kept / divergent).
"""

from __future__ import annotations

import collections

import pytest

import compile_pass
import program_generator as pg

PROGRAMS = pg.generated_programs()
BY_NAME = {p.name: p for p in PROGRAMS}
RESULTS: dict = {}


def test_corpus_size_and_spread():
    assert len(PROGRAMS) >= 500, len(PROGRAMS)
    categories = collections.Counter(p.category.split("/")[0] for p in PROGRAMS)
    assert set(categories) == {"edit", "metadata", "cast", "chained"}, categories
    assert sum(p.must_keep for p in PROGRAMS) > 150
    positions = collections.Counter(p.name.split(" | ")[2] for p in PROGRAMS if p.category.startswith("edit/"))
    assert set(positions) == set(pg.POSITIONS)
    assert all(name in BY_NAME for name in pg.INDUCTOR_PROGRAMS)


def _check(result: pg.Result):
    program = result.program
    RESULTS[program.name] = result
    if result.untraceable:
        pytest.skip(f"Dynamo cannot trace it under fullgraph=True: {result.untraceable}")
    where = f"\n[{program.variant} inputs]\n{program.source}"
    if result.crashed:
        pytest.fail(f"the pass crashed: {result.crashed}{where}", pytrace=False)
    if result.divergences and result.dynamo_also_diverges:
        pytest.xfail(f"Dynamo alone (no pass) diverges from eager: {result.divergences[0]}")
    if result.divergences:
        pytest.fail("compiled != eager:\n  " + "\n  ".join(result.divergences) + where, pytrace=False)
    if program.must_keep and result.decision == "rewritten":
        pytest.fail(f"a protected tensor is written where the proof must see it, yet the max was rewritten{where}",
                    pytrace=False)


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_generated_program_equals_eager(program):
    _check(pg.run_program(program))


def test_zz_summary():
    """The per-category table of what ran above (printed with -s; nothing to assert beyond the runs)."""
    if not RESULTS:
        pytest.skip("no generated program ran in this session")
    print("\n" + pg.summarize(list(RESULTS.values())))


# -- a representative few through the full backend and Inductor --------------------------------------------------
@pytest.mark.inductor
@pytest.mark.parametrize("name", pg.INDUCTOR_PROGRAMS)
def test_through_inductor(name):
    program = BY_NAME[name]
    fn = program.function()
    compiled = compile_pass.compile(fn, max_context_len=pg.MCL, fullgraph=True)
    for n, lengths in enumerate(program.vectors[:3]):
        want = pg._outcome(fn, pg.make_args(lengths, program.variant, program.seed + n))
        got = pg._outcome(compiled, pg.make_args(lengths, program.variant, program.seed + n))
        d = pg.step_difference(got, want, lengths)
        if d:
            pytest.fail(f"Inductor: compiled != eager at lengths={lengths}: {d}\n{program.source}", pytrace=False)
    report = compile_pass.last_report()
    if program.must_keep:
        assert report.kept and not report.rewritten, str(report)
        assert report.post_grad is None or report.post_grad["local_scalar_dense"] > 0
