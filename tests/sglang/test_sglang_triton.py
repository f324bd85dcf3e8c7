"""SGLang 0.5.23's TritonAttnBackend (the PyPI wheel, unmodified) compiled through the syncfree pass on CPU.

Each path builds the backend over SGLang's own pools (harness_backends.py), builds a ForwardBatch and compiles
`Engine.step` = `backend.init_forward_metadata(fb)` + two layers of `forward_decode` / `forward_extend` (KV write
included), over changing lengths and batch sizes; every result must equal the same step run eagerly. SGLang's
Triton kernels are CPU stand-ins with their contracts (standins/sglang_triton_ops.py).

Two things stopped the graph in SGLang's own code, whatever the lengths (issue 30, item 3):
  1. TritonAttnBackend.__init__ wraps its kernels in torch.compiler.disable (triton_backend.py:188,
     `self.decode_attention_fwd = torch.compiler.disable(decode_attention_fwd)`; :194 for extend_attention_fwd);
  2. KVIndexTranslator builds a `KVIndexTable(msgspec.Struct)` per gather (kv_index_translator.py:529,
     `_passthrough_table`, reached from `pack_read_stream` -> `read_source`), which Dynamo cannot construct.
Through compile_pass.compile, 2 is traced (a msgspec.Struct is the plain container it is; no shim), so only 1
remains on the unmodified paths. Two ways past 1: the `_registered` paths leave the backend as SGLang built it
and register the launchers its wrappers disable (compile_pass.register_disabled_launcher with the kernels'
schemas, `register_launchers()` in harness_backends.py); the `_op` paths replace the kernels as a user may
(register_user_ops: torch.library.custom_op with the kernels' contracts, assigned to backend.decode_attention_fwd /
backend.extend_attention_fwd; the extend op in its functional form, returning the output, unless `_inplace_`).
The `_op_table` paths are the `_op` paths under their old names (they used to swap KVIndexTable for a dataclass;
nothing is swapped now).

| path | status | reason | what it costs a user | what they can do |
|---|---|---|---|---|
| triton_decode (seq_lens_sum set) | graph_break | torch.compiler.disable'd decode kernel (triton_backend.py:2472) | the step splits around each layer's kernel, not CUDA-graphable as a whole; no host sync of its own (seq_lens_sum is the scheduler's host int) | register the launchers (register_disabled_launcher); the note at the break says so |
| triton_decode_no_sum (seq_lens_sum None) | graph_break | the same | the same | the same |
| triton_verify | graph_break | the same (extend kernel, triton_backend.py:1921) | the same | the same |
| triton_draft_extend (host lists) | graph_break | the same | the same | the same |
| triton_draft_extend_no_lists | graph_break | the same; `int(extend_seq_lens.max())` (triton_backend.py:1126) is a host sync before the break | a device->host sync per step as well | the same, then the indptr rule's facts (below) |
| triton_decode_registered / triton_decode_no_sum_registered | nothing | no host read; the launcher traced as sglang_launch::decode_attention_fwd (lean buffers declared written) | one graph per shape | nothing more |
| triton_verify_registered | nothing | no host read (max_extend_len is num_tokens_per_req) | one graph | nothing more |
| triton_draft_extend_registered (host lists) | nothing | host lists only (`max(extend_seq_lens_cpu)`): no device sync; extend_seq_lens_cpu is in the extend schema | recompiles as the list values change, then dynamic | publish the host lists (SGLang's scheduler does) |
| triton_draft_extend_no_lists_registered (Inductor), _registered_pass | rewritten (at a batch as large as the `qo_indptr` buffer too, bs == max_bs, where `qo_indptr[:bs + 1]` is the whole buffer; the same for the `_op_table` paths; test_sglang_realistic_bounds.py) | `max_extend_len = int(extend_seq_lens.max())` (triton_backend.py:1126) -> length_bounds['extend_seq_lens'] = 4 (max_len_extend -> 4; qo_indptr[0] == 0 and every length in [0, 4] asserted on the device) | nothing: no host sync, one graph per batch size (dynamic=False), Inductor's post-grad graph holds no host read | register_disabled_launcher for both launchers; register_indptr_bound_consumer(sglang_launch::extend_attention_fwd, indptr="qo_indptr", upper_bounds=("max_len_extend",)); options length_bounds={"extend_seq_lens": 4}, static_escapes=True (the max is stored on forward_metadata) |
| triton_decode_op, triton_decode_op_table | nothing | no host read | one graph per shape; a new seq_lens_sum value recompiles once, then it is a dynamic int | nothing more |
| triton_decode_no_sum_op_table | nothing | no host read (`bs * max_context_len`, triton_backend.py:905) | one graph | nothing more |
| triton_verify_op_table | nothing | no host read | one graph | nothing more |
| triton_draft_extend_op_table (host lists) | nothing | host lists only: no device sync | recompiles as the list values change (they are Python ints), then dynamic | publish the host lists |
| triton_draft_extend_no_lists_op_table | rewritten | the same as _registered, through sglang_user::extend_attention | nothing | register_indptr_bound_consumer(sglang_user::extend_attention, ...) and the same options |
| triton_draft_extend_no_lists_inplace_op_table | rewritten | the same, with the extend op writing o_extend in place and returning nothing (SGLang's convention; its outputs are checked on fake tensors from its inputs' fake mode) | nothing | the same registration, on the in-place op |

Compile paths: passlib.TracedPassOnly (the pass on Dynamo's graph, then the graph as captured: aot_eager-style,
fast; it traces as compile_pass.compile does) for all but `triton_draft_extend_no_lists_op_table` and
`triton_draft_extend_no_lists_registered`, which go through compile_pass.compile (Inductor).
The indptr rule's facts are registered here (the `triton_backend` fixture), through the public API.

EXPECTED is the end state per path (status, then a reason code for kept or words Dynamo's reason must contain for
graph_break); the entries in NEEDS_RULE are not met yet and xfail naming the rule they wait for (strict: once met,
the test fails until the entry is removed).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import harness_backends as B

SE = {"static_escapes": True}
P = B.Path


def _triton(name, mode, **kw):
    draft = 4 if mode != "decode" else 0
    ragged = mode == "draft_extend"
    return P(name, "triton", mode, draft_tokens=draft, ragged=ragged, **kw)


OP = dict(kernels="custom_op")
OP_TABLE = dict(kernels="custom_op")  # the index table needs no shim any more (issue 30): the same as OP
REG = dict(kernels="registered")
BOUNDED = {**SE, "length_bounds": {"extend_seq_lens": 4}}
PATHS = {p.name: p for p in [
    _triton("triton_decode", "decode"),
    _triton("triton_decode_no_sum", "decode", seq_lens_sum=False),
    _triton("triton_verify", "target_verify"),
    _triton("triton_draft_extend", "draft_extend"),
    _triton("triton_draft_extend_no_lists", "draft_extend", host_lists=False, options=SE),
    _triton("triton_decode_op", "decode", **OP),
    _triton("triton_decode_op_table", "decode", **OP_TABLE),
    _triton("triton_decode_no_sum_op_table", "decode", seq_lens_sum=False, **OP_TABLE),
    _triton("triton_verify_op_table", "target_verify", **OP_TABLE),
    _triton("triton_draft_extend_op_table", "draft_extend", **OP_TABLE),
    _triton("triton_draft_extend_no_lists_op_table", "draft_extend", host_lists=False, inductor=True,
            options=BOUNDED, **OP_TABLE),
    _triton("triton_draft_extend_no_lists_inplace_op_table", "draft_extend", host_lists=False,
            options=BOUNDED, kernels="custom_op_inplace"),
    _triton("triton_decode_registered", "decode", **REG),
    _triton("triton_decode_no_sum_registered", "decode", seq_lens_sum=False, **REG),
    _triton("triton_verify_registered", "target_verify", **REG),
    _triton("triton_draft_extend_registered", "draft_extend", **REG),
    _triton("triton_draft_extend_no_lists_registered", "draft_extend", host_lists=False, inductor=True,
            options=BOUNDED, **REG),
    _triton("triton_draft_extend_no_lists_registered_pass", "draft_extend", host_lists=False, options=BOUNDED,
            **REG),
]}

DISABLED = "Skip calling `torch.compiler.disable()`d function"
# path -> (status, detail): a reason code (kept), words every listed graph break must show (graph_break), or words
# of the rewritten item (rewritten)
EXPECTED = {
    "triton_decode": ("graph_break", ("triton_backend.py:2472: " + DISABLED,)),
    "triton_decode_no_sum": ("graph_break", ("triton_backend.py:2472: " + DISABLED,)),
    "triton_verify": ("graph_break", ("triton_backend.py:1921: " + DISABLED,)),
    "triton_draft_extend": ("graph_break", ("triton_backend.py:1921: " + DISABLED,)),
    "triton_draft_extend_no_lists": ("graph_break", ("triton_backend.py:1921: " + DISABLED,)),
    "triton_decode_op": ("nothing", None),
    "triton_decode_op_table": ("nothing", None),
    "triton_decode_no_sum_op_table": ("nothing", None),
    "triton_verify_op_table": ("nothing", None),
    "triton_draft_extend_op_table": ("nothing", None),
    "triton_draft_extend_no_lists_op_table": ("rewritten", "extend_seq_lens"),
    "triton_draft_extend_no_lists_inplace_op_table": ("rewritten", "extend_seq_lens"),
    "triton_decode_registered": ("nothing", None),
    "triton_decode_no_sum_registered": ("nothing", None),
    "triton_verify_registered": ("nothing", None),
    "triton_draft_extend_registered": ("nothing", None),
    "triton_draft_extend_no_lists_registered": ("rewritten", "extend_seq_lens"),
    "triton_draft_extend_no_lists_registered_pass": ("rewritten", "extend_seq_lens"),
}
NEEDS_RULE: dict = {}
# what the paths in NEEDS_RULE report until then (asserted, so that a change shows)
UNTIL_THEN: dict = {}



@pytest.fixture(scope="module")
def triton_backend(sglang_fa3):
    B.setup()
    ops = B.register_user_ops()
    launched = B.register_launchers()  # defines the launchers' ops; each registered path registers them again
    B.unregister_launchers()
    import compile_pass

    extend_ops = (ops["extend_op"], ops["extend_inplace_op"], launched["extend_op"])
    for op in extend_ops:  # recipe 1, the indptr rule's facts
        compile_pass.register_indptr_bound_consumer(op, indptr="qo_indptr", upper_bounds=("max_len_extend",))
    yield ops
    for op in extend_ops:
        compile_pass.unregister_indptr_bound_consumer(op)


outcome = B.Outcomes(PATHS, EXPECTED)
vectors_for = outcome.vectors


@pytest.mark.parametrize("name", sorted(PATHS))
def test_equal_to_eager(triton_backend, name):
    result = outcome(name)  # run_path asserts equality per length vector
    assert len(result.errors) == vectors_for(name) and max(result.errors) <= 1e-5


@pytest.mark.parametrize("name", sorted(PATHS))
def test_report(triton_backend, name):
    result = outcome(name)
    status, detail = EXPECTED[name]
    if name in NEEDS_RULE:
        if result.status == status:
            pytest.fail(f"{name} is {status} now: remove it from NEEDS_RULE\n{B.shown(result)}")
        B.check_status(result, *UNTIL_THEN[name])
        pytest.xfail(NEEDS_RULE[name])
    B.check_status(result, status, detail)


def test_the_draft_extend_is_sync_free_through_inductor(triton_backend):
    """The rewritten draft extend compiled by Inductor: no host read left in the post-grad graph, and the extend
    op gets the declared bound."""
    result = outcome("triton_draft_extend_no_lists_op_table")
    assert result.status == "rewritten", B.shown(result)
    for report in result.reports:
        assert report.post_grad is not None and not report.post_grad["reads"], B.shown(result)
        assert not report.post_grad["unbacked_symbols"] and not report.post_grad["local_scalar_dense"]
        assert "max_len_extend -> 4" in report.rewritten[0].reason, B.shown(result)


def test_an_extend_length_past_the_declared_bound_raises_on_the_device(triton_backend):
    """length_bounds={'extend_seq_lens': 2} with rows extending up to 4 tokens: the check the rewrite inserts
    (checked, the default) fails on the device instead of launching too few query blocks."""
    path = dataclasses.replace(PATHS["triton_draft_extend_no_lists_op_table"], inductor=False,
                               options={**SE, "length_bounds": {"extend_seq_lens": 2}})
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"outside \[0, 2\] \(length_bounds\['extend_seq_lens'\]=2\)"):
        B.run_path(path, vectors=1)


def test_the_unmodified_draft_extend_without_host_lists_syncs_before_it_breaks(triton_backend):
    """`int(forward_batch.extend_seq_lens.max())` (triton_backend.py:1126) is read on the host in the piece before
    the first graph break: a device->host sync every step, on top of the breaks."""
    result = outcome("triton_draft_extend_no_lists")
    items = [i for r in result.reports for i in r.kept]
    assert any(i.location == "triton_backend.py:1126" and i.host_sync for i in items), B.shown(result)


# -- the stand-ins keep the kernels' contracts ------------------------------------------------------------------
def _pool(slots=64, hk=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, hk, d, generator=g), torch.randn(slots, hk, d, generator=g)


def _dense(q, keys, vals, allowed=None):
    h = q.shape[1]
    kk = keys.repeat_interleave(h // keys.shape[1], 1)
    vv = vals.repeat_interleave(h // vals.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * q.shape[-1] ** -0.5
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


def test_decode_stand_in_reads_through_kv_indptr_and_raises_out_of_bounds(triton_backend):
    import sglang_triton_ops as ops

    k, v = _pool()
    q = torch.randn(2, 4, 8)
    indptr = torch.tensor([0, 3, 8])
    indices = torch.tensor([5, 1, 9, 2, 3, 4, 60, 7])
    o = torch.empty(2, 4, 8)
    logits, lse = torch.empty(2, 4, 8, 8), torch.empty(2, 4, 8)
    splits = torch.full((2,), 8, dtype=torch.int32)
    ops.decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, 8, 8 ** -0.5, 1.0, 1.0)
    for b in range(2):
        idx = indices[indptr[b]:indptr[b + 1]]
        torch.testing.assert_close(o[b:b + 1], _dense(q[b:b + 1], k[idx], v[idx]))
    with pytest.raises(IndexError, match="past its end"):
        ops.decode_attention_fwd(q, k, v, o, torch.tensor([0, 3, 9]), indices, logits, lse, splits, 8, 1.0, 1.0, 1.0)
    with pytest.raises(IndexError, match="outside"):
        ops.decode_attention_fwd(q, k, v, o, indptr, indices.masked_fill(indices == 60, 64), logits, lse, splits, 8,
                                 1.0, 1.0, 1.0)
    with pytest.raises(IndexError, match="KV splits"):
        ops.decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits + 1, 8, 1.0, 1.0, 1.0)


def test_extend_stand_in_writes_only_the_query_blocks_max_len_extend_launches(triton_backend):
    import sglang_triton_ops as ops

    k_buf, v_buf = _pool()
    g = torch.Generator().manual_seed(3)
    lens, prefix = [3, 1], [4, 2]
    qo = torch.tensor([0, 3, 4])
    kv_indptr = torch.tensor([0, 4, 6])
    kv_indices = torch.tensor([10, 11, 12, 13, 20, 21])
    q, k, v = (torch.randn(4, 4, 8, generator=g), torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g))

    def run(max_len):
        o = torch.full((4, 4, 8), float("nan"))
        ops.extend_attention_fwd(q, k, v, o, k_buf, v_buf, qo, kv_indptr, kv_indices, None, True, None, max_len,
                                 1.0, 1.0)
        return o

    full = run(3)
    for b in range(2):
        keys = torch.cat([k_buf[kv_indices[kv_indptr[b]:kv_indptr[b + 1]]], k[qo[b]:qo[b + 1]]])
        vals = torch.cat([v_buf[kv_indices[kv_indptr[b]:kv_indptr[b + 1]]], v[qo[b]:qo[b + 1]]])
        i, j = torch.arange(lens[b])[:, None], torch.arange(prefix[b] + lens[b])[None, :]
        torch.testing.assert_close(full[qo[b]:qo[b + 1]], _dense(q[qo[b]:qo[b + 1]], keys, vals,
                                                                 (j < prefix[b]) | (j - prefix[b] <= i)))
    torch.testing.assert_close(run(256), full)  # an upper bound gives the same output
    short = run(2)  # one query block too few for row 0: its third query is never written
    assert torch.isnan(short[2]).all() and not torch.isnan(short[:2]).any() and not torch.isnan(short[3]).any()
    with pytest.raises(IndexError, match="past its end"):
        ops.extend_attention_fwd(q, k, v, full, k_buf, v_buf, qo, torch.tensor([0, 4, 7]), kv_indices, None, True,
                                 None, 3, 1.0, 1.0)


def test_kv_indices_stand_in_writes_only_each_rows_indptr_range(triton_backend):
    import sglang_triton_ops as ops

    r2t = torch.arange(4 * 32, dtype=torch.int32).view(4, 32)
    rpi, lens = torch.tensor([2, 0]), torch.tensor([3, 2])
    indptr = torch.tensor([0, 3, 5])
    out = torch.full((8,), -7, dtype=torch.int64)
    ops.create_flashinfer_kv_indices_triton[(2,)](r2t, rpi, lens, indptr, None, out, r2t.stride(0))
    assert out.tolist() == [64, 65, 66, 0, 1, -7, -7, -7]
    with pytest.raises(IndexError, match="past its end"):
        ops.create_flashinfer_kv_indices_triton[(2,)](r2t, rpi, lens, indptr, None, out[:4], r2t.stride(0))


def test_the_unmodified_backend_report_names_the_change_at_each_break(triton_backend):
    """Issue 30: through compile_pass.compile, the unmodified Triton draft extend breaks only at the
    torch.compiler.disable'd kernel (KVIndexTable, a msgspec.Struct, is traced as the container it is), and the
    report's note there names the one change: register the launcher (register_disabled_launcher)."""
    path = dataclasses.replace(PATHS["triton_draft_extend_no_lists"], inductor=True)
    torch._dynamo.reset()
    result = B.run_path(path, vectors=1)
    notes = [n for r in result.reports for n in r.notes]
    assert not any("kv_index_translator" in b for b in result.graph_breaks), B.shown(result)
    assert any(n.startswith("triton_backend.py:1921") and "register_disabled_launcher" in n for n in notes), notes


# -- the unmodified backend, its launchers registered (register_disabled_launcher) --------------------------------
def test_the_registered_draft_extend_is_sync_free_through_inductor(triton_backend):
    """SGLang's own backend object, nothing of it replaced: the draft extend without host lists is one graph per
    compile, int(extend_seq_lens.max()) (triton_backend.py:1126) rewritten to the declared bound, Inductor's
    post-grad graph holds no host read, and the launcher's op gets the bound."""
    result = outcome("triton_draft_extend_no_lists_registered")
    assert result.status == "rewritten" and not result.graph_breaks, B.shown(result)
    for report in result.reports:
        assert report.post_grad is not None and not report.post_grad["reads"], B.shown(result)
        assert not report.post_grad["unbacked_symbols"] and not report.post_grad["local_scalar_dense"]
        assert [i.location for i in report.rewritten] == ["triton_backend.py:1126"], B.shown(result)
        assert "max_len_extend -> 4" in report.rewritten[0].reason, B.shown(result)


def test_the_registered_draft_extend_is_one_graph_per_batch_size(triton_backend):
    """dynamic=False (a CUDA-graph runner captures one graph per batch size, every request extending the draft
    tokens, so the token count follows the batch size): batch sizes 3, 2, 4, 1, 3 give one graph each for the
    four sizes (the fifth call reuses the first, with other lengths), each rewritten, each equal to eager."""
    path = dataclasses.replace(PATHS["triton_draft_extend_no_lists_registered_pass"], dynamic=False, ragged=False)
    torch._dynamo.reset()
    result = B.run_path(path, vectors=5)
    assert len(result.errors) == 5 and max(result.errors) <= 1e-5
    assert not result.graph_breaks and len(result.reports) == 4, B.shown(result)
    assert all(r.rewritten and not r.kept and r.syncs_remaining == 0 for r in result.reports), B.shown(result)


def test_a_registered_extend_length_past_the_declared_bound_raises_on_the_device(triton_backend):
    """length_bounds={'extend_seq_lens': 2} with rows extending up to 4 tokens, checked (the default): the check
    the rewrite inserts fails instead of launching too few query blocks."""
    path = dataclasses.replace(PATHS["triton_draft_extend_no_lists_registered_pass"],
                               options={**SE, "length_bounds": {"extend_seq_lens": 2}})
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"outside \[0, 2\] \(length_bounds\['extend_seq_lens'\]=2\)"):
        B.run_path(path, vectors=1)


def test_registering_the_launchers_leaves_the_backend_as_sglang_built_it(triton_backend):
    """The registered paths change nothing of the backend: its kernels are still SGLang's own
    torch.compiler.disable wrappers around the launchers the harness registers."""
    from compile_pass import _compat
    from sglang.kernels.ops.attention import decode_attention, extend_attention

    engine = B.Engine(PATHS["triton_draft_extend_no_lists_registered_pass"])
    assert _compat.disabled_target(engine.backend.extend_attention_fwd) is extend_attention.extend_attention_fwd
    assert _compat.disabled_target(engine.backend.decode_attention_fwd) is decode_attention.decode_attention_fwd
