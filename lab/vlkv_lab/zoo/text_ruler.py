"""RULER's needle tasks as RULER writes them (Hsieh et al., 2024), for ``text_suite.py``: the generators only.

Each builder takes a ``random.Random`` and returns a ``Spec``: the sentences to hide (``facts``), the
question, the exact value(s) the answer must hold (``answers``, all of them) and the other needles' values it
must not (``wrong``), and which haystack the facts go into. ``text_suite.make_item`` fills the prompt up to
its length and scores it. The haystack here is RULER's "noise": its five sentences repeated.

- ``niah_single_1``: one "One of the special magic numbers for KEY is: 1234567." in the noise; asked for
  KEY's number (RULER's niah_single_1: a word key, a 7-digit number);
- ``niah_word``: the same, the value a word (RULER's niah_single_2/3 use other values; here a noun);
- ``niah_code``: the same, the value a short uuid-like code ("3f9a-c27e"; RULER's niah_single_3 a uuid);
- ``niah_multikey_1``: the needle and two distractor needles with other keys; asked for one key's number;
- ``niah_multivalue``: two numbers for one key; asked for all of them (both must be in the answer);
- ``niah_multiquery``: two keys, asked for both numbers in one question;
- ``vt_1hop``: "VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE."; asked which variables hold 12345
  (RULER's variable tracking with one chain of one hop: both names must be in the answer).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

NOISE = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
"""RULER's noise haystack, repeated sentence by sentence."""

KEY_WORDS = (
    "apple candle mirror pillow rocket violin wallet ladder basket helmet compass lantern marble orchid "
    "pepper quartz saddle tunnel velvet walnut anchor cactus dragon engine feather glacier harbor island "
    "jacket kettle lemon magnet napkin oyster parrot rabbit silver tomato"
).split()
"""Keys are two of these joined by a hyphen ("lemon-falcon"), as RULER's adjective-noun keys (none is a
word of either haystack)."""
VALUE_WORDS = (
    "tractor biscuit trumpet pyramid hammock cabbage giraffe lobster sparrow tornado blossom chimney "
    "cushion diamond emerald furnace goblet hurdle igloo jasmine kayak mustard noodle pelican radish "
    "scooter thimble turnip walrus zeppelin acorn beetle cobweb doorbell eyebrow funnel gazelle hedgehog "
    "lighthouse mitten nutmeg pancake pretzel raincoat sandal toaster"
).split()
"""The values of ``niah_word``: nouns that are no key word and no word of the noise."""


@dataclass(frozen=True)
class Spec:
    """What one item hides and asks. ``haystack``: "noise" (RULER's) or "grammar" (``text_suite``'s
    sentences); ``dense``: instead of a haystack, ``dense(rng, room, tokenizer) -> lines`` (the context is
    those lines, the facts among them)."""

    facts: list[str]
    question: str
    answers: tuple[str, ...]
    wrong: tuple[str, ...] = ()
    haystack: str = "noise"
    dense: Callable | None = None


def key(rng: random.Random) -> str:
    return "-".join(rng.sample(KEY_WORDS, 2))


def distinct(draw: Callable[[random.Random], str], rng: random.Random, k: int) -> list[str]:
    """``k`` different values of ``draw(rng)``, in the order drawn (repeats are drawn again)."""
    out: list[str] = []
    while len(out) < k:
        new = draw(rng)
        if new not in out:
            out.append(new)
    return out


def number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def code(rng: random.Random) -> str:
    hexd = "0123456789abcdef"
    return "".join(rng.choice(hexd) for _ in range(4)) + "-" + "".join(rng.choice(hexd) for _ in range(4))


def needle(k: str, value: str, kind: str = "number") -> str:
    return f"One of the special magic {kind}s for {k} is: {value}."


def ask(k: str, kind: str = "number") -> str:
    return (
        f"What is the special magic {kind} for {k} mentioned in the provided text? "
        f"Answer with the {kind} only."
    )


def niah_single_1(rng: random.Random) -> Spec:
    k, v = key(rng), number(rng)
    return Spec([needle(k, v)], ask(k), (v,))


def niah_single_2(rng: random.Random) -> Spec:
    k, v = key(rng), number(rng)
    return Spec([needle(k, v)], ask(k), (v,), haystack="grammar")


def niah_single_3(rng: random.Random) -> Spec:
    k, v = key(rng), code(rng)
    return Spec([needle(k, v, "code")], ask(k, "code"), (v,), haystack="grammar")


def niah_word(rng: random.Random) -> Spec:
    k, v = key(rng), rng.choice(VALUE_WORDS)
    return Spec([needle(k, v, "word")], ask(k, "word"), (v,))


def niah_code(rng: random.Random) -> Spec:
    k, v = key(rng), code(rng)
    return Spec([needle(k, v, "code")], ask(k, "code"), (v,))


def niah_multikey_1(rng: random.Random, distractors: int = 2) -> Spec:
    ks, vs = distinct(key, rng, distractors + 1), distinct(number, rng, distractors + 1)
    i = rng.randrange(len(ks))
    facts = [needle(a, b) for a, b in zip(ks, vs, strict=True)]
    return Spec(facts, ask(ks[i]), (vs[i],), tuple(v for j, v in enumerate(vs) if j != i))


def niah_multivalue(rng: random.Random, values: int = 2) -> Spec:
    k, vs = key(rng), distinct(number, rng, values)
    q = (
        f"What are all the special magic numbers for {k} mentioned in the provided text? "
        "Answer with the numbers only."
    )
    return Spec([needle(k, v) for v in vs], q, tuple(vs))


def niah_multiquery(rng: random.Random, queries: int = 2) -> Spec:
    ks, vs = distinct(key, rng, queries), distinct(number, rng, queries)
    q = (
        f"What are all the special magic numbers for {' and '.join(ks)} mentioned in the provided text? "
        "Answer with the numbers only."
    )
    return Spec([needle(a, b) for a, b in zip(ks, vs, strict=True)], q, tuple(vs))


def variable(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def vt_1hop(rng: random.Random) -> Spec:
    a = variable(rng)
    b = variable(rng)
    while b == a:
        b = variable(rng)
    v = number(rng, 5)
    facts = [f"VAR {a} = {v}.", f"VAR {b} = VAR {a}."]
    q = (
        f"Find all variables that are assigned the value {v} in the text above. "
        "Answer with the variable names only."
    )
    return Spec(facts, q, (a, b))


MAX_NEW_TOKENS = 32
"""The model says "The special magic number for KEY mentioned in the provided text is 1234567." (25-27
tokens) and an end of turn."""
MAX_NEW_TOKENS_MANY = 48
"""Two values (or two variables) and the question's echo: up to ~40 tokens."""

BUILDERS = {
    "niah_single_1": niah_single_1,
    "niah_single_2": niah_single_2,
    "niah_single_3": niah_single_3,
    "niah_word": niah_word,
    "niah_code": niah_code,
    "niah_multikey_1": niah_multikey_1,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "vt_1hop": vt_1hop,
}


MANY = ("niah_multivalue", "niah_multiquery", "vt_1hop")


def noise(room: int, cost: Callable[[str], int], start: int = 0) -> list[str]:
    """RULER's noise sentences, in order from ``start``, while they fit in ``room`` tokens."""
    out: list[str] = []
    i = start
    while True:
        s = NOISE[i % len(NOISE)]
        c = cost(s)
        if c > room:
            return out
        out.append(s)
        room -= c
        i += 1
