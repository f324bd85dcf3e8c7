"""The page-table kernel (torch.ops.syncfree.page_table and page_table_) on CPU: the torch fill, and the Triton
kernel under TRITON_INTERPRET=1 (kernels/test_triton_interpreter.py reruns this file so), against the plain-loop
reference and eager indexing (support/kernel_cases.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest_helpers import examples
from kernel_cases import (
    DTYPE_CASES,
    GUARD,
    INDEX_LAYOUTS,
    LAYOUT_CASES,
    PATHS,
    SENTINEL,
    TABLE_LAYOUTS,
    assert_functional_as_eager,
    assert_inplace_as_eager,
    check_layout_case,
    make_eager_case,
    make_inputs,
    on_path,
)

from compile_pass.kernels.page_table import live_pages
from reference import page_table_cells


def check_inplace(req_to_token, rpi, seq_lens, page_size, width):
    batch = rpi.shape[0]
    # Guard rows above and below and guard columns to the right: the op must write none of them.
    full = torch.full((batch + 2 * GUARD, width + GUARD), SENTINEL, dtype=torch.int32, device=req_to_token.device)
    buf = full[GUARD:, :width]
    torch.ops.syncfree.page_table_(buf, req_to_token, rpi, seq_lens, page_size)
    expect = page_table_cells(req_to_token.cpu(), rpi.cpu(), seq_lens.cpu(), page_size, width)
    got = full.cpu()
    for r in range(full.shape[0]):
        for c in range(full.shape[1]):
            key = (r - GUARD, c)
            if key in expect and c < width:
                assert got[r, c] == expect[key], (r, c)
            else:
                assert got[r, c] == SENTINEL, f"cell {(r, c)} outside the live columns was written"


def check_functional(req_to_token, rpi, seq_lens, page_size, max_pages):
    out = torch.ops.syncfree.page_table(req_to_token, rpi, seq_lens, page_size, max_pages)
    assert out.shape == (rpi.shape[0], max_pages) and out.dtype == torch.int32
    expect = page_table_cells(req_to_token.cpu(), rpi.cpu(), seq_lens.cpu(), page_size, max_pages)
    out = out.cpu()
    for (b, j), page in expect.items():
        assert out[b, j] == page, (b, j)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("layouts", LAYOUT_CASES, ids="-".join)
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=lambda d: f"r2t_{d[0]}-idx_{d[1]}".replace("torch.", ""))
def test_strided_expanded_and_negative_inputs_index_as_eager(path, page_size, layouts, dtypes):
    check_layout_case(path, page_size, layouts, dtypes)


@pytest.mark.parametrize("path", PATHS)
def test_negative_indices_wrap_as_eager(path):
    r2t = torch.arange(4 * 6).reshape(4, 6)  # row r holds 6r, 6r+1, ...
    rpi = torch.tensor([-1, -4, 3, -2])
    lens = torch.tensor([6, 6, 6, 6])
    with on_path(path):
        out = torch.ops.syncfree.page_table(r2t, rpi, lens, 1, 6)
    assert torch.equal(out, (r2t[rpi] // 1).int()), out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("checked", [False, True])
def test_out_of_range_indices_read_nothing_and_checked_mode_asserts(path, checked):
    gen = torch.Generator().manual_seed(7)
    r2t = torch.randint(0, 1000, (4, 12), generator=gen)
    # Out of range both ways (4 and -5 with R = 4), one on a zero-length row, one in a column of a matrix.
    meta = torch.tensor([[2, 0], [4, 0], [-5, 0], [10**12, 0], [-1, 0], [7, 0]])
    rpi, lens = meta[:, 0], torch.tensor([12, 12, 5, 0, 7, 0])
    with pytest.raises(IndexError):
        r2t[rpi, :12]  # eager rejects these indices, whatever the lengths
    with on_path(path):
        if checked:
            with pytest.raises(RuntimeError, match="req_pool_indices"):
                torch.ops.syncfree.page_table(r2t, rpi, lens, 2, 6, checked=True)
            with pytest.raises(RuntimeError, match="req_pool_indices"):
                torch.ops.syncfree.page_table_(torch.zeros(6, 6, dtype=torch.int32), r2t, rpi, lens, 2,
                                               checked=True)
            # A zero-length row with a bad index trips the assertion too: eager checks every index.
            with pytest.raises(RuntimeError, match="req_pool_indices"):
                torch.ops.syncfree.page_table(r2t, rpi[3:4], lens[3:4], 2, 6, checked=True)
            torch.ops.syncfree.page_table(r2t, rpi[[0, 4]], lens[[0, 4]], 2, 6, checked=True)  # in range: fine
        else:
            assert_functional_as_eager(r2t, rpi, lens, 2, 6)
            assert_inplace_as_eager(r2t, rpi, lens, 2, 6)


@pytest.mark.parametrize("path", PATHS)
def test_a_table_without_rows_or_tokens_reads_nothing(path):
    with on_path(path):
        for r2t in (torch.zeros(0, 8, dtype=torch.int32), torch.zeros(3, 0, dtype=torch.int32)):
            rpi, lens = torch.tensor([0, -1, 2]), torch.tensor([5, 8, 0])
            assert_inplace_as_eager(r2t, rpi, lens, 2, 4)
            assert torch.ops.syncfree.page_table(r2t, rpi, lens, 2, 4).shape == (3, 4)


@settings(max_examples=examples(80), deadline=None)
@given(
    path=st.sampled_from(PATHS),
    batch=st.integers(1, 6),
    num_reqs=st.integers(1, 6),
    tokens=st.integers(1, 40),
    page_size=st.sampled_from([1, 2, 3, 16]),
    max_pages=st.integers(1, 9),
    table_dtype=st.sampled_from([torch.int32, torch.int64]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    index_layout=st.sampled_from(INDEX_LAYOUTS),
    lens_layout=st.sampled_from(INDEX_LAYOUTS),
    table_layout=st.sampled_from(TABLE_LAYOUTS),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_property_eager_indexing(path, batch, num_reqs, tokens, page_size, max_pages, table_dtype, index_dtype,
                                 index_layout, lens_layout, table_layout, seed, data):
    # Indices mostly in [-R, R) (negative and duplicate ones included), sometimes out of range either way.
    index = st.one_of(st.integers(-num_reqs, num_reqs - 1),
                      st.sampled_from([num_reqs, num_reqs + 3, -num_reqs - 1, 2**31 - 1, -2**31]))
    indices = data.draw(st.lists(index, min_size=batch, max_size=batch))
    length = st.one_of(st.integers(-3, tokens + 2 * page_size),
                       st.sampled_from([0, tokens, tokens + 1, max_pages * page_size, max_pages * page_size + 1,
                                        2**31 - 1]))
    lengths = data.draw(st.lists(length, min_size=batch, max_size=batch))
    gen = torch.Generator().manual_seed(seed)
    r2t, rpi, lens = make_eager_case(gen, batch, num_reqs, tokens, lengths, indices, table_dtype, index_dtype,
                                     index_layout, lens_layout, table_layout)
    with on_path(path):
        assert_functional_as_eager(r2t, rpi, lens, page_size, max_pages)
        assert_inplace_as_eager(r2t, rpi, lens, page_size, max_pages)


# -- the original contract tests ----------------------------------------------------------------------------

def test_inplace_writes_only_live_columns():
    r2t, rpi, lens = make_inputs(4, 4, [0, 5, 16, 99], 40, torch.int32, torch.int64)
    check_inplace(r2t, rpi, lens, 4, 6)


def test_functional_live_columns_and_shape():
    r2t, rpi, lens = make_inputs(3, 3, [1, 7, 30], 30, torch.int64, torch.int32)
    check_functional(r2t, rpi, lens, 3, 5)


def test_negative_lengths_and_padded_rows_read_nothing():
    r2t, _, _ = make_inputs(2, 2, [0, 0], 8, torch.int32, torch.int64)
    rpi = torch.tensor([10**9, 0])  # an out-of-range request index in a row of length <= 0 is never read
    lens = torch.tensor([-5, 0])
    buf = torch.full((2, 4), SENTINEL, dtype=torch.int32)
    torch.ops.syncfree.page_table_(buf, r2t, rpi, lens, 2)
    assert (buf == SENTINEL).all()


def test_floor_division_of_negative_tokens():
    r2t = torch.tensor([[-7, -8, -1, 5]])
    out = torch.ops.syncfree.page_table(r2t, torch.tensor([0]), torch.tensor([4]), 1, 4)
    assert out.tolist() == [[-7, -8, -1, 5]]
    out = torch.ops.syncfree.page_table(r2t, torch.tensor([0]), torch.tensor([4]), 3, 2)
    assert out[0, :2].tolist() == [-7 // 3, 5 // 3]


def test_live_pages_matches_contract():
    n = live_pages(torch.tensor([-1, 0, 1, 16, 17, 1000]), 16, 3, 40)
    assert n.tolist() == [0, 0, 1, 1, 2, 3]


lengths_strategy = st.integers(min_value=-3, max_value=90)


@settings(max_examples=examples(60), deadline=None)
@given(
    batch=st.integers(1, 6),
    page_size=st.sampled_from([1, 2, 3, 4, 7, 16]),
    width=st.integers(1, 12),
    width_tokens=st.integers(1, 70),
    table_dtype=st.sampled_from([torch.int32, torch.int64]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_property_against_loop(batch, page_size, width, width_tokens, table_dtype, index_dtype, data):
    lengths = data.draw(st.lists(st.one_of(lengths_strategy, st.sampled_from([0, page_size, 2 * page_size,
                                                                              width * page_size + 5])),
                                 min_size=batch, max_size=batch))
    r2t, rpi, lens = make_inputs(batch, page_size, lengths, width_tokens, table_dtype, index_dtype)
    check_inplace(r2t, rpi, lens, page_size, width)
    check_functional(r2t, rpi, lens, page_size, width)


def test_opcheck():
    # Every row fills the width: opcheck compares whole outputs, and the functional op's tail is unspecified.
    r2t, rpi, lens = make_inputs(3, 4, [32, 33, 40], 32, torch.int32, torch.int64)
    torch.library.opcheck(torch.ops.syncfree.page_table.default, (r2t, rpi, lens, 4, 8))
    buf = torch.zeros(4, 8, dtype=torch.int32)
    torch.library.opcheck(torch.ops.syncfree.page_table_.default, (buf, r2t, rpi, lens, 4))


def test_fake_tracing_keeps_static_shape():
    r2t, rpi, lens = make_inputs(3, 4, [3, 9, 0], 32, torch.int32, torch.int64)
    shapes = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target in (torch.ops.syncfree.page_table, torch.ops.syncfree.page_table.default):
                shapes.append(tuple(node.meta["example_value"].shape))
        return gm

    fn = torch.compile(lambda a, b, c: torch.ops.syncfree.page_table(a, b, c, 4, 8) + 0, backend=backend,
                       fullgraph=True)
    assert fn(r2t, rpi, lens).shape == (3, 8)
    assert shapes == [(3, 8)]


def test_checked_mode_trips_device_assert():
    r2t, rpi, lens = make_inputs(2, 4, [3, 33], 40, torch.int32, torch.int64)
    torch.ops.syncfree.page_table(r2t, rpi, torch.tensor([3, 32]), 4, 8, checked=True)  # exactly at the bound
    with pytest.raises(RuntimeError, match="static bound"):
        torch.ops.syncfree.page_table(r2t, rpi, lens, 4, 8, checked=True)
    with pytest.raises(RuntimeError, match="static bound"):
        torch.ops.syncfree.page_table_(torch.zeros(2, 8, dtype=torch.int32), r2t, rpi, lens, 4, checked=True)


BAD = [
    (dict(req_to_token=torch.zeros(2, 8)), TypeError, "req_to_token"),
    (dict(req_pool_indices=torch.zeros(2, dtype=torch.bool)), TypeError, "req_pool_indices"),
    (dict(seq_lens=torch.zeros(2)), TypeError, "seq_lens"),
    (dict(req_to_token=torch.zeros(8, dtype=torch.int32)), ValueError, "req_to_token"),
    (dict(seq_lens=torch.zeros(2, 1, dtype=torch.int64)), ValueError, "seq_lens"),
    (dict(seq_lens=torch.zeros(3, dtype=torch.int64)), ValueError, "seq_lens"),
    (dict(page_size=0), ValueError, "page_size"),
    (dict(max_pages=0), ValueError, "max_pages"),
]


def _good():
    return dict(req_to_token=torch.zeros(4, 8, dtype=torch.int32), req_pool_indices=torch.tensor([0, 1]),
                seq_lens=torch.tensor([1, 2]), page_size=2, max_pages=4)


@pytest.mark.parametrize("bad,exc,name", BAD)
def test_bad_input_names_the_argument(bad, exc, name):
    kw = {**_good(), **bad}
    with pytest.raises(exc, match=name):
        torch.ops.syncfree.page_table(**kw)
    # The fake implementation checks too: tracing fails the same way.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(exc, match=name):
        torch.ops.syncfree.page_table(**kw)


@pytest.mark.parametrize("buf,exc,name", [
    (torch.zeros(2, 4, dtype=torch.int64), TypeError, "page_table"),
    (torch.zeros(1, 4, dtype=torch.int32), ValueError, "page_table"),
    (torch.zeros(8, dtype=torch.int32), ValueError, "page_table"),
])
def test_bad_buffer_names_the_argument(buf, exc, name):
    g = _good()
    with pytest.raises(exc, match=name):
        torch.ops.syncfree.page_table_(buf, g["req_to_token"], g["req_pool_indices"], g["seq_lens"], 2)


def test_device_mismatch_names_the_argument():
    g = _good()
    meta = torch.tensor([1, 2], device="meta")
    with pytest.raises(ValueError, match="seq_lens"):
        torch.ops.syncfree.page_table(g["req_to_token"], g["req_pool_indices"], meta, 2, 4)
