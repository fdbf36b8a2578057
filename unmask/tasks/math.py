"""Verifiable multi-step arithmetic problems with worked, digit-by-digit solutions.

Why this format: a tiny model (~5-10M parameters, an hour of CPU training) cannot do a big
computation inside one token, but it can learn steps that are each trivially local — a
single-digit sum, copying a digit, comparing two digits (docs/design.md § The embedded
model). Every solution here is a chain of such steps, written in a fixed, very regular layout,
and ends with a marked final answer line ``#### <answer>`` that :func:`extract_answer` reads.

Families:
- ``add``: multi-digit addition, column by column with carries.
- ``sub``: multi-digit subtraction (non-negative result), column by column with borrows.
- ``sum_list``: running sum of a short list of single digits.
- ``sort``: sorting a short list of single digits by repeated selection of the minimum.
- ``word``: short word problems reduced to the ``add`` / ``sub`` worked format.

Splits: a problem belongs to the held-out split iff a stable hash of its prompt is 0 mod 10
(:func:`is_heldout`); the training stream drops those prompts, so the splits provably never
overlap, and they are also generated from disjoint seeds.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

Split = Literal["train", "heldout"]

PLACE_NAMES = ["ones", "tens", "hundreds", "thousands", "ten-thousands"]
ANSWER_MARK = "####"
# Seeds of the two splits live in disjoint ranges (the hash filter is the real guarantee).
_HELDOUT_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Problem:
    """One problem: the user prompt, the worked reference response and the final answer."""

    prompt: str
    response: str
    answer: str
    family: str


def prompt_hash(prompt: str) -> int:
    """Stable (process-independent) hash of a prompt; Python's ``hash`` is salted per run."""
    return int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little")


def is_heldout(prompt: str) -> bool:
    """True iff this prompt is reserved for the held-out split (about 10% of prompts)."""
    return prompt_hash(prompt) % 10 == 0


# ---------------------------------------------------------------------------- helpers


def _digits_of(n: int, width: int) -> list[int]:
    """Digits of ``n`` from least significant, zero-padded to ``width``."""
    return [(n // 10**i) % 10 for i in range(width)]


def _rand_number(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    """A number whose digit count is uniform in [lo_digits, hi_digits]."""
    nd = rng.randint(lo_digits, hi_digits)
    lo = 0 if nd == 1 else 10 ** (nd - 1)
    return rng.randint(lo, 10**nd - 1)


def _n_digits(rng: random.Random) -> int:
    # Mostly 2-3 digit operands: "What is 47 + 38?" is the canonical example.
    return rng.choices([1, 2, 3, 4], weights=[1, 5, 4, 2])[0]


def addition_steps(a: int, b: int) -> str:
    """Column-by-column addition, one line per column, e.g. ``ones: 7+8+0=15, write 5, carry 1``."""
    width = max(len(str(a)), len(str(b)))
    da, db = _digits_of(a, width), _digits_of(b, width)
    lines = [f"Add {a} and {b} column by column, starting from the ones."]
    carry = 0
    for i in range(width):
        s = da[i] + db[i] + carry
        lines.append(f"{PLACE_NAMES[i]}: {da[i]}+{db[i]}+{carry}={s}, write {s % 10}, carry {s // 10}")
        carry = s // 10
    if carry:
        lines.append(f"The last carry {carry} is written in front.")
    lines.append(f"So {a} + {b} = {a + b}.")
    return "\n".join(lines)


def subtraction_steps(a: int, b: int) -> str:
    """Column-by-column subtraction (a >= b) with borrows, one line per column."""
    assert a >= b
    width = len(str(a))
    da, db = _digits_of(a, width), _digits_of(b, width)
    lines = [f"Subtract {b} from {a} column by column, starting from the ones."]
    borrow = 0
    for i in range(width):
        top = da[i] - borrow
        if top < db[i]:
            # Written as "3-1<7, borrow: 13-1-7=5" so each step is one small local operation.
            r = 10 + top - db[i]
            lines.append(
                f"{PLACE_NAMES[i]}: {da[i]}-{borrow}<{db[i]}, borrow: 1{da[i]}-{borrow}-{db[i]}={r}, "
                f"write {r}, borrow 1"
            )
            borrow = 1
        else:
            r = top - db[i]
            lines.append(f"{PLACE_NAMES[i]}: {da[i]}-{borrow}-{db[i]}={r}, write {r}, borrow 0")
            borrow = 0
    lines.append(f"So {a} - {b} = {a - b}.")
    return "\n".join(lines)


def _finish(body: str, answer: str) -> str:
    return f"{body}\n{ANSWER_MARK} {answer}"


# ---------------------------------------------------------------------------- families

_ADD_TEMPLATES = [
    "What is {a} + {b}?",
    "What is {a} + {b}?",
    "What is {a} + {b}?",
    "What is {a} plus {b}?",
    "Compute {a} + {b}.",
    "Calculate {a} + {b}.",
    "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
]

_SUB_TEMPLATES = [
    "What is {a} - {b}?",
    "What is {a} - {b}?",
    "What is {a} - {b}?",
    "What is {a} minus {b}?",
    "Compute {a} - {b}.",
    "Calculate {a} - {b}.",
    "Subtract {b} from {a}.",
    "What is the difference between {a} and {b}?",
]


def gen_add(rng: random.Random) -> Problem:
    a, b = _rand_number(rng, 1, _n_digits(rng)), _rand_number(rng, 1, _n_digits(rng))
    prompt = rng.choice(_ADD_TEMPLATES).format(a=a, b=b)
    ans = str(a + b)
    return Problem(prompt, _finish(addition_steps(a, b), ans), ans, "add")


def gen_sub(rng: random.Random) -> Problem:
    a, b = _rand_number(rng, 1, _n_digits(rng)), _rand_number(rng, 1, _n_digits(rng))
    a, b = max(a, b), min(a, b)
    prompt = rng.choice(_SUB_TEMPLATES).format(a=a, b=b)
    ans = str(a - b)
    return Problem(prompt, _finish(subtraction_steps(a, b), ans), ans, "sub")


_SUM_TEMPLATES = [
    "What is the sum of {xs}?",
    "What is the sum of {xs}?",
    "Add up {xs}.",
    "What is the total of {xs}?",
]


def gen_sum_list(rng: random.Random) -> Problem:
    xs = [rng.randint(1, 9) for _ in range(rng.randint(3, 7))]
    prompt = rng.choice(_SUM_TEMPLATES).format(xs=", ".join(map(str, xs)))
    lines = ["Add the numbers one at a time, keeping a running total.", f"start: {xs[0]}"]
    total = xs[0]
    for x in xs[1:]:
        lines.append(f"{total}+{x}={total + x}")
        total += x
    lines.append(f"The total is {total}.")
    return Problem(prompt, _finish("\n".join(lines), str(total)), str(total), "sum_list")


_SORT_TEMPLATES = [
    "Sort {xs} from smallest to largest.",
    "Sort the numbers {xs} in increasing order.",
    "Put {xs} in order from smallest to largest.",
]


def gen_sort(rng: random.Random) -> Problem:
    xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
    prompt = rng.choice(_SORT_TEMPLATES).format(xs=", ".join(map(str, xs)))
    lines = ["Repeatedly take the smallest remaining number."]
    remaining, out = list(xs), []
    while remaining:
        m = min(remaining)
        lines.append(f"smallest of {', '.join(map(str, remaining))} is {m}")
        remaining.remove(m)
        out.append(m)
    ans = ", ".join(map(str, out))
    lines.append(f"Sorted: {ans}.")
    return Problem(prompt, _finish("\n".join(lines), ans), ans, "sort")


_NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kim", "Leo", "Mia",
          "Noor", "Omar", "Pia"]
_ITEMS = ["apples", "books", "coins", "marbles", "stickers", "pencils", "cards", "shells", "stamps",
          "cookies"]


def gen_word(rng: random.Random) -> Problem:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b = _rand_number(rng, 1, rng.choice([2, 2, 3])), _rand_number(rng, 1, rng.choice([1, 2, 2, 3]))
    kind = rng.randrange(4)
    if kind == 0:
        prompt = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
        body, ans = f"{name} has {a} + {b} {item}.\n" + addition_steps(a, b), a + b
    elif kind == 1:
        prompt = f"{name} has {a} {item} and {other} has {b} {item}. How many {item} do they have together?"
        body, ans = f"Together they have {a} + {b} {item}.\n" + addition_steps(a, b), a + b
    elif kind == 2:
        a, b = max(a, b), min(a, b)
        prompt = f"{name} has {a} {item} and gives {b} to {other}. How many {item} does {name} have left?"
        body, ans = f"{name} has {a} - {b} {item} left.\n" + subtraction_steps(a, b), a - b
    else:
        a, b = max(a, b), min(a, b)
        prompt = (f"{name} has {a} {item} and {other} has {b} {item}. "
                  f"How many more {item} does {name} have than {other}?")
        body, ans = f"The difference is {a} - {b}.\n" + subtraction_steps(a, b), a - b
    return Problem(prompt, _finish(body, str(ans)), str(ans), "word")


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "add": gen_add,
    "sub": gen_sub,
    "sum_list": gen_sum_list,
    "sort": gen_sort,
    "word": gen_word,
}
# Addition is what `unmask generate "What is 47 + 38?"` shows off, so it gets the most weight.
FAMILY_WEIGHTS: dict[str, float] = {"add": 0.32, "sub": 0.22, "sum_list": 0.14, "sort": 0.12, "word": 0.20}


def generate_problem(rng: random.Random) -> Problem:
    """Draw one problem from the family mixture (no split filtering)."""
    fam = rng.choices(list(FAMILY_WEIGHTS), weights=list(FAMILY_WEIGHTS.values()))[0]
    return FAMILIES[fam](rng)


def iter_split(split: Split, seed: int = 0):
    """Endless stream of problems of one split (training stream excludes held-out prompts)."""
    rng = random.Random(seed + (_HELDOUT_SEED_OFFSET if split == "heldout" else 0))
    want_heldout = split == "heldout"
    while True:
        p = generate_problem(rng)
        if is_heldout(p.prompt) == want_heldout:
            yield p


def make_split(split: Split, n: int, seed: int = 0) -> list[Problem]:
    """``n`` problems of ``split``; held-out problems are de-duplicated by prompt."""
    out: list[Problem] = []
    seen: set[str] = set()
    for p in iter_split(split, seed):
        if split == "heldout":
            if p.prompt in seen:
                continue
            seen.add(p.prompt)
        out.append(p)
        if len(out) >= n:
            return out
    raise AssertionError("unreachable")


ANSWER_RE = re.compile(r"####\s*([^\n]*)")


def extract_answer(text: str) -> str | None:
    """The final answer after the first ``####`` mark, whitespace/trailing-period stripped."""
    m = ANSWER_RE.search(text)
    if m is None:
        return None
    ans = m.group(1).strip().rstrip(".").strip()
    return ans or None


def _normalise(ans: str) -> str:
    return re.sub(r"\s+", "", ans).replace(",", ", ")


def check(text: str, answer: str) -> bool:
    """True iff ``text`` carries a final answer equal to ``answer`` (spacing-insensitive)."""
    got = extract_answer(text)
    return got is not None and _normalise(got) == _normalise(answer)


# ---------------------------------------------------------------------------- numeric answers

# A number as a final answer writes it: a sign (ASCII '-' or U+2212, which typeset text and some
# tokenizers use), '$', digits with thousands commas, decimals ('.5' as well: its lone dot is
# not part of a word, so 'no.5' stays 5), then an exponent or a fraction. Reading only a prefix
# of '.5', '1/2' or '1e3' gave another number (5, 1, 1), so a wrong output could score as right.
NUMBER_RE = re.compile(r"[-\u2212]?\$?(?:\d[\d,]*(?:\.\d+)?|(?<![\w.])\.\d+)"
                       r"(?:[eE][-+]?\d+|/\d[\d,]*(?:\.\d+)?)?")


def parse_number(text: str) -> Fraction | None:
    """The first number in text, exact: '1,234', '$5', '72.0', '-3', '.5', '-.25', '1/2',
    '1e3', a minus sign U+2212. None when text holds none (or only a fraction over zero)."""
    m = NUMBER_RE.search(text)
    if m is None:
        return None
    raw = m.group(0).replace(",", "").replace("$", "").replace("\u2212", "-")
    num, _, den = raw.partition("/")
    try:
        return Fraction(num) / Fraction(den) if den else Fraction(num)
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> Fraction | None:
    """A model's numeric answer: the number after the last ``####`` in text, else the last
    number in it."""
    finals = ANSWER_RE.findall(text)
    if finals:
        got = parse_number(finals[-1])
        if got is not None:
            return got
    numbers = [m.group(0) for m in NUMBER_RE.finditer(text)]
    return parse_number(numbers[-1]) if numbers else None
