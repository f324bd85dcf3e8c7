"""A real package (issue 21): license, classifiers, one torch range, entry points, docs that cover the API."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import compile_pass

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")


@pytest.fixture(scope="module")
def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_license_is_spdx_with_its_file(project):
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639: no license classifier
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77 for r in requires)


def test_classifiers_and_python(project):
    assert project["requires-python"] == ">=3.10"
    assert "Programming Language :: Python :: 3" in project["classifiers"]
    assert any(c.startswith("Topic ::") for c in project["classifiers"])


def test_one_torch_range_stated_the_same_everywhere(project):
    torch_req = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert torch_req == ["torch>=2.11,<2.16"]
    assert not any(d.startswith("triton") for d in project["dependencies"])  # torch's own pin decides
    readme = (ROOT / "README.md").read_text()
    assert "torch 2.11 through 2.15" in readme and "torch>=2.11,<2.16" in readme
    compat = (ROOT / "compile_pass" / "_compat" / "__init__.py").read_text()
    assert "torch 2.11 through 2.15" in compat.split('"""')[1]


def test_entry_points(project):
    eps = project["entry-points"]
    assert project["scripts"] == {"syncfree-inspect": "compile_pass.tools.inspect_cli:main"}
    assert eps["torch_dynamo_backends"] == {"syncfree": "compile_pass.backend:syncfree_backend"}
    assert eps["pytest11"] == {"syncfree": "compile_pass.pytest_plugin"}
    assert eps["torch.backends"] == {"syncfree": "compile_pass:_torch_autoload"}
    assert callable(compile_pass._torch_autoload)


def test_long_description_has_no_repository_relative_links(project):
    readme = (ROOT / project["readme"]).read_text()
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert all(link.startswith(("http://", "https://")) for link in links), links
    assert "pip install torch-syncfree" in readme


def test_docs_api_covers_every_public_name():
    api = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in compile_pass.__all__ if f"compile_pass.{name}" not in api]
    assert not missing, missing
    from compile_pass import testing
    from compile_pass.options import _OURS

    for name in ("assert_sync_free", "SyncCheck", "SyncCheckFailed", "host_reads_in_code", "replay_without_sync"):
        assert hasattr(testing, name) and f"`{name}" in api, name
    for option in _OURS:
        assert f"`{option}`" in api, option
    for op in ("page_table", "page_table_", "paged_decode", "fa4_paged", "fa_with_kvcache", "store_kv"):
        assert f"`{op}(" in api, op
    from compile_pass.tools.inspect_cli import _parser

    flags = [s for a in _parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    for flag in flags:
        assert flag in api, flag
    assert "--syncfree-report" in api and "TORCH_LOGS=syncfree" in api and "syncfree_report" in api


def test_changelog_notes_the_changed_default():
    text = (ROOT / "CHANGELOG.md").read_text()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"## {version}" in text and "`checked=True` is the default" in text


@pytest.mark.inductor  # not an Inductor compile, but a build: slow-ish
def test_the_wheel_metadata(tmp_path):
    source = tmp_path / "src"  # a copy: the build leaves build/ and *.egg-info where it runs
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        source.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    for folder in ("compile_pass", "kernels", "tools", "examples"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = next(tmp_path.glob("torch_syncfree-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
    assert re.search(r"Requires-Dist: torch<2\.16,>=2\.11|Requires-Dist: torch>=2\.11,<2\.16", meta)
    assert "Requires-Dist: triton" not in meta
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    assert "[torch.backends]" in entry_points and "[torch_dynamo_backends]" in entry_points
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"compile_pass"}  # the only top-level import name
    # every source module is in it (a subpackage missing from pyproject's list left the wheel without
    # compile_pass/_compat: `import compile_pass` failed wherever the wheel was installed)
    mapped = {"compile_pass": "compile_pass", "kernels": "compile_pass/kernels", "tools": "compile_pass/tools",
              "examples": "compile_pass/examples"}
    sources = {mapped[p.relative_to(ROOT).parts[0]] + "/" + "/".join(p.relative_to(ROOT).parts[1:])
               for folder in mapped for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}
    assert sources <= set(names), sorted(sources - set(names))
    # and the installed wheel imports, away from the checkout (run in tmp_path: no source folder on the path)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    proc = subprocess.run([sys.executable, "-c", "import compile_pass, compile_pass.cache, compile_pass.kernels; "
                           "print(compile_pass.__file__)"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(str(site)), proc.stdout


def test_the_source_folder_kernels_never_loads_as_a_second_copy_of_the_ops(monkeypatch):
    """A probe for a top-level `kernels` package from the checkout's root (transformers imports what it finds)
    gets the package already imported (tests/conftest.py binds the name), so every torch.ops.syncfree op keeps
    dispatching to compile_pass.kernels' functions."""
    import importlib

    import torch

    import compile_pass.kernels
    import compile_pass.kernels.page_table as page_table_module

    monkeypatch.syspath_prepend(str(ROOT))
    assert importlib.import_module("kernels") is compile_pass.kernels
    seen = []
    monkeypatch.setattr(page_table_module, "_fill", lambda *args: seen.append(args[0].shape))
    torch.ops.syncfree.page_table(torch.zeros(2, 8, dtype=torch.int32), torch.tensor([0, 1]), torch.tensor([1, 2]),
                                  4, 2)
    assert seen == [torch.Size([2, 2])]
