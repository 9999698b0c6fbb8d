"""grpo.py: GRPO and three recent variants of it, in one file to read top to bottom.

    python grpo.py                  # GRPO on the tiny model in data/: CPU, offline, ~40 s
    python grpo.py --variant ma     # or lambda, ta; README.md: real models, torchrun

One GRPO step, as train runs it:

    questions = P questions drawn from the data
    for each question q: o_1..o_G = G samples from π(· | q)          generate
    r_i = score(o_i, q's reference answer)                            score
    A_i = (r_i - mean(r)) / (std(r) + eps) over q's G samples         group_advantages
    w_it = 1 / (all completion tokens of the batch)                   aggregation_weights
    repeat μ times:
        logp_it = log π(o_it | q, o_i<t)                              completion_logps
        ρ_it = exp(logp_it - logp_old_it)                             policy_loss
        loss = -Σ_it w_it min(ρ_it A_i, clip(ρ_it, 1-ε, 1+ε) A_i) + β Σ_it w_it KL_it
        loss.backward(); clip the gradient norm; optimizer.step()     update

    KL_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1      Schulman's k3, to a frozen copy

The default takes one update per batch: μ = 1. Then π_old is π itself, so ρ = 1 and nothing is
clipped. The gradient is the policy gradient -Σ w A ∇ log π. Defaults: P = 16, G = 8, 32 new
tokens, dapo's w, β = 0; K = M = 4 for ma; N = 3 for ta.

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

Notation: a batch is B rows by C completion tokens; a context has L tokens; H is the hidden size.
T is the sampling temperature, and n the samples drawn per prompt by generate.

What the file simplifies: the sampler is a short KV-cache loop, not vLLM, and one process samples
and trains. π_old is the trainer's own forward pass, never the sampler's, so a mismatch between
the two (bf16 sampling, say) goes uncorrected. The reward compares one number or the text of the
answer; --answer-from math-verify grades LaTeX. There is no LoRA: the reference is a full copy.
GRPO-MA's unclosed thoughts get no answers and value 0; its two loss parts are our reading, since
the paper publishes no weighting. TA-GRPO's rephrasings come from the data file. The learning rate
warms up, then stays constant.

Sections: 1 the schemes and the loss, 2 the reward, 3 the sampler, 4 the rows and the rollouts,
5 the update, 6 the loop and the eval. Then plumbing: 7 flags and files, 8 checkpoints and ranks.
"""

from __future__ import annotations

import datetime, importlib.util, json, math, os, random, re, shutil, sys, time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import transformers
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm
from transformers import DynamicCache, HfArgumentParser

# -----------------------------------------------------------------------------
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

    To copy GRPO-MA, take two more pieces from rollout_ma. An answer's context is its prompt,
    then its thought. Thoughts and answers are two loss parts, each aggregated alone, so that M
    answers per thought do not outweigh the thought.
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
    rollout_ta gives every row q0's prompt as its context. At μ = 1 this is a policy gradient for
    π(· | q0) on samples drawn from π(· | q_j), with no importance weight. So it is biased on
    purpose: it is not the gradient of q0's expected reward. Why: the rephrasings explore. They
    make the model write solutions it rarely writes for q0, and training π(· | q0) on them moves
    q0's answers toward those. An importance weight π(o | q0) / π(o | q_j) would be far from 1,
    mostly clipped. The paper's v5 takes this anchored ratio (arxiv.org/abs/2601.22478v5).
    --ta-anchor rephrased keeps each response's own prompt, as its code does
    (github.com/lhkhiem28/TA-GRPO).
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
    gradient scale, up to its eps. Every pair of a group's rows is compared: ~4·B·G·C bytes.
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

    Under dapo each of these six tokens weighs 1/6. Under dapo and grpo a batch's w sum to 1, so
    the loss is a mean. λ-GRPO's 1/|λ| makes the sum smaller; GRPO-MA's two parts make it 2. A
    piece of a batch, such as one rank's rows, takes the whole batch's num_rows and num_tokens.
    Then the pieces' losses add up to the batch's. TRL's bnpo is dapo with a micro-batch's own
    count; here the count is always the batch's.
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
# 2. The reward: 1 for a finished completion whose answer is the reference. It is strict by being
# narrow: what it cannot read is a miss, never a guess, since a false positive trains the policy
# toward it. Model output is text: it is read, never run.

# a plain decimal: commas only as thousands separators; no exponent, no fraction
NUMBER_RE = re.compile(r"[-+]?(?:(?:[1-9][0-9]{0,2}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)")
PROSE = ".,;:!?'\"*"  # what may touch a number besides letters: punctuation, markdown's bold

def score(text: str, reference: str, finished: bool, answer_from: str = "tags") -> float:
    """1.0 if the completion finished with EOS and its answer equals the reference, else 0.0.

    The answer comes after the first </think>. A thought that never closes holds none.
    - tags: what the last <answer>...</answer> holds.
    - last-number: the last number, when only words, prose punctuation or "=" stand around it.
    - math-verify: the tags' answer, graded against the reference as LaTeX by math_verify.
    Both sides are read by plain(): whitespace, $, a final period and one \\boxed{} go. A numeric
    reference then wants a plain number of the same value: '1,234.0' equals '1234'. Any other
    reference wants the same text: '3\\pi' equals '3 \\pi'. So '2x', '-\\frac{1}{2}', 'x = 7' and
    '18 eggs' are misses against 2, -0.5, 7 and 18.
    """
    answer = extract_answer(text, answer_from)
    if not finished or answer is None:
        return 0.0
    if answer_from == "math-verify":
        from math_verify import parse, verify  # check_flags made sure it is installed
        return float(verify(parse(f"${reference}$"), parse(f"${answer}$")))
    if number(plain(reference)) is not None:
        return float(number(plain(answer)) == number(plain(reference)))
    return float(plain(answer) == plain(reference))

def extract_answer(text: str, answer_from: str = "tags"):
    """The answer text that score reads, or None. It only splits and searches: linear time."""
    if "<think>" in text and "</think>" not in text:
        return None
    text = text.split("</think>", 1)[-1]  # a text without <think> is all answer
    if answer_from == "last-number":
        words = re.sub(r"</?(?:think|answer)>", " ", text).split()  # the tags are spaces here
        at = [i for i, word in enumerate(words) if re.search("[0-9]", word)]
        prose = lambda word: all(c.isalpha() or c in PROSE for c in word)
        if not at or not all(map(prose, words[at[-1] + 1:])):
            return None  # '8 - x': an operator after the number
        before = words[at[-1] - 1] if at[-1] else ""
        if not (prose(before) or before == "="):
            return None  # '- 8', 'x ≥ 8': a sign or a relation before it
        return words[at[-1]].rstrip(PROSE).lstrip("'\"*")
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    return text[start + len("<answer>"):text.find("</answer>", start)] if start >= 0 else None

def plain(answer: str) -> str:
    """An answer without whitespace, $, a final period, bold, and one \\boxed{} around it all."""
    answer = re.sub(r"\s|\\?\$", "", answer).rstrip(".").strip("*")
    boxed = re.fullmatch(r"\\boxed\{(.*)\}", answer)
    return boxed.group(1) if boxed else answer

def number(text: str):
    """The value of a plain decimal number ('-1,234.5', '.5', '+7') as a Fraction, else None."""
    if len(text) > 100 or not NUMBER_RE.fullmatch(text):  # int() refuses > 4300 digits
        return None
    return Fraction(text.replace(",", ""))

def score_batch(tokenizer, samples, references, answer_from="tags", before=""):
    """(B,) rewards of generate's Samples. Each text is scored after `before`: the response prefix,
    and for a GRPO-MA answer its thought."""
    texts = decode(tokenizer, samples.completion_ids, samples.completion_mask)
    before = [before] * len(texts) if isinstance(before, str) else before
    return torch.tensor([score(b + text, reference, done, answer_from) for b, text, reference, done
                         in zip(before, texts, references, samples.finished.tolist())])

# -----------------------------------------------------------------------------
# 3. The sampler: each prompt is encoded once and its KV cache copied to its n rows. It assumes
# HF's decoder layout, model.model then model.lm_head (Qwen2/3, Llama), and transformers >= 5.24.

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
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, L - len(s):] = 1
    return ids, mask

def run_decoder(model, input_ids, attention_mask, cache=None):
    """The decoder's last hidden states (B, S, H) for S new tokens input_ids (B, S), before the
    lm_head. They follow the tokens already in `cache`, a DynamicCache that grows in place. The
    attention mask covers both, with 0 for padding anywhere."""
    # a token's position is the number of real tokens before it: padding takes no place
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
    out = model.model(input_ids=input_ids, attention_mask=attention_mask,  # < 5.24: past_key_values
                      position_ids=position_ids, use_cache=cache is not None, cache=cache)
    return out.last_hidden_state

def eos_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and the generation config's."""
    ids = model.generation_config.eos_token_id
    return sorted({*(ids if isinstance(ids, list) else [ids]), tokenizer.eos_token_id} - {None})

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
    softmax(logits / T), with no top-k or top-p, since the loss's log-probs are of it. A row ends
    at an EOS, at the token that completes a stop string, or at max_new_tokens.

        prefill   one pass over the left-padded prompts; each one's cache and last logits
                  are copied to its n rows
        each step token = a draw from logits; rows that ended leave the batch and the cache;
                  logits = lm_head(decoder(token, cache)) for the rows still active

    Row r of the cache, of the mask, of token and of logits is output row active[r]."""
    device, pad = next(model.parameters()).device, tokenizer.pad_token_id
    if not prompts:  # a rank whose GRPO-MA thoughts all stayed open samples no answers
        return Samples(torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long),
                       torch.zeros(0, dtype=torch.bool))
    was_training = model.training
    model.eval()  # no dropout; in train mode HF's gradient checkpointing would drop the cache
    ids, mask = (x.to(device) for x in left_pad(prompts, pad))
    cache = DynamicCache()
    logits = model.lm_head(run_decoder(model, ids, mask, cache)[:, -1]).float()  # (P, V)
    if not logits.isfinite().all():  # overflowed weights show here first
        raise UserError("the policy's logits are not finite: training diverged; lower --lr")
    index = torch.arange(len(prompts), device=device).repeat_interleave(n)
    cache.reorder_cache(index)  # in place: prompt p's cache now fills rows p·n to p·n + n - 1
    logits, mask = logits[index], mask[index]  # (B, V), (B, L)
    B, eos = len(index), torch.tensor(eos_ids(model, tokenizer), device=device)
    out = torch.full((B, max_new_tokens), pad, device=device)
    lengths, finished = torch.zeros_like(index), torch.zeros_like(index, dtype=torch.bool)
    texts, active = [""] * B, torch.arange(B, device=device)  # the rows still being decoded
    for t in range(max_new_tokens):
        if greedy:
            token = logits.argmax(-1)
        else:
            token = torch.multinomial((logits / temperature).softmax(-1), 1).squeeze(-1)
        out[active, t] = token  # token, ended: (len(active),), one per row still decoded
        lengths[active] += 1
        ended = torch.isin(token, eos)
        finished[active[ended]] = True
        if stop_strings:  # append each row's new text; a token may carry text past the string
            pieces = tokenizer.batch_decode(token[:, None].tolist(), skip_special_tokens=True)
            for row, piece in zip(active.tolist(), pieces):
                texts[row] += piece
            ended |= torch.tensor([any(s in texts[row] for s in stop_strings)
                                   for row in active.tolist()], device=device)
        if ended.any():  # ended rows leave the batch; that copies the cache, so only then
            active, mask, token = active[~ended], mask[~ended], token[~ended]
            cache.batch_select_indices((~ended).nonzero().squeeze(1))
        if not len(active) or t + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], 1)
        logits = model.lm_head(run_decoder(model, token[:, None], mask, cache)[:, -1]).float()
    model.train(was_training)
    C = int(lengths.max())
    completion_mask = (torch.arange(C, device=device)[None] < lengths[:, None]).long()
    return Samples(out[:, :C], completion_mask, finished)

# -----------------------------------------------------------------------------
# 4. The rows every variant produces, and one rollout per variant. A rollout samples and scores
# this rank's share of a batch and returns (Rows, metrics). To add one, copy rollout_grpo and add
# it to ROLLOUTS and to --variant's choices. cfg is section 7's Config: cfg.num_generations is the
# flag --num-generations. A metric is a tensor; the log shows its mean over all ranks.

@dataclass
class Rows:
    """What a rollout hands to update(): B completions, each with its context, advantage and
    token weights. A row adds Σ_t w_t · min(ρ_t A, clip(ρ_t) A) to J, and the rollout sets A and
    w, so it states its scheme's whole objective. update() then knows no variant.

        row  context              completion    advantage       weights w
        0    q's prompt           o_1           A_1 (B,)        1 / (all tokens)        grpo
        1    q's prompt           o_2           A_2             1 / (all tokens) / |λ|  lambda
        5    prompt + thought 0   answer 0,0    A(a_0,0)        1 / (answer tokens)     ma
        9    q0's prompt          o, from q1    A_9             1 / (all tokens)        ta
        -    any                  o             (C,) per token  any                     yours

    The advantages are one per row (B,), or one per token (B, C) with 0 off the mask.
    """
    contexts: list[list[int]]      # B lists of token ids: what each completion continues
    completion_ids: torch.Tensor   # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) 1 up to and including EOS or the stop string
    advantages: torch.Tensor       # (B,) or (B, C); finite
    loss_weights: torch.Tensor     # (B, C) each token's w in J over the whole batch, all ranks
    rewards: torch.Tensor          # (B,) shown by --log-completions; an MA thought's is its V

def batch_weights(completion_mask, loss_type: str, max_completion_length: int):
    """aggregation_weights (B, C) of this rank's rows, with the rows and tokens of all ranks."""
    num_rows, num_tokens = all_reduce([len(completion_mask), completion_mask.sum().item()])
    return aggregation_weights(completion_mask, loss_type, num_rows, num_tokens,
                               max_completion_length)

def no_signal(advantages, groups, num_groups: int):
    """(num_groups,) True where every row of the group has A = 0, logged as frac_*_zero_std."""
    nonzero = ((advantages[:, None] if advantages.dim() == 1 else advantages) != 0).any(1)
    return torch.zeros(num_groups).index_add(0, groups, nonzero.float()) == 0

def rollout_grpo(model, tokenizer, cfg, batch: list[dict]):
    """GRPO and λ-GRPO: G completions per prompt, advantages normalised within each group. Under
    lambda each token's w is also divided by |λ|. Both log how much a group's completions share."""
    G = cfg.num_generations
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
               for ex in batch]
    s = generate(model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature)
    ids, mask = s.completion_ids.cpu(), s.completion_mask.cpu()  # (P·G, C)
    references = [ex["answer"] for ex in batch for _ in range(G)]
    rewards = score_batch(tokenizer, s, references, cfg.answer_from, cfg.response_prefix)
    group = torch.arange(len(batch)).repeat_interleave(G)  # (P·G,) each row's prompt
    advantages = group_advantages(rewards, group, cfg.scale_rewards)
    weights = batch_weights(mask, cfg.loss_type, cfg.max_new_tokens)
    inv_lambda = lambda_weights(ids, mask, G)  # under grpo a metric only
    if cfg.variant == "lambda":
        weights = weights * inv_lambda
    metrics = dict(reward=rewards, frac_reward_zero_std=no_signal(advantages, group, len(batch)),
                   completion_length=mask.sum(1).float(), lambda_mean=1 / inv_lambda[mask.bool()])
    return Rows([prompts[p] for p in group], ids, mask, advantages, weights, rewards), metrics

def rollout_ma(model, tokenizer, cfg, batch: list[dict]):
    """GRPO-MA: K thoughts per prompt, each ending at the token that completes </think>, then M
    answers per closed thought; ma_advantages scores the tree. An answer is sampled after prompt
    + thought and scored on prefix + thought + answer. An open thought gets no answers: V = 0.

    One prompt's tree as rows, K = 2, M = 2, thought 1 left open; the thoughts come first:

        row  context             completion        advantage  w under --ma-weighting parts
        0    prompt              thought 0         A(th_0)    1 / (all thought tokens)
        1    prompt              thought 1 (open)  A(th_1)    1 / (all thought tokens)
        2    prompt + thought 0  answer 0,0        A(a_0,0)   1 / (all answer tokens)
        3    prompt + thought 0  answer 0,1        A(a_0,1)   1 / (all answer tokens)

    Under parts the thoughts' w sum to 1 and the answers' to 1: J = J(thoughts) + J(answers), so
    M answers per thought do not outweigh it. --ma-weighting tokens pools all tokens in one mean.
    """
    K, M = cfg.num_thoughts, cfg.num_answers
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
               for ex in batch]
    th = generate(model, tokenizer, prompts, K, cfg.max_new_tokens, cfg.temperature,
                  stop_strings=["</think>"])
    th_ids, th_mask = th.completion_ids.cpu(), th.completion_mask.cpu()  # (P·K, C1)
    thought_texts = decode(tokenizer, th_ids, th_mask)
    thought_prompt = torch.arange(len(batch)).repeat_interleave(K)  # (P·K,) each thought's prompt
    closed_mask = torch.tensor(["</think>" in text for text in thought_texts])  # (P·K,)
    closed = closed_mask.nonzero().squeeze(1).tolist()  # the thoughts that get answers
    contexts = [prompts[thought_prompt[k]] + th_ids[k][th_mask[k].bool()].tolist() for k in closed]
    ans = generate(model, tokenizer, contexts, M, cfg.max_answer_tokens, cfg.temperature)
    answer_thought = torch.tensor(closed, dtype=torch.long).repeat_interleave(M)  # (A,)
    references = [batch[thought_prompt[k]]["answer"] for k in answer_thought]
    before = [cfg.response_prefix + thought_texts[k] for k in answer_thought]
    rewards = score_batch(tokenizer, ans, references, cfg.answer_from, before)  # (A,)
    thought_adv, answer_adv, values = ma_advantages(rewards, answer_thought, thought_prompt,
                                                    cfg.scale_rewards)
    ids = pad_sequence([*th_ids, *ans.completion_ids.cpu()], True, tokenizer.pad_token_id)
    mask = pad_sequence([*th_mask, *ans.completion_mask.cpu()], True)  # (P·K + A, C)
    is_answer = torch.arange(len(mask)) >= len(th_mask)
    if cfg.ma_weighting == "parts":  # each part aggregated alone, with its own length limit
        weights = torch.zeros(mask.shape)
        weights[~is_answer] = batch_weights(mask[~is_answer], cfg.loss_type, cfg.max_new_tokens)
        weights[is_answer] = batch_weights(mask[is_answer], cfg.loss_type, cfg.max_answer_tokens)
    else:
        limit = max(cfg.max_new_tokens, cfg.max_answer_tokens)
        weights = batch_weights(mask, cfg.loss_type, limit)
    metrics = dict(reward=rewards, completion_length=mask[is_answer].sum(1).float(),
                   frac_reward_zero_std=no_signal(answer_adv, thought_prompt[answer_thought],
                                                  len(batch)),
                   thought_value=values, unclosed_thoughts=~closed_mask,  # (P·K,) each
                   frac_value_zero_std=(thought_adv.view(-1, K) == 0).all(1),
                   thought_length=th_mask.sum(1).float())
    row_contexts = [prompts[p] for p in thought_prompt] + [c for c in contexts for _ in range(M)]
    rows = Rows(row_contexts, ids, mask, torch.cat([thought_adv, answer_adv]), weights,
                torch.cat([values, rewards]))
    return rows, metrics

def rollout_ta(model, tokenizer, cfg, batch: list[dict]):
    """TA-GRPO: each question q0 with up to N of its rephrasings, drawn afresh each step, and G
    responses to each phrasing. Advantages are normalised over the question's (N+1)·G responses.
    --ta-anchor original takes every log-prob given q0: ta_advantages says why.

        row  phrasing  context: original / rephrased  group     (one question, N = 1, G = 2)
        0    q0        q0 / q0                         0
        1    q0        q0 / q0                         0
        2    q1        q0 / q1                         0
        3    q1        q0 / q1                         0
    """
    G, N = cfg.num_generations, cfg.num_rephrasings
    phrasings, question = [], []  # per phrasing: its token ids, its question's index
    for p, ex in enumerate(batch):
        drawn = [ex["rephrasings"][i] for i in torch.randperm(len(ex["rephrasings"]))[:N]]
        for text in [ex["question"]] + drawn:
            phrasings.append(prompt_ids(tokenizer, text, cfg.system_prompt, cfg.response_prefix))
            question.append(p)
    s = generate(model, tokenizer, phrasings, G, cfg.max_new_tokens, cfg.temperature)
    group = torch.tensor(question).repeat_interleave(G)  # (B,) each row's question: its group
    phrasing = torch.arange(len(phrasings)).repeat_interleave(G)  # (B,) what it was sampled after
    references = [batch[p]["answer"] for p in group]
    rewards = score_batch(tokenizer, s, references, cfg.answer_from, cfg.response_prefix)
    advantages = ta_advantages(rewards, group, cfg.scale_rewards)
    if cfg.ta_anchor == "original":  # the paper: every response's context is its question's q0
        q0 = [phrasings[question.index(p)] for p in range(len(batch))]
        contexts = [q0[p] for p in group]
    else:
        contexts = [phrasings[j] for j in phrasing]
    mask = s.completion_mask.cpu()
    weights = batch_weights(mask, cfg.loss_type, cfg.max_new_tokens)
    from_q0 = torch.tensor([question.index(question[j]) == j for j in phrasing.tolist()])
    r0 = rewards[from_q0].view(-1, G)  # q0's own G rewards: what plain GRPO would have had
    metrics = dict(reward=rewards, frac_reward_zero_std=no_signal(advantages, group, len(batch)),
                   completion_length=mask.sum(1).float(), reward_q0=r0,
                   reward_rephrased=rewards[~from_q0],
                   frac_reward_zero_std_q0=r0.amax(1) == r0.amin(1))
    rows = Rows(contexts, s.completion_ids.cpu(), mask, advantages, weights, rewards)
    return rows, metrics

ROLLOUTS = {"grpo": rollout_grpo, "lambda": rollout_grpo, "ma": rollout_ma, "ta": rollout_ta}

# -----------------------------------------------------------------------------
# 5. The update. update() takes a rollout's Rows, whichever variant made them:
#   Rows: B rows, advantages (B,), weights w (B, C) -> micro-batches of b rows
#   -> completion_logps (b, C) -> policy_loss -> backward
#   -> the gradients summed over the ranks, the norm clipped, optimizer.step; μ times

def completion_logps(model, contexts: list[list[int]], completion_ids, completion_mask,
                     temperature: float):
    """(B, C) log softmax(logits / T) of each completion token given its context and the tokens
    before it, 0 off the mask. One forward pass over context + completion, no KV cache:

        input       pad p1 p2 p3 | t1 t2 pad      the context left-padded to L tokens,
        mask         0  1  1  1  |  1  1  0       the completion right-padded
        predicts             t1  | t2 -           position L-1 predicts completion token 0
    """
    C = completion_ids.shape[1]
    width = int(completion_mask.sum(1).max())  # columns past every row's end are only padding
    ids, mask = completion_ids[:, :width], completion_mask[:, :width]
    context_ids, context_mask = (x.to(ids.device) for x in left_pad(contexts, 0))
    hidden = run_decoder(model, torch.cat([context_ids, ids], 1),
                         torch.cat([context_mask, mask], 1))  # (B, L + width, H)
    L = context_ids.shape[1]
    logps = token_logps(model.lm_head, hidden[:, L - 1:-1], ids, mask, temperature)
    return torch.nn.functional.pad(logps, (0, C - width))

def token_logps(lm_head, hidden, targets, mask, temperature: float):
    """(B, C) float32 log softmax(lm_head(hidden) / T) at `targets` where mask is 1, else 0.
    hidden (B, C, H) at t predicts targets[:, t]. At most ~2**25 logits exist at a time, and a
    chunk's are recomputed in the backward pass: memory does not grow with B · C · vocabulary."""
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

def update(model, ref_model, optimizer, rows: Rows, cfg) -> dict:
    """μ = --num-iterations optimizer steps on one batch of rows, whichever variant made them.

    The weights w count the whole batch on all ranks, so a micro-batch's loss is its piece of -J.
    Summed over the micro-batches and the ranks, the pieces are -J: backward() adds up a rank's
    gradients and sum_gradients the ranks'. The old log-probs at μ > 1, and the reference's at
    β > 0, come first. At μ = 1 the logged loss is -Σ w A, which says little about progress:
    watch the reward. test_update_works_one_grpo_step_by_hand checks one step's gradient by hand.
    """
    device, size = next(model.parameters()).device, cfg.micro_batch_size
    micro = [slice(i, i + size) for i in range(0, len(rows.contexts), size)]  # about size rows each
    on = lambda x, s: x[s].to(device)
    logps_of = lambda m, s: completion_logps(m, rows.contexts[s], on(rows.completion_ids, s),
                                             on(rows.completion_mask, s), cfg.temperature)
    with torch.no_grad():
        mu_1 = cfg.num_iterations == 1  # then π_old is π itself
        old = None if mu_1 else [logps_of(model, s) for s in micro]
        ref = [logps_of(ref_model, s) for s in micro] if cfg.beta else None
    totals, grad_norms = {"loss": 0.0}, []
    for _ in range(cfg.num_iterations):
        for j, s in enumerate(micro):
            logps = logps_of(model, s)  # (b, C)
            loss, metrics = policy_loss(
                logps, logps.detach() if mu_1 else old[j], on(rows.advantages, s),
                on(rows.completion_mask, s), on(rows.loss_weights, s), ref[j] if ref else None,
                cfg.beta, cfg.epsilon, cfg.epsilon_high)
            loss.backward()
            totals["loss"] += loss.item()
            for key, value in metrics.items():  # token means, summed as token totals
                totals[key] = totals.get(key, 0.0) + value.item() * rows.completion_mask[s].sum()
        sum_gradients(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm).item()
        if not math.isfinite(norm):
            raise UserError(f"the gradient norm is {norm}, so the update was not applied; lower --lr")
        grad_norms.append(norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    *sums, tokens = all_reduce([float(v) for v in totals.values()] + [rows.completion_mask.sum()])
    result = {k: v / cfg.num_iterations / (1 if k == "loss" else tokens)
              for k, v in zip(totals, sums)}
    return result | {"grad_norm": sum(grad_norms) / len(grad_norms)}

# -----------------------------------------------------------------------------
# 6. The training loop and the eval.

def train(cfg) -> dict:
    """Train as configured. Returns rank 0's summary: the first eval and the last.

        eval the starting policy
        for each step: draw the batch, roll out, update, log; eval and save when due
    """
    device = setup_ranks(cfg)
    rank, W = rank_and_world()
    examples, test_examples = load_jsonl(cfg.data), load_jsonl(cfg.test_data)[:cfg.eval_limit or None]
    if len(examples) < cfg.prompts_per_step:
        raise UserError(f"{cfg.data}: {len(examples)} examples, fewer than --prompts-per-step")
    model, tokenizer, ref_model, optimizer, scheduler, start = load_run(cfg, device)
    log = open_log(cfg, start)  # appends one JSON line to metrics.jsonl, on rank 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    evaluation = lambda: evaluate(model, tokenizer, test_examples, cfg, cfg.seed + 12345)
    if start == 0:
        with autocast:
            log({"step": 0, "eval": evaluation()})
    P, t0 = cfg.prompts_per_step, time.time()
    for step in tqdm(range(start, cfg.steps), desc=cfg.variant, disable=rank != 0):
        t_step, lr = time.perf_counter(), scheduler.get_last_lr()[0]
        # the step's P prompts, the same on every rank, and this rank's share of them; then this
        # rank's sampling seed. Both come from the step, so a resumed run draws the same.
        batch = random.Random(cfg.seed * 1_000_003 + step).sample(examples, P)
        batch = batch[rank * P // W:(rank + 1) * P // W]
        torch.manual_seed(cfg.seed * 1_000_003 + step * W + rank)
        with autocast:  # bf16 matmuls on CUDA; AdamW's elementwise ops stay float32
            rows, metrics = ROLLOUTS[cfg.variant](model, tokenizer, cfg, batch)
            metrics = mean_over_ranks(metrics) | update(model, ref_model, optimizer, rows, cfg)
        scheduler.step()
        if rank == 0 and cfg.log_completions and (step + 1) % cfg.log_completions == 0:
            show_group(tokenizer, rows, batch[0]["question"], step + 1)
        log({"step": step + 1, "lr": lr, **metrics, "time/step": time.perf_counter() - t_step})
        if step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
            with autocast:
                log({"step": step + 1, "eval": evaluation()})
        if step + 1 == cfg.steps or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            save_checkpoint(cfg, step + 1, model, tokenizer, optimizer, scheduler)
    return summary(cfg, time.time() - t0) if rank == 0 else None

@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], cfg, seed: int, max_rows: int = 512) -> dict:
    """Greedy accuracy and pass@k on held-out questions. Each pass@k, for k = 1..n, comes from
    n = --eval-samples samples per question at the training temperature. Chunk c of max_rows
    samples is seeded with seed + c and sampled by rank c % W, as one process would. GRPO-MA's
    eval samples plain completions, no tree."""
    n, (rank, W) = cfg.eval_samples, rank_and_world()
    limit = cfg.max_new_tokens + (cfg.max_answer_tokens if cfg.variant == "ma" else 0)
    size = max(1, max_rows // n)
    greedy, pass_k = 0.0, [0.0] * n  # sums over this rank's questions
    for c, start in enumerate(range(0, len(examples), size)):
        if c % W != rank:
            continue
        torch.manual_seed(seed + c)
        chunk = examples[start:start + size]
        prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
                   for ex in chunk]
        references = [ex["answer"] for ex in chunk]
        s = generate(model, tokenizer, prompts, 1, limit, greedy=True)
        greedy += score_batch(tokenizer, s, references, cfg.answer_from, cfg.response_prefix).sum()
        s = generate(model, tokenizer, prompts, n, limit, cfg.temperature)
        rewards = score_batch(tokenizer, s, [a for a in references for _ in range(n)],
                              cfg.answer_from, cfg.response_prefix)
        for correct in rewards.view(len(chunk), n).sum(1).long().tolist():
            for k in range(1, n + 1):
                pass_k[k - 1] += pass_at_k(n, correct, k)
    totals = all_reduce([float(greedy)] + pass_k)
    return {"greedy": totals[0] / len(examples)} | {
        f"pass@{k}": totals[k] / len(examples) for k in range(1, n + 1)}

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of n samples, c correct, as Chen et al. 2021: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))

def show_group(tokenizer, rows: Rows, question: str, step: int):
    """Print the first prompt's rows: reward, advantage (a mean over tokens if per token), text."""
    shown = [i for i, context in enumerate(rows.contexts) if context == rows.contexts[0]]
    on = rows.completion_mask[shown]
    adv = rows.advantages[shown]
    adv = adv if adv.dim() == 1 else (adv * on).sum(1) / on.sum(1)
    lines = [f"step {step}: {question!r}", "  reward  advantage  completion"]
    for r, a, text in zip(rows.rewards[shown], adv, decode(tokenizer, rows.completion_ids[shown], on)):
        lines.append(f"  {r:6.2f}  {a:+9.2f}  {text[:70]!r}")
    tqdm.write("\n".join(lines))

def summary(cfg, wall_s: float) -> dict:
    """Print the first eval against the last, both read from metrics.jsonl, and return them."""
    lines = (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()
    evals = [record["eval"] for record in map(json.loads, lines) if "eval" in record]
    before, after = evals[0], evals[-1]
    shown = dict.fromkeys(["greedy", "pass@1", f"pass@{cfg.eval_samples}"])
    line = [f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in shown if k in before and k in after]
    print(f"{cfg.variant}: " + " | ".join(line) + f" | {wall_s:.0f} s")
    return {"variant": cfg.variant, "steps": cfg.steps, "before": before, "after": after}

# -----------------------------------------------------------------------------
# 7. Plumbing: flags, data files and models. Bad input stops the run with one line that names it.

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPT = "reply <think>...</think><answer>...</answer>"

def _opt(default, help: str):
    return field(default=default, metadata={"help": help})

@dataclass
class Config:
    """Every field is a command-line flag: --field-name."""
    model: str = _opt(str(HERE / "data" / "tiny"), "local folder or hub name of a causal LM")
    data: str = _opt(str(HERE / "data" / "train.jsonl"), "JSONL: question, answer, rephrasings")
    test_data: str = _opt(str(HERE / "data" / "test.jsonl"), "held-out JSONL for eval")
    system_prompt: str = _opt(SYSTEM_PROMPT, "system message; '' for none (a template may add one)")
    response_prefix: str = _opt("", "text the reply starts with, e.g. <think>: part of the prompt")
    variant: Literal["grpo", "ma", "ta", "lambda"] = _opt("grpo", "advantage/weighting scheme")
    num_generations: int = _opt(8, "G: completions per prompt, or per phrasing (ta)")
    prompts_per_step: int = _opt(16, "P: prompts per step, over all ranks")
    max_new_tokens: int = _opt(32, "completion length limit; for ma the thought's")
    temperature: float = _opt(1.0, "sampling temperature; the log-probs use the same")
    # GRPO-MA and TA-GRPO
    num_thoughts: int = _opt(4, "K (ma): thoughts per prompt")
    num_answers: int = _opt(4, "M (ma): answers per thought")
    max_answer_tokens: int = _opt(24, "answer length limit (ma)")
    ma_weighting: Literal["parts", "tokens"] = _opt("parts", "(ma) parts: a mean over the "
                                                    "thoughts plus one over the answers; tokens: one mean over both")
    num_rephrasings: int = _opt(3, "N (ta): rephrasings per question, drawn each step")
    ta_anchor: Literal["original", "rephrased"] = _opt("original", "(ta) context of the "
                                                       "log-probs: q0 (the paper) or the rephrasing (public code)")
    # loss and optimisation
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = _opt("dapo", "token aggregation as TRL's; "
                                                         "DeepSeekMath's is grpo")
    scale_rewards: Literal["group", "none"] = _opt("group", "divide by the std; none: Dr. GRPO")
    beta: float = _opt(0.0, "k3 KL coefficient; a reference is loaded only when > 0")
    epsilon: float = _opt(0.2, "clip range of the ratio, and its upper one by default")
    epsilon_high: float | None = _opt(None, "upper clip range; DAPO's is 0.28")
    num_iterations: int = _opt(1, "mu: updates per sampled batch")
    answer_from: Literal["tags", "last-number", "math-verify"] = _opt(
        "tags", "the last <answer> tags; the last number; or the tags' answer as LaTeX, graded by "
        "math_verify, which credits symbolic equality but reads \\boxed{5}x as 5")
    lr: float = _opt(2e-4, "AdamW learning rate; ~1e-6 for real models")
    warmup_steps: int = _opt(10, "linear warmup over steps, then constant")
    max_grad_norm: float = _opt(1.0, "gradient clipping")
    micro_batch_size: int = _opt(64, "rows per forward/backward of the update")
    steps: int = _opt(100, "training steps")
    # eval, logging, checkpoints
    eval_every: int = _opt(50, "eval every N steps; 0: only at start and end")
    eval_samples: int = _opt(8, "samples per held-out question for pass@k")
    eval_limit: int = _opt(0, "use only the first N held-out questions; 0: all")
    log_completions: int = _opt(25, "every N steps, print a group as text; 0: off")
    save_every: int = _opt(50, "checkpoint every N steps; 0: only at the end")
    out: str = _opt("out", "run folder: metrics.jsonl and the latest checkpoint")
    resume: bool = _opt(False, "continue the run in --out from its checkpoint, or start it")
    overwrite: bool = _opt(False, "replace a run already in --out (else such a folder stops it)")
    seed: int = _opt(0, "seed for data order and sampling")
    gradient_checkpointing: bool = _opt(False, "trade compute for activation memory")

class UserError(Exception):
    """A bad flag, data line or file: main() prints it as one line, without a traceback."""

def parse_args(argv=None) -> Config:
    """Config from the command line, checked before anything loads."""
    parser = HfArgumentParser(Config, description="GRPO and variants.", allow_abbrev=False)
    parser.error = lambda message: sys.exit(f"grpo.py: error: {message}")  # one line, no usage
    cfg = Config(**vars(parser.parse_args(argv)))
    counts = ["num_generations", "prompts_per_step", "max_new_tokens", "num_thoughts", "steps",
              "num_answers", "max_answer_tokens", "num_rephrasings", "num_iterations",
              "micro_batch_size", "eval_samples"]
    rules = [(name, ">= 1", getattr(cfg, name) >= 1) for name in counts] + [
        ("lr", "> 0 and finite", 0 < cfg.lr < math.inf), ("temperature", "> 0", cfg.temperature > 0),
        ("max_grad_norm", "> 0", cfg.max_grad_norm > 0), ("beta", ">= 0", cfg.beta >= 0),
        ("warmup_steps", ">= 0", cfg.warmup_steps >= 0), ("epsilon", ">= 0", cfg.epsilon >= 0),
        ("epsilon_high", ">= 0", cfg.epsilon_high is None or cfg.epsilon_high >= 0),
        ("eval_limit", ">= 0", cfg.eval_limit >= 0),
        ("prompts_per_step", "divisible by the ranks",
         cfg.prompts_per_step % int(os.environ.get("WORLD_SIZE", 1)) == 0)]
    for name, rule, ok in rules:
        if not ok:
            raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be {rule}")
    if extract_answer(cfg.response_prefix, cfg.answer_from) is not None:
        raise UserError(f"--response-prefix {cfg.response_prefix!r} holds an answer: the reward "
                        f"would come from the prompt, not from the model")
    if cfg.variant == "ma" and "</think>" in cfg.response_prefix:
        raise UserError(f"--response-prefix {cfg.response_prefix!r} closes the thought, which "
                        f"--variant ma ends at the model's own </think>")
    if cfg.answer_from == "math-verify" and importlib.util.find_spec("math_verify") is None:
        raise UserError("--answer-from math-verify needs math_verify: pip install math-verify")
    return cfg

def load_jsonl(path) -> list[dict]:
    """A data file's examples; a bad line stops the run with its file:line."""
    if not Path(path).is_file():
        raise UserError(f"{path}: no such data file")
    examples = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            if line.strip():
                ex = json.loads(line)
                ex.setdefault("rephrasings", [])
                if not (all(isinstance(ex.get(k), str) and ex[k].strip() for k in ("question", "answer"))
                        and isinstance(ex["rephrasings"], list)
                        and all(isinstance(r, str) for r in ex["rephrasings"])):
                    raise ValueError('expected {"question": str, "answer": str, "rephrasings": [str]}')
                examples.append(ex)
        except (ValueError, RecursionError, AttributeError) as e:  # bad UTF-8 or JSON, a list
            raise UserError(f"{path}:{number}: {reason(e)}") from None
    if not examples:
        raise UserError(f"{path}: no examples")
    return examples

def reason(e: Exception) -> str:
    """The first line of an exception's message (its type when it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

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

def load_run(cfg: Config, device):
    """Policy, tokenizer, reference (β > 0), AdamW, warmup schedule, and the step to start from:
    the latest checkpoint's under --resume, else 0. state.pt is loaded with weights_only, so a
    run folder from elsewhere runs no code."""
    checkpoint, state = find_checkpoint(cfg), None
    if checkpoint:
        try:
            state = torch.load(checkpoint / "state.pt", weights_only=True)
        except Exception as e:
            raise UserError(f"--resume: {checkpoint / 'state.pt'} is not a checkpoint this file "
                            f"wrote ({reason(e)})") from None
        if state["step"] == cfg.steps and rank_and_world()[0] == 0:  # a requeue of a finished run
            print(f"grpo.py: the run in {cfg.out} finished at step {cfg.steps}; nothing to train")
    model, tokenizer = load_model(str(checkpoint or cfg.model), device)
    seen = tokenizer.decode(tokenizer(cfg.response_prefix, add_special_tokens=False,
                                      split_special_tokens=True).input_ids)
    if seen != cfg.response_prefix:  # the scorer reads the prefix as given: the model must too
        raise UserError(f"--response-prefix {cfg.response_prefix!r} reaches the model as {seen!r}")
    ref_model = None
    if cfg.beta > 0:  # the frozen starting policy
        ref_model = load_model(cfg.model, device)[0].eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    warmup = lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return model, tokenizer, ref_model, optimizer, scheduler, state["step"] if state else 0

# -----------------------------------------------------------------------------
# 8. Plumbing: the run folder, checkpoints and ranks.

def find_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint to continue from, or None to start. A folder holding a run is continued
    (--resume) or replaced (--overwrite), never reused; --resume without a checkpoint starts."""
    out = Path(cfg.out)
    saved = [p for p in out.glob("checkpoint-*") if p.suffix != ".tmp"]  # .tmp: a save that died
    if cfg.resume and saved:
        return max(saved, key=lambda p: int(p.name.split("-")[1]))
    held = sorted(p.name for p in [*out.glob("checkpoint-*"), out / "metrics.jsonl"] if p.exists())
    if held and not (cfg.overwrite or cfg.resume):
        raise UserError(f"--out {out} already holds a run ({', '.join(held)}); continue it with "
                        f"--resume or replace it with --overwrite")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return None

def open_log(cfg: Config, start: int):
    """A function that appends one JSON line to metrics.jsonl, on rank 0 only. A fresh run first
    removes an old run's files, now that its own checks passed. A resumed one cuts the log back to
    its size at the checkpoint, so that what it redoes is not there twice."""
    if rank_and_world()[0] != 0:
        return lambda record: None
    out = Path(cfg.out)
    if start == 0:
        for path in out.glob("checkpoint-*"):
            shutil.rmtree(path)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    else:
        size = torch.load(out / f"checkpoint-{start}" / "state.pt", weights_only=True)["log_size"]
        os.truncate(out / "metrics.jsonl", size)
    file = open(out / "metrics.jsonl", "a")
    return lambda record: (file.write(json.dumps(record) + "\n"), file.flush())

def save_checkpoint(cfg: Config, step: int, model, tokenizer, optimizer, scheduler):
    """On rank 0: out/checkpoint-<step> holds the model, tokenizer and state.pt (optimizer,
    schedule, step, the log's size). It is written as .tmp and renamed when complete, so a kill
    at any moment leaves the last complete one; then the older ones go."""
    out = Path(cfg.out)
    if rank_and_world()[0] != 0:
        return
    final, tmp = out / f"checkpoint-{step}", out / f"checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "log_size": (out / "metrics.jsonl").stat().st_size}, tmp / "state.pt")
    os.replace(tmp, final)
    for old in out.glob("checkpoint-*"):
        if old != final:
            shutil.rmtree(old)

def setup_ranks(cfg: Config) -> torch.device:
    """The device; under torchrun, join the process group: NCCL on GPUs, gloo on CPU."""
    device = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        # NCCL's default timeout, 10 minutes, would kill a long eval or a slow save on rank 0
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             timeout=datetime.timedelta(hours=2))
    return device

def rank_and_world() -> tuple[int, int]:
    """(this process's rank, the number of ranks): (0, 1) without torchrun."""
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

def all_reduce(values: list[float]) -> list[float]:
    """Sum numbers over the ranks; identity in one process. Every rank makes the same calls."""
    if not torch.distributed.is_initialized():
        return [float(v) for v in values]
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()

def mean_over_ranks(metrics: dict) -> dict:
    """Each metric tensor -> the mean of its elements on all ranks (NaN if none), one all_reduce."""
    sums = all_reduce([v.double().sum() for v in metrics.values()] +
                      [v.numel() for v in metrics.values()])
    n = len(metrics)
    return {k: sums[i] / sums[n + i] if sums[n + i] else math.nan for i, k in enumerate(metrics)}

def sum_gradients(model):
    """Sum the gradients over the ranks: the loss weights are shares of the global batch."""
    if torch.distributed.is_initialized():
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
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
