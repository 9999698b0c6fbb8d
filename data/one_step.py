"""
One step of each scheme, seen: the rows that one seeded step of the shipped tiny model trains, and the weight of
each of their tokens in the loss (matplotlib is needed here only, not by grpo.py):

    python data/one_step.py            # draws data/one-step.png and prints the numbers it draws

Each panel is one question's rows, made by grpo.py's own functions in the order train calls them: the rollout,
part_counts, batch_weights and lambda_rows. A row is a line of tokens. At μ = 1 the loss is -Σ_it w_it A_i log π,
so a token's cell is coloured by its coefficient c_it = w_it A_i: red where the step pushes the token's log-prob
up, blue where it pushes it down. The number under a token is |λ(i,t)|, the rows of its context that share its
prefix up to that token; λ-GRPO divides w by it. At a row's left stand the context it trains in, its reward r (a
GRPO-MA thought's value V) and its advantage A.
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import grpo  # noqa: E402

HERE = Path(__file__).resolve().parent
# The question and the seed: a sum with a carry, which the tiny model forgets often enough to give every panel a
# group with signal. Each panel samples one question.
QUESTION = 0
SEED = 3
PANELS = {  # title: the flags of its step
    "GRPO: G = 4 completions of q": dict(variant="grpo", num_generations=4),
    "GRPO-MA: K = 3 thoughts of q, M = 2 answers to each": dict(variant="ma", num_thoughts=3, num_answers=2),
    "TA-GRPO: q0 and N = 1 rephrasing, G = 3 each; every row trains given q0":
        dict(variant="ta", num_rephrasings=1, num_generations=3),
    "GRPO + λ: the rows of the first panel, each w divided by |λ|":
        dict(variant="grpo", num_generations=4, lambda_weights=True),
}


class Row(NamedTuple):
    """One row of a panel, as drawn."""
    index: int            # its place in the Rows of the step
    label: str            # the context it trains in, and what it is
    outcome: float        # r, or V for a GRPO-MA thought
    advantage: float      # A
    weight: float         # w of its tokens, before λ divides it
    tokens: list          # its completion's tokens, as text
    coefficients: list    # w_it A_i of each token
    lambdas: list         # |λ(i,t)| of each token
    start: int            # the column of its first token: a GRPO-MA answer starts where its thought ends
    group: int            # rows of one group are drawn together: a phrasing under ta, a thought's tree under ma


def one_step(model, tokenizer, cfg, examples):
    """Train's blocks 1 and 2 in one process: the rollout, each token's w, then λ's. It returns the Rows and each
    completion token's |λ| (B by C, 0 off the mask)."""
    torch.manual_seed(cfg.seed)
    rows, _ = grpo.ROLLOUTS[cfg.variant](model, tokenizer, cfg, examples)
    counts = grpo.part_counts(rows)  # in one process, the whole batch's counts
    rows = replace(rows, loss_weights=grpo.batch_weights(rows, cfg, counts))
    rows, lambdas = grpo.lambda_rows(rows, cfg.lambda_weights)
    per_token = torch.zeros(rows.completion_mask.shape)
    per_token[rows.completion_mask.bool()] = lambdas
    return rows, per_token


def completion(rows, i) -> list:
    """Row i's completion ids, without padding."""
    return rows.completion_ids[i][rows.completion_mask[i].bool()].tolist()


def layout(rows, cfg, tokenizer):
    """(row index, label, start column, group) in the order drawn. GRPO-MA's rows come from the rollout as its K
    thoughts, then M answers to each closed thought in order; they are drawn as a tree, each thought above its
    answers. TA-GRPO's come phrasing by phrasing, G at a time."""
    B = len(rows.contexts)
    if cfg.variant == "grpo":
        return [(i, f"q | completion {i}", 0, 0) for i in range(B)]
    if cfg.variant == "ta":
        G = cfg.num_generations
        return [(i, f"{'q0' if i < G else f'q{i // G}'} asked, trained given "
                    f"{'q0' if rows.context_swapped[i] or i < G else f'q{i // G}'}", 0, i // G) for i in range(B)]
    K, M, drawn = cfg.num_thoughts, cfg.num_answers, []
    closed = [k for k in range(K) if "</think>" in tokenizer.decode(completion(rows, k))]
    for k in range(K):
        drawn.append((k, f"q | thought {k}", 0, k))
        if k in closed:
            first = K + closed.index(k) * M  # the rollout's order: answers to the j-th closed thought
            length = len(completion(rows, k))
            drawn += [(first + m, f"q + thought {k} | answer {m}", length, k) for m in range(M)]
    return drawn


def table(model, tokenizer, examples):
    """{panel title: [Row, ...]}: the numbers the figure draws, from one seeded step per panel."""
    panels = {}
    for title, flags in PANELS.items():
        cfg = grpo.Config(seed=SEED, **flags)
        rows, lambdas = one_step(model, tokenizer, cfg, [examples[QUESTION]])
        coefficients = rows.loss_weights * rows.advantages[:, None]  # (B, C): w_it A_i
        weights = rows.loss_weights * lambdas if cfg.lambda_weights else rows.loss_weights  # before λ
        on = rows.completion_mask.bool()
        panels[title] = [
            Row(i, label, rows.outcomes[i].item(), rows.advantages[i].item(), weights[i, 0].item(),
                [tokenizer.decode([t]) for t in completion(rows, i)], coefficients[i][on[i]].tolist(),
                lambdas[i][on[i]].tolist(), start, group)
            for i, label, start, group in layout(rows, cfg, tokenizer)]
    return panels


SHORT = {"<think>": "<t>", "</think>": "</t>", "<answer>": "<a>", "</answer>": "</a>"}


def draw(panels, path, question):
    """One panel per scheme: each row a line of cells, coloured by w·A on the panel's own scale, so that a panel's
    largest coefficient, whichever scheme it is, is the deepest colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = matplotlib.colormaps["RdBu_r"]
    heights = [len(rows) + 1.2 for rows in panels.values()]
    width = max(row.start + len(row.tokens) for rows in panels.values() for row in rows)
    figure, axes = plt.subplots(len(panels), 1, figsize=(3.4 + 0.36 * width, 0.42 * sum(heights) + 0.8),
                                gridspec_kw={"height_ratios": heights})
    figure.suptitle(f"One step of each scheme on the tiny model, q = {question['question']} (answer "
                    f"{question['answer']}). A cell is a completion token, coloured by w·A, its coefficient on "
                    "log π in the loss\n(red: the step pushes the token up, blue: down). The small number under it "
                    "is |λ(i,t)|, the rows sampled after its row's context (equal token ids) that share its prefix up "
                    "to it:\nso the answers to two equal thoughts count together, and a row that trains given another "
                    "context than it was sampled after (TA-GRPO's rows asked as q1) counts 1.", fontsize=10, x=0.01,
                    y=0.995, ha="left")
    figure.subplots_adjust(top=0.92, hspace=0.3)
    for ax, (title, rows) in zip(axes, panels.items()):
        scale = max(abs(c) for row in rows for c in row.coefficients)
        norm = matplotlib.colors.TwoSlopeNorm(0, -scale, scale)
        figure.colorbar(matplotlib.cm.ScalarMappable(norm, colours), ax=ax, pad=0.01, aspect=8, label="w·A")
        ax.set_title(title, loc="left", fontsize=11, fontweight="bold")
        for y, row in enumerate(rows):
            if y and row.group != rows[y - 1].group:  # a new phrasing, or a new thought's tree
                ax.axhline(y - 0.5, color="0.6", lw=0.6)
            name = "V" if row.label.endswith(tuple(f"thought {k}" for k in range(10))) else "r"
            ax.text(-0.3, y, f"{row.label}   {name} {row.outcome:.2f}   A {row.advantage:+.2f}   "
                    f"w 1/{1 / row.weight:.0f}", ha="right", va="center", fontsize=9, family="monospace")
            if row.start:  # a GRPO-MA answer continues its thought, drawn above it: join them
                thought = next(t for t in range(y) if rows[t].group == row.group)
                ax.plot([row.start - 0.3, row.start - 0.3, row.start], [thought + 0.45, y, y], color="0.4", lw=0.8)
            for x, (token, c, lam) in enumerate(zip(row.tokens, row.coefficients, row.lambdas), row.start):
                ax.add_patch(plt.Rectangle((x, y - 0.45), 0.95, 0.9, color=colours(norm(c))))
                ink = "white" if abs(norm(c) - 0.5) > 0.35 else "black"  # legible on a deep colour
                short = SHORT.get(token, token if len(token) == 1 else token.strip("<>|"))
                ax.text(x + 0.47, y - 0.1, short, ha="center", va="center", family="monospace",
                        fontsize=9 if len(short) == 1 else 6, color=ink)
                ax.text(x + 0.47, y + 0.3, f"{lam:.0f}", ha="center", va="center", fontsize=6.5, color=ink)
        ax.set_xlim(-0.2, width)
        ax.set_ylim(len(rows) - 0.5, -0.6)
        ax.axis("off")
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "one-step.png"))
    args = parser.parse_args(argv)
    model, tokenizer = grpo.load_model(str(HERE / "tiny"), torch.device("cpu"))
    examples = grpo.load_jsonl(HERE / "train.jsonl")
    panels = table(model, tokenizer, examples)
    for title, rows in panels.items():
        print(f"\n{title}")
        for row in rows:
            print(f"  {row.label:28s} r/V {row.outcome:5.2f}  A {row.advantage:+.3f}  Σ w·A "
                  f"{sum(row.coefficients):+.4f}  {''.join(row.tokens)}")
    draw(panels, args.out, examples[QUESTION])
    print(f"\nwrote {args.out}")
    return panels


if __name__ == "__main__":
    main()
