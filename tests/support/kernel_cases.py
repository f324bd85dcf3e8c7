"""Inputs and eager comparisons shared by the kernel tests (kernels/, test_gpu.py): the page-table op's inputs in
every layout and dtype with the eager-indexing reference, and poisoned paged-decode cases."""

import contextlib
from unittest import mock

import torch

import compile_pass.kernels.page_table as page_table_module
from conftest_helpers import interpreting

SENTINEL = -12345
GUARD = 2


# -- the page-table op --------------------------------------------------------------------------------------
def make_inputs(batch, page_size, lengths, width_tokens, table_dtype, index_dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    reqs = batch + 3
    req_to_token = torch.randint(0, 10_000, (reqs, width_tokens), generator=gen).to(table_dtype)
    rpi = torch.randperm(reqs, generator=gen)[:batch].to(index_dtype)
    seq_lens = torch.tensor(lengths, dtype=index_dtype)
    return req_to_token.to(device), rpi.to(device), seq_lens.to(device)


# -- eager indexing: any strides, negative indices wrapped, out-of-range indices never read ----------------

# The paths the op can take on CPU tensors: the vectorized torch fill always, the Triton kernel under
# TRITON_INTERPRET=1 (kernels/test_triton_interpreter.py reruns the kernel tests so).
# kernels/test_page_table_gpu.py runs both on CUDA tensors.
PATHS = ["torch", "triton"] if interpreting() else ["torch"]


@contextlib.contextmanager
def on_path(path):
    """Run the op through `path` ("torch" or "triton") whatever the tensors' device would pick."""
    with mock.patch.object(page_table_module, "use_triton", lambda t: path == "triton"):
        yield


def eager_cells(req_to_token, req_pool_indices, seq_lens, page_size, width):
    """({(b, j): page} for every specified cell, {rows whose index eager rejects}), by a plain loop over
    Python ints that indexes req_to_token exactly as eager does (negative indices wrap, others raise)."""
    cells, rejected = {}, set()
    num_reqs, num_tokens = req_to_token.shape
    for b in range(req_pool_indices.shape[0]):
        idx = int(req_pool_indices[b])
        try:
            row = req_to_token[idx]  # eager indexing: wraps -R <= idx < 0, raises IndexError otherwise
        except IndexError:
            assert not -num_reqs <= idx < num_reqs
            rejected.add(b)
            continue
        length = max(int(seq_lens[b]), 0)
        n = min(-(-length // page_size), width, -(-num_tokens // page_size))
        for j in range(n):
            cells[(b, j)] = int(row[j * page_size]) // page_size
    return cells, rejected


def assert_functional_as_eager(req_to_token, rpi, seq_lens, page_size, max_pages):
    out = torch.ops.syncfree.page_table(req_to_token, rpi, seq_lens, page_size, max_pages)
    assert out.shape == (rpi.shape[0], max_pages) and out.dtype == torch.int32
    expect, _ = eager_cells(req_to_token.cpu(), rpi.cpu(), seq_lens.cpu(), page_size, max_pages)
    got = out.cpu().tolist()
    wrong = {key: (got[key[0]][key[1]], page) for key, page in expect.items() if got[key[0]][key[1]] != page}
    assert not wrong, f"(b, j): (got, eager) {dict(list(wrong.items())[:8])}"


def assert_inplace_as_eager(req_to_token, rpi, seq_lens, page_size, width):
    """Only the specified cells change: a row eager rejects keeps the sentinel, as do the guards around."""
    batch = rpi.shape[0]
    full = torch.full((batch + 2 * GUARD, width + GUARD), SENTINEL, dtype=torch.int32, device=req_to_token.device)
    torch.ops.syncfree.page_table_(full[GUARD:, :width], req_to_token, rpi, seq_lens, page_size)
    expect, _ = eager_cells(req_to_token.cpu(), rpi.cpu(), seq_lens.cpu(), page_size, width)
    got = full.cpu().tolist()
    for r in range(len(got)):
        for c in range(len(got[0])):
            want = expect.get((r - GUARD, c), SENTINEL)
            assert got[r][c] == want, f"cell {(r - GUARD, c)}: got {got[r][c]}, want {want}"


INDEX_LAYOUTS = ["contiguous", "column", "expanded", "step2"]
TABLE_LAYOUTS = ["contiguous", "column_slice", "step2_columns", "step2_rows", "transposed", "expanded_rows"]


def lay_out_index(values, layout, gen, junk_high, device="cpu"):
    """A 1-D index tensor on `device` holding `values` (or, expanded, values[0] everywhere) in `layout`. The
    memory between the elements holds junk in [-junk_high, junk_high), so reading it as if contiguous gives
    wrong rows. The view is taken on the device (`.to()` would make a gapped view contiguous)."""
    batch = values.shape[0]
    if layout == "contiguous":
        return values.to(device)
    if layout == "expanded":  # stride 0: one element seen B times
        return values[:1].to(device).expand(batch)
    if layout == "column":  # meta[:, 1] of a [B, 3] metadata matrix: stride 3, storage offset 1
        meta = torch.randint(-junk_high, junk_high, (batch, 3), generator=gen).to(values.dtype)
        meta[:, 1] = values
        return meta.to(device)[:, 1]
    if layout == "step2":  # base[1::2]: stride 2, storage offset 1
        base = torch.randint(-junk_high, junk_high, (2 * batch + 1,), generator=gen).to(values.dtype)
        base[1::2] = values
        return base.to(device)[1::2]
    raise ValueError(layout)


def lay_out_table(table, layout, gen, device="cpu"):
    """req_to_token on `device` holding `table`'s values (expanded: its first row in every row) in `layout`."""
    reqs, tokens = table.shape
    junk = lambda *shape: torch.randint(-10**6, 10**6, shape, generator=gen).to(table.dtype)  # noqa: E731
    if layout == "contiguous":
        return table.to(device)
    if layout == "column_slice":  # a column slice of a wider table: row stride > width, storage offset 3
        wide = junk(reqs, tokens + 7)
        wide[:, 3:3 + tokens] = table
        return wide.to(device)[:, 3:3 + tokens]
    if layout == "step2_columns":
        wide = junk(reqs, 2 * tokens)
        wide[:, ::2] = table
        return wide.to(device)[:, ::2]
    if layout == "step2_rows":
        tall = junk(2 * reqs, tokens)
        tall[1::2] = table
        return tall.to(device)[1::2]
    if layout == "transposed":  # column-major: strides (1, R)
        return table.t().contiguous().to(device).t()
    if layout == "expanded_rows":  # row stride 0
        return table[:1].to(device).expand(reqs, tokens)
    raise ValueError(layout)


def make_eager_case(gen, batch, num_reqs, tokens, lengths, indices, table_dtype, index_dtype, index_layout,
                    lens_layout, table_layout, device="cpu"):
    table = torch.randint(-40, 10_000, (num_reqs, tokens), generator=gen).to(table_dtype)
    r2t = lay_out_table(table, table_layout, gen, device)
    # Junk around the indices is mostly out of range, around the lengths mostly past the table.
    rpi = lay_out_index(torch.tensor(indices, dtype=index_dtype), index_layout, gen, 10**6, device)
    lens = lay_out_index(torch.tensor(lengths, dtype=index_dtype), lens_layout, gen, 10**4, device)
    return r2t, rpi, lens


# (index layout, lengths layout, req_to_token layout): every layout of each, in a few combinations.
LAYOUT_CASES = [
    ("column", "column", "contiguous"),
    ("expanded", "expanded", "contiguous"),
    ("step2", "step2", "contiguous"),
    ("contiguous", "column", "column_slice"),
    ("column", "contiguous", "step2_columns"),
    ("step2", "expanded", "transposed"),
    ("expanded", "step2", "step2_rows"),
    ("contiguous", "contiguous", "expanded_rows"),
]
DTYPE_CASES = [(torch.int32, torch.int32), (torch.int64, torch.int64), (torch.int32, torch.int64)]


def check_layout_case(path, page_size, layouts, dtypes, device="cpu"):
    index_layout, lens_layout, table_layout = layouts
    gen = torch.Generator().manual_seed(page_size * 131 + LAYOUT_CASES.index(layouts))
    batch, num_reqs, tokens, max_pages = 7, 5, 50, 6
    # Negative, duplicate and in-range indices; lengths 0, negative, inside, past the table and past max_pages.
    indices = [-1, 2, -5, 2, 4, 0, -3]
    lengths = [0, 1, page_size * 3 + 1, tokens + 9, max_pages * page_size + 5, -2, 10**6]
    r2t, rpi, lens = make_eager_case(gen, batch, num_reqs, tokens, lengths, indices, *dtypes, index_layout,
                                     lens_layout, table_layout, device)
    for t, layout in ((rpi, index_layout), (lens, lens_layout), (r2t, table_layout)):
        assert t.device.type == torch.device(device).type and t.is_contiguous() == (layout == "contiguous")
    with on_path(path):
        assert_functional_as_eager(r2t, rpi, lens, page_size, max_pages)
        assert_inplace_as_eager(r2t, rpi, lens, page_size, max_pages)


# -- paged decode -----------------------------------------------------------------------------------------
def make_case(batch, sq, hq, hkv, dim, page_size, lengths, dtype=torch.float32, seed=0, poison=True, width=None):
    gen = torch.Generator().manual_seed(seed)
    width = width or max(1, max(-(-max(lengths) // page_size), 1) + 1)
    num_pages = batch * width + 4
    q = torch.randn(batch, sq, hq, dim, generator=gen).to(dtype)
    k = torch.randn(num_pages, page_size, hkv, dim, generator=gen).to(dtype)
    v = torch.randn(num_pages, page_size, hkv, dim, generator=gen).to(dtype)
    table = torch.randperm(num_pages, generator=gen)[: batch * width].view(batch, width).to(torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    if poison:
        # Pages past each row's length hold NaN, and the table's dead columns point anywhere (even out of range).
        for b in range(batch):
            used = -(-max(lengths[b], 0) // page_size)
            for j in range(used, width):
                k[table[b, j]] = float("nan")
                v[table[b, j]] = float("nan")
            # Slots after the length inside the last used page are poisoned too: never read.
            if lengths[b] % page_size and used:
                last = table[b, used - 1]
                k[last, lengths[b] % page_size:] = float("nan")
                v[last, lengths[b] % page_size:] = float("nan")
            table[b, used:] = 10**8
    return q, k, v, table, lens
