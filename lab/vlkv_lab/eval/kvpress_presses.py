"""kvpress presses applied inside one shared prefill of a text decoder (lab only; kvpress never a dependency).

kvpress's own path, ``with press(model): model(context)``, runs one prefill per press and budget, and on
transformers >= 5.3 its hook fails (it reads ``cache_position``, which attention layers no longer receive).
:class:`PressHook` instead hangs one forward hook on every attention layer of a single eager prefill of the
whole prompt and calls each press's own ``compress(module, hidden_states, keys, values, attentions,
kwargs)`` there, on exactly what kvpress's hook receives, for every (press, budget, mode); it records which
positions each press kept (per KV head) and leaves the cache whole. kvpress's scoring and selection run
unmodified; the one prefill is shared by every press, budget and mode.

Two modes (``MODES``):
- ``context``: kvpress's pipeline (``KVPressTextGenerationPipeline``): the context (chat template up to
  the question) is compressed, the question is then run uncompressed over the compressed cache
  (question-agnostic compression, kvpress's intended protocol). The hook sees the context's inputs: the
  prefill is causal, so the first ``c`` rows of hidden states, keys, values, attention weights and
  position embeddings are exactly those of a prefill of the context alone.
- ``prompt``: the question inside the compressed prompt (what ``with press(model): model(prompt)`` does
  and what vlkv's policies do): the whole prompt is compressed.

AdaKV-style presses (``AdaKVPress``, ``CriticalAdaKVPress``) keep the cache and set
``module.masked_key_indices`` (a different number of positions per head); the hook turns those into the
kept mask. They assert a non-eager attention, which only matters to kvpress's decoding patch, so the hook
shows them ``sdpa`` while they compress (the prefill itself stays eager: ``ObservedAttentionPress`` needs
the weights).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MODES = ("context", "prompt")


def _snap(kp, r):
    return kp.SnapKVPress(compression_ratio=r)


# name -> factory(kvpress module, compression_ratio): kvpress's defaults throughout
PRESSES: dict[str, Callable] = {
    "SnapKV": _snap,
    "PyramidKV": lambda kp, r: kp.PyramidKVPress(compression_ratio=r),
    "StreamingLLM": lambda kp, r: kp.StreamingLLMPress(compression_ratio=r),
    "TOVA": lambda kp, r: kp.TOVAPress(compression_ratio=r),
    "ExpectedAttention": lambda kp, r: kp.ExpectedAttentionPress(compression_ratio=r),
    "Knorm": lambda kp, r: kp.KnormPress(compression_ratio=r),
    "ObservedAttention": lambda kp, r: kp.ObservedAttentionPress(compression_ratio=r),
    "AdaKV(SnapKV)": lambda kp, r: kp.AdaKVPress(_snap(kp, r)),
    "CriticalAdaKV(SnapKV)": lambda kp, r: kp.CriticalAdaKVPress(_snap(kp, r)),
    "CriticalKV(SnapKV)": lambda kp, r: kp.CriticalKVPress(_snap(kp, r)),
    "KeyDiff": lambda kp, r: kp.KeyDiffPress(compression_ratio=r),
    "LagKV": lambda kp, r: kp.LagKVPress(compression_ratio=r),
    "Random": lambda kp, r: kp.RandomPress(compression_ratio=r, seed=0),
}
DEFAULT_PRESSES = tuple(list(PRESSES)[:9])
"""The issue's nine; the rest run by name (``--presses``): CriticalKV costs as much as CriticalAdaKV, the
others add decode rows."""
# scorers whose ``score`` does not read ``compression_ratio`` (checked in kvpress 0.5.5's source): one
# (press, mode)'s scores are computed once per layer and shared by its budgets
RATIO_FREE_SCORES = {
    "SnapKVPress",
    "TOVAPress",
    "ExpectedAttentionPress",
    "KnormPress",
    "ObservedAttentionPress",
    "KeyDiffPress",
}


def compression_ratio(kept: float) -> float:
    """kvpress's ``compression_ratio`` (the fraction removed) for a kept fraction (vlkv's budget)."""
    if not 0.0 < kept <= 1.0:
        raise ValueError(f"kept fraction must be in (0, 1], got {kept}")
    return round(1.0 - kept, 12)


def kept_fraction(ratio: float) -> float:
    """The kept fraction for kvpress's ``compression_ratio``."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"compression_ratio must be in [0, 1), got {ratio}")
    return round(1.0 - ratio, 12)


def kept_mask(orig: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    """Which positions of ``orig`` ``[H_kv, n, D]`` the rows of ``comp`` ``[H_kv, k, D]`` were gathered
    from: bool ``[H_kv, n]``. Rows are matched on their first 8 bytes (distinct for distinct
    positions after RoPE) and then checked whole."""
    h, n, _ = orig.shape

    def code(x):  # the row's first 8 bytes as one integer
        return x.contiguous().view(torch.uint8)[..., :8].contiguous().view(torch.int64)[..., 0]

    oc, cc = code(orig), code(comp)
    order = oc.sort(-1)
    pos = torch.searchsorted(order.values, cc).clamp(max=n - 1)
    idx = order.indices.gather(-1, pos)  # [H, k]
    if not torch.equal(orig.gather(1, idx[..., None].expand(-1, -1, orig.shape[2])), comp):
        raise RuntimeError("a compressed row matches no row of the original keys")
    mask = torch.zeros(h, n, dtype=torch.bool)
    mask.scatter_(1, idx, True)
    return mask


@contextlib.contextmanager
def _shown_as_sdpa(config):
    saved = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = saved


@dataclass
class Job:
    """One (press, budget, mode): its press object and, after the prefill, per layer its kept mask
    ``[H_kv, n]`` (n = the context's length in ``context`` mode, the prompt's in ``prompt`` mode)."""

    name: str
    budget: float
    mode: str
    press: object
    kept: list[torch.Tensor] = field(default_factory=list)
    error: str = ""


class PressHook:
    """Forward hooks on every attention layer of ``model`` (a ``*ForCausalLM``): each job's press compresses
    the layer's prefill inputs. Set up as ``press(model)`` sets up: ``post_init_from_model`` and the
    rotary embedding on every attention layer (ExpectedAttention reads it there).

    ``context_len``: c, where the question starts (``context`` mode sees the first c positions)."""

    def __init__(self, model, jobs: list[Job], context_len: int) -> None:
        self.jobs = jobs
        self.c = context_len
        self.memo: dict = {}  # (press name, mode) -> this layer's scores
        self.seconds: dict[str, float] = {}  # press name -> time spent compressing
        for job in jobs:
            job.press.post_init_from_model(model)
            self._share_scores(job)
        for layer in model.model.layers:
            layer.self_attn.rotary_emb = model.model.rotary_emb
        self.handles = [
            layer.self_attn.register_forward_hook(self._hook, with_kwargs=True)
            for layer in model.model.layers
        ]

    def _share_scores(self, job: Job) -> None:
        scorer = job.press if hasattr(type(job.press), "score") else getattr(job.press, "press", None)
        score = getattr(type(scorer), "score", None)
        if score is None or score.__qualname__.split(".")[0] not in RATIO_FREE_SCORES:
            return
        key = (job.name, job.mode)

        def shared(*args, **kwargs):
            if key not in self.memo:
                self.memo[key] = score(scorer, *args, **kwargs)
            return self.memo[key].clone()  # AdaKV-style presses write into their scores

        scorer.score = shared

    def _hook(self, module, args, kwargs, output) -> None:
        self.memo.clear()
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layer = cache.layers[module.layer_idx]
        keys, values, hidden, attn = layer.keys, layer.values, kwargs["hidden_states"], output[1]
        cos, sin = kwargs["position_embeddings"]
        c = self.c
        ctx = (
            hidden[:, :c],
            keys[:, :, :c],
            values[:, :, :c],
            None if attn is None else attn[:, :, :c, :c],
            {"position_embeddings": (cos[:, :c], sin[:, :c])},
        )
        whole = (hidden, keys, values, attn, {"position_embeddings": (cos, sin)})
        for job in self.jobs:
            if job.error:
                continue
            h, k, v, a, kw = ctx if job.mode == "context" else whole
            t0 = time.perf_counter()
            try:
                with torch.inference_mode(), _shown_as_sdpa(module.config):
                    module.masked_key_indices = None
                    k2, _ = job.press.compress(module, h, k, v, a, kw)
                masked = getattr(module, "masked_key_indices", None)
                if masked is not None:  # AdaKV-style: the cache stays, these positions are masked
                    keep = torch.ones(k.shape[1], k.shape[2], dtype=torch.bool)
                    keep[masked[1], masked[2]] = False
                else:
                    keep = kept_mask(k[0], k2[0])
                job.kept.append(keep)
            except Exception as exc:  # a press that does not apply is reported with its error
                job.error = f"{exc.__class__.__name__}: {exc}"
            finally:
                module.masked_key_indices = None
                self.seconds[job.name] = self.seconds.get(job.name, 0.0) + time.perf_counter() - t0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
