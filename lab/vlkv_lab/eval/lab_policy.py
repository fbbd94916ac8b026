"""``vlcache_lab``: vlcache with the options the lab's experiments tried and the product does not ship.

Importing this module registers the policy (``registry.register_policy``) in this process, with vlcache's
default text route, so a zoo row or a lab preset that names it differs from vlcache by its own options only.
None of them is used by a default, a calibrate or verifier candidate, or a baseline (issue #63); the write-ups
of each are in ``lab/results/`` and the compression README's history.

post_vision_max: > 0 caps the post-vision window's share at this many slots whatever the budget (0: no cap),
so a larger budget adds scored tokens only (preset ``vlcache_text_lean_w24_skip32_q12``).
post_vision_layers: with ``post_vision_window``, the window is kept in the first ``post_vision_layers``
layers only (0: every layer); the other layers keep the recent window alone and score the question's tokens
like any other (the zoo's "window: first layer only" rows).
question_min, question_max: with ``question_max > 0`` a text-only prompt's observation window is its own
final question (``question``: the tokens after the last line break of the last user turn through the prompt's
end, ``common/model/question.py``), clipped to ``[question_min, question_max]`` rows; a prompt with no line
break there (``question = 0``) keeps ``text_window``. 0: off (preset ``vlcache_text_question``).
chunk_size: the scored tokens are kept in whole chunks of this many consecutive positions, the chunks ranked
by their summed score (ChunkKV; 1: token by token; the zoo's "chunks of 10 tokens" row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vlkv.common.compression.registry import DEFAULT_TEXT_PRESET, register_policy
from vlkv.common.compression.selection import keep
from vlkv.common.compression.vlcache import VLCachePolicy


@dataclass
class VLCacheLabPolicy(VLCachePolicy):
    """vlcache plus ``post_vision_max``, ``post_vision_layers``, ``question_min``/``question_max`` and
    ``chunk_size`` (the module's docstring); every one off by default, so it equals vlcache until set."""

    name = "vlcache_lab"
    post_vision_max: int = 0
    post_vision_layers: int = 0
    question_min: int = 0
    question_max: int = 0
    chunk_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("post_vision_max", "post_vision_layers", "question_min", "question_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.question_max and self.question_min > self.question_max:
            raise ValueError(f"question_min {self.question_min} is above question_max {self.question_max}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")

    def observed_tau(self, m: int, tau: int, question: int = 0) -> int:
        """vlcache's, but a text-only prompt with a final question (``question > 0``) and ``question_max`` set
        takes that question, clipped to ``[question_min, question_max]``, as its window."""
        if tau >= m and self.question_max and question > 0:
            return min(m, max(self.question_min, min(self.question_max, question)))
        return super().observed_tau(m, tau, question)

    def rows_options(self) -> tuple[Any, ...]:
        extra = (self.question_min, self.question_max) if self.question_max else ()
        return (*super().rows_options(), *extra)

    def post_vision_share(self, k: int, m: int) -> int:
        share = super().post_vision_share(k, m)
        return min(share, self.post_vision_max) if self.post_vision_max > 0 else share

    def select(self, scores: torch.Tensor, k: int, tau: int = 0, layer: int = 0) -> torch.Tensor:
        """vlcache's selection with the window kept only below layer ``post_vision_layers`` (when set) and
        the scored tokens taken in chunks of ``chunk_size``."""
        windowed = self.post_vision_window and (
            not self.post_vision_layers or layer < self.post_vision_layers
        )
        return keep(
            scores,
            k,
            tau,
            recent_ratio=self.recent_ratio,
            window=self.post_vision_share(k, scores.shape[-1]) if windowed else 0,
            by_score=self.post_vision_by_score,
            sinks=self.sink_tokens,
            chunk=self.chunk_size,
        )


VLCACHE_FAMILY = (VLCachePolicy.name, VLCacheLabPolicy.name)
"""The policy names whose rows are vlcache's options (the protocol's candidates, the zoo's option rows)."""

register_policy(VLCacheLabPolicy, text_preset=DEFAULT_TEXT_PRESET[VLCachePolicy.name])
