"""Issue 20's engine recipes on a GPU: each step compiled with `cudagraphs=True` and shown sync-free.

Steps (small shapes, fp32, max_context_len 4096 unless --max-context-len; the regional model's own is 256):
  mla       FlashMLA's shape: n = cdiv(seq_lens.max().item(), 64); table = torch.full((bs, n), -1); the bounded
            Triton writer kernels/flashmla_kv_indices.py fills each row; syncfree::paged_decode reads by lengths
            (pages of 64 keys). Rule allocated_table.
  indptr    SGLang's Triton draft extend: qo_indptr[1:bs + 1] = cumsum(extend_seq_lens) in a persistent buffer,
            max_extend_len = int(extend_seq_lens.max()) to syncfree::ragged_extend_attention (reads row b's
            queries at [qo_indptr[b], qo_indptr[b + 1])), length_bounds={"extend_seq_lens": 8}. Rule indptr_bound.
  flat      SGLang's DCP / FlashInfer fallback: n = seq_lens.sum().item() sizes torch.empty(n), syncfree::kv_indices
            fills it through kv_indptr = pad(cumsum(seq_lens), (1, 0)), a reader registered here (a dense
            attention over each row's slots, read through the indptr) reads it. Rule flat_kv_indices.
  regional  the reference decoder (compile_pass.examples.TinyLlama, 4 layers) with each layer's work under
            torch.compiler.nested_compile_region. Rule page_table, through invoke_subgraph.
  flashmla_scratch  SGLang's FlashMLABackend.init_forward_metadata with the CPU mirror published (issue 30): a
            persistent -1 scratch grown on demand (`if buf is None or buf.shape[0] < bs or buf.shape[1] < n`),
            sliced `buf[:bs, :cdiv(seq_lens_cpu.max().item(), 64)]`, filled by the bounded Triton writer
            (kernels/flashmla_kv_indices.py, its stride the scratch's own), read by syncfree::paged_decode, the
            slice stored on the backend's metadata (`static_escapes`). Rule allocated_table (the sliced scratch).
  trtllm_round_up  TRTLLMMLABackend's `_calc_padded_blocks` with the mirror: blocks = cdiv(seq_lens_cpu.max().item(),
            64), `if blocks % lcm != 0: blocks = cdiv(blocks, lcm) * lcm` (lcm = 64, as SGLang's for pages of 64:
            traced at the bound's outcome), `torch.full((bs, blocks), -1)` filled by the writer with the width as
            its row stride, read by syncfree::paged_decode, table and max_seq_len stored on the metadata. Rule
            allocated_table (a round-up page count).
For each: outputs equal eager over changing lengths (two batch sizes); replays pass under
torch.cuda.set_sync_debug_mode("error"); Inductor's "graph partition" lines and cudagraph skips are counted; the
report must say rewritten with nothing kept; Inductor's code holds no `.item()`.

    python benchmarks/engine_steps_gpu.py [--steps mla indptr flat regional] [--json out.json] [--device cpu]

`--device cpu` is a dry run (no CUDA graphs, no sync-debug replays; Triton kernels need TRITON_INTERPRET=1, and
Inductor does not lower a user Triton kernel on CPU tensors, so `mla` fails there). flashmla_scratch and
trtllm_round_up run on the CPU with a writer op of the same contract in place of the Triton kernel; with
`--cudagraphs` the dry run compiles with cudagraphs=True too, and checks the backend's own decisions (it must not
turn CUDA graphs off for a rewritten graph; flashmla_scratch's scratch must become a static input):

    python benchmarks/engine_steps_gpu.py --device cpu --steps flashmla_scratch trtllm_round_up --batches 3,2
    python benchmarks/engine_steps_gpu.py --device cpu --cudagraphs --steps flashmla_scratch --batches 3,2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

MCL = 4096  # --max-context-len
HQ, HKV, D = 8, 2, 64
REQS = 8


def environment(device):
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "python": sys.version.split()[0], "commit": os.environ.get("SYNCFREE_COMMIT", "unknown")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def token_table(gen, page_size, device):
    """[REQS, MCL] token slots: each request owns whole pages of `page_size`, scattered through the pool."""
    pages = torch.randperm(REQS * MCL // page_size, generator=gen).view(REQS, -1)
    tok = torch.arange(MCL)
    return (pages[:, tok // page_size] * page_size + tok % page_size).to(torch.int32).to(device)


# -- the steps ------------------------------------------------------------------------------------------------
def mla_case(device):
    from compile_pass.kernels.flashmla_kv_indices import flashmla_kv_indices_kernel as writer

    ps = 64
    gen = torch.Generator().manual_seed(0)
    r2t = token_table(gen, ps, device)
    k = torch.randn(REQS * MCL // ps, ps, HKV, D, generator=gen).to(device)
    v = torch.randn(REQS * MCL // ps, ps, HKV, D, generator=gen).to(device)

    def step(q, seq_lens, rpi):
        m = seq_lens.max().item()
        n = (m + ps - 1) // ps
        bs = seq_lens.shape[0]
        table = torch.full((bs, n), -1, dtype=torch.int32, device=seq_lens.device)
        writer[(bs,)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table.stride(0), PAGED_SIZE=ps)
        return torch.ops.syncfree.paged_decode(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)

    def inputs(lengths, seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(len(lengths), 1, HQ, D, generator=g).to(device)
        rpi = torch.randperm(REQS, generator=g)[: len(lengths)].to(device)
        return q, torch.tensor(lengths, dtype=torch.int64, device=device), rpi

    return step, inputs, {}, dict(low=1, top=MCL)


class DraftExtendMetadata:
    """SGLang's persistent qo_indptr buffer (TritonAttnBackend.qo_indptr), filled per step."""

    def __init__(self, device):
        self.qo_indptr = torch.zeros(REQS + 1, dtype=torch.int32, device=device)


def indptr_case(device):
    ps = 16
    gen = torch.Generator().manual_seed(1)
    r2t = token_table(gen, ps, device)
    k = torch.randn(REQS * MCL // ps, ps, HKV, D, generator=gen).to(device)
    v = torch.randn(REQS * MCL // ps, ps, HKV, D, generator=gen).to(device)
    meta = DraftExtendMetadata(device)
    if device == "cuda":  # a persistent buffer the step writes: static, as engines mark theirs (README "Use")
        from compile_pass._compat import mark_static_address

        mark_static_address(meta.qo_indptr)
    strided = torch.arange(0, MCL, ps, device=device)

    def step(q, seq_lens, extend_seq_lens, rpi):
        bs = extend_seq_lens.shape[0]
        qo_indptr = meta.qo_indptr
        qo_indptr[1 : bs + 1] = torch.cumsum(extend_seq_lens, dim=0)
        qo_indptr = qo_indptr[: bs + 1]
        max_extend_len = int(extend_seq_lens.max())
        table = (r2t[rpi][:, strided] // ps).to(torch.int32)  # the whole row's pages: a given, static table
        return torch.ops.syncfree.ragged_extend_attention(q, k, v, table, seq_lens.to(torch.int32), qo_indptr,
                                                          max_extend_len)

    def inputs(lengths, seed):
        rng = random.Random(seed)
        extend = [rng.randint(1, 8) for _ in lengths]
        extend[0] = 8
        lengths = [max(L, e) for L, e in zip(lengths, extend)]
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(sum(extend), HQ, D, generator=g).to(device)
        rpi = torch.randperm(REQS, generator=g)[: len(lengths)].to(device)
        return (q, torch.tensor(lengths, dtype=torch.int64, device=device),
                torch.tensor(extend, dtype=torch.int64, device=device), rpi)

    return step, inputs, {"length_bounds": {"extend_seq_lens": 8}}, dict(low=8, top=MCL)


def _flat_attention(q, k, v, indices, indptr, lens):
    """Row b attends the slots indices[indptr[b] : indptr[b] + lens[b]] of a flat [slots, Hkv, D] cache: read as
    MCL positions per row, masked past lens[b] (no position past the row is read: index 0 stands in)."""
    t = torch.arange(MCL, device=q.device)
    live = t[None, :] < lens[:, None].long()
    pos = torch.where(live, indptr[:-1, None].long() + t[None, :], 0)
    slots = torch.where(live, indices[pos.clamp(max=max(indices.numel() - 1, 0))].long(), 0)
    kk = k[slots].float().repeat_interleave(HQ // HKV, dim=2)  # [B, T, Hq, D]
    vv = v[slots].float().repeat_interleave(HQ // HKV, dim=2)
    s = torch.einsum("bhd,bthd->bht", q.float(), kk) / D ** 0.5
    s = s.masked_fill(~live[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bht,bthd->bhd", p, vv).to(q.dtype)


def _register_flat_reader():
    if hasattr(torch.ops, "engine_steps") and hasattr(torch.ops.engine_steps, "flat_attention"):
        return torch.ops.engine_steps.flat_attention
    from compile_pass.rules.flat_kv_indices import register_indptr_reader

    @torch.library.custom_op("engine_steps::flat_attention", mutates_args=())
    def flat_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                       indptr: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return _flat_attention(q, k, v, indices, indptr, lens)

    @flat_attention.register_fake
    def _(q, k, v, indices, indptr, lens):
        return torch.empty_like(q)

    register_indptr_reader("engine_steps::flat_attention", indices="indices", indptr="indptr", lengths="lens")
    return torch.ops.engine_steps.flat_attention


def flat_case(device):
    reader = _register_flat_reader()
    gen = torch.Generator().manual_seed(2)
    r2t = token_table(gen, 1, device)
    k = torch.randn(REQS * MCL, HKV, D, generator=gen).to(device)
    v = torch.randn(REQS * MCL, HKV, D, generator=gen).to(device)

    def step(q, seq_lens, rpi):
        kv_indptr = F.pad(torch.cumsum(seq_lens, 0), (1, 0))
        n = seq_lens.sum().item()
        kv_indices = torch.empty(n, dtype=torch.int32, device=seq_lens.device)
        torch.ops.syncfree.kv_indices(kv_indices, r2t, rpi, seq_lens, kv_indptr)
        return reader(q, k, v, kv_indices, kv_indptr, seq_lens)

    def inputs(lengths, seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(len(lengths), HQ, D, generator=g).to(device)
        rpi = torch.randperm(REQS, generator=g)[: len(lengths)].to(device)
        return q, torch.tensor(lengths, dtype=torch.int64, device=device), rpi

    return step, inputs, {}, dict(low=1, top=MCL)


def regional_case(device):
    from compile_pass._compat import mark_static_address
    from compile_pass.examples import TinyLlama, TinyLlamaConfig, make_batch

    config = TinyLlamaConfig(layers=4, regional=True, max_context_len=256, num_pages=512, page_size=4)
    model = TinyLlama(config, device=device)
    k_pool, v_pool = model.new_kv_pool(device=device)
    gen = torch.Generator().manual_seed(3)
    k_pool.copy_(torch.randn(k_pool.shape, generator=gen).to(device))
    v_pool.copy_(torch.randn(v_pool.shape, generator=gen).to(device))
    mark_static_address(k_pool)
    mark_static_address(v_pool)
    saved = (k_pool.clone(), v_pool.clone())

    def step(fb):
        return model(fb, k_pool, v_pool)

    def inputs(lengths, seed):
        k_pool.copy_(saved[0])  # the step writes the pool: every run starts from the same one
        v_pool.copy_(saved[1])
        return (make_batch(config, lengths, device=device, seed=seed),)

    return step, inputs, {"max_context_len": config.max_context_len}, dict(low=1, top=config.max_context_len)


class MLAMetadata:
    """What SGLang's MLA backends keep between steps: FlashMLA's grown scratch, the metadata the step stores."""

    def __init__(self, device):
        self.device = device
        self.scratch = None
        self.block_kv_indices = None
        self.max_seq_len_k = None

    def grown_scratch(self, bs: int, pages: int) -> torch.Tensor:
        """FlashMLABackend._eager_block_kv_indices (flashmla_backend.py:145): reused, grown to the running max."""
        buf = self.scratch
        if buf is None or buf.shape[0] < bs or buf.shape[1] < pages:
            rows = bs if buf is None else max(bs, buf.shape[0])
            cols = pages if buf is None else max(pages, buf.shape[1])
            # Not marked static (SGLang does not mark its scratch): under cudagraphs the backend makes the scratch a
            # static input of the CUDA graph, as the allocated-table rule proved it (the report's notes say so).
            buf = torch.full((rows, cols), -1, dtype=torch.int32, device=self.device)
            self.scratch = buf
        return buf[:bs, :pages]


def _block_table_writer(device):
    """`write(r2t, rpi, seq_lens, table, table_stride, ps)`: row b's first cdiv(seq_lens[b], ps) columns of the
    table, addressed through `table_stride`. On CUDA the project's bounded Triton writer
    (kernels/flashmla_kv_indices.py, one program per row, registered built in); on the CPU dry run a small op of
    the same contract, registered here with compile_pass.register_bounded_writer (Inductor lowers user Triton
    kernels for GPUs only)."""
    if device == "cuda":
        from compile_pass.kernels.flashmla_kv_indices import flashmla_kv_indices_kernel as kernel

        def write(r2t, rpi, seq_lens, table, table_stride, ps):
            kernel[(seq_lens.shape[0],)](r2t, rpi, seq_lens, None, table, r2t.stride(0), table_stride,
                                         PAGED_SIZE=ps)

        return write
    if not (hasattr(torch.ops, "engine_steps") and hasattr(torch.ops.engine_steps, "block_table_writer")):
        import compile_pass

        @torch.library.custom_op("engine_steps::block_table_writer", mutates_args=("table",))
        def block_table_writer(r2t: torch.Tensor, rpi: torch.Tensor, seq_lens: torch.Tensor, table: torch.Tensor,
                               table_stride: int, ps: int) -> None:
            for b in range(seq_lens.shape[0]):
                pages = -(-max(int(seq_lens[b]), 0) // ps)
                cols = r2t[rpi[b], : pages * ps : ps] // ps
                table.as_strided((pages,), (1,), table.storage_offset() + b * table_stride).copy_(cols.to(table.dtype))

        @block_table_writer.register_fake
        def _(r2t, rpi, seq_lens, table, table_stride, ps):
            return None

        compile_pass.register_bounded_writer("engine_steps::block_table_writer", table="table", lengths="seq_lens",
                                             page_size="ps", req_pool_indices="rpi", req_to_token="r2t",
                                             table_stride="table_stride")
    return torch.ops.engine_steps.block_table_writer


def _mla_inputs(device):
    def inputs(lengths, seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(len(lengths), 1, HQ, D, generator=g).to(device)
        rpi = torch.randperm(REQS, generator=g)[: len(lengths)].to(device)
        seq_lens_cpu = torch.tensor(lengths, dtype=torch.int64)  # the host mirror SGLang publishes
        return q, seq_lens_cpu.to(device), seq_lens_cpu, rpi

    return inputs


def _mla_setup(device, seed: int, ps: int = 64):
    """The writer, a token table, a KV pool of page size `ps` and the metadata store of an MLA-shaped step."""
    gen = torch.Generator().manual_seed(seed)
    r2t = token_table(gen, ps, device)
    k = torch.randn(REQS * MCL // ps, ps, HKV, D, generator=gen).to(device)
    v = torch.randn(REQS * MCL // ps, ps, HKV, D, generator=gen).to(device)
    return _block_table_writer(device), r2t, k, v, MLAMetadata(device)


def flashmla_scratch_case(device):
    ps = 64
    write, r2t, k, v, meta = _mla_setup(device, 4, ps)

    def step(q, seq_lens, seq_lens_cpu, rpi):
        bs = seq_lens.shape[0]
        n = (seq_lens_cpu.max().item() + ps - 1) // ps  # a host read of the mirror: no device sync, but dynamic
        table = meta.grown_scratch(bs, n)
        write(r2t, rpi, seq_lens, table, table.stride(0), ps)
        meta.block_kv_indices = table  # stored, as FlashMLADecodeMetadata holds it
        return torch.ops.syncfree.paged_decode(q, k, v, table[:bs], seq_lens.to(torch.int32))

    return step, _mla_inputs(device), {"static_escapes": True}, dict(low=1, top=MCL)


def trtllm_round_up_case(device):
    import math

    ps = 64
    lcm = math.lcm(128 // ps, 64)  # TRTLLM's block constraint and the Triton writer's pages per block
    write, r2t, k, v, meta = _mla_setup(device, 5, ps)

    def step(q, seq_lens, seq_lens_cpu, rpi):
        bs = seq_lens.shape[0]
        max_seq = seq_lens_cpu.max().item()
        blocks = (max_seq + ps - 1) // ps  # _calc_padded_blocks (trtllm_mla_backend.py:340)
        if blocks % lcm != 0:
            blocks = (blocks + lcm - 1) // lcm * lcm
        table = torch.full((bs, blocks), -1, dtype=torch.int32, device=seq_lens.device)
        write(r2t, rpi, seq_lens, table, blocks, ps)  # the width as the writer's row stride
        meta.block_kv_indices, meta.max_seq_len_k = table, max_seq
        return torch.ops.syncfree.paged_decode(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=max_seq)

    return step, _mla_inputs(device), {"static_escapes": True}, dict(low=1, top=MCL)


CASES = {"mla": mla_case, "indptr": indptr_case, "flat": flat_case, "regional": regional_case,
         "flashmla_scratch": flashmla_scratch_case, "trtllm_round_up": trtllm_round_up_case}


# -- running one ------------------------------------------------------------------------------------------------
def length_vectors(batches, count, low, top, seed=0):
    if RESIDUE_SWEEP:
        return residue_vectors(batches, low, top, seed)
    rng = random.Random(seed)
    out = []
    for b in batches:
        for n in range(count):
            v = [rng.randint(low, top) for _ in range(b)]
            if n == 0:
                v[0] = top
            out.append(v)
    return out


RESIDUE_SWEEP = False  # --residue-sweep: maxima at both edges of every residue class of TRTLLM's round-up
ROUND_UP_SPAN = 4096  # tokens per round-up multiple: lcm(128 / ps, 4096 / ps) pages of ps tokens


def residue_vectors(batches, low, top, seed=0):
    """Per batch size: the max at 1, the bound, and each multiple k of the round-up's span less one page, less one,
    at it and one past it (every residue class of `blocks % lcm` at its edges); the other rows random below."""
    rng = random.Random(seed)
    maxima = {max(low, 1), top}
    for k in range(1, top // ROUND_UP_SPAN + 1):
        maxima |= {k * ROUND_UP_SPAN - 64, k * ROUND_UP_SPAN - 1, k * ROUND_UP_SPAN, k * ROUND_UP_SPAN + 1}
    out = []
    for b in batches:
        for m in sorted(x for x in maxima if low <= x <= top):
            out.append([m] + [rng.randint(low, m) for _ in range(b - 1)])
    return out


def run_case(name, device, batches, count, replays, cudagraphs=None):
    import compile_pass
    from compile_pass import _compat
    from compile_pass.pipeline import CUDAGRAPHS_SCRATCH
    from compile_pass.testing import host_reads_in_code, replay_without_sync
    from torch._dynamo.utils import counters

    cuda = device == "cuda"
    step, inputs, options, span = CASES[name](device)
    # eager's reference on its own state: the MLA steps keep metadata between steps (FlashMLA's grown scratch), and
    # an eager run on the compiled step's state would grow it first (not what a server does: issue 45 item 5). Its
    # inputs come from its own case too: the regional step writes its case's KV pool, which `inputs` resets
    reference, reference_inputs = CASES[name](device)[:2]
    options = {"max_context_len": MCL, **options}
    if cuda if cudagraphs is None else cudagraphs:
        options["cudagraphs"] = True
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_pass.compile(step, fullgraph=True, fx_graph_cache=False, **options)
    rows, problems, codes = [], [], []
    t0 = time.perf_counter()
    with _compat.CudagraphSkips() as skips:
        for n, lengths in enumerate(length_vectors(batches, count, span["low"], span["top"])):
            want = reference(*reference_inputs(lengths, n))
            args = inputs(lengths, n)
            got, new = _compat.run_and_get_code(compiled, *args)
            codes += new
            row = {"batch": len(lengths), "lengths_head": lengths[:4], "compiled_here": bool(new)}
            if cuda:
                for _ in range(2):  # warm-up and recording may synchronise; replays may not
                    args = inputs(lengths, n)
                    got = compiled(*args)
                args = inputs(lengths, n)
                replayed, done, failure = replay_without_sync(compiled, *args, replays=1)
                row.update(replays=done, replay_failure=failure)
                if failure:
                    problems.append(f"{lengths[:4]}: {failure}")
                got = replayed if replayed is not None else got
            err = float((got.float() - want.float()).abs().max())
            ok = torch.allclose(got.float(), want.float(), atol=1e-4, rtol=1e-4)
            row.update(max_abs_err=err, equal=ok)
            if not ok:
                problems.append(f"{lengths[:4]}: compiled differs from eager by {err:.3g}")
            rows.append(row)
        partitions = skips.partitions()
        skipped = [m for m in skips.messages if "skipping" in m]
    reports = list(compile_pass.reports(compiled))
    merged = compile_pass.SyncReport.merge(reports)
    status = "kept" if merged.kept else ("rewritten" if merged.rewritten else "nothing")
    rules = sorted({i.rule for i in merged.rewritten})
    reads = host_reads_in_code(codes)
    if status != "rewritten":
        problems.append(f"status {status}: {[i.reason for i in merged.kept]}")
    if reads:
        problems.append(f"{reads} host reads in Inductor's code")
    if cuda and skipped:
        problems.append(f"cudagraphs skipped: {skipped[:2]}")
    cudagraph_notes = sorted({n for r in reports for n in r.notes if n.startswith("cudagraphs:")})
    if options.get("cudagraphs"):  # the backend's own decisions, checked on the CPU dry run too
        from compile_pass.backend import CUDAGRAPHS_OFF

        if status == "rewritten" and CUDAGRAPHS_OFF in cudagraph_notes:
            problems.append(f"the backend turned CUDA graphs off for a rewritten graph: {cudagraph_notes}")
        # the graph that allocates the scratch (a fresh start, or more rows) runs without CUDA graphs (its output
        # would live in their pool); every graph that slices the stored scratch makes it a static input
        slicing = [r for r in reports if CUDAGRAPHS_SCRATCH not in r.notes]
        if name == "flashmla_scratch" and not (slicing and all(any("static input of the CUDA graph" in n
                                                                   for n in r.notes) for r in slicing)):
            problems.append(f"the scratch was not made a static input of every graph that slices it: "
                            f"{cudagraph_notes}")
    # one partition is not enough: it must be one CUDA graph (the backend turns CUDA graphs off for a graph that
    # still holds a data-dependent size, and says so in the report's notes). The one exception is documented: a
    # graph that allocates the scratch the step stores (a fresh start, or more rows) runs once per growth without
    # CUDA graphs (CUDAGRAPHS_SCRATCH); every other graph, the steady one of each batch size, is one CUDA graph
    allocating = sum(CUDAGRAPHS_SCRATCH in r.notes for r in reports)
    not_graphed = [p for p in partitions if not p.endswith(" 0 non-cudagraphable")]
    steady = len(partitions) - len(not_graphed)
    if cuda and len(not_graphed) > allocating:
        notes = sorted({n for r in reports for n in r.notes if "cudagraphs" in n})
        problems.append(f"a partition is not cudagraphable: {partitions[:2]} {notes[:1]}")
    result = dict(step=name, options={k: v for k, v in options.items()}, status=status, rules=rules,
                  reasons=[i.reason for i in merged.rewritten + merged.kept], vectors=rows,
                  partitions=partitions, cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]),
                  cudagraph_notes=cudagraph_notes, allocating_graphs=allocating, cuda_graphed_partitions=steady,
                  graphs=len(reports), host_reads_in_code=reads, seconds=time.perf_counter() - t0,
                  problems=problems, ok=not problems)
    print(f"{name}: {status} by {rules}; {len(rows)} vectors equal: {all(r['equal'] for r in rows)}; "
          f"replays clean: {all(not r.get('replay_failure') for r in rows)}; partitions: {partitions} "
          f"({steady} CUDA-graphed for {len(set(batches))} batch sizes, {allocating} allocating the scratch); "
          f"problems: {problems or 'none'}", flush=True)
    return result


def main():
    global MCL, RESIDUE_SWEEP
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batches", default="4,6")
    p.add_argument("--vectors", type=int, default=3, help="length vectors per batch size")
    p.add_argument("--replays", type=int, default=1)
    p.add_argument("--cudagraphs", action="store_true", help="compile with cudagraphs=True on the CPU dry run too")
    p.add_argument("--json")
    # 4096, a realistic bound and a multiple of TRTLLM's round-up span: at another bound (1024 before 2026-12-05)
    # its two outcomes' widths differ and the branch breaks the graph, an error under fullgraph=True (README)
    p.add_argument("--max-context-len", type=int, default=4096, help="the static bound (default %(default)s)")
    p.add_argument("--residue-sweep", action="store_true",
                   help="maxima at the edges of every residue class of TRTLLM's round-up (issue 45), not random")
    args = p.parse_args()
    MCL, RESIDUE_SWEEP = args.max_context_len, args.residue_sweep
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("engine_steps_gpu: no CUDA device (use --device cpu for the dry run)")
    import compile_pass  # noqa: F401  (registers the ops)

    batches = [int(b) for b in args.batches.split(",")]
    out = {"env": environment(args.device), "steps": []}
    for name in args.steps:
        try:
            out["steps"].append(run_case(name, args.device, batches, args.vectors, args.replays,
                                         True if args.cudagraphs else None))
        except Exception as e:  # noqa: BLE001  (one step's failure is a result; the next still runs)
            import traceback

            traceback.print_exc()
            out["steps"].append(dict(step=name, ok=False, problems=[f"{type(e).__name__}: {e}"[:2000]]))
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
    out["ok"] = all(s["ok"] for s in out["steps"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print("all ok" if out["ok"] else "NOT ok")


if __name__ == "__main__":
    main()
