"""The in-process prefill that calibration measures and the lab evaluates: each example (a public-API request
or a task example) prefilled once by the prefill worker's forward (``PrefillEngine.forward``, whose observer
records every layer's post-RoPE Q and K on the way); each (policy, budget) then computes its own statistics
from those with the attention-statistics kernel and compresses the cache exactly as the prefill worker does.

``vlkv calibrate`` (``deploy/calibrate``) and the lab's evaluations (``vlkv_lab.eval``) share it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vlkv.common.compression.lookahead import with_draft
from vlkv.common.compression.registry import DEFAULT_POLICY, CompressionSettings, get_policy
from vlkv.common.compression.windows import binding_windows
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.inputs import prepare_inputs
from vlkv.common.model.prompt_cache import prompt_cache
from vlkv.common.model.question import prompt_question
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import PreparedRequest
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy import synthetic_task
from vlkv.deploy.progress import progress as track
from vlkv.deploy.synthetic_task import Example
from vlkv.kernels.attention_stats import attention_stats
from vlkv.prefill_worker.draft_queries import Draft, run_draft
from vlkv.prefill_worker.engine import PrefillEngine

BLOCK_SIZE = 16


class Recorder:
    """``vlkv_stats`` observer that keeps each layer's Q ``[H, q, D]`` and K ``[H_kv, n, D]``."""

    def __init__(self) -> None:
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.scale = 1.0

    def observe(self, layer_idx, query, key, scaling) -> None:
        self.q[layer_idx] = query[0].clone()
        self.k[layer_idx] = key[0].clone()
        self.scale = scaling


@dataclass
class Prepared:
    """One example after its prefill: what every policy needs to compress and score it.

    ``task``: the module that made the example (``is_correct``, ``prompt_text``): the default task
    (``deploy/synthetic_task.py``) or a zoo member (``lab/vlkv_lab/zoo``)."""

    example: Example
    m: int
    tau: int
    first_token: int
    q: list[torch.Tensor]  # per layer [H, m, D]
    keys: list[torch.Tensor]  # per layer [H_kv, m, D]
    values: list[torch.Tensor]
    next_attention: list[torch.Tensor]  # per layer [H, m]: the first decoding token's attention
    scale: float
    task: Any = field(default=synthetic_task, repr=False)
    model: Any = field(default=None, repr=False)  # for lookahead's draft (``draft``)
    eos: tuple[int, ...] = ()
    question: int = 0  # the prompt's final question in tokens (``common/model/question.py``; 0: none)
    windows: tuple[int, ...] = ()  # the model's sliding windows (``ModelSpec.windows``; (): none)
    _stats: dict = field(default_factory=dict, repr=False)
    _draft: Draft | None = field(default=None, repr=False)
    _draft_sums: dict = field(default_factory=dict, repr=False)
    _drafted: dict = field(default_factory=dict, repr=False)

    def stats(self, q0: int, threshold: float) -> list:
        key = (q0, threshold)
        if key not in self._stats:
            if not self.q:
                raise ValueError(f"statistics from row {q0} were not kept before the queries were freed")
            self._stats[key] = [
                attention_stats(q[:, q0:], k, q_start=q0, scale=self.scale, threshold=threshold)
                for q, k in zip(self.q, self.keys, strict=True)
            ]
        return self._stats[key]

    def keep_stats(self, configs, budgets, oracle: bool = True, threshold: float = 0.01) -> None:
        """Compute now the statistics every ``(label, policy, params)`` row reads at every budget (with
        ``oracle`` the default policy's too: the oracle's budgets), then free the queries (``[H, m, D]`` per
        layer, the largest part of a prefill); ``stats`` returns the kept ones, bit for bit the same."""
        rows = [(policy, params) for _, policy, params in configs] + (
            [(DEFAULT_POLICY, {})] if oracle else []
        )
        for policy_name, params in rows:
            policy = get_policy(policy_name, **params)
            for b in budgets:
                if policy.requires_stats and not policy.is_full(b):
                    self.stats(policy.query_start(self.m, self.tau, self.question), threshold)
        self.q = []

    def draft(self, steps: int) -> Draft:
        """The greedy draft lookahead scoring reads (``prefill_worker/draft_queries.run_draft``, as the prefill
        worker runs it), run again only when more steps are asked for than ran (a step does not depend on
        the ones after it: a K-step draft is the first K rows of a longer one) and the draft did not end."""
        d = self._draft
        ended = d is not None and (self.first_token in self.eos or d.tokens[-1:] and d.tokens[-1] in self.eos)
        if d is None or (d.rows < steps and not ended):
            if self.model is None:
                raise ValueError("lookahead needs the model: prepare() records it")
            self._draft = run_draft(self.model, self.keys, self.values, self.first_token, steps, self.eos)
        return self._draft

    def draft_col_sums(self, steps: int, threshold: float) -> tuple[list[torch.Tensor], int]:
        """``(Draft.col_sums, rows)`` of the first ``steps`` draft rows, computed once per row count and
        threshold: every row and budget with the same ``lookahead`` reads the same sums (the first K rows of a
        longer draft are a K-step draft's, so a draft run again longer leaves them valid)."""
        draft = self.draft(steps)
        rows = min(steps, draft.rows)
        key = (rows, threshold)
        if key not in self._draft_sums:
            self._draft_sums[key] = draft.col_sums(rows, threshold)
        return self._draft_sums[key], rows

    def drafted_stats(self, q0: int, steps: int, threshold: float) -> list:
        """``stats(q0, threshold)`` with the first ``steps`` draft rows beside them (``with_draft``), built once
        per (q0, draft rows, threshold): every candidate and budget reading them gets the same objects, so
        what they compute once per layer (``DraftStats.gain``, ``DraftMass``'s sorted draft attention) is
        computed once per prompt."""
        sums, rows = self.draft_col_sums(steps, threshold)
        key = (q0, rows, threshold)
        if key not in self._drafted:
            self._drafted[key] = with_draft(self.stats(q0, threshold), sums, rows)
        return self._drafted[key]


@torch.inference_mode()
def prepare(
    model,
    processor,
    examples: list[Example],
    progress: bool = True,
    task: Any = synthetic_task,
    next_attention: bool = True,
    counter: Any = None,
) -> list[Prepared]:
    """Prefill every example once with the prefill worker's forward, recording every layer's Q and K.

    task: the module whose ``prompt_text`` renders the prompt and whose ``is_correct`` scores the answers.
    next_attention: also the first decoding token's attention (``cache_hit_rate``'s truth; one more decode
    step per example, which ``vlkv eval zoo`` does not read). counter: a ``tools.progress.Progress`` told of
    each example as its prefill ends (``vlkv eval zoo``'s one bar over the whole run)."""
    spec = ModelSpec.from_model(model, processor.tokenizer)
    engine = PrefillEngine(model, spec)
    out = []
    for i, ex in enumerate(track(examples, desc="prefill", unit="example", disable=not progress)):
        inputs = prepare_inputs(processor, ex.images, task.prompt_text(processor, ex), spec.image_token_id)
        tensors = {k: v for k, v in inputs.model_kwargs.items() if torch.is_tensor(v)}
        req = PreparedRequest(
            f"eval-{i}",
            inputs.input_ids,
            tensors,
            inputs.modality,
            SamplingConfig(),
            CompressionSettings("full"),
        )
        rec = Recorder()
        logits, keys, values = engine.forward(req, observer=rec)
        first = int(logits.argmax())
        q = [rec.q[layer] for layer in range(spec.num_layers)]
        m = inputs.modality.m
        nxt = _next_attention(model, keys, values, first, m) if next_attention else []
        out.append(
            Prepared(
                ex,
                m,
                inputs.modality.tau,
                first,
                q,
                keys,
                values,
                nxt,
                rec.scale,
                task,
                model,
                spec.eos_token_ids,
                prompt_question(inputs.input_ids, inputs.modality.tau >= m, spec.turns),  # as the worker does
                spec.windows,
            )
        )
        if counter is not None:
            counter.update(1)
    return out


def _next_attention(model, keys: list, values: list, first: int, m: int) -> list[torch.Tensor]:
    """One dense decode step with the first token over the full cache: per layer its attention ``[H, m]``
    over the m prompt tokens (the truth CacheHitRate ranks against; a lab diagnostic, not served)."""
    cache = prompt_cache(model, keys, values)
    step = Recorder()
    model(
        input_ids=torch.tensor([[first]], device=keys[0].device),
        **cache_arg(model, cache),
        use_cache=True,
        position_ids=torch.tensor([[m]], device=keys[0].device),
        vlkv_stats=step,
    )
    nxt = []
    for layer in range(len(keys)):
        qn, kn = step.q[layer], step.k[layer]  # [H, 1, D], [H_kv, m + 1, D]
        group = qn.shape[0] // kn.shape[0]
        scores = torch.einsum("hd,hnd->hn", qn[:, 0].float(), kn.repeat_interleave(group, 0).float())
        nxt.append(torch.softmax(scores * step.scale, dim=-1)[:, :m])
    return nxt


def policy_stats(prep: Prepared, policy, budget: float, threshold: float = 0.01) -> list | None:
    """The statistics ``policy.compress`` reads for ``prep`` at ``budget``, as ``PrefillEngine.run`` hands
    them over: None when it reads none (a full cache comes back unchanged), with the draft rows' attention
    beside the question's when the prompt's policy has ``lookahead``."""
    if not policy.requires_stats or policy.is_full(budget):
        return None
    q0 = policy.query_start(prep.m, prep.tau, prep.question)
    steps = policy.lookahead_steps(budget, prep.m, prep.tau)
    return prep.drafted_stats(q0, steps, threshold) if steps else prep.stats(q0, threshold)


def compress(prep: Prepared, policy_name: str, budget: float, threshold: float = 0.01, **params) -> CompactKV:
    return compress_with(prep, get_policy(policy_name, **params), budget, threshold)


EVAL_NEW_TOKENS = 64
"""New tokens a request of the evaluation may decode, for which sliding windows bind (``binding_windows``): the
most any evaluation decodes (calibration's whole answer); a window that binds for more is cut at prefill."""


def compress_with(prep: Prepared, policy, budget: float, threshold: float = 0.01) -> CompactKV:
    """``prep`` compressed by a built ``policy`` as ``PrefillEngine.run`` compresses it: its statistics
    (``policy_stats``), the first token, the question count and the binding sliding windows handed over alike."""
    stats = policy_stats(prep, policy, budget, threshold)
    return policy.compress(
        stats,
        prep.keys,
        prep.values,
        alpha=budget,
        m=prep.m,
        tau=prep.tau,
        first_token=prep.first_token,
        question=prep.question,
        windows=binding_windows(prep.windows, prep.m, EVAL_NEW_TOKENS),
    )
