"""
grpo.py: GRPO and three recent variants of it, in one file to read top to bottom.

    python grpo.py                     # GRPO on the tiny model in data/ (CPU, offline, ~40 s)
    python grpo.py --variant ma        # or lambda, ta
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data train.jsonl --test-data test.jsonl \\
        --max-new-tokens 512 --lr 1e-6          # one GPU, bf16 autocast
    torchrun --nproc_per_node=8 grpo.py ...     # data parallel: each rank samples its share
    python grpo.py --resume ...        # one command starts a run, continues it, or finds it done

Every variant samples completions o_i of contexts c_i, scores them, turns the rewards into
advantages A, and takes a gradient step on the loss -J, where (ε_high = ε unless set)

    J = Σ_i Σ_t w_it (min(ρ_it A_it, clip(ρ_it, 1-ε, 1+ε_high) A_it) - β KL_it)
    ρ_it = π(o_it | c_i, o_i<t) / π_old(o_it | c_i, o_i<t)      (= 1 at μ = 1, the default)
    KL_it = exp(ref - logp) - (ref - logp) - 1                  (Schulman's k3, to a frozen copy)
    w_it = 1 / (all tokens of the batch)                        (TRL's dapo; or grpo, dr_grpo)

The variants change the advantages A, the weights w and, for ma and ta, the contexts c_i:

    grpo    A_i = r_i normalised within its group of G completions     (DeepSeekMath, 2402.03300)
    lambda  w_it / |λ(i,t)|, λ(i,t) the completions of the group that agree with o_i up to and
            including its token t                                   (λ-GRPO, 2509.21154)
    ma      K thoughts per prompt, M answers per thought; a thought's A from the mean reward of
            its answers, normalised over the K; an answer's over all K·M; w per part (thoughts,
            answers)                                                 (GRPO-MA, 2509.24494)
    ta      q0 and N rephrasings, G samples each, A normalised over all (N+1)·G; ρ and ∇ log π
            taken as answers to q0                                   (TA-GRPO, 2601.22478)

At μ = --num-iterations = 1 a batch makes one step, so π_old = π, ρ = 1, nothing is clipped, and
the gradient is the policy gradient Σ w A ∇ log π; --num-iterations 2 shows the clip, --beta 0.04
adds the KL (DeepSeekMath: --loss-type grpo --beta 0.04).

Simplified versus the papers: a short KV-cache sampler of the file's own (no vLLM: one process
samples and trains, so models up to ~1-3B on one GPU); the reward reads one number (or compares
text), not math_verify; no LoRA, the reference is a full copy; GRPO-MA's unclosed thoughts get no
answers and value 0, and its thought/answer weighting is our reading (the paper publishes none);
TA-GRPO's rephrasings come from the data file; the learning rate warms up, then stays constant.

Sections: 1 the ideas (one function per scheme, then the loss), 2 the reward, 3 the sampler,
4 Config, the rows and one rollout per variant, 5 log-probs and the update, 6 the loop and the
eval; then what a first read can skip: the number reader, and 7 plumbing (flags, data,
checkpoints, signals, torchrun).
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
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import transformers
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm
from transformers import DynamicCache, HfArgumentParser

# -----------------------------------------------------------------------------
# 1. The ideas: one function per scheme, on plain tensors (ma_ and ta_ call group_advantages:
# copy it with them).

def group_advantages(rewards, group_size: int, scale: str = "group", eps: float = 1e-4):
    """GRPO's advantages; rewards (groups * G,), G = group_size consecutive rewards per group.

        A = (r - mean(r)) / (std(r) + eps)   per group, std unbiased (ddof=1) as TRL
        A = r - mean(r)                      scale="none" (Dr. GRPO)

    A group whose rewards are all equal gets exactly 0: its float mean can miss r by ~1e-8, which
    divided by std + eps would be an advantage. A NaN reward marks a row that does not exist (TA's
    missing rephrasing, MA's unanswered thought): left out of its group's statistics, NaN back.

    >>> group_advantages(torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.]), 4)  # mean .25, std .5
    tensor([ 1.4997, -0.4999, -0.4999, -0.4999,  0.0000,  0.0000,  0.0000,  0.0000])

    scale="none" on these rewards: [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]; a group
    [1, 0, NaN, NaN]: [0.7070, -0.7070, NaN, NaN] (the two rewards that exist, std 0.7071).
    """
    r = rewards.reshape(-1, group_size)  # (groups, G)
    adv = r - r.nanmean(1, keepdim=True)
    if scale == "group":  # unbiased std, NaN left out (no torch.nanstd); 1 reward: NaN, 0 below
        n = (~r.isnan()).sum(1, keepdim=True)
        std = ((adv ** 2).nansum(1, keepdim=True) / (n - 1)).sqrt()
        adv = adv / (std + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group or none, got {scale!r}")
    # all existing rewards equal (max == min) -> exactly 0
    high = torch.where(r.isnan(), -math.inf, r).amax(1, keepdim=True)
    low = torch.where(r.isnan(), math.inf, r).amin(1, keepdim=True)
    adv = torch.where((high == low) & ~r.isnan(), 0.0, adv)
    return adv.reshape(rewards.shape)

def ma_advantages(rewards, scale: str = "group", eps: float = 1e-4):
    """GRPO-MA's advantages; rewards (P, K, M): P prompts, K thoughts each, M answers per thought.

        prompt -+- thought 1 -+- answer 1,1  r = 1     V(th_1) = 1     (the mean of its answers)
                |             +- answer 1,2  r = 1
                +- thought 2 -+- answer 2,1  r = 1     V(th_2) = 0.5
                              +- answer 2,2  r = 0

        thought advantages: V normalised over the K thoughts       [0.7069, -0.7069]
        answer advantages:  r normalised over all K·M answers      [[0.4999, 0.4999],
                            (mean 0.75, std 0.5; not per thought)   [0.4999, -1.4997]]

    A thought that never closed (no </think>) has no answers: NaN rewards, value 0, and no place
    in the answers' statistics. Returns (thought_adv (P, K), answer_adv (P, K, M), V (P, K)).
    """
    P, K, M = rewards.shape
    values = rewards.nanmean(-1).nan_to_num(0.0)  # (P, K); an unanswered thought is worth 0
    thought_adv = group_advantages(values.reshape(-1), K, scale, eps).reshape(P, K)
    answer_adv = group_advantages(rewards.reshape(-1), K * M, scale, eps).reshape(P, K, M)
    return thought_adv, answer_adv, values

def ta_advantages(rewards, scale: str = "group", eps: float = 1e-4):
    """TA-GRPO's advantages; rewards (P, N+1, G): question q0, N rephrasings, G responses each.

        q0  "What is 3 + 5?"   r = 1 1     alone: all equal, no signal
        q1  "Add 3 and 5."     r = 0 1
        pooled over the (N+1)·G = 4: mean 0.75, std 0.5 -> [[0.4999, 0.4999], [-1.4997, 0.4999]]

    A question with fewer than N rephrasings marks the missing ones with NaN (left out, NaN back).
    """
    P, Q, G = rewards.shape
    return group_advantages(rewards.reshape(-1), Q * G, scale, eps).reshape(P, Q, G)

def lambda_weights(completion_ids, completion_mask, group_size: int):
    """λ-GRPO's token weights 1/|λ(i,t)|, (B, T), 0 off the mask. completion_ids and its mask
    (B, T): groups of group_size consecutive rows, each right-padded (its mask 1s from column 0).
    |λ(i,t)| counts the completions of i's group (i itself and exact duplicates included) that
    agree with i up to and including its token t (t from 0), so a shared prefix is trained once.
    One group of group_size = 6:

        A B C D           1/2 1/2  1   1
        A B E F H I       1/2 1/2  1   1   1   1
        J K L M           1/3 1/3 1/3  1
        J K L N Q S T     1/3 1/3 1/3 1/2 1/2  1   1
        J K L N Q U       1/3 1/3 1/3 1/2 1/2  1
        V W Y Z            1   1   1   1

    Loop-free: every pair of a group's rows compared token by token (~4·B·G·T bytes), a running
    product making "equal at t" "equal up to t". The weights scale the per-token loss (policy and
    KL), not the normaliser: aggregation_weights(...) * lambda_weights(...). So shared tokens
    weigh less than the others; the loss's overall scale shrinks too, which Adam mostly cancels.
    """
    B, T = completion_ids.shape
    ids = completion_ids.reshape(-1, group_size, T)  # (groups, G, T)
    mask = completion_mask.reshape(-1, group_size, T).bool()
    same = (ids[:, :, None] == ids[:, None]) & mask[:, :, None] & mask[:, None]  # (groups, G, G, T)
    counts = same.cumprod(-1, dtype=torch.uint8).sum(2, dtype=torch.int32)  # |λ|, (groups, G, T)
    return torch.where(mask, 1.0 / counts.clamp(min=1), 0.0).reshape(B, T)

# The loss: TRL's aggregations as per-token weights, then the clipped ratio and the k3 KL.

def aggregation_weights(completion_mask, loss_type="dapo", num_rows=None, num_tokens=None,
                        max_completion_length=None):
    """(B, T) weight of each token in the loss, as TRL aggregates (|o_i|: row i's tokens):

        dapo     1 / (all tokens)                     one token mean over the batch
        grpo     1 / (rows · |o_i|)                   a mean over rows of each row's token mean
        dr_grpo  1 / (rows · max_completion_length)   a constant (arXiv 2503.20783; Dr. GRPO
                                                      also drops the std: scale="none")

    Rows of 2 and 4 tokens: dapo 1/6 each; grpo [1/4, 1/4], [1/8] * 4; dr_grpo (limit 8) 1/16.
    To weigh a piece of a batch (a micro-batch, a rank), pass the whole batch's num_rows (grpo,
    dr_grpo) and num_tokens (dapo): the pieces' losses then add up to the batch's.
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
    """The loss -J (to minimise) and its metrics; per-token tensors (B, T), advantages (B,) or
    (B, T), finite on the mask.

        ρ = exp(logp - old)
        KL = exp(ref - logp) - (ref - logp) - 1                      (k3)
        per-token loss = -min(ρ A, clip(ρ, 1-ε, 1+ε_high) A) + β KL
        loss = Σ loss_weights · per-token loss, over the mask

    At μ = 1, old = logp.detach(): ρ = 1 in value, with the gradient of logp. The min's two
    terms are then equal, and torch sends half the gradient through each. clamp's gradient is 1
    inside [1-ε, 1+ε_high], so both halves reach logp: ∂loss/∂logp = -w A per token, the policy
    gradient.

    With aggregation_weights' dapo or grpo weights (they sum to 1) the loss is a mean; λ-GRPO
    multiplies them by lambda_weights(ids, mask, G). ε_high = ε when None, as TRL. The metrics
    are 0-dim tensors (token means).
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
# 2. The reward: 1 for a finished completion whose answer is the reference. Model output is text:
# it is read, never run. Only what follows the first </think> can be the answer.

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"  # any text without a think/answer tag in it
FORMAT_RE = re.compile(rf"\s*<think>{NO_TAG}</think>\s*<answer>{NO_TAG}</answer>\s*", re.DOTALL)

def after_thought(text: str):
    """The text after the first </think> (all of it without one; None if a <think> never closes),
    so that an answer written inside the thought is never credited."""
    if "<think>" in text and "</think>" not in text:
        return None
    return text.split("</think>", 1)[-1]

def extract_answer(text: str, answer_from: str = "tags"):
    """The answer after the thought, or None: the last <answer>...</answer>, else the last
    \\boxed{...}; with answer_from="last-number", the last number (GSM8K's convention), unless it is
    part of an expression. (The number reader, parse_number and its helpers, is after section 6.)"""
    text = after_thought(text)
    if text is None:
        return None
    if answer_from == "last-number":
        runs = number_runs(unwrap(text))
        return runs[-1] if runs else None
    found = ANSWER_RE.findall(text)
    if found:
        return found[-1]
    return boxed(text)

def score(text: str, reference: str, finished: bool, format_reward: float = 0.0,
          answer_from: str = "tags"):
    """(reward, parsed) of one completion: 1 if it finished (EOS) and its answer is the reference,
    plus format_reward if it finished as one <think>..</think> then one <answer>..</answer>.

    - A numeric reference wants an answer that is that number (parse_number; '1/2' = '0.5').
    - Any other reference is compared as text, without whitespace or a \\boxed{} around it.
    - parsed: an answer was read (for a numeric reference, a number).
    """
    answer = extract_answer(text, answer_from)
    ref_num = parse_number(reference)
    answer_num = parse_number(answer) if answer is not None else None
    parsed = answer is not None and (ref_num is None or answer_num is not None)
    correct = False
    if parsed and finished and ref_num is not None:
        correct = answer_num == ref_num
    elif parsed and finished:
        correct = as_text(answer) == as_text(reference)
    shaped = finished and FORMAT_RE.fullmatch(text) is not None
    return float(correct) + format_reward * shaped, parsed

def as_text(answer: str) -> str:
    """An answer compared as text: what a \\boxed{} around it holds, without whitespace."""
    return re.sub(r"\s", "", boxed(answer) or answer)

def score_batch(tokenizer, samples, references, format_reward=0.0, answer_from="tags", before=""):
    """(rewards, parsed, tagged), each (B,), of the Samples from generate, decoded with decode
    (section 3). Each text is read after `before` (one string, or one per row): the response
    prefix, and for a GRPO-MA answer its thought too. tagged: <answer> tags after the thought."""
    texts = decode(tokenizer, samples.completion_ids, samples.completion_mask)
    before = [before] * len(texts) if isinstance(before, str) else before
    texts = [b + text for b, text in zip(before, texts)]
    finished = samples.finished.tolist()
    scored = [score(text, reference, done, format_reward, answer_from)
              for text, reference, done in zip(texts, references, finished)]
    tagged = [ANSWER_RE.search(after_thought(t) or "") is not None for t in texts]
    rewards = torch.tensor([r for r, _ in scored], dtype=torch.float32)
    parsed = torch.tensor([p for _, p in scored], dtype=torch.bool)
    return rewards, parsed, torch.tensor(tagged, dtype=torch.bool)

# -----------------------------------------------------------------------------
# 3. The sampler: each prompt encoded once, its KV cache copied to the rows that continue it.
# A first read needs only generate(): n samples per prompt, returned as Samples. It (and the
# log-probs of section 5) assume HF's decoder layout, model.model then model.lm_head (Qwen2/3,
# Llama), and transformers 5.24 or newer (its cache= argument).

def prompt_ids(tokenizer, question: str, system_prompt: str, response_prefix: str = ""):
    """A question (after the system prompt) chat-templated into token ids, generation prompt on,
    then the response prefix: the reply's first words (DeepSeek-R1's template ends with <think>),
    tokenized on their own, so that the template's tokens stay as they are. Never sampled, never
    trained."""
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
    # cache= is transformers 5.24's name for past_key_values (requirements.txt: 5.24 or newer)
    out = model.model(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, use_cache=cache is not None, cache=cache)
    return out.last_hidden_state

@dataclass
class CachedContext:
    """Contexts ready to be continued: the KV cache of all their tokens but the last, and that last
    token, which the next forward pass takes as input (its output predicts the first new token)."""
    cache: object        # a DynamicCache: per layer keys and values, (B, heads, L, head_dim)
    mask: torch.Tensor   # (B, L) 1 where the cache holds a real token, 0 for padding
    last: torch.Tensor   # (B,)

    def reorder(self, index):
        """In place, as the DynamicCache it holds: keep rows `index`, a repeated index copying a
        context to several continuations (HF's reorder_cache and index_select here: their CPU
        backward is deterministic, unlike x[index]'s)."""
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

def prefill(model, prompts: list[list[int]], pad_id: int) -> CachedContext:
    """Encode each prompt (token ids) once, left-padded; with gradients if they are enabled."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    cache = DynamicCache()
    if ids.shape[1] > 1:
        run_decoder(model, ids[:, :-1], mask[:, :-1], cache)
    return CachedContext(cache, mask[:, :-1], ids[:, -1])

@dataclass
class Samples:
    completion_ids: torch.Tensor   # (B, C) right-padded with pad
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the token that ended the row
    finished: torch.Tensor         # (B,) ended with EOS

@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], n: int, max_new_tokens: int,
             temperature=1.0, greedy=False, stop_strings=()) -> Samples:
    """n samples for each prompt (token ids), rows in prompt order, one token per forward pass.

    - Each prompt is prefilled once and its cache copied to its n rows. A row ends at an EOS token
      (any of eos_ids, below), at the length limit, or at the token whose text completes a stop
      string (stop_string_hits, below); ended rows leave the batch.
    - Only the temperature shapes the draw: no top-k, no top-p, nothing of the generation config.
    - Eval mode: no dropout, and HF's gradient checkpointing would drop the cache.
    - Non-finite logits at the first token (a diverged policy) stop the run: UserError (sec. 7).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ctx = prefill(model, prompts, tokenizer.pad_token_id)
    ctx.reorder(torch.arange(len(prompts), device=device).repeat_interleave(n))  # n rows each
    eos = torch.tensor(eos_ids(model, tokenizer), device=device)
    B = len(ctx.last)
    ids = torch.full((B, max_new_tokens), tokenizer.pad_token_id, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    texts = [""] * B  # each row's text so far, for stop strings
    active = torch.arange(B, device=device)  # the rows still being decoded
    cache, mask, token = ctx.cache, ctx.mask, ctx.last
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
    ids = set(ids if isinstance(ids, list) else [ids])
    return sorted((ids | {tokenizer.eos_token_id}) - {None})

def decode(tokenizer, completion_ids, completion_mask) -> list[str]:
    """The text of each completion's masked tokens, special tokens dropped."""
    return [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(completion_ids, completion_mask)]

# -----------------------------------------------------------------------------
# 4. The config, the rows every variant produces, and one rollout per variant.

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
    system_prompt: str = _opt(SYSTEM_PROMPT, "system message ('': none; a chat template may then "
                              "add its own default)")
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
    ma_weighting: str = _opt("parts", "(ma) parts: a mean over the thoughts plus one over the "
                             "answers; tokens: one mean over both", ["parts", "tokens"])
    num_rephrasings: int = _opt(3, "N (ta): rephrasings per question, drawn afresh each step")
    ta_anchor: str = _opt("original", "(ta) context of the log-probs: q0 (the paper) or the "
                          "rephrasing (public code)", ["original", "rephrased"])
    # loss and optimisation
    loss_type: str = _opt("dapo", "token aggregation, as TRL (the default is DAPO's; "
                          "DeepSeekMath's is grpo)", ["grpo", "dr_grpo", "dapo"])
    scale_rewards: str = _opt("group", "divide by the std (none: Dr. GRPO)", ["group", "none"])
    beta: float = _opt(0.0, "k3 KL coefficient (a reference model is loaded only when > 0)")
    epsilon: float = _opt(0.2, "clip range of the ratio (the upper too, unless --epsilon-high)")
    epsilon_high: float | None = _opt(None, "upper clip range (default: --epsilon; DAPO: 0.28)")
    num_iterations: int = _opt(1, "mu: updates per sampled batch")
    answer_from: str = _opt("tags", "where the answer is read: the last <answer> tags (else the "
                            "last \\boxed), or the last number", ["tags", "last-number"])
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

@dataclass
class Rows:
    """What a rollout hands to update(), whichever the variant: completions with their advantages.
    Row i continues prompts[prompt_index[i]] and then, for a GRPO-MA answer, the completion of row
    parent[i] (its thought); a context is named, not copied, so that it is encoded once. Each
    completion is right-padded, its mask a run of 1s from column 0; 2-D fields are (B, C)."""
    prompts: list[list[int]]       # the distinct prompts (chat-templated token ids)
    prompt_index: torch.Tensor     # (B,) the prompt each row continues
    parent: torch.Tensor           # (B,) -1, or the row between prompt and this one (MA's thought)
    completion_ids: torch.Tensor   # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) 1 up to and including EOS / stop
    advantages: torch.Tensor       # (B,), or (B, C) per token (no rollout here needs it); finite
    part_limits: list = field(default_factory=list)  # one per loss part: its length limit (the
    # number of parts is this list's length; the limits matter to dr_grpo only)
    part: torch.Tensor | None = None  # (B,) each row's loss part: an index into part_limits
    inv_lambda: torch.Tensor | None = None  # (B, C) λ-GRPO's 1/|λ|: scales the per-token loss
    rewards: torch.Tensor | None = None  # (B,) shown by log_group (an MA thought: its value)
    loss_weights: torch.Tensor | None = None  # (B, C) each token's w in J (update sets it)

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

# To write a rollout (rollout_grpo is the one to copy): it takes the model, tokenizer, config, this
# rank's examples (so P in a rollout is this rank's prompts) and an rng (TA's draws), makes no
# distributed call, and returns (Rows, metrics):
#   1. prompts = [prompt_ids(...)]; samples = generate(...) inside timed(metrics, "time/sample")
#   2. rewards = score_batch(...); advantages from a scheme of section 1, finite for every row
#   3. Rows: prompt_index for each row, parent -1 (or a thought row, for an answer), part_limits
#      (and part, for more than one loss part)
#   4. metrics: tensors, logged as the mean of their elements over all ranks (global_means,
#      section 6), with the same keys on every rank (one all_reduce carries them all)
#   5. an entry in ROLLOUTS and a --variant choice in Config

@contextlib.contextmanager
def timed(metrics: dict, key: str):
    """Add the block's wall seconds (once the GPU's queued work is done) to metrics[key]."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start

def sample_metrics(rewards, grouped_adv, parsed, tagged, samples) -> dict:
    """The metrics every rollout logs (tensors: means over their elements). reward: that of the
    completions scored; frac_reward_zero_std: the share of normalisation groups (the rows of
    grouped_adv, NaN where a row does not exist) without a signal, every advantage 0."""
    no_signal = (grouped_adv.nan_to_num(0.0) == 0).all(1)
    return {"reward": rewards, "frac_reward_zero_std": no_signal,
            "completion_length": samples.completion_mask.sum(1).float(),
            "truncated": ~samples.finished, "unparseable": ~parsed, "format": tagged}

def rollout_grpo(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """GRPO and λ-GRPO: G completions per prompt, group-normalised advantages; for `lambda` the
    rows also carry 1/|λ| token weights (logged for both: how much a group's completions share)."""
    G, metrics = cfg.num_generations, {}
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
               for ex in batch]
    with timed(metrics, "time/sample"):
        s = generate(model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature)
    ids, mask = s.completion_ids.cpu(), s.completion_mask.cpu()
    references = [ex["answer"] for ex in batch for _ in range(G)]
    rewards, parsed, tagged = score_batch(tokenizer, s, references, cfg.format_reward,
                                          cfg.answer_from, cfg.response_prefix)
    advantages = group_advantages(rewards, G, cfg.scale_rewards)
    inv_lambda = lambda_weights(ids, mask, G)
    on = mask.bool()
    metrics.update(sample_metrics(rewards, advantages.view(-1, G), parsed, tagged, s),
                   lambda_mean=1 / inv_lambda[on],      # mean |λ| over tokens
                   lambda_shared=inv_lambda[on] < 1)    # share of tokens with |λ| > 1
    prompt_index = torch.arange(len(batch)).repeat_interleave(G)
    parent = torch.full((len(ids),), -1)  # every row continues its prompt directly
    rows = Rows(prompts, prompt_index, parent, ids, mask, advantages,
                part_limits=[cfg.max_new_tokens], rewards=rewards,
                inv_lambda=inv_lambda if cfg.variant == "lambda" else None)
    return rows, metrics

def rollout_ma(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """GRPO-MA (ma_advantages): K thoughts per prompt, each ending at the token whose text
    completes </think>; M answers per closed thought, sampled after prompt + thought and scored on
    prefix + thought + answer. A thought that never closes gets no answers and value 0, and is
    trained with its advantage. Rows for P = 1, K = 2, M = 2, thought 1 unclosed:

        row  completion       parent  advantage  part (--ma-weighting parts)
        0    thought 0        -1      A(th_0)    0: thoughts, limit --max-new-tokens
        1    thought 1 (open) -1      A(th_1)    0
        2    answer 0,0        0      A(a_0,0)   1: answers, limit --max-answer-tokens
        3    answer 0,1        0      A(a_0,1)   1
    """
    K, M, P, metrics = cfg.num_thoughts, cfg.num_answers, len(batch), {}  # P: this rank's prompts
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
               for ex in batch]
    with timed(metrics, "time/sample"):
        th = generate(model, tokenizer, prompts, K, cfg.max_new_tokens, cfg.temperature,
                      stop_strings=["</think>"])
        th_ids, th_mask = th.completion_ids.cpu(), th.completion_mask.cpu()
        thought_texts = decode(tokenizer, th_ids, th_mask)
        closed = torch.tensor(["</think>" in text for text in thought_texts])  # (P*K,) bool
        closed_rows = closed.nonzero().squeeze(1).tolist()
        # generate's rows are prompt-major: thought row r belongs to prompt r // K
        contexts = [prompts[r // K] + th_ids[r][th_mask[r].bool()].tolist() for r in closed_rows]
        ans = generate(model, tokenizer, contexts, M, cfg.max_answer_tokens, cfg.temperature)
    parents = [r for r in closed_rows for _ in range(M)]  # each answer's thought row
    references = [batch[r // K]["answer"] for r in parents]
    before = [cfg.response_prefix + thought_texts[r] for r in parents]
    answer_rewards, parsed, tagged = score_batch(tokenizer, ans, references, cfg.format_reward,
                                                 cfg.answer_from, before)
    rewards = torch.full((P * K, M), math.nan)  # an unclosed thought's answers do not exist
    rewards[closed] = answer_rewards.view(-1, M)
    thought_adv, answer_adv, values = ma_advantages(rewards.view(P, K, M), cfg.scale_rewards)
    ids = pad_sequence(list(th_ids) + list(ans.completion_ids.cpu()), batch_first=True,
                       padding_value=tokenizer.pad_token_id)
    mask = pad_sequence(list(th_mask) + list(ans.completion_mask.cpu()), batch_first=True)
    advantages = torch.cat([thought_adv.view(-1), answer_adv.view(P * K, M)[closed].view(-1)])
    parent = torch.tensor([-1] * (P * K) + parents)
    prompt_index = torch.tensor([r // K for r in range(P * K)] + [r // K for r in parents])
    # the completions are the answers; the thoughts have metrics of their own
    metrics.update(sample_metrics(answer_rewards, answer_adv.view(P, -1), parsed, tagged, ans),
                   thought_value=values, frac_value_zero_std=(thought_adv == 0).all(1),
                   unclosed_thoughts=~closed, thought_length=th_mask.sum(1).float())
    if cfg.ma_weighting == "parts":
        part, part_limits = (parent >= 0).long(), [cfg.max_new_tokens, cfg.max_answer_tokens]
    else:  # one token mean over thoughts and answers
        part, part_limits = None, [max(cfg.max_new_tokens, cfg.max_answer_tokens)]
    rows = Rows(prompts, prompt_index, parent, ids, mask, advantages, part_limits=part_limits,
                part=part, rewards=torch.cat([values.view(-1), answer_rewards]))
    return rows, metrics

def rollout_ta(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """TA-GRPO (ta_advantages): each question q0 with n <= N of its rephrasings (drawn afresh each
    step), G responses to each, advantages normalised over the question's (n+1)·G responses.
    --ta-anchor original, the objective of the paper's fifth arXiv version, takes every log-prob
    as log π(o | q0), also for an o sampled after a rephrasing: it trains π(· | q0) on responses
    that π(· | q_j) wrote. At μ = 1 the ratio is 1 either way; at μ > 1 it is π/π_old, both
    given q0. `rephrased` keeps the prompt that produced the response (the public code).
    Rows for P = 1, N = 2, G = 2, one rephrasing drawn:

        row  phrasing  prompt_index (original / rephrased)  its (p, j, g) in rewards
        0    q0        0 / 0                                 [0, 0, 0]
        1    q0        0 / 0                                 [0, 0, 1]
        2    q1        0 / 1                                 [0, 1, 0]
        3    q1        0 / 1                                 [0, 1, 1]
                                               (rewards[0, 2] stays NaN: no second rephrasing)
    """
    G, N, metrics = cfg.num_generations, cfg.num_rephrasings, {}
    phrasings, q0_of = [], []  # every phrasing's prompt; each question's q0 among them
    slots = []  # (question p, phrasing j, sample g) of each row, in row order
    for p, ex in enumerate(batch):
        drawn = rng.sample(ex["rephrasings"], min(N, len(ex["rephrasings"])))
        q0_of.append(len(phrasings))
        for j, question in enumerate([ex["question"]] + drawn):
            phrasings.append(prompt_ids(tokenizer, question, cfg.system_prompt,
                                        cfg.response_prefix))
            slots += [(p, j, g) for g in range(G)]
    p_idx, j_idx, g_idx = torch.tensor(slots).T
    with timed(metrics, "time/sample"):
        s = generate(model, tokenizer, phrasings, G, cfg.max_new_tokens, cfg.temperature)
    references = [batch[p]["answer"] for p in p_idx.tolist()]
    r, parsed, tagged = score_batch(tokenizer, s, references, cfg.format_reward, cfg.answer_from,
                                    cfg.response_prefix)
    rewards = torch.full((len(batch), N + 1, G), math.nan)  # (P, N+1, G)
    rewards[p_idx, j_idx, g_idx] = r
    pooled_adv = ta_advantages(rewards, cfg.scale_rewards)
    advantages = pooled_adv[p_idx, j_idx, g_idx]
    if cfg.ta_anchor == "rephrased":
        prompts, prompt_index = phrasings, torch.arange(len(phrasings)).repeat_interleave(G)
    else:
        prompts, prompt_index = [phrasings[i] for i in q0_of], p_idx
    q0 = rewards[:, 0]  # q0's own G rewards: what plain GRPO would have had
    metrics.update(sample_metrics(r, pooled_adv.view(len(batch), -1), parsed, tagged, s),
                   frac_reward_zero_std_q0=q0.amax(1) == q0.amin(1), reward_q0=q0,
                   reward_rephrased=r[j_idx > 0])
    ids, mask = s.completion_ids.cpu(), s.completion_mask.cpu()
    parent = torch.full((len(ids),), -1)
    rows = Rows(prompts, prompt_index, parent, ids, mask, advantages,
                part_limits=[cfg.max_new_tokens], rewards=r)
    return rows, metrics

ROLLOUTS = {"grpo": rollout_grpo, "lambda": rollout_grpo, "ma": rollout_ma, "ta": rollout_ta}

# -----------------------------------------------------------------------------
# 5. Log-probs and the update. update() takes a rollout's Rows through, whichever variant made
# them. Shapes for grpo with P = 2 prompts, G = 4: B = 8 rows, C = the longest completion. A first
# read needs only plain_logps: rows_logps gives the same numbers faster, sharing contexts.
#
#   Rows: 2 prompts, prompt_index (8,), completion_ids (8, C), advantages (8,)
#     -> global_loss_weights: w (8, C), each token's weight in J over every rank's rows
#     -> micro_batches: groups of rows (a GRPO-MA thought stays with its answers)
#     -> per micro-batch of b rows: rows_logps (b, C) -> policy_loss -> backward
#     -> sum_gradients over the ranks, clip the norm, optimizer.step; μ times

def plain_logps(model, rows: Rows, temperature: float):
    """(B, C) log softmax(logits / T) of each completion token given its context and the tokens
    before it, the plain way: one forward pass per row over context + completion. The definition
    (rows_logps, below update, is the fast way to the same numbers); it serves
    --gradient-checkpointing, under which HF drops KV caches."""
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

def global_loss_weights(rows: Rows, loss_type: str):
    """What update() first does with the rows: (weights, tokens), each token's w in J over the
    global batch (all ranks), (B, C), and that batch's token count.

    - Each loss part (rows.part: one, or GRPO-MA's thoughts and answers) is aggregated on its own
      (aggregation_weights with the part's global counts and length limit), so under dapo and
      grpo each part's weights sum to 1 and J is a sum of one mean per part: GRPO-MA's thoughts
      weigh as much as its answers (Adam mostly cancels the doubled scale).
    - GRPO-MA under dapo: a thought token weighs 1 / (all thought tokens), an answer token
      1 / (all answer tokens); pooled (--ma-weighting tokens), when every thought closed with Lt
      tokens and every answer has La, the thoughts get Lt / (Lt + M La) of J.
    - λ-GRPO's 1/|λ| multiplies the weights (policy and KL terms), not the normaliser.

    GRPO-MA, parts, dapo, 2 thoughts of 3 tokens and 4 answers of 2: each thought token 1/6, each
    answer token 1/8 (J: one mean over the thoughts plus one over the answers).
    """
    assert rows.part_limits, "the rollout sets part_limits, one per loss part"
    assert rows.advantages.isfinite().all(), "the rollout gives every row a finite advantage"
    parents = rows.parent[rows.parent >= 0]
    assert (rows.parent[parents] < 0).all(), "a parent row continues its prompt (one level)"
    part = torch.zeros(len(rows), dtype=torch.long) if rows.part is None else rows.part
    weights, tokens = torch.zeros(rows.completion_mask.shape), 0
    for k, max_len in enumerate(rows.part_limits):
        in_part = part == k
        mask = rows.completion_mask[in_part]
        n_rows, n_tokens = all_reduce([len(mask), mask.sum().item()])  # (section 7: over ranks)
        weights[in_part] = aggregation_weights(mask, loss_type, n_rows, n_tokens, max_len)
        tokens += n_tokens
    if rows.inv_lambda is not None:
        weights = weights * rows.inv_lambda
    return weights, tokens

def update(model, ref_model, optimizer, rows: Rows, cfg: Config) -> dict:
    """μ = --num-iterations optimizer steps on one batch of rows, whichever variant made them.

    - Each token's weight w in J over the global batch (all micro-batches, all ranks) comes first,
      set on the rows so that each micro-batch carries its own: a micro-batch's loss is its piece
      of -J, backward() adds the pieces, sum_gradients the ranks'.
    - Logged: the loss, summed likewise. policy_loss's metrics (kl, the clips, any one added) are
      token means: each weighted by shares[j], its micro-batch's share of the global tokens.
    - Old log-probs at μ > 1 and reference ones at β > 0, before the first step. The schedule
      steps once per batch (in train), not per μ step. Train mode here, eval mode in sampling: the
      same policy only without dropout (Qwen2/3 and Llama set it to 0; turn off a model's own).
    """
    metrics, grad_norms = {}, []
    rows.loss_weights, all_tokens = global_loss_weights(rows, cfg.loss_type)  # before the split
    micro = micro_batches(rows, cfg.micro_batch_size)
    shares = [m.completion_mask.sum().item() / max(all_tokens, 1) for m in micro]  # kl, clips
    micro = [m.to(next(model.parameters()).device) for m in micro]
    # rows_logps (below) shares contexts; plain_logps: the same numbers, plainly (swap to check)
    logps_of = plain_logps if cfg.gradient_checkpointing else rows_logps
    totals = dict.fromkeys(["loss", "clip_low", "clip_high"] + (["kl"] if cfg.beta else []), 0.0)
    with timed(metrics, "time/update"):
        with torch.no_grad():
            old, ref = None, None
            if cfg.num_iterations > 1:
                old = [logps_of(model, m, cfg.temperature) for m in micro]
            if cfg.beta > 0:
                ref = [logps_of(ref_model, m, cfg.temperature) for m in micro]
        for _ in range(cfg.num_iterations):
            for j, m in enumerate(micro):
                logps = logps_of(model, m, cfg.temperature)
                loss, loss_metrics = policy_loss(  # at μ = 1 the old log-probs are logps.detach()
                    logps, old[j] if old else logps.detach(), m.advantages, m.completion_mask,
                    m.loss_weights, ref[j] if ref else None, cfg.beta, cfg.epsilon,
                    cfg.epsilon_high)
                loss.backward()
                totals["loss"] += loss.item() / cfg.num_iterations
                for key, value in loss_metrics.items():  # means per token: weighted by share
                    totals[key] += value.item() * shares[j] / cfg.num_iterations
            sum_gradients(model)  # over the ranks (section 7)
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

def rows_logps(model, rows: Rows, temperature: float):
    """plain_logps' numbers, each shared context encoded once: a prompt's KV cache is copied to its
    rows, a GRPO-MA thought's on to its answers, and gradients flow back through the copies.

    The one-token shift: a context's cache holds all its tokens but the last, which is the next
    pass's first input (its output predicts the first new token). Prompt p1 p2 p3, thought t1 t2,
    answer a1 a2:

        pass      input     cache before     predicts   cache after
        prompt    p1 p2     -                -          p1 p2
        thought   p3 t1     p1 p2            t1 t2      p1 p2 p3 t1
        answer    t2 a1     p1 p2 p3 t1      a1 a2      -

    A row shorter than its pass leaves padding inside the cache, masked (positions count real
    tokens only). `pytest test_grpo.py -k shared_prefix` checks values and gradients against
    plain_logps for every variant."""
    B, C = rows.completion_ids.shape
    device = rows.completion_ids.device
    logps = torch.zeros(B, C, device=device)
    ctx = prefill(model, rows.prompts, 0)  # each distinct prompt encoded once
    top = (rows.parent < 0).nonzero().squeeze(1)  # the rows that continue a prompt directly
    ctx.reorder(rows.prompt_index[top])  # one context per top row
    after_top = continue_rows(model, ctx, rows, top, logps, temperature)
    children = (rows.parent >= 0).nonzero().squeeze(1)  # GRPO-MA's answers, after their thought
    if len(children):
        slot = torch.full((B,), -1, dtype=torch.long, device=device)
        slot[top] = torch.arange(len(top), device=device)  # a top row's place in after_top
        assert (slot[rows.parent[children]] >= 0).all(), "a parent row must continue its prompt"
        after_top.reorder(slot[rows.parent[children]])  # one context per child: its parent's
        continue_rows(model, after_top, rows, children, logps, temperature)
    return logps

def continue_rows(model, ctx: CachedContext, rows: Rows, idx, logps,
                  temperature: float) -> CachedContext:
    """rows_logps' pass: write into logps the log-probs of rows idx, each after its context in ctx,
    and return the contexts that end with those rows, ready for their children (ctx's cache grows
    in place: it is the returned CachedContext's)."""
    n = int(rows.completion_mask[idx].sum(1).max())
    target, target_mask = rows.completion_ids[idx, :n], rows.completion_mask[idx, :n]
    inputs = torch.cat([ctx.last[:, None], target[:, :-1]], 1)  # input t predicts target t
    # inputs[:, t] is real exactly where target t is (a mask is 1s from column 0). The cache
    # takes every input, so it ends one token short of each row: that last token is what a
    # child row's pass feeds first (CachedContext.last)
    attn = torch.cat([ctx.mask, target_mask], 1)
    hidden = run_decoder(model, inputs, attn, ctx.cache)
    logps[idx, :n] = token_logps(model.lm_head, hidden, target, target_mask, temperature)
    last = target.gather(1, (target_mask.sum(1) - 1)[:, None]).squeeze(1)  # each row's last token
    return CachedContext(ctx.cache, attn, last)

# -----------------------------------------------------------------------------
# 6. The training loop and the eval.

def global_means(metrics: dict) -> dict:
    """Each tensor in metrics -> the mean of its elements over all ranks (NaN if there are none),
    also when ranks hold different numbers of them; other values stay. One all_reduce (sec. 7)."""
    keys = [key for key, value in metrics.items() if isinstance(value, torch.Tensor)]
    sums = [metrics[key].cpu().double().sum().item() for key in keys]  # (MPS has no float64)
    totals = all_reduce(sums + [metrics[key].numel() for key in keys])
    means = dict(metrics)
    for i, key in enumerate(keys):
        count = totals[len(keys) + i]
        means[key] = totals[i] / count if count else math.nan
    return means

def train_step(model, tokenizer, ref_model, optimizer, cfg: Config, examples, step: int) -> dict:
    """One step: draw P prompts (afresh each step, from (seed, step): no epochs), sample and score
    this rank's share, update. Returns the metrics. step counts from 0 (logged as step + 1)."""
    t_step = time.perf_counter()
    rank, W = rank_and_world()  # (section 7: (0, 1) without torchrun)
    # data and sampling depend on (seed, step) only, so a resumed run continues the same stream
    data_rng = random.Random(cfg.seed * 1_000_003 + step)
    torch.manual_seed(cfg.seed * 1_000_003 + step * W + rank)
    # every rank takes the same number of whole groups (a data file smaller than P leaves fewer)
    P = min(cfg.prompts_per_step, len(examples) // W * W)
    batch = data_rng.sample(examples, P)[rank * P // W:(rank + 1) * P // W]
    rank_rng = random.Random(f"rephrasings {cfg.seed} {step} {rank}")  # its own stream, per rank
    rows, metrics = ROLLOUTS[cfg.variant](model, tokenizer, cfg, batch, rank_rng)
    metrics = global_means(metrics)  # means over all ranks, in one all-reduce
    if rank == 0 and cfg.log_completions and (step + 1) % cfg.log_completions == 0:  # (below)
        log_group(cfg, tokenizer, batch[0]["question"], rows, step + 1)
    metrics.update(update(model, ref_model, optimizer, rows, cfg))
    metrics["time/step"] = time.perf_counter() - t_step  # times: this rank's (rank 0 logs)
    metrics["tokens_per_s"] = metrics["tokens"] / metrics["time/sample"]
    return metrics

def train(cfg: Config) -> dict:
    """Run GRPO (or a variant) as configured; returns the summary (rank 0; None on the others).
    Each step: train_step (sample, score, update), the schedule, a metrics line, the eval when due,
    a checkpoint every --save-every steps and at the end. A resume starts at its checkpoint's step;
    SIGTERM or Ctrl-C stop the run after the step in progress and its eval (the ranks agree on the
    step, rank 0 saves it, all exit). The helpers called here are plumbing (section 7)."""
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
            log.write(json.dumps(record) + "\n")
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
                message = (f"grpo.py: {(caught or ['a signal'])[0]} after step {done}: checkpoint "
                           f"saved in {out / f'checkpoint-{done}'}; continue with --resume")
                sys.exit(message if main_rank else 1)  # rank 0 prints it; the others exit 1
    return report(cfg, time.time() - t0) if main_rank else None

@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], cfg: Config, seed: int,
             max_rows: int = 512) -> dict:
    """Greedy accuracy, pass@k (k = 1..n) from n = --eval-samples samples per question at the
    training temperature, and format: the share of samples with answer tags. Chunks of at most
    max_rows samples; chunk c is seeded with seed + c and sampled by rank c % W: what one process
    gets. GRPO-MA's eval samples one plain completion of both limits, not thoughts and answers."""
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
        prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
                   for ex in chunk]
        references = [ex["answer"] for ex in chunk]
        s = generate(model, tokenizer, prompts, 1, limit, greedy=True)
        scored = score_batch(tokenizer, s, references, 0.0, cfg.answer_from, cfg.response_prefix)
        greedy += scored[0].sum().item()
        s = generate(model, tokenizer, prompts, n, limit, cfg.temperature)
        rewards, _, tags = score_batch(tokenizer, s, [a for a in references for _ in range(n)],
                                       0.0, cfg.answer_from, cfg.response_prefix)
        tagged += tags.sum().item()
        for correct in rewards.view(len(chunk), n).sum(1).long().tolist():
            for k in range(1, n + 1):
                pass_k[k - 1] += pass_at_k(n, correct, k)
    totals = all_reduce([greedy, tagged] + pass_k)
    result = {"greedy": totals[0] / len(examples), "format": totals[1] / (len(examples) * n)}
    for k in range(1, n + 1):
        result[f"pass@{k}"] = totals[1 + k] / len(examples)
    return result

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))

# What a run shows: a group as text now and then, and the summary at the end.

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
        f.write(json.dumps(record) + "\n")
    lines = [f"step {step}: {question!r}", "  reward  advantage  completion"]
    for c in completions:
        extra = f"  1/|λ| {c['inv_lambda']:.2f}" if "inv_lambda" in c else ""
        lines.append(f"  {c['reward']:6.2f}  {c['advantage']:+9.2f}  {c['text'][:60]!r}{extra}")
        for a in c.get("answers", []):
            lines.append(f"  {a['reward']:6.2f}  {a['advantage']:+9.2f}    -> {a['text'][:56]!r}")
    tqdm.write("\n".join(lines))

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
    shown = dict.fromkeys(["greedy", "pass@1", f"pass@{cfg.eval_samples}"])  # a resume may change n
    line = [f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in shown if k in before and k in after]
    print(f"{cfg.variant}: " + " | ".join(line) + f" | {wall_s:.0f} s")
    return summary

# -----------------------------------------------------------------------------
# The number reader of section 2's score (a first read can skip it). An answer is a number only
# when one number stands alone in it once the known wrappers are gone: a false positive is worse
# than a miss, since the policy is trained toward it.

INNER = r"(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*"  # text with braces nested up to two levels
BOXED_RE = re.compile(rf"\\boxed\{{({INNER})\}}")
TEXT_RE = re.compile(r"\\text\{([^{}]*)\}")
FRAC_RE = re.compile(r"(-?)\\[dt]?frac\{([0-9.,]+)\}\{([0-9.,]+)\}")  # \frac{a}{b} of numbers
PLAIN = [("\u2212", "-"), ("\\$", ""), ("$", ""), ("\\%", "%"), ("**", " ")]  # minus, $, %, bold
ASSIGNMENT_RE = re.compile(r"^\s*[A-Za-z]\w*\s*=")  # "x = 7": the unknown's name goes
RUN_RE = re.compile(r"[-+]?\.?[0-9]+(?:[.,/][0-9]+)*")  # digits joined by . , / (no backtracking)
# a well-formed run: commas only as thousands separators, an optional decimal part, a fraction
DECIMAL = r"(?:[1-9][0-9]{0,2}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
NUMBER_RE = re.compile(rf"[-+]?(?:{DECIMAL})(?:/(?:{DECIMAL}))?")
PROSE = set(".,;:!?'\"%#")  # what may stand around a number besides words and spaces
MAX_NUMBER_CHARS = 100  # longer "numbers" are not parsed: int() refuses > 4300 digits

def parse_number(text: str):
    """The one number an answer holds -> Fraction, else None.

    - The wrappers go first (unwrap): \\boxed{}, \\text{}, $, \\$, \\frac{a}{b} of numbers, **.
    - Then the number may stand among words, spaces and prose punctuation (. , ; : ! ? ' " % #)
      only, after an optional "x =": 'The answer is 1,234.', '18 eggs', '\\$12.50', 'x = 7',
      '-\\frac{1}{2}', '.5', '-3/4', '50\\%'.
    - None for two numbers ('7 or 8', '\\boxed{3} or \\boxed{5}', '2\\frac{1}{3}'), a malformed
      one ('3,5', '1, 2', '0,005'), and an expression: an operator, bracket or LaTeX command
      beside it ('x+5', '- 5', 'y = x + 3', '\\sqrt{2}', '3 \\pi', '±5'), or a letter or ! that
      touches it ('2i', 'v2', '4!'). score then counts such an answer wrong against a numeric
      reference, and compares it as text with any other. Words are not read: '5 thousand' is 5.
    """
    text = ASSIGNMENT_RE.sub(" ", unwrap(text), count=1)
    runs = number_runs(text)
    if len(runs) != 1 or runs[0] is None or len(runs[0]) > MAX_NUMBER_CHARS:
        return None
    around = RUN_RE.sub(" ", text)
    if not NUMBER_RE.fullmatch(runs[0]) or not all(c.isalpha() or c.isspace() or c in PROSE
                                                   for c in around):
        return None
    numerator, _, denominator = runs[0].replace(",", "").partition("/")
    if denominator and Fraction(denominator) == 0:
        return None
    return Fraction(numerator) / Fraction(denominator or 1)

def boxed(text: str):
    """What the last \\boxed{...} holds (braces nested up to two levels inside it), or None."""
    found = BOXED_RE.findall(text)
    return found[-1] if found else None

def unwrap(text: str) -> str:
    """The text with the wrappers around numbers made plain, each set apart by spaces:
    \\boxed{x} and \\text{x} are x, \\frac{a}{b} of numbers is a/b, $ and \\$ go, \\% is %, the
    Unicode minus is -, markdown's ** goes."""
    for old, new in PLAIN:
        text = text.replace(old, new)
    text = TEXT_RE.sub(r" \1 ", BOXED_RE.sub(r" \1 ", text))
    return FRAC_RE.sub(r" \1\2/\3 ", text)

def number_runs(text: str) -> list:
    """The number-like runs of a text, as written; None for a run that touches a letter, a digit
    of another script, LaTeX (\\ ^ _ { }) or a ! (2i, v2, x^2, 3\\pi, \\sqrt{2}, 4!)."""
    runs = []
    for match in RUN_RE.finditer(text):
        around = text[max(match.start() - 1, 0):match.start()] + text[match.end():match.end() + 1]
        alone = not any(c.isalnum() or c in "\\^_{}!" for c in around)
        runs.append(match.group() if alone else None)
    return runs

# -----------------------------------------------------------------------------
# 7. Plumbing (a first read can stop here): flags, data, models, checkpoints, signals, ranks.

class UserError(Exception):
    """A bad flag, data line or file: main() prints it as one line, without a traceback."""

def reason(e: Exception) -> str:
    """The first line of an exception's message (its type when it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

def parse_args(argv=None) -> Config:
    """Config from the command line (argparse checks the types and choices); local paths made
    absolute, so that a requeue started from another folder finds the same files."""
    parser = HfArgumentParser(Config, description="GRPO and variants.", allow_abbrev=False)
    parser.error = lambda message: sys.exit(f"grpo.py: error: {message}")  # one line, no usage
    cfg = Config(**vars(parser.parse_args(argv)))
    for name in ("model", "data", "test_data"):
        path = Path(getattr(cfg, name)).expanduser()
        if path.exists():
            setattr(cfg, name, str(path.resolve()))
    return cfg

def check_example(example) -> dict:
    """A data line's object with "rephrasings" ([] if absent), or a ValueError saying what is wrong:
    question and answer must be non-empty strings, rephrasings a list of them."""
    if not isinstance(example, dict):
        raise ValueError("expected a JSON object with 'question' and 'answer'")
    for key in ("question", "answer"):
        if not isinstance(example.get(key), str) or not example[key].strip():
            raise ValueError(f"field '{key}' must be a non-empty string")
    rephrasings = example.setdefault("rephrasings", [])
    if not isinstance(rephrasings, list) or not all(isinstance(r, str) and r.strip()
                                                    for r in rephrasings):
        raise ValueError("field 'rephrasings' must be a list of non-empty strings")
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
                examples.append(check_example(json.loads(line)))
        except ValueError as e:  # bad UTF-8 and bad JSON are ValueErrors too
            raise UserError(f"{path}:{number}: {reason(e)}") from None
    if not examples:
        raise UserError(f"{path}: no examples")
    return examples

def load_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    """The training examples and the first --eval-limit held-out ones; TA needs rephrasings."""
    examples = load_jsonl(cfg.data)
    test_examples = load_jsonl(cfg.test_data)[:cfg.eval_limit or None]
    if cfg.variant == "ta" and not any(ex["rephrasings"] for ex in examples):
        raise UserError(f"{cfg.data}: --variant ta needs examples with 'rephrasings'; none has any")
    world = rank_and_world()[1]
    if len(examples) < world:
        raise UserError(f"{cfg.data}: {len(examples)} examples, fewer than the {world} ranks")
    return examples, test_examples

def pick_device(name: str) -> torch.device:
    """--device: auto picks the accelerator (cuda, mps) if there is one, else cpu."""
    found = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    if name not in ("auto", "cpu", found.type):
        raise UserError(f"--device {name}: {name} is not available on this machine")
    return found if name == "auto" else torch.device(name)

def load_model(path: str, device):
    """Model and tokenizer from a local folder or the hub; fp32, left padding, a pad token."""
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
    if tokenizer.pad_token is None:  # Llama: pad with eos; the completion mask never relies on pad
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer

def load_run(cfg: Config, device, checkpoint: Path | None):
    """Policy, tokenizer, reference (beta > 0), optimizer, schedule, and the checkpoint's state
    (loaded with weights_only: a run folder from elsewhere runs no code)."""
    state = None
    if checkpoint:
        try:
            state = torch.load(checkpoint / "state.pt", weights_only=True)
        except Exception as e:
            raise UserError(f"--resume: {checkpoint / 'state.pt'} is not a checkpoint this file "
                            f"wrote ({reason(e)})") from None
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

def run_files(out: Path) -> list[Path]:
    """What a run leaves in its folder: checkpoints (and a save that died), logs, summary."""
    names = [out / name for name in LOGS + ("summary.json",)]
    return list(out.glob("checkpoint-*")) + [path for path in names if path.exists()]

def prepare_out(cfg: Config) -> Path | None:
    """The checkpoint to continue from, or None to start. A folder holding a run is continued
    (--resume) or replaced (--overwrite), never reused; --resume without a checkpoint starts."""
    out = Path(cfg.out)
    saved = [path for path in out.glob("checkpoint-*") if path.suffix != ".tmp"]  # .tmp: unfinished
    if cfg.resume and saved:
        return max(saved, key=lambda path: int(path.name.split("-")[1]))
    names = sorted(path.name for path in run_files(out))
    if names and not (cfg.overwrite or cfg.resume):
        raise UserError(f"--out {out} already holds a run ({', '.join(names)}); continue it with "
                        f"--resume or replace it with --overwrite")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return None

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

def sum_gradients(model):
    """Sum the gradients over the ranks: the loss weights are shares of the global batch."""
    if not torch.distributed.is_initialized():
        return
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)

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
