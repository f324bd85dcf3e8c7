"""Dumping what a compile produced: depyf when it works, else the FX graphs and Inductor code by hand.

depyf 0.20 patches private Inductor functions; where its `prepare_debug` fails on this torch, the compile is
redone without it and the graphs and code are written directly (the caller says so in one line).
"""

from __future__ import annotations

import contextlib
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


def recording_backend(inner, graphs: list[str]):
    """Wrap a backend so each Dynamo graph's code is kept (before any rewrite by `inner`)."""

    def backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
        graphs.append(gm.code)
        return inner(gm, example_inputs, **kwargs)

    return backend


def write_dump(directory: Path, graphs: list[str], codes: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, code in enumerate(graphs):
        (directory / f"dynamo_graph_{i}.py").write_text(code)
    for i, code in enumerate(codes):
        (directory / f"inductor_code_{i}.py").write_text(code)
