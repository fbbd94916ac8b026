"""``vlkv calibrate --verifier``: the served verifier run offline over a prompt file.

Every prompt (``calibrate_prompts.read_prompts``: public-API requests, no answers) is prepared as the gateway
prepares it and, at every budget, verified by the prefill worker's own engine (``PrefillEngine.run_verified``
in ``select`` mode: every candidate teacher-forced with the full cache's 16-token draft), its outcome counted
by the same :class:`~vlkv.prefill_worker.ledger.Ledger` a serving worker keeps. The ledger's profile is written
in ``vlkv calibrate``'s format (``measure.kind = "verifier"``); ``vlkv serve --learned-profile PATH`` starts
from it, so the first requests already try the most-winning candidate first. One code path: the counts are
the ones a server would have learned from these prompts.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.compression.verify import VerifyConfig
from vlkv.common.config import Limits, ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import prepare_request
from vlkv.deploy.calibrate.prompts import read_prompts
from vlkv.prefill_worker.engine import PrefillEngine

LEARNED_FILENAME = "learned_profile.json"


def calibrate_verified(
    model_dir: str,
    prompts: str,
    budgets=(0.02, 0.05, 0.1),
    out: str = "",
    dtype: str = "float32",
    max_prompts: int = 0,
    draft_tokens: int = 16,
    model=None,
    processor=None,
    progress=sys.stderr,
):
    """Returns ``(path, profile, seconds)``; ValueError for bad budgets or prompts."""
    start = time.perf_counter()
    budgets = tuple(sorted(float(b) for b in budgets))
    if not budgets or any(not 0.0 < b < 1.0 for b in budgets):
        raise ValueError(f"budgets must lie in (0, 1), got {budgets}")
    requests, digest = read_prompts(prompts)
    requests = requests[:max_prompts] if max_prompts else requests
    model = model if model is not None else load_model(ModelConfig(path=model_dir, dtype=dtype))
    processor = processor if processor is not None else load_processor(model_dir)
    spec = ModelSpec.from_model(model, processor.tokenizer)
    engine = PrefillEngine(model, spec, verify_config=VerifyConfig(mode="select", draft_tokens=draft_tokens))
    engine.ledger.model_info.update(path=str(Path(model_dir).resolve()), dtype=dtype)
    limits = Limits()
    total = len(requests) * len(budgets)
    for i, pb in enumerate(requests):
        prepared = prepare_request(pb, processor, spec, limits, default_seed=0)
        for j, budget in enumerate(budgets):
            compression = CompressionSettings(budget=budget, explicit=False, verify="select")
            engine.run(dataclasses.replace(prepared, compression=compression))
            done = i * len(budgets) + j + 1
            if progress is not None and (done == total or done % max(1, total // 20) == 0):
                rate = done / (time.perf_counter() - start)
                print(
                    f"verified {done}/{total} ({rate:.2f}/s, {(total - done) / rate:.0f} s left)",
                    file=progress,
                )
    profile = engine.ledger.profile()
    profile.prompts.update(digest=digest, file=Path(prompts).name, count=len(requests))
    path = Path(out) if out else Path(model_dir) / LEARNED_FILENAME
    profile.write(path)
    return path, profile, time.perf_counter() - start


def format_learned(profile) -> str:
    """Per budget: each candidate's wins and the mean agreement of the kept caches, the entry starred."""
    lines = ["| budget | candidate | wins | mean agreement | mean KL |", "| --- | --- | --- | --- | --- |"]
    chosen = {e.budget: e.candidate for e in profile.entries}
    for row in profile.table:
        star = " *" if chosen.get(row["budget"]) == row["candidate"] else ""
        lines.append(
            f"| {row['budget']:g} | {row['candidate']}{star} | {row['prompts']} | {row['agreement']:.3f} | "
            f"{row['kl']:.4f} |"
        )
    return "\n".join(lines)
