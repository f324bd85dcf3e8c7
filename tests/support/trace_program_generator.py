"""Generated programs aimed at the trace-time layer (issue 45, item 3: "tests that could find the next one").

The graph side has program_generator.py (writes placed around the canonical step). This module does the same
for what the backend decides WHILE DYNAMO TRACES (compile_pass.tracing): the range a max of declared lengths gets,
branches on that max traced at the bound, msgspec.Struct modelling, registered torch.compiler.disable()d
launchers, and the copy relation (`buf[idx].copy_(seq_lens)`, lengths read back from `buf[idx]`).

Every program is a decode-step-shaped function, generated as Python source (exec'd as the body of a module of its
own, `tgen_<name>`: a fresh code object, so programs never share Dynamo's cache), of one of these families:

  branch     `m = seq_lens.max().item()`, then random Python branches on m or on values derived from it (mod,
             floor-div, compares, min/max, cdiv round-ups `if blocks % L != 0: blocks += L - blocks % L`, while
             loops, nested / sequential / elif / ternary shapes, and/or/not), which choose a width (every outcome
             covers every row: the result must not depend on it), a value (the outcome matters), an early exit, a
             clamp, or a page size; then a page table sized from the result (a gather `r2t[rpi, :w:ps] // ps`, or
             an allocated table filled by a registered bounded writer) fed to a self-guarding consumer
             (syncfree_test::bounded_sum or syncfree::paged_decode). Also the max spelled in several ways and of
             inputs that must not get a range (a sum, an undeclared name), a CPU mirror and a length_bounds name.
             Small bounds (16..128) for most, realistic ones too (4096, 8192, 32768, 131072; pages of 16-64; the
             round-up multiple 64 of SGLang's TRTLLM-MLA).
  grow       SGLang FlashMLA's grow-on-demand scratch (`if scratch.buf.shape[1] < n: grow`), the scratch starting
             at the static width or narrower, persisting across the calls of one program.
  struct     random msgspec.Struct classes over Python's attribute-access features (plain, __getattribute__ or
             __getattr__ overrides, in the class or a base, properties, methods, descriptors, ClassVars, defaults,
             default_factory, __post_init__, __len__/__bool__, a custom metaclass, frozen/kw_only/array_like/dict
             configs, an annotation only a type checker resolves), built in the step (the trace-time model) or
             passed in, whose fields size the table, scale the result or decide a branch.
  launcher   random launcher signatures registered with compile_pass.register_disabled_launcher: schema
             parameters of every kind (given values of the schema's Python type, or of another one the schema
             accepts), and parameters the op does not take with defaults of every type (0.0 vs -0.0, NaN, 1 vs
             True vs 1.0, None, tuples, strings), called at the default, with an equal but not identical value,
             or another one; the launcher's result encodes the exact type and value of every argument it received
             (`sig`).
  copy       `DST.copy_(SRC)` then the consumer's lengths read back through READ, with every indexing kind (basic
             slice views, narrow/select/view chains, and tensor / list / mask indices or clone/contiguous/to
             copies, which write a temporary), dtype pairs (int64 lengths into int32 / int16 buffers: narrowing),
             and the copy before the max, between the max and the gather or after the gather.
  hidden     a branch on the max whose outcomes differ where the FX graph's text does not show it (the classes a
             soundness review broke the comparison of the two outcomes with, 2026-12-05, and their neighbours):
             an nn.Parameter of one input or another (Dynamo builds it before the graph), Python RNG calls with
             other arguments (replayed before the graph), two closures of one factory (one qualname), two
             msgspec.Struct classes of one factory stored on an object (one repr), a predicate whose products
             wrap in int64, the lengths written in place before the max (the range is the inputs'), and the
             compiled function entered again, recursively, after a graph break, and (12 more, `float_bits`)
             two floats that print alike returned by the outcome (nan and -nan, another NaN payload, 0.0 and
             -0.0; Python floats are compared by bits); each with an `observe()` of what the step leaves outside
             its result, compared after every call.

Each program is compiled ONCE through the backend's trace-time path without Inductor
(`passlib.compile_traced(fn, max_context_len=B, checked=...)`) and run, together with eager (the same function
uncompiled), on length vectors chosen to sweep [0, bound]: for branch programs a probe (the program's own integer
code with every predicate and modulus recorded) is evaluated on candidate maxima and a set cover picks maxima that
hit every outcome of every predicate and every residue class of every modulus (buckets for moduli past 16), with
m = 0 and m = bound always included. Under checked=True a few INVALID vectors (lengths past the bound, negative,
int64 values that wrap when narrowed) are added: there the compiled step must raise or equal eager.

What is checked, for every vector (`run_program` returns the divergences, each with its kind):
  valid lengths (all in [0, bound])   compiled returns what eager returns (values, shapes, dtypes, and the buffers
                                      and scratch left behind); it raises where eager raises, and only there
  invalid lengths (checked=True)      compiled raises, or returns what eager returns
Where the compiled step raises on valid lengths, the program is also run through stock torch.compile (backend
"eager", capture_scalar_outputs on, no compile_pass hook, a fresh copy of its code): if that raises the same
exception type on the same lengths, the raise is a limitation of Dynamo itself, not of this layer: it is listed
(`Result.torch_limits`, the table's torch-limit column, and the failure message of any program that also
diverges) and not counted as a divergence. The generator avoids the constructs known to do that (`if m % k:`,
a truth test of a SymInt, raises GuardOnDataDependentSymNode in Dynamo itself).

Programs use public names only (compile_pass.register_disabled_launcher, compile_pass.register_bounded_writer,
passlib.compile_traced). Everything is deterministic (random.Random(seed)). `python
tests/support/trace_program_generator.py` lists the programs (a table per family and category); `--run` runs
them and prints the table of outcomes and one reproducer per failing category; `--family F`, `--limit N`,
`--show NAME` narrow it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import random
import struct
import sys
import time
import types
import typing
import warnings

import torch

import compile_pass
import consumers_for_tests  # noqa: F401  (registers syncfree_test::bounded_sum)
from passlib import compile_traced

try:
    import msgspec
except ImportError:  # msgspec comes with the SGLang set; the struct programs then skip (the test says so)
    msgspec = None

SUM = torch.ops.syncfree_test.bounded_sum
PD = torch.ops.syncfree.paged_decode
REQS = 4  # rows of the token table; batches of 1..4 requests
SMALL_BOUNDS = (16, 24, 32, 40, 48, 60, 64, 96, 100, 128)
SMALL_PAGES = (1, 1, 1, 1, 1, 1, 2, 3, 4, 8, 16)  # mostly 1: a `// ps` on the table costs ~0.1 s of tracing
REALISTIC = ((4096, 16), (4096, 64), (8192, 32), (32768, 16), (32768, 64), (131072, 16), (131072, 32), (131072, 64))
MAX_VECTORS = 14  # valid vectors per program (set cover of the probe's features, then edges)
INVALID_WRAP = -(1 << 32)  # an int64 length that equals the int32 value + this


# -- a bounded writer (TRTLLM-MLA's / FlashMLA's block-table kernel, as a torch op) -----------------------------
def _fill_rows(req_to_token, req_pool_indices, lengths, table, table_stride, page_size):
    """Row b of `table`: its first cdiv(lengths[b], page_size) columns get the pages of request
    req_pool_indices[b]; nothing else is written. Raises IndexError where a row needs more columns than the table
    has (eager's table too narrow for its lengths), ValueError where table_stride is not the table's row stride."""
    if table.dim() != 2 or (table.numel() and table_stride != table.stride(0)):
        raise ValueError(f"table_stride {table_stride} is not the table's row stride {table.stride()}")
    for b in range(lengths.shape[0]):
        pages = -(-max(int(lengths[b]), 0) // page_size)
        if pages > table.shape[1]:
            raise IndexError(f"row {b} needs {pages} columns, the table has {table.shape[1]}")
        row = req_to_token[req_pool_indices[b]]
        table[b, :pages] = (row[: pages * page_size : page_size] // page_size).to(table.dtype)


_LIB = torch.library.Library("syncfree_tgen", "FRAGMENT")
try:
    _LIB.define("fill_rows(Tensor req_to_token, Tensor req_pool_indices, Tensor lengths, Tensor(a!) table, "
                "SymInt table_stride, int page_size) -> ()")
    _LIB.impl("fill_rows", _fill_rows, "CompositeExplicitAutograd")
    torch.library.register_fake("syncfree_tgen::fill_rows", lambda *a: None, lib=_LIB)
except RuntimeError:  # defined already in this process (the module imported under a second name)
    pass
FILL = torch.ops.syncfree_tgen.fill_rows
compile_pass.register_bounded_writer(FILL, table="table", lengths="lengths", page_size="page_size",
                                     req_pool_indices="req_pool_indices", req_to_token="req_to_token",
                                     table_stride="table_stride")


# -- launchers: every op is defined once per process ---------------------------------------------------------
_LAUNCH_OPS: dict = {}
_REGISTERED: list = []  # launchers registered by the program that runs now (unregistered after it)


def register_launcher(launcher, name: str, schema: str):
    """compile_pass.register_disabled_launcher(launcher, name=, schema=), once per op name in a process (a second
    program of the same name registers its launcher with the op already defined: op=)."""
    if name in _LAUNCH_OPS:
        op = compile_pass.register_disabled_launcher(launcher, _LAUNCH_OPS[name])
    else:
        op = _LAUNCH_OPS[name] = compile_pass.register_disabled_launcher(launcher, name=name, schema=schema)
    _REGISTERED.append(launcher)
    return op


def _unregister_launchers():
    undo = getattr(compile_pass, "unregister_disabled_launcher", None)
    while _REGISTERED:
        launcher = _REGISTERED.pop()
        if undo is not None:
            undo(launcher)


def sig(v) -> float:
    """A number that tells apart every value a launcher may receive by type and value: None, False / True, ints,
    floats (the sign of a zero, NaN, infinities), strings, tuples (element by element), tensors."""
    if v is None:
        return 0.5
    if isinstance(v, bool):
        return 1.25 if v else 1.5
    if isinstance(v, int):
        return 2.0 + (v % 97) / 128
    if isinstance(v, float):
        if v != v:
            return 3.875
        if math.isinf(v):
            return 3.75 if v > 0 else 3.625
        return 3.0 + math.copysign(0.0625, v) + (abs(v) % 7) / 1024
    if isinstance(v, str):
        return 4.0 + len(v) / 64 + sum(map(ord, v)) % 13 / 4096
    if isinstance(v, (tuple, list)):
        return (5.0 if isinstance(v, tuple) else 5.5) + sum((i + 1) * sig(e) for i, e in enumerate(v)) / 16
    if isinstance(v, torch.Tensor):
        return 6.0 + float(v.float().sum()) / 1024
    return 7.0


# -- programs ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Program:
    name: str
    family: str  # branch / grow / struct / launcher / copy
    category: str  # family/kind, the unit of the summary table
    source: str  # setup (classes, launchers) and `def step(...)`
    params: tuple  # step's parameters, in order
    bound: int  # max_context_len
    ps: int  # the page size the program uses (token table layout)
    options: dict  # compile options besides max_context_len
    batch: int = 3
    lens_dtype: str = "int64"
    seed: int = 0
    probe: str = ""  # `def probe(x)`: the integer code of the step (x = the max of the lengths)
    extra_tokens: int = 0  # how far past the bound the widest table reaches (the token table is that wide)
    valid_top: int = -1  # lengths in [0, valid_top] are valid (a length_bounds name); -1: the bound
    buf: tuple | None = None  # copy programs: (shape, dtype name, stale fill)
    scratch: int = 0  # grow programs: the scratch's initial width in pages
    consumer: str = "sum"  # sum / pd
    given_struct: str = ""  # struct programs: the expression (setup's names) that builds the argument `geo`
    note: str = ""  # what the program is meant to exercise (printed with a failure)

    @property
    def checked(self) -> bool:
        return self.options.get("checked", True)

    @property
    def top(self) -> int:
        return self.bound if self.valid_top < 0 else self.valid_top

    def namespace(self) -> dict:
        return {"torch": torch, "math": math, "typing": typing, "ClassVar": typing.ClassVar, "msgspec": msgspec,
                "SUM": SUM, "PD": PD, "FILL": FILL, "sig": sig, "register_launcher": register_launcher}

    @property
    def module_name(self) -> str:
        return "tgen_" + self.name.replace("-", "_")

    def build(self) -> dict:
        """The program's source exec'd as the body of a module of its own (`tgen_<name>`, in sys.modules while
        it runs: msgspec resolves a Struct's annotations in its class's module, as for any imported module)."""
        module = types.ModuleType(self.module_name)
        module.__dict__.update(self.namespace())
        sys.modules[self.module_name] = module
        exec(compile(self.source, f"<{self.name}>", "exec"), module.__dict__)
        return module.__dict__

    def release(self) -> None:
        sys.modules.pop(self.module_name, None)

    def function(self):
        return self.build()["step"]

    def header(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options.items()))
        return (f"program {self.name} [{self.category}] (max_context_len={self.bound}, {opts}; page size {self.ps}, "
                f"batch {self.batch}, lengths {self.lens_dtype}, consumer {self.consumer})"
                + (f"\n  meant to exercise: {self.note}" if self.note else ""))


# -- inputs -------------------------------------------------------------------------------------------------------
_TABLES: dict = {}
_QKV: dict = {}


def token_table(width: int, ps: int) -> torch.Tensor:
    """int32 [REQS, width]: token t of request r is in page P(r, t // ps), slot t % ps, with P a fixed
    permutation of the REQS * cdiv(width, ps) pages (so each row's pages differ, and a wrong width shows)."""
    key = (width, ps)
    if key not in _TABLES:
        per_row = -(-width // ps)
        pages = REQS * per_row
        mult = 7919
        while math.gcd(mult, pages) != 1:
            mult += 2
        logical = torch.arange(REQS, dtype=torch.int64)[:, None] * per_row + torch.arange(width)[None, :] // ps
        _TABLES[key] = (((logical * mult + 11) % pages) * ps + torch.arange(width)[None, :] % ps).to(torch.int32)
    return _TABLES[key]


def qkv(batch: int, ps: int, width: int):
    pages = REQS * -(-width // ps)
    key = (batch, ps, pages)
    if key not in _QKV:
        gen = torch.Generator().manual_seed(batch * 1000 + ps)
        _QKV[key] = (torch.randn(batch, 1, 2, 8, generator=gen), torch.randn(pages, ps, 1, 8, generator=gen),
                     torch.randn(pages, ps, 1, 8, generator=gen))
    return _QKV[key]


def request_indices(program: Program) -> torch.Tensor:
    return torch.randperm(REQS, generator=torch.Generator().manual_seed(program.seed))[: program.batch]


class Scratch:
    """A grow-on-demand table kept across steps (SGLang FlashMLA's `_eager_block_kv_indices`)."""

    def __init__(self, width: int, rows: int = REQS):
        self.buf = torch.full((rows, width), -1, dtype=torch.int32)


def stale_buffer(program: Program) -> torch.Tensor:
    shape, dtype, stale = program.buf
    n = math.prod(shape)
    if stale == "high":  # near the bound: a buffer that was not written gives lengths past the step's max
        values = program.bound - torch.arange(n) % 3
    elif stale == "zeros":
        values = torch.zeros(n, dtype=torch.int64)
    else:
        values = torch.randint(0, program.bound + 1, (n,), generator=torch.Generator().manual_seed(program.seed))
    return values.view(shape).to(getattr(torch, dtype))


def make_inputs(program: Program, lengths: list, namespace: dict | None = None) -> list:
    """The step's arguments for one vector, fresh (nothing shared is written by any program: the token table,
    the request indices and q/k/v are shared read-only; buffers are new)."""
    lens = torch.tensor(lengths, dtype=getattr(torch, program.lens_dtype))
    width = program.bound + program.extra_tokens + 2 * program.ps
    args = {"req_to_token": token_table(width, program.ps), "req_pool_indices": request_indices(program),
            "seq_lens": lens, "lens": lens, "verify_lens": lens, "seq_lens_cpu": lens.clone()}
    if program.consumer == "pd":
        args["q"], args["k_cache"], args["v_cache"] = qkv(program.batch, program.ps, width)
    if program.buf is not None:
        args["buf"] = stale_buffer(program)
        args["idx"] = torch.arange(program.batch)
    if "x1" in program.params:  # two float inputs that differ (hidden family: which one an outcome takes)
        gen = torch.Generator().manual_seed(program.seed)
        args["x1"] = torch.rand(4, generator=gen) + 0.5
        args["x2"] = args["x1"] * 3 + 1
    if "geo" in program.params:
        args["geo"] = eval(program.given_struct, namespace)  # noqa: S307 - the program's own setup names
    return [args[p] for p in program.params]


def describe_inputs(program: Program) -> str:
    width = program.bound + program.extra_tokens + 2 * program.ps
    text = (f"req_to_token: int32 [{REQS}, {width}], token t of request r in page P(r, t // {program.ps}) "
            f"(trace_program_generator.token_table); req_pool_indices = {request_indices(program).tolist()}")
    if program.buf is not None:
        text += f"; buf = {stale_buffer(program).tolist()} ({program.buf[1]}, fresh for each call)"
    if program.scratch:
        text += f"; scratch: Scratch({program.scratch}) (persists across the calls, one for eager, one compiled)"
    if program.given_struct:
        text += f"; geo = {program.given_struct}"
    if program.consumer == "pd":
        text += "; q, k_cache, v_cache: randn (trace_program_generator.qkv)"
    return text


# -- choosing length vectors ----------------------------------------------------------------------------------
class _Probe:
    """Runs a program's `probe(x)` and records the outcome of every predicate and the value of every modulus."""

    def __init__(self, source: str):
        self.seen: list = []
        namespace = {"_p": self._p, "_v": self._v, "math": math}
        exec(compile(source, "<probe>", "exec"), namespace)
        self.fn = namespace["probe"]

    def _p(self, i, value):
        self.seen.append(("p", i, bool(value)))
        return value

    def _v(self, i, k, value):
        self.seen.append(("v", i, value if k <= 16 else min(value, 1) if value < 2 else
                          ("top" if value == k - 1 else "mid")))
        return value

    def features(self, x: int):
        self.seen = []
        try:
            out = self.fn(x)
        except Exception as e:  # noqa: BLE001 - eager raises there too: a feature of its own
            out = type(e).__name__
        path = tuple(s for s in self.seen if s[0] == "p")
        return set(self.seen) | {("path", path)}, out


def _candidates(program: Program, rng: random.Random) -> list[int]:
    top = program.top
    if top <= 600:
        return list(range(top + 1))
    span = 300
    found = set(range(0, span)) | set(range(top - span, top + 1))
    for period in (program.ps, 64 * program.ps, 2 * 64 * program.ps, 1024, 2048, 4096):
        for j in (1, 2, 3, top // period - 1, top // period, top // (2 * period)):
            for r in (-1, 0, 1, program.ps - 1, program.ps):
                found.add(j * period + r)
    found |= {rng.randint(0, top) for _ in range(400)}
    return sorted(v for v in found if 0 <= v <= top)


def chosen_maxima(program: Program) -> list[int]:
    """Maxima of the lengths for the program's valid vectors: 0 and the top first, then a greedy set cover of the
    probe's features (each predicate's outcomes, each modulus's residue classes, each path through the branches),
    then 1 and top - 1, at most MAX_VECTORS (more for a program with many features: never fewer than it needs
    to give every predicate both outcomes)."""
    rng = random.Random(program.seed)
    top = program.top
    if not program.probe:
        picks = [0, top, 1, top - 1, rng.randint(2, max(2, top - 2)), top // 2]
        picks += [k * program.ps + r for k in (1, top // max(program.ps, 1) - 1) for r in (0, 1) if program.ps > 1]
        return list(dict.fromkeys(v for v in picks if 0 <= v <= top))[:8]
    probe = _Probe(program.probe)
    table = {x: probe.features(x)[0] for x in _candidates(program, rng)}
    picks = [0, top]
    covered = set().union(*(table[x] for x in picks))
    needed = set().union(*table.values()) - covered
    outcomes = {f for f in needed if f[0] == "p"}
    while needed and (len(picks) < MAX_VECTORS or needed & outcomes):
        best = max(table, key=lambda x: (len(table[x] & needed), len(table[x] & outcomes & needed), -abs(x - top)))
        gain = table[best] & needed
        if not gain:
            break
        picks.append(best)
        needed -= gain
        outcomes -= gain
    for extra in (1, top - 1):
        if len(picks) < MAX_VECTORS and extra not in picks and 0 <= extra <= top:
            picks.append(extra)
    return picks


def lengths_with_max(program: Program, m: int, n: int) -> list[int]:
    """A vector of `batch` lengths whose max is m: one row at m, the others in [0, m] (one at 0 sometimes)."""
    rng = random.Random(program.seed * 7919 + n)
    rows = [rng.randint(0, m) for _ in range(program.batch)]
    if program.batch > 2 and rng.random() < 0.3:
        rows[rng.randrange(program.batch)] = 0
    rows[rng.randrange(program.batch)] = m
    return rows


def invalid_vectors(program: Program) -> list[list[int]]:
    """Lengths outside [0, top] (checked=True only): past the bound, negative, and int64 values that equal a
    length in range once narrowed to int32 (or int16) while the max of the int64 values is small."""
    if not program.checked:
        return []
    top, b = program.top, program.batch
    out = [[top + 1] + [min(3, top)] * (b - 1), [-1] + [top] * (b - 1)]
    if program.lens_dtype == "int64":
        small = min(2, top)
        out.append([INVALID_WRAP + top] + [small] * (b - 1))
        if program.buf is not None and program.buf[1] == "int16":
            out.append([(1 << 16) + top] + [small] * (b - 1))
    return [v[:b] for v in out]


def vectors(program: Program) -> list[tuple[list[int], bool]]:
    """(lengths, valid) for every call of the program, in order: the valid sweep, then the invalid ones."""
    valid = [lengths_with_max(program, m, n) for n, m in enumerate(chosen_maxima(program))]
    return [(v, True) for v in valid] + [(v, False) for v in invalid_vectors(program)]


# -- running one program ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Raised:
    type: str
    message: str

    def __str__(self):
        return f"raised {self.type}: {self.message}"


@dataclasses.dataclass
class Result:
    program: Program
    divergences: list = dataclasses.field(default_factory=list)  # (kind, text)
    vectors: int = 0
    rewritten: int = 0
    kept: int = 0
    graphs: int = 0
    crashed: str = ""
    seconds: float = 0.0
    torch_limits: list = dataclasses.field(default_factory=list)  # raises that stock torch.compile has too

    @property
    def kinds(self) -> list[str]:
        return sorted({k for k, _ in self.divergences})

    def message(self, most: int = 4) -> str:
        p = self.program
        lines = [p.header(), "--- source ---", p.source.rstrip(), "--- inputs ---", describe_inputs(p),
                 f"--- {len(self.divergences)} divergence(s) over {self.vectors} vectors "
                 f"(pass: {self.rewritten} rewritten, {self.kept} kept, {self.graphs} graphs) ---"]
        lines += [f"[{k}] {t}" for k, t in self.divergences[:most]]
        lines += [f"[not counted: torch.compile alone raises too] {t}" for t in self.torch_limits[:2]]
        if len(self.divergences) > most:
            lines.append(f"... and {len(self.divergences) - most} more")
        lines.append(f"(rerun: python tests/support/trace_program_generator.py --show {p.name} --run; in the source, "
                     "SUM = torch.ops.syncfree_test.bounded_sum, PD = torch.ops.syncfree.paged_decode, FILL = "
                     "torch.ops.syncfree_tgen.fill_rows (a registered bounded writer), sig and register_launcher "
                     "are trace_program_generator's; compiled = passlib.compile_traced(step, max_context_len="
                     f"{p.bound}, {', '.join(f'{k}={v!r}' for k, v in sorted(p.options.items()))}))")
        return "\n".join(lines)


def _short(value) -> str:
    if isinstance(value, Raised):
        return str(value)[:400]
    if isinstance(value, torch.Tensor):
        flat = value.flatten()
        body = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in flat[:8].tolist())
        more = ", ..." if flat.numel() > 8 else ""
        return f"tensor([{body}{more}], {str(value.dtype).replace('torch.', '')}, shape {tuple(value.shape)})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_short(v) for v in value) + ")"
    return repr(value)[:200]


def _outcome(fn, args: list):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args)
    except Exception as e:  # noqa: BLE001 - compared: where it raises, and what it says
        text = str(e).strip().splitlines()
        return Raised(type(e).__name__, (text[0] if text else "")[:300] + (" ..." if len(text) > 1 else ""))


def difference(got, want) -> str | None:
    """None when `got` (compiled) equals `want` (eager): values, shapes, dtypes, Python values by type."""
    if isinstance(want, Raised) or isinstance(got, Raised):
        return None if isinstance(want, Raised) and isinstance(got, Raised) else "raised"
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return "structure"
        return next((d for d in (difference(g, w) for g, w in zip(got, want)) if d), None)
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return "not a tensor"
        if got.shape != want.shape or got.dtype != want.dtype:
            return "shape/dtype"
        if torch.equal(got, want):
            return None
        if got.is_floating_point() and torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True):
            return None
        return "values"
    if type(want) is float and type(got) is float:  # by bits: a NaN's sign and payload, a zero's sign
        return None if struct.pack("<d", got) == struct.pack("<d", want) else "values"
    if type(got) is not type(want) or not (got == want or (got != got and want != want)):
        return "values"
    return None


def _left(program: Program, args: list) -> dict:
    """What the step may leave behind in its inputs: the copy buffer."""
    return {p: a.clone() for p, a in zip(program.params, args) if p == "buf"}


@contextlib.contextmanager
def _quick_compiles():
    """Two costs of torch's that say nothing about the programs, taken off while they run: OpenMP's threads on
    tiny tensors (on 2 busy cores they mostly wait on each other: 20 ms for one small softmax), and the guard
    latency profile Dynamo takes after every compile (a cache flush, ~60 ms here; its number only goes to a debug
    log and a metric: compile_pass._compat.no_guard_profiling, the one home of private torch APIs). Both are
    restored after the program."""
    from compile_pass import _compat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _compat.no_guard_profiling():
            yield
    finally:
        torch.set_num_threads(threads)


def run_program(program: Program) -> Result:
    """Compile `program` once (passlib.compile_traced: the backend's trace-time path, the pass, the graph as
    captured) and run it and eager on every vector; the divergences say what differed, and where."""
    result = Result(program)
    start = time.process_time()
    quick = _quick_compiles()
    quick.__enter__()
    try:
        namespace = program.build()
        fn = namespace["step"]
        observe = namespace.get("observe", lambda: None)  # what the step leaves outside its result (hidden family)
        call, backend = compile_traced(fn, max_context_len=program.bound, **program.options)
        if program.scratch:
            eager_scratch, compiled_scratch = Scratch(program.scratch), Scratch(program.scratch)
        stock = _Stock(program)
        for lengths, valid in vectors(program):
            result.vectors += 1
            eager_args = make_inputs(program, lengths, namespace)
            compiled_args = make_inputs(program, lengths, namespace)
            if program.scratch:
                eager_args, compiled_args = [eager_scratch, *eager_args], [compiled_scratch, *compiled_args]
            want = _outcome(fn, eager_args)
            seen_want = observe()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = call(*compiled_args)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                result.crashed = f"{type(e.inner_exception).__name__}: {e.inner_exception}"[:400]
                result.divergences.append(("crashed", f"lengths={lengths}: the backend raised while compiling: "
                                                      f"{result.crashed}"))
                break
            except Exception as e:  # noqa: BLE001
                text = str(e).strip().splitlines()
                got = Raised(type(e).__name__, (text[0] if text else "")[:300] + (" ..." if len(text) > 1 else ""))
            seen_got = observe()
            _compare(result, program, lengths, valid, want, got, eager_args, compiled_args, stock)
            if valid and seen_want != seen_got and not (isinstance(want, Raised) or isinstance(got, Raised)):
                result.divergences.append(("side effect differs", f"lengths={lengths}: observe() after the step: "
                                                                  f"eager {seen_want!r}, compiled {seen_got!r}"))
        result.rewritten = sum(len(r.rewritten) for r in backend.reports)
        result.kept = sum(len(r.kept) for r in backend.reports)
        result.graphs = len(backend.reports)
    finally:
        quick.__exit__(None, None, None)
        _unregister_launchers()
        program.release()
        result.seconds = time.process_time() - start  # CPU seconds of this process
    return result


class _Stock:
    """The program as stock torch.compile runs it (a fresh copy of its code: Dynamo's cache is per code object)."""

    def __init__(self, program: Program):
        self.program, self.call = program, None

    def __call__(self, lengths: list):
        if self.call is None:
            namespace = self.program.build()
            self.call = torch.compile(namespace["step"], backend="eager")
            self.namespace = namespace
        args = make_inputs(self.program, lengths, self.namespace)
        if self.program.scratch:
            args = [Scratch(self.program.scratch), *args]
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return _outcome(self.call, args)


def _compare(result, program, lengths, valid, want, got, eager_args, compiled_args, stock=None):
    where = f"lengths={lengths} (max {max(lengths)}{'' if valid else ', INVALID: outside [0, %d]' % program.top})"
    what = f"eager {_short(want)}; compiled {_short(got)}"
    d = difference(got, want)
    if valid:
        if isinstance(got, Raised) and not isinstance(want, Raised):
            if stock is not None:  # does torch.compile raise there by itself (a limitation of Dynamo's)?
                base = stock(lengths)
                if isinstance(base, Raised) and base.type == got.type:
                    result.torch_limits.append(f"{where}: stock torch.compile raises too: {base}")
                    return
            result.divergences.append(("raises on valid lengths", f"{where}: {what}"))
        elif isinstance(want, Raised) and not isinstance(got, Raised):
            result.divergences.append(("returns where eager raises", f"{where}: {what}"))
        elif d:
            result.divergences.append(("wrong value", f"{where}: {what}"))
        elif not isinstance(want, Raised):  # both returned the same: what they left behind must agree too
            left_want, left_got = _left(program, eager_args), _left(program, compiled_args)
            for key in left_want:
                if not torch.equal(left_want[key], left_got[key]):
                    result.divergences.append(("inputs left differ", f"{where}: {key} after the step: eager "
                                                                     f"{_short(left_want[key])}, compiled "
                                                                     f"{_short(left_got[key])}"))
            if program.scratch and not torch.equal(eager_args[0].buf, compiled_args[0].buf):
                result.divergences.append(("inputs left differ", f"{where}: scratch.buf after the step: eager "
                                                                 f"{_short(eager_args[0].buf)}, compiled "
                                                                 f"{_short(compiled_args[0].buf)}"))
    elif not isinstance(got, Raised) and d:
        result.divergences.append(("unchecked invalid lengths", f"{where}: checked=True, yet {what}"))


# -- the branch family: integer code on the max -----------------------------------------------------------------
class Expr:
    """A fragment of integer Python whose probe rendering records moduli (`_v`) and predicates (`_p`)."""

    def __init__(self, parts):
        self.parts = parts  # strings, Exprs, ("v", id, modulus, Expr) or ("p", id, Expr)

    def render(self, probe: bool = False) -> str:
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Expr):
                out.append(part.render(probe))
            elif part[0] == "v":
                inner = part[3].render(probe)
                out.append(f"_v({part[1]}, {part[2]}, {inner})" if probe else inner)
            else:
                inner = part[2].render(probe)
                out.append(f"_p({part[1]}, {inner})" if probe else inner)
        return "".join(out)


def E(*parts) -> Expr:
    return Expr(list(parts))


class BranchGen:
    """Random integer code over the max `m` (and what is derived from it): predicates and statement shapes."""

    def __init__(self, rng: random.Random, top: int, ps: int):
        self.rng, self.top, self.ps = rng, top, ps
        self.ids = 0

    def _id(self) -> int:
        self.ids += 1
        return self.ids

    def const(self, lo: int, hi: int) -> int:
        r = self.rng
        if r.random() < 0.55:
            return r.randint(lo, max(lo, hi))
        return r.choice([lo, lo + 1, hi, hi - 1, (lo + hi) // 2, hi + 1, max(lo - 1, 0)])

    def modulus(self) -> int:
        return self.rng.choice([2, 2, 3, 4, 4, 5, 7, 8, 16, max(self.ps, 2), 2 * self.ps + 1])

    def mod(self, var: str, k: int) -> Expr:
        return E(("v", self._id(), k, E(f"{var} % {k}")))

    def atom(self, var: str = "m", hi: int | None = None) -> Expr:
        """One comparison on `var` (whose values lie in [0, hi])."""
        r, hi = self.rng, self.top if hi is None else hi
        kind = r.choices(["cmp", "mod", "div", "cdiv", "minmax", "lin", "chain", "range"],
                         weights=[5, 6, 2, 3, 2, 1, 1, 1])[0]
        op = r.choice(["<", "<=", ">", ">=", "==", "!="])
        if kind == "cmp":
            return E(f"{var} {op} {self.const(0, hi)}")
        if kind == "mod":
            k = self.modulus()
            if r.random() < 0.3:  # parity and friends, as engines write them
                return E(self.mod(var, k), f" {r.choice(['==', '!='])} 0")
            return E(self.mod(var, k), f" {op} {r.randint(0, k - 1)}")
        if kind == "div":
            k = r.choice([2, 3, 4, 8, max(self.ps, 2)])
            return E(f"{var} // {k} {op} {self.const(0, hi // k)}")
        if kind == "cdiv":
            a, k = r.choice([self.ps, 2, 4, 16]), r.choice([2, 3, 4, 8])
            a = max(a, 1)
            return E(self.mod(f"(({var} + {a - 1}) // {a})", k), f" {r.choice(['!=', '==', '<'])} "
                                                                   f"{r.randint(0, k - 1)}")
        if kind == "minmax":
            c = self.const(0, hi)
            fn = r.choice(["min", "max"])
            return E(f"{fn}({var}, {c}) {op} {c if r.random() < 0.4 else self.const(0, hi)}")
        if kind == "range":  # decided by the range alone: the same outcome for every value in [0, hi]
            return E(r.choice([f"{var} <= {hi}", f"{var} < {hi + 1}", f"{var} >= 0", f"{var} > {hi}",
                               f"{var} < 0", f"{var} != {hi + 1}"]))
        if kind == "lin":
            a, b = r.randint(2, 5), r.randint(0, 9)
            return E(f"{var} * {a} + {b} {op} {self.const(0, hi * a + b)}")
        lo = self.const(0, hi)  # a chained comparison
        return E(f"{lo} <= {var} < {self.const(lo, hi + 1)}")

    def pred(self, var: str = "m", hi: int | None = None, simple: bool = False) -> Expr:
        r = self.rng
        roll = 1.0 if simple else r.random()
        if roll < 0.62:
            inner = self.atom(var, hi)
        elif roll < 0.77:
            inner = E(self.atom(var, hi), " and ", self.atom(var, hi))
        elif roll < 0.9:
            inner = E(self.atom(var, hi), " or ", self.atom(var, hi))
        else:
            inner = E("not (", self.atom(var, hi), ")")
        return E(("p", self._id(), inner))

    def shape(self, assign, depth: int = 0) -> list:
        """Statement lines (Expr per line, with indentation) in one random shape; `assign()` gives one
        assignment statement (a string)."""
        r = self.rng
        kind = r.choices(["ifelse", "if", "elif", "nested", "seq", "ternary"],
                         weights=[4, 3, 2, 2 if depth == 0 else 0, 2 if depth == 0 else 0, 2])[0]
        if kind == "ifelse":
            return [E("if ", self.pred(), ":"), *self._body(assign, depth), E("else:"), *self._body(assign, depth)]
        if kind == "if":
            return [E("if ", self.pred(), ":"), *self._body(assign, depth)]
        if kind == "elif":
            return [E("if ", self.pred(), ":"), *self._body(assign, depth), E("elif ", self.pred(), ":"),
                    *self._body(assign, depth), E("else:"), *self._body(assign, depth)]
        if kind == "nested":
            inner = self.shape(assign, depth + 1)
            lines = [E("if ", self.pred(), ":"), *[E("    ", line) for line in inner]]
            if r.random() < 0.5:
                lines += [E("else:"), *self._body(assign, depth)]
            return lines
        if kind == "seq":
            return self.shape(assign, depth + 1) + self.shape(assign, depth + 1)
        s = assign()
        if " = " not in s:  # an augmented assignment: no ternary form
            return [E("if ", self.pred(), ":"), E("    ", s)]
        target, value = s.split(" = ", 1)
        other = assign()
        other_value = other.split(" = ", 1)[1] if " = " in other else value
        return [E(f"{target} = {value} if ", self.pred(), f" else {other_value}")]

    def _body(self, assign, depth):
        if depth == 0 and self.rng.random() < 0.2:
            return [E("    ", line) for line in self.shape(assign, depth + 1)]
        return [E("    ", assign())]


def _lines(exprs: list, probe: bool, indent: str = "    ") -> str:
    return "".join(f"{indent}{e.render(probe)}\n" for e in exprs)


def _probe_source(max_of_x: str, int_code: list, result: str) -> str:
    return f"def probe(x):\n    m = {max_of_x}\n{_lines(int_code, True)}    return {result}\n"


def _table(r: random.Random, end: str, ps: int, kind: str | None = None) -> str:
    """A page-table gather of `end` tokens in one of its spellings."""
    kind = kind or r.choice(["slice", "slice", "chained", "zero_start", "strided"])
    if ps == 1:
        return {"slice": f"req_to_token[req_pool_indices, :{end}]",
                "chained": f"req_to_token[req_pool_indices][:, :{end}]",
                "zero_start": f"req_to_token[req_pool_indices, 0:{end}]",
                "strided": f"req_to_token[req_pool_indices, :{end}]"}[kind]
    return {"slice": f"req_to_token[req_pool_indices, :{end}:{ps}] // {ps}",
            "chained": f"req_to_token[req_pool_indices][:, :{end}:{ps}] // {ps}",
            "zero_start": f"req_to_token[req_pool_indices, 0:{end}:{ps}] // {ps}",
            "strided": f"req_to_token[req_pool_indices][:, torch.arange(0, {end}, {ps})] // {ps}"}[kind]


def _consume(consumer: str, table: str, lengths: str, ps: int, upper: str) -> str:
    if consumer == "pd":
        return f"PD(q, k_cache, v_cache, {table}, {lengths}, max_seqlen_k={upper})"
    return f"SUM({table}, {lengths}, {ps}, {upper})"


def _params(consumer: str, *first) -> tuple:
    base = (*first, "req_to_token", "req_pool_indices")
    return base + (("q", "k_cache", "v_cache") if consumer == "pd" else ())


# The max of the lengths in its spellings: (expression, its value for lengths of max x, parameter, options, note).
MAX_FORMS = (
    ("seq_lens.max().item()", "x", "seq_lens", {}, ""),
    ("int(seq_lens.max())", "x", "seq_lens", {}, "int() of the max"),
    ("seq_lens.amax().item()", "x", "seq_lens", {}, "amax"),
    ("torch.max(seq_lens).item()", "x", "seq_lens", {}, "torch.max"),
    ("seq_lens_cpu.max().item()", "x", "seq_lens_cpu", {}, "the max of the CPU mirror, lengths from its twin"),
    ("(seq_lens + 2).max().item()", "x + 2", "seq_lens", {}, "a max of a sum: no range may be given"),
    ("lens.max().item()", "x", "lens", {}, "a max of an input that is not a declared lengths name: no range"),
    ("verify_lens.max().item()", "x", "verify_lens", {"length_bounds": "quarter"}, "a length_bounds name"),
)


def _max_form(r: random.Random, bound: int):
    expr, of_x, name, options, note = r.choices(MAX_FORMS, weights=[14, 2, 2, 2, 2, 2, 2, 2])[0]
    options = dict(options)
    top = -1
    if options.get("length_bounds") == "quarter":
        top = max(4, bound // 4)
        options["length_bounds"] = {"verify_lens": top}
    return expr, of_x, name, options, note, top


def branch_program(n: int, r: random.Random, bound: int, ps: int, form: str, checked: bool,
                   realistic: bool = False) -> Program:
    consumer = "pd" if form == "allocated" or (bound <= 4096 and r.random() < 0.15) else "sum"
    if realistic:
        expr, of_x, name, options, max_note, top = MAX_FORMS[0][0], "x", "seq_lens", {}, "", -1
    else:
        expr, of_x, name, options, max_note, top = _max_form(r, bound)
    lens_name = "seq_lens" if name in ("seq_lens", "seq_lens_cpu") else name
    first = ("seq_lens", "seq_lens_cpu") if name == "seq_lens_cpu" else (lens_name,)
    hi = top if top >= 0 else bound
    gen = BranchGen(r, hi + (2 if of_x == "x + 2" else 0), ps)
    lengths = lens_name if r.random() < 0.8 else r.choice([f"{lens_name}.int()", f"{lens_name}.long()",
                                                           f"{lens_name}.to(torch.int32)"])
    if consumer == "pd" and lengths == lens_name:
        lengths = r.choice([lens_name, f"{lens_name}.int()"])
    form_note = ""
    extra = 0
    code: list = []
    tail: list[str] = []
    result = "m"
    if form == "width":  # every outcome covers every row: the value must not depend on it
        steps = [0, 1, 2, 3, ps, 2 * ps, 5]
        code.append(E(f"w = m + {r.choice([0, 0, 1])}"))
        code += gen.shape(lambda: r.choice([f"w = m + {r.choice(steps)}", f"w += {r.choice(steps)}",
                                            f"w = max(w, m + {r.choice(steps)})"]))
        upper = r.choice(["w", "w", "m"])  # m is an upper bound of the lengths too: w >= m
        tail = [f"t = {_table(r, 'w', ps)}", f"return {_consume(consumer, 't', lengths, ps, upper)}"]
        result, extra = "w", 40 * max(ps, 1)
        form_note = "a width branch: every outcome covers every row (the value does not depend on it)"
    elif form == "value":  # the outcome changes the result: it must be the outcome eager takes
        code.append(E("f = 1"))
        code += gen.shape(lambda: r.choice([f"f = {r.randint(2, 9)}", f"f += {r.randint(1, 5)}", "f = -f"]))
        op = r.choice(["*", "+", "-"])
        tail = [f"t = {_table(r, 'm', ps)}", f"return {_consume(consumer, 't', lengths, ps, 'm')} {op} f"]
        result = "f"
        form_note = "a value branch: the outcome changes the result"
    elif form == "mixed":
        steps = [0, 1, 2, ps]
        code += [E("w = m"), E("f = 1")]
        code += gen.shape(lambda: r.choice([f"w = m + {r.choice(steps)}", f"f = {r.randint(2, 6)}",
                                            f"w += {r.choice(steps)}", f"f += {r.randint(1, 3)}"]))
        tail = [f"t = {_table(r, 'w', ps)}", f"return {_consume(consumer, 't', lengths, ps, 'w')} * f"]
        result, extra = "(w, f)", 40 * max(ps, 1)
        form_note = "outcomes that change the width and the value"
    elif form == "exit":
        pred = gen.pred(simple=r.random() < 0.5) if r.random() < 0.6 else E(("p", gen._id(), E(
            r.choice(["m == 0", "not m", "m < 1", "m <= 0"]))))
        alt = r.choice(["zeros", "wider", "minus"])
        code.append(E("if ", pred, ":"))
        code.append(E("    exit_ = 1"))
        alt_value = {"zeros": f"torch.zeros({lens_name}.shape[0])",
                     "wider": _consume("sum", _table(r, f"m + {ps}", ps, "slice"), lengths, ps, f"m + {ps}"),
                     "minus": f"torch.full(({lens_name}.shape[0],), -1.0)"}[alt]
        if consumer == "pd" and alt != "wider":
            alt_value = "torch.zeros_like(q)" if alt == "zeros" else "torch.full_like(q, -1.0)"
        elif consumer == "pd":
            alt_value = _consume("pd", _table(r, f"m + {ps}", ps, "slice"), lengths, ps, f"m + {ps}")
        code = [E("exit_ = 0"), *code]
        tail = ["if exit_:", f"    return {alt_value}", f"t = {_table(r, 'm', ps)}",
                f"return {_consume(consumer, 't', lengths, ps, 'm')}"]
        result, extra = "exit_", 2 * ps
        form_note = f"an early return ({alt}) on a predicate of the max"
    elif form == "clamp":
        cap = r.choice([bound + 50 * ps, bound, max(1, bound - r.randint(1, max(1, bound // 3))),
                        r.randint(1, bound)])
        c = r.choice([0, 1, ps, 3])
        if r.random() < 0.5:
            code.append(E(f"w = min(m + {c}, {cap})"))
        else:
            code += [E(f"w = m + {c}"), E("if ", E(("p", gen._id(), E(f"w > {cap}"))), ":"), E(f"    w = {cap}")]
        upper = r.choice(["w", "m"])
        tail = [f"t = {_table(r, 'w', ps)}", f"return {_consume(consumer, 't', lengths, ps, upper)}"]
        result, extra = "w", 50 * max(ps, 1)
        form_note = f"a clamp of the width at {cap} (inside the range: the table may be narrower than the max)"
    elif form == "guard":  # the user's own check of the max against a limit (the bound, or inside the range)
        limit = r.choice([hi, hi, hi - r.randint(1, max(1, hi // 4)), hi + r.randint(1, 8)])
        pid = gen._id()
        check = r.choice(["raise", "assert", "check", "clamp", "always", "never"])
        bs = f"{lens_name}.shape[0]"
        if check == "raise":
            code += [E("if ", E(("p", pid, E(f"m > {limit}"))), ":"),
                     E(f"    raise ValueError(f'max length {{m}} is past {limit}')")]
        elif check == "assert":
            code += [E("assert ", E(("p", pid, E(f"m <= {limit}"))), f", 'max length past {limit}'")]
        elif check == "check":
            code += [E("torch._check(", E(("p", pid, E(f"m <= {limit}"))), ")")]
        elif check == "clamp":
            code += [E("if ", E(("p", pid, E(f"m > {limit}"))), ":"), E(f"    m = {limit}")]
        else:  # an early return whose predicate the range decides (or, with a limit inside it, does not)
            op = "<=" if check == "always" else ">"
            code += [E("if ", E(("p", pid, E(f"m {op} {limit}"))), ":"), E("    exit_ = 1")]
            code = [E("exit_ = 0"), *code]
            tail = ["if exit_:", f"    return {'torch.zeros_like(q)' if consumer == 'pd' else f'torch.zeros({bs})'}"]
        static = r.random() < 0.4
        end = str(hi) if static else "m"
        upper = str(max(hi, limit)) if static else "m"
        if check == "clamp" and not static:
            upper = "m"
        tail += [f"t = {_table(r, end, ps, r.choice(['slice', 'chained']))}",
                 f"return {_consume(consumer, 't', lengths, ps, upper)}"]
        result = "m"
        form_note = (f"the user's own check of the max against {limit} ({check}; the table "
                        f"{'static' if static else 'sized by the max'})")
    elif form == "pagesize":
        p2 = r.choice([2, 4, 8]) if ps == 1 else 2 * ps
        code += [E(f"p = {ps}")]
        code += gen.shape(lambda: f"p = {r.choice([ps, p2])}")
        tail = ["t = req_to_token[req_pool_indices, :m:p] // p",
                f"return {_consume('sum', 't', lengths, 'p', 'm')}"]
        consumer = "sum"
        result = "p"
        form_note = "the page size chosen by a branch (the value depends on it)"
    elif form in ("roundup", "allocated"):
        L = 64 if realistic else r.choice([2, 3, 4, 4, 8])
        spell = r.choice(["(m + {a}) // {ps}", "-(-m // {ps})", "(m + {a}) // {ps}"])
        code.append(E("blocks = " + spell.format(a=ps - 1, ps=ps)))
        variant = r.choice(["sglang", "sglang", "ceil", "while", "rem", "plain"] +
                           (["outer"] if not realistic else []))
        if variant == "while" and L > 8:
            variant = "sglang"
        mod = gen.mod("blocks", L)
        pid = gen._id()
        if variant == "sglang":  # trtllm_mla_backend.py's _calc_padded_blocks
            code += [E("if ", E(("p", pid, E(mod, " != 0"))), ":"), E(f"    blocks += {L} - blocks % {L}")]
        elif variant == "ceil":
            code += [E("if ", E(("p", pid, E(mod, " != 0"))), ":"), E(f"    blocks = (blocks + {L - 1}) // {L} * {L}")]
        elif variant == "while":
            code += [E("while ", E(("p", pid, E(mod, " != 0"))), ":"), E("    blocks += 1")]
        elif variant == "rem":
            code += [E("rem = ", mod), E("if ", E(("p", pid, E("rem > 0"))), ":"), E(f"    blocks += {L} - rem")]
        elif variant == "plain":  # no branch: the control
            code += [E(f"blocks = (blocks + {L - 1}) // {L} * {L}")]
        else:  # a round-up only past a threshold (a predicate on the max, then one on the page count)
            code += [E("if ", gen.pred(simple=True), ":"),
                     E("    if ", E(("p", pid, E(mod, " != 0"))), ":"), E(f"        blocks += {L} - blocks % {L}")]
        upper = r.choice(["m", "m", f"blocks * {ps}"])
        if consumer == "pd" and lengths == lens_name:
            lengths = f"{lens_name}.to(torch.int32)"
        bs = f"{lens_name}.shape[0]"
        if form == "allocated":
            tail = [f"table = torch.full(({bs}, blocks), -1, dtype=torch.int32)",
                    f"FILL(req_to_token, req_pool_indices, {lens_name}, table, blocks, {ps})",
                    f"return {_consume(consumer, 'table', lengths, ps, upper)}"]
        else:
            end = f"blocks * {ps}"
            tail = [f"t = {_table(r, end, ps, r.choice(['slice', 'chained']))}",
                    f"return {_consume(consumer, 't', lengths, ps, upper)}"]
        result, extra = "blocks", L * ps + ps
        form_note = f"a page count rounded up to a multiple of {L} ({variant})"
    else:
        raise ValueError(form)
    param_first = first
    source = (f"def step({', '.join(_params(consumer, *param_first))}):\n    m = {expr}\n"
              + _lines(code, False) + "".join(f"    {line}\n" for line in tail))
    probe = _probe_source(of_x, code, result)
    options = {"checked": checked, **options}
    return Program(
        name=f"branch-{form}-{n:04d}", family="branch", category=f"branch/{form}" + ("@realistic" if realistic else ""),
        source=source, params=_params(consumer, *param_first), bound=bound, ps=ps, options=options,
        batch=r.choice([1, 2, 3, 3, 4]) if not realistic else 3,
        lens_dtype=r.choice(["int64", "int64", "int32"]), seed=n, probe=probe, extra_tokens=extra,
        valid_top=top, consumer=consumer,
        note="; ".join(n for n in (form_note, max_note) if n))


# -- the grow family: FlashMLA's grow-on-demand scratch ---------------------------------------------------------
def grow_program(n: int, r: random.Random) -> Program:
    bound = r.choice([32, 48, 64, 100, 128])
    ps = r.choice([1, 2, 4, 8])
    full = -(-bound // ps)
    start = r.choice([full, full, full + 3, max(1, full // 2), 1])
    grow = r.choice(["exact", "double", "bound"])
    new = {"exact": "n", "double": "max(n, 2 * scratch.buf.shape[1])", "bound": f"max(n, {full})"}[grow]
    cmp = r.choice(["scratch.buf.shape[1] < n", "n > scratch.buf.shape[1]", "not scratch.buf.shape[1] >= n"])
    rows = r.choice([":bs", "0:bs"])
    source = (f"def step(scratch, seq_lens, req_to_token, req_pool_indices):\n"
              f"    m = seq_lens.max().item()\n"
              f"    n = (m + {ps - 1}) // {ps}\n"
              f"    bs = seq_lens.shape[0]\n"
              f"    if {cmp}:\n"
              f"        scratch.buf = torch.full((scratch.buf.shape[0], {new}), -1, dtype=torch.int32)\n"
              f"    table = scratch.buf[{rows}, :n]\n"
              f"    FILL(req_to_token, req_pool_indices, seq_lens, table, table.stride(0), {ps})\n"
              f"    return SUM(table, seq_lens, {ps}, m)\n")
    return Program(name=f"grow-{grow}-{n:04d}", family="grow", category=f"grow/{'full' if start >= full else 'narrow'}",
                   source=source, params=("seq_lens", "req_to_token", "req_pool_indices"), bound=bound, ps=ps,
                   options={"checked": r.random() < 0.7}, batch=r.choice([2, 3, 4]), seed=n, probe="",
                   scratch=start, note=f"a scratch {start} pages wide (the bound needs {full}), grown '{grow}'")


# -- the struct family ----------------------------------------------------------------------------------------------
STRUCT_FEATURES = ("plain", "getattribute", "getattribute_base", "getattr", "property", "method", "descriptor",
                   "classvar", "defaults", "factory", "post_init", "len_bool", "metaclass", "setattr_field",
                   "config", "is_none", "tensor_fields", "staticmethod", "forward_ref")


def struct_program(n: int, r: random.Random, feature: str, given: bool) -> Program:
    bound = r.choice([16, 32, 48, 64, 96])
    ps = r.choice([1, 1, 2, 4])
    checked = r.random() < 0.75
    cls = f"Geo{n}"
    config = ""
    if feature == "config":
        config = ", " + r.choice(["frozen=True", "kw_only=True", "array_like=True", "tag=True", "omit_defaults=True",
                                  "order=True", "eq=False", "gc=False", "weakref=True", "dict=True",
                                  "frozen=True, kw_only=True, tag=True, array_like=True"])
    base = "msgspec.Struct"
    setup = []
    transform = r.choice(["value + 1", "value * 3", "-value", "value if value else 5"])
    target = r.choice(["scale", "scale", "extra", "width"])
    if feature == "getattribute_base":
        setup += [f"class Base{n}(msgspec.Struct):",
                  "    def __getattribute__(self, name):",
                  "        value = super().__getattribute__(name)",
                  f"        return {transform} if name == {target!r} else value", ""]
        base = f"Base{n}"
    if feature == "metaclass":
        setup += [f"class Meta{n}(type(msgspec.Struct)):",
                  "    def __call__(cls, *args, **kwargs):",
                  "        obj = super().__call__(*args, **kwargs)",
                  "        obj.scale = obj.scale + 4",
                  "        return obj", ""]
        base = f"msgspec.Struct, metaclass=Meta{n}"
    lines = [f"class {cls}({base}{config}):",
             "    width: int",
             "    scale: int = 2",
             "    extra: int = 1"]
    if feature == "tensor_fields":
        lines[1:1] = ["    lens: torch.Tensor"]
    if feature == "forward_ref":  # an annotation only a type checker resolves (`if TYPE_CHECKING:` imports)
        setup = ["if typing.TYPE_CHECKING:", "    from engine.types import Scale", "", *setup]
        lines[2] = "    scale: 'Scale' = 2"
    if feature in ("defaults", "is_none"):
        lines += ["    opt: typing.Optional[int] = None", "    neg: float = -0.0", "    pair: tuple = (1, 2)"]
    if feature == "factory":
        lines += ["    seen: list = msgspec.field(default_factory=list)"]
    if feature == "classvar":
        lines += ["    K: ClassVar[int] = 3"]
    if feature == "getattribute":
        how = r.choice(["object.__getattribute__(self, name)", "super().__getattribute__(name)",
                        "msgspec.Struct.__getattribute__(self, name)"])
        lines += ["", "    def __getattribute__(self, name):", f"        value = {how}",
                  f"        return {transform} if name == {target!r} else value"]
    if feature == "getattr":
        lines += ["", "    def __getattr__(self, name):", "        if name == 'double':",
                  "            return self.scale * 2", "        raise AttributeError(name)"]
    if feature == "property":
        lines += ["", "    @property", "    def pages(self):", f"        return (self.width + {ps - 1}) // {ps}",
                  "", "    @property", "    def boost(self):", "        return self.scale + self.extra"]
    if feature == "method":
        lines += ["", "    def bonus(self, k):", "        return self.scale * k + self.extra"]
    if feature == "staticmethod":
        lines += ["", "    @staticmethod", "    def pad(k):", "        return k + 3",
                  "", "    @classmethod", "    def unit(cls):", "        return len(cls.__struct_fields__)"]
    if feature == "post_init":
        lines += ["", "    def __post_init__(self):", "        self.scale = self.scale + 5"]
    if feature == "len_bool":
        which = r.choice(["__len__", "__bool__"])
        body = "return 0" if which == "__len__" else "return self.extra > 5"
        lines += ["", f"    def {which}(self):", f"        {body}"]
    if feature == "descriptor":
        setup += [f"class Twice{n}:",
                  "    def __get__(self, obj, owner=None):",
                  "        return 0 if obj is None else obj.scale * 2", ""]
        lines += [f"    stride = Twice{n}()"]
    setup += lines
    # construction
    m_width = r.choice(["m", "m + 1", f"m + {ps}", "m"])
    scale = r.randint(2, 5)
    if given:
        lens_arg = ", lens=torch.tensor([1])" if feature == "tensor_fields" else ""
        ctor = f"{cls}(width={r.randint(0, 3)}, scale={scale}{lens_arg})"
        use_width = "m + geo.width"
        body = ["g = geo"]
    else:
        args = [f"width={m_width}"]
        if feature == "tensor_fields":
            args.insert(0, "lens=seq_lens")
        if r.random() < 0.6:
            args.append(f"scale={scale}")
        if feature == "config" and "kw_only" not in config and r.random() < 0.5:
            args = [a.split("=", 1)[1] for a in args if not a.startswith("lens=")]
        body = [f"g = {cls}({', '.join(args)})"]
        use_width = "g.width"
        ctor = ""
    lengths = "seq_lens"
    value = "g.scale"
    if feature == "getattr":
        value = "g.double"
    elif feature == "property":
        use_width = r.choice([use_width, f"g.pages * {ps}"])
        value = "g.boost"
    elif feature == "method":
        value = f"g.bonus({r.randint(1, 4)})"
    elif feature == "staticmethod":
        value = "g.pad(g.scale) + g.unit()"
    elif feature == "classvar":
        value = "g.scale * g.K"
    elif feature == "descriptor":
        value = "g.stride"
    elif feature == "defaults":
        value = r.choice(["g.scale + g.pair[0]", "g.extra * (2 if g.opt is None else 3)",
                          "g.scale + (1 if math.copysign(1.0, g.neg) < 0 else 7)"])
    elif feature == "is_none":
        body.append("bonus = 0 if g.opt is None else 10")
        value = "g.scale + bonus"
    elif feature == "factory":
        value = "g.scale + len(g.seen)"
    elif feature == "len_bool":
        body.append("on = 3 if g else 5")
        value = "g.scale * on"
    elif feature == "setattr_field":
        body.append("g.scale = g.scale + 2")
    elif feature == "tensor_fields":
        lengths = "g.lens"
    if feature == "is_none" and r.random() < 0.5 and not given:
        body[0] = body[0][:-1] + ", opt=None)" if body[0].endswith(")") else body[0]
    table = _table(r, use_width, ps, r.choice(["slice", "chained"]))
    upper = "m" if use_width == "g.width" and m_width == "m" and r.random() < 0.3 else use_width
    branch = ""
    probe = ""
    if r.random() < 0.3 and not given:
        k = r.choice([2, 3, 4])
        branch = f"    if g.width % {k} == 0:\n        bonus2 = 1\n    else:\n        bonus2 = 2\n"
        value = f"{value} + bonus2"
        off = {"m": 0, "m + 1": 1}.get(m_width, ps)
        probe = f"def probe(x):\n    m = x\n    return _v(1, {k}, (m + {off}) % {k})\n"
    signature = "seq_lens, req_to_token, req_pool_indices" + (", geo" if given else "")
    source = ("\n".join(setup) + "\n\n\n" + f"def step({signature}):\n"
              + "    m = seq_lens.max().item()\n" + "".join(f"    {b}\n" for b in body) + branch
              + f"    t = {table}\n" + f"    return {_consume('sum', 't', lengths, ps, upper)} * ({value})\n")
    params = ("seq_lens", "req_to_token", "req_pool_indices") + (("geo",) if given else ())
    return Program(name=f"struct-{feature}-{n:04d}", family="struct",
                   category=f"struct/{feature}" + ("/given" if given else ""), source=source, params=params,
                   bound=bound, ps=ps, options={"checked": checked}, batch=r.choice([1, 2, 3]), seed=n,
                   probe=probe, extra_tokens=4 * ps + 8, given_struct=ctor,
                   note=f"a msgspec.Struct with {feature}" + (config and f" ({config[2:]})") +
                        (" passed in as an argument" if given else " built in the step"))


# -- the launcher family --------------------------------------------------------------------------------------------
# Parameters the op does not take: (default, values equal to it (==) of another type or sign, values not equal)
DEFAULTS = (
    ("0.0", ["-0.0", "0", "False"], ["1.0", "None"]),
    ("-0.0", ["0.0", "0"], ["1.5"]),
    ("1", ["True", "1.0"], ["2", "None"]),
    ("True", ["1", "1.0"], ["False"]),
    ("1.0", ["1", "True"], ["2.5"]),
    ("None", [], ["0", "False", "''"]),
    ("0", ["False", "0.0", "-0.0"], ["7"]),
    ("False", ["0", "0.0"], ["True", "None"]),
    ("(1, 2)", ["(1.0, 2)", "(True, 2)"], ["(1, 3)", "[1, 2]"]),
    ("(0.0,)", ["(-0.0,)", "(0,)", "(False,)"], ["(1.0,)"]),
    ("'abc'", [], ["'abd'", "None"]),
    ("2 ** 40", ["2.0 ** 40"], ["2 ** 41"]),
    ("math.inf", ["float('inf')"], ["-math.inf"]),
    ("()", [], ["[]", "(1,)"]),
)
NANS = ("math.nan", "float('nan')")
# Parameters the op takes: (schema type, launcher default or None, values of the schema's Python type, values of
# another Python type that the schema still accepts)
SCHEMA_KINDS = (
    ("float", "2.0", ["2.0", "0.5", "-0.0"], ["2", "True"]),
    ("int", "3", ["3", "5"], ["True"]),
    ("SymInt", "4", ["4", "m", "m + 1"], ["True"]),
    ("bool", "False", ["False", "True"], []),
    ("Tensor?", "None", ["None", "x"], []),
    ("float?", "None", ["None", "1.5", "-0.0"], ["1"]),
    ("int[]", None, ["[1, 2]"], ["(1, 2)"]),
    ("str", "'ab'", ["'ab'", "'cd'"], []),
    ("Scalar", "1", ["1", "1.0", "True"], []),
)
LAUNCHER_KINDS = ("default", "equal-not-identical", "equal-not-identical", "nan", "other", "coerced")


def launcher_program(n: int, r: random.Random, kind: str) -> Program:
    """A launcher whose result encodes the type and value of every argument it receives (`sig`), registered with
    an op that takes some of its parameters; the step calls it once. `kind` says what is off the op's path:
    nothing (default: parameters the op does not take are left out or passed their default literal), one passed
    a value equal to its default but of another type or sign, NaN for a NaN default, one passed another value, or
    one op parameter passed a value of another Python type than its schema's (which the dispatcher converts)."""
    bound = r.choice([16, 32, 48, 64])
    ps = r.choice([1, 1, 2, 4])
    name = f"syncfree_tgen::launch_{n:04d}"
    schema = ["Tensor x", "Tensor(a!) out"]
    required, defaulted, keywords, notes = [], [], {}, []
    kinds = r.sample(SCHEMA_KINDS, r.randint(0, 3))
    if kind == "coerced":
        kinds = [k for k in kinds if k[3]] or [r.choice([k for k in SCHEMA_KINDS if k[3]])]
    coerce = r.randrange(len(kinds)) if kind == "coerced" else -1
    for i, (stype, default, values, foreign) in enumerate(kinds):
        pname = f"t{i}" if stype == "Tensor?" else f"a{i}"
        schema.append(f"{stype} {pname}")
        if default is not None and r.random() < 0.5:
            defaulted.append(f"{pname}={default}")
            if i != coerce and r.random() < 0.3:
                notes.append(f"{pname} ({stype}) not passed (default {default})")
                continue
        else:
            required.append(pname)
        value = r.choice(foreign if i == coerce else values)
        keywords[pname] = value
        notes.append(f"{pname} ({stype}) = {value}" + (" (another Python type than the schema's)" if i == coerce
                                                         else ""))
    extras = r.sample(DEFAULTS, r.randint(1, 3))
    if kind == "nan":
        extras[0] = (r.choice(NANS), [], [])
    elif kind == "equal-not-identical":
        if not extras[0][1]:
            extras[0] = r.choice([d for d in DEFAULTS if d[1]])
    for j, (default, equal, other) in enumerate(extras):
        pname = f"e{j}"
        defaulted.append(f"{pname}={default}")
        if j == 0 and kind in ("equal-not-identical", "nan", "other"):
            value = {"equal-not-identical": lambda: r.choice(equal), "nan": lambda: r.choice(NANS),
                     "other": lambda: r.choice(other)}[kind]()
        elif r.random() < 0.5:
            notes.append(f"{pname} not passed (default {default})")
            continue
        else:
            value = default  # the default's own literal
        keywords[pname] = value
        notes.append(f"{pname}={value} (default {default})")
    positional = ["s", "out"]
    for pname in required:  # required parameters of the op: positional while they can be
        if r.random() < 0.5 and len(positional) == 2 + required.index(pname):
            positional.append(keywords.pop(pname))
    arguments = positional + [f"{k}={v}" for k, v in keywords.items()]
    params = ["x", "out", *required, *defaulted]
    used = " + ".join(f"{k + 2} * sig({p.split('=')[0]})" for k, p in enumerate(params[2:])) or "0.0"
    holder = r.random() < 0.3
    launch_ref = f"KERNELS{n}.launch" if holder else f"launch{n}"
    schema_text = "(" + ", ".join(schema) + ") -> ()"
    setup = [f"def _launch{n}({', '.join(params)}):", f"    out.copy_(x + ({used}))", ""]
    if holder:
        setup += [f"class Kernels{n}:", "    def __init__(self):",
                  f"        self.launch = torch.compiler.disable(_launch{n})", "", "",
                  f"KERNELS{n} = Kernels{n}()"]
    else:
        setup += [f"launch{n} = torch.compiler.disable(_launch{n})"]
    setup += [f"register_launcher({launch_ref}, {name!r}, {schema_text!r})"]
    source = ("\n".join(setup) + "\n\n\n"
              + "def step(seq_lens, req_to_token, req_pool_indices):\n"
              + "    m = seq_lens.max().item()\n"
              + f"    t = {_table(r, 'm', ps, 'slice')}\n"
              + f"    s = SUM(t, seq_lens, {ps}, m)\n"
              + "    out = torch.empty_like(s)\n"
              + f"    {launch_ref}({', '.join(arguments)})\n"
              + "    return out\n")
    return Program(name=f"launcher-{n:04d}", family="launcher", category=f"launcher/{kind}", source=source,
                   params=("seq_lens", "req_to_token", "req_pool_indices"), bound=bound, ps=ps,
                   options={"checked": r.random() < 0.75}, batch=r.choice([1, 2, 3]), seed=n, extra_tokens=8,
                   note="a registered launcher called with " + "; ".join(notes))


# -- the copy family ------------------------------------------------------------------------------------------------
# (kind, destination / read-back expression for `bs` rows; `{o}` an offset; 1-D buf of 8 or 2-D [2, 8])
COPY_VIEWS_1D = (
    ("slice", "buf[:{bs}]"), ("slice0", "buf[0:{bs}]"), ("slice step 1", "buf[:{bs}:1]"),
    ("offset slice", "buf[{o}:{o}+{bs}]"), ("narrow", "buf.narrow(0, {o}, {bs})"),
    ("slice view", "buf[:{bs}].view(-1)"),
    ("view slice", "buf.view(-1)[:{bs}]"), ("ellipsis", "buf[..., :{bs}]"), ("none index", "buf[None, :{bs}][0]"),
    ("to same dtype", "buf[:{bs}].to(buf.dtype)"), ("contiguous of contiguous", "buf[:{bs}].contiguous()"),
)
COPY_TEMPS_1D = (
    ("list index", "buf[[{rows}]]"), ("arange index", "buf[torch.arange({o}, {o}+{bs})]"),
    ("tensor index", "buf[torch.tensor([{rows}])]"),
    ("mask", "buf[(torch.arange(8) >= {o}) & (torch.arange(8) < {o}+{bs})]"),
    ("tuple list index", "buf[([{rows}],)]"), ("input index", "buf[idx + {o}]"),
    ("index_select", "buf.index_select(0, torch.arange({o}, {o}+{bs}))"), ("clone", "buf[:{bs}].clone()"),
    ("strided contiguous", "buf[{o}:{o}+2*{bs}:2].contiguous()"), ("to other dtype", "buf[:{bs}].to(torch.float64)"),
    ("slice then list", "buf[:{bs}][[{rows0}]]"),
)
COPY_VIEWS_2D = (
    ("2d row slice", "buf[1, :{bs}]"), ("2d row then slice", "buf[1][:{bs}]"), ("2d select", "buf.select(0, 1)[:{bs}]"),
    ("2d slice row", "buf[:, :{bs}][1]"), ("2d column", "buf[:{bs}, 0]" ),
)
COPY_TEMPS_2D = (
    ("2d row list", "buf[1, [{rows0}]]"), ("2d list row", "buf[[1]][0, :{bs}]"),
    ("2d row tensor", "buf[1, torch.arange({bs})]"),
)


def copy_program(n: int, r: random.Random) -> Program:
    two_d = r.random() < 0.25
    views, temps = (COPY_VIEWS_2D, COPY_TEMPS_2D) if two_d else (COPY_VIEWS_1D, COPY_TEMPS_1D)
    kind, dst = r.choice(views if r.random() < 0.45 else temps)
    batch = r.choice([2, 3, 4])
    o = r.choice([0, 0, 1, 2]) if "{o}" in dst else 0
    fmt = dict(bs=batch, o=o, rows=", ".join(str(o + i) for i in range(batch)),
               rows0=", ".join(str(i) for i in range(batch)))
    dst_e = dst.format(**fmt)
    read = r.choices(["same", "plain view"], weights=[4, 1])[0]
    if two_d:
        plain = "buf[1, :{bs}]".format(**fmt) if "0]" not in dst_e[-3:] else dst_e
        if kind == "2d column":
            plain = dst_e
    else:
        plain = f"buf[{o}:{o + batch}]"
    read_e = dst_e if read == "same" else plain
    if kind == "to other dtype":
        read_e = plain if read_e == dst_e else read_e
    consumer = "pd" if r.random() < 0.3 else "sum"
    buf_dtype = r.choice(["int64", "int32", "int32"] + (["int16"] if consumer == "sum" else []))
    lens_dtype = r.choice(["int64", "int64", "int32"])
    src = r.choice(["seq_lens", "seq_lens", "seq_lens.int()", "seq_lens.long()"])
    position = r.choice(["after gather", "after gather", "between max and gather", "before max"])
    bound = r.choice([16, 32, 48, 64]) if consumer == "pd" else r.choice([16, 32, 48, 64, 100])
    ps = r.choice([1, 1, 2, 4])
    stale = r.choice(["high", "high", "random", "zeros"])
    copy_line = f"{dst_e}.copy_({src})"
    body = ["m = seq_lens.max().item()", f"t = {_table(r, 'm', ps, 'slice')}"]
    at = {"before max": 0, "between max and gather": 1, "after gather": 2}[position]
    body.insert(at, copy_line)
    body.append(f"return {_consume(consumer, 't', read_e, ps, 'm')}")
    params = ("seq_lens", "req_to_token", "req_pool_indices") + (("q", "k_cache", "v_cache") if consumer == "pd"
                                                                 else ()) + ("buf", "idx")
    source = f"def step({', '.join(params)}):\n" + "".join(f"    {b}\n" for b in body)
    view = (kind, dst) in views
    bits = {"int64": 64, "int32": 32, "int16": 16}
    narrowest = min(bits[buf_dtype], bits[lens_dtype], 32 if src == "seq_lens.int()" else 64)
    narrowing = narrowest < bits[lens_dtype]  # a cast or the copy drops bits of the lengths
    category = "copy/" + ("view" if view else "temporary") + ("+narrowing" if narrowing else "")
    if read_e != dst_e:
        category += "+read-other"
    return Program(name=f"copy-{n:04d}", family="copy", category=category, source=source, params=params,
                   bound=bound, ps=ps, options={"checked": r.random() < 0.7}, batch=batch, lens_dtype=lens_dtype,
                   seed=n, buf=((2, 8) if two_d else (8,), buf_dtype, stale), consumer=consumer,
                   note=f"lengths copied into {dst_e} ({kind}: {'a view' if view else 'a temporary'}; "
                        f"{src} {lens_dtype} into {buf_dtype}), read back as {read_e}, the copy {position}")


# -- the corpus -------------------------------------------------------------------------------------------------------

# -- the hidden family: outcomes that differ outside what the graph's text shows ---------------------------------
HIDDEN_KINDS = ("parameter", "rng", "closure", "struct_class", "overflow", "inplace", "recursion", "float_bits")
# Floats that print alike and differ in bits (a helper's programs, 2026-12-05): -nan (what `inf - inf` gives on
# x86) and a NaN of another payload print as nan. Returned as Python floats: stock Dynamo writes a float it puts
# into the FX graph's code as its repr, which loses the sign with any backend (not the backend's to fix).
FLOAT_PAIRS = (("float('nan')", "-float('nan')"), ("float('inf') - float('inf')", "float('nan')"),
               ("struct.unpack('<d', struct.pack('<Q', 0x7FF8000000000001))[0]", "float('nan')"),
               ("0.0", "-0.0"))


def _hidden_predicate(r: random.Random, bound: int, ps: int, kind: str):
    """(source on `m`, probe source on `m` with its predicate and modulus recorded): differs inside [0, bound]."""
    if kind == "inplace":  # near the bound: the write takes the max past it
        t = bound - r.choice([0, 0, 1, 2])
        return f"m > {t}", f"_p(0, m > {t})"
    # float_bits: the forms the pass rewrites (a compare keeps the max), so that a merge of its outcomes shows
    form = r.choice(["mod", "pages_mod"] if kind == "float_bits" else ["mod", "pages_mod", "compare"])
    if form == "mod":
        q = r.choice([2, 3, 5, 7])
        k = r.randrange(q)
        return f"m % {q} == {k}", f"_p(0, _v(0, {q}, m % {q}) == {k})"
    if form == "pages_mod":
        q = r.choice([2, 3, 4])
        k = r.randrange(q)
        return (f"((m + {ps - 1}) // {ps}) % {q} == {k}",
                f"_p(0, _v(0, {q}, ((m + {ps - 1}) // {ps}) % {q}) == {k})")
    t = r.randint(1, bound - 1)
    return f"m > {t}", f"_p(0, m > {t})"


def hidden_program(n: int, r: random.Random, kind: str) -> Program:
    bound, ps = r.choice(REALISTIC[:5] + ((4096, 32), (8192, 16))) if r.random() < 0.7 else \
        (r.choice(SMALL_BOUNDS), r.choice([1, 2, 4]))
    pred, probe_pred = _hidden_predicate(r, bound, ps, kind)
    checked = r.random() < 0.6
    params = ("seq_lens", "x1", "x2", "req_to_token", "req_pool_indices")
    table = _table(r, "m", ps, r.choice(["slice", "chained"]))
    core = (f"    m = seq_lens.max().item()\n"
            f"    out = SUM({table}, seq_lens, {ps}, m)\n")
    setup, prelude, extra, note = "", "", 0, ""
    if kind == "parameter":
        body = (f"    lifted = x1.sum() + x2.sum()  # both inputs lifted in one order by both outcomes\n{core}"
                f"    w = torch.nn.Parameter(x1 if {pred} else x2, requires_grad=False)\n"
                f"    return out * w.sum(), lifted\n")
        note = "an nn.Parameter of one input or the other: Dynamo builds it before the graph"
    elif kind == "rng":
        seed = r.randrange(100)
        call = r.choice([("uniform(0.0, 1.0)", "uniform(0.0, 2.0)"), ("randint(1, 3)", "randint(4, 9)"),
                         ("random()", "random() + rr.random()"), ("uniform(1.0, 2.0)", "uniform(1.0, 2.0) * 0 + 1.5")])
        body = (f"{core}    rr = random.Random({seed})\n"
                f"    x = rr.{call[0]} if {pred} else rr.{call[1]}\n"
                f"    return out * x\n")
        note = "Python RNG calls with other arguments per outcome (Dynamo replays them before the graph)"
    elif kind == "closure":
        wrap = r.choice(["torch.compiler.allow_in_graph(scale)", "scale"])
        fa, fb = r.choice([(1.0, 2.0), (3.0, -3.0), (0.5, 0.25)])
        setup = (f"def make(factor):\n    def scale(x):\n        return x * factor\n    return {wrap}\n"
                 f"SCALE_A, SCALE_B = make({fa}), make({fb})\n")
        warm = r.choice(["    warm = a(x1.sum()) + b(x1.sum())  # both called by both outcomes\n",
                         "    warm = x1.sum()\n"])
        body = (f"    a, b = SCALE_A, SCALE_B\n{warm}{core}"
                f"    return (a if {pred} else b)(out), warm\n")
        note = "two closures of one factory (one module and qualname), chosen by the outcome"
    elif kind == "struct_class":
        if msgspec is None:
            kind = "overflow"
        else:
            setup = ("def make_meta(kind):\n    class Meta(msgspec.Struct):\n        pages: int\n"
                     "        def kind(self):\n            return kind\n    return Meta\n"
                     "META_A, META_B = make_meta('a'), make_meta('b')\n"
                     "class Holder:\n    meta = None\nHOLDER = Holder()\n"
                     "def observe():\n    seen = None if HOLDER.meta is None else (HOLDER.meta.kind(), HOLDER.meta.pages)\n"
                     "    HOLDER.meta = None\n    return seen\n")
            body = (f"    a, b = META_A, META_B\n    a(pages=0), b(pages=0)  # both built by both outcomes\n{core}"
                    f"    HOLDER.meta = (a if {pred} else b)(pages=3)\n"
                    f"    return out\n")
            note = "two msgspec.Struct classes of one factory (one repr), one stored per outcome"
    if kind == "overflow":  # the table allocated and filled by the bounded writer: rewritten at the bound
        core = (f"    m = seq_lens.max().item()\n"
                f"    blocks = (m + {ps - 1}) // {ps}\n"
                f"    t = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)\n"
                f"    FILL(req_to_token, req_pool_indices, seq_lens, t, t.stride(0), {ps})\n"
                f"    out = PD(q, k_cache, v_cache, t, seq_lens.to(torch.int32), max_seqlen_k=m)\n")
        params = params + ("q", "k_cache", "v_cache")
        # the product is a multiple of 2**64 (four consecutive factors: of 8): 0 in int64 for every m, not in Python
        q = r.choice([3, 5, 7])
        # (sympy reduces some products modulo q itself: those forms are not evaluated by the backend at all)
        form = f"(m * (m + 1) * (m + 2) * (m + 3) * 2**{r.choice([61, 62])}) % {q} {r.choice(['==', '!='])} 0"
        body = (f"{core}    s = 1.0 if m % 2 == 0 else 1.0  # one branch traced at the bound, one graph\n"
                f"    if {form}:\n        s = 2.0\n"
                f"    return out * s\n")
        probe_pred = f"_p(0, _v(0, 2, m % 2) == 0) or True, _p(1, {form})"
        pred = form
        note = "a second branch whose products pass 2**63 (exact in Python, wrapped in int64)"
    elif kind == "inplace":
        write = r.choice(["seq_lens.add_(1)", "seq_lens[:1] += 1", "seq_lens[0] = seq_lens[0] + 1",
                          "seq_lens.copy_(seq_lens * 2)", "torch.add(seq_lens, 1, out=seq_lens)",
                          "seq_lens.view(-1)[-1:].add_(2)", "seq_lens.clamp_(min=3)"])
        extra = bound + 8  # a doubled length's table stays inside the token table
        later = r.choice(["torch.ones(1)", "out * 0 + 1"])
        body = (f"    {write}  # the lengths written before their max\n{core}"
                f"    if {pred}:\n        return out * 0\n"
                f"    return {later} + out * 0 + 1\n")
        note = "the lengths written in place before the max: the range holds for the inputs, not for them"
    elif kind == "float_bits":
        a, b = r.choice(FLOAT_PAIRS)
        if r.random() < 0.5:
            a, b = b, a
        setup = "import struct\n"
        body = f"{core}    x = {a} if {pred} else {b}\n    return out, x\n"
        note = "two floats that print alike (a NaN's sign or payload, a signed zero), returned by the outcome"
    elif kind == "recursion":
        setup = "LOG = []\ndef observe():\n    seen = list(LOG)\n    LOG.clear()\n    return seen\n"
        body = (f"    LOG.append(depth)\n    x1.mul_(2)\n"
                f"    if depth > 0:\n        torch._dynamo.graph_break()\n"
                f"        return step(seq_lens, x1, x2, req_to_token, req_pool_indices, depth - 1)\n"
                f"    m = seq_lens.max().item()\n"
                f"    blocks = (m + {ps - 1}) // {ps}\n"
                f"    if {pred}:\n        blocks = blocks + 1\n"
                f"    out = SUM({table}, seq_lens, {ps}, m)\n"
                f"    return out * x1.sum(), blocks * 0\n")
        note = "the compiled function entered again, recursively, after a graph break (not the call's first frame)"
        source = (f"import random\n{setup}def step(seq_lens, x1, x2, req_to_token, req_pool_indices, depth=1):\n"
                  f"{body}")
        return _hidden(n, kind, source, params, bound, ps, checked, probe_pred, extra, note, r)
    source = f"import random\n{setup}def step({', '.join(params)}):\n{body}"
    return _hidden(n, kind, source, params, bound, ps, checked, probe_pred, extra, note, r)


def _hidden(n, kind, source, params, bound, ps, checked, probe_pred, extra, note, r) -> Program:
    probe = f"def probe(x):\n    m = x\n    return ({probe_pred})\n"
    return Program(name=f"hidden-{kind}-{n:04d}", family="hidden", category=f"hidden/{kind}", source=source,
                   params=params, bound=bound, ps=ps, options={"checked": checked}, batch=r.choice([1, 3, 4]),
                   seed=n, probe=probe, extra_tokens=extra, note=note, consumer="pd" if "q" in params else "sum")


BRANCH_FORMS = (("width", 7), ("value", 4), ("mixed", 2), ("exit", 2), ("clamp", 2), ("pagesize", 1),
                ("roundup", 4), ("allocated", 2), ("guard", 2))
COUNTS = {"branch": 330, "realistic": 40, "grow": 20, "struct": 209, "launcher": 222, "copy": 220, "hidden": 84}
HIDDEN_FLOAT_BITS = 12  # the float_bits kind, after the hidden family's first 84


def branch_programs() -> list[Program]:
    rng = random.Random(45)
    out = []
    forms, weights = zip(*BRANCH_FORMS)
    for n in range(COUNTS["branch"]):
        r = random.Random(rng.getrandbits(32))
        form = forms[n % len(forms)] if n < 2 * len(forms) else r.choices(forms, weights=weights)[0]
        bound, ps = r.choice(SMALL_BOUNDS), r.choice(SMALL_PAGES)
        out.append(branch_program(n, r, bound, ps, form, checked=r.random() < 0.7))
    for k in range(COUNTS["realistic"]):
        n = COUNTS["branch"] + k
        r = random.Random(rng.getrandbits(32))
        bound, ps = REALISTIC[k % len(REALISTIC)]
        form = ("roundup", "allocated", "roundup", "width", "value", "exit")[k % 6]
        out.append(branch_program(n, r, bound, ps, form, checked=k % 5 != 4, realistic=True))
    return out


def grow_programs() -> list[Program]:
    rng = random.Random(4501)
    return [grow_program(2000 + n, random.Random(rng.getrandbits(32))) for n in range(COUNTS["grow"])]


def struct_programs() -> list[Program]:
    rng = random.Random(4502)
    out = []
    for n in range(COUNTS["struct"]):
        r = random.Random(rng.getrandbits(32))
        feature = STRUCT_FEATURES[n % len(STRUCT_FEATURES)]
        given = n % 5 == 4 and feature not in ("metaclass", "post_init", "factory", "setattr_field")
        out.append(struct_program(3000 + n, r, feature, given))
    return out


def launcher_programs() -> list[Program]:
    rng = random.Random(4503)
    return [launcher_program(4000 + n, random.Random(rng.getrandbits(32)), LAUNCHER_KINDS[n % len(LAUNCHER_KINDS)])
            for n in range(COUNTS["launcher"])]


def copy_programs() -> list[Program]:
    rng = random.Random(4504)
    return [copy_program(5000 + n, random.Random(rng.getrandbits(32))) for n in range(COUNTS["copy"])]


def hidden_programs() -> list[Program]:
    rng = random.Random(4505)
    first = HIDDEN_KINDS[:7]  # the first 84 programs' kinds, as they were generated before float_bits came
    programs = [hidden_program(6000 + n, random.Random(rng.getrandbits(32)), first[n % len(first)])
                for n in range(COUNTS["hidden"])]
    return programs + [hidden_program(6000 + COUNTS["hidden"] + n, random.Random(rng.getrandbits(32)),
                                      "float_bits") for n in range(HIDDEN_FLOAT_BITS)]


FAMILIES = {"branch": branch_programs, "grow": grow_programs, "struct": struct_programs,
            "launcher": launcher_programs, "copy": copy_programs, "hidden": hidden_programs}


def generated_programs(*families: str) -> list[Program]:
    out = []
    for family in families or FAMILIES:
        out += FAMILIES[family]()
    return out


# -- the tables -------------------------------------------------------------------------------------------------
def listing(programs: list[Program]) -> str:
    rows = collections.Counter(p.category for p in programs)
    checked = collections.Counter(p.category for p in programs if p.checked)
    lines = [f"{'category':40}{'programs':>10}{'checked':>10}"]
    for cat in sorted(rows):
        lines.append(f"{cat:40}{rows[cat]:>10}{checked[cat]:>10}")
    lines.append(f"{'TOTAL':40}{len(programs):>10}{sum(checked.values()):>10}")
    return "\n".join(lines)


KINDS = ("raises on valid lengths", "wrong value", "side effect differs", "returns where eager raises", "inputs left differ",
         "unchecked invalid lengths", "crashed")


def summarize(results: list[Result]) -> str:
    rows: dict = {}
    for res in results:
        row = rows.setdefault(res.program.category, collections.Counter())
        row["programs"] += 1
        row["vectors"] += res.vectors
        row["rewritten"] += res.rewritten > 0 and res.kept == 0
        row["kept"] += res.kept > 0
        row["failing"] += bool(res.divergences)
        for kind in res.kinds:
            row[kind] += 1
        row["torch limit"] += bool(res.torch_limits)
        row["cpu s"] += res.seconds
    short = {"raises on valid lengths": "raise-valid", "wrong value": "wrong", "returns where eager raises":
             "no-raise", "inputs left differ": "inputs", "unchecked invalid lengths": "invalid", "crashed": "crash",
             "torch limit": "torch-limit"}
    cols = ("programs", "vectors", "rewritten", "kept", "failing", *KINDS, "torch limit", "cpu s")
    head = f"{'category':36}" + "".join(f"{short.get(c, c):>11}" for c in cols)
    lines = [head]
    total = collections.Counter()
    for cat in sorted(rows):
        lines.append(f"{cat:36}" + "".join(_cell(rows[cat][c]) for c in cols))
        total.update(rows[cat])
    lines.append(f"{'TOTAL':36}" + "".join(_cell(total[c]) for c in cols))
    return "\n".join(lines)


def _cell(v) -> str:
    return f"{v:>11.1f}" if isinstance(v, float) else f"{v:>11}"


def reproducers(results: list[Result]) -> str:
    """For every (category, kind) that failed: the shortest failing program's message."""
    best: dict = {}
    for res in results:
        for kind in res.kinds:
            key = (res.program.category, kind)
            if key not in best or len(res.program.source) < len(best[key].program.source):
                best[key] = res
    out = []
    for (cat, kind), res in sorted(best.items()):
        out.append(f"==== {cat} :: {kind} ====\n{res.message(most=2)}\n")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run the programs (default: list them)")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES))
    parser.add_argument("--limit", type=int, default=0, help="the first N programs of each family")
    parser.add_argument("--show", help="print one program's source and vectors (by name)")
    parser.add_argument("-v", action="store_true", help="every failing program's message")
    args = parser.parse_args(argv)
    programs = []
    for family in args.family or FAMILIES:
        found = FAMILIES[family]()
        programs += found[: args.limit] if args.limit else found
    if args.show:
        (p,) = [p for p in programs if p.name == args.show]
        print(p.header(), p.source, p.probe, describe_inputs(p), *vectors(p), sep="\n")
        if args.run:
            print(run_program(p).message(most=100))
        return 0
    if not args.run:
        print(listing(programs))
        return 0
    start = time.time()
    results = []
    for p in programs:
        torch._dynamo.reset()
        results.append(run_program(p))
    print(summarize(results))
    if args.v:
        for res in results:
            if res.divergences:
                print("\n" + res.message())
    print("\n" + reproducers(results))
    print(f"{len(results)} programs in {time.time() - start:.0f} s (CPU {time.process_time():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
