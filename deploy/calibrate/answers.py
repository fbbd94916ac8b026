"""``vlkv calibrate --rerank K``: **answer recall**, a label-free measure on free-running answers.

Teacher forcing (``calibrate.py``) compares a compressed cache against the full cache's own words: a cache
that rewords the answer ("The answer to this puzzle is: 92736." where the full cache says "The number of
Yara is 92736.") disagrees at the first word yet carries the value, and a cache that echoes the words but
invents the value agrees on most positions (#38, ``needle`` at 2%). Here every cache decodes greedily on
its own (the decode core, ``InProcessEngine.decode_caches``, to its end token: the full cache at most as many
tokens as the reference, a candidate at most ``ANSWER_MARGIN`` more than the full cache's answer on its prompt),
and what is compared is the content the full cache's answer took from the context:

* the **question** is the last non-empty line of the prompt's last turn: the rendered prompt without the
  chat template's generation suffix (what the template appends after a user turn's text, found by
  rendering a marker; none for a plain prompt);
* the **retrieved words** are the lower-cased ``\\w+`` words of the full cache's answer that the question
  does not contain (the value, a name the question did not give); the words the question already gives
  ("the", "number of Yara") are no evidence that anything was retrieved;
* each retrieved word weighs by its **rarity in the prompt**, ``1 / (1 + n)`` with ``n`` its occurrences among
  the rendered prompt's words: a word the context gives once (the value, ``92736``) weighs 1/2, one it
  repeats on every line (``red``, ``has`` in a catalogue) little, one the prompt does not contain 1 (a word
  of the image or the model's own phrasing: as much as before). A smoothed inverse frequency, label-free: a
  word that occurs once says which line was read, a word that occurs everywhere does not;
* a candidate's **answer recall** on a prompt is the weighted share of those words found in its own
  free-running answer (the plain share without a prompt); when the full answer has none, 1.0 if its
  normalized answer (the words, joined by one space) equals the full cache's, else 0.0. The table's column
  is the mean over prompts.

No dataset answer is used: the reference is the full cache's own answer.
"""

from __future__ import annotations

import re
from collections import Counter

from vlkv.common.model.question import render_around_message
from vlkv.common.sampling import SamplingConfig

_WORD = re.compile(r"\w+")
ANSWER_MARGIN = 16
"""The most tokens a candidate's answer may run past the full cache's answer on its prompt: a rewording
("The answer to this puzzle is: 92736." for "The number of Yara is 92736.") is a few tokens longer; a
candidate that has not given the value a sentence after the full cache ended has digressed, and decoding
it on to ``-n`` tokens (64) was most of the pass's decode on prompts with short answers."""


def words(text: str) -> list[str]:
    """The lower-cased ``\\w+`` words of ``text``, in order."""
    return _WORD.findall(text.lower())


def generation_suffix(processor) -> str:
    """What the chat template appends after a user turn's text (its end and the assistant's header), as
    ``question.render_around_message`` renders it; "" without a chat template (the prompt ends with its
    text)."""
    rendered = render_around_message(processor)
    return rendered[1] if rendered is not None else ""


def question_of(prompt: str, suffix: str = "") -> str:
    """The prompt's question: the last non-empty line of its text before the generation ``suffix``."""
    if suffix and prompt.endswith(suffix):
        prompt = prompt[: -len(suffix)]
    lines = [line for line in prompt.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def retrieved_words(full_answer: str, question: str) -> list[str]:
    """The distinct words of the full cache's answer that the question does not contain, in order."""
    asked = set(words(question))
    out: list[str] = []
    for w in words(full_answer):
        if w not in asked and w not in out:
            out.append(w)
    return out


def rarity_weights(wanted: list[str], prompt: str) -> list[float]:
    """Each word's weight ``1 / (1 + n)``, ``n`` its occurrences among ``prompt``'s words (all 1 without one)."""
    counts = Counter(words(prompt))
    return [1.0 / (1 + counts[w]) for w in wanted]


def answer_recall(full_answer: str, answer: str, question: str, prompt: str = "") -> float:
    """The share of ``retrieved_words(full_answer, question)`` found among ``answer``'s words, each word
    weighted by its rarity in ``prompt`` (``rarity_weights``; "" : every word 1); without any retrieved
    word, whole normalized-answer equality (1.0 or 0.0)."""
    wanted = retrieved_words(full_answer, question)
    if not wanted:
        return float(words(answer) == words(full_answer))
    got = set(words(answer))
    weights = rarity_weights(wanted, prompt)
    return sum(wt for w, wt in zip(wanted, weights, strict=True) if w in got) / sum(weights)


def free_run(engine, caches, tokens: int | list[int], eos_ids) -> list[list[int]]:
    """Each cache's greedy answer, decoded together through the decode core: at most ``tokens`` tokens
    (one limit, or one per cache), the prefill's included, ending at an end token."""
    limits = tokens if isinstance(tokens, list) else [tokens] * len(caches)
    return engine.decode_caches(caches, [SamplingConfig(max_new_tokens=n) for n in limits], eos_ids)
