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
| flashmla_decode_mirror | **rewritten** | the mirror's max gets the range [0, max_context_len] while Dynamo traces (compile_pass.tracing), so `if buf is None or buf.shape[0] < bs or buf.shape[1] < max_seqlen_pad` (flashmla_backend.py:151) is False for every such value once the scratch is the bound's 4 pages wide (the warm-up's, or the one the first compiled call allocates from None: test_sglang_realistic_bounds.py's fresh start); the page count slices the persistent scratch `buf[:bs, :max_seqlen_pad]` (:157), filled by the block-table writer (registered here with compile_pass.register_bounded_writer; its stride is the scratch's own) and read by the FlashMLA kernel by the same lengths (the mirror's device twin): allocated table rule, the slice widened to 4 pages, the stored table at that width (`static_escapes`); one graph per batch size (the static one, then a dynamic one), the host read gone | nothing | `static_escapes=True`, the writer's and the kernel's facts |
| flashmla_draft_extend_mirror | **rewritten** | reaches the pass as decode does; the kernel's lengths are `seq_lens - extend_seq_lens + 4` (:236) against the page count `cdiv(m + 4, 64)`: the relation `x - y + c` (ProofContext.relate_lengths), an upper bound where every `extend_seq_lens >= 0`, which the rewrite asserts on the device, checked or not (every length at most max(seq_lens) + 4); the slice widened to 5 pages | nothing | `static_escapes=True`, the writer's and the kernel's facts |
| flashmla_verify_mirror | **rewritten** | `cdiv(m + 4, 64)` reaches 5 pages within the bound and the warm-up grew the scratch to 4: the grow branch (:151) differs inside the range. Its bound's outcome regrows the scratch (`torch.full((rows, max(n, 4)), -1)`, `max(n, 4)` widened to 5) where the other outcome slices the 4-wide one as it is: one computation but for where the scratch's cells live (trace_signature.regrown_scratch: the same writer and readers over the same rows, the new scratch stored in the old one's place and nothing else), so the bound's outcome's graph runs for every max, with no assertion on the outcome; the scratch is stored 5 wide in the first compiled call | nothing | `static_escapes=True` (the scratch leaves at the static width, a new tensor) |
| flashmla_verify_mirror_bounded | **rewritten** | SGLang's own invariant declared, `length_bounds={"seq_lens": 252, "seq_lens_cpu": 252}` (max_context_len less the 4 draft tokens, whose room the scheduler reserves): `cdiv(m + 4, 64)` is at most 4 pages, so the grow branch (:151) is False for every value and the slice is widened to 4 pages, as decode's; a committed length past 252 raises under `checked` | nothing | declare the bound for the mirror and its twin |
| flashmla_replay_decode_static (one static graph per batch size, as the CUDA-graph runner captures) | **rewritten** | `max_seqlen_pad = cdiv(seq_lens_cpu.max().item(), 64)` (flashmla_backend.py:352) slicing `cuda_graph_kv_indices[:bs, :max_seqlen_pad]` (:427), read as `block_kv_indices[:bs]` (:498): page table -> width 4 (page size 64, from a page-level table), the stored table at the static width (`static_escapes`) | nothing: no host read | `static_escapes=True`, the FlashMLA kernel's facts (as this test registers them) |
| flashmla_replay_decode (automatic dynamic shapes) | kept (`lengths_differ`) on the dynamic graph; its first, static graph is rewritten | the max is over `seq_lens_cpu[:bs]` with `bs` and the mirror's size two symbols | a host read of the mirror per replay on the dynamic graph | `dynamic=False` (one graph per batch size) |
| flashmla_replay_verify_static | **rewritten** | the max is over `seq_lens_cpu[:bs] + 4` (:343), the kernel's lengths `seq_lens.to(int32) + 4`: the same values (constant adds on both sides, the mirror pair): page table -> width 5, bound 260 (max_context_len + 4) | nothing: no host read | as for decode |
| flashmla_replay_verify (automatic dynamic) | kept (`lengths_differ`) on the dynamic graph; the static one rewritten | as for flashmla_replay_decode | a host read per replay on the dynamic graph | `dynamic=False` |
| flashmla_replay_draft_extend_static | **rewritten** (at a batch as large as the CUDA-graph buffers too, bs == max_bs, where the slice `[:bs]` is the whole buffer; test_sglang_realistic_bounds.py) | the copy of the int64 seq_lens into the int32 buffer (:421) narrows: under `checked` its wide source is asserted within the bound (issue 45: a wrapped value would pass a check on the buffer). The kernel reads `cuda_graph_draft_extend_seq_lens_k[:bs]`, a persistent buffer the step has just `copy_`ed seq_lens into (:411): the copy relation (the last copy into the same view of the same buffer, after the max, nothing writing the buffer after it) relates the view to seq_lens[:bs], the mirror's twin: page table -> width 4 | nothing | as for decode |
| flashmla_replay_draft_extend (automatic dynamic) | kept (`lengths_differ`) on the dynamic graph; the static one rewritten | as for flashmla_replay_decode | a host read per replay on the dynamic graph | `dynamic=False` |
| trtllm_mla_{decode,verify,draft_extend} (no mirror: SGLang's default) | nothing | no host read: `max_seq = self.max_context_len` (trtllm_mla_backend.py:836) | nothing | nothing |
| trtllm_mla_{decode,verify}_mirror | verify **rewritten** at this bound; decode a graph break at :355 at this bound (issue 45: at 256 the round-up's two outcomes rewrite to different widths). At realistic bounds (4096 to 131072, pages 32 and 64: test_sglang_realistic_bounds.py) decode is **rewritten** from a fresh backend: both outcomes of `blocks % lcm != 0` give the bound's width, and FlashInfer's block-table check `block_num % (128 / page_size) == 0` (`_check_trtllm_gen_mla_shape`, Python) holds for every max either outcome admits, so it adds no assumption (traced_ranges.implied_outcome); verify breaks at :355 (its bound's outcome `cdiv(m + 4, ps)` is one page past a multiple of the lcm: two widths) unless SGLang's invariant is declared (trtllm_mla_verify_mirror_bounded, `length_bounds` max_context_len - 4: rewritten). Before: | `_calc_padded_blocks` (trtllm_mla_backend.py:340): `if blocks % constraint_lcm != 0` (:355) is traced at the bound's outcome (True; False only at m = 0, asserted on the device), verify's `cdiv(m + 4, 64) >= 1` needs no assumption; the round-up `cdiv(cdiv(m [+ 4], 64), 64) * 64` (Dynamo: `torch.sym_sum([63, m])`) sizes `torch.full((bs, blocks), -1)`, filled by the registered writer with that width as its stride, read by the TRTLLM kernel (`max_seq_len` an upper bound): allocated table rule, width 64 (the round-up of the bound's 4 pages), `max_seq_len` 256 (verify 264), the stored table and `max_seq_len_k` at the static values (`static_escapes`); one graph per batch size | nothing | `static_escapes=True`, the writer's and the kernel's facts |
| trtllm_mla_draft_extend_mirror_static (one graph per batch size) | graph break at :355 (issue 45: the slack exists only where the branch rounds up; the other outcome keeps the max). Before: | the kernel's lengths are `seq_lens - extend_seq_lens + max(extend_seq_lens_cpu)` (:862, 4 here), up to the max + 3 with ragged extends, while the table is sized by the unpadded max (`_calc_padded_blocks(max_seq)`): the relation `x - y + k` (its premise asserted on the device) within the round-up's slack, which the allocated-table rule credits: the least the rounded table covers past the max over every value the max can take, the max + 3840 for m in [1, 256] (m = 0 fails the branch traced at :355 and is asserted away); `max_seq_len` (:1589/:1596, the max + 4) an upper bound | nothing | `static_escapes=True`, the writer's and the kernel's facts, `dynamic=False` |
| trtllm_mla_draft_extend_mirror (automatic dynamic) | graph_break | a break at :355 from the first graph on (as the static path: its round-up slack exists only where the branch rounds up); on the dynamic graph `max_seq_len = max_seq_len_k + total_tokens // bs` (:1589) adds a size expression to the max, not a constant (kept, `arithmetic`), so that frame is traced again without the bound's outcome and Dynamo breaks at :355 | a host read, a break per step after the first batch size | `dynamic=False` |

The allocated-table rule takes the eager mirror paths above: FlashMLA's grown scratch (a slice of a persistent
buffer) and TRTLLM-MLA's round-up page count, both stored on the backend (`static_escapes`). The writer here is
the stand-in op of create_flashmla_kv_indices_triton, registered as an op writer. On a GPU, SGLang launches the
Triton kernel itself on a 2-D grid `(bs, get_num_kv_index_blocks_flashmla(width, 64))` with
`kv_indices_ptr_stride: tl.constexpr` (kv_indices.py:201): the grid is covered by `pages_per_program` (its
programs past a row's pages write nothing, kv_indices.py:228), and FlashMLA's constexpr stride is the scratch's
own, a constant; TRTLLM-MLA's is the dynamic width itself, which Dynamo cannot specialise (a Dynamo limit).

Compile paths: passlib.TracedPassOnly (the pass on Dynamo's graph, then the graph as captured: aot_eager-style) for
all but flashmla_replay_decode_static and trtllm_mla_verify, which go through compile_pass.compile (Inductor).
"""

from __future__ import annotations

import pytest
import torch

import harness_backends as B

SE = {"static_escapes": True}
P = B.Path


# SGLang reserves the draft tokens' room in the token table: a verify's committed lengths are at most
# max_context_len - num_draft_tokens. Declared for the mirror and its device twin (the range while Dynamo traces
# is looked up by the mirror's name, the rule's bound by either; checked=True asserts it on the device).
VERIFY_BOUNDS = {"seq_lens": 256 - 4, "seq_lens_cpu": 256 - 4}


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
    _mla("trtllm_mla", "draft_extend", mirror=True, dynamic=False),  # one graph per batch size
    # verify with SGLang's own invariant declared: the committed lengths leave room for the draft tokens
    P("flashmla_verify_mirror_bounded", "flashmla", "target_verify", draft_tokens=4, mirror=True,
      options={**SE, "length_bounds": VERIFY_BOUNDS}),
    P("trtllm_mla_verify_mirror_bounded", "trtllm_mla", "target_verify", draft_tokens=4, mirror=True,
      options={**SE, "length_bounds": VERIFY_BOUNDS}),
]}

TRTLLM_BRANCH = "trtllm_mla_backend.py:355: Consider annotating your code using torch._check*(). Could not guard on " \
                "data-dependent expression"
EXPECTED = {
    "flashmla_decode": ("nothing", None),
    "flashmla_verify": ("nothing", None),
    "flashmla_draft_extend": ("nothing", None),
    # the backend gives the mirror's max its range [0, max_context_len] while Dynamo traces: the grow-on-demand
    # branch (flashmla_backend.py:151) is False for every such value and no longer breaks; the page count slices
    # the persistent scratch `buf[:bs, :n]` (4 wide after the warm-up), filled by the registered block-table
    # writer and read by the FlashMLA kernel: the slice gets the bound's 4 pages (allocated-table rule, its
    # persistent-scratch form), and the stored table leaves at that width (static_escapes)
    "flashmla_decode_mirror": ("rewritten", "sliced table -> width 4 (page_size 64)"),
    # verify sizes by cdiv(m + 4, 64): up to 5 pages within the bound, and the scratch the eager warm-up grew is 4
    # wide, so the grow branch differs inside the range: the bound's outcome regrows the scratch (`max(n, 4)`
    # widened to 5) that the other outcome slices as it is, one computation but for where the scratch lives
    # (trace_signature.regrown_scratch, static_escapes): the bound's outcome's graph for every max, the scratch
    # stored 5 wide in the first compiled call
    "flashmla_verify_mirror": ("rewritten", "regrown width max(n, 4) is 5 within the bound"),
    # the same with SGLang's invariant declared (length_bounds 252 for seq_lens and seq_lens_cpu): cdiv(m + 4, 64)
    # is at most 4 pages, the grow branch False for every value, the slice widened to 4 pages
    "flashmla_verify_mirror_bounded": ("rewritten", "sliced table -> width 4 (page_size 64)"),
    # the kernel's lengths are `seq_lens - extend_seq_lens + 4` (:236), the page count cdiv(m + 4, 64): x - y + c,
    # an upper bound where extend_seq_lens >= 0, asserted on the device (checked or not); the slice widened to 5
    "flashmla_draft_extend_mirror": ("rewritten", "sliced table -> width 5 (page_size 64)"),
    # automatic dynamic: the first batch size's static graph is rewritten, the dynamic graph after it is kept (the
    # max is over seq_lens_cpu[:bs], and bs and the mirror's size are two symbols: not provably the same rows)
    "flashmla_replay_decode": ("kept", "lengths_differ"),
    "flashmla_replay_verify": ("kept", "lengths_differ"),
    "flashmla_replay_draft_extend": ("kept", "lengths_differ"),
    # one static graph per batch size: decode rewritten (through Inductor); verify too (the max over
    # seq_lens_cpu[:bs] + 4, the kernel's lengths seq_lens.to(int32) + 4: the same values); draft extend too: its
    # kernel reads `cuda_graph_draft_extend_seq_lens_k[:bs]`, which the step has just `copy_`ed seq_lens into (:411),
    # nothing writing it after (the copy relation)
    "flashmla_replay_decode_static": ("rewritten", None),
    "flashmla_replay_verify_static": ("rewritten", "page table -> syncfree.page_table width 5"),
    # (the copy narrows SGLang's int64 lengths into the int32 buffer: under checked its wide source is asserted
    # within the bound, issue 45)
    "flashmla_replay_draft_extend_static": ("rewritten", "page table -> syncfree.page_table width 4"),
    "trtllm_mla_decode": ("nothing", None),
    "trtllm_mla_verify": ("nothing", None),
    "trtllm_mla_draft_extend": ("nothing", None),
    # traced at the bound's outcome of `blocks % lcm != 0` (True but at m = 0; asserted on the device): the round-up
    # count `cdiv(cdiv(m, 64), 64) * 64` sizes `torch.full((bs, n), -1)` filled by the registered writer with the
    # width as its row stride: rewritten to the round-up at the bound (64), the max_seq_len bound 256, the
    # stored table and max_seq_len_k at the static values (static_escapes)
    # issue 45: at this bound (256, not a multiple of 4096) the branch's two outcomes rewrite to different widths
    # (64 rounded, 4 at m = 0), so the frame is traced with the range only and the branch breaks the graph
    # (tests/relations/test_branch_outcomes.py: rewritten at bounds that are multiples of 4096)
    "trtllm_mla_decode_mirror": ("graph_break", ("trtllm_mla_backend.py:355",)),
    # verify pads cdiv(m + 4, 64) >= 1 block: `blocks % lcm != 0` holds for every value, one graph; rewritten too
    "trtllm_mla_verify_mirror": ("rewritten", "allocated table -> width 64 (page_size 64, rounded up)"),
    # the same with SGLang's invariant declared: at this bound as above; at a realistic bound (a multiple of 4096:
    # test_sglang_realistic_bounds.py) the undeclared verify's bound's outcome is one page past a multiple of the
    # lcm (two outcomes of two widths: a break at :355), the declared one's is on it (one graph: rewritten)
    "trtllm_mla_verify_mirror_bounded": ("rewritten", "allocated table -> width 64 (page_size 64, rounded up)"),
    # the kernel's lengths are `seq_lens - extend_seq_lens + max(extend_seq_lens_cpu)` (:862), up to the max + 3
    # with ragged extends, the table sized by the max alone: the round-up covers the max + 3840 for every m in
    # [1, 256] (m = 0 asserted away with the traced branch), which the rule credits; `max_seq_len` is the max + 4
    "trtllm_mla_draft_extend_mirror_static": ("graph_break", ("trtllm_mla_backend.py:355",)),
    # automatic dynamic: a break at :355 from the first graph on, as the static path; on the dynamic graph the kernel's
    # `max_seq_len = max_seq_len_k + total_tokens // bs` (:1589) adds a size expression to the max, not a
    # constant (kept, `arithmetic`), so that frame is traced again without the bound's outcome: the break
    "trtllm_mla_draft_extend_mirror": ("graph_break", (TRTLLM_BRANCH,)),
}
NEEDS_RULE: dict = {}

CONSUMERS = (
    ("flash_mla_standin::fwd_kvcache_mla",
     dict(page_table="block_table", lengths="cache_seqlens", page_size_of=("k_cache", 1))),
    ("flashinfer_standin::trtllm_batch_decode_mla",
     dict(page_table="block_tables", lengths="seq_lens", upper_bounds=("max_seq_len",), page_size_of=("kv_cache", 2))),
)
# The block-table writer both backends launch (create_flashmla_kv_indices_triton, through its stand-in op): row b's
# first cdiv(page_kernel_lens[b], paged_size) columns of kv_indices, addressed through kv_indices_stride, nothing
# else. Registered as a user would, through compile_pass.register_bounded_writer.
WRITERS = (
    ("sglang_standin::create_flashmla_kv_indices",
     dict(table="kv_indices", lengths="page_kernel_lens", page_size="paged_size", req_pool_indices="req_pool_indices",
          req_to_token="req_to_token", table_stride="kv_indices_stride")),
)


@pytest.fixture(scope="module")
def mla_backends(sglang_fa3):
    B.setup()
    import compile_pass

    for op, facts in CONSUMERS:
        compile_pass.register_self_guarding_consumer(op, **facts)
    for op, facts in WRITERS:
        compile_pass.register_bounded_writer(op, **facts)
    yield
    for op, _ in CONSUMERS:
        compile_pass.unregister_self_guarding_consumer(op)
    for op, _ in WRITERS:
        compile_pass.unregister_bounded_writer(op)


outcome = B.Outcomes(PATHS, EXPECTED, vectors={"trtllm_mla_draft_extend_mirror": 2})
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
    graph per batch size (two length vectors, two batch sizes), and the max reaches the pass: decode and draft
    extend rewritten (the host read gone from both graphs)."""
    for name in ("flashmla_decode_mirror", "flashmla_draft_extend_mirror"):
        result = outcome(name)
        assert result.graph_breaks == [] and result.graphs == 2, B.shown(result)
        assert all(not r.kept and len(r.rewritten) == 1 and r.rewritten[0].location == "flashmla_backend.py:164"
                   for r in result.reports), B.shown(result)


def _past_the_bound(name, device_too):
    """The path compiled after an eager warm-up at the bound (the scratch grown to the bound's width), one step run,
    then a step whose mirror (and, with `device_too`, its device twin) lies past max_context_len."""
    import dataclasses

    torch._dynamo.reset()
    path = dataclasses.replace(PATHS[name])
    engine = B.Engine(path)
    top = B.MAX_CONTEXT - (path.draft_tokens if path.mode == "target_verify" else 0)  # verify: room for the drafts
    engine.step(*engine.make_batch([top, 7]))  # eager: the scratch table grows to the bound's width
    step, reports = B.compile_step(path, engine.step)
    fb, hidden = engine.make_batch([100, 7], seed=0)
    step(fb, hidden)
    fb, hidden = engine.make_batch([100, 7], seed=1)
    fb.seq_lens_cpu = fb.seq_lens_cpu + B.MAX_CONTEXT  # the mirror past the bound
    if device_too:
        fb.seq_lens = fb.seq_lens + B.MAX_CONTEXT
    return step, fb, hidden, reports


@pytest.mark.parametrize("name", ["flashmla_decode_mirror", "flashmla_draft_extend_mirror",
                                  "flashmla_verify_mirror_bounded"])
def test_a_rewritten_mirror_max_past_the_bound_raises(mla_backends, name):
    """Where the pass rewrote the mirror's max, the host read is gone: checked=True asserts on the device that every
    length (the mirror's device twin) lies within the bound that replaced the max, before the writer reads them."""
    step, fb, hidden, reports = _past_the_bound(name, device_too=True)
    assert all(r.rewritten and not r.kept for r in reports()), "\n".join(map(str, reports()))
    with pytest.raises(RuntimeError, match="exceeds the static bound that replaced its max"):
        step(fb, hidden)


def test_the_draft_extends_premise_is_asserted_with_checked_off(mla_backends):
    """FlashMLA's draft extend is rewritten on the premise that extend_seq_lens >= 0 (its lengths
    `seq_lens - extend_seq_lens + 4` are then at most the max + 4): the premise is the proof's, asserted on the
    device with checked=False too. A negative extend length raises instead of running on lengths the proof does
    not cover (here past the max + 4)."""
    import dataclasses

    torch._dynamo.reset()
    path = dataclasses.replace(PATHS["flashmla_draft_extend_mirror"], options={**SE, "checked": False})
    engine = B.Engine(path)
    engine.step(*engine.make_batch([B.MAX_CONTEXT, 7]))  # eager: the scratch table grows to the bound's width
    step, reports = B.compile_step(path, engine.step)
    fb, hidden = engine.make_batch([100, 7], seed=0)
    step(fb, hidden)
    assert all(r.rewritten and not r.kept for r in reports()), "\n".join(map(str, reports()))
    fb, hidden = engine.make_batch([100, 7], seed=1)
    fb.extend_seq_lens = fb.extend_seq_lens - torch.tensor([0, 100], dtype=torch.int32)  # row 1 reads 7 + 100
    with pytest.raises(RuntimeError, match="a value they subtract is negative"):
        step(fb, hidden)


@pytest.mark.parametrize("name", ["flashmla_decode_mirror", "flashmla_draft_extend_mirror",
                                  "trtllm_mla_verify_mirror", "flashmla_verify_mirror_bounded", "flashmla_verify_mirror"])
def test_a_rewritten_mirror_path_equals_eager_over_many_lengths(mla_backends, name):
    """The rewritten mirror paths over 8 random length vectors and 4 batch sizes (3, 2, 4, 1: a static graph, then
    a dynamic one): every step equal to eager (run_path compares each), the host read gone from every graph."""
    torch._dynamo.reset()
    result = B.run_path(PATHS[name], vectors=8)
    assert len(result.errors) == 8 and max(result.errors) <= 1e-5
    assert result.graph_breaks == [] and result.reports and all(
        r.rewritten and not r.kept and r.syncs_remaining == 0 for r in result.reports), B.shown(result)


def test_trtllm_draft_extend_with_ragged_extends_equals_eager(mla_backends):
    """TRTLLM-MLA's draft extend with per-row extend lengths in [1, 4], one graph per batch size: a row's kernel
    length `seq_len - extend + max(extend_seq_lens_cpu)` exceeds the mirror's max by up to 3, inside the
    round-up's slack. Every graph rewritten, every step equal to eager (eager's table is the round-up at the
    step's max; the stand-in writer raises where a row would need more columns than the table has). The maxima
    stay 3 under the bound: the token table's rows are max_context_len wide, and eager reads past them beyond."""
    import dataclasses
    import random

    torch._dynamo.reset()
    path = dataclasses.replace(PATHS["trtllm_mla_draft_extend_mirror_static"], ragged=True)
    engine = B.Engine(path)
    step, reports = B.compile_step(path, engine.step)
    rng = random.Random(5)
    top = B.MAX_CONTEXT - 3
    vectors = [[top, 9, 130], [200, 4], [64, 65, 63, 250], [top, top - 1, 5], [128]]
    vectors.append([rng.randint(4, top) for _ in range(3)])
    # (Not here: extends whose sum divides by the batch size but differ, e.g. [1, 3]. SGLang then views q
    # directly and passes `max_seq_len = max_seq_len_k + total_tokens // bs` (:1589), the max + 2, below what the
    # lengths may reach, the max + 3: kept, `lengths_exceed`, and traced again: the break at :355.)
    for n, lengths in enumerate(vectors):
        want = engine.step(*engine.make_batch(lengths, seed=n))
        got = step(*engine.make_batch(lengths, seed=n))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    graph_reports = reports()
    # issue 45: at this bound (256) the round-up's two outcomes differ, so the branch at :355 breaks the graph and
    # nothing is rewritten there; every step above still equals eager, and none raises on a valid length
    assert graph_reports and not any(r.rewritten for r in graph_reports), "\n".join(map(str, graph_reports))


def test_the_declared_verify_bound_is_what_the_device_asserts(mla_backends):
    """flashmla_verify_mirror_bounded: a committed length of 253, past the declared 252 but within
    max_context_len, raises under checked=True (the bound the rewrite rests on, not max_context_len, is
    asserted); 252 runs and equals eager."""
    import dataclasses

    torch._dynamo.reset()
    path = dataclasses.replace(PATHS["flashmla_verify_mirror_bounded"])
    engine = B.Engine(path)
    step, reports = B.compile_step(path, engine.step)
    want = engine.step(*engine.make_batch([252, 7], seed=0))
    torch.testing.assert_close(step(*engine.make_batch([252, 7], seed=0)), want, rtol=1e-5, atol=1e-5)
    assert all(r.rewritten and not r.kept for r in reports()), "\n".join(map(str, reports()))
    fb, hidden = engine.make_batch([100, 7], seed=1)
    fb.seq_lens_cpu = fb.seq_lens_cpu + 153
    fb.seq_lens = fb.seq_lens + 153
    with pytest.raises(RuntimeError, match="exceeds the static bound that replaced its max"):
        step(fb, hidden)
