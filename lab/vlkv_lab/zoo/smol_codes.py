"""Zoo member ``smol_codes``: an image plus a 512-token text context on the real decoder (SmolLM2-135M-Instruct);
the answer needs both.

The task: one image (196 x 196, **14 x 14 = 196 vision tokens**; ``smol_vision``'s scenes) with one object,
one of 5 colours x 4 shapes, then a catalogue of all 20 colour-shape pairs in random order, each with its own
random 4-digit code and two distractor numbers (``The red circle has code 4821. It is kept on shelf 12 in
room 7.``: 25 tokens a line, **512 tokens** of context), then the question "What is the code of the object
in the image?" -> "The red circle has code 4821" (the answer names the object it saw, then the code its
line gives). The image alone does not give the code and the text alone does not say which of
the 20 objects is meant; the entries sharing the object's colour or its shape are the near misses. Prompts
are ~750-765 tokens (SmolLM2's ChatML frame and default system prompt included).

Scoring: the zoo's one ``is_correct`` over the 4-digit codes (the generated text's 4-digit numbers must be
exactly the code; the words before it are not scored).

Training: ``python -m vlkv_lab.zoo.smol_codes --out lab/vlkv_lab/zoo/models/smol_codes`` (``smol_training``).
"""

from __future__ import annotations

import random
from dataclasses import replace

from vlkv.deploy.synthetic_task import COLOURS, SHAPES, Example

from vlkv_lab.zoo.smol_training import smol_member, train_member
from vlkv_lab.zoo.smol_vision import draw_object

NAME = "smol_codes"
MAX_NEW_TOKENS = 14  # "The <colour> <shape> has code " + four digits (one token each) + <|im_end|>
GEOMETRY = (
    "LLaVA-1.5 on SmolLM2-135M-Instruct (30 layers, GQA 9/3), 196 vision tokens, then a 512-token catalogue; "
    "the code is looked up in the text under the colour and shape seen in the image (~750-765-token prompts)"
)
KINDS = ("code_of_object",)
HEADER = "Here is the catalogue of all objects and their codes:"
LINE = "The {colour} {shape} has code {code}. It is kept on shelf {shelf} in room {room}."
QUESTION = "What is the code of the object in the image?"
ANSWER = "The {colour} {shape} has code {code}"
RECIPE = {"align_steps": 200, "steps": 160, "batch": 4, "first": 14, "lr": 1e-3, "check_every": 40}
"""``smol_training``'s defaults for this member (the training command takes no other flag than ``--out``)."""


def _rng(split: str, seed: int, index: int) -> random.Random:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return random.Random(f"vlkv-zoo-{NAME}/{split}/{seed}/{index}")  # disjoint streams per split


def variants(example: Example) -> list[Example]:
    """Training only: the example's question, then the same catalogue asked by name ("What is the code of
    the red circle?") for the object in the image and its 7 near misses (same colour or same shape), packed
    into one sequence (``smol_lm.pack``): the lookup in the text trains on every block, the image-to-line
    step on the first. Held-out examples ask only the image question."""
    ((_, obj),) = example.focus
    *lines, _ = example.question.splitlines()
    out = [example]
    for line in lines[1:]:
        _, colour, shape, _, _, code, *_ = line.split()
        if colour == obj.colour or shape == obj.shape:
            question = "\n".join([*lines, f"What is the code of the {colour} {shape}?"])
            answer = ANSWER.format(colour=colour, shape=shape, code=code[:-1])
            out.append(replace(example, question=question, answer=answer, target=code[:-1]))
    return out


def make_example(index: int, seed: int = 0, split: str = "heldout") -> Example:
    rng = _rng(split, seed, index)
    pairs = [(c, s) for c in COLOURS for s in SHAPES]
    rng.shuffle(pairs)
    codes = rng.sample(range(1000, 10000), len(pairs))
    lines = [
        LINE.format(colour=c, shape=s, code=code, shelf=rng.randint(1, 40), room=rng.randint(1, 20))
        for (c, s), code in zip(pairs, codes, strict=True)
    ]
    which = rng.randrange(len(pairs))
    image, obj = draw_object(rng, *pairs[which])
    answer = ANSWER.format(colour=obj.colour, shape=obj.shape, code=codes[which])
    question = "\n".join([HEADER, *lines, QUESTION])
    return Example([image], question, answer, str(codes[which]), "code", KINDS[0], [[obj]], [(0, obj)])


MEMBER = smol_member(
    NAME,
    make_example,
    max_new_tokens=MAX_NEW_TOKENS,
    geometry=GEOMETRY,
    scored=frozenset(str(code) for code in range(1000, 10000)),
)
make_examples = MEMBER.make_examples

if __name__ == "__main__":
    train_member(MEMBER, make_example, RECIPE, variants=variants)
