"""Lengths copied into a persistent buffer (issue 30, FlashMLA's CUDA-graph replay draft extend).

SGLang's replay refreshes a static buffer the captured kernel binds, `buf[:bs].copy_(seq_lens)`, and the kernel reads
`buf[:bs]`. The proof relates the view to the copy's source: the last copy into the same view of the same graph
input, after the max, of a source of the same shape, with nothing else writing the buffer until the consumer. Only a
view relates (basic indexing: a tensor or list index copies into a temporary), and only a copy that keeps every
value (the same dtype or wider: int64 lengths into an int32 buffer wrap). Each step is compiled with the pass-only
backend and compared with eager over several length vectors (the buffer is compared after the step too); the kept
forms say why.
"""

from __future__ import annotations

import pytest
import torch

import consumers_for_tests  # noqa: F401  (syncfree_test::bounded_sum)
from passlib import Rewriting, length_vectors, make_fb

from compile_pass import _compat

SUM = torch.ops.syncfree_test.bounded_sum
MCL = 64


def _run(step, dtype=torch.int64, vectors=None):  # the lengths' own dtype: an int32 buffer narrows (below)
    backend = Rewriting(max_context_len=MCL)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    buf_got = torch.ones(6, dtype=dtype)
    buf_want = buf_got.clone()
    for lengths in vectors or length_vectors(3, 6, seed=3, top=MCL, first=([MCL, 5, 9],)):
        with _compat.capture_scalar_outputs():
            got = compiled(make_fb(lengths), buf_got)
        torch.testing.assert_close(got, step(make_fb(lengths), buf_want))
        assert torch.equal(buf_got, buf_want)
    return backend


def copied(fb, buf):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m]
    buf[:3].copy_(fb.seq_lens)  # the replay's refresh of the kernel's static buffer
    return SUM(table, buf[:3], 1, m)


def codes(backend):
    return [i.reason_code for r in backend.reports for i in r.kept]


def test_lengths_copied_into_a_buffer_relate_to_the_copy_s_source():
    backend = _run(copied)
    assert all(r.rewritten and not r.kept for r in backend.reports), [str(r) for r in backend.reports]
    assert "item" not in [str(t) for t in backend.targets()]


def test_another_write_to_the_buffer_after_the_copy_keeps_the_max():
    def rewritten_after(fb, buf):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m]
        buf[:3].copy_(fb.seq_lens)
        buf[1:2].add_(1)  # a row past what the max covered
        return SUM(table, buf[:3], 1, m + 1)

    assert "written" in codes(_run(rewritten_after))


def test_a_copy_into_another_view_or_of_another_shape_keeps_the_max():
    def shifted_view(fb, buf):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m]
        buf[1:4].copy_(fb.seq_lens)
        return SUM(table, buf[:3].clamp(max=m), 1, m)

    def broadcast(fb, buf):
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m]
        buf[:3].copy_(fb.seq_lens[:1])  # one value broadcast to three rows
        return SUM(table, buf[:3], 1, m)

    assert "lengths_differ" in codes(_run(shifted_view))
    assert "lengths_differ" in codes(_run(broadcast))


def test_a_copy_before_the_max_keeps_it():
    def copied_first(fb, buf):
        buf[:3].copy_(fb.seq_lens)
        m = fb.seq_lens.max().item()
        table = fb.req_to_token[fb.req_pool_indices, :m]
        return SUM(table, buf[:3], 1, m)

    found = codes(_run(copied_first))
    assert found and set(found) == {"written"}, found


# -- only a copy through a basic-indexing view relates (issue 45, item 2) ------------------------------------------
# `buf[idx].copy_(x)` with a tensor or list index writes a temporary that advanced indexing made: buf is unchanged,
# and a later `buf[idx]` holds what buf held, not x. Related as "holds x", the max would be replaced while the
# consumer reads buf's own values, which may exceed it: compiled differs from eager. The buffer here holds lengths
# past every max the vectors take (but within the bound, so no check fires), and the upper bound is m + MCL, so
# eager raises nowhere.
HELD = [50, 60, 64, 33, 47, 58]


def _run_held(step, vectors, dtype=torch.int32, checked=True):
    backend = Rewriting(max_context_len=MCL, checked=checked)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for lengths in vectors:
        buf_got, buf_want = torch.tensor(HELD, dtype=dtype), torch.tensor(HELD, dtype=dtype)
        with _compat.capture_scalar_outputs():
            got = compiled(make_fb(lengths), buf_got)
        want = step(make_fb(lengths), buf_want)
        torch.testing.assert_close(got, want, msg=lambda m: f"lengths {lengths}: {m}")
        assert torch.equal(buf_got, buf_want)
    return backend


def through_a_tensor_index(fb, buf):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m]
    idx = torch.arange(3)
    buf[idx].copy_(fb.seq_lens)  # writes a temporary: buf keeps HELD
    return SUM(table, buf[idx], 1, m + MCL)


def through_a_list_index(fb, buf):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m]
    buf[[0, 1, 2]].copy_(fb.seq_lens)
    return SUM(table, buf[[0, 1, 2]], 1, m + MCL)


def through_an_input_index(fb, buf):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m]
    buf[fb.req_pool_indices].copy_(fb.seq_lens)
    return SUM(table, buf[fb.req_pool_indices], 1, m + MCL)


def through_a_basic_view(fb, buf):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m]
    buf[0:3].copy_(fb.seq_lens)  # a view: the copy reaches buf
    return SUM(table, buf[0:3], 1, m + MCL)


# small maxima (where buf's values exceed what eager's table covers), the bound, and random vectors
SMALL_MAXIMA = ([5, 9, 3], [0, 0, 0], [1, 2, 1], [MCL, 5, 9], [12, 0, 7])


def _vectors(seed):
    return length_vectors(3, 24, seed=seed, top=MCL, first=SMALL_MAXIMA)



@pytest.mark.parametrize("step", [through_a_tensor_index, through_a_list_index, through_an_input_index])
@pytest.mark.parametrize("checked", [True, False])
def test_a_copy_through_an_advanced_index_does_not_relate(step, checked):
    """Compiled equals eager over small maxima, the bound and random vectors, checked or not; the max is kept and
    the report says why (the copy writes a temporary: copy_not_a_view)."""
    backend = _run_held(step, _vectors(11), checked=checked)
    assert "copy_not_a_view" in codes(backend), [str(r) for r in backend.reports]
    assert not any(r.rewritten for r in backend.reports), [str(r) for r in backend.reports]


def test_a_copy_through_a_basic_view_still_relates():
    backend = _run_held(through_a_basic_view, _vectors(12), dtype=torch.int64)
    assert all(r.rewritten and not r.kept for r in backend.reports), [str(r) for r in backend.reports]


# -- a narrowing copy (int64 lengths into an int32 buffer) (issue 45, item 2) ------------------------------------
# The int32 buffer holds the int64 values modulo 2**32: a length of 2**32 + 5 (past every bound) arrives as 5,
# which a check on the buffer's values would let through. A narrowing copy relates only with its wide source
# asserted within the bound under `checked` (the bound fits int32: every value in it survives the copy); a cast
# below the copy is refused (narrowing_copy: no assertion sees the wide values); widening copies relate.
WRAPS = 2**32 + 5


def _int32_fb(lengths):
    fb = make_fb(lengths)
    fb.seq_lens = fb.seq_lens.to(torch.int32)
    fb.seq_lens_cpu = fb.seq_lens.clone()
    return fb


def narrowing_below_the_copy(fb, buf):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m]
    buf[:3].copy_(fb.seq_lens.to(torch.int32))  # narrowed by a cast, then copied: the same wrap
    return SUM(table, buf[:3], 1, m)


@pytest.mark.parametrize("checked", [True, False])
def test_a_narrowing_copy_relates_with_its_wide_source_asserted(checked):
    """Every length vector within the bound gives eager's values, checked or not; under checked a source past
    the bound (one that would wrap to a small buffer value) raises on the device, outside the contract."""
    vectors = length_vectors(3, 20, seed=5, top=MCL, first=([MCL, 5, 9], [0, 1, 2]))
    backend = Rewriting(max_context_len=MCL, checked=checked)
    compiled = torch.compile(copied, backend=backend, fullgraph=True)
    for lengths in vectors:
        buf_got, buf_want = torch.ones(6, dtype=torch.int32), torch.ones(6, dtype=torch.int32)
        with _compat.capture_scalar_outputs():
            got = compiled(make_fb(lengths), buf_got)
        torch.testing.assert_close(got, copied(make_fb(lengths), buf_want))
        assert torch.equal(buf_got, buf_want)
    assert all(r.rewritten and not r.kept for r in backend.reports), [str(r) for r in backend.reports]
    if checked:
        with pytest.raises(RuntimeError, match="exceeds the static bound"), _compat.capture_scalar_outputs():
            compiled(make_fb([WRAPS, 3, 4]), torch.ones(6, dtype=torch.int32))


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("step", [narrowing_below_the_copy])
def test_a_narrowing_cast_below_a_copy_does_not_relate(step, checked):
    vectors = [*length_vectors(3, 20, seed=5, top=MCL, first=([MCL, 5, 9], [0, 1, 2])), [WRAPS, 3, 4], [3, WRAPS, 0]]
    backend = Rewriting(max_context_len=MCL, checked=checked)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for lengths in vectors:
        buf_got, buf_want = torch.ones(6, dtype=torch.int32), torch.ones(6, dtype=torch.int32)
        with _compat.capture_scalar_outputs():
            got = compiled(make_fb(lengths), buf_got)
        torch.testing.assert_close(got, step(make_fb(lengths), buf_want))
        assert torch.equal(buf_got, buf_want)
    assert codes(backend) and set(codes(backend)) == {"narrowing_copy"}, [str(r) for r in backend.reports]


def test_a_widening_copy_relates():
    """int32 lengths into an int64 buffer keep every value: the copy relation holds."""
    backend = Rewriting(max_context_len=MCL)
    compiled = torch.compile(copied, backend=backend, fullgraph=True)
    for lengths in length_vectors(3, 12, seed=6, top=MCL, first=([MCL, 5, 9],)):
        buf_got, buf_want = torch.ones(6, dtype=torch.int64), torch.ones(6, dtype=torch.int64)
        with _compat.capture_scalar_outputs():
            got = compiled(_int32_fb(lengths), buf_got)
        torch.testing.assert_close(got, copied(_int32_fb(lengths), buf_want))
        assert torch.equal(buf_got, buf_want)
    assert all(r.rewritten and not r.kept for r in backend.reports), [str(r) for r in backend.reports]
