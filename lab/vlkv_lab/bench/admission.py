"""How many 2K-token sequences one decode pool holds with 10% vs 100% caches (no model, no timing).

``python -m vlkv_lab.bench.admission [--pool-gib 2]`` (also part 1 of ``bench_decode``)

On the full 32-layer LLaVA-Mistral-7B layout (8 KV heads, head dim 128, fp16, 16-token blocks), with the
decode worker's own ``BlockManager`` (exact accounting; the pool sized by a ``KVCache`` on the ``meta``
device, no memory), its ``AdmissionPolicy`` and its ``Scheduler``:

1. Admitted: caches handed to an empty pool one after another until admission refuses one, under each
   admission policy: ``grow`` (the default: blocks of the cache itself, 1% of the pool kept free) and
   ``reserve`` (the cache plus ``max_new_tokens`` in every layer).
2. Sustained: a closed loop in which a new cache arrives whenever admission takes it and every sequence
   generates ``max_new_tokens`` tokens, stepped through the scheduler's ``schedule()`` (growth, preemption
   to host memory, resumption; no K/V is copied): the mean number of sequences decoding per step over the last two thirds of
   ``3 x max_new_tokens`` steps, and the preemptions it took. This is the concurrency the pool sustains.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

import torch
from vlkv.common.sampling import SamplingConfig
from vlkv.decode_worker.block_manager import AdmissionPolicy, BlockManager, SequenceBlocks
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.scheduler import Scheduler
from vlkv.decode_worker.sequence import Sequence

GIB = 1 << 30
BLOCK_SIZE = 16  # PoolConfig.block_size default
WATERMARK = 0.01  # PoolConfig.watermark default
BUDGET = 0.10
ADMIT_PROMPT = 2048
ADMIT_MAX_NEW = 100
ADMIT_DTYPE = torch.float16  # what a 7B server keeps its KV in; the ratio does not depend on it
RATIO_TARGET = 9.0
POLICIES = ("grow", "reserve")


@dataclass(frozen=True)
class Layout:
    """LLaVA-Mistral-7B's language model (Mistral-7B)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    vocab: int = 32000
    layers: int = 32


LAYOUT_7B = Layout()


def uniform_lengths(m: int, budget: float, layers: int) -> list[int]:
    return [min(m, max(1, math.ceil(budget * m)))] * layers


def uneven_lengths(m: int, budget: float, layers: int) -> list[int]:
    """The same total as :func:`uniform_lengths`, split across layers in proportion to weights falling
    linearly from 1.5 (first layer) to 0.5 (last), the shape of VL-Cache's layer-adaptive budgets
    (early layers attend densely and keep more tokens). Largest remainders keep the total exact."""
    total = sum(uniform_lengths(m, budget, layers))
    weights = [1.5 - i / (layers - 1) for i in range(layers)] if layers > 1 else [1.0]
    raw = [total * w / sum(weights) for w in weights]
    out = [math.floor(r) for r in raw]
    for i in sorted(range(layers), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    if max(out) > m:
        raise ValueError(f"an uneven split of {total} tokens over {layers} layers exceeds m={m}")
    return out


def meta_cache(pool_bytes: int, layout: Layout = LAYOUT_7B, dtype=ADMIT_DTYPE) -> KVCache:
    """A real ``KVCache`` sized as the decode worker sizes it, on the meta device: no memory."""
    return KVCache.from_bytes(pool_bytes, BLOCK_SIZE, layout.kv_heads, layout.head_dim, dtype, device="meta")


def meta_pool(pool_bytes: int, policy: str = "grow") -> BlockManager:
    """The decode worker's block manager for ``pool_bytes`` of 7B blocks, under admission ``policy``."""
    n = meta_cache(pool_bytes).num_blocks
    return BlockManager(n, BLOCK_SIZE, AdmissionPolicy.from_config(policy, WATERMARK, n))


def admit_count(pool_bytes: int, lengths: list[int], max_new_tokens: int, policy: str = "grow") -> int:
    """Caches admitted one after another into an empty pool until admission refuses one."""
    pool = meta_pool(pool_bytes, policy)
    n = 0
    while isinstance(pool.admit(lengths, max_new_tokens), SequenceBlocks):
        n += 1
    return n


def sustained(pool_bytes: int, lengths: list[int], max_new_tokens: int, policy: str = "grow") -> dict:
    """Closed loop through the decode scheduler: mean sequences decoding per step, and preemptions."""
    pool = meta_pool(pool_bytes, policy)
    sched: Scheduler[Sequence] = Scheduler(pool, max_batch=1 << 30, swap_bytes=1 << 62)
    steps, counts, finished = 3 * max_new_tokens, [], 0
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    for step in range(steps):
        while isinstance(blocks := pool.admit(lengths, max_new_tokens, len(sched.swapped)), SequenceBlocks):
            sched.add(Sequence(str(step), blocks, list(lengths), ADMIT_PROMPT, 0, sampling))
        plan = sched.schedule()
        counts.append(len(plan.running))
        for seq in plan.running:  # the step: one token per running sequence
            seq.lengths = [n + 1 for n in seq.lengths]
            seq.generated.append(0)
            if len(seq.generated) >= max_new_tokens:
                sched.finish(seq)  # leaves the batch and frees its blocks
                finished += 1
    tail = counts[steps // 3 :]
    return {"mean_running": sum(tail) / len(tail), "preemptions": sched.preemptions, "finished": finished}


@dataclass
class AdmissionRow:
    policy: str
    case: str
    k_min: int
    k_max: int
    k_total: int
    blocks_at_admission: int
    admitted: int
    admitted_vs_full: float
    sustained: float
    sustained_vs_full: float
    preemptions: int


def admission(
    pool_bytes: int = 2 * GIB, prompt: int = ADMIT_PROMPT, max_new_tokens: int = ADMIT_MAX_NEW
) -> dict:
    """Admitted and sustained sequences of ``prompt`` tokens in ``pool_bytes``, per policy and cache."""
    layers = LAYOUT_7B.layers
    cache = meta_cache(pool_bytes)
    cases = {
        "100%": [prompt] * layers,
        "10% uniform": uniform_lengths(prompt, BUDGET, layers),
        "10% uneven (VL-Cache-like)": uneven_lengths(prompt, BUDGET, layers),
    }
    rows = []
    for policy in POLICIES:
        need = meta_pool(pool_bytes, policy).admit_need
        full = full_sus = None
        for name, lengths in cases.items():
            n = admit_count(pool_bytes, lengths, max_new_tokens, policy)
            sus = sustained(pool_bytes, lengths, max_new_tokens, policy)
            full = n if full is None else full
            full_sus = sus["mean_running"] if full_sus is None else full_sus
            rows.append(
                AdmissionRow(policy, name, min(lengths), max(lengths), sum(lengths),
                             need(lengths, max_new_tokens), n, n / full if full else math.inf,
                             sus["mean_running"], sus["mean_running"] / full_sus, sus["preemptions"])
            )  # fmt: skip
    return {
        "pool_bytes": pool_bytes,
        "num_blocks": cache.num_blocks,
        "block_bytes": cache.block_bytes,
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
        "rows": [asdict(r) for r in rows],
    }


def row_of(adm: dict, policy: str, case: str) -> dict:
    return next(r for r in adm["rows"] if r["policy"] == policy and r["case"] == case)


def admission_table(adm: dict) -> str:
    lines = [
        f"Pool: {adm['pool_bytes'] / GIB:.2f} GiB = {adm['num_blocks']} blocks of {BLOCK_SIZE} tokens x 8 KV "
        f"heads x 128 dims, K+V, fp16 ({adm['block_bytes'] // 1024} KiB); full 32-layer 7B layout; "
        f"{adm['prompt']}-token prompts, {adm['max_new_tokens']} new tokens each.",
        "",
        "| admission | caches | k_l per layer | blocks at admission | admitted | vs 100% "
        "| sustained (mean decoding) | vs 100% | preemptions |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in adm["rows"]:
        k = f"{r['k_min']}" if r["k_min"] == r["k_max"] else f"{r['k_min']}-{r['k_max']}"
        lines.append(
            f"| {r['policy']} | {r['case']} | {k} | {r['blocks_at_admission']} | {r['admitted']} "
            f"| {r['admitted_vs_full']:.2f}x | {r['sustained']:.1f} | {r['sustained_vs_full']:.2f}x "
            f"| {r['preemptions']} |"
        )
    grow, reserve = row_of(adm, "grow", "10% uniform"), row_of(adm, "reserve", "10% uniform")
    verdict = "meets" if grow["admitted_vs_full"] >= RATIO_TARGET else "MISSES"
    lines += [
        "",
        f"Default admission (grow): 10% caches admit {grow['admitted_vs_full']:.2f}x the sequences of 100% "
        f"caches ({verdict} the {RATIO_TARGET:.0f}x target) and sustain {grow['sustained_vs_full']:.2f}x as "
        f"many decoding while each generates {adm['max_new_tokens']} tokens; reserving max_new_tokens at "
        f"admission instead: {reserve['admitted_vs_full']:.2f}x admitted.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-gib", type=float, default=2.0)
    ap.add_argument("--max-new-tokens", type=int, default=ADMIT_MAX_NEW)
    args = ap.parse_args(argv)
    print(admission_table(admission(int(args.pool_gib * GIB), max_new_tokens=args.max_new_tokens)))


if __name__ == "__main__":
    main()
