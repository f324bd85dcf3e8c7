"""What the backend tells Dynamo while it traces: hooks at a captured `.item()`, at a data-dependent branch of
the user's code, at a user class's construction and at a call of a torch.compiler.disable()d function; and the
VariableTracker of a msgspec.Struct modelled as a plain container.

Patches here (each installed once, marked with a `_syncfree_*` attribute; each dated: the torch versions it was
checked on, what would remove it). "Checked" means tests/test_hook_versions.py, tests/test_compat.py and
tests/test_tracing.py passed on that torch (PyPI's builds for 2.11.0, 2.12.1, 2.14.1, 2.15.0; the CPU build of
2.13.0), 2026-12-04:
  * on_captured_item wraps torch._dynamo.variables.tensor.TensorVariable.call_method. Checked on 2.11.0, 2.12.1,
    2.13.0, 2.14.1, 2.15.0. Removed when Dynamo offers a hook at unbacked-symbol creation with the FX node.
  * on_data_dependent_guard wraps SymNodeVariable.evaluate_expr. Checked on 2.11.0, 2.12.1, 2.13.0, 2.14.1,
    2.15.0. Removed when Dynamo lets a backend give an unbacked symbol's range before tracing.
  * on_user_class_call wraps UserDefinedClassVariable.call_function; on_disabled_call wraps
    SkipFunctionVariable.call_function. Checked on 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0. Removed when Dynamo
    traces msgspec.Struct construction and lets a backend trace a torch.compiler.disable()d call as an op.
  * break_where_dynamo_cannot_allocate: the same class-call wrapper, installed at `import compile_pass` on 2.11
    and 2.12 only, turns Dynamo's failure to allocate an extension type (TypeError "object.__new__(X) is not
    safe", raised as InternalTorchDynamoError: the compile failed, with any backend) into the graph break 2.13
    makes there itself (ALLOCATION_BREAK). Checked on 2.11.0 and 2.12.1 (the failure, and the break instead) and
    2.13.0, 2.14.1, 2.15.0 (Dynamo breaks by itself; not installed early). Removed with torch 2.12.
  * StructVariable (a VariableTracker subclass, not a patch) answers attribute reads through var_getattr (Dynamo
    up to 2.13) and tp_getattro_impl (2.14 on), and binds a method as this torch builds a UserMethodVariable
    (the function and the object up to 2.14; the function's VariableTracker and the object from 2.15:
    _method_layout); every other per-type method of this torch's VariableTracker (truth, comparison, hashing,
    iteration, operators: 2.13's bool_impl / richcompare_impl, 2.14's nb_bool_impl / tp_richcompare_impl, ...)
    breaks the graph on it (default deny). Truth of a Struct with no __bool__ / __len__ is True in one graph
    from 2.13 on (Dynamo reads it from the class); on 2.11 and 2.12 Dynamo asks the VariableTracker
    (unpack_var_sequence), denied: the graph breaks there. Where VariableTracker has neither attribute reader, or
    UserMethodVariable takes neither layout, struct_model_unfit() turns the model off (a Struct breaks where it
    is built, and the break says why). Checked on 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0: the model fits on each.
  * on_frame_compile wraps torch._dynamo.convert_frame.ConvertFrameAssert.__call__ (issue 43: what a call of
    compile_pass.compile gives Dynamo is entered where Dynamo compiles a frame, not around every call). Checked on
    2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0. Removed when Dynamo offers a per-compile context hook to a backend.
  * compiling_frame_entry (read, not patched; 2026-12-06) walks the Python stack from the frame-compile wrapper
    above: past Dynamo's callback chain (the frames of torch/_dynamo/convert_frame.py) to the caller of the frame
    being compiled (on CPython 3.11+ that frame is not linked into the stack yet while Dynamo compiles it), then past
    torch.compile's wrapper (torch/_dynamo/eval_frame.py) and nn.Module's call of a module without forward
    pre-hooks (a compiled module's forward). Checked on 2.11.0, 2.13.0, 2.15.0 (tests/test_tracing.py,
    tests/relations/test_trace_time_frames.py). Removed when Dynamo tells a hook whether the frame it compiles is
    the outermost frame of a compiled call.
tests/test_hook_versions.py has a test per hook that fails when the hook stops seeing what it models on the
installed torch (CI: 2.13; `make test-versions`: 2.11 and 2.15); tests/test_compat.py tests each function alone.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx


from .accessors import free_unbacked_symbols


# What the backend gives Dynamo while it traces: a callback at each captured `.item()`, where a max of declared
# lengths receives its value range (compile_pass.tracing). Tested in tests/test_tracing.py.
_ITEM_HOOKS: list = []


def on_captured_item(hook) -> None:
    """Call `hook(item_node, value, root_code)` whenever Dynamo captures a `Tensor.item()` (also `int(t)`,
    `t.__index__()`) into the graph: `item_node` is the FX node just created, `value` its fake SymInt / SymFloat,
    `root_code` the code object of the frame Dynamo is compiling (the outermost one, inlined calls included).
    Installed once (a wrapper around Dynamo's TensorVariable.call_method); the hook runs inside Dynamo's trace."""
    from torch._dynamo.variables.tensor import TensorVariable

    if hook not in _ITEM_HOOKS:
        _ITEM_HOOKS.append(hook)
    if getattr(TensorVariable.call_method, "_syncfree_item_hook", False):
        return
    original = TensorVariable.call_method

    def call_method(self, tx, name, *rest, **kw):
        result = original(self, tx, name, *rest, **kw)
        if name == "item" and _ITEM_HOOKS:
            proxy = getattr(result, "proxy", None)
            node = getattr(proxy, "node", None)
            if isinstance(node, torch.fx.Node):
                root = getattr(getattr(tx, "output", None), "root_tx", None)
                for each in list(_ITEM_HOOKS):
                    each(node, node.meta.get("example_value"), getattr(root, "f_code", None))
        return result

    call_method._syncfree_item_hook = True  # type: ignore[attr-defined]
    TensorVariable.call_method = call_method


def symbol_of(value):
    """The sympy symbol behind an unbacked SymInt (u0), or None."""
    node = getattr(value, "node", None)
    expr = getattr(node, "expr", None)
    return expr if getattr(expr, "is_Symbol", False) else None


_GUARD_HOOKS: list = []
RETRY = object()  # a guard hook's answer: facts were added (a value range), evaluate the condition again


def on_data_dependent_guard(hook) -> None:
    """Call `hook(shape_env, expr)` where the user's code branches on a condition over unbacked symbols that
    Dynamo cannot decide (`if blocks % lcm != 0:`, where it would break the graph). Only the user's own branches
    (Dynamo's SymNodeVariable.evaluate_expr: `if`, `bool()`), not the guards torch evaluates internally (those
    catch the error and take a general path). The hook returns None (the break stands), the value to trace
    with, after recording a runtime assertion of it (`shape_env.guard_or_defer_runtime_assert`), or RETRY after
    it added facts (`torch._check`) that may decide the condition: Dynamo then evaluates it again. Installed once."""
    from torch._dynamo.variables.tensor import SymNodeVariable

    if hook not in _GUARD_HOOKS:
        _GUARD_HOOKS.append(hook)
    if getattr(SymNodeVariable.evaluate_expr, "_syncfree_guard_hook", False):
        return
    original = SymNodeVariable.evaluate_expr

    def evaluate_expr(self, *args, **kwargs):
        for _attempt in range(3):  # a hook that returns RETRY has added facts: Dynamo evaluates again
            try:
                return original(self, *args, **kwargs)
            except Exception:
                node = getattr(getattr(self, "sym_num", None), "node", None)
                shape_env, expr = getattr(node, "shape_env", None), getattr(node, "expr", None)
                if shape_env is None or expr is None or not free_unbacked_symbols(self.sym_num):
                    raise
                retry = False
                for each in list(_GUARD_HOOKS):
                    value = each(shape_env, expr)
                    if value is RETRY:
                        retry = True
                        break
                    if value is not None:
                        return bool(value)
                if not retry:
                    raise
        return original(self, *args, **kwargs)

    evaluate_expr._syncfree_guard_hook = True  # type: ignore[attr-defined]
    SymNodeVariable.evaluate_expr = evaluate_expr


def size_facts(shape_env, expr):
    """(hints, ranges) for a condition over symbols: each backed symbol's value in this trace (a size of an input:
    Dynamo guards on it) and each unbacked symbol's value range as the shape env holds it ([lower, upper], ints;
    the range given while tracing, runtime-asserted). None where a symbol has neither, or a range is not finite.
    Read, not patched (ShapeEnv.backed_var_to_val, var_to_val before it; var_to_range): checked on 2.11.0, 2.13.0,
    2.15.0, 2026-12-05 (tests/test_compat.py)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols as _unbacked

    values = getattr(shape_env, "backed_var_to_val", None)
    if values is None:
        values = shape_env.var_to_val
    unbacked = set(_unbacked(expr))
    hints, ranges = {}, {}
    for symbol in getattr(expr, "free_symbols", ()):
        if symbol in unbacked:
            ranges[symbol] = symbol_range(shape_env, symbol)
            if ranges[symbol] is None:
                return None
        elif symbol in values and getattr(values[symbol], "is_Integer", False):
            hints[symbol] = int(values[symbol])
        else:
            return None
    return hints, ranges


def symbol_range(shape_env, symbol):
    """(lower, upper) of a symbol's value range in the shape env (ShapeEnv.var_to_range), ints; None where it is
    not finite or not known. Read, not patched: checked on 2.11.0, 2.13.0, 2.15.0, 2026-12-05."""
    found = getattr(shape_env, "var_to_range", {}).get(symbol)
    lower, upper = getattr(found, "lower", None), getattr(found, "upper", None)
    if not (getattr(lower, "is_Integer", False) and getattr(upper, "is_Integer", False)):
        return None
    return int(lower), int(upper)


def guard_sizes(shape_env, condition) -> bool:
    """Make `condition` (over backed symbols only: input sizes) a guard of this trace, as Dynamo's own shape
    guards are (checked on the host before the compiled code runs; a call where it fails compiles again). True
    where it holds in this trace and was recorded. ShapeEnv.evaluate_expr: checked on 2.11.0, 2.13.0, 2.15.0."""
    import sympy

    try:
        return shape_env.evaluate_expr(condition) is sympy.true
    except Exception:  # noqa: BLE001 -- not recorded: not decided
        return False


def shape_env_of(value):
    """The ShapeEnv behind a SymInt / SymBool (None for a plain value)."""
    return getattr(getattr(value, "node", None), "shape_env", None)


def assert_at_runtime(shape_env, guard, message: str) -> str:
    """Record `guard` (a sympy condition) as a runtime assertion of this trace (Dynamo puts it in the graph as
    `_assert_scalar`); returns the condition as that assertion's message spells it."""
    record = getattr(shape_env, "guard_or_defer_runtime_assert", None) or shape_env.defer_runtime_assert
    record(guard, message)
    return str(shape_env.simplify(guard))


def discard_graph_breaks(since: int) -> None:
    """Forget the graph breaks Dynamo recorded after the first `since`: those of a trace whose graph the backend
    refused (tracing.Retrace), which never runs."""
    try:
        from torch._dynamo.utils import graph_break_reasons as reasons
    except ImportError:
        return
    del reasons[since:]


# Where Dynamo compiles a frame (issue 43): compile_pass.compile enters what its call gives Dynamo
# (capture_scalar_outputs, the bounded maxima, the report collector) only there, so that a call Dynamo's cache
# serves runs nothing of it.
_FRAME_COMPILE_HOOKS: list = []


def on_frame_compile(hook) -> bool:
    """Call `hook()` where Dynamo starts compiling a frame (its cache missed, or a guard failed: a first compile or a
    recompile, fullgraph or not, whatever the compile stance or backend), before it traces: `hook` returns a
    context manager that stays entered for that frame's whole compile (the trace, the backend call, the guards),
    or None. A call Dynamo's cache serves never reaches it. Installed once, around ConvertFrameAssert.__call__
    (every frame compile passes there: ConvertFrame delegates to it); returns False (nothing installed) on a
    torch without that class."""
    import contextlib

    try:
        from torch._dynamo import convert_frame
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    owner = getattr(convert_frame, "ConvertFrameAssert", None)
    if owner is None or not callable(getattr(owner, "__call__", None)):  # pragma: no cover
        return False
    if hook not in _FRAME_COMPILE_HOOKS:
        _FRAME_COMPILE_HOOKS.append(hook)
    if getattr(owner.__call__, "_syncfree_compile_hook", False):
        _COMPILE_WRAPPER_CODE[:] = [owner.__call__.__code__]
        return True
    original = owner.__call__

    def __call__(self, *args, **kwargs):
        if "skip" in kwargs:  # the frames Dynamo drops from the user's traceback: this wrapper's is one more
            kwargs["skip"] += 1
        entered = [c for c in (each() for each in list(_FRAME_COMPILE_HOOKS)) if c is not None]
        if not entered:
            return original(self, *args, **kwargs)
        with contextlib.ExitStack() as stack:
            for context in entered:
                stack.enter_context(context)
            return original(self, *args, **kwargs)

    __call__._syncfree_compile_hook = True  # type: ignore[attr-defined]
    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    owner.__call__ = __call__
    _COMPILE_WRAPPER_CODE[:] = [__call__.__code__]
    return True


_COMPILE_WRAPPER_CODE: list = []  # the code object of on_frame_compile's wrapper, once installed


def compiling_frame_entry():
    """Called from a hook of on_frame_compile (inside the wrapper, before Dynamo traces): how the frame Dynamo is
    about to compile was entered, as (through_wrapper, outer):
      - through_wrapper: True where its callers up to the first other frame are torch.compile's own wrapper
        (torch/_dynamo/eval_frame.py) and, for a compiled module, nn.Module's call of a module without forward
        pre-hooks (_calls_through), i.e. the frame is the outermost frame of a call of a compiled function (nothing
        of that call has run yet);
        False where its caller is any other frame (user code: a frame resumed after a graph break, a function
        the caller could not inline, a recursive call);
      - outer: the first frame above the caller and torch.compile's wrapper frames (through_wrapper True: whoever
        called the compiled function), or the caller itself (through_wrapper False); None at the stack's top.
    None where the wrapper is not on the stack (not called from a frame-compile hook) or not installed.
    Frames are returned, not kept: the caller reads them at once."""
    import sys

    from torch._dynamo import convert_frame, eval_frame

    if not _COMPILE_WRAPPER_CODE:
        return None
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _COMPILE_WRAPPER_CODE[0]:
        frame = frame.f_back
    if frame is None:
        return None
    frame = frame.f_back
    callback = _source_file(convert_frame)
    while frame is not None and _source_file(frame) == callback:  # Dynamo's callback chain: ConvertFrame, ...
        frame = frame.f_back
    caller, through_wrapper = frame, False
    while frame is not None and _calls_through(frame):
        through_wrapper = through_wrapper or _source_file(frame) == _source_file(eval_frame)
        frame = frame.f_back
    return (True, frame) if through_wrapper else (False, caller)


def _calls_through(frame) -> bool:
    """Is `frame` one that only passes a call on, running no user code before it: torch.compile's wrapper
    (torch/_dynamo/eval_frame.py), or nn.Module's call (`_wrapped_call_impl`, `_call_impl`) of a module with no
    forward pre-hook of its own and none global (a compiled module's forward is entered through both)?"""
    from torch._dynamo import eval_frame
    from torch.nn.modules import module

    where = _source_file(frame)
    if where == _source_file(eval_frame):
        return True
    if where != _source_file(module) or frame.f_code.co_name not in ("_wrapped_call_impl", "_call_impl"):
        return False
    owner = frame.f_locals.get("self")
    return isinstance(owner, torch.nn.Module) and not getattr(owner, "_forward_pre_hooks", True) \
        and not getattr(module, "_global_forward_pre_hooks", True)


def _source_file(thing) -> str:
    name = thing.f_code.co_filename if hasattr(thing, "f_code") else (getattr(thing, "__file__", None) or "")
    return _real_path(name)


@functools.lru_cache(maxsize=256)
def _real_path(name: str) -> str:
    import os

    return os.path.normcase(os.path.realpath(name))


# -- constructs that break the trace before any max (issue 30, item 3) ----------------------------------------
# A msgspec.Struct built while Dynamo traces (Dynamo cannot allocate it: object.__new__ refuses an extension type),
# and a torch.compiler.disable()d kernel launcher that the user registered with the schema of the op it is.
# compile_pass.tracing decides what is modelled; here is only how Dynamo is told. Tested in tests/test_compat.py.
_CLASS_CALL_HOOKS: list = []
_DISABLED_CALL_HOOKS: list = []


def unsupported(what: str, explanation: str):
    """Make Dynamo break the graph here, as it does at what it cannot trace, with `what` as the break's type."""
    from torch._dynamo.exc import unimplemented

    try:
        unimplemented(gb_type=what, context="", explanation=explanation, hints=[])
    except TypeError:  # pragma: no cover - a torch whose unimplemented() takes a message
        unimplemented(f"{what}: {explanation}")  # type: ignore[call-arg]


def on_user_class_call(hook) -> bool:
    """Call `hook(tx, cls, args, kwargs)` where Dynamo traces a call of a user-defined class `cls` (construction);
    `args`/`kwargs` are Dynamo's VariableTrackers. It returns a VariableTracker for the new object, or None
    (Dynamo goes on as it would). Installed once, around UserDefinedClassVariable.call_function; returns False
    (nothing installed: Dynamo breaks there as without it) on a torch without that class. The same wrapper breaks
    the graph where Dynamo cannot allocate the instance (break_where_dynamo_cannot_allocate)."""
    return _hook_call_function("torch._dynamo.variables.user_defined", "UserDefinedClassVariable",
                               "_syncfree_class_hook", _CLASS_CALL_HOOKS, hook,
                               lambda variable: variable.value if isinstance(getattr(variable, "value", None), type)
                               else None, rescue=_unallocatable)


# torch 2.11 and 2.12: where Dynamo inlines the construction of a class whose instances object.__new__ cannot
# allocate (an extension type: a msgspec.Struct), it calls object.__new__(cls) for its side-effect replay and the
# TypeError ("object.__new__(X) is not safe") escapes as InternalTorchDynamoError: the compile fails, with any
# backend. torch 2.13 breaks the graph there instead ("Unsupported object.__new__ user-defined class
# construction"). The class-call wrapper makes 2.11 and 2.12 do what 2.13 does.
ALLOCATION_BREAK = "Unsupported object.__new__ user-defined class construction"
_ALLOCATION_FIXED_IN = (2, 13)  # Dynamo breaks there itself from this torch on: the wrapper is not installed early


def _unallocatable(cls, error):
    """(break type, explanation) where `error`, raised while Dynamo traced the construction of `cls`, is Dynamo's
    failure to allocate it with object.__new__; else None (the error is not that one: it propagates)."""
    if not isinstance(error, TypeError) or "object.__new__" not in str(error):
        return None
    try:
        object.__new__(cls)
    except TypeError as e:
        return ALLOCATION_BREAK, (f"Dynamo could not construct an example {cls.__qualname__} for its side-effect "
                                  f"replay using object.__new__ ({e}); the construction runs in Python")
    return None


def break_where_dynamo_cannot_allocate() -> bool:
    """On torch 2.11 and 2.12, install the class-call wrapper now (before any compile_pass.compile call) so that a
    class Dynamo cannot allocate breaks the graph, as from 2.13 on, instead of failing the compile, in every
    compile of the process (torch.compile(backend="syncfree") alone included). True where installed; False (a
    no-op) on a torch that breaks there by itself."""
    if _torch_version() >= _ALLOCATION_FIXED_IN:
        return False
    return on_user_class_call(None)


def _torch_version() -> tuple[int, int]:
    import re

    return tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])  # type: ignore[return-value]


def _hook_call_function(module: str, name: str, marker: str, hooks: list, hook, target_of, rescue=None) -> bool:
    """Add `hook` (unless None) to `hooks` and wrap Dynamo's `module.name.call_function` (a VariableTracker class)
    once: where `target_of(variable)` names a target (not None), each of `hooks` sees `(tx, target, args, kwargs)`
    and may return the call's VariableTracker; else, or when every hook returns None, Dynamo's own call_function
    runs, and where it raises, `rescue(target, error)` may name the graph break to make instead. False (nothing
    installed) on a torch without that class."""
    import importlib

    try:
        owner = getattr(importlib.import_module(module), name, None)
    except ImportError:  # pragma: no cover - every supported torch has both modules
        owner = None
    if owner is None:  # pragma: no cover - every supported torch has both classes
        return False
    if hook is not None and hook not in hooks:
        hooks.append(hook)
    if getattr(owner.call_function, marker, False):
        return True
    original = owner.call_function

    def call_function(self, tx, args, kwargs):
        target = target_of(self)
        if target is not None:
            for each in list(hooks):
                made = each(tx, target, list(args), dict(kwargs))
                if made is not None:
                    return made
        if rescue is None or target is None:
            return original(self, tx, args, kwargs)
        try:
            return original(self, tx, args, kwargs)
        except Exception as error:  # noqa: BLE001  (rescue names the one error it turns into a break)
            instead = rescue(target, error)
            if instead is None:
                raise
        unsupported(*instead)

    setattr(call_function, marker, True)
    owner.call_function = call_function
    return True


def on_disabled_call(hook) -> bool:
    """Call `hook(tx, fn, args, kwargs)` where Dynamo would skip a call of a torch.compiler.disable()d function
    (a graph break): `fn` is the function the wrapper disables. It returns the VariableTracker of the call's
    result (having traced something in its place), or None (the break stands). Installed once, around
    SkipFunctionVariable.call_function; returns False (nothing installed) on a torch without that class."""
    return _hook_call_function("torch._dynamo.variables.functions", "SkipFunctionVariable",
                               "_syncfree_disabled_hook", _DISABLED_CALL_HOOKS, hook,
                               lambda variable: disabled_target(getattr(variable, "value", None)))


def disabled_target(fn):
    """The function a torch.compiler.disable() wrapper calls, or None when `fn` is not such a wrapper."""
    import inspect

    if not inspect.getattr_static(fn, "_torchdynamo_disable", False):
        return None
    return getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None)


def constant_of(vt) -> tuple[bool, Any]:
    """(True, value) when Dynamo's VariableTracker `vt` is a Python constant (guarded where it has a source),
    else (False, None)."""
    try:
        if vt.is_python_constant():
            return True, vt.as_python_constant()
    except Exception:  # noqa: BLE001  (a VariableTracker that cannot say)
        pass
    return False, None


def python_type_of(vt):
    """The Python type of the value Dynamo's VariableTracker `vt` stands for (a constant's own type, a SymInt's
    int), or None where it cannot say."""
    known, value = constant_of(vt)
    if known:
        return type(value)
    try:
        return vt.python_type()
    except Exception:  # noqa: BLE001  (a VariableTracker that cannot say)
        return None


def list_items_of(vt):
    """The items (VariableTrackers) of a Python list Dynamo traces (not a tuple), or None."""
    from torch._dynamo.variables.lists import ListVariable

    if type(vt) is not ListVariable:
        known, value = constant_of(vt)
        return [constant_variable(v) for v in value] if known and type(value) is list else None
    return list(vt.items)


def is_tensor_variable(vt) -> bool:
    from torch._dynamo.variables.tensor import TensorVariable

    return isinstance(vt, TensorVariable)


def constant_variable(value):
    from torch._dynamo.variables import ConstantVariable

    return ConstantVariable.create(value)


def trace_call(tx, fn, args: list, kwargs: dict):
    """Trace a call of `fn` (a torch op, or a Python function Dynamo inlines) with these VariableTrackers."""
    from torch._dynamo.variables.builder import SourcelessBuilder

    return SourcelessBuilder.create(tx, fn).call_function(tx, list(args), dict(kwargs))


def build_struct(cls, names: tuple, *values):
    """`cls(**dict(zip(names, values)))`: how a Struct modelled while tracing is built when it leaves the graph."""
    return cls(**dict(zip(names, values)))


_STRUCT_VARIABLE: list = []
NOT_IN_CLASS = object()  # class_attribute's answer for a name no class of the MRO defines


def class_attribute(cls, name: str):
    """What `cls`'s own MRO (not its metaclass) holds under `name`, as the instance's attribute lookup finds it
    (the first class that defines it, unbound: a function, a property, a member descriptor), or NOT_IN_CLASS."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return NOT_IN_CLASS


# The methods through which Dynamo reads an attribute of a VariableTracker's object, by torch version: var_getattr
# (2.11-2.13), tp_getattro_impl (2.14, 2.15). The model answers both; on a torch whose VariableTracker has neither,
# a field read would reach Dynamo's generic fallback (a GetAttrVariable: `t.v2p is None` False, arithmetic on a
# field running the frame eagerly), so the model turns itself off there (struct_model_unfit).
_ATTRIBUTE_READERS = ("var_getattr", "tp_getattro_impl")


def struct_model_unfit() -> str | None:
    """None where struct_variable models a Struct exactly on this torch; else why not (Struct construction then
    breaks the graph, as without the backend)."""
    import types

    from torch._dynamo.variables.base import VariableTracker

    if not any(isinstance(vars(VariableTracker).get(name), types.FunctionType) for name in _ATTRIBUTE_READERS):
        return (f"this torch's Dynamo ({torch.__version__}) reads attributes through none of "
                f"{', '.join(_ATTRIBUTE_READERS)}: the Struct model would not see field reads, so it is off")
    if _method_layout() is None:
        return (f"this torch's Dynamo ({torch.__version__}) builds a bound method (UserMethodVariable) from neither "
                "(fn, obj) nor (im_func, im_self): the Struct model could not bind its methods, so it is off")
    return None


def _method_layout() -> str | None:
    """How this torch's UserMethodVariable is built: "fn" (2.11-2.14: the function and the object), "im_func"
    (2.15: the function's VariableTracker and the object), or None (neither: the model is off)."""
    import inspect

    from torch._dynamo.variables.functions import UserMethodVariable

    try:
        names = list(inspect.signature(UserMethodVariable.__init__).parameters)[1:3]
    except (TypeError, ValueError):  # pragma: no cover
        return None
    return {("fn", "obj"): "fn", ("im_func", "im_self"): "im_func"}.get(tuple(names))


def _method_variable(fn, obj):
    """The VariableTracker of `fn` bound to `obj` (a plain function of the Struct's class), as this torch builds
    one."""
    from torch._dynamo.variables.functions import UserFunctionVariable, UserMethodVariable

    if _method_layout() == "im_func":
        return UserMethodVariable(UserFunctionVariable(fn), obj)
    return UserMethodVariable(fn, obj)


def struct_variable(cls, fields: dict):
    """A Dynamo VariableTracker for a new instance of the msgspec.Struct class `cls` with these field values
    (VariableTrackers, every field given): the plain attribute container a Struct is. Reading a field gives its
    value; a method or property of the class is inlined with this object as `self`; anything else (setting an
    attribute, comparing, hashing, truth, iteration, ...) breaks the graph, where Dynamo builds the object with
    `cls(**fields)` and Python runs the rest. Dynamo builds it that way wherever it leaves the graph, once per
    object (a value used twice is kept in a temporary). The caller (compile_pass.traceable.struct_refusal) has
    checked that no class of `cls`'s MRO customises attribute access or construction."""
    if not _STRUCT_VARIABLE:
        _STRUCT_VARIABLE.append(_make_struct_variable_class())
    return _STRUCT_VARIABLE[0](cls, dict(fields))


# The methods through which Dynamo asks a VariableTracker what an operation on its object does: each version names
# them its own way (2.13: bool_impl, richcompare_impl, sq_length, ...; 2.14: nb_bool_impl, tp_richcompare_impl,
# sq_length_impl, tp_getattro_impl, ...), and the base class answers as `object` would. A Struct's class may answer
# otherwise (a __bool__, __len__, __eq__, __iter__, __add__ of its own, or msgspec's field-wise __eq__ and hash):
# default deny, every such method of this torch's VariableTracker breaks the graph on a StructVariable, except the
# few modelled below (attribute reads, hasattr).
_SLOT_PREFIXES = ("nb_", "sq_", "mp_", "tp_")
_SLOT_EXTRAS = ("bool_impl", "hash_impl", "richcompare_impl", "repr_impl", "str_impl", "call_function",
                "unpack_var_sequence", "call_getattr_fallback", "lookup_instance_dict", "get_dict_vt")
_MODELLED = ("tp_getattro_impl", "var_getattr", "call_obj_hasattr", "call_method")


def _denied_slots(base) -> list[str]:
    import types

    names = []
    for name, member in vars(base).items():
        if not isinstance(member, types.FunctionType) or name in _MODELLED:
            continue
        if name.endswith("_impl") or name.startswith(_SLOT_PREFIXES) or name in _SLOT_EXTRAS:
            names.append(name)
    return names


def _make_struct_variable_class():
    import types

    from torch._dynamo.bytecode_transformation import create_call_function
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.functions import UserFunctionVariable, UserMethodVariable

    class StructVariable(VariableTracker):
        _nonvar_fields = {"cls", *VariableTracker._nonvar_fields}

        def __init__(self, cls, fields: dict, **kwargs):
            super().__init__(**kwargs)
            self.cls = cls
            self.fields = fields

        def python_type(self):
            return self.cls

        def debug_repr(self):
            return f"{self.cls.__name__}(<traced>)"

        def __repr__(self):
            return f"StructVariable({self.cls.__name__})"

        def attribute(self, tx, name):
            """`obj.name`, modelled exactly: a field's value; a plain function of the class, bound to this object;
            a plain property (exactly `property`, its getter a plain function), inlined. Else the graph breaks."""
            if name in self.fields:
                return self.fields[name]
            static = class_attribute(self.cls, name)
            if type(static) is types.FunctionType:
                return _method_variable(static, self)
            if type(static) is property and type(static.fget) is types.FunctionType:
                return UserFunctionVariable(static.fget).call_function(tx, [self], {})
            unsupported("syncfree: msgspec.Struct attribute",
                        f"{self.cls.__name__}.{name} is not a field, a plain method or a plain property of the class")

        # Dynamo reads an attribute through var_getattr up to torch 2.13 and through tp_getattro_impl from 2.14
        # on: both are this model (tests/test_compat.py fails when neither is called).
        def var_getattr(self, tx, name):
            return self.attribute(tx, name)

        def tp_getattro_impl(self, tx, name):
            return self.attribute(tx, name)

        def call_obj_hasattr(self, tx, name):
            """hasattr(obj, name): True for a field, a plain function, a staticmethod or classmethod or a plain
            class constant (none of which can raise AttributeError); False where no class of the MRO defines the
            name (no __getattr__: the class was refused otherwise); else (a property, which may raise, another
            descriptor) the graph breaks."""
            if name in self.fields:
                return constant_variable(True)
            static = class_attribute(self.cls, name)
            if static is NOT_IN_CLASS:
                return constant_variable(False)
            if type(static) in (types.FunctionType, staticmethod, classmethod) \
                    or not hasattr(type(static), "__get__"):
                return constant_variable(True)
            unsupported("syncfree: msgspec.Struct attribute",
                        f"hasattr on {self.cls.__name__}.{name} runs a descriptor; not modelled while tracing")

        def call_method(self, tx, name, args, kwargs):
            static = class_attribute(self.cls, name)
            if not name.startswith("__") and name not in self.fields and type(static) is types.FunctionType:
                return UserFunctionVariable(static).call_function(tx, [self, *args], kwargs)
            unsupported("syncfree: msgspec.Struct method",
                        f"{self.cls.__name__}.{name}() is not modelled while tracing (it runs in Python)")

        def reconstruct(self, codegen):
            names = tuple(self.fields)
            codegen.add_push_null(lambda: codegen.append_output(codegen.create_load_const_unchecked(build_struct)))
            codegen.append_output(codegen.create_load_const_unchecked(self.cls))
            codegen.append_output(codegen.create_load_const_unchecked(names))
            for name in names:
                codegen(self.fields[name])
            codegen.extend_output(create_call_function(2 + len(names), False))

    def _deny(name):
        def denied(self, *args, **kwargs):
            unsupported("syncfree: msgspec.Struct operation",
                        f"{name} on a {self.cls.__name__} is not modelled while tracing (its class may define it)")
        denied.__name__ = name
        return denied

    for name in _denied_slots(VariableTracker):
        if name not in vars(StructVariable):
            setattr(StructVariable, name, _deny(name))
    return StructVariable
