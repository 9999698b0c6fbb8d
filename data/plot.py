"""
Plot learning curves from runs' metrics.jsonl files (matplotlib is needed here only, not by grpo.py):

    python data/plot.py --out data/curves.png --title "default task" grpo=out/grpo ma=out/ma ta=out/ta lambda=out/lambda
    python data/plot.py --out data/curves.png default:grpo=out/grpo ... smollm2:grpo=out/smol

Each argument is [panel:]label=run_folder. One panel per name before ':' (default: one panel); in each, held-out
pass@1 (solid) at every eval step and the batch reward (dotted, its moving average over 5 steps) per label.
"""

import argparse
import json
import sys
from pathlib import Path


def read(folder: Path):
    """(eval step, pass@1) and (step, batch reward) of one run."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"plot.py: error: {path}: no such metrics file")
    evals, rewards = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            sys.exit(f"plot.py: error: {path}:{number}: not a JSON line")
        if record.get("eval"):
            evals.append((record["step"], record["eval"]["pass@1"]))
        elif record.get("reward") is not None:
            rewards.append((record["step"], record["reward"]))
    return evals, rewards


def moving_average(values: list[float], n: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - n + 1):i + 1]
        out.append(sum(window) / len(window))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description="Plot pass@1 and reward over steps from metrics.jsonl files.")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--title", default="", help="a title over the panels")
    parser.add_argument("runs", nargs="+", help="[panel:]label=run_folder")
    args = parser.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py: error: needs matplotlib (pip install matplotlib)")
    panels = {}
    for spec in args.runs:
        if "=" not in spec:
            sys.exit(f"plot.py: error: {spec!r} is not [panel:]label=run_folder")
        name, folder = spec.split("=", 1)
        panel, _, label = name.rpartition(":")
        panels.setdefault(panel, []).append((label, Path(folder)))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    colors = {}  # one colour per label, the same in every panel
    for ax, (panel, runs) in zip(axes[0], panels.items()):
        for label, folder in runs:
            evals, rewards = read(folder)
            color = colors.setdefault(label, f"C{len(colors)}")
            ax.plot([s for s, _ in evals], [p for _, p in evals], marker="o", color=color, label=f"{label} pass@1")
            if rewards:
                smooth = moving_average([r for _, r in rewards])
                ax.plot([s for s, _ in rewards], smooth, linestyle=":", color=color, label=f"{label} reward")
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
