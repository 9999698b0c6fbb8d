"""grpo.py: GRPO and three recent variants of it, in one file to read top to bottom.

    python grpo.py                  # GRPO on the tiny model in data/: CPU, offline, ~40 s
    python grpo.py --variant ma     # or lambda, ta; README.md: real models, torchrun

One GRPO step, as train_step and update run it:

    questions = P questions drawn from the data
    for each question q: o_1..o_G = G samples from π(· | q)          generate
    r_i = score(o_i, q's reference answer)                            score_batch
    A_i = (r_i - mean(r)) / (std(r) + eps) over q's G samples         group_advantages
    w_it = 1 / (all completion tokens of the batch)                   aggregation_weights
    repeat μ times:
        logp_it = log π(o_it | q, o_i<t)                              plain_logps
        ρ_it = exp(logp_it - logp_old_it)                             policy_loss
        loss = -Σ_it w_it min(ρ_it A_i, clip(ρ_it, 1-ε, 1+ε) A_i) + β Σ_it w_it KL_it
        loss.backward(); clip the gradient norm; optimizer.step()     update

    KL_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1      Schulman's k3, to a frozen copy

The default takes one update per batch: μ = 1. Then π_old is π itself, so ρ = 1 and nothing is
clipped. The gradient is the policy gradient -Σ w A ∇ log π. Defaults: P = 16, G = 8, 32 new
tokens, dapo's w, β = 0; K = M = 4 for ma; N = 3 for ta. A batch is (B, C): B rows by C tokens.

One step in numbers: G = 4 completions of 4, 4, 2 and 4 tokens score r = 1, 0, 0, 1. Their mean
is 0.5 and their unbiased std 0.577, so A = +0.87, -0.87, -0.87, +0.87. Under dapo each of the
14 tokens weighs w = 1/14. At μ = 1 the loss is -Σ w A = -0.124, and ∂loss/∂logp_it = -w A_i,
±0.062. test_update_works_one_grpo_step_by_hand checks these numbers against update's gradient.

The variants change the advantages A, the weights w and the contexts:

    grpo    A_i normalised within the G samples of a question     DeepSeekMath, arXiv 2402.03300
    lambda  w_it divided by |λ(i,t)|, the number of samples of    λ-GRPO, arXiv 2509.21154
            the group that share o_i's tokens 0..t
    ma      K thoughts per question, M answers per thought;       GRPO-MA, arXiv 2509.24494
            a thought's A from the mean reward V of its answers;
            thoughts and answers are two parts of the loss
    ta      q0 and N rephrasings of it, G samples each; A over    TA-GRPO, arXiv 2601.22478
            all (N+1)·G; every log-prob is taken given q0

What the file simplifies: the sampler is a short KV-cache loop, not vLLM, and one process samples
and trains. π_old is the trainer's own forward pass, never the sampler's, so a mismatch between
the two (bf16 sampling, say) goes uncorrected. The reward reads one number or compares text;
--answer-from math-verify grades LaTeX. There is no LoRA: the reference is a full copy. GRPO-MA's
unclosed thoughts get no answers and value 0; its two loss parts are our reading, since the paper
publishes no weighting. TA-GRPO's rephrasings come from the data file. The learning rate warms
up, then stays constant.

Part I is the algorithm, complete for every variant: 1 the schemes and the loss, 2 the reward,
3 the sampler, 4 the rows and the rollouts, 5 the log-probs and the update, 6 the loop and the
eval. Part II makes them fast, scalable and safe; a comment says what each call into it does.
"""

from __future__ import annotations

import contextlib, datetime, importlib.util, json, math, os, random, re, shutil, signal, sys
import threading, time
from dataclasses import asdict, dataclass, field, fields, replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import transformers
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm
from transformers import DynamicCache, HfArgumentParser

# Part I: the algorithm =======================================================================
# 1. The schemes and the loss, on plain tensors. This section needs only math and torch: paste it
# alone into a file and its examples run. In your own trainer, with log-probs (B, C) of the
# sampled tokens under π, π_old and the reference:
#     A = group_advantages(rewards, group_ids)          # ma_advantages, ta_advantages likewise
#     w = aggregation_weights(completion_mask, "dapo")  # λ-GRPO: w * lambda_weights(ids, mask, G)
#     loss, metrics = policy_loss(logps, old_logps, A, completion_mask, w, ref_logps, beta=0.04)

def group_advantages(rewards, groups, scale: str = "group", eps: float = 1e-4):
    """GRPO's advantage: each reward normalised within its group.

        A_i = (r_i - mean(r_g)) / (std(r_g) + eps)      g: the rows with i's group id
        A_i = r_i - mean(r_g)                           scale="none", as Dr. GRPO

    rewards (B,) are floats; groups (B,) are ids from 0 to n-1. The std is unbiased, as TRL's.

    >>> group_advantages(torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.]), torch.arange(8) // 4)
    tensor([ 1.4997, -0.4999, -0.4999, -0.4999,  0.0000,  0.0000,  0.0000,  0.0000])

    eps makes the 0.5 and 1.5 here read 0.4999 and 1.4997. A group whose rewards are all equal
    gets exactly 0, as the second one: a float mean can miss equal rewards by ~1e-8, and
    std + eps would scale that up.
    """
    n = torch.bincount(groups).to(rewards.dtype)  # rows per group
    mean = torch.zeros_like(n).index_add(0, groups, rewards) / n
    adv = rewards - mean[groups]
    if scale == "group":
        var = torch.zeros_like(n).index_add(0, groups, adv ** 2) / (n - 1)
        adv = adv / (var.sqrt()[groups] + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group or none, got {scale!r}")
    high = torch.full_like(n, -math.inf).scatter_reduce(0, groups, rewards, "amax")
    low = torch.full_like(n, math.inf).scatter_reduce(0, groups, rewards, "amin")
    return torch.where(high[groups] == low[groups], 0.0, adv)

def ma_advantages(rewards, answer_thought, thought_prompt, scale: str = "group", eps: float = 1e-4):
    """GRPO-MA's advantages of the thoughts and of their answers.

        V(th)   = the mean reward of th's answers; 0 for a thought without answers
        A(th)   = V(th) normalised over the K thoughts of its prompt
        A(ans)  = r(ans) normalised over all answers of its prompt, not per thought

    The inputs are the answers' rewards, each answer's thought and each thought's prompt. It
    returns the thoughts' A, the answers' A and V. A prompt has K·M answers when all its thoughts
    closed. An open thought has none, so its V is 0: it is pushed down like a wrong one.

        prompt -+- thought 0 -+- answer 0  r = 1     V = 1      A(th) =  0.7069
                |             +- answer 1  r = 1
                +- thought 1 -+- answer 2  r = 1     V = 0.5    A(th) = -0.7069
                              +- answer 3  r = 0

    >>> th, ans, V = ma_advantages(torch.tensor([1., 1., 1., 0.]), torch.tensor([0, 0, 1, 1]),
    ...                            torch.tensor([0, 0]))
    >>> th, ans
    (tensor([ 0.7069, -0.7069]), tensor([ 0.4999,  0.4999,  0.4999, -1.4997]))

    To copy GRPO-MA, take two more pieces. In rollout_ma, an answer's context is its prompt, then
    its thought. In global_loss_weights, thoughts and answers are two loss parts, each aggregated
    alone, so that M answers per thought do not outweigh the thought.
    """
    answers = torch.bincount(answer_thought, minlength=len(thought_prompt)).to(rewards.dtype)
    values = torch.zeros_like(answers).index_add(0, answer_thought, rewards) / answers.clamp(min=1)
    thought_adv = group_advantages(values, thought_prompt, scale, eps)
    answer_adv = group_advantages(rewards, thought_prompt[answer_thought], scale, eps)
    return thought_adv, answer_adv, values

def ta_advantages(rewards, question, scale: str = "group", eps: float = 1e-4):
    """TA-GRPO's advantages: GRPO's, with the group id of each response's original question q0.
    So q0's G responses and those to its N rephrasings form one group of (N+1)·G.

        q0  "What is 3 + 5?"   r = 1 1      alone: all equal, no signal
        q1  "Add 3 and 5."     r = 0 1      pooled: mean 0.75, std 0.5

    >>> ta_advantages(torch.tensor([1., 1., 0., 1.]), torch.tensor([0, 0, 0, 0]))
    tensor([ 0.4999,  0.4999, -1.4997,  0.4999])

    The objective, for responses o_jg sampled from π_old(· | q_j), the rephrasing q_j:

        J = Σ_jgt w min(ρ_jgt A_jg, clip(ρ_jgt, 1-ε, 1+ε) A_jg),
        ρ_jgt = π(o_jgt | q0, o_jg<t) / π_old(o_jgt | q0, o_jg<t)

    To copy TA-GRPO, also take every log-prob given q0, for the responses to rephrasings too:
    rollout_ta's prompt_index points at q0. At μ = 1 this is a policy gradient for π(· | q0) on
    samples drawn from π(· | q_j), with no importance weight. So it is biased on purpose: it is
    not the gradient of q0's expected reward. Why: the rephrasings explore. They make the model
    write solutions it rarely writes for q0, and training π(· | q0) on them moves q0's answers
    toward those. An importance weight π(o | q0) / π(o | q_j) would be far from 1, mostly clipped.
    The paper's v5 takes this anchored ratio (arxiv.org/abs/2601.22478v5). --ta-anchor
    rephrased keeps each response's own prompt, as its code does (github.com/lhkhiem28/TA-GRPO).
    """
    return group_advantages(rewards, question, scale, eps)

def lambda_weights(completion_ids, completion_mask, group_size: int):
    """λ-GRPO's token weights 1/|λ(i,t)|, (B, C), 0 off the mask.

    |λ(i,t)| counts the completions of i's group that agree with i on tokens 0..t. It counts
    i itself and exact duplicates. So a prefix shared by k completions is trained once, not k
    times. A group is group_size consecutive rows, each right-padded. A group of 6:

        A B C D           1/2 1/2  1   1
        A B E F H I       1/2 1/2  1   1   1   1
        J K L M           1/3 1/3 1/3  1
        J K L N Q S T     1/3 1/3 1/3 1/2 1/2  1   1
        J K L N Q U       1/3 1/3 1/3 1/2 1/2  1
        V W Y Z            1   1   1   1

    >>> ids = torch.tensor([[1, 2, 3], [1, 2, 4], [5, 6, 0]])
    >>> lambda_weights(ids, torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]]), 3)
    tensor([[0.5000, 0.5000, 1.0000],
            [0.5000, 0.5000, 1.0000],
            [1.0000, 1.0000, 0.0000]])

    To copy λ-GRPO, multiply the aggregation weights by these, for the policy and the KL terms.
    The normaliser stays the raw token count, as in the paper. Adam's step ignores a uniform
    gradient scale, up to its eps. Every pair of a group's rows is compared: ~4·B·G·T bytes.
    """
    B, C = completion_ids.shape
    ids = completion_ids.reshape(-1, group_size, C)  # (groups, G, C)
    mask = completion_mask.reshape(-1, group_size, C).bool()
    same = (ids[:, :, None] == ids[:, None]) & mask[:, :, None] & mask[:, None]  # (groups, G, G, C)
    # a running product turns "equal at t" into "equal up to t"
    counts = same.cumprod(-1, dtype=torch.uint8).sum(2, dtype=torch.int32)  # |λ|, (groups, G, C)
    return torch.where(mask, 1.0 / counts.clamp(min=1), 0.0).reshape(B, C)

def aggregation_weights(completion_mask, loss_type="dapo", num_rows=None, num_tokens=None,
                        max_completion_length=None):
    """(B, C) weight w of each token in the loss, as TRL aggregates. |o_i| is row i's length.

        dapo     1 / (all tokens)                     one token mean over the batch
        grpo     1 / (rows · |o_i|)                   the mean over rows of each row's token mean
        dr_grpo  1 / (rows · max_completion_length)   a constant, as Dr. GRPO (arXiv 2503.20783)

    >>> aggregation_weights(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), "grpo")
    tensor([[0.2500, 0.2500, 0.0000, 0.0000],
            [0.1250, 0.1250, 0.1250, 0.1250]])

    Under dapo each of these six tokens weighs 1/6. A piece of a batch, such as a micro-batch,
    takes the whole batch's num_rows and num_tokens. Then the pieces' losses add up to the batch's.
    TRL's bnpo is dapo with a micro-batch's own count; here the count is always the batch's.
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
    """The loss -J to minimise, and its metrics. Tensors are (B, C); advantages (B,) or (B, C).

        ρ  = exp(logp - old)
        KL = exp(ref - logp) - (ref - logp) - 1           k3
        loss = Σ w · (-min(ρ A, clip(ρ, 1-ε, 1+ε_high) A) + β KL)      w: loss_weights

    >>> logp = torch.zeros(1, 2, requires_grad=True)  # two tokens, A = 2, w = 0.5 each
    >>> loss, _ = policy_loss(logp, logp.detach(), torch.tensor([2.]), torch.ones(1, 2),
    ...                       torch.full((1, 2), 0.5))
    >>> loss.backward(); loss.item(), logp.grad
    (-2.0, tensor([[-1., -1.]]))

    At μ = 1 the old log-probs are logp.detach(). So ρ is 1 in value, and ∂ρ/∂logp = ρ = 1.
    Both terms of the min are then ρA, since 1 is inside the clip range. Either term gives
    ∂loss/∂logp = -w A, so it does not matter how torch splits the tie. This is the policy
    gradient. As in TRL, ε_high is ε when None. The metrics are token means.
    """
    mask = completion_mask.float()
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    adv = torch.where(mask.bool(), adv, 0.0)  # (B, C), 0 off the mask
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(per_token_logps - old_per_token_logps)  # ρ
    surrogate = ratio * adv
    clipped_surrogate = ratio.clamp(1 - epsilon, 1 + epsilon_high) * adv
    loss = -torch.min(surrogate, clipped_surrogate)  # (B, C)
    metrics, n = {}, mask.sum().clamp(min=1)
    if beta:
        assert ref_per_token_logps is not None, "beta > 0 needs ref_per_token_logps"
        delta = ref_per_token_logps - per_token_logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
        metrics["kl"] = (kl * mask).sum().detach() / n
    with torch.no_grad():  # where the clip binds: ρ left the range in A's direction
        metrics["clip_low"] = (((ratio < 1 - epsilon) & (adv < 0)) * mask).sum() / n
        metrics["clip_high"] = (((ratio > 1 + epsilon_high) & (adv > 0)) * mask).sum() / n
    return torch.where(mask.bool(), loss * loss_weights, 0.0).sum(), metrics

# -----------------------------------------------------------------------------
# 2. The reward: 1 for a finished completion whose answer is the reference. Model output is text:
# it is read, never run.

def score(text: str, reference: str, finished: bool, format_reward: float = 0.0,
          answer_from: str = "tags"):
    """(reward, parsed) of one completion. The reward is 1 if the completion finished with EOS
    and its answer is the reference. It adds format_reward for exactly one <think>...</think>,
    then one <answer>...</answer>. parsed says that an answer was read. For a numeric
    reference, the answer must be a number.
    - The answer comes after the first </think>: the last <answer>...</answer>, else the last
      \\boxed{}; with --answer-from last-number, the last number. A thought never closed has none.
    - A numeric reference wants the number itself: '1/2' equals '0.5'.
    - Any other reference is compared as text by as_text, which drops whitespace and \\boxed{}.
    - With math-verify, Hugging Face's math_verify compares the two as LaTeX.
    """
    answer = extract_answer(text, answer_from)  # Part II: the answer as the first rule says
    ref_num = parse_number(reference)  # Part II: the one number a text holds, or None
    answer_num = parse_number(answer) if answer is not None else None
    if answer_from == "math-verify":
        parsed = answer is not None
        correct = parsed and finished and math_verify_equal(answer, reference)  # Part II
    else:
        parsed = answer is not None and (ref_num is None or answer_num is not None)
        correct = parsed and finished and (answer_num == ref_num if ref_num is not None
                                           else as_text(answer) == as_text(reference))
    shaped = finished and FORMAT_RE.fullmatch(text) is not None  # Part II: <think>, then <answer>
    return float(correct) + format_reward * shaped, parsed

def score_batch(tokenizer, samples, references, format_reward=0.0, answer_from="tags", before=""):
    """(rewards, parsed, tagged), each (B,), of generate's Samples. Each text is read after
    `before`: the response prefix, and for a GRPO-MA answer its thought. tagged says that
    <answer> tags follow the thought."""
    texts = decode(tokenizer, samples.completion_ids, samples.completion_mask)
    before = [before] * len(texts) if isinstance(before, str) else before
    texts = [b + text for b, text in zip(before, texts)]
    scored = [score(text, reference, done, format_reward, answer_from)
              for text, reference, done in zip(texts, references, samples.finished.tolist())]
    tagged = [tagged_answer(after_thought(t) or "") is not None for t in texts]  # Part II
    rewards = torch.tensor([r for r, _ in scored], dtype=torch.float32)
    parsed = torch.tensor([p for _, p in scored], dtype=torch.bool)
    return rewards, parsed, torch.tensor(tagged, dtype=torch.bool)

# -----------------------------------------------------------------------------
# 3. The sampler: each prompt is encoded once and its KV cache copied to its rows. It assumes HF's
# decoder layout, model.model then model.lm_head (Qwen2/3, Llama), and transformers >= 5.24.

def prompt_ids(tokenizer, question: str, system_prompt: str, response_prefix: str = ""):
    """The token ids of a question in the chat template, then the response prefix. The prefix is
    the reply's first words, as DeepSeek-R1's template ends with <think>. It is plain text,
    tokenized alone. It belongs to the prompt, so it is never sampled or trained."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    prefix = tokenizer(response_prefix, add_special_tokens=False, split_special_tokens=True)
    return ids + prefix.input_ids

def left_pad(seqs: list[list[int]], pad_id: int):
    """Lists of ids -> (B, L) ids and attention mask, padded on the left."""
    L = max((len(s) for s in seqs), default=1)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, L - len(s):] = 1
    return ids, mask

def run_decoder(model, input_ids, attention_mask, cache=None):
    """The decoder's last hidden states (B, T, H) for input_ids (B, T), before the lm_head. The
    input follows the L tokens in `cache`, a DynamicCache that grows in place. The attention mask
    covers both, (B, L + T), with 0 for padding anywhere."""
    # a token's position is the number of real tokens before it: padding takes no place
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
    out = model.model(input_ids=input_ids, attention_mask=attention_mask,  # < 5.24: past_key_values
                      position_ids=position_ids, use_cache=cache is not None, cache=cache)
    return out.last_hidden_state

def prefill(model, prompts: list[list[int]], pad_id: int):
    """(cache, mask, last): the KV cache of each prompt but its last token, its mask, and that
    last token. The next pass feeds that token first: its output predicts the first new token.
    So a context's cache ends one token short of it. For a prompt p1 p2 p3, generate feeds p3,
    then one sampled token at a time. In the update, rows_logps feeds a whole completion t1 t2,
    then a GRPO-MA answer a1 a2 after it:

        pass        input     cache before     predicts   cache after
        prefill     p1 p2     -                -          p1 p2
        completion  p3 t1     p1 p2            t1 t2      p1 p2 p3 t1
        answer      t2 a1     p1 p2 p3 t1      a1 a2      -

    Left padding stays inside the cache. The mask hides it, and run_decoder's positions skip it."""
    ids, mask = (x.to(next(model.parameters()).device) for x in left_pad(prompts, pad_id))
    cache = DynamicCache()
    if ids.shape[1] > 1:
        run_decoder(model, ids[:, :-1], mask[:, :-1], cache)
    return cache, mask[:, :-1], ids[:, -1]

def reorder(context, index):
    """A prefill's (cache, mask, last) with rows `index`, the cache reordered in place: a repeated
    index copies a context to several rows. Its CPU backward is deterministic, unlike x[index]'s."""
    cache, mask, last = context
    cache.reorder_cache(index)
    return cache, mask.index_select(0, index), last.index_select(0, index)

def decode(tokenizer, completion_ids, completion_mask) -> list[str]:
    """The text of each completion's masked tokens, special tokens dropped."""
    return [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(completion_ids, completion_mask)]

@dataclass
class Samples:
    completion_ids: torch.Tensor   # (B, C) right-padded with pad
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the token that ended the row
    finished: torch.Tensor         # (B,) ended with EOS; a stop string does not count

@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], n: int, max_new_tokens: int,
             temperature=1.0, greedy=False, stop_strings=()) -> Samples:
    """n samples of each prompt, rows prompt-major. Each step draws one token per row from
    softmax(logits / T), with no top-k or top-p. The loss's log-probs are of this distribution.
    A row ends at an EOS, at the token that completes a stop string, or at max_new_tokens."""
    was_training = model.training
    model.eval()  # no dropout; in train mode HF's gradient checkpointing would drop the cache
    device = next(model.parameters()).device
    index = torch.arange(len(prompts), device=device).repeat_interleave(n)
    cache, mask, token = reorder(prefill(model, prompts, tokenizer.pad_token_id), index)  # n each
    eos, B = torch.tensor(eos_ids(model, tokenizer), device=device), len(index)  # Part II: EOSs
    ids = torch.full((B, max_new_tokens), tokenizer.pad_token_id, device=device)
    lengths, finished = torch.zeros_like(index), torch.zeros_like(index, dtype=torch.bool)
    texts, active = [""] * B, torch.arange(B, device=device)  # the rows still being decoded
    for t in range(max_new_tokens):
        if not len(active):
            break
        mask = torch.cat([mask, mask.new_ones(len(token), 1)], 1)
        logits = model.lm_head(run_decoder(model, token[:, None], mask, cache)[:, -1]).float()
        if t == 0:
            check_finite(logits)  # Part II: a diverged policy stops the run with one line
        if greedy:
            token = logits.argmax(-1)
        else:
            token = torch.multinomial((logits / temperature).softmax(-1), 1).squeeze(-1)
        ids[active, t] = token  # token, ended: (len(active),), one per row still decoded
        lengths[active] += 1
        ended = torch.isin(token, eos)
        finished[active[ended]] = True
        if stop_strings:  # Part II: the rows whose text now holds a stop string
            ended = ended | stop_string_hits(tokenizer, token, active, texts, stop_strings)
        if ended.any():  # ended rows leave the batch; that copies the cache, so only then
            active, mask, token = active[~ended], mask[~ended], token[~ended]
            cache.batch_select_indices((~ended).nonzero().squeeze(1))
    model.train(was_training)
    C = max(lengths.tolist(), default=0)
    completion_mask = (torch.arange(C, device=device)[None] < lengths[:, None]).long()
    return Samples(ids[:, :C], completion_mask, finished)

# -----------------------------------------------------------------------------
# 4. The rows every variant produces, and one rollout per variant. A rollout samples and scores
# this rank's share of a batch and returns (Rows, metrics). To add one, copy rollout_grpo and add
# it to ROLLOUTS and to --variant's choices; any callable will do, one that closes over a reward
# model too. cfg is Part II's Config: cfg.num_generations is the flag --num-generations. A metric
# is a tensor; the log shows its mean over all ranks.

@dataclass
class Rows:
    """What a rollout hands to update(), whichever the variant: completions and their advantages.
    A rollout sets every field without a default. part is GRPO-MA's; inv_lambda is λ-GRPO's.

    Row i continues prompts[prompt_index[i]]. A GRPO-MA answer then continues its thought, the
    completion of row parent[i]. A context is named, not copied, so the update can encode it once.
    Completions are right-padded: a mask is a run of 1s from column 0.

    GRPO, one prompt, G = 2: prompts [ids], prompt_index [0, 0], parent [-1, -1], advantages
    [+0.7, -0.7], rewards [1, 0], part_limits [32]. The loss has one part here. GRPO-MA's
    thoughts and answers can be two, part 0 and part 1, each aggregated alone.
    """
    prompts: list[list[int]]       # the distinct prompts, as token ids
    prompt_index: torch.Tensor     # (B,) the prompt each row continues
    parent: torch.Tensor           # (B,) -1, or the row between prompt and this one: MA's thought
    completion_ids: torch.Tensor   # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) 1 up to and including EOS or the stop string
    advantages: torch.Tensor       # (B,), or (B, C) per token; finite
    rewards: torch.Tensor          # (B,) shown by log_group; an MA thought's is its V
    part_limits: list              # each loss part's length limit, which dr_grpo divides by
    part: torch.Tensor | None = None  # (B,) each row's loss part; None: all in part 0
    inv_lambda: torch.Tensor | None = None  # (B, C) λ-GRPO's 1/|λ|
    loss_weights: torch.Tensor | None = None  # (B, C) each token's w in J; update() sets it

    def __len__(self):
        return len(self.completion_ids)

    def context(self, i: int) -> list[int]:
        """Row i's context as token ids: its prompt, then its parent's completion."""
        ids = list(self.prompts[self.prompt_index[i]])
        if self.parent[i] >= 0:
            p = int(self.parent[i])
            ids += self.completion_ids[p][self.completion_mask[p].bool()].tolist()
        return ids

def rollout_grpo(model, tokenizer, cfg, batch: list[dict], rng):
    """GRPO and λ-GRPO: G completions per prompt, advantages normalised within each group. Under
    lambda the rows also carry 1/|λ|. Both log how much a group's completions share."""
    G, metrics = cfg.num_generations, {}
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
               for ex in batch]
    with timed(metrics, "time/sample"):  # Part II: adds the block's seconds to metrics
        s = generate(model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature)
    ids, mask = s.completion_ids.cpu(), s.completion_mask.cpu()
    references = [ex["answer"] for ex in batch for _ in range(G)]
    rewards, parsed, tagged = score_batch(tokenizer, s, references, cfg.format_reward,
                                          cfg.answer_from, cfg.response_prefix)
    prompt_index = torch.arange(len(batch)).repeat_interleave(G)  # also each row's group
    advantages = group_advantages(rewards, prompt_index, cfg.scale_rewards)
    inv_lambda, on = lambda_weights(ids, mask, G), mask.bool()  # under grpo, a metric only
    # sample_metrics (Part II): reward, length and the like, which every rollout logs
    metrics |= sample_metrics(rewards, advantages, prompt_index, len(batch), parsed, tagged, s)
    metrics |= dict(lambda_mean=1 / inv_lambda[on],    # mean |λ| over tokens
                    lambda_shared=inv_lambda[on] < 1)  # share of tokens with |λ| > 1
    rows = Rows(prompts=prompts, prompt_index=prompt_index, parent=torch.full((len(ids),), -1),
                completion_ids=ids, completion_mask=mask, advantages=advantages,
                part_limits=[cfg.max_new_tokens], rewards=rewards,
                inv_lambda=inv_lambda if cfg.variant == "lambda" else None)
    return rows, metrics

# rollout_ma's rows for P = 1, K = 2, M = 2, with thought 1 left open:
#     row  completion        parent  advantage  part (--ma-weighting parts)
#     0    thought 0         -1      A(th_0)    0: thoughts, limit --max-new-tokens
#     1    thought 1 (open)  -1      A(th_1)    0
#     2    answer 0,0         0      A(a_0,0)   1: answers, limit --max-answer-tokens
#     3    answer 0,1         0      A(a_0,1)   1

def rollout_ma(model, tokenizer, cfg, batch: list[dict], rng):
    """GRPO-MA: K thoughts per prompt, each ending at the token that completes </think>, then M
    answers per closed thought; ma_advantages scores them. An answer is sampled after prompt +
    thought and scored on prefix + thought + answer. An open thought gets no answers, so V = 0."""
    K, M, metrics = cfg.num_thoughts, cfg.num_answers, {}
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
               for ex in batch]
    thought_prompt = torch.arange(len(batch)).repeat_interleave(K)  # (P·K,) generate's order
    with timed(metrics, "time/sample"):
        th = generate(model, tokenizer, prompts, K, cfg.max_new_tokens, cfg.temperature,
                      stop_strings=["</think>"])
        th_ids, th_mask = th.completion_ids.cpu(), th.completion_mask.cpu()  # (P·K, C)
        thought_texts = decode(tokenizer, th_ids, th_mask)
        closed = torch.tensor(["</think>" in text for text in thought_texts])  # (P·K,)
        closed_rows = closed.nonzero().squeeze(1)  # the thoughts that get answers
        contexts = [prompts[thought_prompt[r]] + th_ids[r][th_mask[r].bool()].tolist()
                    for r in closed_rows.tolist()]  # prompt + thought, encoded anew
        ans = generate(model, tokenizer, contexts, M, cfg.max_answer_tokens, cfg.temperature)
    answer_thought = closed_rows.repeat_interleave(M)  # (A,) each answer's thought, also its row
    answer_prompt = thought_prompt[answer_thought]  # (A,)
    references = [batch[p]["answer"] for p in answer_prompt.tolist()]
    before = [cfg.response_prefix + thought_texts[r] for r in answer_thought.tolist()]
    rewards, parsed, tagged = score_batch(tokenizer, ans, references, cfg.format_reward,
                                          cfg.answer_from, before)
    thought_adv, answer_adv, values = ma_advantages(rewards, answer_thought, thought_prompt,
                                                    cfg.scale_rewards)
    metrics |= sample_metrics(rewards, answer_adv, answer_prompt, len(batch), parsed, tagged, ans)
    metrics |= dict(thought_value=values, unclosed_thoughts=~closed,  # (P·K,) each
                    frac_value_zero_std=(thought_adv.view(-1, K) == 0).all(1),
                    thought_length=th_mask.sum(1).float())
    parent = torch.cat([torch.full((len(closed),), -1), answer_thought])  # thoughts, then answers
    ids, masks = [*th_ids, *ans.completion_ids.cpu()], [*th_mask, *ans.completion_mask.cpu()]
    part, part_limits = None, [max(cfg.max_new_tokens, cfg.max_answer_tokens)]  # one, pooled
    if cfg.ma_weighting == "parts":  # part 0: the thoughts, part 1: the answers
        part, part_limits = (parent >= 0).long(), [cfg.max_new_tokens, cfg.max_answer_tokens]
    return Rows(prompts=prompts, prompt_index=torch.cat([thought_prompt, answer_prompt]),
                parent=parent, advantages=torch.cat([thought_adv, answer_adv]),
                completion_ids=pad_sequence(ids, True, tokenizer.pad_token_id),
                completion_mask=pad_sequence(masks, True), rewards=torch.cat([values, rewards]),
                part=part, part_limits=part_limits), metrics

# rollout_ta's rows for P = 1, N = 2, G = 2, one rephrasing drawn; all four form one group:
#     row  phrasing  prompt_index: original / rephrased  question (the group id)
#     0    q0        0 / 0                                0
#     1    q0        0 / 0                                0
#     2    q1        0 / 1                                0
#     3    q1        0 / 1                                0

def rollout_ta(model, tokenizer, cfg, batch: list[dict], rng):
    """TA-GRPO: each question q0 with n <= N of its rephrasings, drawn afresh each step, and G
    responses to each phrasing. Advantages are normalised over the question's (n+1)·G
    responses. --ta-anchor original takes every log-prob given q0: ta_advantages says why."""
    G, N, metrics = cfg.num_generations, cfg.num_rephrasings, {}
    phrasings, phrasing_question, is_q0 = [], [], []  # per phrasing: ids, its question, is it q0
    for p, ex in enumerate(batch):
        drawn = rng.sample(ex["rephrasings"], min(N, len(ex["rephrasings"])))
        for k, text in enumerate([ex["question"]] + drawn):
            phrasings.append(prompt_ids(tokenizer, text, cfg.system_prompt, cfg.response_prefix))
            phrasing_question.append(p)
            is_q0.append(k == 0)
    with timed(metrics, "time/sample"):
        s = generate(model, tokenizer, phrasings, G, cfg.max_new_tokens, cfg.temperature)
    question = torch.tensor(phrasing_question).repeat_interleave(G)  # (B,) each row's group
    from_q0 = torch.tensor(is_q0).repeat_interleave(G)  # (B,) the rows sampled after q0
    references = [batch[p]["answer"] for p in question.tolist()]
    r, parsed, tagged = score_batch(tokenizer, s, references, cfg.format_reward, cfg.answer_from,
                                    cfg.response_prefix)
    advantages = ta_advantages(r, question, cfg.scale_rewards)
    if cfg.ta_anchor == "rephrased":
        prompts, prompt_index = phrasings, torch.arange(len(phrasings)).repeat_interleave(G)
    else:  # the paper: every response's context is its question's q0
        q0_prompts = [ids for ids, first in zip(phrasings, is_q0) if first]  # in question order
        prompts, prompt_index = q0_prompts, question
    q0 = r[from_q0].view(-1, G)  # q0's own G rewards: what plain GRPO would have had
    metrics |= sample_metrics(r, advantages, question, len(batch), parsed, tagged, s)
    metrics |= dict(frac_reward_zero_std_q0=q0.amax(1) == q0.amin(1), reward_q0=q0,
                    reward_rephrased=r[~from_q0])
    rows = Rows(prompts=prompts, prompt_index=prompt_index, parent=torch.full((len(r),), -1),
                completion_ids=s.completion_ids.cpu(), completion_mask=s.completion_mask.cpu(),
                advantages=advantages, part_limits=[cfg.max_new_tokens], rewards=r)
    return rows, metrics

ROLLOUTS = {"grpo": rollout_grpo, "lambda": rollout_grpo, "ma": rollout_ma, "ta": rollout_ta}

# -----------------------------------------------------------------------------
# 5. The log-probs and the update. update() takes a rollout's Rows, whichever variant made them:
#   Rows: B rows, completion_ids (B, C), advantages (B,) -> global_loss_weights: w (B, C)
#   -> per micro-batch of b rows: log-probs (b, C) -> policy_loss -> backward
#   -> the gradients summed over the ranks, the norm clipped, optimizer.step; μ times

def plain_logps(model, rows: Rows, temperature: float):
    """(B, C) log softmax(logits / T) of each completion token given its context and the tokens
    before it. One forward pass per row over context + completion. This defines the log-probs."""
    context_ids, context_mask = left_pad([rows.context(i) for i in range(len(rows))], 0)
    device = rows.completion_ids.device
    input_ids = torch.cat([context_ids.to(device), rows.completion_ids], 1)
    attention_mask = torch.cat([context_mask.to(device), rows.completion_mask], 1)
    hidden = run_decoder(model, input_ids, attention_mask)  # (B, L + C, H), no KV cache
    # the one-token shift: position L-1, the context's last token, predicts completion token 0
    L = context_ids.shape[1]
    # token_logps (Part II): log softmax(lm_head(hidden) / T) at each target, in chunks
    return token_logps(model.lm_head, hidden[:, L - 1:-1], rows.completion_ids,
                       rows.completion_mask, temperature)

def global_loss_weights(rows: Rows, loss_type: str):
    """(w, tokens): each token's weight w in J over the whole batch, (B, C), and its token count.

    Each loss part is aggregated alone, with its counts over all ranks and its length limit.
    There is one part, or GRPO-MA's thoughts and answers. Under dapo and grpo each part's w
    sum to 1, so J is one mean per part: GRPO-MA's thoughts weigh as much as its answers.
    λ-GRPO's 1/|λ| then multiplies w, not the normaliser.

    GRPO-MA, parts, dapo, 2 thoughts of 3 tokens and 4 answers of 2: a thought token weighs 1/6,
    an answer token 1/8. Pooled by --ma-weighting tokens, every token would weigh 1/14.
    """
    check_rows(rows)  # Part II: asserts the parts, finite advantages, parents one level deep
    part = torch.zeros(len(rows), dtype=torch.long) if rows.part is None else rows.part
    weights, tokens = torch.zeros(rows.completion_mask.shape), 0
    for k, max_len in enumerate(rows.part_limits):
        in_part = part == k
        mask = rows.completion_mask[in_part]
        # all_reduce (Part II): sums over the ranks; without torchrun it returns its input
        n_rows, n_tokens = all_reduce([len(mask), mask.sum().item()])
        weights[in_part] = aggregation_weights(mask, loss_type, n_rows, n_tokens, max_len)
        tokens += n_tokens
    if rows.inv_lambda is not None:
        weights = weights * rows.inv_lambda
    return weights, tokens

def update(model, ref_model, optimizer, rows: Rows, cfg) -> dict:
    """μ = --num-iterations optimizer steps on one batch of rows, whichever variant made them.
    The weights w count the whole batch, so a micro-batch's loss is its piece of -J. backward()
    adds up the pieces' gradients. The old log-probs at μ > 1, and the reference's at β > 0,
    come first. At μ = 1 the logged loss is -Σ w A, which says little about progress: watch the
    reward. test_update_works_one_grpo_step_by_hand checks one step's gradient by hand.
    """
    metrics, device = {}, next(model.parameters()).device
    weights, tokens = global_loss_weights(rows, cfg.loss_type)  # w (B, C), and all tokens
    rows = replace(rows, loss_weights=weights)  # a copy; each micro-batch then carries its w
    # Part II: pieces of about --micro-batch-size rows, on the device; MA's thought with its answers
    micro = micro_batches(rows, cfg.micro_batch_size, device)
    # rows_logps (Part II): plain_logps' numbers, only faster: it encodes each shared context once.
    # --plain-logps runs plain_logps; so does --gradient-checkpointing, which drops the KV cache.
    logps_of = plain_logps if cfg.plain_logps or cfg.gradient_checkpointing else rows_logps
    log = UpdateLog(micro, tokens, cfg)  # Part II: the loss and metrics, summed over the pieces
    with timed(metrics, "time/update"):
        with torch.no_grad():
            mu_1 = cfg.num_iterations == 1  # then π_old is π itself
            old = None if mu_1 else [logps_of(model, m, cfg.temperature) for m in micro]
            ref = [logps_of(ref_model, m, cfg.temperature) for m in micro] if cfg.beta else None
        for _ in range(cfg.num_iterations):
            for j, m in enumerate(micro):
                logps = logps_of(model, m, cfg.temperature)  # (b, C)
                old_logps = logps.detach() if mu_1 else old[j]  # at μ = 1, ρ = 1 in value
                loss, loss_metrics = policy_loss(
                    logps, old_logps, m.advantages, m.completion_mask, m.loss_weights,
                    ref[j] if ref else None, cfg.beta, cfg.epsilon, cfg.epsilon_high)
                loss.backward()
                log.add(j, loss, loss_metrics)
            sum_gradients(model)  # Part II: over the ranks
            log.grad_norms.append(clip_gradients(model, cfg.max_grad_norm))  # Part II
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return metrics | log.result()

# -----------------------------------------------------------------------------
# 6. The training loop and the eval. Where to make a change, and the tests that check it. They
# all run in about 25 s on a CPU; run some as pytest test_grpo.py -k 'by_hand or kl'.
#   a scheme or a variant: section 1, a rollout, ROLLOUTS, --variant      rows_carry, by_hand
#   the per-token loss (an entropy term, another KL): policy_loss         by_hand, kl
#   the aggregation: aggregation_weights and --loss-type                  loss_types, pieces
#   the log-probs: plain_logps, run with --plain-logps; then rows_logps   shared_prefix
#   the step or the loop, which resumes bit for bit: train_step, train    resume, reproducible
# A change must keep three rules. A rollout fills Rows as its docstring says. Under torchrun,
# every rank makes the same all_reduce calls. For a resume that repeats the run bit for bit,
# chance comes only from draw_batch's seeds. rows_logps adds no rule: --plain-logps turns it off.

def train_step(model, tokenizer, ref_model, optimizer, cfg, examples, step: int) -> dict:
    """One step: draw P prompts, sample and score this rank's share, update; returns the metrics.
    The step counts from 0 and is logged as step + 1."""
    t_step = time.perf_counter()
    # Part II: this rank's share of P prompts drawn afresh, with no epochs; a rng for TA; torch's
    # seed. All come from the seed, the step and the rank, so that a resume draws the same
    batch, rng = draw_batch(cfg, examples, step)
    rows, metrics = ROLLOUTS[cfg.variant](model, tokenizer, cfg, batch, rng)
    metrics = global_means(metrics)  # Part II: each metric's mean over all ranks
    log_group(cfg, tokenizer, batch[0]["question"], rows, step + 1)  # Part II: one group, if due
    metrics.update(update(model, ref_model, optimizer, rows, cfg))
    metrics["time/step"] = time.perf_counter() - t_step  # this rank's; rank 0 logs
    metrics["tokens_per_s"] = metrics["tokens"] / metrics["time/sample"]
    return metrics

def train(cfg) -> dict:
    """Train as configured:

        eval the starting policy
        for each step: train_step, the schedule, a metrics line, an eval when due,
                       a checkpoint when due, or a stop after SIGTERM
        print and return the summary, the first eval against the last: on rank 0; None elsewhere
    """
    # Part II: ranks, data, run folder; the policy, a frozen reference if β > 0, AdamW, a warmup,
    # and state: the checkpoint's that --resume continues from, or None
    rank, device = setup_distributed(cfg)
    examples, test_examples = load_data(cfg)
    checkpoint = prepare_out(cfg)
    model, tokenizer, ref_model, optimizer, scheduler, state = load_run(cfg, device, checkpoint)
    write = open_logs(cfg, state, rank)  # Part II: writes a metrics.jsonl line on rank 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    evaluation = lambda: evaluate(model, tokenizer, test_examples, cfg, cfg.seed + 12345)
    t0 = time.time()
    with signals_caught() as caught:  # Part II: SIGTERM or Ctrl-C asks for a stop
        if state is None:
            with autocast:
                write({"step": 0, "eval": evaluation()})
        for step in tqdm(range(state["step"] if state else 0, cfg.steps), desc=cfg.variant,
                         disable=rank != 0):
            lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
            with autocast:  # bf16 matmuls on CUDA; AdamW's elementwise ops stay float32
                metrics = train_step(model, tokenizer, ref_model, optimizer, cfg, examples, step)
            scheduler.step()
            write({"step": step + 1, "lr": lr, **metrics})
            if step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                with autocast:
                    write({"step": step + 1, "eval": evaluation()})
            # Part II: a checkpoint every --save-every steps and at the end; after a signal,
            # a checkpoint and an exit with one line
            save_or_stop(cfg, step + 1, caught, model, tokenizer, optimizer, scheduler)
    return report(cfg, time.time() - t0) if rank == 0 else None  # Part II: the summary

@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], cfg, seed: int, max_rows: int = 512) -> dict:
    """Greedy accuracy, pass@k and format on held-out questions. Each pass@k, for k = 1..n, comes
    from n = --eval-samples samples per question at the training temperature. Format is the share
    with answer tags. Chunk c of max_rows samples is seeded with seed + c and sampled by rank
    c % W, as one process would. GRPO-MA's eval samples plain completions, no tree."""
    n, (rank, W) = cfg.eval_samples, rank_and_world()
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
                pass_k[k - 1] += pass_at_k(n, correct, k)  # Part II: Chen et al.'s estimator
    totals = all_reduce([greedy, tagged] + pass_k)  # Part II: sums over the ranks
    result = {"greedy": totals[0] / len(examples), "format": totals[1] / (len(examples) * n)}
    return result | {f"pass@{k}": totals[1 + k] / len(examples) for k in range(1, n + 1)}

# Part II: the machinery, which makes Part I fast, scalable and safe. A first read can stop here.

def rows_logps(model, rows: Rows, temperature: float):
    """plain_logps' numbers, each shared context encoded once. A prompt's KV cache is copied to its
    rows, a GRPO-MA thought's on to its answers, and gradients flow back through the copies. The
    passes are those of prefill's table. A row shorter than the longest of its pass leaves
    padding inside the cache, as prefill's prompts do. Tested: pytest -k shared_prefix."""
    logps = torch.zeros_like(rows.completion_ids, dtype=torch.float32)  # (B, C)
    top = (rows.parent < 0).nonzero().squeeze(1)  # (b,) the rows that continue a prompt directly
    ctx = reorder(prefill(model, rows.prompts, 0), rows.prompt_index[top])  # one per top row
    after_top = continue_rows(model, ctx, rows, top, logps, temperature)  # prompt + row, per row
    children = (rows.parent >= 0).nonzero().squeeze(1)  # GRPO-MA's answers, after their thought
    if len(children):
        slot = torch.full_like(rows.parent, -1)
        slot[top] = torch.arange(len(top), device=top.device)  # a top row's place in after_top
        after_top = reorder(after_top, slot[rows.parent[children]])  # each child: its parent's
        continue_rows(model, after_top, rows, children, logps, temperature)
    return logps

def continue_rows(model, ctx, rows: Rows, idx, logps, temperature: float):
    """rows_logps' pass: write the log-probs of the b rows idx, each after its context in ctx,
    into logps. Returns the contexts that end with those rows, one token short; the cache grows."""
    cache, mask, last = ctx  # the contexts' KV cache, mask (b, L), last token (b,)
    n = int(rows.completion_mask[idx].sum(1).max())  # the longest of these completions
    target, target_mask = rows.completion_ids[idx, :n], rows.completion_mask[idx, :n]  # (b, n)
    inputs = torch.cat([last[:, None], target[:, :-1]], 1)  # (b, n): input t predicts target t
    attn = torch.cat([mask, target_mask], 1)  # (b, L + n): input t is real where target t is
    hidden = run_decoder(model, inputs, attn, cache)  # (b, n, H); the cache now holds L + n
    logps[idx, :n] = token_logps(model.lm_head, hidden, target, target_mask, temperature)
    last = target.gather(1, (target_mask.sum(1) - 1)[:, None]).squeeze(1)  # (b,) a row's last
    return cache, attn, last

def token_logps(lm_head, hidden, targets, mask, temperature: float):
    """(B, C) float32 log softmax(lm_head(hidden) / T) at `targets` where mask is 1, else 0.
    hidden (B, C, H) at t predicts targets[:, t]. At most ~2**25 logits exist at a time, and a
    chunk's are recomputed in the backward pass: memory does not grow with B * C * vocabulary."""
    keep = mask.bool()
    h, t = hidden[keep], targets[keep]  # (N, H), (N,): only real tokens
    chunk = max(1, 2**25 // lm_head.out_features)

    def chunk_logps(h, t):
        logits = lm_head(h).float() / temperature  # after the cast: bf16 / T would round again
        return logits.gather(-1, t[:, None]).squeeze(-1) - logits.logsumexp(-1)
    pieces = [torch.utils.checkpoint.checkpoint(chunk_logps, hc, tc, use_reentrant=False)
              for hc, tc in zip(h.split(chunk), t.split(chunk))]  # no_grad: checkpoint just calls
    logps = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
    logps[keep] = torch.cat(pieces)
    return logps

def micro_batches(rows: Rows, size: int, device="cpu") -> list[Rows]:
    """Rows in micro-batches of about `size` rows, on `device`; a thought keeps its answers."""
    batches, current = [], []
    for i in (rows.parent < 0).nonzero().squeeze(1).tolist():
        unit = [i] + (rows.parent == i).nonzero().squeeze(1).tolist()
        if current and len(current) + len(unit) > size:
            batches, current = batches + [current], []
        current.extend(unit)
    return [select_rows(rows, torch.tensor(sorted(b), dtype=torch.long), device)
            for b in batches + [current]]

def select_rows(rows: Rows, index: torch.Tensor, device="cpu") -> Rows:
    """The rows `index` on `device`, with only the prompts they use and the completion columns that
    hold a token. A row's parent must be among them. The indices are renumbered: rows 4, 5, 7,
    where 7's parent is 4, become rows 0, 1, 2 with parent[2] = 0."""
    used = rows.prompt_index[index].unique()
    new_prompt = torch.full((len(rows.prompts),), -1, dtype=torch.long)
    new_prompt[used] = torch.arange(len(used))
    new_row = torch.full((len(rows),), -1, dtype=torch.long)
    new_row[index] = torch.arange(len(index))
    C = max(1, int(rows.completion_mask[index].sum(1).max()))
    take = lambda x: x[index][:, :C] if x.dim() == 2 else x[index]  # (B, C) tensors lose columns
    picked = {k: take(v) if torch.is_tensor(v) else v for k, v in vars(rows).items()}
    parent = picked["parent"]
    picked.update(parent=torch.where(parent >= 0, new_row[parent.clamp(min=0)], -1),
                  prompt_index=new_prompt[picked["prompt_index"]],
                  prompts=[rows.prompts[p] for p in used.tolist()])
    return Rows(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in picked.items()})

# -----------------------------------------------------------------------------
# Sums over micro-batches and ranks, the metrics, and the guards of sampling and the update.

class UpdateLog:
    """update()'s metrics over micro-batches and ranks, averaged over μ; token means stay means."""

    def __init__(self, micro: list[Rows], tokens: int, cfg: Config):
        self.shares = [m.completion_mask.sum().item() / max(tokens, 1) for m in micro]
        self.passes, self.tokens, self.grad_norms = cfg.num_iterations, tokens, []
        self.totals = dict.fromkeys(["loss", "clip_low", "clip_high"] + ["kl"] * (cfg.beta > 0), 0)

    def add(self, j: int, loss, metrics: dict):
        self.totals["loss"] += loss.item() / self.passes
        for key, value in metrics.items():  # a metric added to policy_loss is logged too
            self.totals[key] += value.item() * self.shares[j] / self.passes

    def result(self) -> dict:
        totals = dict(zip(self.totals, all_reduce(list(self.totals.values()))))
        return totals | {"grad_norm": float(np.mean(self.grad_norms)), "tokens": self.tokens}

def sample_metrics(rewards, advantages, groups, num_groups, parsed, tagged, samples) -> dict:
    """What every rollout logs; frac_reward_zero_std: the share of groups with every A = 0."""
    signal = ((advantages != 0).any(1) if advantages.dim() == 2 else advantages != 0).float()
    nonzero = torch.zeros(num_groups).index_add(0, groups, signal)
    return {"reward": rewards, "frac_reward_zero_std": nonzero == 0,
            "completion_length": samples.completion_mask.sum(1).float(),
            "truncated": ~samples.finished, "unparseable": ~parsed, "format": tagged}

def check_rows(rows: Rows):
    """What update() relies on, asserted: loss parts, finite advantages, parents one level deep."""
    assert rows.part_limits, "the rollout sets part_limits, one per loss part"
    assert rows.advantages.isfinite().all(), "the rollout gives every row a finite advantage"
    parents = rows.parent[rows.parent >= 0]
    assert (rows.parent[parents] < 0).all(), "a parent row continues its prompt (one level)"

def clip_gradients(model, max_norm: float) -> float:
    """Clip the gradient norm to max_norm; return the norm before. A NaN or inf stops the run."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    if not math.isfinite(norm):
        raise UserError(f"the gradient norm is {norm}, so the update was not applied; lower --lr")
    return norm

def check_finite(logits):
    """Stop the run when the policy's logits are not finite: overflowed weights show there."""
    if not logits.isfinite().all():
        raise UserError("the policy's logits are not finite: training diverged; lower --lr")

def eos_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and the generation config's."""
    ids = model.generation_config.eos_token_id
    return sorted({*(ids if isinstance(ids, list) else [ids]), tokenizer.eos_token_id} - {None})

def stop_string_hits(tokenizer, token, active, texts: list[str], stop_strings):
    """(B,) bool: the rows whose text holds a stop string once this step's token is appended to
    texts[row]. A token may carry text past the string: BPE's '><' ends '</think>'."""
    pieces = tokenizer.batch_decode(token[:, None].tolist(), skip_special_tokens=True)
    for row, piece in zip(active.tolist(), pieces):
        texts[row] += piece
    hit = [any(s in texts[row] for s in stop_strings) for row in active.tolist()]
    return torch.tensor(hit, dtype=torch.bool, device=token.device)

@contextlib.contextmanager
def timed(metrics: dict, key: str):
    """Add the block's wall seconds, once the GPU's queued work is done, to metrics[key]."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start

def global_means(metrics: dict) -> dict:
    """Each tensor in metrics -> the mean of its elements over all ranks, in one all_reduce."""
    keys = [key for key, value in metrics.items() if isinstance(value, torch.Tensor)]
    sums = [metrics[key].cpu().double().sum().item() for key in keys]  # MPS has no float64
    totals = all_reduce(sums + [metrics[key].numel() for key in keys])
    counts = totals[len(keys):]
    return metrics | {key: totals[i] / counts[i] if counts[i] else math.nan
                      for i, key in enumerate(keys)}

def setup_distributed(cfg: Config):
    """Join torchrun's process group, NCCL on GPUs and gloo on CPU; returns (rank, device)."""
    device, world = pick_device(cfg.device), int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, device
    if cfg.prompts_per_step % world:
        raise UserError(f"--prompts-per-step {cfg.prompts_per_step}: {world} ranks must divide it")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    # NCCL's default timeout, 10 minutes, would kill a long step or a slow save on rank 0
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         timeout=datetime.timedelta(hours=2))
    return int(os.environ["RANK"]), device

def draw_batch(cfg: Config, examples: list[dict], step: int):
    """(this rank's share of the step's P prompts, a rng for TA's rephrasings). They and torch's
    seed come from the seed, the step and the rank, so a resumed run draws the same."""
    rank, W = rank_and_world()
    data_rng = random.Random(cfg.seed * 1_000_003 + step)
    torch.manual_seed(cfg.seed * 1_000_003 + step * W + rank)
    # every rank takes the same number of whole groups; a data file smaller than P leaves fewer
    P = min(cfg.prompts_per_step, len(examples) // W * W)
    batch = data_rng.sample(examples, P)[rank * P // W:(rank + 1) * P // W]
    return batch, random.Random(f"rephrasings {cfg.seed} {step} {rank}")

def rank_and_world() -> tuple[int, int]:
    """(this process's rank, the number of ranks): (0, 1) without torchrun."""
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

def all_reduce(values: list[float]) -> list[float]:
    """Sum numbers over the ranks; identity in one process. Every rank makes the same calls."""
    if not torch.distributed.is_initialized():
        return values
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()

def sum_gradients(model):
    """Sum the gradients over the ranks: the loss weights are shares of the global batch."""
    if torch.distributed.is_initialized():
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                torch.distributed.all_reduce(p.grad)

# -----------------------------------------------------------------------------
# The answer reader of score: where the answer is, and the number in it. An answer is a number
# only when one number stands alone in it once the wrappers are gone. A false positive is worse
# than a miss, as the policy is trained toward it.

NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"  # any text without a think or answer tag in it
FORMAT_RE = re.compile(rf"\s*<think>{NO_TAG}</think>\s*<answer>{NO_TAG}</answer>\s*", re.DOTALL)

def after_thought(text: str):
    """The text after the first </think>, where the answer must be. A text without <think> is all
    answer; a <think> that never closes gives None. So an answer inside the thought never counts."""
    if "<think>" in text and "</think>" not in text:
        return None
    return text.split("</think>", 1)[-1]

def extract_answer(text: str, answer_from: str = "tags"):
    """The answer after the thought, or None: the last <answer>...</answer>, else the last
    \\boxed{}. With last-number, the last number and the text around it, as GSM8K is graded."""
    text = after_thought(text)
    if text is None:
        return None
    if answer_from == "last-number":
        return last_number(text)  # Part II: the text from the number or '=' before the last one
    found = tagged_answer(text)  # Part II: what the last <answer>...</answer> holds, or None
    return found if found is not None else boxed(text)  # Part II: what the last box holds

TEXT_RE = re.compile(r"\\text\{([^{}]*)\}")
FRAC_RE = re.compile(r"(-?)\\[dt]?frac\{([0-9.,]+)\}\{([0-9.,]+)\}")  # \frac{a}{b} of numbers
EDGE = "\x00"  # a wrapper's edge: where it touches a letter or a digit, the number is not alone
PROSE = ".,;:!?'\"%#"  # what may stand around a number besides words and spaces
# the Unicode minus, $ and \$, \%, bold, LaTeX's thin space, degrees
PLAIN = [("\u2212", "-"), ("\\$", ""), ("$", ""), ("\\%", "%"), ("**", EDGE), ("\\,", " "),
         ("^\\circ", ""), ("^{\\circ}", ""), ("\u00b0", "")]
LOOSE_EDGE_RE = re.compile(rf"(?<![^\s{re.escape(PROSE)}]){EDGE}|{EDGE}(?![^\s{re.escape(PROSE)}])")
ASSIGNMENT_RE = re.compile(r"^\s*[A-Za-z]\w*\s*=")  # "x = 7": the unknown's name goes
RUN_RE = re.compile(r"[-+]?\.?[0-9]+(?:[.,/][0-9]+)*")  # digits joined by . , / (no backtracking)
# a well-formed run: commas only as thousands separators, an optional decimal part, a fraction
DECIMAL = r"(?:[1-9][0-9]{0,2}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
NUMBER_RE = re.compile(rf"[-+]?(?:{DECIMAL})(?:/(?:{DECIMAL}))?")
MAX_NUMBER_CHARS = 100  # longer "numbers" are not parsed: int() refuses > 4300 digits

def parse_number(text: str):
    """The one number an answer holds -> Fraction, else None. Once the wrappers are gone (unwrap),
    only words, spaces and prose punctuation may stand around it, after an optional "x =":
    '1,234.', '18 eggs', '\\$12.50', 'x = 7', '-\\frac{1}{2}', '50\\%', '90^\\circ'. None for two
    numbers ('7 or 8', '2\\frac{1}{3}'), a malformed one ('3,5', '0,005'), and an expression: an
    operator, bracket or LaTeX beside it ('x+5', '- 5', '\\sqrt{2}', '±5'), or a letter or !
    touching it, also across a wrapper ('2i', '4!', '\\boxed{5}x'). Units with / or ^ could be
    operators: '60 km/h' and '42 m^2' are not read. Nor are words: '5 thousand' is 5."""
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

def tagged_answer(text: str):
    """What the last <answer>...</answer> holds, or None. Each <answer> pairs with the first
    </answer> after it. The search only goes forward, so its time is linear in the text."""
    found, start = None, text.find("<answer>")
    while start >= 0 and (end := text.find("</answer>", start)) >= 0:
        found, start = text[start + len("<answer>"):end], text.find("<answer>", end)
    return found

def as_text(answer: str) -> str:
    """An answer compared as text: what a \\boxed{} around it holds, without whitespace."""
    return re.sub(r"\s", "", boxed(answer) or answer)

def boxes(text: str) -> list[tuple]:
    """(start, end, inside) of each \\boxed{...} that is not inside another, braces nested to any
    depth. The last one's end and inside are None when its braces never close."""
    found, start = [], text.find("\\boxed{")
    while start >= 0:
        depth, end = 0, None
        for i in range(start + 6, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                end = i + 1
                break
        found.append((start, end, text[start + 7:end - 1] if end else None))
        start = text.find("\\boxed{", end) if end else -1
    return found

def boxed(text: str):
    """What the last \\boxed{...} holds, or None: also when that box never closes."""
    found = boxes(text)
    return found[-1][2] if found else None

def unwrap(text: str) -> str:
    """The text with the wrappers around numbers made plain: \\boxed{x} and \\text{x} are x,
    \\frac{a}{b} of numbers is a/b, $ and ** go. A wrapper's edge becomes a space beside a space
    or prose; beside anything else it stays EDGE, which touches: '\\boxed{5}x' is not 5."""
    for old, new in PLAIN:
        text = text.replace(old, new)
    pieces, done = [], 0
    for start, end, inside in boxes(text):
        if end is not None:  # an unclosed box stays LaTeX: no number
            pieces, done = pieces + [text[done:start], EDGE, inside, EDGE], end
    text = TEXT_RE.sub(rf"{EDGE}\1{EDGE}", "".join(pieces) + text[done:])
    text = re.sub(f"{EDGE}+", EDGE, FRAC_RE.sub(rf"{EDGE}\1\2/\3{EDGE}", text))
    return LOOSE_EDGE_RE.sub(" ", text)

def number_runs(text: str) -> list:
    """The number-like runs of a text, as written; None for a run that touches a letter, a digit
    of another script, LaTeX (\\ ^ _ { }), a ! or an EDGE (2i, v2, x^2, 3\\pi, 4!)."""
    runs = []
    for match in RUN_RE.finditer(text):
        around = text[max(match.start() - 1, 0):match.start()] + text[match.end():match.end() + 1]
        alone = not any(c.isalnum() or c in "\\^_{}!" + EDGE for c in around)
        runs.append(match.group() if alone else None)
    return runs

def last_number(text: str):
    """--answer-from last-number's answer: the last number and the text after it, from the
    number or '=' before it; None without a number, or when something touches it. parse_number
    then reads it: '3 + 4 = 7.' is 7, '8, not 9' is 9, 'x ≥ 5' and '- 5' are not numbers."""
    text = re.sub(r"</?(?:think|answer)>", " ", unwrap(text))  # the tags are spaces here
    runs = list(RUN_RE.finditer(text))
    if not runs or number_runs(text)[-1] is None:
        return None
    start = max(text.rfind("=", 0, runs[-1].start()) + 1, runs[-2].end() if len(runs) > 1 else 0)
    return text[start:]

def math_verify_equal(answer: str, reference: str) -> bool:
    """--answer-from math-verify: Hugging Face's math_verify compares the two as LaTeX."""
    from math_verify import parse, verify  # check_flags has made sure it is installed
    return verify(parse(f"${reference}$"), parse(f"${answer}$"))

# -----------------------------------------------------------------------------
# Flags, data files and models. Bad input stops the run with one line that names it.

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPT = "reply <think>...</think><answer>...</answer>"

def _opt(default, help, choices=None):
    """A flag's default and help. A help that ends in a bound, such as [>= 1], is checked."""
    return field(default=default, metadata={"help": help, "choices": choices})

@dataclass
class Config:
    """Every field is a command-line flag: --field-name."""
    model: str = _opt(str(HERE / "data" / "tiny"), "local folder or hub name of a causal LM")
    data: str = _opt(str(HERE / "data" / "train.jsonl"), "JSONL: question, answer, rephrasings")
    test_data: str = _opt(str(HERE / "data" / "test.jsonl"), "held-out JSONL for eval")
    system_prompt: str = _opt(SYSTEM_PROMPT, "system message; '' for none (a template may add one)")
    response_prefix: str = _opt("", "text the reply starts with, e.g. <think>: part of the prompt")
    variant: str = _opt("grpo", "advantage/weighting scheme", ["grpo", "ma", "ta", "lambda"])
    num_generations: int = _opt(8, "G: completions per prompt, or per phrasing (ta) [>= 1]")
    prompts_per_step: int = _opt(16, "P: prompts per step [>= 1]")
    max_new_tokens: int = _opt(32, "completion length limit; for ma the thought's [>= 1]")
    temperature: float = _opt(1.0, "sampling temperature; the log-probs use the same [> 0]")
    # GRPO-MA and TA-GRPO
    num_thoughts: int = _opt(4, "K (ma): thoughts per prompt [>= 1]")
    num_answers: int = _opt(4, "M (ma): answers per thought [>= 1]")
    max_answer_tokens: int = _opt(24, "answer length limit (ma) [>= 1]")
    ma_weighting: str = _opt("parts", "(ma) parts: a mean over the thoughts plus one over the "
                             "answers; tokens: one mean over both", ["parts", "tokens"])
    num_rephrasings: int = _opt(3, "N (ta): rephrasings per question, drawn each step [>= 1]")
    ta_anchor: str = _opt("original", "(ta) context of the log-probs: q0 (the paper) or the "
                          "rephrasing (public code)", ["original", "rephrased"])
    # loss and optimisation
    loss_type: str = _opt("dapo", "token aggregation as TRL's; DeepSeekMath's is grpo",
                          ["grpo", "dr_grpo", "dapo"])
    scale_rewards: str = _opt("group", "divide by the std; none: Dr. GRPO", ["group", "none"])
    beta: float = _opt(0.0, "k3 KL coefficient; a reference is loaded only when > 0 [>= 0]")
    epsilon: float = _opt(0.2, "clip range of the ratio, and its upper one by default [>= 0]")
    epsilon_high: float | None = _opt(None, "upper clip range; DAPO's is 0.28 [>= 0]")
    num_iterations: int = _opt(1, "mu: updates per sampled batch [>= 1]")
    answer_from: str = _opt("tags", "the last <answer> tags, else \\boxed; the last number; or "
                            "the tags' answer as LaTeX, graded by math_verify, which credits "
                            "symbolic equality but reads \\boxed{5}x as 5 (pip install "
                            "math-verify)", ["tags", "last-number", "math-verify"])
    format_reward: float = _opt(0.0, "reward for one <think>..</think><answer>..</answer> [>= 0]")
    lr: float = _opt(2e-4, "AdamW learning rate; ~1e-6 for real models [> 0]")
    warmup_steps: int = _opt(10, "linear warmup over steps, then constant [>= 0]")
    weight_decay: float = _opt(0.0, "AdamW weight decay [>= 0]")
    max_grad_norm: float = _opt(1.0, "gradient clipping [> 0]")
    micro_batch_size: int = _opt(64, "rows per forward/backward of the update [>= 1]")
    steps: int = _opt(100, "training steps [>= 1]")
    # eval, logging, checkpoints, runtime
    eval_every: int = _opt(50, "eval every N steps; 0: only at start and end [>= 0]")
    eval_samples: int = _opt(8, "samples per held-out question for pass@k [>= 1]")
    eval_limit: int = _opt(0, "use only the first N held-out questions; 0: all [>= 0]")
    log_completions: int = _opt(25, "every N steps, show a group as text; 0: off [>= 0]")
    save_every: int = _opt(50, "checkpoint every N steps; 0: only at the end [>= 0]")
    out: str = _opt("out", "run folder: metrics.jsonl, completions.jsonl, checkpoint, summary")
    resume: bool = _opt(False, "continue the run in --out, or start it")
    overwrite: bool = _opt(False, "replace a run already in --out (else such a folder stops it)")
    seed: int = _opt(0, "seed for data order, sampling and init")
    device: str = _opt("auto", "auto: cuda or mps if any, else cpu", ["auto", "cuda", "mps", "cpu"])
    gradient_checkpointing: bool = _opt(False, "trade compute for activation memory (real models)")
    plain_logps: bool = _opt(False, "the update takes plain_logps, Part I's definition, not "
                             "rows_logps: the same numbers, slower")

class UserError(Exception):
    """A bad flag, data line or file: main() prints it as one line, without a traceback."""

def reason(e: Exception) -> str:
    """The first line of an exception's message (its type when it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

def parse_args(argv=None) -> Config:
    """Config from the command line, checked; local paths made absolute for requeues elsewhere."""
    parser = HfArgumentParser(Config, description="GRPO and variants.", allow_abbrev=False)
    parser.error = lambda message: sys.exit(f"grpo.py: error: {message}")  # one line, no usage
    cfg = Config(**vars(parser.parse_args(argv)))
    for name in ("model", "data", "test_data"):
        path = Path(getattr(cfg, name)).expanduser()
        if path.exists():
            setattr(cfg, name, str(path.resolve()))
    check_flags(cfg)
    return cfg

BOUND_RE = re.compile(r"\[(>=?) (\S+)\]$")  # a bound at the end of a flag's help

def check_flags(cfg: Config):
    """Each flag within the bound its help ends with; math_verify installed if asked for; and a
    response prefix that cannot earn the reward: it holds no answer, and under ma no </think>."""
    for f in fields(cfg):
        value, bound = getattr(cfg, f.name), BOUND_RE.search(f.metadata["help"])
        if bound and value is not None:
            op, limit = bound.groups()
            if not (math.isfinite(value) and (value > float(limit) if op == ">" else
                                              value >= float(limit))):
                raise UserError(f"--{f.name.replace('_', '-')} {value}: must be {op} {limit}")
    if cfg.answer_from == "math-verify" and importlib.util.find_spec("math_verify") is None:
        raise UserError("--answer-from math-verify needs math_verify: pip install math-verify")
    prefix = cfg.response_prefix
    if "</answer>" in prefix or boxed(prefix) is not None or (cfg.answer_from == "last-number"
                                                               and RUN_RE.search(prefix)):
        raise UserError(f"--response-prefix {prefix!r} holds an answer: the reward would come "
                        f"from the prompt, not from the model")
    if cfg.variant == "ma" and "</think>" in prefix:
        raise UserError(f"--response-prefix {prefix!r} closes the thought, which --variant ma "
                        f"ends at the model's own </think>")

def check_example(example) -> dict:
    """A data line's object with "rephrasings", [] if absent; a ValueError says what is wrong."""
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
        except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, nesting too deep
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
    if len(examples) < (world := rank_and_world()[1]):
        raise UserError(f"{cfg.data}: {len(examples)} examples, fewer than the {world} ranks")
    return examples, test_examples

def pick_device(name: str) -> torch.device:
    """--device: auto picks the accelerator (cuda, mps) if there is one, else cpu; torch 2.6+."""
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
        if state["step"] == cfg.steps and rank_and_world()[0] == 0:  # a requeue of a finished run
            print(f"grpo.py: the run in {cfg.out} finished at step {cfg.steps}; nothing to train")
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(str(checkpoint) if checkpoint else cfg.model, device)
    prefix = tokenizer(cfg.response_prefix, add_special_tokens=False, split_special_tokens=True)
    seen = tokenizer.decode(prefix.input_ids, clean_up_tokenization_spaces=False)
    if seen != cfg.response_prefix:  # the scorer reads the prefix as given: the model must too
        raise UserError(f"--response-prefix {cfg.response_prefix!r} reaches the model as {seen!r}")
    ref_model = None
    if cfg.beta > 0:  # the frozen starting policy
        ref_model = load_model(cfg.model, device)[0].eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()  # transformers 5's gradient_checkpointing_enable
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return model, tokenizer, ref_model, optimizer, scheduler, state

# -----------------------------------------------------------------------------
# The run folder, checkpoints and signals.

LOGS = ("metrics.jsonl", "completions.jsonl")  # appended to as the run goes

def run_files(out: Path) -> list[Path]:
    """What a run leaves in its folder: checkpoints (and a save that died), logs, summary."""
    names = [out / name for name in LOGS + ("summary.json",) if (out / name).exists()]
    return list(out.glob("checkpoint-*")) + names

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

def open_logs(cfg: Config, state: dict | None, rank: int):
    """A function that appends one JSON line to metrics.jsonl, on rank 0 only. A fresh run first
    removes an old run's files, now that its own checks passed. A resumed one cuts the logs to
    their size at the checkpoint, so that what it redoes is not there twice."""
    if rank != 0:
        return lambda record: None
    out = Path(cfg.out)
    for path in run_files(out) if state is None else []:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for name in LOGS if state else []:  # a log the checkpoint did not see (no size) is cut to 0
        if (out / name).exists():
            os.truncate(out / name, min(state["logs"].get(name, 0), (out / name).stat().st_size))
    log = open(out / "metrics.jsonl", "a")

    def write(record: dict):
        log.write(json.dumps(record) + "\n")
        log.flush()
    return write

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

def save_or_stop(cfg: Config, done: int, caught: list, model, tokenizer, optimizer, scheduler):
    """After step `done`: rank 0 saves every --save-every steps and at the end. After a signal on
    any rank, every rank stops: rank 0 saves and prints one line, and no rank exits before it."""
    out, main_rank = Path(cfg.out), rank_and_world()[0] == 0
    save = lambda: save_checkpoint(out, model, tokenizer, optimizer, scheduler, done, cfg)
    if main_rank and (done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
        save()
    if all_reduce([len(caught)])[0] and done < cfg.steps:  # on every rank
        if main_rank:  # save() does nothing more when it has just saved this step
            save()
        all_reduce([0])  # no rank exits before the save: torchrun would stop rank 0 too
        message = (f"grpo.py: {(caught or ['a signal'])[0]} after step {done}: checkpoint "
                   f"saved in {out / f'checkpoint-{done}'}; continue with --resume")
        sys.exit(message if main_rank else 1)  # rank 0 prints it; the others exit 1

@contextlib.contextmanager
def signals_caught():
    """Yields the signals caught: SIGTERM and Ctrl-C ask for a stop after the step in progress.
    A second one acts as before, so Ctrl-C twice stops now."""
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
# What a run shows: a group as text now and then, and the summary at the end.

def log_group(cfg: Config, tokenizer, question: str, rows: Rows, step: int):
    """Every --log-completions steps, on rank 0: the first prompt's rows with reward, advantage and
    mean 1/|λ|, as a table and in completions.jsonl. MA lists answers under their thought."""
    if rank_and_world()[0] != 0 or not cfg.log_completions or step % cfg.log_completions:
        return
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
        parent = int(rows.parent[i])  # an answer is listed under its thought
        listed = entries[parent].setdefault("answers", []) if parent >= 0 else completions
        listed.append(entries[i])
    with open(Path(cfg.out) / "completions.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "question": question, "completions": completions}) + "\n")
    lines = [f"step {step}: {question!r}", "  reward  advantage  completion"]
    for c in completions:
        extra = f"  1/|λ| {c['inv_lambda']:.2f}" if "inv_lambda" in c else ""
        lines.append(f"  {c['reward']:6.2f}  {c['advantage']:+9.2f}  {c['text'][:60]!r}{extra}")
        for a in c.get("answers", []):
            lines.append(f"  {a['reward']:6.2f}  {a['advantage']:+9.2f}    -> {a['text'][:56]!r}")
    tqdm.write("\n".join(lines))

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of n samples, c correct, as Chen et al. 2021: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))

def report(cfg: Config, wall_s: float) -> dict:
    """Print and save the summary: the first and last eval in metrics.jsonl, median phase times."""
    records = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").open()]
    evals = [r["eval"] for r in records if "eval" in r]
    steps = [r for r in records if "time/step" in r]
    phases = {key[5:]: float(np.median([r[key] for r in steps])) for key in
              ("time/sample", "time/update", "time/step")} if steps else {}
    before, after = evals[0], evals[-1]
    summary = {"variant": cfg.variant, "steps": cfg.steps, "before": before, "after": after,
               "wall_s": wall_s, "median_seconds_per_step": phases}
    (Path(cfg.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    shown = dict.fromkeys(["greedy", "pass@1", f"pass@{cfg.eval_samples}"])  # a resume may change n
    line = [f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in shown if k in before and k in after]
    print(f"{cfg.variant}: " + " | ".join(line) + f" | {wall_s:.0f} s")
    return summary

def main(argv=None):
    """The command line: bad flags, files or data stop with one line that names it."""
    try:
        return train(parse_args(argv))
    except UserError as e:
        sys.exit(f"grpo.py: error: {e}")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main()
