"""A RULER-style real-text suite for SmolLM2-135M-Instruct (``smollm2.py``): long contexts, one fact asked.

Each item is a one-turn, text-only chat (a context, then a question): what a user sends to a VLM server
with no image, through the public API as a chat request. Tasks (RULER, Hsieh et al. 2024, in spirit):

- ``needle``: one "The secret number of NAME is 12345." in a haystack; asked for NAME's number;
- ``multikey``: four such needles with different names; asked for one;
- ``kv``: the whole context is "The code for WORD-WORD is 12345." lines; asked for one word's code;
- ``tracing``: NAME's number, then "NAME2 has the same secret number as NAME."; asked for NAME2's (2 hops);
- ``passage``: a short story about two people (where each moved, their jobs) in a haystack; asked where one
  of them lives now;
- RULER's own needle tasks, as RULER writes them (``text_ruler.py``): ``niah_single_1`` (RULER's noise
  haystack, a 7-digit number), ``niah_single_2`` / ``niah_single_3`` (this suite's sentences, a number / a
  short code), ``niah_code``, ``niah_word`` (noise, a code / a word), ``niah_multikey_1`` (two distractor
  needles), ``niah_multivalue`` (two values, both asked), ``niah_multiquery`` (two keys asked), ``vt_1hop``
  (variable tracking, one hop).

The haystack is plain English sentences drawn from a small grammar (no names, numbers or cities in it), or
RULER's noise ("The grass is green. The sky is blue. ..." repeated).
Lengths are prompt tokens under the model's tokenizer and chat template (1K, 2K, 4K: ``LENGTHS``).
Everything is deterministic from ``(task, length, split, seed, index)``; the ``train`` and ``heldout`` splits
draw from disjoint seed spaces.

API (the kvpress anchor and ``vlkv eval zoo`` import it)::

    from vlkv_lab.zoo import text_suite as ts
    batch = ts.items("needle", 1024, "heldout", n=50, seed=0)   # list[TextItem]
    prompt = ts.render(batch[0], processor_or_tokenizer)         # the chat prompt string
    ok = ts.is_correct(generated_text, batch[0])                 # the zoo's argument order
    batch[0].messages                                            # the chat messages the public API takes
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

from vlkv_lab.zoo import text_ruler
from vlkv_lab.zoo.text_ruler import Spec

TASKS = ("needle", "multikey", "kv", "tracing", "passage", *text_ruler.BUILDERS)
PASSING_TASKS = ("needle", "niah_single_1", "niah_single_2", "niah_single_3", "niah_code")
"""The tasks SmolLM2-135M-Instruct does with the full cache (held-out, 1K, n = 50: at least 0.9;
``lab/vlkv_lab/zoo/README.md``): the text tasks the tuning protocol scores. The others are dropped and named there;
they still run with ``--text-tasks``."""
DEFAULT_TASKS = ("needle", "niah_single_1", "niah_single_3")
"""``vlkv eval zoo``'s default run: three of ``PASSING_TASKS`` (both haystacks, a number and a code), to
keep its text part modest (one task's rows at 1K and n = 50 take 6-15 minutes here)."""
LENGTHS = (1024, 2048, 4096)
SPLITS = ("train", "heldout")
MAX_NEW_TOKENS = 20
"""Enough for "The secret number of NAME is 12345." and an end of turn (``max_new_tokens``: per task)."""


def max_new_tokens(task: str) -> int:
    """Tokens generated for ``task``'s answers: RULER's tasks echo their longer question first."""
    if task in text_ruler.MANY:
        return text_ruler.MAX_NEW_TOKENS_MANY
    return text_ruler.MAX_NEW_TOKENS if task in text_ruler.BUILDERS else MAX_NEW_TOKENS


NAMES = (
    "Anna Bruno Clara Daniel Elena Felix Greta Hugo Irene Jonas Karla Leon Maria Nico Olga Pablo Rosa "
    "Stefan Tina Ulrich Vera Walter Yara Zeno Alice Boris Celia Dmitri Emma Fabio Gina Henrik Ines Jakob "
    "Lena Marco Nina Oscar Paula Rafael Sofia Tomas Ursula Viktor Wanda Xavier Yusuf Zora"
).split()
CITIES = (
    "Paris Berlin Madrid Rome Vienna Prague Lisbon Dublin Oslo Athens Warsaw Budapest Zurich Brussels "
    "Amsterdam Copenhagen Stockholm Helsinki Toronto Chicago Boston Denver Seattle Sydney Tokyo Seoul "
    "Cairo Nairobi Lima Santiago"
).split()
JOBS = (
    "baker teacher doctor pilot farmer lawyer painter nurse chef writer engineer dentist plumber "
    "architect librarian singer tailor carpenter"
).split()
WORDS = (
    "apple river candle mirror garden pillow rocket violin wallet ladder basket helmet compass lantern "
    "marble needle orchid pepper quartz saddle tunnel velvet walnut anchor bridge cactus dragon engine "
    "feather glacier harbor island jacket kettle lemon magnet napkin oyster parrot rabbit silver tomato "
    "umbrella valley window yogurt zipper almond blanket cherry dolphin falcon ginger hammer iguana jigsaw "
    "koala lobster meadow nectar olive panda quilt raven salmon tulip unicorn vapor whistle bamboo cobalt"
).split()

# The haystack's grammar: bland sentences with no names, numbers, cities or jobs.
_SUBJECTS = (
    "the old bridge,the quiet river,a small garden,the morning light,the long road,an empty field,"
    "the wooden fence,a tall tree,the autumn wind,the narrow street,a distant hill,the village market,"
    "the evening train,a gentle rain,the stone wall,the open window,a thick fog,the summer sky"
).split(",")
_VERBS = (
    "stretched toward,rested near,turned slowly past,faded behind,shone over,waited beside,"
    "leaned against,drifted across,rose above,curved around,glowed beneath,stood close to"
).split(",")
_OBJECTS = (
    "the sleeping houses,a field of grass,the grey clouds,the still water,an old barn,the far mountains,"
    "a row of lamps,the empty benches,the silent hills,a patch of flowers,the dusty path,the harbour walls"
).split(",")
_TAILS = (
    ",,, as the day went on, while nothing else moved, for a long while, in the usual way, "
    "without a sound, as it always had"
).split(",")


@dataclass(frozen=True)
class TextItem:
    """One question over a long text. ``context`` + "\\n\\n" + ``question`` is the user's message."""

    task: str
    length: int
    split: str
    index: int
    context: str
    question: str
    answer: str
    seed: int = 0
    images: tuple = field(default=(), repr=False)  # none: a text-only request (the zoo's Example shape)
    answers: tuple[str, ...] = ()
    """Every value the answer must hold (``(answer,)`` when empty)."""
    wrong: tuple[str, ...] = ()
    """The other needles' values: an answer holding one is wrong (a hedge is no retrieval)."""

    @property
    def text(self) -> str:
        return f"{self.context}\n\n{self.question}"

    @property
    def messages(self) -> list[dict]:
        """The one-turn chat the public API takes (``build_request(question=item.text)`` sends the same)."""
        return [{"role": "user", "content": [{"type": "text", "text": self.text}]}]

    def is_correct(self, text: str) -> bool:
        return is_correct(text, self)


def is_correct(text: str, item: TextItem) -> bool:
    """Every value of the answer (a number, a city, a word, a code, a variable) appears in the generated text
    as a whole word, and no other needle's value does; anything after the model's end of turn is ignored."""
    text = text.split("<|im_end|>")[0]
    return all(_holds(text, v) for v in item.answers or (item.answer,)) and not any(
        _holds(text, v) for v in item.wrong
    )


def _holds(text: str, value: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(value)}(?![\w])", text, flags=re.IGNORECASE) is not None


def render(item: TextItem, processor) -> str:
    """The chat prompt string (``processor`` or a tokenizer with the model's chat template)."""
    return processor.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=False)


def prompt_text(processor, item: TextItem) -> str:
    """``render`` in the zoo member interface's argument order."""
    return render(item, processor)


@lru_cache(maxsize=1)
def default_tokenizer():
    """SmolLM2's tokenizer with the served chat template (the assembled text-only wrapper's)."""
    from transformers import AutoTokenizer

    from vlkv_lab.zoo.smollm2 import text_checkpoint

    return AutoTokenizer.from_pretrained(str(text_checkpoint()))


def items(
    task: str, length: int, split: str = "heldout", n: int = 50, seed: int = 0, tokenizer=None
) -> list[TextItem]:
    """``n`` items of ``task`` whose prompts are about ``length`` tokens (within a sentence, never over)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if length < 256:
        raise ValueError(f"length must be at least 256 tokens, got {length}")
    tok = tokenizer or default_tokenizer()
    return [make_item(task, length, split, i, seed, tok) for i in range(n)]


def make_item(task: str, length: int, split: str, index: int, seed: int, tokenizer) -> TextItem:
    rng = random.Random(f"vlkv-text/{split}/{task}/{length}/{seed}/{index}")
    spec = _BUILDERS[task](rng)
    facts, question = spec.facts, spec.question
    frame = len(_tokens(tokenizer, _frame_text(tokenizer, " ".join(facts), question)))
    room = length - frame
    if room < 0:
        raise ValueError(f"{task}: the facts alone need {frame} tokens, over {length}")
    if spec.dense:  # the context is the facts (kv: every line is a key-value pair)
        lines = spec.dense(rng, room, tokenizer)
        context = " ".join(lines)
    else:
        if spec.haystack == "noise":
            filler = text_ruler.noise(room, lambda s: _cost(tokenizer, s))
        else:
            filler = _haystack(rng, room, tokenizer)
        depths = sorted(rng.randint(0, len(filler)) for _ in facts)  # uniform depths, the facts' order kept
        for j, (depth, fact) in enumerate(zip(depths, facts, strict=True)):
            filler.insert(depth + j, fact)
        context = " ".join(filler)
    multi = len(spec.answers) > 1
    answer = ", ".join(spec.answers)
    return TextItem(
        task, length, split, index, context, question, answer, seed,
        answers=spec.answers if multi else (), wrong=spec.wrong,
    )  # fmt: skip


def _frame_text(tokenizer, context: str, question: str) -> str:
    msgs = [{"role": "user", "content": [{"type": "text", "text": f"{context}\n\n{question}"}]}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}."
    return s[0].upper() + s[1:]


def _cost(tokenizer, sentence: str) -> int:
    """Tokens a sentence adds after a space (memoized: the grammar's sentences repeat)."""
    return _cost_cached(tokenizer, sentence)


@lru_cache(maxsize=65536)
def _cost_cached(tokenizer, sentence: str) -> int:
    return len(_tokens(tokenizer, " " + sentence))


def _haystack(rng: random.Random, room: int, tokenizer) -> list[str]:
    out: list[str] = []
    while True:
        s = _sentence(rng)
        c = _cost(tokenizer, s)
        if c > room:
            return out
        out.append(s)
        room -= c


def _number(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _needle(rng):
    name, num = rng.choice(NAMES), _number(rng)
    q = f"What is the secret number of {name}? Answer with the number only."
    return Spec([f"The secret number of {name} is {num}."], q, (num,), haystack="grammar")


def _multikey(rng):
    names = rng.sample(NAMES, 4)
    nums = [_number(rng) for _ in names]
    facts = [f"The secret number of {a} is {b}." for a, b in zip(names, nums, strict=True)]
    i = rng.randrange(len(names))
    q = f"What is the secret number of {names[i]}? Answer with the number only."
    return Spec(facts, q, (nums[i],), haystack="grammar")


def _kv(rng):
    word, num = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}", _number(rng)
    target = f"The code for {word} is {num}."
    q = f"What is the code for {word}? Answer with the number only."

    def lines(rng2, room, tokenizer):  # distinct two-word keys until the room is used
        out, seen = [], {word}
        while True:
            key = f"{rng2.choice(WORDS)}-{rng2.choice(WORDS)}"
            if key in seen:
                continue
            line = f"The code for {key} is {_number(rng2)}."
            c = _cost(tokenizer, line)
            if c > room:
                break
            seen.add(key)
            out.append(line)
            room -= c  # the target line is counted in the frame already
        out.insert(rng2.randint(0, len(out)), target)
        return out

    return Spec([target], q, (num,), haystack="grammar", dense=lines)


def _tracing(rng):
    a, b = rng.sample(NAMES, 2)
    num = _number(rng)
    facts = [f"The secret number of {a} is {num}.", f"{b} has the same secret number as {a}."]
    q = f"What is the secret number of {b}? Answer with the number only."
    return Spec(facts, q, (num,), haystack="grammar")


def _passage(rng):
    a, b = rng.sample(NAMES, 2)
    ca, cb = rng.sample(CITIES, 2)
    ja, jb = rng.sample(JOBS, 2)
    story = (
        f"{a} and {b} grew up in the same town and went to school together. After school {a} moved to "
        f"{ca} to work as a {ja}, while {b} went to {cb} and became a {jb}. They still write to each other "
        f"every winter."
    )
    who, city = (a, ca) if rng.random() < 0.5 else (b, cb)
    q = f"In which city does {who} live now? Answer with the city only."
    return Spec([story], q, (city,), haystack="grammar")


_BUILDERS = {
    "needle": _needle,
    "multikey": _multikey,
    "kv": _kv,
    "tracing": _tracing,
    "passage": _passage,
    **text_ruler.BUILDERS,
}
