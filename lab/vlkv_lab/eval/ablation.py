"""``vlkv eval ablation``: where VL-Cache's accuracy goes on the default model (common/compression/README.md).

Runs on the held-out split, every example prefilled once (``evaluation.prepare``):

1. scorer x allocator x recent-window swaps at 5/10/20% budgets, with the realized mean k_l per layer;
2. what each policy keeps at 10%: share of vision tokens, the answer's patches, the question's key word;
3. how the answers fail: is the key word repeated (answer token 2), is the colour right when it is;
4. CacheHitRate against the first decoding token and against the deciding step (the query that produces
   the deciding word, answer token 3, teacher-forced over the full cache);
5. oracle caches built from known positions: what a perfect token choice could reach at such budgets.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from vlkv.common.compression.registry import get_policy
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.inputs import prepare_inputs
from vlkv.common.model.spec import ModelSpec
from vlkv.deploy.calibrate.prepared import Recorder
from vlkv.deploy.progress import progress as track
from vlkv.deploy.synthetic_task import GRID, SHAPES, SPAN, TOKENS_PER_IMAGE, is_correct, prompt_text

from vlkv_lab.eval.evaluation import cache_hit_rate, compress, evaluate_caches, policy_stats

BUDGETS = (0.05, 0.10, 0.20)
# (label, policy, params): scorer and allocator swapped one at a time around vlcache
CONFIGS = (
    ("vlcache (post-vision scores, Algorithm 1)", "vlcache", {}),
    ("vlcache scores + uniform", "vlcache", {"allocator": "uniform"}),
    ("vlcache scores + pyramid", "vlcache", {"allocator": "pyramid"}),
    ("vlcache scores + cake", "vlcache", {"allocator": "cake"}),
    ("vlcache, exact budget", "vlcache", {"exact_budget": True}),
    (
        "vlcache, the paper's 10% window only (no post-vision window)",
        "vlcache",
        {"post_vision_window": False},
    ),
    ("vlcache, no recent window", "vlcache", {"recent_ratio": 0.0, "post_vision_window": False}),
    ("snapkv scores (pooled) + Algorithm 1", "snapkv", {"allocator": "sparsity"}),
    ("snapkv scores, pool 1 (= vlcache scores here) + uniform", "snapkv", {"pool_kernel": 1}),
    ("snapkv (pooled) + uniform", "snapkv", {}),
    ("snapkv (pooled) + uniform + post-vision window", "snapkv", {"post_vision_window": True}),
    ("pyramidkv (pooled + pyramid)", "pyramidkv", {}),
    ("random + pyramid", "random", {"allocator": "pyramid"}),
)
KEPT_CONFIGS = (
    ("vlcache", {}),
    ("vlcache", {"allocator": "uniform"}),
    ("snapkv", {}),
    ("pyramidkv", {}),
    ("h2o", {}),
    ("streamingllm", {}),
)
HIT_SCORERS = (
    ("vlcache", {}),
    ("snapkv", {}),
    ("h2o", {}),
    ("zipcache", {}),
    ("streamingllm", {}),
    ("random", {}),
)


class Positions:
    """Prompt positions of one example: vision tokens, the answer's patches, the question's key word."""

    def __init__(self, prep, processor, image_token_id: int) -> None:
        ex = prep.example
        inputs = prepare_inputs(processor, ex.images, prompt_text(processor, ex), image_token_id)
        ids = inputs.input_ids[0].tolist()
        self.inputs = inputs
        self.vision = [i for i, t in enumerate(ids) if t == image_token_id]
        words = processor.tokenizer.convert_ids_to_tokens(ids)
        keys = set(SHAPES) | {"shapes"}
        self.key_word = [i for i in range(prep.m - prep.tau, prep.m) if words[i] in keys]
        self.target: list[int] = []  # the patches of the shapes the answer reads (every shape for counting)
        for im, o in ex.focus:
            r, c = o.cell
            top = self.vision[im * TOKENS_PER_IMAGE] + r * GRID + c
            self.target += [top + dr * GRID + dc for dr in range(SPAN) for dc in range(SPAN)]
        self.text = [i for i in range(prep.m) if i not in set(self.vision)]


@torch.inference_mode()
def deciding_attention(model, processor, prep, pos: Positions) -> list[torch.Tensor]:
    """Per layer ``[H, m]``: full-cache attention of the query at position m+1 (it produces answer token 3,
    the deciding word) over the prompt, teacher-forced with the reference answer."""
    answer = processor.tokenizer(prep.example.answer, add_special_tokens=False).input_ids
    ids = torch.cat([pos.inputs.input_ids, torch.tensor([answer[:2]])], dim=1)
    rec = Recorder()
    model(input_ids=ids, vlkv_stats=rec, **pos.inputs.model_kwargs)
    out = []
    for layer in sorted(rec.q):
        q, k = rec.q[layer], rec.k[layer]
        group = q.shape[0] // k.shape[0]
        s = torch.einsum("hd,hnd->hn", q[:, prep.m + 1].float(), k.repeat_interleave(group, 0).float())
        out.append(torch.softmax(s[:, : prep.m + 2] * rec.scale, dim=-1)[:, : prep.m])
    return out


def oracle_cache(prep, keep) -> CompactKV:
    """A cache keeping ``keep(layer)`` (positions) in every KV head of each layer."""
    ks, vs, kept = [], [], []
    for layer, (k, v) in enumerate(zip(prep.keys, prep.values, strict=True)):
        idx = torch.tensor(sorted(set(keep(layer)))).expand(k.shape[0], -1)
        gather = idx.unsqueeze(-1).expand(-1, -1, k.shape[-1])
        ks.append(k.gather(1, gather))
        vs.append(v.gather(1, gather))
        kept.append(idx)
    return CompactKV(ks, vs, prompt_length=prep.m, first_token=prep.first_token, kept_indices=kept)


def _key_word_breakdown(texts, prepared) -> tuple[float, float]:
    """Colour questions: share whose answer repeats the right key word; accuracy among those."""
    rep = right = total = 0
    for text, p in zip(texts, prepared, strict=True):
        if p.example.category != "colour":
            continue
        total += 1
        words = text.split()
        if len(words) > 1 and words[1] == p.example.answer.split()[1]:
            rep += 1
            right += is_correct(text, p.example)
    return rep / max(total, 1), right / max(rep, 1)


def _fmt(xs, nd=2) -> str:
    return ", ".join(f"{x:.{nd}f}" for x in xs)


def run_ablation(args, model, processor, prepared, full_accuracy: float, start: float) -> int:
    image_token_id = ModelSpec.from_config(model.config, model.dtype, ()).image_token_id
    num_layers = len(prepared[0].keys)
    n = len(prepared)
    pos = [Positions(p, processor, image_token_id) for p in prepared]
    mnt = args.max_new_tokens
    split = getattr(args, "split", "heldout")

    def run(policy, budget, **params):
        caches = [compress(p, policy, budget, **params) for p in prepared]
        return evaluate_caches(model, processor, prepared, caches, policy, budget, mnt)

    md = [
        f"# VL-Cache ablations ({n} examples of split {split}, full cache {full_accuracy:.3f})",
        "",
        f"Command: `vlkv eval ablation -n {n}{'' if split == 'heldout' else f' --split {split}'}`",
        "",
        "## 1. Scorer / allocator / window swaps (accuracy; mean k_l per layer at 10%)",
        "",
        "| configuration | " + " | ".join(f"{b:.0%}" for b in BUDGETS) + " | k_l at 10% |",
        "| --- |" + " --- |" * (len(BUDGETS) + 1),
    ]
    for label, policy, params in track(CONFIGS, desc="ablation: swaps", unit="config"):
        res = {b: run(policy, b, **params) for b in BUDGETS}
        m_mean = sum(p.m for p in prepared) / n
        k10 = [s * m_mean for s in res[0.10].layer_budget_share]
        md.append(
            f"| {label} | " + " | ".join(f"{res[b].accuracy:.2f}" for b in BUDGETS) + f" | {_fmt(k10)} |"
        )
        print(md[-1], flush=True)

    md += [
        "",
        "## 2. What is kept at 10% (per layer L0..L3)",
        "",
        "vision = share of kept slots holding vision tokens; patches = share of the answer's patches kept "
        "(any KV head); key word = share of examples keeping the question's shape word (any KV head).",
        "",
        "| policy | vision | patches | key word |",
        "| --- | --- | --- | --- |",
    ]
    for policy, params in KEPT_CONFIGS:
        pol = get_policy(policy, **params)
        vis = torch.zeros(num_layers)
        tgt = torch.zeros(num_layers)
        key = torch.zeros(num_layers)
        for p, ps in zip(prepared, pos, strict=True):
            stats = policy_stats(p, pol, 0.1)
            kept = pol.plan(stats, p.keys, p.values, alpha=0.1, m=p.m, tau=p.tau, question=p.question)
            vset = set(ps.vision)
            for layer, idx in enumerate(kept):
                flat = idx.flatten().tolist()
                vis[layer] += sum(x in vset for x in flat) / len(flat)
                tgt[layer] += len(set(flat) & set(ps.target)) / max(1, len(ps.target))
                key[layer] += float(bool(set(flat) & set(ps.key_word)))
        label = policy + (f" {params}" if params else "")
        md.append(f"| {label} | {_fmt(vis / n)} | {_fmt(tgt / n)} | {_fmt(key / n)} |")

    md += [
        "",
        "## 3. How the answers fail (colour questions)",
        "",
        "| policy | budget | accuracy | key word repeated | colour right given key word |",
        "| --- | --- | --- | --- | --- |",
    ]
    failures = [(policy, b) for policy in ("vlcache", "snapkv", "pyramidkv") for b in BUDGETS]
    for policy, b in track(failures, desc="ablation: failures", unit="run"):
        r = run(policy, b)
        rep, right = _key_word_breakdown(r.answers, prepared)
        md.append(f"| {policy} | {b:.0%} | {r.accuracy:.2f} | {rep:.2f} | {right:.2f} |")

    pairs = track(
        zip(prepared, pos, strict=True), total=n, desc="ablation: deciding attention", unit="example"
    )
    deciding = [deciding_attention(model, processor, p, ps) for p, ps in pairs]
    md += [
        "",
        "## 4. Attention mass of the full-cache decode (mean over heads and examples)",
        "",
        "| layer | first token: vision | deciding step: vision | deciding: answer's patches | "
        "deciding: key word | post-vision prompt rows: vision |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for layer in range(num_layers):
        cols = [0.0] * 5
        for p, ps, dec in zip(prepared, pos, deciding, strict=True):
            cols[0] += float(p.next_attention[layer][:, ps.vision].sum(-1).mean())
            cols[1] += float(dec[layer][:, ps.vision].sum(-1).mean())
            cols[2] += float(dec[layer][:, ps.target].sum(-1).mean())
            cols[3] += float(dec[layer][:, ps.key_word].sum(-1).mean())
            st = p.stats(p.m - p.tau, 0.01)[layer]
            cols[4] += float(st.col_sum[:, ps.vision].sum(-1).mean()) / p.tau
        md.append(f"| L{layer} | " + " | ".join(f"{c / n:.3f}" for c in cols) + " |")

    md += ["", "CacheHitRate at k = 10% of m (per layer L0..L3; mean):", ""]
    md += ["| scorer | vs first decoding token | vs deciding step |", "| --- | --- | --- |"]
    for policy, params in HIT_SCORERS:
        row = []
        for truth in (None, "deciding"):
            per = [0.0] * num_layers
            for p, dec in zip(prepared, deciding, strict=True):
                rates = cache_rates(p, policy, params, None if truth is None else dec)
                per = [a + b for a, b in zip(per, rates, strict=True)]
            per = [x / n for x in per]
            row.append(f"{_fmt(per)}; {sum(per) / len(per):.2f}")
        md.append(f"| {policy} | {row[0]} | {row[1]} |")

    last = [[p.m - 1] for p in prepared]
    oracles = (
        ("L0-L3: key word + answer's patches + last token", lambda i, layer: pos[i].key_word + pos[i].target),
        (
            "L0: key word + patches + last; L1-3: key word + last",
            lambda i, layer: pos[i].key_word + (pos[i].target if layer == 0 else []),
        ),
        ("L0-L3: patches + last token (no key word)", lambda i, layer: pos[i].target),
        ("L0-L3: key word + last token (no patches)", lambda i, layer: pos[i].key_word),
        ("L0-L3: all text tokens (no vision)", lambda i, layer: pos[i].text),
        (
            "full cache minus the key word in L0",
            lambda i, layer: [j for j in range(prepared[i].m) if not (layer == 0 and j in pos[i].key_word)],
        ),
        (
            "full cache minus the answer's patches in L0",
            lambda i, layer: [j for j in range(prepared[i].m) if not (layer == 0 and j in pos[i].target)],
        ),
        (
            "full cache minus every vision token in L1-3",
            lambda i, layer: [j for j in range(prepared[i].m) if not (layer > 0 and j in set(pos[i].vision))],
        ),
    )
    md += ["", "## 5. Oracle caches", "", "| kept | accuracy | realized ratio |", "| --- | --- | --- |"]
    for label, keep in oracles:
        caches = [
            oracle_cache(p, lambda layer, i=i, keep=keep: keep(i, layer) + last[i])
            for i, p in enumerate(prepared)
        ]
        r = evaluate_caches(model, processor, prepared, caches, "oracle", 0.0, mnt)
        md.append(f"| {label} | {r.accuracy:.2f} | {r.ratio:.3f} |")

    md += ["", f"Wall time: {time.perf_counter() - start:.0f} s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out / 'ablation.md'}")
    return 0


def cache_rates(prep, policy: str, params: dict, truth) -> list[float]:
    return cache_hit_rate(prep, policy, 0.1, truth=truth, **params)
