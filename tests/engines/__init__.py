"""Engine-shaped decode steps, one module per style, written the way serving engines write them (our own code,
after reading SGLang's flashattention_backend.py, its dflash device page-table path and vLLM's flash_attn.py).

Each module's CASES maps a name to an EngineCase: how to build the step, what the pass must do with it
(rewritten, or kept with which words in the reason) and the backend options it needs.
"""


def all_cases() -> dict:
    """Every style's CASES by name (suites/test_engines.py on CPU, test_gpu.py on an H200)."""
    from . import dflash, sglang_fa3, vllm_flash_attn

    return {**sglang_fa3.CASES, **vllm_flash_attn.CASES, **dflash.CASES}


def case_lengths(case, batch: int, count: int, seed: int) -> list[list[int]]:
    """Length vectors for one case: every length the step forms fits the token table (in [queries, top]), and row 0
    of the first vector is at the top."""
    from passlib import length_vectors

    from .common import MAX_CONTEXT

    top = MAX_CONTEXT - case.queries - case.headroom
    vectors = length_vectors(batch, count, seed, top=top, low=case.queries)
    vectors[0][0] = top
    return vectors
