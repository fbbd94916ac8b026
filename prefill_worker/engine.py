"""The prefill step: prepared request -> LLaVA forward with statistics -> first token -> compact cache.

``PrefillEngine.run`` is synchronous (the server runs it in a worker thread). It takes a
:class:`PreparedRequest` (the gateway already ran the processor and checked the limits), runs the real
forward once over the whole prompt (the vlkv attention function hands every layer's post-RoPE Q and K to a
:class:`StatsCollector`, which keeps only the statistics the chosen policy needs), samples the first token
from the last position's logits (with ``lookahead``, drafts a few greedy tokens over the full cache whose
attention joins the scores: ``draft_queries.py``), and lets the policy compress each layer's K and V into a
:class:`CompactKV` (a full cache comes back bitwise unchanged). A verified request (``VerifyConfig.plan``)
collects the statistics every candidate reads, drafts greedily over the full cache and keeps the candidate
whose cache reproduces the draft best, raising the budget to meet its floor (``verifier.py``; the outcome is
counted in ``ledger.Ledger``). A verified ``continue`` turn checks the previous turn's compact cache with the
new tokens appended against the draft first, and keeps it only when it meets the floor (``run_verified``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache
from vlkv.common.compression.lookahead import with_draft
from vlkv.common.compression.profile import CompressionProfile
from vlkv.common.compression.registry import policy_from_dict
from vlkv.common.compression.verify import VerifyConfig, VerifyPlan
from vlkv.common.compression.windows import binding_windows, window_cut_tokens
from vlkv.common.errors import InvalidInput
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.attention import use_vlkv_attention
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.forced import append_tokens
from vlkv.common.model.inputs import ModalityMap
from vlkv.common.model.question import prompt_question
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import PreparedRequest
from vlkv.common.sampling import NonFiniteLogits, make_generator, sample_token
from vlkv.kernels.attention_stats import attention_stats
from vlkv.prefill_worker.continuation import Retained, RetainedCache
from vlkv.prefill_worker.draft_batch import DraftBatcher
from vlkv.prefill_worker.draft_queries import run_draft
from vlkv.prefill_worker.image_cache import ImageCache
from vlkv.prefill_worker.image_reuse import ImageReuser, ReuseReport
from vlkv.prefill_worker.ledger import LEARNED_KIND, Ledger
from vlkv.prefill_worker.prefix_cache import PrefixCache
from vlkv.prefill_worker.prefix_reuse import PrefixReport, PrefixReuser
from vlkv.prefill_worker.verifier import Candidate, Verdict, check_continued, verify

log = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    cache: CompactKV
    modality: ModalityMap
    policy: str
    prefill_ms: float
    reuse: ReuseReport | None = None  # what the image cache did (None: no cache on this worker)
    profile: str = ""  # the compression profile that chose the policy ("": none did)
    verdict: Verdict | None = None  # what verification did (None: not verified)
    draft_ms: float = 0.0  # of prefill_ms: the greedy draft over the full cache (lookahead or verification)
    verify_ms: float = 0.0  # of prefill_ms: the candidates' compression and teacher forcing (verification)
    window_saved_bytes: int = 0  # full-cache bytes the binding sliding windows never keep
    prefix: PrefixReport | None = None  # what the prefix cache did (None: no prefix cache on this worker)
    continued_tokens: int = 0  # conversation "continue": tokens appended to the previous turn's compact cache
    continue_refused: bool = False  # a verified "continue" turn's continued cache fell short: re-compressed


def _window_saved(windows, m: int, ckv: CompactKV) -> int:
    """Bytes (K and V, the model's dtype) of the token-layers the binding windows cut from the full cache."""
    per_token = ckv.num_kv_heads * ckv.head_dim * ckv.dtype.itemsize * 2
    return window_cut_tokens(windows, m) * per_token


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


class StatsByRows:
    """``vlkv_stats`` observer of a verified request: one :class:`StatsCollector` per distinct first row the
    candidates read (``Policy.query_start``)."""

    def __init__(self, q_starts, threshold: float) -> None:
        self.by_row = {q: StatsCollector(q, threshold) for q in sorted(set(q_starts))}

    @property
    def q_start(self) -> int:
        return min(self.by_row)

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        for collector in self.by_row.values():
            collector.observe(layer_idx, query, key, scaling)

    def stats(self, q_start: int, num_layers: int) -> list:
        return self.by_row[q_start].stats(num_layers)


class PrefillEngine:
    def __init__(
        self,
        model,
        spec: ModelSpec,
        image_cache: ImageCache | None = None,
        profile: CompressionProfile | None = None,
        verify_config: VerifyConfig | None = None,
        learned_profile: str = "",
        learned: CompressionProfile | None = None,
        draft_batch: int = 1,
        prefix_cache: PrefixCache | None = None,
        share_prefixes: bool = False,
    ) -> None:
        """``profile``: a compression profile checked against this model (``vlkv calibrate``, or one this
        server learned); it chooses the policy of every unverified request that names none
        (``CompressionSettings.explicit`` False), and a verified one tries its entry first. ``verify_config``:
        the server's verification defaults (None: nothing is verified). ``learned_profile``: where to write the
        verifier's outcomes as a profile (every ``learn_after`` verified requests; "": not written);
        ``learned``: a profile it wrote before (the counts start from it). ``draft_batch`` > 1: the drafts of
        requests run at once (from several threads) step as one batch of up to that many
        (``draft_batch.DraftBatcher``). ``prefix_cache``: the prompts' full K/V by block, so a follow-up turn
        prefills only its new tokens (``prefix_reuse.py``); ``share_prefixes``: one tenant's blocks serve
        another's prompts (off: never)."""
        use_vlkv_attention(model)
        self.model = model
        self.spec = spec
        self.profile = profile
        self.device = next(model.parameters()).device
        self.image_cache = image_cache
        self.reuser = ImageReuser(model, spec, image_cache) if image_cache is not None else None
        self.prefixes = (
            PrefixReuser(model, spec, prefix_cache, share_prefixes) if prefix_cache is not None else None
        )
        # conversation "continue" turns' compact caches: a quarter of the prefix cache's bound, beside it
        self.retained = Retained(prefix_cache.capacity // 4) if prefix_cache is not None else None
        self.verify_config = verify_config
        self.drafts = DraftBatcher(model, spec.eos_token_ids, draft_batch) if draft_batch > 1 else None
        self.learned_profile = learned_profile
        labels = verify_config.candidates if verify_config is not None else ()
        self.candidates = [Candidate(label, policy_from_dict(d)) for label, d in labels]
        self.ledger = Ledger(
            self.candidates,
            verify_config.learn_after if verify_config is not None else 0,
            spec.fingerprint,
            {"dtype": str(spec.dtype).removeprefix("torch.")},
        )
        for seen in (profile, learned):
            if seen is not None and seen.measure.get("kind") == LEARNED_KIND:
                self.ledger.seed(seen)
                self.ledger.learned_profile = seen.label

    @property
    def hint_mismatches(self) -> int:
        """Requests whose ``image_hashes`` were not the digests of their pixel values (``ImageReuser``)."""
        return self.reuser.hint_mismatches if self.reuser is not None else 0

    @torch.inference_mode()
    def forward(self, req: PreparedRequest, observer=None) -> tuple[torch.Tensor, list, list]:
        """The whole prompt through the model: last-position logits ``[vocab]`` (fp32) and every layer's
        post-RoPE keys and values ``[H_kv, m, D]``. ``observer.observe(layer, q, k, scaling)`` sees each
        layer's Q and K on the way (statistics, or a recorder in the evaluation). Every layer's whole prompt,
        sliding-window layers' too (the model's own cache would keep only their window: ``Policy.compress``
        cuts them, with the request's budget, by ``spec.windows``)."""
        cache = DynamicCache()  # no config: no sliding layers; the model's masks still apply its windows
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

    def forward_prompt(self, req: PreparedRequest, observer=None, q_start: int = 0):
        """The prompt's forward through the prefix cache, then the image cache: ``(logits, keys, values,
        ReuseReport | None, PrefixReport | None)``. A prefix hit prefills only the tokens after it (its
        images are inside it: the image cache is not consulted); every full block of the prompt is stored
        after. ``reuse: off`` reads and fills neither cache."""
        prefixes = self.prefixes
        if prefixes is None or not prefixes.active or not req.reuse.enabled:
            return (*self.forward_cached(req, observer, q_start), None)
        keyed = prefixes.keys_of(req)
        try:
            hit = prefixes.forward(req, observer, q_start, keyed)
        except (ValueError, IndexError) as exc:  # inputs that do not fit this model
            raise InvalidInput(f"the model rejected the prepared inputs: {exc}") from None
        if hit is not None:
            logits, keys, values, report = hit
            reuse = None
        else:
            logits, keys, values, reuse = self.forward_cached(req, observer, q_start)
            report = PrefixReport()
        report.stored_blocks = prefixes.store(req, keys, values, keyed[0])
        return logits, keys, values, reuse, report

    def run(self, req: PreparedRequest) -> PrefillResult:
        keep = req.reuse.enabled and req.reuse.conversation == "continue"
        keep = keep and self.retained is not None and self.retained.enabled
        keyed = self.prefixes.keys_of(req)[0] if keep else []
        ids = req.input_ids.reshape(-1).tolist() if keep else []
        layout = (self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim)
        entry = self.retained.find(keyed, ids, layout, self.spec.dtype) if keep else None
        plan = self.verify_config.plan(req.compression) if self.verify_config is not None else None
        if entry is not None and plan is None:
            result = self.run_continued(req, entry)
        elif plan is not None:
            result = self.run_verified(req, plan, entry)
        else:
            result = self.run_fixed(req)
        if keep:
            self.retained.put(keyed, RetainedCache(tuple(ids), result.cache, result.policy))
        return result

    def run_continued(self, req: PreparedRequest, entry: RetainedCache) -> PrefillResult:
        """Conversation "continue", unverified: the prompt's new tokens appended to the compact cache kept for
        the longest earlier prompt it extends (``continuation.py``)."""
        start = time.perf_counter()
        ckv, logits, cut = self._append(req, entry)
        ckv.first_token = self._first_token(logits, req.sampling)
        ms = (time.perf_counter() - start) * 1000
        saved = _window_saved(cut, req.m, ckv)
        new = req.m - len(entry.ids)
        return PrefillResult(
            ckv, req.modality, entry.policy, ms, window_saved_bytes=saved, continued_tokens=new
        )

    def _append(self, req: PreparedRequest, entry: RetainedCache):
        """``entry``'s compact cache with the prompt's tokens after it appended, the next-token logits, and
        the binding windows that cut it."""
        new = req.input_ids.reshape(-1)[len(entry.ids) :].tolist()
        cut = binding_windows(self.spec.windows, req.m, req.sampling.max_new_tokens)
        ckv, logits = append_tokens(self.model, entry.cache, new, cut)
        return ckv, logits, cut

    def _draft(self, keys, values, first: int, steps: int):
        """The greedy draft over the full cache, with each step's log-probabilities (batched with the other
        requests' drafts when this engine batches them)."""
        if self.drafts is not None:
            return self.drafts.draft(keys, values, first, steps)
        return run_draft(self.model, keys, values, first, steps, self.spec.eos_token_ids, logprobs=True)

    def close(self) -> None:
        if self.drafts is not None:
            self.drafts.close()

    def _first_token(self, logits: torch.Tensor, sampling) -> int:
        generator = None if sampling.greedy else make_generator(sampling.seed)
        try:
            return sample_token(logits, sampling, generator)
        except NonFiniteLogits as exc:  # from this request's own inputs (its image, its ids)
            raise InvalidInput(f"the first token cannot be sampled: {exc.message}") from None

    def _verify_candidates(self, budget: float, explicit: bool) -> tuple[list[Candidate], bool, str]:
        """The candidates in the order verified, whether that order is learned, and the profile label when a
        calibrated profile put its entry first."""
        ordered, learned = self.ledger.order(budget)
        profile = self.profile
        if profile is None or explicit or profile.measure.get("kind") == LEARNED_KIND:
            return ordered, learned, ""
        entry = profile.entry_for(budget)
        same = [c for c in ordered if c.policy.to_dict() == entry.policy.to_dict()]
        first = same[0] if same else Candidate(f"profile: {entry.candidate}", entry.policy)
        return [first, *[c for c in ordered if c is not first]], learned, profile.label

    def run_verified(
        self, req: PreparedRequest, plan: VerifyPlan, previous: RetainedCache | None = None
    ) -> PrefillResult:
        """One prefill, every candidate's statistics, a greedy draft over the full cache, then the verifier
        (``verifier.verify``) keeps the cache that reproduces the draft best. ``previous``: a ``continue`` turn's
        previous compact cache; with the new tokens appended it is checked first and handed off when its
        agreement meets the floor (the prefix cache makes the full forward cost only the new tokens)."""
        start = time.perf_counter()
        m, tau = req.modality.m, req.modality.tau
        question = prompt_question(req.input_ids, tau >= m, self.spec.turns)
        compression = req.compression
        windows = binding_windows(self.spec.windows, m, req.sampling.max_new_tokens)
        candidates, learned, label = self._verify_candidates(compression.budget, compression.explicit)
        reads = [c.policy.query_start(m, tau, question) for c in candidates if c.policy.requires_stats]
        collector = StatsByRows(reads, compression.threshold) if reads else None
        q0 = collector.q_start if reads else m
        logits, keys, values, reuse, prefix = self.forward_prompt(req, collector, q0)
        first = self._first_token(logits, req.sampling)
        steps = max(
            [plan.draft_tokens] + [c.policy.lookahead_steps(compression.budget, m, tau) for c in candidates]
        )
        t_draft = time.perf_counter()
        draft = self._draft(keys, values, first, steps)
        t_verify = time.perf_counter()
        drafted: dict[tuple[int, int], list] = {}
        num_layers = self.spec.num_layers

        def compress(policy, budget: float) -> CompactKV:
            stats = None
            if policy.requires_stats and not policy.is_full(budget):
                q0 = policy.query_start(m, tau, question)
                rows = min(policy.lookahead_steps(budget, m, tau), draft.rows)
                if (q0, rows) not in drafted:
                    base = collector.stats(q0, num_layers)
                    extra = draft.col_sums(rows, compression.threshold) if rows else []
                    drafted[(q0, rows)] = with_draft(base, extra, rows) if rows else base
                stats = drafted[(q0, rows)]
            return policy.compress(
                stats,
                keys,
                values,
                alpha=budget,
                m=m,
                tau=tau,
                first_token=first,
                question=question,
                windows=windows,
            )

        refused = False
        if previous is not None:
            appended, _, _ = self._append(req, previous)
            appended.first_token = first  # the full cache's own first token
            held, verdict = check_continued(self.model, appended, plan, compression.budget, draft)
            if held:
                t_end = time.perf_counter()
                ms = (t_end - start) * 1000
                return PrefillResult(
                    appended,
                    req.modality,
                    previous.policy,
                    ms,
                    reuse,
                    verdict=verdict,
                    draft_ms=(t_verify - t_draft) * 1000,
                    verify_ms=(t_end - t_verify) * 1000,
                    window_saved_bytes=_window_saved(windows, m, appended),
                    prefix=prefix,
                    continued_tokens=m - len(previous.ids),
                )
            refused = True
            log.info(
                "continued cache short of the floor (%.3f < %.3f): re-compressed",
                verdict.agreement,
                plan.floor,
            )
        ckv, verdict = verify(self.model, candidates, plan, compression.budget, compress, draft, learned)
        verdict.verified += int(refused)
        t_end = time.perf_counter()
        kept = next(c for c in candidates if c.label == verdict.candidate)
        self._count(compression.budget, verdict, kept.policy)
        name = "full" if kept.policy.is_full(verdict.budget) else kept.policy.name
        ms = (time.perf_counter() - start) * 1000
        draft_ms, verify_ms = (t_verify - t_draft) * 1000, (t_end - t_verify) * 1000
        saved = _window_saved(windows, m, ckv)
        return PrefillResult(
            ckv,
            req.modality,
            name,
            ms,
            reuse,
            label,
            verdict,
            draft_ms,
            verify_ms,
            saved,
            prefix,
            continue_refused=refused,
        )

    def _count(self, budget: float, verdict: Verdict, policy) -> None:
        """Count the outcome; every ``learn_after`` verified requests, write the learned profile."""
        self.ledger.record(budget, verdict, policy)
        every = self.verify_config.learn_after if self.verify_config is not None else 0
        if self.learned_profile and every and self.ledger.verified % every == 0:
            try:
                label = self.ledger.write(self.learned_profile)
                log.info("wrote the learned compression profile %s", label)
            except OSError as exc:  # the request is served; the file waits for the next chance
                log.warning("cannot write the learned profile %s: %s", Path(self.learned_profile), exc)

    def run_fixed(self, req: PreparedRequest) -> PrefillResult:
        """The request's (or the profile's) one policy at its budget, unverified."""
        start = time.perf_counter()
        m, tau = req.modality.m, req.modality.tau
        question = prompt_question(req.input_ids, tau >= m, self.spec.turns)
        compression, sampling = req.compression, req.sampling
        windows = binding_windows(self.spec.windows, m, sampling.max_new_tokens)
        profiled = self.profile is not None and not compression.explicit and compression.budget < 1.0
        policy = self.profile.policy_for(compression.budget) if profiled else compression.build_policy()
        full = policy.is_full(compression.budget)  # the one definition (Policy.is_full), on the built policy
        collector = None
        if policy.requires_stats and not full:
            collector = StatsCollector(policy.query_start(m, tau, question), compression.threshold)
        logits, keys, values, reuse, prefix = self.forward_prompt(
            req, collector, policy.query_start(m, tau, question)
        )
        first = self._first_token(logits, sampling)
        stats = collector.stats(self.spec.num_layers) if collector is not None else None
        steps = policy.lookahead_steps(compression.budget, m, tau)
        draft_ms = 0.0
        if steps and stats is not None:  # lookahead: a greedy draft over the full cache, then discarded
            t_draft = time.perf_counter()
            draft = self._draft(keys, values, first, steps)
            stats = with_draft(stats, draft.col_sums(steps, compression.threshold), draft.rows)
            draft_ms = (time.perf_counter() - t_draft) * 1000
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
                windows=windows,
            )
        name = "full" if full else policy.name
        label = self.profile.label if profiled else ""
        ms = (time.perf_counter() - start) * 1000
        saved = _window_saved(windows, m, ckv)
        return PrefillResult(
            ckv,
            req.modality,
            name,
            ms,
            reuse,
            label,
            draft_ms=draft_ms,
            window_saved_bytes=saved,
            prefix=prefix,
        )
