"""The project's own steps as syncfree-inspect targets (`entry_point_steps:NAME`, each a function returning
(fn, example_args)), with the bound each is inspected at: tests/test_entry_points.py checks that the inspector,
assert_sync_free and compile_pass.compile decide alike on them (issue 44).

TARGETS maps a name to (factory, max_context_len): the built-in examples (compile_pass.examples), the engine
steps of tests/engines that need no option beyond the bound, and two steps that branch on the max before they
size their table, which only a trace with the max's range (compile_pass.compile's) rewrites: a guard that no
length within the bound takes (`grow_step`) and TRTLLM-MLA's round-up (`round_up_step`, whose outcome differs
inside the range but gives one graph either way).
"""

from __future__ import annotations

import torch


PS = 4
MCL = 64
GROW_BOUND = 64


def grow_step(q, k, v, r2t, rpi, seq_lens):
    m = seq_lens.max().item()
    if m > GROW_BOUND:  # never taken for a length within max_context_len=64
        raise ValueError("a request is longer than the pool")
    table = r2t[rpi, :m:PS] // PS
    return torch.ops.syncfree.paged_decode(q, k, v, table, seq_lens, max_seqlen_k=m)


def _paged_inputs(lengths=(5, 9), seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(4 * MCL // PS, generator=gen).view(4, -1)
    tok = torch.arange(MCL)
    r2t = (pages[:, tok // PS] * PS + tok % PS).to(torch.int32)
    batch = len(lengths)
    return (torch.randn(batch, 1, 4, 8, generator=gen), torch.randn(4 * MCL // PS, PS, 2, 8, generator=gen),
            torch.randn(4 * MCL // PS, PS, 2, 8, generator=gen), r2t, torch.randperm(4, generator=gen)[:batch],
            torch.tensor(lengths))


def grow():
    return grow_step, _paged_inputs()


# -- TRTLLM-MLA's round-up: `if blocks % LCM != 0`: traced both ways, one rewritten graph -------------------------
from consumers_for_tests import WRITE_ROWS as WRITER  # noqa: E402  (a registered bounded writer)

LCM = 16  # divides the bound's 16 pages: either outcome of the branch gives one static width (TRTLLM-MLA at 4096)


def round_up_step(q, k, v, r2t, rpi, seq_lens):
    m = seq_lens.max().item()
    blocks = (m + PS - 1) // PS
    if blocks % LCM != 0:  # trtllm_mla_backend.py's _calc_padded_blocks
        blocks = (blocks + LCM - 1) // LCM * LCM
    table = torch.full((seq_lens.shape[0], blocks), -1, dtype=torch.int32)
    WRITER(r2t, rpi, seq_lens, table, blocks, PS)
    return torch.ops.syncfree.paged_decode(q, k, v, table, seq_lens.to(torch.int32), max_seqlen_k=m)


def round_up():
    return round_up_step, _paged_inputs((5, 17, 9))


# -- a graph break that is no host read ----------------------------------------------------------------------
def broken_step(q, k, v, r2t, rpi, seq_lens):
    m = seq_lens.max().item()
    table = r2t[rpi, :m:PS] // PS
    out = torch.ops.syncfree.paged_decode(q, k, v, table, seq_lens, max_seqlen_k=m)
    torch._dynamo.graph_break()  # Dynamo splits the step here
    return out * 2


def broken():
    return broken_step, _paged_inputs()


def already_compiled():
    """A target that returns torch.compile's result (its backend fixed) instead of the function."""
    return torch.compile(grow_step, backend="eager"), _paged_inputs()


# -- the project's own steps ---------------------------------------------------------------------------------
def _example(name: str):
    def factory():
        from compile_pass.examples import BUILTIN_EXAMPLES

        return BUILTIN_EXAMPLES[name][1]()

    return factory


def _engine(name: str):
    def factory():
        from engines import all_cases, case_lengths

        case = all_cases()[name]
        step, make_args = case.build("cpu", case.page_size)
        return step, make_args(case_lengths(case, 3, 1, 7)[0], seed=0)

    return factory


def _targets() -> dict:
    from compile_pass.examples import BUILTIN_EXAMPLES, TinyLlamaConfig
    from engines import all_cases
    from engines.common import MAX_CONTEXT

    found = {"grow": (grow, MCL), "round_up": (round_up, MCL)}
    found.update({f"example_{name}": (_example(name), TinyLlamaConfig().max_context_len)
                  for name in sorted(BUILTIN_EXAMPLES)})
    found.update({f"engine_{name}": (_engine(name), MAX_CONTEXT) for name, case in sorted(all_cases().items())
                  if not case.options})
    return found


TARGETS = _targets()
globals().update({name: factory for name, (factory, _) in TARGETS.items()})
