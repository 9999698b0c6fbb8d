"""
grpo.py: GRPO and three recent variants of it, in one file you can read top to bottom.

    python grpo.py                      # GRPO (--loss-type dapo) on data/tiny (CPU, offline, ~28 s)
    python grpo.py --variant lambda     # or ma, ta
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data my_train.jsonl \\
        --test-data my_test.jsonl --max-new-tokens 512 --lr 1e-6    # one GPU, bf16 autocast
    torchrun --nproc_per_node=8 grpo.py ...   # data parallel: each rank samples its share
    python grpo.py --resume ...         # one command starts a run, continues it, or finds it done

The variants differ only in how completions are sampled and how advantages and token weights are
filled in; the sampler, the log-prob pass and the loss are shared. Their objectives (the loss is
-J), with ρ_t = π(o_t | c, o_<t) / π_old(o_t | c, o_<t), |o| the length of completion o, and
f(ρ, A) = min(ρ A, clip(ρ, 1-ε, 1+ε_high) A) - β KL_t (Schulman's k3 estimator of the KL to a frozen
reference, exp(ref - logp) - (ref - logp) - 1):

  grpo    GRPO (DeepSeekMath, arXiv 2402.03300): G completions o_i per prompt, A_i = r_i normalised
          within the group; J = 1/(P G) Σ_i 1/|o_i| Σ_t f(ρ_it, A_i) (--loss-type grpo); the
          default, dapo (arXiv 2503.14476), is one token mean over the batch: Σ_i Σ_t f / Σ_i |o_i|.
  lambda  λ-GRPO (arXiv 2509.21154): the same with each f(ρ_it, A_i) divided by |λ(i,t)|, the
          number of completions of the group that share o_i's prefix up to and including t.
  ma      GRPO-MA (arXiv 2509.24494): K thoughts th_k per prompt, M answers a_kj per thought; V_k
          (the mean reward of th_k's answers) normalised over the K, r_kj over all K*M;
          J = J(thoughts) + J(answers), each aggregated on its own (--ma-weighting parts).
  ta      TA-GRPO (arXiv 2601.22478): q0 and N rephrasings, G samples each, normalised jointly
          over the (N+1) G responses; J as for the grpo variant (any --loss-type), with ρ and
          ∇ log π taken as π(o | q0) (--ta-anchor rephrased: π(o | q_j), as the public code).

The default run is on-policy (μ = --num-iterations = 1): each batch makes one step, so π_old = π,
ρ = 1, nothing is clipped and the gradient is the policy gradient A ∇ log π. `--num-iterations 2`
reuses the batch and shows the clip; `--beta 0.04` adds the KL.

One training step (train_step, then update) in pseudocode:

    batch = P prompts drawn from (seed, step)
    rows, metrics = ROLLOUTS[variant](model, tokenizer, cfg, batch, rng), e.g. rollout_grpo:
        completions = generate(model, tokenizer, prompts, G, ...)  # the policy at temperature T
        rewards = score_batch(tokenizer, completions, answers)      # 1: EOS and the right answer
        advantages = group_advantages(rewards, G)                   # (or ma_ / ta_advantages)
    rows.loss_weights, tokens = global_loss_weights(rows, loss_type)  # each token's share of J
    micro = micro_batches(rows, size)                               # a thought with its answers
    old_logps = [rows_logps(model, m, T) for m in micro] if μ > 1   # (ref_logps if β > 0)
    repeat μ times:
        for m in micro:
            logps = rows_logps(model, m, T)                         # log π(o_t | context, o_<t)
            loss, _ = policy_loss(logps, old_logps[j] if μ > 1 else logps.detach(), ...)
            loss.backward()                                         # the losses sum to -J
        sum_gradients (over ranks); clip_grad_norm_; optimizer.step()

To add a variant: a rollout, by the checklist before rollout_grpo (section 4); update() does not
know which variant made the rows. Under torchrun each rank samples its share of the prompts, and the
ranks meet only in all_reduce: the batch's counts (global_loss_weights), the gradients
(sum_gradients), the logged numbers (global_means, update, evaluate) and the stop signal (train).

Simplified versus the papers: sampling is a short KV-cache loop (no vLLM, no paged attention; one
process samples and trains, so models up to ~1-3B on one GPU); the reward is exact match after
number normalisation, not math_verify; no LoRA, and the reference is a full frozen copy; GRPO-MA's
unclosed thoughts get no answers and value 0, and its thought/answer weighting is our reading (the
paper does not publish one); TA-GRPO's rephrasings come from the data file, not GPT-4-Turbo; the
learning rate warms up linearly and then stays constant.

Sections 1-6 are the algorithm, in the order a first read wants them; section 7 (its last ~365
lines) is plumbing a first read can skip.
"""

import contextlib
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import transformers
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm
from transformers import DynamicCache, HfArgumentParser

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPT = "reply <think>...</think><answer>...</answer>"

def _opt(default, help, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})

@dataclass
class Config:
    """Every field is a command-line flag: --field-name."""
    # model and data
    model: str = _opt(str(HERE / "data" / "tiny"), "local folder or hub name of a causal LM")
    data: str = _opt(str(HERE / "data" / "train.jsonl"), "JSONL: question, answer, rephrasings")
    test_data: str = _opt(str(HERE / "data" / "test.jsonl"), "held-out JSONL for eval")
    system_prompt: str = _opt(SYSTEM_PROMPT, "system message of every prompt ('' for none)")
    response_prefix: str = _opt("", "text the reply starts with, after the generation prompt (e.g. "
                                "<think>): part of the prompt, never sampled or trained")
    variant: str = _opt("grpo", "advantage/weighting scheme", ["grpo", "ma", "ta", "lambda"])
    # sampling
    num_generations: int = _opt(8, "G: completions per prompt (grpo, lambda) or per phrasing (ta)")
    prompts_per_step: int = _opt(16, "P: prompts per step")
    max_new_tokens: int = _opt(32, "completion length limit (for ma: the thought's limit)")
    temperature: float = _opt(1.0, "sampling temperature; log-probs use the same (no top-k/p)")
    # GRPO-MA and TA-GRPO
    num_thoughts: int = _opt(4, "K (ma): thoughts per prompt")
    num_answers: int = _opt(4, "M (ma): answers per thought")
    max_answer_tokens: int = _opt(24, "answer length limit (ma)")
    ma_weighting: str = _opt("parts", "(ma) parts: thoughts, answers apart", ["parts", "tokens"])
    num_rephrasings: int = _opt(3, "N (ta): rephrasings per question, drawn afresh each step")
    ta_anchor: str = _opt("original", "(ta) context of the log-probs: q0 (paper v5) or the "
                          "rephrasing (public code)", ["original", "rephrased"])
    # loss and optimisation
    loss_type: str = _opt("dapo", "token aggregation, as TRL", ["grpo", "dr_grpo", "dapo"])
    scale_rewards: str = _opt("group", "divide by the std (none: Dr. GRPO)", ["group", "none"])
    beta: float = _opt(0.0, "k3 KL coefficient (a reference model is loaded only when > 0)")
    epsilon: float = _opt(0.2, "lower clip range of the ratio")
    epsilon_high: float = _opt(0.0, "upper clip range (0 = same as --epsilon; DAPO uses 0.28)")
    num_iterations: int = _opt(1, "mu: updates per sampled batch")
    reward: str = _opt("tags", "the answer is in <answer> tags (or \\boxed), or the last number",
                       ["tags", "last-number"])
    format_reward: float = _opt(0.0, "extra reward for one <think>..</think><answer>..</answer>")
    lr: float = _opt(2e-4, "AdamW learning rate (tiny model; use ~1e-6 for real models)")
    warmup_steps: int = _opt(10, "linear warmup over training steps, then constant")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    max_grad_norm: float = _opt(1.0, "gradient clipping")
    micro_batch_size: int = _opt(64, "rows per forward/backward of the update (sampling: all)")
    steps: int = _opt(100, "training steps")
    # eval, logging, checkpoints, runtime
    eval_every: int = _opt(50, "eval every N steps (0 = only at start and end)")
    eval_samples: int = _opt(8, "samples per held-out question for pass@k")
    eval_limit: int = _opt(0, "use only the first N held-out questions (0 = all)")
    log_completions: int = _opt(25, "every N steps, show a group as text (0 = off; log_group)")
    save_every: int = _opt(50, "checkpoint every N steps (0 = only at the end; SIGTERM saves)")
    out: str = _opt("out", "run folder: metrics.jsonl, completions.jsonl, checkpoint, summary")
    resume: bool = _opt(False, "continue the run in --out, or start it (see prepare_out)")
    overwrite: bool = _opt(False, "replace a run already in --out (else such a folder stops it)")
    seed: int = _opt(0, "seed for data order, sampling and init")
    device: str = _opt("auto", "auto: cuda or mps if any, else cpu", ["auto", "cuda", "mps", "cpu"])
    gradient_checkpointing: bool = _opt(False, "trade compute for activation memory (real models)")

# -----------------------------------------------------------------------------
# 1. The ideas: one small function per scheme, on plain tensors, then the loss.

def group_advantages(rewards, group_size: int, scale: str = "group", eps: float = 1e-4):
    """GRPO advantages: with r of shape (groups, G), G = group_size consecutive rewards,
    A = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps), the std unbiased (ddof=1,
    as TRL); scale="none" skips the division (Dr. GRPO). Two refinements: a group whose rewards are
    all equal gets exactly 0; NaN rewards mark rows that do not exist (TA's missing rephrasings,
    MA's unanswered thoughts), which are left out of the statistics and get NaN back.

    >>> group_advantages(torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.]), 4)  # mean 0.25, std 0.5
    tensor([ 1.4997, -0.4999, -0.4999, -0.4999,  0.0000,  0.0000,  0.0000,  0.0000])
    """
    r = rewards.reshape(-1, group_size)  # (num_groups, group_size)
    adv = r - r.nanmean(1, keepdim=True)
    if scale == "group":  # unbiased std, NaN left out (torch has no nanstd); one reward: 0/0 -> 0
        n = (~r.isnan()).sum(1, keepdim=True)
        std = ((adv ** 2).nansum(1, keepdim=True) / (n - 1)).sqrt()
        adv = adv / (std + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group or none, got {scale!r}")
    # all existing rewards equal (max == min) -> exactly 0, not the rounding noise of the mean / eps
    high = torch.where(r.isnan(), -math.inf, r).amax(1, keepdim=True)
    low = torch.where(r.isnan(), math.inf, r).amin(1, keepdim=True)
    adv = torch.where((high == low) & ~r.isnan(), 0.0, adv)
    return adv.reshape(rewards.shape)

def ma_advantages(rewards, scale: str = "group", eps: float = 1e-4):
    """GRPO-MA advantages from a (P, K, M) reward tensor: P prompts, K thoughts each, M answers per
    thought. A thought's value V(th_k) is the mean of its M answer rewards; the thought advantage
    normalises V over the K thoughts of its prompt; the answer advantage normalises the rewards over
    all K*M answers of the prompt (not within a thought). A thought that was never answered (it did
    not close with </think>) has NaN answer rewards: its value is 0 and its missing answers are left
    out of the answer statistics. Returns (thought_adv (P, K), answer_adv (P, K, M), V (P, K)).

    Rewards [[1, 1], [1, 0]] (P=1, K=2, M=2): V = [1, 0.5] -> thought_adv = [0.7069, -0.7069];
    answers: mean 0.75, std 0.5 -> answer_adv = [[0.4999, 0.4999], [0.4999, -1.4997]].
    Rewards [[1, 0], [nan, nan]]: V = [0.5, 0] -> thought_adv = [0.7069, -0.7069];
    answer_adv = [[0.7070, -0.7070], [nan, nan]] (the two real answers: mean 0.5, std 0.7071).
    """
    P, K, M = rewards.shape
    values = rewards.nanmean(-1).nan_to_num(0.0)  # (P, K); an unanswered thought is worth 0
    thought_adv = group_advantages(values.reshape(-1), K, scale, eps).reshape(P, K)
    answer_adv = group_advantages(rewards.reshape(-1), K * M, scale, eps).reshape(P, K, M)
    return thought_adv, answer_adv, values

def ta_advantages(rewards, scale: str = "group", eps: float = 1e-4):
    """TA-GRPO advantages from a (P, N+1, G) reward tensor: question q0 and its N rephrasings, G
    responses each. All (N+1)*G responses of a question form one group. A question with fewer than N
    rephrasings marks the missing ones with NaN rewards (a ragged group): ignored, NaN back.

    Rewards [[1, 1], [0, 1]] (N=1, G=2): q0's group alone has zero variance, but pooled mean 0.75,
    std 0.5 -> [[0.4999, 0.4999], [-1.4997, 0.4999]].
    """
    P, Q, G = rewards.shape
    return group_advantages(rewards.reshape(-1), Q * G, scale, eps).reshape(P, Q, G)

def lambda_weights(completion_ids, completion_mask, group_size: int):
    """λ-GRPO token weights 1/|λ(i,t)|, (B, T) float, 0 where the mask is 0. Rows form groups of
    `group_size` consecutive rows, each completion right-padded (its token t in column t). λ(i,t)
    is the set of completions j in i's group (i itself and exact duplicates included) with
    all(ids[j, :t+1] == ids[i, :t+1]) and all(mask[j, :t+1]), so the tokens of a shared prefix are
    trained once per prefix, not once per completion. Loop-free: compare every pair of rows of a
    group token by token (about 4·B·G·T bytes for B rows, G = group_size); a running product turns
    "equal at t" into "equal up to t". They multiply the per-token loss (policy and KL), not the
    normaliser: aggregation_weights * lambda_weights.

    Group {ABCD, ABEFHI, JKLM, JKLNQST, JKLNQU, VWYZ}: A,B -> 1/2; J,K,L -> 1/3; N,Q -> 1/2; the
    other tokens 1.
    """
    B, T = completion_ids.shape
    ids = completion_ids.reshape(-1, group_size, T)  # (groups, G, T)
    mask = completion_mask.reshape(-1, group_size, T).bool()
    same = (ids[:, :, None] == ids[:, None]) & mask[:, :, None] & mask[:, None]  # (groups, G, G, T)
    counts = same.to(torch.uint8).cumprod(-1).sum(2, dtype=torch.int32)  # |λ(i,t)|, (groups, G, T)
    return torch.where(mask, 1.0 / counts.clamp(min=1), 0.0).reshape(B, T)

# -----------------------------------------------------------------------------
# The loss: TRL's aggregations as per-token weights, then the clipped ratio and the k3 KL.

def aggregation_weights(completion_mask, loss_type="dapo", num_rows=None, num_tokens=None,
                        max_completion_length=None):
    """(B, T) weight of each token in the batch loss, as TRL aggregates: grpo, each row's token
    mean, averaged over rows (1 / (|o_i| rows)); dapo, one token mean (1 / tokens); dr_grpo (arXiv
    2503.20783), 1 / (rows * max_completion_length, else the padded width). To weigh a piece of a
    batch (a micro-batch, a rank), pass the whole batch's num_rows and num_tokens: pieces add up.

    Rows of 2 and 4 tokens: grpo [1/4, 1/4], [1/8] * 4; dapo 1/6 each; dr_grpo (limit 8) 1/16 each.
    """
    mask = completion_mask.float()
    rows = len(mask) if num_rows is None else num_rows
    tokens = mask.sum().item() if num_tokens is None else num_tokens
    if loss_type == "grpo":
        return mask / (mask.sum(1, keepdim=True).clamp(min=1) * max(rows, 1))
    if loss_type == "dapo":
        return mask / max(tokens, 1)
    if loss_type == "dr_grpo":
        return mask / (rows * (max_completion_length or mask.shape[1]))
    raise ValueError(f"unknown loss_type {loss_type!r}")

def policy_loss(per_token_logps, old_per_token_logps, advantages, completion_mask, loss_weights,
                ref_per_token_logps=None, beta=0.0, epsilon=0.2, epsilon_high=None):
    """GRPO surrogate loss (to minimise) and metrics. Per-token tensors are (B, T).

    per-token loss = -min(ρ A, clip(ρ, 1-ε, 1+ε_high) A) + β (exp(ref - logp) - (ref - logp) - 1),
    with ρ = exp(logp - old) and ε_high = ε when None (as TRL). At μ = 1, old = logp.detach(): ρ
    is 1 and no token is clipped, but ρ's gradient is logp's, so the gradient is the policy
    gradient. The loss is Σ loss_weights * per-token loss over the tokens of completion_mask: a mean
    when the weights sum to 1, as aggregation_weights' do over a batch. For one batch, λ-GRPO's
    loss is w = aggregation_weights(mask, "dapo") * lambda_weights(ids, mask, G);
    policy_loss(logps, logps.detach(), adv, mask, w). advantages: (B,), or (B, T) per token;
    finite on the mask.
    The metrics are 0-dim tensors, so the loss makes no device sync (and no graph break).
    """
    mask = completion_mask.float()
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    adv = torch.where(mask.bool(), adv, 0.0)  # (B, T); a NaN off the mask gets no gradient either
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(per_token_logps - old_per_token_logps)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)  # (B, T)
    metrics = {}
    n = mask.sum().clamp(min=1)
    if beta:
        assert ref_per_token_logps is not None, "beta > 0 needs ref_per_token_logps"
        delta = ref_per_token_logps - per_token_logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
        metrics["kl"] = (kl * mask).sum().detach() / n
    with torch.no_grad():  # the clip binds where the ratio left the range in A's direction
        metrics["clip_low"] = (((ratio < 1 - epsilon) & (adv < 0)) * mask).sum() / n
        metrics["clip_high"] = (((ratio > 1 + epsilon_high) & (adv > 0)) * mask).sum() / n
    return torch.where(mask.bool(), loss * loss_weights, 0.0).sum(), metrics

# -----------------------------------------------------------------------------
# 2. The reward: exact match of the final answer (model output is text: read, never run).

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"  # any text without a think/answer tag in it
FORMAT_RE = re.compile(rf"\s*<think>{NO_TAG}</think>\s*<answer>{NO_TAG}</answer>\s*", re.DOTALL)

# The number reader: an answer is a number only when one number stands alone in it, once the known
# wrappers are gone. A false positive is worse than a miss: the policy is trained toward it.

BRACES = r"\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}"  # {...} with braces nested two levels inside
BOXED_RE = re.compile(rf"\\boxed({BRACES})")
TEXT_RE = re.compile(r"\\text\{([^{}]*)\}")
FRAC_RE = re.compile(r"\\[dt]?frac\{(-?[0-9.,]+)\}\{([0-9.,]+)\}")  # \frac{a}{b} of plain numbers
# a run of digits joined by . , or / (linear: no backtracking); [0-9], not \d (other scripts)
RUN_RE = re.compile(r"-?\.?[0-9]+(?:[.,/][0-9]+)*")
# a well-formed run: commas only as thousands separators, an optional decimal part, a fraction
DECIMAL = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
NUMBER_RE = re.compile(rf"-?(?:{DECIMAL})(?:/(?:{DECIMAL}))?")
MATH = set("\\^_{}")  # what is left of LaTeX once the wrappers are gone: an expression, not a number
MAX_NUMBER_CHARS = 100  # longer "numbers" are not parsed: int() refuses > 4300 digits

def boxed(text: str):
    """What the last \\boxed{...} holds (braces nested two levels inside it), or None."""
    found = BOXED_RE.findall(text)
    return found[-1][1:-1] if found else None

def unwrap(text: str) -> str:
    """The text with the wrappers around numbers made plain: $ and \\$ go, \\text{x} is x set apart,
    \\frac{a}{b} of plain numbers is a/b, the Unicode minus is -."""
    text = text.replace("\\$", "").replace("$", "").replace("\u2212", "-")
    return FRAC_RE.sub(r"\1/\2", TEXT_RE.sub(r" \1 ", text))

def number_runs(text: str) -> list:
    """The number-like runs of a text, as written; None for a run that touches a letter, a digit of
    another script, LaTeX (\\ ^ _ { }) or a ! (2i, v2, x^2, 3\\pi, \\sqrt{2}, 4!)."""
    runs = []
    for match in RUN_RE.finditer(text):
        around = text[max(match.start() - 1, 0):match.start()] + text[match.end():match.end() + 1]
        alone = not any(c.isalnum() or c in MATH or c == "!" for c in around)
        runs.append(match.group() if alone else None)
    return runs

def parse_number(text: str):
    """The one number an answer holds -> Fraction, else None. Inside the last \\boxed{} if there is
    one; words and units set apart by spaces, $, \\$, \\text{}, ** and a final full stop around it
    are ignored ('The answer is 1,234.', '18 eggs', '\\$12.50', '-\\frac{1}{2}', '.5', '-3/4').
    None for two numbers ('7 or 8'), a malformed one ('3,5', '1, 2') and any LaTeX left once the
    wrappers are gone ('3 \\pi', '\\frac{\\pi}{4}', 'x^2'): score then compares it as text."""
    inner = boxed(text)
    text = unwrap(text if inner is None else inner)
    runs = number_runs(text)
    if MATH & set(text) or len(runs) != 1 or runs[0] is None or len(runs[0]) > MAX_NUMBER_CHARS:
        return None
    if not NUMBER_RE.fullmatch(runs[0]):
        return None
    numerator, _, denominator = runs[0].replace(",", "").partition("/")
    if denominator and Fraction(denominator) == 0:
        return None
    return Fraction(numerator) / Fraction(denominator or 1)

def after_thought(text: str):
    """The text after the first </think> (all of it without one; None if a <think> never closes),
    so that an answer written inside the thought is never credited."""
    if "<think>" in text and "</think>" not in text:
        return None
    return text.split("</think>", 1)[-1]

def extract_answer(text: str, reward: str = "tags"):
    """The answer after the thought, or None: the last <answer>...</answer>, else the last
    \\boxed{...}; with reward="last-number", the last number (as GSM8K graders read it)."""
    text = after_thought(text)
    if text is None:
        return None
    if reward == "last-number":  # the last run, unless it is part of an expression (then None)
        runs = number_runs(unwrap(text))
        return runs[-1] if runs else None
    found = ANSWER_RE.findall(text)
    if found:
        return found[-1]
    return boxed(text)

def score(text: str, reference: str, finished: bool, format_reward: float = 0.0,
          reward: str = "tags"):
    """(reward, parsed): 1 if the completion finished (EOS) and its answer equals the reference,
    plus format_reward if it finished with one <think>..</think> then one <answer>..</answer>.
    A numeric reference needs an answer that is that number (parse_number); any other reference is
    compared as text, without whitespace or a \\boxed{} around it. parsed: an answer was read."""
    answer = extract_answer(text, reward)
    ref_num = parse_number(reference)
    answer_num = parse_number(answer) if answer is not None else None
    parsed = answer is not None and (ref_num is None or answer_num is not None)
    correct = False
    if parsed and finished and ref_num is not None:
        correct = answer_num == ref_num
    elif parsed and finished:
        plain = lambda t: re.sub(r"\s", "", boxed(t) or t)
        correct = plain(answer) == plain(reference)
    shaped = finished and FORMAT_RE.fullmatch(text) is not None
    return float(correct) + format_reward * shaped, parsed

def score_batch(tokenizer, samples, answers, format_reward=0.0, reward="tags", before=""):
    """(rewards, parsed, tagged), each (B,), of the completions in `samples` (from generate, in
    section 3), each read after the text `before` it (a string for all, or one per row): the
    response prefix, and for a GRPO-MA answer its thought too. tagged: <answer> after the thought."""
    texts = decode(tokenizer, samples.completion_ids, samples.completion_mask)
    before = [before] * len(texts) if isinstance(before, str) else before
    texts = [b + text for b, text in zip(before, texts)]
    finished = samples.finished.tolist()
    scored = [score(t, a, f, format_reward, reward) for t, a, f in zip(texts, answers, finished)]
    tagged = [ANSWER_RE.search(after_thought(t) or "") is not None for t in texts]
    rewards = torch.tensor([r for r, _ in scored], dtype=torch.float32)
    parsed = torch.tensor([p for _, p in scored], dtype=torch.bool)
    return rewards, parsed, torch.tensor(tagged, dtype=torch.bool)

# -----------------------------------------------------------------------------
# 3. The sampler: each prompt encoded once, its KV cache copied to the rows that continue it.
# A first read needs only generate(): n samples per prompt, returned as Samples.

def prompt_ids(tokenizer, question: str, system_prompt: str, response_prefix: str = "") -> list[int]:
    """A question (with the system prompt) chat-templated into token ids, generation prompt on, then
    the response prefix (the reply's first words, as DeepSeek-R1's template ends with <think>). The
    prefix is tokenized on its own, as the model would have written it after the template."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ids + tokenizer(response_prefix, add_special_tokens=False).input_ids

def run_decoder(model, input_ids, attention_mask, cache=None):
    """The decoder (model.model: no lm_head) over input_ids (B, T) after the L tokens in `cache` (a
    transformers DynamicCache, grown in place; None: L = 0, no cache); attention_mask (B, L + T)
    covers both, with padding (0) anywhere. Returns the last hidden states (B, T, H)."""
    # a token's position is the number of real tokens before it: padding takes no place
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
    # cache= is transformers 5.24's name for past_key_values (load_model refuses older versions)
    out = model.model(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, use_cache=cache is not None, cache=cache)
    return out.last_hidden_state

@dataclass
class Prefix:
    """Contexts ready to be continued: the KV cache of all their tokens but the last, and that last
    token, which the next forward pass takes as input (its output predicts the first new token)."""
    cache: object        # a DynamicCache: per layer keys and values, (B, heads, L, head_dim)
    mask: torch.Tensor   # (B, L) 1 where the cache holds a real token, 0 for padding
    last: torch.Tensor   # (B,)

    def reorder(self, index):
        """In place, as the DynamicCache it holds: keep rows `index`, a repeated index copying a
        context to several continuations. index_select: its CPU backward is deterministic."""
        self.cache.reorder_cache(index)
        self.mask = self.mask.index_select(0, index)
        self.last = self.last.index_select(0, index)

def left_pad(seqs: list[list[int]], pad_id: int):
    """Lists of ids -> (B, L) ids and attention mask, padded on the left."""
    L = max((len(s) for s in seqs), default=1)  # (no seqs: (0, 1) tensors)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, L - len(s):] = 1
    return ids, mask

def prefill(model, prompts: list[list[int]], pad_id: int) -> Prefix:
    """Encode each prompt (token ids) once, left-padded; with gradients if they are enabled."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    cache = DynamicCache()
    if ids.shape[1] > 1:
        run_decoder(model, ids[:, :-1], mask[:, :-1], cache)
    return Prefix(cache, mask[:, :-1], ids[:, -1])

@dataclass
class Samples:
    completion_ids: torch.Tensor   # (B, C) right-padded with pad
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the token that ended the row
    finished: torch.Tensor         # (B,) ended with EOS

@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], n: int, max_new_tokens: int,
             temperature=1.0, greedy=False, stop_strings=()) -> Samples:
    """n samples for each prompt (token ids), rows in prompt order, one token per forward pass;
    each prompt is prefilled once and its cache copied to its n rows. A row ends at an EOS token
    (any of eos_ids), at the length limit, or at the token whose text completes a stop string;
    ended rows leave the batch. Only the temperature shapes the draw (not the generation config).
    Eval mode: no dropout, and HF's gradient checkpointing would drop the cache."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prefix = prefill(model, prompts, tokenizer.pad_token_id)
    prefix.reorder(torch.arange(len(prompts), device=device).repeat_interleave(n))  # n rows each
    eos = torch.tensor(eos_ids(model, tokenizer), device=device)
    B = len(prefix.last)
    ids = torch.full((B, max_new_tokens), tokenizer.pad_token_id, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    texts = [""] * B  # each row's text so far, for stop strings
    active = torch.arange(B, device=device)  # the rows still being decoded
    cache, mask, token = prefix.cache, prefix.mask, prefix.last
    for t in range(max_new_tokens):
        if not len(active):  # every row has ended (or there were none)
            break
        mask = torch.cat([mask, mask.new_ones(len(token), 1)], 1)
        hidden = run_decoder(model, token[:, None], mask, cache)
        logits = model.lm_head(hidden[:, -1]).float()  # (B, V)
        if t == 0 and not logits.isfinite().all():  # overflowed weights show at the first token
            raise UserError("the policy's logits are not finite: training diverged; lower --lr")
        if greedy:
            token = logits.argmax(-1)
        else:  # softmax(logits / T) is what the loss's log-probs see: no top-k or top-p
            token = torch.multinomial((logits / temperature).softmax(-1), 1).squeeze(-1)
        ids[active, t] = token
        lengths[active] += 1
        ended = torch.isin(token, eos)
        finished[active[ended]] = True
        if stop_strings:
            ended = ended | stop_string_hits(tokenizer, token, active, texts, stop_strings)
        if ended.any():  # ended rows leave the batch: a copy of every layer's cache, so only then
            go = ~ended
            active, mask, token = active[go], mask[go], token[go]
            cache.batch_select_indices(go.nonzero().squeeze(1))
    model.train(was_training)
    C = max(lengths.tolist(), default=0)
    completion_mask = (torch.arange(C, device=device)[None] < lengths[:, None]).long()
    return Samples(ids[:, :C], completion_mask, finished)

def stop_string_hits(tokenizer, token, active, texts: list[str], stop_strings):
    """(B,) bool: the rows whose text, with this step's token appended to texts[row], now holds a
    stop string, also when the token carries text past the string's end (a BPE token '><' ends
    '</think>' and starts '<answer>')."""
    pieces = tokenizer.batch_decode(token[:, None].tolist(), skip_special_tokens=True)
    hit = []
    for row, piece in zip(active.tolist(), pieces):
        texts[row] += piece
        hit.append(any(s in texts[row] for s in stop_strings))
    return torch.tensor(hit, dtype=torch.bool, device=token.device)

def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's (Qwen has
    two: <|im_end|> and <|endoftext|>)."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    return sorted(ids | {tokenizer.eos_token_id})

def decode(tokenizer, completion_ids, completion_mask) -> list[str]:
    """The text of each completion's masked tokens, special tokens dropped."""
    return [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(completion_ids, completion_mask)]

# -----------------------------------------------------------------------------
# 4. Rows, their loss weights, and the rollouts: one function per variant fills the rows.

@dataclass
class Rows:
    """Completions to train on, each pointing at its context (its prompt, and for a GRPO-MA answer
    the thought row in between) so that a shared context is encoded once. A rollout fills them as
    the checklist before rollout_grpo says. Invariants: each completion right-padded, its mask a run
    of 1s from column 0; every 2-D tensor field is (B, C) (select cuts them all to the columns in
    use); a parent row continues its prompt (one level); advantages finite (the last two asserted
    by global_loss_weights)."""
    prompts: list[list[int]]       # the distinct prompts (chat-templated token ids)
    prompt_index: torch.Tensor     # (B,) the prompt each row continues
    parent: torch.Tensor           # (B,) -1, or the row between prompt and this one (MA's thought)
    completion_ids: torch.Tensor   # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) 1 up to and including EOS / stop
    advantages: torch.Tensor       # (B,), or (B, C) per token, 0 off the mask (see policy_loss)
    loss_parts: list | None = None  # LossParts: rows whose loss is aggregated on its own
    part: torch.Tensor | None = None  # (B,) each row's index in loss_parts (None: all in part 0)
    inv_lambda: torch.Tensor | None = None  # (B, C) λ-GRPO's 1/|λ|: scales the per-token loss
    rewards: torch.Tensor | None = None  # (B,) for --log-completions (MA thoughts: their value)
    loss_weights: torch.Tensor | None = None  # (B, C) each token's share of J (set by update)

    def __len__(self):
        return len(self.completion_ids)

    def to(self, device) -> "Rows":
        """The same rows with every tensor on `device`."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return Rows(**moved)

    def context(self, i: int) -> list[int]:
        """Row i's context as token ids: its prompt, then its parent's completion."""
        ids = list(self.prompts[self.prompt_index[i]])
        if self.parent[i] >= 0:
            p = int(self.parent[i])
            ids += self.completion_ids[p][self.completion_mask[p].bool()].tolist()
        return ids

    def select(self, index: torch.Tensor) -> "Rows":
        """The rows `index` (a row's parent must be among them), with only the prompts they use
        and only the completion columns that hold a token."""
        used = self.prompt_index[index].unique()
        new_prompt = torch.full((len(self.prompts),), -1, dtype=torch.long)
        new_prompt[used] = torch.arange(len(used))
        new_row = torch.full((len(self),), -1, dtype=torch.long)
        new_row[index] = torch.arange(len(index))
        C = max(1, int(self.completion_mask[index].sum(1).max()))
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):  # per-token tensors also lose their empty columns
                value = value[index][:, :C] if value.dim() == 2 else value[index]
            picked[f.name] = value
        parent = picked["parent"]
        picked["parent"] = torch.where(parent >= 0, new_row[parent.clamp(min=0)], -1)
        picked["prompt_index"] = new_prompt[picked["prompt_index"]]
        picked["prompts"] = [self.prompts[p] for p in used.tolist()]
        return Rows(**picked)

class LossPart(NamedTuple):
    """The rows of one part (see Rows.part) are aggregated on their own; the losses are summed."""
    nominal_rows: int      # rows planned (P*G...), missing ones too: dr_grpo's, summed over ranks
    max_len: int           # the longest completion it allowed (dr_grpo's constant)

def global_loss_weights(rows: Rows, loss_type: str):
    """What update() first does with the rows: (weights, tokens), (B, C) each token's weight in J
    over the global batch (all ranks), and the global batch's token count. In each of
    rows.loss_parts the weights are aggregation_weights with the part's global counts (dr_grpo: its
    nominal rows, what the rollout set out to make, and its longest allowed completion), so each
    part's weights sum to 1 (dapo, grpo) and J is a sum of one mean per part; λ-GRPO's inv_lambda
    multiplies them. GRPO-MA's two parts under dapo: a thought token gets 1 / (all thought tokens),
    an answer token 1 / (all answer tokens); pooled (--ma-weighting tokens), thoughts of Lt tokens
    get only Lt / (Lt + M La) of J (answers: La)."""
    assert rows.loss_parts is not None, "the rollout sets loss_parts"
    assert rows.advantages.isfinite().all(), "the rollout gives every row a finite advantage"
    parents = rows.parent[rows.parent >= 0]
    assert (rows.parent[parents] < 0).all(), "a parent row continues its prompt (one level)"
    part = torch.zeros(len(rows), dtype=torch.long) if rows.part is None else rows.part
    weights, tokens = torch.zeros(rows.completion_mask.shape), 0
    for k, (nominal_rows, max_len) in enumerate(rows.loss_parts):
        in_part = part == k
        mask = rows.completion_mask[in_part]
        n_rows, n_tokens, nominal_rows = all_reduce([len(mask), mask.sum().item(), nominal_rows])
        if loss_type == "dr_grpo":
            n_rows = nominal_rows
        weights[in_part] = aggregation_weights(mask, loss_type, n_rows, n_tokens, max_len)
        tokens += n_tokens
    if rows.inv_lambda is not None:  # λ-GRPO: scales policy and KL terms, not the normaliser
        weights = weights * rows.inv_lambda
    return weights, tokens

# To write a rollout (rollout_grpo is the one to copy): it takes the model, tokenizer, config, this
# rank's examples and an rng (TA's draws), makes no distributed call, and returns (Rows, metrics):
#   1. prompts = [prompt_ids(...)]; completions = generate(...) inside timed(metrics, "time/sample")
#   2. rewards = score_batch(...); advantages from a scheme of section 1, finite for every row
#   3. Rows: prompt_index for each row, parent -1 (or a top row: MA's answer continues its thought),
#      loss_parts (and part, for more than one), each with the rows it set out to make (dr_grpo)
#   4. metrics: tensors, logged as the mean of their elements over all ranks (global_means)
#   5. an entry in ROLLOUTS and a --variant choice in Config
# (timed, all_reduce and the rest of the torchrun helpers are plumbing, in section 7)

def sample_metrics(rewards, groups, parsed, tagged, samples) -> dict:
    """The metrics of one step's samples (tensors: means); groups: (groups, n) rewards."""
    return {"reward": rewards, "frac_reward_zero_std": groups.amax(1) == groups.amin(1),
            "completion_length": samples.completion_mask.sum(1).float(),
            "truncated": ~samples.finished, "unparseable": ~parsed, "format": tagged}

def rollout_grpo(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """GRPO (and λ-GRPO): G completions per prompt, group-normalised advantages; for `lambda` the
    rows also carry 1/|λ| token weights."""
    G, metrics = cfg.num_generations, {}
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix) for ex in batch]
    with timed(metrics, "time/sample"):
        s = generate(model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature)
    ids, mask = s.completion_ids.cpu(), s.completion_mask.cpu()
    answers = [ex["answer"] for ex in batch for _ in range(G)]
    rewards, parsed, tagged = score_batch(tokenizer, s, answers, cfg.format_reward, cfg.reward,
                                          cfg.response_prefix)
    advantages = group_advantages(rewards, G, cfg.scale_rewards)
    inv_lambda = lambda_weights(ids, mask, G)  # 1/|λ|, logged for grpo too: how much rows share
    on = mask.bool()
    metrics.update(sample_metrics(rewards, rewards.view(-1, G), parsed, tagged, s),
                   lambda_mean=1 / inv_lambda[on],      # mean |λ| over tokens
                   lambda_shared=inv_lambda[on] < 1)    # share of tokens with |λ| > 1
    prompt_index = torch.arange(len(batch)).repeat_interleave(G)
    parent = torch.full((len(ids),), -1)  # every row continues its prompt directly
    rows = Rows(prompts, prompt_index, parent, ids, mask, advantages,
                loss_parts=[LossPart(len(batch) * G, cfg.max_new_tokens)], rewards=rewards,
                inv_lambda=inv_lambda if cfg.variant == "lambda" else None)
    return rows, metrics

def rollout_ma(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """GRPO-MA: K thoughts per prompt, each ending at the token whose text completes </think>, then
    M answers per thought, sampled after the prompt + the thought's tokens and scored on the
    thought's text + their own. An *unclosed* thought (no </think>) gets no answers (NaN rewards)
    and value 0, and is still trained with its advantage. Rows: the P*K thoughts, then the closed
    ones' answers (weights: global_loss_weights). P = 1, K = 2, M = 2, thought 1 unclosed: rows 0, 1
    the thoughts (parent -1), rows 2, 3 thought 0's answers (parent 0)."""
    K, M, P, metrics = cfg.num_thoughts, cfg.num_answers, len(batch), {}  # P: this rank's prompts
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix) for ex in batch]
    with timed(metrics, "time/sample"):
        th = generate(model, tokenizer, prompts, K, cfg.max_new_tokens, cfg.temperature,
                      stop_strings=["</think>"])
        th_ids, th_mask = th.completion_ids.cpu(), th.completion_mask.cpu()
        thought_texts = decode(tokenizer, th_ids, th_mask)
        closed = torch.tensor(["</think>" in text for text in thought_texts])  # (P*K,) bool
        closed_rows = closed.nonzero().squeeze(1).tolist()
        # generate's rows are prompt-major: thought k of prompt p is row p*K + k (prompt: row // K)
        contexts = [prompts[row // K] + th_ids[row][th_mask[row].bool()].tolist()
                    for row in closed_rows]
        ans = generate(model, tokenizer, contexts, M, cfg.max_answer_tokens, cfg.temperature)
    parents = [row for row in closed_rows for _ in range(M)]  # each answer's thought row
    answers = [batch[row // K]["answer"] for row in parents]
    before = [cfg.response_prefix + thought_texts[row] for row in parents]  # prefix + thought
    answer_rewards, parsed, tagged = score_batch(tokenizer, ans, answers, cfg.format_reward,
                                                 cfg.reward, before)
    rewards = torch.full((P * K, M), math.nan)  # (P*K, M): an unclosed thought has no answers
    rewards[closed] = answer_rewards.view(-1, M)
    thought_adv, answer_adv, values = ma_advantages(rewards.view(P, K, M), cfg.scale_rewards)
    ids = pad_sequence(list(th_ids) + list(ans.completion_ids.cpu()), batch_first=True,
                       padding_value=tokenizer.pad_token_id)
    mask = pad_sequence(list(th_mask) + list(ans.completion_mask.cpu()), batch_first=True)
    advantages = torch.cat([thought_adv.view(-1), answer_adv.view(P * K, M)[closed].view(-1)])
    parent = torch.tensor([-1] * (P * K) + parents)  # a thought continues its prompt directly
    prompt_index = torch.tensor([row // K for row in range(P * K)] + [row // K for row in parents])
    # rows: the P*K thoughts (prompt-major), then M answers for each closed thought, in its order
    # reward and zero variance: the thought values'; lengths, truncated, format: the answers'
    metrics.update(sample_metrics(values, groups=values, parsed=parsed, tagged=tagged, samples=ans),
                   answer_reward=answer_rewards, unclosed_thoughts=~closed,
                   thought_length=th_mask.sum(1).float())
    if cfg.ma_weighting == "parts":  # part 0 the thoughts, part 1 the answers
        part = (parent >= 0).long()
        loss_parts = [LossPart(P * K, cfg.max_new_tokens),
                      LossPart(P * K * M, cfg.max_answer_tokens)]
    else:  # one token mean over thoughts and answers
        part = None
        loss_parts = [LossPart(P * K * (1 + M), max(cfg.max_new_tokens, cfg.max_answer_tokens))]
    rows = Rows(prompts, prompt_index, parent, ids, mask, advantages, loss_parts, part,
                rewards=torch.cat([values.view(-1), answer_rewards]))
    return rows, metrics

def rollout_ta(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """TA-GRPO: each question q0 with up to N of its rephrasings (drawn afresh each step), G
    responses to each, advantages normalised jointly over the question's (n+1)*G responses (ragged
    when n < N). --ta-anchor original (paper v5) takes every log-prob as log π(o | q0): at μ = 1 the
    ratio is 1 either way, but the gradient is ∇ log π(o | q0), not ∇ log π(o | q_j).
    `rephrased` keeps the prompt that produced the response (the public code). Rows: per question
    p, per phrasing j (0 = q0), G samples; N = 2, G = 2 and one rephrasing drawn: rows (p, j, g) =
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), and rewards[0, 2] (the missing one) stays NaN."""
    G, N, metrics = cfg.num_generations, cfg.num_rephrasings, {}
    phrasings, first = [], []  # every phrasing's prompt; where each question's q0 is among them
    slots = []  # one row per (question p, phrasing j, sample g), in that order
    for p, ex in enumerate(batch):
        drawn = rng.sample(ex["rephrasings"], min(N, len(ex["rephrasings"])))
        first.append(len(phrasings))
        for j, question in enumerate([ex["question"]] + drawn):
            phrasings.append(prompt_ids(tokenizer, question, cfg.system_prompt, cfg.response_prefix))
            slots += [(p, j, g) for g in range(G)]
    p_idx, j_idx, g_idx = torch.tensor(slots).T
    with timed(metrics, "time/sample"):
        s = generate(model, tokenizer, phrasings, G, cfg.max_new_tokens, cfg.temperature)
    answers = [batch[p]["answer"] for p in p_idx.tolist()]
    r, parsed, tagged = score_batch(tokenizer, s, answers, cfg.format_reward, cfg.reward,
                                    cfg.response_prefix)
    rewards = torch.full((len(batch), N + 1, G), math.nan)  # (P here, N+1, G); NaN: no phrasing
    rewards[p_idx, j_idx, g_idx] = r
    pooled_adv = ta_advantages(rewards, cfg.scale_rewards)  # (P, N+1, G), NaN: no phrasing
    advantages = pooled_adv[p_idx, j_idx, g_idx]
    if cfg.ta_anchor == "rephrased":
        prompts, prompt_index = phrasings, torch.arange(len(phrasings)).repeat_interleave(G)
    else:
        prompts, prompt_index = [phrasings[i] for i in first], p_idx
    # zero variance of q0's own G responses (what plain GRPO meets), then of the pooled groups,
    # whose advantages group_advantages sets to exactly 0
    pooled_constant = (pooled_adv.view(len(batch), -1).nan_to_num(0.0) == 0).all(1)
    metrics.update(sample_metrics(r, rewards[:, 0], parsed, tagged, s),
                   frac_reward_zero_std_pooled=pooled_constant, reward_original=rewards[:, 0],
                   reward_rephrased=r[j_idx > 0])
    ids, mask = s.completion_ids.cpu(), s.completion_mask.cpu()
    parent = torch.full((len(ids),), -1)
    loss_parts = [LossPart(len(batch) * (N + 1) * G, cfg.max_new_tokens)]  # all N+1 phrasings
    rows = Rows(prompts, prompt_index, parent, ids, mask, advantages, loss_parts, rewards=r)
    return rows, metrics

ROLLOUTS = {"grpo": rollout_grpo, "lambda": rollout_grpo, "ma": rollout_ma, "ta": rollout_ta}

# -----------------------------------------------------------------------------
# 5. Log-probs and the update.

def flat_logps(model, rows: Rows, temperature: float):
    """(B, C) log softmax(logits / T) of each completion token given its context and the tokens
    before it, the plain way: one forward pass per row over context + completion. The definition;
    rows_logps (after update) is the fast way; this one serves --gradient-checkpointing, under
    which HF drops KV caches."""
    context_ids, context_mask = left_pad([rows.context(i) for i in range(len(rows))], 0)
    device = rows.completion_ids.device
    input_ids = torch.cat([context_ids.to(device), rows.completion_ids], 1)
    attention_mask = torch.cat([context_mask.to(device), rows.completion_mask], 1)
    hidden = run_decoder(model, input_ids, attention_mask)  # (B, L + C, H), no KV cache
    # the one-token shift: position L-1 (the context's last token) predicts completion token 0
    L = context_ids.shape[1]
    return token_logps(model.lm_head, hidden[:, L - 1:-1], rows.completion_ids,
                       rows.completion_mask, temperature)

def token_logps(lm_head, hidden, targets, mask, temperature: float):
    """(B, C) float32 log softmax(lm_head(hidden) / T) at `targets` where mask is 1 (else 0), hidden
    (B, C, H) at t predicting targets[:, t]. At most ~2**25 logits exist at a time (a chunk's are
    recomputed in the backward pass), so memory does not grow with B * C * vocabulary."""
    keep = mask.bool()
    h, t = hidden[keep], targets[keep]  # (N, H), (N,): only real tokens
    chunk = max(1, 2**25 // lm_head.out_features)

    def chunk_logps(h, t):
        logits = lm_head(h).float() / temperature  # after the cast: bf16 / T would round again
        return logits.gather(-1, t[:, None]).squeeze(-1) - logits.logsumexp(-1)
    pieces = []
    for hc, tc in zip(h.split(chunk), t.split(chunk)):  # (under no_grad, checkpoint just calls)
        pieces.append(torch.utils.checkpoint.checkpoint(chunk_logps, hc, tc, use_reentrant=False))
    logps = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
    logps[keep] = torch.cat(pieces)
    return logps

def micro_batches(rows: Rows, size: int) -> list[Rows]:
    """Split rows into micro-batches of about `size` rows. A GRPO-MA thought stays in the same
    micro-batch as its answers, which reuse its cache."""
    batches, current = [], []
    for i in (rows.parent < 0).nonzero().squeeze(1).tolist():
        unit = [i] + (rows.parent == i).nonzero().squeeze(1).tolist()
        if current and len(current) + len(unit) > size:
            batches.append(current)
            current = []
        current = current + unit
    batches.append(current)
    return [rows.select(torch.tensor(sorted(b), dtype=torch.long)) for b in batches]

def update(model, ref_model, optimizer, rows: Rows, cfg: Config) -> dict:
    """μ = --num-iterations optimiser steps on one batch of rows, whichever variant made them.
    Sampling ran in eval mode, this runs in train mode: the same policy without dropout (Qwen2/3
    and Llama configs set it to 0). A new per-token loss is a change to policy_loss; a new
    aggregation (TRL's bnpo, say) one to aggregation_weights and global_loss_weights, which weigh
    the whole batch before it is split, so that micro-batches and ranks add up to the batch."""
    metrics = {}
    rows.loss_weights, all_tokens = global_loss_weights(rows, cfg.loss_type)  # before the split
    micro = micro_batches(rows, cfg.micro_batch_size)
    shares = [m.completion_mask.sum().item() / max(all_tokens, 1) for m in micro]  # kl, clips
    device = next(model.parameters()).device
    micro = [m.to(device) for m in micro]
    logps_of = flat_logps if cfg.gradient_checkpointing else rows_logps
    totals = dict.fromkeys(["loss", "clip_low", "clip_high"] + (["kl"] if cfg.beta else []), 0.0)
    grad_norms = []
    with timed(metrics, "time/update"):
        with torch.no_grad():  # old log-probs only when the batch is reused (μ > 1)
            old, ref = None, None
            if cfg.num_iterations > 1:
                old = [logps_of(model, m, cfg.temperature) for m in micro]
            if cfg.beta > 0:
                ref = [logps_of(ref_model, m, cfg.temperature) for m in micro]
        for _ in range(cfg.num_iterations):
            for j, m in enumerate(micro):
                logps = logps_of(model, m, cfg.temperature)
                loss, loss_metrics = policy_loss(
                    logps, old[j] if old else logps.detach(), m.advantages, m.completion_mask,
                    m.loss_weights, ref[j] if ref else None, beta=cfg.beta, epsilon=cfg.epsilon,
                    epsilon_high=cfg.epsilon_high or None)  # the flag's 0: as --epsilon
                loss.backward()
                totals["loss"] += loss.item() / cfg.num_iterations
                for key, value in loss_metrics.items():  # means per token: weighted by share
                    totals[key] += value.item() * shares[j] / cfg.num_iterations
            sum_gradients(model)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm).item()
            if not math.isfinite(norm):  # a NaN step would poison the weights for good
                raise UserError(f"the gradient norm is {norm}, so the update was not applied; "
                                f"lower --lr or --max-grad-norm")
            grad_norms.append(norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    metrics.update(zip(totals, all_reduce(list(totals.values()))))
    metrics["grad_norm"] = float(np.mean(grad_norms))
    metrics["tokens"] = all_tokens
    return metrics

# -----------------------------------------------------------------------------
# The fast log-prob pass that update uses (a first read can skip it): flat_logps' numbers.

def rows_logps(model, rows: Rows, temperature: float):
    """flat_logps' numbers, each shared context encoded once: a prompt's cache is copied to its
    rows, a GRPO-MA thought's on to its answers, and gradients flow back through the copies. A
    prompt, 2 thoughts, 2 answers each:

        level  rows                   input                 cache (a Prefix)      targets
        0      prompt p1 p2 p3        p1 p2                 -                     -
        1      th0, th1               p3, th_k[:-1]         p1 p2 (copied)        th_k
        2      a00 a01, a10 a11       th_k[-1], a_kj[:-1]   p1 p2 p3 th_k[:-1]    a_kj

    Levels 1 and 2 are each one continue_rows. At each level the cache (a Prefix) holds every
    context token but the last, which is the level's first input: the one-token shift. A row
    shorter than its level leaves padding inside the cache, which is masked (positions count real
    tokens only). After a change here or to Rows, `pytest test_grpo.py -k shared_prefix` checks the
    values and gradients against flat_logps' for every variant."""
    B, C = rows.completion_ids.shape
    device = rows.completion_ids.device
    logps = torch.zeros(B, C, device=device)
    prefix = prefill(model, rows.prompts, 0)  # each distinct prompt encoded once
    top = (rows.parent < 0).nonzero().squeeze(1)  # the rows that continue a prompt directly
    prefix.reorder(rows.prompt_index[top])  # one context per top row
    after_top = continue_rows(model, prefix, rows, top, logps, temperature)
    children = (rows.parent >= 0).nonzero().squeeze(1)  # GRPO-MA's answers, after their thought
    if len(children):
        slot = torch.full((B,), -1, dtype=torch.long, device=device)
        slot[top] = torch.arange(len(top), device=device)  # a top row's place in after_top
        assert (slot[rows.parent[children]] >= 0).all(), "a parent row must continue its prompt"
        after_top.reorder(slot[rows.parent[children]])  # one context per child: its parent's
        continue_rows(model, after_top, rows, children, logps, temperature)
    return logps

def continue_rows(model, ctx: Prefix, rows: Rows, idx, logps, temperature: float) -> Prefix:
    """rows_logps' step: write into logps the log-probs of rows idx, each after its context in ctx,
    and return the contexts that end with those rows, ready for their children."""
    n = int(rows.completion_mask[idx].sum(1).max())
    target, target_mask = rows.completion_ids[idx, :n], rows.completion_mask[idx, :n]
    inputs = torch.cat([ctx.last[:, None], target[:, :-1]], 1)  # input t predicts target t
    # a mask is a run of 1s from column 0, so inputs[:, t] is real exactly where target t is: the
    # cache then holds all but each row's last token, its children's first input (Prefix.last)
    attn = torch.cat([ctx.mask, target_mask], 1)
    hidden = run_decoder(model, inputs, attn, ctx.cache)
    logps[idx, :n] = token_logps(model.lm_head, hidden, target, target_mask, temperature)
    last = target.gather(1, (target_mask.sum(1) - 1)[:, None]).squeeze(1)  # each row's last token
    return Prefix(ctx.cache, attn, last)

# -----------------------------------------------------------------------------
# 6. The training loop and the eval.

def train_step(model, tokenizer, ref_model, optimizer, cfg: Config, examples, step: int) -> dict:
    """One step: draw P prompts (afresh each step, from (seed, step): no epochs), sample and score
    this rank's share, update. Returns the metrics."""
    t_step = time.perf_counter()
    rank, W = rank_and_world()
    # data and sampling depend on (seed, step) only, so a resumed run continues the same stream
    data_rng = random.Random(cfg.seed * 1_000_003 + step)
    torch.manual_seed(cfg.seed * 1_000_003 + step * W + rank)
    # every rank takes the same number of whole groups (a data file smaller than P leaves fewer)
    P = min(cfg.prompts_per_step, len(examples) // W * W)
    batch = data_rng.sample(examples, P)[rank * P // W:(rank + 1) * P // W]
    rank_rng = random.Random(f"rephrasings {cfg.seed} {step} {rank}")  # its own stream, per rank
    rows, metrics = ROLLOUTS[cfg.variant](model, tokenizer, cfg, batch, rank_rng)
    metrics = global_means(metrics)  # one all-reduce for all of the rollout's metrics
    if rank == 0 and cfg.log_completions and (step + 1) % cfg.log_completions == 0:
        log_group(cfg, tokenizer, batch[0]["question"], rows, step + 1)
    metrics.update(update(model, ref_model, optimizer, rows, cfg))
    metrics["time/step"] = time.perf_counter() - t_step  # times: this rank's (rank 0 logs)
    metrics["tokens_per_s"] = metrics["tokens"] / metrics["time/sample"]
    return metrics

def log_group(cfg: Config, tokenizer, question: str, rows: Rows, step: int):
    """--log-completions: the rows of the batch's first prompt (GRPO-MA: thoughts with their
    answers; TA under --ta-anchor rephrased: q0's G only) with reward, advantage and (λ-GRPO) mean
    1/|λ|, in completions.jsonl and a table."""
    shown = (rows.prompt_index == 0).nonzero().squeeze(1).tolist()
    texts = decode(tokenizer, rows.completion_ids[shown], rows.completion_mask[shown])
    entries, completions = {}, []
    for i, text in zip(shown, texts):
        on = rows.completion_mask[i].bool()
        advantage = rows.advantages[i][on] if rows.advantages.dim() == 2 else rows.advantages[i]
        entries[i] = {"text": text, "reward": rows.rewards[i].item(),
                      "advantage": advantage.mean().item()}
        if rows.inv_lambda is not None:
            entries[i]["inv_lambda"] = rows.inv_lambda[i][on].mean().item()
        if rows.parent[i] >= 0:  # an answer: listed under its thought
            entries[int(rows.parent[i])].setdefault("answers", []).append(entries[i])
        else:
            completions.append(entries[i])
    record = {"step": step, "question": question, "completions": completions}
    with open(Path(cfg.out) / "completions.jsonl", "a") as f:
        f.write(json.dumps(finite(record), allow_nan=False) + "\n")
    lines = [f"step {step}: {question!r}", "  reward  advantage  completion"]
    for c in completions:
        extra = f"  1/|λ| {c['inv_lambda']:.2f}" if "inv_lambda" in c else ""
        lines.append(f"  {c['reward']:6.2f}  {c['advantage']:+9.2f}  {c['text'][:60]!r}{extra}")
        for a in c.get("answers", []):
            lines.append(f"  {a['reward']:6.2f}  {a['advantage']:+9.2f}    -> {a['text'][:56]!r}")
    tqdm.write("\n".join(lines))

def train(cfg: Config) -> dict:
    """Run GRPO (or a variant) as configured; returns the summary (rank 0; None on the others).
    Checkpoints every --save-every steps and at the end, and when SIGTERM or Ctrl-C stops it
    (after the step in progress and its eval). Setup, loading and saving are in section 7."""
    rank, device = setup_distributed(cfg)
    examples, test_examples = load_data(cfg)
    checkpoint = prepare_out(cfg)
    model, tokenizer, ref_model, optimizer, scheduler, state = load_run(cfg, device, checkpoint)
    start = state["step"] if state else 0
    out, main_rank = Path(cfg.out), rank == 0
    if checkpoint and start == cfg.steps and main_rank:  # a requeue of a finished run
        print(f"grpo.py: the run in {out} finished at step {start}; nothing to train")
    log = open_logs(out, state) if main_rank else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def write(record):
        if main_rank:
            log.write(json.dumps(finite(record), allow_nan=False) + "\n")
            log.flush()

    def run_eval(step):  # at step 0, every --eval-every steps and at the end; rank 0 writes
        if step in (0, cfg.steps) or (cfg.eval_every and step % cfg.eval_every == 0):
            with autocast:  # the same sampling noise for every eval of a run
                write({"step": step, "eval": evaluate(model, tokenizer, test_examples, cfg,
                                                      cfg.seed + 12345)})
    t0 = time.time()
    with signals_caught() as caught:  # a signal in the first eval stops the run after step 1
        if checkpoint is None:
            run_eval(0)
        for step in tqdm(range(start, cfg.steps), desc=cfg.variant, disable=not main_rank):
            lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
            with autocast:  # backward ops take their forward ops' dtypes; AdamW is not autocast
                metrics = train_step(model, tokenizer, ref_model, optimizer, cfg, examples, step)
            scheduler.step()
            write({"step": step + 1, "lr": lr, **metrics})
            run_eval(step + 1)
            done = step + 1
            if main_rank and (done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
                save_checkpoint(out, model, tokenizer, optimizer, scheduler, done, cfg)
            if all_reduce([len(caught)])[0] and done < cfg.steps:  # on every rank
                if main_rank:  # (nothing to write when this step was just saved)
                    save_checkpoint(out, model, tokenizer, optimizer, scheduler, done, cfg)
                all_reduce([0])  # no rank exits before the save: torchrun would stop rank 0 too
                sys.exit(f"grpo.py: {(caught or ['a signal'])[0]} after step {done}: checkpoint "
                         f"saved in {out / f'checkpoint-{done}'}; continue with --resume"
                         if main_rank else 1)
    return report(cfg, time.time() - t0) if main_rank else None

def report(cfg: Config, wall_s: float) -> dict:
    """Print and save the summary: the first and last eval in metrics.jsonl, median phase times."""
    records = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").open()]
    evals = [r["eval"] for r in records if "eval" in r]
    steps = [r for r in records if "time/step" in r]
    phases = {}
    if steps:
        for key in ("time/sample", "time/update", "time/step"):
            phases[key[5:]] = float(np.median([r[key] for r in steps]))
    before, after = evals[0], evals[-1]
    summary = {"variant": cfg.variant, "steps": cfg.steps, "before": before, "after": after,
               "wall_s": wall_s, "median_seconds_per_step": phases}
    (Path(cfg.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    print("median seconds per step: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    k = f"pass@{cfg.eval_samples}"
    print(f"{cfg.variant}: greedy {before['greedy']:.3f} -> {after['greedy']:.3f} | "
          f"pass@1 {before['pass@1']:.3f} -> {after['pass@1']:.3f} | "
          f"{k} {before[k]:.3f} -> {after[k]:.3f} | {wall_s:.0f} s")
    return summary

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))

@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], cfg: Config, seed: int,
             max_rows: int = 512) -> dict:
    """Greedy accuracy, pass@k (k = 1..n) from n = --eval-samples samples per question at the
    training temperature, and the share of samples with answer tags. Chunks of at most max_rows
    samples; chunk c is seeded with seed + c and sampled by rank c % W: what one process gets.
    GRPO-MA's eval samples one plain completion of both limits, not thoughts and answers."""
    n = cfg.eval_samples
    rank, W = rank_and_world()
    limit = cfg.max_new_tokens + (cfg.max_answer_tokens if cfg.variant == "ma" else 0)
    size = max(1, max_rows // n)
    greedy, tagged, pass_k = 0.0, 0.0, [0.0] * n  # sums over this rank's questions and samples
    for c, start in enumerate(range(0, len(examples), size)):
        if c % W != rank:
            continue
        torch.manual_seed(seed + c)
        chunk = examples[start:start + size]
        prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix) for ex in chunk]
        answers = [ex["answer"] for ex in chunk]
        s = generate(model, tokenizer, prompts, 1, limit, greedy=True)
        scored = score_batch(tokenizer, s, answers, 0.0, cfg.reward, cfg.response_prefix)
        greedy += scored[0].sum().item()
        s = generate(model, tokenizer, prompts, n, limit, cfg.temperature)
        rewards, _, tags = score_batch(tokenizer, s, [a for a in answers for _ in range(n)], 0.0,
                                       cfg.reward, cfg.response_prefix)
        tagged += tags.sum().item()
        for correct in rewards.view(len(chunk), n).sum(1).long().tolist():
            for k in range(1, n + 1):
                pass_k[k - 1] += pass_at_k(n, correct, k)
    totals = all_reduce([greedy, tagged] + pass_k)
    result = {"greedy": totals[0] / len(examples), "format": totals[1] / (len(examples) * n)}
    for k in range(1, n + 1):
        result[f"pass@{k}"] = totals[1 + k] / len(examples)
    return result

# -----------------------------------------------------------------------------
# 7. Plumbing (a first read can stop here): numbers, flags, data, models, checkpoints, ranks.

# -----------------------------------------------------------------------------
# Flags and data files: every bad value stops the run with one line that names it.

class UserError(Exception):
    """A bad flag, data line, file or step: main() prints it as one line, without a traceback."""

def reason(e: Exception) -> str:
    """The first line of an exception's message (its type when it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

# the smallest value of each numeric flag (others: 0, and lr, temperature, max_grad_norm > 0)
LOWEST = {"num_generations": 2, "num_thoughts": 2, "prompts_per_step": 1, "num_answers": 1,
          "num_rephrasings": 1, "max_new_tokens": 1, "max_answer_tokens": 1, "num_iterations": 1,
          "micro_batch_size": 1, "eval_samples": 1}

def parse_args(argv=None) -> Config:
    """Flags from the Config fields, checked; local paths made absolute, as a requeue needs."""
    parser = HfArgumentParser(Config, description="GRPO and variants.", allow_abbrev=False)
    parser.error = lambda message: sys.exit(f"grpo.py: error: {message}")  # one line, no usage
    cfg = Config(**vars(parser.parse_args(argv)))
    for f in fields(Config):
        value, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if f.type is float and not math.isfinite(value):
            raise UserError(f"{flag} must be a finite number, got {value}")
        if f.name in ("lr", "temperature", "max_grad_norm") and value <= 0:
            raise UserError(f"{flag} must be > 0, got {value}")
        low = LOWEST.get(f.name, 0)
        if f.type in (int, float) and f.name not in ("seed", "format_reward") and value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    for name in ("model", "data", "test_data"):
        path = Path(getattr(cfg, name)).expanduser()
        if path.exists():
            setattr(cfg, name, str(path.resolve()))
    return cfg

def is_text(value) -> bool:
    """A non-empty string that UTF-8 can write (a lone surrogate such as "\\ud800" cannot)."""
    if not isinstance(value, str):
        return False
    return value.strip() != "" and re.search("[\ud800-\udfff]", value) is None

def parse_example(line: bytes) -> dict:
    """A JSONL line -> {"question": str, "answer": str, "rephrasings": [str] (optional)}, or a
    ValueError saying what is wrong (bad UTF-8 and bad JSON raise their own)."""
    example = json.loads(line.decode("utf-8"), parse_float=Decimal, parse_int=Decimal)
    if not isinstance(example, dict):
        raise ValueError("expected a JSON object with 'question' and 'answer'")
    answer = example.get("answer")
    if isinstance(answer, Decimal):  # a number, written out exactly (1e20 and 0.50 as such)
        if abs(answer.adjusted()) > MAX_NUMBER_CHARS or parse_number(format(answer, "f")) is None:
            raise ValueError("field 'answer' is a number too long to score")
        example["answer"] = format(answer, "f")
    for key in ("question", "answer"):
        if not is_text(example.get(key)):
            raise ValueError(f"field '{key}' is missing, empty or not valid text")
    rephrasings = example.setdefault("rephrasings", [])
    if not isinstance(rephrasings, list) or not all(is_text(r) for r in rephrasings):
        raise ValueError("field 'rephrasings' must be a list of non-empty texts")
    return example

def load_jsonl(path) -> list[dict]:
    """A data file's examples; a bad line stops the run with its file:line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such data file")
    examples = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            if line.strip():
                examples.append(parse_example(line))
        except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deeply
            raise UserError(f"{path}:{number}: {reason(e)}") from None
    if not examples:
        raise UserError(f"{path}: no examples")
    return examples

def load_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    """The training examples and the first --eval-limit held-out ones; TA needs rephrasings."""
    examples = load_jsonl(cfg.data)
    test_examples = load_jsonl(cfg.test_data)[:cfg.eval_limit or None]
    world = rank_and_world()[1]
    if len(examples) < world:
        raise UserError(f"{cfg.data}: {len(examples)} examples, fewer than the {world} ranks")
    if cfg.variant == "ta" and not any(ex["rephrasings"] for ex in examples):
        raise UserError(f"{cfg.data}: --variant ta needs examples with 'rephrasings'; none has any")
    return examples, test_examples

# -----------------------------------------------------------------------------
# Models, checkpoints, resume and signals.

def pick_device(name: str) -> torch.device:
    """--device: auto picks the accelerator (cuda, mps) if there is one, else cpu."""
    found = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    if name not in ("auto", "cpu", found.type):
        raise UserError(f"--device {name}: {name} is not available on this machine")
    return found if name == "auto" else torch.device(name)

def load_model(path: str, device):
    """Model and tokenizer from a local folder or the hub; fp32, left padding, a pad token."""
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24):
        raise UserError(f"transformers {transformers.__version__}: grpo.py needs 5.24 or newer")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
        raise UserError(f"--model {path}: no such folder")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as e:  # a missing, corrupt or empty file: say which folder, in one line
        raise UserError(f"--model {path}: cannot load a model and tokenizer there "
                        f"({reason(e)})") from None
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        raise UserError(f"--model {path}: {type(model).__name__} is not supported (the sampler "
                        f"needs a decoder at .model and an .lm_head, as Qwen2/3 and Llama have)")
    if not tokenizer.chat_template:
        raise UserError(f"--model {path}: the tokenizer has no chat template (a base model?); "
                        f"prompts are chat-templated: use an instruct model or add a template")
    if tokenizer.pad_token is None:  # Llama: pad with eos; the completion mask never relies on pad
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer

def load_run(cfg: Config, device, checkpoint: Path | None):
    """Policy, tokenizer, reference (beta > 0), optimizer, schedule, and the checkpoint's state."""
    state = load_state(checkpoint, cfg) if checkpoint else None
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(str(checkpoint) if checkpoint else cfg.model, device)
    ref_model = None
    if cfg.beta > 0:  # the frozen starting policy
        ref_model = load_model(cfg.model, device)[0].eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return model, tokenizer, ref_model, optimizer, scheduler, state

LOGS = ("metrics.jsonl", "completions.jsonl")  # appended to as the run goes
# flags a resumed run may change: where it runs, how often it evaluates and saves, memory knobs;
# not what it trains or evaluates on (its first and last evals must stay comparable)
RESUMABLE = {"steps", "out", "resume", "overwrite", "device", "eval_every", "save_every",
             "micro_batch_size", "gradient_checkpointing", "log_completions"}

def run_files(out: Path) -> list[Path]:
    """What a run leaves in its folder: checkpoints (and a save that died), logs, summary."""
    names = [out / name for name in LOGS + ("summary.json",)]
    return list(out.glob("checkpoint-*")) + [path for path in names if path.exists()]

def prepare_out(cfg: Config) -> Path | None:
    """The checkpoint to continue from, or None to start. A folder holding a run is continued
    (--resume) or replaced (--overwrite), never reused; --resume without a checkpoint starts."""
    out = Path(cfg.out)
    found = {}  # step -> its complete checkpoint (a save in progress is 'checkpoint-<step>.tmp')
    for path in out.glob("checkpoint-*"):
        if re.fullmatch("[0-9]+", path.name[len("checkpoint-"):]):
            found[int(path.name[len("checkpoint-"):])] = path
    if cfg.resume and found:
        return found[max(found)]
    names = sorted(path.name for path in run_files(out))
    if names and not (cfg.overwrite or cfg.resume):
        raise UserError(f"--out {out} already holds a run ({', '.join(names)}); continue it with "
                        f"--resume or replace it with --overwrite")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return None

def load_state(checkpoint: Path, cfg: Config) -> dict:
    """A checkpoint's state.pt (weights_only: no code runs), if the flags keep the run's meaning."""
    path = checkpoint / "state.pt"
    try:
        state = torch.load(path, weights_only=True)
        saved = state["config"]
    except Exception as e:
        raise UserError(f"--resume: {path} is not a checkpoint this file wrote ({reason(e)})") \
            from None
    differ = [n for n in saved if n not in RESUMABLE and saved[n] != getattr(cfg, n, None)]
    if differ:
        change = ", ".join(f"--{n.replace('_', '-')} {saved[n]} -> {getattr(cfg, n, None)}"
                           for n in differ)
        raise UserError(f"--resume: {change} would change what the run in {checkpoint.parent} "
                        f"means; keep its flags or start a new run in another --out")
    if cfg.steps < state["step"]:
        raise UserError(f"--resume: the run is at step {state['step']}; --steps {cfg.steps} must "
                        f"be at least that")
    return state

def open_logs(out: Path, state: dict | None):
    """metrics.jsonl to append to. A fresh run first removes an old run's files (now that its own
    checks passed); a resumed one cuts the logs to their size at the checkpoint: what it redoes
    (and a line cut short by a kill) is not there twice."""
    if state is None:
        for path in run_files(out):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    else:
        for name in LOGS:  # a log the checkpoint did not see (no size) is cut to nothing
            if (out / name).exists():
                size = state["logs"].get(name, 0)
                os.truncate(out / name, min(size, (out / name).stat().st_size))
    return open(out / "metrics.jsonl", "a")

def save_checkpoint(out: Path, model, tokenizer, optimizer, scheduler, step: int, cfg: Config):
    """out/checkpoint-<step>: model, tokenizer, and state.pt (optimizer, schedule, step, config,
    the logs' sizes), renamed from a temporary folder when complete; then older ones go."""
    final = out / f"checkpoint-{step}"
    if not final.is_dir():
        tmp = out / f"checkpoint-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        logs = {name: (out / name).stat().st_size for name in LOGS if (out / name).exists()}
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "step": step, "config": asdict(cfg), "logs": logs}, tmp / "state.pt")
        os.replace(tmp, final)
    for old in out.glob("checkpoint-*"):
        if old != final:
            shutil.rmtree(old)

@contextlib.contextmanager
def signals_caught():
    """SIGTERM (Slurm's and Kubernetes' stop) and Ctrl-C ask the run to stop after the step in
    progress: yields the signals caught. A second one acts as before (Ctrl-C twice stops now)."""
    caught, previous = [], {}

    def catch(signum, frame):
        caught.append(signal.Signals(signum).name)
        signal.signal(signum, previous[signum])
    if threading.current_thread() is threading.main_thread():  # where Python allows handlers
        previous = {s: signal.signal(s, catch) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

def finite(value):
    """NaN and infinities -> None (null), inside dicts and lists too: the logs stay strict JSON."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value

# -----------------------------------------------------------------------------
# Data parallel (torchrun): each rank samples whole groups for its share of the prompts, metrics
# are of the global batch, gradients are summed over the ranks, rank 0 writes and saves.

def setup_distributed(cfg: Config):
    """Join torchrun's process group (NCCL on GPUs, gloo on CPU); returns (rank, device)."""
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return 0, pick_device(cfg.device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.prompts_per_step % world:
        raise UserError(f"--prompts-per-step {cfg.prompts_per_step} must be divisible by the "
                        f"{world} ranks")
    device = pick_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    # NCCL's default timeout, 10 minutes, would kill a long step or a slow save on rank 0
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         timeout=datetime.timedelta(hours=2))
    return rank, device

def rank_and_world() -> tuple[int, int]:
    """(this process's rank, the number of ranks): (0, 1) without torchrun."""
    if not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()

def all_reduce(values: list[float]) -> list[float]:
    """Sum plain numbers over the ranks; identity in a single process."""
    if not torch.distributed.is_initialized():
        return values
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()

def global_means(metrics: dict) -> dict:
    """Each tensor in metrics -> the mean of its elements over all ranks (NaN if there are none),
    also when ranks hold different numbers of them; other values stay. One all-reduce."""
    keys = [key for key, value in metrics.items() if isinstance(value, torch.Tensor)]
    sums = [metrics[key].cpu().double().sum().item() for key in keys]  # (MPS has no float64)
    totals = all_reduce(sums + [metrics[key].numel() for key in keys])
    means = dict(metrics)
    for i, key in enumerate(keys):
        count = totals[len(keys) + i]
        means[key] = totals[i] / count if count else math.nan
    return means

def sum_gradients(model):
    """Sum the gradients over the ranks: the loss weights are shares of the global batch."""
    if not torch.distributed.is_initialized():
        return
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)

@contextlib.contextmanager
def timed(metrics: dict, key: str):
    """Add the block's wall seconds (once the GPU's queued work is done) to metrics[key]."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start

def main(argv=None):
    """The command line: bad flags, files or data stop with one line that names them."""
    try:
        return train(parse_args(argv))
    except UserError as e:
        sys.exit(f"grpo.py: error: {e}")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main()
