"""Shared parts of the zoo members ``next_anyres`` and ``deep8``: scenes, questions, scoring, fine-tuning from
the default model, and per-layer post-vision attention sparsity.

Both members ask the default model's kind of look-up (the question names a shape, unique in the image; the
answer repeats the shape and names its colour: ``"what colour is the cross ?" -> "the cross red ."``) in new
geometry: ``next_anyres`` on small objects in wide or tall LLaVA-NeXT images whose shape only the
full-resolution tiles show, ``deep8`` on two objects in opposite corners read by an 8-layer decoder. The
deciding colour word is the 3rd generated token (the 7th too in ``deep8``'s two-key answers). Objects are the
default task's textured silhouettes (``synthetic_task``: the texture names the shape in every patch), drawn at
member-specific sizes on member-specific canvases; within an image shapes and colours are pairwise distinct.

What did not train in time (kept here as the lesson): the *inverse* look-up, colour-keyed ("what shape is the
red one ?" -> "the red cross ."). Fine-tuned from the default model, the answer's copy of the colour key did
not form: after 100 steps (batch 8, 1-3 objects, 168 px) its loss was still 0.92 nats on two-object scenes
and 1.58 on three-object ones (the model named a colour it saw in the image, not the one asked: the default
copies shape words, not colour words), and 450 steps of the whole recipe reached 0.36 held-out on 336 px
images (``deep8``: 0.047 after 370 steps). Training at most 60 minutes on this shared 2-core CPU left no
room for the several hundred more steps the copy needed.

Scoring: the colour and shape words of the generated text (up to the first eos), in order, must equal those of
the reference answer (so a wrong key copy is wrong too).

The vocabulary, tokenizer and system prompt are the default model's (every question and answer word is in
it), so the members fine-tune from ``common/default_model`` without new embeddings.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw
from vlkv.tools.progress import progress
from vlkv.tools.task.synthetic_task import (
    BACKGROUND,
    COLOURS,
    OUTLINE,
    OUTLINE_WIDTH,
    SHAPES,
    Example,
    Obj,
    _silhouette,
    _texture,
)

PATCH = 14
CONTENT_WORDS = set(COLOURS) | set(SHAPES)


@dataclass(frozen=True)
class Placed:
    """An object at a patch-aligned place: ``cell`` is (row, col) of its top-left patch, ``span`` patches wide."""

    shape: str
    colour: str
    cell: tuple[int, int]
    span: int

    def obj(self) -> Obj:
        return Obj(self.shape, self.colour, self.cell)


def render(items: list[Placed], width: int, height: int, rng: random.Random) -> Image.Image:
    """Textured silhouettes with a light outline on a dark background (small jitter of background and colours),
    each covering ``span`` x ``span`` patches of ``PATCH`` pixels."""
    bg = tuple(max(0, min(255, v + rng.randint(-6, 6))) for v in BACKGROUND)
    img = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(img)
    for it in items:
        box = it.span * PATCH
        rgb = tuple(max(0, min(255, v + rng.randint(-20, 20))) for v in COLOURS[it.colour])
        r, c = it.cell
        x0, y0 = c * PATCH, r * PATCH
        mask = Image.new("L", (box, box), 0)
        _silhouette(ImageDraw.Draw(mask), it.shape, 0, 0, box - 1, box - 1, fill=255)
        img.paste(_texture(it.shape, rgb, box), (x0, y0), mask)
        _silhouette(draw, it.shape, x0, y0, x0 + box - 1, y0 + box - 1, outline=OUTLINE, width=OUTLINE_WIDTH)
    return img


def free_cells(rows: int, cols: int, span: int, taken: list[Placed], gap: int = 1) -> list[tuple[int, int]]:
    """Top-left cells where a ``span``-wide object fits in a ``rows`` x ``cols`` patch grid without touching
    (``gap`` patches apart from) any object in ``taken``."""
    out = []
    for r in range(rows - span + 1):
        for c in range(cols - span + 1):
            if all(
                r + span + gap <= t.cell[0]
                or t.cell[0] + t.span + gap <= r
                or c + span + gap <= t.cell[1]
                or t.cell[1] + t.span + gap <= c
                for t in taken
            ):
                out.append((r, c))
    return out


# --- questions and scoring -------------------------------------------------------------------------------


def qa_one(it: Placed) -> tuple[str, str]:
    return f"what colour is the {it.shape} ?", f"the {it.shape} {it.colour} ."


def qa_two(a: Placed, b: Placed) -> tuple[str, str]:
    return (
        f"what colour are the {a.shape} and the {b.shape} ?",
        f"the {a.shape} {a.colour} and the {b.shape} {b.colour} .",
    )


_WORD_RE = re.compile(r"[a-z]+")


def content_words(text: str) -> list[str]:
    """The colour and shape words of ``text``, in order."""
    return [w for w in _WORD_RE.findall(text.lower()) if w in CONTENT_WORDS]


def is_correct(generated_text: str, example: Example) -> bool:
    """True iff the colour and shape words of the generated text (up to the first eos) are those of the
    reference answer, in order."""
    return content_words(generated_text.split("</s>")[0]) == content_words(example.answer)


def prompt_text(processor, example: Example) -> str:
    return processor.apply_chat_template(example.messages, add_generation_prompt=True)


def example_rng(member: str, split: str, seed: int, index: int) -> random.Random:
    """One ``random.Random`` per example; the split name keeps train and held-out seed spaces disjoint."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return random.Random(f"vlkv-zoo-{member}/{split}/{seed}/{index}")


# --- evaluation -----------------------------------------------------------------------------------------


def generate_answer(model, processor, example: Example, max_new_tokens: int) -> str:
    """Greedy full-cache answer (the decoded continuation, special tokens stripped)."""
    inputs = processor(images=example.images, text=prompt_text(processor, example), return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def evaluate(
    model, processor, examples: list[Example], max_new_tokens: int
) -> tuple[float, dict[str, float]]:
    """Greedy full-cache accuracy overall and per kind (``model.generate``)."""
    hits: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    for ex in progress(examples, desc="evaluate", unit="example"):
        totals[ex.kind] += 1
        hits[ex.kind] += is_correct(generate_answer(model, processor, ex, max_new_tokens), ex)
    acc = sum(hits.values()) / max(1, sum(totals.values()))
    return acc, {k: hits[k] / totals[k] for k in sorted(totals)}


# --- fine-tuning ----------------------------------------------------------------------------------------


def answer_labels(ids: torch.Tensor, assistant_id: int, colon_id: int, eos_id: int) -> torch.Tensor:
    """``ids`` with -100 everywhere but the tokens after the last "ASSISTANT :" up to and including eos."""
    labels = torch.full_like(ids, -100)
    starts = [j for j in range(1, len(ids)) if ids[j] == colon_id and ids[j - 1] == assistant_id]
    for j in range(starts[-1] + 1, len(ids)):
        labels[j] = ids[j]
        if ids[j] == eos_id:
            break
    return labels


def collate(processor, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded batch of one-turn chats (question, answer); labels only on the answer and its eos. Every
    tensor the processor returns besides the ids (``pixel_values``, LLaVA-NeXT's ``image_sizes``) is
    concatenated along the batch."""
    tok = processor.tokenizer
    a_id, c_id = tok.convert_tokens_to_ids("ASSISTANT"), tok.convert_tokens_to_ids(":")
    ids, labels, extra = [], [], {}
    for ex in examples:
        msgs = [*ex.messages, {"role": "assistant", "content": ex.answer}]
        enc = processor(images=ex.images, text=processor.apply_chat_template(msgs), return_tensors="pt")
        seq = enc["input_ids"][0]
        ids.append(seq)
        labels.append(answer_labels(seq, a_id, c_id, tok.eos_token_id))
        for k, v in enc.items():
            if k not in ("input_ids", "attention_mask"):
                extra.setdefault(k, []).append(v)
    width = max(len(s) for s in ids)
    batch = {
        "input_ids": torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(ids), width), dtype=torch.long),
        "labels": torch.full((len(ids), width), -100, dtype=torch.long),
    }
    for i, (s, lab) in enumerate(zip(ids, labels, strict=True)):
        batch["input_ids"][i, : len(s)] = s
        batch["attention_mask"][i, : len(s)] = 1
        batch["labels"][i, : len(s)] = lab
    return batch | {k: torch.cat(v, 0) for k, v in extra.items()}


def lr_at(step: int, steps: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 5% of ``base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def set_determinism(seed: int, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def finetune(
    model,
    processor,
    stream: Iterator[list[Example]],
    steps: int,
    lr: float,
    warmup: int = 30,
    weight_decay: float = 0.01,
    log_every: int = 25,
    on_log: Callable[[int], None] | None = None,
) -> float:
    """Next-token loss on the answers (full attention, no eviction), AdamW, every parameter trained; returns
    the training seconds."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    model.train()
    t0, ema = time.time(), None
    for step in progress(range(steps), desc="train", unit="step"):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        loss = model(**collate(processor, next(stream))).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % log_every == 0 or step == steps - 1:
            print(
                f"step {step:5d} loss {loss.item():.4f} ema {ema:.4f} elapsed {time.time() - t0:7.1f}s",
                flush=True,
            )
            if on_log is not None:
                on_log(step)
                model.train()
    model.eval()
    return time.time() - t0


def batches(make: Callable[[int], Example], batch_size: int) -> Iterator[list[Example]]:
    """Consecutive examples ``make(0), make(1), ...`` in batches."""
    i = 0
    while True:
        yield [make(i + j) for j in range(batch_size)]
        i += batch_size


# --- attention sparsity ---------------------------------------------------------------------------------


class _SparsityObserver:
    """``vlkv_stats`` observer: per layer, the share of post-vision attention entries below ``p`` times their
    row's max (``kernels.attention_stats_reference`` -> ``common.compression.stats.layer_sparsity``)."""

    def __init__(self, q_start: int, threshold: float) -> None:
        self.q_start, self.threshold = q_start, threshold
        self.per_layer: dict[int, float] = {}

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        from vlkv.common.compression.stats import layer_sparsity
        from vlkv.kernels.attention_stats_reference import attention_stats_reference

        stats = attention_stats_reference(
            query[0, :, self.q_start :], key[0], q_start=self.q_start, scale=scaling, threshold=self.threshold
        )
        self.per_layer[layer_idx] = layer_sparsity(stats)


def layer_sparsities(model, processor, examples: list[Example], threshold: float = 0.01) -> list[float]:
    """Mean over ``examples`` of each layer's post-vision attention sparsity (VL-Cache's gamma_l: query rows
    after the last vision token, threshold ``p``), from the full prompt's prefill."""
    from vlkv.common.model.attention import use_vlkv_attention
    from vlkv.common.model.inputs import ModalityMap

    use_vlkv_attention(model)
    sums: list[float] = []
    for ex in examples:
        inputs = processor(images=ex.images, text=prompt_text(processor, ex), return_tensors="pt")
        modality = ModalityMap.from_input_ids(inputs["input_ids"], model.config.image_token_id)
        obs = _SparsityObserver(modality.m - modality.tau, threshold)
        with torch.no_grad():
            model(**inputs, vlkv_stats=obs)
        vals = [obs.per_layer[i] for i in range(len(obs.per_layer))]
        sums = [a + b for a, b in zip(sums, vals, strict=True)] if sums else vals
    model.set_attn_implementation({"text_config": "sdpa"})
    return [s / len(examples) for s in sums]


def heldout_accuracy(name: str, n: int = 300, seed: int = 0) -> tuple[float, dict[str, float]]:
    """Held-out full-cache greedy accuracy (``model.generate``) of the shipped checkpoint of member ``name``,
    loaded through the product's ``load_model`` / ``load_processor``."""
    from vlkv.common.config import ModelConfig
    from vlkv.common.model.loading import load_model, load_processor
    from vlkv.tools.zoo import member

    mod = member(name)
    model = load_model(ModelConfig(path=str(mod.MODEL_DIR)))
    processor = load_processor(str(mod.MODEL_DIR))
    return evaluate(model, processor, mod.make_examples(n, seed, "heldout"), mod.MAX_NEW_TOKENS)


def main(argv: list[str] | None = None) -> None:
    """``python -m vlkv.tools.zoo.next_scenes MEMBER [-n 300] [--sparsity 50]``: a shipped member's held-out
    full-cache accuracy and (``--sparsity N``) its per-layer post-vision attention sparsity over N examples."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("member")
    p.add_argument("-n", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sparsity", type=int, default=0, help="examples for the per-layer sparsity (0: skip)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.n:
        acc, per_kind = heldout_accuracy(args.member, args.n, args.seed)
        print(
            f"{args.member}: held-out full-cache accuracy {acc:.4f} (n={args.n}, seed {args.seed}) {per_kind}"
        )
    if args.sparsity:
        from vlkv.common.config import ModelConfig
        from vlkv.common.model.loading import load_model, load_processor
        from vlkv.tools.zoo import member

        mod = member(args.member)
        model = load_model(ModelConfig(path=str(mod.MODEL_DIR)))
        gamma = layer_sparsities(model, load_processor(str(mod.MODEL_DIR)), mod.make_examples(args.sparsity))
        print(
            f"{args.member}: per-layer post-vision sparsity (p=0.01, n={args.sparsity}):",
            [round(g, 3) for g in gamma],
        )


if __name__ == "__main__":
    main()
