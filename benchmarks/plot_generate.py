"""Plot decode ms/step against the floor per path, from bench_generate.py JSON results (later files win per cell).

    python3 benchmarks/plot_generate.py OUT.png RESULT.json [RESULT.json ...]
"""

from __future__ import annotations

import json
import sys

STYLE = {"hf": ("transformers generate", "tab:gray"), "experts_impl": ('experts_implementation="moecomp"', "tab:olive"),
         "optimize_hf": ("optimize + transformers' loop", "tab:blue"),
         "hf_static": ("static cache, torch.compile (reduce-overhead)", "tab:brown"),
         "hf_static_moecomp": ("static cache, backend=moecomp", "tab:purple"),
         "optimize_static": ("optimize + static cache (compile)", "tab:pink"),
         "one_liner": ("optimize + generate() (moecomp)", "tab:red")}


def load(paths: list[str]) -> tuple[dict, dict]:
    rows, floors = {}, {}
    for p in paths:
        r = json.load(open(p))
        for x in r["rows"]:
            if "error" not in x and x["path"] in STYLE:
                rows[(x["model"], x["batch"], x["path"])] = x
        for f in r.get("floors", []):
            floors[(f["model"], f["batch"])] = f["decode_ms"]
    return rows, floors


def main(argv):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, paths = argv[0], argv[1:]
    rows, floors = load(paths)
    models = sorted({m for m, _, _ in rows}, key=lambda m: ["qwen3", "qwen2", "mixtral", "deepseek"].index(m)
                    if m in ("qwen3", "qwen2", "mixtral", "deepseek") else 9)
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False)
    for ax, m in zip(axes[0], models):
        batches = sorted({b for mm, b, _ in rows if mm == m})
        for path, (label, color) in STYLE.items():
            pts = [(b, rows[(m, b, path)]["decode_ms"]) for b in batches if (m, b, path) in rows]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label,
                        lw=2.5 if path == "one_liner" else 1.2, ms=4)
        fl = [(b, floors[(m, b)]) for b in batches if (m, b) in floors]
        if fl:
            ax.plot([p[0] for p in fl], [p[1] for p in fl], "k--", label="floor (bytes / copy rate)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.set_ylabel("decode ms / step")
        ax.set_title(m)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("generate() decode step on one H200, bf16 (prompt 512, 64 new tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
