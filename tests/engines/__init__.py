"""Engine-shaped decode steps, one module per style, written the way serving engines write them (our own code,
after reading SGLang's flashattention_backend.py, its dflash device page-table path and vLLM's flash_attn.py).

Each module's CASES maps a name to an EngineCase: how to build the step, what the pass must do with it
(rewritten, or kept with which words in the reason) and the backend options it needs.
"""
