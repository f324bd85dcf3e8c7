"""Compile caches and precompile: torch's mega-cache, AOT precompile, the serializable forms of a compiled step.

Patches here: none. `serializable_step` wraps Inductor's output as torch's own Inductor backends do under AOT
precompile (torch 2.11 wraps it only for them); checked on torch 2.13.0 and 2.14.1 (2026-12-04) and on
2.11.0, 2.12.1 and 2.15.0 (2026-12-05: tests/test_cache.py, 31 passed on each); removed when
torch wraps a custom backend's compile_fx output itself.
"""

from __future__ import annotations

import contextlib
import torch
import torch.fx

from .inductor import inductor_config_fingerprint


# -- compile caches (issue 29) ------------------------------------------------------------------------------------
# What compile_pass.cache builds on: torch's "mega-cache" (torch.compiler.save_cache_artifacts /
# load_cache_artifacts, every supported torch), its AOT precompile (`torch.compile(fn).aot_compile`,
# torch.compiler.load_compiled_function; not on every supported torch), Inductor's view of its own config for
# cache keys, and the cache counters.

def inductor_cache_config_fingerprint() -> str:
    """Inductor's config as its FX graph cache key sees it (`save_config_portable`): settings that do not change
    the compiled code (compile_threads, worker_start_method, the cache switches, custom passes, which are keyed by
    their uuid) are left out, so the text is the same on two machines of one kind."""
    from torch._inductor import config

    try:
        portable = config.save_config_portable(ignore_private_configs=False)
    except Exception:  # noqa: BLE001  (a torch without it, or a config value it cannot express)
        return inductor_config_fingerprint()
    return repr(sorted((k, repr(v)) for k, v in portable.items()))


def save_cache_artifacts() -> bytes | None:
    """torch's serialized compile artifacts (FX graph cache, AOT autograd cache, Triton kernels, autotuning) of
    what this process compiled or loaded from its caches; None when it recorded none."""
    saved = torch.compiler.save_cache_artifacts()
    return None if saved is None else saved[0]


def load_cache_artifacts(blob: bytes) -> dict[str, int] | None:
    """Write torch's artifacts into this process's caches: {artifact kind: count}, or None when torch could not
    read them (it logs why and writes nothing)."""
    info = torch.compiler.load_cache_artifacts(blob)
    if info is None:
        return None
    return {kind: len(keys) for kind, keys in info.artifacts.items()}


def compile_cache_counters() -> dict[str, int]:
    """Inductor's FX graph cache and AOT autograd's cache counters in this process (hits, misses, bypasses)."""
    from torch._dynamo.utils import counters

    found = {f"fxgraph_{k[len('fxgraph_cache_'):]}": v for k, v in counters["inductor"].items()
             if k.startswith("fxgraph_cache_")}
    found.update({f"aot_autograd_{k[len('autograd_cache_'):]}": v for k, v in counters["aot_autograd"].items()
                  if k.startswith("autograd_cache_")})
    return found


def aot_compile_supported() -> str | None:
    """None where this torch can AOT-compile a Dynamo graph and load it in another process without tracing again
    (torch.compile(fn).aot_compile + torch.compiler.load_compiled_function); else why not."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function (AOT precompile)"
    try:
        from torch._dynamo.aot_compile import aot_compile_fullgraph  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile"
    return None


def aot_compile_enabled():
    """A context in which torch.compile(...) gives its result an `aot_compile` method: torch 2.11 does so only
    under `torch._dynamo.config.enable_aot_compile` (off by default there; on by default from 2.13)."""
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "enable_aot_compile"):
        return dynamo_config.patch(enable_aot_compile=True)
    return contextlib.nullcontext()


def aot_compile(compiled, args: tuple, kwargs: dict):
    """AOT-compile a torch.compile(fullgraph=True) function (made under aot_compile_enabled()) for these example
    inputs: an object with save_compiled_function(path) that is also callable."""
    if not hasattr(compiled, "aot_compile"):
        raise RuntimeError(f"torch {torch.__version__}: this torch.compile result has no aot_compile (it was not "
                           "made under _compat.aot_compile_enabled())")
    with aot_compile_enabled():
        return compiled.aot_compile((tuple(args), dict(kwargs)))


def compiled_function_bytes(compiled, directory: str, external_data: dict | None = None) -> bytes:
    """What `compiled.save_compiled_function(path)` writes (torch's own format), as bytes; written through a
    temporary file in `directory`, as torch writes only to a path."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".syncfree-", suffix=".aot.tmp", dir=directory)
    os.close(fd)
    try:
        if external_data is None:
            compiled.save_compiled_function(tmp)
        else:
            compiled.save_compiled_function(tmp, external_data)
        with open(tmp, "rb") as f:
            return f.read()
    finally:
        os.unlink(tmp)


def load_compiled_function_bytes(data: bytes):
    import io

    return torch.compiler.load_compiled_function(io.BytesIO(data))


def precompiling() -> bool:
    """Is a backend call under torch's AOT precompile (aot_compile sets AOT autograd's bundled cache for it)?"""
    import torch._functorch.config as functorch_config

    return bool(getattr(functorch_config, "bundled_autograd_cache", False))


try:  # torch with AOT precompile
    from torch._dynamo.aot_compile_types import SerializableCallable as SerializableCallable
except ImportError:  # pragma: no cover - a torch without it never precompiles
    SerializableCallable = object  # type: ignore[assignment,misc]


def picklable_fallback(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the untouched Dynamo graph that torch's graph pickler takes: no node meta (fake tensors it
    cannot pickle; the fallback runs eagerly and needs none), and no FX node inside a `slice` (torch 2.11's
    pickler maps nodes through pytrees, which do not enter a slice: `t[:, :n]` becomes `t[:, slice(None, n)]`
    with the slice built by a node)."""
    import builtins

    def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
        new = torch.fx.Graph()
        env: dict = {}

        def arg(a):
            if isinstance(a, torch.fx.Node):
                return env[a]
            if isinstance(a, slice) and any(isinstance(x, torch.fx.Node) for x in (a.start, a.stop, a.step)):
                return new.call_function(builtins.slice, (arg(a.start), arg(a.stop), arg(a.step)))
            if isinstance(a, (tuple, list)):
                return type(a)(arg(x) for x in a)
            if isinstance(a, dict):
                return {k: arg(v) for k, v in a.items()}
            return a

        for node in graph.nodes:
            if node.op == "placeholder":
                env[node] = new.placeholder(node.target)
            elif node.op == "output":
                new.output(arg(node.args[0]))
            else:
                env[node] = new.create_node(node.op, node.target, arg(node.args), arg(node.kwargs), node.name)
        return new

    root = torch.nn.Module()
    for name, value in gm.named_children():
        setattr(root, name, picklable_fallback(value) if isinstance(value, torch.fx.GraphModule) else value)
    for name, value in list(gm.named_parameters(recurse=False)) + list(gm.named_buffers(recurse=False)):
        setattr(root, name, value)
    for node in gm.graph.nodes:  # other attributes the graph reads (constants Dynamo lifted)
        if node.op == "get_attr" and not hasattr(root, node.target.split(".")[0]):
            setattr(root, node.target.split(".")[0], getattr(gm, node.target.split(".")[0]))
    return torch.fx.GraphModule(root, copy_graph(gm.graph))


def serializable_step(compiled):
    """Under AOT precompile, Inductor's compiled graph in the form torch saves (its bundled AOT autograd entry):
    torch 2.11 wraps it so only for its own Inductor backends, not for a backend that calls Inductor itself.
    Elsewhere `compiled` as it is."""
    if not precompiling() or SerializableCallable is object or isinstance(compiled, SerializableCallable) \
            or not hasattr(compiled, "serialize"):
        return compiled
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    return BundledAOTAutogradSerializableCallable(compiled)
