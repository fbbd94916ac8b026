"""``vlkv calibrate``: per budget, the compression settings that agree best with the full cache on a
checkpoint's own prompts, label-free; writes ``compression_profile.json`` (``common/compression/profile.py``).

For every prompt (``deploy/calibrate/prompts.py``: public-API requests, no answers), one prefill through the
prefill worker's forward records every layer's Q and K (``evaluation.prepare``). The full cache is decoded
greedily through the decode core (``InProcessEngine.teacher_force``) to its end token, at most ``tokens``
tokens (64: the whole answer): the reference tokens and next-token distributions. Then every candidate (``CANDIDATES``: registered options, the paper's
preset, the current default) at every budget compresses that same prefill (its own statistics rows from
the recorded Q and K, as the prefill worker computes them) and the reference tokens are teacher-forced
through its compressed cache, all of a prompt's distinct caches and forced tokens in one forward
(``prefill_worker/teacher_force.py``, as the prefill worker's verifier runs it: the decode step's layers and fp32 attention, not N decode steps): **agreement** is the share of positions whose greedy token under the
compressed cache is the full cache's, **KL** the mean ``KL(p_full || p_compressed)`` over those positions
(the prefill's own token is the same for every cache and is not counted). Per budget the candidate with the
highest mean agreement wins, ties to the lower KL. The table also reports **exact**, the share of prompts whose
whole answer was reproduced (agreement 1.0); ranking by it first chose the same entries on smol_codes,
smol_objects and needle (``common/compression/README.md``, "Whole-answer agreement"), so it is not ranked on.
``--rerank K`` (default 4: ``DEFAULT_RERANK``; 0: off) then decodes the K best distinct candidates per budget (``rerank_set``:
a row ``same_as`` an earlier one is that one) and the default free-running on the first
``--rerank-prompts`` prompts (40) and ranks them by **answer recall** first (``calibrate_answers.py``,
rarity-weighted; ``rerank_chunk``, on the same ``--jobs`` workers as the measure): on ``needle`` it fixes 2%, on
``smol_codes`` it keeps 2%'s gain and is one item of 50 below the old entry at 5%.
Prompts are prefilled in chunks, each chunk's full caches decoded as one batch; the chunks run on the tools' worker
pool or in this process (``calibrate_jobs.py``).

Cost per prompt on ``smol_codes`` (SmolLM2-135M with an image, ~760 tokens, fp32, one CPU thread, 29
candidates x 4 budgets, ~10-token answers): ~10 s CPU (100 prompts: 998 s CPU), about a third the prefill with
Q and K recorded, a third the ~90 distinct caches teacher-forced, the rest the statistics (the draft's column
sums, computed once per row count), compression and the reference decode. ``screen`` (successive halving,
on by default: ``DEFAULT_SCREEN``, ``DEFAULT_KEEP``) measures fewer candidates after the first prompts; the
prefill is paid for every prompt.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from vlkv.common.compression.presets import PRESETS
from vlkv.common.compression.profile import PROFILE_FILENAME, CompressionProfile, ProfileEntry
from vlkv.common.compression.registry import policy_from_dict
from vlkv.common.config import Limits
from vlkv.common.model.inputs import decode_images, input_side
from vlkv.common.request import render_prompt
from vlkv.decode_worker.block_manager import blocks_needed
from vlkv.decode_worker.kv_cache import block_bytes_of
from vlkv.deploy.calibrate.answers import ANSWER_MARGIN, answer_recall, free_run, question_of
from vlkv.deploy.calibrate.prepared import BLOCK_SIZE, compress, compress_with, prepare
from vlkv.deploy.calibrate.prompts import read_prompts
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.prefill_worker.teacher_force import agreement
from vlkv.prefill_worker.verifier import distinct_caches

DEFAULT_BUDGETS = (0.02, 0.05, 0.1)
DEFAULT_TOKENS = 64
"""The most tokens of the full cache's answer compared per prompt (the answer ends sooner at its end token).
The whole answer: a RULER answer repeats the question before its value ("The special magic number for X
mentioned in the provided text is 1234567", ~25 tokens); 16 tokens saw only the repeated words, and on
niah_single_1 chose a preset that keeps none of the values (``common/compression/README.md``)."""
DEFAULT_RERANK = 4
"""``--rerank``'s default: the 4 best by agreement per budget and the default re-ranked by answer recall (0: off,
the agreement ranking alone). With it ``needle``'s 2% entry holds the bar the agreement ranking misses by 12
points (``common/compression/README.md``, "Answer recall on free-running answers"); the pass reuses the
measure's prefills, so a 100-prompt run on a real-decoder member fits the 10-minute bar."""
DEFAULT_RERANK_PROMPTS = 40
"""``--rerank``'s prompts: the first 40 (the re-ranking that fixed ``needle`` at 2% and kept ``smol_codes``' 2%
gain was measured on 40 of 100, ``common/compression/README.md``). The rerank set is still chosen on every
prompt's agreement; the pass's cost is the decode of ~20 caches per re-ranked prompt (its prefill is the
measure pass's, kept by the worker that measured it: ``keep_for_rerank``)."""
DEFAULT_SCREEN = 12
"""``--screen``'s default: every candidate on the first 12 prompts, then per budget the ``DEFAULT_KEEP`` best
distinct ones and the default on the rest (0: every candidate on every prompt). Replayed on full-grid traces of
the five image members' 100 training prompts (every candidate's answer recall measured), the cheapest setting
that chose the full grid's entry at every budget (1, 2, 5, 10%) on all five (``common/compression/README.md``,
"Screening by default"); it measures about a third of the candidate evaluations."""
DEFAULT_KEEP = 6
"""``--keep``'s default: the distinct candidates per budget measured past the screening (the default besides)."""
THRESHOLD = 0.01
_VL = {"policy": "vlcache"}
# (label, policy dict): the declared grid, one change at a time from the default (at most two: the question's
# window back with one of its options or the draft's weight, the previous default), plus the baselines. Each
# vlcache row keeps the default's options but the ones it names, the 16-token draft (lookahead 16, weight
# 0.5) included.
_WINDOW = {**_VL, "post_vision_window": True}
CANDIDATES: tuple[tuple[str, dict], ...] = (
    ("default", PRESETS["vlcache_default"]),
    ("lookahead: off", {**_VL, "lookahead": 0}),
    ("lookahead: 8", {**_VL, "lookahead": 8}),
    ("lookahead: weight 1.0", {**_VL, "lookahead_weight": 1.0}),
    ("lookahead: 8, weight 1.0", {**_VL, "lookahead": 8, "lookahead_weight": 1.0}),
    ("window: on, lookahead weight 1.0", {**_WINDOW, "lookahead_weight": 1.0}),
    ("window: on, slope 5", {**_WINDOW, "post_vision_slope": 5.0}),
    ("paper (vlcache_paper)", PRESETS["vlcache_paper"]),
    ("allocator: Algorithm 1", {**_VL, "allocator": {"name": "sparsity"}}),
    ("allocator: uniform", {**_VL, "allocator": {"name": "uniform"}}),
    ("allocator: mixed 0.2", {**_VL, "allocator": {"name": "mixed", "weight": 0.2}}),
    ("allocator: coverage", {**_VL, "allocator": {"name": "coverage"}}),
    ("allocator: cake", {**_VL, "allocator": {"name": "cake"}}),
    ("allocator: pyramid", {**_VL, "allocator": {"name": "pyramid", "beta": 4.0}}),
    ("allocator: pyramid beta 2", {**_VL, "allocator": {"name": "pyramid", "beta": 2.0}}),
    ("allocator: pyramid beta 20", {**_VL, "allocator": {"name": "pyramid", "beta": 20.0}}),
    ("window: on", _WINDOW),
    ("window: on, cap 1/4", {**_WINDOW, "post_vision_cap": 0.25}),
    ("window: on, by score", {**_WINDOW, "post_vision_by_score": True}),
    ("previous default (pyramid, window on)", PRESETS["vlcache_pyramid_window"]),
    ("pooling: off", {**_VL, "pool_kernel": 1}),
    ("pooling: 7", {**_VL, "pool_kernel": 7}),
    ("sinks: 4", {**_VL, "sink_tokens": 4}),
    ("text-only: no preset (32-row text window)", {**_VL, "text_preset": ""}),
    ("text window: off", {**_VL, "text_preset": "", "text_window": 0}),
    ("text window: 8", {**_VL, "text_preset": "", "text_window": 8}),
    ("text-only: preset vlcache_text", {**_VL, "text_preset": "vlcache_text"}),
    ("text-only: preset vlcache_lookup", {**_VL, "text_preset": "vlcache_lookup"}),
    ("text-only: preset vlcache_text_lowbudget", {**_VL, "text_preset": "vlcache_text_lowbudget"}),
    # the text default before protocol v2.2 adopted vlcache_text_by_budget (2026-11-28; now the default's)
    ("text-only: preset vlcache_text_span", {**_VL, "text_preset": "vlcache_text_span"}),
    ("snapkv", {"policy": "snapkv"}),
    ("pyramidkv", {"policy": "pyramidkv"}),
)


@dataclass
class _Score:
    """Running sums over prompts for one (candidate, budget)."""

    agreement: float = 0.0
    kl: float = 0.0
    exact: int = 0  # prompts whose every counted position agrees: the whole answer reproduced
    prompts: int = 0


@dataclass
class Calibration:
    """The running table; ``trace``, when kept, one ``{"candidate|budget": [agreement, kl]}`` per prompt.

    A prompt counts as **exact** for a (candidate, budget) when its agreement is 1.0: every counted position's
    greedy token is the full cache's, so the compressed cache's own greedy decode gives the full cache's
    answer token for token. ``caches``: per (candidate, budget) the prompt's cache number
    (``_candidate_caches``' slot: two candidates with the same number kept the same positions), one per prompt
    in order; a row whose numbers are an earlier candidate's on every prompt gets that one's label as
    ``same_as`` (the function ``same_as``)."""

    table: dict[tuple[str, float], _Score] = field(default_factory=dict)
    trace: list[dict[str, list[float]]] | None = None
    caches: dict[tuple[str, float], list[int]] = field(default_factory=dict)

    def add(self, key: tuple[str, float], agreement: float, kl: float, cache: int | None = None) -> None:
        s = self.table.setdefault(key, _Score())
        s.agreement, s.kl, s.prompts = s.agreement + agreement, s.kl + kl, s.prompts + 1
        s.exact += agreement >= 1.0
        if cache is not None:
            self.caches.setdefault(key, []).append(cache)
        if self.trace is not None:
            self.trace[-1][f"{key[0]}|{key[1]:g}"] = [agreement, kl]

    def rows(self) -> list[dict]:
        policies = dict(CANDIDATES)
        same = same_as(self.caches)
        rows = []
        for (label, budget), s in self.table.items():
            row = {
                "candidate": label,
                "budget": budget,
                "agreement": round(s.agreement / s.prompts, 6),
                "kl": round(s.kl / s.prompts, 6),
                "exact": round(s.exact / s.prompts, 6),
                "prompts": s.prompts,
                "policy": policy_from_dict(policies[label]).to_dict(),
            }
            if (label, budget) in same:
                row["same_as"] = same[label, budget]
            rows.append(row)
        return rows


def same_as(caches: dict[tuple[str, float], list[int]]) -> dict[tuple[str, float], str]:
    """Per (candidate, budget) that kept the same positions as an earlier candidate of the grid at that budget
    on every prompt (``Calibration.caches``: the same cache number on each), that candidate's label (the
    first such in ``CANDIDATES``' order). Those two are one candidate on these prompts: on a text-only prompt
    every option that acts on images alone leaves the default's cache as it is."""
    order = {label: i for i, (label, _) in enumerate(CANDIDATES)}
    out, first = {}, {}
    for (label, budget), numbers in sorted(caches.items(), key=lambda item: order[item[0][0]]):
        earlier = first.setdefault((budget, tuple(numbers)), label)
        if earlier != label:
            out[label, budget] = earlier
    return out


def _ranked(rows: list[dict], budget: float, by_recall: bool = False) -> list[dict]:
    """The rows at ``budget`` best first: the highest agreement, ties to the lower KL, then the grid's order.
    ``by_recall``: the rows with an answer recall (``--rerank``'s set) first, by the highest recall, then as
    before; the others after them."""
    order = {label: i for i, (label, _) in enumerate(CANDIDATES)}
    mine = [r for r in rows if r["budget"] == budget]

    def key(r):
        first = (0, -r["recall"]) if by_recall and "recall" in r else (1, 0.0)
        return (*first, -r["agreement"], r["kl"], order[r["candidate"]])

    return sorted(mine, key=key)


def survivors(rows: list[dict], budgets, keep: int) -> dict[float, set[str]]:
    """Successive halving's cut: per budget the ``keep`` best distinct rows (``_ranked``; a row ``same_as``
    an earlier one kept the same positions on every screening prompt and is that one, not counted again)
    and the default, the candidates measured on the prompts after the screening ones. Counted row by row,
    the options that act on text-only prompts alone took most of the places on image prompts: the
    default's cache kept four times."""
    out = {}
    for b in budgets:
        distinct = [r["candidate"] for r in _ranked(rows, b) if "same_as" not in r]
        out[b] = set(distinct[:keep]) | {CANDIDATES[0][0]}
    return out


def _measured_on_all(ranked: list[dict]) -> list[dict]:
    """``ranked``'s rows measured on every prompt, in order (after a screening the others saw fewer)."""
    most = max(r.get("prompts", 0) for r in ranked)
    return [r for r in ranked if r.get("prompts", 0) == most]


def rerank_set(rows: list[dict], budgets, k: int) -> dict[float, set[str]]:
    """Per budget the candidates whose free-running answers ``--rerank k`` decodes: the ``k`` best distinct ones
    by agreement (``_ranked``, among the rows measured on every prompt; a row ``same_as`` another is that one,
    not counted again) and the default. Counted row by row, the 4 best on a text-only prompt file were the
    default and three options that act on images alone: the same cache decoded four times, nothing re-ranked."""
    out = {}
    for b in budgets:
        distinct: list[str] = []
        for r in _measured_on_all(_ranked(rows, b)):
            one = r.get("same_as", r["candidate"])
            if one not in distinct:
                distinct.append(one)
        out[b] = set(distinct[:k]) | {CANDIDATES[0][0]}
    return out


def best_per_budget(rows: list[dict], budgets, by_recall: bool = False) -> list[ProfileEntry]:
    """Per budget the best row (``_ranked``, by answer recall first with ``by_recall``) among the rows
    measured on every prompt."""
    entries = []
    for b in budgets:
        best = _measured_on_all(_ranked(rows, b, by_recall))[0]
        entries.append(ProfileEntry(b, best["candidate"], policy_from_dict(best["policy"])))
    return entries


def _examples(requests, processor, limits: Limits):
    """Each request as ``evaluation.prepare`` takes it: the rendered prompt and the decoded images."""
    side = input_side(processor)
    for req in requests:
        images = decode_images(list(req.images), limits, side)
        yield SimpleNamespace(images=images, prompt=render_prompt(req, processor), name=req.request_id)


class _RenderedTask:
    """``evaluation.prepare``'s task interface for prompts that are already rendered."""

    @staticmethod
    def prompt_text(processor, example) -> str:
        return example.prompt


def _engine(model, caches, steps: int) -> InProcessEngine:
    c0 = caches[0]
    need = sum(blocks_needed(c.layer_lengths, steps, BLOCK_SIZE) for c in caches)
    pool = need * block_bytes_of(BLOCK_SIZE, c0.num_kv_heads, c0.head_dim, c0.dtype, "fp16")
    return InProcessEngine(
        model, pool_bytes=pool, block_size=BLOCK_SIZE, max_batch=len(caches), admission="reserve"
    )


def _share_draft(p, policies, budgets) -> None:
    """Run ``p``'s draft once with the most steps any candidate asks for (a shorter one first would be run
    again longer); ``Prepared.draft_col_sums`` then shares its column sums among the candidates."""
    steps = max(policy.lookahead_steps(b, p.m, p.tau) for policy in policies for b in budgets)
    if steps:
        p.draft(steps)


def measure_chunk(
    model, prepared, budgets, tokens: int, out: Calibration, active: dict[float, set[str]] | None = None
) -> None:
    """Reference decode of the chunk's full caches, then every candidate x budget teacher-forced (``active``:
    only those candidates per budget)."""
    full = [compress(p, "full", 1.0) for p in prepared]
    ref_logp: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prepared))}

    def keep_ref(rows, logits):
        for r, i in enumerate(rows):
            ref_logp[i].append(torch.log_softmax(logits[r].float(), -1).cpu())

    ref = _engine(model, full, tokens).teacher_force(full, tokens, observe=keep_ref)
    del full
    keys = [
        (label, policy_from_dict(d), b)
        for label, d in CANDIDATES
        for b in budgets
        if active is None or label in active[b]
    ]
    for i, p in enumerate(prepared):
        caches, slot = _candidate_caches(p, keys, budgets)
        scores = _agreement(model, caches, ref[i], ref_logp[i])
        if out.trace is not None:
            out.trace.append({})
        for (label, _, b), c in zip(keys, slot, strict=True):
            out.add((label, b), *scores[c], c)


def _acting(p, policy, budget: float) -> tuple:
    """What compresses ``p`` under ``policy`` at ``budget``: the policy that acts on this prompt
    (``for_prompt``: for a wrapper, the policy it hands ``p`` to at that budget), every option of it,
    and the statistics rows and draft steps ``policy_stats`` reads. Two candidates with the same key compress
    ``p`` to the same cache."""
    acting = policy.for_prompt(p.m, p.tau, budget)
    reads = policy.requires_stats and not policy.is_full(budget)
    rows = policy.query_start(p.m, p.tau, p.question) if reads else -1
    steps = policy.lookahead_steps(budget, p.m, p.tau) if reads else 0
    return json.dumps(acting.to_dict(), sort_keys=True), budget, reads, rows, steps


def _candidate_caches(p, keys, budgets) -> tuple[list, list[int]]:
    """``p`` compressed by every (label, policy, budget) of ``keys``: the distinct caches and, per key, the
    index of its cache (two candidates that keep the same positions hold the same cache: decoded once). A
    candidate that acts on ``p`` as an earlier one does (``_acting``) is not compressed again."""
    _share_draft(p, [policy for _, policy, _ in keys], budgets)
    made, per_key = {}, []
    for _, policy, b in keys:
        acting = _acting(p, policy, b)
        if acting not in made:  # with lookahead's draft rows, as served
            made[acting] = compress_with(p, policy, b, THRESHOLD)
        per_key.append(made[acting])
    return distinct_caches(per_key)  # the verifier's: caches keeping the same positions decoded once


def _agreement(model, caches, ref: list[int], ref_logp: list[torch.Tensor]) -> list[tuple[float, float]]:
    """Per cache (agreement, mean KL) against the full cache's tokens ``ref`` and log-probabilities
    ``ref_logp`` (``ref_logp[g]`` predicts ``ref[g + 1]``), the prefill's token ``ref[0]`` not counted: the
    verifier's score (``teacher_force.agreement``)."""
    if len(ref) < 2:  # the prefill's token ended the answer: nothing to compare
        return [(1.0, 0.0)] * len(caches)
    return agreement(model, caches, ref[:-1], ref[1:], torch.stack(ref_logp[: len(ref) - 1]))


def recall_chunk(model, tokenizer, suffix: str, prepared, prompts, budgets, tokens: int, chosen):
    """Per prompt of the chunk, ``{(candidate, budget): answer recall}`` for the candidates ``chosen[budget]``:
    the full caches decoded free-running (at most ``tokens``), then every chosen candidate's (distinct) caches
    together, each at most ``ANSWER_MARGIN`` tokens past its prompt's full answer, each answer compared with
    that full-cache answer (``calibrate_answers.py``)."""
    keys = [(label, policy_from_dict(d), b) for label, d in CANDIDATES for b in budgets if label in chosen[b]]
    full = [compress(p, "full", 1.0) for p in prepared]
    engine = _engine(model, full, tokens)
    eos = engine.spec.eos_token_ids
    full_answers = free_run(engine, full, tokens, eos)
    del full, engine
    caches, spans, limits = [], [], []
    for i, p in enumerate(prepared):
        mine, slot = _candidate_caches(p, keys, budgets)
        spans.append((len(caches), len(mine), slot))
        caches += mine
        limits += [min(tokens, len(full_answers[i]) + ANSWER_MARGIN)] * len(mine)
    answers = free_run(_engine(model, caches, max(limits)), caches, limits, eos)
    out = []
    for i, (at, count, slot) in enumerate(spans):
        question = question_of(prompts[i], suffix)
        full_text = tokenizer.decode(full_answers[i], skip_special_tokens=True)
        texts = [tokenizer.decode(a, skip_special_tokens=True) for a in answers[at : at + count]]
        out.append(
            {
                (label, b): answer_recall(full_text, texts[c], question, prompts[i])
                for (label, _, b), c in zip(keys, slot, strict=True)
            }
        )
    return out


def rerank_chunk(
    model, processor, suffix: str, requests, budgets, tokens: int, chosen, kept: list | None = None
) -> list[dict]:
    """``--rerank``'s work on a chunk of prompts (a worker's, or the calling process's with ``--jobs 1``):
    ``recall_chunk`` on their prefills. ``kept``: per request its ``Prepared`` from the measure pass
    (``keep_for_rerank``), None where it was not kept; those are prefilled here (each prompt's prefill is its
    own, so a kept one and a new one are the same numbers)."""
    kept = list(kept) if kept is not None else [None] * len(requests)
    missing = [req for req, p in zip(requests, kept, strict=True) if p is None]
    fresh = iter(
        prepare(
            model,
            processor,
            list(_examples(missing, processor, Limits())),
            progress=False,
            task=_RenderedTask,
            next_attention=False,
        )
        if missing
        else ()
    )
    prepared = [p if p is not None else next(fresh) for p in kept]
    prompts = [p.example.prompt for p in prepared]
    return recall_chunk(model, processor.tokenizer, suffix, prepared, prompts, budgets, tokens, chosen)


def keep_for_rerank(p) -> None:
    """After ``measure_chunk``, what ``recall_chunk`` needs of prefill ``p`` kept and the rest freed: its
    queries (the largest part of a prefill) go; the statistics and the draft every measured candidate read
    stay cached in ``p``, and the re-ranked candidates are among the measured ones (``rerank_set``), so
    their caches are the same bits. A statistic not computed raises rather than being read wrong."""
    p.q = []


def chunk_phases(n: int, cut: int, chunk: int, parts: int = 1) -> list[list[tuple[int, int]]]:
    """The prompts' chunks as (start, end): those of the first ``cut`` (the screening), then the rest's (one
    phase when ``cut`` is ``n``). A screening's chunks are of about equal size (at most ``chunk``) and as many
    as a multiple of ``parts`` (the workers), so that no worker waits at the end of the phase for another
    (every worker waits for the survivors): 10 prompts on 2 workers were a chunk of 8 and one of 2."""
    if cut >= n:
        return [[(a, min(a + chunk, n)) for a in range(0, n, chunk)]]
    count = -(-cut // chunk)
    count = min(cut, -(-count // parts) * parts)
    bounds = [round(i * cut / count) for i in range(count + 1)]
    first = list(zip(bounds, bounds[1:], strict=False))
    rest = [(a, min(a + chunk, n)) for a in range(cut, n, chunk)]
    return [first, rest]


def calibrate(
    model_dir: str,
    prompts: str,
    budgets=DEFAULT_BUDGETS,
    tokens: int = DEFAULT_TOKENS,
    out: str = "",
    dtype: str = "float32",
    max_prompts: int = 0,
    chunk: int = 8,
    screen: int = DEFAULT_SCREEN,
    keep: int = DEFAULT_KEEP,
    trace: str = "",
    jobs: int = 1,
    rerank: int = DEFAULT_RERANK,
    rerank_prompts: int = DEFAULT_RERANK_PROMPTS,
) -> tuple[Path, CompressionProfile, float]:
    """Run the calibration; returns the profile's path, the profile and the seconds it took.

    screen: successive halving: every candidate on the first ``screen`` prompts, then per budget only the
    ``keep`` best distinct ones so far (``survivors``) and the default on the rest (0, or at least as many
    prompts as there are: every candidate on every prompt). trace: write every
    prompt's agreement and KL per (candidate, budget) there as JSON lines. jobs: worker processes sharing the
    chunks (``calibrate_jobs.py``; the same table as one process). rerank: per budget the ``rerank`` best by
    agreement and the default decoded free-running afterwards on the first ``rerank_prompts`` prompts (0: all),
    on the same workers, ranked by their answer recall first (``calibrate_answers.py``; default
    ``DEFAULT_RERANK``, 0: off); the trace's rows
    for them get the recall as a third number."""
    from vlkv.deploy.calibrate.jobs import run_chunks

    start = time.perf_counter()
    budgets = tuple(sorted(float(b) for b in budgets))
    if not budgets or any(not 0.0 < b < 1.0 for b in budgets):
        raise ValueError(f"budgets must lie in (0, 1), got {budgets}")
    if tokens < 2:
        raise ValueError("tokens must be >= 2 (the first is the prefill's, the same for every cache)")
    if screen < 0 or keep < 1:
        raise ValueError(f"screen must be >= 0 and keep >= 1, got {screen} and {keep}")
    if jobs < 1 or chunk < 1 or rerank < 0 or rerank_prompts < 0:
        raise ValueError(
            f"jobs and chunk must be >= 1, rerank and rerank_prompts >= 0, got {jobs}, {chunk}, {rerank} "
            f"and {rerank_prompts}"
        )
    requests, digest = read_prompts(prompts)
    requests = requests[:max_prompts] if max_prompts else requests
    result = Calibration(trace=[] if trace else None)
    cut = screen if 0 < screen < len(requests) else len(requests)
    phases = chunk_phases(len(requests), cut, chunk, jobs)
    reranked = min(rerank_prompts or len(requests), len(requests)) if rerank else 0
    # the measured chunks (their first ``reranked`` prompts): each re-ranked by the worker that kept its prefills
    rerank_chunks = [(a, min(b, reranked)) for phase in phases for a, b in phase if a < reranked]
    spec = (model_dir, prompts, dtype, budgets, tokens, max_prompts)
    active, fingerprint, answers = run_chunks(spec, phases, result, keep, jobs, rerank, rerank_chunks)
    rows = result.rows()
    measure = {"tokens": tokens, "threshold": THRESHOLD, "candidates": len(CANDIDATES)}
    if active is not None:
        measure.update(screen=cut, keep=keep)
    if rerank:
        sums: dict[str, float] = {}
        for one in answers:  # prompt order: the same sums in the same order with any --jobs
            for key, value in one.items():
                sums[key] = sums.get(key, 0.0) + value
        for r in rows:
            if (key := f"{r['candidate']}|{r['budget']:g}") in sums:
                r["recall"] = round(sums[key] / len(answers), 6)
        for per_prompt, one in zip(result.trace or [], answers, strict=False):
            for key, value in one.items():
                per_prompt[key].append(value)
        measure.update(rerank=rerank, rerank_prompts=reranked)
    profile = CompressionProfile(
        model={"fingerprint": fingerprint, "path": str(Path(model_dir).resolve()), "dtype": dtype},
        prompts={"digest": digest, "count": len(requests), "file": Path(prompts).name},
        measure=measure,
        entries=best_per_budget(rows, budgets, by_recall=bool(rerank)),
        table=rows,
    )
    path = Path(out) if out else Path(model_dir) / PROFILE_FILENAME
    profile.write(path)
    if trace:
        Path(trace).write_text("".join(json.dumps(t) + "\n" for t in result.trace or []))
    return path, profile, time.perf_counter() - start


def format_table(profile: CompressionProfile) -> str:
    """The agreement table as markdown: a row per candidate, per budget the share of prompts whose whole answer
    was reproduced (``exact``; left out for a profile written before it was measured) / agreement / KL, the
    choice starred, the prompts a row was measured on when a screening cut it (``--screen``); with ``--rerank``,
    first the answer recall of the rows decoded free-running (``-`` for the others)."""
    budgets = profile.budgets
    count = profile.prompts.get("count", 0)
    chosen = {(e.candidate, e.budget) for e in profile.entries}
    exact = all("exact" in r for r in profile.table)
    recall = any("recall" in r for r in profile.table)
    cells: dict[str, dict[float, str]] = {}
    for r in profile.table:
        mark = " *" if (r["candidate"], r["budget"]) in chosen else ""
        mark += f" (= {r['same_as']})" if "same_as" in r else ""
        screened = f" ({r['prompts']} prompts)" if r.get("prompts", count) < count else ""
        whole = f"{r['exact']:.2f} / " if exact else ""
        if recall:
            whole = (f"{r['recall']:.2f} / " if "recall" in r else "- / ") + whole
        cells.setdefault(r["candidate"], {})[r["budget"]] = (
            f"{whole}{r['agreement']:.3f} / {r['kl']:.3f}{mark}{screened}"
        )
    what = "exact / agreement / KL" if exact else "agreement / KL"
    what = f"recall / {what}" if recall else what
    head = "| candidate | " + " | ".join(f"{b:g}: {what}" for b in budgets) + " |"
    lines = [head, "|" + " --- |" * (len(budgets) + 1)]
    lines += [f"| {c} | " + " | ".join(v.get(b, "") for b in budgets) + " |" for c, v in cells.items()]
    return "\n".join(lines)
