"""Facts about ops (compile_pass/consumers.py): one schema lookup, one validator, one registration path. Every
public registration function checks its fact against the op's own overload schema the same way: each named
argument exists, has the kind the fact says (a tensor for a table or lengths, an int or SymInt for a bound, a
stride or a page size) and is written or not as the fact says; the message names the field, the argument and
the op."""

import warnings

import pytest
import torch

import compile_pass
from compile_pass import consumers
from compile_pass.rules import bounded_writers, flat_buffer, indptr_bound, self_guarding

_LIB = torch.library.Library("syncfree_facts_test", "DEF")
_LIB.define("attn(Tensor page_table, Tensor lens, int page_size, SymInt max_seqlen_k, float scale) -> Tensor")
_LIB.define("attn.swapped(Tensor lens, Tensor page_table, SymInt most) -> Tensor")
_LIB.define("fill(Tensor(a!) out, Tensor indptr, Tensor lens, Tensor(b!) other) -> ()")
_LIB.define("rows(Tensor req_to_token, Tensor req_pool_indices, Tensor lengths, Tensor(a!) table, "
            "SymInt table_stride, int page_size) -> ()")
ATTN = torch.ops.syncfree_facts_test.attn


def test_a_fact_naming_a_missing_argument_names_the_field_the_argument_and_the_op():
    with pytest.raises(ValueError, match=r"lengths='seqlens' is not an argument of syncfree_facts_test::attn\.default "
                                         r"\(arguments: \['page_table', 'lens', "):
        compile_pass.register_self_guarding_consumer(ATTN, page_table="page_table", lengths="seqlens")
    with pytest.raises(ValueError, match=r"upper_bounds\[1\]='max_k' is not an argument of syncfree_facts_test::attn"):
        compile_pass.register_indptr_bound_consumer(ATTN, indptr="lens", upper_bounds=("max_seqlen_k", "max_k"))
    with pytest.raises(ValueError, match=r"indptr='ptr' is not an argument of syncfree_facts_test::fill\.default"):
        compile_pass.register_indptr_writer("syncfree_facts_test::fill", out="out", indptr="ptr", lengths="lens")
    with pytest.raises(ValueError, match=r"page_size_of\[0\]='k_cache' is not an argument of"):
        compile_pass.register_self_guarding_consumer(ATTN, page_table="page_table", lengths="lens",
                                                     page_size_of=("k_cache", 1))
    # A writer's names may be a Triton kernel's: its facts speak of parameters.
    with pytest.raises(ValueError, match=r"table_stride='stride' is not a parameter of syncfree_facts_test::rows"):
        compile_pass.register_bounded_writer("syncfree_facts_test::rows", table="table", lengths="lengths",
                                             page_size=64, table_stride="stride")
    assert "syncfree_facts_test::attn.default" not in compile_pass.registered_consumers()


@pytest.mark.parametrize("register, kwargs, words", [
    (compile_pass.register_self_guarding_consumer, dict(page_table="page_table", lengths="page_size"),
     r"lengths='page_size' is not a tensor argument of syncfree_facts_test::attn\.default: its type is int"),
    (compile_pass.register_self_guarding_consumer,
     dict(page_table="page_table", lengths="lens", upper_bounds=("lens",)),
     r"upper_bounds\[0\]='lens' is not an int or SymInt argument of .*: its type is Tensor"),
    (compile_pass.register_indptr_bound_consumer, dict(indptr="lens", upper_bounds=("scale",)),
     r"upper_bounds\[0\]='scale' is not an int or SymInt argument of .*: its type is float"),
    (compile_pass.register_indptr_bound_consumer, dict(indptr="max_seqlen_k", upper_bounds=("page_size",)),
     r"indptr='max_seqlen_k' is not a tensor argument of .*: its type is SymInt"),
])
def test_a_fact_naming_an_argument_of_the_wrong_kind_is_refused(register, kwargs, words):
    with pytest.raises(ValueError, match=words):
        register(ATTN, **kwargs)
    assert "syncfree_facts_test::attn.default" not in compile_pass.registered_consumers()
    assert "syncfree_facts_test::attn.default" not in indptr_bound.registered_indptr_bound_consumers()


def test_a_writers_stride_and_page_size_must_be_ints_and_its_table_a_tensor():
    rows = "syncfree_facts_test::rows"
    with pytest.raises(ValueError, match=r"table_stride='lengths' is not an int or SymInt parameter of .*: its type is "
                                         "Tensor"):
        compile_pass.register_bounded_writer(rows, table="table", lengths="lengths", page_size=64,
                                             table_stride="lengths")
    with pytest.raises(ValueError, match=r"page_size='table' is not an int or SymInt parameter"):
        compile_pass.register_bounded_writer(rows, table="table", lengths="lengths", page_size="table")
    with pytest.raises(ValueError, match=r"page_size must be an int >= 1 or a parameter name, got 0"):
        compile_pass.register_bounded_writer(rows, table="table", lengths="lengths", page_size=0)
    entry = compile_pass.register_bounded_writer(rows, table="table", lengths="lengths", page_size="page_size",
                                                 table_stride="table_stride")
    try:
        assert entry.op and entry.page_size == "page_size"
    finally:
        compile_pass.unregister_bounded_writer(rows)


def test_what_a_fact_says_is_written_is_checked_against_the_schema():
    fill = "syncfree_facts_test::fill"
    with pytest.raises(ValueError, match=r"out='indptr' is not written by syncfree_facts_test::fill\.default's schema"):
        compile_pass.register_indptr_writer(fill, out="indptr", indptr="out", lengths="lens")
    with pytest.raises(ValueError, match=r"indices='out' is written by syncfree_facts_test::fill\.default's schema: "
                                         "a reader through an indptr must not write it"):
        compile_pass.register_indptr_reader(fill, indices="out", indptr="indptr", lengths="lens")
    entry = compile_pass.register_indptr_writer(fill, out="out", indptr="indptr", lengths="lens")
    try:
        assert entry == flat_buffer.IndptrWriter("syncfree_facts_test::fill.default", "out", "indptr", "lens")
    finally:
        compile_pass.unregister_flat_kv_facts(fill)


def test_facts_of_an_op_with_two_overloads_belong_to_the_overload_they_name():
    assert [name for name, _ in consumers.overload_schemas(ATTN)] == [
        "syncfree_facts_test::attn.default", "syncfree_facts_test::attn.swapped"]
    assert consumers.schema_of(ATTN) is not None and consumers.schema_argument_names(ATTN)[:2] == ["page_table", "lens"]
    assert consumers.schema_argument_names(ATTN.swapped) == ["lens", "page_table", "most"]
    # The packet means .default, whose schema has no `most`: the message says which overload has it.
    with pytest.raises(ValueError, match=r"upper_bounds\[0\]='most' is not an argument of syncfree_facts_test::"
                                         r"attn\.default .*facts belong to one overload, and 'most' is an argument "
                                         r"of syncfree_facts_test::attn\.swapped"):
        compile_pass.register_self_guarding_consumer(ATTN, page_table="page_table", lengths="lens",
                                                     upper_bounds=("most",))
    entry = compile_pass.register_self_guarding_consumer(ATTN.swapped, page_table="page_table", lengths="lens",
                                                         upper_bounds=("most",))
    try:
        assert entry.name == "syncfree_facts_test::attn.swapped" and entry.overload == "swapped"
        registered = compile_pass.registered_consumers()
        assert "syncfree_facts_test::attn.swapped" in registered
        assert "syncfree_facts_test::attn.default" not in registered
    finally:
        compile_pass.unregister_self_guarding_consumer(ATTN.swapped)


def test_a_value_of_the_wrong_python_type_is_a_type_error_and_a_value_error():
    for error in (TypeError, ValueError):
        with pytest.raises(error, match="lengths must be an argument name, got 3"):
            compile_pass.register_self_guarding_consumer(ATTN, page_table="page_table", lengths=3)
    with pytest.raises(TypeError, match="upper_bounds must be a tuple of argument names, got the string"):
        compile_pass.register_self_guarding_consumer(ATTN, lengths="lens", upper_bounds="max_seqlen_k")
    with pytest.raises(ValueError, match=r"page_size_of must be \(an argument name, a dim\), got "
                                         r"\('page_table', '1'\)"):
        compile_pass.register_self_guarding_consumer(ATTN, page_table="page_table", lengths="lens",
                                                     page_size_of=("page_table", "1"))
    with pytest.raises(TypeError, match="op must be a torch op"):
        compile_pass.register_indptr_reader(len, indices="i", indptr="p", lengths="l")
    with pytest.raises(ValueError, match="not a registered torch op overload"):
        compile_pass.register_indptr_bound_consumer("nope::missing", indptr="p", upper_bounds=("m",))


def test_every_registration_takes_the_one_path(monkeypatch):
    """The public registration functions all end in consumers.register_facts, which checks each record once."""
    seen = []
    check = consumers.check_record
    monkeypatch.setattr(consumers, "check_record", lambda kind, record, sig: (seen.append(kind.scope),
                                                                             check(kind, record, sig)))
    rows, fill = "syncfree_facts_test::rows", "syncfree_facts_test::fill"
    try:
        compile_pass.register_self_guarding_consumer(ATTN, page_table="page_table", lengths="lens")
        compile_pass.register_indptr_bound_consumer(ATTN, indptr="lens", upper_bounds=("max_seqlen_k",))
        compile_pass.register_indptr_writer(fill, out="out", indptr="indptr", lengths="lens")
        compile_pass.register_indptr_reader(ATTN, indices="page_table", indptr="lens", lengths="lens")
        compile_pass.register_bounded_writer(rows, table="table", lengths="lengths", page_size=16)
    finally:
        compile_pass.unregister_self_guarding_consumer(ATTN)
        compile_pass.unregister_indptr_bound_consumer(ATTN)
        compile_pass.unregister_flat_kv_facts(fill)
        compile_pass.unregister_flat_kv_facts(ATTN)
        compile_pass.unregister_bounded_writer(rows)
    assert seen == ["page_table", "indptr_bound", "flat_kv_indices", "flat_kv_indices", "allocated_table"]


def test_built_in_facts_of_an_op_defined_later_are_checked_when_a_graph_first_calls_it():
    table = {"syncfree_facts_later::attn": dict(page_table="page_table", lengths="lens", upper_bounds=("bound",)),
             "syncfree_facts_later::misfit": dict(page_table="page_table", lengths="lengths")}
    consumers.load_facts(table, compile_pass.register_self_guarding_consumer, later=self_guarding.SCOPE)
    assert "syncfree_facts_later::attn.default" not in compile_pass.registered_consumers()
    lib = torch.library.Library("syncfree_facts_later", "DEF")
    lib.define("attn(Tensor page_table, Tensor lens, SymInt bound) -> Tensor")
    lib.define("misfit(Tensor page_table, Tensor lens) -> Tensor")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    try:
        entry = self_guarding.lookup_consumer(graph.call_function(torch.ops.syncfree_facts_later.attn.default,
                                                                  (x, x, 1)))
        assert entry == compile_pass.registered_consumers()["syncfree_facts_later::attn.default"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert self_guarding.lookup_consumer(graph.call_function(torch.ops.syncfree_facts_later.misfit.default,
                                                                     (x, x))) is None
        assert any("lengths='lengths' is not an argument of syncfree_facts_later::misfit.default" in str(w.message)
                   for w in caught)
    finally:
        compile_pass.unregister_self_guarding_consumer("syncfree_facts_later::attn")


def test_the_page_table_rules_facts_are_a_kind_of_their_own():
    """The generic registry holds only the mechanism; each rule's facts are a declared kind beside the rule."""
    kinds = [self_guarding.SELF_GUARDING_CONSUMER, bounded_writers.BOUNDED_WRITER, flat_buffer.INDPTR_WRITER,
             flat_buffer.INDPTR_READER, indptr_bound.INDPTR_BOUND_CONSUMER]
    assert all(isinstance(k, consumers.FactKind) for k in kinds)
    assert not hasattr(consumers, "SelfGuardingConsumer") and not hasattr(consumers, "register_self_guarding_consumer")
    assert compile_pass.SelfGuardingConsumer is self_guarding.SelfGuardingConsumer
    assert "syncfree::paged_decode.default" in consumers.facts_of(self_guarding.SELF_GUARDING_CONSUMER)
