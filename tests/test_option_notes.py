"""Options that have no effect on a graph say so in its report (issue 44, item 3): `cudagraphs=True` on a graph
whose tensors are all on the CPU, `outline_repeats=True` where nothing repeats (or the graph keeps a host read)."""

import torch

from compile_pass import pipeline
from compile_pass.options import SyncfreeOptions


def _graph(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def _step(x, w):
    return torch.relu(x @ w).sum(-1)


def test_cudagraphs_on_a_cpu_graph_says_it_has_no_effect():
    gm = _graph(_step, torch.randn(3, 4), torch.randn(4, 4))
    state = pipeline.run(gm, SyncfreeOptions.from_dict({"max_context_len": 64, "cudagraphs": True}))
    assert pipeline.CUDAGRAPHS_ON_CPU in state.notes
    state = pipeline.run(gm, SyncfreeOptions.from_dict({"max_context_len": 64}))
    assert pipeline.CUDAGRAPHS_ON_CPU not in state.notes


def test_outline_repeats_that_outlines_nothing_says_so():
    gm = _graph(_step, torch.randn(3, 4), torch.randn(4, 4))
    state = pipeline.run(gm, SyncfreeOptions.from_dict({"max_context_len": 64, "outline_repeats": True}))
    assert state.outlined is None and pipeline.OUTLINED_NOTHING in state.notes


def test_outline_repeats_on_a_graph_that_keeps_a_host_read_says_it_was_not_tried():
    def keeps(x, seq_lens):
        m = seq_lens.max().item()
        return x[:, :m].sum(-1), m  # the max escapes: kept

    from compile_pass import _compat

    with _compat.capture_scalar_outputs():
        gm = _graph(keeps, torch.randn(3, 8), torch.tensor([3, 5, 2]))
    state = pipeline.run(gm, SyncfreeOptions.from_dict({"max_context_len": 8, "outline_repeats": True}))
    assert state.keeps_host_read and pipeline.OUTLINE_NOT_TRIED in state.notes


def test_an_empty_batch_raises_as_eager_with_one_clear_warning():
    """Issue 44, item 5: B = 3, then B = 0, then B = 3 again through compile_pass.compile (Inductor): the empty
    batch raises eager's error, after one warning that names the case (not Inductor's failure on a max over zero
    elements), and the full batch after it still gives eager's values."""
    import warnings

    import pytest

    import compile_pass
    import consumers_for_tests  # noqa: F401  (syncfree_test::bounded_sum)
    from compile_pass.backend import EMPTY_BATCH
    from passlib import make_fb

    def step(fb):
        m = fb.seq_lens.max().item()
        return torch.ops.syncfree_test.bounded_sum(fb.req_to_token[fb.req_pool_indices, :m], fb.seq_lens, 1, m)

    torch._dynamo.reset()
    compiled = compile_pass.compile(step, max_context_len=64)
    torch.testing.assert_close(compiled(make_fb([3, 9, 5])), step(make_fb([3, 9, 5])))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="numel\\(\\) == 0"):
            compiled(make_fb([]))
    ours = [str(w.message) for w in caught if str(w.message).startswith("syncfree")]
    assert len(ours) == 1 and EMPTY_BATCH in ours[0], ours
    with pytest.raises(RuntimeError, match="numel\\(\\) == 0"):
        step(make_fb([]))
    torch.testing.assert_close(compiled(make_fb([4, 1, 7])), step(make_fb([4, 1, 7])))
