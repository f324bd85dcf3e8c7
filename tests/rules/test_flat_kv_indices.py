"""The flat kv_indices rule (issue 20, recipe 3): `n = seq_lens.sum().item()` sizing a kv_indices buffer that a
bounded writer fills through an indptr and readers read through it becomes B x max_context_len. Each compiled
step is compared with eager over many length vectors (pass-only backend, no Inductor, except the one Inductor
test); kept variants assert their reason codes."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import compile_pass
from compile_pass import rules, sync_pass
from compile_pass.rules.flat_kv_indices import register_indptr_reader
import consumers_for_tests  # noqa: F401  (syncfree_test::indptr_read, a registered reader)
from passlib import host_reads, length_vectors, make_fb, run

MCL = 64
KV = torch.ops.syncfree.kv_indices


# -- test readers through an indptr, and an unregistered writer ------------------------------------------------
@torch.library.custom_op("syncfree_flat_test::gather_all", mutates_args=())
def gather_all(values: torch.Tensor, indices: torch.Tensor, indptr: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return values[indices.to(torch.int64).clamp(0, values.numel() - 1)]  # one output per slot: shaped by n


@gather_all.register_fake
def _(values, indices, indptr, lens):
    return values.new_empty(indices.shape)


@torch.library.custom_op("syncfree_flat_test::unregistered_writer", mutates_args=("out",))
def unregistered_writer(out: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                        lengths: torch.Tensor, indptr: torch.Tensor) -> None:
    KV(out, req_to_token, req_pool_indices, lengths, indptr)


@unregistered_writer.register_fake
def _(out, req_to_token, req_pool_indices, lengths, indptr):
    return None


register_indptr_reader("syncfree_flat_test::gather_all", indices="indices", indptr="indptr", lengths="lens")
READ = torch.ops.syncfree_test.indptr_read  # tests/support: row b reads indices[indptr[b] : indptr[b] + lens[b]]


@torch._dynamo.allow_in_graph
def opaque_scribble(t):
    """An allow_in_graph helper that writes its argument (the graph shows only a call to it)."""
    t.add_(1)
    return t


def vectors_of(batch, count, seed=0):
    """All zeros first (the vector Dynamo traces with), all at the bound, one row of 1; then random ones."""
    return length_vectors(batch, count, seed, top=MCL, first=([0] * batch, [MCL] * batch, [1] + [0] * (batch - 1)))


VALUES = torch.randn(6 * 64, generator=torch.Generator().manual_seed(1))


def args_of(lengths):
    return make_fb(lengths, seed=len(lengths)), VALUES


def compare(step, vectors, args=args_of, **options):
    options.setdefault("max_context_len", MCL)
    out, backend, compiled = run(step, *args(vectors[0]), **options)
    torch.testing.assert_close(out, step(*args(vectors[0])))
    for lengths in vectors[1:]:
        with compile_pass._compat.capture_scalar_outputs():
            torch.testing.assert_close(compiled(*args(lengths)), step(*args(lengths)))
    return backend


def codes(backend):
    return [i.reason_code for i in backend.report.kept]


def allocations(backend):
    return [n for n in backend.graphs[-1].graph.nodes
            if (n.op == "call_function" and n.target in (torch.empty, torch.zeros))
            or (n.op == "call_method" and n.target in ("new_empty", "new_zeros"))]


# -- the rewritten case ----------------------------------------------------------------------------------------
def step(fb, values):
    lens = fb.seq_lens
    kv_indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
    n = lens.sum().item()
    kv_indices = torch.empty(n, dtype=torch.int32, device=lens.device)
    KV(kv_indices, fb.req_to_token, fb.req_pool_indices, lens, kv_indptr)
    return READ(values, kv_indices, kv_indptr, lens)


def test_sum_sizing_kv_indices_becomes_b_times_max_context_len():
    backend = compare(step, vectors_of(4, 24))
    (item,) = backend.report.rewritten
    assert not backend.report.kept, str(backend.report)
    assert item.rule == "flat_kv_indices" and "4 x 64" in item.reason, item.reason
    (alloc,) = allocations(backend)
    assert alloc.args[0] == 4 * MCL and alloc.meta["example_value"].shape == (4 * MCL,)
    assert not host_reads(backend.graphs[-1])
    assert "lengths asserted on the device" in item.reason
    # Dynamo's own `u0 >= 0` on the size is implied by the lengths' check: it goes, and no other sum is left
    graph = backend.graphs[-1].graph
    assert not [n for n in graph.nodes if n.target is torch.ops.aten._assert_scalar.default]
    assert not [n for n in graph.nodes if n.target in ("sum", torch.ops.aten.sum.default)]


def test_other_spellings_cat_indptr_new_empty_torch_sum_int():
    def spelled(fb, values):
        lens = fb.seq_lens.to(torch.int32)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(dim=0)])
        kv_indices = fb.req_to_token.new_empty(int(torch.sum(lens)))
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, lens, indptr)
        return READ(values, kv_indices, indptr, lens)

    backend = compare(spelled, vectors_of(3, 16, seed=2))
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)
    (alloc,) = [a for a in allocations(backend) if a.target == "new_empty"]
    assert alloc.args[1] == 3 * MCL and not host_reads(backend.graphs[-1])


def test_zeros_buffer_and_two_readers():
    def two(fb, values):
        lens = fb.seq_lens
        indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
        kv_indices = torch.zeros(lens.sum().item(), dtype=torch.int64)
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, lens, indptr)
        again = F.pad(torch.cumsum(lens, 0), (1, 0))  # another indptr node of the same lengths: same values
        return READ(values, kv_indices, indptr, lens) + READ(values * 2, kv_indices, again, lens)

    backend = compare(two, vectors_of(5, 12, seed=3))
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)
    assert "2 reader(s)" in backend.report.rewritten[0].reason


def test_sum_over_the_cpu_mirror_writer_on_the_device_twin():
    def mirrored(fb, values):
        indptr = F.pad(torch.cumsum(fb.seq_lens, 0), (1, 0))
        kv_indices = torch.empty(fb.seq_lens_cpu.sum().item(), dtype=torch.int32)
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, indptr)
        return READ(values, kv_indices, indptr, fb.seq_lens)

    backend = compare(mirrored, vectors_of(3, 10, seed=4))
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)


def test_dynamic_batch_gives_a_backed_symbolic_size():
    vectors = [v for b in (3, 5, 2, 6) for v in vectors_of(b, 4, seed=b)]
    backend = compare(step, vectors)
    assert len(backend.graphs) == 2  # the second batch size recompiles with a dynamic B, then no more
    assert all(r.rewritten and not r.kept for r in backend.reports)
    (alloc,) = allocations(backend)
    size = alloc.args[0]
    assert isinstance(size, torch.fx.Node) and size.args[1] == MCL
    assert isinstance(alloc.meta["example_value"].shape[0], torch.SymInt)
    assert not host_reads(backend.graphs[-1])


def test_checked_asserts_every_length_within_the_bound():
    out, backend, compiled = run(step, *args_of([3, 9, 5]), max_context_len=MCL)
    assert backend.report.rewritten
    with compile_pass._compat.capture_scalar_outputs():
        with pytest.raises(RuntimeError, match=r"outside \[0, max_context_len=64\]"):
            compiled(*args_of([3, 65, 5]))
        with pytest.raises(RuntimeError, match="outside"):
            compiled(*args_of([3, -1, 5]))


def test_unchecked_no_device_check_and_the_writer_stays_in_the_buffer():
    """checked=False: no assertion. A length past the bound then gives unspecified values: the writer still writes
    nothing outside the buffer (it is bounded by it), but a reader through the indptr reads past its end, as any
    reader given an indptr beyond its buffer does; the test reader raises there."""
    out, backend, compiled = run(step, *args_of([3, 9, 5]), max_context_len=8, checked=False)
    assert backend.report.rewritten and "asserted" not in backend.report.rewritten[0].reason
    graph = backend.graphs[-1].graph
    assert not [n for n in graph.nodes if n.target is torch.ops.aten.le.Scalar]  # no bound check on the lengths
    with compile_pass._compat.capture_scalar_outputs(), pytest.raises(RuntimeError, match="reads indices"):
        compiled(*args_of([3, 60, 5]))  # total 68 > 3 * 8


def test_dynamos_size_check_and_a_user_check_stay_as_device_checks():
    def user_check(fb, values):
        lens = fb.seq_lens
        indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
        n = lens.sum().item()
        torch._check(n <= 100)
        kv_indices = torch.empty(n, dtype=torch.int32)
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, lens, indptr)
        return READ(values, kv_indices, indptr, lens)

    backend = compare(user_check, [[3, 9, 5], [30, 30, 30], [0, 0, 0]])
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)
    assert "checks on the sum run on the device" in backend.report.rewritten[0].reason
    compiled = torch.compile(user_check, backend=backend, fullgraph=True)
    with compile_pass._compat.capture_scalar_outputs(), pytest.raises(RuntimeError, match="check on the sum"):
        compiled(*args_of([40, 40, 40]))  # 120 > 100: eager's torch._check raises too
    with pytest.raises(RuntimeError):
        user_check(*args_of([40, 40, 40]))


# -- kept variants, by reason code -----------------------------------------------------------------------------
def _variant(writer=KV, writer_lens=None, reader_indptr=None, between=None, extra=None, source=None,
             reader=READ):
    def variant(fb, values, other):
        lens = fb.seq_lens
        indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
        n = (source(fb, other) if source else lens.sum()).item()
        kv_indices = torch.empty(n, dtype=torch.int32)
        writer(kv_indices, fb.req_to_token, fb.req_pool_indices, writer_lens(fb, other) if writer_lens else lens,
               indptr)
        if between is not None:
            between(kv_indices)
        out = reader(values, kv_indices, reader_indptr(fb, other, indptr) if reader_indptr else indptr, lens)
        return extra(out, n, kv_indices) if extra else out

    return variant


def kept_args(lengths):
    fb, values = args_of(lengths)
    return fb, values, fb.seq_lens.clone()  # `other`: the same values, another tensor


KEPT = {
    "unregistered_writer": (dict(writer=torch.ops.syncfree_flat_test.unregistered_writer), "not_a_consumer"),
    "writer_other_lengths": (dict(writer_lens=lambda fb, other: other), "lengths_differ"),
    "writer_lengths_plus_one": (dict(writer_lens=lambda fb, other: fb.seq_lens + 1), "lengths_exceed"),
    "reader_other_indptr": (dict(reader_indptr=lambda fb, other, ip: F.pad(torch.cumsum(other, 0), (1, 0))),
                            "indptr_differs"),
    "reader_indptr_input": (dict(reader_indptr=lambda fb, other, ip: F.pad(other, (1, 0))), "indptr_differs"),
    "write_between_by_unknown_op": (dict(between=opaque_scribble), "written"),
    "write_between_by_a_method": (dict(between=lambda t: t.add_(1)), "written"),
    "sum_returned": (dict(extra=lambda out, n, kv: (out, n)), "escapes"),
    "sum_arithmetic": (dict(extra=lambda out, n, kv: out * (n + 1)), "arithmetic"),
    "buffer_returned": (dict(extra=lambda out, n, kv: (out, kv)), "escapes"),
    "sum_over_computed_tensor": (dict(source=lambda fb, other: (fb.seq_lens * 2).sum()), "not_lengths"),
    "sum_over_other_input": (dict(source=lambda fb, other: other.sum()), "lengths_differ"),
    "output_shaped_by_n": (dict(reader=torch.ops.syncfree_flat_test.gather_all), "output_changes"),
}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_kept_variants_carry_their_reason_codes(name):
    spec, code = KEPT[name]
    backend = compare(_variant(**spec), [[3, 9, 5], [0, 64, 1], [17, 17, 17]], args=kept_args)
    assert codes(backend) == [code], str(backend.report)
    assert [i.rule for i in backend.report.kept] == ["flat_kv_indices"]
    assert not backend.report.rewritten
    assert host_reads(backend.graphs[-1])  # kept exactly as eager computes it


def test_lengths_below_the_summed_values_are_fine_for_writer_and_reader():
    def fewer(fb, values):
        lens = fb.seq_lens
        indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
        kv_indices = torch.empty(lens.sum().item(), dtype=torch.int32)
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, lens - 1, indptr)
        return READ(values, kv_indices, indptr, lens - 2)

    backend = compare(fewer, vectors_of(3, 10, seed=5))
    assert backend.report.rewritten and not backend.report.kept, str(backend.report)


def test_a_reader_without_a_writer_is_kept():
    def unfilled(fb, values):
        lens = fb.seq_lens
        indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
        kv_indices = torch.zeros(lens.sum().item(), dtype=torch.int32)
        return READ(values, kv_indices, indptr, lens)

    backend = compare(unfilled, [[3, 9, 5], [0, 1, 2]])
    assert codes(backend) == ["no_writer"], str(backend.report)


def test_a_float_sum_is_not_lengths():
    def float_sum(fb, values):
        return values * values[:4].sum().item()

    _, backend, _ = run(float_sum, *args_of([3, 9, 5]), max_context_len=MCL)
    assert codes(backend) == ["not_int_lengths"], str(backend.report)


def test_without_max_context_len_the_sum_is_kept():
    _, backend, _ = run(step, *args_of([3, 9, 5]))
    assert codes(backend) == ["no_bound"], str(backend.report)


def test_the_sum_as_something_other_than_a_size_is_kept_with_sum_use():
    def slice_end(fb, values):
        n = fb.seq_lens.sum().item()
        return values[:n].sum()  # the sum ends a slice: no allocation it sizes

    backend = compare(slice_end, vectors_of(3, 4, seed=6))
    assert codes(backend) == ["sum_use"], str(backend.report)


def test_a_buffer_with_two_writers_is_kept_with_buffer_use():
    def written_twice(fb, values):
        lens = fb.seq_lens
        indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
        kv_indices = torch.empty(lens.sum().item(), dtype=torch.int32)
        for _ in range(2):
            KV(kv_indices, fb.req_to_token, fb.req_pool_indices, lens, indptr)
        return READ(values, kv_indices, indptr, lens)

    backend = compare(written_twice, vectors_of(3, 4, seed=7))
    assert codes(backend) == ["buffer_use"], str(backend.report)


# -- the op, the registry, the driver --------------------------------------------------------------------------
def test_kv_indices_op_writes_only_its_rows_and_never_out_of_bounds():
    fb = make_fb([3, 0, 7, 64])
    lens = fb.seq_lens
    indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
    out = torch.full((80,), -1, dtype=torch.int32)
    KV(out, fb.req_to_token, fb.req_pool_indices, lens, indptr)
    expect = torch.cat([fb.req_to_token[r, :n] for r, n in zip(fb.req_pool_indices.tolist(), lens.tolist())])
    torch.testing.assert_close(out[:74], expect)
    assert (out[74:] == -1).all()  # nothing past indptr[B]
    short = torch.full((10,), -1, dtype=torch.int64)  # a buffer shorter than the total: clipped, no error
    KV(short, fb.req_to_token, fb.req_pool_indices, lens, indptr)
    torch.testing.assert_close(short, expect[:10].to(torch.int64))
    wild = torch.tensor([-5, 200, 9, 0])  # indptr out of range, negative: nothing outside [0, 10) written
    KV(short, fb.req_to_token, fb.req_pool_indices, lens, wild)
    with pytest.raises(ValueError, match="indptr"):
        KV(out, fb.req_to_token, fb.req_pool_indices, lens, indptr[:2])


def test_rule_is_registered_and_the_driver_names_no_rule():
    names = [r.name for r in rules.registered_rules()]
    assert names.count("flat_kv_indices") == 1 and "page_table" in names
    source = inspect.getsource(sync_pass)
    assert not any(word in source for word in ("flat_kv", "FlatKv", "sum_source", "kv_indices"))


def test_writer_facts_are_checked_against_the_schema():
    from compile_pass.rules.flat_kv_indices import register_indptr_writer

    with pytest.raises(ValueError, match="not written"):
        register_indptr_writer("syncfree_test::indptr_read", out="indices", indptr="indptr", lengths="lens")
    with pytest.raises(ValueError, match="not an argument"):
        register_indptr_reader("syncfree_test::indptr_read", indices="idx", indptr="indptr", lengths="lens")


@pytest.mark.inductor
def test_through_inductor_no_host_sync_and_no_recompile():
    from compile_pass._compat import run_and_get_code
    from compile_pass.testing import host_reads_in_code
    from torch._dynamo.utils import counters

    compiled = compile_pass.compile(step, max_context_len=MCL, fullgraph=True)
    counters.clear()
    out, code = run_and_get_code(compiled, *args_of([3, 9, 5, 1]))
    torch.testing.assert_close(out, step(*args_of([3, 9, 5, 1])))
    assert host_reads_in_code(code) == 0
    report = compile_pass.last_report()
    assert report.syncs_remaining == 0 and len(report.rewritten) == 1, str(report)
    for lengths in vectors_of(4, 8, seed=9):
        torch.testing.assert_close(compiled(*args_of(lengths)), step(*args_of(lengths)))
    assert counters["stats"]["unique_graphs"] == 1
