"""VL-Cache (paper 001, section 4): post-vision attention scores with sparsity-aware layer budgets.

Statistics: rows ``m - tau .. m-1`` (the language tokens after the last vision token); with tau = 0 the
last ``min(m, 8)`` rows (see ``selection.post_vision_start``). A text-only prompt (tau = m) has no
post-vision text to tell it apart from the rest: its last ``text_window`` (32) tokens take that role, as
SnapKV's observation window (they score the rest; kept outright, up to the window's cap, only with
``post_vision_window``). A request that names vlcache hands text-only prompts to the preset
``vlcache_text_by_budget`` (a ``routing.ByPromptKind`` built by ``registry.get_policy``) (protocol v2.2 and held-out seed 5, ``common/compression/README.md``): at 7.5% and
above ``vlcache_text_span`` (a 24-row observation window, 16-token spans after what it looks up), below it
``vlcache_text_lean_w24_skip32``.
The prompts vlcache scores itself (image prompts; text-only ones too with ``text_preset=""``) mix in the
attention of a 16-token greedy draft decoded over the full
cache at prefill (``lookahead``, ``lookahead.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .allocators import Allocator, DraftMass
from .base import Policy


@dataclass
class VLCachePolicy(Policy):
    """Score = column sums of the post-vision softmax, summed over the query heads of a KV group
    (the base ``score`` and ``query_start``).

    Defaults chosen on the model zoo by the tuning protocol (``common/compression/README.md``): scores are
    max-pooled over 3 positions, and image prompts mix the attention of a 16-token greedy draft into the
    scores (``lookahead=16``, ``lookahead_weight=0.5``: the draft is discarded; "Draft-query scoring
    (lookahead)"); ``lookahead=0`` turns it off. Layer budgets: ``DraftMass(weight=0.5, floor_layers=2)``, half
    of the total where the draft's attention is best covered, half as ``Pyramid(beta=4.0)``, the first two
    layers at least at the pyramid's budget; no question window kept outright (``post_vision_window=False``:
    the paper's recent 10% only, the question's tokens compete on their scores). Both chosen by protocol v2.1's
    image dimension on 2026-11-28 ("Draft-mass budgets with a floor"); before, ``Pyramid(beta=4.0)`` and the
    question's last tokens kept outright (up to half the budget), the ``ABLATION`` row "vlcache before
    draft-mass budgets". Algorithm 1 on the post-vision layer sparsity gamma_l = mean_h below_h / unmasked_h is
    ``allocator=Sparsity()``; the paper's policy as first shipped is the preset ``vlcache_paper``
    (``presets.py``). Text-only prompts (no image), as a request naming vlcache gets it: the preset
    ``vlcache_text_by_budget`` (``registry.DEFAULT_TEXT_PRESET``, chosen per prompt kind by protocol v2.2 on
    five text tasks, held-out seed 5), which pins its own allocator and window; this policy on its own
    (``text_preset=""``) scores them with a 32-token observation window (SnapKV's paper default), with its
    budgets and window settings.
    """

    name = "vlcache"
    allocator: Allocator = DraftMass(weight=0.5, beta=4.0, floor_layers=2)
    lookahead: int = 16
    pool_kernel: int = 3
    post_vision_window: bool = False
    text_window: int = 32
