"""Training batches for the one trainer (``lab/vlkv_lab/zoo/trainer.py``): chats, their streams and their collation
(labels on the answers and their eos only)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from vlkv.deploy.synthetic_task import Example

Chat = tuple[Example, list[dict]]
"""One training conversation: the example (its images) and its messages, answers included."""


def one_turn(examples: list[Example]) -> list[Chat]:
    """Each example's question and its answer as one chat."""
    return [(ex, [*ex.messages, {"role": "assistant", "content": ex.answer}]) for ex in examples]


def consecutive(make: Callable[[int], Example], batch_size: int) -> Iterator[list[Chat]]:
    """One-turn batches of consecutive examples ``make(0), make(1), ...``."""
    i = 0
    while True:
        yield one_turn([make(i + j) for j in range(batch_size)])
        i += batch_size


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


def collate(processor, chats: list[Chat]) -> dict[str, torch.Tensor]:
    """Right-padded batch; labels are -100 everywhere but the answers and their closing eos. Every tensor
    the processor returns besides the ids (``pixel_values``, LLaVA-NeXT's ``image_sizes``) is concatenated
    along the batch."""
    tok = processor.tokenizer
    a_id, c_id = tok.convert_tokens_to_ids("ASSISTANT"), tok.convert_tokens_to_ids(":")
    ids, labels, extra = [], [], {}
    for ex, msgs in chats:
        enc = processor(images=ex.images, text=processor.apply_chat_template(msgs), return_tensors="pt")
        seq = enc["input_ids"][0]
        ids.append(seq)
        labels.append(torch.where(answer_mask(seq, a_id, c_id, tok.eos_token_id), seq, -100))
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
