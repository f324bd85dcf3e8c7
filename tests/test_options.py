"""Backend options (issue 21): unknown keys and wrong types are rejected by name, `mode=` through
compile_pass.compile, and the safe default checked=True."""

import warnings

import pytest
import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from compile_pass import _compat
from compile_pass.options import OptionError, SyncfreeOptions
from passlib import make_fb


def step(fb):
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
    return torch.ops.syncfree_test.bounded_sum(table, fb.seq_lens, 4, m)


def gather_only(fb):
    """The max sizes only the gather; the consumer's own bound (64, the token table's width) holds any length."""
    m = fb.seq_lens.max().item()
    table = fb.req_to_token[fb.req_pool_indices, :m:4] // 4
    return torch.ops.syncfree_test.bounded_sum(table, fb.seq_lens, 4, 64)


@pytest.mark.parametrize("key,suggestion", [
    ("max_contxt_len", "max_context_len"),   # ours
    ("pagesize", "page_size"),
    ("chcked", "checked"),
    ("max_autotun", "max_autotune"),          # Inductor's
    ("triton.cudagrahps", "triton.cudagraphs"),
])
def test_a_misspelled_option_names_the_key_and_the_nearest_one(key, suggestion):
    with pytest.raises(OptionError, match=f"unknown syncfree option '{key}'; did you mean '{suggestion}'"):
        SyncfreeOptions.from_dict({"max_context_len": 128, key: 1})


def test_an_unknown_key_without_a_near_one_still_names_it():
    with pytest.raises(OptionError, match="unknown syncfree option 'zzzz_qqqq'") as info:
        SyncfreeOptions.from_dict({"zzzz_qqqq": 1})
    assert "did you mean" not in str(info.value)


def test_inductor_keys_pass_through_as_patches():
    opts = SyncfreeOptions.from_dict({"max_context_len": 8, "max_autotune": True, "triton.cudagraphs": False})
    assert opts.config_patches() == {"max_autotune": True, "triton.cudagraphs": False}


def test_compile_rejects_an_unknown_key_at_once():
    with pytest.raises(OptionError, match="did you mean 'max_context_len'"):
        compile_pass.compile(step, max_context_len=128, max_contxt_len=128)


def test_the_backend_rejects_an_unknown_key_at_its_first_call():
    compiled = torch.compile(step, backend="syncfree", options={"max_contxt_len": 128}, fullgraph=True)
    with _compat.capture_scalar_outputs(), pytest.raises(Exception, match="did you mean 'max_context_len'"):
        compiled(make_fb([3, 9]))


@pytest.mark.parametrize("options,name", [
    ({"max_context_len": "128"}, "max_context_len"),
    ({"max_context_len": 0}, "max_context_len"),
    ({"max_context_len": True}, "max_context_len"),
    ({"page_size": 2.0}, "page_size"),
    ({"checked": 1}, "checked"),
    ({"cudagraphs": "yes"}, "cudagraphs"),
    ({"static_escapes": None}, "static_escapes"),
    ({"cpu_mirrors": ["a_cpu"]}, "cpu_mirrors"),
])
def test_wrong_types_name_the_argument(options, name):
    with pytest.raises(OptionError, match=rf"options\['{name}'\]"):
        SyncfreeOptions.from_dict(options)
    with pytest.raises((TypeError, ValueError)):  # OptionError is both, as the errors were before
        SyncfreeOptions.from_dict(options)


def test_checked_is_on_by_default_and_can_be_turned_off():
    assert SyncfreeOptions().checked is True
    assert SyncfreeOptions.from_dict({}).checked is True
    assert SyncfreeOptions.from_dict({"checked": False}).checked is False


@pytest.mark.inductor
def test_by_default_a_length_past_the_bound_trips_the_device_assertion():
    compiled = compile_pass.compile(gather_only, max_context_len=16, fullgraph=True)
    torch.testing.assert_close(compiled(make_fb([3, 16])), gather_only(make_fb([3, 16])))  # at the bound: fine
    with pytest.raises(RuntimeError, match="exceeds the static bound"):
        compiled(make_fb([3, 40]))
    assert "lengths asserted on the device" in compile_pass.last_report().rewritten[0].reason


@pytest.mark.inductor
def test_checked_false_opts_out():
    compiled = compile_pass.compile(gather_only, max_context_len=16, checked=False, fullgraph=True)
    compiled(make_fb([3, 16]))
    compiled(make_fb([3, 40]))  # past the bound: unspecified values, no assertion, no out-of-bounds access
    assert "asserted" not in compile_pass.last_report().rewritten[0].reason


def _options_seen(monkeypatch):
    from compile_pass import backend

    seen = []
    real = backend.SyncfreeOptions.from_dict

    def spy(options):
        seen.append(dict(options or {}))
        return real(options)

    monkeypatch.setattr(backend.SyncfreeOptions, "from_dict", staticmethod(spy))
    return seen


def test_compile_maps_mode_as_the_backend_does(monkeypatch):
    seen = _options_seen(monkeypatch)
    compile_pass.compile(step, max_context_len=16, mode="reduce-overhead")
    assert seen[-1]["cudagraphs"] is True and "mode" not in seen[-1]
    compile_pass.compile(step, max_context_len=16, mode="reduce-overhead", cudagraphs=False)
    assert seen[-1]["cudagraphs"] is False  # an explicit cudagraphs wins over the mode
    compile_pass.compile(step, max_context_len=16, mode="max-autotune-no-cudagraphs")
    assert seen[-1].get("max_autotune") is True
    compile_pass.compile(step, max_context_len=16)
    assert "cudagraphs" not in seen[-1]  # the option's default: off
    with pytest.raises(RuntimeError, match="Unrecognized mode"):
        compile_pass.compile(step, max_context_len=16, mode="reduce-overhed")


@pytest.mark.inductor
def test_compile_with_reduce_overhead_runs():
    compiled = compile_pass.compile(step, max_context_len=16, mode="reduce-overhead", fullgraph=True)
    torch.testing.assert_close(compiled(make_fb([3, 9])), step(make_fb([3, 9])))
    report = compile_pass.last_report()
    assert report.options["cudagraphs"] is True and report.rewritten


@pytest.mark.inductor
def test_a_missing_bound_under_mode_names_cudagraphs_and_compile_pass_compile():
    compiled = torch.compile(step, backend="syncfree", mode="reduce-overhead", fullgraph=True)
    with _compat.capture_scalar_outputs(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(make_fb([3, 9]))
    report = compile_pass.last_report()
    assert report.kept and not report.rewritten
    syncfree_warnings = [str(w.message) for w in caught if "host sync point(s) kept" in str(w.message)]
    notes = [n for n in report.notes if "without max_context_len" in n]
    assert len(syncfree_warnings) == 1 and len(notes) == 1
    for text in (report.kept[0].reason, notes[0], syncfree_warnings[0]):
        assert "cudagraphs=True" in text and "compile_pass.compile" in text, text


def test_option_validation_names_the_option():
    from compile_pass.options import SyncfreeOptions

    for bad, name in (({"max_context_len": 0}, "max_context_len"), ({"page_size": "4"}, "page_size"),
                      ({"strict": "yes"}, "strict"), ({"cpu_mirrors": {"a": 1}}, "cpu_mirrors")):
        with pytest.raises((TypeError, ValueError), match=name):
            SyncfreeOptions.from_dict(bad)
    with pytest.raises(ValueError, match="max_context_len"):
        compile_pass.compile(lambda x: x, max_context_len=-1)


def test_uuid_changes_with_every_option():
    from compile_pass.options import SyncfreeOptions
    from compile_pass.post_grad_check import SyncFreeCheck

    variants = [{}, {"max_context_len": 64}, {"max_context_len": 128}, {"page_size": 16}, {"strict": True},
                {"checked": False}, {"cudagraphs": True}, {"cpu_mirrors": {"a_cpu": "a"}},
                {"max_autotune": True}]
    uuids = {SyncFreeCheck(SyncfreeOptions.from_dict(v).fingerprint()).uuid() for v in variants}
    assert len(uuids) == len(variants)
    same = SyncFreeCheck(SyncfreeOptions.from_dict({"max_context_len": 64}).fingerprint()).uuid()
    assert same in uuids  # deterministic
