"""The graph-dump inspection CLI, `syncfree-inspect` (importable as compile_pass.tools)."""
