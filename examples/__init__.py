"""Reference decode models (importable as compile_pass.examples). `BUILTIN_EXAMPLES` lists what
`syncfree-inspect --example NAME` and `make demo` run."""

from .tiny_llama import BUILTIN_EXAMPLES, ForwardBatch, TinyLlama, TinyLlamaConfig, make_batch  # noqa: F401
