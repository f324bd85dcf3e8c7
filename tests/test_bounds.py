"""The one answer to a lengths input's static bound (compile_pass.bounds, issue 42 item 4), and the one deliberate
difference between its callers: while Dynamo traces, only inputs named as lengths get a range; the rules bound
any input whose max reaches a consumer's lengths."""

import pytest

from compile_pass import bounds, tracing
from compile_pass.options import SyncfreeOptions


def _opts(**kw):
    return SyncfreeOptions.from_dict({"max_context_len": 4096, **kw})


@pytest.mark.parametrize("name", ["seq_lens", "seq_lens_cpu", "verify_lens", "x"])
def test_the_rules_bound_every_lengths_input_by_max_context_len(name):
    found = bounds.lengths_bound(_opts(), name)
    assert found == bounds.Bound(4096, "max_context_len=4096", False)


def test_a_declared_bound_wins_for_the_input_or_its_twin():
    opts = _opts(length_bounds={"verify_lens": 8})
    assert bounds.lengths_bound(opts, "verify_lens") == bounds.Bound(8, "length_bounds['verify_lens']=8", True)
    assert bounds.lengths_bound(opts, "verify_lens_cpu", "verify_lens").value == 8  # the mirror's twin declared
    assert bounds.lengths_bound(opts, None, "other").value == 4096


def test_without_max_context_len_only_a_declared_bound_exists():
    opts = SyncfreeOptions.from_dict({"length_bounds": {"a": 3}})
    assert bounds.lengths_bound(opts, "seq_lens") is None
    assert bounds.lengths_bound(opts, "a").value == 3
    with pytest.raises(Exception, match="max_context_len"):
        bounds.require_bound(opts)


def test_the_one_deliberate_difference_the_trace_time_range_needs_a_lengths_name():
    opts = _opts(cpu_mirrors={"lens_cpu": "lens"}, length_bounds={"verify_lens": 8})
    policy = tracing.TracingPolicy(opts)
    assert policy.bound_of("seq_lens") == (4096, "max_context_len=4096")
    assert policy.bound_of("seq_lens_cpu") == (4096, "max_context_len=4096")
    assert policy.bound_of("lens_cpu") == (4096, "max_context_len=4096")  # a declared mirror
    assert policy.bound_of("verify_lens") == (8, "length_bounds['verify_lens']=8")
    assert policy.bound_of("x") is None  # the rules would bound it (by the consumer's facts); the trace does not
    assert bounds.lengths_bound(opts, "x").value == 4096
