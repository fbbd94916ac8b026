"""``vlkv eval --api``: the held-out accuracy measured through the public gRPC API.

``vlkv eval --table`` prefills each example once and compresses it per (policy, budget) in-process, which
is what makes a sweep of every policy over six budgets affordable on a CPU. This command checks that table
against the served system: it starts a gateway, a prefill worker and a decode worker (real gRPC over
localhost, in this process), asks every held-out question through the gateway at each requested
(policy, budget), scores the answers, and reports, per run, the accuracy and how many answers differ
from the in-process evaluation's answers for the same example.

``--compression-profile PATH`` (a ``vlkv calibrate`` profile of this model) checks the profile instead of
``--policy``: the servers load it as ``vlkv serve --compression-profile PATH`` does, every request names a
budget and nothing else (so the profile chooses), and the in-process side evaluates the settings of the
profile's entry for that budget (``CompressionProfile.policy_for``) at that budget. Each served answer must
also name the profile in ``Finished.usage.compression_profile``: a run where any does not is reported.
"""

from __future__ import annotations

import asyncio
import io
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from vlkv.common.config import ModelConfig, ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.deploy.servers import (
    load_compression_profile,
    start_decode_worker,
    start_gateway,
    start_prefill_worker,
)
from vlkv.tools.client import build_request, generate
from vlkv.tools.eval.evaluation import evaluate, prepare
from vlkv.tools.progress import progress as track
from vlkv.tools.task.synthetic_task import is_correct, make_examples
from vlkv.v1 import generate_pb2_grpc


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


async def _serve(cfg: ServerConfig, model, processor):
    prefill = await start_prefill_worker(cfg, model=model, processor=processor)
    decode = await start_decode_worker(cfg, model=model, tokenizer=processor.tokenizer)
    gateway = await start_gateway(cfg, [prefill.address], [decode.address], processor=processor)
    return prefill, decode, gateway


def _ask_all(
    address: str,
    examples,
    policy: str,
    budget: float | None,
    max_new: int,
    workers: int,
    profiles: list[str] | None = None,
) -> list[str]:
    """Every example's answer through the gateway at ``address``; ``profiles`` (if given) receives each
    answer's ``Finished.usage.compression_profile`` (empty: no profile chose its policy)."""
    images = [[_png(im) for im in ex.images] for ex in examples]
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        def one(i: int) -> str:
            req = build_request(
                images=images[i],
                question=examples[i].question,
                max_new_tokens=max_new,
                policy=policy,
                budget=budget,
            )
            return generate(stub, req, 600)

        with ThreadPoolExecutor(workers) as pool:
            label = f"api {policy or 'profile'}" + (f" {budget:.0%}" if budget is not None else "")
            outs = list(track(pool.map(one, range(len(examples))), total=len(examples), desc=label, unit="q"))
    if profiles is not None:
        profiles.extend(o.finished.usage.compression_profile for o in outs)
    return [o.text for o in outs]


def _runs(args, profile) -> list[tuple[str, str, float | None, dict]]:
    """(label, the policy the request names, budget, the in-process policy's parameters): full, then per
    budget ``--policy`` or, with a profile, no policy named and the profile entry's settings in-process."""
    runs: list[tuple[str, str, float | None, dict]] = [("full", "full", None, {})]
    for b in (float(x) for x in args.budgets.split(",")):
        if profile is None:
            runs.append((f"{args.policy} {b:.0%}", args.policy, b, {}))
        else:
            entry = profile.entry_for(b)
            runs.append((f"profile {b:.0%} ({entry.candidate})", "", b, entry.policy.to_dict()))
    return runs


def run_api_check(args) -> int:
    from vlkv.common.compression.profile import read_profile

    profile_path = getattr(args, "compression_profile", "") or ""
    profile = read_profile(profile_path) if profile_path else None
    # without --compression-profile no profile is served (not even one beside the checkpoint)
    cfg = ServerConfig(model=ModelConfig(path=args.model), compression_profile=profile_path or "none")
    runs = _runs(args, profile)
    model = load_model(cfg.model)
    processor = load_processor(args.model)
    # another model's profile or a bad file: refused here as `vlkv serve` refuses it, before any prefill
    load_compression_profile(cfg, ModelSpec.from_model(model, processor.tokenizer).fingerprint)
    examples = make_examples(args.n, seed=args.seed, split=getattr(args, "split", "heldout"))
    prepared = prepare(model, processor, examples, progress=True)

    loop = asyncio.new_event_loop()
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = asyncio.run_coroutine_threadsafe(_serve(cfg, model, processor), loop).result(300)
    rows = []
    start = time.perf_counter()
    try:
        for label, policy, budget, params in runs:
            t0 = time.perf_counter()
            named: list[str] = []
            api = _ask_all(
                servers[2].address, examples, policy, budget, args.max_new_tokens, args.concurrency, named
            )
            params = dict(params)
            local_policy = params.pop("policy", policy)
            local = evaluate(
                model, processor, prepared, local_policy, budget or 1.0, args.max_new_tokens, **params
            ).answers
            acc = sum(is_correct(t, ex) for t, ex in zip(api, examples, strict=True)) / len(examples)
            local_acc = sum(is_correct(t, ex) for t, ex in zip(local, examples, strict=True)) / len(examples)
            differ = sum(a.strip() != b.strip() for a, b in zip(api, local, strict=True))
            expect = profile.label if (profile is not None and policy == "") else ""
            unnamed = sum(n != expect for n in named)  # answers whose usage names another (or no) profile
            rows.append((label, acc, local_acc, differ, unnamed, time.perf_counter() - t0))
            print(
                f"{label}: api {acc:.3f} in-process {local_acc:.3f} differ {differ} profile-mismatch {unnamed}",
                flush=True,
            )
    finally:
        for s in servers[::-1]:
            asyncio.run_coroutine_threadsafe(s.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
    md = _markdown(args, examples, rows, profile, profile_path, time.perf_counter() - start)
    print("\n".join(md))
    if args.out:
        from pathlib import Path

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "api_check_profile.md" if profile is not None else "api_check.md"
        (out / name).write_text("\n".join(md) + "\n")
        print(f"wrote {out / name}")
    return 0 if all(r[3] == 0 and r[4] == 0 for r in rows) else 1


def _markdown(args, examples, rows, profile, profile_path: str, wall: float) -> list[str]:
    full_acc = rows[0][1]
    what = f"--compression-profile {profile_path}" if profile is not None else f"--policy {args.policy}"
    md = [
        f"# Accuracy through the public gRPC API ({len(examples)} examples of split "
        f"{getattr(args, 'split', 'heldout')})",
        "",
        f"Command: `vlkv eval --api -n {args.n} {what} --budgets {args.budgets}`",
        "",
    ]
    if profile is not None:
        md += [
            f"Profile {profile.label} (model {profile.fingerprint[:12]}, calibrated on "
            f"{profile.prompts.get('count', '?')} prompts): each request names only its budget; the "
            "in-process column evaluates the entry's settings at that budget.",
            "",
        ]
    md += [
        "| run | accuracy (API) | relative to full (API) | accuracy (in-process eval) | answers that differ "
        "| usage not naming the profile |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, acc, local_acc, differ, unnamed, _ in rows:
        rel = acc / full_acc if full_acc else 0.0
        md.append(
            f"| {label} | {acc:.3f} | {rel:.3f} | {local_acc:.3f} | {differ}/{len(examples)} "
            f"| {unnamed}/{len(examples)} |"
        )
    md += ["", f"Wall time: {wall:.0f} s"]
    return md
