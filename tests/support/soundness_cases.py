"""Decode-shaped functions where a rewrite would be wrong or the code is tricky, each with what the pass must do.

Every function takes one `Inputs` and returns tensors. `REWRITTEN` cases must lose their host read; `KEPT`
cases must keep it, with a reason containing the given words. Either way the compiled function must compute
exactly what eager does: the differential runner (test_soundness.py) checks values, shapes, dtypes, raised
errors and the inputs each call leaves behind.
"""

from __future__ import annotations

import dataclasses

import torch

import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)

MCL = 64  # the static bound; lengths stay within it unless a case says otherwise
TOKENS = 96  # req_to_token's width: wider than the bound, so a wrong width shows
REQS = 8
SUM = torch.ops.syncfree_test.bounded_sum  # self-guarding: reads ceil(lens[b] / ps) columns; checks its bound
UNGUARDED = torch.ops.syncfree_test.unguarded_sum


@dataclasses.dataclass
class Inputs:
    req_to_token: torch.Tensor  # [REQS, TOKENS] int32
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    seq_lens_cpu: torch.Tensor  # [B] int64, the host mirror
    other_lens: torch.Tensor  # [B] int64, a second lengths tensor (>= seq_lens)
    pool: torch.Tensor  # [16] float: an unrelated buffer (a KV pool stand-in)
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def clone(self) -> "Inputs":
        return Inputs(**{f.name: getattr(self, f.name).clone() for f in dataclasses.fields(self)})

    def tensors(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def make_inputs(lengths, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    r2t = torch.randint(0, 4096, (REQS, TOKENS), generator=gen, dtype=torch.int64).to(torch.int32)
    rpi = torch.randperm(REQS, generator=gen)[:batch]
    lens = torch.tensor(lengths, dtype=torch.int64)
    num_pages = 4096 // 4 + 1
    return Inputs(
        req_to_token=r2t, req_pool_indices=rpi, seq_lens=lens, seq_lens_cpu=lens.clone(),
        other_lens=lens + torch.randint(0, 3, (batch,), generator=gen), pool=torch.randn(16, generator=gen),
        q=torch.randn(batch, 1, 4, 8, generator=gen), k=torch.randn(num_pages, 4, 2, 8, generator=gen),
        v=torch.randn(num_pages, 4, 2, 8, generator=gen),
    )


def table(x: Inputs, m, ps: int = 1):
    t = x.req_to_token[x.req_pool_indices, :m:ps]
    return t // ps if ps > 1 else t


REWRITTEN: dict = {}
KEPT: dict = {}


def rewritten(fn):
    REWRITTEN[fn.__name__] = fn
    return fn


def kept(*words):
    def mark(fn):
        KEPT[fn.__name__] = (fn, words)
        return fn

    return mark


# -- safe: must be rewritten -------------------------------------------------------------------------------
@rewritten
def plain_gather(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m), x.seq_lens, 1, m)


@rewritten
def strided_gather_ps4(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m, 4), x.seq_lens, 4, m)


@rewritten
def explicit_zero_start(x):
    m = x.seq_lens.max().item()
    return SUM(x.req_to_token[x.req_pool_indices, 0:m:4] // 4, x.seq_lens, 4, m)


@rewritten
def int_cast_chain(x):
    m = x.seq_lens.max().item()
    return SUM((x.req_to_token[x.req_pool_indices, :m:4].long() // 4).int(), x.seq_lens, 4, m)


@rewritten
def torch_div_floor(x):
    m = x.seq_lens.max().item()
    t = torch.div(x.req_to_token[x.req_pool_indices, :m:2], 2, rounding_mode="floor")
    return SUM(t.to(torch.int32), x.seq_lens, 2, m)


@rewritten
def contiguous_and_clone(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m, 4).contiguous().clone(), x.seq_lens, 4, m)


@rewritten
def int_of_max(x):
    m = int(x.seq_lens.max())
    return SUM(table(x, m), x.seq_lens, 1, m)


@rewritten
def torch_max_fn(x):
    m = torch.max(x.seq_lens).item()
    return SUM(table(x, m), x.seq_lens, 1, m)


@rewritten
def amax(x):
    m = x.seq_lens.amax().item()
    return SUM(table(x, m), x.seq_lens, 1, m)


@rewritten
def max_dim0_values(x):
    m = x.seq_lens.max(dim=0).values.item()
    return SUM(table(x, m), x.seq_lens, 1, m)


@rewritten
def tolist_max(x):
    m = max(x.seq_lens.tolist())
    return SUM(table(x, m, 4), x.seq_lens, 4, m)


@rewritten
def offset_gather_and_bound(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m + 1, 4), x.seq_lens, 4, m + 3)


@rewritten
def int32_lengths(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m), x.seq_lens.to(torch.int32), 1, m)


@rewritten
def speculative_lengths(x):
    m = x.seq_lens.max().item() + 2
    return SUM(table(x, m, 4), x.seq_lens + 2, 4, m)


@rewritten
def mirror_max_device_lengths(x):
    m = x.seq_lens_cpu.max().item()
    return SUM(table(x, m), x.seq_lens, 1, m)


@rewritten
def two_layers_one_table(x):
    m = x.seq_lens.max().item()
    t = table(x, m, 4)
    return SUM(t, x.seq_lens, 4, m) + SUM(t, x.seq_lens, 4, m)


@rewritten
def one_table_two_lengths(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    return SUM(t, x.seq_lens, 1, m) * 3 + SUM(t, x.seq_lens.to(torch.int32), 1, m)


@rewritten
def paged_decode_attention(x):
    m = x.seq_lens.max().item()
    t = x.req_to_token[x.req_pool_indices, :m:4] // 4
    return torch.ops.syncfree.paged_decode(x.q, x.k, x.v, t.to(torch.int32), x.seq_lens.to(torch.int32))


@rewritten
def write_before_the_max(x):
    x.req_to_token[x.req_pool_indices, 0] = 7
    x.seq_lens.clamp_(max=MCL - 2)
    m = x.seq_lens.max().item()
    return SUM(table(x, m), x.seq_lens, 1, m)


@rewritten
def write_to_an_unrelated_buffer_between(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    x.pool.add_(1)
    return SUM(t, x.seq_lens, 1, m) + x.pool.sum()


@rewritten
def write_after_the_consumer(x):
    m = x.seq_lens.max().item()
    out = SUM(table(x, m), x.seq_lens, 1, m)
    x.req_to_token[x.req_pool_indices, 0] = 3
    x.seq_lens.add_(5)
    return out


@rewritten
def bound_only(x):
    m = x.seq_lens.max().item()
    return SUM(x.req_to_token[x.req_pool_indices, :TOKENS], x.seq_lens, 1, m)


@rewritten
def two_tables_one_max(x):
    m = x.seq_lens.max().item()
    other = x.req_to_token.flip(0)
    return SUM(table(x, m), x.seq_lens, 1, m) + SUM(other[x.req_pool_indices, :m], x.seq_lens, 1, m)


@rewritten
def numpy_max_of_the_mirror(x):
    m = int(x.seq_lens_cpu.numpy().max())
    return SUM(table(x, m), x.seq_lens, 1, m)


# -- unsafe or unrecognised: must be kept ---------------------------------------------------------------
@kept("written in place")
def table_written_between_gather_and_consumer(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    x.req_to_token[x.req_pool_indices] = x.req_to_token[x.req_pool_indices] + 1
    return SUM(t, x.seq_lens, 1, m)


@kept("written in place")
def indices_copied_between(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    x.req_pool_indices.copy_(x.req_pool_indices.flip(0))
    return SUM(t, x.seq_lens, 1, m)


@kept("written in place")
def index_put_between(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    x.req_to_token.index_put_((x.req_pool_indices,), torch.zeros(TOKENS, dtype=torch.int32))
    return SUM(t, x.seq_lens, 1, m)


@kept("written in place")
def write_through_a_view_between(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    x.req_to_token[:, 0:4].fill_(1)
    return SUM(t, x.seq_lens, 1, m)


@kept("written in place")
def out_kwarg_write_between(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    torch.add(x.req_to_token, 1, out=x.req_to_token)
    return SUM(t, x.seq_lens, 1, m)


@kept("written in place")
def lengths_grow_after_the_max(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    x.seq_lens.add_(2)
    return SUM(t, x.seq_lens, 1, m)


@kept("written in place")
def lengths_out_kwarg_after_the_max(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    torch.add(x.seq_lens, 3, out=x.seq_lens)
    return SUM(t, x.seq_lens, 1, m)


@kept("written in place")
def lengths_written_through_an_alias(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    x.seq_lens[1:].mul_(2)
    return SUM(t, x.seq_lens, 1, m + 64)


@kept("written in place")
def cast_lengths_written_before_use(x):
    lens = x.seq_lens.to(torch.int64)  # a no-op cast: the same memory
    m = x.seq_lens.max().item()
    t = table(x, m)
    lens.add_(1)
    return SUM(t, lens, 1, m + 1)


@kept("mirror")
def stale_mirror(x):
    x.seq_lens_cpu.sub_(1)
    m = x.seq_lens_cpu.max().item()
    return SUM(table(x, m), x.seq_lens, 1, m)


@kept("does not hold the values")
def mirror_of_another_shape(x):
    mirror = torch.cat([x.seq_lens_cpu, x.seq_lens_cpu[:1]])
    m = mirror.max().item()
    return SUM(table(x, m), x.seq_lens, 1, m)


@kept("not an upper bound")
def minus_one_gather(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m - 1), (x.seq_lens - 1).clamp(min=0), 1, m)


@kept("not an upper bound")
def minus_one_bound(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m), x.seq_lens, 1, m - 1)


@kept("max minus")
def plus_negative_constant(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m + (-2)), x.seq_lens, 1, m)


@kept("changes values")
def float_cast_table(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m).to(torch.float32).to(torch.int32), x.seq_lens, 1, m)


@kept("changes values")
def int16_cast_table(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m).to(torch.int16).to(torch.int32), x.seq_lens, 1, m)


@kept("int32/int64")
def int16_lengths(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m), (x.seq_lens * 1000).to(torch.int16), 1, m * 1000)


@kept("returned to the caller")
def returns_the_table(x):
    m = x.seq_lens.max().item()
    return table(x, m, 4)


@kept("returned to the caller")
def returns_the_max(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m), x.seq_lens, 1, m), m


@kept("neither a page-table bound")
def sizes_a_tensor(x):
    m = x.seq_lens.max().item()
    return torch.zeros(m) + x.seq_lens.sum()


@kept("neither a page-table bound")
def max_into_a_tensor(x):
    m = x.seq_lens.max().item()
    flag = torch.full((1,), m) > 5
    return torch.where(flag, x.pool[:1], -x.pool[:1])


@kept("arithmetic")
def doubled(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m), x.seq_lens, 1, m * 2)


@kept("not a registered self-guarding consumer")
def unregistered_consumer(x):
    m = x.seq_lens.max().item()
    return UNGUARDED(table(x, m), x.seq_lens, 1, m)


@kept("does not hold the values")
def halved_lengths(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m), x.seq_lens // 2, 1, m)


@kept("does not hold the values")
def another_lengths_tensor(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m), x.other_lens, 1, m + 2)


@kept("exceed the max by 3")
def lengths_beyond_the_offset(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m + 1), x.seq_lens + 3, 1, m + 4)


@kept("divides by 1")
def step_without_floordiv(x):
    m = x.seq_lens.max().item()
    return SUM(x.req_to_token[x.req_pool_indices, :m:4], x.seq_lens, 4, m)


@kept("user assertion")
def user_check_on_the_width(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    torch._check(t.shape[1] <= 40)
    return SUM(t, x.seq_lens, 1, m)


@rewritten
def user_check_on_the_max(x):
    m = x.seq_lens.max().item()
    torch._check(m <= 50)  # kept, as a device assertion: raises exactly when eager does
    return SUM(table(x, m), x.seq_lens, 1, m)


@rewritten
def user_check_strict_on_the_offset_max(x):
    m = x.seq_lens.max().item() + 2
    torch._check(m < 60)
    return SUM(table(x, m, 4), x.seq_lens, 4, m)


@rewritten
def chained_row_gather(x):
    m = x.seq_lens.max().item()
    return SUM(x.req_to_token[x.req_pool_indices][:, :m:4] // 4, x.seq_lens, 4, m)


@rewritten
def strided_arange_columns(x):
    m = x.seq_lens.max().item()
    t = x.req_to_token[x.req_pool_indices, :m]
    strided = torch.arange(0, t.shape[1], 4, device=t.device)
    return SUM(t[:, strided] // 4, x.seq_lens, 4, m)


@rewritten
def min_clamp_above_the_bound(x):
    m = min(x.seq_lens.max().item() + 1, TOKENS)
    return SUM(table(x, m, 2), x.seq_lens, 2, m)


@kept("below the static bound")
def min_clamp_below_the_bound(x):
    m = min(x.seq_lens.max().item(), 40)
    return SUM(table(x, m), x.seq_lens.clamp(max=40), 1, m)


@kept("compared")
def user_check_lower_bound(x):
    m = x.seq_lens.max().item()
    torch._check(m >= 1)
    return SUM(table(x, m), x.seq_lens, 1, m)


@kept("strided column index")
def strided_arange_used_elsewhere(x):
    m = x.seq_lens.max().item()
    t = x.req_to_token[x.req_pool_indices, :m]
    strided = torch.arange(0, t.shape[1], 4)
    return SUM(t[:, strided] // 4, x.seq_lens, 4, m), strided.sum()


@kept("neither a page-table bound")
def row_gather_also_returned(x):
    m = x.seq_lens.max().item()
    rows = x.req_to_token[x.req_pool_indices]
    return SUM(rows[:, :m], x.seq_lens, 1, m), rows


@kept("width is used")
def table_width_used(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    return SUM(t, x.seq_lens, 1, m) + t.shape[1]


@kept("not a 1-D int32/int64")
def bool_request_mask(x):
    m = x.seq_lens.max().item()
    mask = torch.zeros(REQS, dtype=torch.bool)
    mask[: x.seq_lens.shape[0]] = True
    return SUM(x.req_to_token[mask, :m], x.seq_lens, 1, m)


@kept("also used by")
def tolist_element_used_elsewhere(x):
    values = x.seq_lens.tolist()
    m = max(values)
    return SUM(table(x, m), x.seq_lens, 1, m) + values[0]


@kept("arithmetic")
def numpy_max_returned(x):
    m = int(x.seq_lens_cpu.numpy().max())
    return x.pool * m


@kept("the page table reaches `sum`")
def table_also_summed(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    return SUM(t, x.seq_lens, 1, m) + t.sum()


@kept("the page table")
def table_written_in_place(x):
    m = x.seq_lens.max().item()
    t = table(x, m)
    t[:, 0] = 0
    return SUM(t, x.seq_lens, 1, m)


@kept("the page table reaches")
def float_table_escapes(x):
    m = x.seq_lens.max().item()
    return table(x, m).float()


@kept("neither a page-table bound")
def slice_from_one(x):
    m = x.seq_lens.max().item()
    return SUM(x.req_to_token[x.req_pool_indices, 1:m], x.seq_lens, 1, m)


@kept("neither a page-table bound")
def rows_sliced_by_the_max(x):
    m = x.seq_lens.max().item()
    return x.req_to_token[:m].sum(1)


@kept("not an upper-bound argument")
def max_in_the_page_size_slot(x):
    m = x.seq_lens.max().item()
    return SUM(x.req_to_token[x.req_pool_indices, :20], x.seq_lens, m, 64)


@kept("does not hold the values")
def two_maxes_one_wrong(x):
    m = x.seq_lens.max().item()
    m2 = x.other_lens.max().item()
    return SUM(table(x, m2), x.seq_lens, 1, m)



@rewritten
def token_table_narrower_than_the_bound(x):
    """Lengths may pass the token table's width (48 < 64 + 2): the rebuilt table is never wider than eager's,
    so a consumer that clamps to the table's width reads what it read in eager."""
    narrow = x.req_to_token[:, :48]
    m = x.seq_lens.max().item() + 2
    t = narrow[x.req_pool_indices, :m:4] // 4
    return torch.ops.syncfree.paged_decode(x.q, x.k, x.v, t.to(torch.int32), (x.seq_lens + 2).to(torch.int32),
                                           max_seqlen_k=m)


def page_level(x, ps=4):
    """The engine's page-level table (page ids), made in the step from the token table."""
    return (x.req_to_token[:, ::ps] // ps).contiguous()


@rewritten
def page_count_slicing_a_page_level_table(x):
    m = x.seq_lens.max().item()
    pages = page_level(x)[x.req_pool_indices, : (m + 3) // 4]
    return torch.ops.syncfree.paged_decode(x.q, x.k, x.v, pages.to(torch.int32), x.seq_lens.to(torch.int32))


@rewritten
def page_count_with_speculative_offset(x):
    m = x.seq_lens.max().item() + 2
    pages = page_level(x)[x.req_pool_indices, : (m + 3) // 4]
    return torch.ops.syncfree.paged_decode(x.q, x.k, x.v, pages.to(torch.int32), (x.seq_lens + 2).to(torch.int32),
                                           max_seqlen_k=m)


@kept("pages of 8 but")
def page_count_of_another_page_size(x):
    m = x.seq_lens.max().item()
    pages = page_level(x, 8)[x.req_pool_indices, : (m + 7) // 8]
    return torch.ops.syncfree.paged_decode(x.q, x.k, x.v, pages.to(torch.int32), x.seq_lens.to(torch.int32))


@kept("rounds the bound down")
def page_count_rounded_down(x):
    m = x.seq_lens.max().item()
    pages = page_level(x)[x.req_pool_indices, : m // 4]
    return torch.ops.syncfree.paged_decode(x.q, x.k, x.v, pages.to(torch.int32), x.seq_lens.to(torch.int32))


@rewritten
def page_count_spelled_plus_ps_minus_one(x):
    m = x.seq_lens.max().item()
    pages = page_level(x)[x.req_pool_indices, : (m + 4 - 1) // 4]  # Dynamo: (m + 4) - 1, net + 3
    return torch.ops.syncfree.paged_decode(x.q, x.k, x.v, pages.to(torch.int32), x.seq_lens.to(torch.int32))


@kept("not an upper bound")
def added_then_taken_back_too_much(x):
    m = x.seq_lens.max().item()
    return SUM(table(x, m + 1 - 2), (x.seq_lens - 1).clamp(min=0), 1, m)
