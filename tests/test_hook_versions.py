"""Each trace-time hook of compile_pass._compat.dynamo_hooks, through compile_pass.compile on the installed torch
(issue 45, item 4). The hooks patch Dynamo's private classes, which change from one torch to the next: each test
fails when its hook stops seeing what it models on this torch, never only when a value differs. CI runs them on
torch 2.13; `make test-versions` runs them (with the trace-time and SGLang suites) on 2.11 and 2.15 as well.

    hook (what it wraps)                                   what it must see on this torch
    on_captured_item (TensorVariable.call_method)          the `.item()` of a max of declared lengths
    on_data_dependent_guard (SymNodeVariable.evaluate_expr) the user's branch on that max, decided by [0, bound]
    on_user_class_call + StructVariable (UserDefinedClassVariable.call_function; var_getattr up to 2.13,
        tp_getattro_impl from 2.14; UserMethodVariable of (fn, obj) up to 2.14, (im_func, im_self) from 2.15)
                                                           a None field read with `is`, arithmetic on a field,
                                                           a field compared, a method, a property
    on_disabled_call (SkipFunctionVariable.call_function)  a launcher's argument at its default: same type, same bits
    on_frame_compile (ConvertFrameAssert.__call__)          each frame compile; never a call Dynamo's cache serves
    break_where_dynamo_cannot_allocate (the class-call wrapper, installed at import on 2.11 / 2.12)
                                                           a Struct Dynamo builds by itself: a graph break, not a
                                                           failed compile, in a fresh process
    no_guard_profiling (torch._dynamo.guards.profile_guard_manager)   the function it replaces, and restored
    user_triton_kernel (torch's kernel side table, read by TraceSignature)
                                                           a launch's kernel and constants, one signature for two
                                                           traces of one launch, another for other constants

"One graph" is checked by the reports of the compiled function as well as by the breaks Dynamo records: a frame
Dynamo gives up on runs eagerly with eager's values and no recorded break (torch 2.11 / 2.12 do that at a denied
operation), which a value check alone would not see.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import compile_pass
from compile_pass import _compat, traceable

# The torch versions the README's version table says these hooks were checked on: there the Struct model must fit
# (on another torch it may turn itself off, with its reason, and the tests check that instead).
CHECKED = {(2, 11), (2, 12), (2, 13), (2, 14), (2, 15)}
TORCH = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])

try:
    import msgspec
except ImportError:  # pragma: no cover - msgspec comes with the SGLang set (make sglang-deps)
    msgspec = None
needs_msgspec = pytest.mark.skipif(msgspec is None, reason="msgspec is not installed (make sglang-deps)")


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn, **options):
    """(compile_pass.compile(fn), a function giving the graph breaks recorded since)."""
    before = len(_compat.graph_break_reasons())
    compiled = compile_pass.compile(fn, max_context_len=16, **options)
    return compiled, lambda: [reason for reason, _ in _compat.graph_break_reasons()[before:]]


# -- on_captured_item + on_data_dependent_guard: the range a max gets while Dynamo traces ----------------------------
PS = 4


class Scratch:
    def __init__(self, width):
        self.buf = torch.full((4, width), -1, dtype=torch.int32)


def _grow_step(scratch, seq_lens, r2t):
    m = seq_lens.max().item()
    n = (m + PS - 1) // PS
    buf = scratch.buf
    if buf.shape[1] < n:  # undecidable without the range; False for every m in [0, 16] with a 4-page buffer
        buf = torch.full((4, n), -1, dtype=torch.int32)
        scratch.buf = buf
    table = buf[:2, :n]
    table.copy_(r2t[:2, :n])
    return table.sum(), m


def test_a_max_of_lengths_gets_its_range_while_dynamo_traces():
    """The item hook sees the `.item()` of the max (a lengths input), the guard hook the branch on it: the branch
    is decided by [0, 16], so every length in the range runs one graph, compiled once, with eager's values; the
    kept max (it is returned) has the range checked on the host, so 17 raises."""
    from torch._dynamo.variables.tensor import SymNodeVariable, TensorVariable

    r2t = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    step, breaks = _compiled(_grow_step)
    for m in range(17):
        lens = torch.tensor([m, m // 2])
        got, want = step(Scratch(16 // PS), lens, r2t), _grow_step(Scratch(16 // PS), lens, r2t)
        assert int(got[0]) == int(want[0]) and int(got[1]) == want[1] == m
    assert getattr(TensorVariable.call_method, "_syncfree_item_hook", False)
    assert getattr(SymNodeVariable.evaluate_expr, "_syncfree_guard_hook", False)
    assert breaks() == [] and len(compile_pass.reports(step)) == 1
    assert _compat.dynamo_cache_entries(_grow_step.__code__) == 1
    with pytest.raises(RuntimeError, match=r"max_context_len=16|<= 16"):  # the pass's message, or Inductor's
        step(Scratch(16 // PS), torch.tensor([17, 1]), r2t)


# -- on_user_class_call + StructVariable: a msgspec.Struct traced as the plain container it is ----------------------
if msgspec is not None:
    class Geometry(msgspec.Struct):
        ids: torch.Tensor
        stride: int
        v2p: object = None
        scale: float = 0.5

        def scaled(self, k):
            return self.ids * k

        @property
        def width(self):
            return self.stride * 10


def _struct_step(x, stride):
    g = Geometry(x + 1, stride)
    a = 2 if g.v2p is None else 3  # a None field read with `is`
    b = g.stride * 2 + g.stride // 2 - g.stride % 2 + g.scale * 4  # arithmetic on fields
    c = (10 if g.stride == 3 else 20) + (100 if g.scale < 1 else 200)  # fields compared
    d = isinstance(g, Geometry) + 2 * (type(g) is Geometry) + 4 * hasattr(g, "v2p") + 8 * hasattr(g, "nothing")
    return g.scaled(a) + b + c + d * 1000 + g.width


@needs_msgspec
def test_a_struct_field_read_compared_and_used_in_arithmetic_is_eager_s_in_one_graph():
    """On a torch where the model fits, one graph, eager's values; where it does not (struct_model_unfit names
    why), the Struct breaks the graph where it is built, with that reason, and the values are eager's."""
    unfit = _compat.struct_model_unfit()
    if TORCH in CHECKED:
        assert unfit is None, unfit
    for stride in (3, 4, 7):
        torch._dynamo.reset()
        step, breaks = _compiled(_struct_step)
        torch.testing.assert_close(step(torch.ones(2), stride), _struct_step(torch.ones(2), stride))
        if unfit is None:
            assert breaks() == [] and len(compile_pass.reports(step)) == 1, breaks()
        else:
            assert any(traceable.STRUCT_REFUSED in b and unfit in b for b in breaks()), breaks()


@needs_msgspec
def test_a_struct_leaves_the_graph_as_one_instance_with_the_fields_given():
    def step(x):
        g = Geometry(x * 2, 5, scale=0.25)
        return g.ids + g.stride, g, g

    got, g, again = compile_pass.compile(step, max_context_len=16)(torch.ones(2))
    assert type(g) is Geometry and g is again and (g.stride, g.v2p, g.scale) == (5, None, 0.25)
    torch.testing.assert_close(got, torch.full((2,), 7.0))
    torch.testing.assert_close(g.ids, torch.full((2,), 2.0))


@needs_msgspec
def test_a_struct_through_torch_compile_alone_breaks_the_graph_in_a_fresh_process():
    """Dynamo builds the Struct by itself there (the class hook models it only under compile_pass.compile). torch
    2.11 / 2.12 failed that compile (InternalTorchDynamoError: object.__new__ is not safe) with any backend; from
    `import compile_pass` on, they break the graph as 2.13 on do. A fresh process: nothing else installed it."""
    code = textwrap.dedent("""
        import msgspec, torch
        import compile_pass
        from compile_pass import _compat

        class Table(msgspec.Struct):
            ids: torch.Tensor
            stride: int

        def step(x):
            return Table(x + 1, 2).ids * 2

        got = torch.compile(step, backend="syncfree", options={"max_context_len": 16})(torch.ones(2))
        assert torch.equal(got, torch.full((2,), 4.0)), got
        breaks = [reason for reason, _ in _compat.graph_break_reasons()]
        assert any("user-defined class construction" in b for b in breaks), breaks
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


# -- on_disabled_call: a registered launcher's default, identical by type and bits --------------------------------
def _launch(x, out, scale, sign=0.0, nan=float("nan"), mode=1, pair=(1, 0.0)):
    """Writes what each argument the op does not take is exactly: a call not at its defaults writes otherwise."""
    k = math.copysign(1.0, sign) * (2.0 if math.isnan(nan) and math.copysign(1.0, nan) > 0 else 3.0)
    k += 10.0 * (type(mode) is not int) + 100.0 * math.copysign(1.0, pair[1]) + 1000.0 * (type(pair[0]) is not int)
    out.copy_(x * scale + k)


LAUNCH = torch.compiler.disable(_launch)
_OP: list = []


@pytest.fixture
def launcher():
    if not _OP:  # an op is defined once per process
        _OP.append(compile_pass.register_disabled_launcher(
            _launch, name="syncfree_hook_versions::launch", schema="(Tensor x, Tensor(a!) out, float scale) -> ()"))
    else:
        compile_pass.register_disabled_launcher(_launch, _OP[0])
    yield _OP[0]
    compile_pass.unregister_disabled_launcher(_launch)


@pytest.mark.parametrize("given, at_default", [
    ({}, True), ({"sign": 0.0}, True), ({"nan": float("nan")}, True), ({"mode": 1}, True), ({"pair": (1, 0.0)}, True),
    ({"sign": -0.0}, False), ({"nan": -float("nan")}, False), ({"mode": True}, False), ({"mode": 1.0}, False),
    ({"pair": (1, -0.0)}, False), ({"pair": (True, 0.0)}, False),
])
def test_a_launcher_argument_is_at_its_default_only_when_identical_in_type_and_bits(launcher, given, at_default):
    """The disabled-call hook hands the launcher's arguments over as Dynamo's constants: -0.0 keeps its sign, a NaN
    its sign bit, True stays a bool. At the default: traced as the op, one graph; else the graph breaks there and
    the break names the argument. Eager's values either way."""
    def step(x):
        out = torch.empty_like(x)
        LAUNCH(x + 1, out, 2.0, **given)
        return out * 3

    compiled, breaks = _compiled(step)
    torch.testing.assert_close(compiled(torch.ones(3)), step(torch.ones(3)))
    if at_default:
        assert breaks() == [] and len(compile_pass.reports(compiled)) == 1, breaks()
    else:
        name = next(iter(given))
        assert any(f"{traceable.LAUNCHER_REFUSED} ({name}=)" in b for b in breaks()), breaks()


# -- on_frame_compile: entered where Dynamo compiles a frame, never at a call its cache serves ------------------------
def test_the_frame_compile_hook_is_entered_at_each_compile_and_never_at_a_cached_call():
    entered = []

    def hook():
        entered.append(1)
        return None

    def f(x):
        return x * 2 + 1

    assert _compat.on_frame_compile(hook) is True
    try:
        compiled = torch.compile(f, backend="eager", dynamic=False)
        compiled(torch.ones(3))
        first = len(entered)
        for _ in range(3):
            compiled(torch.ones(3))
        assert first >= 1 and len(entered) == first
        compiled(torch.ones(5))  # a new shape: a recompile
        assert len(entered) > first
    finally:
        _compat._FRAME_COMPILE_HOOKS.remove(hook)


# -- no_guard_profiling: the test-speed patch of the generated trace-time suites --------------------------------------
def test_no_guard_profiling_replaces_the_function_dynamo_calls_and_restores_it():
    import torch._dynamo.guards as guards

    original = getattr(guards, "profile_guard_manager", None)
    if TORCH in CHECKED:
        assert original is not None  # on a torch without it the patch is a no-op
    with _compat.no_guard_profiling():
        if original is not None:
            assert guards.profile_guard_manager is not original
            torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    assert getattr(guards, "profile_guard_manager", None) is original


@needs_msgspec
@pytest.mark.parametrize("unfit", ["attribute_reader", "method_layout"])
def test_where_the_struct_model_does_not_fit_it_turns_itself_off_with_its_reason_code(monkeypatch, unfit):
    """As on a torch whose Dynamo reads attributes through a method the model does not answer, or builds a bound
    method in another layout: the model is off, the Struct breaks the graph where it is built, the report's note
    carries the reason code and the one change, and the values are eager's."""
    from compile_pass._compat import dynamo_hooks

    if unfit == "attribute_reader":
        monkeypatch.setattr(dynamo_hooks, "_ATTRIBUTE_READERS", ("no_such_reader",))
    else:
        monkeypatch.setattr(dynamo_hooks, "_method_layout", lambda: None)
    assert _compat.struct_model_unfit() is not None
    step, breaks = _compiled(_struct_step)
    torch.testing.assert_close(step(torch.ones(2), 3), _struct_step(torch.ones(2), 3))
    assert any(traceable.STRUCT_REFUSED in b for b in breaks()), breaks()
    notes = [n for r in compile_pass.reports(step) for n in r.notes if traceable.STRUCT_REFUSED in n]
    codes = [traceable.break_code(n) for n in notes]
    assert "struct_model_unfit" in codes, notes
    assert all("the msgspec.Struct model is off on this torch" in n for n in notes), notes


def test_a_user_triton_launch_is_read_from_the_kernel_side_table_and_spelled_by_its_entries(monkeypatch):
    """_compat.user_triton_kernel reads torch's kernel side table (a private class): the kernel and the constant
    arguments of a launch in a Dynamo graph. Two traces of one launch get two constant-argument indices; their
    TraceSignatures must still be equal (the two outcomes of TRTLLM-MLA's round-up launch the Triton writer alike),
    and a launch with another constant must differ. Traced only (a backend that never runs the graph), so no GPU
    and no interpreter: on every torch of the version table."""
    triton = pytest.importorskip("triton")
    import torch.utils._triton as triton_utils
    import triton.language as tl

    from compile_pass.trace_signature import TraceSpelling, graph_signature

    @triton.jit
    def fill(out_ptr, n, VALUE: tl.constexpr):
        i = tl.arange(0, 8)
        tl.store(out_ptr + i, VALUE, mask=i < n)

    monkeypatch.setattr(triton_utils, "has_triton", lambda *args, **kwargs: True)  # a GPU-less machine

    spell = TraceSpelling()  # one spelling: every signature is compared while its objects are alive

    def traced(value):
        """(signature, the launch's constant-argument index, what the side table holds for the launch, the graph),
        read right after the trace as the pass reads them (torch._dynamo.reset() empties the side table)."""
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return lambda *args: ()  # the launch never runs here

        def step(out):  # a new function each time: traced anew without resetting Dynamo
            fill[(1,)](out, out.shape[0], VALUE=value)

        torch.compile(step, backend=backend, fullgraph=True)(torch.zeros(8, dtype=torch.int32))
        (gm,) = graphs
        (launch,) = [n for n in gm.graph.nodes if _compat.user_triton_kernel(n) is not None]
        return (graph_signature(gm.graph, spell), launch.kwargs["constant_args_idx"],
                _compat.user_triton_kernel(launch), gm)

    torch._dynamo.reset()
    first, first_index, (kernel, constants), first_graph = traced(3)
    again, again_index, _, _ = traced(3)
    other, _, _, _ = traced(4)
    assert kernel is fill and constants["VALUE"] == 3, constants
    assert first_index != again_index  # what made the two outcomes' traces differ before 2026-12-05
    assert first == again
    assert first != other
    # a launch whose entries the table no longer holds (torch._dynamo.reset() empties it from torch 2.12 on; the
    # table's own reset_table on every version) is never the same as another trace's: the indices restart
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernel_side_table.reset_table()
    (launch,) = [n for n in first_graph.graph.nodes if "constant_args_idx" in n.kwargs]
    assert _compat.user_triton_kernel(launch) is None
    assert graph_signature(first_graph.graph, spell) != graph_signature(first_graph.graph, spell)
