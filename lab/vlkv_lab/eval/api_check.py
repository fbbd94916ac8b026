"""``vlkv eval api``: the held-out accuracy measured through the public gRPC API.

``vlkv eval table`` / ``zoo`` prefill each example once and compress it per (policy, budget) in-process
(``zoo_scoring.py``), which is what makes a sweep of every policy over the budgets affordable on a CPU. This
command checks that table against the served system: it starts a gateway, a prefill worker and a decode
worker (real gRPC over localhost, in this process, as ``vlkv serve --model DIR`` starts them), asks every
held-out question through the gateway at each requested (policy, budget), scores the answers, and reports,
per run, the accuracy and how many answers differ from the in-process table's answers for the same example.

What is checked (``_target``): the default model's synthetic task (``--model``), or ``--member NAME``, a zoo
member (``lab/vlkv_lab/zoo``; a real-decoder member is assembled on first use) or ``text:TASK[:LENGTH]``, a task of
the real-text suite on SmolLM2-135M-Instruct (``zoo_text.TextTask``, 1,024 tokens unless given), served in
bfloat16 as ``vlkv eval zoo`` scores it (``vlkv serve --model DIR --dtype bfloat16``; ``--dtype`` serves and
scores both sides in another dtype: bfloat16 decoding is not batch-invariant, ``--dtype float32`` with
``--concurrency`` above 1 checks the batched served path without bfloat16's rounding; ``--batch-invariant``
serves with ``vlkv serve --batch-invariant``, each sequence decoded as a batch of one, and decodes the
in-process side one cache at a time, so bfloat16 is compared at any concurrency). Each question is
the example's one user turn, sent as ``vlkv generate --chat`` sends it (``build_request(question=...)``).

``--compression-profile PATH`` (a ``vlkv calibrate`` profile of this model, in this dtype) checks the profile
instead of ``--policy``: the servers load it as ``vlkv serve --compression-profile PATH`` does, every request
names a budget and nothing else (so the profile chooses), and the in-process side evaluates the settings of
the profile's entry for that budget (``CompressionProfile.entry_for``) at that budget, beside the default
policy's (the profile - default column). Each served answer must also name the profile in
``Finished.usage.compression_profile``: a run where any does not is reported.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from vlkv.common.compression.registry import DEFAULT_POLICY
from vlkv.common.compression.verify import VerifyConfig
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv.deploy.client import build_request, generate, png_bytes
from vlkv.deploy.progress import progress as track
from vlkv.deploy.servers import (
    load_compression_profile,
    start_decode_worker,
    start_gateway,
    start_prefill_worker,
)
from vlkv.v1 import generate_pb2_grpc

from vlkv_lab.eval.evaluation import prepare
from vlkv_lab.eval.zoo_scoring import DECODE_CHUNK, FULL, full_answers, score_rows, wilson


@dataclass
class Target:
    """What the check asks: the task (``prompt_text`` / ``is_correct``), its examples and checkpoint."""

    name: str  # "" for the default model's synthetic task
    model_dir: str
    dtype: str
    task: object
    examples: list
    max_new_tokens: int


def _target(args) -> tuple[Target, object, object]:
    """``(target, model, processor)`` for ``--member`` (a zoo member or ``text:TASK[:LENGTH]``) or, without
    it, the synthetic task on ``--model``."""
    name = getattr(args, "member", "") or ""
    split = getattr(args, "split", "heldout")
    dtype = getattr(args, "dtype", "") or "float32"  # --dtype: both sides; text tasks default to bfloat16
    if name.startswith("text:"):
        from vlkv_lab.eval.zoo_text import TextTask
        from vlkv_lab.zoo import text_suite as ts
        from vlkv_lab.zoo.smollm2 import text_checkpoint

        _, task, *length = name.split(":")
        path, dtype = str(text_checkpoint()), getattr(args, "dtype", "") or "bfloat16"
        model, processor = load_model(ModelConfig(path=path, dtype=dtype)), load_processor(path)
        t = TextTask(
            task,
            int(length[0]) if length else 1024,
            processor.tokenizer,
            max_new_tokens=ts.max_new_tokens(task),
        )
        return (
            Target(name, path, dtype, t, t.make_examples(args.n, args.seed, split), t.max_new_tokens),
            model,
            processor,
        )
    if name:
        from vlkv_lab.zoo import member

        mod = member(name)
        path = str(mod.checkpoint())
        examples = mod.make_examples(args.n, seed=args.seed, split=split)
        target = Target(name, path, dtype, mod, examples, mod.max_new_tokens)
    else:
        from vlkv.deploy import synthetic_task

        examples = synthetic_task.make_examples(args.n, seed=args.seed, split=split)
        target = Target("", args.model, dtype, synthetic_task, examples, args.max_new_tokens)
    model = load_model(ModelConfig(path=target.model_dir, dtype=dtype))
    return target, model, load_processor(target.model_dir)


def _question(example) -> str:
    """The text of the example's one user turn (what ``build_request(question=...)`` sends after its images)."""
    return "".join(p["text"] for p in example.messages[-1]["content"] if p.get("type") == "text")


async def _serve(cfg: ServerConfig, model, processor):
    prefill = await start_prefill_worker(cfg, model=model, processor=processor)
    decode = await start_decode_worker(cfg, model=model, tokenizer=processor.tokenizer)
    gateway = await start_gateway(cfg, [prefill.address], [decode.address], processor=processor)
    return prefill, decode, gateway


def ask_served(cfg: ServerConfig, model, processor, examples, asks, max_new: int, workers: int) -> list:
    """Start a gateway and one prefill and one decode worker on localhost (``model`` shared), ask every example
    through the gateway at each ``(policy, budget)`` of ``asks`` (policy ``""``: the request names only its
    budget), stop them; per ask ``(answers, usages)``; an ask may carry a third item, the request's verify mode."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = asyncio.run_coroutine_threadsafe(_serve(cfg, model, processor), loop).result(300)
    images = [[png_bytes(im) for im in ex.images] for ex in examples]
    out = []
    try:
        with grpc.insecure_channel(servers[2].address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            for policy, budget, *mode in asks:

                def one(i: int, policy=policy, budget=budget, verify=mode[0] if mode else ""):
                    q = _question(examples[i])
                    req = build_request(
                        images=images[i],
                        question=q,
                        max_new_tokens=max_new,
                        policy=policy,
                        budget=budget,
                        verify=verify,
                    )
                    return generate(stub, req, 600)

                label = f"api {policy or 'profile'}" + (f" {budget:.0%}" if budget is not None else "")
                with ThreadPoolExecutor(workers) as pool:
                    done = list(track(pool.map(one, range(len(examples))), total=len(examples), desc=label))
                out.append(([o.text for o in done], [o.finished.usage for o in done]))
    finally:
        for s in servers[::-1]:
            asyncio.run_coroutine_threadsafe(s.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return out


def _runs(args, profile) -> list[tuple[str, str, float | None, str, dict]]:
    """(label, the policy the request names, budget, the in-process policy and its parameters): full, then
    per budget ``--policy`` or, with a profile, no policy named and the profile entry's settings in-process."""
    runs: list[tuple[str, str, float | None, str, dict]] = [("full", "full", None, "full", {})]
    for b in (float(x) for x in args.budgets.split(",")):
        if profile is None:
            runs.append((f"{args.policy} {b:.0%}", args.policy, b, args.policy, {}))
        else:
            entry = profile.entry_for(b)
            params = entry.policy.to_dict()
            runs.append((f"profile {b:.0%} ({entry.candidate})", "", b, params.pop("policy"), params))
    return runs


def _in_process(
    model, processor, prepared, runs, max_new: int, with_default: bool, one_by_one: bool, invariant: bool
):
    """The in-process table's answers per run (``zoo_scoring``: one prefill, each run's caches decoded
    together; with ``one_by_one`` one at a time, the batch a server asked one request at a time decodes;
    with ``invariant`` batched as ``vlkv serve --batch-invariant`` decodes, each answer the one it would get
    alone), and with ``with_default`` the default policy's per budget run (``[]`` for full)."""
    texts: dict = {}
    chunk = 1 if one_by_one else DECODE_CHUNK
    ids, _ = full_answers(model, processor, prepared, max_new, texts, chunk=chunk, batch_invariant=invariant)
    answers, default = [texts[FULL]["1.0"]], [[]]
    for label, _, budget, policy, params in runs[1:]:
        rows = [(label, policy, params)] + ([("default", DEFAULT_POLICY, {})] if with_default else [])
        score_rows(model, processor, prepared, ids, rows, [budget], max_new, False, texts, chunk, invariant)
        answers.append(texts[label][str(budget)])
        default.append(texts["default"][str(budget)] if with_default else [])
    return answers, default


def run_api_check(args) -> int:
    from vlkv.common.compression.profile import read_profile

    if getattr(args, "api_verify", None):
        from vlkv_lab.eval.api_verify import run_api_verify

        return run_api_verify(args)

    profile_path = getattr(args, "compression_profile", "") or ""
    profile = read_profile(profile_path) if profile_path else None
    target, model, processor = _target(args)
    # without --compression-profile no profile is served (not even one beside the checkpoint)
    batch_invariant = bool(getattr(args, "batch_invariant", False))
    cfg = ServerConfig(
        model=ModelConfig(path=target.model_dir, dtype=target.dtype),
        pool=PoolConfig(batch_invariant=batch_invariant),
        compression_profile=profile_path or "none",
        verify=VerifyConfig(
            mode="off"
        ),  # the fixed settings are checked: a request naming none is not verified
    )
    runs = _runs(args, profile)
    # another model's profile or a bad file: refused here as `vlkv serve` refuses it, before any prefill
    load_compression_profile(cfg, ModelSpec.from_model(model, processor.tokenizer).fingerprint)
    examples, task = target.examples, target.task
    start = time.perf_counter()
    prepared = prepare(model, processor, examples, progress=True, task=task, next_attention=False)
    # bfloat16 decoding is not batch-invariant: a greedy token can change with the batch it is decoded in
    # (the served decode worker batches the requests in flight); --concurrency 1 decodes both sides alone;
    # --batch-invariant decodes both sides so that each answer is the one it would get alone, at any batch
    one_by_one = args.concurrency == 1 and not batch_invariant
    local, default = _in_process(
        model,
        processor,
        prepared,
        runs,
        target.max_new_tokens,
        profile is not None,
        one_by_one,
        batch_invariant,
    )
    del prepared
    asks = [(policy, budget) for _, policy, budget, _, _ in runs]
    served = ask_served(cfg, model, processor, examples, asks, target.max_new_tokens, args.concurrency)

    def right(texts) -> int:
        return sum(task.is_correct(t, ex) for t, ex in zip(texts, examples, strict=True))

    rows = []
    for (label, policy, _, _, _), (api, usages), mine, dflt in zip(runs, served, local, default, strict=True):
        differ = sum(a.strip() != b.strip() for a, b in zip(api, mine, strict=True))
        expect = profile.label if (profile is not None and policy == "") else ""
        unnamed = sum(u.compression_profile != expect for u in usages)  # naming another (or no) profile
        rows.append((label, right(api), right(mine), right(dflt) if dflt else None, differ, unnamed))
        print(
            f"{label}: api {right(api)} in-process {right(mine)} differ {differ} profile-mismatch {unnamed}"
        )
    md = _markdown(args, target, rows, profile, profile_path, time.perf_counter() - start)
    print("\n".join(md))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() or c == "_" else "_" for c in target.name)
        name = (
            "api_check" + (f"_{slug}" if slug else "") + ("_profile" if profile is not None else "") + ".md"
        )
        (out / name).write_text("\n".join(md) + "\n")
        print(f"wrote {out / name}")
    return 0 if all(r[4] == 0 and r[5] == 0 for r in rows) else 1


def _cell(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{k / n:.3f} ({k}/{n}, {lo:.2f}-{hi:.2f})"


def _markdown(args, target: Target, rows, profile, profile_path: str, wall: float) -> list[str]:
    n = len(target.examples)
    split = getattr(args, "split", "heldout")
    what = f"--compression-profile {profile_path}" if profile is not None else f"--policy {args.policy}"
    member = f" --member {target.name}" if target.name else ""
    dtype = f" --dtype {args.dtype}" if getattr(args, "dtype", "") else ""
    dtype += f" --concurrency {args.concurrency}"
    dtype += " --batch-invariant" if getattr(args, "batch_invariant", False) else ""
    md = [
        f"# Accuracy through the public gRPC API ({target.name or 'the default model'}, {n} examples of split "
        f"{split}, {target.dtype})",
        "",
        f"Command: `vlkv eval api{member} -n {args.n} {what} --budgets {args.budgets}{dtype}`",
        "",
    ]
    head = "| run | accuracy (API) | accuracy (in-process table) | answers that differ | usage not naming the profile |"
    if profile is not None:
        md += [
            f"Profile {profile.label} (model {profile.fingerprint[:12]}, calibrated on "
            f"{profile.prompts.get('count', '?')} prompts): each request names only its budget; the "
            "in-process column evaluates the entry's settings at that budget, beside the default policy's.",
            "",
        ]
        head += " default (in-process) | profile - default (points) |"
    md += [head, "|" + " --- |" * (head.count("|") - 1)]
    for label, api, mine, dflt, differ, unnamed in rows:
        line = f"| {label} | {_cell(api, n)} | {_cell(mine, n)} | {differ}/{n} | {unnamed}/{n} |"
        if profile is not None:
            line += " | |" if dflt is None else f" {_cell(dflt, n)} | {100 * (mine - dflt) / n:+.1f} |"
        md.append(line)
    md += ["", f"Wall time: {wall:.0f} s"]
    return md
