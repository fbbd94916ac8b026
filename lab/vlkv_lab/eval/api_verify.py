"""``vlkv eval api --api-verify floor|select``: verified compression through the public gRPC API against the
same verifier in process.

Every held-out question is asked through a local gateway and workers (``api_check.ask_served``: real gRPC) at
each ``--budgets`` budget with no policy named and ``verify`` set, and answered in process by the same stack
(``InProcessEngine`` with the server's ``VerifyConfig``, each request prefilled, verified and decoded alone).
Per budget the table gives the accuracy on both sides, the answers that differ, the requests whose served
verifier kept another candidate than the in-process one (or whose usage lacks the verifier's fields), the
realized mean budget and the share of requests raised.
"""

from __future__ import annotations

import time
from pathlib import Path

from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.compression.verify import VerifyConfig
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy.client import png_bytes
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.deploy.progress import progress as track

from vlkv_lab.eval.api_check import _question, _target, ask_served
from vlkv_lab.eval.zoo_scoring import wilson


def _in_process(model, processor, examples, budgets, mode: str, max_new: int) -> dict:
    """Per budget ``[(text, candidate, ratio, raises)]``, one request at a time through the in-process stack."""
    engine = InProcessEngine(model, processor, verify=VerifyConfig())
    out = {}
    for budget in budgets:
        rows = []
        for ex in track(examples, total=len(examples), desc=f"in-process verify {mode} {budget:.0%}"):
            req = engine.prepare(
                [png_bytes(im) for im in ex.images],
                question=_question(ex),
                sampling=SamplingConfig(max_new_tokens=max_new),
                compression=CompressionSettings(budget=budget, explicit=False, verify=mode),
            )
            result = engine.prefill.run(req)
            gen = engine.generate_batch([req])[0]
            v = result.verdict
            rows.append(
                (gen.text, v.candidate if v else "", result.cache.compression_ratio, v.raises if v else 0)
            )
        out[budget] = rows
    return out


def run_api_verify(args) -> int:
    mode = args.api_verify
    target, model, processor = _target(args)
    budgets = [float(x) for x in args.budgets.split(",")]
    cfg = ServerConfig(
        model=ModelConfig(path=target.model_dir, dtype=target.dtype),
        pool=PoolConfig(batch_invariant=bool(getattr(args, "batch_invariant", False))),
        compression_profile="none",
    )
    start = time.perf_counter()
    examples, task = target.examples, target.task
    local = _in_process(model, processor, examples, budgets, mode, target.max_new_tokens)
    asks = [("", b, mode) for b in budgets]
    served = ask_served(cfg, model, processor, examples, asks, target.max_new_tokens, args.concurrency)
    n = len(examples)

    def right(texts) -> int:
        return sum(task.is_correct(t, ex) for t, ex in zip(texts, examples, strict=True))

    def cell(k: int) -> str:
        lo, hi = wilson(k, n)
        return f"{k / n:.3f} ({k}/{n}, {lo:.2f}-{hi:.2f})"

    head = (
        "| budget | accuracy (API) | accuracy (in-process verifier) | answers that differ | "
        "kept another candidate or no verifier fields | realized mean budget (API) | raised (API) |"
    )
    md = [
        f"# Verified compression through the public gRPC API ({target.name or 'the default model'}, {n} "
        f"examples, {target.dtype}, verify={mode})",
        "",
        f"Command: `vlkv eval api{f' --member {target.name}' if target.name else ''} -n {args.n} "
        f"--api-verify {mode} --budgets {args.budgets} --concurrency {args.concurrency}`",
        "",
        head,
        "|" + " --- |" * (head.count("|") - 1),
    ]
    bad = 0
    for budget, (api, usages) in zip(budgets, served, strict=True):
        mine = local[budget]
        differ = sum(a.strip() != b[0].strip() for a, b in zip(api, mine, strict=True))
        other = sum(
            u.verify != mode or u.verified_candidate != b[1] for u, b in zip(usages, mine, strict=True)
        )
        ratio = sum(u.compression_ratio for u in usages) / n
        raised = sum(u.budget_raises > 0 for u in usages) / n
        bad += differ + other
        md.append(
            f"| {budget:.0%} | {cell(right(api))} | {cell(right([t for t, *_ in mine]))} | {differ}/{n} | "
            f"{other}/{n} | {ratio:.4f} | {raised:.2f} |"
        )
        print(f"verify {mode} {budget:.0%}: differ {differ}, other candidate or fields {other}")
    md += ["", f"Wall time: {time.perf_counter() - start:.0f} s"]
    print("\n".join(md))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() or c == "_" else "_" for c in target.name)
        path = out / f"api_check{'_' + slug if slug else ''}_verify_{mode}.md"
        path.write_text("\n".join(md) + "\n")
        print(f"wrote {path}")
    return 0 if bad == 0 else 1
