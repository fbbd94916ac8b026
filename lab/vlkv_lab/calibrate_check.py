"""Held-out accuracy of the default policy beside a compression profile or other rows, with the zoo's own
machinery (``lab/vlkv_lab/eval/zoo_scoring.py``: one prefill per example, every row compressed and decoded through
the in-process engine, the task's ``is_correct``; no oracle rows), each with its 95% Wilson interval.

    python -m vlkv_lab.calibrate_check --member deep8 --profile P.json [-n 200] [--budgets 0.01,...]
    python -m vlkv_lab.calibrate_check --text-suite [--tasks needle,multikey,kv] [--length 1024] [-n 8]
        [--profile P.json]

With a profile, at each budget its row is the entry a server would use (``CompressionProfile.entry_for``):
every entry is decoded at every budget (one row per distinct chosen candidate) and the table reads the one
that applies. ``--text-suite``: SmolLM2's text-only wrapper on the real-text suite (``lab/vlkv_lab/zoo``), with the
text-only rows (vlcache, vlcache with every row scoring as before #38, snapkv, pyramidkv).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from vlkv.common.compression.profile import CompressionProfile, read_profile
from vlkv.common.compression.registry import DEFAULT_POLICY

from vlkv_lab.eval.zoo import ZOO_BUDGETS, evaluate_many
from vlkv_lab.eval.zoo_scoring import wilson

TEXT_ROWS = [
    (DEFAULT_POLICY, DEFAULT_POLICY, {}),
    ("vlcache, every row (before #38)", DEFAULT_POLICY, {"text_window": 0}),
    ("snapkv", "snapkv", {}),
    ("pyramidkv", "pyramidkv", {}),
]


def profile_rows(profile: CompressionProfile) -> list[tuple[str, str, dict]]:
    rows: dict[str, tuple[str, dict]] = {}
    for e in profile.entries:
        params = e.policy.to_dict()
        rows.setdefault(f"profile: {e.candidate}", (params.pop("policy"), params))
    return [(label, p, params) for label, (p, params) in rows.items()]


def _acc(a: float, n: int) -> str:
    """The accuracy with its 95% Wilson interval when n is known."""
    if not n:
        return f"{a:.3f}"
    lo, hi = wilson(round(a * n), n)
    return f"{a:.3f} ({lo:.2f}-{hi:.2f})"


def _cells(accs: dict, b: float, profile: CompressionProfile | None, labels, n: int = 0) -> list[str]:
    cells = [_acc(accs[label][str(b)], n) for label in labels]
    if profile is not None:
        e = profile.entry_for(b)
        p, d = accs[f"profile: {e.candidate}"][str(b)], accs[DEFAULT_POLICY][str(b)]
        cells.append(f"{_acc(p, n)} ({e.candidate} @ {e.budget:g}) | {100 * (p - d):+.1f}")
    return cells


def _table(title: str, accs: dict, budgets, profile, labels, n: int = 0) -> list[str]:
    head = ["budget", *labels] + (["profile (entry)", "profile - default"] if profile else [])
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += [f"| {b:g} | " + " | ".join(_cells(accs, b, profile, labels, n)) + " |" for b in budgets]
    return lines


def _member(name: str, n: int, seed: int, rows_at, budgets, chunk: int = 50) -> dict:
    """A zoo member's held-out rows as ``vlkv eval zoo`` scores them (``zoo_scoring``: one prefill per
    example, the full cache's answers, every row compressed and decoded through the in-process engine), at
    each budget only the rows ``rows_at(budget)`` (the default and the profile's entry there), without the
    oracle rows this check does not read."""
    from vlkv.deploy.progress import progress as track

    from vlkv_lab.eval.evaluation import prepare
    from vlkv_lab.eval.zoo_report import finalize
    from vlkv_lab.eval.zoo_scoring import full_answers, merge, score_rows
    from vlkv_lab.zoo import member
    from vlkv_lab.zoo.accuracy import load_member

    mod = member(name)
    model, processor = load_member(mod)
    examples = mod.make_examples(n, seed=seed, split="heldout")
    hits: dict = {}
    for at in track(range(0, n, chunk), desc=name, unit=f"{chunk} examples"):
        prepared = prepare(
            model, processor, examples[at : at + chunk], progress=False, task=mod, next_attention=False
        )
        full_ids, right = full_answers(model, processor, prepared, mod.max_new_tokens)
        for b in budgets:
            part = score_rows(
                model, processor, prepared, full_ids, rows_at(b), [b], mod.max_new_tokens, oracle=False
            )
            merge(right, part)
        merge(hits, right)
        del prepared
    return finalize({"hits": hits})


def check_member(member: str, profile_path: str, n: int, budgets, seed: int = 0) -> list[str]:
    """``member``: a zoo member, or ``text:TASK[:LENGTH]`` (the real-text suite's task on SmolLM2 in bfloat16,
    the rows ``vlkv eval zoo --members text`` scores; 1,024 tokens unless given)."""
    profile = read_profile(profile_path)
    configs = [(DEFAULT_POLICY, DEFAULT_POLICY, {}), *profile_rows(profile)]
    if member.startswith("text:"):
        out = _text_task(member, n, seed, configs, budgets)
    else:

        def rows_at(b: float) -> list:
            mine = f"profile: {profile.entry_for(b).candidate}"
            return [c for c in configs if c[0] in (DEFAULT_POLICY, mine)]

        out = _member(member, n, seed, rows_at, budgets)
    title = f"{member} (held-out, n={n}, full {out['full']:.3f}), profile {profile.label}"
    return _table(title, out["rows"], budgets, profile, [DEFAULT_POLICY], n)


def _text_task(name: str, n: int, seed: int, configs, budgets) -> dict:
    from vlkv_lab.eval.zoo_report import finalize
    from vlkv_lab.eval.zoo_text import TextTask, load_text_model, run_task
    from vlkv_lab.zoo import text_suite as ts

    _, task, *length = name.split(":")
    model, processor = load_text_model()
    t = TextTask(
        task, int(length[0]) if length else 1024, processor.tokenizer, max_new_tokens=ts.max_new_tokens(task)
    )
    return finalize(run_task(model, processor, t, n, seed, "heldout", configs, budgets, 25, oracle=False))


def check_text_suite(tasks, length: int, n: int, budgets, profile_path: str = "") -> list[str]:
    from vlkv.common.config import ModelConfig
    from vlkv.common.model.loading import load_model, load_processor

    from vlkv_lab.eval.evaluation import evaluate, prepare
    from vlkv_lab.zoo import text_suite as ts
    from vlkv_lab.zoo.smollm2 import text_checkpoint

    class Task:  # evaluation.prepare's and evaluate_many's task interface over text-suite items
        @staticmethod
        def prompt_text(processor, ex) -> str:
            return ts.prompt_text(processor, ex.item)

        @staticmethod
        def is_correct(text: str, ex) -> bool:
            return ts.is_correct(text, ex.item)

    profile = read_profile(profile_path) if profile_path else None
    configs = TEXT_ROWS + (profile_rows(profile) if profile else [])
    path = str(text_checkpoint())
    model, processor = load_model(ModelConfig(path=path)), load_processor(path)
    lines = []
    for task in tasks:
        items = ts.items(task, length, "heldout", n=n, seed=0, tokenizer=processor.tokenizer)
        prepared = prepare(model, processor, [SimpleNamespace(images=[], item=i) for i in items], task=Task)
        full = evaluate(model, processor, prepared, "full", 1.0, ts.MAX_NEW_TOKENS).accuracy
        accs: dict = {}
        for b in budgets:
            for label, acc in evaluate_many(
                model, processor, prepared, configs, b, ts.MAX_NEW_TOKENS, {}
            ).items():
                accs.setdefault(label, {})[str(b)] = acc
        title = f"{task} {length} tokens (held-out, n={n}, full {full:.3f})"
        lines += _table(title, accs, budgets, profile, [c[0] for c in TEXT_ROWS]) + [""]
        del prepared
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--member", default="")
    ap.add_argument("--text-suite", action="store_true")
    ap.add_argument("--tasks", default="needle,multikey,kv")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--profile", default="")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default=",".join(str(b) for b in ZOO_BUDGETS))
    args = ap.parse_args(argv)
    budgets = tuple(float(b) for b in args.budgets.split(","))
    if args.text_suite:
        lines = check_text_suite(args.tasks.split(","), args.length, args.n, budgets, args.profile)
    elif args.member and args.profile:
        lines = check_member(args.member, args.profile, args.n, budgets, args.seed)
    else:
        ap.error("give --member NAME --profile PATH, or --text-suite")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
