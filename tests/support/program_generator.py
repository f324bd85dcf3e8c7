"""Decode programs aimed at the write analysis (issue 18, "soundness by construction").

A program is the canonical decode step

    m = lens.max().item()
    t = r2t[rpi, :m:4] // 4
    out = SUM(t, lens, 4, m)          # self-guarding: reads ceil(lens[b] / 4) columns, checks its bound

plus ONE edit: an in-place write to a protected tensor (the lengths, the token table, the request indices, or a
view of one of them), placed before the max, between the max and the gather, between the gather and the consumer
or after the consumer; optionally with metadata variants (strided or expanded lengths, negative or duplicate
request indices, an int64 table) and cast chains on the lengths and the table.

Programs are Python source strings, exec'd into fresh functions (one code object each, so Dynamo never
recompiles one function for another program and no `torch._dynamo.reset()` is needed between them). Everything is
deterministic: no `hash()`, no unseeded randomness (the `random_`-style edits run under one manual seed in eager
and compiled alike).

`run_program` compiles a program with the pass-only backend (`passlib.Rewriting`), runs it and eager on several
length vectors, and returns what the pass decided and every divergence (values, shapes, dtypes, raised error
type, the inputs left behind). `python tests/support/program_generator.py` runs them all and prints the per-category
table.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import warnings
from typing import Callable

import numpy as np
import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from passlib import Rewriting, length_vectors

MCL = 64  # the static bound
TOKENS = 96  # the token table's width: wider than the bound, so a wrong width shows
REQS = 16  # token-table rows; request indices are drawn from the first half, so `rpi + 1`, `rpi * 2` stay in range
PS = 4
BATCH = 3
SUM = torch.ops.syncfree_test.bounded_sum
ARG_NAMES = ("lens", "r2t", "rpi", "q", "k", "v", "aux")

ROLES = ("lens", "table", "rpi")
ROLE_TENSOR = {"lens": "lens", "table": "r2t", "rpi": "rpi"}
# The protected tensors and views of them that an edit writes.
VIEWS = {
    "lens": ("lens", "lens[1:]", "lens.view(-1)", "lens[:]"),
    "table": ("r2t", "r2t[1:]", "r2t.view(-1)", "r2t.T", "r2t[:, :8]"),
    "rpi": ("rpi", "rpi[1:]", "rpi.view(-1)", "rpi[:]"),
}
POSITIONS = ("before_max", "max_gather", "gather_consumer", "after_consumer")


# -- a helper Dynamo keeps opaque, and a custom op whose schema says it writes --------------------------------
@torch._dynamo.allow_in_graph
def opaque_bump(t):
    """An allow_in_graph callable that writes its argument (the graph shows only a call to it)."""
    t.add_(1)
    return t.sum()


@torch.library.custom_op("syncfree_gen::bump_", mutates_args=("t",))
def bump_(t: torch.Tensor) -> None:
    t.add_(1)


@bump_.register_fake
def _(t):
    return None


def user_writer(t):
    """A plain user function (Dynamo inlines it)."""
    t.mul_(2)


# -- the write tables --------------------------------------------------------------------------------------
# Simple argument spellings for in-place methods, tried in order; `{t}` is the written tensor's expression.
METHOD_ARGS = (
    "",
    "1",
    "torch.ones_like({t})",
    "torch.ones_like({t}), torch.ones_like({t})",
    "0, torch.zeros(1, dtype=torch.long), 1",
    "0, torch.zeros(1, dtype=torch.long), torch.ones_like({t}[:1])",
    "0, torch.zeros_like({t}, dtype=torch.long), torch.ones_like({t})",
    "0, torch.zeros_like({t}, dtype=torch.long), torch.ones_like({t}), 'sum'",
    "0, torch.zeros(1, dtype=torch.long), torch.ones_like({t}[:1]), 'amax'",
    "{t} > 3, 1",
    "{t} > 3, torch.ones_like({t})",
    "torch.zeros(1, dtype=torch.long), torch.ones(1, dtype={t}.dtype)",
    "(torch.zeros(1, dtype=torch.long),), torch.ones(1, dtype={t}.dtype)",
    "0, 1",
    "{t}.shape",
    "{t}.size(), {t}.stride()",
)
# Methods that change no value (metadata, grad flags, shared memory): a pass may know they write nothing.
VALUE_PRESERVING = {"detach_", "requires_grad_", "share_memory_"}
# Methods that change a tensor's metadata in place: on a temporary view they change no input.
METADATA = {"squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_", "resize_",
            "resize_as_", "set_", "sparse_resize_", "sparse_resize_and_clear_", "resize_as_sparse_"}


def inplace_methods() -> list[str]:
    return sorted(n for n in dir(torch.Tensor) if n.endswith("_") and not n.startswith("_"))


DUNDERS = {
    "__iadd__": ("+=", "1"), "__isub__": ("-=", "1"), "__imul__": ("*=", "2"), "__ifloordiv__": ("//=", "2"),
    "__imod__": ("%=", "7"), "__iand__": ("&=", "7"), "__ior__": ("|=", "1"), "__ixor__": ("^=", "1"),
    "__ilshift__": ("<<=", "1"), "__irshift__": (">>=", "1"), "__ipow__": ("**=", "2"),
}


def dunder_edits() -> list[tuple[str, str]]:
    """(name, statement template) for every in-place dunder, in its three spellings."""
    out = []
    for name, (sym, arg) in DUNDERS.items():
        out.append((f"t.{name}", f"{{t}}.{name}({arg})"))
        out.append((f"Tensor.{name}", f"torch.Tensor.{name}({{t}}, {arg})"))
        out.append((f"aug{sym}", f"_w = {{t}}; _w {sym} {arg}"))
    return out


NUMPY_EDITS = (
    ("np a+=1", "_a = {t}.numpy(); _a += 1"),
    ("np a*=2", "_a = {t}.numpy(); _a *= 2"),
    ("np a|=1", "_a = {t}.numpy(); _a |= 1"),
    ("np a.fill", "_a = {t}.numpy(); _a.fill(8)"),
    ("np a[0]=3", "_a = {t}.numpy(); _a[0] = 3"),
    ("np a[...]=0", "_a = {t}.numpy(); _a[...] = 0"),
    ("np.add out", "_a = {t}.numpy(); np.add(_a, 1, out=_a)"),
    ("np.negative out", "_a = {t}.numpy(); np.negative(_a, out=_a)"),
    ("np.clip out", "_a = {t}.numpy(); np.clip(_a, 0, 50, out=_a)"),
    ("np.copyto", "_a = {t}.numpy(); np.copyto(_a, 5)"),
)

MISC_EDITS = (
    ("setitem [0]", "{t}[0] = 3"),
    ("setitem [...]", "{t}[...] = 2"),
    ("setitem mask", "{t}[{t} > 3] = 1"),
    ("torch.add out=", "torch.add({t}, 1, out={t})"),
    ("torch.clamp out=", "torch.clamp({t}, 0, 10, out={t})"),
    ("torch.cumsum out=", "torch.cumsum({t}, 0, out={t})"),
    ("aten.clamp packet out=", "torch.ops.aten.clamp({t}, 40, 60, out={t})"),
    ("aten.clamp.out", "torch.ops.aten.clamp.out({t}, 40, 60, out={t})"),
    ("aten.add_ packet", "torch.ops.aten.add_({t}, 1)"),
    ("aten.add_.Scalar", "torch.ops.aten.add_.Scalar({t}, 1)"),
    ("aten.copy_ packet", "torch.ops.aten.copy_({t}, torch.ones_like({t}))"),
    ("aten.fill_ packet", "torch.ops.aten.fill_({t}, 2)"),
    ("torch.relu_", "torch.relu_({t})"),
    ("torch.fill_", "torch.fill_({t}, 2)"),
    ("torch.index_put_", "torch.index_put_({t}, (torch.zeros(1, dtype=torch.long),), torch.ones(1, dtype={t}.dtype))"),
    ("Tensor.add_ unbound", "torch.Tensor.add_({t}, 1)"),
    ("F.threshold inplace", "torch.nn.functional.threshold({t}, 5, 0, inplace=True)"),
    ("_foreach_add_", "torch._foreach_add_([{t}], 1)"),
    ("allow_in_graph", "_s = opaque_bump({t})"),
    ("custom op mutates", "bump_({t})"),
    ("user function", "user_writer({t})"),
    (".data.add_", "{t}.data.add_(1)"),
)


def method_statement(method: str, args: str) -> str:
    return f"{{t}}.{method}({args})"


# -- inputs ------------------------------------------------------------------------------------------------
def make_args(lengths, variant: str = "plain", seed: int = 0) -> dict:
    """The step's arguments, fresh (aliasing kept: a strided `lens` is a view of `aux`)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    r2t = torch.randint(0, 4096, (REQS, TOKENS), generator=gen, dtype=torch.int64).to(torch.int32)
    rpi = torch.randperm(REQS // 2, generator=gen)[:batch]
    lens = torch.tensor(lengths, dtype=torch.int64)
    num_pages = 4096 // PS + 1
    q = torch.randn(batch, 1, 4, 8, generator=gen)
    k = torch.randn(num_pages, PS, 2, 8, generator=gen)
    v = torch.randn(num_pages, PS, 2, 8, generator=gen)
    aux = torch.zeros(1, dtype=torch.int64)
    if variant == "strided":  # seq_lens = meta[:, 0], a strided view of a metadata block
        aux = torch.stack([lens, torch.arange(batch) + 100], 1).contiguous()
        lens = aux[:, 0]
    elif variant == "expanded":  # one length broadcast to the batch (every write through it is a race: eager raises)
        aux = lens[:1].clone()
        lens = aux.expand(batch)
    elif variant == "negative_rpi":
        rpi = rpi - REQS
    elif variant == "out_of_range_rpi":  # eager's gather raises IndexError
        rpi = rpi.clone()
        rpi[-1] = REQS
    elif variant == "duplicate_rpi":
        rpi = rpi[torch.tensor([0] * (batch - 1) + [batch - 1])].clone()
    elif variant == "int32_lens":
        lens = lens.to(torch.int32)
    elif variant == "int64_table_big":  # entries past int32: a narrowing cast changes them
        r2t = r2t.to(torch.int64) + (1 << 32) + ((torch.arange(TOKENS) % 3) << 31)
    elif variant != "plain":
        raise ValueError(variant)
    return dict(lens=lens, r2t=r2t, rpi=rpi, q=q, k=k, v=v, aux=aux)


TOP = MCL // 2 - 2  # lengths stay within the bound after an edit doubles them or adds one before the max


def program_vectors(count: int, seed: int) -> list[list[int]]:
    """A program's length vectors: [3, TOP, 5] first (the vector Dynamo traces with), then random ones."""
    return length_vectors(BATCH, count, seed, top=TOP, first=([3, TOP, 5],))


# Lengths whose int64 values wrap when narrowed to int32: max 50, but the int32 view of the first is 60.
WRAP_VECTORS = [[-(1 << 32) + 60, 50, 3], [-(1 << 32) + 10, 20, 7]]


# -- programs ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Program:
    name: str
    category: str
    source: str
    variant: str = "plain"
    must_keep: bool = False  # a protected tensor is written where the proof must see it
    vectors: list = dataclasses.field(default_factory=lambda: program_vectors(4, 0))
    seed: int = 0

    def function(self) -> Callable:
        namespace = {"torch": torch, "np": np, "SUM": SUM, "opaque_bump": opaque_bump, "bump_": bump_,
                     "user_writer": user_writer, "PD": torch.ops.syncfree.paged_decode}
        exec(compile(self.source, f"<{self.name}>", "exec"), namespace)
        return namespace["step"]


def indent(statement: str) -> str:
    return "".join(f"    {line}\n" for line in statement.split("; ") if line) if statement else ""


def step_source(edit: str | None = None, position: str = "gather_consumer", *, max_of: str = "lens",
                table: str | None = None, consumer_lens: str = "lens", chained: bool = False,
                consumer: str = "sum", ps: int = 4) -> str:
    """The canonical step with `edit` (a statement, already formatted) at `position`.

    ps=1 drops the `// ps` (Dynamo's fake floor_divide on the unbacked width costs ~0.2 s of tracing per program);
    the bulk of the write-analysis programs use it, a deterministic share keeps ps=4."""
    if table is None:
        table = f"r2t[rpi, :m:{ps}] // {ps}" if ps > 1 else "r2t[rpi, :m]"
    at = {p: (edit if p == position else None) for p in POSITIONS}
    body = indent(at["before_max"] or "")
    body += f"    m = {max_of}.max().item()\n"
    if chained:
        body += "    rows = r2t[rpi]\n"
        table = f"rows[:, :m:{ps}] // {ps}" if ps > 1 else "rows[:, :m]"
    body += indent(at["max_gather"] or "")
    body += f"    t = {table}\n"
    body += indent(at["gather_consumer"] or "")
    if consumer == "sum":
        body += f"    out = SUM(t, {consumer_lens}, {ps}, m)\n"
    else:
        body += f"    out = PD(q, k, v, t.to(torch.int32), {consumer_lens}.to(torch.int32), max_seqlen_k=m)\n"
    body += indent(at["after_consumer"] or "")
    body += "    return out\n"
    return f"def step({', '.join(ARG_NAMES)}):\n{body}"


def role_of(target: str) -> str:
    return {"lens": "lens", "r2t": "table", "rpi": "rpi", "aux": "lens"}[target.split("[")[0].split(".")[0]]


def must_keep(role: str, position: str, method: str | None = None, target: str = "") -> bool:
    """Where default deny promises a KEPT max: the write lands after eager read the tensor and before the consumer.

    The lengths are read by the max and again by the consumer: any write after the max. The table and the request
    indices are read at the gather: writes between the gather and the consumer (between the max and the gather the
    rewritten table, built where eager gathered, sees the same values)."""
    if method in VALUE_PRESERVING or (method in METADATA and target not in ROLE_TENSOR.values()):
        return False
    if role == "lens":
        return position in ("max_gather", "gather_consumer")
    return position == "gather_consumer"


_SAMPLES: dict = {}


def sample_args(variant: str = "plain") -> dict:
    """Fresh copies of one set of inputs (cheap: the big q/k/v are shared, no statement touches them)."""
    if variant not in _SAMPLES:
        _SAMPLES[variant] = make_args([3, TOP, 5], variant)
    base = _SAMPLES[variant]
    args = {k: (v if k in ("q", "k", "v") else v.clone()) for k, v in base.items()}
    if variant == "strided":
        args["lens"] = args["aux"][:, 0]
    elif variant == "expanded":
        args["lens"] = args["aux"].expand(base["lens"].shape[0])
    return args


def eager_accepts(statement: str, variant: str = "plain") -> bool:
    """Does eager run `statement` on the step's own inputs?"""
    args = sample_args(variant)
    namespace = {"torch": torch, "np": np, "opaque_bump": opaque_bump, "bump_": bump_, "user_writer": user_writer,
                 **args}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(statement, namespace)
        return True
    except Exception:  # noqa: BLE001 - eager refuses: not a program we can compare
        return False


def method_statement_for(method: str, target: str) -> str | None:
    """The first simple statement calling `method` on `target` that eager accepts, or None."""
    for args in METHOD_ARGS:
        statement = method_statement(method, args).format(t=target)
        if eager_accepts(statement):
            return statement
    return None


# -- running one program -----------------------------------------------------------------------------------
class Untraceable(Exception):
    """Dynamo (not the pass) refused the program under fullgraph=True."""


@dataclasses.dataclass
class Result:
    program: Program
    rewritten: int = 0
    kept: int = 0
    host_reads: int = 0
    divergences: list = dataclasses.field(default_factory=list)
    dynamo_also_diverges: bool = False
    untraceable: str = ""
    crashed: str = ""  # the pass (backend) raised while compiling

    @property
    def decision(self) -> str:
        if self.untraceable:
            return "untraceable"
        if self.crashed:
            return "crashed"
        return "rewritten" if self.rewritten and not self.host_reads else "kept"


class DeviceAssertion(Exception):
    """The compiled step stopped at one of syncfree's device-side assertions (checked, the default): it raised
    where eager raised, but a device assertion cannot carry eager's exception type (IndexError, say)."""


def _outcome(fn, args: dict):
    torch.default_generator.manual_seed(1234)  # CPU only (torch.manual_seed also seeds lazy devices: slow)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fn(**args)
    except torch._dynamo.exc.TorchDynamoException:
        raise
    except Exception as e:  # noqa: BLE001 - compared by type
        result = DeviceAssertion if isinstance(e, RuntimeError) and "syncfree:" in str(e) else type(e)
    return result, args


def difference(got, want, where: str = "out") -> str | None:
    """None when `got` equals `want` (values, shapes, dtypes, exception type), else what differs."""
    if isinstance(want, type):
        if isinstance(got, type) and (issubclass(got, want) or issubclass(want, got) or got is DeviceAssertion):
            return None
        return f"{where}: eager raised {want.__name__}, compiled gave {_short(got)}"
    if isinstance(got, type):
        return f"{where}: compiled raised {got.__name__}, eager returned {_short(want)}"
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"{where}: {_short(got)} vs eager {_short(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = difference(g, w, f"{where}[{i}]")
            if d:
                return d
        return None
    if isinstance(want, dict):
        for key in want:
            d = difference(got[key], want[key], f"{where}.{key}")
            if d:
                return d
        return None
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: {type(got).__name__} is not a tensor"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{where}: {tuple(got.shape)} {got.dtype} vs eager {tuple(want.shape)} {want.dtype}"
        if not torch.equal(got, want) and not (got.is_floating_point()
                                               and torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)):
            return f"{where}: values {_short(got)} vs eager {_short(want)}"
        return None
    return None if got == want else f"{where}: {got!r} vs eager {want!r}"


def outside_the_contract(lengths) -> bool:
    """A length outside [0, MCL] (WRAP_VECTORS: an int64 value whose int32 view is in range): under `checked` (the
    default) the compiled step may stop at its device assertion there (the documented contract), where eager,
    reading the narrowed values, computes."""
    return any(not 0 <= int(x) <= MCL for x in lengths)


def step_difference(got, want, lengths) -> str | None:
    """`difference` of the result and of the inputs left behind; a device assertion on lengths outside the contract
    is what the contract says (and the inputs a stopped step leaves are not compared)."""
    if got[0] is DeviceAssertion and outside_the_contract(lengths):
        return None
    return difference(got[0], want[0], "out") or difference(got[1], want[1], "inputs")


def _short(value) -> str:
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, torch.Tensor):
        return str(value.flatten()[:6].tolist()) + ("..." if value.numel() > 6 else "")
    return repr(value)[:60]


def _differential(fn, compiled, program: Program) -> list[str]:
    found = []
    for n, lengths in enumerate(program.vectors):
        want = _outcome(fn, make_args(lengths, program.variant, program.seed + n))
        with compile_pass._compat.capture_scalar_outputs():
            got = _outcome(compiled, make_args(lengths, program.variant, program.seed + n))
        d = step_difference(got, want, lengths)
        if d:
            found.append(f"lengths={lengths}: {d}")
    return found


def run_program(program: Program) -> Result:
    result = Result(program)
    fn = program.function()
    backend = Rewriting(max_context_len=MCL)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    try:
        result.divergences = _differential(fn, compiled, program)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        result.crashed = f"{type(e.inner_exception).__name__}: {e.inner_exception}"[:300]
        return result
    except torch._dynamo.exc.TorchDynamoException as e:
        result.untraceable = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        return result
    result.rewritten = sum(len(r.rewritten) for r in backend.reports)
    result.kept = sum(len(r.kept) for r in backend.reports)
    result.host_reads = sum(1 for t in backend.targets() if t == "item" or getattr(t, "__name__", "") == "wrapped_item")
    if result.divergences:  # does Dynamo alone (no pass) diverge too? Then it is not the pass's doing.
        plain = torch.compile(program.function(), backend="eager", fullgraph=True)
        try:
            result.dynamo_also_diverges = bool(_differential(program.function(), plain, program))
        except torch._dynamo.exc.TorchDynamoException:
            result.dynamo_also_diverges = True
    return result


# -- the generated corpus ----------------------------------------------------------------------------------
# The edits the generator composes with targets and positions: every kind of writer (methods, dunders in their
# three spellings, numpy, out=, packets, opaque callables, a custom op, setitem).
GENERATOR_EDITS = (
    ("method add_", "{t}.add_(1)"),
    ("method mul_", "{t}.mul_(2)"),
    ("method copy_", "{t}.copy_(torch.ones_like({t}))"),
    ("method index_fill_", "{t}.index_fill_(0, torch.zeros(1, dtype=torch.long), 1)"),
    ("method masked_fill_", "{t}.masked_fill_({t} > 3, 1)"),
    ("method zero_", "{t}.zero_()"),
    ("dunder t.__iadd__", "{t}.__iadd__(1)"),
    ("dunder Tensor.__ior__", "torch.Tensor.__ior__({t}, 1)"),
    ("dunder aug //=", "_w = {t}; _w //= 2"),
    ("numpy a+=1", "_a = {t}.numpy(); _a += 1"),
    ("numpy a[0]=3", "_a = {t}.numpy(); _a[0] = 3"),
    ("numpy np.add out", "_a = {t}.numpy(); np.add(_a, 1, out=_a)"),
    ("setitem", "{t}[0] = 3"),
    ("torch.add out=", "torch.add({t}, 1, out={t})"),
    ("aten.clamp packet out=", "torch.ops.aten.clamp({t}, 40, 60, out={t})"),
    ("aten.add_ packet", "torch.ops.aten.add_({t}, 1)"),
    ("allow_in_graph", "_s = opaque_bump({t})"),
    ("custom op mutates", "bump_({t})"),
)
GENERATOR_TARGETS = ("lens", "lens[1:]", "r2t", "r2t[:, :8]", "rpi", "rpi[1:]")
METADATA_VARIANTS = ("strided", "expanded", "negative_rpi", "duplicate_rpi")
# (name, max over, consumer lengths, table expression, variant, vectors): int32 <-> int64 on lengths and table.
CAST_CHAINS = (
    ("lens int", "lens", "lens.int()", "r2t[rpi, :m:4] // 4", "plain"),
    ("lens long", "lens", "lens.long()", "r2t[rpi, :m:4] // 4", "plain"),
    ("lens int.long", "lens", "lens.int().long()", "r2t[rpi, :m:4] // 4", "plain"),
    ("max of lens.int", "lens.int()", "lens", "r2t[rpi, :m:4] // 4", "plain"),
    ("max of lens.int, lens.int", "lens.int()", "lens.int()", "r2t[rpi, :m:4] // 4", "plain"),
    ("int32 lens long", "lens", "lens.long()", "r2t[rpi, :m:4] // 4", "int32_lens"),
    ("int32 lens, max long", "lens.long()", "lens", "r2t[rpi, :m:4] // 4", "int32_lens"),
    ("lens int narrowing wraps", "lens", "lens.int()", "r2t[rpi, :m:4] // 4", "plain"),
    ("lens int16 narrowing", "lens", "lens.to(torch.int16).long()", "r2t[rpi, :m:4] // 4", "plain"),
    ("table long // int", "lens", "lens", "(r2t[rpi, :m:4].long() // 4).int()", "plain"),
    ("table int then //", "lens", "lens", "r2t[rpi, :m:4].int() // 4", "int64_table_big"),
    ("table // then int", "lens", "lens", "(r2t[rpi, :m:4] // 4).int()", "int64_table_big"),
    ("table int.long //", "lens", "lens", "r2t[rpi, :m:4].int().long() // 4", "int64_table_big"),
    ("table long", "lens", "lens", "r2t[rpi, :m:4].long() // 4", "plain"),
)


def _add(programs: list, seen: set, program: Program):
    if program.name not in seen:
        seen.add(program.name)
        programs.append(program)


def generated_programs() -> list[Program]:
    programs: list[Program] = []
    seen: set = set()
    n = 0
    # 1. every edit x every protected target (or view) x every position
    for (edit_name, template), target, position in itertools.product(GENERATOR_EDITS, GENERATOR_TARGETS, POSITIONS):
        statement = template.format(t=target)
        if not eager_accepts(statement):
            continue
        n += 1
        _add(programs, seen, Program(
            name=f"{edit_name} | {target} | {position}", category=f"edit/{edit_name.split()[0]}",
            source=step_source(statement, position, ps=4 if n % 4 == 0 else 1),
            must_keep=must_keep(role_of(target), position), vectors=program_vectors(3, n), seed=n))
    # 2. metadata variants: the lengths strided or expanded, request indices negative or duplicated
    for variant, (edit_name, template), position in itertools.product(
            METADATA_VARIANTS, GENERATOR_EDITS[::2], ("max_gather", "gather_consumer")):
        target = {"strided": "aux", "expanded": "lens", "negative_rpi": "rpi", "duplicate_rpi": "rpi"}[variant]
        statement = template.format(t=target)
        n += 1
        _add(programs, seen, Program(
            name=f"{edit_name} | {target} | {position} | {variant}", category=f"metadata/{variant}",
            source=step_source(statement, position, ps=4 if n % 2 else 1), variant=variant,
            must_keep=must_keep(role_of(target), position), vectors=program_vectors(3, n), seed=n))
    for variant in METADATA_VARIANTS + ("out_of_range_rpi",):  # no edit: the safe step on that metadata
        n += 1
        vectors = program_vectors(4, n)
        if variant == "out_of_range_rpi":  # the bad index on a row of length 0: eager's gather still raises
            vectors = [[3, TOP, 0], [5, 9, 0], [3, TOP, 5]]
        _add(programs, seen, Program(name=f"no edit | {variant}", category=f"metadata/{variant}",
                                     source=step_source(ps=1), variant=variant, vectors=vectors, seed=n))
    # 3. cast chains, alone and with a write to the lengths or the table
    for name, max_of, consumer_lens, table, variant in CAST_CHAINS:
        vectors = WRAP_VECTORS + program_vectors(2, n) if "narrowing" in name else program_vectors(3, n)
        for edit_name, statement, position in ((None, None, "gather_consumer"),
                                               ("add_ lens", "lens.add_(1)", "max_gather"),
                                               ("add_ r2t", "r2t.add_(1)", "gather_consumer"),
                                               ("add_ lens after", "lens.add_(1)", "after_consumer")):
            n += 1
            _add(programs, seen, Program(
                name=f"cast {name} | {edit_name or 'no edit'} | {position}", category="cast",
                source=step_source(statement, position, max_of=max_of, table=table, consumer_lens=consumer_lens),
                variant=variant, must_keep=statement is not None and position != "after_consumer",
                vectors=vectors, seed=n))
    # 4. the chained-gather window: rows gathered, then written, then sliced
    for (edit_name, template), target in itertools.product(GENERATOR_EDITS[:8], ("r2t", "rpi", "r2t[:, :8]")):
        statement = template.format(t=target)
        if not eager_accepts(statement):
            continue
        n += 1
        _add(programs, seen, Program(
            name=f"chained {edit_name} | {target}", category="chained",
            source=step_source(statement, "max_gather", chained=True), vectors=program_vectors(3, n), seed=n))
    return programs


# A representative few for the full backend with Inductor.
INDUCTOR_PROGRAMS = (
    "method add_ | lens | gather_consumer",
    "method add_ | lens | before_max",
    "method copy_ | rpi | gather_consumer",
    "numpy a+=1 | lens | gather_consumer",
    "aten.clamp packet out= | lens | gather_consumer",
    "allow_in_graph | lens | gather_consumer",
    "setitem | r2t | gather_consumer",
    "method add_ | aux | gather_consumer | strided",
    "cast lens int narrowing wraps | no edit | gather_consumer",
    "chained method add_ | r2t",
)


def summarize(results: list[Result]) -> str:
    rows: dict = {}
    for r in results:
        row = rows.setdefault(r.program.category, collections_counter())
        row[r.decision] += 1
        row["divergent"] += bool(r.divergences) and not r.dynamo_also_diverges
        row["dynamo-divergent"] += bool(r.divergences) and r.dynamo_also_diverges
        row["must-keep missed"] += r.program.must_keep and r.decision == "rewritten"
    cols = ("rewritten", "kept", "crashed", "untraceable", "divergent", "dynamo-divergent", "must-keep missed")
    lines = [f"{'category':28}" + "".join(f"{c:>18}" for c in cols)]
    for cat in sorted(rows):
        lines.append(f"{cat:28}" + "".join(f"{rows[cat][c]:>18}" for c in cols))
    total = collections_counter()
    for row in rows.values():
        total.update(row)
    lines.append(f"{'TOTAL (' + str(len(results)) + ')':28}" + "".join(f"{total[c]:>18}" for c in cols))
    return "\n".join(lines)


def collections_counter():
    import collections

    return collections.Counter()


if __name__ == "__main__":  # python tests/support/program_generator.py [-v]
    import time

    start = time.time()
    results = [run_program(p) for p in generated_programs()]
    print(summarize(results))
    for r in results:
        bad = (r.divergences and not r.dynamo_also_diverges) or r.crashed or \
            (r.program.must_keep and r.decision == "rewritten")
        if bad or "-v" in sys.argv:
            print(f"\n[{r.decision}] {r.program.name} ({r.program.variant})")
            print(r.program.source.rstrip())
            for d in r.divergences[:2] + ([r.crashed] if r.crashed else []):
                print("   ", d)
    print(f"\n{len(results)} programs in {time.time() - start:.0f} s")
