"""Where a text-only prompt's final question starts, read from its input ids and the model's chat template.

The question is the tokens after the last line break inside the last user turn, through the end of the
prompt (the chat template's generation tail included): in "<context>\\n\\nWhat is X? Answer ...<|im_end|>\\n
<|im_start|>assistant\\n" the tokens from "What" on. A policy may take them as a text-only prompt's
observation window (``Policy.observed_tau``'s ``question``; the lab's ``vlcache_lab`` does). Everything here
comes from the tokenizer and its chat template (``TurnLayout.from_tokenizer``, once per process), never from
a task's wording; the prefill worker (``engine.PrefillEngine.run``) and the in-process evaluation
(``lab/vlkv_lab/eval/evaluation.prepare``) both call :func:`question_tokens` on the request's ids with the
``ModelSpec``'s layout, so they pass the same value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_SENTINEL = "\x00vlkv-question\x00"


@dataclass(frozen=True)
class TurnLayout:
    """What :func:`question_tokens` needs to know of a tokenizer and its chat template.

    breaks: ids whose text holds a line break. stops: special ids (turn markers, BOS ...): the search for the
    break never crosses one, so it stays inside the last turn. tail: the template's ids after a user
    message's text (its end of turn and generation prompt), matched at the prompt's end as far as they agree.
    head: the template's tokens between the user turn's last special token and the message's text (ChatML's
    "user\\n": 2); a break among them is the template's, not the user's."""

    breaks: frozenset[int] = frozenset()
    stops: frozenset[int] = frozenset()
    tail: tuple[int, ...] = ()
    head: int = 0

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TurnLayout:
        """From a Hugging Face tokenizer (its vocabulary, special tokens and chat template, if any)."""
        size = len(tokenizer)
        pieces = tokenizer.batch_decode([[i] for i in range(size)])
        breaks = frozenset(i for i, piece in enumerate(pieces) if "\n" in piece)
        stops = frozenset(int(i) for i in tokenizer.all_special_ids) | frozenset(
            int(i) for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items() if added.special
        )
        rendered = render_around_message(tokenizer)
        if rendered is None:
            return cls(breaks - stops, stops)
        before, after = rendered
        tail = tuple(tokenizer(after, add_special_tokens=False).input_ids) if after else ()
        prefix = tokenizer(before, add_special_tokens=False).input_ids
        last_stop = max((j for j, t in enumerate(prefix) if t in stops), default=-1)
        return cls(breaks - stops, stops, tail, len(prefix) - 1 - last_stop)


def render_around_message(templated) -> tuple[str, str] | None:
    """The chat template's text before and after a one-turn user message (its text a marker; the
    generation prompt included), or None without a template. ``templated``: a tokenizer or a processor
    (``apply_chat_template`` and ``chat_template``)."""
    if not getattr(templated, "chat_template", None):
        return None
    for content in (_SENTINEL, [{"type": "text", "text": _SENTINEL}]):
        try:
            text = templated.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 - a template that wants the other content shape
            continue
        if isinstance(text, str) and text.count(_SENTINEL) == 1:
            before, after = text.split(_SENTINEL)
            return before, after
    return None


def question_tokens(input_ids: Sequence[int], layout: TurnLayout | None) -> int:
    """Tokens of the prompt's final question: after the last line break in the last user turn, through the
    prompt's end (the template's tail included); 0 when that turn holds no line break (or no layout)."""
    if layout is None or not layout.breaks:
        return 0
    ids = [int(i) for i in input_ids]
    m = len(ids)
    matched = 0
    while matched < min(m, len(layout.tail)) and ids[m - 1 - matched] == layout.tail[-1 - matched]:
        matched += 1
    for j in range(m - matched - 1, -1, -1):
        if ids[j] in layout.stops:
            return 0
        if ids[j] in layout.breaks:
            if any(t in layout.stops for t in ids[max(0, j - layout.head) : j]):
                return 0  # the template's own break before the message (ChatML's "user\n")
            return m - 1 - j
    return 0


def prompt_question(input_ids, text_only: bool, layout: TurnLayout | None) -> int:
    """:func:`question_tokens` of a request's ids (``[1, m]`` tensor or a sequence) when the prompt is
    text-only, else 0 (an image prompt's window is its post-vision text): what the prefill worker and the
    in-process evaluation hand the policy as ``question``."""
    if not text_only:
        return 0
    ids = input_ids.reshape(-1).tolist() if hasattr(input_ids, "reshape") else list(input_ids)
    return question_tokens(ids, layout)
