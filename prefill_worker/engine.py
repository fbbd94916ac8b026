"""The prefill step: prepared request -> LLaVA forward with statistics -> first token -> compact cache.

``PrefillEngine.run`` is synchronous (the server runs it in a worker thread). It takes a
:class:`PreparedRequest` (the gateway already ran the processor and checked the limits), runs the real
forward once over the whole prompt (the vlkv attention function hands every layer's post-RoPE Q and K to a
:class:`StatsCollector`, which keeps only the statistics the chosen policy needs), samples the first token
from the last position's logits (with ``lookahead``, drafts a few greedy tokens over the full cache whose
attention joins the scores: ``draft_queries.py``), and lets the policy compress each layer's K and V into a
:class:`CompactKV` (a full cache comes back bitwise unchanged).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from vlkv.common.compression.lookahead import with_draft
from vlkv.common.compression.profile import CompressionProfile
from vlkv.common.errors import InvalidInput
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.attention import use_vlkv_attention
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.inputs import ModalityMap
from vlkv.common.model.question import prompt_question
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import PreparedRequest
from vlkv.common.sampling import NonFiniteLogits, make_generator, sample_token
from vlkv.kernels.attention_stats import attention_stats
from vlkv.prefill_worker.draft_queries import run_draft
from vlkv.prefill_worker.image_cache import ImageCache
from vlkv.prefill_worker.image_reuse import ImageReuser, ReuseReport


@dataclass
class PrefillResult:
    cache: CompactKV
    modality: ModalityMap
    policy: str
    prefill_ms: float
    reuse: ReuseReport | None = None  # what the image cache did (None: no cache on this worker)
    profile: str = ""  # the compression profile that chose the policy ("": none did)


class StatsCollector:
    """``vlkv_stats`` observer: runs the attention-statistics kernel over query rows ``q_start .. m-1`` of
    every layer (Q ``[1, H, m, D]``, K ``[1, H_kv, m, D]``) and keeps its O(rows + m) per-head results."""

    def __init__(self, q_start: int, threshold: float) -> None:
        self.q_start = q_start
        self.threshold = threshold
        self.per_layer: dict[int, object] = {}

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        if query.shape[0] != 1:
            raise ValueError("statistics are collected for one sequence at a time")
        # Rows q_start .. m-1 are the query's last rows (a reuse forward passes only its recomputed rows).
        rows = query.shape[2] - (key.shape[2] - self.q_start)
        self.per_layer[layer_idx] = attention_stats(
            query[0, :, rows:], key[0], q_start=self.q_start, scale=scaling, threshold=self.threshold
        )

    def stats(self, num_layers: int) -> list:
        missing = [i for i in range(num_layers) if i not in self.per_layer]
        if missing:
            raise RuntimeError(f"no attention statistics for layers {missing}")
        return [self.per_layer[i] for i in range(num_layers)]


class PrefillEngine:
    def __init__(
        self,
        model,
        spec: ModelSpec,
        image_cache: ImageCache | None = None,
        profile: CompressionProfile | None = None,
    ) -> None:
        """``profile``: a compression profile checked against this model (``vlkv calibrate``); it chooses the
        policy of every request that names none (``CompressionSettings.explicit`` False)."""
        use_vlkv_attention(model)
        self.model = model
        self.spec = spec
        self.profile = profile
        self.device = next(model.parameters()).device
        self.image_cache = image_cache
        self.reuser = ImageReuser(model, spec, image_cache) if image_cache is not None else None

    @property
    def hint_mismatches(self) -> int:
        """Requests whose ``image_hashes`` were not the digests of their pixel values (``ImageReuser``)."""
        return self.reuser.hint_mismatches if self.reuser is not None else 0

    @torch.inference_mode()
    def forward(self, req: PreparedRequest, observer=None) -> tuple[torch.Tensor, list, list]:
        """The whole prompt through the model: last-position logits ``[vocab]`` (fp32) and every layer's
        post-RoPE keys and values ``[H_kv, m, D]``. ``observer.observe(layer, q, k, scaling)`` sees each
        layer's Q and K on the way (statistics, or a recorder in the evaluation)."""
        cache = DynamicCache(config=self.model.config.text_config)
        kwargs = {k: v.to(self.device) for k, v in req.model_inputs.items()}
        if "pixel_values" in kwargs:
            kwargs["pixel_values"] = kwargs["pixel_values"].to(self.model.dtype)
        try:
            out = self.model(
                input_ids=req.input_ids.to(self.device),
                **cache_arg(self.model, cache),
                use_cache=True,
                logits_to_keep=1,
                vlkv_stats=observer,
                **kwargs,
            )
        except (ValueError, IndexError) as exc:  # model inputs that do not fit this model (shapes, ids)
            raise InvalidInput(f"the model rejected the prepared inputs: {exc}") from None
        layers = cache.layers[: self.spec.num_layers]
        return out.logits[0, -1].float(), [x.keys[0] for x in layers], [x.values[0] for x in layers]

    def forward_cached(self, req: PreparedRequest, observer=None, q_start: int = 0):
        """``forward`` through the image cache when this worker has one (``image_reuse.ImageReuser``: reuse
        the images' K/V on a hit, store them on a miss): ``(logits, keys, values, ReuseReport | None)``."""
        if self.reuser is None or not self.reuser.active:
            return (*self.forward(req, observer), None)
        try:
            return self.reuser.forward(req, observer, q_start)
        except (ValueError, IndexError) as exc:  # inputs that do not fit this model
            raise InvalidInput(f"the model rejected the prepared inputs: {exc}") from None

    def run(self, req: PreparedRequest) -> PrefillResult:
        start = time.perf_counter()
        m, tau = req.modality.m, req.modality.tau
        question = prompt_question(req.input_ids, tau >= m, self.spec.turns)
        compression, sampling = req.compression, req.sampling
        profiled = self.profile is not None and not compression.explicit and compression.budget < 1.0
        policy = self.profile.policy_for(compression.budget) if profiled else compression.build_policy()
        full = policy.is_full(compression.budget)  # the one definition (Policy.is_full), on the built policy
        collector = None
        if policy.requires_stats and not full:
            collector = StatsCollector(policy.query_start(m, tau, question), compression.threshold)
        logits, keys, values, reuse = self.forward_cached(
            req, collector, policy.query_start(m, tau, question)
        )
        generator = None if sampling.greedy else make_generator(sampling.seed)
        try:
            first = sample_token(logits, sampling, generator)
        except NonFiniteLogits as exc:  # from this request's own inputs (its image, its ids)
            raise InvalidInput(f"the first token cannot be sampled: {exc.message}") from None
        stats = collector.stats(self.spec.num_layers) if collector is not None else None
        steps = policy.lookahead_steps(compression.budget, m, tau)
        if steps and stats is not None:  # lookahead: a greedy draft over the full cache, then discarded
            draft = run_draft(self.model, keys, values, first, steps, self.spec.eos_token_ids)
            stats = with_draft(stats, draft.col_sums(steps, compression.threshold), draft.rows)
        # A full cache (full policy or budget >= 1) comes back from compress bitwise unchanged.
        with torch.inference_mode():
            ckv = policy.compress(
                stats,
                keys,
                values,
                alpha=compression.budget,
                m=m,
                tau=tau,
                first_token=first,
                question=question,
            )
        name = "full" if full else policy.name
        label = self.profile.label if profiled else ""
        return PrefillResult(ckv, req.modality, name, (time.perf_counter() - start) * 1000, reuse, label)
