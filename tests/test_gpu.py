"""GPU tests (marker `gpu`, skipped without CUDA): the kernels on CUDA against the references, and the
compiled decode step with no host sync at run time (proof 3 of docs/design.md)."""

import warnings

import pytest
import torch

from kernel_cases import SENTINEL, make_case, make_inputs
from reference import attention_f64, page_table_cells

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int64), (torch.int64, torch.int32)])
def test_page_table_cuda_sentinel(page_size, dtypes):
    lengths = [0, 1, page_size, 5 * page_size, 10**6, -4, 37, 2048]
    r2t, rpi, lens = make_inputs(len(lengths), page_size, lengths, 3000, dtypes[0], dtypes[1], device="cuda")
    width = 40
    full = torch.full((len(lengths) + 4, width + 3), SENTINEL, dtype=torch.int32, device="cuda")
    torch.ops.syncfree.page_table_(full[2:, :width], r2t, rpi, lens, page_size)
    expect = page_table_cells(r2t.cpu(), rpi.cpu(), lens.cpu(), page_size, width)
    got = full.cpu()
    for r in range(got.shape[0]):
        for c in range(got.shape[1]):
            key = (r - 2, c)
            want = expect.get(key, SENTINEL) if c < width else SENTINEL
            assert got[r, c] == want, (r, c)
    out = torch.ops.syncfree.page_table(r2t, rpi, lens, page_size, width).cpu()
    for (b, j), page in expect.items():
        assert out[b, j] == page


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("sq", [1, 4])
def test_paged_decode_cuda_against_float64(dtype, atol, page_size, sq):
    q, k, v, table, lens = make_case(3, sq, 8, 2, 64, page_size, [1, 300, 1000], dtype=dtype, seed=page_size + sq)
    out = torch.ops.syncfree.paged_decode(q.cuda(), k.cuda(), v.cuda(), table.cuda(), lens.cuda())
    assert torch.isfinite(out).all()
    ref = attention_f64(q, k, v, table.clamp(max=k.shape[0] - 1), lens)
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("batch", [1, 4, 40])
def test_paged_decode_split_and_direct_paths(batch):
    # B=1 and 4 split the keys over many programs and combine them; B=40 x 8 KV heads fill the device, so one
    # split writes the output directly. Ragged lengths, poisoned tails, both against float64.
    import compile_pass.kernels.paged_decode as pd

    lengths = [(977 * (b + 1)) % 3000 + (b % 3) for b in range(batch)]
    q, k, v, table, lens = make_case(batch, 1, 32, 8, 128, 16, lengths, dtype=torch.bfloat16, seed=batch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = pd.num_splits_for(batch, 8, table.shape[1] * 16, sms)
    assert (splits == 1) == (batch * 8 >= pd.TUNING["split_below_rows_per_sm"] * sms), splits
    out = torch.ops.syncfree.paged_decode(q.cuda(), k.cuda(), v.cuda(), table.cuda(), lens.cuda())
    assert torch.isfinite(out).all()
    ref = attention_f64(q, k, v, table.clamp(max=k.shape[0] - 1), lens)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=0)


def test_paged_decode_long_context_splits():
    # One row of 20K keys: many splits; the result must match a float64 reference (computed densely).
    q, k, v, table, lens = make_case(1, 1, 8, 8, 64, 16, [20000], dtype=torch.bfloat16, poison=True)
    out = torch.ops.syncfree.paged_decode(q.cuda(), k.cuda(), v.cuda(), table.cuda(), lens.cuda())
    t = torch.arange(20000)
    kk = k[table[0, t // 16].long(), t % 16].double()  # [T, H, D]
    vv = v[table[0, t // 16].long(), t % 16].double()
    w = torch.softmax(torch.einsum("hd,thd->ht", q[0, 0].double(), kk) / 8.0, -1)
    ref = torch.einsum("ht,thd->hd", w, vv)
    torch.testing.assert_close(out[0, 0].cpu().double(), ref, atol=2e-2, rtol=0)


def _model(attention="paged_decode"):
    from compile_pass.examples import TinyLlama, TinyLlamaConfig

    config = TinyLlamaConfig(attention=attention, page_size=16, max_context_len=256, num_pages=64,
                             max_requests=4)
    model = TinyLlama(config, device="cuda")
    k, v = model.new_kv_pool("cuda")
    k.normal_()
    v.normal_()
    from compile_pass._compat import mark_static_address

    mark_static_address(k)  # the KV pool is a persistent buffer the CUDA graph writes in place
    mark_static_address(v)
    return config, model, k, v


def _replay_without_sync(step, fb, skips):
    """Three calls under `skips` (warm-up and CUDA-graph recording), then three replays that raise on any host
    sync (sync debug mode "error"); the last output."""
    with skips:
        for _ in range(3):
            got = step(fb)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            got = step(fb)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return got


@pytest.mark.parametrize("cudagraphs", [False, True])
def test_compiled_decode_has_no_host_sync_at_run_time(cudagraphs):
    import compile_pass
    from compile_pass.examples import make_batch
    from torch._dynamo.utils import counters

    config, model, k, v = _model()
    step = compile_pass.compile(lambda fb: model(fb, k, v), max_context_len=config.max_context_len,
                                cudagraphs=cudagraphs, fullgraph=True, strict=True)
    from compile_pass._compat import CudagraphSkips

    counters.clear()
    skips = CudagraphSkips()
    for lengths in ([5, 17, 9], [40, 1, 250], [16, 32, 48]):
        fb = make_batch(config, lengths, device="cuda")
        expect = model(fb, k.clone(), v.clone())
        got = _replay_without_sync(step, fb, skips)
        torch.testing.assert_close(got.float(), expect.float(), atol=2e-4, rtol=2e-4)
    assert counters["stats"]["unique_graphs"] == 1
    if cudagraphs:
        assert counters["inductor"]["cudagraph_skips"] == 0, skips.messages
    report = compile_pass.last_report()
    assert report.syncs_remaining == 0 and len(report.rewritten) == 1
    assert report.post_grad["local_scalar_dense"] == 0 and report.post_grad["unbacked_symbols"] == []


def test_outlined_whole_model_is_sync_free_and_one_cudagraph():
    """outline_repeats on the whole model (4 layers, a KV tensor per layer): eager's logits and KV writes, no host
    sync at replay (sync debug "error"), no CUDA-graph skip, one partition, the layers run as one compiled body."""
    import dataclasses

    import compile_pass
    from compile_pass._compat import CudagraphSkips, mark_static_address
    from compile_pass.examples import TinyLlama, make_batch
    from torch._dynamo.utils import counters

    config, _, _, _ = _model()
    config = dataclasses.replace(config, layers=4)
    model = TinyLlama(config, device="cuda")
    ks, vs = model.new_kv_pool("cuda", per_layer=True)
    for t in ks + vs:
        t.normal_()
        mark_static_address(t)
    step = compile_pass.compile(lambda fb: model(fb, ks, vs), max_context_len=config.max_context_len,
                                cudagraphs=True, fullgraph=True, strict=True, outline_repeats=True,
                                fx_graph_cache=False)
    counters.clear()
    skips = CudagraphSkips()
    for lengths in ([5, 17, 9], [40, 1, 250], [16, 32, 48]):
        fb = make_batch(config, lengths, device="cuda")
        expect = model(fb, [t.clone() for t in ks], [t.clone() for t in vs])
        got = _replay_without_sync(step, fb, skips)
        torch.testing.assert_close(got.float(), expect.float(), atol=2e-4, rtol=2e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["inductor"]["cudagraph_skips"] == 0, skips.messages
    assert skips.partitions() == ["Created 1 graph partitions: 1 cudagraphable, 0 non-cudagraphable"], \
        skips.partitions()
    report = compile_pass.last_report()
    assert report.syncs_remaining == 0 and len(report.rewritten) == 1
    assert report.post_grad["local_scalar_dense"] == 0 and report.post_grad["unbacked_symbols"] == []
    assert any(n.startswith("outline_repeats:") and "compiled once" in n for n in report.notes), report.notes


def test_eager_engine_step_does_sync():
    """The check above can fail: the eager step with .max().item() trips the sync detector."""
    from compile_pass.examples import make_batch

    config, model, k, v = _model()
    fb = make_batch(config, [5, 17, 9], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            model(fb, k, v)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_fa4_adapter_against_paged_decode_and_float64():
    pytest.importorskip("flash_attn.cute")
    q, k, v, table, lens = make_case(3, 1, 8, 2, 128, 16, [1, 300, 1000], dtype=torch.bfloat16)
    table = table.clamp(max=k.shape[0] - 1)  # FA4 may prefetch whole pages from the table
    args = (q.cuda(), k.cuda(), v.cuda(), table.cuda(), lens.cuda())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.ops.syncfree.fa4_paged(*args, max_seqlen_k=4096, causal=True)
    ours = torch.ops.syncfree.paged_decode(*args)
    ref = attention_f64(q, k, v, table, lens)
    torch.testing.assert_close(got.cpu().double(), ref, atol=2e-2, rtol=0)
    torch.testing.assert_close(got.float(), ours.float(), atol=2e-2, rtol=0)


# -- engine-shaped steps on the GPU (tests/engines): CUDA graphs, no sync at replay, eager-equal --------------
def _engine_cases():
    from engines import all_cases

    return all_cases()


@pytest.mark.parametrize("name", sorted(_engine_cases()))
def test_engine_step_cudagraphs_sync_free(name):
    import compile_pass
    from compile_pass._compat import CudagraphSkips
    from engines.common import MAX_CONTEXT
    from engines import case_lengths
    from torch._dynamo.utils import counters

    case = _engine_cases()[name]
    step, make_args = case.build("cuda", case.page_size)
    rewritten = case.expect == "rewritten"
    # fx_graph_cache off: Inductor logs its partitions when it compiles, not on a cache hit
    compiled = compile_pass.compile(step, max_context_len=MAX_CONTEXT, cudagraphs=True, fullgraph=True,
                                    strict=rewritten, fx_graph_cache=False, **case.options)
    counters.clear()
    with CudagraphSkips() as log:
        for n, lengths in enumerate(case_lengths(case, 3, 3, 5)):
            args = make_args(lengths, seed=n)
            expect = step(*args)
            for _ in range(3):  # warm-up and CUDA-graph recording
                got = compiled(*args)
            torch.cuda.synchronize()
            if case.expect != "kept":
                torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    got = compiled(*args)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.testing.assert_close(got.float(), expect.float(), atol=2e-3, rtol=2e-3, msg=f"{name} {lengths}")
    report = compile_pass.last_report()
    print(f"\n[{name}] {report.to_dict()['rewritten'] or report.to_dict()['kept']} notes={report.notes} "
          f"cudagraph log={log.messages}")
    assert counters["stats"]["unique_graphs"] == 1
    if case.expect == "kept":  # a kept host read: CUDA graphs are dropped for the graph, and it runs
        assert any("cudagraphs: off" in n for n in report.notes)
        return
    assert report.syncs_remaining == 0 and report.post_grad["local_scalar_dense"] == 0
    assert counters["inductor"]["cudagraph_skips"] == 0, log.messages
    partitions = log.partitions()
    assert partitions and all(p.startswith("Created 1 graph partition") and "1 cudagraphable" in p
                              for p in partitions), \
        log.messages


def test_device_tensor_named_like_a_mirror_is_a_sync():
    """A `seq_lens_cpu` that lives on the GPU is no mirror: reading it is a device sync, and strict says so."""
    import compile_pass

    def step(seq_lens_cpu, x):
        return x[: seq_lens_cpu.max().item()].sum()

    compiled = compile_pass.compile(step, max_context_len=64, strict=True, fullgraph=True)
    with pytest.raises(compile_pass.SyncRemainsError):
        compiled(torch.tensor([3, 5], device="cuda"), torch.ones(64, device="cuda"))


def test_assert_sync_free_on_cuda_proves_all_three_ways():
    """compile_pass.testing on a GPU: replays under sync debug mode "error" and one CUDA-graph partition."""
    from compile_pass.examples import make_batch
    from compile_pass.testing import SyncCheckFailed, assert_sync_free

    config, model, k, v = _model()
    fb = make_batch(config, [5, 17, 9], device="cuda")
    result = assert_sync_free(lambda b: model(b, k, v), fb, max_context_len=config.max_context_len, cudagraphs=True,
                              fx_graph_cache=False)
    assert result.replays_checked == 3 and result.host_reads_in_code == 0
    assert any("1 cudagraphable, 0 non-cudagraphable" in m for m in result.cudagraph_log), result.cudagraph_log
    assert torch.cuda.get_sync_debug_mode() == 0  # restored

    def syncs(b):
        m = b.seq_lens.max().item()
        return b.req_to_token[b.req_pool_indices, :m].float().sum(1)  # kept: the table is summed

    with pytest.raises(SyncCheckFailed, match="kept by the pass"):
        assert_sync_free(syncs, fb, max_context_len=config.max_context_len)
    assert torch.cuda.get_sync_debug_mode() == 0


_KERNEL_WARMUP_PROBE = r'''
import json, sys, threading
import torch, triton
import compile_pass
from compile_pass.examples import TinyLlama, TinyLlamaConfig, make_batch

# (kernel, thread, found in Triton's on-disk cache) of every triton.compile in this process of a kernel of this
# package (Inductor's kernels compile in its workers and are left out by name)
compiles = []
PROJECT = ("page_table_kernel", "paged_decode_split_kernel", "paged_decode_combine_kernel",
           "paged_decode_short_kernel", "kv_indices_kernel")


def record(src, cache_hit, **_):
    name = getattr(getattr(getattr(src, "fn", None), "fn", None), "__name__", "")  # ASTSource.fn: the JITFunction
    if name in PROJECT:
        compiles.append((name, threading.current_thread().name, cache_hit))


DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
triton.knobs.compilation.listener = record
config = TinyLlamaConfig(page_size=16, max_context_len=256, num_pages=64, max_requests=4, regional=True)
model = TinyLlama(config, device=DEVICE)
k, v = model.new_kv_pool(DEVICE, per_layer=True)  # a KV tensor per layer, as the benchmarks' regional step
for t in (*k, *v):
    t.normal_()
fb = make_batch(config, [5, 200, 9], device=DEVICE)
k0, v0 = [t.clone() for t in k], [t.clone() for t in v]
step = compile_pass.compile(lambda fb: model(fb, k, v), max_context_len=config.max_context_len, fullgraph=True)
got = step(fb)
first_call = list(compiles)  # before eager runs: eager compiles the kernels of its own launches
expect = model(fb, k0, v0)
error = (got.float() - expect.float()).abs().max().item()
print(json.dumps(dict(compiles=first_call, error=error)))
'''


def _first_call_compiles(tmp_path, prewarm: str, triton_of: str | None = None) -> dict:
    """The regional TinyLlama step's first compiled call in a fresh process with empty Triton and Inductor caches
    (triton_of: the Triton cache an earlier run of that setting left): which thread compiled each of this
    package's kernels, and the output's distance from eager."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton-{triton_of or prewarm}"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{prewarm}-{triton_of}"),
               SYNCFREE_PREWARM_KERNELS=prewarm)
    # cwd: a folder without the checkout's compile_pass/ source, which would shadow the installed package
    proc = subprocess.run([sys.executable, "-c", _KERNEL_WARMUP_PROBE], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_first_call_finds_this_packages_kernels_compiled_by_the_warm_up(tmp_path):
    """compile_pass.kernel_warmup on the H200, each way in a fresh process with empty caches: by default each of this
    package's kernels that the first call launches was compiled by the helper process, and this process only read
    it from Triton's on-disk cache, once, in the warm-up thread; with =thread that thread compiles it; with =0 the
    calling thread does, at the launch. A later process with warm-ups off, on the Triton cache the helper filled,
    reads every kernel from it: the helper's compiles are under the keys Triton's JIT computes. Eager-equal every
    way."""
    import triton

    from compile_pass.kernel_warmup import THREAD_NAME

    if not hasattr(getattr(triton, "knobs", None), "compilation"):
        pytest.skip("triton.knobs.compilation (the compile listener) is not in this Triton")
    runs = {prewarm: _first_call_compiles(tmp_path, prewarm) for prewarm in ("1", "thread", "0")}
    runs["0 on 1's cache"] = _first_call_compiles(tmp_path, "0", triton_of="1")
    for run in runs.values():
        assert run["error"] < 2e-4, run
    kernels = sorted(name for name, _, _ in runs["1"]["compiles"])
    assert {"page_table_kernel", "paged_decode_split_kernel"} <= set(kernels), runs
    assert len(kernels) == len(set(kernels)), runs  # each read once
    assert {(thread, hit) for _, thread, hit in runs["1"]["compiles"]} == {(THREAD_NAME, True)}, runs
    assert sorted(name for name, _, _ in runs["thread"]["compiles"]) == kernels, runs
    assert {(thread, hit) for _, thread, hit in runs["thread"]["compiles"]} == {(THREAD_NAME, False)}, runs
    assert sorted(name for name, _, _ in runs["0"]["compiles"]) == kernels, runs
    assert {(thread, hit) for _, thread, hit in runs["0"]["compiles"]} == {("MainThread", False)}, runs
    assert sorted(name for name, _, _ in runs["0 on 1's cache"]["compiles"]) == kernels, runs
    assert {(thread, hit) for _, thread, hit in runs["0 on 1's cache"]["compiles"]} == {("MainThread", True)}, runs
