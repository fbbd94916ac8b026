"""Held-out accuracy of a compression profile against the default policy on a zoo member, with the zoo's
own machinery (``tools/eval/zoo.py`` ``run_member``: one prefill per example, every row compressed and
decoded through the in-process engine, the member's ``is_correct``).

    python -m vlkv.tools.calibrate_check --member deep8 --profile P.json [-n 200] [--budgets 0.01,...]

At each budget the profile's row is the entry a server would use (``CompressionProfile.entry_for``); every
entry is decoded at every budget (one row per distinct chosen candidate), and the table reads the one that
applies. Prints a markdown table: full, default, profile, profile - default (points).
"""

from __future__ import annotations

import argparse

from vlkv.common.compression.profile import read_profile
from vlkv.common.compression.registry import DEFAULT_POLICY
from vlkv.tools.eval.zoo import ZOO_BUDGETS, run_member


def check(member: str, profile_path: str, n: int, budgets, seed: int = 0) -> list[str]:
    profile = read_profile(profile_path)
    rows = {}
    for e in profile.entries:
        params = e.policy.to_dict()
        rows.setdefault(f"profile: {e.candidate}", (params.pop("policy"), params))
    configs = [(DEFAULT_POLICY, DEFAULT_POLICY, {})] + [
        (label, p, params) for label, (p, params) in rows.items()
    ]
    out = run_member(member, n, seed, "heldout", configs, budgets)
    lines = [
        f"{member} (held-out, n={n}, full {out['full']:.3f}), profile {profile.label}",
        "",
        "| budget | default | profile (entry) | profile - default |",
        "| --- | --- | --- | --- |",
    ]
    for b in budgets:
        entry = profile.entry_for(b)
        d, p = out["rows"][DEFAULT_POLICY][str(b)], out["rows"][f"profile: {entry.candidate}"][str(b)]
        lines.append(
            f"| {b:g} | {d:.3f} | {p:.3f} ({entry.candidate} @ {entry.budget:g}) | {100 * (p - d):+.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--member", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default=",".join(str(b) for b in ZOO_BUDGETS))
    args = ap.parse_args(argv)
    budgets = tuple(float(b) for b in args.budgets.split(","))
    print("\n".join(check(args.member, args.profile, args.n, budgets, args.seed)))


if __name__ == "__main__":
    main()
