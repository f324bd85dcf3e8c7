"""Every private torch API the project touches, in one place (torch 2.11 through 2.15).

Keep this module small; tests/test_compat.py exercises each function on the installed torch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx

try:  # torch >= 2.6
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - older torch is not supported, but fail clearly
    CustomGraphPass = object  # type: ignore[assignment,misc]


def compile_fx(gm: torch.fx.GraphModule, example_inputs, config_patches: dict[str, Any]):
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    with region_schema_cache():
        return _compile_fx(gm, example_inputs, config_patches=config_patches)


# -- one schema per compiled region body (issue 29) ---------------------------------------------------------------
# AOTAutograd functionalizes every invoke_subgraph call (a nested_compile_region's call) twice, once to collect
# metadata and once to trace, and each time torch 2.11 derives the call's schema (which operands the body mutates,
# what it returns) by tracing the body again with make_fx (`HopInstance.create` -> `gen_schema` ->
# `materialize_as_graph`): 128 traces of 2 bodies for the 32-layer regional step, the largest part of its cold
# AOTAutograd time on the H200 (benchmarks/results/profile_*). Later torch caches that schema itself, per tracing
# context, keyed by (id(subgraph), identifier, operand types) (`InvokeSubgraphCache.get_functionalize_schema_entry`);
# where it does not, the same cache, with the same key, is kept here while the backend's compile_fx runs. The
# schema is derived from the body alone (its mutations and outputs), so a body with the same identifier and
# operand types has the same schema; the cached entry holds the body itself, so an id reused after the body is
# freed never matches.
_SCHEMAS = "_syncfree_functionalize_schemas"  # the attribute of torch's per-compile InvokeSubgraphCache


def torch_caches_region_schemas() -> bool:
    from torch._guards import InvokeSubgraphCache

    return hasattr(InvokeSubgraphCache, "get_functionalize_schema_entry")


@contextlib.contextmanager
def region_schema_cache(force: bool = False):
    """While inside: invoke_subgraph's functionalization derives a body's schema once per tracing context, where
    torch does not cache it itself (force=True installs it anyway: for tests). Yields whether it is installed.
    SYNCFREE_REGION_SCHEMA_CACHE=0 in the environment turns it off (torch's own behaviour, for comparison)."""
    import os

    if os.environ.get("SYNCFREE_REGION_SCHEMA_CACHE", "1") == "0":
        yield False
        return
    region = _invoke_subgraph_module()
    base = getattr(region, "HopInstance", None)
    if base is None or getattr(base, "_syncfree_schema_cache", False) or (
            torch_caches_region_schemas() and not force):
        yield False
        return

    class CachedSchemaHopInstance(base):  # type: ignore[misc,valid-type]
        _syncfree_schema_cache = True

        @staticmethod
        def create(hop, *args, **kwargs):
            cache = region.get_invoke_subgraph_cache()
            if hop is not region.invoke_subgraph or kwargs or cache is None or len(args) < 2 or not isinstance(
                    args[1], str):
                return base.create(hop, *args, **kwargs)
            subgraph, identifier, *operands = args
            store = cache.__dict__.setdefault(_SCHEMAS, {})
            key = (id(subgraph), identifier, tuple(type(o) for o in operands))
            hit = store.get(key)
            if hit is not None and hit[0] is subgraph:
                return base(hop, hit[1])
            made = base.create(hop, *args)
            store[key] = (subgraph, made._schema)
            return made

    region.HopInstance = CachedSchemaHopInstance
    try:
        yield True
    finally:
        region.HopInstance = base


def warm_compile_workers() -> bool:
    """Start Inductor's compile-worker pool now (what Inductor starts only when its first graph compiles), so that
    it is up when Inductor reaches its kernels: with a fast AOTAutograd it otherwise compiles the first ones in the
    process, one after another (1.8-2.9 s of the regional 8B step's cold call on the H200). False where there is
    no pool to start (compile_threads <= 1, or this torch lacks the calls)."""
    try:
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads
    except ImportError:  # pragma: no cover - every supported torch has them
        return False
    if get_compile_threads() <= 1 or not all(hasattr(AsyncCompile, m) for m in ("warm_pool", "wakeup")):
        return False
    AsyncCompile.warm_pool()
    AsyncCompile.wakeup()
    return True


def _invoke_subgraph_module():
    """The module torch._higher_order_ops.invoke_subgraph (the package's attribute of that name is the op)."""
    import importlib

    try:
        return importlib.import_module("torch._higher_order_ops.invoke_subgraph")
    except ImportError:  # pragma: no cover - every supported torch has it
        return None


def region_schema_entries() -> int | None:
    """How many schemas region_schema_cache holds in the current tracing context (None outside one)."""
    region = _invoke_subgraph_module()
    cache = None if region is None else region.get_invoke_subgraph_cache()
    return None if cache is None else len(cache.__dict__.get(_SCHEMAS, {}))


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_triton_cache_dir(device: int) -> str:
    """Where Inductor points TRITON_CACHE_DIR (when unset) as it builds its first kernel launcher in a process:
    TRITON_CACHE_DIR itself where set, else <Inductor's cache dir>/triton/<device>."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    return triton_cache_dir(device)


def inductor_config_value(name: str):
    from torch._inductor import config

    return getattr(config, name, None)


def inductor_config_fingerprint() -> str:
    """Inductor's global config, as text (every key, machine-dependent ones such as compile_threads included)."""
    from torch._inductor import config

    return repr(sorted((k, repr(v)) for k, v in config.get_config_copy().items()))


def placeholder_source_name(node: torch.fx.Node) -> str | None:
    """Dynamo's record of where a graph input came from, e.g. "L['forward_batch'].seq_lens_cpu"."""
    grapharg = node.meta.get("grapharg")  # present while the backend runs; Dynamo drops it afterwards
    source = getattr(grapharg, "source", None) or getattr(node, "_dynamo_source", None)
    if source is None:
        return None
    try:
        return source.name() if callable(source.name) else source.name
    except Exception:
        return None


def example_value(node: Any):
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def storage_id(t: torch.Tensor):
    """An identity of the memory behind a (fake) tensor: views and aliases share it; None when unknown."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(t.untyped_storage()).cdata
    except Exception:
        return None


def fake_mode_of(nodes) -> Any:
    """The FakeTensorMode the Dynamo graph was traced with (from any node's example value)."""
    for node in nodes:
        value = example_value(node)
        mode = getattr(value, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def fresh_fake_mode():
    """A FakeTensorMode of its own (no shape environment, no dispatch cache): for work on fake tensors in another
    thread than the compile's, which must not share the compile's mode or its caches (compile_pass.kernel_warmup)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    mode.cache_enabled = False  # the dispatch cache is shared by every mode, and this mode runs in another thread
    return mode


@contextlib.contextmanager
def capture_scalar_outputs():
    """Dynamo reads this flag at trace time, i.e. at the first call, not at torch.compile()."""
    import torch._dynamo

    old = torch._dynamo.config.capture_scalar_outputs
    torch._dynamo.config.capture_scalar_outputs = True
    try:
        yield
    finally:
        torch._dynamo.config.capture_scalar_outputs = old


def capture_scalar_outputs_enabled() -> bool:
    import torch._dynamo

    return bool(torch._dynamo.config.capture_scalar_outputs)


def graph_counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return counters


def known_equal(a, b) -> bool:
    """Are two ints / SymInts equal for every value of their symbols (no guard added)? False when unknown."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001  (an expression it cannot decide)
        return False


def free_unbacked_symbols(value) -> set:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols as _free

    return _free(value)


def run_and_get_code(fn, *args, **kwargs):
    """(fn(*args), Inductor wrapper code of what compiles during the call).

    Unlike torch._inductor.utils.run_and_get_code this does not reset Dynamo, so other compiled functions
    keep their caches (a reset would make them compile again and look like recompiles).
    """
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", lambda code: codes.append(code)):
        result = fn(*args, **kwargs)
    return result, codes


def dynamo_cache_entries(code) -> int:
    """How many compiled entries Dynamo holds for a code object (tests: a check must not add any to yours)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def mark_static_address(t: torch.Tensor) -> None:
    """A persistent buffer (KV pool, req_to_token): CUDA graphs may keep its address and let the graph mutate it."""
    import torch._dynamo

    torch._dynamo.mark_static_address(t)


# -- static inputs of a CUDA graph (the persistent scratch of the allocated-table rule) ----------------------
# AOT autograd takes a Dynamo graph's static inputs from its placeholders: those whose
# node.meta["tensor_dict"]["_dynamo_static_input_type"] is set (what torch._dynamo.mark_static_address records on a
# tensor, copied to its placeholder by Dynamo; torch 2.11 _functorch/_aot_autograd/frontend_utils.py:200,
# _dynamo/utils.py:5048). Inductor hands them to CUDA graph trees as static_input_idxs: not copied into the graph's
# own buffers, so an in-place write lands in the caller's tensor, as in eager; a new address re-records
# (cudagraph_trees.py:876, :1780) where rerecord_if_static_inputs_change holds. Tested in tests/test_compat.py.
_STATIC_KEY = "_dynamo_static_input_type"


def static_inputs_rerecord() -> bool:
    """Do CUDA graph trees re-record a graph when a static input's address changes (rather than fail)? torch 2.11:
    `inline_inbuilt_nn_modules or triton.cudagraph_support_input_mutation` (cudagraph_trees.py:876); later torch
    always re-records (2.13: the Dynamo flag is deprecated, always True; a torch without the flag: True)."""
    import warnings

    import torch._dynamo.config
    from torch._inductor import config

    if getattr(config.triton, "cudagraph_support_input_mutation", False):
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13: "inline_inbuilt_nn_modules is deprecated"
        return bool(getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", True))


def is_static_placeholder(node: torch.fx.Node) -> bool:
    """Will AOT autograd count this Dynamo placeholder as a static input (mark_static_address, or marked here)?"""
    return bool((node.meta.get("tensor_dict") or {}).get(_STATIC_KEY))


def mark_static_placeholder(node: torch.fx.Node) -> bool:
    """Make a Dynamo graph's placeholder a static input ('unguarded', as mark_static_address(t) makes a tensor:
    a new address re-records, no recompile). The tensor itself is not touched. The dict is replaced, not edited:
    a copied graph's node shares it with Dynamo's own. False when it was static already."""
    if node.op != "placeholder" or is_static_placeholder(node):
        return False
    node.meta["tensor_dict"] = {**(node.meta.get("tensor_dict") or {}), _STATIC_KEY: "unguarded"}
    return True


def unmark_static_placeholder(node: torch.fx.Node) -> None:
    """Undo mark_static_placeholder."""
    found = dict(node.meta.get("tensor_dict") or {})
    found.pop(_STATIC_KEY, None)
    node.meta["tensor_dict"] = found


def input_alignment() -> int:
    """The alignment (bytes) Inductor's kernels assume of a GPU input whose example is aligned; a static input is
    not checked again at run time (torch 2.11 compile_fx.py:1821, utils.py:3296 tensor_is_aligned)."""
    try:
        from torch._inductor.utils import GPU_ALIGN_BYTES
    except ImportError:  # pragma: no cover
        return 16
    return int(GPU_ALIGN_BYTES)


def statically_aligned(t) -> bool:
    """Is a (fake) tensor's storage offset known, without a guard, to keep it aligned as Inductor assumes?"""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true((t.storage_offset() * t.element_size()) % input_alignment() == 0))
    except Exception:
        return False


_TORCH_LOGGERS = ("torch", "torch._inductor", "torch._dynamo", "torch._inductor.cudagraph_utils")


class CudagraphSkips:
    """Collects Inductor's 'skipping cudagraphs due to ...' messages (TORCH_LOGS=cudagraphs) while active."""

    def __init__(self):
        import logging

        self.messages: list[str] = []
        outer = self

        class _Handler(logging.Handler):
            def emit(self, record):
                text = record.getMessage()
                if "cudagraph" in text.lower():
                    outer.messages.append(text[:300])

        self.handler = _Handler()

    def __enter__(self):
        import logging

        torch._logging.set_logs(cudagraphs=True)  # Inductor logs its skip reasons under this artifact
        for name in _TORCH_LOGGERS:  # torch's loggers do not propagate to "torch"
            logging.getLogger(name).addHandler(self.handler)
        return self

    def partitions(self) -> list[str]:
        """Inductor's "Created N graph partitions: ..." lines (logged when it compiles, not on a cache hit)."""
        import re

        return [m.group(0) for text in self.messages
                for m in [re.search(r"Created \d+ graph partitions?: [^\n]*", text)] if m]

    def __exit__(self, *exc):
        import logging

        for name in _TORCH_LOGGERS:
            logging.getLogger(name).removeHandler(self.handler)
        torch._logging.set_logs()
        return False


def copy_dynamo_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a Dynamo graph that AOT autograd still recognises as Dynamo's.

    AOT reads `gm.meta["dynamo_compile_id"]`, `gm._param_name_to_source` and each placeholder's
    `_dynamo_source` to find static inputs (parameters, buffers, mark_static_address tensors); without them a
    CUDA graph would refuse to let the step write its KV pool ("skipping cudagraphs due to mutated inputs").
    """
    graph = torch.fx.Graph()
    value_map: dict = {}
    out = graph.graph_copy(gm.graph, value_map)
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    for old_node, new_node in value_map.items():
        if hasattr(old_node, "_dynamo_source"):
            new_node._dynamo_source = old_node._dynamo_source
    return new


def overload_schemas(packet) -> list:
    """[(overload name, schema)] of an OpOverloadPacket: every overload a call of the packet may resolve to."""
    found = []
    for name in packet.overloads():
        try:
            found.append((name, getattr(packet, name)._schema))
        except (AttributeError, RuntimeError):
            continue
    return found


def resolve_packet_call(packet, args, kwargs):
    """The OpOverload that `packet(*args, **kwargs)` runs (the dispatcher's own choice), or None when unknown."""
    names = packet.overloads()
    if names == ["default"]:
        return packet.default
    try:
        name = torch._C._jit_resolve_packet(packet._qualified_op_name, *args, **kwargs)
    except Exception:
        return None
    return getattr(packet, name or "default", None)


def graph_break_reasons() -> list[tuple[str, str]]:
    """[(reason, 'file.py:LINE' of the user's code)] of every graph break Dynamo recorded in this process."""
    try:
        from torch._dynamo.utils import graph_break_reasons as reasons
    except ImportError:
        return []
    found = []
    for r in list(reasons):
        stack = getattr(r, "user_stack", None) or []
        where = f"{stack[-1].filename.rsplit('/', 1)[-1]}:{stack[-1].lineno}" if stack else "<unknown>"
        found.append((str(getattr(r, "reason", r)), where))
    return found

def inductor_config_keys() -> frozenset[str]:
    """Every key torch._inductor.config accepts as a patch ("max_autotune", "triton.cudagraphs", ...)."""
    from torch._inductor import config

    return frozenset(config.get_config_copy())


def register_torch_log(setting_name: str, logger_name: str) -> bool:
    """Let TORCH_LOGS / torch._logging.set_logs control `logger_name` under `setting_name`. False when this torch
    has no registry to add to (the logger then still works through TORCH_LOGS=<module name>)."""
    try:
        from torch._logging._internal import register_log
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    register_log(setting_name, logger_name)
    return True


def trace_artifact(name: str, payload_fn) -> None:
    """A structured-trace artifact (TORCH_TRACE, tlparse) of JSON `payload_fn()`; a no-op when tracing is off."""
    torch._logging.trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "json"},
                                    payload_fn=payload_fn)


@contextlib.contextmanager
def no_compile_caches():
    """Inductor's FX graph cache and AOT autograd's cache off: every compile generates its code (syncfree-inspect
    counts host reads in the code of this run, the same way on both sides)."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config

    aot = {"enable_autograd_cache": False} if hasattr(functorch_config, "enable_autograd_cache") else {}
    with config.patch(fx_graph_cache=False), functorch_config.patch(**aot):
        yield


def invoke_subgraph_op():
    """The higher-order op a `torch.compiler.nested_compile_region` call becomes in a Dynamo graph (or None)."""
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)

def user_triton_kernel(node: torch.fx.Node):
    """(kernel, constant args) of a `triton_kernel_wrapper_mutation` node: the user's @triton.jit kernel (or its
    autotuner) that the node launches, from torch's kernel side table, and the arguments Dynamo kept there
    (constexprs, None, non-tensor constants) by parameter name. None for any other node."""
    hop = getattr(torch.ops.higher_order, "triton_kernel_wrapper_mutation", None)
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or hop is None or node.target is not hop:
        return None
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    try:
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        constants = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
    except (AssertionError, KeyError):
        return None
    return kernel, dict(constants)


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
    from torch._dynamo.aot_compile_types import SerializableCallable as _SerializableCallable
except ImportError:  # pragma: no cover - a torch without it never precompiles
    _SerializableCallable = object  # type: ignore[assignment,misc]


def _picklable_fallback(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
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
        setattr(root, name, _picklable_fallback(value) if isinstance(value, torch.fx.GraphModule) else value)
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
    if not precompiling() or _SerializableCallable is object or isinstance(compiled, _SerializableCallable) \
            or not hasattr(compiled, "serialize"):
        return compiled
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    return BundledAOTAutogradSerializableCallable(compiled)


class GuardedSerializableStep(_SerializableCallable):  # type: ignore[misc,valid-type]
    """The backend's per-call guard (backend.guard_disjoint_inputs) in a form torch's AOT precompile can save: the
    compiled graph (AOT autograd's bundled entry), the untouched Dynamo graph it falls back to, the input pairs the
    proof assumed distinct and the positions of the inputs made static that must stay aligned."""

    def __init__(self, compiled, original, pairs: tuple, boxed: bool, aligned: tuple = ()):
        self.compiled, self.original, self.pairs, self._boxed_call = compiled, original, pairs, boxed
        self.aligned = aligned

    def __call__(self, *args):
        from .backend import _flat_inputs, inputs_misaligned, inputs_share_memory

        if inputs_share_memory(args, self.pairs) or inputs_misaligned(args, self.aligned):
            return self.original(*_flat_inputs(args))
        return self.compiled(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "GuardedSerializableStep") -> bytes:
        import pickle

        from torch._dynamo.aot_compile_types import (BundledAOTAutogradSerializableCallable as Bundled,
                                                     GraphModuleSerializableCallable as Graph)

        compiled = fn.compiled if isinstance(fn.compiled, Bundled) else Bundled(fn.compiled)
        if isinstance(fn.original, Graph):
            original = Graph.serialize_compile_artifacts(fn.original)
        else:
            original = Graph.serialize_compile_artifacts(Graph(_picklable_fallback(fn.original)))
        return pickle.dumps((Bundled.serialize_compile_artifacts(compiled), original, fn.pairs, fn._boxed_call,
                             tuple(fn.aligned)))

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "GuardedSerializableStep":
        import pickle

        from torch._dynamo.aot_compile_types import (BundledAOTAutogradSerializableCallable as Bundled,
                                                     GraphModuleSerializableCallable as Graph)

        compiled, original, pairs, boxed, *rest = pickle.loads(data)  # saved before `aligned` existed: 4 fields
        return cls(Bundled.deserialize_compile_artifacts(compiled), Graph.deserialize_compile_artifacts(original),
                   pairs, boxed, tuple(rest[0]) if rest else ())


# -- Dynamo tracing (issue 30) --------------------------------------------------------------------------------
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
    (nothing installed: Dynamo breaks there as without it) on a torch without that class."""
    return _hook_call_function("torch._dynamo.variables.user_defined", "UserDefinedClassVariable",
                               "_syncfree_class_hook", _CLASS_CALL_HOOKS, hook,
                               lambda variable: variable.value if isinstance(getattr(variable, "value", None), type)
                               else None)


def _hook_call_function(module: str, name: str, marker: str, hooks: list, hook, target_of) -> bool:
    """Add `hook` to `hooks` and wrap Dynamo's `module.name.call_function` (a VariableTracker class) once: where
    `target_of(variable)` names a target (not None), each of `hooks` sees `(tx, target, args, kwargs)` and may
    return the call's VariableTracker; else, or when every hook returns None, Dynamo's own call_function runs.
    False (nothing installed) on a torch without that class."""
    import importlib

    try:
        owner = getattr(importlib.import_module(module), name, None)
    except ImportError:  # pragma: no cover - every supported torch has both modules
        owner = None
    if owner is None:  # pragma: no cover - every supported torch has both classes
        return False
    if hook not in hooks:
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
        return original(self, tx, args, kwargs)

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


def struct_variable(cls, fields: dict):
    """A Dynamo VariableTracker for a new instance of the msgspec.Struct class `cls` with these field values
    (VariableTrackers, every field given): the plain attribute container a Struct is. Reading a field gives its
    value; a method or property of the class is inlined with this object as `self`; anything else (setting an
    attribute, comparing, hashing, ...) breaks the graph, where Dynamo builds the object with
    `cls(**fields)` and Python runs the rest. Dynamo builds it that way wherever it leaves the graph, once per
    object (a value used twice is kept in a temporary)."""
    if not _STRUCT_VARIABLE:
        _STRUCT_VARIABLE.append(_make_struct_variable_class())
    return _STRUCT_VARIABLE[0](cls, dict(fields))


def _make_struct_variable_class():
    import inspect
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

        def var_getattr(self, tx, name):
            if name in self.fields:
                return self.fields[name]
            static = inspect.getattr_static(self.cls, name, None)
            if isinstance(static, types.FunctionType):
                return UserMethodVariable(static, self)
            if isinstance(static, property) and isinstance(static.fget, types.FunctionType):
                return UserFunctionVariable(static.fget).call_function(tx, [self], {})
            unsupported("syncfree: msgspec.Struct attribute",
                        f"{self.cls.__name__}.{name} is not a field, a method or a property of the class")

        def call_obj_hasattr(self, tx, name):
            if name in self.fields:
                return constant_variable(True)
            return constant_variable(hasattr(self.cls, name))

        def call_method(self, tx, name, args, kwargs):
            static = inspect.getattr_static(self.cls, name, None)
            if not name.startswith("__") and isinstance(static, types.FunctionType):
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

    return StructVariable
