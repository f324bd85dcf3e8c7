"""Constructs that break Dynamo's trace before any max: what is traced where that is sound, and the one change
that makes a line traceable where it is not (the report's fix for a graph break).

While compile_pass.compile traces (compile_pass.tracing.bounded_maxima installs the hooks below), a msgspec.Struct
built by the user's code and a call of a registered torch.compiler.disable()d launcher are traced; how Dynamo is
told lives in compile_pass._compat.dynamo_hooks. Default deny: only what is modelled exactly, else Dynamo breaks
at the line and the report names the reason.
"""

from __future__ import annotations

import struct

import torch

from . import _compat
from .proof import declare_reasons


# -- constructs that break the trace before any max: the one change that makes the line traceable -----------
# Neither is rewritten for the user: a torch.compiler.disable()d wrapper may write anything it receives (a
# custom op needs its mutated arguments declared), and an extension type's constructor is native code. The
# report says, at the line Dynamo broke, what the user changes.
TRACEABILITY_FIXES = (
    ("; struct_model_unfit)",  # before the refusals below: the class is fine, this torch's Dynamo is not
     "the msgspec.Struct model is off on this torch (struct_model_unfit: its Dynamo reads attributes or binds "
     "methods in a way the model does not answer); to make this line traceable: define the class as a dataclass "
     "or NamedTuple with the same fields, or use a torch the model was checked on (README, Supported versions)"),
    ("syncfree: msgspec.Struct not modelled",
     "to make this line traceable: build the object without running code at construction or attribute access "
     "(no __post_init__, no default_factory for a field left out, msgspec's own metaclass, no __getattribute__ / "
     "__getattr__ / __setattr__ / __delattr__, no property or class attribute named as a field), or define it as "
     "a dataclass or NamedTuple with the same fields"),
    ("syncfree: registered launcher not traced",
     "to trace this call as its registered op: add that argument to the op's schema "
     "(register_disabled_launcher), or call the launcher with it at its default"),
    ("user-defined class construction",
     "to make this line traceable: Dynamo cannot allocate this class with object.__new__ (an extension type such "
     "as a msgspec.Struct); compile through compile_pass.compile (a msgspec.Struct is then traced as the plain "
     "container it is), or define it as a dataclass or NamedTuple with the same fields"),
    ("torch.compiler.disable",
     "to keep the step in one graph: register the launcher with compile_pass.register_disabled_launcher (the "
     "schema of the op it is, `Tensor(a!)` for what it writes) and compile through compile_pass.compile, or call "
     "the kernel through a torch.library.custom_op (mutates_args= what it writes, with register_fake) instead of "
     "a torch.compiler.disable()d wrapper; its facts can then be registered (register_self_guarding_consumer / "
     "register_indptr_bound_consumer)"),
)


def fix_for(reason: str) -> str | None:
    """The one change that makes the line traceable, for a graph break Dynamo reported with `reason`."""
    return next((fix for words, fix in TRACEABILITY_FIXES if words in reason), None)


# -- constructs that break the trace before any max: traced where that is sound --------------------------------
# While compile_pass.compile traces (bounded_maxima), two constructs that Dynamo breaks at are traced:
#
#   * a msgspec.Struct built by the user's code (SGLang's KVIndexTable, RaggedTargetVerifyGeometry): a Struct is a
#     plain attribute container whose constructor (native code) stores each argument in its field and runs nothing
#     else. Modelled as that container (_compat.struct_variable): fields read as the values given, methods and
#     properties inlined, anything else breaks the graph where Python builds the object as eager does; wherever it
#     leaves the graph it is built with `cls(**fields)`, which stores the same values. Refused (Dynamo breaks as
#     before, and the report names the one change) where construction runs more than the stores: a
#     `__post_init__`, a default_factory for a field not given, a metaclass other than msgspec's, a class that
#     overrides __new__ / __init__, or arguments that do not bind to the fields (eager raises there); and where
#     attribute access runs the class's code (__getattribute__, __getattr__, __setattr__, __delattr__, a field
#     shadowed by a property or class attribute). What the model answers is listed in _compat.struct_variable;
#     every other operation on the object (truth with a __bool__ / __len__, comparison, hashing, iteration,
#     operators, a staticmethod, a property subclass, ...) breaks the graph where it happens.
#   * a torch.compiler.disable()d launcher registered with register_disabled_launcher: its call is traced as a call
#     of the op it was registered with (the schema declares what it writes), where every argument the op does not
#     take is at the launcher's default; else the break stands and the report names the argument.
# Names whose definition in a class of the Struct's MRO (above msgspec's own) makes attribute access or
# construction run the class's code: refused (issue 45). msgspec's own __setattr__ / __delattr__ (frozen checks)
# are below, in msgspec's classes, and a set / deleted attribute breaks the graph anyway.
_CUSTOMISING = ("__getattribute__", "__getattr__", "__setattr__", "__delattr__", "__new__", "__init__",
                "__post_init__", "__class__", "__dict__", "__signature__")


def struct_refusal(cls) -> str | None:
    """None when `cls` is a msgspec.Struct class whose construction only stores its arguments and whose attribute
    access is the plain lookup the model makes (_compat.struct_variable); else why not. Raises LookupError for a
    class that is not a msgspec.Struct.

    Default deny: refused where any class of the MRO above msgspec's own defines one of _CUSTOMISING (attribute
    access or construction runs the class's code), where a field's name does not resolve to msgspec's own slot for
    it (a property, a descriptor or a class attribute of a subclass shadows the field: eager reads that), or where
    the metaclass is not msgspec's."""
    import types

    meta = type(cls)
    if not (hasattr(cls, "__struct_fields__") and hasattr(cls, "__struct_config__")
            and any(m.__module__.startswith("msgspec") and m.__name__ == "StructMeta" for m in meta.__mro__)):
        raise LookupError(cls)
    if meta.__module__.split(".")[0] != "msgspec":
        return f"its metaclass {meta.__name__} is not msgspec's (it may run code at construction)"
    if getattr(cls, "__post_init__", None) is not None:
        return "it defines __post_init__, which runs the class's own code after the fields are stored"
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "msgspec":
            break
        if "__new__" in vars(klass) or "__init__" in vars(klass):
            return f"{klass.__name__} overrides __new__ / __init__"
        custom = [name for name in _CUSTOMISING if name in vars(klass)]
        if custom:
            return (f"{klass.__name__} defines {custom[0]}, which runs the class's own code where the model reads "
                    "or builds the object")
    for name in cls.__struct_fields__:
        slot = _compat.class_attribute(cls, name)
        owner = getattr(slot, "__objclass__", None)
        if type(slot) is not types.MemberDescriptorType or owner not in cls.__mro__ \
                or name not in getattr(owner, "__struct_fields__", ()):
            return (f"its field {name!r} is shadowed by {type(slot).__name__} {name!r} of the class (eager reads "
                    "that, not the field)")
    return None


def _struct_fields(cls, args, kwargs) -> tuple[dict | None, str | None]:
    """({field: VariableTracker}, None) for a construction that only stores its arguments, or (None, why not).

    Bound as msgspec's constructor binds, from the class's own metadata: `__match_args__` are the fields taken by
    position (a prefix of `__struct_fields__`; the rest are keyword-only), `__struct_defaults__` the defaults of
    the last fields (NODEFAULT: required). Not inspect.signature(cls): msgspec builds that from the annotations,
    which raises on a forward reference only a type checker resolves (`scale: "Scale"` under TYPE_CHECKING)."""
    import msgspec  # the class is a msgspec.Struct (struct_refusal checked it): msgspec is there

    fields_order = tuple(cls.__struct_fields__)
    positional = tuple(getattr(cls, "__match_args__", ()))
    defaults = tuple(getattr(cls, "__struct_defaults__", ()))
    if positional != fields_order[:len(positional)] or len(defaults) > len(fields_order):
        return None, "its fields' layout is not msgspec's (__match_args__, __struct_defaults__)"
    if len(args) > len(positional):
        return None, (f"it is given {len(args)} positional arguments and takes {len(positional)}; eager raises "
                      "there")
    given = dict(zip(positional, args))
    for name, value in kwargs.items():
        if name not in fields_order or name in given:
            return None, f"argument {name!r} does not bind to a field (unknown or given twice); eager raises there"
        given[name] = value
    first_default = len(fields_order) - len(defaults)
    fields = {}
    for i, name in enumerate(fields_order):
        if name in given:
            fields[name] = given[name]
            continue
        default = defaults[i - first_default] if i >= first_default else _NO_DEFAULT
        if default is _NO_DEFAULT or default is msgspec.NODEFAULT:
            return None, f"required field {name!r} is not given; eager raises there"
        if type(default).__name__ == "Factory" or not _is_plain_default(default):
            return None, f"field {name!r} is not given and its default is built at construction (default_factory)"
        fields[name] = _compat.constant_variable(default)
    return fields, None


_NO_DEFAULT = object()


def _is_plain_default(value) -> bool:
    return value is None or type(value) in (bool, int, float, str, bytes) or (
        type(value) is tuple and all(_is_plain_default(v) for v in value))


STRUCT_REFUSED = "syncfree: msgspec.Struct not modelled"

# Why a trace-time model is off on the installed torch (it turns itself off there: Dynamo breaks where it would
# without the backend). The break's first line, which the report's note quotes, ends with the code: `break_code`
# reads it back. tests/test_hook_versions.py asserts each.
TRACE_TIME_REASONS = declare_reasons("traceable", {
    "struct_model_unfit": "the msgspec.Struct model does not fit this torch's Dynamo (it reads attributes or binds "
                          "methods through what the model does not answer: _compat.struct_model_unfit): a Struct "
                          "breaks the graph where it is built",
})


def break_code(reason: str) -> str | None:
    """The trace-time reason code that a graph break's text (or the report's note quoting it) carries in its first
    line (`(Geometry; struct_model_unfit)`), or None."""
    lines = reason.strip().splitlines()
    first = lines[0] if lines else ""
    return next((code for code in TRACE_TIME_REASONS if f"; {code})" in first), None)

# torch 2.11 and 2.12 fail the compile where Dynamo builds a msgspec.Struct by itself (outside compile_pass.compile:
# `torch.compile(backend="syncfree")` alone), with any backend; 2.13 on break the graph there. From
# `import compile_pass` on, those two break the graph as 2.13 does (a no-op on 2.13 on; tests/test_hook_versions.py).
_compat.break_where_dynamo_cannot_allocate()


def on_class_call(tx, cls, args, kwargs):
    """The hook at a user class's construction (installed while compile_pass.compile traces)."""
    try:
        why = struct_refusal(cls)
    except LookupError:
        return None
    fields, code = None, ""
    if why is None:
        why = _compat.struct_model_unfit()
        code = "; struct_model_unfit" if why is not None else ""
    if why is None:
        fields, why = _struct_fields(cls, args, kwargs)
    if why is not None:
        _compat.unsupported(f"{STRUCT_REFUSED} ({cls.__qualname__}{code})",
                            f"{cls.__qualname__} cannot be traced as a plain container: {why}")
    try:
        return _compat.struct_variable(cls, fields)
    except (ImportError, AttributeError):  # a torch whose Dynamo lacks what the model needs: break as before
        return None


# -- registered torch.compiler.disable()d launchers ------------------------------------------------------------
_LAUNCHERS: dict = {}  # the launcher function -> the op its calls are traced as


def register_disabled_launcher(launcher, op=None, *, name: str | None = None, schema: str | None = None):
    """Trace calls of `launcher` made through a torch.compiler.disable() wrapper (where Dynamo breaks the graph)
    as calls of a torch op with declared facts, while compile_pass.compile traces. Returns the op (its
    OpOverloadPacket), on which facts are registered as on any op (register_indptr_bound_consumer, ...).

    Either `op=`: your torch.library op whose arguments are parameters of `launcher` by name; or `name=` and
    `schema=`: the op is defined here, `torch.library.define(name, schema)`, with the launcher as its
    implementation and a fake that returns nothing. The schema must return nothing (`-> ()`: a launcher that
    writes its outputs in place) and mark every tensor the launcher writes `Tensor(a!)`: that is your
    declaration, as `mutates_args` is for torch.library.custom_op. At run time the op calls `launcher` with the
    schema's arguments by name and raises if it returns a value.

    A call is traced as the op only where every argument that the op does not take is at the launcher's default
    (a constant equal to it, or not passed); else Dynamo breaks there as before and the report names the
    argument. Calls through `torch.compile(fn, backend="syncfree")` are not changed (the backend sees the graph
    after Dynamo traced it): compile through compile_pass.compile."""
    import inspect

    if not callable(launcher):
        raise TypeError(f"register_disabled_launcher: launcher must be a function, got {type(launcher).__name__}")
    launcher = _compat.disabled_target(launcher) or launcher
    if (op is None) == (schema is None):
        raise TypeError("register_disabled_launcher: give op= (your op) or name= and schema= (defined here)")
    params = inspect.signature(launcher).parameters
    if op is None:
        if not name or "::" not in name:
            raise TypeError(f"register_disabled_launcher: name= must be 'namespace::op', got {name!r}")
        op = _define_launcher_op(launcher, name, schema)
    packet = getattr(op, "_qualified_op_name", None) and (op if hasattr(op, "overloads") else op.overloadpacket)
    if packet is None:
        raise TypeError(f"register_disabled_launcher: op must be a torch op, got {op!r}")
    schemas = _compat.overload_schemas(packet)
    if len(schemas) != 1:
        raise TypeError(f"register_disabled_launcher: {packet._qualified_op_name} must have one overload")
    missing = [a.name for a in schemas[0][1].arguments if a.name not in params]
    if missing:
        raise TypeError(f"register_disabled_launcher: {packet._qualified_op_name} takes {missing}, which "
                        f"{launcher.__qualname__} has no parameter of that name for")
    _LAUNCHERS[launcher] = packet
    return packet


def unregister_disabled_launcher(launcher) -> None:
    _LAUNCHERS.pop(_compat.disabled_target(launcher) or launcher, None)


def registered_launchers() -> dict:
    """{launcher: op} registered with register_disabled_launcher."""
    return dict(_LAUNCHERS)


def _define_launcher_op(launcher, name: str, schema: str):
    if not isinstance(schema, str) or not schema.replace(" ", "").endswith("->()"):
        raise TypeError(f"register_disabled_launcher: schema must return nothing ('... -> ()'), got {schema!r}")
    namespace, opname = name.split("::", 1)
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define(opname + schema)
    packet = getattr(getattr(torch.ops, namespace), opname)
    argument_names = [a.name for a in _compat.overload_schemas(packet)[0][1].arguments]

    def run(*args, **kwargs):
        given = dict(zip(argument_names, args))
        given.update(kwargs)
        result = launcher(**given)
        if result is not None:
            raise RuntimeError(f"{name}: {launcher.__qualname__} returned a value; its schema returns nothing")

    def fake(*args, **kwargs):
        return None

    lib.impl(opname, run, "CompositeExplicitAutograd")
    torch.library.register_fake(name, fake, lib=lib)
    _LIBRARIES.append(lib)
    return packet


_LIBRARIES: list = []  # kept alive: a Library's definitions go with it


LAUNCHER_REFUSED = "syncfree: registered launcher not traced"


def on_disabled_call(tx, fn, args, kwargs):
    """The hook at a call of a torch.compiler.disable()d function (installed while compile_pass.compile traces)."""
    if fn not in _LAUNCHERS:
        return None
    import inspect

    packet = _LAUNCHERS[fn]
    schema = _compat.overload_schemas(packet)[0][1]
    signature = inspect.signature(fn)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None  # eager raises there: the break stands
    taken = {a.name for a in schema.arguments}
    for pname, vt in bound.arguments.items():
        if pname in taken:
            continue
        param = signature.parameters[pname]
        known, value = _compat.constant_of(vt)
        default = param.default
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or default is inspect.Parameter.empty \
                or not known or not _same_default(value, default):
            _compat.unsupported(f"{LAUNCHER_REFUSED} ({pname}=)",
                                f"{fn.__qualname__} is called with {pname}= other than its default, and "
                                f"{packet._qualified_op_name} does not take {pname}")
    positional, keywords = [], {}
    for argument in schema.arguments:
        if argument.name in bound.arguments:
            vt = bound.arguments[argument.name]
        else:
            default = signature.parameters[argument.name].default
            if not _is_plain_default(default):  # a default object the op cannot hand over as it is
                _compat.unsupported(f"{LAUNCHER_REFUSED} ({argument.name}=)",
                                    f"{fn.__qualname__}'s default for {argument.name} is not a plain constant; "
                                    f"pass {argument.name} to the call")
            vt = _compat.constant_variable(default)
        if not _fits(argument, vt):
            _compat.unsupported(f"{LAUNCHER_REFUSED} ({argument.name}=)",
                                f"{fn.__qualname__} is called with {argument.name}= of a kind its op's schema "
                                f"does not take ({argument.type}), or that the op would hand the launcher as "
                                f"another type (an int for a float, a tuple for a list)")
        (keywords.__setitem__(argument.name, vt) if argument.kwarg_only else positional.append(vt))
    return _compat.trace_call(tx, packet, positional, keywords)


# What the op hands the launcher for a schema argument is what torch's dispatcher makes of the traced value: an int
# given for `float` arrives as a float, True given for `int` as 1, a tuple for `int[]` as a list. Default deny:
# only a value that arrives as it was given (the same Python type) is traced as the op.
_SCALAR_TYPES = {"float": float, "int": int, "bool": bool, "str": str}


def _fits(argument, vt) -> bool:
    """Does the traced value `vt` reach the launcher through the op as eager passes it: a tensor for a tensor,
    None only where optional, and for a scalar or an int list the very Python type the schema converts to (an
    int for `float` would arrive as a float). Other schema types (Scalar, lists of tensors, dtypes, ...) are not
    modelled. torch checks the rest when the op is traced."""
    text = str(argument.type)
    optional = text.startswith("Optional[")
    inner = text[len("Optional["):-1] if optional else text
    known, value = _compat.constant_of(vt)
    if known and value is None:
        return optional
    if inner == "Tensor":
        return _compat.is_tensor_variable(vt)
    if _compat.is_tensor_variable(vt):
        return False
    if inner in _SCALAR_TYPES:
        return _compat.python_type_of(vt) is _SCALAR_TYPES[inner]
    if inner == "List[int]":
        items = _compat.list_items_of(vt)
        return items is not None and all(_compat.python_type_of(item) is int for item in items)
    return False


def _same_default(value, default) -> bool:
    """Is `value` exactly `default`, so that the op, which runs the launcher with the default, runs what eager runs?
    Default deny (issue 45): identical in value AND type, of a plain type only: None; bool, int, str, bytes of the
    same type and equal; floats bit for bit (so -0.0 is not 0.0, a NaN is only its own NaN: not `==`, which takes
    -0.0 for 0.0 and no NaN for itself); tuples element by element by the same rule. `1`, `True` and `1.0`
    differ; a subclass (an IntEnum, a float subclass), a list or any other object is never at its default."""
    if type(value) is not type(default):
        return False
    if value is None:
        return True
    if type(value) is tuple:
        return len(value) == len(default) and all(_same_default(v, d) for v, d in zip(value, default))
    if type(value) is float:
        return struct.pack("<d", value) == struct.pack("<d", default)
    if type(value) in (bool, int, str, bytes):
        return value == default
    return False
