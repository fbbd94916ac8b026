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
from transformers import DynamicCache
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


class _BatchRecorder:
    """``vlkv_stats`` observer of a batched draft step: each layer's query rows ``[B, H, 1, D]``."""

    def __init__(self) -> None:
        self.q: dict[int, list[torch.Tensor]] = {}
        self.scale = 1.0

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        self.q.setdefault(layer_idx, []).append(query.clone())
        self.scale = scaling


@torch.inference_mode()
def run_drafts(model, prompts: list[tuple[list, list, int, int]], eos: Iterable[int], logprobs: bool = False):
    """:func:`run_draft` for several prompts at once, one forward per step for all of them: ``prompts`` holds
    ``(keys, values, first, steps)`` per prompt. Each prompt's full cache is left-padded to the longest
    (masked), its new tokens take its own positions, and a prompt whose draft ended (its steps, or an end token)
    rides along masked out of nothing but is cut from its result. One prompt: :func:`run_draft` itself."""
    if len(prompts) == 1:
        keys, values, first, steps = prompts[0]
        return [run_draft(model, keys, values, first, steps, eos, logprobs)]
    stop = set(eos)
    lengths = [int(k[0].shape[1]) for k, _, _, _ in prompts]
    longest, b = max(lengths), len(prompts)
    num_layers = len(prompts[0][0])
    device = prompts[0][0][0].device
    cache = DynamicCache()  # as ``prompt_cache``, a batch of all the prompts, each left-padded to the longest
    for layer in range(num_layers):
        ref = prompts[0][0][layer]
        kk = ref.new_zeros((b, ref.shape[0], longest, ref.shape[2]))
        vv = torch.zeros_like(kk)
        for i, (keys, values, _, _) in enumerate(prompts):
            kk[i, :, longest - lengths[i] :] = keys[layer]
            vv[i, :, longest - lengths[i] :] = values[layer]
        cache.update(kk, vv, layer)
    mask = torch.zeros(b, longest, dtype=torch.long, device=device)
    for i, m in enumerate(lengths):
        mask[i, longest - m :] = 1
    rec = _BatchRecorder()
    tokens = torch.tensor([int(first) for _, _, first, _ in prompts], device=device)
    budget = [steps for _, _, _, steps in prompts]
    inputs: list[list[int]] = [[] for _ in prompts]
    drafted: list[list[int]] = [[] for _ in prompts]
    logp: list[list[torch.Tensor]] = [[] for _ in prompts]
    live = [int(first) not in stop and s > 0 for (_, _, first, s) in prompts]
    step = 0
    while any(live):
        mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=device)], dim=1)
        out = model(
            input_ids=tokens[:, None],
            **cache_arg(model, cache),
            use_cache=True,
            attention_mask=mask,
            position_ids=torch.tensor(lengths, device=device)[:, None] + step,
            logits_to_keep=1,
            vlkv_stats=rec,
        )
        logits = out.logits[:, -1].float()
        nxt = logits.argmax(-1)
        for i in range(b):
            if not live[i]:
                continue
            inputs[i].append(int(tokens[i]))
            drafted[i].append(int(nxt[i]))
            if logprobs:
                logp[i].append(torch.log_softmax(logits[i], -1))
            live[i] = len(inputs[i]) < budget[i] and int(nxt[i]) not in stop
        tokens = nxt
        step += 1
    results = []
    for i, m in enumerate(lengths):
        rows = len(inputs[i])
        if not rows:
            results.append(Draft(m, [], [], [], [], rec.scale))
            continue
        queries = [torch.cat([q[i] for q in rec.q[layer][:rows]], dim=1) for layer in range(num_layers)]
        keys = [cache.layers[layer].keys[i, :, longest - m : longest + rows] for layer in range(num_layers)]
        kept = torch.stack(logp[i]) if logprobs else None
        results.append(Draft(m, inputs[i], drafted[i], queries, keys, rec.scale, kept))
    return results
