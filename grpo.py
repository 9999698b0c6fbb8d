"""
grpo.py: GRPO and three recent variants of it, in one file you can read top to bottom.

    python grpo.py                                   # GRPO on the tiny model in data/tiny (CPU, offline, ~2 min)
    python grpo.py --variant lambda                  # or ma, ta
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data my_train.jsonl --test-data my_test.jsonl \\
        --max-new-tokens 512 --lr 1e-6 --gradient-checkpointing    # one GPU, bf16 autocast
    torchrun --nproc_per_node=8 grpo.py ...          # data parallel: each rank samples its share of the prompts

The four schemes differ only in how completions are sampled and how their advantages and per-token weights
are filled in; they share the sampler, the log-prob pass and the loss:

- grpo    GRPO (DeepSeekMath, arXiv 2402.03300): P prompts x G completions; advantage = reward normalised
          within the group; clipped ratio; optional k3 KL to a frozen reference.
- ma      GRPO-MA (arXiv 2509.24494): per prompt K thoughts (stopped after </think>) and M answers per
          thought; a thought's value is the mean reward of its answers, thought advantage normalised over
          the K thoughts, answer advantage over all K*M answers.
- ta      TA-GRPO (arXiv 2601.22478): the question plus N problem-equivalent rephrasings, G samples each;
          advantages normalised jointly over the (N+1)*G responses; every response is trained as if it had
          been an answer to the original question q0 (importance ratios anchored on q0).
- lambda  λ-GRPO (arXiv 2509.21154): each token's loss term is divided by |λ(i,t)|, the number of completions
          in the group that share the completion's prefix up to and including that token.

Everything is organised around *rows*. A row is: context ids (what the completion is conditioned on when
log-probs are taken), completion ids and mask, an advantage (per row or per token) and optional per-token
weights. A variant is a function that samples and fills rows; `update()` does not know which variant made them.

What is simplified versus the papers (honestly):
- Generation is HF `model.generate` with a KV cache, not vLLM; one process samples and trains (no colocated
  inference engine), so it is meant for models up to ~1-3B on one GPU.
- The reward is exact-match of the last <answer>...</answer> (or \\boxed{...}) after simple number
  normalisation, not math_verify; an unfinished completion (no EOS within --max-new-tokens) scores 0.
- No LoRA; the reference model, when beta > 0, is a full frozen copy.
- GRPO-MA: thoughts that never close with </think> are not continued; their M answers score 0 (documented
  in rollout_ma). The paper's weighting between thought and answer tokens is not published; here every
  thought and answer token goes through the same loss aggregation (see rollout_ma). The M answers of a
  thought each prefill prompt + thought again (no shared KV cache).
- TA-GRPO: rephrasings come from the data file (rule-made for the shipped data; `data/prepare.py rephrase`
  makes them with a local model) instead of GPT-4-Turbo.
- λ-GRPO: the paper's synthetic experiment used GPT-2; our reproduction uses a tabular policy.
- The learning rate warms up linearly and then stays constant.
"""

import argparse
import contextlib
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
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPT = "reply <think>...</think><answer>...</answer>"

# -----------------------------------------------------------------------------
# Config: one dataclass of defaults; every field is also a command-line flag.


def _opt(default, help, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    # model and data
    model: str = _opt(str(HERE / "data" / "tiny"), "local folder or hub name of a causal LM and its tokenizer")
    data: str = _opt(str(HERE / "data" / "train.jsonl"), "training JSONL: question, answer, rephrasings (optional)")
    test_data: str = _opt(str(HERE / "data" / "test.jsonl"), "held-out JSONL for eval")
    system_prompt: str = _opt(SYSTEM_PROMPT, "system message of every prompt ('' for none)")
    variant: str = _opt("grpo", "advantage/weighting scheme", ["grpo", "ma", "ta", "lambda"])
    # sampling
    num_generations: int = _opt(8, "G: completions per prompt (grpo, lambda) or per question (ta)")
    prompts_per_step: int = _opt(16, "P: prompts per step")
    max_new_tokens: int = _opt(32, "completion length limit (for ma: the thought's limit)")
    temperature: float = _opt(1.0, "sampling temperature; log-probs use the same")
    top_p: float = _opt(1.0, "nucleus sampling (1.0 = off); top-k is always off")
    # GRPO-MA
    num_thoughts: int = _opt(4, "K (ma): thoughts per prompt")
    num_answers: int = _opt(4, "M (ma): answers per thought")
    max_answer_tokens: int = _opt(12, "answer length limit (ma)")
    # TA-GRPO
    num_rephrasings: int = _opt(3, "N (ta): rephrasings per question, drawn afresh each step")
    ta_anchor: str = _opt("original", "(ta) context for log-probs: q0 (paper v5) or the rephrasing (public code)",
                          ["original", "rephrased"])
    # loss and optimisation
    loss_type: str = _opt("dapo", "token aggregation, as TRL", ["grpo", "bnpo", "dr_grpo", "dapo"])
    scale_rewards: str = _opt("group", "std used to scale advantages", ["group", "batch", "none"])
    beta: float = _opt(0.0, "k3 KL coefficient (a reference model is loaded only when > 0)")
    epsilon: float = _opt(0.2, "lower clip range of the ratio")
    epsilon_high: float = _opt(0.0, "upper clip range (0 = same as --epsilon; DAPO uses 0.28)")
    num_iterations: int = _opt(1, "mu: updates per sampled batch")
    format_reward: float = _opt(0.0, "extra reward for a well-formed <think>..</think><answer>..</answer>")
    lr: float = _opt(2e-4, "AdamW learning rate (tiny model; use ~1e-6 for real models)")
    warmup_steps: int = _opt(10, "linear warmup, then constant")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    max_grad_norm: float = _opt(1.0, "gradient clipping")
    micro_batch_size: int = _opt(64, "rows per forward/backward (gradients accumulate across them)")
    steps: int = _opt(100, "training steps")
    # eval, logging, checkpoints, runtime
    eval_every: int = _opt(50, "eval every N steps (0 = only at start and end)")
    save_every: int = _opt(50, "checkpoint every N steps (0 = only at the end); SIGTERM, Ctrl-C and crashes save too")
    eval_samples: int = _opt(8, "samples per held-out question for pass@k")
    eval_limit: int = _opt(0, "use only the first N held-out questions (0 = all)")
    out: str = _opt("out", "run folder: metrics.jsonl, checkpoint")
    resume: bool = _opt(False, "continue from the latest checkpoint in --out")
    overwrite: bool = _opt(False, "replace a run already in --out (without it, such a folder stops the run)")
    seed: int = _opt(0, "seed for data order, sampling and init")
    device: str = _opt("auto", "auto picks cuda, then mps, then cpu", ["auto", "cuda", "mps", "cpu"])
    gradient_checkpointing: bool = _opt(False, "trade compute for activation memory (real models)")


class ConfigError(ValueError):
    pass


class DataError(ValueError):
    pass


def parse_args(argv=None) -> Config:
    """Build argparse from the Config fields (--field-name), then check the sizes."""
    parser = argparse.ArgumentParser(description="GRPO and variants in one file.")
    parser.error = lambda message: sys.exit(f"grpo.py: error: {message}")  # one line, not usage + error
    for f in fields(Config):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        else:
            parser.add_argument(flag, type=f.type, default=f.default, choices=f.metadata["choices"], help=help)
    cfg = Config(**vars(parser.parse_args(argv)))
    check_config(cfg)
    return cfg


def check_config(cfg: Config):
    """Stop on impossible values with one line naming the flag."""
    at_least = [("num_generations", 2), ("prompts_per_step", 1), ("num_thoughts", 2), ("num_answers", 1),
                ("num_rephrasings", 1), ("max_new_tokens", 1), ("max_answer_tokens", 1), ("num_iterations", 1),
                ("micro_batch_size", 1), ("eval_samples", 1), ("steps", 0), ("warmup_steps", 0),
                ("eval_every", 0), ("eval_limit", 0), ("save_every", 0),
                ("beta", 0.0), ("epsilon", 0.0), ("epsilon_high", 0.0), ("weight_decay", 0.0)]
    above = ["lr", "temperature", "max_grad_norm"]
    for name in ["lr", "temperature", "top_p", "beta", "epsilon", "epsilon_high", "format_reward", "weight_decay",
                 "max_grad_norm"]:
        if not math.isfinite(getattr(cfg, name)):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(cfg, name)}")
    for name, low in at_least:
        if getattr(cfg, name) < low:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(cfg, name)}")
    for name in above:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {cfg.top_p}")

# -----------------------------------------------------------------------------
# Data: JSONL rows {"question": str, "answer": str, "rephrasings": [str, ...]} (rephrasings optional).


class Row(dict):
    """A data row {"question", "answer", "rephrasings"} that remembers its 'file:line' for later errors."""
    where = ""


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
            raise DataError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object with 'question' and 'answer'")
        for key in ("question", "answer"):
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key == "answer":
                value = row[key] = str(value)
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where}: field '{key}' is missing or empty")
        rephrasings = row.setdefault("rephrasings", [])
        if not isinstance(rephrasings, list) or not all(isinstance(r, str) and r.strip() for r in rephrasings):
            raise DataError(f"{where}: field 'rephrasings' must be a list of non-empty strings")
        row = Row(row)
        row.where = where
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def prompt_ids(tokenizer, question: str, system_prompt: str) -> list[int]:
    """Chat-template a question (with the system prompt) into token ids, generation prompt included."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def check_lengths(tokenizer, rows: list[Row], cfg, max_positions: int, phrasings: bool):
    """Stop before training when a prompt plus its completion budget (thought + answer for ma) would run
    past the model's positions; phrasings=True checks the rephrasings too."""
    budget = cfg.max_new_tokens + (cfg.max_answer_tokens if cfg.variant == "ma" else 0)
    for row in rows:
        for question in [row["question"]] + (row["rephrasings"] if phrasings else []):
            n = len(prompt_ids(tokenizer, question, cfg.system_prompt))
            if n + budget > max_positions:
                raise DataError(f"{row.where}: a prompt of {n} tokens + {budget} new tokens = {n + budget} exceeds "
                                f"the model's {max_positions} positions (max_position_embeddings); shorten the "
                                f"question or lower --max-new-tokens")

# -----------------------------------------------------------------------------
# Rewards: exact match of the final answer. Model output is only ever parsed as text.

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d+(\.\d+)?")
FRACTION_RE = re.compile(r"(-?\d+)/(\d+)|\\d?frac\{(-?\d+)\}\{(\d+)\}")
NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"  # any text without a think/answer tag in it
FORMAT_RE = re.compile(rf"\s*<think>{NO_TAG}</think>\s*<answer>{NO_TAG}</answer>\s*", re.DOTALL)
MAX_NUMBER_CHARS = 100  # longer "numbers" are not parsed: int() refuses > 4300 digits, and none is an answer


def extract_answer(text: str):
    """The last <answer>...</answer>, else the last \\boxed{...} (braces matched), else None. Only the text
    after the first </think> is read, so an answer written inside the thought is never credited."""
    text = text.split("</think>", 1)[-1]
    found = ANSWER_RE.findall(text)
    if found:
        return found[-1]
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def parse_number(text: str):
    """'1,234' '+5' '85.0' '-3/4' '\\frac{1}{2}' -> Fraction; anything else -> None."""
    s = re.sub(r"[\s,$]", "", text)
    s = s[1:] if s.startswith("+") else s
    if len(s) > MAX_NUMBER_CHARS:
        return None
    if NUMBER_RE.fullmatch(s):
        return Fraction(s)
    m = FRACTION_RE.fullmatch(s)
    if m:
        num, den = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return Fraction(int(num), int(den)) if int(den) else None
    return None


def score(text: str, reference: str, finished: bool, format_reward: float = 0.0):
    """Return (reward, parsed). Reward 1 if the completion finished (EOS) and its answer equals the
    reference (as numbers when both parse, else as whitespace-free strings); plus format_reward for exactly
    one <think>..</think> followed by exactly one <answer>..</answer>. parsed is False when no answer could
    be read."""
    answer = extract_answer(text)
    ref_num = parse_number(reference)
    answer_num = parse_number(answer) if answer is not None else None
    parsed = answer is not None and (ref_num is None or answer_num is not None)
    correct = False
    if parsed and finished:
        correct = (answer_num == ref_num) if ref_num is not None else (
            re.sub(r"\s", "", answer) == re.sub(r"\s", "", reference))
    shaped = finished and FORMAT_RE.fullmatch(text) is not None
    return float(correct) + format_reward * shaped, parsed

# -----------------------------------------------------------------------------
# Sampler: batched, left-padded, KV-cached generation; returns completions and their masks.


def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's (Qwen has two)."""
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


def completion_mask(completion_ids, eos, tokenizer=None, stop_strings=None):
    """(B, C) mask of the tokens up to and including the first EOS or the token that completes a stop
    string, plus (B,) finished flags. Never `!= pad`: real tokenizers often have pad == eos, and generate
    pads a stopped row with pad, which would look like an EOS the model never chose."""
    B, C = completion_ids.shape
    ends = torch.full((B,), C, dtype=torch.long)
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device)).cpu()
    has_eos = is_eos.any(1)
    ends[has_eos] = is_eos.int().argmax(1)[has_eos]
    if stop_strings:
        pieces = tokenizer.batch_decode(completion_ids.reshape(-1, 1).cpu())  # each token's text
        for i in range(B):
            row = pieces[i * C:(i + 1) * C]
            cum = np.cumsum([len(p) for p in row])
            text = "".join(row)
            hits = [text.find(s) + len(s) for s in stop_strings if s in text]
            if hits:
                ends[i] = min(ends[i], int(np.searchsorted(cum, min(hits))))
    positions = torch.arange(C)[None, :]
    return (positions <= ends[:, None]).long().to(completion_ids.device), ends < C


@torch.no_grad()
def sample(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature=1.0, top_p=1.0,
           greedy=False, stop_strings=None, batch_size=512):
    """Sample one completion per prompt (token-id lists). Returns completion_ids (B, C), completion_mask
    (B, C) and finished (B,). Seed torch beforehand for reproducible samples."""
    was_training = model.training
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    model.eval()
    if checkpointing:  # with checkpointing on, generate silently turns the KV cache off
        model.gradient_checkpointing_disable()
    eos = eos_ids(model, tokenizer)
    # only EOS and pad come from the model's generation config: a hub config's top-k, min-p, typical-p,
    # repetition or n-gram penalties would sample from a policy that the log-probs of the loss never see
    from transformers import GenerationConfig
    hub_config = model.generation_config
    model.generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=not greedy,
        **({} if greedy else dict(temperature=temperature, top_p=top_p, top_k=0)))
    device = next(model.parameters()).device
    chunks = []
    try:
        for i in range(0, len(prompts), batch_size):
            ids, mask = left_pad(prompts[i:i + batch_size], tokenizer.pad_token_id)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), stop_strings=stop_strings,
                                 tokenizer=tokenizer if stop_strings else None)
            chunks.append(out[:, ids.shape[1]:])
    finally:
        model.generation_config = hub_config
    C = max(c.shape[1] for c in chunks)
    completion_ids = torch.cat([torch.nn.functional.pad(c, (0, C - c.shape[1]), value=tokenizer.pad_token_id)
                                for c in chunks])
    mask, finished = completion_mask(completion_ids, eos, tokenizer, stop_strings)
    model.train(was_training)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return completion_ids, mask, finished


def decode(tokenizer, completion_ids, completion_mask) -> list[str]:
    """The text of each completion's masked tokens, special tokens dropped."""
    return [tokenizer.decode(ids[m.bool()], skip_special_tokens=True) for ids, m in zip(completion_ids, completion_mask)]

# -----------------------------------------------------------------------------
# Rows: what every variant hands to the loss.


@dataclass
class Rows:
    context_ids: torch.Tensor      # (B, Lc) left-padded: what the completion is conditioned on
    context_mask: torch.Tensor     # (B, Lc)
    completion_ids: torch.Tensor   # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) 1 up to and including EOS / stop
    advantages: torch.Tensor       # (B,) or (B, C)
    token_weights: torch.Tensor | None = None  # (B, C) multiplies the whole per-token loss (λ-GRPO)

    def __len__(self):
        return len(self.completion_ids)

    def select(self, idx):
        pick = lambda t: None if t is None else t[idx]
        return Rows(*(pick(getattr(self, f.name)) for f in fields(self)))


def make_rows(contexts: list[list[int]], completion_ids, completion_mask, advantages, pad_id, token_weights=None):
    """Rows from context id lists (left-padded here) and sampled completions."""
    context_ids, context_mask = left_pad(contexts, pad_id)
    return Rows(context_ids, context_mask, completion_ids.cpu(), completion_mask.cpu(), advantages, token_weights)


def cat_rows(parts: list[Rows], pad_id) -> Rows:
    """Stack rows of different context and completion lengths (GRPO-MA's thought and answer rows):
    contexts are left-padded, completions right-padded. Parts carry one advantage per row and no weights."""
    Lc = max(r.context_ids.shape[1] for r in parts)
    C = max(r.completion_ids.shape[1] for r in parts)
    left = lambda t, value: torch.nn.functional.pad(t, (Lc - t.shape[1], 0), value=value)
    right = lambda t, value: torch.nn.functional.pad(t, (0, C - t.shape[1]), value=value)
    assert all(r.advantages.dim() == 1 and r.token_weights is None for r in parts)
    return Rows(torch.cat([left(r.context_ids, pad_id) for r in parts]),
                torch.cat([left(r.context_mask, 0) for r in parts]),
                torch.cat([right(r.completion_ids, pad_id) for r in parts]),
                torch.cat([right(r.completion_mask, 0) for r in parts]),
                torch.cat([r.advantages for r in parts]))


def trim(rows: Rows) -> Rows:
    """Drop context columns that are padding in every row and completion columns masked in every row."""
    first = int(rows.context_mask.any(0).int().argmax())
    last = int(rows.completion_mask.any(0).nonzero().max()) + 1 if rows.completion_mask.any() else 1
    cut = lambda t: None if t is None else (t[:, :last] if t.dim() == 2 else t)
    return Rows(rows.context_ids[:, first:], rows.context_mask[:, first:], rows.completion_ids[:, :last],
                rows.completion_mask[:, :last], cut(rows.advantages), cut(rows.token_weights))

# -----------------------------------------------------------------------------
# Log-probs: log π(completion_t | context, completion_<t), without a (B, T, V) float32 log-softmax copy.


def per_token_logps(model, input_ids, attention_mask, completion_len: int, temperature: float = 1.0):
    """input_ids (B, L) = left-padded context + completion -> (B, C) float32 log-probs of the completion
    tokens under logits / temperature (the distribution they were sampled from)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=completion_len + 1).logits[:, :-1]  # (B, C, V), model dtype
    targets = input_ids[:, -completion_len:]
    # a few rows at a time, so that logsumexp's float32 temporaries stay near 2**27 elements (512 MB)
    rows_per_chunk = max(1, 2**27 // logits[0].numel())
    chunks = []
    for chunk, chunk_targets in zip(logits.split(rows_per_chunk), targets.split(rows_per_chunk)):
        chunk = chunk.float() / temperature  # divide after the cast: bf16 logits / T would round again
        chunks.append(chunk.gather(-1, chunk_targets[..., None]).squeeze(-1) - chunk.logsumexp(-1))
    return torch.cat(chunks)

# -----------------------------------------------------------------------------
# Advantages and token weights: one small function per scheme, on plain tensors.


def _nanstd(x, dim=None, keepdim=False):
    """Unbiased (ddof=1) std that ignores NaN entries."""
    mean = x.nanmean(dim=dim, keepdim=True) if dim is not None else x.nanmean()
    n = (~x.isnan()).sum(dim=dim, keepdim=keepdim) if dim is not None else (~x.isnan()).sum()
    sq = ((x - mean) ** 2).nansum(dim=dim, keepdim=keepdim) if dim is not None else ((x - mean) ** 2).nansum()
    return (sq / (n - 1)).sqrt()


def group_advantages(rewards, group_size: int, scale: str = "group", eps: float = 1e-4):
    """GRPO advantages. Rows form groups of `group_size` consecutive rewards;
    A = (r - group mean) / (std + eps), std unbiased (ddof=1, as TRL); scale="batch" uses the std of the
    whole batch, "none" skips the division. A group whose rewards are all equal gets 0. NaN rewards mark
    rows that do not exist (ragged groups): they are left out of the statistics and get NaN back.

    >>> group_advantages(torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.]), 4)
    tensor([ 1.4997, -0.4999, -0.4999, -0.4999,  0.0000,  0.0000,  0.0000,  0.0000])

    (group 1: mean 0.25, std 0.5, so 0.75/0.5001 and -0.25/0.5001; group 2 has one value, so 0.)
    """
    r = rewards.reshape(-1, group_size)  # (num_groups, group_size)
    adv = r - r.nanmean(1, keepdim=True)
    if scale == "group":
        adv = adv / (_nanstd(r, 1, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / (_nanstd(rewards) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    filled = torch.where(r.isnan(), -math.inf, r)
    emptied = torch.where(r.isnan(), math.inf, r)
    constant = filled.amax(1, keepdim=True) == emptied.amin(1, keepdim=True)
    adv = torch.where(constant & ~r.isnan(), 0.0, adv)  # exactly 0, not rounding noise / eps
    return adv.reshape(rewards.shape)


def ma_advantages(rewards, scale: str = "group", eps: float = 1e-4):
    """GRPO-MA advantages from a (P, K, M) reward tensor: P prompts, K thoughts each, M answers per thought.
    A thought's value V(th_k) is the mean of its M answer rewards; the thought advantage normalises V over
    the K thoughts of its prompt; the answer advantage normalises the rewards over all K*M answers of the
    prompt (not within a thought). Same std convention and zero-variance rule as group_advantages.
    A thought that was never answered (it did not close with </think>) has NaN answer rewards: its value
    is 0 and its missing answers are left out of the answer statistics (they get NaN back).
    Returns (thought_adv (P, K), answer_adv (P, K, M)).

    One prompt, K=2, M=2, rewards [[1, 1], [1, 0]]: V = [1, 0.5], mean 0.75, std 0.3536 ->
    thought_adv = [0.7069, -0.7069]; answers: mean 0.75, std 0.5 -> answer_adv = [[0.4999, 0.4999], [0.4999, -1.4997]].
    Rewards [[1, 0], [nan, nan]]: V = [0.5, 0] -> thought_adv = [0.7069, -0.7069]; answer_adv = [[0.7070, -0.7070],
    [nan, nan]] (the two real answers alone: mean 0.5, std 0.7071).
    """
    P, K, M = rewards.shape
    values = rewards.nanmean(-1).nan_to_num(0.0)  # (P, K); an unanswered thought is worth 0
    thought_adv = group_advantages(values.reshape(-1), K, scale, eps).reshape(P, K)
    answer_adv = group_advantages(rewards.reshape(-1), K * M, scale, eps).reshape(P, K, M)
    return thought_adv, answer_adv


def ta_advantages(rewards, scale: str = "group", eps: float = 1e-4):
    """TA-GRPO advantages from a (P, N+1, G) reward tensor: question q0 and its N rephrasings, G responses
    each. All (N+1)*G responses of a question form one group. A question with fewer than N rephrasings
    marks the missing ones with NaN rewards (a ragged group): they are ignored and get NaN back.

    One question, N=1, G=2, rewards [[1, 1], [0, 1]]: the q0 group alone has zero variance, but pooled
    mean 0.75, std 0.5 -> [[0.4999, 0.4999], [-1.4997, 0.4999]].
    """
    P, Q, G = rewards.shape
    return group_advantages(rewards.reshape(-1), Q * G, scale, eps).reshape(P, Q, G)


def lambda_weights(completion_ids, completion_mask, group_size: int):
    """λ-GRPO token weights 1/|λ(i,t)|, (B, T) float, 0 where the mask is 0.

    λ(i,t), the process set of token t of completion i, is the set of completions j in i's group whose
    tokens 0..t (up to and including t) equal i's and are all unmasked; it counts i itself and exact
    duplicates. Tokens in a shared prefix are trained once per prefix instead of once per completion.
    Rows form groups of `group_size` consecutive rows. Exact and loop-free: compare every pair of rows of a
    group token by token, and a running product turns "equal at t" into "equal up to and including t";
    this takes B * group_size * T bytes.

    Group {ABCD, ABEFHI, JKLM, JKLNQST, JKLNQU, VWYZ}: A,B -> 1/2; J,K,L -> 1/3; N,Q -> 1/2; others 1.
    """
    B, T = completion_ids.shape
    ids = completion_ids.view(-1, group_size, T)        # (groups, G, T)
    mask = completion_mask.view(-1, group_size, T).bool()
    same = (ids[:, :, None] == ids[:, None]) & mask[:, :, None] & mask[:, None]  # (groups, G, G, T): i, j, t
    counts = same.to(torch.uint8).cumprod(-1).sum(2, dtype=torch.int32)          # |λ(i,t)|, (groups, G, T)
    return torch.where(mask, 1.0 / counts.clamp(min=1), 0.0).view(B, T)

# -----------------------------------------------------------------------------
# Loss: clipped ratio, optional k3 KL, per-token weights, TRL's aggregations.


def policy_loss(per_token_logps, old_per_token_logps, advantages, completion_mask, ref_per_token_logps=None,
                token_weights=None, beta=0.0, epsilon=0.2, epsilon_high=None, loss_type="dapo",
                max_completion_length=None):
    """GRPO surrogate loss (to minimise) and metrics.

    per-token loss = -min(ρ A, clip(ρ, 1-ε, 1+ε_high) A) + β (exp(ref - logp) - (ref - logp) - 1),
    with ρ = exp(logp - old); advantages (B,) broadcast over tokens, or (B, T) per token. token_weights
    (B, T) multiply the whole per-token loss (policy and KL) and leave the normaliser alone (λ-GRPO).
    Aggregation as TRL: grpo = mean over rows of each row's token mean; bnpo/dapo = sum over all tokens /
    number of tokens; dr_grpo = sum / (B * max_completion_length).
    Per-token losses A=[1,1], B=[2,2,2,2]: grpo 1.5, bnpo/dapo 1.667, dr_grpo (length 8) 0.625.
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
    n = mask.sum().clamp(min=1)
    with torch.no_grad():
        metrics["clip_low"] = (((ratio < 1 - epsilon) & (adv < 0)).float() * mask).sum().item() / n.item()
        metrics["clip_high"] = (((ratio > 1 + epsilon_high) & (adv > 0)).float() * mask).sum().item() / n.item()
    return total, metrics

# -----------------------------------------------------------------------------
# Rollouts: one function per variant samples completions, scores them and fills rows.


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


def score_batch(tokenizer, completion_ids, completion_mask, finished, answers, format_reward=0.0, prefixes=None):
    """Rewards (B,) and parsed flags (B,) for sampled completions; prefixes (e.g. a thought) are prepended."""
    texts = decode(tokenizer, completion_ids, completion_mask)
    if prefixes is not None:
        texts = [p + t for p, t in zip(prefixes, texts)]
    scored = [score(t, a, bool(f), format_reward) for t, a, f in zip(texts, answers, finished)]
    return torch.tensor([r for r, _ in scored]), torch.tensor([p for _, p in scored])


def sample_metrics(rewards, group_size, parsed, completion_mask, finished) -> dict:
    """Reward, zero-variance, length, truncation and parse metrics of one step's samples."""
    groups = rewards.reshape(-1, group_size)
    lengths = completion_mask.sum(1).float()
    return {"reward": rewards.mean().item(), "reward_std": rewards.std().item(),
            "frac_reward_zero_std": (groups.amax(1) == groups.amin(1)).float().mean().item(),
            "completion_length": lengths.mean().item(), "completion_length_max": lengths.max().item(),
            "truncated": 1 - finished.float().mean().item(), "unparseable": 1 - parsed.float().mean().item()}


def rollout_grpo(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """GRPO (and λ-GRPO): G completions per prompt, group-normalised advantages; for `lambda` the rows also
    carry 1/|λ| token weights."""
    G, metrics = cfg.num_generations, {}
    prompts = [p for row in batch for p in [prompt_ids(tokenizer, row["question"], cfg.system_prompt)] * G]
    with timed(metrics, "time/sample"):
        ids, mask, finished = sample(model, tokenizer, prompts, cfg.max_new_tokens, cfg.temperature, cfg.top_p)
    with timed(metrics, "time/score"):
        answers = [row["answer"] for row in batch for _ in range(G)]
        rewards, parsed = score_batch(tokenizer, ids, mask, finished, answers, cfg.format_reward)
        advantages = on_global_batch(group_advantages, rewards, G, cfg.scale_rewards)
        weights = lambda_weights(ids, mask, G) if cfg.variant == "lambda" else None
    metrics.update(sample_metrics(rewards, G, parsed, mask, finished), tokens=mask.sum().item())
    if weights is not None:
        on = mask.bool()
        metrics["lambda_mean"] = (1 / weights[on]).mean().item()        # mean |λ| over completion tokens
        metrics["lambda_shared"] = (weights[on] < 1).float().mean().item()  # share of tokens with |λ| > 1
    return make_rows(prompts, ids, mask, advantages, tokenizer.pad_token_id, weights), metrics


def rollout_ma(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """GRPO-MA: K thoughts per prompt, each stopped by the token whose text completes </think> (with a BPE
    tokenizer that token can carry more text, e.g. '><' of '</think><answer>'), then M answers per thought,
    continued from prompt + the thought's tokens as sampled and stopped at EOS. An answer is scored on the
    thought's text + its own text (only what follows </think> can be the answer).

    A thought whose text has no </think> (length limit or EOS) is *unclosed*: it is not continued, its M
    answers are missing (NaN rewards, left out of the answer statistics), its value is 0, and the thought
    row itself is trained with its (usually negative) thought advantage. Counted in metrics["unclosed_thoughts"].

    Each thought is one row (context = prompt, advantage = thought advantage), trained once, not M times;
    each answer is one row (context = prompt + its thought, advantage = answer advantage). Under the token
    aggregations (dapo, bnpo) every thought and answer token weighs the same in one token mean, so the
    K*M answers together outweigh the K thoughts when answers are as long; under grpo each row (thought or
    answer) is one sequence of the row mean; under dr_grpo every token counts 1/(rows * max length).
    """
    K, M, metrics = cfg.num_thoughts, cfg.num_answers, {}
    prompts = [p for row in batch for p in [prompt_ids(tokenizer, row["question"], cfg.system_prompt)] * K]
    with timed(metrics, "time/sample"):
        th_ids, th_mask, th_finished = sample(model, tokenizer, prompts, cfg.max_new_tokens, cfg.temperature,
                                              cfg.top_p, stop_strings=["</think>"])
    thoughts = decode(tokenizer, th_ids, th_mask)
    closed = torch.tensor(["</think>" in t for t in thoughts])
    keep = closed.nonzero().squeeze(1).tolist()
    contexts = [prompts[k] + th_ids[k][th_mask[k].bool()].tolist() for k in keep for _ in range(M)]
    rewards = torch.full((len(prompts), M), math.nan)  # (P*K, M): unclosed thoughts have no answers
    pad = tokenizer.pad_token_id
    metrics.update(tokens=th_mask.sum().item(), answer_reward=0.0, answer_length=0.0, truncated=1.0, unparseable=1.0)
    if keep:
        with timed(metrics, "time/sample"):
            ans_ids, ans_mask, ans_finished = sample(model, tokenizer, contexts, cfg.max_answer_tokens,
                                                     cfg.temperature, cfg.top_p)
        with timed(metrics, "time/score"):
            answers = [batch[k // K]["answer"] for k in keep for _ in range(M)]
            r, parsed = score_batch(tokenizer, ans_ids, ans_mask, ans_finished, answers, cfg.format_reward,
                                    prefixes=[thoughts[k] for k in keep for _ in range(M)])
            rewards[keep] = r.view(-1, M)
        metrics.update(tokens=metrics["tokens"] + ans_mask.sum().item(), answer_reward=r.mean().item(),
                       answer_length=ans_mask.sum(1).float().mean().item(),
                       truncated=1 - ans_finished.float().mean().item(), unparseable=1 - parsed.float().mean().item())
    thought_adv, answer_adv = on_global_batch(ma_advantages, rewards.view(len(batch), K, M), cfg.scale_rewards)
    parts = [make_rows(prompts, th_ids, th_mask, thought_adv.reshape(-1), pad)]
    if keep:
        parts.append(make_rows(contexts, ans_ids, ans_mask, answer_adv.reshape(-1, M)[keep].reshape(-1), pad))
    values = rewards.view(len(batch), K, M).nanmean(-1).nan_to_num(0.0)  # V(th_k), (P, K)
    metrics.update(reward=values.mean().item(), reward_std=values.std().item(), thought_reward=values.mean().item(),
                   frac_reward_zero_std=(values.amax(1) == values.amin(1)).float().mean().item(),
                   unclosed_thoughts=1 - closed.float().mean().item(),
                   thought_length=th_mask.sum(1).float().mean().item())
    return cat_rows(parts, pad), metrics


def rollout_ta(model, tokenizer, cfg: Config, batch: list[dict], rng):
    """TA-GRPO: for each question q0 take up to N of its rephrasings (a fresh random subset each step),
    sample G responses to each of the N+1 questions, score each response as it is, and normalise the
    advantages jointly over the question's (n+1)*G responses (ragged when a question has n < N).
    With --ta-anchor original (paper v5) every row's context is q0's prompt, so the current, old and
    reference log-probs are all log π(o | q0); `rephrased` keeps the prompt that produced the response
    (the public code's behaviour)."""
    G, N, metrics = cfg.num_generations, cfg.num_rephrasings, {}
    questions = [[row["question"]] + rng.sample(row["rephrasings"], min(N, len(row["rephrasings"]))) for row in batch]
    slots = [(p, j, g) for p, qs in enumerate(questions) for j in range(len(qs)) for g in range(G)]
    p_idx, j_idx, g_idx = torch.tensor(slots).T  # row -> (question, phrasing, sample)
    templated = [[prompt_ids(tokenizer, q, cfg.system_prompt) for q in qs] for qs in questions]  # once per question
    own = [templated[p][j] for p, j, _ in slots]
    with timed(metrics, "time/sample"):
        ids, mask, finished = sample(model, tokenizer, own, cfg.max_new_tokens, cfg.temperature, cfg.top_p)
    with timed(metrics, "time/score"):
        r, parsed = score_batch(tokenizer, ids, mask, finished, [batch[p]["answer"] for p, _, _ in slots],
                                cfg.format_reward)
        rewards = torch.full((len(batch), N + 1, G), math.nan)  # (P, N+1, G); NaN = no such phrasing
        rewards[p_idx, j_idx, g_idx] = r
        advantages = on_global_batch(ta_advantages, rewards, cfg.scale_rewards)[p_idx, j_idx, g_idx]
    contexts = own if cfg.ta_anchor == "rephrased" else [templated[p][0] for p, _, _ in slots]
    originals = rewards[:, 0]  # (P, G): what plain GRPO would have seen
    pooled = [rewards[p][~rewards[p].isnan()] for p in range(len(batch))]
    metrics.update(sample_metrics(r, G, parsed, mask, finished), tokens=mask.sum().item(),
                   frac_reward_zero_std=(originals.amax(1) == originals.amin(1)).float().mean().item(),
                   frac_reward_zero_std_pooled=float(np.mean([(g.max() == g.min()).item() for g in pooled])),
                   reward_original=originals.mean().item(), reward_rephrased=r[j_idx > 0].mean().item())
    return make_rows(contexts, ids, mask, advantages, tokenizer.pad_token_id), metrics


ROLLOUTS = {"grpo": rollout_grpo, "lambda": rollout_grpo, "ma": rollout_ma, "ta": rollout_ta}

# -----------------------------------------------------------------------------
# Update: log-probs of the rows, μ clipped steps. The same code for every variant.


def rows_logps(model, rows: Rows, temperature, device):
    """(B, C) per-token log-probs of the rows' completions given their contexts."""
    input_ids = torch.cat([rows.context_ids, rows.completion_ids], 1).to(device)
    attention_mask = torch.cat([rows.context_mask, rows.completion_mask], 1).to(device)
    return per_token_logps(model, input_ids, attention_mask, rows.completion_ids.shape[1], temperature)


def world_size() -> int:
    """Number of data-parallel ranks (1 without torchrun)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum (or mean, or max) plain numbers over the data-parallel ranks; identity in a single process."""
    if not torch.distributed.is_initialized():
        return values
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM)
    return (t / world_size() if op == "mean" else t).tolist()


def on_global_batch(scheme, rewards, *args):
    """scheme(rewards, *args) computed on the rewards of all ranks, returning this rank's part (as TRL does),
    so that batch statistics (--scale-rewards batch) are those of the whole batch. Every rank holds the same
    number of prompts, so the rewards tensors have the same shape; one process: scheme(rewards, *args)."""
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


def reduce_metrics(metrics: dict) -> dict:
    """A rank's rollout metrics averaged over the ranks (the maximum for *_max keys)."""
    keys = sorted(metrics)
    means, maxima = (all_reduce([metrics[k] for k in keys], op) for op in ("mean", "max"))
    return {k: hi if k.endswith("_max") else m for k, m, hi in zip(keys, means, maxima)}


def update(model, ref_model, optimizer, rows: Rows, cfg: Config, device) -> dict:
    """μ = --num-iterations optimiser steps on one batch of rows, in micro-batches. Each micro-batch loss
    is weighted so that the weighted sum is the loss of the whole (global) batch under cfg.loss_type; under
    DDP, which averages gradients over W ranks, the weights carry a factor W and use global row/token counts."""
    metrics, W = {}, world_size()
    micro = [trim(rows.select(slice(i, i + cfg.micro_batch_size))) for i in range(0, len(rows), cfg.micro_batch_size)]
    tokens = [m.completion_mask.sum().item() for m in micro]
    global_rows, global_tokens = all_reduce([len(rows), sum(tokens)])
    share = {"grpo": [W * len(m) / global_rows for m in micro], "dr_grpo": [W * len(m) / global_rows for m in micro],
             "bnpo": [1 / len(micro)] * len(micro),  # TRL's bnpo normalises each micro-batch on its own
             "dapo": [W * t / max(global_tokens, 1) for t in tokens]}[cfg.loss_type]
    max_len = max(cfg.max_new_tokens, cfg.max_answer_tokens if cfg.variant == "ma" else 0)
    with timed(metrics, "time/logps"), torch.no_grad():
        # old log-probs are needed only when the batch is reused (μ > 1); at μ = 1 they equal the current ones
        old = [rows_logps(model, m, cfg.temperature, device) for m in micro] if cfg.num_iterations > 1 else None
        ref = [rows_logps(ref_model, m, cfg.temperature, device) for m in micro] if cfg.beta > 0 else None
    totals, grad_norms = {}, []
    with timed(metrics, "time/update"):
        for _ in range(cfg.num_iterations):
            for j, m in enumerate(micro):
                last = j == len(micro) - 1  # DDP all-reduces gradients on the last micro-batch only
                with model.no_sync() if W > 1 and not last else contextlib.nullcontext():
                    logps = rows_logps(model, m, cfg.temperature, device)
                    loss, loss_metrics = policy_loss(
                        logps, old[j] if old else logps.detach(), m.advantages.to(device), m.completion_mask.to(device),
                        ref_per_token_logps=ref[j] if ref else None,
                        token_weights=None if m.token_weights is None else m.token_weights.to(device),
                        beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high or None,
                        loss_type=cfg.loss_type, max_completion_length=max_len)
                    (loss * share[j]).backward()
                # the loss adds up as the objective does; kl and clip fractions are token means of the batch
                weights = dict.fromkeys(loss_metrics, tokens[j] / max(global_tokens, 1)) | {"loss": share[j] / W}
                for key, value in dict(loss_metrics, loss=loss.item()).items():
                    totals[key] = totals.get(key, 0.0) + value * weights[key] / cfg.num_iterations
            grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm).item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    metrics.update(zip(totals, all_reduce(list(totals.values()))), grad_norm=float(np.mean(grad_norms)))
    return metrics

# -----------------------------------------------------------------------------
# Train loop and checkpoints.


def pick_device(name: str) -> torch.device:
    """--device: auto picks cuda, then mps, then cpu; an explicit device must be available."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available on this machine")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps: MPS is not available on this machine")
    return torch.device(name)


def load_model(path: str, device):
    """Model and tokenizer from a local folder or the hub; left padding, a pad token, fp32 weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
        raise ConfigError(f"--model {path}: no such folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as e:  # a missing, corrupt or empty file: say which folder, in one line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"--model {path}: cannot load a model and tokenizer there ({reason})") from None
    if tokenizer.pad_token is None:  # Llama: pad with eos; the completion mask never relies on pad
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer


def checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints in a run folder, oldest first (a save in progress is '*.tmp')."""
    found = [p for p in out.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(out: Path, model, tokenizer, optimizer, scheduler, step: int, cfg: Config) -> Path:
    """Write out/checkpoint-<step>: save_pretrained of model and tokenizer, plus optimizer, schedule, step
    and config in state.pt. Atomic: everything goes to a temporary folder that is renamed when complete,
    so a save that dies half-way leaves the previous checkpoint as it was; then older ones are removed."""
    final = out / f"checkpoint-{step}"
    if not final.is_dir():
        tmp = out / f"checkpoint-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                    "config": asdict(cfg)}, tmp / "state.pt")
        os.replace(tmp, final)
    for old in checkpoints(out):
        if old != final:
            shutil.rmtree(old)
    return final


def train_step(model, policy, tokenizer, ref_model, optimizer, cfg: Config, train_rows, step: int, device) -> dict:
    """One step: draw P prompts, sample and score (this rank's share), then update. `policy` is the model,
    or its DDP wrapper. Returns the step's metrics."""
    t_step = time.perf_counter()
    W = world_size()
    rank = torch.distributed.get_rank() if W > 1 else 0
    rng = random.Random(cfg.seed * 1_000_003 + step)      # data and sampling depend on (seed, step) only,
    torch.manual_seed(cfg.seed * 1_000_003 + step * W + rank)  # so a resumed run continues the same stream
    batch = rng.sample(train_rows, min(cfg.prompts_per_step, len(train_rows)))
    batch = batch[rank * len(batch) // W:(rank + 1) * len(batch) // W]  # whole groups stay on one rank
    rows, metrics = ROLLOUTS[cfg.variant](model, tokenizer, cfg, batch, rng)
    metrics = reduce_metrics(metrics)
    metrics.update(update(policy, ref_model, optimizer, rows, cfg, device))
    metrics["time/step"] = time.perf_counter() - t_step
    metrics["tokens_per_s"] = metrics["tokens"] * W / metrics["time/sample"]
    return metrics


def setup_distributed(cfg: Config):
    """torchrun sets RANK, LOCAL_RANK and WORLD_SIZE: join the process group (NCCL on GPUs, gloo on CPU).
    Returns (rank, device); a plain `python grpo.py` is rank 0 of 1."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, pick_device(cfg.device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.prompts_per_step % world:
        raise ConfigError(f"--prompts-per-step {cfg.prompts_per_step} must be divisible by the {world} ranks")
    device = pick_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, device


# Flags that a resumed run may change: where and how it runs and evaluates, not what it trains.
RESUMABLE = {"steps", "out", "resume", "overwrite", "device", "eval_every", "eval_samples", "eval_limit",
             "test_data", "save_every", "micro_batch_size", "gradient_checkpointing"}


def prepare_out(cfg: Config, main_rank: bool) -> Path | None:
    """Check the run folder: a folder that already holds a run is only continued (--resume) or replaced
    (--overwrite), never silently reused. Returns the checkpoint to resume from, if any."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file, not a folder")
    found = sorted(p.name for p in out.glob("*") if p.name in ("metrics.jsonl", "summary.json", "state.pt")
                   or p.name.startswith("checkpoint-")) if out.is_dir() else []
    if cfg.resume:
        if not checkpoints(out):
            raise ConfigError(f"--resume: no checkpoint in {out} (no {out}/checkpoint-<step> folder)")
        return checkpoints(out)[-1]
    if found and not cfg.overwrite:
        raise ConfigError(f"--out {out} already holds a run ({', '.join(found)}); continue it with --resume "
                          f"or replace it with --overwrite")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").touch()
        (out / ".write-test").unlink()
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    for name in found if main_rank else []:
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    return None


def load_state(checkpoint: Path, cfg: Config) -> dict:
    """state.pt of a checkpoint (tensors and plain values only: weights_only, so a run folder from elsewhere
    cannot run code), after checking that the flags keep the run's meaning and --steps goes further."""
    path = checkpoint / "state.pt"
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"--resume: {path} is not a checkpoint this file wrote ({reason})") from None
    saved, now = Config(**{**asdict(cfg), **state["config"]}), cfg
    same = lambda a, b: a == b or (isinstance(a, str) and os.path.exists(a) and os.path.samefile(a, b))
    may_change = RESUMABLE - ({"micro_batch_size"} if cfg.loss_type == "bnpo" else set())  # bnpo: per micro-batch
    differ = [f.name for f in fields(Config)
              if f.name not in may_change and not same(getattr(saved, f.name), getattr(now, f.name))]
    if differ:
        change = ", ".join(f"--{n.replace('_', '-')} {getattr(saved, n)} -> {getattr(now, n)}" for n in differ)
        raise ConfigError(f"--resume: {change} would change what the run in {checkpoint.parent} means; "
                          f"keep its flags or start a new run in another --out")
    finished = (checkpoint.parent / "summary.json").exists()
    if cfg.steps < state["step"] or (cfg.steps == state["step"] and finished):
        raise ConfigError(f"--resume: the run is at step {state['step']}; --steps {cfg.steps} must be larger")
    return state


def load_run(cfg: Config, device, checkpoint: Path | None):
    """Policy, tokenizer, reference (only when beta > 0), optimizer and schedule, and the step to start
    from (the checkpoint's, when resuming)."""
    state = load_state(checkpoint, cfg) if checkpoint else None
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(str(checkpoint) if checkpoint else cfg.model, device)
    ref_model = None
    if cfg.beta > 0:  # the frozen starting policy
        ref_model = load_model(cfg.model, device)[0].eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1)))
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return model, tokenizer, ref_model, optimizer, scheduler, state["step"] if state else 0


class Interrupted(Exception):
    """SIGTERM (what Slurm and Kubernetes send before they stop a job) or Ctrl-C."""


# From the optimizer's first step in a training step until the step counter says so, the weights are ahead
# of the counter: a signal arriving then is held until the step is counted, so a checkpoint never pairs N
# updates with step N-1; an exception arriving then cannot be saved from.
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
    """Turn SIGTERM and Ctrl-C into Interrupted (in the main thread) and mark every optimizer step as the
    start of 'weights ahead of the counter'; restore the previous handlers afterwards."""
    def ahead(*args):
        _signals["weights_ahead"] = True
    hook = optimizer.register_step_pre_hook(ahead)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        yield
    finally:
        hook.remove()
        for s, handler in previous.items():
            signal.signal(s, handler)
        _signals.update(weights_ahead=False, held=None)


def finite(record: dict) -> dict:
    """NaN and infinities -> None (null), recursively: metrics.jsonl stays strict JSON."""
    clean = lambda v: finite(v) if isinstance(v, dict) else None if isinstance(v, float) and not math.isfinite(v) else v
    return {k: clean(v) for k, v in record.items()}


def open_metrics(out: Path, resume_from: int | None):
    """metrics.jsonl for appending. A resumed run first drops what came after its checkpoint (steps it will
    redo, and the eval at the checkpoint's step, which it redoes), so the file reads as one run."""
    path = out / "metrics.jsonl"
    if resume_from is not None and path.exists():
        start = resume_from
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        kept = [r for r in lines if r["step"] < start or (r["step"] == start and "eval" not in r)]
        (out / "metrics.jsonl.tmp").write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(out / "metrics.jsonl.tmp", path)
    return open(path, "a")


def train(cfg: Config) -> dict:
    """Run GRPO (or a variant) as configured; returns the summary it also prints and saves (rank 0)."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    train_rows, test_rows = load_jsonl(cfg.data), load_jsonl(cfg.test_data)[: cfg.eval_limit or None]
    if cfg.variant == "ta" and not any(row["rephrasings"] for row in train_rows):
        raise DataError(f"{cfg.data}: --variant ta needs rows with 'rephrasings'; none has any")
    rank, device = setup_distributed(cfg)
    W, main_rank = world_size(), rank == 0
    checkpoint = prepare_out(cfg, main_rank)
    model, tokenizer, ref_model, optimizer, scheduler, start = load_run(cfg, device, checkpoint)
    max_positions = model.config.max_position_embeddings
    check_lengths(tokenizer, train_rows, cfg, max_positions, phrasings=cfg.variant == "ta")
    check_lengths(tokenizer, test_rows, cfg, max_positions, phrasings=False)
    policy = model if W == 1 else torch.nn.parallel.DistributedDataParallel(model)  # forward for gradients
    out = Path(cfg.out)
    log = open_metrics(out, start if checkpoint else None) if main_rank else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    eval_seed = cfg.seed + 12345  # the same sampling noise for every eval of a run

    def write(record):
        if main_rank:
            log.write(json.dumps(finite(record), allow_nan=False) + "\n")
            log.flush()

    def run_eval(step):  # at step 0, every --eval-every steps and at the end; rank 0 evaluates, the others wait
        if step == 0 or step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
            with autocast:
                write({"step": step, "eval": evaluate(model, tokenizer, test_rows, cfg, eval_seed) if main_rank else None})
            if W > 1:
                torch.distributed.barrier()

    t0 = time.time()
    done = start  # completed steps: the weights are those of step `done`
    with signals_handled(optimizer):
        try:
            run_eval(start)
            for step in tqdm(range(start, cfg.steps), desc=cfg.variant, dynamic_ncols=True, disable=not main_rank):
                with autocast:
                    metrics = train_step(model, policy, tokenizer, ref_model, optimizer, cfg, train_rows, step, device)
                scheduler.step()
                done = step + 1
                write({"step": done, "lr": scheduler.get_last_lr()[0], **metrics})
                step_counted()
                if main_rank and (done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
                    save_checkpoint(out, model, tokenizer, optimizer, scheduler, done, cfg)
                run_eval(done)
        except Interrupted as e:
            where = save_checkpoint(out, model, tokenizer, optimizer, scheduler, done, cfg) if main_rank else out
            sys.exit(f"grpo.py: {e} after step {done}: checkpoint saved in {where}; continue with --resume")
        except BaseException:
            if main_rank and not _signals["weights_ahead"]:
                where = save_checkpoint(out, model, tokenizer, optimizer, scheduler, done, cfg)
                print(f"grpo.py: step {done + 1} failed; the checkpoint of step {done} is in {where}", file=sys.stderr)
            elif main_rank:
                print(f"grpo.py: step {done + 1} failed while the optimizer was changing the weights; "
                      f"nothing saved (the last checkpoint in {out} stands)", file=sys.stderr)
            raise
    if W > 1:
        torch.distributed.destroy_process_group()
    return report(cfg, time.time() - t0) if main_rank else None


def report(cfg: Config, wall_s: float) -> dict:
    """Print and save the end-of-run summary from metrics.jsonl: the run's first and last eval (a resumed
    run included) and the median phase times."""
    lines = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval"] for r in lines if "eval" in r]
    steps = [r for r in lines if "time/step" in r]
    phases = {k[5:]: float(np.median([r[k] for r in steps])) for k in (steps[0] if steps else {}) if k.startswith("time/")}
    before, after = evals[0], evals[-1]
    summary = {"variant": cfg.variant, "steps": cfg.steps, "before": before, "after": after, "wall_s": wall_s,
               "median_seconds_per_step": phases}
    (Path(cfg.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    if phases:
        print("median seconds per step:\n" + "\n".join(f"  {k:<8} {v:7.3f}" for k, v in phases.items()))
    k = f"pass@{cfg.eval_samples}"
    print(f"{cfg.variant}: greedy {before['greedy']:.3f} -> {after['greedy']:.3f} | "
          f"pass@1 {before['pass@1']:.3f} -> {after['pass@1']:.3f} | "
          f"{k} {before.get(k, math.nan):.3f} -> {after.get(k, math.nan):.3f} | {wall_s:.0f} s")
    return summary

# -----------------------------------------------------------------------------
# Eval: greedy accuracy and pass@k on the held-out set.


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], cfg: Config, seed: int) -> dict:
    """Greedy accuracy, and pass@k for k = 1..n from n = --eval-samples samples per question at the
    training temperature (pass@1 is the mean accuracy of those samples)."""
    torch.manual_seed(seed)
    n = cfg.eval_samples
    prompts = [prompt_ids(tokenizer, row["question"], cfg.system_prompt) for row in rows]
    answers = [row["answer"] for row in rows]
    limit = cfg.max_new_tokens + (cfg.max_answer_tokens if cfg.variant == "ma" else 0)  # ma: thought + answer
    ids, mask, finished = sample(model, tokenizer, prompts, limit, greedy=True)
    greedy, _ = score_batch(tokenizer, ids, mask, finished, answers)
    ids, mask, finished = sample(model, tokenizer, [p for p in prompts for _ in range(n)], limit,
                                 cfg.temperature, cfg.top_p)
    correct, _ = score_batch(tokenizer, ids, mask, finished, [a for a in answers for _ in range(n)])
    counts = correct.view(len(rows), n).sum(1).long().tolist()
    return {"greedy": greedy.mean().item(),
            **{f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in counts])) for k in range(1, n + 1)}}

# -----------------------------------------------------------------------------
# Main


def main(argv=None):
    """Command line entry point: bad flags or data stop with one line naming the flag, file, line and field."""
    try:
        cfg = parse_args(argv)
        return train(cfg)
    except (ConfigError, DataError) as e:
        sys.exit(f"grpo.py: error: {e}")


if __name__ == "__main__":
    main()
