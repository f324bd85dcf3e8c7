"""Triton kernels and their torch.library ops (`torch.ops.syncfree.*`), importable as compile_pass.kernels."""

from . import page_table as _page_table  # noqa: F401  (registers syncfree::page_table, syncfree::page_table_)
from . import paged_decode as _paged_decode  # noqa: F401,E402  (registers syncfree::paged_decode)
from . import flash_attn as _flash_attn  # noqa: F401,E402  (registers syncfree::fa4_paged, syncfree::fa_with_kvcache)
from . import kv_store as _kv_store  # noqa: F401,E402  (registers syncfree::store_kv)
from . import kv_indices as _kv_indices  # noqa: F401,E402  (registers syncfree::kv_indices)
from . import ragged_extend as _ragged_extend  # noqa: F401,E402  (registers syncfree::ragged_extend_attention)

# Each op's self-guarding facts, next to the op; compile_pass.rules.self_guarding registers them.
SELF_GUARDING = {**_paged_decode.SELF_GUARDING, **_flash_attn.SELF_GUARDING}
# Facts for ops defined elsewhere (sgl_kernel, flash_attn_interface), registered when the op first shows up.
EXTERNAL_SELF_GUARDING = dict(_flash_attn.EXTERNAL_SELF_GUARDING)
# The flat kv_indices rule's facts (compile_pass/rules/flat_kv_indices.py): bounded writers and indptr readers.
FLAT_KV_INDICES = {"writers": dict(_kv_indices.INDPTR_WRITERS), "readers": dict(_kv_indices.INDPTR_READERS)}
# The indptr-bound rule's facts (compile_pass/rules/indptr_bound.py): readers through an indptr, upper bounds.
INDPTR_BOUND = dict(_ragged_extend.INDPTR_BOUND)
