"""The host-sum rule (issue 27, item 6): a host int declared equal to sum(seq_lens) (SGLang's
`forward_batch.seq_lens_sum`) sizing a flat kv_indices buffer gets the static size B x max_context_len, so that
the step stops following the int (one graph, and on a GPU one CUDA graph, per batch size). Each compiled step is
compared with eager over many length vectors (pass-only backend); kept variants assert their reason codes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import compile_pass
from compile_pass.options import OptionError, SyncfreeOptions
import consumers_for_tests  # noqa: F401  (registers syncfree_test::indptr_read)
from passlib import Rewriting, make_fb

MCL = 64
KV = torch.ops.syncfree.kv_indices


@torch.library.custom_op("syncfree_host_sums_test::unregistered_read", mutates_args=())
def unregistered_read(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return values[indices.to(torch.int64).clamp(0, values.numel() - 1)].sum(0, keepdim=True)


@unregistered_read.register_fake
def _(values, indices):
    return values.new_empty((1,))


READ = torch.ops.syncfree_test.indptr_read  # a registered reader through an indptr
VALUES = torch.randn(6 * 64, generator=torch.Generator().manual_seed(7))


@dataclasses.dataclass
class Batch:
    """SGLang's forward batch, as far as the Triton backend's decode reads it."""

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_sum: int  # a host int: sum(seq_lens), published by the scheduler


def batch(lengths, seed=0):
    fb = make_fb(lengths, seed=seed)
    return Batch(fb.req_to_token, fb.req_pool_indices, fb.seq_lens, int(sum(lengths)))


def length_vectors(batch_size, count, seed):
    gen = torch.Generator().manual_seed(seed)
    found = [[5] * batch_size, [MCL] * batch_size, [0] * batch_size, [1] + [0] * (batch_size - 1)]
    found += [torch.randint(0, MCL + 1, (batch_size,), generator=gen).tolist() for _ in range(count)]
    return found


def decode(fb, values):
    """SGLang's Triton decode metadata: kv_indptr from the lengths, kv_indices sized by the host sum."""
    kv_indptr = F.pad(torch.cumsum(fb.seq_lens, 0), (1, 0))
    kv_indices = torch.empty(fb.seq_lens_sum, dtype=torch.int32, device=fb.seq_lens.device)
    KV(kv_indices, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr)
    return READ(values, kv_indices, kv_indptr, fb.seq_lens)


def compare(step, vectors, **options):
    """Compile through the pass (no Inductor) and compare with eager on every vector; the backend's graphs."""
    options.setdefault("max_context_len", MCL)
    backend = Rewriting(**options)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for n, lengths in enumerate(vectors):
        torch.testing.assert_close(compiled(batch(lengths, seed=n), VALUES), step(batch(lengths, seed=n), VALUES))
    return backend


def allocations(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.empty]


def test_declared_host_sum_sizes_the_buffer_statically():
    vectors = length_vectors(4, 8, seed=1)
    backend = compare(decode, vectors, host_sums={"seq_lens_sum": "seq_lens"})
    # the first graph is specialised on the first sum (a constant: nothing to rewrite); the second value made the
    # int a dynamic input, which the rule removes from the buffer's size: no graph after that one
    assert len(backend.graphs) == 2
    first, second = backend.reports
    assert not first.rewritten and not first.kept
    (item,) = second.rewritten
    assert not second.kept, str(second)
    assert item.rule == "host_sums" and item.kind == "host_sum" and not item.host_sync
    assert "4 x 64" in item.reason and "lengths asserted on the device" in item.reason, item.reason
    (alloc,) = allocations(backend.graphs[-1])
    assert alloc.args[0] == 4 * MCL and alloc.meta["example_value"].shape == (4 * MCL,)
    placeholder = next(n for n in backend.graphs[-1].graph.nodes if n.op == "placeholder" and "sum" in n.name)
    # the buffer no longer follows the int: only the device assertion of the declaration reads it (checked)
    assert [u.target for u in placeholder.users] == [torch.ops.aten.eq.Scalar]
    assert "fb.seq_lens_sum == sum(fb.seq_lens) asserted on the device" in item.reason, item.reason


def test_unchecked_the_int_is_read_by_nothing():
    backend = compare(decode, length_vectors(3, 3, seed=4), host_sums={"seq_lens_sum": "seq_lens"}, checked=False)
    (item,) = backend.reports[-1].rewritten
    assert "asserted" not in item.reason, item.reason
    placeholder = next(n for n in backend.graphs[-1].graph.nodes if n.op == "placeholder" and "sum" in n.name)
    assert not placeholder.users


@pytest.mark.parametrize("options", [{"cudagraphs": True}, {"triton.cudagraphs": True}])
def test_under_cuda_graphs_the_declaration_is_not_asserted(options):
    """An int the graph reads keys Inductor's recorded CUDA graphs (one recording per value: measured on the H200,
    8 recordings for 8 sums against one): under CUDA graphs the int stays unread and the report says the
    declaration is the user's promise there; the lengths' range is still asserted."""
    backend = compare(decode, length_vectors(3, 3, seed=5), host_sums={"seq_lens_sum": "seq_lens"}, **options)
    (item,) = backend.reports[-1].rewritten
    assert "lengths asserted on the device" in item.reason, item.reason
    assert "fb.seq_lens_sum == sum(fb.seq_lens) not asserted under cudagraphs" in item.reason, item.reason
    placeholder = next(n for n in backend.graphs[-1].graph.nodes if n.op == "placeholder" and "sum" in n.name)
    assert not placeholder.users


def _wrong_sums(lengths) -> list[int]:
    """Host ints that are not sum(lengths) (never negative: a scheduler's count)."""
    total = sum(lengths)
    return [t for t in (total - 1, total + 1, total + 64, 0 if total else 5) if t >= 0 and t != total]


@pytest.mark.parametrize("batch_size", [1, 3, 6])
def test_checked_asserts_the_declared_sum_on_the_device(batch_size):
    """Over random vectors: the compiled step equals eager where the int is the sum (never raises: each length in
    [0, bound] with its sum), and raises where it is not, whether eager's buffer would have been too small (eager
    reads past it) or too large (eager runs): the rewrite rests on the declaration, and checked asserts it."""
    backend = Rewriting(max_context_len=MCL, host_sums={"seq_lens_sum": "seq_lens"})
    compiled = torch.compile(decode, backend=backend, fullgraph=True)
    vectors = length_vectors(batch_size, 12, seed=10 + batch_size)
    for n, lengths in enumerate(vectors):
        torch.testing.assert_close(compiled(batch(lengths, seed=n), VALUES), decode(batch(lengths, seed=n), VALUES))
    assert backend.reports[-1].rewritten and len(backend.graphs) == 2, str(backend.reports[-1])
    checked = 0
    for n, lengths in enumerate(vectors):
        for wrong in _wrong_sums(lengths):
            fb = dataclasses.replace(batch(lengths, seed=n), seq_lens_sum=wrong)
            with pytest.raises(RuntimeError, match=r"syncfree: fb\.seq_lens_sum is not sum\(fb\.seq_lens\) at "
                                                   r"test_host_sums\.py:\d+: options\['host_sums'\] declares it"):
                compiled(fb, VALUES)
            checked += 1
    assert checked >= 3 * len(vectors) and len(backend.graphs) == 2  # no recompile for a wrong int either


def test_unchecked_a_wrong_sum_is_the_user_s_promise():
    backend = Rewriting(max_context_len=MCL, host_sums={"seq_lens_sum": "seq_lens"}, checked=False)
    compiled = torch.compile(decode, backend=backend, fullgraph=True)
    compiled(batch([3, 9, 5]), VALUES)
    compiled(batch([4, 9, 5]), VALUES)
    fb = dataclasses.replace(batch([4, 9, 5]), seq_lens_sum=100)
    torch.testing.assert_close(compiled(fb, VALUES), decode(batch([4, 9, 5]), VALUES))  # no assertion, no raise


def test_without_the_declaration_the_size_follows_the_int():
    backend = compare(decode, length_vectors(3, 4, seed=2))
    assert len(backend.graphs) == 2 and not backend.reports[-1].rewritten and not backend.reports[-1].kept
    (alloc,) = allocations(backend.graphs[-1])
    assert isinstance(alloc.args[0], torch.fx.Node) and alloc.args[0].op == "placeholder"


def test_dynamic_batch_gives_a_symbolic_static_size():
    vectors = [v for b in (3, 5, 2, 6) for v in length_vectors(b, 2, seed=b)]
    backend = compare(decode, vectors, host_sums={"seq_lens_sum": "seq_lens"})
    assert backend.reports[-1].rewritten and not backend.reports[-1].kept, str(backend.reports[-1])
    size = allocations(backend.graphs[-1])[0].args[0]
    assert isinstance(size, torch.fx.Node) and size.args[1] == MCL  # sym_size(seq_lens, 0) * 64


def test_checked_asserts_the_lengths_within_the_bound():
    backend = Rewriting(max_context_len=MCL, host_sums={"seq_lens_sum": "seq_lens"})
    compiled = torch.compile(decode, backend=backend, fullgraph=True)
    compiled(batch([3, 9, 5]), VALUES)
    compiled(batch([4, 9, 5]), VALUES)
    assert backend.reports[-1].rewritten
    with pytest.raises(RuntimeError, match=r"outside \[0, max_context_len=64\]"):
        compiled(batch([3, 65, 5]), VALUES)
    with pytest.raises(RuntimeError, match="outside"):
        compiled(batch([3, -1, 5]), VALUES)


def _kept(step, **options):
    backend = compare(step, [[3, 9, 5], [4, 9, 5], [1, 0, 7]], host_sums={"seq_lens_sum": "seq_lens"}, **options)
    report = backend.reports[-1]
    assert not report.rewritten, str(report)
    (item,) = report.kept
    assert item.kind == "host_sum" and "(a host int: no device sync)" in item.reason
    return item


def test_declared_lengths_missing_from_the_graph_keep_the_int():
    def other(fb, values):
        kv_indptr = F.pad(torch.cumsum(fb.req_pool_indices, 0), (1, 0))
        kv_indices = torch.empty(fb.seq_lens_sum, dtype=torch.int32)
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, fb.req_pool_indices.clamp(max=0), kv_indptr)
        return kv_indices.numel() + values[:1]

    assert _kept(other).reason_code == "host_sum_lengths"


def test_a_buffer_read_by_an_op_without_facts_keeps_the_int():
    def unregistered(fb, values):
        kv_indptr = F.pad(torch.cumsum(fb.seq_lens, 0), (1, 0))
        kv_indices = torch.zeros(fb.seq_lens_sum, dtype=torch.int32)
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr)
        return torch.ops.syncfree_host_sums_test.unregistered_read(values, kv_indices)

    assert _kept(unregistered).reason_code == "not_a_consumer"


def test_the_int_in_arithmetic_keeps_it():
    def arithmetic(fb, values):
        kv_indptr = F.pad(torch.cumsum(fb.seq_lens, 0), (1, 0))
        kv_indices = torch.empty(fb.seq_lens_sum, dtype=torch.int32)
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr)
        return READ(values, kv_indices, kv_indptr, fb.seq_lens) * (fb.seq_lens_sum * 2)

    assert _kept(arithmetic).reason_code == "arithmetic"


def test_a_reader_through_another_indptr_keeps_the_int():
    def clipped(fb, values):
        kv_indptr = F.pad(torch.cumsum(fb.seq_lens, 0), (1, 0))
        kv_indices = torch.empty(fb.seq_lens_sum, dtype=torch.int32)
        KV(kv_indices, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr)
        short = fb.seq_lens.clamp(max=2)
        return READ(values, kv_indices, F.pad(torch.cumsum(short, 0), (1, 0)), short)

    assert _kept(clipped).reason_code in ("indptr_differs", "lengths_differ")


def test_the_option_is_checked_and_named():
    assert SyncfreeOptions.from_dict({"host_sums": {"seq_lens_sum": "seq_lens"}}).rule_option("host_sums") == (
        ("seq_lens_sum", "seq_lens"),)
    with pytest.raises(OptionError, match="host_sums"):
        SyncfreeOptions.from_dict({"host_sums": {"seq_lens_sum": 3}})
    with pytest.raises(OptionError, match="did you mean 'host_sums'"):
        SyncfreeOptions.from_dict({"host_sum": {"seq_lens_sum": "seq_lens"}})


def test_through_the_backend_by_name():
    """`torch.compile(backend="syncfree")` with the option: equal to eager, the buffer static (aot_eager-free: the
    pass-only check above covers the graph; this one covers the option's path through the real backend)."""
    step = compile_pass.compile(decode, max_context_len=MCL, host_sums={"seq_lens_sum": "seq_lens"})
    for n, lengths in enumerate([[3, 9, 5], [4, 9, 5], [7, 0, 2]]):
        torch.testing.assert_close(step(batch(lengths, seed=n), VALUES), decode(batch(lengths, seed=n), VALUES))
    merged = compile_pass.SyncReport.merge(compile_pass.reports(step))
    assert any(i.rule == "host_sums" for i in merged.rewritten), str(merged)
    # Through Inductor too: the declaration is asserted on the device (the int a scalar input of the kernel)
    with pytest.raises(RuntimeError, match="seq_lens_sum is not sum"):
        step(dataclasses.replace(batch([7, 0, 2]), seq_lens_sum=8), VALUES)
    assert merged.post_grad is None or not merged.post_grad["local_scalar_dense"]
