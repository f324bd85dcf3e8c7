"""Render BENCHMARKS.md's tables from the JSON results, so that the document quotes the runs exactly.

    python benchmarks/tables.py decode_loop RESULT.json [RESULT.json ...]
    python benchmarks/tables.py paged_decode RESULT.json
    python benchmarks/tables.py page_table RESULT.json
    python benchmarks/tables.py splits TUNE.json PAGED_DECODE.json

The decode loop's bound is recomputed from each run's copy bandwidth and weight bytes with decode_loop.py's
kv_bytes_per_step (runs made before its off-by-one fix counted one more key per row: < 0.03% of the bytes).
"""

from __future__ import annotations

import argparse
import json

from decode_loop import LLAMA3_8B, kv_bytes_per_step, model_config

VARIANTS = "abef"


def _k(ctx: int) -> str:
    return f"{ctx // 1024}K"


def _header(*cells: str) -> list[str]:
    """A markdown table's header and its right-aligned separator."""
    return ["| " + " | ".join(cells) + " |", "|" + "---:|" * len(cells)]


def decode_loop_table(paths) -> str:
    lines = _header("B", "context", "bound: us/step (tokens/s)", "(a) eager", "(b) stock torch.compile",
                    "(e) syncfree + CUDA graphs", "(f) hand-written CUDA graph", "(e)/(f)")
    for path in paths:
        data = json.load(open(path))
        args = argparse.Namespace(layers=data.get("layers", LLAMA3_8B["layers"]), steps=data["steps"])
        for r in data["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['B']} | {_k(r['ctx'])} | skipped: {r['skipped']} | | | | | |")
                continue
            config = model_config(args, r["B"], [r["ctx"]])
            bound_bytes = data["weight_bytes_per_step"] + kv_bytes_per_step(config, r["B"], r["ctx"], data["steps"])
            bound_us = bound_bytes / (data["copy_tbs"] * 1e12) * 1e6
            cells = [f"{bound_us:.0f} ({r['B'] / bound_us * 1e6:.0f})"]
            for v in VARIANTS:
                if f"{v}_us" in r:
                    cells.append(f"{r[v + '_us']:.0f} us, {r[v + '_tokens_per_s']:.0f} tok/s, "
                                 f"{100 * bound_us / r[v + '_us']:.0f}%")
                else:
                    cells.append(r.get(f"{v}_error", "not run"))
            ratio = f"{r['e_us'] / r['f_us']:.3f}" if "e_us" in r and "f_us" in r else "n/a"
            lines.append(f"| {r['B']} | {_k(r['ctx'])} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def paged_decode_table(path) -> str:
    data = json.load(open(path))
    lines = _header("B", "context", "page", "floor us", "paged_decode us", "% of floor", "eager us", "FA4 us",
                    "FA4/ours", "gather+SDPA us", "max abs err vs FA4")
    for r in data["rows"]:
        fa4 = r.get("fa4_us")
        fa4_cells = f"{fa4:.1f} | {fa4 / r['ours_us']:.2f}x" if fa4 else "n/a | n/a"
        sdpa = f"{r['sdpa_us']:.1f}" if "sdpa_us" in r else "n/a (dense copy too large)"
        lines.append(
            f"| {r['B']} | {_k(r['ctx'])} | {r['page_size']} | {r['floor_us']:.1f} | {r['ours_us']:.1f} | "
            f"{100 * r['ours_share_of_floor']:.0f}% | {r['ours_eager_us']:.1f} | {fa4_cells} | {sdpa} | "
            f"{r['max_abs_err']:.1e} |")
    return "\n".join(lines)


def page_table_table(path) -> str:
    data = json.load(open(path))
    lines = _header("B", "context", "page", "op (graph) us", "TB/s", "% of copy", "op eager us",
                    "gather, m on host (graph) us", "gather + .max().item() (eager) us")
    for r in data["rows"]:
        lines.append(f"| {r['B']} | {_k(r['ctx'])} | {r['page_size']} | {r['op_us']:.1f} | {r['op_tbs']:.2f} | "
                     f"{r['pct_copy']:.0f}% | {r['op_eager_us']:.1f} | {r['gather_us']:.1f} | "
                     f"{r['gather_item_us']:.1f} |")
    flat = data.get("flat", [])
    if flat:
        lines += ["", "| static width (pages) | " + " | ".join(str(f["max_pages"]) for f in flat) + " |",
                  "|---|" + "---:|" * len(flat),
                  "| op (graph) us | " + " | ".join(f"{f['op_us']:.1f}" for f in flat) + " |"]
    return "\n".join(lines)


def splits_table(tune_path, final_path) -> str:
    """What each change bought: the earlier kernel, the new kernel with the earlier launch values, and the
    committed values (the final paged_decode run, where it has the shape)."""
    tune = json.load(open(tune_path))["paged_decode"]["compare"]
    final = {(r["B"], r["ctx"], r["page_size"]): r for r in json.load(open(final_path))["rows"]}
    lines = _header("B", "context", "page", "before (0d72b29) us", "new combine + direct path, earlier splits us",
                    "committed TUNING us (final run)")
    for r in tune:
        f = final.get((r["B"], r["ctx"], r["ps"]))
        committed = f"{f['ours_us']:.1f}" if f else "-"
        lines.append(f"| {r['B']} | {_k(r['ctx'])} | {r['ps']} | {r['old_kernel_us']:.1f} | "
                     f"{r['new_kernel_old_tuning_us']:.1f} | {committed} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("table", choices=["decode_loop", "paged_decode", "page_table", "splits"])
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args()
    if args.table == "decode_loop":
        print(decode_loop_table(args.paths))
    elif args.table == "paged_decode":
        print(paged_decode_table(args.paths[0]))
    elif args.table == "page_table":
        print(page_table_table(args.paths[0]))
    else:
        print(splits_table(*args.paths[:2]))


if __name__ == "__main__":
    main()
