"""Full Inductor compiles through backend="syncfree" (proofs 1 and 2 of docs/design.md, on CPU)."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import compile_pass
from compile_pass.testing import host_reads_in_code as host_syncs
from compile_pass._compat import capture_scalar_outputs, run_and_get_code
from passlib import make_fb, make_qkv

pytestmark = pytest.mark.inductor


def decode(q, k, v, fb):
    max_len = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :max_len:4] // 4
    return torch.ops.syncfree.paged_decode(q, k, v, table.to(torch.int32), fb.seq_lens.to(torch.int32))




def test_syncfree_inductor_code_has_no_host_sync_and_matches_eager():
    from torch._dynamo.utils import counters

    q, k, v = make_qkv(3)
    compiled = compile_pass.compile(decode, max_context_len=64, fullgraph=True)
    counters.clear()
    fb = make_fb([3, 9, 5])
    out, codes = run_and_get_code(compiled, q, k, v, fb)
    torch.testing.assert_close(out, decode(q, k, v, fb))
    assert host_syncs(codes) == 0
    assert "page_table" in "".join(codes)
    report = compile_pass.last_report()
    assert report.syncs_remaining == 0 and len(report.rewritten) == 1
    # Always filled: on an FX-graph-cache hit the findings come from the store (test_post_grad_check.py)
    assert report.post_grad["local_scalar_dense"] == 0 and report.post_grad["unbacked_symbols"] == []
    for lengths in ([1, 64, 30], [0, 2, 63], [17, 17, 17]):  # new lengths: no recompile
        fb = make_fb(lengths)
        torch.testing.assert_close(compiled(q, k, v, fb), decode(q, k, v, fb))
    assert counters["stats"]["unique_graphs"] == 1


def test_report_says_where_compile_time_went(monkeypatch):
    # pass_seconds: the FX pass and the post-grad check; backend_seconds: the whole backend call (Inductor too).
    import compile_pass.post_grad_check as post_grad_check
    import compile_pass.sync_pass as sync_pass

    real_check = post_grad_check.post_grad_syncs

    def slow_check(graph):
        time.sleep(0.2)
        return real_check(graph)

    real_rewrite = sync_pass.SyncPass.__call__

    def slow_rewrite(self, gm):
        time.sleep(0.3)
        return real_rewrite(self, gm)

    monkeypatch.setattr(post_grad_check, "post_grad_syncs", slow_check)
    monkeypatch.setattr(sync_pass.SyncPass, "__call__", slow_rewrite)
    q, k, v = make_qkv(3)
    fb = make_fb([3, 9, 5])
    torch._dynamo.reset()
    # The FX graph cache off: the post-grad check runs in this compile (a cache hit would skip it).
    compiled = compile_pass.compile(decode, max_context_len=64, fullgraph=True, fx_graph_cache=False)
    compiled(q, k, v, fb)
    report = compile_pass.last_report()
    assert 0.5 <= report.pass_seconds < report.backend_seconds
    assert report.to_dict()["pass_seconds"] == report.pass_seconds
    merged = compile_pass.SyncReport.merge([report, report])
    assert merged.pass_seconds == 2 * report.pass_seconds and merged.backend_seconds == 2 * report.backend_seconds


def test_stock_inductor_keeps_the_sync():
    """The counter-check: the same code through stock Inductor has a host read in its wrapper."""
    q, k, v = make_qkv(3)
    fb = make_fb([3, 9, 5])
    compiled = torch.compile(decode, fullgraph=True)
    with capture_scalar_outputs():
        out, codes = run_and_get_code(compiled, q, k, v, fb)
    torch.testing.assert_close(out, decode(q, k, v, fb))
    assert host_syncs(codes) >= 1


def test_backend_found_by_name_in_a_fresh_process(tmp_path):
    script = textwrap.dedent("""
        import json, sys, torch
        torch._dynamo.config.capture_scalar_outputs = True
        def f(x, lens):
            m = lens.max().item()
            return x[:, :m].sum(1), m
        x = torch.arange(40.).view(4, 10); lens = torch.tensor([3, 7, 2, 5])
        out = torch.compile(f, backend="syncfree", options={"max_context_len": 10}, fullgraph=True)(x, lens)
        imported_before = "compile_pass" in sys.modules
        import compile_pass
        report = compile_pass.last_report()
        print(json.dumps({"ok": torch.equal(out[0], f(x, lens)[0]) and out[1] == 7,
                          "imported": imported_before, "kept": len(report.kept)}))
    """)
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"ok": True, "imported": True, "kept": 1}
