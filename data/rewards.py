"""Rewards for what real models write, kept apart from the trainer as TRL keeps trl.rewards apart.

    python grpo.py ... --reward-fn data/rewards.py:last_number     # GSM8K with Qwen, sums with SmolLM2
    python grpo.py ... --reward-fn data/rewards.py:math_verified   # LaTeX answers (pip install math-verify)

Each is called as TRL calls a reward function: prompts, completions and each data column by name, here
`answer`, with a float returned per completion. grpo.py also passes `finished`, whether the completion ended
with EOS; TRL does not, so there every completion counts as finished. A TRL user passes them as they are:
`GRPOTrainer(reward_funcs=[last_number], ...)`. They need only the standard library, and math-verify for
math_verified.

As grpo.py's own reward, both are strict. What cannot be read is a miss, never a guess, because the policy
would be trained toward a false positive. A reply is read after its first </think>, and a thought that never
closes holds no answer. Reading only splits and searches, so it takes linear time on any text.
"""

import re
from fractions import Fraction

NUMBER_RE = re.compile(r"[-+]?(?:(?:[1-9][0-9]{0,2}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)")
PROSE = ".,;:?'\"*"  # what may touch a number besides letters; 4! is a factorial
# Words that change the number they stand before or after: '2 * 8', 'not 8', '3 or 8' before it;
# '8 thousand', '8 squared' after it.
NOT_BEFORE = {"*", "x", ":", "not", "negative", "minus", "plus", "times", "over", "than", "point",
              "and", "or"}
NOT_AFTER = {"and", "hundred", "thousand", "million", "billion", "k", "squared", "cubed"}
# What a box may hold around its number: \$ before it; \%, % or a unit of one or two words in \text{}
# after it. Each part has one way to match, so a failed match costs linear time.
BOXED_RE = re.compile(r"(?:\\\$)?(\S+?)(?:\\?%|(?:\s|\\[,; ]|~)*\\text\{ *(?!(?:" + "|".join(
    NOT_AFTER) + r")\b)[A-Za-z][A-Za-z/]+(?: [A-Za-z/]+)? *\})?")


def last_number(prompts, completions, answer, finished=None, **columns):
    """1.0 for each finished completion whose last \\boxed{} or, without a box, last number equals the
    reference by value, else 0.0. read_last_number says what is read; a reference that is not a number
    wants the same text."""
    finished = finished or [True] * len(completions)
    return [float(done and same_answer(read_last_number(content(completion)), reference))
            for completion, reference, done in zip(completions, answer, finished)]


def math_verified(prompts, completions, answer, finished=None, **columns):
    """1.0 for each finished completion whose answer math_verify grades equal to the reference as LaTeX.
    The answer is what the last <answer>...</answer> holds, or else what the last \\boxed{} holds."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("math_verified needs math_verify: pip install math-verify") from None
    rewards = []
    for completion, reference, done in zip(completions, answer, finished or [True] * len(completions)):
        text = content(completion)
        reply = after_thought(text) or ""
        found = tag_answer(reply) if "<answer>" in reply else read_last_number(text, whole_box=True)
        rewards.append(float(bool(done) and found is not None
                             and verify(parse(f"${reference}$"), parse(f"${found}$"))))
    return rewards


def content(completion) -> str:
    """A completion as text: TRL passes a conversational one as a list of messages."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def after_thought(text: str):
    """The reply after the first </think>, or None if a thought opens and never closes."""
    return None if "<think>" in text and "</think>" not in text else text.split("</think>", 1)[-1]


def tag_answer(text: str):
    """What the last <answer>...</answer> holds, or None."""
    start = text.rfind("<answer>", 0, max(text.rfind("</answer>"), 0))
    return text[start + len("<answer>"):text.find("</answer>", start)] if start >= 0 else None


def read_box(reply):
    """(what the last \\boxed{} holds, the reply with that box emptied). The tags and math delimiters
    become spaces first. Without a box: (None, the reply). A box that never closes, cut off by the length
    limit, and a reply of None give (None, None)."""
    if reply is None:
        return None, None
    reply = re.sub(r"</?(?:think|answer)>|\\[()[\]]|(?<!\\)\$", " ", reply)
    start, depth = reply.rfind("\\boxed{"), 0
    for brace in re.finditer("[{}]", reply[start:] if start >= 0 else ""):  # to the box's own }
        depth += 1 if brace[0] == "{" else -1
        if depth == 0:  # the box, emptied, becomes one word with what touches it
            return reply[start + 7:start + brace.end() - 1], reply[:start] + "\\boxed{}" + reply[
                start + brace.end():]
    return None, reply if start < 0 else None


def read_last_number(text: str, whole_box: bool = False):
    """The answer that last_number reads, or None.
    - The last \\boxed{}: its number, which may carry \\$, % or a \\text{} unit, else what it holds.
    - Without a box: the last number, when only words and prose punctuation follow it.
    The box, like the number, must stand as a word, with a word or "=" before it. Words that change a
    number, such as 'not' before it or 'thousand' after it, make a miss. Math delimiters count as spaces,
    so 'is \\( 45 \\).' reads 45, and so does '45%'. With whole_box, what math_verified reads: only a
    box, and all it holds."""
    box, text = read_box(after_thought(text))
    if text is None or whole_box and box is None:
        return None
    words = text.split()
    at = [i for i, word in enumerate(words) if ("\\boxed{}" in word if box is not None
                                                else re.search("[0-9]", word))]
    if not at:
        return None
    before, after = words[at[-1] - 1] if at[-1] else "", words[at[-1] + 1:]
    prose = lambda word: all(c.isalpha() or c in PROSE + "!" for c in re.sub(r"\b-\b", "", word))
    beside = lambda word, no: prose(word) and (word.strip(PROSE).lower() or word) not in no
    if not (beside(before, NOT_BEFORE) or before in ("=", "&=")):
        return None  # a sign, relation or operator before it, as in '- 8', 'x ≥ 8', 'not 8'
    if after and not (beside(after[0], NOT_AFTER) or box is not None and re.match(
            r"[0-9]+-?[A-Za-z]|\\text\{|\\end\{|\\?%", after[0])):
        return None  # an operator or a scale after it, as in '8 - x', '8 thousand', '\boxed{8}^2'
    if box is None and not all(map(prose, after)):
        return None  # only words follow the last number; a box's later words may hold numbers
    word = re.sub(r"^\\\$|\\?%$", "", words[at[-1]].rstrip(PROSE).lstrip("'\"*"))  # 25% reads 25
    if box is None or word != "\\boxed{}":  # a number, or a box that something touches
        return None if box else word
    number = BOXED_RE.fullmatch(box.strip())  # else the box is read as it is
    return number[1] if number and not whole_box else box


def same_answer(answer, reference: str) -> bool:
    """Whether a read answer is the reference. Both sides lose whitespace, $, math delimiters, a final
    period, markdown's bold and one \\boxed{}. A numeric reference wants the same value: '1,234.0' is
    1234, '2x' and '18 eggs' miss. Any other wants the same text."""
    if answer is None:
        return False
    plain = lambda s: re.sub(r"^\\boxed\{(.*)\}$", r"\1", re.sub(  # 1 5 and 5$5 stay apart
        r"(?<![0-9,])\s|\s(?![0-9])|(?<![0-9])\\?\$|\\?\$(?![0-9])|\\[()[\]]", "", s).rstrip("."))
    number = lambda s: Fraction(s.replace(",", "")) if NUMBER_RE.fullmatch(s) and len(s) < 99 else None
    answer, reference = plain(answer).strip("*"), plain(reference)
    return number(answer) == number(reference) if number(reference) is not None else answer == reference
