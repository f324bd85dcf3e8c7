"""Dumping what a compile produced: depyf when it works, else the FX graphs and Inductor code by hand.

depyf 0.20 patches private Inductor functions; where its `prepare_debug` fails on this torch, the compile is
redone without it and the graphs and code are written directly (the caller says so in one line).
"""

from __future__ import annotations

import contextlib
import difflib
import shutil
from pathlib import Path

import torch


def depyf_context(directory: Path):
    """(context manager, problem): depyf's prepare_debug, or a null context and why depyf is not used."""
    try:
        import depyf
    except ImportError:
        return contextlib.nullcontext(), "depyf is not installed"
    try:
        return depyf.prepare_debug(str(directory)), None
    except Exception as e:  # depyf rejects this torch
        return contextlib.nullcontext(), f"depyf failed ({type(e).__name__}: {e})"


# What syncfree-inspect writes into its output folder; a run removes these (and only these) first.
SIDES = ("before", "after")
TOP_FILES = ("report.json", "report.md", "rewrite.diff")
MARKER = ".syncfree-inspect"  # in before/ and after/: the folder is ours to empty
_OURS = ("dynamo_graph_*.py", "rewritten_graph_*.py", "inductor_code_*.py", "rewrite_*.diff", "full_code_for_*",
         "__compiled_fn_*", "__transformed_code_*")


class ForeignFolder(Exception):
    """An output subfolder that syncfree-inspect did not write: it is left alone, and the run refuses."""


def clean_output(out: Path) -> None:
    """Start clean: remove what earlier runs wrote into `out` (before/, after/, the reports and the diff) and
    nothing else; before/ and after/ are emptied only when a marker, or the dump files, show they are ours."""
    for side in SIDES:
        folder = out / side
        if folder.is_dir():
            ours = (folder / MARKER).exists() or any(any(folder.glob(g)) for g in _OURS) or not any(folder.iterdir())
            if not ours:
                raise ForeignFolder(f"{folder} exists and was not written by syncfree-inspect; remove it or choose "
                                    "another --out")
            shutil.rmtree(folder)
        elif folder.exists():
            raise ForeignFolder(f"{folder} exists and is not a folder; remove it or choose another --out")
    for name in TOP_FILES:
        (out / name).unlink(missing_ok=True)
    for side in SIDES:
        (out / side).mkdir(parents=True)
        (out / side / MARKER).write_text("written by syncfree-inspect; emptied by its next run into this folder\n")


def recording_backend(inner, graphs: list[str], name: str | None = None):
    """Wrap a backend so each Dynamo graph's code is kept (before any rewrite by `inner`)."""

    def backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
        graphs.append(gm.code)
        return inner(gm, example_inputs, **kwargs)

    backend.__name__ = name or getattr(inner, "__name__", "backend")  # Dynamo's errors name the backend by it
    return backend


def write_dump(directory: Path, graphs: list[str], codes: list[str], rewritten: list[str] | None = None) -> list[str]:
    """Write the graphs as Dynamo captured them, the rewritten graphs (if any) with a unified diff per graph,
    and Inductor's code. Returns the diffs."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, code in enumerate(graphs):
        (directory / f"dynamo_graph_{i}.py").write_text(code)
    for i, code in enumerate(codes):
        (directory / f"inductor_code_{i}.py").write_text(code)
    diffs = []
    for i, code in enumerate(rewritten or []):
        (directory / f"rewritten_graph_{i}.py").write_text(code)
        before = graphs[i] if i < len(graphs) else ""
        diff = "".join(difflib.unified_diff(before.splitlines(True), code.splitlines(True),
                                            fromfile=f"dynamo_graph_{i}.py (as captured)",
                                            tofile=f"rewritten_graph_{i}.py (after the syncfree pass)"))
        (directory / f"rewrite_{i}.diff").write_text(diff)
        diffs.append(diff)
    return diffs
