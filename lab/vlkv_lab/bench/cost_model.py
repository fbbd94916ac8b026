"""Roofline cost model of the Triton kernels and of a decode step, at published GPU figures.

Per launch: bytes moved (unique DRAM bytes: each input read once, each output written once; L2 reuse
assumed for the statistics' re-reads of K across a query tile loop and a GQA group) and FLOPs as the kernel
executes them (``tl.dot`` tiles padded to ``BLOCK_G`` >= 16 query rows per KV head, ``BLOCK_Q`` = 64
statistics rows, whole ``BLOCK_N`` key tiles); time = max(bytes / bandwidth, FLOPs / peak), the lower bound
a kernel can reach (no launch latency, no tail effects). The paged kernels' shapes (splits, tile sizes)
come from the same rules as the launcher in ``kernels/paged_decode.py``.

Decode step of LLaVA-1.5-7B's language model (Vicuna-7B: 32 layers, 32 heads, no GQA, D=128, d=4096,
ffn 11008, vocab 32000, fp16 weights): the weight read and the matmuls' FLOPs, plus per layer the paged
decode kernels over each sequence's kept tokens. Cache lengths: a 2,048-token prompt, 100% kept or 10%.

``python -m vlkv_lab.bench.cost_model`` prints the tables (``vlkv bench kernels --model-only`` too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """Published figures (NVIDIA datasheets, SXM parts; dense tensor-core peaks, no sparsity)."""

    name: str
    bandwidth: float  # HBM bytes/s
    fp16_flops: float  # fp16/bf16 tensor core
    tf32_flops: float  # what the 8-bit pools' fp32 tiles run on (PRECISION="tf32")
    memory: float  # bytes of HBM
    sms: int


GPUS = {
    "A100": GPU("A100 SXM 80GB", 2.039e12, 312e12, 156e12, 80e9, 108),
    "H100": GPU("H100 SXM 80GB", 3.35e12, 989e12, 494e12, 80e9, 132),
    "B200": GPU("B200 (HGX) 180GB", 8.0e12, 2250e12, 1100e12, 180e9, 148),
}


@dataclass(frozen=True)
class Cost:
    kernel: str
    bytes: float
    flops: float
    tensor: str = "fp16"  # which peak the FLOPs run at

    def seconds(self, gpu: GPU) -> float:
        peak = gpu.fp16_flops if self.tensor == "fp16" else gpu.tf32_flops
        return max(self.bytes / gpu.bandwidth, self.flops / peak)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def decode_splits(n_seq: int, length: int, n_kv: int, sms: int, block_n: int) -> int:
    """Splits per sequence, as ``paged_decode_attention`` sizes them on a device with ``sms`` SMs."""
    n_tiles = _cdiv(max(1, length), block_n)
    want = max(1, min(n_tiles, _cdiv(2 * sms, n_seq * n_kv)))
    return _cdiv(length, _cdiv(n_tiles, min(want, n_tiles)) * block_n)


def paged_decode_costs(
    n_seq: int, length: int, heads: int, kv_heads: int, dim: int, *, kv: str = "fp16", act_bytes: int = 2,
    page: int = 16, sms: int = 132, mass: bool = False,
) -> list[Cost]:  # fmt: skip
    """One layer's paged decode launches for ``n_seq`` sequences of ``length`` cached tokens each."""
    block_n = 32 if kv == "fp8" else 64
    elem = act_bytes if kv == "fp16" else 1
    splits = decode_splits(n_seq, length, kv_heads, sms, block_n)
    tokens = n_seq * length
    block_g = max(16, _pow2(heads // kv_heads))
    padded = n_seq * splits * _cdiv(_cdiv(length, splits), block_n) * block_n  # tokens the tiles cover
    kv_bytes = 2 * tokens * kv_heads * dim * elem
    scales = 0 if kv == "fp16" else tokens * kv_heads * 2 + n_seq * splits * kv_heads * dim * 2
    tables = n_seq * _cdiv(length, page) * 4 + n_seq * 4
    q_bytes = n_seq * heads * dim * act_bytes
    partials = n_seq * heads * splits * (dim + 2) * 4
    tensor = "fp16" if kv == "fp16" else "tf32"
    split_flops = 4 * padded * kv_heads * block_g * dim
    costs = [
        Cost("_split_kernel", kv_bytes + scales + tables + q_bytes + partials, split_flops, tensor),
        Cost("_combine_kernel", partials + q_bytes, 3 * n_seq * heads * splits * dim),
    ]
    if mass:
        mass_bytes = kv_bytes / 2 + scales / 2 + tables + q_bytes + n_seq * kv_heads * length * 4
        costs.append(Cost("_mass_kernel", mass_bytes, split_flops / 2, tensor))
    return costs


def attention_stats_costs(
    heads: int, kv_heads: int, rows: int, m: int, dim: int, act_bytes: int = 2, block: int = 64
) -> list[Cost]:
    """The statistics of ``rows`` query rows (the last ones) against ``m`` keys, per layer."""
    q_bytes = heads * rows * dim * act_bytes
    k_bytes = kv_heads * m * dim * act_bytes
    padded_rows = _cdiv(rows, block) * block
    flops = 2 * heads * padded_rows * _cdiv(m, block) * block * dim  # one q k^T per kernel
    n_parts = _cdiv(m, block)
    return [
        Cost("_row_stats_kernel", q_bytes + k_bytes + 2 * heads * rows * 4, flops),
        Cost(
            "_col_stats_kernel", q_bytes + k_bytes + 2 * heads * rows * 4 + heads * (m + n_parts) * 4, flops
        ),
        Cost("_sum_counts_kernel", heads * (n_parts * 4 + 8), heads * n_parts),
    ]


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    heads: int
    kv_heads: int
    dim: int
    hidden: int
    ffn: int
    vocab: int

    @property
    def matmul_params(self) -> int:
        """Weights every decode step multiplies by: the layers' projections and the LM head."""
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.dim + self.heads * self.dim * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.ffn) + self.hidden * self.vocab

    def kv_bytes_per_token(self, kv: str, page: int = 16) -> float:
        """Pool bytes per cached token, all layers (8-bit: plus the per-block scales, as in the pool)."""
        if kv == "fp16":
            return 2 * self.layers * self.kv_heads * self.dim * 2
        return self.layers * self.kv_heads * (2 * self.dim + 2 * (self.dim + page) / page)


LLAVA_15_7B = Model("LLaVA-1.5-7B (Vicuna-7B)", 32, 32, 32, 128, 4096, 11008, 32000)
PROMPT = 2048
BATCHES = (1, 32, 128)
CACHES = (("10%", 0.1), ("100%", 1.0))


def decode_step(model: Model, gpu: GPU, n_seq: int, length: int, kv: str) -> dict:
    """Modelled seconds of one decode step (weights + attention) and whether weights + pool fit."""
    params = model.matmul_params
    weights = Cost("weights", 2 * params, 2 * params * n_seq).seconds(gpu)
    layer = paged_decode_costs(n_seq, length, model.heads, model.kv_heads, model.dim, kv=kv, sms=gpu.sms)
    attention = model.layers * sum(c.seconds(gpu) for c in layer)
    held = 2 * params + n_seq * length * model.kv_bytes_per_token(kv)
    return {
        "weights_s": weights,
        "attention_s": attention,
        "step_s": weights + attention,
        "fits": held <= gpu.memory,
    }


def decode_table(model: Model = LLAVA_15_7B, gpus: tuple[str, ...] = tuple(GPUS)) -> tuple[str, list[dict]]:
    """The decode-step table (Markdown) and its rows."""
    rows = []
    for kv in ("fp16", "int8"):
        for n_seq in BATCHES:
            for label, frac in CACHES:
                length = math.ceil(frac * PROMPT)
                row = {"kv": kv, "batch": n_seq, "cache": label, "length": length}
                for g in gpus:
                    row[g] = decode_step(model, GPUS[g], n_seq, length, kv)
                rows.append(row)
    head = "| kv | batch | cache (tokens) | " + " | ".join(f"{g} ms/step (attention)" for g in gpus) + " |"
    lines = [head, "|" + " --- |" * (3 + len(gpus))]
    for r in rows:
        cells = []
        for g in gpus:
            d = r[g]
            fit = "" if d["fits"] else " (does not fit)"
            cells.append(f"{d['step_s'] * 1e3:.2f} ({d['attention_s'] * 1e3:.2f}){fit}")
        lines.append(
            f"| {r['kv']} | {r['batch']} | {r['cache']} ({r['length']}) | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines), rows


def ratio_line(rows: list[dict], gpu: str = "H100", batch: int = 32) -> str:
    out = []
    for kv in ("fp16", "int8"):
        pick = {r["cache"]: r[gpu]["step_s"] for r in rows if r["kv"] == kv and r["batch"] == batch}
        out.append(
            f"{gpu} batch {batch} {kv}: 10% {pick['10%'] * 1e3:.2f} ms vs 100% {pick['100%'] * 1e3:.2f} ms "
            f"per step ({pick['100%'] / pick['10%']:.2f}x)"
        )
    return "\n".join(out)


def launch_table(shapes: list[dict], gpus: tuple[str, ...] = tuple(GPUS)) -> str:
    """Per-launch bytes, FLOPs and modelled microseconds for a list of named shapes (``costs`` inside)."""
    head = "| shape | kernel | MB moved | GFLOP | " + " | ".join(f"{g} us" for g in gpus) + " | bound |"
    lines = [head, "|" + " --- |" * (5 + len(gpus))]
    for s in shapes:
        for c in s["costs"]:
            times = [c.seconds(GPUS[g]) for g in gpus]
            g0 = GPUS[gpus[0]]
            peak = g0.fp16_flops if c.tensor == "fp16" else g0.tf32_flops
            bound = "memory" if c.bytes / g0.bandwidth >= c.flops / peak else f"{c.tensor} FLOPs"
            lines.append(
                f"| {s['name']} | `{c.kernel}` | {c.bytes / 1e6:.2f} | {c.flops / 1e9:.3f} | "
                + " | ".join(f"{t * 1e6:.1f}" for t in times)
                + f" | {bound} |"
            )
    return "\n".join(lines)


def llava_launch_shapes(model: Model = LLAVA_15_7B) -> list[dict]:
    """One layer of LLaVA-1.5-7B: decode at batch 32 (H100 splits) 10% / 100%, and the statistics."""
    shapes = []
    for kv in ("fp16", "int8"):
        for label, frac in CACHES:
            length = math.ceil(frac * PROMPT)
            costs = paged_decode_costs(32, length, model.heads, model.kv_heads, model.dim, kv=kv, mass=True)
            shapes.append({"name": f"decode S=32 {label} ({length} tok) {kv}", "costs": costs})
    for m in (640, PROMPT):
        shapes.append({"name": f"stats 50 rows, m={m}", "costs": attention_stats_costs(32, 32, 50, m, 128)})
    return shapes


def print_model() -> None:
    print(
        f"Per launch, one layer of {LLAVA_15_7B.name} (fp16 activations; decode with re-compression's mass):"
    )
    print(launch_table(llava_launch_shapes()))
    table, rows = decode_table()
    print(
        f"\nModelled decode step, {LLAVA_15_7B.name}, {PROMPT}-token prompts (weights {2 * LLAVA_15_7B.matmul_params / 1e9:.1f} GB "
        "read per step + paged attention; roofline lower bound):"
    )
    print(table)
    print(ratio_line(rows))


if __name__ == "__main__":
    print_model()
