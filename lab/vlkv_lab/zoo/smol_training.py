"""One training command for the real-decoder members (``smol_objects``, ``smol_codes``), and their assembly.

``python -m vlkv_lab.zoo.<member> [--out DIR]`` (deterministic from ``--seed``; 1 thread by default; the
member's ``RECIPE`` sets the other flags' defaults):

1. **Align** (``smol_vision.align``, no decoder forward): a tiny CLIP tower + LLaVA's projector learn to put
   each vision token on the decoder's input embedding of the word describing its patch.
2. **Adapt** (``smol_lm``): with the vision parts frozen, LoRA adapters (rank 8) on layers ``--first``..29
   train for ``--steps`` steps of ``--batch`` fresh training scenes (each drawn once, every question it
   supports packed into one sequence by the member's ``variants``; loss on the answer tokens only; layers
   below ``--first`` forward only). Every ``--check-every`` steps the log shows the teacher-forced argmax
   accuracy on ``--check-n`` unseen training-split scenes (never the held-out split).
3. **Evaluate**: the checkpoint assembled exactly as at set-up (``assemble``: SmolLM2 from the GGUF, the
   trained parts, the adapters merged, bfloat16), greedy ``generate`` on ``--eval-n`` held-out examples.
4. **Write** ``DIR/vision.safetensors`` (tower + projector, float32), ``DIR/lora.safetensors`` (float16)
   and ``DIR/TRAINING.json`` (command, seed, steps, wall times, the decoder's relative weight change,
   held-out accuracy).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vlkv_lab.task.tiny_llava import build_processor
from vlkv_lab.zoo import smollm2
from vlkv_lab.zoo.interface import Member
from vlkv_lab.zoo.smol_lm import LoraSpec, lora_state, merge_lora, pack, packed_loss, train_lora
from vlkv_lab.zoo.smol_vision import GEOM, VisionParts, align, vision_config
from vlkv_lab.zoo.trainer import set_determinism

SHIPPED = Path(__file__).resolve().parent / "models"
VISION_FILE = "vision.safetensors"
LORA_FILE = "lora.safetensors"
RECORD_FILE = "TRAINING.json"
END = "<|im_end|>"
CHECK_FROM = 1_000_000  # validation scenes: training-split indices no run of this size draws


def text_side(tokenizer):
    """The tokenizer with the image token and the LLaVA chat template, and its processor (what
    ``smollm2.build_llava`` gives the assembled checkpoint)."""
    tokenizer.add_tokens([smollm2.IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = smollm2.CHAT_TEMPLATE
    processor = build_processor(tokenizer, image_size=GEOM.image, patch_size=GEOM.patch)
    return processor, tokenizer.convert_tokens_to_ids(smollm2.IMAGE_TOKEN)


def prompt_text(processor, example) -> str:
    return processor.apply_chat_template(example.messages, add_generation_prompt=True)


def encode(processor, example):
    return processor(text=prompt_text(processor, example), images=example.images, return_tensors="pt")


def shipped_dir(name: str) -> Path:
    """Where a member's trained parts are shipped (package data): ``lab/vlkv_lab/zoo/models/<name>/``."""
    return SHIPPED / name


def build(model_dir: Path):
    """``(LlavaForConditionalGeneration, processor, relative weight change)``: SmolLM2 from the GGUF, the
    trained vision parts in ``model_dir``, its LoRA adapters merged into the decoder (float32; ``assemble``
    stores bfloat16)."""
    vision = load_file(str(model_dir / VISION_FILE))
    record = json.loads((model_dir / RECORD_FILE).read_text())
    model, processor = smollm2.build_llava(vision_config(), vision, dtype=torch.float32)
    change = merge_lora(
        model.model.language_model, load_file(str(model_dir / LORA_FILE)), record["lora"]["scale"]
    )
    return model, processor, change


def checkpoint_dir(name: str) -> Path:
    """The assembled checkpoint's folder: ``<model cache>/<name>-<digest of the shipped files>``, so new
    trained parts get a new checkpoint (``smollm2.cache_root()``; nothing is built here)."""
    digest = hashlib.sha256()
    for file in (VISION_FILE, LORA_FILE, RECORD_FILE):
        path = shipped_dir(name) / file
        digest.update(path.read_bytes() if path.is_file() else b"missing")
    return smollm2.cache_root() / f"{name}-{digest.hexdigest()[:10]}"


def assemble(name: str) -> Path:
    """The member's full Hugging Face checkpoint (``checkpoint_dir``), assembled from the GGUF and the shipped
    parts on first use (``smollm2.ensure_checkpoint``: bfloat16, written atomically, then found at once)."""
    return smollm2.ensure_checkpoint(checkpoint_dir(name).name, build=lambda: build(shipped_dir(name))[:2])


def smol_member(name: str, make_example, *, max_new_tokens: int, geometry: str, **facts) -> Member:
    """A real-decoder member: its examples drawn one index at a time by ``make_example(index, seed, split)``,
    its checkpoint assembled from the GGUF and its shipped parts on first use (``assemble``)."""

    def make_examples(n: int, seed: int = 0, split: str = "heldout") -> list:
        return [make_example(i, seed, split) for i in range(n)]

    return Member(
        name=name,
        model_dir=checkpoint_dir(name),
        max_new_tokens=max_new_tokens,
        geometry=geometry,
        make_examples=make_examples,
        assemble=partial(assemble, name),
        **facts,
    )


def generate(model, processor, example, max_new_tokens: int) -> str:
    inputs = encode(processor, example)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def evaluate(model, processor, member: Member, n: int, seed: int = 0, log=print) -> dict:
    right = 0
    for i, ex in enumerate(member.make_examples(n, seed=seed, split="heldout")):
        text = generate(model, processor, ex, member.max_new_tokens)
        right += member.is_correct(text, ex)
        if i < 5 or (i + 1) % 10 == 0:
            log(f"eval {i + 1}/{n}: {right} right; {ex.question[-60:]!r} -> {text!r} (answer {ex.answer!r})")
    return {"n": n, "right": right, "accuracy": right / max(1, n)}


def train_member(
    member: Member, make_example, recipe: dict, argv: list[str] | None = None, *, variants=lambda ex: [ex]
) -> dict:
    """The member's training command (``recipe``: its defaults for the flags below)."""
    p = argparse.ArgumentParser(description=f"train zoo member {member.name}: {__doc__.splitlines()[0]}")
    p.add_argument("--out", default=str(shipped_dir(member.name)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--align-steps", type=int, default=recipe.get("align_steps", 150))
    p.add_argument("--steps", type=int, default=recipe.get("steps", 200))
    p.add_argument("--batch", type=int, default=recipe.get("batch", 4))
    p.add_argument("--first", type=int, default=recipe.get("first", 20))
    p.add_argument("--lr", type=float, default=recipe.get("lr", 1e-3))
    p.add_argument("--eval-n", type=int, default=40)
    p.add_argument("--check-n", type=int, default=16, help="validation scenes (unseen, training split)")
    p.add_argument("--check-every", type=int, default=recipe.get("check_every", 25))
    p.add_argument(
        "--vision-from", default=recipe.get("vision_from"), help="reuse these aligned vision parts"
    )
    args = p.parse_args(argv)
    set_determinism(args.seed, args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    t0 = time.time()
    decoder, tokenizer = smollm2.load_decoder(torch.float32)
    decoder.requires_grad_(False)
    decoder.set_attn_implementation("sdpa")  # the GGUF load leaves none set (eager): sdpa is faster
    processor, image_id = text_side(tokenizer)
    parts = VisionParts(decoder.config)
    if args.vision_from:  # another member's aligned parts (the same stage 1), reused as they are
        parts.load_state_dict({k.removeprefix("model."): v for k, v in load_file(args.vision_from).items()})
        aligned = {"from": args.vision_from}
    else:
        aligned = align(
            parts,
            decoder.get_input_embeddings().weight,
            tokenizer,
            processor.image_processor,
            steps=args.align_steps,
            seed=args.seed,
            log=log,
        )
    save_file({k: v.contiguous() for k, v in parts.llava_state().items()}, str(out / VISION_FILE))
    parts.requires_grad_(False)
    t_align = time.time()
    spec = LoraSpec(first=args.first)
    decoder = decoder.to(torch.bfloat16)  # the served precision; the adapters train in float32
    parts.to(torch.bfloat16)

    def draw(index: int, split: str = "train", variants=variants):
        example = make_example(index, args.seed, split)
        group = variants(example)
        prompts = [encode(processor, ex) for ex in group]
        answers = [tokenizer(ex.answer + END, add_special_tokens=False)["input_ids"] for ex in group]
        packed = pack([p["input_ids"][0] for p in prompts], answers, image_id)
        packed.pixel_values = prompts[0]["pixel_values"].to(torch.bfloat16)
        return packed

    def check(model) -> float:  # unseen training-split scenes, one question each: teacher-forced argmax
        with torch.no_grad():
            fits = [
                packed_loss(model, parts, draw(CHECK_FROM + i, variants=lambda ex: [ex]), image_id, 0)[1]
                for i in range(args.check_n)
            ]
        return sum(fits) / max(1, len(fits))

    peft_model = train_lora(
        decoder,
        parts,
        draw,
        spec,
        image_id=image_id,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        check=check if args.check_n else None,
        check_every=args.check_every,
        log=log,
    )
    parts.float()
    adapters = lora_state(peft_model)
    t_lora = time.time()
    save_file(adapters, str(out / LORA_FILE))
    record = {
        "member": member.name,
        "command": f"python -m vlkv_lab.zoo.{member.name} "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "seed": args.seed,
        "threads": args.threads,
        "align": {"steps": 0 if args.vision_from else args.align_steps, "batch": 8, **aligned},
        "lora": {
            "rank": spec.rank,
            "alpha": spec.alpha,
            "scale": spec.scale,
            "layers": [spec.first, 29],
            "scenes": args.steps * args.batch,
            "batch": args.batch,
            "lr": args.lr,
            "steps": args.steps,
        },
        "wall_s": {
            "align": round(t_align - t0),
            "lora": round(t_lora - t_align),
        },
    }
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    del peft_model, decoder
    model, processor, change = build(out)
    record["lora"]["relative_weight_change"] = change
    model = model.to(torch.bfloat16)
    record["heldout"] = evaluate(model, processor, member, args.eval_n, seed=args.seed, log=log)
    record["wall_s"]["total"] = round(time.time() - t0)
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    log(json.dumps(record))
    return record
