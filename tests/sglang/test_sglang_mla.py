"""SGLang 0.5.23's FlashMLABackend and TRTLLMMLABackend (the PyPI wheel, unmodified) compiled through the syncfree
pass on CPU: the eager decode, target-verify and draft-extend paths (`init_forward_metadata`), and FlashMLA's
CUDA-graph replay metadata (`init_forward_metadata_out_graph`, what runs before every replay).

The kernels are CPU stand-ins with their contracts (standins/flash_mla, standins/flashinfer_mla.py,
standins/sglang_triton_ops.py: the block-table writer). Their facts are registered here, as a user would, through
compile_pass.register_self_guarding_consumer: FlashMLA's decode reads cdiv(cache_seqlens[b], 64) blocks of row b,
TRTLLM-MLA's reads cdiv(seq_lens[b], page) pages and takes max_seq_len as an upper bound.

Both backends size their block table with a host max only where a CPU mirror is published
(`seq_lens_cpu.max().item()`, flashmla_backend.py:164 / :352, trtllm_mla_backend.py:834); otherwise they use the
static bound `max_context_len` themselves. Their SGLang default is no mirror (`needs_cpu_seq_lens = False`).

| path | status | reason | what it costs a user | what they can do |
|---|---|---|---|---|
| flashmla_{decode,verify,draft_extend} (no mirror: SGLang's default) | nothing | no host read: `eager_max_k = self.max_context_len` (flashmla_backend.py:166) | nothing: one graph per shape | nothing |
| flashmla_{decode,draft_extend}_mirror | kept (`not_a_consumer`) | traced as one graph: the mirror's max gets the range [0, max_context_len] while Dynamo traces (compile_pass.tracing), so `if buf is None or buf.shape[0] < bs or buf.shape[1] < max_seqlen_pad` (flashmla_backend.py:151) is False for every such value; the page count then slices the persistent scratch `buf[:bs, :max_seqlen_pad]` (:157), which the page-table rule reads as a page-level table reaching the writer, and the allocated-table rule has no grow-on-demand form yet | a host read of the mirror (no device sync), one graph per batch size | do not publish seq_lens_cpu for FlashMLA (its default) |
| flashmla_verify_mirror | graph_break | `cdiv(m + 4, 64)` reaches 5 pages within the bound and the warm-up grew the scratch to 4: the grow branch (:151) differs inside the range; traced at the bound, kept (the grown scratch is stored on the backend), traced again without | a host read, a break per step | do not publish the mirror |
| flashmla_replay_decode_static (one static graph per batch size, as the CUDA-graph runner captures) | **rewritten** | `max_seqlen_pad = cdiv(seq_lens_cpu.max().item(), 64)` (flashmla_backend.py:352) slicing `cuda_graph_kv_indices[:bs, :max_seqlen_pad]` (:427), read as `block_kv_indices[:bs]` (:498): page table -> width 4 (page size 64, from a page-level table), the stored table at the static width (`static_escapes`) | nothing: no host read | `static_escapes=True`, the FlashMLA kernel's facts (as this test registers them) |
| flashmla_replay_decode (automatic dynamic shapes) | kept (`lengths_differ`) on the dynamic graph; its first, static graph is rewritten | the max is over `seq_lens_cpu[:bs]` with `bs` and the mirror's size two symbols | a host read of the mirror per replay on the dynamic graph | `dynamic=False` (one graph per batch size) |
| flashmla_replay_{verify,draft_extend}, static or not | kept (`lengths_differ`) | the max is over `seq_lens_cpu[:bs] + 4` (:343) and the kernel's lengths are `seq_lens.to(int32)`: not related by the rule | a host read of the mirror per replay | (a rule gap) |
| trtllm_mla_{decode,verify,draft_extend} (no mirror: SGLang's default) | nothing | no host read: `max_seq = self.max_context_len` (trtllm_mla_backend.py:836) | nothing | nothing |
| trtllm_mla_{decode,draft_extend}_mirror | graph_break | `if blocks % constraint_lcm != 0` (trtllm_mla_backend.py:355, False only at m = 0): traced at the bound's outcome, the pass keeps the max (a round-up page count the allocated-table rule does not take), so the frame is traced again without the assumption and Dynamo breaks there | a host read, a graph break per step | do not publish seq_lens_cpu (its default) |
| trtllm_mla_verify_mirror | kept (`page_count`) | `cdiv(m + 4, 64) >= 1`: the branch holds for every value in the range, one graph; the padded page count reaches arithmetic the rule does not take | a host read of the mirror | (the allocated-table rule, issue 30 item 2) |

No path here reaches the allocated_table rule: where a max sizes the table (mirror published), SGLang branches on
it first (the two lines above), stores the table on the backend (flashmla_backend.py:155 and the metadata;
trtllm_mla_backend.py:902, `forward_batch.decode_trtllm_mla_metadata`), and launches
create_flashmla_kv_indices_triton with `kv_indices_ptr_stride: tl.constexpr` (kv_indices.py:201) on a grid
whose second axis is the width's block count (flashmla_backend.py:178, trtllm_mla_backend.py:462); the rule
needs a non-constexpr stride and a (rows, 1, 1) grid, and it keeps a table that escapes.

Compile paths: PassOnly (the pass on Dynamo's graph, then the graph as captured: aot_eager-style) for all but
flashmla_replay_decode_static and trtllm_mla_verify, which go through compile_pass.compile (Inductor).
"""

from __future__ import annotations

import pytest
import torch

import harness_backends as B

SE = {"static_escapes": True}
P = B.Path


def _mla(backend, mode, mirror=False, replay=False, inductor=False, dynamic=None):
    name = f"{backend}_{'replay_' if replay else ''}{mode if mode != 'target_verify' else 'verify'}" \
           f"{'_mirror' if mirror and not replay else ''}{'_static' if dynamic is False else ''}"
    return P(name, backend, mode, draft_tokens=0 if mode == "decode" else 4, mirror=mirror or replay,
             replay=replay, options=SE, inductor=inductor, dynamic=dynamic)


MODES = ("decode", "target_verify", "draft_extend")
PATHS = {p.name: p for p in [
    *[_mla("flashmla", m) for m in MODES],
    *[_mla("flashmla", m, mirror=True) for m in MODES],  # the three reach the same line (flashmla_backend.py:151)
    *[_mla("flashmla", m, replay=True) for m in MODES],
    # one static graph per batch size, as SGLang's CUDA-graph runner replays one captured graph per batch size
    *[_mla("flashmla", m, replay=True, inductor=m == "decode", dynamic=False) for m in MODES],
    *[_mla("trtllm_mla", m, inductor=m == "target_verify") for m in MODES],
    *[_mla("trtllm_mla", m, mirror=True) for m in MODES],  # the same line (trtllm_mla_backend.py:355)
]}

FLASHMLA_BRANCH = "flashmla_backend.py:151: Consider annotating your code using torch._check*(). Could not guard on " \
                  "data-dependent expression"
TRTLLM_BRANCH = "trtllm_mla_backend.py:355: Consider annotating your code using torch._check*(). Could not guard on " \
                "data-dependent expression"
EXPECTED = {
    "flashmla_decode": ("nothing", None),
    "flashmla_verify": ("nothing", None),
    "flashmla_draft_extend": ("nothing", None),
    # the backend gives the mirror's max its range [0, max_context_len] while Dynamo traces: the grow-on-demand
    # branch (flashmla_backend.py:151) is False for every such value and no longer breaks; the pass then keeps the
    # max, since the page count slices a persistent scratch table filled by the writer (not a consumer): the
    # allocated-table rule's grow-on-demand form (issue 30, item 2) is not there yet
    "flashmla_decode_mirror": ("kept", "not_a_consumer"),
    # verify sizes by cdiv(m + 4, 64): up to 5 pages within the bound, and the scratch the eager warm-up grew is 4
    # wide, so the grow branch differs inside the range: traced at the bound (grown), kept (the grown scratch is
    # stored on the backend), traced again without: the break
    "flashmla_verify_mirror": ("graph_break", (FLASHMLA_BRANCH,)),
    "flashmla_draft_extend_mirror": ("kept", "not_a_consumer"),
    # automatic dynamic: the first batch size's static graph is rewritten, the dynamic graph after it is kept (the
    # max is over seq_lens_cpu[:bs], and bs and the mirror's size are two symbols: not provably the same rows)
    "flashmla_replay_decode": ("kept", "lengths_differ"),
    "flashmla_replay_verify": ("kept", "lengths_differ"),
    "flashmla_replay_draft_extend": ("kept", "lengths_differ"),
    # one static graph per batch size: decode rewritten (through Inductor); verify and draft extend keep the max
    # (the max is over seq_lens_cpu[:bs] + 4, the kernel's lengths seq_lens.to(int32): not related)
    "flashmla_replay_decode_static": ("rewritten", None),
    "flashmla_replay_verify_static": ("kept", "lengths_differ"),
    "flashmla_replay_draft_extend_static": ("kept", "lengths_differ"),
    "trtllm_mla_decode": ("nothing", None),
    "trtllm_mla_verify": ("nothing", None),
    "trtllm_mla_draft_extend": ("nothing", None),
    # traced at the bound's outcome of `blocks % lcm != 0`, kept by the pass (a round-up page count the
    # allocated-table rule does not take), traced again without the assumption: the break, as before
    "trtllm_mla_decode_mirror": ("graph_break", (TRTLLM_BRANCH,)),
    # verify pads cdiv(m + 4, 64) >= 1 block: `blocks % lcm != 0` holds for every value, one graph; kept (page_count)
    "trtllm_mla_verify_mirror": ("kept", "page_count"),
    "trtllm_mla_draft_extend_mirror": ("graph_break", (TRTLLM_BRANCH,)),
}
NEEDS_RULE: dict = {}

CONSUMERS = (
    ("flash_mla_standin::fwd_kvcache_mla",
     dict(page_table="block_table", lengths="cache_seqlens", page_size_of=("k_cache", 1))),
    ("flashinfer_standin::trtllm_batch_decode_mla",
     dict(page_table="block_tables", lengths="seq_lens", upper_bounds=("max_seq_len",), page_size_of=("kv_cache", 2))),
)


@pytest.fixture(scope="module")
def mla_backends(sglang_fa3):
    B.setup()
    import compile_pass

    for op, facts in CONSUMERS:
        compile_pass.register_self_guarding_consumer(op, **facts)
    yield
    for op, _ in CONSUMERS:
        compile_pass.unregister_self_guarding_consumer(op)


outcome = B.Outcomes(PATHS, EXPECTED)
vectors_for = outcome.vectors


@pytest.mark.parametrize("name", sorted(PATHS))
def test_equal_to_eager(mla_backends, name):
    result = outcome(name)
    assert len(result.errors) == vectors_for(name) and max(result.errors) <= 1e-5


@pytest.mark.parametrize("name", sorted(PATHS))
def test_report(mla_backends, name):
    result = outcome(name)
    status, detail = EXPECTED[name]
    if name in NEEDS_RULE:
        if result.status == status:
            pytest.fail(f"{name} is {status} now: remove it from NEEDS_RULE\n{B.shown(result)}")
        pytest.xfail(NEEDS_RULE[name])
    B.check_status(result, status, detail)


def test_the_replay_path_reads_the_mirror_on_the_host(mla_backends):
    """The replay metadata keeps `seq_lens_cpu.max().item()` (flashmla_backend.py:352): a host read of the mirror,
    no device sync, reported as kept with the line."""
    result = outcome("flashmla_replay_decode")
    kept = [i for r in result.reports for i in r.kept]
    assert kept and all(i.location == "flashmla_backend.py:352" for i in kept), B.shown(result)


# -- the stand-ins keep the kernels' contracts ------------------------------------------------------------------
def _mla_cache(blocks=12, page=64, d=48, seed=0):
    return torch.randn(blocks, page, 1, d, generator=torch.Generator().manual_seed(seed))


def _reference(q, cache, table, lens, dv, scale):
    out = []
    for b in range(q.shape[0]):
        L = int(lens[b])
        keys = cache[table[b, :-(-L // cache.shape[1])].long()].reshape(-1, cache.shape[-1])[:L]
        s = torch.einsum("qhd,kd->hqk", q[b], keys) * scale
        pos = torch.arange(q.shape[1])[:, None] + L - q.shape[1]
        s = s.masked_fill(torch.arange(L)[None, :] > pos, float("-inf"))
        out.append(torch.einsum("hqk,kd->qhd", s.softmax(-1), keys[:, :dv]))
    return torch.stack(out)


def test_flash_mla_stand_in(mla_backends):
    import flash_mla

    cache = _mla_cache()
    q = torch.randn(2, 2, 4, 48, generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([70, 130], dtype=torch.int32)
    table = torch.tensor([[3, 5, -1], [7, 1, 9]], dtype=torch.int32)  # row 0 reads 2 blocks: column 2 unread
    md, splits = flash_mla.get_mla_decoding_metadata(lens, 8, 1)
    meta = flash_mla.FlashMLASchedMeta(tile_scheduler_metadata=md, num_splits=splits)
    out, _ = flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 32, meta, softmax_scale=0.2, causal=True)
    torch.testing.assert_close(out, _reference(q, cache, table, lens, 32, 0.2))
    with pytest.raises(IndexError, match="block table has 2 columns"):
        flash_mla.flash_mla_with_kvcache(q, cache, table[:, :2], lens, 32, meta, causal=True)
    with pytest.raises(IndexError, match="outside"):
        flash_mla.flash_mla_with_kvcache(q, cache, table.masked_fill(table == 9, 12), lens, 32, meta, causal=True)
    md_stale, splits_stale = flash_mla.get_mla_decoding_metadata(lens - 69, 8, 1)  # planned for other lengths
    stale = flash_mla.FlashMLASchedMeta(tile_scheduler_metadata=md_stale, num_splits=splits_stale)
    with pytest.raises(RuntimeError, match="not computed for these cache_seqlens"):
        flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 32, stale, causal=True)


def test_trtllm_mla_stand_in(mla_backends):
    import flashinfer_mla as fi

    cache = _mla_cache().transpose(1, 2)  # [pages, 1, page, D], as SGLang's paged_row_view(...).unsqueeze(1)
    q = torch.randn(2, 1, 4, 48, generator=torch.Generator().manual_seed(2))
    lens = torch.tensor([5, 128], dtype=torch.int32)
    table = torch.tensor([[2, -1], [4, 6]], dtype=torch.int32)
    decode = fi.flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla
    kw = dict(workspace_buffer=None, qk_nope_head_dim=16, kv_lora_rank=32, qk_rope_head_dim=16, bmm1_scale=0.3)
    wide = torch.cat([table, torch.full((2, 2), 99, dtype=torch.int32)], 1)  # 128 / 64 = 2: widths 2, 4, ...
    with pytest.raises(IndexError, match="the block table has 2 columns"):
        decode(q, cache, block_tables=table, seq_lens=lens + torch.tensor([0, 64], dtype=torch.int32),
               max_seq_len=256, **kw)
    out = decode(q, cache, block_tables=wide, seq_lens=lens, max_seq_len=4096, **kw)
    torch.testing.assert_close(out, decode(q, cache, block_tables=table, seq_lens=lens, max_seq_len=128, **kw))
    torch.testing.assert_close(out, _reference(q, cache[:, 0], table, lens, 32, 0.3))
    with pytest.raises(ValueError, match="multiple of 128 / block_size"):
        decode(q, cache, block_tables=wide[:, :3], seq_lens=lens, max_seq_len=4096, **kw)


def test_block_table_writer_stand_in(mla_backends):
    import sglang_triton_ops as ops

    r2t = torch.arange(3 * 256, dtype=torch.int32).view(3, 256)
    buf = torch.full((4, 5), -1, dtype=torch.int32)
    table = buf[:2, :3]  # a slice of a persistent buffer, written through its row stride
    ops.create_flashmla_kv_indices_triton[(2, 1)](r2t, torch.tensor([2, 0]), torch.tensor([130, 64]), None, table,
                                                   r2t.stride(0), table.stride(0))
    assert buf[:2].tolist() == [[8, 9, 10, -1, -1], [0, -1, -1, -1, -1]] and (buf[2:] == -1).all()
    narrow = torch.full((2, 3), -1, dtype=torch.int32)
    with pytest.raises(IndexError, match="row stride is 3"):  # 256 tokens need 4 columns
        ops.create_flashmla_kv_indices_triton[(2, 1)](r2t, torch.tensor([2, 0]), torch.tensor([256, 64]), None,
                                                       narrow, r2t.stride(0), narrow.stride(0))


def test_the_grow_on_demand_branch_no_longer_breaks_the_graph(mla_backends):
    """Issue 30: with the range given while Dynamo traces, FlashMLA's eager metadata with the mirror published is one
    graph per batch size (two length vectors, two batch sizes), and the max reaches the pass (decode, and draft
    extend, whose warm-up grew the scratch to the bound's width)."""
    for mode in ("decode", "draft_extend"):
        result = outcome(f"flashmla_{mode}_mirror")
        assert result.graph_breaks == [] and result.graphs == 2, B.shown(result)
        kept = [i for r in result.reports for i in r.kept]
        assert kept and all(i.location == "flashmla_backend.py:164" and not i.host_sync for i in kept), \
            B.shown(result)


def test_a_kept_mirror_max_past_the_bound_raises(mla_backends):
    """The range the max was traced with is checked again on the host where the pass keeps the max: a length past
    max_context_len raises instead of running a graph traced for lengths within it."""
    import dataclasses

    torch._dynamo.reset()
    path = dataclasses.replace(PATHS["flashmla_decode_mirror"])
    engine = B.Engine(path)
    engine.step(*engine.make_batch([B.MAX_CONTEXT, 7]))  # eager: the scratch table grows to the bound's width
    step, _ = B.compile_step(path, engine.step)
    fb, hidden = engine.make_batch([100, 7], seed=0)
    step(fb, hidden)
    fb, hidden = engine.make_batch([100, 7], seed=1)
    fb.seq_lens_cpu = fb.seq_lens_cpu + B.MAX_CONTEXT  # the mirror past the bound (only the host read sees it)
    with pytest.raises(RuntimeError, match="exceeds max_context_len=256"):
        step(fb, hidden)
