"""
grpo.py: GRPO and three recent variants of it, in one file you can read top to bottom.

    python grpo.py                      # GRPO on the tiny model in data/tiny (CPU, offline, ~40 s)
    python grpo.py --variant lambda     # or ma, ta
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data my_train.jsonl \\
        --test-data my_test.jsonl --max-new-tokens 512 --lr 1e-6    # one GPU, bf16 autocast
    torchrun --nproc_per_node=8 grpo.py ...   # data parallel: each rank samples its share

The four schemes differ only in how completions are sampled and how their advantages and per-token
weights are filled in; they share the sampler, the log-prob pass and the loss:

- grpo    GRPO (DeepSeekMath, arXiv 2402.03300): P prompts x G completions; advantage = reward
          normalised within the group; clipped ratio; optional k3 KL to a frozen reference.
- ma      GRPO-MA (arXiv 2509.24494): per prompt K thoughts (stopped after </think>) and M
          answers per thought; a thought's value is the mean reward of its answers, thought
          advantage normalised over the K thoughts, answer advantage over all K*M answers.
- ta      TA-GRPO (arXiv 2601.22478): the question plus N problem-equivalent rephrasings, G
          samples each; advantages normalised jointly over the (N+1)*G responses; every response
          is trained as an answer to the original question q0 (importance ratios anchored on q0).
- lambda  λ-GRPO (arXiv 2509.21154): each token's loss term is divided by |λ(i,t)|, the number
          of completions in the group sharing the completion's prefix up to and including it.

Reading map (a first read can stop before the plumbing):
  1. The ideas           group_advantages, ma_advantages, ta_advantages, lambda_weights: one
                         function per scheme, on plain tensors, with worked numbers; policy_loss
                         and micro_batch_weights: the clipped surrogate, the KL, the aggregations.
  2. Samples into rows   score (the reward), Rows (what every variant hands to the loss), and one
                         rollout function per variant: sample, score, fill rows.
  3. Sampler, log-probs  prefill each distinct context once, decode token by token (sample);
                         log-probs of the rows, each shared context encoded once (rows_logps).
  4. Update and loop     update (μ clipped steps in micro-batches), train_step, train, report.
  5. Eval                greedy accuracy and unbiased pass@k.
  6. Plumbing            flags and their checks, data files, model loading, checkpoints and
                         resume, signals, the metrics file, data-parallel helpers, timing.

Everything is organised around *rows*. A row is a completion to train on: its ids and mask, an
advantage (per row, or per token), optional per-token weights, and its context: the prompt it
continues and, for GRPO-MA's answers, the row (the thought) that comes between. What each variant
makes for one prompt (or question) p:

    variant       rows      context            completion        advantage
    grpo, lambda  G         p                  o_i               r_i normalised over the G
                                                                 (lambda: token weights 1/|λ|)
    ma            K         p                  thought th_k      V_k = mean_j r_kj, over the K
                  K*M       p + th_k           answer a_kj       r_kj normalised over all K*M
    ta            (N+1)*G   q0 (or q_j with    response to q_j   r normalised over all (N+1)*G
                            --ta-anchor rephrased)

A variant is a function that samples and fills rows; update() does not know which variant made
them.

One training step (train_step, then update), in pseudocode:

    batch = P prompts drawn for this step (from seed and step)
    rows = ROLLOUTS[variant](model, tokenizer, cfg, batch, rng), e.g. rollout_grpo:
        completions = generate(model, tokenizer, prompts, G, ...)  # the policy at temperature T
        rewards = score_batch(tokenizer, completions, answers)      # 1 if the answer is right
        advantages = group_advantages(rewards, G)                   # (or ma_ / ta_advantages)
    old_logps = rows_logps(model, rows) if μ > 1                    # (and ref_logps if β > 0)
    for each of the μ = --num-iterations passes:
        for each micro-batch of rows:
            logps = rows_logps(model, micro)                        # log π(o_t | context, o_<t)
            loss = policy_loss(logps, old_logps or logps.detach(), advantages, mask, ...)
            (loss * micro_batch_weights(...)).backward()            # adds up to the batch's loss
        sum_gradients (ranks); clip_grad_norm_; optimizer.step()

The default run is on-policy (μ = 1): old_logps = logps.detach(), so the ratio is 1, nothing is
clipped, and the gradient is the policy gradient A ∇ log π; `--num-iterations 2` reuses the batch
and shows the clip, `--beta 0.04` adds the KL to a frozen reference. The default --loss-type is
dapo (one token mean over the batch); DeepSeekMath's GRPO is --loss-type grpo.

The objectives (to maximise; the loss is -J). With ρ_t = π(o_t | c, o_<t) / π_old(...), the
clipped term f(ρ, A) = min(ρ A, clip(ρ, 1-ε, 1+ε_high) A) - β KL_t and |o| tokens in o:

    grpo    J = 1/(P G) Σ_i 1/|o_i| Σ_t f(ρ_it, A_i)          (--loss-type grpo, DeepSeekMath's)
            --loss-type dapo (the default): Σ_i Σ_t f / Σ_i |o_i|, one token mean over the batch
    lambda  the same with each f(ρ_it, A_i) multiplied by 1/|λ(i,t)|
    ma      J = J_tok(thoughts th_k, V-advantages) + J_tok(answers a_kj, answer advantages), each
            part aggregated on its own (--ma-weighting parts), so the thoughts keep half of the
            objective for every M; --ma-weighting tokens pools both in one aggregation
    ta      J as grpo over the (N+1) G responses of a question, with ρ and ∇ log π taken on q0:
            π(o | q0) whichever phrasing o answered

What is simplified versus the papers (honestly):
- Sampling is a short KV-cache loop of our own over the model's forward (each distinct prompt
  prefilled once, its cache copied to its G continuations, finished rows dropped), not vLLM: no
  paged attention, no continuous batching, and one process samples and trains, so it is meant for
  models up to ~1-3B on one GPU. The update encodes each shared context once too, except with
  --gradient-checkpointing (HF drops the KV cache then).
- The reward is exact-match of the last <answer>...</answer> (or \\boxed{...}) after simple number
  normalisation, not math_verify; an unfinished completion (no EOS within the limit) scores 0.
- No LoRA; the reference model, when beta > 0, is a full frozen copy.
- GRPO-MA: thoughts that never close with </think> are not continued: value 0, answers missing
  (see rollout_ma). The paper's weighting between thought and answer tokens is not published;
  the default (parts) follows the one written reading, (1/K) Σ_k J(th_k) + (1/KM) Σ_kj J(a_kj)
  (exactly so under --loss-type grpo when every thought closes: the answer mean is over the
  answers that exist; under dapo each part is a token mean).
- TA-GRPO: rephrasings come from the data file (rule-made for the shipped data; `data/prepare.py
  rephrase` makes them with a local model) instead of GPT-4-Turbo.
- λ-GRPO: the paper's synthetic experiment used GPT-2; our reproduction uses a tabular policy.
- The learning rate warms up linearly and then stays constant.
"""

import argparse
import contextlib
import datetime
import inspect
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
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPT = "reply <think>...</think><answer>...</answer>"

# -----------------------------------------------------------------------------
# Config: one dataclass of defaults; every field is also a command-line flag (--field-name).


def _opt(default, help, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    # model and data
    model: str = _opt(str(HERE / "data" / "tiny"), "local folder or hub name of a causal LM")
    data: str = _opt(str(HERE / "data" / "train.jsonl"),
                     "training JSONL: question, answer, rephrasings (optional)")
    test_data: str = _opt(str(HERE / "data" / "test.jsonl"), "held-out JSONL for eval")
    system_prompt: str = _opt(SYSTEM_PROMPT, "system message of every prompt ('' for none)")
    variant: str = _opt("grpo", "advantage/weighting scheme", ["grpo", "ma", "ta", "lambda"])
    # sampling
    num_generations: int = _opt(8, "G: completions per prompt (grpo, lambda) or per phrasing (ta)")
    prompts_per_step: int = _opt(16, "P: prompts per step")
    max_new_tokens: int = _opt(32, "completion length limit (for ma: the thought's limit)")
    temperature: float = _opt(1.0, "sampling temperature; log-probs use the same")
    top_p: float = _opt(1.0, "nucleus sampling (1.0 = off); top-k is always off")
    # GRPO-MA
    num_thoughts: int = _opt(4, "K (ma): thoughts per prompt")
    num_answers: int = _opt(4, "M (ma): answers per thought")
    max_answer_tokens: int = _opt(24, "answer length limit (ma)")
    ma_weighting: str = _opt("parts", "(ma) thoughts and answers aggregated each on its own, then "
                             "summed (parts), or pooled in one aggregation (tokens)",
                             ["parts", "tokens"])
    # TA-GRPO
    num_rephrasings: int = _opt(3, "N (ta): rephrasings per question, drawn afresh each step")
    ta_anchor: str = _opt("original",
                          "(ta) context of the log-probs: q0 (paper v5) or the rephrasing "
                          "(public code)",
                          ["original", "rephrased"])
    # loss and optimisation
    loss_type: str = _opt("dapo", "token aggregation, as TRL", ["grpo", "bnpo", "dr_grpo", "dapo"])
    scale_rewards: str = _opt("group", "std used to scale advantages", ["group", "batch", "none"])
    beta: float = _opt(0.0, "k3 KL coefficient (a reference model is loaded only when > 0)")
    epsilon: float = _opt(0.2, "lower clip range of the ratio")
    epsilon_high: float = _opt(0.0, "upper clip range (0 = same as --epsilon; DAPO uses 0.28)")
    num_iterations: int = _opt(1, "mu: updates per sampled batch")
    reward: str = _opt("tags", "how the answer is read: the last <answer>..</answer> (else "
                       "\\boxed), or the last number (for models that do not write the tags)",
                       ["tags", "last-number"])
    format_reward: float = _opt(0.0, "extra reward for one <think>..</think><answer>..</answer>")
    lr: float = _opt(2e-4, "AdamW learning rate (tiny model; use ~1e-6 for real models)")
    warmup_steps: int = _opt(10, "linear warmup, then constant")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    max_grad_norm: float = _opt(1.0, "gradient clipping")
    micro_batch_size: int = _opt(64, "rows per forward/backward (gradients accumulate across them)")
    steps: int = _opt(100, "training steps")
    # eval, logging, checkpoints, runtime
    eval_every: int = _opt(50, "eval every N steps (0 = only at start and end)")
    save_every: int = _opt(50, "checkpoint every N steps (0 = only at the end); SIGTERM and "
                               "Ctrl-C save too")
    eval_samples: int = _opt(8, "samples per held-out question for pass@k")
    eval_limit: int = _opt(0, "use only the first N held-out questions (0 = all)")
    log_completions: int = _opt(25, "every N steps, the first prompt's group as text: a table "
                                    "on the console, a line in <out>/completions.jsonl (0 = off)")
    out: str = _opt("out", "run folder: metrics.jsonl, checkpoint")
    resume: bool = _opt(False, "continue from the latest checkpoint in --out, or start the run "
                               "there if it has none; a finished run exits 0 (one command for the "
                               "first launch and every requeue)")
    overwrite: bool = _opt(False, "replace a run already in --out (else such a folder stops it)")
    seed: int = _opt(0, "seed for data order, sampling and init")
    device: str = _opt("auto", "auto: cuda, then mps, then cpu", ["auto", "cuda", "mps", "cpu"])
    gradient_checkpointing: bool = _opt(False, "trade compute for activation memory (real models)")

# =============================================================================
# 1. The ideas: one small function per scheme, on plain tensors, then the loss.
# =============================================================================


def group_advantages(rewards, group_size: int, scale: str = "group", eps: float = 1e-4):
    """GRPO advantages. Rows form groups of `group_size` consecutive rewards;
    A = (r - group mean) / (std + eps), std unbiased (ddof=1, as TRL); scale="batch" uses the std of
    the whole batch, "none" skips the division. A group whose rewards are all equal gets exactly 0.
    NaN rewards mark rows that do not exist (TA's questions with fewer rephrasings, MA's unanswered
    thoughts): they are left out of the statistics and get NaN back.

    >>> group_advantages(torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.]), 4)
    tensor([ 1.4997, -0.4999, -0.4999, -0.4999,  0.0000,  0.0000,  0.0000,  0.0000])

    (group 1: mean 0.25, std 0.5, so 0.75/0.5001 and -0.25/0.5001; group 2's rewards are all
    equal, so 0.)
    """
    r = rewards.reshape(-1, group_size)  # (num_groups, group_size)
    adv = r - r.nanmean(1, keepdim=True)
    if scale == "group":
        adv = adv / (_nanstd(r, 1, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / (_nanstd(rewards) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    # a group whose existing rewards are all equal (max == min, NaN left out) gets exactly 0, not
    # the rounding noise of its mean divided by eps
    high = torch.where(r.isnan(), -math.inf, r).amax(1, keepdim=True)
    low = torch.where(r.isnan(), math.inf, r).amin(1, keepdim=True)
    adv = torch.where((high == low) & ~r.isnan(), 0.0, adv)
    return adv.reshape(rewards.shape)


def _nanstd(x, dim=None, keepdim=False):
    """Unbiased (ddof=1) std that ignores NaN entries (torch has nanmean but no nanstd)."""
    if dim is None:
        return (((x - x.nanmean()) ** 2).nansum() / ((~x.isnan()).sum() - 1)).sqrt()
    mean = x.nanmean(dim=dim, keepdim=True)
    n = (~x.isnan()).sum(dim=dim, keepdim=keepdim)
    return (((x - mean) ** 2).nansum(dim=dim, keepdim=keepdim) / (n - 1)).sqrt()


def ma_advantages(rewards, scale: str = "group", eps: float = 1e-4):
    """GRPO-MA advantages from a (P, K, M) reward tensor: P prompts, K thoughts each, M answers per
    thought. A thought's value V(th_k) is the mean of its M answer rewards; the thought advantage
    normalises V over the K thoughts of its prompt; the answer advantage normalises the rewards over
    all K*M answers of the prompt (not within a thought). Same std convention and zero-variance rule
    as group_advantages. A thought that was never answered (it did not close with </think>) has NaN
    answer rewards: its value is 0 and its missing answers are left out of the answer statistics.
    Returns (thought_adv (P, K), answer_adv (P, K, M)).

    One prompt, K=2, M=2, rewards [[1, 1], [1, 0]]: V = [1, 0.5], mean 0.75, std 0.3536 ->
    thought_adv = [0.7069, -0.7069]; answers: mean 0.75, std 0.5 ->
    answer_adv = [[0.4999, 0.4999], [0.4999, -1.4997]].
    Rewards [[1, 0], [nan, nan]]: V = [0.5, 0] -> thought_adv = [0.7069, -0.7069];
    answer_adv = [[0.7070, -0.7070], [nan, nan]] (the two real answers alone: mean 0.5, std 0.7071).
    """
    P, K, M = rewards.shape
    values = rewards.nanmean(-1).nan_to_num(0.0)  # (P, K); an unanswered thought is worth 0
    thought_adv = group_advantages(values.reshape(-1), K, scale, eps).reshape(P, K)
    answer_adv = group_advantages(rewards.reshape(-1), K * M, scale, eps).reshape(P, K, M)
    return thought_adv, answer_adv


def ta_advantages(rewards, scale: str = "group", eps: float = 1e-4):
    """TA-GRPO advantages from a (P, N+1, G) reward tensor: question q0 and its N rephrasings, G
    responses each. All (N+1)*G responses of a question form one group. A question with fewer than N
    rephrasings marks the missing ones with NaN rewards (a ragged group): ignored, NaN back.

    One question, N=1, G=2, rewards [[1, 1], [0, 1]]: the q0 group alone has zero variance, but
    pooled mean 0.75, std 0.5 -> [[0.4999, 0.4999], [-1.4997, 0.4999]].
    """
    P, Q, G = rewards.shape
    return group_advantages(rewards.reshape(-1), Q * G, scale, eps).reshape(P, Q, G)


def lambda_weights(completion_ids, completion_mask, group_size: int):
    """λ-GRPO token weights 1/|λ(i,t)|, (B, T) float, 0 where the mask is 0.

    λ(i,t), the process set of token t of completion i, is the set of completions j in i's group
    whose tokens 0..t (up to and including t) equal i's and are all unmasked; it counts i itself and
    exact duplicates. Tokens in a shared prefix are trained once per prefix instead of once per
    completion. Rows form groups of `group_size` consecutive rows. Exact and loop-free: compare
    every pair of rows of a group token by token, and a running product turns "equal at t" into
    "equal up to and including t"; this takes B * group_size * T bytes.

    Group {ABCD, ABEFHI, JKLM, JKLNQST, JKLNQU, VWYZ}: A,B -> 1/2; J,K,L -> 1/3; N,Q -> 1/2; the
    other tokens 1.
    """
    B, T = completion_ids.shape
    ids = completion_ids.view(-1, group_size, T)  # (groups, G, T)
    mask = completion_mask.view(-1, group_size, T).bool()
    same = (ids[:, :, None] == ids[:, None]) & mask[:, :, None] & mask[:, None]  # (groups, G, G, T)
    counts = same.to(torch.uint8).cumprod(-1).sum(2, dtype=torch.int32)  # |λ(i,t)|, (groups, G, T)
    return torch.where(mask, 1.0 / counts.clamp(min=1), 0.0).view(B, T)

# -----------------------------------------------------------------------------
# The loss: clipped ratio, optional k3 KL, per-token weights, TRL's aggregations.


def policy_loss(per_token_logps, old_per_token_logps, advantages, completion_mask,
                ref_per_token_logps=None, token_weights=None, beta=0.0, epsilon=0.2,
                epsilon_high=None, loss_type="dapo", max_completion_length=None):
    """GRPO surrogate loss (to minimise) and metrics.

    per-token loss = -min(ρ A, clip(ρ, 1-ε, 1+ε_high) A) + β (exp(ref - logp) - (ref - logp) - 1),
    with ρ = exp(logp - old). With one update per batch (μ = 1) old = logp.detach(): ρ is 1 and no
    token is clipped, but ρ's gradient is logp's: the loss's value, -(token-weighted mean
    advantage), says little, while its gradient is the policy gradient.
    advantages: (B,) broadcast over tokens, or (B, T) per token, the hook for a scheme of your own
    (a process reward, say); none of the four here needs it. token_weights (B, T) multiply the whole
    per-token loss (policy and KL) and leave the normaliser alone (λ-GRPO).
    Aggregation as TRL: grpo = mean over rows of each row's token mean; bnpo and dapo = sum over all
    tokens / number of tokens (the same within one micro-batch: they differ in how micro-batches are
    weighted, see micro_batch_weights); dr_grpo = sum / (B * max_completion_length).

    Per-token losses of row 1 [1, 1] and row 2 [2, 2, 2, 2]: grpo 1.5, bnpo/dapo 1.667, dr_grpo
    (length 8) 0.625.
    """
    mask = completion_mask.float()
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    epsilon_high = epsilon_high or epsilon
    ratio = torch.exp(per_token_logps - old_per_token_logps)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)  # (B, T)
    metrics = {}
    if beta:
        delta = ref_per_token_logps - per_token_logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).item()
    if token_weights is not None:
        loss = loss * token_weights
    if loss_type == "grpo":
        total = ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    elif loss_type in ("bnpo", "dapo"):
        total = (loss * mask).sum() / mask.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        total = (loss * mask).sum() / (loss.shape[0] * (max_completion_length or loss.shape[1]))
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    n = mask.sum().clamp(min=1).item()
    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (adv < 0)  # clipped tokens, where the clip binds
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        metrics["clip_low"] = (low.float() * mask).sum().item() / n
        metrics["clip_high"] = (high.float() * mask).sum().item() / n
    return total, metrics


def micro_batch_weights(loss_type: str, rows: list[int], tokens: list[int],
                        nominal_rows: int) -> list[float]:
    """The weight of each micro-batch's loss (rows[j] rows, tokens[j] completion tokens) so that the
    sum of weighted losses over micro-batches, and over ranks (gradients are summed over ranks), is
    the loss of the whole batch. dapo's micro loss is a token mean, so it weighs its share of the
    batch's tokens; grpo's is a row mean, so it weighs its share of the rows; dr_grpo's is
    sum / (rows * max length), so it weighs its rows over the batch's *nominal* rows (P*G, however
    many were made): the normaliser stays the constant nominal_rows * max length; TRL's bnpo
    normalises each micro-batch on its own and averages them over all (non-empty) micro-batches of
    all ranks: that is the only difference between bnpo and dapo. (all_reduce sums plain numbers
    over the ranks, so the shares are of the global batch; in one process it does nothing.)

    One rank, micro-batches of 2 rows each with 3 and 5 tokens, 8 nominal rows: dapo 3/8, 5/8;
    grpo and bnpo 1/2, 1/2; dr_grpo 1/4, 1/4."""
    non_empty = sum(1 for r in rows if r)
    all_rows, all_tokens, all_micro = all_reduce([sum(rows), sum(tokens), non_empty])
    if loss_type == "dapo":
        return [t / max(all_tokens, 1) for t in tokens]
    if loss_type == "grpo":
        return [r / max(all_rows, 1) for r in rows]
    if loss_type == "dr_grpo":
        return [r / nominal_rows for r in rows]
    return [1 / max(all_micro, 1)] * len(rows)


def loss_parts(cfg, num_prompts: int) -> list[tuple[int, int]]:
    """The parts of a batch whose losses are aggregated on their own and then summed, each as
    (nominal rows in the global batch, longest allowed completion): dr_grpo's constant is their
    product. One part, except GRPO-MA with --ma-weighting parts: part 0 the K thoughts, part 1 the
    K*M answers of each prompt (a row's part is whether it has a parent), so that
    J = J(thoughts) + J(answers) and the thoughts keep their share of the objective for every M.
    (--ma-weighting tokens pools both in one aggregation: under dapo the thoughts' share is
    Lt / (Lt + M*La), under grpo 1 / (1 + M).)"""
    P, G = num_prompts, cfg.num_generations
    if cfg.variant == "ma":
        K, M = cfg.num_thoughts, cfg.num_answers
        if cfg.ma_weighting == "parts":
            return [(P * K, cfg.max_new_tokens), (P * K * M, cfg.max_answer_tokens)]
        return [(P * K * (1 + M), max(cfg.max_new_tokens, cfg.max_answer_tokens))]
    if cfg.variant == "ta":
        return [(P * (cfg.num_rephrasings + 1) * G, cfg.max_new_tokens)]
    return [(P * G, cfg.max_new_tokens)]

# =============================================================================
# 2. Samples into rows: the reward, the rows every variant hands to the loss, one rollout each.
# =============================================================================

# The reward: exact match of the final answer, read the way graders read it. Model output is only
# ever parsed as text.
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# a run of digits joined by . , or / (linear: no backtracking on long punctuation); [0-9], not \d,
# which also matches other scripts' digits
RUN_RE = re.compile(r"-?\.?[0-9]+(?:[.,/][0-9]+)*")
# a well-formed run: commas only as thousands separators, an optional decimal part, a fraction
DECIMAL = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
NUMBER_RE = re.compile(rf"-?(?:{DECIMAL})(?:/(?:{DECIMAL}))?")
FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"  # any text without a think/answer tag in it
FORMAT_RE = re.compile(rf"\s*<think>{NO_TAG}</think>\s*<answer>{NO_TAG}</answer>\s*", re.DOTALL)
MAX_NUMBER_CHARS = 100  # longer "numbers" are not parsed: int() refuses > 4300 digits


def after_thought(text: str):
    """The text after the first </think> (all of it without one; None if a <think> never closes),
    so that an answer written inside the thought is never credited."""
    if "<think>" in text and "</think>" not in text:
        return None
    return text.split("</think>", 1)[-1]


def boxed(text: str):
    """What the last \\boxed{...} holds (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def number_runs(text: str) -> list[str]:
    """The number-like runs of a text, after the Unicode minus and \\frac{a}{b} are made plain."""
    text = FRAC_RE.sub(r"\1/\2", text.replace("\u2212", "-"))
    return RUN_RE.findall(text)


def extract_answer(text: str, reward: str = "tags"):
    """The answer a completion gives, after its thought (see after_thought), or None.
    tags: the last <answer>...</answer>, else the last \\boxed{...}; last-number: the last number
    (as GSM8K graders read it, for models that do not write the tags)."""
    text = after_thought(text)
    if text is None:
        return None
    if reward == "last-number":
        runs = number_runs(text)
        return runs[-1] if runs else None
    found = ANSWER_RE.findall(text)
    if found:
        return found[-1]
    return boxed(text)


def parse_number(text: str):
    """The one number an answer holds -> Fraction, else None. Read as graders do: inside a
    \\boxed{...} if there is one; words, units, $, \\text{}, ** and a final full stop around the
    number ignored ('The answer is 1,234.', '18 eggs', '\\$12.50'); '.5', '-3/4', '-\\frac{1}{2}',
    the Unicode minus. Commas only as thousands separators: '3,5' and '1, 2' are not numbers."""
    inner = boxed(text)
    runs = number_runs(text if inner is None else inner)
    if len(runs) != 1 or len(runs[0]) > MAX_NUMBER_CHARS or not NUMBER_RE.fullmatch(runs[0]):
        return None
    numerator, _, denominator = runs[0].replace(",", "").partition("/")
    if denominator and Fraction(denominator) == 0:
        return None
    return Fraction(numerator) / Fraction(denominator or 1)


def score(text: str, reference: str, finished: bool, format_reward: float = 0.0,
          reward: str = "tags"):
    """Return (reward, parsed). Reward 1 if the completion finished (EOS) and its answer (see
    extract_answer) equals the reference (as numbers when the reference is one, else as
    whitespace-free strings); plus format_reward, if it finished, for exactly one <think>..</think>
    followed by exactly one <answer>..</answer>. parsed is False when no answer could be read."""
    answer = extract_answer(text, reward)
    ref_num = parse_number(reference)
    answer_num = parse_number(answer) if answer is not None else None
    parsed = answer is not None and (ref_num is None or answer_num is not None)
    correct = False
    if parsed and finished:
        correct = (answer_num == ref_num) if ref_num is not None else (
            re.sub(r"\s", "", answer) == re.sub(r"\s", "", reference))
    shaped = finished and FORMAT_RE.fullmatch(text) is not None
    return float(correct) + format_reward * shaped, parsed


def score_batch(tokenizer, samples, answers, format_reward=0.0, reward="tags", prefixes=None):
    """Rewards (B,), parsed flags (B,) and tagged flags (B,: an <answer>...</answer> after the
    thought, in either reward mode) of sampled completions; prefixes (a thought) are prepended."""
    texts = decode(tokenizer, samples.completion_ids, samples.completion_mask)
    if prefixes is not None:
        texts = [p + t for p, t in zip(prefixes, texts)]
    finished = samples.finished.tolist()
    scored = [score(t, a, f, format_reward, reward) for t, a, f in zip(texts, answers, finished)]
    tagged = [ANSWER_RE.search(after_thought(t) or "") is not None for t in texts]
    rewards = torch.tensor([r for r, _ in scored])
    return rewards, torch.tensor([p for _, p in scored]), torch.tensor(tagged)

# -----------------------------------------------------------------------------
# Rows point at shared contexts (a prompt, or a prompt and a GRPO-MA thought), so that each context
# is encoded once, in sampling and in the update.


@dataclass
class Rows:
    prompts: list[list[int]]       # the distinct prompts (chat-templated token ids)
    prompt_index: torch.Tensor     # (B,) the prompt each row continues
    parent: torch.Tensor           # (B,) the row between prompt and this row (an MA thought), or -1
    completion_ids: torch.Tensor   # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) 1 up to and including EOS / stop
    advantages: torch.Tensor       # (B,), or (B, C) per token (see policy_loss)
    token_weights: torch.Tensor | None = None  # (B, C) multiplies the whole per-token loss (λ-GRPO)
    rewards: torch.Tensor | None = None  # (B,) for --log-completions (MA thoughts: their value)

    def __len__(self):
        return len(self.completion_ids)

    def context(self, i: int) -> list[int]:
        """Row i's context as token ids: its prompt, then its parent's completion."""
        ids = list(self.prompts[self.prompt_index[i]])
        if self.parent[i] >= 0:
            p = int(self.parent[i])
            ids += self.completion_ids[p][self.completion_mask[p].bool()].tolist()
        return ids

    def select(self, index: torch.Tensor) -> "Rows":
        """The rows `index` (a row's parent must be among them), keeping only the prompts they use
        and only the completion columns that hold a token."""
        used = self.prompt_index[index].unique()
        new_prompt = torch.full((len(self.prompts),), -1, dtype=torch.long)
        new_prompt[used] = torch.arange(len(used))
        new_row = torch.full((len(self),), -1, dtype=torch.long)
        new_row[index] = torch.arange(len(index))
        parent = self.parent[index]
        parent = torch.where(parent >= 0, new_row[parent.clamp(min=0)], -1)
        C = max(1, int(self.completion_mask[index].sum(1).max()))

        def cut(t):  # the selected rows; per-token tensors also lose their empty columns
            if t is None:
                return None
            return t[index][:, :C] if t.dim() == 2 else t[index]
        prompts = [self.prompts[p] for p in used.tolist()]
        return Rows(prompts, new_prompt[self.prompt_index[index]], parent, cut(self.completion_ids),
                    cut(self.completion_mask), cut(self.advantages), cut(self.token_weights),
                    cut(self.rewards))


def micro_batches(rows: Rows, size: int) -> list[Rows]:
    """Split rows into micro-batches of about `size` rows. A row that continues a prompt directly
    stays with the rows that continue it (a GRPO-MA thought with its answers); a prompt shared by
    several micro-batches is encoded once in each."""
    units = []
    for i in (rows.parent < 0).nonzero().squeeze(1).tolist():
        units.append([i] + (rows.parent == i).nonzero().squeeze(1).tolist())
    batches, current = [], []
    for unit in units:
        if current and len(current) + len(unit) > size:
            batches.append(current)
            current = []
        current = current + unit
    batches.append(current)
    return [rows.select(torch.tensor(sorted(b))) for b in batches]

# -----------------------------------------------------------------------------
# Rollouts: one function per variant samples completions, scores them and fills rows. Each takes the
# model, tokenizer, config, this step's data rows and an rng (TA draws its rephrasings with it), and
# returns (Rows, metrics). From the plumbing: prompt_ids (chat template -> ids), timed (adds a
# phase's seconds to metrics), on_global_batch (a scheme over the rewards of all ranks; in one
# process, just the scheme).


def sample_metrics(rewards, group_size, parsed, tagged, samples) -> dict:
    """Reward, zero-variance, length, truncation, parse and format (share that wrote the answer
    tags) metrics of one step's samples."""
    groups = rewards.reshape(-1, group_size)
    lengths = samples.completion_mask.sum(1).float()
    return {"reward": global_mean(rewards), "reward_std": global_std(rewards),
            "frac_reward_zero_std": global_mean(groups.amax(1) == groups.amin(1)),
            "completion_length": global_mean(lengths),
            "completion_length_max": all_reduce([lengths.max().item()], "max")[0],
            "truncated": 1 - global_mean(samples.finished), "unparseable": 1 - global_mean(parsed),
            "format": global_mean(tagged), "tokens": all_reduce([lengths.sum().item()])[0]}


def rollout_grpo(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """GRPO (and λ-GRPO): G completions per prompt, group-normalised advantages; for `lambda` the
    rows also carry 1/|λ| token weights."""
    G, metrics = cfg.num_generations, {}
    prompts = [prompt_ids(tokenizer, row["question"], cfg.system_prompt) for row in batch]
    with timed(metrics, "time/sample"):
        s = generate(model, tokenizer, prompts, G, cfg.max_new_tokens, temperature=cfg.temperature,
                     top_p=cfg.top_p)
    ids, mask = s.completion_ids.cpu(), s.completion_mask.cpu()
    with timed(metrics, "time/score"):
        answers = [row["answer"] for row in batch for _ in range(G)]
        rewards, parsed, tagged = score_batch(tokenizer, s, answers, cfg.format_reward, cfg.reward)
        advantages = on_global_batch(group_advantages, rewards, G, cfg.scale_rewards)
        weights = lambda_weights(ids, mask, G)  # logged for grpo too: how much completions share
    on = mask.bool()
    metrics.update(sample_metrics(rewards, G, parsed, tagged, s),
                   lambda_mean=global_mean(1 / weights[on]),      # mean |λ| over tokens
                   lambda_shared=global_mean(weights[on] < 1))    # share of tokens with |λ| > 1
    prompt_index = torch.arange(len(batch)).repeat_interleave(G)
    token_weights = weights if cfg.variant == "lambda" else None
    parent = torch.full((len(ids),), -1)  # every row continues its prompt directly
    rows = Rows(prompts, prompt_index, parent, ids, mask, advantages, token_weights, rewards)
    return rows, metrics


def rollout_ma(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """GRPO-MA: K thoughts per prompt, each stopped by the token whose text completes </think> (with
    a BPE tokenizer that token can carry more text, e.g. '><' of '</think><answer>'), then M answers
    per thought, continued from the thought's KV cache (its tokens as sampled) and stopped at EOS.
    An answer is scored on the thought's text + its own text (only what follows </think> can be the
    answer).

    A thought whose text has no </think> (length limit or EOS) is *unclosed*: it is not continued,
    its M answers are missing (NaN rewards, left out of the answer statistics), its value is 0, and
    the thought row itself is trained with its (usually negative) thought advantage. Counted in
    metrics["unclosed_thoughts"]. Here frac_reward_zero_std is the share of prompts whose K thought
    values are all equal (no thought signal), and reward is the mean thought value.

    Each thought is one row (context = prompt, advantage = thought advantage), trained once, not M
    times; each answer is one row (context = prompt + its thought: its parent is the thought row,
    advantage = answer advantage). How thought and answer rows are weighed against each other is
    update()'s business (see loss_parts and --ma-weighting).

    P = 1, K = 2, M = 2, thought 1 unclosed: rows 0, 1 are the thoughts (parent -1), rows 2, 3 the
    answers of thought 0 (parent 0, context = prompt + thought 0); thought 1 has none.
    """
    K, M, metrics = cfg.num_thoughts, cfg.num_answers, {}
    P = len(batch)
    prompts = [prompt_ids(tokenizer, row["question"], cfg.system_prompt) for row in batch]
    with timed(metrics, "time/sample"):  # keep=True: every thought also comes back as a Prefix
        th = generate(model, tokenizer, prompts, K, cfg.max_new_tokens, temperature=cfg.temperature,
                      top_p=cfg.top_p, stop_strings=["</think>"], keep=True)
    closed = th.stopped.cpu()  # (P*K,): the thought's text reached </think>
    closed_rows = closed.nonzero().squeeze(1)  # the thoughts that get answers
    thought_texts = decode(tokenizer, th.completion_ids, th.completion_mask)
    answer_parent = closed_rows.repeat_interleave(M)  # the thought row each answer continues
    with timed(metrics, "time/sample"):  # (no rows at all when no thought closed)
        continued = th.prefix.select(answer_parent.to(th.prefix.last.device))
        ans = sample(model, tokenizer, continued, cfg.max_answer_tokens, cfg.temperature,
                     cfg.top_p)
    with timed(metrics, "time/score"):
        answers = [batch[k // K]["answer"] for k in answer_parent.tolist()]
        thought_of = [thought_texts[k] for k in answer_parent.tolist()]
        answer_rewards, parsed, tagged = score_batch(tokenizer, ans, answers, cfg.format_reward,
                                                     cfg.reward, thought_of)
    rewards = torch.full((P * K, M), math.nan)  # (P*K, M): unclosed thoughts have no answers
    rewards[closed_rows] = answer_rewards.view(-1, M)
    grid = rewards.view(P, K, M)
    thought_adv, answer_adv = on_global_batch(ma_advantages, grid, cfg.scale_rewards)
    # rows: the P*K thoughts, then the answers of the closed ones, right-padded to one width
    C = max(th.completion_ids.shape[1], ans.completion_ids.shape[1])
    right = lambda t, value: torch.nn.functional.pad(t.cpu(), (0, C - t.shape[1]), value=value)
    ids = torch.cat([right(th.completion_ids, tokenizer.pad_token_id),
                     right(ans.completion_ids, tokenizer.pad_token_id)])
    mask = torch.cat([right(th.completion_mask, 0), right(ans.completion_mask, 0)])
    answer_adv = answer_adv.reshape(-1, M)[closed_rows].reshape(-1)  # the answers that exist
    advantages = torch.cat([thought_adv.reshape(-1), answer_adv])
    prompt_index = torch.cat([torch.arange(P).repeat_interleave(K), answer_parent // K])
    parent = torch.cat([torch.full((P * K,), -1), answer_parent])
    values = grid.nanmean(-1).nan_to_num(0.0)  # V(th_k), (P, K)
    # answer metrics are NaN (null in metrics.jsonl) when no thought of the batch closed
    metrics.update(answer_reward=global_mean(answer_rewards),
                   answer_length=global_mean(ans.completion_mask.sum(1).float()),
                   truncated=1 - global_mean(ans.finished), unparseable=1 - global_mean(parsed),
                   format=global_mean(tagged), reward=global_mean(values),
                   reward_std=global_std(values), thought_reward=global_mean(values),
                   frac_reward_zero_std=global_mean(values.amax(1) == values.amin(1)),
                   unclosed_thoughts=1 - global_mean(closed),
                   tokens=all_reduce([mask.sum().item()])[0],
                   thought_length=global_mean(th.completion_mask.sum(1).float()))
    rows = Rows(prompts, prompt_index, parent, ids, mask, advantages,
                rewards=torch.cat([values.reshape(-1), answer_rewards]))
    return rows, metrics


def rollout_ta(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """TA-GRPO: for each question q0 take up to N of its rephrasings (a fresh random subset each
    step), sample G responses to each of the N+1 questions, score each response as it is, and
    normalise the advantages jointly over the question's (n+1)*G responses (ragged when a question
    has n < N).

    With --ta-anchor original (paper v5) every row's context is q0's prompt, so the current, old and
    reference log-probs are all log π(o | q0): a response to a rephrasing is trained as if it had
    been a response to q0. At μ = 1 the ratio is 1 whatever the context; what anchoring changes is
    the gradient, ∇ log π(o | q0) instead of ∇ log π(o | q_j). `rephrased` keeps the prompt that
    produced the response (the public code's behaviour)."""
    G, N, metrics = cfg.num_generations, cfg.num_rephrasings, {}
    questions = [[row["question"]] + rng.sample(row["rephrasings"], min(N, len(row["rephrasings"])))
                 for row in batch]
    # one row per (question p, phrasing j, sample g), in that order
    slots = [(p, j, g) for p, qs in enumerate(questions) for j in range(len(qs)) for g in range(G)]
    p_idx = torch.tensor([p for p, _, _ in slots])
    j_idx = torch.tensor([j for _, j, _ in slots])
    g_idx = torch.tensor([g for _, _, g in slots])
    phrasings = [prompt_ids(tokenizer, q, cfg.system_prompt) for qs in questions for q in qs]
    with timed(metrics, "time/sample"):
        s = generate(model, tokenizer, phrasings, G, cfg.max_new_tokens,
                     temperature=cfg.temperature, top_p=cfg.top_p)
    with timed(metrics, "time/score"):
        answers = [batch[p]["answer"] for p, _, _ in slots]
        r, parsed, tagged = score_batch(tokenizer, s, answers, cfg.format_reward, cfg.reward)
        rewards = torch.full((len(batch), N + 1, G), math.nan)  # (P, N+1, G); NaN: no such phrasing
        rewards[p_idx, j_idx, g_idx] = r  # each row's reward into its question's grid
        advantages = on_global_batch(ta_advantages, rewards, cfg.scale_rewards)[p_idx, j_idx, g_idx]
    if cfg.ta_anchor == "rephrased":
        prompts, prompt_index = phrasings, torch.arange(len(phrasings)).repeat_interleave(G)
    else:
        first = [0] + np.cumsum([len(qs) for qs in questions])[:-1].tolist()  # q0 of each question
        prompts, prompt_index = [phrasings[i] for i in first], p_idx
    originals = rewards[:, 0]  # (P, G): what plain GRPO would have seen
    pooled = [rewards[p][~rewards[p].isnan()] for p in range(len(batch))]
    metrics.update(sample_metrics(r, G, parsed, tagged, s))
    # zero variance as plain GRPO would have met it (q0's own G responses), and after pooling
    metrics["frac_reward_zero_std"] = global_mean(originals.amax(1) == originals.amin(1))
    pooled_constant = torch.tensor([(g.max() == g.min()).item() for g in pooled])
    metrics["frac_reward_zero_std_pooled"] = global_mean(pooled_constant)
    metrics["reward_original"] = global_mean(originals)
    metrics["reward_rephrased"] = global_mean(r[j_idx > 0])
    ids, mask = s.completion_ids.cpu(), s.completion_mask.cpu()
    parent = torch.full((len(ids),), -1)
    return Rows(prompts, prompt_index, parent, ids, mask, advantages, rewards=r), metrics


ROLLOUTS = {"grpo": rollout_grpo, "lambda": rollout_grpo, "ma": rollout_ma, "ta": rollout_ta}

# =============================================================================
# 3. The sampler and the log-prob pass. A Prefix is a batch of contexts ready to be continued:
#    sampling copies a prompt's cache to its G rows, the update to the rows that continue it.
# =============================================================================


def run_decoder(model, input_ids, attention_mask, cache=None):
    """The transformer (Qwen2, Qwen3, Llama: model.model, without the lm_head) over input_ids (B, T)
    that follow the tokens in `cache` (a transformers DynamicCache, grown in place, or None);
    attention_mask (B, L + T) covers the cached and the new tokens, with padding (0) anywhere.
    Returns the final hidden states (B, T, H) and the cache."""
    from transformers import DynamicCache
    decoder = model.model
    # a token's position is the number of real tokens before it: padding takes no place
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
    cache = DynamicCache() if cache is None else cache
    # transformers renamed the forward's past_key_values to cache (5.2x)
    name = "past_key_values"
    if "cache" in inspect.signature(decoder.forward).parameters:
        name = "cache"
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  use_cache=True, **{name: cache})
    return out.last_hidden_state, cache


def kv_of(cache) -> list:
    """A cache's tensors: per layer (keys, values), each (B, heads, L, head_dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_of(kv: list | None):
    """A transformers DynamicCache holding these tensors (None: an empty cache)."""
    from transformers import DynamicCache
    return DynamicCache(ddp_cache_data=kv) if kv else None


@dataclass
class Prefix:
    """Contexts ready to be continued: the KV cache of all their tokens but the last one, and that
    last token, which the next forward pass takes as input (its output predicts the first new
    token)."""
    kv: list | None      # per layer (keys, values), each (B, heads, L, head_dim)
    mask: torch.Tensor   # (B, L) 1 where the cache holds a real token, 0 for padding
    last: torch.Tensor   # (B,)

    def select(self, index) -> "Prefix":
        """Rows `index` (long) of the prefix; repeated indices copy a context to several
        continuations. index_select, not k[index]: PyTorch documents the backward of k[index] as
        nondeterministic on CPU (it sums the copies' gradients in varying order); with it, seeded
        runs in fresh processes drifted apart in the last bit after a few steps."""
        kv = None
        if self.kv is not None:
            kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.kv]
        return Prefix(kv, self.mask.index_select(0, index), self.last.index_select(0, index))


def prefill(model, prompts: list[list[int]], pad_id: int) -> Prefix:
    """Encode each prompt (token ids) once, left-padded; with gradients if they are enabled."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    kv = kv_of(run_decoder(model, ids[:, :-1], mask[:, :-1])[1]) if ids.shape[1] > 1 else None
    return Prefix(kv, mask[:, :-1], ids[:, -1])


def pick(logits, temperature: float, top_p: float, greedy: bool):
    """Next tokens from (B, V) float32 logits: the argmax, or a draw from softmax(logits / T) cut to
    its top-p nucleus when top_p < 1. The loss's log-probs see the full softmax(logits / T), as
    TRL's do, so with top_p < 1 the ratio is not that of the distribution sampled from: train with
    --top-p 1."""
    if greedy:
        return logits.argmax(-1)
    probs = (logits / temperature).softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the tokens before reach top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1).squeeze(-1)


@dataclass
class Samples:
    completion_ids: torch.Tensor   # (B, C) right-padded with pad
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the token that ended the row
    finished: torch.Tensor         # (B,) ended with EOS
    stopped: torch.Tensor          # (B,) ended with the token whose text completed a stop string
    prefix: Prefix | None = None   # keep=True: every row as a prefix, ready to be continued


def generate(model, tokenizer, prompts: list[list[int]], n: int, max_new_tokens: int,
             **kwargs) -> Samples:
    """n samples for each prompt (token ids), rows in prompt order: each prompt is prefilled once
    and its cache copied to its n rows. kwargs go to sample()."""
    with sampling(model):
        prefix = prefill(model, prompts, tokenizer.pad_token_id)
    index = torch.arange(len(prompts), device=prefix.last.device).repeat_interleave(n)
    return sample(model, tokenizer, prefix.select(index), max_new_tokens, **kwargs)


def sample(model, tokenizer, prefix: Prefix, max_new_tokens: int, temperature=1.0, top_p=1.0,
           greedy=False, stop_strings=(), keep=False) -> Samples:
    """Continue every row of `prefix` by up to max_new_tokens tokens. A row ends at an EOS token
    (any of eos_ids), at the token whose text completes a stop string (even when that token carries
    more text, as BPE's '><' in '</think><answer>'), or at the length limit; ended rows leave the
    decode batch. Only temperature and top-p shape the draw: nothing of the model's generation
    config but its EOS ids. keep=True also returns every row as a Prefix (GRPO-MA continues its
    thoughts with answers). Seed torch beforehand for reproducible samples."""
    with sampling(model):
        device = next(model.parameters()).device
        eos = torch.tensor(eos_ids(model, tokenizer), device=device)
        B = len(prefix.last)
        ids = torch.full((B, max_new_tokens), tokenizer.pad_token_id, device=device)
        lengths = torch.zeros(B, dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        stopped = torch.zeros(B, dtype=torch.bool, device=device)
        texts = [""] * B  # the text of each row so far, for stop strings
        rows = torch.arange(B, device=device)  # the rows still being decoded
        cache, mask, token = cache_of(prefix.kv), prefix.mask, prefix.last
        ended_rows, ended_prefixes = [], []
        for t in range(max_new_tokens):
            if not len(rows):  # every row has ended (or there were none)
                break
            mask = torch.cat([mask, mask.new_ones(len(token), 1)], 1)  # mask may have no columns
            hidden, cache = run_decoder(model, token[:, None], mask, cache)
            token = pick(model.lm_head(hidden[:, -1]).float(), temperature, top_p, greedy)
            ids[rows, t] = token
            lengths[rows] += 1
            ended = torch.isin(token, eos)
            finished[rows[ended]] = True
            if stop_strings:  # GRPO-MA's thoughts end at </think>
                hit = stop_string_hits(tokenizer, token, rows, ended, texts, stop_strings)
                stopped[rows[hit]] = True
                ended = ended | hit
            if t == max_new_tokens - 1:
                ended[:] = True
            if not ended.any():
                continue
            if keep:  # the cache holds every token but the one just picked: a Prefix, as defined
                ended_rows.append(rows[ended])
                ended_index = ended.nonzero()[:, 0]
                ended_prefixes.append(Prefix(kv_of(cache), mask, token).select(ended_index))
            go = ~ended
            rows, mask, token = rows[go], mask[go], token[go]
            cache.batch_select_indices(go.nonzero().squeeze(1))  # finished rows leave the batch
        C = max(lengths.tolist(), default=0)
        completion_mask = (torch.arange(C, device=device)[None] < lengths[:, None]).long()
        kept = gather_prefixes(torch.cat(ended_rows), ended_prefixes) if keep else None
        return Samples(ids[:, :C], completion_mask, finished, stopped, kept)


def stop_string_hits(tokenizer, token, rows, ended, texts: list[str], stop_strings):
    """(B,) bool: the rows (not ended at EOS) whose text, with this step's token appended to
    texts[row], now contains a stop string, even when the token carries more text than the
    string's end. One device sync for the step, not one per row."""
    pieces = tokenizer.batch_decode(token[:, None].tolist(), skip_special_tokens=True)
    at_eos = ended.tolist()
    longest = max(map(len, stop_strings))
    hit = []
    for i, (row, piece) in enumerate(zip(rows.tolist(), pieces)):
        texts[row] += piece
        window = texts[row][-(len(piece) + longest):]  # where a new match can be
        hit.append(not at_eos[i] and any(s in window for s in stop_strings))
    return torch.tensor(hit, dtype=torch.bool, device=token.device)


@contextlib.contextmanager
def sampling(model):
    """No gradients, and eval mode: no dropout, and HF's gradient checkpointing, which drops the KV
    cache in training mode, is off. The model's mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def gather_prefixes(rows, prefixes: list[Prefix]) -> Prefix:
    """Prefixes of rows that ended at different steps, as one Prefix in row order: each is
    right-padded (mask 0) to the longest cache."""
    L = max(p.mask.shape[1] for p in prefixes)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, L - t.shape[2]))  # (B, heads, l, d) -> L
    kv = []
    for layer in range(len(prefixes[0].kv)):
        keys = torch.cat([pad(p.kv[layer][0]) for p in prefixes])
        values = torch.cat([pad(p.kv[layer][1]) for p in prefixes])
        kv.append((keys, values))
    mask = torch.cat([torch.nn.functional.pad(p.mask, (0, L - p.mask.shape[1])) for p in prefixes])
    merged = Prefix(kv, mask, torch.cat([p.last for p in prefixes]))
    return merged.select(rows.argsort())


def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's (Qwen has
    two: <|im_end|> and <|endoftext|>)."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    return sorted(ids | {tokenizer.eos_token_id})


def left_pad(seqs: list[list[int]], pad_id: int):
    """Lists of ids -> (B, L) ids and attention mask, padded on the left."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, L - len(s):] = 1
    return ids, mask


def decode(tokenizer, completion_ids, completion_mask) -> list[str]:
    """The text of each completion's masked tokens, special tokens dropped."""
    return [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(completion_ids, completion_mask)]

# -----------------------------------------------------------------------------
# Log-probs: log softmax(logits / T) at each completion token given its context and the tokens
# before it, each shared context encoded once.


def rows_logps(model, rows: Rows, temperature: float, device):
    """(B, C) per-token log-probs of the rows' completions given their contexts. Each prompt is
    encoded once and its KV cache copied to the rows that continue it; a GRPO-MA thought's cache is
    copied on to its answers. Gradients flow through the copies into the shared encoding, so values
    and gradients equal those of encoding every row's context on its own (flat_logps), with a
    fraction of the tokens."""
    B, C = rows.completion_ids.shape
    ids, cmask = rows.completion_ids.to(device), rows.completion_mask.to(device)
    parent = rows.parent.to(device)
    logps = torch.zeros(B, C, device=device)
    prefix = prefill(model, rows.prompts, 0)
    level = parent < 0  # first the rows that continue a prompt directly, then their children
    source = rows.prompt_index.to(device)  # each row's context: a row of `prefix`
    while level.any():
        idx = level.nonzero().squeeze(1)
        p = prefix.select(source[idx])
        n = int(cmask[idx].sum(1).max())
        target, target_mask = ids[idx, :n], cmask[idx, :n]
        # the one-token shift: input t is the token before target t, i.e. the context's last token,
        # then the completion shifted right by one; output t predicts target t
        x = torch.cat([p.last[:, None], target[:, :-1]], 1)
        # x[:, t] is real where target t is, so target_mask masks x too; the cache then holds every
        # completion token but the last, which becomes the children's `last`: a Prefix again
        m = torch.cat([p.mask, target_mask], 1)
        hidden, cache = run_decoder(model, x, m, cache_of(p.kv))
        logps[idx, :n] = token_logps(model.lm_head, hidden, target, target_mask, temperature)
        last = target.gather(1, (target_mask.sum(1) - 1)[:, None]).squeeze(1)  # each last token
        prefix = Prefix(kv_of(cache), m, last)
        position = torch.full((B,), -1, dtype=torch.long, device=device)
        position[idx] = torch.arange(len(idx), device=device)
        level = torch.isin(parent, idx)
        source = position[parent.clamp(min=0)]
    return logps


def flat_logps(model, rows: Rows, temperature: float, device):
    """rows_logps the plain way: every row encodes its whole context and completion in one forward
    pass, without a KV cache (what --gradient-checkpointing needs: HF drops the cache when it is
    on)."""
    context_ids, context_mask = left_pad([rows.context(i) for i in range(len(rows))], 0)
    input_ids = torch.cat([context_ids, rows.completion_ids], 1).to(device)
    attention_mask = torch.cat([context_mask, rows.completion_mask], 1).to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=False).last_hidden_state
    # the one-token shift: position L-1 (the context's last token) predicts completion token 0
    L = context_ids.shape[1]
    return token_logps(model.lm_head, hidden[:, L - 1:-1], rows.completion_ids.to(device),
                       rows.completion_mask.to(device), temperature)


def token_logps(lm_head, hidden, targets, mask, temperature: float):
    """(B, C) float32 log softmax(lm_head(hidden) / T) at `targets`, where mask is 1 (0 elsewhere):
    hidden (B, C, H) at position t is what predicts targets[:, t]. The logits of at most ~2**25
    entries exist at a time, with and without gradients (a chunk's logits are recomputed in the
    backward pass), so memory does not grow with B * C * vocabulary."""
    keep = mask.bool()
    h, t = hidden[keep], targets[keep]  # (N, H), (N,): only real tokens
    chunk = max(1, 2**25 // lm_head.out_features)

    def chunk_logps(h, t):
        logits = lm_head(h).float() / temperature  # after the cast: bf16 / T would round again
        return logits.gather(-1, t[:, None]).squeeze(-1) - logits.logsumexp(-1)
    pieces = []
    for hc, tc in zip(h.split(chunk), t.split(chunk)):
        if torch.is_grad_enabled():
            piece = torch.utils.checkpoint.checkpoint(chunk_logps, hc, tc, use_reentrant=False)
            pieces.append(piece)
        else:
            pieces.append(chunk_logps(hc, tc))
    logps = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
    logps[keep] = torch.cat(pieces)
    return logps

# =============================================================================
# 4. The update and the training loop.
# =============================================================================


def part_weights(micro: list[Rows], parts: list[tuple[int, int]], loss_type: str):
    """For each part q of the batch (loss_parts) and micro-batch j: which rows of j are in q, the
    weight of that piece's loss (micro_batch_weights within the part), and its share of the whole
    batch's tokens (kl and the clip fractions are token means, whatever the loss type). Returns
    three lists indexed [q][j]. With two parts (GRPO-MA), part 1 is the answers: rows with a
    parent."""
    all_tokens = all_reduce([sum(m.completion_mask.sum().item() for m in micro)])[0]
    in_part, weights, token_share = [], [], []
    for q, (nominal_rows, _) in enumerate(parts):
        selected = []
        for m in micro:
            if len(parts) == 1:
                selected.append(torch.ones(len(m), dtype=torch.bool))
            elif q == 0:
                selected.append(m.parent < 0)
            else:
                selected.append(m.parent >= 0)
        n_rows = [int(sel.sum()) for sel in selected]
        n_tokens = [m.completion_mask[sel].sum().item() for m, sel in zip(micro, selected)]
        in_part.append(selected)
        weights.append(micro_batch_weights(loss_type, n_rows, n_tokens, nominal_rows))
        token_share.append([t / max(all_tokens, 1) for t in n_tokens])
    return in_part, weights, token_share


def piece_loss(m: Rows, selected, logps, old_logps, ref_logps, cfg: Config, max_len: int,
               device):
    """policy_loss of the rows `selected` (B,) bool of micro-batch m, whose per-token log-probs
    (current, old and reference, each (B, C) or None) are already computed."""
    sel = selected.to(device)
    token_weights = None
    if m.token_weights is not None:
        token_weights = m.token_weights.to(device)[sel]
    return policy_loss(logps[sel], old_logps[sel], m.advantages.to(device)[sel],
                       m.completion_mask.to(device)[sel],
                       ref_per_token_logps=None if ref_logps is None else ref_logps[sel],
                       token_weights=token_weights, beta=cfg.beta, epsilon=cfg.epsilon,
                       epsilon_high=cfg.epsilon_high or None, loss_type=cfg.loss_type,
                       max_completion_length=max_len)


def update(model, ref_model, optimizer, rows: Rows, cfg: Config, device, num_prompts: int) -> dict:
    """μ = --num-iterations optimiser steps on one batch of rows, in micro-batches whose losses
    are weighted to add up to the loss of the whole (global) batch of num_prompts prompts;
    gradients are summed over the ranks. Each part of the batch (loss_parts) is aggregated on its
    own: J = sum over parts q of sum over micro-batches j of weight[q][j] * loss(part q of j)."""
    metrics = {}
    micro = micro_batches(rows, cfg.micro_batch_size)
    parts = loss_parts(cfg, num_prompts)
    in_part, weights, token_share = part_weights(micro, parts, cfg.loss_type)
    logps_of = flat_logps if cfg.gradient_checkpointing else rows_logps
    with timed(metrics, "time/logps"), torch.no_grad():
        # old log-probs are needed only when the batch is reused (μ > 1); at μ = 1 they equal the
        # current ones, detached
        old, ref = None, None
        if cfg.num_iterations > 1:
            old = [logps_of(model, m, cfg.temperature, device) for m in micro]
        if cfg.beta > 0:
            ref = [logps_of(ref_model, m, cfg.temperature, device) for m in micro]
    # the same keys on every rank, whatever parts it holds, for the all_reduce below
    totals = {"loss": 0.0, "clip_low": 0.0, "clip_high": 0.0}
    if cfg.beta > 0:
        totals["kl"] = 0.0
    grad_norms = []
    with timed(metrics, "time/update"):
        for _ in range(cfg.num_iterations):
            for j, m in enumerate(micro):
                logps = logps_of(model, m, cfg.temperature, device)
                old_logps = old[j] if old else logps.detach()
                total = 0.0
                for q, (_, max_len) in enumerate(parts):
                    if not in_part[q][j].any():
                        continue
                    ref_logps = ref[j] if ref else None
                    loss, loss_metrics = piece_loss(m, in_part[q][j], logps, old_logps, ref_logps,
                                                    cfg, max_len, device)
                    total = total + loss * weights[q][j]
                    for key, value in dict(loss_metrics, loss=loss.item()).items():
                        share = weights[q][j] if key == "loss" else token_share[q][j]
                        totals[key] = totals.get(key, 0.0) + value * share / cfg.num_iterations
                total.backward()
            sum_gradients(model)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            if not math.isfinite(norm.item()):  # a NaN step would poison the weights for good
                raise TrainingError(f"the gradient norm is {norm.item()}, so the update was not "
                                    f"applied; lower --lr or --max-grad-norm")
            grad_norms.append(norm.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    metrics.update(zip(totals, all_reduce(list(totals.values()))))
    metrics["grad_norm"] = float(np.mean(grad_norms))
    return metrics


def train_step(model, tokenizer, ref_model, optimizer, cfg: Config, train_rows, step: int,
               device) -> dict:
    """One step: draw P prompts, sample and score (this rank's share), then update. Returns the
    step's metrics."""
    t_step = time.perf_counter()
    W, rank = world_size(), this_rank()
    # data and sampling depend on (seed, step) only, so a resumed run continues the same stream
    rng = random.Random(cfg.seed * 1_000_003 + step)
    torch.manual_seed(cfg.seed * 1_000_003 + step * W + rank)
    # every rank takes the same number of whole groups (a data file smaller than P leaves fewer)
    P = min(cfg.prompts_per_step, len(train_rows) // W * W)
    batch = rng.sample(train_rows, P)[rank * P // W:(rank + 1) * P // W]
    rank_rng = random.Random(f"rephrasings {cfg.seed} {step} {rank}")  # its own stream, per rank
    rows, metrics = ROLLOUTS[cfg.variant](model, tokenizer, cfg, batch, rank_rng)
    if rank == 0 and cfg.log_completions and (step + 1) % cfg.log_completions == 0:
        log_group(cfg, tokenizer, batch[0]["question"], rows, step + 1)
    metrics.update(update(model, ref_model, optimizer, rows, cfg, device, P))
    metrics["time/step"] = time.perf_counter() - t_step
    # the slowest rank's phase times, in one call with the same keys on every rank (a rank whose MA
    # thoughts all stayed open scored nothing)
    phases = ["time/sample", "time/score", "time/logps", "time/update", "time/step"]
    slowest = all_reduce([metrics.get(key, 0.0) for key in phases], "max")
    metrics.update(zip(phases, slowest))
    metrics["tokens_per_s"] = metrics["tokens"] / metrics["time/sample"]
    return metrics


def log_group(cfg: Config, tokenizer, question: str, rows: Rows, step: int):
    """--log-completions: the rows of the batch's first prompt (a GRPO group; a GRPO-MA prompt's
    thoughts, each with its answers; TA's (N+1)*G responses, or q0's G with --ta-anchor
    rephrased), each with its reward, advantage and (λ-GRPO) mean token weight 1/|λ|, as a line
    of <out>/completions.jsonl and a short table on the console."""
    first = (rows.prompt_index == 0).nonzero().squeeze(1).tolist()
    texts = decode(tokenizer, rows.completion_ids[first], rows.completion_mask[first])
    entries = {}
    for i, text in zip(first, texts):
        entry = {"text": text, "reward": rows.rewards[i].item(),
                 "advantage": rows.advantages[i].mean().item()}
        if rows.token_weights is not None:
            on = rows.completion_mask[i].bool()
            entry["lambda_weight"] = rows.token_weights[i][on].mean().item()
        entries[i] = entry
    completions = []
    for i in first:
        parent = int(rows.parent[i])
        if parent >= 0:
            entries[parent].setdefault("answers", []).append(entries[i])
        else:
            completions.append(entries[i])
    record = {"step": step, "question": question, "completions": completions}
    with open(Path(cfg.out) / "completions.jsonl", "a") as f:
        f.write(json.dumps(finite(record), allow_nan=False) + "\n")
    lines = [f"step {step}: {question!r}", "  reward  advantage  completion"]
    for c in completions:
        extra = f"  1/|λ| {c['lambda_weight']:.2f}" if "lambda_weight" in c else ""
        lines.append(f"  {c['reward']:6.2f}  {c['advantage']:+9.2f}  {c['text'][:60]!r}{extra}")
        for a in c.get("answers", []):
            lines.append(f"  {a['reward']:6.2f}  {a['advantage']:+9.2f}    -> {a['text'][:56]!r}")
    tqdm.write("\n".join(lines))


def train(cfg: Config) -> dict:
    """Run GRPO (or a variant) as configured; returns the summary it also prints and saves (rank 0).
    Checkpoints every --save-every steps; SIGTERM and Ctrl-C save the last completed step (see
    signals_handled); a crash leaves the last checkpoint; --resume continues from the latest."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    train_rows, test_rows = load_data(cfg)
    rank, device = setup_distributed(cfg)
    W, main_rank = world_size(), rank == 0
    checkpoint = prepare_out(cfg)
    model, tokenizer, ref_model, optimizer, scheduler, start = load_run(cfg, device, checkpoint)
    max_positions = model.config.max_position_embeddings
    check_lengths(tokenizer, train_rows, cfg, max_positions, phrasings=cfg.variant == "ta")
    check_lengths(tokenizer, test_rows, cfg, max_positions, phrasings=False)
    out = Path(cfg.out)
    if checkpoint and start == cfg.steps and (out / "summary.json").exists():  # a requeue
        if main_rank:
            print(f"grpo.py: the run in {out} finished at step {start}; nothing to do")
        return json.loads((out / "summary.json").read_text())
    if main_rank and checkpoint is None:
        remove_old_run(out)
    log = open_metrics(out, start if checkpoint else None, cfg) if main_rank else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    eval_seed = cfg.seed + 12345  # the same sampling noise for every eval of a run

    def write(record):
        if main_rank:
            log.write(json.dumps(finite(record), allow_nan=False) + "\n")
            log.flush()

    def run_eval(step):  # every rank evaluates its share; rank 0 writes
        if eval_due(cfg, step):
            with autocast:
                result = evaluate(model, tokenizer, test_rows, cfg, eval_seed)
            write({"step": step, "eval": result})

    t0 = time.time()
    done = start  # completed steps: the weights are those of step `done`
    with signals_handled(optimizer):
        try:
            run_eval(start)
            for step in tqdm(range(start, cfg.steps), desc=cfg.variant, dynamic_ncols=True,
                             disable=not main_rank):
                lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
                with autocast:
                    metrics = train_step(model, tokenizer, ref_model, optimizer, cfg, train_rows,
                                         step, device)
                scheduler.step()
                done = step + 1
                write({"step": done, "lr": lr, **metrics})
                step_counted()
                due = done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)
                if main_rank and due:
                    save_checkpoint(out, model, tokenizer, optimizer, scheduler, done, cfg)
                run_eval(done)
        except Interrupted as e:
            where = out
            if main_rank:
                where = save_checkpoint(out, model, tokenizer, optimizer, scheduler, done, cfg)
            sys.exit(f"grpo.py: {e} after step {done}: checkpoint saved in {where}; "
                     f"continue with --resume")
    if W > 1:
        torch.distributed.destroy_process_group()
    return report(cfg, time.time() - t0) if main_rank else None


def report(cfg: Config, wall_s: float) -> dict:
    """Print and save the end-of-run summary from metrics.jsonl: the run's first and last eval (a
    resumed run included) and the median phase times."""
    text = (Path(cfg.out) / "metrics.jsonl").read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    evals = [r["eval"] for r in lines if "eval" in r]
    steps = [r for r in lines if "time/step" in r]
    phases = {}
    for key in steps[0] if steps else {}:
        if key.startswith("time/"):
            phases[key[5:]] = float(np.median([r[key] for r in steps]))
    before, after = evals[0], evals[-1]
    summary = {"variant": cfg.variant, "steps": cfg.steps, "before": before, "after": after,
               "wall_s": wall_s, "median_seconds_per_step": phases}
    (Path(cfg.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    if phases:
        table = "\n".join(f"  {k:<8} {v:7.3f}" for k, v in phases.items())
        print("median seconds per step:\n" + table)
    k = f"pass@{cfg.eval_samples}"
    print(f"{cfg.variant}: greedy {before['greedy']:.3f} -> {after['greedy']:.3f} | "
          f"pass@1 {before['pass@1']:.3f} -> {after['pass@1']:.3f} | "
          f"{k} {before.get(k, math.nan):.3f} -> {after.get(k, math.nan):.3f} | {wall_s:.0f} s")
    return summary

# =============================================================================
# 5. Eval: greedy accuracy and pass@k on the held-out set.
# =============================================================================


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], cfg: Config, seed: int,
             max_rows: int = 512) -> dict:
    """Greedy accuracy, and pass@k for k = 1..n from n = --eval-samples samples per question at the
    training temperature (pass@1 is the mean accuracy of those samples), and the share of samples
    that wrote the answer tags. The questions go in chunks of at most max_rows samples; chunk c is
    seeded with seed + c and sampled by rank c % W, and the counts are summed over the ranks, so W
    ranks evaluate about W times faster and get exactly what one process gets."""
    n, W, rank = cfg.eval_samples, world_size(), this_rank()
    limit = cfg.max_new_tokens + (cfg.max_answer_tokens if cfg.variant == "ma" else 0)  # ma: both
    size = max(1, max_rows // n)
    greedy, tagged, pass_k = 0.0, 0.0, [0.0] * n  # sums over this rank's questions and samples
    for c, start in enumerate(range(0, len(rows), size)):
        if c % W != rank:
            continue
        torch.manual_seed(seed + c)
        chunk = rows[start:start + size]
        prompts = [prompt_ids(tokenizer, row["question"], cfg.system_prompt) for row in chunk]
        answers = [row["answer"] for row in chunk]
        s = generate(model, tokenizer, prompts, 1, limit, greedy=True)
        greedy += score_batch(tokenizer, s, answers, reward=cfg.reward)[0].sum().item()
        s = generate(model, tokenizer, prompts, n, limit, temperature=cfg.temperature,
                     top_p=cfg.top_p)
        rewards, _, tags = score_batch(tokenizer, s, [a for a in answers for _ in range(n)],
                                       reward=cfg.reward)
        tagged += tags.sum().item()
        for correct in rewards.view(len(chunk), n).sum(1).long().tolist():
            for k in range(1, n + 1):
                pass_k[k - 1] += pass_at_k(n, correct, k)
    totals = all_reduce([greedy, tagged] + pass_k)
    result = {"greedy": totals[0] / len(rows), "format": totals[1] / (len(rows) * n)}
    for k in range(1, n + 1):
        result[f"pass@{k}"] = totals[1 + k] / len(rows)
    return result

# =============================================================================
# 6. Plumbing: a first read can stop here. Flags and their checks, data files, model loading,
#    checkpoints and resume, signals, the metrics file, data-parallel helpers, timing.
# =============================================================================


class ConfigError(ValueError):
    pass


class DataError(ValueError):
    pass


class TrainingError(RuntimeError):
    """A step that cannot be applied (non-finite gradients): one line, not a traceback."""


def parse_args(argv=None) -> Config:
    """Build argparse from the Config fields (--field-name), then check the values."""
    parser = argparse.ArgumentParser(description="GRPO and variants in one file.")
    parser.error = lambda message: sys.exit(f"grpo.py: error: {message}")  # one line, no usage
    for f in fields(Config):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help)
        else:
            parser.add_argument(flag, type=f.type, default=f.default, choices=f.metadata["choices"],
                                help=help)
    cfg = Config(**vars(parser.parse_args(argv)))
    check_config(cfg)
    return cfg


def check_config(cfg: Config):
    """Stop on impossible values with one line naming the flag."""
    at_least = [("num_generations", 2), ("prompts_per_step", 1), ("num_thoughts", 2),
                ("num_answers", 1), ("num_rephrasings", 1), ("max_new_tokens", 1),
                ("max_answer_tokens", 1), ("num_iterations", 1), ("micro_batch_size", 1),
                ("eval_samples", 1), ("steps", 0), ("warmup_steps", 0), ("eval_every", 0),
                ("eval_limit", 0), ("save_every", 0), ("beta", 0.0), ("epsilon", 0.0),
                ("epsilon_high", 0.0), ("weight_decay", 0.0)]
    above = ["lr", "temperature", "max_grad_norm"]
    flag = lambda name: "--" + name.replace("_", "-")
    for name in ["lr", "temperature", "top_p", "beta", "epsilon", "epsilon_high", "format_reward",
                 "weight_decay", "max_grad_norm"]:
        if not math.isfinite(getattr(cfg, name)):
            raise ConfigError(f"{flag(name)} must be a finite number, got {getattr(cfg, name)}")
    for name, low in at_least:
        if getattr(cfg, name) < low:
            raise ConfigError(f"{flag(name)} must be >= {low}, got {getattr(cfg, name)}")
    for name in above:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{flag(name)} must be > 0, got {getattr(cfg, name)}")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {cfg.top_p}")

# -----------------------------------------------------------------------------
# Data files: JSONL rows {"question": str, "answer": str, "rephrasings": [str, ...]} (rephrasings
# optional); every bad line stops with 'file:line: field ...'.


class Row(dict):
    """A data row {"question", "answer", "rephrasings"} that remembers its 'file:line' for
    errors."""
    where = ""


def not_json(constant: str):
    """json.loads accepts NaN and Infinity, which are not JSON: refuse them."""
    raise ValueError(f"{constant} is not a JSON value")


def load_jsonl(path) -> list[Row]:
    """Read and check a data file; any bad line stops with 'file:line: field ...'."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    rows = []
    for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad = f"byte {raw[e.start]:#04x} at column {e.start + 1}"
            raise DataError(f"{where}: not UTF-8 ({bad})") from None
        if not line.strip():
            continue
        try:  # numbers stay exact (Decimal); NaN and Infinity are not JSON
            row = json.loads(line, parse_float=Decimal, parse_constant=not_json)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # 5,000-digit integers, deep nesting, NaN
            reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise DataError(f"{where}: not valid JSON ({reason})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object with 'question' and 'answer'")
        for key in ("question", "answer"):
            value = row.get(key)
            numeric = isinstance(value, (int, Decimal)) and not isinstance(value, bool)
            if numeric and key == "answer":
                value = row[key] = format(value, "f") if isinstance(value, Decimal) else str(value)
                if parse_number(value) is None:  # 1e400 would be 401 digits: never matched
                    raise DataError(f"{where}: field 'answer' is a number too long to score")
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where}: field '{key}' is missing or empty")
        rephrasings = row.setdefault("rephrasings", [])
        texts = isinstance(rephrasings, list) and all(isinstance(r, str) for r in rephrasings)
        if not texts or not all(r.strip() for r in rephrasings):
            raise DataError(f"{where}: field 'rephrasings' must be a list of non-empty strings")
        for key in ("question", "answer", "rephrasings"):
            for text in rephrasings if key == "rephrasings" else [row[key]]:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:  # a lone surrogate ("\ud800") has no UTF-8 form
                    raise DataError(f"{where}: field '{key}' is not valid text") from None
        row = Row(row)
        row.where = where
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def load_data(cfg: Config) -> tuple[list[Row], list[Row]]:
    """The training rows and the held-out rows (the first --eval-limit of them)."""
    train_rows = load_jsonl(cfg.data)
    test_rows = load_jsonl(cfg.test_data)[: cfg.eval_limit or None]
    if cfg.variant == "ta" and not any(row["rephrasings"] for row in train_rows):
        raise DataError(f"{cfg.data}: --variant ta needs rows with 'rephrasings'; none has any")
    return train_rows, test_rows


def prompt_ids(tokenizer, question: str, system_prompt: str) -> list[int]:
    """Chat-template a question (with the system prompt) into token ids, generation prompt
    included."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def check_lengths(tokenizer, rows: list[Row], cfg, max_positions: int, phrasings: bool):
    """Stop before training when a prompt plus its completion budget (thought + answer for ma) would
    run past the model's positions; phrasings=True checks the rephrasings too."""
    budget = cfg.max_new_tokens + (cfg.max_answer_tokens if cfg.variant == "ma" else 0)
    for row in rows:
        for question in [row["question"]] + (row["rephrasings"] if phrasings else []):
            n = len(prompt_ids(tokenizer, question, cfg.system_prompt))
            if n + budget > max_positions:
                raise DataError(f"{row.where}: a prompt of {n} tokens + {budget} new tokens = "
                                f"{n + budget} exceeds the model's {max_positions} positions "
                                f"(max_position_embeddings); shorten the question or lower "
                                f"--max-new-tokens")

# -----------------------------------------------------------------------------
# Model loading, checkpoints and resume.


def pick_device(name: str) -> torch.device:
    """--device: auto picks cuda, then mps, then cpu; an explicit device must be available."""
    if name == "auto":
        name = "cpu"
        if torch.backends.mps.is_available():
            name = "mps"
        if torch.cuda.is_available():
            name = "cuda"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available on this machine")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps: MPS is not available on this machine")
    return torch.device(name)


def load_model(path: str, device):
    """Model and tokenizer from a local folder or the hub; left padding, a pad token, fp32
    weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if path.startswith(("/", "./", "../", "~")):
        if not Path(path).expanduser().is_dir():
            raise ConfigError(f"--model {path}: no such folder")
        path = str(Path(path).expanduser())  # `--model=~/x` reaches us unexpanded
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as e:  # a missing, corrupt or empty file: say which folder, in one line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"--model {path}: cannot load a model and tokenizer there "
                          f"({reason})") from None
    if not (hasattr(model, "model") and hasattr(model, "lm_head")
            and hasattr(model.config, "max_position_embeddings")):
        raise ConfigError(f"--model {path}: {type(model).__name__} is not supported (the sampler "
                          f"needs a decoder at .model and an .lm_head, as Qwen2/3 and Llama have)")
    if not tokenizer.chat_template:
        raise ConfigError(f"--model {path}: the tokenizer has no chat template (a base model?); "
                          f"prompts are chat-templated: use an instruct model or add a template")
    if tokenizer.pad_token is None:  # Llama: pad with eos; the completion mask never relies on pad
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer


def load_run(cfg: Config, device, checkpoint: Path | None):
    """Policy, tokenizer, reference (only when beta > 0), optimizer and schedule, and the step to
    start from (the checkpoint's, when resuming)."""
    state = load_state(checkpoint, cfg) if checkpoint else None
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(str(checkpoint) if checkpoint else cfg.model, device)
    ref_model = None
    if cfg.beta > 0:  # the frozen starting policy
        ref_model = load_model(cfg.model, device)[0].eval().requires_grad_(False)
    if cfg.gradient_checkpointing:  # renamed in transformers 5.2x; the old name warns there
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return model, tokenizer, ref_model, optimizer, scheduler, state["step"] if state else 0


def checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints in a run folder, oldest first (a save in progress is '*.tmp')."""
    found = [p for p in out.glob("checkpoint-*")
             if re.fullmatch(r"checkpoint-\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(out: Path, model, tokenizer, optimizer, scheduler, step: int,
                    cfg: Config) -> Path:
    """Write out/checkpoint-<step>: save_pretrained of model and tokenizer, plus optimizer,
    schedule, step and config in state.pt. Atomic: everything goes to a temporary folder that is
    renamed when complete, so a save that dies half-way leaves the previous checkpoint as it was;
    then older ones are removed."""
    final = out / f"checkpoint-{step}"
    if not final.is_dir():
        tmp = out / f"checkpoint-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "step": step, "config": asdict(cfg)}, tmp / "state.pt")
        os.replace(tmp, final)
    for old in out.glob("checkpoint-*"):  # older checkpoints, and a save that died half-way
        if old != final:
            shutil.rmtree(old)
    return final


# Flags that a resumed run may change: where and how it runs and evaluates, not what it trains.
RESUMABLE = {"steps", "out", "resume", "overwrite", "device", "eval_every", "eval_samples",
             "eval_limit", "test_data", "save_every", "micro_batch_size", "gradient_checkpointing",
             "log_completions"}


def prepare_out(cfg: Config) -> Path | None:
    """Check the run folder: a folder that already holds a run is only continued (--resume) or
    replaced (--overwrite), never silently reused. With --resume and no checkpoint yet (the first
    launch, or a kill before the first save) the run starts afresh. Returns the checkpoint to
    resume from, if any."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file, not a folder")
    found = run_files(out)
    if cfg.resume and checkpoints(out):
        return checkpoints(out)[-1]
    if found and not (cfg.overwrite or cfg.resume):
        raise ConfigError(f"--out {out} already holds a run ({', '.join(found)}); continue it with "
                          f"--resume or replace it with --overwrite")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").touch()
        (out / ".write-test").unlink()
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return None


def run_files(out: Path) -> list[str]:
    """The names in `out` that belong to a run: checkpoints, metrics, summary."""
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.glob("*") if p.name.startswith("checkpoint-")
                  or p.name in ("metrics.jsonl", "summary.json", "state.pt", "completions.jsonl"))


def remove_old_run(out: Path):
    """--overwrite: called once the new run's model and data have passed their checks, so a run
    that stops on a bad flag leaves the old one in place."""
    for name in run_files(out):
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        else:
            (out / name).unlink()


def load_state(checkpoint: Path, cfg: Config) -> dict:
    """state.pt of a checkpoint (tensors and plain values only: weights_only, so a run folder from
    elsewhere cannot run code), after checking that the flags keep the run's meaning and that
    --steps goes further."""
    path = checkpoint / "state.pt"
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"--resume: {path} is not a checkpoint this file wrote "
                          f"({reason})") from None
    saved, now = Config(**{**asdict(cfg), **state["config"]}), cfg
    def same(a, b):  # equal, or two spellings of one existing path
        paths = isinstance(a, str) and os.path.exists(a) and os.path.exists(b)
        return a == b or (paths and os.path.samefile(a, b))
    # bnpo normalises per micro-batch, so there the micro-batch size changes the loss
    may_change = RESUMABLE - ({"micro_batch_size"} if cfg.loss_type == "bnpo" else set())
    differ = [f.name for f in fields(Config) if f.name not in may_change
              and not same(getattr(saved, f.name), getattr(now, f.name))]
    if differ:
        change = ", ".join(f"--{n.replace('_', '-')} {getattr(saved, n)} -> {getattr(now, n)}"
                           for n in differ)
        raise ConfigError(f"--resume: {change} would change what the run in {checkpoint.parent} "
                          f"means; keep its flags or start a new run in another --out")
    if cfg.steps < state["step"]:
        raise ConfigError(f"--resume: the run is at step {state['step']}; --steps {cfg.steps} "
                          f"must be at least that")
    return state

# -----------------------------------------------------------------------------
# Signals: SIGTERM (what Slurm and Kubernetes send before they stop a job) and Ctrl-C save the last
# completed step.


class Interrupted(Exception):
    """SIGTERM or Ctrl-C."""


# From the optimizer's first step in a training step until the step counter says so, the weights
# are ahead of the counter: a signal arriving then is held until the step is counted, so a
# checkpoint never pairs N updates with step N-1.
_signals = {"weights_ahead": False, "held": None}


def _on_signal(signum, frame):
    name = signal.Signals(signum).name
    if _signals["weights_ahead"]:
        _signals["held"] = name
    else:
        raise Interrupted(name)


def step_counted():
    """The weights and the counter agree again: raise a signal held meanwhile."""
    _signals["weights_ahead"] = False
    held, _signals["held"] = _signals["held"], None
    if held:
        raise Interrupted(held)


@contextlib.contextmanager
def signals_handled(optimizer):
    """Turn SIGTERM and Ctrl-C into Interrupted (in the main thread) and mark every optimizer step
    as the start of 'weights ahead of the counter'; restore the previous handlers afterwards."""
    def ahead(*args):
        _signals["weights_ahead"] = True
    hook = optimizer.register_step_pre_hook(ahead)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        hook.remove()
        for s, handler in previous.items():
            signal.signal(s, handler)
        _signals.update(weights_ahead=False, held=None)

# -----------------------------------------------------------------------------
# The metrics file.


def finite(record: dict) -> dict:
    """NaN and infinities -> None (null), recursively: metrics.jsonl stays strict JSON."""
    def clean(value):
        if isinstance(value, dict):
            return finite(value)
        return None if isinstance(value, float) and not math.isfinite(value) else value
    return {k: clean(v) for k, v in record.items()}


def eval_due(cfg: Config, step: int) -> bool:
    """Evals run at step 0, every --eval-every steps and at the end."""
    return step == 0 or step == cfg.steps or bool(cfg.eval_every and step % cfg.eval_every == 0)


def open_metrics(out: Path, resume_from: int | None, cfg: Config):
    """metrics.jsonl for appending. A resumed run first drops what came after its checkpoint (steps
    it will redo) and the eval at the checkpoint's step if it redoes it, so the file reads as one
    run. A last line cut short (the process killed while writing it) came after the checkpoint and
    goes too."""
    path = out / "metrics.jsonl"
    if resume_from is not None and path.exists():
        lines = path.read_text().splitlines()
        last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number < last:
                    raise DataError(f"{path}:{number}: not a JSON line") from None
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise DataError(f"{path}:{number}: a record without a 'step'")
            records.append(record)
        redone = eval_due(cfg, resume_from)
        kept = [r for r in records if r["step"] < resume_from
                or (r["step"] == resume_from and not ("eval" in r and redone))]
        (out / "metrics.jsonl.tmp").write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(out / "metrics.jsonl.tmp", path)
    return open(path, "a")

# -----------------------------------------------------------------------------
# Data parallel (torchrun): each rank samples whole groups for its share of the prompts; advantages
# use the global batch; gradients are summed over the ranks; only rank 0 writes, evaluates, saves.


def setup_distributed(cfg: Config):
    """torchrun sets RANK, LOCAL_RANK and WORLD_SIZE: join the process group (NCCL on GPUs, gloo on
    CPU). Returns (rank, device); a plain `python grpo.py` is rank 0 of 1."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, pick_device(cfg.device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.prompts_per_step % world:
        raise ConfigError(f"--prompts-per-step {cfg.prompts_per_step} must be divisible by the "
                          f"{world} ranks")
    device = pick_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    # NCCL's default timeout is 10 minutes; a long step of a large model or a slow save on rank 0
    # would kill the job
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         timeout=datetime.timedelta(hours=2))
    return rank, device


def world_size() -> int:
    """Number of data-parallel ranks (1 without torchrun)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def this_rank() -> int:
    """This process's rank (0 without torchrun)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum (or max) plain numbers over the ranks; identity in a single process."""
    if not torch.distributed.is_initialized():
        return values
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
    torch.distributed.all_reduce(t, reduce_op)
    return t.tolist()


def global_mean(x: torch.Tensor) -> float:
    """The mean of x's entries over all ranks, from summed sums and counts (NaN if none): what one
    process holding the whole batch would compute, also when ranks hold different numbers of rows
    (GRPO-MA's answers, TA-GRPO's rephrasings)."""
    total, count = all_reduce([x.double().sum().item(), x.numel()])
    return total / count if count else math.nan


def global_std(x: torch.Tensor) -> float:
    """The unbiased std of x's entries over all ranks, from summed sums and sums of squares."""
    x = x.double()
    total, squares, count = all_reduce([x.sum().item(), (x * x).sum().item(), x.numel()])
    if count < 2:
        return math.nan
    return math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))


def on_global_batch(scheme, rewards, *args):
    """scheme(rewards, *args) computed on the rewards of all ranks, returning this rank's part (as
    TRL does), so that batch statistics (--scale-rewards batch) are those of the whole batch. Every
    rank holds the same number of prompts, so the rewards tensors have the same shape; one process:
    scheme(rewards, *args)."""
    if not torch.distributed.is_initialized():
        return scheme(rewards, *args)
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    parts = [torch.empty_like(rewards, device=device) for _ in range(world_size())]
    torch.distributed.all_gather(parts, rewards.to(device))
    result = scheme(torch.cat(parts).cpu(), *args)
    n, rank = len(rewards), torch.distributed.get_rank()
    if isinstance(result, tuple):
        return tuple(r[rank * n:(rank + 1) * n] for r in result)
    return result[rank * n:(rank + 1) * n]


def sum_gradients(model):
    """Sum the gradients over the ranks (the micro-batch weights are shares of the global batch, so
    the sum is the global gradient; DDP would average, overlapped with the backward pass; here it
    is one all-reduce per parameter after the last micro-batch); a single process: nothing."""
    if not torch.distributed.is_initialized():
        return
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)


# -----------------------------------------------------------------------------
# Timing and the command line.


class timed:
    """`with timed(metrics, "time/sample"):` adds the block's wall seconds to metrics[key]."""

    def __init__(self, metrics, key):
        self.metrics, self.key = metrics, key

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.metrics[self.key] = self.metrics.get(self.key, 0.0) + time.perf_counter() - self.start


def main(argv=None):
    """Command line entry point: bad flags or data stop with one line naming the flag, file, line
    and field."""
    try:
        cfg = parse_args(argv)
        return train(cfg)
    except (ConfigError, DataError, TrainingError) as e:
        sys.exit(f"grpo.py: error: {e}")


if __name__ == "__main__":
    main()
