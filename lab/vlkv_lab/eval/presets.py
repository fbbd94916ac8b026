"""Compression presets that were tried and not adopted: the lab's ablation rows and tests name them. Importing
this module adds them to the product's presets (``vlkv.common.compression.registry.register_preset``), in this process.

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

from vlkv.common.compression.presets import PRESETS
from vlkv.common.compression.registry import register_preset

from vlkv_lab.eval.lab_policy import VLCacheLabPolicy

_SPAN = PRESETS["vlcache_text_span"]
LAB_PRESETS: dict[str, dict[str, Any]] = {}
# Fewer fixed slots for text-only prompts: no recent window, and the question's share shrinking with the
# budget (vlcache_text_lean) or two sinks instead of four (vlcache_text_lean_sinks2).
LAB_PRESETS["vlcache_text_lean"] = _SPAN | {
    "text_window": 20,
    "span_after": 12,
    "recent_ratio": 0.0,
    "post_vision_slope": 5.0,
}
LAB_PRESETS["vlcache_text_lean_sinks2"] = _SPAN | {
    "text_window": 20,
    "span_after": 12,
    "recent_ratio": 0.0,
    "sink_tokens": 2,
}
# vlcache_text_lean with the default's 24-row window: lean's 5% losses on training needle items keep every
# needle token but answer a garbled question (the question share picked from 20 rows; #38, needle5).
LAB_PRESETS["vlcache_text_lean_w24"] = LAB_PRESETS["vlcache_text_lean"] | {"text_window": 24}
LAB_PRESETS["vlcache_text_span_skip32"] = _SPAN | {"span_skip": 32, "span_skip_weight": 0.5}
# The question window stops growing at its 5% size (12 slots at 1K): a larger budget adds scored tokens only
# (#38, needle10: the whole question kept outright at 10% is echoed and the token limit cuts the number).
_LAB = {"policy": VLCacheLabPolicy.name}  # the options the product does not ship (``lab_policy.py``)
LAB_PRESETS["vlcache_text_lean_w24_skip32_q12"] = (
    PRESETS["vlcache_text_lean_w24_skip32"] | _LAB | {"post_vision_max": 12}
)
LAB_PRESETS["vlcache_text_question"] = _SPAN | _LAB | {"question_min": 8, "question_max": 48}
LAB_PRESETS["vlcache_text_span_lookahead"] = _SPAN | {"lookahead": 16, "lookahead_weight": 0.5}
# Longer drafts for text-only prompts (a RULER answer repeats its ~25-token question before the value, so a
# 16-token draft ends before it): candidates for protocol v2.1's text dimension.
for _k in (32, 48):
    LAB_PRESETS[f"vlcache_text_span_lookahead{_k}"] = _SPAN | {"lookahead": _k, "lookahead_weight": 0.5}
    LAB_PRESETS[f"vlcache_text_span_lookahead{_k}_w1"] = _SPAN | {"lookahead": _k, "lookahead_weight": 1.0}
del _k

for _name, _settings in LAB_PRESETS.items():
    register_preset(_name, _settings)
