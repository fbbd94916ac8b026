"""Named policies: settings with a name of their own, each a plain JSON dict (``Policy.to_dict``'s shape).

``vlcache_paper``: VL-Cache as the paper defines it and as vlkv shipped it before the zoo (#30):
Algorithm 1's sparsity budgets, the post-vision rows as the scoring window and the question kept outright
(up to half a layer's budget, its last tokens), no pooling, and for a text-only prompt every row as
post-vision (the paper's definition: tau = m). ``vlcache_default``: the ``vlcache`` policy as it is built
with no options (the current default; its text-only handling included). ``vlcache_pyramid_window``: the
image default before draft-mass budgets (#38, 2026-11-28): ``Pyramid(beta=4.0)`` layer budgets and the
question's window kept outright, every other setting today's (`vlkv calibrate`'s "previous default" candidate,
the zoo's option rows are built over it).

``vlcache_lookup``: chosen on the real-text suite's training split (``needle`` on SmolLM2-135M-Instruct,
README "Text-only prompts") for prompts whose answer is a fact looked up in a long context: each token
also scores as the best of the 8 before it (``span_after``: the value travels with the name the question
attends to), one layer's look-up competes in every layer (``layer_share``), the first 4 tokens kept as
sinks, the question's best-scoring tokens kept (a quarter of the budget at most) with row-normalised
scores, a 16-token observation window for text-only prompts, uniform layer budgets. ``vlcache_text``: the
same with vlcache's own ``Pyramid(beta=4.0)``, for ``text_preset`` (text-only prompts only): on the
training split it keeps the needle at 5% and 10% (40 and 39 of 40), where uniform budgets keep 36 and 37
but also 27 at 2% (the pyramid 0). Neither suits image prompts (grid16 and longprompt lose 10-50 points).

``vlcache_text_lowbudget``: ``vlcache_text`` laid out as SnapKV lays out a text prompt, the observation
window and scored tokens only: no recent window before the question (``recent_ratio=0``; in a text-only
prompt those slots hold the context's tail, which the window's scores can keep if it matters), and a gentler
pyramid (``Pyramid(beta=2.0)``: the last layer half the mean, not a quarter). At 2% (about 20 tokens a
layer) ``vlcache_text``'s deep layers spend 5-14 slots on the recent window, sinks and question, and the
few scored slots left go to the looked-up name before the value that follows it; on the training split
(needle 1K, n = 50) this keeps 49 of 50 at 2% (``vlcache_text`` 0) and 49 / 47 at 5 / 10% (50 / 48);
held-out (n = 50) 0.94 / 0.98 / 0.98 at 2 / 5 / 10% (``vlcache_text`` 0.00 / 0.98 / 1.00).

``vlcache_text_span``: ``vlcache_lookup`` for text-only prompts whose question is longer than the needle's
(README "Text-only presets across tasks"): a 24-token observation window (``vlcache_lookup``'s 16 rows end
after the looked-up key of a RULER question, so none of them looks it up) and 16-token spans (8 reach the
third digit of "KEY is: 1234567" or of a "3f9a-c27e" code, counted from the key's last token). A wider window
(32) takes in the context's last tokens as rows, whose local look-ups, each spread 16 forward, crowd the
value out on ``needle``. Chosen on the training split of all five text tasks (n = 10 each).

``vlcache_text_question``: ``vlcache_text_span`` whose observation window is the prompt's own final question
(``question_min``/``question_max``: the tokens after the last line break of the user turn through the chat
template's tail, ``common/model/question.py``; 21 rows on a ``needle`` prompt, 28-30 on a RULER one),
clipped to 8..48 rows; a prompt with no line break there keeps the 24-row window (issue #38; compression
README, "Text-only prompts: the question as the window").

``vlcache_text_span_lookahead``: ``vlcache_text_span`` with a 16-token draft mixed half and half into the
scores (``lookahead``, ``lookahead.py``); not adopted (protocol v2.1's text dimension, 0.510 against 0.615).
``vlcache_text_span_lookahead{32,48}`` (w 0.5) and ``..._w1`` (w 1.0): the same with 32- and 48-token drafts,
long enough to pass a RULER answer's echo of its question (~25 tokens) and reach the value; not adopted
either (training split: 0.510 at w 0.5, 0.450 at w 1.0, against 0.615; compression README, "Text-only
prompts: 32- and 48-token drafts").

``vlcache_text_lean``: ``vlcache_text_span`` with fewer slots fixed and shorter spans (issue #38; compression
README, "Text-only presets: fewer fixed slots"): a 20-row window, no recent window (``recent_ratio=0``: in a
text-only prompt it holds the context's tail), the question's share shrinking below 5%
(``post_vision_slope=5``: a quarter of a layer at 5%, a tenth at 2%), and 12-token spans (enough for "KEY
is: 1234567" from the key's last token; 16 carry the looked-up phrase's followers into the slots the needle's
last digits need). ``vlcache_text_lean_sinks2``: the same with two sinks and the question's quarter at every
budget. The two best of nine on the training split (n = 10 per task); not adopted (protocol v2.1's text
dimension chose ``vlcache_text_lean``, 0.825 against 0.615, but three folds lose one held-out item of 20 at
5% or 10%; at 2% it keeps 0.20-0.85 of the RULER values, the default none).
``vlcache_text_lean_w24``: ``vlcache_text_lean`` with the default's 24-row window (compression README,
"Text-only presets: the question's window at 5%"): on training needle items lean loses at 5% it keeps every
needle token but answers a question read from its 20-row window's best tokens ("the number of Emma's
digits?"); screened on the training split only, not adopted.
``vlcache_text_lean_w24_skip32`` / ``vlcache_text_span_skip32``: ``vlcache_text_lean_w24`` /
``vlcache_text_span`` whose first 32 prompt positions spread half their score forward (``span_skip=32``,
``span_skip_weight=0.5``; compression README, "Text-only prompts: the user turn's sink block"). SmolLM2's
chat template ends its system prompt and opens the user turn at positions 18-23, and the context's first
words after it (24-31) draw sink-like attention from the question's rows whatever they say; spread 12-16
tokens forward (and shared across layers) they took 15-30 of a layer's 35 scored slots at 5% in the training
needle items the presets lost, crowding the needle out. At half weight a fact that opens the context still
carries its value (skipped outright, the needle at position 24 lost its digits). Training split (n = 100,
2 / 5 / 10%): ``..._lean_w24_skip32`` needle 0.84 / 0.98 / 0.94, niah_single_3 0.56 / 0.95 / 0.97 (the default
0.40 / 0.87 / 0.96 and 0.00 / 0.92 / 0.97), protocol v2.1's training choice (0.809; w24 0.798, default 0.619);
``..._span_skip32`` needle 0.38 / 0.90 / 0.95 (not run further). Not the default (held-out check: README).

``vlcache_text_by_budget``: ``vlcache_text_span`` that hands budgets below 7.5% to
``vlcache_text_lean_w24_skip32`` (``low_budget_preset`` / ``low_budget_below``; one preset of the two by name,
not a copy of either). On the training split ``..._skip32`` beats the default at 2% and 5% on every task but
one ``niah_single_2`` item at 5%, and loses ``needle`` items at 10% (0.94 against 0.96: it keeps the needle,
but its answer repeats the question and the token limit cuts the number), so the switch sits between 5% and
10% (compression README, "Text-only prompts: the preset by budget"). Protocol v2.1's training choice (0.815);
held-out seed 4 (n = 100): within 1 point of the default on all five tasks, +45-73 at 2%, but not adopted: the
``needle`` fold's choice (skip32, a tie) loses 3 points at 10%. **vlcache's text default since 2026-11-28**:
protocol v2.2 (ties to the smaller change) chooses it in every fold, and on held-out seed 5 (n = 100, float32)
every fold holds: +42 to +78 points at 2%, +0 to +10 at 5%, +0 at 10%, never below ``vlcache_text_span``.

``vlcache_text_lean_w24_skip32_q12``: ``vlcache_text_lean_w24_skip32`` whose question window keeps at most 12
slots (``post_vision_max=12``; compression README, "Text-only prompts: the 10% needle loss"). At 1K tokens the
window has 12 slots at 5% (the question's last 12 tokens: "Answer with the number only." and the chat
template's tail) and grows to the whole 24-token window at 10%, which adds "What is the secret number of
NAME?"; on the training items lost at 10% (and not at 5%) the model then echoes that question ('The answer to
the question "What is the secret number of Yara?" is 927') and the 20-token limit cuts the number. Capped,
a larger budget only adds scored tokens; at 1-5% on 1K prompts it is skip32 but where a layer's 5% budget is 52
(m >= 1021), whose window skip32 gives 13 slots. Training needle 1K, float32, n = 100: 0.99 at 10% (skip32 0.96,
the default 0.97, the better oracle 0.99), but niah_single_3 0.90 at 5% (n = 20; skip32 and the default 1.00: the
cap binds where the 5% window has 13 slots); not adopted.
"""

from __future__ import annotations

from typing import Any

from .base import Policy
from .registry import policy_from_dict

PRESETS: dict[str, dict[str, Any]] = {
    "vlcache_paper": {
        "policy": "vlcache",
        "allocator": {"name": "sparsity", "exact": False},
        "post_vision_window": True,
        "post_vision_cap": 0.5,
        "post_vision_by_score": False,
        "pool_kernel": 1,
        "text_window": 0,
        "lookahead": 0,
        "text_preset": "",
    },
    "vlcache_default": {"policy": "vlcache"},
    "vlcache_pyramid_window": {
        "policy": "vlcache",
        "allocator": {"name": "pyramid", "beta": 4.0},
        "post_vision_window": True,
    },
    "vlcache_lookup": {
        "policy": "vlcache",
        "allocator": {"name": "uniform"},
        "span_after": 8,
        "layer_share": 1.0,
        "sink_tokens": 4,
        "post_vision_cap": 0.25,
        "post_vision_by_score": True,
        "row_normalized": True,
        "text_window": 16,
        "post_vision_window": True,  # pinned, as lookahead and the allocator: the presets keep their settings
        "lookahead": 0,  # whatever vlcache's default
        "text_preset": "",  # compresses every prompt itself (a text preset cannot name another)
    },
}
PRESETS["vlcache_text"] = PRESETS["vlcache_lookup"] | {"allocator": {"name": "pyramid", "beta": 4.0}}
PRESETS["vlcache_text_lowbudget"] = PRESETS["vlcache_text"] | {
    "allocator": {"name": "pyramid", "beta": 2.0},
    "recent_ratio": 0.0,
}
PRESETS["vlcache_text_span"] = PRESETS["vlcache_lookup"] | {"text_window": 24, "span_after": 16}
# Fewer fixed slots for text-only prompts: no recent window, and the question's share shrinking with the
# budget (vlcache_text_lean) or two sinks instead of four (vlcache_text_lean_sinks2).
PRESETS["vlcache_text_lean"] = PRESETS["vlcache_text_span"] | {
    "text_window": 20,
    "span_after": 12,
    "recent_ratio": 0.0,
    "post_vision_slope": 5.0,
}
PRESETS["vlcache_text_lean_sinks2"] = PRESETS["vlcache_text_span"] | {
    "text_window": 20,
    "span_after": 12,
    "recent_ratio": 0.0,
    "sink_tokens": 2,
}
# vlcache_text_lean with the default's 24-row window: lean's 5% losses on training needle items keep every
# needle token but answer a garbled question (the question share picked from 20 rows; #38, needle5).
PRESETS["vlcache_text_lean_w24"] = PRESETS["vlcache_text_lean"] | {"text_window": 24}
# The prompt's first 32 positions (the chat template's system prompt and user-turn header, and the context's
# first words) draw sink-like attention whatever they say; spread a half-weight span (#38, textfix).
PRESETS["vlcache_text_lean_w24_skip32"] = PRESETS["vlcache_text_lean_w24"] | {
    "span_skip": 32,
    "span_skip_weight": 0.5,
}
PRESETS["vlcache_text_span_skip32"] = PRESETS["vlcache_text_span"] | {
    "span_skip": 32,
    "span_skip_weight": 0.5,
}
# The two by budget (#38): skip32 where the training split favours it (2%, 5%), the default at 10%.
PRESETS["vlcache_text_by_budget"] = PRESETS["vlcache_text_span"] | {
    "low_budget_preset": "vlcache_text_lean_w24_skip32",
    "low_budget_below": 0.075,
}
# The question window stops growing at its 5% size (12 slots at 1K): a larger budget adds scored tokens only
# (#38, needle10: the whole question kept outright at 10% is echoed and the token limit cuts the number).
PRESETS["vlcache_text_lean_w24_skip32_q12"] = PRESETS["vlcache_text_lean_w24_skip32"] | {
    "post_vision_max": 12
}
PRESETS["vlcache_text_question"] = PRESETS["vlcache_text_span"] | {"question_min": 8, "question_max": 48}
PRESETS["vlcache_text_span_lookahead"] = PRESETS["vlcache_text_span"] | {
    "lookahead": 16,
    "lookahead_weight": 0.5,
}
# Longer drafts for text-only prompts (a RULER answer repeats its ~25-token question before the value, so a
# 16-token draft ends before it): candidates for protocol v2.1's text dimension.
for _k in (32, 48):
    PRESETS[f"vlcache_text_span_lookahead{_k}"] = PRESETS["vlcache_text_span"] | {
        "lookahead": _k,
        "lookahead_weight": 0.5,
    }
    PRESETS[f"vlcache_text_span_lookahead{_k}_w1"] = PRESETS["vlcache_text_span"] | {
        "lookahead": _k,
        "lookahead_weight": 1.0,
    }
del _k


def preset(name: str) -> Policy:
    """The policy of preset ``name``; ValueError for an unknown one."""
    if name not in PRESETS:
        raise ValueError(f"unknown compression preset {name!r}; choose from {', '.join(PRESETS)}")
    return policy_from_dict(PRESETS[name])


def preset_params(name: str) -> dict[str, Any]:
    """``get_policy(policy, **params)`` keywords for preset ``name`` (every field, allocator as a dict)."""
    data = preset(name).to_dict()
    data.pop("policy")
    return data
