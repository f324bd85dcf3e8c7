"""Each private-torch helper in compile_pass._compat, on the installed torch."""

import torch

from compile_pass import _compat


def _dynamo_graph(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, _compat.copy_dynamo_graph_module(gm), [
            _compat.placeholder_source_name(n) for n in gm.graph.nodes if n.op == "placeholder"]))
        return gm.forward

    with _compat.capture_scalar_outputs():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def test_capture_scalar_outputs_restores_the_flag():
    before = _compat.capture_scalar_outputs_enabled()
    with _compat.capture_scalar_outputs():
        assert _compat.capture_scalar_outputs_enabled()
    assert _compat.capture_scalar_outputs_enabled() == before


def test_sources_copy_and_fake_mode():
    class Batch:
        def __init__(self):
            self.seq_lens_cpu = torch.tensor([1, 2])

    gm, copy, sources = _dynamo_graph(lambda b, x: x * b.seq_lens_cpu.max().item(), Batch(), torch.ones(2))
    assert "L['b'].seq_lens_cpu" in sources and "L['x']" in sources
    assert "dynamo_compile_id" in copy.meta and copy.meta["dynamo_compile_id"] == gm.meta["dynamo_compile_id"]
    for old, new in zip(gm.graph.nodes, copy.graph.nodes):
        assert old.name == new.name
        if old.op == "placeholder":
            assert _compat.placeholder_source_name(new) == _compat.placeholder_source_name(old)
    assert _compat.fake_mode_of(list(gm.graph.nodes)) is not None
    assert _compat.example_value(next(iter(gm.graph.nodes))) is not None


def test_free_unbacked_symbols_and_counters():
    assert _compat.free_unbacked_symbols(torch.ones(2)) == set()
    x = torch.zeros(2, 3)
    assert _compat.free_unbacked_symbols(x) == set()
    counters = _compat.graph_counters()
    counters.clear()
    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(2))
    assert counters["stats"]["unique_graphs"] == 1  # the counters Dynamo really updates


def test_storage_id_follows_views_and_differs_between_tensors():
    a = torch.arange(10)
    assert _compat.storage_id(a) == _compat.storage_id(a[2:]) == _compat.storage_id(a.view(2, 5))
    assert _compat.storage_id(a) != _compat.storage_id(a.clone())


def test_inductor_config_helpers():
    assert _compat.inductor_config_value("post_grad_custom_post_pass") is None
    assert _compat.inductor_config_value("no_such_option") is None
    assert "fx_graph_cache" in _compat.inductor_config_fingerprint()
    import os

    assert os.path.isdir(_compat.inductor_cache_dir())


def test_run_and_get_code_does_not_reset_dynamo():
    from torch._dynamo.utils import counters

    f = torch.compile(lambda x: x + 1)
    g = torch.compile(lambda x: x * 2)
    counters.clear()
    f(torch.ones(3))
    out, codes = _compat.run_and_get_code(g, torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0)) and codes and "def call" in codes[0]
    f(torch.ones(3))  # still cached
    assert counters["stats"]["unique_graphs"] == 2


def test_custom_graph_pass_base_and_static_address():
    from compile_pass.post_grad_check import SyncFreeCheck

    assert issubclass(SyncFreeCheck, _compat.CustomGraphPass)
    t = torch.zeros(2)
    _compat.mark_static_address(t)
    assert getattr(t, "_dynamo_static_input_type", None) is not None


def test_cudagraph_skips_collects_messages():
    import logging

    with _compat.CudagraphSkips() as skips:
        logging.getLogger("torch._inductor").warning("skipping cudagraphs due to mutated inputs")
    assert skips.messages == ["skipping cudagraphs due to mutated inputs"]


def test_dynamo_cache_entries_counts_compiled_entries():
    def g(x):
        return x * 2

    assert _compat.dynamo_cache_entries(g.__code__) == 0
    torch.compile(g, backend="eager")(torch.ones(2))
    assert _compat.dynamo_cache_entries(g.__code__) == 1


def test_cudagraph_log_partitions_are_picked_out():
    import logging

    with _compat.CudagraphSkips() as log:
        logging.getLogger("torch._inductor").warning("Created 1 graph partitions: 1 cudagraphable, 0 non-cudagraphable")
        logging.getLogger("torch._inductor").warning("skipping cudagraphs due to cpu device")
    assert log.partitions() == ["Created 1 graph partitions: 1 cudagraphable, 0 non-cudagraphable"]


def test_inductor_config_keys_hold_flat_and_nested_keys():
    keys = _compat.inductor_config_keys()
    assert {"max_autotune", "fx_graph_cache", "triton.cudagraphs"} <= keys
    assert "max_context_len" not in keys


def test_register_torch_log_makes_a_setting_name():
    import logging

    from torch._logging._internal import log_registry

    assert _compat.register_torch_log("syncfree_compat_test", "compile_pass.compat_test")
    assert log_registry.is_log("syncfree_compat_test")
    torch._logging.set_logs(modules={"syncfree_compat_test": logging.DEBUG})
    try:
        assert logging.getLogger("compile_pass.compat_test").isEnabledFor(logging.DEBUG)
    finally:
        torch._logging.set_logs()


def test_trace_artifact_goes_to_the_structured_trace_log():
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    trace_log = logging.getLogger("torch.__trace")
    handler, level = Keep(), trace_log.level
    trace_log.addHandler(handler)
    trace_log.setLevel(logging.DEBUG)
    # After some earlier tests (test_flat_kv_indices first, in one process) the first record sent to this logger is
    # lost, whatever it is; a probe takes that place, so that the test asks only whether the artifact is emitted.
    trace_log.debug("probe")
    try:
        _compat.trace_artifact("syncfree_compat_test", lambda: '{"x": 1}')
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(level)
    ours = [r for r in records if getattr(r, "metadata", {}).get("artifact", {}).get("name") == "syncfree_compat_test"]
    assert ours and ours[0].metadata["artifact"]["encoding"] == "json" and ours[0].payload == '{"x": 1}'


def test_no_compile_caches_turns_both_caches_off_and_restores_them():
    import torch._functorch.config as functorch_config
    from torch._inductor import config

    before = (config.fx_graph_cache, functorch_config.enable_autograd_cache)
    with _compat.no_compile_caches():
        assert config.fx_graph_cache is False and functorch_config.enable_autograd_cache is False
    assert (config.fx_graph_cache, functorch_config.enable_autograd_cache) == before


def test_user_triton_kernel_reads_the_kernel_side_table():
    """The one access to torch's kernel side table: which @triton.jit kernel a triton_kernel_wrapper_mutation node
    launches, and the constant arguments Dynamo kept beside it."""
    import pytest

    triton = pytest.importorskip("triton")
    import triton.language as tl
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    @triton.jit
    def side_table_probe(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), 0)

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    hop = torch.ops.higher_order.triton_kernel_wrapper_mutation
    kernel_idx = kernel_side_table.add_kernel(side_table_probe)
    constant_args_idx = kernel_side_table.add_constant_args({"N": 4})
    try:
        node = graph.call_function(hop, (), {
            "kernel_idx": kernel_idx, "constant_args_idx": constant_args_idx, "grid": [(1, 1, 1)],
            "tma_descriptor_metadata": {}, "kwargs": {"x_ptr": x}})
        kernel, constants = _compat.user_triton_kernel(node)
        assert kernel is side_table_probe and constants == {"N": 4}
        assert _compat.user_triton_kernel(x) is None
        assert _compat.user_triton_kernel(graph.call_function(torch.add, (x, 1))) is None
    finally:
        # A kernel local to this test must not stay in the process-wide table: torch's AOT precompile saves every
        # kernel of the table with a step, and a later load would look this one up by its module path.
        kernel_side_table.id_to_kernel.pop(kernel_idx, None)
        kernel_side_table.kernel_to_id.pop(side_table_probe, None)
        kernel_side_table.constant_args.pop(constant_args_idx, None)


def test_known_equal_decides_ints_and_symbolic_sizes_without_guards():
    assert _compat.known_equal(4, 4) and not _compat.known_equal(4, 5)
    seen = {}

    def backend(gm, example_inputs):
        n = next(n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(
            n.meta.get("example_value"), torch.SymInt))
        size = n.meta["example_value"]
        seen["same"] = _compat.known_equal(size + 1, 1 + size)
        seen["other"] = _compat.known_equal(size + 1, size + 2)
        return gm.forward

    f = torch.compile(lambda x: x * 2, backend=backend, dynamic=True)
    f(torch.ones(5))
    assert seen == {"same": True, "other": False}


# -- Dynamo tracing (issue 30) --------------------------------------------------------------------------------
def test_on_captured_item_sees_each_item_with_its_fake_value():
    seen = []

    def hook(node, value, root_code):
        seen.append((node.op, node.target, _compat.symbol_of(value) is not None, root_code is not None))

    _compat.on_captured_item(hook)
    _compat.on_captured_item(hook)  # once only
    try:
        torch._dynamo.reset()
        with _compat.capture_scalar_outputs():
            torch.compile(lambda x: torch.zeros(int(x.max())) + x.max().item(), backend="eager")(
                torch.tensor([2, 3]))
    finally:
        _compat._ITEM_HOOKS.remove(hook)
        torch._dynamo.reset()
    assert seen and all(s == ("call_method", "item", True, True) for s in seen)
    assert _compat.symbol_of(3) is None


def test_assert_at_runtime_puts_the_condition_in_the_graph():
    graphs, texts = [], []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def hook(node, value, root_code):
        env = _compat.shape_env_of(value)
        assert env is not None and _compat.shape_env_of(3) is None
        texts.append(_compat.assert_at_runtime(env, _compat.symbol_of(value) >= 2, "test"))

    _compat.on_captured_item(hook)
    try:
        torch._dynamo.reset()
        with _compat.capture_scalar_outputs():
            torch.compile(lambda x: x + x.max().item(), backend=backend, fullgraph=True)(torch.tensor([2, 3]))
    finally:
        _compat._ITEM_HOOKS.remove(hook)
        torch._dynamo.reset()
    assert texts == ["u0 >= 2"] and "_assert_scalar" in graphs[0] and "u0 >= 2" in graphs[0]


def test_on_data_dependent_guard_decides_only_user_branches():
    import sympy

    asked = []

    def hook(shape_env, expr):
        asked.append(str(expr))
        _compat.assert_at_runtime(shape_env, expr, "test")
        return sympy.true

    def step(x):
        m = x.max().item()
        return x + 1 if m > 2 else x - 1  # undecidable: a user branch

    _compat.on_data_dependent_guard(hook)
    try:
        torch._dynamo.reset()
        with _compat.capture_scalar_outputs():
            out = torch.compile(step, backend="eager", fullgraph=True)(torch.tensor([2, 3]))
    finally:
        _compat._GUARD_HOOKS.remove(hook)
        torch._dynamo.reset()
    assert asked == ["u0 > 2"] and out.tolist() == [3, 4]


def test_size_facts_symbol_range_and_guard_sizes_on_a_branch_of_sizes_and_a_max():
    """A branch `x.shape[0] < m` with x's size dynamic and m an `.item()` checked into [0, 9]: size_facts gives the
    size's value in this call and the max's range, guard_sizes makes a condition on the size a shape guard (the
    compiled code does not run, and is compiled again, for a call where it fails), known_at_least reads it."""
    import sympy

    seen = []

    def hook(shape_env, expr):
        facts = _compat.size_facts(shape_env, expr)
        (size,), (maximum,) = facts[0], facts[1]
        seen.append((facts[0][size], facts[1][maximum], _compat.symbol_range(shape_env, maximum)))
        assert _compat.guard_sizes(shape_env, sympy.Ge(size, 10)) is (facts[0][size] >= 10)
        assert not _compat.guard_sizes(shape_env, sympy.Lt(size, 0))
        return sympy.false if facts[0][size] >= 10 else None

    def step(x, lengths):
        m = lengths.max().item()
        torch._check(m >= 0)
        torch._check(m <= 9)
        return x + 1 if x.shape[0] < m else x - 1

    _compat.on_data_dependent_guard(hook)
    try:
        torch._dynamo.reset()
        with _compat.capture_scalar_outputs():
            compiled = torch.compile(step, backend="eager", dynamic=True)
            assert compiled(torch.zeros(12), torch.tensor([3, 9])).tolist() == [-1] * 12
            assert compiled(torch.zeros(15), torch.tensor([3, 9])).tolist() == [-1] * 15  # the guard holds
            assert compiled(torch.zeros(4), torch.tensor([3, 9])).tolist() == [1] * 4  # it fails: traced again
    finally:
        _compat._GUARD_HOOKS.remove(hook)
        torch._dynamo.reset()
    assert seen[0] == (12, (0, 9), (0, 9)) and len(seen) >= 2 and seen[-1][0] == 4
    assert _compat.known_at_least(5, 5) and not _compat.known_at_least(4, 5)


def test_frame_residual_reads_the_attribute_stores_with_their_graph_nodes():
    found = []

    class State:
        pass

    state = State()

    def backend(gm, example_inputs):
        residual = _compat.frame_residual(repr)
        found.append((residual.stores, [n for n in gm.graph.nodes if n.op == "call_function"]))
        return gm.forward

    def step(x):
        state.table = x * 2
        state.flag = "set"
        return x + 1

    torch._dynamo.reset()
    torch.compile(step, backend=backend, fullgraph=True)(torch.ones(3))
    torch._dynamo.reset()
    (stores, calls), = found
    assert [where.rsplit(".", 1)[-1] for where, _ in stores] == ["flag", "table"]
    assert stores[0][1] is None and stores[1][1] is calls[0]  # `x * 2`, the graph's node


# -- constructs that break the trace before any max (issue 30, item 3) --------------------------------------
def test_disabled_target_unwraps_only_a_disable_wrapper():
    def kernel(x):
        return x

    assert _compat.disabled_target(torch.compiler.disable(kernel)) is kernel
    assert _compat.disabled_target(kernel) is None


class Pair:
    """A class Dynamo would trace by itself; the hook below models it instead, as tracing.py does a Struct."""

    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    def total(self):
        return self.a * self.b


def test_on_user_class_call_can_build_a_struct_variable_that_leaves_the_graph_as_the_class():
    """A hook that models a class as a container: its fields are read and its method inlined in the graph;
    returned (twice), the object is built once with cls(**fields)."""
    calls = []

    def hook(tx, cls, args, kwargs):
        if cls is Pair:
            calls.append(cls)
            return _compat.struct_variable(cls, {"a": args[0], "b": args[1]})
        return None

    assert _compat.on_user_class_call(hook) is True
    try:
        def fn(x):
            p = Pair(x + 1, 3)
            return p.a * p.b + p.total(), p, p

        out, pair, again = torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))
    finally:
        _compat._CLASS_CALL_HOOKS.remove(hook)
    assert calls == [Pair]
    torch.testing.assert_close(out, torch.full((2,), 12.0))
    assert type(pair) is Pair and pair.b == 3 and pair is again
    torch.testing.assert_close(pair.a, torch.full((2,), 2.0))


class Triple:
    """Modelled by the hook below as a container of three fields, one holding None."""

    __slots__ = ("a", "b", "c")

    def __init__(self, a, b, c=None):
        self.a, self.b, self.c = a, b, c


def test_the_struct_variable_sees_every_field_read_on_this_torch():
    """Dynamo reads an attribute through var_getattr up to 2.13 and through tp_getattro_impl from 2.14 on: the
    model must answer whichever this torch calls. fullgraph=True: a read the model does not see (a GetAttrVariable
    in its place) breaks, or silently runs the frame eagerly, and `t.c is None` would be False. Checked here:
    a None field read with `is`, arithmetic on a field, a field compared with the value it was given and hasattr,
    each with eager's value."""
    def hook(tx, cls, args, kwargs):
        if cls is Triple:
            return _compat.struct_variable(cls, {"a": args[0], "b": args[1], "c": _compat.constant_variable(None)})
        return None

    assert _compat.on_user_class_call(hook) is True
    try:
        def fn(x, b):
            t = Triple(x + 1, b)
            is_none = 2 if t.c is None else 3
            arithmetic = t.b * 2 + t.b // 2 - t.b % 2
            compared = 10 if t.b == 3 else 20
            has = hasattr(t, "a") + 2 * hasattr(t, "nothing")
            return t.a * is_none + arithmetic + compared + has * 100

        for b in (3, 4):
            torch._dynamo.reset()
            got = torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2), b)
            torch.testing.assert_close(got, fn(torch.ones(2), b))
    finally:
        _compat._CLASS_CALL_HOOKS.remove(hook)


def _reads_truth_from_the_class() -> bool:
    """torch 2.13 on: a branch on an object goes through Dynamo's generic_bool (2.13) / generic_is_true (2.14 on),
    which decides from the Python type's own slots (nb_bool, then the length, then True) and asks the
    VariableTracker only where the class defines __bool__ / __len__. 2.11 and 2.12 ask the VariableTracker
    (unpack_var_sequence), which the model denies: the graph breaks there."""
    import torch._dynamo.symbolic_convert as symbolic_convert

    return any(hasattr(symbolic_convert, name) for name in ("generic_bool", "generic_is_true"))


def test_the_truth_of_a_struct_variable_is_eager_s_in_one_graph_or_breaks():
    """`if t:` on a class with no __bool__ / __len__: True, in one graph where this torch reads truth from the
    class (2.13 on); on 2.11 / 2.12 the graph breaks there (default deny). Eager's value either way."""
    def hook(tx, cls, args, kwargs):
        if cls is Triple:  # also where the object is built again after the break: build_struct(cls, **fields)
            given = {**dict(zip(("a", "b", "c"), args)), **kwargs}
            return _compat.struct_variable(cls, {"a": given["a"], "b": given["b"],
                                                 "c": given.get("c", _compat.constant_variable(None))})
        return None

    def fn(x):
        y = x * 3
        t = Triple(y + 1, 2)
        return t.a * (1000 if t else 7) + 1

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    assert _compat.on_user_class_call(hook) is True
    try:
        torch._dynamo.reset()
        before = len(_compat.graph_break_reasons())
        got = torch.compile(fn, backend=backend)(torch.ones(2))
        breaks = _compat.graph_break_reasons()[before:]
    finally:
        _compat._CLASS_CALL_HOOKS.remove(hook)
    torch.testing.assert_close(got, fn(torch.ones(2)))
    if _reads_truth_from_the_class():
        assert len(graphs) == 1 and not breaks, breaks
    else:
        assert breaks


def test_the_struct_variable_breaks_at_what_it_does_not_model():
    """Default deny on this torch: comparing, hashing, iterating, a non-field attribute, ...: each breaks (fullgraph
    raises with the model's words), or raises what eager raises (Dynamo reads the class's own slots first: no
    __iter__, no __len__), never an answer made up as `object` would give it. Where this torch answers from what
    the model states exactly (2.15: `t.__class__` from python_type(), the class itself), the answer is eager's."""
    def hook(tx, cls, args, kwargs):
        if cls is Triple:
            return _compat.struct_variable(cls, {"a": args[0], "b": args[1], "c": _compat.constant_variable(None)})
        return None

    bodies = [lambda t: t == t, lambda t: {t: 1}, lambda t: list(t), lambda t: t.__class__, lambda t: t + 1,
              lambda t: len(t), lambda t: str(t)]
    traced = []
    assert _compat.on_user_class_call(hook) is True
    try:
        for i, body in enumerate(bodies):
            try:
                want = body(Triple(torch.ones(2), 1))
                eager = None
            except Exception as e:  # noqa: BLE001
                eager = type(e)
            torch._dynamo.reset()
            try:
                got, _ = torch.compile(lambda x: (body(Triple(x, 1)), x + 1), backend="eager", fullgraph=True)(
                    torch.ones(2))
            except Exception as e:  # noqa: BLE001
                # fullgraph: a break raises Unsupported; an exception Dynamo raises in the user's code arrives as
                # "Observed exception" naming it, and must be eager's
                assert isinstance(e, torch._dynamo.exc.Unsupported), (body, e)
                if "Observed exception" in str(e):
                    assert eager is not None and f"{eager.__name__}(" in str(e), (body, e)
            else:
                assert eager is None and type(got) is type(want) and got is want, (i, got, want)
                traced.append(i)
    finally:
        _compat._CLASS_CALL_HOOKS.remove(hook)
    assert set(traced) <= {3}, traced  # only t.__class__ may be answered, and only with the class


def test_on_disabled_call_sees_each_constant_exactly():
    """The launcher hook decides "at its default" on the constant Dynamo hands it: -0.0 keeps its sign, a NaN
    stays a NaN, True stays a bool, 1.0 a float, a tuple a tuple (compile_pass.traceable._same_default)."""
    import math

    def kernel(x, v):
        return x

    wrapped = torch.compiler.disable(kernel)
    seen = []

    def hook(tx, fn, args, kwargs):
        known, value = _compat.constant_of(args[1])
        seen.append((known, value))
        return _compat.trace_call(tx, torch.mul, [args[0], _compat.constant_variable(2)], {})

    values = [-0.0, float("nan"), True, 1.0, 1, (1, -0.0)]
    assert _compat.on_disabled_call(hook) is True
    try:
        for v in values:
            torch._dynamo.reset()
            torch.compile(lambda x, v=v: wrapped(x, v), backend="eager", fullgraph=True)(torch.ones(2))
    finally:
        _compat._DISABLED_CALL_HOOKS.remove(hook)
    assert [known for known, _ in seen] == [True] * len(values)
    got = [value for _, value in seen]
    assert math.copysign(1.0, got[0]) == -1.0 and math.isnan(got[1])
    assert [type(v) for v in got] == [float, float, bool, float, int, tuple]
    assert math.copysign(1.0, got[5][1]) == -1.0


def test_on_disabled_call_traces_what_the_hook_returns_in_place_of_the_break():
    def kernel(x):
        return x * 2

    wrapped = torch.compiler.disable(kernel)
    seen = []

    def hook(tx, fn, args, kwargs):
        seen.append(fn)
        known, value = _compat.constant_of(args[1])
        assert known and value == 3 and _compat.is_tensor_variable(args[0])
        return _compat.trace_call(tx, torch.mul, [args[0], _compat.constant_variable(2)], {})

    assert _compat.on_disabled_call(hook) is True
    try:
        def fn(x):
            return wrapped(x + 1, 3) - 1

        got = torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))
    finally:
        _compat._DISABLED_CALL_HOOKS.remove(hook)
    assert seen == [kernel]
    torch.testing.assert_close(got, torch.full((2,), 3.0))


def test_a_placeholder_marked_static_is_a_static_input_of_aot_autograd():
    """mark_static_placeholder sets what AOT autograd reads for static inputs (the placeholder's
    meta['tensor_dict']['_dynamo_static_input_type'], as mark_static_address records it); the tensor and the
    Dynamo graph's own node (whose meta dict a copy shares) are untouched; unmark undoes it."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    def step(x, buf):
        buf[:2].add_(x)
        return x * 2

    x, buf = torch.ones(3), torch.zeros(4, 3)
    gm, copy, names = _dynamo_graph(step, x, buf)
    own = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    placeholders = [n for n in copy.graph.nodes if n.op == "placeholder"]
    target = placeholders[names.index("L['buf']")]
    assert not _compat.is_static_placeholder(target)
    assert _compat.mark_static_placeholder(target) and not _compat.mark_static_placeholder(target)
    assert _compat.is_static_placeholder(target) and not _compat.is_static_placeholder(own[target.name])
    assert not hasattr(buf, "_dynamo_static_input_type")

    def static_indices(module):
        found = []

        def forward(fx, args):
            found.extend(torch._guards.TracingContext.try_get().fw_metadata.static_input_indices)
            return make_boxed_func(fx.forward)

        inputs = [n.meta["example_value"] for n in module.graph.nodes if n.op == "placeholder"]
        with torch._guards.tracing(torch._guards.TracingContext(_compat.fake_mode_of(module.graph.nodes))):
            aot_module_simplified(module, inputs, fw_compiler=forward)  # as Dynamo calls its backend
        return found

    assert static_indices(copy) == [names.index("L['buf']")]
    _compat.unmark_static_placeholder(target)
    assert not _compat.is_static_placeholder(target) and static_indices(copy) == []


def test_static_input_helpers_on_this_torch():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch 2.13 deprecates inline_inbuilt_nn_modules: read without a warning
        assert _compat.static_inputs_rerecord()  # OSS torch: a static input's new address re-records
    assert _compat.input_alignment() == 16
    pool = torch.zeros(16, dtype=torch.int32)
    assert _compat.statically_aligned(pool[4:]) and not _compat.statically_aligned(pool[1:])


def test_inductor_triton_cache_dir_is_where_inductor_points_triton(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "set"))
    assert _compat.inductor_triton_cache_dir(1) == str(tmp_path / "set")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert _compat.inductor_triton_cache_dir(1) == str(tmp_path / "inductor" / "triton" / "1")


# -- region_schema_cache: one schema per region body while the backend's compile_fx runs ---------------------------
@torch.compiler.nested_compile_region
def _region_matmul(x, w):
    return torch.relu(x @ w) + 1


@torch.compiler.nested_compile_region
def _region_accumulate(x, buf):  # mutates an operand: the schema says so, and functionalization follows it
    buf.add_(x.sum())
    return x * 2


def _regions_step(x, ws, buf):
    for w in ws:
        x = _region_accumulate(_region_matmul(x, w), buf)
    return x


def _graph_text(gm) -> str:
    """The forward graph's code with each region call's schema constant written out: the cache hands every call
    of a body the same schema object (one attribute), torch without it one equal object per call."""
    import re

    code = re.sub(r"_tree_spec_constant\w*", "SCHEMA", gm.code)
    import torch.utils._pytree as pytree

    schemas = [str(getattr(pytree.tree_unflatten([], getattr(gm, n.target)), "schema", None)) for n in gm.graph.nodes
               if n.op == "get_attr" and n.target.startswith("_tree_spec_constant")]
    assert all(s != "None" for s in schemas)
    return code + "\n".join(schemas)


def _compile_regions(cache: str, monkeypatch):
    """The step compiled through AOTAutograd (no Inductor) with cache "off", "on" (where torch lacks its own)
    or "forced"; returns (outputs, buffer, forward graph code, schema traces of region bodies, installed)."""
    import torch._higher_order_ops.utils as hop_utils
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    traces, codes, installed = [], [], []
    original = hop_utils.materialize_as_graph
    monkeypatch.setattr(hop_utils, "materialize_as_graph", lambda *a, **k: traces.append(1) or original(*a, **k))

    def fw(gm, _):
        codes.append(_graph_text(gm))
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        if cache == "off":
            return aot_autograd(fw_compiler=fw)(gm, example_inputs)
        with _compat.region_schema_cache(force=cache == "forced") as on:
            installed.append(on)
            return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x, ws, buf = torch.randn(4, 8, generator=gen), [torch.randn(8, 8, generator=gen) for _ in range(6)], torch.zeros(())
    out = torch.compile(_regions_step, backend=backend, fullgraph=True)(x, ws, buf)
    return out, buf, codes[0], len(traces), installed[0] if installed else None


def test_region_schema_cache_traces_each_body_once_and_changes_no_graph(monkeypatch):
    original = _compat._invoke_subgraph_module().HopInstance
    gen = torch.Generator().manual_seed(0)
    x, ws, buf = torch.randn(4, 8, generator=gen), [torch.randn(8, 8, generator=gen) for _ in range(6)], torch.zeros(())
    expected = _regions_step(x, ws, buf)  # eager: the regions are plain calls
    off = _compile_regions("off", monkeypatch)
    forced = _compile_regions("forced", monkeypatch)
    assert forced[4] is True
    for out, got_buf, *_ in (off, forced):
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(got_buf, buf)
    assert forced[2] == off[2]  # the same forward graph, with and without the cache
    assert forced[3] <= 2 * 2  # at most one schema trace per body per AOTAutograd pass (metadata, trace)
    assert _compat._invoke_subgraph_module().HopInstance is original  # restored
    assert not getattr(_compat._invoke_subgraph_module().HopInstance, "_syncfree_schema_cache", False)


def test_region_schema_cache_installs_only_where_torch_lacks_its_own(monkeypatch):
    off = _compile_regions("off", monkeypatch)
    on = _compile_regions("on", monkeypatch)
    assert on[4] is (not _compat.torch_caches_region_schemas())
    assert on[2] == off[2]
    if _compat.torch_caches_region_schemas():  # torch's own cache: a trace per body per pass already
        assert off[3] <= 2 * 2
    else:  # torch 2.11: a trace per call per pass without the cache (6 layers x 2 regions x 2 passes)
        assert off[3] >= 2 * 6 * 2 and on[3] <= 2 * 2
    torch.testing.assert_close(on[0], off[0])


def test_region_schema_cache_is_per_tracing_context():
    assert _compat.region_schema_entries() is None  # no tracing context outside a compile
    with _compat.region_schema_cache(force=True) as on:
        assert on
        with _compat.region_schema_cache(force=True) as nested:
            assert not nested  # already installed: the outer one restores it
    assert not getattr(_compat._invoke_subgraph_module().HopInstance, "_syncfree_schema_cache", False)


def test_region_schema_cache_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SYNCFREE_REGION_SCHEMA_CACHE", "0")
    with _compat.region_schema_cache(force=True) as on:
        assert not on
        assert not getattr(_compat._invoke_subgraph_module().HopInstance, "_syncfree_schema_cache", False)


def test_warm_compile_workers_starts_nothing_without_a_pool(monkeypatch):
    import torch._inductor.async_compile as async_compile

    started = []
    monkeypatch.setattr(async_compile, "get_compile_threads", lambda: 1)
    monkeypatch.setattr(async_compile.AsyncCompile, "warm_pool", classmethod(lambda cls: started.append("warm")))
    assert _compat.warm_compile_workers() is False and started == []
    monkeypatch.setattr(async_compile, "get_compile_threads", lambda: 4)
    monkeypatch.setattr(async_compile.AsyncCompile, "wakeup", classmethod(lambda cls: started.append("wakeup")))
    assert _compat.warm_compile_workers() is True and started == ["warm", "wakeup"]


def test_fresh_fake_mode_makes_fake_tensors_of_its_own_without_the_shared_cache():
    mode = _compat.fresh_fake_mode()
    other = _compat.fresh_fake_mode()
    assert mode is not other and not mode.cache_enabled
    with mode:
        t = torch.empty(4, 8, dtype=torch.bfloat16).as_strided((4, 4), (8, 1), 2)
    assert t.fake_mode is mode and t.shape == (4, 4) and t.stride() == (8, 1) and t.storage_offset() == 2
