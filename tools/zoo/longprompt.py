"""Zoo member ``longprompt``: a long instruction before the image and a long question after it, the key inside.

The task (its own): a 168 x 168 image (patch 14: 12 x 12 = 144 vision tokens) shows 1-4 square cards on a
table, each 4 x 4 patches, in pairwise distinct colours, each with a pattern (``rows``, ``columns``,
``checks``, ``plain``; patterns may repeat, so a pattern is never a key).

- Before the image: the checkpoint's system prompt (its chat template writes it when a chat has none), a
  fixed instruction of more than 100 tokens about the card game.
- After the image: a long message of more than 100 tokens: small-talk sentences in random order (no colour
  or pattern word in any of them), with **one sentence naming the card's colour at a random place among
  them**, and a fixed closing question ``so what pattern does that card have ?``. The key is therefore
  anywhere in the message, usually well before its tail.
- The answer: ``you asked about red , red rows .``: the colour copied from the middle of the message is
  the 4th generated token, the pattern read out of the image (one hop from the repeated colour) the 7th.

Scoring (``is_correct``): the colour and pattern words of the generated text (up to the first eos), in
order, must equal the reference answer's (both the copied key and the read-out count).

Training: ``python -m vlkv.tools.zoo.longprompt --out tools/zoo/models/longprompt``
(``tools/zoo/training.py``): a vision probe, then one-card scenes growing to four over the first 40% of
steps.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from vlkv.tools.task.synthetic_task import COLOURS, Example, Geometry
from vlkv.tools.zoo.scenes import PATTERNS, place, render_cards
from vlkv.tools.zoo.training import Arch, Member, prompt_text, train_member

NAME = "longprompt"
MODEL_DIR = Path(__file__).resolve().parent / "models" / NAME
GEOM = Geometry(image=168, patch=14, span=4)  # 12 x 12 patches; a card covers 4 x 4 of them
MAX_NEW_TOKENS = 10  # the answer is 8 words + eos
MAX_CARDS = 4
MIN_QUESTION_TOKENS = 100
KIND = "pattern_of_card"

SYSTEM_PROMPT = (
    "you are a careful visual assistant for a card game . the user shows you one picture of a table with "
    "a few cards on it . each card on the table has one colour and one pattern . the user then writes a "
    "long message about the game . most of the message is small talk that does not matter for the answer . "
    "somewhere in the message the user names the one card that matters . read the whole message with care "
    ", find the card the user asks about , then look at that card in the picture and name its pattern . "
    "first say which card the user asked about , then name its pattern . keep the answer short and do not "
    "add anything else ."
)
FILLERS = (
    "i have been playing this game with my friends for a long time .",
    "we usually meet at the weekend and play for a few hours .",
    "the table in the picture is in my kitchen .",
    "my brother says that the game is too easy , but i do not agree .",
    "last week we played until late at night .",
    "the rules say that every player gets a few cards at the start .",
    "i took the picture with my phone just now .",
    "the light in the room is not very good , so look with care .",
    "we keep the cards in a small box when we do not play .",
    "my sister always wins , and nobody knows how she does it .",
    "there is a new version of the game , but we like the old one .",
    "sometimes we play with more cards , sometimes with less .",
    "i want to write down what is on the table before we go on .",
    "the game is over when a player has no cards left .",
    "it is my turn now , and i need to think about my next move .",
    "we bought this game in a shop near the station .",
    "my friend thinks the picture is a little dark .",
    "a good player looks at every card on the table .",
    "we play a new round after dinner .",
    "nobody has touched the cards since i took the picture .",
    "the other players are waiting for me , so please be quick .",
    "i am not sure i remember all the rules .",
)
KEY_SENTENCES = (
    "please tell me the pattern of the {c} card .",
    "the card i want to know about is the {c} one .",
    "i am asking about the {c} card .",
)
CLOSING = "so what pattern does that card have ?"
GEOMETRY = (
    "LLaVA-1.5, 144 vision tokens/image (12x12, 168 px), 4 layers, GQA 4/2; a 131-token system prompt before "
    "the image, a 100-150 token question after it with the key at a random place inside, 8-token answers"
)
_TEXT = " ".join([SYSTEM_PROMPT, *FILLERS, *KEY_SENTENCES, CLOSING, "you asked about"])
WORDS: list[str] = list(dict.fromkeys([w for w in _TEXT.split() if "{" not in w] + [*COLOURS, *PATTERNS]))
SCORED = set(COLOURS) | set(PATTERNS)
ARCH = Arch(geometry=GEOM, layers=4, hidden=128, heads=4, kv_heads=2, rope_theta=1e6)


def _rng(split: str, seed: int, index: int) -> random.Random:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return random.Random(f"vlkv-zoo-{NAME}/{split}/{seed}/{index}")  # SHA-512 of the string: disjoint splits


def long_question(rng: random.Random, colour: str) -> tuple[str, int]:
    """The message after the image and the index of its key sentence among its sentences: small talk up to
    a drawn length (at least ``MIN_QUESTION_TOKENS`` tokens in all), the key sentence at a uniformly drawn
    place among it, the closing question last."""
    fillers = list(FILLERS)
    rng.shuffle(fillers)
    key = rng.choice(KEY_SENTENCES).format(c=colour)
    target = rng.randint(MIN_QUESTION_TOKENS + 5, MIN_QUESTION_TOKENS + 40)
    fixed = len(key.split()) + len(CLOSING.split())
    chosen: list[str] = []
    while fixed + sum(len(s.split()) for s in chosen) < target:
        chosen.append(fillers[len(chosen)])
    at = rng.randint(0, len(chosen))
    return " ".join([*chosen[:at], key, *chosen[at:], CLOSING]), at


def make_example(index: int, seed: int = 0, split: str = "heldout", max_cards: int = MAX_CARDS) -> Example:
    """The ``index``-th example of the stream ``(split, seed)``; ``max_cards`` caps the scene (warm-up)."""
    rng = _rng(split, seed, index)
    n = rng.randint(1, max_cards)
    colours = rng.sample(list(COLOURS), n)
    cards = place(rng, [(rng.choice(PATTERNS), c) for c in colours], GEOM)
    card = rng.choice(cards)
    question, _ = long_question(rng, card.colour)
    answer = f"you asked about {card.colour} , {card.colour} {card.shape} ."
    image = render_cards(cards, rng, GEOM)
    return Example([image], question, answer, card.shape, "pattern", KIND, [cards], [(0, card)])


def make_examples(n: int, seed: int = 0, split: str = "heldout") -> list[Example]:
    """``n`` deterministic examples of the split (``"train"`` or ``"heldout"``: disjoint seed spaces)."""
    return [make_example(i, seed, split) for i in range(n)]


def train_example(index: int, frac: float) -> Example:
    """Training's curriculum at progress ``frac``: scenes grow from one card to four over the first 40%."""
    return make_example(index, 0, "train", max_cards=min(MAX_CARDS, 1 + int(frac / 0.4 * MAX_CARDS)))


def scored_words(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z]+", text.lower()) if w in SCORED]


def is_correct(generated_text: str, example: Example) -> bool:
    """True iff the colour and pattern words of the generated text (up to the first eos) are the answer's."""
    return scored_words(generated_text.split("</s>")[0]) == scored_words(example.answer)


MEMBER = Member(
    name=NAME,
    words=WORDS,
    system_prompt=SYSTEM_PROMPT,
    arch=ARCH,
    object_kinds=PATTERNS,
    train_example=train_example,
    make_examples=make_examples,
    is_correct=is_correct,
    max_new_tokens=MAX_NEW_TOKENS,
    steps=700,
    probe_steps=50,
)

__all__ = ["GEOMETRY", "MAX_NEW_TOKENS", "MODEL_DIR", "NAME", "is_correct", "make_examples", "prompt_text"]

if __name__ == "__main__":
    train_member(MEMBER)
