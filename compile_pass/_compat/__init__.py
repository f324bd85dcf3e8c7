"""Every private torch API the project touches, in one package (torch 2.11 through 2.15), split by phase:

    accessors     reading FX node meta, fake tensors and modes, symbols, op schemas, Dynamo's counters
    dynamo_hooks  what the backend tells Dynamo while it traces (the patches of Dynamo's classes)
    inductor      compile_fx, Inductor's config and compile workers, CUDA-graph static inputs, logging
    caches        compile caches and AOT precompile
    regions       compiled regions (invoke_subgraph) and their schema cache
    residual      the code Dynamo runs around the graph it is compiling, before and after its call (read, not
                  patched)

Each module's docstring lists the patches it installs, each dated: the torch versions it was checked on and what
would remove it. Nothing here imports the rest of compile_pass (tests/test_architecture.py checks it): this
package is the bottom layer. Callers use `_compat.name`; every public name of the modules is re-exported here.
tests/test_compat.py exercises each function on the installed torch.
"""

from __future__ import annotations

from .accessors import (  # noqa: F401
    placeholder_source_name, example_value, storage_id, fake_mode_of, fresh_fake_mode, capture_scalar_outputs,
    capture_scalar_outputs_enabled, graph_counters, known_equal, known_at_least, free_unbacked_symbols,
    run_and_get_code,
    dynamo_cache_entries, mark_static_address, copy_dynamo_graph_module, overload_schemas, resolve_packet_call,
    graph_break_reasons, unseen_graph_break_reasons, no_guard_profiling, graph_break_count, invoke_subgraph_op,
    user_triton_kernel,
)
from .inductor import (  # noqa: F401
    CustomGraphPass, compile_fx, warm_compile_workers, inductor_cache_dir, inductor_triton_cache_dir,
    inductor_config_value, inductor_config_fingerprint, static_inputs_rerecord, is_static_placeholder,
    mark_static_placeholder, unmark_static_placeholder, input_alignment, statically_aligned, CudagraphSkips,
    inductor_config_keys, register_torch_log, trace_artifact, no_compile_caches,
)
from .regions import (  # noqa: F401
    torch_caches_region_schemas, region_schema_cache, _invoke_subgraph_module, region_schema_entries,
)
from .caches import (  # noqa: F401
    inductor_cache_config_fingerprint, save_cache_artifacts, load_cache_artifacts, compile_cache_counters,
    aot_compile_supported, aot_compile_enabled, aot_compile, compiled_function_bytes, load_compiled_function_bytes,
    precompiling, SerializableCallable, picklable_fallback, serializable_step,
)
from .residual import frame_residual  # noqa: F401
from .dynamo_hooks import (  # noqa: F401
    _ITEM_HOOKS, on_captured_item, symbol_of, _GUARD_HOOKS, RETRY, on_data_dependent_guard, shape_env_of,
    size_facts, symbol_range, guard_sizes,
    assert_at_runtime, discard_graph_breaks, _CLASS_CALL_HOOKS, _DISABLED_CALL_HOOKS, unsupported,
    on_user_class_call, on_disabled_call, disabled_target, constant_of, python_type_of, list_items_of,
    is_tensor_variable, constant_variable,
    trace_call, build_struct, struct_variable, class_attribute, NOT_IN_CLASS,
    struct_model_unfit, _FRAME_COMPILE_HOOKS, on_frame_compile, compiling_frame_entry, ALLOCATION_BREAK,
    break_where_dynamo_cannot_allocate,
)
