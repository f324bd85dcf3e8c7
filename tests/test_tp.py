"""Tensor parallelism: the TP shard of the reference decoder through the syncfree backend, 2 ranks on CPU
(gloo) spawned by the test; the GPU variant (2 GPUs, NCCL, CUDA graphs) carries the gpu marker."""

import json
import os
import subprocess
import sys

import pytest
import torch

from compile_pass.examples import TinyLlama, TinyLlamaConfig

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")


def torchrun(nproc: int, *args, cwd, timeout: int = 300, env_extra=None):
    # cwd: not the repository root, whose compile_pass/ source folder would shadow the installed package
    env = {**os.environ, **(env_extra or {}), "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "-m", "compile_pass.examples.tp_decode", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def test_world_size_one_is_the_whole_model():
    config = TinyLlamaConfig()
    whole = TinyLlama(config)
    shard = TinyLlama(config, tp_rank=0, tp_size=1)
    for a, b in zip(whole.parameters(), shard.parameters()):
        assert torch.equal(a, b)


def test_shards_partition_the_weights():
    config = TinyLlamaConfig()
    whole = TinyLlama(config)
    shards = [TinyLlama(config, tp_rank=r, tp_size=2) for r in range(2)]
    c = config
    q = c.heads * c.head_dim // 2
    for i, layer in enumerate(whole.layers):
        w0, w1 = shards[0].layers[i].wqkv, shards[1].layers[i].wqkv
        assert torch.equal(torch.cat([w0[:q], w1[:q]]), layer.wqkv[: 2 * q])  # query heads split in two
        assert torch.equal(torch.cat([shards[0].layers[i].wo, shards[1].layers[i].wo], 1), layer.wo)
        assert torch.equal(torch.cat([shards[0].layers[i].w_down, shards[1].layers[i].w_down], 1), layer.w_down)
    with pytest.raises(ValueError, match="kv_heads=2 must divide evenly over tp_size=4"):
        TinyLlama(config, tp_rank=0, tp_size=4)


@pytest.mark.inductor
def test_two_ranks_on_cpu_match_world_size_one(tmp_path):
    out = tmp_path / "rank{rank}.json"
    proc = torchrun(2, "--device", "cpu", "--check", "--steps", "3", "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["world_size"] == 2 and r["reports_identical"]
        assert r["host_reads_in_code"] == 0 and r["collectives_in_code"] >= 4  # 2 layers x 2 all-reduces
        assert r["max_abs_err"] < 1e-4  # equal to the world-size-1 model
        assert [i["kind"] for i in r["report"]["rewritten"]] == ["item"] and r["report"]["kept"] == []
    timings = ("pass_seconds", "backend_seconds")  # each rank's own compile times
    assert [{k: v for k, v in r["report"].items() if k not in timings} for r in results] == \
        [{k: v for k, v in results[0]["report"].items() if k not in timings}] * 2


def test_ranks_that_disagree_on_options_stop_with_a_clear_error(tmp_path):
    import torch.multiprocessing as mp

    sys.path.insert(0, SUPPORT)
    import tp_helpers

    mp.spawn(tp_helpers.disagree, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    errors = [json.loads((tmp_path / f"rank{r}.json").read_text())["error"] for r in range(2)]
    assert all(e and "ranks disagree on the syncfree options ['max_context_len']" in e for e in errors)


def test_launcher_outside_torchrun_says_how_to_run_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "compile_pass.examples.tp_decode", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 2 and "torchrun --nproc-per-node" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_cudagraphs_no_sync_and_clean_shutdown(tmp_path):
    out = tmp_path / "rank{rank}.json"
    proc = torchrun(2, "--device", "cuda", "--cudagraphs", "--check", "--steps", "4", "--json", str(out),
                    cwd=tmp_path, timeout=150,  # a hang at teardown fails here
                    # Inductor logs its partitions when it compiles, not on an FX-graph-cache hit
                    env_extra={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(2):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert result["reports_identical"] and result["host_reads_in_code"] == 0
        assert result["max_abs_err"] < 1e-3
        assert result["sync_free_replays"]  # replays under set_sync_debug_mode("error") on every rank
        assert any("1 cudagraphable, 0 non-cudagraphable" in p for p in result["partitions"]), result["partitions"]
