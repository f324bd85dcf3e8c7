"""Plot tokens/s against context from decode_loop.py's JSON results (needs matplotlib: pip install matplotlib).

    python benchmarks/plot_decode_loop.py RESULT.json [RESULT.json ...] --out decode_loop.png [--batches 1 64]

One panel per batch size: tokens/s of (a) eager, (b) stock torch.compile, (e) syncfree + CUDA graphs and
(f) the hand-written CUDA graph, and the bandwidth bound's tokens/s, against the prompt context (log scale).
"""

from __future__ import annotations

import argparse
import json

VARIANTS = {"a": "(a) eager, .max().item()", "b": "(b) stock torch.compile",
            "e": "(e) syncfree + CUDA graphs", "f": "(f) hand-written CUDA graph"}
# (e) and (f) nearly coincide: (f) is drawn dotted with crosses over (e)'s line.
STYLE = {"a": dict(marker="o"), "b": dict(marker="o"), "e": dict(marker="o", linewidth=3, alpha=0.6),
         "f": dict(marker="x", linestyle=":", color="black")}


def load_rows(paths) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += [r for r in data["rows"] if "skipped" not in r]
    return rows


def series(rows, batch: int, key: str) -> tuple[list[int], list[float]]:
    """(contexts, values) of one batch size, sorted by context; rows without the key are left out."""
    points = sorted((r["ctx"], r[key]) for r in rows if r["B"] == batch and key in r)
    return [c for c, _ in points], [v for _, v in points]


def plot(rows, batches, out: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        ctx, bound = series(rows, batch, "bound_tokens_per_s")
        if not ctx:
            raise SystemExit(f"no rows for B={batch} in the results")
        ax.plot(ctx, bound, "--", color="gray", label="bandwidth bound")
        for variant, label in VARIANTS.items():
            xs, ys = series(rows, batch, f"{variant}_tokens_per_s")
            if xs:
                ax.plot(xs, ys, label=label, **STYLE[variant])
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [f"{c // 1024}K" for c in ctx])
        ax.set_xlabel("prompt context (tokens)")
        ax.set_ylabel("tokens/s (whole batch)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"B={batch}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    plot(load_rows(args.results), args.batches, args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
