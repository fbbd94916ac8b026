"""Train the default tiny LLaVA on the synthetic task and save it in Hugging Face format.

    python -m vlkv_lab.task.train_default_model --out common/default_model

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
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration
from vlkv.deploy.synthetic_task import (
    COLOURS,
    FULL,
    IMAGE_SIZE,
    KIND_WEIGHTS,
    KINDS,
    LONG_KIND,
    LONG_MAX_NEW_TOKENS,
    LOW,
    PATCH_SIZE,
    SHAPES,
    SYSTEM_PROMPT,
    VOCAB,
    Example,
    make_example,
    patch_labels,
    scene_questions,
)

from vlkv_lab.task.tiny_llava import build_processor, build_tiny, tokens_per_image
from vlkv_lab.zoo.accuracy import full_cache_accuracy
from vlkv_lab.zoo.default import MEMBER
from vlkv_lab.zoo.trainer import Probe, Recipe, Stage, interpolate_positions
from vlkv_lab.zoo.trainer import main as train_command

DEFAULTS = (
    dict(
        steps=2400, max_turns=1, lookup_only_steps=1700, batch_size=16, lr=1e-3, warmup=50, weight_decay=0.01
    )
    | dict(seed=1234, data_seed=0, eval_n=300, eval_seed=0, long_eval_n=100, threads=2)
    | dict(layers=4, hidden=128, heads=4, kv_heads=2, vision_hidden=64, vision_layers=2, rope_theta=1e6)
    | dict(
        warmup_scene_steps=1400,
        low_res_steps=0,
        warmup_max_objects=4,
        warmup_ramp_steps=1600,
        probe_steps=150,
    )
    | dict(evict_steps=1400, evict_lr=5e-4, evict_data_seed=11, evict_seed=0)
)
# per KINDS: counting and the two-region kind, the slowest to learn, weigh most; the long kind joins here
EVICT_KIND_WEIGHTS = [0.15, 0.2, 0.15, 0.25, 0.25]


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


def build(args: argparse.Namespace):
    """The model (from random init, or ``--init-from`` a saved model of stages 1-4) and its two stages."""
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
    low_processor = build_processor(tok, image_size=LOW.image, patch_size=PATCH_SIZE)
    interpolate_positions(model)  # the first stage's smaller grid (a no-op at full size)

    def main_stream(steps: int) -> Iterator[list]:
        return batches(
            args.data_seed,
            args.batch_size,
            args.max_turns,
            args.lookup_only_steps,
            args.warmup_scene_steps,
            args.low_res_steps,
            args.warmup_max_objects,
            args.warmup_ramp_steps,
        )

    def evict_stream(steps: int) -> Iterator[list]:
        return batches(args.evict_data_seed, args.batch_size, 1, mix_weights=EVICT_KIND_WEIGHTS)

    low = (lambda i: low_processor if i < args.low_res_steps else processor) if args.low_res_steps else None
    probe = Probe(args.probe_steps, len(SHAPES), probe_targets) if args.probe_steps else None
    stages = [
        Stage(
            "stages 1-4",
            args.steps,
            args.lr,
            main_stream,
            args.warmup,
            probe=probe,
            processor_at=low,
            weight_decay=args.weight_decay,
        ),
        Stage(
            "eviction-robust",
            args.evict_steps,
            args.evict_lr,
            evict_stream,
            warmup=20,
            evict_seed=args.evict_seed,
            decay_groups=False,
        ),
    ]
    return model, processor, stages


def report(model, processor, args: argparse.Namespace) -> dict:
    """The long kind's held-out accuracy and the facts ``TRAINING.md`` states."""
    longs = [make_example(i, args.eval_seed, "heldout", kind=LONG_KIND) for i in range(args.long_eval_n)]
    long_acc = full_cache_accuracy(MEMBER, model, processor, longs, LONG_MAX_NEW_TOKENS)[0] if longs else 0.0
    print(f"held-out accuracy of the long kind {long_acc:.4f} on {args.long_eval_n}", flush=True)
    return {
        "init_from": args.init_from or None,
        "prior_stages_seconds": _prior_seconds(args.init_from) if args.init_from else None,
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
        "heldout_seed": args.eval_seed,
        "heldout_long": {"kind": LONG_KIND, "n": args.long_eval_n, "accuracy": round(long_acc, 4)},
    }


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
        "Trained from random init on `vlkv.deploy.synthetic_task` (content-keyed questions, multi-token",
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
        "- stages (see the module docstring of `lab/vlkv_lab/task/train_default_model.py`): a linear probe on the",
        "  vision features, a one-image colour warm-up ramping from one shape to four, both colour kinds, the",
        "  full mix, then eviction-robust fine-tuning (`lab/vlkv_lab/task/eviction.py`): the answer's tokens after the",
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
        f"67th token; `vlkv eval kv-table`), max_new_tokens={LONG_MAX_NEW_TOKENS}, n={long['n']}: "
        f"**{long['accuracy']:.4f}**",
        "",
        "Reproduce the accuracy with `python -m vlkv_lab.zoo.accuracy default -n 300`; the compressed",
        "accuracy with `vlkv eval table -n 300`.",
        "",
        "```json",
        json.dumps(rec, indent=1),
        "```",
        "",
    ]
    path.write_text("\n".join(lines))


RECIPE = Recipe(MEMBER, DEFAULTS | {"init_from": ""}, build, report, write_training_md)


def main(argv: list[str] | None = None) -> None:
    train_command(RECIPE, argv)


if __name__ == "__main__":
    main()
