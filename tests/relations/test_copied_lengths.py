"""Lengths copied into a persistent buffer (issue 30, FlashMLA's CUDA-graph replay draft extend).

SGLang's replay refreshes a static buffer the captured kernel binds, `buf[:bs].copy_(seq_lens)`, and the kernel reads
`buf[:bs]`. The proof relates the view to the copy's source: the last copy into the same view of the same graph
input, after the max, of a source of the same shape, with nothing else writing the buffer until the consumer. Each
step is compiled with the pass-only backend and compared with eager over several length vectors (the buffer is
compared after the step too); the kept forms say why.
"""

from __future__ import annotations

import torch

import consumers_for_tests  # noqa: F401  (syncfree_test::bounded_sum)
from passlib import Rewriting, length_vectors, make_fb

from compile_pass import _compat

SUM = torch.ops.syncfree_test.bounded_sum
MCL = 64


def _run(step, dtype=torch.int32, vectors=None):
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


def test_a_copy_into_a_buffer_of_the_same_dtype_too():
    backend = _run(copied, dtype=torch.int64)
    assert all(r.rewritten and not r.kept for r in backend.reports), [str(r) for r in backend.reports]


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
