"""Draft queries for lookahead scoring (``common/compression/lookahead.py``): a few greedy decode steps over the
full prompt cache, their post-RoPE queries recorded, then their attention over the prompt keys.

The prefill worker runs :func:`run_draft` after the prompt's forward when the prompt's policy has
``lookahead > 0`` (``PrefillEngine.run``); the in-process evaluation runs the same function once per example
and reads the first K rows for each K (a step does not depend on the ones after it, so the rows are the same
bits). The draft tokens are discarded: the decode worker generates the answer from the compressed cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.prompt_cache import prompt_cache
from vlkv.kernels.attention_stats import attention_stats


class _QueryRecorder:
    """``vlkv_stats`` observer: each layer's query rows ``[H, 1, D]``, one per decode step."""

    def __init__(self) -> None:
        self.q: dict[int, list[torch.Tensor]] = {}
        self.scale = 1.0

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        self.q.setdefault(layer_idx, []).append(query[0].clone())
        self.scale = scaling


@dataclass
class Draft:
    """``rows`` greedy decode steps after an ``m``-token prompt: the step inputs are ``inputs`` (the first
    token, then each drafted token but the last), ``tokens`` what the steps drafted; per layer the steps'
    queries ``[H, rows, D]`` and the keys ``[H_kv, m + rows, D]`` (the prompt's, then the inputs')."""

    m: int
    inputs: list[int]
    tokens: list[int]
    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    scale: float
    logprobs: torch.Tensor | None = (
        None  # [rows, vocab] fp32: each step's log-softmax (``run_draft(logprobs=)``)
    )

    @property
    def rows(self) -> int:
        return len(self.inputs)

    def col_sums(self, rows: int, threshold: float = 0.01) -> list[torch.Tensor]:
        """Per layer ``[H, m]`` fp32: the attention the first ``min(rows, self.rows)`` draft rows pay each
        prompt key, summed over the rows (the attention-statistics kernel, rows ``q_start = m`` on: each row
        sees the whole prompt and the draft's keys before it); [] when there are none."""
        n = min(rows, self.rows)
        if n <= 0:
            return []
        return [
            attention_stats(
                q[:, :n], k[:, : self.m + n], q_start=self.m, scale=self.scale, threshold=threshold
            )
            .col_sum[:, : self.m]
            .float()
            for q, k in zip(self.queries, self.keys, strict=True)
        ]


@torch.inference_mode()
def run_draft(
    model,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    first: int,
    steps: int,
    eos: Iterable[int],
    logprobs: bool = False,
) -> Draft:
    """Up to ``steps`` greedy decode steps over the full cache (per layer ``[H_kv, m, D]`` post-RoPE K and
    V), the first one's input ``first``; no step runs after an end-of-sequence token (none at all when
    ``first`` is one). ``logprobs``: also keep each step's next-token log-softmax (the verifier's reference,
    ``verifier.py``)."""
    m = int(keys[0].shape[1])
    stop = set(eos)
    cache = prompt_cache(model, keys, values)
    device = keys[0].device
    rec = _QueryRecorder()
    inputs: list[int] = []
    tokens: list[int] = []
    logp: list[torch.Tensor] = []
    token = int(first)
    for step in range(steps):
        if token in stop:
            break
        out = model(
            input_ids=torch.tensor([[token]], device=device),
            **cache_arg(model, cache),
            use_cache=True,
            position_ids=torch.tensor([[m + step]], device=device),
            logits_to_keep=1,
            vlkv_stats=rec,
        )
        inputs.append(token)
        logits = out.logits[0, -1].float()
        if logprobs:
            logp.append(torch.log_softmax(logits, -1))
        token = int(logits.argmax())
        tokens.append(token)
    num_layers = len(keys)
    if not inputs:
        return Draft(m, [], [], [], [], rec.scale)
    queries = [torch.cat(rec.q[layer], dim=1) for layer in range(num_layers)]
    draft_keys = [cache.layers[layer].keys[0] for layer in range(num_layers)]
    kept = torch.stack(logp) if logp else None
    return Draft(m, inputs, tokens, queries, draft_keys, rec.scale, kept)
