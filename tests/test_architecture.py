"""The package's shape (issue 42), read from the source with `ast` (nothing is imported or run):

- no import cycle among the modules of compile_pass (kernels/ and tools/ as compile_pass.kernels / .tools),
  counting imports made inside functions;
- compile_pass._compat imports nothing of the package (it is the bottom layer);
- no rule, and no graph-time module, imports the Dynamo-time module compile_pass.tracing;
- the compile's steps are one list (compile_pass.pipeline.STEPS) and the backend runs it;
- no module over MAX_LINES lines;
- every rule of RULE_ORDER has tests/rules/test_<rule>.py, and every file in tests/rules is a rule's.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = {"compile_pass": "compile_pass", "kernels": "compile_pass.kernels", "tools": "compile_pass.tools"}
MAX_LINES = 700


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if folder == "compile_pass" and parts and parts[0] in ("kernels", "tools"):
                continue
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (module level or inside functions)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names: list = [None]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name if is_package else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    package = package.rsplit(".", 1)[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            bases, names = [base], [alias.name for alias in node.names]
        else:
            continue
        for base in bases:
            for member in names:
                full = f"{base}.{member}" if member else base
                if full in modules:
                    targets.add(full)
                elif base in modules:
                    targets.add(base)
    targets.discard(name)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from .other import g\n")
    assert _imports("compile_pass.m", source, {"compile_pass.m": source, "compile_pass.other": source}) == {
        "compile_pass.other"}


def test_compat_is_the_bottom_layer():
    graph = _graph()
    for name, targets in graph.items():
        if name == "compile_pass._compat" or name.startswith("compile_pass._compat."):
            outside = {t for t in targets if not t.startswith("compile_pass._compat")}
            assert not outside, f"{name} imports {outside}"


def test_no_rule_or_graph_time_module_imports_the_dynamo_time_module():
    graph = _graph()
    graph_time = [n for n in graph if n.startswith("compile_pass.rules")] + [
        "compile_pass.traced_ranges", "compile_pass.pipeline", "compile_pass.sync_pass", "compile_pass.proof"]
    for name in graph_time:
        assert "compile_pass.tracing" not in graph[name], f"{name} imports the Dynamo-time module"


def test_the_backend_runs_the_pipeline_and_the_steps_are_one_list():
    from compile_pass import pipeline

    names = [step.name for step in pipeline.STEPS]
    assert len(names) == len(set(names))
    assert names.index("strip_range_asserts") < names.index("rules") < names.index("settle_at_bound")
    assert "compile_pass.pipeline" in _graph()["compile_pass.backend"]
    backend = (ROOT / "compile_pass" / "backend.py").read_text()
    for step in ("strip_range_asserts", "respell_widths", "settle_at_bound", "recheck_kept", "SyncPass("):
        assert step not in backend, f"the backend runs {step} itself: it belongs in pipeline.STEPS"


def test_no_module_is_over_the_line_limit():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_rule_has_its_test_file_and_every_rule_test_file_a_rule():
    from compile_pass import rules

    files = {p.stem.removeprefix("test_") for p in (ROOT / "tests" / "rules").glob("test_*.py")}
    assert files == set(rules.RULE_ORDER), (files, rules.RULE_ORDER)
