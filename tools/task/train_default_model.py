"""Train the default tiny LLaVA on the synthetic task and save it in Hugging Face format.

    python -m vlkv.tools.task.train_default_model --out common/default_model

Deterministic (fixed seeds, deterministic algorithms), CPU only, from random init. The stages (``DEFAULTS``):

1. ``--probe-steps`` (150): the vision tower and projector alone, with a linear probe naming each vision
   token's shape and colour (background included). Without it, the decoder's shape-keyed look-up over 576
   vision tokens did not form within 500+ steps: at init the features carry colour far more than shape.
2. ``--warmup-scene-steps`` (to step 1400): one-image colour-of-shape questions, the scenes holding one shape
   first and then up to ``--warmup-max-objects`` (4), one more every ``--warmup-ramp-steps`` / 4 (400) steps:
   one shape teaches the colour read-out, two the look-up keyed by the shape.
3. ``--lookup-only-steps`` (to step 1700): both colour-of-shape kinds (one and two images).
4. The full mix (counting and the two-region kind join) to ``--steps`` (2400).
5. ``--evict-steps`` (1,400, fresh AdamW at ``--evict-lr``, its own data stream, counting and the two-region
   kind weighted up, the long kind joining, ``EVICT_KIND_WEIGHTS``): eviction-robust fine-tuning
   (``eviction.py``): the answer's tokens after the first see a random part of the prompt, so the model does
   not lean on every background patch, as a pretrained LLM leans on its attention sink instead. The long
   kind's 66 words of fixed text before its colour learn here (about 5,600 examples). ``--init-from DIR`` starts this stage from a saved model of stages 1-4.

The loss is next-token cross-entropy on the answer tokens (and the closing eos) only. The decoder's RoPE base
is 1e6 (as Mistral-7B-v0.2): content look-ups over 600-1,200 tokens keep more position-independent
frequency pairs. Bit-exact reproduction is promised for the same ``--threads`` (2 by default; on a 2-core
machine shared with other work, 1 thread avoids spinning).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration
from vlkv.tools.progress import progress
from vlkv.tools.task.eviction import eviction_masks, use_layered_attention
from vlkv.tools.task.synthetic_task import (
    COLOURS,
    FULL,
    IMAGE_SIZE,
    KIND_WEIGHTS,
    KINDS,
    LONG_KIND,
    LONG_MAX_NEW_TOKENS,
    LOW,
    MAX_NEW_TOKENS,
    PATCH_SIZE,
    SHAPES,
    SYSTEM_PROMPT,
    VOCAB,
    Example,
    make_example,
    make_examples,
    patch_labels,
    scene_questions,
)
from vlkv.tools.task.tiny_llava import build_processor, build_tiny, tokens_per_image
from vlkv.tools.zoo.accuracy import full_cache_accuracy
from vlkv.tools.zoo.default import MEMBER

DEFAULTS = dict(
    steps=2400,
    max_turns=1,
    lookup_only_steps=1700,
    batch_size=16,
    lr=1e-3,
    warmup=50,
    weight_decay=0.01,
    seed=1234,
    data_seed=0,
    eval_n=300,
    eval_seed=0,
    long_eval_n=100,
    layers=4,
    hidden=128,
    heads=4,
    kv_heads=2,
    vision_hidden=64,
    vision_layers=2,
    threads=2,
    warmup_scene_steps=1400,
    low_res_steps=0,
    rope_theta=1e6,
    warmup_max_objects=4,
    warmup_ramp_steps=1600,
    probe_steps=150,
    evict_steps=1400,
    evict_lr=5e-4,
    evict_data_seed=11,
    evict_seed=0,
)
# per KINDS: counting and the two-region kind, the slowest to learn, weigh most; the long kind joins here
EVICT_KIND_WEIGHTS = [0.15, 0.2, 0.15, 0.25, 0.25]


def set_determinism(seed: int, threads: int = 1) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def conversation(
    ex: Example, index: int, seed: int, max_turns: int, kinds: set[str] | None = None
) -> list[dict]:
    """Chat for one training scene: the example's question first (exactly the evaluation format), then up to
    ``max_turns - 1`` further questions about the same image(s), so one prefill of the images carries
    several supervised answers."""
    msgs = [*ex.messages, {"role": "assistant", "content": ex.answer}]
    rng = random.Random(f"turns/{seed}/{index}")
    keys = set(COLOURS) | set(SHAPES)

    def named(qa_text: str) -> set[str]:
        return keys & set(qa_text.split())

    # Later turns never ask about a colour or shape already named, so no answer can be read off the history.
    used = named(f"{ex.question} {ex.answer}")
    extra = [
        q
        for q in scene_questions(ex.objects)
        if q.question != ex.question and (kinds is None or q.kind in kinds)
    ]
    rng.shuffle(extra)
    n_extra = rng.randint(0, max_turns - 1)
    for qa in extra:
        if n_extra == 0:
            break
        words = named(f"{qa.question} {qa.answer}")
        if words & used or (qa.kind == "count" and "count" in used):
            continue
        used |= words | ({"count"} if qa.kind == "count" else set())
        msgs += [{"role": "user", "content": qa.question}, {"role": "assistant", "content": qa.answer}]
        n_extra -= 1
    return msgs


def answer_mask(ids: torch.Tensor, assistant_id: int, colon_id: int, eos_id: int) -> torch.Tensor:
    """True on every token after "ASSISTANT :" up to and including the next eos."""
    mask = torch.zeros_like(ids, dtype=torch.bool)
    inside = False
    for j in range(len(ids)):
        t = int(ids[j])
        if inside:
            mask[j] = True
            if t == eos_id:
                inside = False
        elif t == colon_id and j > 0 and int(ids[j - 1]) == assistant_id:
            inside = True
    return mask


def collate(processor, chats: list[tuple[Example, list[dict]]]) -> dict[str, torch.Tensor]:
    """Right-padded batch; labels are -100 everywhere but the answers and their closing eos."""
    tok = processor.tokenizer
    a_id, c_id = tok.convert_tokens_to_ids("ASSISTANT"), tok.convert_tokens_to_ids(":")
    ids, labels, pixels = [], [], []
    for ex, msgs in chats:
        text = processor.apply_chat_template(msgs)
        enc = processor(images=ex.images, text=text, return_tensors="pt")
        seq = enc["input_ids"][0]
        lab = torch.where(answer_mask(seq, a_id, c_id, tok.eos_token_id), seq, torch.full_like(seq, -100))
        ids.append(seq)
        labels.append(lab)
        pixels.append(enc["pixel_values"])
    width = max(len(s) for s in ids)
    input_ids = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(ids), width), dtype=torch.long)
    lab_t = torch.full((len(ids), width), -100, dtype=torch.long)
    for i, (s, lab) in enumerate(zip(ids, labels, strict=True)):
        input_ids[i, : len(s)] = s
        attn[i, : len(s)] = 1
        lab_t[i, : len(s)] = lab
    return {
        "input_ids": input_ids,
        "attention_mask": attn,
        "labels": lab_t,
        "pixel_values": torch.cat(pixels, 0),
    }


def batches(
    seed: int,
    batch_size: int,
    max_turns: int,
    lookup_only_batches: int = 0,
    warmup_batches: int = 0,
    low_res_batches: int = 0,
    warmup_max_objects: int = 2,
    warmup_ramp_batches: int = 0,
    mix_weights: list[float] | None = None,
) -> Iterator[list[tuple[Example, list[dict]]]]:
    """Deterministic training batches, bucketed by image count so padding stays small.

    The first ``lookup_only_batches`` batches hold only colour-of-shape questions: with counting in the mix
    from the start, the model learned counting first and the colour look-up did not form (held-out
    colour-of-shape stayed below chance for 400+ steps); learned first, it survives the full mix.
    """
    lookup_only = [
        w if k.startswith("colour_of_shape") else 0.0 for k, w in zip(KINDS, KIND_WEIGHTS, strict=True)
    ]
    one_image = [1.0 if k == "colour_of_shape" else 0.0 for k in KINDS]
    pools: dict[int, list] = {1: [], 2: []}
    stage = None
    done = 0
    i = 0
    while True:
        warm = done < warmup_batches
        weights = one_image if warm else lookup_only if done < lookup_only_batches else mix_weights
        kinds = {k for k, w in zip(KINDS, weights, strict=True) if w} if weights else None
        geometry = LOW if done < low_res_batches else FULL
        if geometry is not stage:  # stage change: no batch mixes the two sizes
            stage = geometry
            for p in pools.values():
                p.clear()
        # warm-up scenes hold one shape at first, then up to ``warmup_max_objects`` in even steps
        ramp = max(1, warmup_ramp_batches or warmup_batches)
        n_obj = min(warmup_max_objects, 1 + done * warmup_max_objects // ramp) if warm else 4
        ex = make_example(i, seed, "train", weights=weights, max_objects=n_obj, geometry=geometry)
        pool = pools[len(ex.images)]
        pool.append((ex, conversation(ex, i, seed, max_turns, kinds)))
        i += 1
        if len(pool) == batch_size:
            yield list(pool)
            pool.clear()
            done += 1


def probe_targets(chats: list[tuple[Example, list[dict]]]) -> torch.Tensor:
    """``[images, tokens, 2]``: per vision token its object's shape and colour class (background: the last
    class of each), in the order the batch's images go through the vision tower."""
    colours = list(COLOURS)
    rows = []
    for ex, _ in chats:
        for objs in ex.objects:
            rows.append(
                [
                    [len(SHAPES), len(colours)]
                    if o is None
                    else [SHAPES.index(o.shape), colours.index(o.colour)]
                    for o in patch_labels(objs)
                ]
            )
    return torch.tensor(rows, dtype=torch.long)


def probe_loss(head: torch.nn.Linear, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Stage 1: a linear probe on each projected vision token names its shape and its colour (background
    included), so the features the decoder starts from carry both linearly."""
    logits = head(features).reshape(-1, len(SHAPES) + 1 + len(COLOURS) + 1)
    shape, colour = targets.reshape(-1, 2).unbind(-1)
    ce = torch.nn.functional.cross_entropy
    return ce(logits[:, : len(SHAPES) + 1], shape) + ce(logits[:, len(SHAPES) + 1 :], colour)


def lr_at(step: int, steps: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def evict_stage(model, processor, args: argparse.Namespace) -> None:
    """Stage 5: eviction-robust fine-tuning (``eviction.py``), the long kind in the mix, deterministic from
    ``--evict-seed``."""
    torch.manual_seed(args.evict_seed)
    rng = random.Random(args.evict_seed)
    steps = args.evict_steps
    opt = torch.optim.AdamW(model.parameters(), lr=args.evict_lr, betas=(0.9, 0.98), weight_decay=0.01)
    stream = batches(args.evict_data_seed, args.batch_size, 1, mix_weights=EVICT_KIND_WEIGHTS)
    image_token_id = model.config.image_token_id
    num_layers = model.config.text_config.num_hidden_layers
    use_layered_attention(model)
    model.train()
    t0 = time.time()
    for step in progress(range(steps), desc="train: eviction stage", unit="step"):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.evict_lr, 20)
        chats = next(stream)
        batch = collate(processor, chats)
        masks = eviction_masks(
            batch["input_ids"],
            batch["labels"],
            batch["attention_mask"],
            [ex for ex, _ in chats],
            image_token_id,
            num_layers,
            rng,
        )
        batch["attention_mask"] = masks[0]
        batch["evict_masks"] = masks
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(
                f"evict step {step:5d} loss {loss.item():.4f} elapsed {time.time() - t0:7.1f}s",
                flush=True,
            )
    model.set_attn_implementation({"text_config": "sdpa"})
    model.eval()


def train(args: argparse.Namespace) -> dict:
    set_determinism(args.seed, args.threads)
    tok, processor, cfg = build_tiny(
        VOCAB,
        kind="llava",
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        hidden=args.hidden,
        layers=args.layers,
        vision_hidden=args.vision_hidden,
        vision_layers=args.vision_layers,
        max_position_embeddings=2048,
        rope_theta=args.rope_theta,
        system_prompt=SYSTEM_PROMPT,
    )
    torch.manual_seed(args.seed)
    model = LlavaForConditionalGeneration(cfg)
    if args.init_from:  # stages 1-4 done already: start stage 5 from that model
        processor = AutoProcessor.from_pretrained(args.init_from)
        model = LlavaForConditionalGeneration.from_pretrained(args.init_from, dtype=torch.float32)
        args.steps = 0
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"params={n_params} vocab={len(tok)} tokens/image={tokens_per_image(IMAGE_SIZE, PATCH_SIZE)}",
        flush=True,
    )

    head = torch.nn.Linear(cfg.text_config.hidden_size, len(SHAPES) + 1 + len(COLOURS) + 1)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    decay += list(head.parameters()) if args.probe_steps else []
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    stream = batches(
        args.data_seed,
        args.batch_size,
        args.max_turns,
        args.lookup_only_steps,
        args.warmup_scene_steps,
        args.low_res_steps,
        args.warmup_max_objects,
        args.warmup_ramp_steps,
    )
    low_processor = build_processor(tok, image_size=LOW.image, patch_size=PATCH_SIZE)
    # CLIP interpolates its position embeddings to the smaller grid of the first stage (a no-op at full size)
    model.model.vision_tower.embeddings.register_forward_pre_hook(
        lambda mod, args_, kwargs: (args_, {**kwargs, "interpolate_pos_encoding": True}), with_kwargs=True
    )
    projected: list[torch.Tensor] = []
    capture = model.model.multi_modal_projector.register_forward_hook(
        lambda mod, inp, out: projected.append(out)
    )
    t0 = time.time()
    model.train()
    ema = None
    for step in progress(range(args.steps), desc="train", unit="step"):
        chats = next(stream)
        batch = collate(low_processor if step < args.low_res_steps else processor, chats)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        projected.clear()
        if step < args.probe_steps:  # stage 1: vision tower and projector only, with a linear probe head
            model.model.get_image_features(pixel_values=batch["pixel_values"])
            loss = probe_loss(head, projected[0], probe_targets(chats))
        else:
            loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == args.steps - 1:
            print(
                f"step {step:5d} loss {loss.item():.4f} ema {ema:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"elapsed {time.time() - t0:7.1f}s",
                flush=True,
            )
        if args.eval_every and step and step % args.eval_every == 0:
            model.eval()
            acc, per = full_cache_accuracy(
                MEMBER, model, processor, make_examples(100, args.eval_seed + 1, "heldout")
            )
            print(
                f"  eval@{step}: acc {acc:.3f} {json.dumps({k: round(v, 3) for k, v in per.items()})}",
                flush=True,
            )
            model.train()
    capture.remove()
    projected.clear()
    if args.evict_steps:
        evict_stage(model, processor, args)
    train_time = time.time() - t0
    model.eval()

    t1 = time.time()
    acc, per_kind = full_cache_accuracy(
        MEMBER, model, processor, make_examples(args.eval_n, args.eval_seed, "heldout")
    )
    eval_time = time.time() - t1
    print(f"held-out accuracy {acc:.4f} on {args.eval_n} ({eval_time:.1f}s): {per_kind}", flush=True)
    long_examples = [
        make_example(i, args.eval_seed, "heldout", kind=LONG_KIND) for i in range(args.long_eval_n)
    ]
    long_acc, _ = (
        full_cache_accuracy(MEMBER, model, processor, long_examples, LONG_MAX_NEW_TOKENS)
        if long_examples
        else (0.0, {})
    )
    print(f"held-out accuracy of the long kind {long_acc:.4f} on {args.long_eval_n}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "TRAINING.md")
    record = {
        "command": "python -m vlkv.tools.task.train_default_model " + " ".join(sys.argv[1:]),
        "train_seconds": round(train_time, 1),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "max_turns": args.max_turns,
        "lookup_only_steps": args.lookup_only_steps,
        "warmup_scene_steps": args.warmup_scene_steps,
        "low_res_steps": args.low_res_steps,
        "evict_steps": args.evict_steps,
        "evict_lr": args.evict_lr,
        "init_from": args.init_from or None,
        "prior_stages_seconds": _prior_seconds(args.init_from) if args.init_from else None,
        "threads": args.threads,
        "params": n_params,
        "size_bytes": size,
        "dtype": "float32",
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "tokens_per_image": tokens_per_image(IMAGE_SIZE, PATCH_SIZE),
        "text": {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
        },
        "vision": {"layers": args.vision_layers, "hidden": args.vision_hidden},
        "heldout_accuracy": round(acc, 4),
        "heldout_n": args.eval_n,
        "heldout_seed": args.eval_seed,
        "heldout_per_kind": {k: round(v, 4) for k, v in per_kind.items()},
        "heldout_long": {"kind": LONG_KIND, "n": args.long_eval_n, "accuracy": round(long_acc, 4)},
        "max_new_tokens": MAX_NEW_TOKENS,
        "torch": torch.__version__,
    }
    write_training_md(out / "TRAINING.md", record)
    print(json.dumps(record, indent=1), flush=True)
    return record


def _prior_seconds(model_dir: str) -> float | None:
    """The training time recorded in a saved model's TRAINING.md (its JSON block; the stages before it
    included), if there is one."""
    path = Path(model_dir) / "TRAINING.md"
    if not path.exists():
        return None
    text = path.read_text()
    start, end = text.find("```json"), text.rfind("```")
    try:
        rec = json.loads(text[start + len("```json") : end])
        prior = rec.get("prior_stages_seconds") or rec.get("stages_1_4_seconds") or 0.0
        return float(rec["train_seconds"]) + float(prior)
    except (ValueError, KeyError):
        return None


def write_training_md(path: Path, rec: dict) -> None:
    prior = rec.get("prior_stages_seconds") or 0.0
    total = rec["train_seconds"] + prior
    long = rec["heldout_long"]
    per_kind = "\n".join(f"| {k} | {v:.4f} |" for k, v in rec["heldout_per_kind"].items())
    lines = [
        "# Default model: a small LLaVA at LLaVA-1.5's geometry, trained on the synthetic task",
        "",
        "Trained from random init on `vlkv.tools.task.synthetic_task` (content-keyed questions, multi-token",
        "answers whose deciding words are never the first generated token), on this repo's 2-core CPU,",
        "deterministically (fixed seeds and data order; bit-exact for the same `--threads`).",
        "",
        f"- command: `{rec['command']}`",
        f"- training time: {total:.0f} s ({total / 60:.1f} min) for {rec['steps'] or DEFAULTS['steps']} "
        f"steps of batch {rec['batch_size']} (stages 1-4) and {rec['evict_steps']} eviction-robust steps "
        f"(stage 5), {rec['threads']} thread(s)",
        *(
            [
                f"- stage 5 started from `{rec['init_from']}` (stages 1-4 saved by the same command with",
                f"  `--evict-steps 0`, {prior:.0f} s); without `--init-from` the "
                "command runs all five stages in one go",
            ]
            if rec.get("init_from")
            else []
        ),
        "- stages (see the module docstring of `tools/task/train_default_model.py`): a linear probe on the",
        "  vision features, a one-image colour warm-up ramping from one shape to four, both colour kinds, the",
        "  full mix, then eviction-robust fine-tuning (`tools/task/eviction.py`): the answer's tokens after the",
        "  first see a random part of the prompt, so the model does not lean on every background patch",
        f"- parameters: {rec['params']:,} ({rec['dtype']}), on disk {rec['size_bytes'] / 1e6:.2f} MB",
        f"- images: {rec['image_size']}x{rec['image_size']}, patch {rec['patch_size']}: "
        f"**{rec['tokens_per_image']} vision tokens per image** (24x24, as LLaVA-1.5)",
        f"- vision tower: CLIP, {rec['vision']['layers']} layer(s), hidden {rec['vision']['hidden']}; projector: "
        "LLaVA-1.5's two-layer GELU MLP",
        f"- decoder: Mistral (Llama-style), {rec['text']['layers']} layers, hidden {rec['text']['hidden']}, "
        f"{rec['text']['heads']} query heads / {rec['text']['kv_heads']} KV heads (GQA), context 2048",
        "- chat template with a system prompt (written when the chat has none): one-image prompts are ~620",
        "  tokens, two-image prompts ~1,190",
        "",
        f"Held-out accuracy, full cache, greedy, max_new_tokens={rec['max_new_tokens']}, n={rec['heldout_n']} "
        f"(split `heldout`, seed {rec['heldout_seed']}): **{rec['heldout_accuracy']:.4f}**",
        "",
        "| kind | accuracy |",
        "| --- | --- |",
        per_kind,
        "",
        f"The long kind (`{long['kind']}`, not in the mix above: 69-token answers whose one deciding word is the "
        f"67th token; `vlkv eval --kv-table`), max_new_tokens={LONG_MAX_NEW_TOKENS}, n={long['n']}: "
        f"**{long['accuracy']:.4f}**",
        "",
        "Reproduce the accuracy with `python -m vlkv.tools.zoo.accuracy default -n 300`; the compressed",
        "accuracy with `vlkv eval --table -n 300`.",
        "",
        "```json",
        json.dumps(rec, indent=1),
        "```",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=type(v), default=v)
    p.add_argument("--eval-every", dest="eval_every", type=int, default=0)
    p.add_argument(
        "--init-from", dest="init_from", default="", help="a saved model of stages 1-4 (skips them)"
    )
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
