"""
The mechanism each variant's paper claims, measured on the shipped tasks and drawn in one figure (matplotlib is
needed here only, not by grpo.py). It runs what it needs into data/variants/ (git-ignored; ~30 min on 2 CPU cores)
and reuses the runs that finished there, so a second call only redraws:

    python data/mechanisms.py                       # data/mechanisms.png, and its numbers as markdown tables

    GRPO-MA  (a) the spread of a fixed thought's advantage A(th) over fresh draws of its M answers, against
             1/sqrt(M); (b) grad_norm per step over its run's median, and (c) the share of steps above twice
             it, for T4A4 against GRPO with G = 16: 16 scored answers per prompt either way.
    TA-GRPO  (d) frac_reward_zero_std per step and (e) pass@k at the end, on three-digit sums, against GRPO with
             G = 8: 8 samples per question either way (the question and 3 rephrasings, 2 samples each).
    λ-GRPO   (f) how often the target path is sampled on the paper's binary tree, over 250 steps.

    python data/mechanisms.py --real                # SmolLM2-135M-Instruct's time to accuracy (~2.4 h)

The tiny model is bound by Python and kernel launches, so its cost follows decode steps. A real model's follows
tokens, so --real judges the time claims on SmolLM2-135M-Instruct (data/prepare.py smollm2), as curves of greedy
accuracy against training seconds. It first prints the share of GRPO-MA's thoughts that close within 48, 64 and
96 tokens before training. Then it trains 3 seeds of each scheme on one-digit sums (P = 8 questions a step, 10
steps, an eval every 2) into data/variants/smollm2-curves/, with 8 scored answers a question in every run: GRPO
G = 8, GRPO-MA T4A2, TA-GRPO N = 3 G = 2, and GRPO with λ and with dynamic sampling.
Each step's sampling is timed apart from the rest, and its sampled tokens are counted. It prints a table of the
time to greedy 0.75 and of the accuracy at equal time, and draws data/smollm2-curves.png.

Every scheme comes from grpo.py: runs are grpo.main, the tree's loss is grpo.policy_loss with
grpo.group_advantages and grpo.lambda_weights, panel (a) scores with grpo.ma_advantages.
"""

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import grpo  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNS = HERE / "variants" / "mechanisms"
MS = (1, 2, 4, 8)

# -----------------------------------------------------------------------------
# The quantities (each tested in test_grpo.py against a case worked by hand or a known distribution)


def thought_advantage_spread(draw, thought_question, M: int, repeats: int):
    """How much a thought's estimated advantage moves when its M answers are drawn afresh: the variance over
    `repeats` draws of A(th), and of V(th), averaged over the thoughts, as a standard deviation (its square root).
    draw(M) returns the rewards of M new answers to each thought, thought-major; thought_question gives each
    thought's prompt, as in grpo.ma_advantages. The variance is unbiased, so the average over thoughts is too."""
    answer_thought = torch.arange(len(thought_question)).repeat_interleave(M)
    no_cut = torch.zeros(len(thought_question))  # every thought has its M answers, so no cut reward is read
    draws = [grpo.ma_advantages(draw(M), answer_thought, thought_question, no_cut) for _ in range(repeats)]
    spread = lambda values: torch.stack(values).var(0).mean().sqrt().item()
    return spread([a for a, _, _ in draws]), spread([v for _, _, v in draws])


def spike_share(grad_norms, factor: float = 2.0) -> float:
    """The share of steps whose gradient norm exceeds `factor` times the run's median."""
    median = statistics.median(grad_norms)
    return sum(g > factor * median for g in grad_norms) / len(grad_norms)


def binary_tree(n, r_neg, lam, seed, steps=250, lr=1.0, G=16, depth=4, target=(0, 0, 1, 0)):
    """The paper's synthetic tree with a tabular policy (one pair of logits per trie node, plain SGD): emit L/R
    `depth` times; the target path gets 1, other paths sharing its first n tokens get r_neg, the rest 0.7. One
    group of G per step, dapo's weights, divided by |λ| when lam. Returns the share of each step's G samples that
    are the target."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(2 ** depth - 1, 2, requires_grad=True)  # node of prefix p at depth d: 2^d - 1 + p
    opt = torch.optim.SGD([logits], lr=lr)
    target_t, hits = torch.tensor(target), []
    for _ in range(steps):
        with torch.no_grad():
            node, paths = torch.zeros(G, dtype=torch.long), []
            for d in range(depth):
                a = torch.multinomial(logits[node].softmax(-1), 1, generator=g).squeeze(1)
                paths.append(a)
                node = 2 * node + 1 + a
            paths = torch.stack(paths, 1)  # (G, depth)
        prefix, logps = torch.zeros(G, dtype=torch.long), []
        for d in range(depth):
            logps.append(logits[2 ** d - 1 + prefix].log_softmax(-1).gather(1, paths[:, d:d + 1]).squeeze(1))
            prefix = 2 * prefix + paths[:, d]
        logps = torch.stack(logps, 1)
        is_target = (paths == target_t).all(1)
        near = (paths[:, :n] == target_t[:n]).all(1)
        rewards = torch.where(is_target, 1.0, torch.where(near, r_neg, 0.7))
        mask = torch.ones(G, depth)
        weights = grpo.aggregation_weights(mask, "dapo")
        weights = weights * grpo.lambda_weights(paths, mask, torch.zeros(G, dtype=torch.long)) if lam else weights
        advantages = grpo.group_advantages(rewards, torch.zeros(G, dtype=torch.long))
        loss, _ = grpo.policy_loss(logps, logps.detach(), advantages, mask, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hits.append(is_target.float().mean().item())
    return hits


def read_run(folder: Path):
    """A run's metrics.jsonl: its step lines and its eval lines."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "eval" in r]

# -----------------------------------------------------------------------------
# The experiments


def run(name: str, seed: int, flags: list[str]) -> Path:
    """grpo.main with these flags into RUNS/<name>-<seed>; a finished run is reused (--resume)."""
    out = RUNS / f"{name}-{seed}"
    grpo.main(flags + ["--seed", str(seed), "--out", str(out), "--resume", "--log-completions", "0"])
    return out


def model_flags(name: str, prepare_flags: list[str]) -> list[str]:
    """grpo.py flags for a premise-knob model of data/prepare.py, built once into data/variants/<name>."""
    folder = HERE / "variants" / name
    if not (folder / "tiny" / "model.safetensors").exists():
        import data.prepare as prepare
        prepare.main(["--out", str(folder), *prepare_flags])
    return ["--model", str(folder / "tiny"), "--data", str(folder / "train.jsonl"), "--test-data",
            str(folder / "test.jsonl")]


def ma_spread(seed: int, prompts: int = 32, K: int = 4, repeats: int = 32):
    """Panel (a) for one seed: K thoughts for each of `prompts` training questions from the shipped model, the
    prompts whose K thoughts all closed kept; then, at each M, A(th) re-estimated `repeats` times from M fresh
    answers per thought, scored as rollout_ma scores them."""
    cfg = grpo.Config()
    model, tok = grpo.load_model(cfg.model, torch.device("cpu"))
    torch.manual_seed(seed)
    data = grpo.load_jsonl(cfg.data)
    examples = [data[i] for i in torch.randperm(len(data))[:prompts].tolist()]
    ids = [grpo.prompt_ids(tok, cfg, ex["question"]) for ex in examples]
    samples = grpo.generate(model, tok, ids, K, cfg.max_new_tokens, cfg.temperature,
                                       stop_strings=["</think>"])
    th_ids, th_mask = samples.completion_ids, samples.completion_mask
    texts = grpo.decode(tok, th_ids, th_mask)
    keep = [p for p in range(prompts) if all("</think>" in texts[p * K + k] for k in range(K))]
    thoughts = [p * K + k for p in keep for k in range(K)]
    contexts = [ids[t // K] + th_ids[t, :th_mask[t].sum()].tolist() for t in thoughts]
    thought_question = torch.arange(len(keep)).repeat_interleave(K)

    def draw(M):
        answers = grpo.generate(model, tok, contexts, M, cfg.max_answer_tokens, cfg.temperature)
        answer_texts = grpo.decode(tok, answers.completion_ids, answers.completion_mask)
        after = [texts[t] + text for t, text in zip([t for t in thoughts for _ in range(M)], answer_texts)]
        rows = [examples[t // K] for t in thoughts for _ in range(M)]
        return grpo.score_batch(cfg, rows, after, answers.finished)
    return {M: thought_advantage_spread(draw, thought_question, M, repeats) for M in MS}, len(keep)


def experiments(seeds: int):
    """Every run and measurement of the figure; returns what the panels draw."""
    out = {"spread": [ma_spread(s) for s in range(seeds)]}
    ma_base = ["--prompts-per-step", "8", "--eval-every", "0", "--eval-limit", "100"]
    out["ma"] = {name: [read_run(run(name, s, ma_base + flags)) for s in range(5)] for name, flags in {
        "GRPO G=16": ["--num-generations", "16"],
        "GRPO-MA T4A4": ["--variant", "ma", "--num-thoughts", "4", "--num-answers", "4", "--max-new-tokens", "24",
                         "--max-answer-tokens", "8"]}.items()}
    three = model_flags("three-digit", ["--digits", "3"]) + [
        "--lr", "5e-5", "--max-new-tokens", "48", "--eval-samples", "16", "--eval-every", "0"]
    ta = ["--variant", "ta", "--num-rephrasings", "3", "--num-generations", "2"]
    out["ta"] = {name: [read_run(run(name, s, three + flags)) for s in range(seeds)] for name, flags in {
        "GRPO G=8": ["--num-generations", "8"],
        "TA, anchor q0": ta,
        "TA, anchor rephrasing": ta + ["--ta-anchor", "rephrased"]}.items()}
    out["tree"] = {lam: [binary_tree(1, -1.0, lam, s) for s in range(20)] for lam in (False, True)}
    return out

# -----------------------------------------------------------------------------
# The real model: time to accuracy on SmolLM2-135M-Instruct, token-bound where the tiny model is launch-bound

TARGET = 0.75  # the greedy accuracy on the 24 test sums that each run's time is measured to
THOUGHT_LIMITS = (48, 64, 96)  # the thought limits whose closed share is measured before training
SMOLLM2 = ["--model", str(HERE / "smollm2"), "--data", str(HERE / "sums" / "train.jsonl"), "--test-data",
           str(HERE / "sums" / "test.jsonl"), "--response-prefix", "<think>", "--reward-fn",
           f"{HERE / 'rewards.py'}:last_number", "--prompts-per-step", "8", "--lr", "1e-5", "--warmup-steps", "0",
           "--steps", "10", "--eval-every", "2", "--eval-samples", "2", "--save-every", "0"]
# 8 scored answers a question in every run; GRPO's completion may be as long as GRPO-MA's thought and answer.
# A thought closes within 48 tokens or not within 96 (closed_share), so 48 costs least.
THOUGHT, ANSWER = 48, 16
GRPO = ["--num-generations", "8", "--max-new-tokens", str(THOUGHT + ANSWER)]
MA = ["--variant", "ma", "--num-thoughts", "4", "--num-answers", "2", "--max-new-tokens", str(THOUGHT),
      "--max-answer-tokens", str(ANSWER)]
TA = ["--variant", "ta", "--num-rephrasings", "3", "--num-generations", "2", "--max-new-tokens", str(THOUGHT + ANSWER)]
CURVES = {"GRPO G=8": GRPO, "GRPO-MA T4A2": MA, "TA-GRPO N=3 G=2": TA, "GRPO G=8 + λ": GRPO + ["--lambda-weights"],
          "GRPO G=8 + dynamic sampling": GRPO + ["--dynamic-sampling", "--max-gen-batches", "2"]}
# GRPO-MA and TA-GRPO with λ would take another ~50 min beyond the 2.5 h budget: pass runs=COMBINED to add them
COMBINED = {"GRPO-MA T4A2 + λ": MA + ["--lambda-weights"], "TA-GRPO N=3 G=2 + λ": TA + ["--lambda-weights"]}
PAPERS = {"GRPO-MA T4A2": "T4A4 as good as T16A1 in 40% less training time",
          "TA-GRPO N=3 G=2": "pass@32 +4.97 over GRPO (Qwen3-1.7B)",
          "GRPO G=8 + λ": "peak validation accuracy in under half the steps"}


def closed_share(limits=THOUGHT_LIMITS, K: int = 4, seed: int = 0, folder=HERE / "smollm2",
                 data=HERE / "sums" / "train.jsonl") -> dict:
    """The share of GRPO-MA's thoughts that close within each limit, before training: K thoughts of every
    training question after the prefix <think>, sampled at T = 1 with the longest limit. A thought closes within a
    limit if it ends on </think> with at most that many tokens, which is what a shorter limit would have kept."""
    cfg = grpo.Config(model=str(folder), response_prefix="<think>")
    model, tok = grpo.load_model(cfg.model, torch.device("cpu"))
    prompts = [grpo.prompt_ids(tok, cfg, ex["question"]) for ex in grpo.load_jsonl(data)]
    torch.manual_seed(seed)
    s = grpo.generate(model, tok, prompts, K, max(limits), stop_strings=["</think>"])
    closed = torch.tensor(["</think>" in t for t in grpo.decode(tok, s.completion_ids, s.completion_mask)])
    lengths = s.completion_mask.sum(1)
    return {limit: (closed & (lengths <= limit)).float().mean().item() for limit in limits}


@contextlib.contextmanager
def sampling_log(path: Path):
    """While open, each step of grpo.train appends a line to `path`: its step, the seconds its rollouts took
    (sampling, decoding and scoring), the tokens they sampled and the tokens of the rows that train. grpo.py logs
    only time/step, so the rest of the step, the weights and the update, is time/step minus these seconds. The
    line is written when the loop weighs the step's rows, and the step is read from the run's metrics.jsonl
    beside `path`, which holds one line for each step done, so a resumed step has the step it had."""
    rollouts, batch_weights, seconds, sampled = dict(grpo.ROLLOUTS), grpo.batch_weights, [], []

    def timed(rollout):
        def call(*args):
            t = time.perf_counter()
            rows, metrics = rollout(*args)
            seconds.append(time.perf_counter() - t)
            sampled.append(int(rows.completion_mask.sum()))
            return rows, metrics
        return call

    def weights(rows, cfg, table):
        done = sum('"lr"' in line for line in (path.parent / "metrics.jsonl").read_text().splitlines())
        line = {"step": done + 1, "sample_s": sum(seconds), "sampled": sum(sampled),
                "trained": int(rows.completion_mask.sum())}
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        seconds.clear()
        sampled.clear()
        return batch_weights(rows, cfg, table)
    grpo.ROLLOUTS.update({name: timed(rollout) for name, rollout in rollouts.items()})
    grpo.batch_weights = weights
    try:
        yield
    finally:
        grpo.ROLLOUTS.update(rollouts)
        grpo.batch_weights = batch_weights


def read_real_run(folder: Path):
    """A run's step lines, each with its sampling line (the last one of its step, as a resume repeats steps),
    and its eval lines."""
    steps, evals = read_run(folder)
    sampling = {}
    for record in map(json.loads, (folder / "sampling.jsonl").read_text().splitlines()):
        sampling[record["step"]] = record
    return [r | sampling[r["step"]] for r in steps], evals


def real_experiments(seeds: int, runs=None, base=SMOLLM2, root=RUNS.parent / "smollm2-curves"):
    """Every run of the curves, every scheme for seed 0 first, into data/variants/smollm2-curves/. A finished run
    is reused, and one that was cut off resumes from its last checkpoint."""
    out = {name: [] for name in (runs or CURVES)}
    for seed in range(seeds):  # seed by seed, so that a run cut short still compares every scheme
        for name, flags in (runs or CURVES).items():
            folder = root / f"{name.replace(' ', '_')}-{seed}"
            folder.mkdir(parents=True, exist_ok=True)
            with sampling_log(folder / "sampling.jsonl"):
                grpo.main(base + flags + ["--seed", str(seed), "--out", str(folder), "--resume",
                                          "--log-completions", "0"])
            out[name].append(read_real_run(folder))
    return out


class Point(NamedTuple):
    """A run at one of its evals: the steps done, the training seconds (time/step summed over those steps, the
    evals left out) and the tokens sampled up to it, and the eval's greedy accuracy and pass@1."""
    step: int
    seconds: float
    tokens: int
    greedy: float
    pass1: float


def curve(steps, evals) -> list[Point]:
    """A run's eval points, in order, from the step lines (with their sampling lines) and the eval lines."""
    points = []
    for e in evals:
        done = [r for r in steps if r["step"] <= e["step"]]
        points.append(Point(e["step"], sum(r["time/step"] for r in done), sum(r["sampled"] for r in done),
                            e["eval"]["greedy"], e["eval"]["pass@1"]))
    return points


def time_to(points, target: float = TARGET):
    """The first point whose greedy accuracy reaches the target, or None for a run that never reaches it."""
    return next((p for p in points if p.greedy >= target), None)


def at_time(points, seconds: float) -> Point:
    """The last point at or before that many training seconds: what the run had reached by then."""
    return [p for p in points if p.seconds <= seconds][-1]


def median_or_none(values):
    """The median of values in which None (a run that never got there) counts as larger than any number: None
    if the middle run never got there."""
    ranked = sorted(values, key=lambda v: math.inf if v is None else v)
    middle = ranked[(len(ranked) - 1) // 2:len(ranked) // 2 + 1]
    return None if None in middle else statistics.mean(middle)


def curves_table(out, target: float = TARGET) -> str:
    """The time-to-accuracy table: for each scheme, how many runs reached the target greedy accuracy, the median
    training seconds and tokens sampled to it, each run's accuracy at the same training time (the shortest run's
    whole training time, so every run has a curve up to it), the accuracy at the end and the median step."""
    curves = {name: [curve(*run) for run in runs] for name, runs in out.items()}
    equal = min(c[-1].seconds for runs in curves.values() for c in runs)
    fmt = lambda v, f: "not reached" if v is None else format(v, f)
    lines = [f"Training seconds exclude the evals. Equal time: {equal:.0f} s, the shortest run's whole training.",
             "", f"| scheme | runs that reach greedy {target} | median s to it | median tokens to it | greedy at "
             f"{equal:.0f} s | pass@1 at {equal:.0f} s | greedy at the end | pass@1 at the end | s a step | "
             "the paper's figure |", "|---|" + "---|" * 9]
    for name, runs in curves.items():
        reached = [time_to(c, target) for c in runs]
        at, end = [at_time(c, equal) for c in runs], [c[-1] for c in runs]
        step_s = [statistics.median(r["time/step"] for r in steps) for steps, _ in out[name]]
        lines.append(f"| {name} | {sum(p is not None for p in reached)} of {len(runs)} | "
                     f"{fmt(median_or_none([p and p.seconds for p in reached]), '.0f')} | "
                     f"{fmt(median_or_none([p and p.tokens for p in reached]), ',.0f')} | "
                     f"{mean_sd([p.greedy for p in at])} | {mean_sd([p.pass1 for p in at])} | "
                     f"{mean_sd([p.greedy for p in end])} | {mean_sd([p.pass1 for p in end])} | "
                     f"{mean_sd(step_s, '.1f')} | {PAPERS.get(name, '')} |")
    before = [c[0] for runs in curves.values() for c in runs]
    lines.append(f"- before training: greedy {mean_sd([p.greedy for p in before])}, pass@1 "
                 f"{mean_sd([p.pass1 for p in before])}")
    for name, runs in curves.items():
        lines.append(f"- {name}: seconds to greedy {target} by seed: " + ", ".join(
            fmt(p and p.seconds, ".0f") for p in (time_to(c, target) for c in runs)))
    return "\n".join(lines)


def draw_curves(out, path: Path, target: float = TARGET):
    """Greedy accuracy against training seconds, a colour per scheme: each seed a thin line, and the median over
    seeds at each eval (of the seconds and of the accuracy) a thick one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (name, runs) in enumerate(out.items()):
        curves = [curve(*run) for run in runs]
        color = f"C{i}"
        for c in curves:
            ax.plot([p.seconds for p in c], [p.greedy for p in c], color=color, alpha=0.3, lw=0.8)
        ax.plot([statistics.median(p.seconds for p in ps) for ps in zip(*curves)],
                [statistics.median(p.greedy for p in ps) for ps in zip(*curves)], color=color, lw=2.5, label=name)
    ax.axhline(target, color="k", ls=":", lw=1)
    ax.set(xlabel="training seconds (2 CPU cores; evals left out)", ylabel="greedy accuracy, 24 test sums",
           ylim=(0, 1), title="SmolLM2-135M-Instruct on one-digit sums: thin, each seed; thick, the median")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)

# -----------------------------------------------------------------------------
# The figure and its numbers


def moving_average(values, n=5):
    return [statistics.mean(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


def mean_sd(xs, f=".3f"):
    return f"{statistics.mean(xs):{f}} ± {statistics.stdev(xs):{f}}" if len(xs) > 1 else f"{xs[0]:{f}}"


def tables(out) -> str:
    """The figure's numbers: mean ± standard deviation over seeds (the spread of seeds, not an error of the mean)."""
    lines = ["(a) spread of A(th) over fresh answers, mean over thoughts; seeds: " + ", ".join(
        f"{kept} prompts × 4 thoughts" for _, kept in out["spread"]),
        "| M | spread of A(th) | × sqrt(M) | spread of V(th) | × sqrt(M) |", "|---|---|---|---|---|"]
    for M in MS:
        a, v = [s[M][0] for s, _ in out["spread"]], [s[M][1] for s, _ in out["spread"]]
        lines.append(f"| {M} | {mean_sd(a)} | {mean_sd([x * M ** 0.5 for x in a])} | {mean_sd(v)} | "
                     f"{mean_sd([x * M ** 0.5 for x in v])} |")
    lines += ["", "(b, c) 100 steps, P = 8, 5 seeds", "| run | median grad_norm | share of steps > 2 × median | "
              "max / median | pass@1 before → after |", "|---|---|---|---|---|"]
    for name, runs in out["ma"].items():
        norms = [[r["grad_norm"] for r in steps] for steps, _ in runs]
        lines.append(f"| {name} | {mean_sd([statistics.median(n) for n in norms])} | "
                     f"{mean_sd([spike_share(n) for n in norms])} | "
                     f"{mean_sd([max(n) / statistics.median(n) for n in norms])} | "
                     f"{mean_sd([e[0]['eval']['pass@1'] for _, e in runs])} → "
                     f"{mean_sd([e[-1]['eval']['pass@1'] for _, e in runs])} |")
    ks = (1, 2, 4, 8, 16)
    lines += ["", "(d, e) three-digit sums, lr 5e-5, 100 steps, 3 seeds", "| run | frac_reward_zero_std, mean over "
              "steps | " + " | ".join(f"pass@{k} after" for k in ks) + " |", "|---|---|" + "---|" * len(ks)]
    base = [e[0]["eval"] for runs in out["ta"].values() for _, e in runs][0]
    lines.append("| before | | " + " | ".join(f"{base[f'pass@{k}']:.3f}" for k in ks) + " |")
    for name, runs in out["ta"].items():
        zero = [statistics.mean(r["frac_reward_zero_std"] for r in steps) for steps, _ in runs]
        lines.append(f"| {name} | {mean_sd(zero)} | " + " | ".join(
            mean_sd([e[-1]["eval"][f"pass@{k}"] for _, e in runs]) for k in ks) + " |")
    lines += ["", "(f) binary tree, n = 1, r_neg = -1, lr 1, G = 16, 20 seeds", "| run | target share, steps 1-50 | "
              "last 50 | seeds above 0.5 over the last 50 |", "|---|---|---|---|"]
    for lam, runs in out["tree"].items():
        last = [statistics.mean(h[-50:]) for h in runs]
        lines.append(f"| {'λ-GRPO' if lam else 'GRPO'} | {mean_sd([statistics.mean(h[:50]) for h in runs])} | "
                     f"{mean_sd(last)} | {sum(x > 0.5 for x in last)} of {len(runs)} |")
    return "\n".join(lines)


def band(ax, curves, label, color, x=None):
    """The mean over seeds, with the seeds' range shaded."""
    x = x or list(range(1, len(curves[0]) + 1))
    mean = [statistics.mean(c) for c in zip(*curves)]
    ax.fill_between(x, [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)], color=color, alpha=0.2)
    ax.plot(x, mean, color=color, label=label)


def draw(out, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    (a, b, c), (d, e, f) = axes
    for j, (name, color) in enumerate((("A(th), the advantage", "C0"), ("V(th), the mean reward", "C2"))):
        for i, (seed, _) in enumerate(out["spread"]):
            a.plot(MS, [seed[M][j] for M in MS], marker="o", color=color, label=name if i == 0 else None)
        first = statistics.mean(s[1][j] for s, _ in out["spread"])
        a.plot(MS, [first / M ** 0.5 for M in MS], "--", color=color, lw=1, label="1/√M from M = 1")
    a.set(xscale="log", yscale="log", xticks=MS, xlabel="answers per thought M", ylabel="spread over fresh answers",
          title="(a) GRPO-MA: a thought's estimate, 3 seeds")
    a.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    a.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    for color, (name, runs) in zip(("C1", "C0"), out["ma"].items()):
        norms = [[r["grad_norm"] / statistics.median(x["grad_norm"] for x in steps) for r in steps]
                 for steps, _ in runs]
        for i, n in enumerate(norms):
            b.plot(range(1, len(n) + 1), n, color=color, alpha=0.5, lw=0.8, label=name if i == 0 else None)
        shares = [spike_share([r["grad_norm"] for r in steps]) for steps, _ in runs]
        c.bar(name, statistics.mean(shares), color=color, alpha=0.4)
        c.plot([name] * len(shares), shares, "o", color=color)
    b.axhline(2, color="k", ls=":", lw=1)
    b.set(xlabel="step", ylabel="grad_norm / the run's median", title="(b) GRPO-MA vs GRPO: gradient norms, 5 seeds")
    c.set(ylabel="share of steps with grad_norm > 2 × median", title="(c) spikes per run (dots: seeds)")
    ks = (1, 2, 4, 8, 16)
    for color, (name, runs) in zip(("C1", "C0", "C2"), out["ta"].items()):
        band(d, [moving_average([r["frac_reward_zero_std"] for r in steps]) for steps, _ in runs], name, color)
        after = [[e[-1]["eval"][f"pass@{k}"] for k in ks] for _, e in runs]
        band(e, after, name, color, x=list(ks))
    e.plot(ks, [out["ta"]["GRPO G=8"][0][1][0]["eval"][f"pass@{k}"] for k in ks], "k:", label="before")
    d.set(xlabel="step", ylabel="frac_reward_zero_std (5-step mean)", ylim=(0, 1),
          title="(d) TA-GRPO vs GRPO: groups without signal")
    e.set(xscale="log", xticks=ks, xticklabels=ks, xlabel="k", ylabel="pass@k after 100 steps", ylim=(0, 1),
          title="(e) TA-GRPO vs GRPO: pass@k, three-digit sums")
    for color, (lam, runs) in zip(("C1", "C0"), out["tree"].items()):
        curves = [moving_average(h, 10) for h in runs]
        for curve in curves:
            f.plot(range(1, len(curve) + 1), curve, color=color, alpha=0.15, lw=0.8)
        f.plot(range(1, len(curves[0]) + 1), [statistics.mean(c) for c in zip(*curves)], color=color, lw=2,
               label=f"{'λ-GRPO' if lam else 'GRPO'}: the mean; thin, each seed")
    f.set(xlabel="step", ylabel="share of samples on the target (10-step mean)", ylim=(0, 1),
          title="(f) λ-GRPO vs GRPO: the binary tree, 20 seeds")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8) if ax is not c else None
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Measure each paper's mechanism and draw data/mechanisms.png.")
    parser.add_argument("--out", default=str(HERE / "mechanisms.png"))
    parser.add_argument("--seeds", type=int, default=3, help="seeds of panels (a), (d) and (e), or of --real")
    parser.add_argument("--real", action="store_true", help="instead, SmolLM2-135M-Instruct's time to accuracy "
                        "(after data/prepare.py smollm2): 15 runs, ~2.4 h on 2 cores, and data/smollm2-curves.png")
    args = parser.parse_args(argv)
    if args.real:
        shares = closed_share()
        print("thoughts closed before training: " + ", ".join(f"{shares[n]:.3f} within {n} tokens" for n in shares))
        out = real_experiments(args.seeds)
        print(curves_table(out))
        draw_curves(out, HERE / "smollm2-curves.png")
        print(f"wrote {HERE / 'smollm2-curves.png'}")
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("mechanisms.py: error: needs matplotlib (pip install matplotlib)")
    out = experiments(args.seeds)
    print(tables(out))
    draw(out, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
