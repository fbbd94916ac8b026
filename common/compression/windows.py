"""Sliding-window layers in a compression plan: each keeps at most its window, its share spills to the others.

A layer with sliding window ``W`` (``common/model/families.py``; 0: none) can read only its last ``W - 1``
prompt positions at the first decode step (and, in decode, the last ``W`` entries of its cache). At prefill it
keeps a contiguous tail of its prompt: its last ``min(k_l, W - 1)`` positions, chosen without scores, so its
cache stays a run of consecutive positions ending at the newest token and the decode attention masks it to its
window by counting entries (``kernels/paged_decode_reference.py``, ``window``). What the allocator gave it
beyond that spills to the layers that read the whole prompt, in proportion to their own budgets and at most
``m`` each; with the full cache a sliding layer keeps exactly what the model's own cache keeps.

A window binds only when the request can outgrow it (``binding_windows``): Mistral's 4K window over a 2K prompt
and 64 new tokens is a full-attention layer for that request, compressed by score like any other.

Tradeoff: below its window a sliding layer keeps its most recent tokens, not its best-scoring ones (a scored
subset would need each entry's position in the decode pool to mask the window exactly).
"""

from __future__ import annotations

from collections.abc import Sequence


def binding_windows(windows: Sequence[int], m: int, new_tokens: int) -> tuple[int, ...]:
    """The windows that cut anything for a request of ``m`` prompt tokens and up to ``new_tokens`` new ones: a
    layer whose window ``W >= m + new_tokens`` reads every token until the request ends, so it is compressed as
    a full-attention layer (its cache, at most ``W`` entries, is never cut by the decode attention's window).
    () when none binds."""
    out = tuple(w if 0 < w < m + new_tokens else 0 for w in windows)
    return out if any(out) else ()


def window_cut_tokens(windows: Sequence[int], m: int) -> int:
    """Token-layers of an ``m``-token prompt the binding ``windows`` never keep (each sliding layer's positions
    before its reach): what the windows save against every layer's whole prompt."""
    return sum(m - prompt_reach(w, m) for w in windows if w > 0)


def prompt_reach(window: int, m: int) -> int:
    """Prompt positions a layer with ``window`` (0: none) reads at the first decode step (the token at position
    ``m``): all ``m``, or its last ``W - 1``."""
    return m if window <= 0 else max(1, min(m, window - 1))


def fit_windows(budgets: Sequence[int], windows: Sequence[int], m: int) -> tuple[list[int], list[bool]]:
    """``(budgets, tails)``: each sliding layer's budget cut to its reach (``tails[l]`` True: it keeps its last
    ``budgets[l]`` positions), the cut spilled to the other layers (each at most ``m``). The total is kept
    unless every layer is full."""
    if not windows or not any(windows):
        return list(budgets), [False] * len(budgets)
    if len(windows) != len(budgets):
        raise ValueError(f"{len(windows)} sliding windows for {len(budgets)} layers")
    tails = [w > 0 for w in windows]
    out = [
        min(k, prompt_reach(w, m)) if tail else k for k, w, tail in zip(budgets, windows, tails, strict=True)
    ]
    extra = sum(budgets) - sum(out)
    caps = [m] * len(out)
    while extra > 0:
        room = [i for i, (k, tail) in enumerate(zip(out, tails, strict=True)) if not tail and k < caps[i]]
        if not room:
            break
        weight = sum(out[i] for i in room)
        given = 0
        for i in room:
            give = min(caps[i] - out[i], extra * out[i] // weight)
            out[i] += give
            given += give
        extra -= given
        if not given:  # less than one token per layer left: one each, largest budgets first
            for i in sorted(room, key=lambda i: -out[i])[:extra]:
                out[i] += 1
                extra -= 1
    return out, tails
