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
tokens, dapo's w, β = 0; K = M = 4 for ma; N = 3 for ta. One step in numbers: G = 4 completions
of 4, 4, 2 and 4 tokens score r = 1, 0, 0, 1, so A = ±0.87 (mean 0.5, unbiased std 0.577). Each
of the 14 tokens weighs w = 1/14, so ∂loss/∂logp_it = -w A_i = ∓0.062, as the test
test_update_works_one_grpo_step_by_hand checks against update's gradient.

The variants change the advantages A, the weights w and the contexts:

    grpo    A_i normalised within the G samples of a question     DeepSeekMath, arXiv 2402.03300
    lambda  w_it divided by |λ(i,t)|, the number of samples of    λ-GRPO, arXiv 2509.21154
            the group that share o_i's tokens 0..t
    ma      K thoughts per question, M answers per thought;       GRPO-MA, arXiv 2509.24494
            a thought's A from the mean reward V of its answers;
            thoughts and answers are two parts of the loss
    ta      q0 and N rephrasings of it, G samples each; A over    TA-GRPO, arXiv 2601.22478
            all (N+1)·G; every log-prob is taken given q0

Notation: a batch is B rows by C completion tokens; a context has L tokens; H is the hidden size;
T is the sampling temperature; generate draws n samples per prompt.

What the file simplifies: the sampler is a short KV-cache loop, not vLLM, and one process samples
and trains. π_old is the trainer's own forward pass, never the sampler's, so a mismatch between
the two (bf16 sampling, say) goes uncorrected. The reward reads one number or compares text;
--answer-from math-verify grades LaTeX. There is no LoRA: the reference is a full copy. GRPO-MA's
unclosed thoughts get no answers and value 0; its two loss parts are our reading, since the paper
publishes no weighting. TA-GRPO's rephrasings come from the data file. The learning rate warms
up, then stays constant. Sections 1 to 6 are the algorithm; 7 and 8 are plumbing.
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

    To copy GRPO-MA, also take rollout_ma's rows: an answer's context is its prompt, then its
    thought, and thoughts and answers are two loss parts, each aggregated alone.
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

    To copy TA-GRPO, also take every log-prob given q0, as rollout_ta's contexts do. At μ = 1 this
    trains π(· | q0) on samples drawn from π(· | q_j), with no importance weight. So it is biased
    on purpose: the rephrasings explore solutions that q0 rarely gets, and q0's answers move toward
    them. The paper's v5 anchors so (arxiv.org/abs/2601.22478v5). --ta-anchor rephrased keeps
    each response's own prompt, as its code does (github.com/lhkhiem28/TA-GRPO).
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
    The normaliser stays the raw token count, as in the paper. Memory: ~4·B·G·C bytes.
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
# narrow: what it cannot read is a miss, never a guess, since the policy is trained toward a false
# positive. Model output is text: it is read, never run.

# a plain decimal: commas only as thousands separators; no exponent, no fraction
NUMBER_RE = re.compile(r"[-+]?(?:(?:[1-9][0-9]{0,2}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)")
PROSE = ".,;:!?'\"*"  # what may touch a number besides letters: punctuation, markdown's bold

def score(text: str, reference: str, finished: bool, answer_from: str = "tags") -> float:
    """1.0 if the completion finished with EOS and its answer equals the reference, else 0.0.
    The answer comes after the first </think>; a thought that never closes holds none.
    - tags: what the last <answer>...</answer> holds.
    - last-number: the last number, when only words, prose punctuation or "=" stand around it.
    - math-verify: the tags' answer, graded against the reference as LaTeX by math_verify.
    Both sides lose whitespace, $, a final period and one \\boxed{} around all. A numeric reference
    then wants a plain number of its value: '1,234.0' equals '1234'. Any other wants the same
    text: '3\\pi' equals '3 \\pi'. So '2x', '-\\frac{1}{2}' and '18 eggs' miss 2, -0.5 and 18."""
    answer = extract_answer(text, answer_from)
    if not finished or answer is None:
        return 0.0
    if answer_from == "math-verify":
        from math_verify import parse, verify  # parse_args made sure it is installed
        return float(verify(parse(f"${reference}$"), parse(f"${answer}$")))
    plain = lambda s: re.sub(r"^\\boxed\{(.*)\}$", r"\1", re.sub(r"\s|\\?\$", "", s).rstrip("."))
    value = lambda s: (Fraction(s.replace(",", "")) if len(s) < 100 and NUMBER_RE.fullmatch(s)
                       else None)  # int() refuses a number of over 4300 digits
    answer, reference = plain(answer).strip("*"), plain(reference)
    return float(value(answer) == value(reference) if value(reference) is not None
                 else answer == reference)

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

def score_batch(tokenizer, samples, references, answer_from="tags", before=""):
    """(B,) rewards of generate's Samples. Each text is scored after `before`: the response
    prefix, and for a GRPO-MA answer its thought."""
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
    prefix = tokenizer(response_prefix, add_special_tokens=False, split_special_tokens=True)
    return tokenizer(text, add_special_tokens=False).input_ids + prefix.input_ids

def left_pad(seqs: list[list[int]], pad_id: int):
    """Lists of ids -> (B, L) ids and attention mask, padded on the left."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):], mask[i, L - len(s):] = torch.tensor(s, dtype=torch.long), 1
    return ids, mask

def run_decoder(model, input_ids, attention_mask, cache=None):
    """The decoder's last hidden states (B, S, H) for S new tokens (B, S), before the lm_head.
    They follow the tokens already in `cache`, a DynamicCache that grows in place. The attention
    mask covers both, with 0 for padding anywhere."""
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

        prefill     one pass over the left-padded prompts; each one's KV cache and last
                    logits are copied to its n rows
        each step   token = a draw from the logits; the rows that ended leave the batch and
                    the cache; logits = lm_head(decoder(token, cache)) for the rest

    Row r of the cache, the mask, token and logits is output row active[r]."""
    device, pad = next(model.parameters()).device, tokenizer.pad_token_id
    if not prompts:  # a rank whose GRPO-MA thoughts all stayed open samples no answers
        return Samples(*[torch.zeros(0, 0, dtype=torch.long)] * 2, torch.zeros(0, dtype=torch.bool))
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
    eos = torch.tensor(eos_ids(model, tokenizer), device=device)
    B, active = len(index), torch.arange(len(index), device=device)  # rows still being decoded
    out, texts = torch.full((B, max_new_tokens), pad, device=device), [""] * B
    lengths, finished = torch.zeros_like(index), torch.zeros_like(index, dtype=torch.bool)
    for t in range(max_new_tokens):
        probs = (logits / temperature).softmax(-1)
        token = logits.argmax(-1) if greedy else torch.multinomial(probs, 1).squeeze(-1)
        out[active, t] = token  # token, ended: (len(active),), one per row still decoded
        lengths[active] += 1
        ended = torch.isin(token, eos)
        finished[active[ended]] = True
        if stop_strings:  # each row's text so far; a token may carry text past the string
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
    return Samples(out[:, :C], (torch.arange(C, device=device) < lengths[:, None]).long(), finished)

# -----------------------------------------------------------------------------
# 4. The rows every variant produces, and one rollout per variant. A rollout samples and scores
# this rank's share of a batch and returns (Rows, metrics); a metric is a tensor, logged as its
# mean over all ranks. To add one, copy rollout_grpo and add it to ROLLOUTS and --variant's
# choices. cfg is section 7's Config: cfg.num_generations is the flag --num-generations.

@dataclass
class Rows:
    """What a rollout hands to update(): B completions, each with its context, advantage and
    token weights. A row adds Σ_t w_t min(ρ_t A, clip(ρ_t) A) to J, and the rollout sets A and w.
    So a rollout states its scheme's whole objective, and update() knows no variant.

        context              completion     advantage        weights w                scheme
        q's prompt           o_i            A_i              1 / (all tokens)         grpo
        q's prompt           o_i            A_i              1 / (all tokens) / |λ|   lambda
        prompt + thought k   answer k,m     A(a_k,m)         1 / (answer tokens)      ma
        q0's prompt          o_i, from q1   A_i              1 / (all tokens)         ta
        any                  o_i            A_it, per token  any                      yours
    """
    contexts: list[list[int]]      # B lists of token ids: what each completion continues
    completion_ids: torch.Tensor   # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) 1 up to and including EOS or the stop string
    advantages: torch.Tensor       # (B,) one per row, or (B, C) one per token, 0 off the mask
    loss_weights: torch.Tensor     # (B, C) each token's w in J over the whole batch, all ranks
    rewards: torch.Tensor          # (B,) shown by --log-completions; an MA thought's is its V

def batch_weights(completion_mask, loss_type: str, max_completion_length: int):
    """aggregation_weights (B, C) of this rank's rows, with the rows and tokens of all ranks."""
    rows, tokens = all_reduce([len(completion_mask), completion_mask.sum()])
    return aggregation_weights(completion_mask, loss_type, rows, tokens, max_completion_length)

def no_signal(advantages, groups, num_groups: int):
    """(num_groups,) True where every row of the group has A = 0: frac_reward_zero_std's cases."""
    nonzero = ((advantages[:, None] if advantages.dim() == 1 else advantages) != 0).any(1)
    return torch.zeros(num_groups).index_add(0, groups, nonzero.float()) == 0

def rollout_grpo(model, tokenizer, cfg, batch: list[dict]):
    """GRPO and λ-GRPO: G completions per prompt, advantages normalised within each group. Under
    lambda each token's w is also divided by |λ|. Both log the mean |λ| over tokens."""
    G = cfg.num_generations
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
               for ex in batch]
    s = generate(model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature)
    ids, mask = s.completion_ids.cpu(), s.completion_mask.cpu()  # (P·G, C)
    references = [ex["answer"] for ex in batch for _ in range(G)]
    rewards = score_batch(tokenizer, s, references, cfg.answer_from, cfg.response_prefix)
    group = torch.arange(len(batch)).repeat_interleave(G)  # (P·G,) each row's prompt
    advantages = group_advantages(rewards, group, cfg.scale_rewards)
    inv_lambda = lambda_weights(ids, mask, G)
    weights = batch_weights(mask, cfg.loss_type, cfg.max_new_tokens)
    weights = weights * inv_lambda if cfg.variant == "lambda" else weights
    metrics = dict(reward=rewards, frac_reward_zero_std=no_signal(advantages, group, len(batch)),
                   completion_length=mask.sum(1).float(), lambda_mean=1 / inv_lambda[mask.bool()])
    return Rows([prompts[p] for p in group], ids, mask, advantages, weights, rewards), metrics

def rollout_ma(model, tokenizer, cfg, batch: list[dict]):
    """GRPO-MA: K thoughts per prompt, each ending at the token that completes </think>, then M
    answers per closed thought; ma_advantages scores the tree. An answer is sampled after prompt
    + thought and scored on prefix + thought + answer. An open thought gets no answers: V = 0.
    The rows, for K = 2, M = 2 and thought 1 left open (w: under --ma-weighting parts):

        row  context             completion        advantage  w
        0    prompt              thought 0         A(th_0)    1 / (all thought tokens)
        1    prompt              thought 1 (open)  A(th_1)    1 / (all thought tokens)
        2    prompt + thought 0  answer 0,0        A(a_0,0)   1 / (all answer tokens)
        3    prompt + thought 0  answer 0,1        A(a_0,1)   1 / (all answer tokens)

    The thoughts' w sum to 1 and the answers' to 1: J = J(thoughts) + J(answers), so M answers
    do not outweigh their thought. --ma-weighting tokens pools both in one mean instead."""
    K, M = cfg.num_thoughts, cfg.num_answers
    prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
               for ex in batch]
    th = generate(model, tokenizer, prompts, K, cfg.max_new_tokens, cfg.temperature,
                  stop_strings=["</think>"])
    thought_texts = decode(tokenizer, th.completion_ids, th.completion_mask)
    thought_prompt = torch.arange(len(batch)).repeat_interleave(K)  # (P·K,) each thought's prompt
    closed = torch.tensor(["</think>" in text for text in thought_texts])  # (P·K,)
    answer_thought = closed.nonzero().squeeze(1).repeat_interleave(M)  # (A,) each answer's thought
    contexts = [prompts[thought_prompt[k]] + th.completion_ids[k, :th.completion_mask[k].sum()]
                .tolist() for k in answer_thought]  # (A,) prompt + thought
    ans = generate(model, tokenizer, contexts[::M], M, cfg.max_answer_tokens, cfg.temperature)
    references = [batch[thought_prompt[k]]["answer"] for k in answer_thought]
    before = [cfg.response_prefix + thought_texts[k] for k in answer_thought]
    rewards = score_batch(tokenizer, ans, references, cfg.answer_from, before)  # (A,)
    thought_adv, answer_adv, values = ma_advantages(rewards, answer_thought, thought_prompt,
                                                    cfg.scale_rewards)
    ids = pad_sequence([*th.completion_ids, *ans.completion_ids], True, tokenizer.pad_token_id)
    mask = pad_sequence([*th.completion_mask, *ans.completion_mask], True).cpu()  # (P·K + A, C)
    answer = torch.arange(len(mask)) >= len(thought_texts)  # (P·K + A,) the answers' rows
    if cfg.ma_weighting == "parts":  # each part aggregated alone, with its own length limit
        weights = torch.zeros(mask.shape)
        weights[~answer] = batch_weights(mask[~answer], cfg.loss_type, cfg.max_new_tokens)
        weights[answer] = batch_weights(mask[answer], cfg.loss_type, cfg.max_answer_tokens)
    else:
        limit = max(cfg.max_new_tokens, cfg.max_answer_tokens)
        weights = batch_weights(mask, cfg.loss_type, limit)
    metrics = dict(reward=rewards, completion_length=mask[answer].sum(1).float(),
                   frac_reward_zero_std=no_signal(answer_adv, thought_prompt[answer_thought], len(batch)),
                   thought_value=values, unclosed_thoughts=~closed,
                   frac_value_zero_std=(thought_adv.view(-1, K) == 0).all(1))
    rows = Rows([prompts[p] for p in thought_prompt] + contexts, ids.cpu(), mask,
                torch.cat([thought_adv, answer_adv]), weights, torch.cat([values, rewards]))
    return rows, metrics

def rollout_ta(model, tokenizer, cfg, batch: list[dict]):
    """TA-GRPO: each question q0 with up to N of its rephrasings, drawn afresh each step, and G
    responses to each phrasing. Advantages are normalised over the question's (N+1)·G responses.
    --ta-anchor original takes every log-prob given q0: ta_advantages says why.

        rows  sampled after  context: original / rephrased   group     (N = 1, G = 2)
        0, 1  q0             q0 / q0                          0
        2, 3  q1             q0 / q1                          0"""
    G, N = cfg.num_generations, cfg.num_rephrasings
    phrasings, question, first = [], [], []  # per phrasing: its ids, its question, is it q0
    for p, ex in enumerate(batch):
        drawn = [ex["rephrasings"][i] for i in torch.randperm(len(ex["rephrasings"]))[:N]]
        for j, text in enumerate([ex["question"]] + drawn):
            phrasings.append(prompt_ids(tokenizer, text, cfg.system_prompt, cfg.response_prefix))
            question, first = question + [p], first + [j == 0]
    s = generate(model, tokenizer, phrasings, G, cfg.max_new_tokens, cfg.temperature)
    group = torch.tensor(question).repeat_interleave(G)  # (B,) each row's question: its group
    from_q0 = torch.tensor(first).repeat_interleave(G)  # (B,) the rows sampled after q0
    rewards = score_batch(tokenizer, s, [batch[p]["answer"] for p in group], cfg.answer_from,
                          cfg.response_prefix)
    advantages = ta_advantages(rewards, group, cfg.scale_rewards)
    contexts = [ids for ids in phrasings for _ in range(G)]  # each row's own phrasing
    if cfg.ta_anchor == "original":  # the paper: every response's context is its question's q0
        q0 = [ids for ids, is_q0 in zip(phrasings, first) if is_q0]
        contexts = [q0[p] for p in group]
    mask, r0 = s.completion_mask.cpu(), rewards[from_q0].view(-1, G)  # r0: q0's own G rewards
    metrics = dict(reward=rewards, frac_reward_zero_std=no_signal(advantages, group, len(batch)),
                   completion_length=mask.sum(1).float(), reward_q0=r0,
                   reward_rephrased=rewards[~from_q0], frac_reward_zero_std_q0=r0.amax(1) == r0.amin(1))
    weights = batch_weights(mask, cfg.loss_type, cfg.max_new_tokens)
    return Rows(contexts, s.completion_ids.cpu(), mask, advantages, weights, rewards), metrics

ROLLOUTS = {"grpo": rollout_grpo, "lambda": rollout_grpo, "ma": rollout_ma, "ta": rollout_ta}

# -----------------------------------------------------------------------------
# 5. The update: Rows from any rollout -> micro-batches of b rows -> completion_logps (b, C) ->
# policy_loss -> backward; then the gradients summed over the ranks, clipped, optimizer.step.

def completion_logps(model, contexts: list[list[int]], completion_ids, completion_mask,
                     temperature: float):
    """(B, C) log softmax(logits / T) of each completion token given its context and the tokens
    before it, 0 off the mask. One forward pass over context + completion, no KV cache:

        input       pad p1 p2 p3 | t1 t2 pad      the context left-padded to L tokens,
        mask         0  1  1  1  |  1  1  0       the completion right-padded
        predicts             t1  | t2 -           position L-1 predicts completion token 0
    """
    width = int(completion_mask.sum(1).max())  # the columns past it hold only padding
    ids, mask = completion_ids[:, :width], completion_mask[:, :width]
    context_ids, context_mask = (x.to(ids.device) for x in left_pad(contexts, 0))
    hidden = run_decoder(model, torch.cat([context_ids, ids], 1),
                         torch.cat([context_mask, mask], 1))  # (B, L + width, H)
    L = context_ids.shape[1]
    logps = token_logps(model.lm_head, hidden[:, L - 1:-1], ids, mask, temperature)
    return torch.nn.functional.pad(logps, (0, completion_ids.shape[1] - width))

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
    The weights w count the whole batch on all ranks, so a micro-batch's loss is its piece of -J,
    and the pieces summed over micro-batches and ranks are -J. backward() adds up a rank's
    gradients, sum_gradients the ranks'. At μ = 1 the logged loss is -Σ w A, which says little
    about progress: watch the reward. test_update_works_one_grpo_step_by_hand checks a step."""
    device, mu_1, size = next(model.parameters()).device, cfg.num_iterations == 1, cfg.micro_batch_size
    micro = [slice(i, i + size) for i in range(0, len(rows.contexts), size)]
    on = lambda x, s: x[s].to(device)
    logps_of = lambda m, s: completion_logps(m, rows.contexts[s], on(rows.completion_ids, s),
                                             on(rows.completion_mask, s), cfg.temperature)
    with torch.no_grad():  # π_old's log-probs at μ > 1 (at μ = 1 it is π itself); the reference's
        old = None if mu_1 else [logps_of(model, s) for s in micro]
        ref = [logps_of(ref_model, s) for s in micro] if cfg.beta else None
    totals, grad_norms = {"loss": 0.0}, []
    for _ in range(cfg.num_iterations):
        for j, s in enumerate(micro):
            logps = logps_of(model, s)  # (b, C)
            loss, metrics = policy_loss(
                logps, logps.detach() if mu_1 else old[j], on(rows.advantages, s),
                on(rows.completion_mask, s), on(rows.loss_weights, s), ref and ref[j], cfg.beta,
                cfg.epsilon, cfg.epsilon_high)
            loss.backward()
            totals["loss"] += loss.item()
            for key, value in metrics.items():  # token means, summed as token totals
                totals[key] = totals.get(key, 0.0) + value.item() * rows.completion_mask[s].sum()
        sum_gradients(model)
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        if not grad_norms[-1].isfinite():
            raise UserError(f"the gradient norm is {grad_norms[-1]:.0f}: no update; lower --lr")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    *sums, tokens = all_reduce([*totals.values(), rows.completion_mask.sum()])
    means = {k: v / cfg.num_iterations / (1 if k == "loss" else tokens) for k, v in zip(totals, sums)}
    return means | {"grad_norm": torch.stack(grad_norms).mean().item()}

# -----------------------------------------------------------------------------
# 6. The training loop and the eval.

def train(cfg) -> dict:
    """Train as configured; rank 0 returns the summary, the first eval and the last.

        eval the starting policy, unless the run resumes
        each step: draw the batch and a seed, roll out, update, log; eval and save when due
    """
    device = setup_ranks()
    rank, W = rank_and_world()
    examples, test_examples = load_jsonl(cfg.data), load_jsonl(cfg.test_data)[:cfg.eval_limit or None]
    if len(examples) < cfg.prompts_per_step:
        raise UserError(f"{cfg.data}: {len(examples)} examples, fewer than --prompts-per-step")
    checkpoint, state, log = open_run(cfg)  # log() appends a line to metrics.jsonl on rank 0
    model, tokenizer, ref_model, optimizer, scheduler = load_run(cfg, device, checkpoint, state)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    evaluation = lambda: evaluate(model, tokenizer, test_examples, cfg, cfg.seed + 12345)
    if state is None:
        with autocast:
            log({"step": 0, "eval": evaluation()})
    P, t0 = cfg.prompts_per_step, time.time()
    for step in tqdm(range(state["step"] if state else 0, cfg.steps), disable=rank != 0):
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
    """Greedy accuracy, and pass@k for k = 1..n from n = --eval-samples samples per held-out
    question at the training temperature. Chunk c of max_rows samples is seeded with seed + c
    and sampled by rank c % W, as one process would. GRPO-MA's eval samples plain completions."""
    n, (rank, W) = cfg.eval_samples, rank_and_world()
    limit = cfg.max_new_tokens + (cfg.max_answer_tokens if cfg.variant == "ma" else 0)
    size, greedy, pass_k = max(1, max_rows // n), 0.0, [0.0] * n  # sums over this rank's chunks
    for c, start in enumerate(range(0, len(examples), size)):
        if c % W == rank:
            torch.manual_seed(seed + c)
            prompts = [prompt_ids(tokenizer, ex["question"], cfg.system_prompt, cfg.response_prefix)
                       for ex in examples[start:start + size]]
            references = [ex["answer"] for ex in examples[start:start + size]]
            s = generate(model, tokenizer, prompts, 1, limit, greedy=True)
            greedy += score_batch(tokenizer, s, references, cfg.answer_from, cfg.response_prefix).sum()
            s = generate(model, tokenizer, prompts, n, limit, cfg.temperature)
            rewards = score_batch(tokenizer, s, [a for a in references for _ in range(n)],
                                  cfg.answer_from, cfg.response_prefix)
            for c in rewards.view(len(prompts), n).sum(1).long().tolist():  # c: correct samples
                pass_k = [total + pass_at_k(n, c, k + 1) for k, total in enumerate(pass_k)]
    greedy, *pass_k = all_reduce([greedy, *pass_k])
    return {"greedy": greedy / len(examples)} | {
        f"pass@{k + 1}": total / len(examples) for k, total in enumerate(pass_k)}

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of n samples, c correct, as Chen et al. 2021: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))

def show_group(tokenizer, rows: Rows, question: str, step: int):
    """Print the rows after the first row's context: reward, advantage (a token mean), text."""
    shown = [i for i, context in enumerate(rows.contexts) if context == rows.contexts[0]]
    mask, adv = rows.completion_mask[shown], rows.advantages[shown]
    adv = adv if adv.dim() == 1 else (adv * mask).sum(1) / mask.sum(1)
    texts = decode(tokenizer, rows.completion_ids[shown], mask)
    tqdm.write("\n".join([f"step {step}: {question!r}", "  reward  advantage  completion"] + [
        f"  {r:6.2f}  {a:+9.2f}  {text[:70]!r}" for r, a, text in zip(rows.rewards[shown], adv, texts)]))

def summary(cfg, wall_s: float) -> dict:
    """Print the first eval against the last, both read from metrics.jsonl, and return them."""
    lines = (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()
    evals = [record["eval"] for record in map(json.loads, lines) if "eval" in record]
    shown = dict.fromkeys(["greedy", "pass@1", f"pass@{cfg.eval_samples}"])  # a resume may change n
    print(f"{cfg.variant}: " + " | ".join(f"{k} {evals[0].get(k, math.nan):.3f} -> {evals[-1][k]:.3f}"
                                           for k in shown) + f" | {wall_s:.0f} s")
    return {"variant": cfg.variant, "steps": cfg.steps, "before": evals[0], "after": evals[-1]}

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
    ma_weighting: Literal["parts", "tokens"] = _opt("parts", "(ma) a mean per part, or one mean")
    num_rephrasings: int = _opt(3, "N (ta): rephrasings per question, drawn each step")
    ta_anchor: Literal["original", "rephrased"] = _opt("original", "(ta) log-probs given q0 or not")
    # loss and optimisation
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = _opt("dapo", "token aggregation, as TRL's")
    scale_rewards: Literal["group", "none"] = _opt("group", "divide by the std; none: Dr. GRPO")
    beta: float = _opt(0.0, "k3 KL coefficient; a reference is loaded only when > 0")
    epsilon: float = _opt(0.2, "clip range of the ratio, and its upper one by default")
    epsilon_high: float | None = _opt(None, "upper clip range; DAPO's is 0.28")
    num_iterations: int = _opt(1, "mu: updates per sampled batch")
    answer_from: Literal["tags", "last-number", "math-verify"] = _opt("tags", "see score()")
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
    """Config from the command line; a value that would crash or train wrong stops here."""
    parser = HfArgumentParser(Config, description="GRPO and variants.", allow_abbrev=False)
    parser.error = lambda message: sys.exit(f"grpo.py: error: {message}")  # one line, no usage
    cfg = Config(**vars(parser.parse_args(argv)))
    counts = ["num_generations", "prompts_per_step", "max_new_tokens", "num_thoughts", "steps",
              "num_answers", "max_answer_tokens", "num_rephrasings", "num_iterations",
              "micro_batch_size", "eval_samples"]
    for name, rule, ok in [(name, ">= 1", getattr(cfg, name) >= 1) for name in counts] + [
            ("lr", "> 0", 0 < cfg.lr < math.inf), ("temperature", "> 0", cfg.temperature > 0),
            ("max_grad_norm", "> 0", cfg.max_grad_norm > 0), ("beta", ">= 0", cfg.beta >= 0),
            ("warmup_steps", ">= 0", cfg.warmup_steps >= 0), ("epsilon", ">= 0", cfg.epsilon >= 0),
            ("epsilon_high", ">= 0", (cfg.epsilon_high or 0) >= 0),
            ("eval_limit", ">= 0", cfg.eval_limit >= 0), ("prompts_per_step", "divisible by "
             "the ranks", cfg.prompts_per_step % int(os.environ.get("WORLD_SIZE", 1)) == 0)]:
        if not ok:
            raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be {rule}")
    if extract_answer(cfg.response_prefix, cfg.answer_from) is not None or (
            cfg.variant == "ma" and "</think>" in cfg.response_prefix):
        raise UserError(f"--response-prefix {cfg.response_prefix!r} holds an answer, or under ma "
                        f"closes the thought: the reward would not come from the model")
    if cfg.answer_from == "math-verify" and importlib.util.find_spec("math_verify") is None:
        raise UserError("--answer-from math-verify needs math_verify: pip install math-verify")
    return cfg

def load_jsonl(path) -> list[dict]:
    """A data file's {"question": str, "answer": str, "rephrasings": [str]} lines, rephrasings
    optional; a bad line stops the run with its file:line."""
    examples = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            ex = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, nesting too deep
            raise UserError(f"{path}:{number}: {reason(e)}") from None
        if ex is not None and not (isinstance(ex, dict) and isinstance(
                ex.setdefault("rephrasings", []), list) and all(isinstance(s, str) and s.strip() for s
                                                                 in [ex.get("question"), ex.get("answer"), *ex["rephrasings"]])):
            raise UserError(f'{path}:{number}: expected {{"question": str, "answer": str, '
                            f'"rephrasings": [str]}}')
        examples += [ex] if ex is not None else []
    if not examples:
        raise UserError(f"{path}: no examples")
    return examples

def reason(e: Exception) -> str:
    """The first line of an exception's message (its type when it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

def load_model(path: str, device):
    """Model and tokenizer from a local folder or the hub; fp32, left padding, a pad token."""
    transformers.utils.logging.set_verbosity_error()  # no loading bars and notices
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as e:  # a missing, corrupt or empty file: say which folder, in one line
        raise UserError(f"--model {path}: cannot load a model and tokenizer ({reason(e)})") from None
    if tokenizer.pad_token is None:  # Llama: pad with eos; the completion mask never relies on pad
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer

def load_run(cfg: Config, device, checkpoint: Path | None, state: dict | None):
    """Policy and tokenizer, from the checkpoint if any; the reference when β > 0; AdamW and the
    warmup schedule, with the checkpoint's state."""
    model, tokenizer = load_model(str(checkpoint or cfg.model), device)
    ref_model = load_model(cfg.model, device)[0].eval().requires_grad_(False) if cfg.beta else None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    warmup = lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return model, tokenizer, ref_model, optimizer, scheduler

# -----------------------------------------------------------------------------
# 8. Plumbing: the run folder, checkpoints and ranks.

def open_run(cfg: Config):
    """(checkpoint, state, log). Under --resume, the latest checkpoint and its state.pt, loaded
    with weights_only so that a folder from elsewhere runs no code; else None, None. log()
    appends a JSON line to metrics.jsonl on rank 0. A folder holding a run is continued (--resume)
    or replaced (--overwrite), never reused. A resumed log is cut back to its size at the
    checkpoint, so that the steps the run redoes are not there twice."""
    out, main_rank = Path(cfg.out), rank_and_world()[0] == 0
    held = sorted([*out.glob("checkpoint-*"), *out.glob("metrics.jsonl")])
    saved = sorted((p for p in held if p.name[11:].isdigit()), key=lambda p: int(p.name[11:]))
    if held and not (cfg.resume or cfg.overwrite):
        raise UserError(f"--out {out} already holds a run ({', '.join(p.name for p in held)}); "
                        f"continue it with --resume or replace it with --overwrite")
    checkpoint, state = (saved[-1], None) if cfg.resume and saved else (None, None)
    if checkpoint:
        try:
            state = torch.load(checkpoint / "state.pt", weights_only=True)
        except Exception as e:
            raise UserError(f"--resume: {checkpoint / 'state.pt'} is not a checkpoint this file "
                            f"wrote ({reason(e)})") from None
    if not main_rank:
        return checkpoint, state, lambda record: None
    for path in held if not checkpoint else []:  # a fresh run replaces an old one
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    file = open(out / "metrics.jsonl", "a")
    file.truncate(state["log_size"] if state else 0)
    return checkpoint, state, lambda record: (file.write(json.dumps(record) + "\n"), file.flush())

def save_checkpoint(cfg: Config, step: int, model, tokenizer, optimizer, scheduler):
    """On rank 0: out/checkpoint-<step> holds the model, tokenizer and state.pt (AdamW, schedule,
    step, the log's size). It is written as .tmp and renamed when complete, so a kill at any
    moment leaves the last complete one; then the older ones go."""
    out, final = Path(cfg.out), Path(cfg.out) / f"checkpoint-{step}"
    if rank_and_world()[0] == 0:
        tmp = final.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "step": step, "log_size": (out / "metrics.jsonl").stat().st_size}, tmp / "state.pt")
        os.replace(tmp, final)
        for old in set(out.glob("checkpoint-*")) - {final}:
            shutil.rmtree(old)

def setup_ranks() -> torch.device:
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

def all_reduce(values: list) -> list[float]:
    """Sum numbers over the ranks; identity in one process. Every rank makes the same calls."""
    values = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if torch.distributed.is_initialized():
        values = values.to("cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
        torch.distributed.all_reduce(values)
    return values.tolist()

def mean_over_ranks(metrics: dict) -> dict:
    """Each metric tensor -> the mean of its elements on all ranks (NaN if none), one all_reduce."""
    sums = all_reduce([v.double().sum() for v in metrics.values()] + [v.numel() for v in metrics.values()])
    n = len(metrics)
    return {k: sums[i] / sums[n + i] if sums[n + i] else math.nan for i, k in enumerate(metrics)}

def sum_gradients(model):
    """Sum the gradients over the ranks: the loss weights are shares of the global batch."""
    for p in model.parameters() if torch.distributed.is_initialized() else []:
        if p.requires_grad:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            torch.distributed.all_reduce(p.grad)

def main(argv=None):
    """The command line: bad flags, files or data stop with one line that names them."""
    try:
        return train(parse_args(argv))
    except (UserError, OSError) as e:  # OSError: a missing data file, an --out not writable
        sys.exit(f"grpo.py: error: {e}")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main()
