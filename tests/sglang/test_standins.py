"""The CPU stand-ins keep FA3's contract: the right values, and an error where the real kernel would read out of
bounds (a narrow page table, a bad page id, a scheduler_metadata built for another problem)."""

from __future__ import annotations

import pytest
import torch

import harness as H


@pytest.fixture(scope="module")
def fa(sglang_fa3):
    import sgl_kernel.flash_attn as fa

    return fa


def _cache(page_size=4, pages=40, hk=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(pages, page_size, hk, d, generator=g), torch.randn(pages, page_size, hk, d, generator=g))


def _dense(q, k, v, table, lens, page_size):
    """Reference: gather each row's keys through the page table, causal bottom-right, GQA, float."""
    outs = []
    for b in range(q.shape[0]):
        L = int(lens[b])
        pages = table[b, : -(-L // page_size)].long()
        kk = k[pages].reshape(-1, k.shape[2], k.shape[3])[:L].repeat_interleave(q.shape[2] // k.shape[2], 1)
        vv = v[pages].reshape(-1, v.shape[2], v.shape[3])[:L].repeat_interleave(q.shape[2] // k.shape[2], 1)
        sq = q.shape[1]
        s = torch.einsum("qhd,khd->hqk", q[b], kk) * q.shape[-1] ** -0.5
        mask = torch.arange(L)[None, :] <= (torch.arange(sq)[:, None] + L - sq)
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.stack(outs)


def test_fwd_matches_a_dense_reference(fa):
    k, v = _cache()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 4, 8, generator=g)
    table = torch.randperm(40, generator=g)[:30].view(3, 10).to(torch.int32)
    lens = torch.tensor([5, 40, 17], dtype=torch.int32)
    got = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table, causal=True)
    torch.testing.assert_close(got, _dense(q, k, v, table, lens, 4))


def test_fwd_reads_only_the_pages_it_needs(fa):
    k, v = _cache()
    q = torch.randn(1, 1, 4, 8)
    table = torch.tensor([[3, 7, 10**6]], dtype=torch.int32)  # column 2 is past ceil(8 / 4): never read
    fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.tensor([8], dtype=torch.int32), page_table=table)


def test_fwd_raises_on_a_narrow_page_table_or_a_bad_page(fa):
    k, v = _cache()
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(IndexError, match="page table has 2 columns"):
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.tensor([9], dtype=torch.int32),
                                   page_table=torch.tensor([[1, 2]], dtype=torch.int32))
    with pytest.raises(IndexError, match="out of range"):
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.tensor([5], dtype=torch.int32),
                                   page_table=torch.tensor([[1, 40]], dtype=torch.int32))


def _md(fa, lens, max_seqlen_k, page_size=4):
    return fa.get_scheduler_metadata(batch_size=lens.numel(), max_seqlen_q=1, max_seqlen_k=max_seqlen_k, num_heads=4,
                                     num_heads_k=2, headdim=8, cache_seqlens=lens, qkv_dtype=torch.float32,
                                     cu_seqlens_q=torch.arange(lens.numel() + 1, dtype=torch.int32),
                                     page_size=page_size, causal=True)


def test_scheduler_metadata_must_match_the_call(fa):
    k, v = _cache(pages=200)
    q = torch.randn(2, 1, 4, 8)
    lens = torch.tensor([150, 60], dtype=torch.int32)
    table = torch.arange(100, dtype=torch.int32).view(2, 50)  # seqlen_k = 50 * 4 = 200
    ok = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table[:, :38],
                                    scheduler_metadata=_md(fa, lens, 150))  # eager: width ceil(150 / 4)
    torch.testing.assert_close(ok, _dense(q, k, v, table, lens, 4))
    with pytest.raises(RuntimeError, match="stale"):  # a static-width table, metadata planned for the true max
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table,
                                   scheduler_metadata=_md(fa, lens, 150))
    with pytest.raises(IndexError, match="split-KV combine would read out of bounds"):  # planned for more splits
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table[:, :38],
                                   scheduler_metadata=_md(fa, lens, 8192), num_splits=1)
    with pytest.raises(RuntimeError, match="shape"):  # built for another batch
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table[:, :38],
                                   scheduler_metadata=_md(fa, torch.tensor([150] * 5, dtype=torch.int32), 150))


def test_stand_in_ops_carry_the_real_argument_names(sglang_fa3):
    fwd = [a.name for a in torch.ops.sgl_kernel.fwd.default._schema.arguments]
    sched = [a.name for a in torch.ops.sgl_kernel.get_scheduler_metadata.default._schema.arguments]
    assert {"page_table", "seqused_k", "max_seqlen_k", "scheduler_metadata", "out"} <= set(fwd)
    assert sched[:9] == ["batch_size", "max_seqlen_q", "max_seqlen_k", "num_heads", "num_heads_k", "headdim",
                         "headdim_v", "qkv_dtype", "seqused_k"]
    exact = [a.name for a in torch.ops.sgl_kernel_exact.fwd.default._schema.arguments]
    assert exact == fwd


# -- the CUDA implementations (standins/sgl_kernel/cuda_ops.py), run here on CPU tensors ---------------------
def test_cuda_scheduler_metadata_equals_the_cpu_one(fa):
    import random

    from sgl_kernel import cuda_ops, flash_ops

    rng = random.Random(0)
    for _ in range(60):
        b, ps, hk = rng.randint(1, 9), rng.choice([1, 16, 64]), rng.choice([1, 2, 8])
        h = hk * rng.choice([1, 4])
        lens = torch.tensor([rng.randint(0, 5000) for _ in range(b)], dtype=torch.int32)
        args = (b, 1, int(lens.max()) + rng.randint(0, 3000), h, hk, 64, 64, torch.float16, lens, None, None, None,
                None, None, ps)
        splits = rng.choice([0, 0, 1, 4])
        assert torch.equal(flash_ops.get_scheduler_metadata_impl(*args, num_splits=splits),
                           cuda_ops.get_scheduler_metadata_device(*args, num_splits=splits))


def test_cuda_fwd_equals_the_cpu_one_and_asserts_on_the_device(fa):
    from sgl_kernel import cuda_ops, flash_ops

    k, v = _cache(page_size=4, pages=40, hk=2, d=8)
    q = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
    table = torch.randperm(40, generator=torch.Generator().manual_seed(2))[:30].view(3, 10).to(torch.int32)
    lens = torch.tensor([1, 17, 40], dtype=torch.int32)
    cu = torch.arange(4, dtype=torch.int32)

    def md(max_k, lengths=lens):
        return flash_ops.get_scheduler_metadata_impl(3, 1, max_k, 4, 2, 8, 8, torch.float32, lengths, cu, None,
                                                     None, None, None, 4)

    def args(tbl, m):
        return (q, k, v, None, None, None, None, cu, None, None, None, lens, 1, None, tbl, None, None, None, None,
                None, None, None, None, 0.3, True, -1, -1, 0, 0.0, False, m, 0, None, 0, None, None, False)

    want = flash_ops.fwd_impl(*args(table, md(40)))[0]
    got = cuda_ops.fwd_paged_decode(*args(table, md(40)))[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    bad_page = table.masked_fill(table == table[2, 9], 99)
    stale = md(8, torch.tensor([1, 2, 8], dtype=torch.int32))
    for case, match in ((args(table[:, :5], None), "more pages than the page table"),
                        (args(bad_page, None), "out of range"), (args(table, stale), "stale")):
        with pytest.raises(RuntimeError, match=match):  # torch._assert_async: at once on the CPU
            cuda_ops.fwd_paged_decode(*case)
