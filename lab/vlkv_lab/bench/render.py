"""Writes ``vlkv bench all``'s results as ``report.md`` (tables, PNG plots) and ``results.json``."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from vlkv.deploy.synthetic_task import MAX_NEW_TOKENS

from vlkv_lab.bench.compare_systems import COLORS, SYSTEMS, Results


def _f(x, fmt: str = ".1f", none: str = "—") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, fmt)


def _mib(b) -> str:
    return _f(b / (1 << 20), ".2f") if b else "—"


def _ratio(a, b) -> float:
    return a / b if a and b and not math.isnan(a) and not math.isnan(b) else math.nan


def _plot_fig6(res: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for s, points in res.sweeps.items():
        pts = [p for p in points if p["ok"]]
        if not pts:
            continue
        x = [p["throughput_tok_s"] for p in pts]
        axes[0].plot(x, [p["e2e_mean_s"] for p in pts], marker="o", color=COLORS[s], label=SYSTEMS[s])
        axes[1].plot(x, [p["itl_p50_s"] * 1000 for p in pts], marker="o", color=COLORS[s], label=SYSTEMS[s])
        for p, xi in zip(pts, x, strict=True):
            axes[0].annotate(
                str(p["concurrency"]),
                (xi, p["e2e_mean_s"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    axes[0].set_ylabel("mean end-to-end latency per request (s)")
    axes[1].set_ylabel("inter-token latency p50 (ms)")
    for ax in axes:
        ax.set_xlabel("throughput (generated tokens/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    m = res.workload.get("long_prompt_tokens", "?")
    fig.suptitle(f"Throughput vs latency, {m}-token prompts, 100 output tokens (labels: concurrency)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_capacity(res: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    keys = [s for s in ("a", "b", "c") if f"{s}/long" in res.capacity]
    caps = [res.capacity[f"{s}/long"]["admitted"] for s in keys]
    dec = [res.capacity[f"{s}/long"].get("decode_tok_s", math.nan) for s in keys]
    labels = [SYSTEMS[s] for s in keys]
    axes[0].bar(labels, caps, color=[COLORS[s] for s in keys])
    axes[0].set_ylabel("sequences held at once")
    axes[0].set_title(f"Concurrency in {res.plan.kv_mb:g} MiB of KV")
    axes[1].bar(labels, dec, color=[COLORS[s] for s in keys])
    axes[1].set_ylabel("decode tokens/s")
    axes[1].set_title("Decode throughput at that concurrency")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(res: Results, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(asdict(res), indent=1, default=str))
    _plot_fig6(res, out / "fig6_throughput_latency.png")
    _plot_capacity(res, out / "capacity.png")
    (out / "report.md").write_text("\n".join(_markdown(res)) + "\n")


def _markdown(res: Results) -> list[str]:
    mc, plan, wl = res.machine, res.plan, res.workload
    v = mc["versions"]
    total = res.timings.get("total_s", 0)
    md = [
        "# vlkv benchmark report",
        "",
        f"- Command: `{res.command}` ({'quick' if plan.quick else 'full'} run), "
        f"duration **{total / 60:.1f} min** ({total:.0f} s)",
        f"- Date: {mc['date']}",
        f"- Machine: {mc['cpu']}, {mc['cores']} cores, {mc['memory']} RAM, {mc['os']}, no GPU",
        f"- Versions: python {v.get('python')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"grpcio {v.get('grpc')}, ray {v.get('ray')}, numpy {v.get('numpy')}",
        f"- Load average (1/5/15 min) at start {tuple(round(x, 2) for x in mc['load_avg_start'])}, at end "
        f"{tuple(round(x, 2) for x in mc.get('load_avg_end', (0, 0, 0)))}: the machine is shared, so absolute "
        "times carry that noise; the three systems ran one after another in the same invocation.",
        "",
    ]
    for n in res.notes:
        md.append(f"> **Note:** {n}")
        md.append("")
    md += [
        "## Setup",
        "",
        f"- Systems: {SYSTEMS['a']}; {SYSTEMS['b']}; {SYSTEMS['c']}. (a) and (b) are one deployment "
        "(`vlkv serve`: Ray `LocalCluster`, 1 prefill + 1 decode worker actor, 1 torch thread each, gateway "
        "in the serve process); the policy is a request parameter. (c) is `python -m vlkv_lab.bench.hf_baseline` "
        "(one process, 1 torch thread, static batches through `model.generate`, padded left, tokens streamed "
        "per step by a `transformers` streamer; 1 thread because with 2 its `generate()` ran ~5x slower on "
        "this shared machine, OpenMP threads contending with the other load). Each server is its own process; the load generator "
        "(`vlkv_lab.loadgen`, grpc.aio) runs in the bench process and speaks the public API to all three.",
        f"- Same KV memory: **{plan.kv_mb:g} MiB** per system: vlkv's decode-worker pool (`--pool-mb "
        f"{plan.kv_mb:g}`, 16-token blocks, default admission `grow`: a cache takes the blocks of its own tokens, sequences "
        "take blocks as they decode and the newest is preempted to host memory when the pool fills); "
        "the HF baseline caps a batch at n sequences with n x (padded prompt + max_new_tokens) x "
        "(full KV bytes per token) <= the budget.",
        f"- Models: fidelity on `{res.models.get('eval')}`. Speed runs on a copy "
        f"(`{res.models.get('speed')}`) with the same weights, the context raised to "
        f"{plan.long_tokens + plan.max_new_tokens + 256} positions and no end-of-sequence token, so every "
        f"request decodes exactly {plan.max_new_tokens} tokens in all three systems (answers past the trained "
        "length are meaningless; speed is not affected).",
        f"- Short prompts: the synthetic task as is (1-2 images of {wl.get('tokens_per_image')} vision tokens, the question): "
        f"{wl.get('short_prompt_tokens_min')}-{wl.get('short_prompt_tokens_max')} tokens "
        f"(mean {_f(wl.get('short_prompt_tokens_mean'), '.0f')}).",
        f'- "2K" prompts: {wl.get("long_images")} images (the gateway\'s limit; {wl.get("long_images", 0) * (wl.get("tokens_per_image") or 0)} '
        f"vision tokens) after a text context of {wl.get('long_filler_words')} task-vocabulary words, question "
        f"last: **{wl.get('long_prompt_tokens')} tokens** each (counted by the model's processor; the servers "
        "report the same in `usage.prompt_tokens`).",
        f"- Every request: greedy, {plan.max_new_tokens} new tokens; (a) `policy=vlcache, budget={plan.budget}`, "
        "(b) and (c) `policy=full`.",
        "",
    ]
    md += _capacity_section(res)
    md += _fig6_section(res)
    md += _table2_section(res)
    md += _ttft_section(res)
    md += _fidelity_section(res)
    md += _targets_section(res)
    md += _reading_section(res)
    t = res.timings
    md += [
        "## Run time",
        "",
        "| phase | seconds |",
        "| --- | --- |",
        *[f"| {k} | {v:.0f} |" for k, v in t.items()],
        "",
        "## Commands",
        "",
        f"Everything above: `{res.command}` (writes `report.md`, `results.json`, the PNGs and `logs/`).",
        "Each figure's own command (the same code the report runs):",
        "",
        f"- servers: `vlkv serve --model SPEED_MODEL --port P --pool-mb {plan.kv_mb:g} --max-batch 1024 "
        f"--threads 1` and `python -m vlkv_lab.bench.hf_baseline --model SPEED_MODEL --port P --kv-budget-mb "
        f"{plan.kv_mb:g} --threads 1 --collect-ms 20`",
        f"- Figure 6 points: `python -m vlkv_lab.loadgen --address HOST:P --concurrency C -n N "
        f"--images-per-prompt {wl.get('long_images')} --filler-words {wl.get('long_filler_words')} "
        f"--max-new-tokens {plan.max_new_tokens} --policy vlcache --budget {plan.budget}` (`--policy full` for "
        f"(b) and (c)), N = max(4, {plan.requests_per_level:g} C)",
        "- Table 2 cells: the same with `--concurrency B -n B` (and without `--images-per-prompt/--filler-words` "
        "for the short prompts)",
        "- Capacity and decode-phase throughput: `vlkv_lab.bench.compare_systems.probe_capacity` (worker API, "
        "described in section 1); for (c) one batch of its capacity through the load generator",
        f"- Fidelity: `vlkv eval --policy P --budget B -n {res.fidelity.get('n', plan.eval_n)}` for each row; "
        "kvpress rows: `vlkv_lab.bench.kvpress.run_kvpress`",
        "",
    ]
    return md


def _capacity_section(res: Results) -> list[str]:
    cap, plan = res.capacity, res.plan
    if "a/long" not in cap:
        return []
    a, b, c = cap.get("a/long", {}), cap.get("b/long", {}), cap.get("c/long", {})
    md = [
        "## 1. Concurrency in the same KV memory, and decode throughput there",
        "",
        f"{res.workload.get('long_prompt_tokens')}-token prompts, {plan.max_new_tokens} output tokens, "
        f"{plan.kv_mb:g} MiB of KV. ![capacity](capacity.png)",
        "",
        "| system | sequences held at once | decoding at once (mean) | KV per sequence (kept / full, MiB) "
        "| blocks per sequence | refusal that ended the count | decode-phase throughput (tok/s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s, d in (("a", a), ("b", b)):
        md.append(
            f"| {SYSTEMS[s]} | **{d['admitted']}** | {_f(d.get('decoding_mean'), '.1f')} "
            f"| {_mib(d['kv_bytes_kept_mean'])} / {_mib(d['kv_bytes_full_mean'])} "
            f"| {_f(d['blocks_per_sequence_mean'], '.0f')} of {d['total_blocks']} | {d['refusal'].split(':')[0]} "
            f"| {_f(d['decode_tok_s'], '.0f')} |"
        )
    if c:
        md.append(
            f"| {SYSTEMS['c']} | **{c['admitted']}** | {c['admitted']} | {_mib(c['kv_bytes_full_mean'])} / "
            f"{_mib(c['kv_bytes_full_mean'])} | — | the batch cap (queues the rest) | {_f(c.get('decode_tok_s'), '.0f')} |"
        )
    for key in ("a/short", "b/short"):
        if key in cap:
            d = cap[key]
            md.append(
                f"| {SYSTEMS[key[0]]}, short prompts ({_f(d['prompt_tokens_mean'], '.0f')} tokens) | {d['admitted']} | "
                f"{_f(d.get('decoding_mean'), '.1f')} | {_mib(d['kv_bytes_kept_mean'])} / {_mib(d['kv_bytes_full_mean'])} | "
                f"{_f(d['blocks_per_sequence_mean'], '.0f')} of {d['total_blocks']} | {d['refusal'].split(':')[0]} | "
                f"{_f(d['decode_tok_s'], '.0f')} |"
            )
    md += [
        "",
        "How it is counted. vlkv: compact caches are handed to the decode worker the way a request's are "
        "(prefill worker -> policy -> `TransferKV`; the decode worker's default admission takes the blocks of "
        "the compact cache, leaving 1% of the pool free), but no `Decode` stream claims them yet, so they stay "
        "resident; the count is the caches admitted before the first RESOURCE_EXHAUSTED. While the pool was "
        "full a public `Generate` with a 3 s deadline got: (a) "
        f"{a.get('public_generate_when_full')}, (b) {b.get('public_generate_when_full')} (DEADLINE_EXCEEDED: "
        "held in the gateway's admission queue). Then one `Decode` stream per held cache is opened at once, "
        "so they all decode as one continuous batch, taking blocks as they grow, the newest preempted to host "
        f"memory when the pool runs out (preemptions: (a) {a.get('preemptions', '—')}, (b) "
        f"{b.get('preemptions', '—')}): that is the decode-phase throughput (generated tokens from the first "
        "streamed token to the last). "
        f"Free blocks after those finished: (a) {a.get('free_blocks_after_decode')}/{a.get('total_blocks')}, "
        f"(b) {b.get('free_blocks_after_decode')}/{b.get('total_blocks')} (nothing leaked). "
        "HF baseline: its cap is floor(budget / ((prompt + 100) x full KV bytes per token)); one batch of "
        f"that many requests through the public API gives its decode-phase throughput (the largest batch it "
        f"formed in the whole run, short prompts included, was {c.get('max_batch_seen', '—')}).",
        f"Realized compression of (a): {_f(a.get('compression_ratio_mean'), '.3f')} of the prompt's KV "
        f"(per-layer budgets from attention sparsity); the {plan.max_new_tokens} output tokens per layer are "
        "not compressed and grow every sequence while it decodes, so the sequences that decode at once are "
        "fewer than those admitted, and the gain is below 1/ratio.",
        "",
    ]
    return md


def _fig6_section(res: Results) -> list[str]:
    if not res.sweeps:
        return []
    md = [
        "## 2. Throughput against latency (paper Figure 6)",
        "",
        f"Closed loop at each concurrency C (C streams, each sending its next request when the last ends), "
        f"{res.workload.get('long_prompt_tokens')}-token prompts, {res.plan.max_new_tokens} output tokens. "
        "vlkv refuses what its pool cannot hold (RESOURCE_EXHAUSTED, counted as errors); the HF baseline queues.",
        "",
        "![throughput vs latency](fig6_throughput_latency.png)",
        "",
        "| system | C | requests ok / sent | errors | throughput (tok/s) | decode-phase tok/s | TTFT p50 (s) | "
        "ITL p50 (ms) | e2e mean (s) | e2e p90 (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s, points in res.sweeps.items():
        for p in points:
            errs = ", ".join(f"{k} {n}" for k, n in p["errors"].items()) or "0"
            md.append(
                f"| {SYSTEMS[s]} | {p['concurrency']} | {p['ok']}/{p['requests']} | {errs} | "
                f"{_f(p['throughput_tok_s'])} | {_f(p.get('decode_phase_tok_s'))} | {_f(p['ttft_p50_s'], '.2f')} | "
                f"{_f(p['itl_p50_s'] * 1000)} | {_f(p['e2e_mean_s'], '.2f')} | {_f(p['e2e_p90_s'], '.2f')} |"
            )
    md.append("")
    return md


def _table2_section(res: Results) -> list[str]:
    if not res.table2:
        return []
    plan, wl = res.plan, res.workload
    md = [
        "## 3. End-to-end latency for 100 output tokens by batch size and prompt length (paper Table 2)",
        "",
        "B requests sent at once; time until the last of them has its 100th token (seconds). Speedup = "
        "the other system's time / (a)'s. A vlkv cell with failures shows how many of the B its pool could "
        "not hold (refused; no speedup is computed for it); the HF baseline queues instead.",
        "",
        "| prompt | B | (a) vlkv 10% | (b) vlkv full | (c) HF | speedup (a) vs (b) | speedup (a) vs (c) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    names = {
        "short": f"short (~{_f(wl.get('short_prompt_tokens_mean'), '.0f')} tokens)",
        "long": f"{wl.get('long_prompt_tokens')} tokens",
    }
    for kind in ("short", "long"):
        for b in plan.table2_batches:
            cells, times = [], {}
            for s in ("a", "b", "c"):
                d = res.table2.get(f"{s}/{kind}/{b}")
                if d is None:
                    cells.append("—")
                    continue
                refused = d["requests"] - d["ok"]
                t = d["batch_e2e_s"] if d["ok"] else math.nan
                times[s] = t if not refused else math.nan
                codes = ", ".join(f"{k} {n}" for k, n in d["errors"].items())
                note = f" ({refused} of {b} failed: {codes})" if refused else ""
                cells.append(f"{_f(t, '.2f')}{note}")
            sab = _ratio(times.get("b"), times.get("a"))
            sac = _ratio(times.get("c"), times.get("a"))
            xs = [f"{_f(x, '.2f')}x" if not math.isnan(x) else "—" for x in (sab, sac)]
            md.append(f"| {names[kind]} | {b} | {' | '.join(cells)} | {xs[0]} | {xs[1]} |")
    md.append("")
    return md


def _ttft_section(res: Results) -> list[str]:
    if not res.table2:
        return []
    md = [
        "## 4. Time to first token, KV hand-off included",
        "",
        "One request at a time (B = 1 cells of section 3). TTFT as the client sees it: for vlkv it spans "
        "gateway validation, prefill (with attention statistics and compression for (a)), the KV hand-off "
        "to the decode worker and the first token's way back; the HF baseline's is its batch prefill. The "
        "prefill and transfer split is the prefill worker's own account during the capacity probe.",
        "",
        "| system | prompt | TTFT p50, client (ms) | TTFT, server's usage (ms) | KV handed off (MiB) | "
        "prefill (ms) | KV transfer (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in ("short", "long"):
        for s in ("a", "b", "c"):
            d = res.table2.get(f"{s}/{kind}/1")
            if d is None:
                continue
            probe = res.capacity.get(f"{s}/{kind}", {})
            handed = _mib(d.get("kv_bytes_kept_mean")) if s != "c" else "— (colocated)"
            md.append(
                f"| {SYSTEMS[s]} | {kind} ({_f(d['prompt_tokens_mean'], '.0f')} tokens) | "
                f"{_f(d['ttft_p50_s'] * 1000, '.0f')} | {_f(d.get('server_ttft_ms_p50'), '.0f')} | {handed} | "
                f"{_f(probe.get('prefill_ms_mean'), '.0f')} | {_f(probe.get('transfer_ms_mean'), '.1f')} |"
            )
    md.append("")
    return md


def _fidelity_section(res: Results) -> list[str]:
    fid, kp = res.fidelity, res.kvpress
    if not fid:
        return []
    md = [
        "## 5. Fidelity beside speed",
        "",
        f"Held-out split of the synthetic task, {fid['n']} examples (prompts ~{_f(fid.get('prompt_tokens_mean'), '.0f')} "
        f"tokens), greedy, {MAX_NEW_TOKENS} new tokens, accuracy read from the decoded answer (the deciding word comes after "
        "the first token, so it is decoded from the compressed cache). vlkv rows: "
        "`vlkv_lab.eval.evaluation.prepare/evaluate` (the prefill worker's compression, the decode worker's "
        "paged decode). kvpress rows: the press's own `compress()` on the same model and examples, decoded "
        "by the same paged decode path.",
        "",
        "| source | policy / press | KV budget | accuracy | realized KV ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in fid["rows"]:
        md.append(f"| vlkv | {r['policy']} | {r['budget']:.0%} | {r['accuracy']:.3f} | {r['ratio']:.3f} |")
    for r in kp.get("rows", []):
        if "error" in r:
            md.append(
                f"| kvpress {kp.get('version')} | {r['press']} | {r['budget']:.0%} | error: {r['error']} | — |"
            )
        else:
            md.append(
                f"| kvpress {kp.get('version')} | {r['press']} | {r['budget']:.0%} | {r['accuracy']:.3f} | "
                f"{r['ratio']:.3f} |"
            )
    md.append("")
    md.append(f"kvpress: {kp.get('note', 'not run (--kvpress off)')}.")
    if kp.get("available"):
        md += [
            "",
            "kvpress 0.5.5 pins `transformers<5.3` (this environment has "
            f"{res.machine['versions'].get('transformers')}), so it is loaded from its own directory with "
            "`--no-deps` rather than installed into the project. Its own entry point, `with press(model):` "
            f"(a forward hook on each attention layer), fails here with `{kp.get('hook_path_error') or 'no error'}`: "
            "transformers 5.x no longer passes `cache_position` to attention layers. The bench applies each "
            "press through its `compress()` on the inputs that hook would see (hidden states, post-RoPE keys "
            "and values, position embeddings, eager attention weights), so kvpress's scoring and selection run "
            "unmodified. kvpress's default SnapKV/PyramidKV window (64) exceeds these prompts (it asserts "
            "q_len > window), so window 8 is used, vlkv's default. kvpress does not list LLaVA as supported; "
            "its hooks target the Mistral decoder inside it, which is what vlkv compresses too.",
            "",
            "Keep-set check (same prompts; share of (layer, KV head) keep-sets, mean Jaccard):",
            "",
            "| comparison | settings | mean Jaccard | identical keep-sets |",
            "| --- | --- | --- | --- |",
        ]
        for r in kp.get("keep_sets", []):
            md.append(f"| {r['comparison']} | {r['settings']} | {r['jaccard']:.3f} | {r['identical']:.0%} |")
        md += [
            "",
            "Where they differ, and why:",
            "",
            "- SnapKV, matched settings (same window w, no pooling, same k, the window kept whole on both "
            "sides): the same scores (softmax of the last w queries over all keys, summed over the window "
            "and over a GQA group; kvpress averages, which ranks the same) and the same selection, so the "
            "keep-sets should be identical; any difference is a float tie.",
            "- SnapKV, each at its defaults: kvpress keeps the whole observation window (w tokens, forced by "
            "giving them the maximum score) and smooths with an average pool of width 5; vlkv keeps a recent "
            "window of ceil(10% of k) tokens and smooths with a max pool of width 7 (a strongly attended "
            "token pulls its neighbours in). When k <= w (prompts of under ~80 tokens at 10%) kvpress's top-k "
            "falls entirely inside its tied window scores and the choice among them is topk's tie order.",
            "- StreamingLLM, matched k: both keep 4 sinks + the most recent k - 4 tokens: identical. At "
            "defaults they differ only in k: vlkv ceil(0.1 m), kvpress int(m (1 - 0.9)) (floor, and one "
            "lower again when m (1 - 0.9) lands just below an integer in floating point).",
            "- ObservedAttention vs vlkv `zipcache`: both score a key by its attention summed over all "
            "queries divided by the number of queries that can see it; with no recent window and the same "
            "k they keep the same tokens. vlkv's `h2o` is the unnormalized sum (favours early tokens).",
            "- PyramidKV: kvpress's layer budgets follow KVCache-Factory's formula (window + linear steps, "
            "falling back to uniform when the pyramid does not fit a short prompt); vlkv's `pyramidkv` uses "
            "a linear schedule with the same total and no window term, so per-layer k differ and the sets "
            "are not compared token by token.",
        ]
    md.append("")
    return md


def _targets_section(res: Results) -> list[str]:
    cap = res.capacity
    a, b, c = cap.get("a/long", {}), cap.get("b/long", {}), cap.get("c/long", {})
    if not a or not b or not c:
        return []
    ca, cb, cc = a["admitted"], b["admitted"], c["admitted"]
    r_ab, r_ac = _ratio(ca, cb), _ratio(ca, cc)
    da, dc = a.get("decode_tok_s", math.nan), c.get("decode_tok_s", math.nan)
    r_dec = _ratio(da, dc)
    pub_a = _at_level(res.sweeps.get("a", []), ca)
    pub_c = _at_level(res.sweeps.get("c", []), cc)
    r_pub = _ratio(pub_a.get("throughput_tok_s"), pub_c.get("throughput_tok_s"))
    ok1 = r_ab >= 5 and r_ac >= 5
    ok2 = r_dec >= 3
    md = [
        "## 6. Targets of issue 8",
        "",
        "| target | measured | verdict |",
        "| --- | --- | --- |",
        f"| (a) holds >= 5x the concurrency of (b) and (c), same KV memory, {res.workload.get('long_prompt_tokens')}"
        f"-token prompts | {ca} vs {cb} and {cc}: {_f(r_ab, '.2f')}x and {_f(r_ac, '.2f')}x | "
        f"{'**met**' if ok1 else '**missed**'} |",
        f"| decode throughput of (a) at its highest concurrency >= 3x that of (c) at its own | {_f(da, '.0f')} "
        f"vs {_f(dc, '.0f')} tok/s: {_f(r_dec, '.2f')}x | {'**met**' if ok2 else '**missed**'} |",
        f"| (sequences decoding at once while the held caches grow by their output tokens, mean) | "
        f"{_f(a.get('decoding_mean'), '.1f')} vs {_f(b.get('decoding_mean'), '.1f')} and {cc}: "
        f"{_f(_ratio(a.get('decoding_mean'), b.get('decoding_mean')), '.2f')}x and "
        f"{_f(_ratio(a.get('decoding_mean'), cc), '.2f')}x | (context) |",
        f"| (same, end to end through the public API: closed loop at each one's capacity, prefill included) | "
        f"{_f(pub_a.get('throughput_tok_s'), '.0f')} vs {_f(pub_c.get('throughput_tok_s'), '.0f')} tok/s: "
        f"{_f(r_pub, '.2f')}x | (context) |",
        "",
    ]
    expl = []
    if not ok1:
        expl.append(
            "Concurrency: every sequence grows by its 100 output tokens in every layer, uncompressed; with ~205 "
            "kept prompt tokens per layer at 10% of 2K, that growth is half the compact cache, and block "
            "rounding adds to it, so the sequences decoding at once are bounded by (m + 100) / (0.1 m + 100)."
        )
    if not ok2:
        expl.append(
            "Decode throughput: on this CPU the tiny model's decode step is dominated by per-step fixed costs "
            "(Python, the per-layer paged-attention reference, gRPC streaming of each token), not by reading KV, "
            "so more sequences per step add tokens less than proportionally; and the HF baseline's static "
            "batch runs a fused SDPA over a contiguous cache. The paper's 3x comes from GPU decode being bound "
            "by KV reads, which this machine does not reproduce."
        )
    if expl:
        md += ["Why:", "", *[f"- {e}" for e in expl], ""]
    return md


def _at_level(points: list[dict], level: int) -> dict:
    for p in points:
        if p["concurrency"] == level:
            return p
    return {}


def _reading_section(res: Results) -> list[str]:
    """Caveats computed from the measurements: where the numbers come from and what bounds them."""
    md = ["## 7. Reading the numbers", ""]
    cap_a = res.capacity.get("a/long", {}).get("admitted")
    top = _at_level(res.sweeps.get("a", []), cap_a) if cap_a else {}
    probe = res.capacity.get("a/long", {})
    if top:
        md.append(
            f"- Through the public API at C = {cap_a}, (a)'s TTFT p50 is {_f(top['ttft_p50_s'], '.1f')} s while its "
            f"inter-token latency p50 is {_f(top['itl_p50_s'] * 1000, '.0f')} ms: requests queue for the single "
            f"prefill worker (about {_f(probe.get('prefill_ms_mean'), '.0f')} ms per 2K prompt on one core), so the "
            "decode worker is fed fewer sequences than its pool holds. The decode-phase figures of section 1 "
            "(caches pre-admitted, all decoding together) show what the decode side does with a full pool; "
            "end-to-end throughput at that concurrency needs more prefill workers (`--prefill N`), which this "
            "2-core machine cannot give."
        )
    short = [res.table2.get(f"{s}/short/16", {}).get("batch_e2e_s") for s in ("a", "b", "c")]
    if all(x is not None for x in short):
        md.append(
            f"- Short prompts (~{_f(res.workload.get('short_prompt_tokens_mean'), '.0f')} tokens): 16 at once take "
            f"{_f(short[0], '.2f')} s / {_f(short[1], '.2f')} s / {_f(short[2], '.2f')} s for (a) / (b) / (c). "
            "Their caches are tiny, so compression saves nothing that matters and costs the statistics pass; the "
            "one-process HF baseline has no hand-off or per-token gRPC hops. vlkv's gains are a long-prompt effect."
        )
    odd = {}
    for key, d in [*res.table2.items(), *((f"sweep {k}", p) for k, v in res.sweeps.items() for p in v)]:
        if key.startswith("c/"):
            continue
        for code, n in d.get("errors", {}).items():
            if code != "RESOURCE_EXHAUSTED":
                odd[code] = odd.get(code, 0) + n
    refusals = {k: v.get("refusal", "") for k, v in res.capacity.items() if v.get("refusal")}
    odd_probe = {k: r for k, r in refusals.items() if not r.startswith("RESOURCE_EXHAUSTED")}
    if odd or odd_probe:
        md.append(
            "- Finding for vlkv: when the decode worker's pool is full, a request should end with "
            "RESOURCE_EXHAUSTED; here some ended otherwise: "
            + ", ".join(f"{n} x {c}" for c, n in odd.items())
            + "".join(
                f"; the capacity probe's refusal ({k}) came back as `{r[:120]}`" for k, r in odd_probe.items()
            )
            + ". They appear to be refusals of full (4 MiB) caches arriving after the gateway's free-block check had "
            "passed; the refusal reaches the sender as a broken stream instead of the decode worker's status."
        )
    md.append(
        "- All three systems share 2 cores with other work (see the load average); vlkv's prefill and decode "
        "workers each have a core, the HF baseline one process with one thread."
    )
    md.append("")
    return md


def main(argv: list[str] | None = None) -> int:
    """Re-render ``report.md`` and the plots from a ``results.json`` (no measurement)."""
    import argparse

    from vlkv_lab.bench.compare_systems import Plan

    p = argparse.ArgumentParser(prog="python -m vlkv_lab.bench.render")
    p.add_argument("results", help="results.json written by vlkv bench all")
    args = p.parse_args(argv)
    path = Path(args.results)
    d = json.loads(path.read_text())
    d["plan"] = Plan(**d["plan"])
    render(Results(**d), path.parent)
    print(f"wrote {path.parent / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
