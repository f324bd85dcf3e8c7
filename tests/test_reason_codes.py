"""Every reason code a kept host read can carry (compile_pass.proof.REASONS) is asserted by at least one test.

A code counts as asserted when some module under tests/ other than this one holds it as a string literal in one
of these places (found by parsing, `ast`, never by running the tests):

1. a comparison (`==`, `!=`, `in`, ...) whose other side names a code: `item.reason_code == "written"`,
   `codes(backend) == ["written"]`, `kept_code(step)[0] in ("arithmetic", ...)`,
   `kept_codes(b) == [("page_size", "allocated_table")]`;
2. an argument for a parameter that names a code: `code="written"`, or `check_kept(step, make_fb, "written")`
   where `check_kept`, defined in the same module, takes `code` at that position;
3. a table that a test unpacks into a name that names a code: with `spec, code = KEPT[name]`, the element at
   that position of every entry of the module's `KEPT`; with `@pytest.mark.parametrize("name, code", [...])`,
   the element at the position of `code`; with `@pytest.mark.parametrize("code", sorted(REFUSALS))`, the keys
   of the module's dict `REFUSALS` (or the elements of a list).

A name "names a code" when it (a variable, attribute or called function) contains "code": `reason_code`,
`codes`, `kept_code`, `code`. A code that is only declared (`{"written"} <= set(REASONS)`), only in prose, or
only an option or a report kind of the same spelling (`"page_size"`, `item.kind == "post_grad"`) does not count.
A new code needs a test that makes the pass keep a host read with it (tests/README.md, "reason codes").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from compile_pass.proof import REASONS

TESTS = Path(__file__).resolve().parent


def _names_a_code(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else ""
        if "code" in name and name != "returncode":  # a process's exit status is no reason code
            return True
    return False


def _strings(node: ast.AST) -> list[str]:
    return [s.value for s in ast.walk(node) if isinstance(s, ast.Constant) and isinstance(s.value, str)]


def _element(entry: ast.AST, index: int) -> list[str]:
    if isinstance(entry, (ast.Tuple, ast.List)) and index < len(entry.elts):
        return _strings(entry.elts[index])
    return []


def _rows(argument: ast.AST, tables: dict) -> list[ast.AST]:
    """The rows of a parametrize argument: a literal list, or a module-level table by name (`sorted(T)`,
    `list(T)`, `T`): a dict's keys, a list's elements."""
    if isinstance(argument, ast.Call) and isinstance(argument.func, ast.Name) \
            and argument.func.id in ("sorted", "list") and len(argument.args) == 1:
        argument = argument.args[0]
    if isinstance(argument, ast.Name):
        argument = tables.get(argument.id)
    if isinstance(argument, ast.Dict):
        return [k for k in argument.keys if k is not None]
    return list(argument.elts) if isinstance(argument, (ast.List, ast.Tuple)) else []


def asserted_codes(source: str) -> set[str]:
    """The string literals that `source` asserts as reason codes (the module docstring's three places)."""
    tree = ast.parse(source)
    functions = {n.name: [a.arg for a in n.args.posonlyargs + n.args.args]
                 for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    tables = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):  # 1.
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                if any(_names_a_code(o) for j, o in enumerate(operands) if j != i):
                    found += _strings(operand)
        elif isinstance(node, ast.Call):  # 2.
            found += [s for k in node.keywords if k.arg and "code" in k.arg for s in _strings(k.value)]
            params = functions.get(node.func.id, []) if isinstance(node.func, ast.Name) else []
            found += [s for p, a in zip(params, node.args) if "code" in p for s in _strings(a)]
            if isinstance(node.func, ast.Attribute) and node.func.attr == "parametrize" and len(node.args) >= 2 \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):  # 3.
                names = [n.strip() for n in node.args[0].value.split(",")]
                rows = _rows(node.args[1], tables)
                for i, name in enumerate(names):
                    if "code" in name:
                        found += [s for row in rows for s in (_strings(row) if len(names) == 1 else _element(row, i))]
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript) \
                and isinstance(node.value.value, ast.Name) and node.value.value.id in tables:  # 3.
            table = tables[node.value.value.id]
            entries = table.values if isinstance(table, ast.Dict) else getattr(table, "elts", [])
            for target in node.targets:
                if isinstance(target, ast.Tuple):
                    for i, elt in enumerate(target.elts):
                        if isinstance(elt, ast.Name) and "code" in elt.id:
                            found += [s for entry in entries for s in _element(entry, i)]
    return {s for s in found if s in REASONS}


def _where_asserted() -> dict[str, list[str]]:
    where: dict[str, list[str]] = {code: [] for code in REASONS}
    for path in sorted(TESTS.rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue
        for code in asserted_codes(path.read_text()):
            where[code].append(str(path.relative_to(TESTS)))
    return where


WHERE = _where_asserted()

# Codes no test can make the pass keep today, each with why. Strict: once a test asserts one, its entry here
# fails (XPASS) until it is removed.
UNREACHABLE: dict[str, str] = {}


@pytest.mark.parametrize("code", [pytest.param(c, marks=pytest.mark.xfail(reason=UNREACHABLE[c], strict=True))
                                  if c in UNREACHABLE else c for c in sorted(REASONS)])
def test_every_reason_code_is_asserted_by_a_test(code):
    assert WHERE[code], (f"no test asserts the reason code {code!r} ({REASONS[code]}): add one that makes the "
                         f"pass keep a host read with it (tests/README.md)")


def test_the_unreachable_codes_are_codes():
    assert set(UNREACHABLE) <= set(REASONS)


def test_what_counts_as_asserting_a_code():
    counted = asserted_codes('''
import pytest

KEPT = {"a": (dict(x=1), "written"), "b": (dict(x=2), "escapes")}


def check_kept(step, factory, code, **options):
    assert code in codes(step)


def test_kept(name):
    spec, code = KEPT[name]
    assert [i.reason_code for i in report.kept] == ["arithmetic"]
    assert any(i.reason_code == "compared" for i in kept)
    check_kept(step, make_fb, "subtracted")
    keep(step, code="table_use")


@pytest.mark.parametrize("form, code", [("f", "mismatch"), ("g", "page_count")])
def test_table(form, code):
    pass


REFUSALS = {"no_consumer": (step, [[3]], {}), "element_use": (step, [[3]], {})}


@pytest.mark.parametrize("code", sorted(REFUSALS))
def test_refusals(code):
    step, vectors, options = REFUSALS[code]
''')
    assert counted == {"written", "escapes", "arithmetic", "compared", "subtracted", "table_use", "mismatch",
                       "page_count", "no_consumer", "element_use"}
    not_counted = asserted_codes('''
def test_declared_kinds_options_prose():
    assert {"written", "output_changes"} <= set(REASONS)
    assert [i.kind for i in report.kept] == ["post_grad"] and "page_size" in proc.stderr
    run(step, page_size="page_size", name="escapes")
    assert "arithmetic" in item.reason
''')
    assert not_counted == set()
