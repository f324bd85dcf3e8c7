"""Generated programs for the trace-time layer, part 2: Structs, launchers, copies (issue 45, item 3).

Generator: tests/support/trace_program_generator.py. This file runs three families (part 1,
tests/suites/test_trace_time_programs.py, runs the branches):

  struct     random msgspec.Struct classes over Python's attribute-access features (plain, __getattribute__ /
             __getattr__ overrides in the class or a base, properties, methods, descriptors, ClassVars, defaults,
             default_factory, __post_init__, __len__ / __bool__, a custom metaclass, struct configs, annotations
             only a type checker resolves), built in the step or passed in;
  launcher   random signatures registered with compile_pass.register_disabled_launcher, called with schema
             arguments of every kind and with parameters the op does not take at, equal to (0.0 / -0.0, NaN,
             1 / True / 1.0, tuples) or other than their defaults;
  copy       lengths copied into a buffer through every indexing kind (views, and indices that write a
             temporary) and dtype pair (narrowing included), then read back by the consumer.

Each program is compiled once (passlib.compile_traced) and compared with eager on a sweep of length vectors;
expected: 0 divergences. A failure names the program (its source), the lengths, eager's result and the compiled
one. Without msgspec the struct programs skip, saying so (nothing else is skipped).
"""

from __future__ import annotations

import collections

import pytest

import trace_program_generator as tg

PROGRAMS = tg.generated_programs("struct", "launcher", "copy")
RESULTS: dict = {}


def test_corpus_spread():
    by_family = collections.Counter(p.family for p in PROGRAMS)
    assert set(by_family) == {"struct", "launcher", "copy"} and min(by_family.values()) >= 100, by_family
    features = {p.category.split("/")[1] for p in PROGRAMS if p.family == "struct"}
    assert features == set(tg.STRUCT_FEATURES), features
    sources = "\n".join(p.source for p in PROGRAMS if p.family == "launcher")
    for spelling in ("=-0.0", "=0.0", "=True", "=1.0", "=None", "float('nan')", "=(1.0, 2)"):
        assert spelling in sources, spelling
    copies = {p.category for p in PROGRAMS if p.family == "copy"}
    assert {"copy/view", "copy/temporary", "copy/view+narrowing", "copy/temporary+narrowing"} <= copies, copies


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_trace_time_program_equals_eager(program):
    if program.family == "struct" and tg.msgspec is None:
        pytest.skip("msgspec is not installed in this environment: the msgspec.Struct programs cannot run "
                    "(it comes with the SGLang set: make sglang-deps)")
    result = tg.run_program(program)
    RESULTS[program.name] = result
    if result.divergences:
        pytest.fail(result.message(), pytrace=False)


def test_zz_summary():
    """The per-category table of what ran above (printed with -s)."""
    if not RESULTS:
        pytest.skip("no trace-time program ran in this session")
    print("\n" + tg.summarize(list(RESULTS.values())))
