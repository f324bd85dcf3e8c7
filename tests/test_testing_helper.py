"""compile_pass.testing (assert_sync_free), compile_pass.reports across graph breaks, and the pytest plugin
exercised through pytester."""

import json

import pytest
import torch

import compile_pass
import consumers_for_tests  # noqa: F401
from compile_pass import _compat
from compile_pass.examples import TinyLlama, TinyLlamaConfig, make_batch
from compile_pass.testing import SyncCheckFailed, assert_sync_free
from passlib import make_fb

pytestmark = pytest.mark.inductor


def keeps_a_sync(fb):
    m = fb.seq_lens.max().item()
    return fb.req_to_token[fb.req_pool_indices, :m:4] // 4  # the table is returned: kept


def only_post_grad(fb):
    m = fb.seq_lens_cpu.max().item()  # a CPU mirror: the pass keeps it as "no device sync"
    return fb.req_to_token[fb.req_pool_indices, :m].sum(1)


def test_reference_decoder_is_sync_free():
    config = TinyLlamaConfig()
    model = TinyLlama(config)
    k, v = model.new_kv_pool()

    def step(fb):
        return model(fb, k, v)

    fb = make_batch(config, [5, 17, 9])
    result = assert_sync_free(step, fb, max_context_len=config.max_context_len)
    assert result.host_reads_in_code == 0 and result.report.rewritten and not result.report.kept
    assert result.report.post_grad["local_scalar_dense"] == 0
    torch.testing.assert_close(result.output, model(fb, *model.new_kv_pool()), atol=1e-4, rtol=1e-4)


def test_a_kept_sync_fails_with_the_reports_table():
    with pytest.raises(SyncCheckFailed) as info:
        assert_sync_free(keeps_a_sync, make_fb([3, 9, 5]), max_context_len=64)
    message = str(info.value)
    assert "1 host sync point(s) kept by the pass" in message
    assert "test_testing_helper.py:" in message and "returned to the caller" in message
    assert "reads the host" in message  # the post-grad and code proofs fail too


def test_a_sync_found_only_post_grad_fails():
    with pytest.raises(SyncCheckFailed) as info:
        assert_sync_free(only_post_grad, make_fb([3, 9, 5]), max_context_len=64)
    message = str(info.value)
    assert "kept by the pass" not in message  # the pass counted no device sync ...
    assert "the post-grad graph reads the host" in message  # ... the post-grad check finds the host read
    assert "test_testing_helper.py:" in message


def test_no_global_state_changes():
    def step(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)

    other = torch.compile(lambda x: x + 1, backend="eager")
    other(torch.ones(2))
    before = (_compat.capture_scalar_outputs_enabled(), _compat.dynamo_cache_entries(step.__code__),
              _compat.dynamo_cache_entries(other.__wrapped__.__code__ if hasattr(other, "__wrapped__") else
                                           other._torchdynamo_orig_callable.__code__))
    assert_sync_free(step, make_fb([3, 9, 5]), max_context_len=64)
    with pytest.raises(SyncCheckFailed):
        assert_sync_free(keeps_a_sync, make_fb([3, 9, 5]), max_context_len=64)
    after = (_compat.capture_scalar_outputs_enabled(), _compat.dynamo_cache_entries(step.__code__),
             _compat.dynamo_cache_entries(other.__wrapped__.__code__ if hasattr(other, "__wrapped__") else
                                          other._torchdynamo_orig_callable.__code__))
    assert before == after and before[1] == 0 and before[2] == 1
    assert not torch.cuda.is_available() or torch.cuda.get_sync_debug_mode() == 0


def test_reports_cover_every_graph_of_a_split_step():
    def split(fb):
        m = fb.seq_lens.max().item()
        t = torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)
        print("a graph break")  # Dynamo splits the step here
        m2 = fb.seq_lens_cpu.max().item()
        return t + fb.req_to_token[fb.req_pool_indices, :m2].sum(1)

    fb = make_fb([3, 9, 5])
    compiled = compile_pass.compile(split, max_context_len=64)
    torch.testing.assert_close(compiled(fb), split(fb))
    graphs = compile_pass.reports(compiled)
    assert len(graphs) == 2
    merged = compile_pass.SyncReport.merge(graphs)
    assert len(merged.rewritten) == 1 and len(merged.kept) == 1  # last_report() alone would show one of them
    assert compile_pass.reports()[-2:] == graphs
    with pytest.raises(TypeError, match="compile_pass.compile"):
        compile_pass.reports(split)


PLUGIN_TEST = '''
import torch

def good(x, lens):
    return x[:, :4].sum() + lens.sum()  # no host read at all

def bad(x, lens):
    m = lens.max().item()
    return x[:, :m].sum()

def test_good(syncfree):
    result = syncfree(good, torch.ones(2, 8), torch.tensor([3, 5]), max_context_len=8)
    assert result.host_reads_in_code == 0

def test_bad(syncfree):
    syncfree(bad, torch.ones(2, 8), torch.tensor([3, 5]), max_context_len=8)
'''


def test_pytest_plugin_fixture_and_report(pytester):
    pytester.makepyfile(test_steps=PLUGIN_TEST)
    out = pytester.path / "syncfree.json"
    result = pytester.runpytest("-p", "no:cacheprovider", f"--syncfree-report={out}")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*SyncCheckFailed*not sync-free*"])
    data = json.loads(out.read_text())
    assert [(d["test"].split("::")[-1], d["sync_free"]) for d in data] == [("test_good", True), ("test_bad", False)]
    assert data[1]["report"]["kept"][0]["location"] == "test_steps.py:7"  # the `.item()` line of `bad`
    # the whole failure message (what failed, and the report's table), not its first line
    error = data[1]["error"]
    assert error.startswith("the compiled step is not sync-free:\n") and "host sync point(s) kept" in error
    assert "test_steps.py:7" in error and "sync points rewritten: 0, kept: 1" in error
    # the user's frames only: the step's own line, no frame of compile_pass.testing
    assert data[1]["report"]["kept"][0]["stack"] == ["test_steps.py:7 in bad"]


class Step(torch.nn.Module):
    def forward(self, fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)


def test_stacks_hold_the_user_s_frames_only():
    """A module is called from a fresh wrapper (its own code object): that frame is not the user's, and is not
    in the report's stacks."""
    result = assert_sync_free(Step(), make_fb([3, 9, 5]), max_context_len=64)
    (item,) = result.report.rewritten
    assert item.stack and all(f.startswith("test_testing_helper.py:") for f in item.stack), item.stack
    assert item.stack[-1].endswith("in forward")


def test_an_already_compiled_step_is_checked_through_compile_with_one_line():
    step = torch.compile(keeps_a_sync, backend="eager")
    with pytest.warns(UserWarning, match="already compiled by torch.compile") as caught, \
            pytest.raises(SyncCheckFailed, match="test_testing_helper.py:"):
        assert_sync_free(step, make_fb([3, 9, 5]), max_context_len=64)
    assert len([w for w in caught if "already compiled" in str(w.message)]) == 1
    assert "\n" not in str(caught[0].message)


def test_cuda_arguments_are_found_inside_batch_objects():
    from compile_pass.testing import _on_cuda

    fb = make_fb([3, 9])
    assert not _on_cuda((fb, [torch.ones(1)], {"x": torch.ones(1)}))
    fb.seq_lens = torch.empty(2, device="meta")  # stands in for any non-CPU device: not CUDA either
    assert not _on_cuda((fb,))
