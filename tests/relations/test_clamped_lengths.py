"""Lengths floored at zero (`(seq_lens - k).clamp_min(0)`, SGLang's prefix lengths and query positions) count as
lengths where they provably read no more than the values the bound covers: each is at most its value (+ c) and
at least 0, so a consumer that reads no key past its lengths reads within the static table, and a reader through
an indptr reads within what the writer wrote. An indptr of floored lengths is not the indptr of the lengths, and a
floor that adds (`(x + 1).clamp(min=0)`) exceeds them: both keep. Compared with eager on many vectors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from compile_pass.normalize import floored_at_zero
from passlib import make_fb, run

MCL = 64
SUM = torch.ops.syncfree_test.bounded_sum
KV = torch.ops.syncfree.kv_indices
VECTORS = [[3, 9, 5], [0, 64, 1], [1, 1, 1], [0, 0, 0], [64, 64, 64], [17, 2, 40]]


READ = torch.ops.syncfree_test.indptr_read  # a registered reader through an indptr
VALUES = torch.randn(6 * 64, generator=torch.Generator().manual_seed(3))


def compare(step, **options):
    out, backend, compiled = run(step, make_fb(VECTORS[0]), max_context_len=MCL, **options)
    torch.testing.assert_close(out, step(make_fb(VECTORS[0])))
    for lengths in VECTORS[1:]:
        with compile_pass._compat.capture_scalar_outputs():
            torch.testing.assert_close(compiled(make_fb(lengths)), step(make_fb(lengths)))
    return backend


@pytest.mark.parametrize("spelling", ["clamp_min", "clamp_kw", "clamp_pos", "torch_clamp", "torch_clamp_min"])
def test_the_floor_at_zero_is_recognised_in_every_spelling(spelling):
    floor = {"clamp_min": lambda x: x.clamp_min(0), "clamp_kw": lambda x: x.clamp(min=0),
             "clamp_pos": lambda x: x.clamp(0), "torch_clamp": lambda x: torch.clamp(x, min=0),
             "torch_clamp_min": lambda x: torch.clamp_min(x, 0)}[spelling]

    def step(fb):
        m = fb.seq_lens.max().item()
        return SUM(fb.req_to_token[fb.req_pool_indices, :m], floor(fb.seq_lens - 1), 1, m)

    backend = compare(step)
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)


def test_a_page_table_consumer_reading_floored_lengths_is_rewritten_and_checked():
    def step(fb):
        m = fb.seq_lens.max().item()
        return SUM(fb.req_to_token[fb.req_pool_indices, :m:4] // 4, (fb.seq_lens - 3).clamp_min(0), 4, m)

    backend = compare(step)
    (item,) = backend.report.rewritten
    assert "lengths asserted on the device" in item.reason
    _, _, compiled = run(step, make_fb([3, 9, 5]), max_context_len=MCL)
    with compile_pass._compat.capture_scalar_outputs(), pytest.raises(RuntimeError, match="static bound"):
        compiled(make_fb([3, 66, 5]))  # the values behind the floor are asserted, not the floored lengths


def test_a_floor_that_adds_exceeds_the_max():
    def step(fb):
        m = fb.seq_lens.max().item()
        return SUM(fb.req_to_token[fb.req_pool_indices, :m], (fb.seq_lens + 1).clamp(min=0), 1, m + 1)

    backend = compare(step)
    assert [i.reason_code for i in backend.report.kept] == ["lengths_exceed"], str(backend.report)


def test_a_floor_above_zero_is_not_a_floor_at_zero():
    def step(fb):
        m = fb.seq_lens.max().item()
        return SUM(fb.req_to_token[fb.req_pool_indices, :m + 1], (fb.seq_lens - 1).clamp(min=1), 1, m + 1)

    backend = compare(step)
    assert [i.reason_code for i in backend.report.kept] == ["lengths_differ"], str(backend.report)


def _flat(reader_lengths, indptr_lengths=None):
    def step(fb):
        lens = fb.seq_lens
        kv_indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
        kv_indices = torch.empty(lens.sum().item(), dtype=torch.int32)
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, lens, kv_indptr)
        indptr = kv_indptr if indptr_lengths is None else F.pad(torch.cumsum(indptr_lengths(lens), 0), (1, 0))
        return READ(VALUES, kv_indices, indptr, reader_lengths(lens))

    return step


def test_a_reader_through_the_indptr_with_floored_lengths_reads_within_the_writes():
    backend = compare(_flat(lambda lens: (lens - 1).clamp_min(0)))
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)


def test_an_indptr_of_floored_lengths_is_another_indptr():
    floored = lambda lens: (lens - 1).clamp_min(0)  # noqa: E731
    backend = compare(_flat(floored, indptr_lengths=floored))
    assert [i.reason_code for i in backend.report.kept] == ["indptr_differs"], str(backend.report)


def test_floored_at_zero_reads_only_its_spellings():
    def step(x):
        return x.clamp(min=0), x.clamp(max=3), x.clamp(0, 5), x.clamp_min(1), torch.clamp(x, min=0)

    gm = torch.fx.symbolic_trace(step)
    calls = [n for n in gm.graph.nodes if n.op in ("call_method", "call_function")]
    for n in calls:  # symbolic_trace has no example values: give the dtype the vocabulary reads
        n.meta["example_value"] = torch.empty(2, dtype=torch.int64)
    assert [floored_at_zero(n) is not None for n in calls] == [True, False, False, False, True]
