"""``vlkv eval zoo``: every zoo member and text task x policy x budget, with the oracle ceiling.

Each member (``lab/vlkv_lab/zoo``) is loaded through ``load_model`` / ``load_processor`` like any user's checkpoint;
its examples are prefilled once per chunk by the prefill worker's forward (``evaluation.prepare``), and every
(policy, budget) compresses them with ``policy.compress`` and decodes them through the decode worker's core
(``deploy/inprocess.py``), all rows of a budget in one batch (``zoo_scoring.py``). Beside full and the
policies, two oracle rows (``oracle.py``: the full-cache answer's own attention, at the default's per-layer
budgets and at its own). ``text`` (in ``--members``, and in the default run) adds the real-text suite on
SmolLM2-135M-Instruct (``zoo_text.py``; ``--text-n``, ``--text-lengths``, ``--text-tasks``). ``--api`` then
asks every question again through a local gateway and workers (real gRPC) with the default policy at each
budget and counts the answers that differ from the in-process ones. ``--ablation`` swaps the table's rows for
vlcache's options (``ABLATION``), the rows the tuning protocol chooses from (``common/compression/README.md``;
``--rows`` runs some of them; ``vlkv eval protocol`` reads the JSON files, ``protocol.py``). ``--jobs N``
(default ``auto``: both cores here) runs the members and the text suite's (task, length) groups in N worker
processes of one torch thread each, the longest first (the tools' one pool, ``deploy/pool.py``), with the same
results and tables.

Tables (``zoo_report.py``): n and a 95% Wilson interval per figure; eviction-trained members and model-bound
cells (the better oracle < 0.9 of full) marked and left out of the worst member, the ranking and the
protocol's check. Writes ``<out>/zoo.md`` (or ``zoo_ablation.md``), ``zoo.json`` beside it (after every
member, so a long run leaves its tables as it goes) and a plot.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vlkv.common.compression.presets import PRESETS
from vlkv.common.compression.registry import DEFAULT_POLICY, POLICY_NAMES, preset_params
from vlkv.common.config import ModelConfig
from vlkv.deploy.jobs import parse_jobs
from vlkv.deploy.pool import Pool, WorkerFailed
from vlkv.deploy.progress import Progress
from vlkv.deploy.progress import progress as track

import vlkv_lab.eval.presets  # noqa: F401  (the lab's presets: the experiments this names)
from vlkv_lab.eval import zoo_report, zoo_verify
from vlkv_lab.eval.evaluation import prepare
from vlkv_lab.eval.lab_policy import VLCACHE_FAMILY
from vlkv_lab.eval.protocol_ties import recorded
from vlkv_lab.eval.zoo_report import finalize, worst_member
from vlkv_lab.eval.zoo_scoring import FULL, merge, score_chunk
from vlkv_lab.eval.zoo_text import (
    WEIGHT,
    Steps,
    load_text_model,
    run_item,
    run_text,
    text_items,
    text_name,
    text_weight,
)
from vlkv_lab.zoo import MEMBERS, member, text_suite
from vlkv_lab.zoo.accuracy import load_member

TEXT = "text"
"""``--members`` name of the real-text suite (SmolLM2-135M-Instruct, ``zoo_text.py``)."""
__all__ = ["evaluate_many", "run_member", "run_zoo", "worst_member"]

ZOO_BUDGETS = (0.01, 0.02, 0.05, 0.10)
BASELINES = tuple(p for p in POLICY_NAMES if p not in ("full", DEFAULT_POLICY))
# (label, policy, params): vlcache's registered options, one change at a time from its defaults
PREVIOUS_DEFAULT = preset_params("vlcache_paper")
"""vlcache's settings before the zoo (#30), the paper's own (``common/compression/presets.py``): the
protocol's "before" row."""
PREVIOUS_LABEL = "vlcache before the zoo"
PYRAMID_WINDOW = {k: v for k, v in PRESETS["vlcache_pyramid_window"].items() if k != "policy"}
"""The default's image-prompt settings before draft-mass budgets (#38, protocol v2.1's image dimension,
2026-11-28): ``Pyramid(beta=4.0)`` layer budgets and the question's window kept outright. Every ``ABLATION``
option row below but the text-preset ones is that default with its option, as it was run and recorded
before the change (so rows in older files and new runs are the same policies)."""
PYRAMID_WINDOW_LABEL = "vlcache before draft-mass budgets (pyramid, question window)"
ABLATION = (
    ("vlcache (defaults)", "vlcache", {}),
    (PREVIOUS_LABEL, "vlcache", PREVIOUS_DEFAULT),
    ("window: the best-scoring question tokens", "vlcache", {"post_vision_by_score": True}),
    ("window: none (the paper's recent window only)", "vlcache", {"post_vision_window": False}),
    ("window: cap 1/4", "vlcache", {"post_vision_cap": 0.25}),
    ("scores not pooled", "vlcache", {"pool_kernel": 1}),
    ("scores max-pooled over 7", "vlcache", {"pool_kernel": 7}),
    ("sinks: first 4 tokens", "vlcache", {"sink_tokens": 4}),
    ("chunks of 10 tokens (ChunkKV)", "vlcache_lab", {"chunk_size": 10}),
    ("preset vlcache_lookup (spans, shared layers, sinks)", "vlcache", preset_params("vlcache_lookup")),
    ("text-only prompts: preset vlcache_text", "vlcache", {"text_preset": "vlcache_text"}),
    (
        "text-only prompts: preset vlcache_text_lowbudget",
        "vlcache",
        {"text_preset": "vlcache_text_lowbudget"},
    ),
    ("text-only prompts: preset vlcache_lookup", "vlcache", {"text_preset": "vlcache_lookup"}),
    ("text-only prompts: preset vlcache_text_span", "vlcache", {"text_preset": "vlcache_text_span"}),
    ("text-only prompts: preset vlcache_text_question", "vlcache", {"text_preset": "vlcache_text_question"}),
    ("text-only prompts: preset vlcache_text_lean", "vlcache", {"text_preset": "vlcache_text_lean"}),
    (
        "text-only prompts: preset vlcache_text_lean_sinks2",
        "vlcache",
        {"text_preset": "vlcache_text_lean_sinks2"},
    ),
    ("text-only prompts: preset vlcache_text_lean_w24", "vlcache", {"text_preset": "vlcache_text_lean_w24"}),
    ("allocator: Algorithm 1", "vlcache", {"allocator": "sparsity"}),
    ("allocator: uniform", "vlcache", {"allocator": "uniform"}),
    ("allocator: mixed (0.8 uniform + 0.2 Algorithm 1)", "vlcache", {"allocator": "mixed"}),
    ("allocator: coverage", "vlcache", {"allocator": "coverage"}),
    ("allocator: cake", "vlcache", {"allocator": "cake"}),
    ("allocator: pyramid, beta 2", "vlcache", {"pyramid_beta": 2.0}),
    ("allocator: pyramid, beta 20 (PyramidKV's)", "vlcache", {"pyramid_beta": 20.0}),
    ("text-only prompts: no preset (the 32-row text window)", "vlcache", {"text_preset": ""}),
    ("text window: off (every row, the paper's)", "vlcache", {"text_preset": "", "text_window": 0}),
    ("text window: 8 rows", "vlcache", {"text_preset": "", "text_window": 8}),
    ("lookahead 8 (w 0.5)", "vlcache", {"lookahead": 8, "lookahead_weight": 0.5}),
    ("lookahead 16 (w 0.5)", "vlcache", {"lookahead": 16, "lookahead_weight": 0.5}),
    ("lookahead 8 (w 1.0)", "vlcache", {"lookahead": 8, "lookahead_weight": 1.0}),
    ("lookahead 16 (w 1.0)", "vlcache", {"lookahead": 16, "lookahead_weight": 1.0}),
    (
        "text-only prompts: preset vlcache_text_span + lookahead 16 (w 0.5)",
        "vlcache",
        {"text_preset": "vlcache_text_span_lookahead"},
    ),
    (
        "text-only prompts: preset vlcache_text_span + lookahead 32 (w 0.5)",
        "vlcache",
        {"text_preset": "vlcache_text_span_lookahead32"},
    ),
    (
        "text-only prompts: preset vlcache_text_span + lookahead 32 (w 1.0)",
        "vlcache",
        {"text_preset": "vlcache_text_span_lookahead32_w1"},
    ),
    (
        "text-only prompts: preset vlcache_text_span + lookahead 48 (w 0.5)",
        "vlcache",
        {"text_preset": "vlcache_text_span_lookahead48"},
    ),
    (
        "text-only prompts: preset vlcache_text_span + lookahead 48 (w 1.0)",
        "vlcache",
        {"text_preset": "vlcache_text_span_lookahead48_w1"},
    ),
    ("snapkv (baseline)", "snapkv", {}),
    ("pyramidkv (baseline)", "pyramidkv", {}),
    ("allocator: draft mass (w 0.5)", "vlcache", {"allocator": {"name": "draft_mass", "weight": 0.5}}),
    ("allocator: draft mass (w 1.0)", "vlcache", {"allocator": {"name": "draft_mass", "weight": 1.0}}),
    ("lookahead 16 (w 0.75)", "vlcache", {"lookahead": 16, "lookahead_weight": 0.75}),
    (
        "window: none + lookahead 16 (w 1.0)",
        "vlcache",
        {"post_vision_window": False, "lookahead": 16, "lookahead_weight": 1.0},
    ),
    (
        "allocator: draft mass (w 0.5) + window: none",
        "vlcache",
        {"allocator": {"name": "draft_mass", "weight": 0.5}, "post_vision_window": False},
    ),
    (
        "allocator: draft mass (w 1.0) + window: none",
        "vlcache",
        {"allocator": {"name": "draft_mass", "weight": 1.0}, "post_vision_window": False},
    ),
    ("window: first layer only", "vlcache_lab", {"post_vision_layers": 1}),
    ("window: first 2 layers only", "vlcache_lab", {"post_vision_layers": 2}),
    (
        "allocator: draft mass (w 0.5, pyramid floor in layer 0) + window: none",
        "vlcache",
        {"allocator": {"name": "draft_mass", "weight": 0.5, "floor_layers": 1}, "post_vision_window": False},
    ),
    (
        "allocator: draft mass (w 0.5, pyramid floor in layers 0-1) + window: none",
        "vlcache",
        {"allocator": {"name": "draft_mass", "weight": 0.5, "floor_layers": 2}, "post_vision_window": False},
    ),
    (
        "text-only prompts: preset vlcache_text_lean_w24_skip32",
        "vlcache",
        {"text_preset": "vlcache_text_lean_w24_skip32"},
    ),
    (
        "text-only prompts: preset vlcache_text_span_skip32",
        "vlcache",
        {"text_preset": "vlcache_text_span_skip32"},
    ),
    (
        "text-only prompts: preset vlcache_text_by_budget",
        "vlcache",
        {"text_preset": "vlcache_text_by_budget"},
    ),
    (
        "text-only prompts: preset vlcache_text_lean_w24_skip32_q12",
        "vlcache",
        {"text_preset": "vlcache_text_lean_w24_skip32_q12"},
    ),
)


def _on_the_pyramid_window(rows) -> tuple[tuple[str, str, dict], ...]:
    """``rows`` with each vlcache option row over ``PYRAMID_WINDOW`` (its own keys win), then that default's own
    row. Left as they are: today's default (``{}``), complete presets (they name the allocator and the window),
    the text-preset rows (a named ``text_preset`` and nothing else: image prompts are today's default's by
    construction, which the protocol's text dimension checks) and the baselines."""
    out = []
    for label, policy, params in rows:
        preset_only = set(params) == {"text_preset"} and params["text_preset"]
        if policy in VLCACHE_FAMILY and params and not preset_only:
            params = {**PYRAMID_WINDOW, **params}
        out.append((label, policy, params))
    return (*out, (PYRAMID_WINDOW_LABEL, DEFAULT_POLICY, dict(PYRAMID_WINDOW)))


ABLATION = _on_the_pyramid_window(ABLATION)


def _configs(ablation: bool, rows: str = "") -> list[tuple[str, str, dict]]:
    """The table's rows; ``rows``: only the ``ABLATION`` rows with these labels (``|``-separated; the
    protocol names the rows a held-out check still needs)."""
    if ablation:
        if not rows:
            return list(ABLATION)
        wanted = [x.strip() for x in rows.split("|") if x.strip()]
        unknown = [x for x in wanted if x not in {label for label, _, _ in ABLATION}]
        if unknown:
            raise ValueError(
                f"unknown --rows {unknown}; ABLATION rows: {[label for label, _, _ in ABLATION]}"
            )
        return [row for row in ABLATION if row[0] in wanted]
    previous = (PREVIOUS_LABEL, DEFAULT_POLICY, PREVIOUS_DEFAULT)
    return [(DEFAULT_POLICY, DEFAULT_POLICY, {}), previous] + [(p, p, {}) for p in BASELINES]


def run_member(
    name: str,
    n: int,
    seed: int,
    split: str,
    configs,
    budgets,
    api: bool = False,
    chunk: int = 50,
    bar: Progress | Steps | None = None,
    verify: bool = False,
) -> dict:
    """One member's result (``zoo_report``'s shape): every row at every budget, the two oracle rows, per
    example, in chunks of ``chunk`` examples (one prefill each, freed before the next chunk). bar: the run's
    one progress bar (two steps an example: its prefill, then its rows; its own bar when None). verify: also
    verified compression's rows (``zoo_verify.py``), under ``verify``."""
    mod = member(name)
    model, processor = load_member(mod)
    verified = zoo_verify.Verified(model, processor, mod, budgets, configs) if verify else None
    examples = mod.make_examples(n, seed=seed, split=split)
    hits: dict = {}
    texts: dict = {}
    ms: list[int] = []
    parts = [examples[i : i + chunk] for i in range(0, len(examples), chunk)]
    for part in track(parts, desc=name, unit=f"{chunk} examples", disable=bar is not None):
        prepared = prepare(
            model, processor, part, progress=False, task=mod, next_attention=False, counter=bar
        )
        ms += [p.m for p in prepared]
        part_texts: dict = {}
        right = score_chunk(
            model, processor, prepared, configs, budgets, mod.max_new_tokens, texts=part_texts
        )
        merge(hits, right)
        merge(texts, part_texts)
        if verified is not None:
            verified.score(prepared, right)
        if bar is not None:
            bar.update(len(part))
        del prepared
        gc.collect()
    out = finalize({"hits": hits, "m": sum(ms) / len(ms), "geometry": mod.geometry})
    out["eviction_trained"] = mod.eviction_trained
    out["real_decoder"] = mod.assemble is not None  # assembled from SmolLM2's GGUF
    if verified is not None:
        out["verify"] = verified.result()
    if api:
        answers = {b: texts[DEFAULT_POLICY][str(b)] for b in budgets}
        out["api"] = _api_check(mod, model, processor, examples, budgets, answers)
    del model
    gc.collect()
    return out


def evaluate_many(
    model, processor, prepared, configs, budget: float, max_new_tokens: int, answers: dict, chunk: int = 1200
) -> dict[str, float]:
    """Accuracy of every ``(label, policy, params)`` at ``budget`` (no oracle): all their caches decoded
    together. ``answers[budget]`` receives the default policy's texts."""
    texts: dict = {}
    right = score_chunk(
        model,
        processor,
        prepared,
        configs,
        [budget],
        max_new_tokens,
        oracle=False,
        texts=texts,
        decode_chunk=chunk,
    )
    if DEFAULT_POLICY in texts:
        answers[budget] = texts[DEFAULT_POLICY][str(budget)]
    return {label: sum(h[str(budget)]) / len(prepared) for label, h in right.items() if label != FULL}


def _api_check(mod, model, processor, examples, budgets, answers) -> dict:
    """Ask every question through real gRPC at the default policy and each budget (``api_check.ask_served``):
    accuracy and how many answers differ from the in-process evaluation's."""
    from vlkv.common.config import ServerConfig

    from vlkv_lab.eval.api_check import ask_served

    cfg = ServerConfig(model=ModelConfig(path=str(mod.checkpoint())))
    asks = [(DEFAULT_POLICY, b) for b in budgets]
    result = {}
    served = ask_served(cfg, model, processor, examples, asks, mod.max_new_tokens, 4)
    for b, (texts, _) in zip(budgets, served, strict=True):
        acc = sum(mod.is_correct(t, ex) for t, ex in zip(texts, examples, strict=True)) / len(examples)
        differ = sum(t.strip() != a.strip() for t, a in zip(texts, answers[b], strict=True))
        result[str(b)] = {"accuracy": acc, "differ": differ}
    return result


def run_zoo(args) -> int:
    budgets = ZOO_BUDGETS
    names = args.members.split(",") if getattr(args, "members", "") else [*MEMBERS, TEXT]
    ablation = getattr(args, "ablation", False)
    configs = _configs(ablation, getattr(args, "rows", "") or "")
    split = getattr(args, "split", "heldout")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "zoo_ablation" if ablation else "zoo"
    verify = bool(getattr(args, "verify", False))
    start = time.perf_counter()
    results: dict = {}
    described = {label: {"policy": policy, "params": params} for label, policy, params in configs}
    for d in described.values():  # the policies this run used, whatever the defaults become (protocol v2.2)
        d["resolved"] = recorded(d, budgets)

    def write() -> list[str]:  # after every member, so a long run leaves its tables as it goes
        md = zoo_report.render(
            results, budgets, _command(args, split), split, time.perf_counter() - start, PREVIOUS_LABEL
        ) + (zoo_verify.render(results) if verify else [])
        (out / f"{stem}.md").write_text("\n".join(md) + "\n")
        (out / f"{stem}.json").write_text(
            json.dumps({"split": split, "n": args.n, "configs": described, "results": results}, indent=1)
        )
        return md

    lengths = [int(x) for x in str(getattr(args, "text_lengths", "") or "1024,2048").split(",")]
    tasks = (getattr(args, "text_tasks", "") or ",".join(text_suite.DEFAULT_TASKS)).split(",")
    text_n = getattr(args, "text_n", 50)
    items = _items(names, args.n, tasks, lengths, text_n)
    steps = sum(item.steps for item in items)
    jobs = max(1, min(parse_jobs(getattr(args, "jobs", 1)), len(items)))
    if jobs > 1 and getattr(args, "api", False):
        print("vlkv eval zoo --api: one process (--api starts servers); --jobs ignored", file=sys.stderr)
        jobs = 1
    if verify and TEXT in names:
        print(
            "vlkv eval zoo --verify: verifier rows for the image members only, not the text suite",
            file=sys.stderr,
        )
    # one bar over the whole run, with an ETA: per example its prefill, then its rows, each weighted by its cost
    with Progress(2 * steps, desc="vlkv eval zoo", unit="steps") as bar:
        if jobs > 1:
            spec = {"n": args.n, "seed": args.seed, "split": split, "configs": configs, "budgets": budgets}
            spec["text_n"] = text_n
            spec["verify"] = verify
            done: dict = {}

            def finished(item: Item, result: dict) -> None:  # the tables in the serial run's order
                done[item.key] = finalize(result) if item.kind == TEXT else result
                results.clear()
                results.update({i.key: done[i.key] for i in items if i.key in done})
                write()

            order = sorted(items, key=lambda i: -i.steps)  # the longest first
            try:
                with Pool(jobs, _run_item, spec=spec, bar=bar, label=lambda i: i.key) as pool:
                    pool.run(order, on_result=lambda i, result: finished(order[i], result))
            except WorkerFailed as e:
                bar.close()
                print(f"vlkv eval zoo: {e.item} failed; the run is stopped.\n{e.error}", file=sys.stderr)
                return 1
        else:  # one process: the run as before --jobs
            for name in names:
                bar.set_postfix(name)
                if name == TEXT:
                    for task_name, r in run_text(
                        tasks, lengths, text_n, args.seed, split, configs, budgets, bar=bar
                    ):
                        results[task_name] = finalize(r)
                        write()
                    continue
                results[name] = run_member(
                    name,
                    args.n,
                    args.seed,
                    split,
                    configs,
                    budgets,
                    api=getattr(args, "api", False),
                    bar=Steps(bar, _weight(name)),
                    verify=verify,
                )
                write()
    md = write()
    zoo_report.plot(results, budgets, out / f"{stem}.png")
    plotted = verify and zoo_verify.plot(results, out / f"{stem}_verify.png")
    print("\n".join(md))
    print(
        f"wrote {out / (stem + '.md')}, {stem}.json and {stem}.png"
        + (f" and {stem}_verify.png" if plotted else "")
    )
    return 0


@dataclass(frozen=True)
class Item:
    """One work item of ``--jobs N`` (``deploy/pool.py``): a member, or one text task at one length."""

    key: str
    """Its name in the tables (``results``)."""
    kind: str
    """``member`` or ``text``."""
    name: str
    """The member, or the text task."""
    length: int = 0
    steps: int = 0
    """Its share of the bar (half of it): the longest first."""


def _items(names, n: int, tasks, lengths, text_n: int) -> list[Item]:
    """The run's work items in the serial run's order (``run_text``'s for the text suite's)."""
    items = []
    for name in names:
        if name != TEXT:
            items.append(Item(name, "member", name, steps=n * _weight(name)))
            continue
        for task, length in text_items(tasks, lengths):
            items.append(Item(text_name(task, length), TEXT, task, length, text_n * text_weight(length)))
    return items


_TEXT_MODEL: list = []
"""A worker's SmolLM2 (model, processor), loaded by its first text item and kept for the next."""


def _run_item(item: Item, spec: dict, bar) -> dict:
    """One ``Item`` in a worker (``Pool.run``): ``run_member``'s result, or ``run_task``'s (the
    parent finalizes it as the serial run does)."""
    common = (spec["seed"], spec["split"], spec["configs"], spec["budgets"])
    if item.kind != TEXT:
        bar = Steps(bar, _weight(item.name))
        return run_member(item.name, spec["n"], *common, bar=bar, verify=spec.get("verify", False))
    if not _TEXT_MODEL:
        _TEXT_MODEL.extend(load_text_model())
    model, processor = _TEXT_MODEL
    return run_item(model, processor, item.name, item.length, spec["text_n"], *common, bar=bar)[1]


def _weight(name: str) -> int:
    """The run's bar: steps per example of a member (``zoo_text.WEIGHT`` for SmolLM2's, 1 for a toy's)."""
    return WEIGHT if member(name).assemble is not None else 1


def _command(args, split: str) -> str:
    flags = (" --ablation" if getattr(args, "ablation", False) else "") + (
        " --api" if getattr(args, "api", False) else ""
    )
    flags += " --verify" if getattr(args, "verify", False) else ""
    cmd = f"vlkv eval zoo{flags} -n {args.n} --split {split}"
    if getattr(args, "seed", 0):
        cmd += f" --seed {args.seed}"
    if getattr(args, "members", ""):
        cmd += f" --members {args.members}"
    if getattr(args, "rows", ""):
        cmd += f" --rows '{args.rows}'"
    if getattr(args, "jobs", None) not in (None, "", "auto"):
        cmd += f" --jobs {args.jobs}"
    for flag in ("text_n", "text_lengths", "text_tasks"):
        value = getattr(args, flag, None)
        if value not in (None, ""):
            cmd += f" --{flag.replace('_', '-')} {value}"
    return cmd
