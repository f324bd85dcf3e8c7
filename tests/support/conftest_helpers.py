import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def examples(n: int) -> int:
    """Hypothesis example counts; the Triton interpreter runs fewer (it is slow on CPU)."""
    return max(6, n // 6) if interpreting() else n
