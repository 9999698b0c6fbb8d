"""grpo.py: GRPO and three recent variants of it, in one file to read from top to bottom.

    python grpo.py                  # GRPO on the tiny model in data/: CPU, offline, ~1 min
    python grpo.py --variant ma     # or ta; --lambda-weights with any; README.md: real models

By default a step optimises GRPO's clipped objective with DAPO's token mean (--loss-type dapo),
no KL term (β = 0) and one update per batch (μ = 1). So the ratio ρ is 1, the clip never binds,
and a step is a policy gradient with a group-normalised baseline. DeepSeekMath's setting is
--loss-type grpo --beta 0.04, and --num-iterations 2 or more makes the clip bind.

One GRPO step, as train runs it:
    draw P questions from the data                                    train
    for each question q: o_1..o_G = G samples from π(· | q)          generate
    r_i = score(o_i, the reference answer of q)                       score
    A_i = (r_i - mean(r)) / (std(r) + eps) over the G samples of q    group_advantages
    w_it = 1 / (all completion tokens of the batch)                   batch_weights
    repeat μ times:
        logp_it = log π(o_it | q, o_i<t)                              completion_logps
        ρ_it = exp(logp_it - logp_old_it)                             policy_loss
        loss = -Σ_it w_it min(ρ_it A_i, clip(ρ_it, 1-ε, 1+ε) A_i) + β Σ_it w_it KL_it
        loss.backward(); clip the gradient norm; optimizer.step()     update
    KL_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1 is Schulman's k3 estimator of the KL
    divergence to the reference, a frozen copy of the model.

Each variant changes what a row holds, which is its context, its advantage A and its weights w.
data/one-step.png draws one step of each: its rows, token by token, coloured by each token's w·A.
    grpo    G samples of q; A normalised within them                DeepSeekMath, arXiv 2402.03300
    ma      K thoughts of q, M answers to each; A(th) from V(th)    GRPO-MA, arXiv 2509.24494
    ta      q0 and N rephrasings, G each; A over all; given q0      TA-GRPO, arXiv 2601.22478
    --lambda-weights, with any of them: w_it divided by |λ(i,t)|   λ-GRPO, arXiv 2509.21154
    --dynamic-sampling, with any: drop questions without signal    DAPO, arXiv 2503.14476

Each symbol has one meaning:
    B rows in a batch, C completion tokens per row, W ranks, T the temperature
    P questions per step (16 by default), G samples per question (8 by default)
    K thoughts per question, M answers per thought (ma, 4 and 4), N rephrasings of q0 (ta, 3)
    A advantage, V a thought's value, w a token's weight, J the objective, ρ the ratio, ε the clip
    β the KL coefficient, μ updates per batch, λ(i,t) the rows that share o_i's prefix up to t
    group: the rows whose advantages are normalised together: a question's G samples (grpo), its
        (N+1)·G responses (ta), its K thoughts or its K·M answers (ma)
    context: the token ids that a completion continues, a prompt or under ma a prompt + thought
    part: a term of J that is a token mean of its own; ma has two (thoughts, answers), others one
    swapped context: a row's, if it trains given another context than it was sampled after (ta)

What the file simplifies. One process samples, with a short KV-cache loop, and trains. π_old's
log-probs come from the trainer's own forward pass. There is no LoRA, so the reference is a full
copy of the model. The weighting of GRPO-MA's two loss parts is our reading of the paper, and
TA-GRPO's rephrasings come from the data file."""

import functools, json, math, os, random, re, runpy, shutil, sys, time
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Literal, NamedTuple

import torch, transformers
from tqdm import tqdm

# 0. The knobs, first as in nanoGPT. Each is a flag: num_generations is --num-generations.
@dataclass
class Config:
    model: str = str(Path(__file__).parent / "data/tiny")  # a local folder or a hub name
    data: str = str(Path(__file__).parent / "data/train.jsonl")  # see load_jsonl
    system_prompt: str = "reply <think>...</think><answer>...</answer>"  # '' for none
    response_prefix: str = ""  # what the reply starts with, such as <think>; part of the prompt
    variant: Literal["grpo", "ma", "ta"] = "grpo"
    lambda_weights: bool = False  # λ-GRPO's w / |λ(i,t)|, with any variant
    dynamic_sampling: bool = False  # DAPO's: drop questions without signal, draw more of them
    max_gen_batches: int = 10  # draws of P questions per step at most, with --dynamic-sampling
    num_generations: int = 8  # G, completions per prompt, or per phrasing under ta
    prompts_per_step: int = 16  # P, over all ranks
    max_new_tokens: int = 32  # the completion's length limit; under ma the thought's
    temperature: float = 1.0  # of the sampling, and so of the log-probs
    num_thoughts: int = 4  # K (ma)
    num_answers: int = 4  # M (ma): answers per thought
    max_answer_tokens: int = 24  # (ma)
    ma_weighting: Literal["parts", "tokens"] = "parts"  # (ma) a mean per part, or one mean
    num_rephrasings: int = 3  # N (ta), drawn afresh each step
    ta_anchor: Literal["original", "rephrased"] = "original"  # (ta) log-probs given q0, or not
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "dapo"  # the aggregation w, as TRL's
    scale_rewards: Literal["group", "none"] = "group"  # divide A by the std; none as Dr. GRPO
    beta: float = 0.0  # the k3 KL's coefficient; a reference is loaded only when > 0
    epsilon: float = 0.2  # the clip range, and its upper side unless epsilon_high is given
    epsilon_high: float | None = None  # DAPO's is 0.28
    num_iterations: int = 1  # μ, updates per sampled batch
    reward_fn: str = ""  # FILE.py:NAME, a reward function called as TRL calls one; default correct
    lr: float = 2e-4  # AdamW's; ~1e-6 for real models
    warmup_steps: int = 10  # linear warmup, then constant
    max_grad_norm: float = 1.0
    seed: int = 0
    autocast: Literal["auto", "bf16", "off"] = "auto"  # of every forward pass; auto: bf16 on CUDA
    micro_batch_tokens: int = 1024  # padded tokens per forward and backward pass of the update
    gradient_checkpointing: bool = False  # less activation memory for more compute
    steps: int = 100
    test_data: str = str(Path(__file__).parent / "data/test.jsonl")  # held out, for the eval
    eval_every: int = 50  # 0 for the start and the end only
    eval_samples: int = 8  # n per held-out question, for pass@1..n
    eval_limit: int = 0  # the eval's questions: the first N of --test-data; 0 for all
    eval_batch_tokens: int = 32768  # the eval's KV cache: rows sampled at once × their length
    log_completions: int = 25  # print a group as text every N steps; 0 for never
    save_every: int = 50  # 0 for the end only
    out: str = "out"  # the run folder, with metrics.jsonl and the latest checkpoint
    resume: bool = False  # continue the run in --out from its checkpoint, or start it
    overwrite: bool = False  # replace a run in --out, which without it or --resume stops

RESUMABLE = {"micro_batch_tokens", "gradient_checkpointing", "steps", "test_data", "eval_every",
             "eval_samples", "eval_limit", "eval_batch_tokens", "log_completions", "save_every",
             "out", "resume", "overwrite"}  # these change no training, so --resume may change them

# 1. The schemes and the loss, on plain tensors. This section needs only math and torch, so it
# pastes alone into your trainer, and policy_loss's example runs one GRPO step through it.
def group_advantages(rewards, groups, scale="group", eps=1e-4):
    """GRPO's advantages. Each reward is normalised within its group by an unbiased std, as TRL's.
    Group ids run from 0 to n-1. With G rows a group in order, this normalises r.view(n, G) by row.

        A_i = (r_i - mean(r_g)) / (std(r_g) + eps)      g: the rows with i's group id
        A_i = r_i - mean(r_g)                           scale="none", as Dr. GRPO

    >>> group_advantages(torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.]), torch.arange(8) // 4)
    tensor([ 1.4997, -0.4999, -0.4999, -0.4999,  0.0000,  0.0000,  0.0000,  0.0000])

    Because of eps, 0.5 prints as 0.4999. Rewards that are equal within float rounding, such as
    1.0 and 0.99999994, give exactly 0, not noise divided by eps."""
    n = torch.bincount(groups).to(rewards.dtype)  # rows per group; GRPO-MA's groups are ragged,
    mean = torch.zeros_like(n).index_add(0, groups, rewards) / n  # so sums go by id, not by view
    adv = rewards - mean[groups]
    if scale == "group":
        var = torch.zeros_like(n).index_add(0, groups, adv ** 2) / (n - 1)
        adv = adv / (var.sqrt()[groups] + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group or none, got {scale!r}")
    high = torch.full_like(n, -math.inf).scatter_reduce(0, groups, rewards, "amax")
    low = torch.full_like(n, math.inf).scatter_reduce(0, groups, rewards, "amin")
    return torch.where(torch.isclose(high, low)[groups], 0.0, adv)

def ma_advantages(rewards, answer_thought, thought_question, cut_rewards, scale="group", eps=1e-4):
    """GRPO-MA's advantages, from the answers' rewards, each answer's thought, each thought's
    question and each thought's reward as a cut completion. It returns A(th), A(ans) and V:
        V(th)   = the mean reward of the answers to th. A thought that never closed has no answers,
                  so V(th) = cut_rewards[th], its own reward as GRPO would score it
        A(th)   = V(th) normalised over the K thoughts of the same question
        A(ans)  = r(ans) normalised over all answers to the same question, not per thought

        prompt -+- thought 0 -+- answer 0  r = 1     V = 1      A(th) =  0.7069
                |             +- answer 1  r = 1
                +- thought 1 -+- answer 2  r = 1     V = 0.5    A(th) = -0.7069
                              +- answer 3  r = 0

    >>> th, ans, V = ma_advantages(torch.tensor([1., 1., 1., 0.]), torch.tensor([0, 0, 1, 1]),
    ...                            torch.tensor([0, 0]), cut_rewards=torch.zeros(2))
    >>> th, ans
    (tensor([ 0.7069, -0.7069]), tensor([ 0.4999,  0.4999,  0.4999, -1.4997]))

    To copy GRPO-MA, also take the rows of rollout_ma and the two loss parts of batch_weights."""
    answers = torch.bincount(answer_thought, minlength=len(thought_question)).to(rewards.dtype)
    sums = torch.zeros_like(answers).index_add(0, answer_thought, rewards)
    values = torch.where(answers > 0, sums / answers.clamp(min=1), cut_rewards)  # (K·P,)
    thought_adv = group_advantages(values, thought_question, scale, eps)
    answer_adv = group_advantages(rewards, thought_question[answer_thought], scale, eps)
    return thought_adv, answer_adv, values

def ta_advantages(rewards, question, scale="group", eps=1e-4):
    """TA-GRPO's advantages are GRPO's, with one group for each original question q0. So the G
    responses to q0 and the G responses to each of its N rephrasings form one group of (N+1)·G.

        q0  "What is 3 + 5?"   r = 1 1      alone: all equal, no signal
        q1  "Add 3 and 5."     r = 0 1      pooled: mean 0.75, std 0.5

    >>> ta_advantages(torch.tensor([1., 1., 0., 1.]), torch.tensor([0, 0, 0, 0]))
    tensor([ 0.4999,  0.4999, -1.4997,  0.4999])

    To copy TA-GRPO, also take every log-prob given q0, as rollout_ta does by default (it says
    what that costs and what the paper's code does):
        ρ_jgt = π(o_jgt | q0, o_jg<t) / π_old(o_jgt | q0, o_jg<t)     o_jg was sampled after q_j"""
    return group_advantages(rewards, question, scale, eps)

def lambda_weights(completion_ids, completion_mask, context_ids):
    """λ-GRPO's token weights 1/|λ(i,t)|, B by C, and 0 off the mask. Rows share a context id when
    they were sampled after the same context, in any number and order. Completions are right-padded.

    |λ(i,t)| counts the rows of i's context that agree with row i on tokens 0 to t, row i itself
    and exact duplicates included. So a prefix that k completions share is trained once, not k
    times. Here are three rows of one context, the last one a token shorter:
    >>> ids = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 0]])
    >>> mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    >>> lambda_weights(ids, mask, torch.tensor([0, 0, 0]))
    tensor([[0.3333, 0.5000, 1.0000],
            [0.3333, 0.5000, 1.0000],
            [0.3333, 1.0000, 0.0000]])

    To copy λ-GRPO, multiply the aggregation weights by these. As in the paper, the weights scale
    the policy and the KL terms, not the normaliser. A context of n rows takes n·n·C bools."""
    weights = torch.zeros(completion_ids.shape, device=completion_ids.device)
    for context in context_ids.unique():
        rows = (context_ids == context).nonzero().squeeze(1)  # the context's n rows
        ids, mask = completion_ids[rows], completion_mask[rows].bool()  # (n, C)
        same = (ids[:, None] == ids[None]) & mask[:, None] & mask[None]  # (n, n, C): agree at t
        agree = same.cumprod(-1, dtype=torch.int32)  # (n, n, C): rows j and k agree at 0 to t
        counts = agree.sum(1)  # (n, C): |λ(j,t)|, the rows that agree with row j on 0 to t
        weights[rows] = torch.where(mask, 1.0 / counts.clamp(min=1), 0.0)  # off the mask: 0
    return weights

def aggregation_weights(completion_mask, loss_type="dapo", num_rows=None, num_tokens=None,
                        max_completion_length=None):
    """The weight w of each token in the loss, B by C, as TRL aggregates. |o_i| is row i's length.

        dapo     1 / (all tokens)                     one token mean over the batch
        grpo     1 / (rows · |o_i|)                   the mean over rows of each row's token mean
        dr_grpo  1 / (rows · max_completion_length)   a constant, as Dr. GRPO (arXiv 2503.20783)

    >>> aggregation_weights(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), "grpo")
    tensor([[0.2500, 0.2500, 0.0000, 0.0000],
            [0.1250, 0.1250, 0.1250, 0.1250]])

    Under dapo each of these six tokens weighs 1/6. A batch's weights sum to 1 under dapo and grpo,
    to less under λ-GRPO, and to 2 with GRPO-MA's two parts. Under torchrun, pass the whole batch's
    counts. TRL's bnpo is left out, as it divides by a micro-batch's tokens and so by the split."""
    mask = completion_mask.float()
    rows = len(mask) if num_rows is None else num_rows
    tokens = mask.sum().item() if num_tokens is None else num_tokens
    divisor = {"dapo": max(tokens, 1), "dr_grpo": rows * (max_completion_length or mask.shape[1]),
               "grpo": mask.sum(1, keepdim=True).clamp(min=1) * max(rows, 1)}  # the table above
    return mask / divisor[loss_type]  # an unknown loss_type is a KeyError

def policy_loss(per_token_logps, old_per_token_logps, advantages, completion_mask, loss_weights,
                ref_per_token_logps=None, beta=0.0, epsilon=0.2, epsilon_high=None):
    """The loss -J to minimise, and its metrics: clip_low and clip_high (1 where the clip binds)
    and kl (if β > 0) for each masked token. Tensors are B by C; the advantages, B or B by C.

        ρ  = exp(logp - old)
        KL = exp(ref - logp) - (ref - logp) - 1           k3
        loss = Σ w · (-min(ρ A, clip(ρ, 1-ε, 1+ε_high) A) + β KL)      w: loss_weights

    At μ = 1 the old log-probs are logp, detached, so ρ is 1 in value and ∂ρ/∂logp = ρ = 1. Both
    terms of the min then equal ρ A, and torch.min splits a tie's gradient between them, so they
    give the policy gradient, ∂loss/∂logp = -w A. Here is one GRPO step by hand: G = 4 completions
    score r = 1, 0, 0, 0, so mean(r) = 0.25, std(r) = 0.5 and A = 1.5, -0.5, -0.5, -0.5. They have
    6 tokens, so dapo's w is 1/6, and each token's gradient is -w A, -0.25 or +0.0833:
    >>> A = group_advantages(torch.tensor([1., 0., 0., 0.]), torch.zeros(4, dtype=torch.long))
    >>> mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 0]])
    >>> logp = torch.zeros(4, 2, requires_grad=True)  # log π of each token; any value will do
    >>> loss, _ = policy_loss(logp, logp.detach(), A, mask, aggregation_weights(mask, "dapo"))
    >>> loss.backward(); logp.grad[mask.bool()]  # the 6 tokens, row by row
    tensor([-0.2500, -0.2500,  0.0833,  0.0833,  0.0833,  0.0833])"""
    on = completion_mask.bool()
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    adv = torch.where(on, adv, 0.0)  # (B, C), 0 off the mask
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(per_token_logps - old_per_token_logps)  # ρ
    loss = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon_high) * adv)  # (B, C)
    with torch.no_grad():  # the clip binds where ρ has left the range in A's direction
        metrics = {"clip_low": ((ratio < 1 - epsilon) & (adv < 0))[on].float(),
                   "clip_high": ((ratio > 1 + epsilon_high) & (adv > 0))[on].float()}
    if beta:
        assert ref_per_token_logps is not None, "beta > 0 needs ref_per_token_logps"
        delta = ref_per_token_logps - per_token_logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
        metrics["kl"] = kl[on].detach()
    return torch.where(on, loss * loss_weights, 0.0).sum(), metrics

# 2. The reward. An answer that cannot be read is a miss, never a guess, so that no false positive
# is ever trained. Model output is read, never run. data/rewards.py reads what real models write.
NUMBER_RE = re.compile(r"[-+]?(?:(?:[1-9][0-9]{0,2}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)")

def score(text: str, reference: str, finished: bool) -> float:
    """1.0 if the completion finished with EOS and its answer equals the reference, else 0.0. The
    answer is the text in the last <answer>...</answer> after the first </think>, so a thought that
    never closes holds none. A numeric reference asks for the same value ('+85.0' and '1,234' are
    numbers), and any other for the same text. The reading only splits and searches strings."""
    if not finished or ("<think>" in text and "</think>" not in text):
        return 0.0
    text = text.split("</think>", 1)[-1]  # a text without <think> is all answer
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))  # the last <answer> that opens before `end`
    if start < 0:
        return 0.0
    a = text[start + len("<answer>"):text.find("</answer>", start)].strip()
    num = lambda s: Fraction(s.replace(",", "")) if NUMBER_RE.fullmatch(s) and len(s) < 99 else None
    ref = reference.strip()
    return float(num(a) == num(ref) if num(ref) is not None else a == ref)

def correct(prompts, completions, answer, finished=None, **columns):
    """The default --reward-fn, called as TRL calls one, with each data key as a keyword. TRL passes
    chat messages or text, and no `finished`, so every completion then counts as finished."""
    finished = finished or [True] * len(completions)
    return [score(c if isinstance(c, str) else c[-1]["content"], a, f)
            for c, a, f in zip(completions, answer, finished)]

def score_batch(cfg, examples, texts: list[str], finished, prompts=None):
    """The rewards of B completion texts, from one call of the reward function. Each text is scored
    with --response-prefix before it. The prompts are the rows' questions, or `prompts` if given."""
    if not texts:  # a rank whose GRPO-MA thoughts all stayed open has no answers
        return torch.zeros(0)
    columns = {key: [ex.get(key) for ex in examples] for key in examples[0]}  # (B,) each
    rewards = torch.tensor(reward_function(cfg.reward_fn)(prompts=prompts or columns["question"],
        completions=[cfg.response_prefix + t for t in texts], finished=[bool(f) for f in finished],
        **columns), dtype=torch.float)
    if rewards.shape != (len(texts),) or not rewards.isfinite().all():  # one float per completion
        raise UserError(f"--reward-fn {cfg.reward_fn} gave {rewards} for {len(texts)} completions")
    return rewards

# 3. The sampler, for HF's decoder layout: model.model, then model.lm_head, as in Qwen2/3 and Llama.
def prompt_ids(tokenizer, cfg, question: str) -> list[int]:
    """The ids of a question in the chat template, then those of --response-prefix. The prefix is
    plain text that begins the reply, as <think> in DeepSeek-R1's template. It is never trained."""
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)
    prefix = tokenizer(cfg.response_prefix, add_special_tokens=False, split_special_tokens=True)
    return tokenizer(text, add_special_tokens=False).input_ids + prefix.input_ids

def pad_ids(seqs: list[list[int]], pad_id: int, side: str = "left"):
    """Lists of ids -> a tensor of ids and its attention mask, B by L, padded on the given side."""
    pad = lambda rows, value: torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(row, dtype=torch.long) for row in rows], True, value, side)
    return pad(seqs, pad_id), pad([[1] * len(s) for s in seqs], 0)

def run_decoder(model, input_ids, attention_mask, cache=None):
    """The decoder's last hidden states, B by S by H, for S new tokens after those in `cache`. The
    caller applies the lm_head only where it needs logits. The mask covers the cached tokens too."""
    # a token's position is the number of real tokens before it, so padding takes no place
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
    out = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=cache is not None, cache=cache)  # past_key_values= before 5.24
    return out.last_hidden_state

def eos_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and the generation config's."""
    ids = model.generation_config.eos_token_id
    return sorted({*(ids if isinstance(ids, list) else [ids]), tokenizer.eos_token_id} - {None})

def decode(tokenizer, completion_ids, completion_mask) -> list[str]:
    """The text of each completion's masked tokens, special tokens dropped."""
    return [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(completion_ids, completion_mask)]

class Samples(NamedTuple):
    """What generate returns, on the CPU: B rows, n per prompt, prompt-major."""
    completion_ids: torch.Tensor   # (B, C) right-padded with the pad id
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the token that ended the row
    finished: torch.Tensor         # (B,) True where that token was an EOS

@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], n: int, max_new_tokens: int,
             temperature=1.0, greedy=False, stop_strings=()):
    """Samples n completions of each prompt and returns them as Samples. A row ends at an EOS, at
    the end of a stop string, or at the limit. Each token is drawn from softmax(logits / T), with
    no top-k or top-p, because the loss assumes that distribution.

        prefill     one pass over the P prompts fills the KV cache; each prompt's cache and last
                    logits are then copied to its n rows, so the batch has B = P·n rows
        each step   each running row draws a token, and one decoder pass on those tokens gives
                    the next logits; a row that ends leaves the batch and the cache
        running     the batch's row i is out's row running[i]; as row 1 of 3 ends, [0 1 2] -> [0 2]
    Ended rows leave, as a fixed-shape batch cost SmolLM2 1.28x the sampling time (RESULTS.md)."""
    if not prompts:  # a rank whose GRPO-MA thoughts all stayed open samples no answers
        empty = torch.zeros(0, 0, dtype=torch.long)
        return Samples(empty, empty, torch.zeros(0, dtype=torch.bool))
    device, was_training = next(model.parameters()).device, model.training
    model.eval()  # no dropout; in train mode HF's gradient checkpointing would drop the cache
    ids, mask = (x.to(device) for x in pad_ids(prompts, tokenizer.pad_token_id))
    cache = transformers.DynamicCache()
    logits = model.lm_head(run_decoder(model, ids, mask, cache)[:, -1]).float()  # (P, vocab)
    if cache.get_seq_length() != ids.shape[1]:  # transformers 5.17 ignored cache= without a word
        raise UserError(f"transformers {transformers.__version__} kept no KV cache: install 5.24+")
    index = torch.arange(len(prompts), device=device).repeat_interleave(n)
    cache.reorder_cache(index)  # an index_select with repeats, so prompt p fills rows p·n..p·n+n-1
    logits, mask = logits[index], mask[index]  # (B, vocab), (B, L)
    B, eos = len(index), torch.tensor(eos_ids(model, tokenizer), device=device)
    out = torch.full((B, max_new_tokens), tokenizer.pad_token_id, device=device)
    lengths, finished, texts = torch.zeros_like(index), torch.zeros_like(index).bool(), [""] * B
    running = torch.arange(B, device=device)
    for t in range(max_new_tokens):
        token = logits.argmax(-1) if greedy else torch.multinomial(
            (logits / temperature).softmax(-1), 1).squeeze(-1)
        out[running, t] = token  # token[i] and ends[i] belong to row running[i] of out
        lengths[running] += 1
        ends = torch.isin(token, eos)
        finished[running[ends]] = True
        for i, row in enumerate(running.tolist() if stop_strings else []):
            texts[row] += tokenizer.decode(token[i:i + 1], skip_special_tokens=True)
            ends[i] |= any(s in texts[row] for s in stop_strings)  # GRPO-MA's thoughts
        if ends.any():  # the rows that ended leave the batch and the cache
            running, mask, token = running[~ends], mask[~ends], token[~ends]
            cache.batch_select_indices((~ends).nonzero().squeeze(1))
        if not len(running) or t + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones(len(running), 1)], 1)
        logits = model.lm_head(run_decoder(model, token[:, None], mask, cache)[:, -1]).float()
    model.train(was_training)
    C = int(lengths.max())
    completion_mask = (torch.arange(C, device=device) < lengths[:, None]).long()
    return Samples(out[:, :C].cpu(), completion_mask.cpu(), finished.cpu())

# 4. The rows: a rollout for each variant, then the functions that choose and weigh the rows.
@dataclass
class Rows:
    """The completions of a batch, one row each, with what the loss needs to know of them. Row i
    adds Σ_t w_it min(ρ_it A_i, clip(ρ_it) A_i) to J, so update() needs to know no variant."""
    contexts: list[list[int]]      # B lists of token ids: what each completion continues
    completion_ids: torch.Tensor   # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the EOS or the stop string
    advantages: torch.Tensor       # (B,) one per row, or (B, C) for a per-token scheme of yours
    outcomes: torch.Tensor         # (B,) the reward, or a GRPO-MA thought's value V; for the log
    questions: torch.Tensor        # (B,) the index of the row's question in the rollout's batch
    parts: torch.Tensor | None = None  # (B,) the row's part of J: 1 for GRPO-MA's answers, else 0
    context_swapped: torch.Tensor | None = None  # (B,) True if sampled after another context
    loss_weights: torch.Tensor | None = None  # (B, C) each token's w in J, set by batch_weights

    def __post_init__(self):  # unless a rollout says otherwise, every row is in part 0, unswapped
        zero = torch.zeros(len(self.contexts), dtype=torch.long)  # (B,)
        self.parts = zero if self.parts is None else self.parts
        self.context_swapped = zero.bool() if self.context_swapped is None else self.context_swapped

def select_rows(rows: Rows, index, device="cpu") -> Rows:
    """The rows at the positions that index (a 1-D tensor) lists, in that order, on device."""
    tensors = {name: value[index].to(device) for name, value in vars(rows).items()
               if isinstance(value, torch.Tensor)}
    return Rows(contexts=[rows.contexts[i] for i in index.tolist()], **tensors)

def cat_rows(many: list[Rows]) -> Rows:
    """Several Rows as one, in order. Every (B, C) tensor is right-padded to the widest C."""
    C = max(rows.completion_ids.shape[1] for rows in many)
    widen = lambda x: torch.nn.functional.pad(x, (0, C - x.shape[1])) if x.dim() == 2 else x
    tensors = {name: torch.cat([widen(getattr(rows, name)) for rows in many])
               for name, value in vars(many[0]).items() if isinstance(value, torch.Tensor)}
    return Rows(contexts=[c for rows in many for c in rows.contexts], **tensors)

def no_signal(advantages, groups, num_groups: int):
    """True for each group whose rows all have A = 0, so that it teaches nothing (no signal)."""
    nonzero = ((advantages[:, None] if advantages.dim() == 1 else advantages) != 0).any(1)  # (B,)
    return torch.zeros(num_groups).index_add(0, groups, nonzero.float()) == 0

def rollout_grpo(model, tokenizer, cfg, batch: list[dict]):
    """GRPO: G completions of each question, advantages normalised within the question's G."""
    G = cfg.num_generations
    prompts = [prompt_ids(tokenizer, cfg, ex["question"]) for ex in batch]
    s = generate(model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature)
    question = torch.arange(len(batch)).repeat_interleave(G)  # (P·G,) each row's question
    texts = decode(tokenizer, s.completion_ids, s.completion_mask)
    rewards = score_batch(cfg, [batch[q] for q in question], texts, s.finished)
    advantages = group_advantages(rewards, question, cfg.scale_rewards)
    metrics = dict(reward=rewards, frac_reward_zero_std=no_signal(advantages, question, len(batch)),
                   completion_length=s.completion_mask.sum(1).float(), frac_truncated=~s.finished)
    return Rows(contexts=[prompts[q] for q in question], completion_ids=s.completion_ids,
                completion_mask=s.completion_mask, advantages=advantages, outcomes=rewards,
                questions=question), metrics

def rollout_ma(model, tokenizer, cfg, batch: list[dict]):
    """GRPO-MA: each question gets K thoughts, and each thought ends at the token that completes
    </think>. Each closed thought gets M answers, sampled after the prompt and the thought. An open
    thought gets no answers. So its V is its own reward as GRPO would score it, which is 0 under
    both shipped rewards when the thought was cut at its limit. One question's rows, K = 3, M = 2:
        row  context             completion                advantage  part  w (batch_weights)
        0-2  prompt              thoughts 0, 1 (open), 2   A(th_k)    0     1 / (thought tokens)
        3-4  prompt + thought 0  answers 0 and 1 to it     A(a_0m)    1     1 / (answer tokens)
        5-6  prompt + thought 2  answers 0 and 1 to it     A(a_2m)    1     1 / (answer tokens)
    So J is the mean over the thoughts' tokens plus the mean over the answers' tokens, and M
    answers do not outweigh the thought they follow. data/one-step.png draws such rows. The index
    lists below rely on generate's order, n rows to a prompt, prompt by prompt. So thought k of
    question p is row p·K + k, and the j-th closed thought's answers are rows j·M to j·M + M - 1."""
    K, M = cfg.num_thoughts, cfg.num_answers
    # 1. Sample the tree. The comments show its indices in the example above.
    prompts = [prompt_ids(tokenizer, cfg, ex["question"]) for ex in batch]
    thoughts = generate(model, tokenizer, prompts, K, cfg.max_new_tokens, cfg.temperature,
                        stop_strings=["</think>"])  # P·K rows
    thought_question = torch.arange(len(batch)).repeat_interleave(K)  # [0 0 0]: each one's question
    thought_texts = decode(tokenizer, thoughts.completion_ids, thoughts.completion_mask)
    closed = torch.tensor(["</think>" in text for text in thought_texts], dtype=bool)  # [T F T]
    closed_context = [prompts[p] + ids[m.bool()].tolist() for p, ids, m, ok in zip(
        thought_question, thoughts.completion_ids, thoughts.completion_mask, closed) if ok]
    answers = generate(model, tokenizer, closed_context, M, cfg.max_answer_tokens, cfg.temperature)
    answer_thought = closed.nonzero().squeeze(1).repeat_interleave(M)  # [0 0 2 2]: its thought
    answer_context = [c for c in closed_context for _ in range(M)]  # prompt + its thought
    answer_texts = decode(tokenizer, answers.completion_ids, answers.completion_mask)
    texts = [thought_texts[k] + a for k, a in zip(answer_thought, answer_texts)]  # thought + answer
    answer_question = thought_question[answer_thought]  # [0 0 0 0]: an answer's question
    rewards = score_batch(cfg, [batch[p] for p in answer_question], texts, answers.finished)
    cut_rewards = score_batch(cfg, [batch[p] for p in thought_question], thought_texts,
                              thoughts.finished)  # as GRPO would; read only for open thoughts
    thought_adv, answer_adv, values = ma_advantages(rewards, answer_thought, thought_question,
                                                    cut_rewards, cfg.scale_rewards)
    # 2. The rows: the P·K thoughts (part 0), then the answers (part 1)
    thought_rows = Rows(
        contexts=[prompts[p] for p in thought_question], completion_ids=thoughts.completion_ids,
        completion_mask=thoughts.completion_mask, advantages=thought_adv, outcomes=values,
        questions=thought_question)
    answer_rows = Rows(
        contexts=answer_context, completion_ids=answers.completion_ids,
        completion_mask=answers.completion_mask, advantages=answer_adv, outcomes=rewards,
        questions=answer_question, parts=torch.ones_like(answer_question))
    metrics = dict(reward=rewards,
                   frac_reward_zero_std=no_signal(answer_adv, answer_question, len(batch)),
                   completion_length=answers.completion_mask.sum(1).float(), thought_value=values,
                   unclosed_thoughts=~closed, frac_value_zero_std=~thought_adv.view(-1, K).any(1),
                   frac_truncated=~answers.finished)
    return cat_rows([thought_rows, answer_rows]), metrics

def rollout_ta(model, tokenizer, cfg, batch: list[dict]):
    """TA-GRPO: each question q0 comes with up to N rephrasings, drawn afresh each step, and each
    phrasing gets G responses. The advantages pool a question's (N+1)·G responses, and each row's
    context follows --ta-anchor. Take two questions, N = 1, G = 2, and no rephrasing of the second:
        phrasing                q0 of 0    q1 of 0    q0 of 1
        rows, of question       0 1, q 0   2 3, q 0   4 5, q 1
        context, original       q0 of 0    q0 of 0    q0 of 1    rows 2 and 3: context swapped
        context, rephrased      q0 of 0    q1 of 0    q0 of 1    no context swapped
    The default anchor has a cost. A response sampled given q_j trains π given q0 with no
    importance weight. So the step is not q0's policy gradient, because it raises π(o | q0) for
    what q_j made likely. The paper (v5) takes this bias on purpose, so that the rephrasings
    explore. The rephrased anchor, as in the paper's code, is each phrasing's policy gradient."""
    G, N = cfg.num_generations, cfg.num_rephrasings
    phrasings, question, is_q0 = [], [], []  # one entry per phrasing: its text, question, if q0
    for q, ex in enumerate(batch):
        drawn = [ex["rephrasings"][i] for i in torch.randperm(len(ex["rephrasings"]))[:N]]
        phrasings += [ex["question"]] + drawn  # q0 first, then the rephrasings drawn
        question += [q] * (1 + len(drawn))
        is_q0 += [True] + [False] * len(drawn)
    prompts = [prompt_ids(tokenizer, cfg, text) for text in phrasings]
    s = generate(model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature)
    row_question = torch.tensor(question, dtype=torch.long).repeat_interleave(G)  # (B,)
    row_is_q0 = torch.tensor(is_q0, dtype=torch.bool).repeat_interleave(G)  # (B,) True after q0
    texts = decode(tokenizer, s.completion_ids, s.completion_mask)
    rewards = score_batch(cfg, [batch[q] for q in row_question], texts, s.finished,
                          [text for text in phrasings for _ in range(G)])  # each as it was asked
    advantages = ta_advantages(rewards, row_question, cfg.scale_rewards)
    q0_prompts = [p for p, first in zip(prompts, is_q0) if first]  # one for each question
    if cfg.ta_anchor == "original":  # every row continues its question's q0
        contexts, swapped = [q0_prompts[q] for q in row_question], ~row_is_q0
    else:  # every row continues the phrasing it was sampled after
        contexts, swapped = [p for p in prompts for _ in range(G)], torch.zeros_like(row_is_q0)
    r0 = rewards[row_is_q0].view(-1, G)  # the G rewards of q0 itself, as GRPO's
    metrics = dict(reward=rewards, completion_length=s.completion_mask.sum(1).float(),
                   frac_reward_zero_std=no_signal(advantages, row_question, len(batch)),
                   frac_truncated=~s.finished, reward_rephrased=rewards[~row_is_q0],
                   frac_reward_zero_std_q0=r0.amax(1) == r0.amin(1))
    return Rows(contexts=contexts, completion_ids=s.completion_ids,
                completion_mask=s.completion_mask, advantages=advantages, outcomes=rewards,
                questions=row_question, context_swapped=swapped), metrics

ROLLOUTS = {"grpo": rollout_grpo, "ma": rollout_ma, "ta": rollout_ta}

def part_counts(rows: Rows):
    """(2, 2): counts[p] holds the rows and the completion tokens of part p of J. Only GRPO-MA's
    answers are in part 1, so under grpo and ta counts[1] is 0, 0."""
    tokens = rows.completion_mask.sum(1)  # (B,)
    return torch.tensor([[(rows.parts == p).sum(), tokens[rows.parts == p].sum()] for p in (0, 1)])

def batch_weights(rows: Rows, cfg, counts) -> torch.Tensor:
    """w_it = aggregation_weights of row i's part of J, with counts[p], that part's rows and tokens
    on all ranks. So a token's w is its share of the whole batch. Under grpo and ta, and under ma
    with --ma-weighting tokens, the batch is one part. Otherwise GRPO-MA's thoughts and answers are
    two parts, each a token mean with its own length limit. With dapo, 40 thought tokens and 120
    answer tokens make a thought token's w 1/40 and an answer token's 1/120, so the w sum to 2.
    With --loss-type grpo and one question, J = (1/K) Σ_k J(th_k) + (1/KM) Σ_km J(a_km), where J(o)
    is row o's token mean. This form comes from a summary, as the paper's body was not available."""
    limits = [cfg.max_new_tokens, cfg.max_answer_tokens]  # ma: the thoughts' and the answers'
    if cfg.variant != "ma" or cfg.ma_weighting == "tokens":  # one part: the whole batch
        num_rows, num_tokens = counts.sum(0).tolist()  # every rank's rows and tokens
        limit = max(limits) if cfg.variant == "ma" else cfg.max_new_tokens  # dr_grpo's constant
        return aggregation_weights(rows.completion_mask, cfg.loss_type, num_rows, num_tokens, limit)
    weights = torch.zeros(rows.completion_mask.shape)  # GRPO-MA's two parts, a mean each
    for p, limit in enumerate(limits):
        num_rows, num_tokens = counts[p].tolist()  # every rank's rows and tokens in part p
        weights[rows.parts == p] = aggregation_weights(rows.completion_mask[rows.parts == p],
                                                       cfg.loss_type, num_rows, num_tokens, limit)
    return weights

def lambda_rows(rows: Rows, enabled: bool):
    """If enabled, this divides each token's w by |λ(i,t)|, as λ-GRPO does, for any variant. The set
    λ(i,t) holds the rows that were sampled after row i's context, train in it, and agree with row i
    on tokens 0 to t. Contexts are compared as token lists, so the answers to two equal thoughts
    share one. A swapped row keeps its w, because it was not sampled in the context it trains in.
    The log reads each masked token's |λ| even with λ off, so lambda_rows returns those too."""
    on = ~rows.context_swapped  # (B,) the rows sampled after the context they train in
    contexts = [c for c, sampled_here in zip(rows.contexts, on.tolist()) if sampled_here]
    context_ids = torch.tensor([contexts.index(c) for c in contexts], dtype=torch.long)  # first row
    inv_lambda = rows.completion_mask.float()  # 1 / |λ| = 1 for a row sampled elsewhere
    inv_lambda[on] = lambda_weights(rows.completion_ids[on], rows.completion_mask[on], context_ids)
    weights = rows.loss_weights * inv_lambda if enabled else rows.loss_weights
    return replace(rows, loss_weights=weights), 1 / inv_lambda[rows.completion_mask.bool()]

# 5. The update: Rows -> micro-batches -> completion_logps -> policy_loss -> backward -> step.
def completion_logps(model, rows: Rows, temperature: float):
    """The log-prob log softmax(logits / T) of each completion token given its row's context and
    the tokens before it, B by C and 0 off the mask. One forward pass without a KV cache computes
    them. The rows are right-padded, so no position sees only padding, which can make CUDA's
    backward pass NaN.

        input      p1 p2 p3 t1 t2 pad     a context of c = 3 tokens, then n = 2 completion tokens
        predicts         t1 t2  -         position c - 1 + j predicts completion token j
    The lm_head runs on chunks of the batch's tokens, as a call per row was 1.07x slower."""
    mask, n = rows.completion_mask.bool(), rows.completion_mask.sum(1)  # n tokens, then padding
    seqs = [c + row[:k].tolist() for c, row, k in zip(rows.contexts, rows.completion_ids, n)]
    ids, attention = (x.to(n.device) for x in pad_ids(seqs, 0, "right"))  # (B, S)
    hidden = run_decoder(model, ids, attention)  # (B, S, H)
    hidden = torch.cat([hidden[i, len(c) - 1:len(c) - 1 + k]  # row i's n states, as drawn above
                        for i, (c, k) in enumerate(zip(rows.contexts, n.tolist()))])  # (tokens, H)
    chunk = max(1, 2**25 // model.lm_head.out_features)  # so memory does not grow with the vocab
    def chunk_logps(h, t):
        logits = model.lm_head(h).float() / temperature  # after the cast: bf16 / T would round
        return logits.gather(-1, t[:, None]).squeeze(-1) - logits.logsumexp(-1)
    logps = torch.zeros(rows.completion_ids.shape, device=mask.device)
    logps[mask] = torch.cat([  # logps[mask] lists row 0's n tokens, then row 1's, as hidden does
        torch.utils.checkpoint.checkpoint(chunk_logps, h, t, use_reentrant=False)  # no logits kept
        for h, t in zip(hidden.split(chunk), rows.completion_ids[mask].split(chunk))])
    return logps

def update(model, ref_model, optimizer, rows: Rows, cfg):
    """Takes μ = --num-iterations optimizer steps on this rank's rows, whichever variant made them.
    A micro-batch holds as many rows as --micro-batch-tokens holds at the longest row's length, so
    the activations kept for backward follow that budget. It returns this rank's part of -J over
    the μ passes and the metrics, grad_norm per pass and clip_low, clip_high and kl per token. Its
    one collective sums the gradients, as DDP does. At μ = 1 the loss is -Σ w A, not the reward."""
    device, mu, T = next(model.parameters()).device, cfg.num_iterations, cfg.temperature
    lengths = torch.tensor([len(c) for c in rows.contexts]) + rows.completion_mask.sum(1)  # (B,)
    order = lengths.argsort(stable=True)  # rows of like length share a micro-batch and pad less
    size = max(1, cfg.micro_batch_tokens // max(lengths.tolist(), default=1))  # rows to a batch
    micro_batches = [select_rows(rows, index, device)  # none on a rank that holds no rows
                     for index in order.split(size) if len(index)]
    with torch.no_grad():  # π_old's log-probs if μ > 1, and the reference's if β > 0
        old = [completion_logps(model, mb, T) if mu > 1 else None for mb in micro_batches]
        ref = [completion_logps(ref_model, mb, T) if cfg.beta else None for mb in micro_batches]
    names = ["clip_low", "clip_high", "kl"] if cfg.beta else ["clip_low", "clip_high"]
    per_token = {name: [torch.zeros(0)] for name in names}  # the values of every micro-batch
    loss_sum, grad_norms = 0.0, []
    for _ in range(mu):
        for j, mb in enumerate(micro_batches):
            logps = completion_logps(model, mb, T)  # (b, C)
            old_logps = logps.detach() if mu == 1 else old[j]  # at μ = 1 π_old is π, so ρ = 1
            loss, metrics = policy_loss(logps, old_logps, mb.advantages, mb.completion_mask,
                                        mb.loss_weights, ref[j], cfg.beta, cfg.epsilon,
                                        cfg.epsilon_high)
            loss.backward()
            loss_sum += loss.item()  # the micro-batches' pieces of -J add up to this rank's part
            for name in names:
                per_token[name].append(metrics[name].cpu())
        sum_gradients(model)
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        if not grad_norms[-1].isfinite():
            raise UserError(f"the gradient norm is {grad_norms[-1]:.0f}: no update; lower --lr")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    metrics = {name: torch.cat(values) for name, values in per_token.items()}
    return torch.tensor(loss_sum / mu), metrics | {"grad_norm": torch.stack(grad_norms).cpu()}

# 6. The training loop and the eval.
def dynamic_sampling(model, tokenizer, cfg, examples: list[dict], rng):
    """kept = the first P questions drawn that have signal, a row with A ≠ 0. DAPO's dynamic
    sampling returns this rank's rows of the kept questions, and the metrics of all it sampled.
        repeat: draw P questions not drawn before in this step; roll out this rank's share of them
                gather every rank's signal, a bool per question, so that all ranks hold the draw's
                keep the first questions with signal, until P questions are kept
        until P questions are kept or --max-gen-batches draws are spent
    In one process the share is the whole draw. Take two ranks and P = 2, one question a rank:
        draw 1   rank 0: question a, no signal   rank 1: question b, signal   keep b       1 of 2
        draw 2   rank 0: question c, signal      rank 1: question d, signal   keep c, not d 2 of 2
    Both ranks read the same gathered signal, so both choose alike. Rank 0 trains c, rank 1 b."""
    P, (rank, W) = cfg.prompts_per_step, rank_and_world()
    share = slice(rank * P // W, (rank + 1) * P // W)  # this rank's share of a draw
    left, kept, draws = list(range(len(examples))), 0, []
    while kept < P <= len(left) and len(draws) < cfg.max_gen_batches:
        drawn = rng.sample(left, P)  # questions not drawn before in this step
        left = sorted(set(left) - set(drawn))
        mine = drawn[share]  # this rank's questions, which rows.questions counts from 0
        rows, metrics = ROLLOUTS[cfg.variant](model, tokenizer, cfg, [examples[i] for i in mine])
        signal = gather(~no_signal(rows.advantages, rows.questions, len(mine)))  # (P,) rank order
        keep = signal & (signal.cumsum(0) <= P - kept)  # (P,) the first with signal, as fit in P
        kept += int(keep.sum())
        row_keep = keep[share][rows.questions]  # (B,) True if the row's question trains
        metrics["frac_dropped"] = ~row_keep
        draws.append((select_rows(rows, row_keep.nonzero().flatten()), metrics))
    metrics = {name: torch.cat([m[name] for _, m in draws]) for name in draws[0][1]}
    return cat_rows([rows for rows, _ in draws]), metrics | {
        "prompts_drawn": torch.tensor(P * len(draws))}

def train(cfg) -> dict:
    """Train as configured and return rank 0's summary, in three numbered blocks a step. In one
    process W = 1 and rank = 0, gather returns its input and sum_gradients does nothing, so rules
    1 and 2 hold by themselves there. An editor of the loop must keep these rules:
    1. A token's w is its share of the batch on all ranks, as batch_weights counts every rank's
       rows. With dapo and ranks of 10 and 6 tokens, w is 1/16, not 1/10 and 1/6. So the
       micro-batches' losses on all ranks add up to one -J.
    2. Every rank makes the same collective calls in the same order, whatever rows it holds. Only
       section 6, save_checkpoint and update's sum_gradients call them. A choice that must agree
       on all ranks, such as which rows train, reads only gathered numbers.
    3. The step's seed draws its questions and seeds its sampling, so a resume repeats the step.
    4. A checkpoint is saved only between steps, so its weights, AdamW and log agree (open_run).
       So a kill loses the steps since the last save, which --resume repeats, bit for bit on CPU.
    5. A rank may hold no rows at any stage: dynamic sampling drops questions, and an open GRPO-MA
       thought gets no answers. A step where no rank holds a row makes no update.
    After an edit, `pytest test_grpo.py -k "rule_1 or gloo or kill_after or no_rows"` checks all."""
    device, (rank, W) = setup_ranks(), rank_and_world()
    P = cfg.prompts_per_step
    examples = load_jsonl(cfg.data, P)
    test_examples = load_jsonl(cfg.test_data)[:cfg.eval_limit or None]  # the questions evaluated
    check_prefix(cfg, examples + test_examples)
    checkpoint, state, log = open_run(cfg)  # log() appends a line to metrics.jsonl on rank 0
    bf16 = cfg.autocast == "bf16" or (cfg.autocast == "auto" and device.type == "cuda")
    model, tokenizer, ref_model, optimizer = load_run(cfg, device, checkpoint, state, bf16)
    print(f"grpo.py: {device}, weights {model.dtype}, autocast {'bf16' if bf16 else 'off'}")
    t0 = time.time()
    # matmuls in bf16 if on. No cast is cached, so none is stale after a step or lacks a graph.
    with torch.autocast(device.type, torch.bfloat16, enabled=bf16, cache_enabled=False):
        if state is None:
            log({"step": 0, "eval": evaluate(model, tokenizer, test_examples, cfg)})
        bar = tqdm(range(state["step"] if state else 0, cfg.steps), disable=rank != 0)
        for step in bar:  # counts from 0; the log and checkpoints count the steps done, step + 1
            t_step = time.perf_counter()
            # 1. This rank's rows. The step's seed draws the questions and seeds the sampling.
            seed = cfg.seed * 1_000_003 + step  # rule 3
            rng = random.Random(seed)
            torch.manual_seed(seed * W + rank)  # each rank samples its own completions
            if cfg.dynamic_sampling:
                rows, metrics = dynamic_sampling(model, tokenizer, cfg, examples, rng)
            else:  # draw P questions, take this rank's share, and roll it out
                questions = rng.sample(examples, P)[rank * P // W:(rank + 1) * P // W]
                rows, metrics = ROLLOUTS[cfg.variant](model, tokenizer, cfg, questions)
            # 2. Each token's weight, as a share of the batch on all ranks (rule 1), then λ's
            counts = gather(part_counts(rows)[None]).sum(0)  # (2, 2); gather(x) is x in one process
            rows = replace(rows, loss_weights=batch_weights(rows, cfg, counts))
            rows, metrics["lambda_mean"] = lambda_rows(rows, cfg.lambda_weights)
            # 3. The update, unless no rank holds a row (rule 5). The learning rate warms up.
            lr = cfg.lr * min(1.0, (step + 1) / (cfg.warmup_steps + 1))
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            if counts.sum():
                loss, update_metrics = update(model, ref_model, optimizer, rows, cfg)
                metrics |= update_metrics | {"loss": gather(loss.view(1)).sum()}  # all ranks' -J
            metrics = mean_over_ranks(metrics)
            bar.set_postfix_str(f"reward {metrics.get('reward', math.nan):.3f}")
            if rank == 0 and cfg.log_completions and (step + 1) % cfg.log_completions == 0:
                show_group(tokenizer, rows, step + 1)
            log({"step": step + 1, "lr": lr, **metrics, "time/step": time.perf_counter() - t_step})
            if step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                log({"step": step + 1, "eval": evaluate(model, tokenizer, test_examples, cfg)})
            if step + 1 == cfg.steps or (cfg.save_every and (step + 1) % cfg.save_every == 0):
                save_checkpoint(cfg, step + 1, model, tokenizer, optimizer)
    if W > 1:
        torch.distributed.destroy_process_group()
    return summary(cfg, time.time() - t0) if rank == 0 else None

@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], cfg) -> dict:
    """Greedy accuracy and Chen et al.'s unbiased pass@k for k = 1..n. The n = --eval-samples
    samples of a question are drawn at the training temperature, under ma as plain completions
    within both limits. A chunk holds the questions whose rows × (longest prompt + limit) fit in
    --eval-batch-tokens of KV cache. Rank c % W samples chunk c, seeded --seed + 12345 + c."""
    n, (rank, W) = cfg.eval_samples, rank_and_world()
    limit = cfg.max_new_tokens + (cfg.max_answer_tokens if cfg.variant == "ma" else 0)
    prompts = [prompt_ids(tokenizer, cfg, ex["question"]) for ex in examples]
    greedy, pass_k = 0.0, [0.0] * n  # this rank's sums
    for rows, sampled in ((1, False), (n, True)):  # the greedy pass, then the sampled one
        size = max(1, cfg.eval_batch_tokens // (rows * (max(map(len, prompts)) + limit)))
        chunks = list(enumerate(range(0, len(examples), size)))[rank::W]
        for c, start in tqdm(chunks, "eval", leave=False, disable=rank != 0):
            torch.manual_seed(cfg.seed + 12345 + c)
            chunk, asked = examples[start:start + size], prompts[start:start + size]
            s = generate(model, tokenizer, asked, rows, limit, cfg.temperature, not sampled)
            texts = decode(tokenizer, s.completion_ids, s.completion_mask)
            rewards = score_batch(cfg, [ex for ex in chunk for _ in range(rows)], texts, s.finished)
            right = (rewards == 1).view(len(chunk), rows).sum(1).tolist()  # (questions,)
            greedy += 0 if sampled else sum(right)
            for r in right if sampled else []:  # a question with r of its n samples right
                pass_k = [p + 1 - math.comb(n - r, k) / math.comb(n, k)
                          for k, p in enumerate(pass_k, 1)]
    means = gather(torch.tensor([[greedy, *pass_k]], dtype=torch.float64)).sum(0) / len(examples)
    return {"greedy": means[0].item()} | {f"pass@{k}": means[k].item() for k in range(1, n + 1)}

# 7. Plumbing: printing, flags, data, models, checkpoints, ranks. A first read may stop here.
def show_group(tokenizer, rows: Rows, step: int):
    """Print the rows that share the first row's context: outcome, advantage and text."""
    shown = [i for i, context in enumerate(rows.contexts) if context == rows.contexts[0]]
    texts = decode(tokenizer, rows.completion_ids[shown], rows.completion_mask[shown])
    for i, text in zip(shown, texts):  # per-token advantages show as their mean where not 0
        a = rows.advantages[i].sum() / rows.advantages[i].count_nonzero().clamp(min=1)
        text = " ".join(text.split())
        text = text if len(text) <= 100 else f"{text[:30]} [...] {text[-64:]}"  # keep the answer
        tqdm.write(f"step {step}  r {rows.outcomes[i]:4.2f}  A {a:+5.2f}  {text}")

def summary(cfg, wall_s: float) -> dict:
    """Print the first eval against the last, both read from metrics.jsonl, and return them."""
    records = map(json.loads, (Path(cfg.out) / "metrics.jsonl").read_text().splitlines())
    evals = [record["eval"] for record in records if "eval" in record]
    shown = dict.fromkeys(["greedy", "pass@1", f"pass@{cfg.eval_samples}"])  # a resume may change n
    line = " | ".join(f"{k} {evals[0].get(k, math.nan):.3f} -> {evals[-1][k]:.3f}" for k in shown)
    print(f"{cfg.variant}{' + λ' if cfg.lambda_weights else ''}: {line} | {wall_s:.0f} s")
    return {"variant": cfg.variant, "steps": cfg.steps, "before": evals[0], "after": evals[-1]}

class UserError(Exception):
    """A bad flag, data line or file. The main function prints it as one line, no traceback."""

def parse_args(argv=None) -> Config:
    """Config from the command line; a value that would crash or train wrong stops here."""
    parser = transformers.HfArgumentParser(Config, allow_abbrev=False)
    parser.error = lambda message: sys.exit(f"grpo.py: error: {message}")  # one line, no usage
    cfg = Config(**vars(parser.parse_args(argv)))
    nonneg = ["beta", "epsilon", "epsilon_high", "warmup_steps", "eval_every", "save_every",
              "log_completions", "eval_limit"]  # may be 0; every other number must be > 0; any seed
    for name, value in vars(cfg).items():
        if type(value) in (int, float) and name != "seed" and not (
                (value >= 0 if name in nonneg else value > 0) and value < math.inf):
            rule = ">=" if name in nonneg else ">"
            raise UserError(f"--{name.replace('_', '-')} {value}: must be {rule} 0")
    if cfg.prompts_per_step % int(os.environ.get("WORLD_SIZE", 1)):
        raise UserError(f"--prompts-per-step {cfg.prompts_per_step}: the ranks must divide it")
    if cfg.variant == "ma" and "</think>" in cfg.response_prefix:
        raise UserError(f"--response-prefix {cfg.response_prefix!r} closes the thought under ma")
    reward_function(cfg.reward_fn)  # a bad --reward-fn stops here
    return cfg

def load_jsonl(path, at_least: int = 1) -> list[dict]:
    """A data file's {"question": str, "answer": str, "rephrasings": [str]} lines, checked."""
    examples = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            ex = json.loads(line)
            strings = [ex["question"], ex["answer"]] + ex.setdefault("rephrasings", [])
            if not all(isinstance(s, str) and s.strip() for s in strings):
                raise ValueError("expected non-empty strings")
        except (ValueError, RecursionError, TypeError, KeyError) as e:  # deep nesting recurses
            raise UserError(f"{path}:{number}: {e!r}") from None
        examples.append(ex)
    if len(examples) < at_least:  # the train file needs a step's prompts
        raise UserError(f"{path}: {len(examples)} examples, fewer than {at_least}")
    return examples

def check_prefix(cfg: Config, examples: list[dict]):
    """Score an empty completion on every question, so a bad reward fails before anything loads.
    Then stop if --response-prefix alone earns more on any question. A lone EOS would earn it."""
    n = len(examples)
    empty = score_batch(replace(cfg, response_prefix=""), examples, [""] * n, [True] * n)
    if cfg.response_prefix and (score_batch(cfg, examples, [""] * n, [True] * n) > empty).any():
        raise UserError(f"--response-prefix {cfg.response_prefix!r} earns the reward alone")

@functools.cache
def reward_function(spec: str):
    """--reward-fn FILE.py:NAME, a function of yours, or else correct. The file runs as a script."""
    if not spec:
        return correct
    path, _, name = spec.rpartition(":")
    functions = runpy.run_path(path) if path.endswith(".py") else {}  # a missing file: OSError
    if not callable(functions.get(name)):
        raise UserError(f"--reward-fn {spec}: wanted FILE.py:NAME, a function in that file")
    return functions[name]

def load_model(path: str, device, dtype=torch.float32):
    """Model and tokenizer from a local folder or the hub, with a pad token."""
    transformers.utils.logging.disable_progress_bar()  # no bar per weight file
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if tokenizer.pad_token is None:  # as Llama's; no mask is ever made from the pad id
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer

def load_run(cfg: Config, device, checkpoint: Path | None, state: dict | None, bf16: bool):
    """The policy, from the checkpoint if any; the reference if β > 0; AdamW."""
    model, tokenizer = load_model(str(checkpoint or cfg.model), device)  # in float32
    dtype = torch.bfloat16 if bf16 else torch.float32  # never trained: bf16 is enough
    ref_model = load_model(cfg.model, device, dtype)[0].requires_grad_(False) if cfg.beta else None
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()  # transformers 5's gradient checkpointing
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    if state:
        optimizer.load_state_dict(state.pop("optimizer"))  # popped, so its copy is freed
    return model, tokenizer, ref_model, optimizer

def open_run(cfg: Config):
    """The latest checkpoint, its state and log(). Its state.pt loads with weights_only, so no code
    runs. The log is cut back to the checkpoint, so no step is in it twice."""
    out, rank = Path(cfg.out), rank_and_world()[0]
    held = sorted([*out.glob("checkpoint-*"), *out.glob("metrics.jsonl")])
    number = lambda path: path.name.removeprefix("checkpoint-")  # "12" for checkpoint-12
    saved = sorted((p for p in held if number(p).isdigit()), key=lambda p: int(number(p)))
    if held and not (cfg.resume or cfg.overwrite) and rank == 0:  # others may see rank 0's new log
        raise UserError(f"--out {out} holds a run: --resume continues it, --overwrite replaces it")
    checkpoint = saved[-1] if cfg.resume and saved else None  # never a .tmp, a save that died
    state = torch.load(checkpoint / "state.pt", "cpu", weights_only=True) if checkpoint else None
    if checkpoint:  # a resume trains what its run trained: only RESUMABLE flags may change
        # a flag added to Config since the save compares as its default, which the run had
        flags = vars(Config()) | json.loads((checkpoint / "flags.json").read_text())
        changed = [k for k in vars(cfg) if k not in RESUMABLE and flags[k] != getattr(cfg, k)]
        changed += ["steps"] if cfg.steps < state["step"] else []  # --steps may only grow
        if changed:
            raise UserError(f"--resume: the run in {out} was trained with " + ", ".join(
                f"--{k.replace('_', '-')} {flags[k]}" for k in changed))
    if rank != 0:
        return checkpoint, state, lambda record: None
    for path in [] if checkpoint else held:  # a fresh run replaces an old one
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    file = open(out / "metrics.jsonl", "a")
    file.truncate(state["log_size"] if state else 0)
    return checkpoint, state, lambda record: print(json.dumps(record, allow_nan=False), file=file,
                                                   flush=True)  # strict JSON: no NaN can pass

def save_checkpoint(cfg: Config, step: int, model, tokenizer, optimizer):
    """On rank 0, out/checkpoint-<step>: model, tokenizer, and state.pt with AdamW, the step and
    the log's size. It is written as .tmp, then renamed: a kill leaves a whole one."""
    out, final = Path(cfg.out), Path(cfg.out) / f"checkpoint-{step}"
    if rank_and_world()[0] == 0:
        tmp = final.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "flags.json").write_text(json.dumps(vars(cfg), indent=1))  # what a resume checks
        log_size = (out / "metrics.jsonl").stat().st_size
        torch.save({"optimizer": optimizer.state_dict(), "step": step, "log_size": log_size},
                   tmp / "state.pt")
        os.replace(tmp, final)
        for old in set(out.glob("checkpoint-*")) - {final}:
            shutil.rmtree(old)
    gather(torch.zeros(1))  # a barrier: no rank runs on, or exits, while rank 0 writes

def setup_ranks() -> torch.device:
    """The device; under torchrun, join the process group: NCCL on GPUs, gloo on CPU."""
    device = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    if device.type == "cuda":  # under torchrun, each rank's own GPU
        torch.cuda.set_device(device := torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # Loading a model imports torch.distributed.nn, whose defaults keep any group made before,
        __import__("torch.distributed.nn")  # and gloo's threads with it, which can abort the exit
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device

def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks; 0 and 1 without torchrun."""
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

def gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x, concatenated along dim 0 in rank order, on the CPU; x itself in one process.
    The ranks' x may differ in length along dim 0. Every rank calls it, as every collective."""
    if not torch.distributed.is_initialized():
        return x
    pieces = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(pieces, x.cpu())  # pickled between our own ranks
    return torch.cat(pieces)

def mean_over_ranks(metrics: dict) -> dict:
    """Each metric's values on every rank -> their mean. A metric with no value is left out."""
    values = {name: gather(value.flatten().double()) for name, value in metrics.items()}
    return {name: v.mean().item() for name, v in values.items() if len(v)}

def sum_gradients(model):
    """Sum the ranks' gradients, not their mean. Each w is a share of the whole batch (rule 1)."""
    for p in model.parameters() if torch.distributed.is_initialized() else []:
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad  # the same calls on every rank
        torch.distributed.all_reduce(p.grad)

def main(argv=None):
    """The command line: bad flags, files or data stop with one line that names them."""
    try:
        return train(parse_args(argv))
    except (UserError, OSError, ImportError) as e:  # a missing file, package or model, say
        sys.exit(f"grpo.py: error: {e}")

if __name__ == "__main__":
    main()
