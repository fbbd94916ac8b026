"""The decode core's step around the model: sampling and bookkeeping for a batch, this tree against another.

``DecodeCore.step`` at batch 32 with a runner that returns fixed random logits over a 7B-sized vocabulary
(32,000), so what is timed is everything a step does besides the model: scheduling, growing the tables,
sampling (one ``sample_tokens`` call for the batch here; a per-sequence loop before #31) and, in this
tree, the stop rules. Three mixes: every row greedy, half greedy and half sampled (temperature 0.8, top-p
0.9, top-k 50), every row sampled. ``--before PATH`` times a second checkout in the same run (its own
process, interleaved rounds; see ``handoff_latency``).

    python -m vlkv_lab.bench.decode_step [--before /tmp/before] [--batch 32] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if os.environ.get("VLKV_BENCH_TREE"):  # a worker for another checkout: import vlkv from it alone, never
    # falling back to this checkout's editable install for a module that checkout lacks
    sys.meta_path[:] = [
        f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
    ]

VOCAB = 32_000
MIXES = ("greedy", "half", "sampled")
ROUNDS = 5


def worker() -> None:
    import torch
    from vlkv.common.sampling import SamplingConfig
    from vlkv.decode_worker.block_manager import BlockManager
    from vlkv.decode_worker.core import DecodeCore
    from vlkv.decode_worker.kv_cache import KVCache

    try:
        from vlkv.decode_worker.sequence import Sequence
    except ImportError:  # before #31
        from vlkv.decode_worker.core import DecodeSequence as Sequence

    torch.set_num_threads(1)

    class Runner:
        def __init__(self, logits: torch.Tensor) -> None:
            self.logits = logits

        def step(self, batch, mass: bool = False) -> torch.Tensor:
            return self.logits[: len(batch)]

    def core_for(mix: str, batch: int):
        blocks, cache = BlockManager(1 << 16, 16), KVCache(1 << 16, 16, 1, 2)
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
        core = DecodeCore(Runner(logits), blocks, cache, max_batch=batch)
        for i in range(batch):
            sampled = mix == "sampled" or (mix == "half" and i % 2)
            cfg = SamplingConfig(max_new_tokens=1 << 20, seed=i)
            if sampled:
                cfg = SamplingConfig(max_new_tokens=1 << 20, temperature=0.8, top_p=0.9, top_k=50, seed=i)
            core.add(Sequence(f"r{i}", blocks.allocate([4], 0), [4], 4, 1, cfg))
        return core

    print(json.dumps({"ready": True}), flush=True)
    cores: dict = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        key = (cmd["mix"], cmd["batch"])
        if key not in cores:
            cores[key] = core_for(*key)
            cores[key].step()
        core, secs = cores[key], []
        for _ in range(cmd["steps"]):
            start = time.perf_counter()
            core.step()
            secs.append(time.perf_counter() - start)
        print(json.dumps({"seconds": secs}), flush=True)


def main() -> None:
    from vlkv_lab.bench.handoff_latency import _Tree

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default=None, help="a second checkout to time in the same run")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300, help="steps per mix and tree")
    args = ap.parse_args()
    trees = [_Tree("this tree", None, __file__)]
    if args.before:
        trees.append(_Tree(f"before ({args.before})", args.before, __file__))
    got = {(m, t.name): [] for m in MIXES for t in trees}
    try:
        for mix in MIXES:
            for _ in range(ROUNDS):
                for t in trees:
                    cmd = {"op": "step", "mix": mix, "batch": args.batch, "steps": args.steps // ROUNDS}
                    got[(mix, t.name)] += t.ask(cmd)["seconds"]
    finally:
        for t in trees:
            t.close()
    print(
        f"decode step around the model at batch {args.batch}, vocab {VOCAB}: median ms over {args.steps} steps"
    )
    names = [t.name for t in trees]
    print(
        f"{'mix':<8}" + "".join(f" | {n:>32}" for n in names) + (" | this/before" if len(names) > 1 else "")
    )
    for mix in MIXES:
        med = [statistics.median(got[(mix, n)]) * 1e3 for n in names]
        line = f"{mix:<8}" + "".join(f" | {m:>32.3f}" for m in med)
        print(line + (f" | {med[0] / med[1]:>6.2f}" if len(med) > 1 else ""))


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        # run as a script: its folder is sys.path[0], where lab/vlkv_lab/bench/kernels.py would pass for the
        # ``kernels`` package transformers looks for
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        worker()
    else:
        main()
