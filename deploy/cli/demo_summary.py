"""The summary `vlkv demo` ends with: answers vs the full cache, KV bytes kept, and pool capacity."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlkv.decode_worker.block_manager import blocks_needed


@dataclass
class DemoSummary:
    policy: str
    budget: float | None
    n: int = 0
    correct: int = 0
    full_correct: int = 0
    compared: int = 0
    agree: int = 0
    kept: int = 0
    full: int = 0
    layer_budgets: list[list[int]] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)
    verified: int = 0
    raised: int = 0
    floor_missed: int = 0

    def add(self, out, ok: bool, ref=None, ref_ok: bool | None = None) -> None:
        """One answered question: ``out`` compressed (a ``vlkv.deploy.client`` result), ``ref`` the full cache."""
        u = out.finished.usage
        self.n += 1
        self.correct += ok
        self.kept += u.kv_bytes_kept
        self.full += u.kv_bytes_full
        self.layer_budgets.append(list(u.layer_budgets))
        self.prompts.append(u.prompt_tokens)
        if u.verify:
            self.verified += 1
            self.raised += u.budget_raises > 0
            self.floor_missed += not u.floor_met
        if ref is not None:
            self.compared += 1
            self.full_correct += bool(ref_ok)
            self.agree += ref.text.strip() == out.text.strip()

    def capacity(self, total_blocks: int, block_size: int, max_new_tokens: int) -> tuple[float, float]:
        """Mean number of sequences like the ones asked that ``total_blocks`` hold, compressed and full."""
        comp = full = 0.0
        for budgets, m in zip(self.layer_budgets, self.prompts, strict=True):
            comp += total_blocks // max(1, blocks_needed(budgets, max_new_tokens, block_size))
            full += total_blocks // max(1, blocks_needed([m] * len(budgets), max_new_tokens, block_size))
        return comp / max(1, self.n), full / max(1, self.n)

    def render(self, pool: tuple[int, int] | None, block_size: int, max_new_tokens: int) -> str:
        label = self.policy if self.budget is None else f"{self.policy} at {self.budget:.0%}"
        lines = [f"summary ({label}, {self.n} questions through the public gRPC API):"]
        lines.append(
            f"  answers correct: {self.correct}/{self.n} {'with the full cache' if self.policy == 'full' else 'compressed'}"
        )
        if self.compared:
            lines[-1] += (
                f", {self.full_correct}/{self.compared} with the full cache; "
                f"{self.agree}/{self.compared} compressed answers identical to the full-cache answer"
            )
        if self.full:
            lines.append(
                f"  KV bytes kept: {self.kept / self.n / 1e6:.2f} MB of {self.full / self.n / 1e6:.2f} MB per "
                f"request on average ({self.kept / self.full:.1%})"
            )
        if self.verified:
            lines.append(
                f"  verified: {self.verified}/{self.n} requests, {self.raised} with the budget raised, "
                f"{self.floor_missed} below the fidelity floor at the cap"
            )
        if pool is not None and self.n and self.policy == "full":
            comp, _ = self.capacity(pool[0], block_size, max_new_tokens)
            lines.append(
                f"  one decode worker's KV pool ({pool[0]} blocks of {block_size} tokens) holds {comp:.0f} sequences "
                f"of this size with the full cache (run with --policy vlcache --budget 0.1 to compare)"
            )
        elif pool is not None and self.n:
            blocks, workers = pool
            comp, full = self.capacity(blocks, block_size, max_new_tokens)
            ratio = f"{comp / full:.1f}x" if full else "n/a"
            lines.append(
                f"  one decode worker's KV pool ({blocks} blocks of {block_size} tokens) holds {comp:.0f} "
                f"sequences of this size at {label} vs {full:.0f} with the full cache ({ratio}), each with room "
                f"for {max_new_tokens} new tokens"
            )
        return "\n".join(lines)
