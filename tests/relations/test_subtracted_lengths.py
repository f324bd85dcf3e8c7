"""Lengths that subtract a tensor (`seq_lens - extend_seq_lens + 4`, SGLang's FlashMLA draft extend) count as
lengths where the premise that makes them an upper-bound relation holds: every subtracted value >= 0, so each
length is at most its value + 4 and the consumer reads within what eager's `max + 4` covered. The rewrite asserts
that premise on the device, checked or not (every length <= max(values) + 4): a negative subtracted value raises
instead of reading past the table. A subtraction that leaves the lengths above what the bound covers keeps, and
so does one in a rule that needs the values themselves (a sum). And a max over `x + c` relates to lengths `x + c`
computed apart (constant adds on both sides). Compared with eager on many vectors."""

from __future__ import annotations

import pytest
import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from compile_pass.normalize import tensor_sub
from passlib import length_vectors, make_fb, run

MCL = 56  # the token table is 64 wide: `:m + 8` stays inside it for every m within the bound
SUM = torch.ops.syncfree_test.bounded_sum


def extend_of(lengths, seed):
    """Per row, an extend length in [0, length] (what SGLang's draft extend has: seq_lens count them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, x + 1, (), generator=g) for x in lengths])


def step_minus_extend(fb, ext):
    m = fb.seq_lens.max().item()
    lens = (fb.seq_lens - ext + 4).to(torch.int32)
    return SUM(fb.req_to_token[fb.req_pool_indices, :m + 4], lens, 1, m + 4)


def compare(step, vectors, **options):
    first = vectors[0]
    out, backend, compiled = run(step, make_fb(first), extend_of(first, 0), max_context_len=MCL, **options)
    torch.testing.assert_close(out, step(make_fb(first), extend_of(first, 0)))
    for n, lengths in enumerate(vectors[1:], 1):
        with compile_pass._compat.capture_scalar_outputs():
            fb, ext = make_fb(lengths, seed=n), extend_of(lengths, n)
            torch.testing.assert_close(compiled(fb, ext), step(fb, ext), msg=lambda s: f"{lengths}: {s}")
    return backend, compiled


def test_lengths_minus_a_tensor_are_rewritten_and_equal_eager():
    vectors = length_vectors(3, 24, seed=5, top=MCL, first=[[MCL, 3, 17], [0, 0, 0], [1, MCL, 1]])
    backend, _ = compare(step_minus_extend, vectors)
    (item,) = backend.report.rewritten
    assert not backend.report.kept and "bound 56" in item.reason, str(backend.report)


@pytest.mark.parametrize("checked", [True, False])
def test_a_negative_subtracted_value_raises_checked_or_not(checked):
    """The premise is the proof's, not a bound check: asserted with checked=False too."""
    _, compiled = compare(step_minus_extend, [[20, 3, 17], [5, 9, 1]], checked=checked)
    fb = make_fb([20, 3, 17])
    ext = torch.tensor([0, -30, 2])  # row 1 reads 3 + 30 + 4 keys: past eager's max + 4 (24)
    with compile_pass._compat.capture_scalar_outputs(), pytest.raises(RuntimeError, match="subtract is negative"):
        compiled(fb, ext)


def test_the_values_behind_the_subtraction_are_checked_against_the_bound():
    _, compiled = compare(step_minus_extend, [[20, 3, 17]])
    fb = make_fb([20, 3, 17])
    fb.seq_lens[1] = MCL + 1  # past max_context_len, though its length (MCL + 1 - ext + 4) might not be
    with compile_pass._compat.capture_scalar_outputs(), pytest.raises(RuntimeError, match="static bound"):
        compiled(fb, torch.tensor([0, 6, 2]))


def test_a_subtraction_that_still_exceeds_the_bound_keeps():
    def step(fb, ext):
        m = fb.seq_lens.max().item()
        lens = fb.seq_lens - ext + 5  # one past what `:m + 4` covers
        return SUM(fb.req_to_token[fb.req_pool_indices, :m + 4], lens, 1, m + 5)

    backend, _ = compare(step, [[20, 3, 17], [5, 9, 1]])
    assert [i.reason_code for i in backend.report.kept] == ["lengths_exceed"], str(backend.report)


def test_the_max_over_values_plus_c_relates_to_lengths_plus_c_computed_apart():
    def step(fb, ext):
        m = (fb.seq_lens + 4).max().item()  # the max over x + 4 ...
        lens = fb.seq_lens.to(torch.int32) + 4  # ... and lengths x + 4 of their own
        return SUM(fb.req_to_token[fb.req_pool_indices, :m], lens, 1, m)

    vectors = length_vectors(3, 12, seed=9, top=MCL, first=[[MCL, 1, 2]])
    backend, _ = compare(step, vectors)
    (item,) = backend.report.rewritten
    assert not backend.report.kept and "bound 60" in item.reason, str(backend.report)


def test_tensor_sub_recognises_only_a_difference_of_int_tensors_shaped_as_the_minuend():
    g = torch.fx.Graph()
    x, y, s, f = (g.placeholder(n) for n in "xysf")
    for node, value in ((x, torch.zeros(3, dtype=torch.int64)), (y, torch.zeros(3, dtype=torch.int32)),
                        (s, torch.zeros((), dtype=torch.int64)), (f, torch.zeros(3))):
        node.meta["example_value"] = value

    def sub(a, b, how="function"):
        node = g.call_function(torch.sub, (a, b)) if how == "function" else g.call_method("sub", (a, b))
        node.meta["example_value"] = torch.sub(a.meta["example_value"], b.meta["example_value"])
        return node

    assert tensor_sub(sub(x, y)) == (x, y)
    assert tensor_sub(sub(x, y, "method")) == (x, y)
    assert tensor_sub(sub(x, s)) == (x, s)  # a scalar tensor broadcast over the lengths
    assert tensor_sub(sub(s, x)) is None  # the lengths broadcast over a scalar: not one value per length
    assert tensor_sub(sub(x, f)) is None  # a float operand
