import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest_helpers import examples, interpreting
from kernel_cases import make_case
from reference import attention_f64


def check(case, atol, scale=None):
    q, k, v, table, lens = case
    out = torch.ops.syncfree.paged_decode(q, k, v, table, lens, scale)
    safe_table = table.clamp(max=k.shape[0] - 1)  # the reference gathers only live columns anyway
    ref = attention_f64(q, k, v, safe_table, lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("sq", [1, 2, 4])
def test_against_float64_reference(page_size, sq):
    case = make_case(3, sq, 4, 2, 16, page_size, [1, 20, 37], seed=page_size * 10 + sq)
    check(case, atol=1e-5)


def test_zero_length_rows_and_short_rows_give_zeros():
    q, k, v, table, lens = make_case(2, 3, 2, 1, 8, 2, [0, 2])
    out = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
    assert (out[0] == 0).all()
    assert (out[1, 0] == 0).all()  # query 0 sits at position -1: sees nothing


def test_custom_scale():
    check(make_case(2, 1, 4, 4, 8, 4, [5, 9], seed=3), atol=1e-5, scale=0.3)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision(dtype, atol):
    if dtype is torch.bfloat16 and interpreting():
        pytest.skip("the Triton interpreter has no bfloat16 (numpy lacks it); the H200 run covers bf16")
    check(make_case(2, 2, 8, 2, 32, 4, [7, 30], dtype=dtype, seed=5), atol=atol)


@settings(max_examples=examples(25), deadline=None)
@given(
    batch=st.integers(1, 3), sq=st.integers(1, 4), group=st.sampled_from([1, 2, 4]), hkv=st.integers(1, 2),
    dim=st.sampled_from([8, 16, 24]), page_size=st.sampled_from([1, 3, 16]), data=st.data(),
)
def test_property_random_shapes(batch, sq, group, hkv, dim, page_size, data):
    lengths = data.draw(st.lists(st.integers(1, 48), min_size=batch, max_size=batch))
    check(make_case(batch, sq, hkv * group, hkv, dim, page_size, lengths, seed=sum(lengths)), atol=1e-5)


def test_opcheck():
    q, k, v, table, lens = make_case(2, 1, 4, 2, 16, 4, [5, 9], poison=False)
    torch.library.opcheck(torch.ops.syncfree.paged_decode.default, (q, k, v, table, lens))


def _good():
    q, k, v, table, lens = make_case(2, 1, 4, 2, 16, 4, [5, 9], poison=False)
    return dict(q=q, k_cache=k, v_cache=v, page_table=table, cache_seqlens=lens)


@pytest.mark.parametrize("change,exc,name", [
    (lambda g: dict(q=g["q"].int()), TypeError, "q"),
    (lambda g: dict(k_cache=g["k_cache"][0]), ValueError, "k_cache"),
    (lambda g: dict(v_cache=g["v_cache"].half()), TypeError, "v_cache"),
    (lambda g: dict(page_table=g["page_table"].float()), TypeError, "page_table"),
    (lambda g: dict(cache_seqlens=g["cache_seqlens"][:1]), ValueError, "cache_seqlens"),
    (lambda g: dict(q=g["q"][:, :, :3]), ValueError, "heads"),
    (lambda g: dict(cache_seqlens=g["cache_seqlens"].to("meta")), ValueError, "cache_seqlens"),
])
def test_bad_input_names_the_argument(change, exc, name):
    g = _good()
    g.update(change(g))
    with pytest.raises(exc, match=name):
        torch.ops.syncfree.paged_decode(**g)


def test_registered_as_self_guarding_consumer():
    import compile_pass

    entry = compile_pass.registered_consumers()["syncfree::paged_decode.default"]
    assert (entry.page_table, entry.lengths) == ("page_table", "cache_seqlens")


def test_default_scale_is_inverse_sqrt_dim():
    q, k, v, table, lens = make_case(1, 1, 2, 2, 16, 4, [6], poison=False)
    a = torch.ops.syncfree.paged_decode(q, k, v, table, lens)
    b = torch.ops.syncfree.paged_decode(q, k, v, table, lens, 1 / math.sqrt(16))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("sms", [0, 1, 5, 12])
@pytest.mark.parametrize("sq", [1, 3])
def test_split_keys_and_combine_against_float64(monkeypatch, sms, sq):
    # The split kernel and the combine kernel: a device of `sms` SMs splits each row's keys (0: one split, the
    # kernel writes the output itself). Rows of 0 keys, of fewer keys than a split, and
    # splits that get no key at all (short rows) must all combine to the reference.
    if not interpreting():
        pytest.skip("the Triton kernels run here only under TRITON_INTERPRET=1 (test_triton_interpreter runs it)")
    import compile_pass.kernels.paged_decode as pd

    monkeypatch.setattr(pd, "sm_count", lambda t: sms)
    monkeypatch.setitem(pd.TUNING, "block_n", 16)
    monkeypatch.setitem(pd.TUNING, "programs_per_sm", 8)
    monkeypatch.setitem(pd.TUNING, "split_below_rows_per_sm", 2)
    monkeypatch.setitem(pd.TUNING, "min_blocks_per_split", 1)
    monkeypatch.setitem(pd.TUNING, "combine_block_s", 4)  # several chunks of splits in the combine
    lengths = [0, 2, 45, 300]
    case = make_case(4, sq, 8, 2, 16, 4, lengths, seed=sms + sq)
    splits = pd.num_splits_for(4, 2, case[3].shape[1] * 4, sms)
    assert splits == {0: 1, 1: 1, 5: 5, 12: 12}[sms], splits  # 8 (row, head) programs fill 1 SM (2 per SM) but not 5
    check(case, atol=1e-5)


def _force_short(monkeypatch, sms, heads=64, block_n=16, min_keys=16, programs_per_sm=8, block_s=4):
    """The short path (one program per (row, group of KV heads, split), then the combine kernel) on a device of
    `sms` SMs (0: one split, the kernel writes the output itself), `heads` KV heads per program (clamped to Hkv:
    64 is all of them), with small blocks so that the interpreter's small shapes still split into several key
    blocks per split and several chunks of splits in the combine."""
    if not interpreting():
        pytest.skip("the Triton kernels run here only under TRITON_INTERPRET=1 (test_triton_interpreter runs it)")
    import compile_pass.kernels.paged_decode as pd

    monkeypatch.setattr(pd, "sm_count", lambda t: sms)
    monkeypatch.setitem(pd.SHORT_TUNING, "path", "short")
    monkeypatch.setitem(pd.SHORT_TUNING, "heads_per_program", heads)
    monkeypatch.setitem(pd.SHORT_TUNING, "block_n", block_n)
    monkeypatch.setitem(pd.SHORT_TUNING, "programs_per_sm", programs_per_sm)
    monkeypatch.setitem(pd.SHORT_TUNING, "min_keys_per_split", min_keys)
    monkeypatch.setitem(pd.SHORT_TUNING, "max_splits", 64)
    monkeypatch.setitem(pd.SHORT_TUNING, "combine_block_s", block_s)
    return pd


@pytest.mark.parametrize("heads", [1, 2, 64])
@pytest.mark.parametrize("sms", [0, 2, 6])
@pytest.mark.parametrize("sq", [1, 4])
def test_short_path_against_float64(monkeypatch, heads, sms, sq):
    # 4 KV heads in programs of 1, 2 or all 4 of them; one split (the kernel writes the output) or several. Rows
    # of 0 keys, of fewer keys than Sq (queries that see nothing), of fewer keys than a split, splits with no key
    # at all and a split count that is not a multiple of the combine's chunk of splits (4) must all give the
    # reference; poisoned pages and table columns past each row's length are never read.
    pd = _force_short(monkeypatch, sms, heads=heads)
    lengths = [0, 2, 45, 200]
    case = make_case(4, sq, 8, 4, 16, 4, lengths, seed=100 + heads + sms + sq)
    groups = 4 // min(heads, 4)
    splits = pd.short_splits_for(4, 4, case[3].shape[1] * 4, sms)
    assert splits == {0: 1, 2: cdiv(16, 4 * groups), 6: cdiv(48, 4 * groups)}[sms], splits
    check(case, atol=1e-5)


def cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("sq", [1, 4])
def test_short_path_page_sizes_and_target_verify(monkeypatch, page_size, sq):
    _force_short(monkeypatch, 3, heads=2)
    case = make_case(3, sq, 4, 2, 16, page_size, [1, 20, 137], seed=7 * page_size + sq)
    check(case, atol=1e-5)


@pytest.mark.parametrize("group,hkv,heads", [(1, 3, 2), (4, 2, 64), (8, 1, 64), (2, 3, 64)])
def test_short_path_gqa_groups(monkeypatch, group, hkv, heads):
    # Hkv 3 in programs of 2 heads (the second program's second lane is past Hkv) and of all 3 (a power-of-two
    # tile of 4 lanes, one masked); a group of 8 queries per KV head.
    _force_short(monkeypatch, 3, heads=heads, block_n=32, min_keys=32)
    check(make_case(2, 2, group * hkv, hkv, 24, 5, [77, 130], seed=group + hkv), atol=1e-5)


@pytest.mark.parametrize("sms", [0, 4])
def test_short_path_strided_inputs(monkeypatch, sms):
    # Non-contiguous q (heads-major storage), k in [page, head, slot, D] storage, v with a padded head dim, a
    # column-major page table and strided int64 lengths: the same values, the same output.
    _force_short(monkeypatch, sms, heads=2)
    q, k, v, table, lens = make_case(3, 2, 8, 4, 16, 4, [9, 0, 70], seed=21)
    q2 = q.transpose(1, 2).contiguous().transpose(1, 2)
    k2 = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    v2 = torch.full(v.shape[:3] + (24,), float("nan"))
    v2[..., :16] = v
    v2 = v2[..., :16]
    table2 = table.t().contiguous().t()
    lens2 = torch.stack([lens.long(), torch.full_like(lens.long(), 10**6)], 1)[:, 0]
    assert not (q2.is_contiguous() or k2.is_contiguous() or v2.is_contiguous() or table2.is_contiguous()
                or lens2.is_contiguous())
    out = torch.ops.syncfree.paged_decode(q2, k2, v2, table2, lens2)
    ref = attention_f64(q, k, v, table.clamp(max=k.shape[0] - 1), lens, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_short_path_lengths_past_the_table(monkeypatch):
    # Lengths beyond what the table addresses are clamped to it (nothing past the table is read); negative ones
    # are 0. Then calls with other split counts on the same device: no state is carried from call to call.
    pd = _force_short(monkeypatch, 4)
    q, k, v, table, _ = make_case(3, 1, 4, 2, 16, 16, [64, 64, 64], seed=11, width=4, poison=False)
    out = torch.ops.syncfree.paged_decode(q, k, v, table, torch.tensor([10**6, -3, 64], dtype=torch.int32))
    ref = attention_f64(q, k, v, table, torch.tensor([64, 0, 64], dtype=torch.int32), None)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    for sms in (9, 1):
        monkeypatch.setattr(pd, "sm_count", lambda t, sms=sms: sms)
        check(make_case(2, 3, 8, 4, 8, 2, [33, 9], seed=12 + sms), atol=1e-5)


def test_short_path_half_precision(monkeypatch):
    _force_short(monkeypatch, 5, heads=2)
    check(make_case(2, 2, 8, 4, 32, 4, [7, 90], dtype=torch.float16, seed=5), atol=2e-3)


def test_short_launch_fits_shared_memory(monkeypatch):
    import compile_pass.kernels.paged_decode as pd

    monkeypatch.setitem(pd.SHORT_TUNING, "heads_per_program", 8)
    monkeypatch.setitem(pd.SHORT_TUNING, "block_n", 64)
    smem = 227 << 10
    # bf16, D 128: 8 heads x 64 keys (288 KB) do not fit; 8 x 32 (160 KB) do.
    assert pd.short_heads_and_block(8, 16, 128, 2, smem) == (8, 32)
    assert pd.short_heads_and_block(2, 16, 128, 2, smem) == (2, 64)  # clamped to Hkv, then it fits
    # fp32: 8 heads x 16 keys take 256 KB, 4 heads 128 KB.
    assert pd.short_heads_and_block(8, 16, 128, 4, smem) == (4, 16)
    assert pd.short_heads_and_block(8, 16, 128, 2, 36 << 10) == (1, 16)  # a small device: 1 head x 16 keys
    monkeypatch.setitem(pd.SHORT_TUNING, "block_n", 24)  # not a power of two: the next one
    assert pd.short_heads_and_block(1, 16, 128, 2, smem) == (1, 32)


def test_short_splits_rule(monkeypatch):
    import compile_pass.kernels.paged_decode as pd

    for key, value in dict(heads_per_program=8, programs_per_sm=1, min_keys_per_split=32, max_splits=128).items():
        monkeypatch.setitem(pd.SHORT_TUNING, key, value)
    assert pd.short_splits_for(1, 8, 4096, 132) == 128  # 132 wanted, at least 32 keys per split
    assert pd.short_splits_for(1, 8, 65536, 132) == 128  # max_splits
    assert pd.short_splits_for(4, 8, 8192, 132) == 33
    assert pd.short_splits_for(1, 8, 8192, 132, heads_per_program=2) == 33  # 4 head groups per row
    assert pd.short_splits_for(64, 8, 4096, 132) == 3
    assert pd.short_splits_for(1, 8, 4096, 0) == 1  # no SM count (the interpreter): one split
    assert pd.short_splits_for(1, 8, 10, 132) == 1


def test_short_path_selected_by_shape(monkeypatch):
    import compile_pass.kernels.paged_decode as pd

    monkeypatch.setitem(pd.SHORT_TUNING, "path", "auto")
    sms = 132
    assert pd.use_short_path(1, 8, 8192, sms) and pd.use_short_path(4, 8, 8192, sms)
    assert not pd.use_short_path(64, 8, 4096, sms)  # B x Hkv fills the device: the direct path, unchanged
    assert not pd.use_short_path(1, 8, pd.SHORT_TUNING["max_keys"] + 1, sms)  # long tables: split + combine
    assert not pd.use_short_path(1, 8, 4096, 0)  # the interpreter / CPU: only when forced
    monkeypatch.setitem(pd.SHORT_TUNING, "path", "short")
    assert pd.use_short_path(64, 8, 4096, sms)
    monkeypatch.setitem(pd.SHORT_TUNING, "path", "split")
    assert not pd.use_short_path(1, 8, 4096, sms)


@pytest.mark.parametrize("sms", [0, 4])
def test_split_path_reads_strided_lengths(monkeypatch, sms):
    """The split kernel reads cache_seqlens with its stride (a column of a metadata matrix), with one split and
    with several: it once read lengths[b] at offset b and gave wrong rows."""
    from compile_pass.kernels import paged_decode as pd

    monkeypatch.setitem(pd.SHORT_TUNING, "path", "split")
    monkeypatch.setattr(pd, "sm_count", lambda t: sms)
    q, k, v, table, lens = make_case(3, 1, 4, 2, 16, 4, [9, 0, 70], seed=22)
    strided = torch.stack([lens.long(), torch.full_like(lens.long(), 10**6)], 1)[:, 0]
    assert not strided.is_contiguous()
    out = torch.ops.syncfree.paged_decode(q, k, v, table, strided)
    ref = attention_f64(q, k, v, table.clamp(max=k.shape[0] - 1), lens, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
