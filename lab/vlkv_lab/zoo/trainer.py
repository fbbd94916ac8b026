"""The one trainer of the zoo and the default model: a member declares its stages, this runs them.

A training command is ``main(Recipe(...))``: the recipe names the member, its options and their defaults
(``--steps``, ``--lr``, ...) and ``build(args) -> (model, processor, stages)``; ``main`` parses the command
line, makes the run deterministic (fixed seeds, deterministic algorithms; bit-exact for the same
``--threads``), runs the stages in order, measures held-out full-cache accuracy through the one accuracy path
(``lab/vlkv_lab/zoo/accuracy.py``) and saves the checkpoint (Hugging Face format) and its record in ``--out``.

A ``Stage`` is one optimizer run: a fresh AdamW (no weight decay on embeddings and 1-d parameters unless
``decay_groups`` is off), a linear warm-up then cosine learning rate over its ``steps``, gradients clipped to
norm 1, next-token cross-entropy on the answer tokens and their eos only (``collate``), full attention. It
declares its data (``batches``: the stage's step count -> a stream of batches of chats), what is frozen
(``frozen`` parameter-name prefixes), an optional vision ``Probe`` for its first steps, an optional
eviction-robust fine-tune (``evict_seed``: per-layer masks from ``lab/vlkv_lab/task/eviction.py``), the processor it
collates with (another image size) and a model swap before it (``next_anyres``: into the LLaVA-NeXT wrapper).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vlkv.deploy.progress import progress
from vlkv.deploy.synthetic_task import COLOURS

from vlkv_lab.zoo.accuracy import full_cache_accuracy
from vlkv_lab.zoo.batching import Chat, collate
from vlkv_lab.zoo.interface import Member


@dataclass(frozen=True)
class Probe:
    """The stage's first ``steps`` steps train the vision tower and projector alone: a linear head on every
    projected vision token names its object kind (``kinds`` of them) and colour, background included."""

    steps: int
    kinds: int
    targets: Callable[[list[Chat]], torch.Tensor]  # [images, tokens, 2]: (kind, colour) classes


@dataclass(frozen=True)
class Stage:
    name: str
    steps: int
    lr: float
    batches: Callable[[int], Iterator[list[Chat]]]  # the stage's step count -> its batch stream
    warmup: int = 50
    processor: Any = None  # collate with this processor instead of the run's
    processor_at: Callable[[int], Any] | None = None  # or with this step's (a smaller image size first)
    probe: Probe | None = None
    evict_seed: int | None = None  # eviction-robust fine-tune, its masks drawn from this seed
    frozen: tuple[str, ...] = ()  # parameter-name prefixes this stage leaves as they are
    decay_groups: bool = True  # False: weight decay on every parameter
    weight_decay: float = 0.01
    model: Callable[[Any], Any] | None = None  # the model this stage trains, made from the previous one's


@dataclass(frozen=True)
class Recipe:
    """A training command: ``python -m vlkv_lab.zoo.<name> --out DIR`` runs ``main(RECIPE)``."""

    member: Member
    defaults: dict  # option -> default (its type too); seed, threads, eval_n at least
    build: Callable[[argparse.Namespace], tuple[Any, Any, list[Stage]]]  # -> (model, processor, stages)
    report: Callable[[Any, Any, argparse.Namespace], dict] | None = None  # more figures for the record
    write_record: Callable[[Path, dict], None] | None = None  # default: TRAINING.json


def set_determinism(seed: int, threads: int = 1) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def lr_at(step: int, steps: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 5% of ``base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def interpolate_positions(model) -> None:
    """Let the CLIP tower take smaller images than its own (position embeddings interpolated; a no-op at
    its own size)."""
    model.model.vision_tower.embeddings.register_forward_pre_hook(
        lambda mod, args, kwargs: (args, {**kwargs, "interpolate_pos_encoding": True}), with_kwargs=True
    )


def probe_loss(
    head: torch.nn.Linear, features: torch.Tensor, targets: torch.Tensor, kinds: int
) -> torch.Tensor:
    logits = head(features).reshape(-1, kinds + 1 + len(COLOURS) + 1)
    kind, colour = targets.reshape(-1, 2).unbind(-1)
    ce = torch.nn.functional.cross_entropy
    return ce(logits[:, : kinds + 1], kind) + ce(logits[:, kinds + 1 :], colour)


def _optimizer(model, stage: Stage, head: torch.nn.Module | None) -> torch.optim.AdamW:
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(stage.frozen))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n] + list(
        head.parameters() if head else []
    )
    rest = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n)]
    wd = stage.weight_decay
    groups = [
        {"params": decay, "weight_decay": wd},
        {"params": rest, "weight_decay": 0.0 if stage.decay_groups else wd},
    ]
    return torch.optim.AdamW(groups, lr=stage.lr, betas=(0.9, 0.98))


def run_stage(model, processor, stage: Stage, on_step: Callable[[int], None] | None = None) -> list[float]:
    """Train ``model`` through one stage; returns its losses, one per step."""
    proc = stage.processor or processor
    rng = None
    if stage.evict_seed is not None:
        from vlkv_lab.task.eviction import eviction_masks, use_layered_attention

        torch.manual_seed(stage.evict_seed)
        rng = random.Random(stage.evict_seed)
    head = None
    if stage.probe is not None:
        head = torch.nn.Linear(model.config.text_config.hidden_size, stage.probe.kinds + 1 + len(COLOURS) + 1)
    opt = _optimizer(model, stage, head)
    stream = stage.batches(stage.steps)
    projected: list[torch.Tensor] = []
    capture = model.model.multi_modal_projector.register_forward_hook(lambda m, i, out: projected.append(out))
    if rng is not None:
        use_layered_attention(model)
    model.train()
    losses: list[float] = []
    ema, t0 = None, time.time()
    for step in progress(range(stage.steps), desc=f"train: {stage.name}", unit="step"):
        chats = next(stream)
        batch = collate(stage.processor_at(step) if stage.processor_at else proc, chats)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, stage.steps, stage.lr, stage.warmup)
        projected.clear()
        if stage.probe is not None and step < stage.probe.steps:
            model.model.get_image_features(pixel_values=batch["pixel_values"])
            loss = probe_loss(head, projected[0], stage.probe.targets(chats), stage.probe.kinds)
        else:
            if rng is not None:
                masks = eviction_masks(
                    batch["input_ids"],
                    batch["labels"],
                    batch["attention_mask"],
                    [ex for ex, _ in chats],
                    model.config.image_token_id,
                    model.config.text_config.num_hidden_layers,
                    rng,
                )
                batch["attention_mask"], batch["evict_masks"] = masks[0], masks
            loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        ema = losses[-1] if ema is None else 0.95 * ema + 0.05 * losses[-1]
        if step % 25 == 0 or step == stage.steps - 1:
            print(
                f"{stage.name} step {step:5d} loss {losses[-1]:.4f} ema {ema:.4f} "
                f"lr {opt.param_groups[0]['lr']:.2e} elapsed {time.time() - t0:7.1f}s",
                flush=True,
            )
        if on_step is not None and (stage.probe is None or step >= stage.probe.steps):
            on_step(step)
    capture.remove()
    if rng is not None:
        model.set_attn_implementation({"text_config": "sdpa"})
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return losses


def train(model, processor, stages: list[Stage], on_step=None) -> tuple[Any, list[float], list[list[float]]]:
    """Run ``stages`` in order: ``(final model, seconds per stage, losses per stage)``. ``on_step(model,
    step)`` after every training step of a stage on the run's processor (not during a probe)."""
    seconds, losses = [], []
    for stage in stages:
        if stage.model is not None:
            model = stage.model(model)
        t0 = time.time()
        # on the run's model and processor only: the member's held-out examples fit them
        peek = (lambda s, m=model: on_step(m, s)) if on_step and stage.processor is None else None
        losses.append(run_stage(model, processor, stage, peek))
        seconds.append(round(time.time() - t0, 1))
    return model, seconds, losses


def main(recipe: Recipe, argv: list[str] | None = None) -> dict:
    """The member's training command (module docstring)."""
    m = recipe.member
    doc = sys.modules["__main__"].__doc__  # the member module's (run with -m): its task and stages
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    defaults = {"eval_every": 0, "eval_seed": 0} | recipe.defaults
    for k, v in defaults.items():
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=type(v), default=v)
    args = p.parse_args(argv)
    t_start = time.time()
    set_determinism(args.seed, args.threads)
    model, processor, stages = recipe.build(args)
    n_params = sum(x.numel() for x in model.parameters())
    print(f"{m.name}: {n_params} parameters; stages {[(s.name, s.steps) for s in stages]}", flush=True)

    def peek(model, step: int) -> None:
        if args.eval_every and step and step % args.eval_every == 0:
            held = m.make_examples(50, args.eval_seed + 1, "heldout")
            print(f"  eval@{step}: {full_cache_accuracy(m, model, processor, held)[0]:.3f}", flush=True)

    model, stage_seconds, _ = train(model, processor, stages, peek)
    acc, per_kind = full_cache_accuracy(
        m, model, processor, m.make_examples(args.eval_n, args.eval_seed, "heldout")
    )
    print(f"held-out accuracy {acc:.4f} on {args.eval_n}: {per_kind}", flush=True)
    extra = recipe.report(model, processor, args) if recipe.report else {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    spec = sys.modules["__main__"].__spec__  # the module run with -m
    record = {
        "command": " ".join(
            ["python -m", spec.name if spec else f"vlkv_lab.zoo.{m.name}", *(argv or sys.argv[1:])]
        ),
        "train_seconds": round(sum(stage_seconds), 1),
        "stage_seconds": dict(zip([s.name for s in stages], stage_seconds, strict=True)),
        **{k: v for k, v in vars(args).items() if k != "out"},
        "params": n_params,
        "size_bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.stem != "TRAINING"),
        "heldout_accuracy": round(acc, 4),
        "heldout_n": args.eval_n,
        "heldout_per_kind": {k: round(v, 4) for k, v in per_kind.items()},
        "max_new_tokens": m.max_new_tokens,
        "torch": torch.__version__,
        **extra,
        "command_seconds": round(time.time() - t_start, 1),
    }
    if recipe.write_record:
        recipe.write_record(out / "TRAINING.md", record)
    else:
        (out / "TRAINING.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1), flush=True)
    return record
