"""One training recipe for the zoo's small LLaVA members (``grid16``, ``longprompt``).

A member hands ``train_member`` a ``Member`` (vocabulary, system prompt, architecture, its curriculum and
task) and gets the single deterministic command ``python -m vlkv.tools.zoo.<name> --out DIR``:

1. The vision tower and projector start from the default model's (``common/default_model``), the tower's
   position embeddings resized (bicubic) to the member's patch grid; the decoder, embeddings and head start
   from random init (the default's decoder was fine-tuned to tolerate KV eviction, a user's is not).
2. ``probe_steps``: the tower and projector alone, with a linear probe naming each vision token's object
   kind (shape or pattern) and colour, background included, so they adapt to the member's grid and objects
   before the decoder reads them (``tools/task/train_default_model``'s lesson).
3. The rest: next-token cross-entropy on the answer tokens and the closing eos only, full attention (no
   eviction-robust stage), batches drawn by the member's curriculum (``Member.train_example``), a cosine
   learning-rate schedule (``train_default_model.lr_at``).
4. Held-out full-cache greedy accuracy (``model.generate``) on ``--eval-n`` examples, then the checkpoint
   (Hugging Face format) and ``TRAINING.md`` (the record) in ``--out``.

Deterministic: fixed seeds and data order, deterministic algorithms; bit-exact for the same ``--threads``
(1 by default: the lab machine's 2 cores are shared).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlavaForConditionalGeneration
from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.tools.progress import progress
from vlkv.tools.task.synthetic_task import COLOURS, Example, Geometry
from vlkv.tools.task.tiny_llava import build_tiny, tokens_per_image
from vlkv.tools.task.train_default_model import collate, lr_at, set_determinism
from vlkv.tools.zoo.accuracy import full_cache_accuracy
from vlkv.tools.zoo.interface import Member
from vlkv.tools.zoo.scenes import patch_labels


@dataclass(frozen=True)
class Arch:
    """The member's model: image geometry and decoder shape (vision tower as the default's, to reuse it)."""

    geometry: Geometry
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    rope_theta: float = 1e6


@dataclass(frozen=True)
class Recipe:
    """How ``train_member`` trains a zoo member."""

    member: Member
    words: list[str]
    system_prompt: str | None
    arch: Arch
    object_kinds: tuple[str, ...]  # the probe's first class set (shapes or patterns)
    train_example: Callable[[int, float], Example]  # (index, training progress in [0, 1)) -> example
    steps: int
    probe_steps: int
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 50
    init_from: Path | None = None  # a saved member to start from (decoder, shared words, vision) instead


def init_vision_from_default(model: LlavaForConditionalGeneration, default_dir: str = str(DEFAULT_MODEL_DIR)):
    """Copy the default model's vision tower and projector into ``model``, position embeddings resized."""
    src = LlavaForConditionalGeneration.from_pretrained(default_dir, dtype=torch.float32)
    tower = src.model.vision_tower.state_dict()
    key = "embeddings.position_embedding.weight"
    pe = tower[key]  # [1 + old*old, dim]: CLS first
    old = math.isqrt(pe.shape[0] - 1)
    new = math.isqrt(model.model.vision_tower.state_dict()[key].shape[0] - 1)
    grid = pe[1:].reshape(1, old, old, -1).permute(0, 3, 1, 2)
    grid = torch.nn.functional.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False)
    tower[key] = torch.cat([pe[:1], grid.permute(0, 2, 3, 1).reshape(new * new, -1)])
    model.model.vision_tower.load_state_dict(tower)
    model.model.multi_modal_projector.load_state_dict(src.model.multi_modal_projector.state_dict())


def init_from_member(model: LlavaForConditionalGeneration, tokenizer, src_dir: Path) -> None:
    """Start from another member's checkpoint: its vision tower and projector (position embeddings resized),
    decoder layers and final norm, and the embedding and output rows of every word both vocabularies share
    (the new words keep their random init)."""
    init_vision_from_default(model, str(src_dir))
    src = LlavaForConditionalGeneration.from_pretrained(src_dir, dtype=torch.float32)
    src_vocab = AutoTokenizer.from_pretrained(src_dir).get_vocab()
    dst_lm, src_lm = model.model.language_model, src.model.language_model
    dst_lm.layers.load_state_dict(src_lm.layers.state_dict())
    dst_lm.norm.load_state_dict(src_lm.norm.state_dict())
    pairs = [(i, src_vocab[w]) for w, i in tokenizer.get_vocab().items() if w in src_vocab]
    dst_ids, src_ids = (torch.tensor(x) for x in zip(*pairs, strict=True))
    with torch.no_grad():
        dst_lm.embed_tokens.weight[dst_ids] = src_lm.embed_tokens.weight[src_ids]
        model.lm_head.weight[dst_ids] = src.lm_head.weight[src_ids]


def probe_targets(examples: list[Example], m: Recipe) -> torch.Tensor:
    """``[images, tokens, 2]``: per vision token its (object kind, colour) class, background last."""
    rows = []
    for ex in examples:
        for img, objs in zip(ex.images, ex.objects, strict=True):
            rows.append(patch_labels(img, objs, m.arch.geometry, m.object_kinds))
    return torch.tensor(rows, dtype=torch.long)


def probe_loss(
    head: torch.nn.Linear, features: torch.Tensor, targets: torch.Tensor, n_kinds: int
) -> torch.Tensor:
    logits = head(features).reshape(-1, n_kinds + 1 + len(COLOURS) + 1)
    kind, colour = targets.reshape(-1, 2).unbind(-1)
    ce = torch.nn.functional.cross_entropy
    return ce(logits[:, : n_kinds + 1], kind) + ce(logits[:, n_kinds + 1 :], colour)


def _chats(examples: list[Example]) -> list[tuple[Example, list[dict]]]:
    return [(ex, [*ex.messages, {"role": "assistant", "content": ex.answer}]) for ex in examples]


def train_member(r: Recipe, argv: list[str] | None = None) -> dict:
    m, mem = r, r.member
    p = argparse.ArgumentParser(description=f"Train the zoo member {mem.name!r} (deterministic, CPU).")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=m.steps)
    p.add_argument("--probe-steps", type=int, default=m.probe_steps)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-n", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=0, help="held-out accuracy on 50 every N steps (0: off)")
    args = p.parse_args(argv)
    t_start = time.time()
    set_determinism(args.seed, args.threads)
    g = m.arch.geometry
    tok, processor, cfg = build_tiny(
        m.words,
        image_size=g.image,
        patch_size=g.patch,
        system_prompt=m.system_prompt,
        num_heads=m.arch.heads,
        num_kv_heads=m.arch.kv_heads,
        hidden=m.arch.hidden,
        layers=m.arch.layers,
        rope_theta=m.arch.rope_theta,
    )
    torch.manual_seed(args.seed)
    model = LlavaForConditionalGeneration(cfg)
    if m.init_from is not None:
        init_from_member(model, tok, m.init_from)
    else:
        init_vision_from_default(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{mem.name}: params={n_params} vocab={len(tok)} tokens/image={tokens_per_image(g.image, g.patch)}")

    n_kinds = len(m.object_kinds)
    head = torch.nn.Linear(cfg.text_config.hidden_size, n_kinds + 1 + len(COLOURS) + 1)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    decay += list(head.parameters())
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=m.lr,
        betas=(0.9, 0.98),
    )
    projected: list[torch.Tensor] = []
    capture = model.model.multi_modal_projector.register_forward_hook(
        lambda mod, i, out: projected.append(out)
    )
    model.train()
    ema = None
    t0 = time.time()
    for step in progress(range(args.steps), desc=f"train {mem.name}", unit="step"):
        examples = [m.train_example(step * m.batch_size + j, step / args.steps) for j in range(m.batch_size)]
        batch = collate(processor, _chats(examples))
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, args.steps, m.lr, m.warmup)
        projected.clear()
        if step < args.probe_steps:
            model.model.get_image_features(pixel_values=batch["pixel_values"])
            loss = probe_loss(head, projected[0], probe_targets(examples, m), n_kinds)
        else:
            loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == args.steps - 1:
            print(
                f"step {step:5d} loss {loss.item():.4f} ema {ema:.4f} elapsed {time.time() - t0:7.1f}s",
                flush=True,
            )
        if args.eval_every and step > args.probe_steps and step % args.eval_every == 0:
            model.eval()
            acc, per = full_cache_accuracy(mem, model, processor, mem.make_examples(50, 1, "heldout"))
            print(
                f"  eval@{step}: {acc:.3f} {json.dumps({k: round(v, 3) for k, v in per.items()})}", flush=True
            )
            model.train()
    capture.remove()
    train_seconds = time.time() - t0
    model.eval()

    t1 = time.time()
    examples = mem.make_examples(args.eval_n, 0, "heldout")
    acc, per_kind = full_cache_accuracy(mem, model, processor, examples)
    print(f"held-out accuracy {acc:.4f} on {args.eval_n} ({time.time() - t1:.0f}s): {per_kind}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "TRAINING.md")
    prompt_tokens = [
        len(processor(images=ex.images, text=mem.prompt_text(processor, ex))["input_ids"][0])
        for ex in examples
    ]
    record = {
        "command": f"python -m vlkv.tools.zoo.{mem.name} " + " ".join(sys.argv[1:] if argv is None else argv),
        "train_seconds": round(train_seconds, 1),
        "command_seconds": round(time.time() - t_start, 1),
        "steps": args.steps,
        "probe_steps": args.probe_steps,
        "batch_size": m.batch_size,
        "lr": m.lr,
        "init_from": str(m.init_from.relative_to(Path(__file__).resolve().parents[2]))
        if m.init_from
        else None,
        "seed": args.seed,
        "threads": args.threads,
        "params": n_params,
        "size_bytes": size,
        "image_size": g.image,
        "patch_size": g.patch,
        "tokens_per_image": tokens_per_image(g.image, g.patch),
        "prompt_tokens": {"min": min(prompt_tokens), "max": max(prompt_tokens)},
        "text": {
            "layers": m.arch.layers,
            "hidden": m.arch.hidden,
            "heads": m.arch.heads,
            "kv_heads": m.arch.kv_heads,
        },
        "rope_theta": m.arch.rope_theta,
        "heldout_accuracy": round(acc, 4),
        "heldout_n": args.eval_n,
        "heldout_per_kind": {k: round(v, 4) for k, v in per_kind.items()},
        "max_new_tokens": mem.max_new_tokens,
        "torch": torch.__version__,
    }
    (out / "TRAINING.md").write_text(
        f"# Zoo member `{mem.name}`: training record\n\n"
        f"Written by `{record['command']}` (see `tools/zoo/{mem.name}.py` and `tools/zoo/training.py`).\n"
        f"Held-out full-cache greedy accuracy (n={args.eval_n}, seed 0): **{acc:.4f}**.\n\n"
        f"```json\n{json.dumps(record, indent=1)}\n```\n"
    )
    print(json.dumps(record, indent=1), flush=True)
    return record
