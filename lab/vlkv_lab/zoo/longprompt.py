"""Zoo member ``longprompt``: a long instruction before the image and a long question after it, the key inside.

The task (its own): a 168 x 168 image (patch 14: 12 x 12 = 144 vision tokens) shows 1-4 shapes (square,
circle, triangle, cross with their textures, 4 x 4 patches each) in pairwise distinct colours; shapes may
repeat, so a shape is never a key.

- Before the image: the checkpoint's system prompt (its chat template writes it when a chat has none), a
  fixed instruction of 120+ tokens about the picture game.
- After the image: a long message of 100-150 tokens: small-talk sentences in random order (no colour or
  shape word in any of them), with **one sentence naming the colour at a uniformly drawn place among
  them**, and a fixed closing question ``so what shape is it ?``. The key is anywhere in the message,
  usually well before its tail.
- The answer: ``the red circle .``: the colour copied from inside the message is the 2nd generated token
  (the first decode step after the prefill), the shape read out of the image (one hop from the colour) the
  3rd.

Scoring (``is_correct``): the colour and shape words of the generated text (up to the first eos), in
order, must equal the reference answer's (both the copied key and the read-out count).

Training: ``python -m vlkv_lab.zoo.longprompt --out lab/vlkv_lab/zoo/models/longprompt``
(``lab/vlkv_lab/zoo/training.py``): fine-tuned from ``grid16``'s checkpoint (same decoder shape; the words both
vocabularies share keep grid16's rows, the tower's position embeddings are resized to 12 x 12), which reads
a shape keyed by a colour already; what it learns here is to find the colour inside the long message. The
curriculum grows the small talk from none to the full 100+ tokens over the first 30% of steps and the
scenes from two shapes to four over the first 40%.

Earlier designs that did not train in the time: cards told apart by pattern alone (the default tower needs
the silhouette too: a linear probe named a card's pattern on 0.62 of its patches after 30 steps, a shape on
0.96; held-out stayed below 0.15 for 300 steps), and this task from random init with GQA 4/2 (held-out
0.56 at step 300 of 450).
"""

from __future__ import annotations

import random

from vlkv.deploy.synthetic_task import COLOURS, SHAPES, Example, Geometry

from vlkv_lab.zoo import grid16
from vlkv_lab.zoo.interface import Member
from vlkv_lab.zoo.scenes import example_rng, place, render_image
from vlkv_lab.zoo.trainer import main
from vlkv_lab.zoo.training import Arch, small_llava

NAME = "longprompt"
GEOM = Geometry(image=168, patch=14, span=4)  # 12 x 12 patches; a shape covers 4 x 4 of them
MAX_NEW_TOKENS = 8  # the answer is 4 words + eos
MAX_OBJECTS = 4
MIN_QUESTION_TOKENS = 100
KIND = "shape_in_long_message"

SYSTEM_PROMPT = (
    "you are a careful visual assistant for a picture game . the user shows you one picture with a few "
    "shapes on it . each shape in the picture has its own colour . the user then writes a long message "
    "about the game . most of the message is small talk that does not matter for the answer . somewhere in "
    "the message the user names the one colour that matters . read the whole message with care , find the "
    "colour the user asks about , then look at the shape of that colour in the picture and name it . first "
    "say the colour the user asked about , then name the shape . keep the answer short and do not add "
    "anything else ."
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
    "a good player looks at every part of the picture .",
    "we play a new round after dinner .",
    "nobody has touched the table since i took the picture .",
    "the other players are waiting for me , so please be quick .",
    "i am not sure i remember all the rules .",
)
KEY_SENTENCES = (
    "please tell me which shape is {c} .",
    "the shape i want to know about is the {c} one .",
    "i am asking about the {c} shape .",
)
CLOSING = "so what shape is it ?"
GEOMETRY = (
    "LLaVA-1.5, 144 vision tokens/image (12x12, 168 px), 4 layers, MHA 4/4; a 128-token system prompt before "
    "the image, a 100-150 token question after it with the key at a random place inside, 4-token answers"
)
_TEXT = " ".join([SYSTEM_PROMPT, *FILLERS, *KEY_SENTENCES, CLOSING])
# grid16's words first (training starts from grid16's checkpoint, whose rows the shared words keep)
WORDS: list[str] = list(dict.fromkeys([*grid16.WORDS, *(w for w in _TEXT.split() if "{" not in w)]))
ARCH = Arch(geometry=GEOM, layers=4, hidden=128, heads=4, kv_heads=4, rope_theta=1e6)  # grid16's decoder


def long_question(rng: random.Random, colour: str, min_tokens: int = MIN_QUESTION_TOKENS) -> tuple[str, int]:
    """The message after the image and the index of its key sentence among its sentences: small talk up to
    a drawn length (at least ``min_tokens`` tokens in all), the key sentence at a uniformly drawn place
    among it, the closing question last."""
    fillers = list(FILLERS)
    rng.shuffle(fillers)
    key = rng.choice(KEY_SENTENCES).format(c=colour)
    target = rng.randint(min_tokens + 5, min_tokens + 40)
    fixed = len(key.split()) + len(CLOSING.split())
    chosen: list[str] = []
    while fixed + sum(len(s.split()) for s in chosen) < target:
        chosen.append(fillers[len(chosen)])
    at = rng.randint(0, len(chosen))
    return " ".join([*chosen[:at], key, *chosen[at:], CLOSING]), at


def make_example(
    index: int,
    seed: int = 0,
    split: str = "heldout",
    max_objects: int = MAX_OBJECTS,
    min_question_tokens: int = MIN_QUESTION_TOKENS,
) -> Example:
    """The ``index``-th example of the stream ``(split, seed)``; ``max_objects`` and ``min_question_tokens``
    shrink the scene and the message (training's warm-up)."""
    rng = example_rng(NAME, split, seed, index)
    n = rng.randint(1, max_objects)
    colours = rng.sample(list(COLOURS), n)
    objs = place(rng, [(rng.choice(SHAPES), c) for c in colours], GEOM)
    obj = rng.choice(objs)
    question, _ = long_question(rng, obj.colour, min_question_tokens)
    answer = f"the {obj.colour} {obj.shape} ."
    image = render_image(objs, rng, GEOM)
    return Example([image], question, answer, obj.shape, "shape", KIND, [objs], [(0, obj)])


def make_examples(n: int, seed: int = 0, split: str = "heldout") -> list[Example]:
    """``n`` deterministic examples of the split (``"train"`` or ``"heldout"``: disjoint seed spaces)."""
    return [make_example(i, seed, split) for i in range(n)]


def train_example(index: int, frac: float) -> Example:
    """Training's curriculum at progress ``frac``: the small talk grows from none to the full length over
    the first 30% (the copy of the key is learned at short range first), scenes from up to two shapes to
    four over the first 40% (one shape teaches the read-out, two or more need the key)."""
    max_objects = min(MAX_OBJECTS, 2 + int(frac / 0.4 * (MAX_OBJECTS - 1)))
    min_tokens = int(MIN_QUESTION_TOKENS * min(1.0, frac / 0.3)) - 5 if frac < 0.3 else MIN_QUESTION_TOKENS
    return make_example(index, 0, "train", max_objects=max_objects, min_question_tokens=max(0, min_tokens))


MEMBER = Member.shipped(NAME, MAX_NEW_TOKENS, GEOMETRY, make_examples)
# fine-tuned from grid16's checkpoint
FROM = grid16.MEMBER.model_dir
RECIPE = small_llava(
    MEMBER, WORDS, SYSTEM_PROMPT, ARCH, train_example, tuple(SHAPES), 160, 0, 16, 5e-4, 20, FROM
)

if __name__ == "__main__":
    main(RECIPE)
