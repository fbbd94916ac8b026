"""The decoder side of the real-decoder members: SmolLM2-135M-Instruct adapted with LoRA on its top layers.

Stage 2 of ``smol_training``: the vision parts are frozen after their alignment. Every step draws fresh
training scenes (no prompt is seen twice); each scene is **packed** (``pack``): its shared prefix (system
prompt, images) once, then one block per question about it (the question, the assistant header and the
answer), each block attending to the prefix and to itself only and placed at the positions it has in its
own prompt, so one forward carries every question a scene supports. Layers ``0..first-1`` run forward only
(no gradient); LoRA adapters (rank 8, ``peft``) on the attention and MLP projections of layers
``first..29`` train on the next-token loss of the answer tokens and the closing ``<|im_end|>``.

What ships is the adapters (``lora.safetensors``, float16, peft's key names); ``merge_lora`` adds
``scale * B @ A`` to the assembled checkpoint's decoder weights at set-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    first: int = 20  # adapters on layers first..last
    rank: int = 8
    alpha: int = 16

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class Packed:
    """One scene's prompts packed into one sequence: ``ids`` [1, seq] (every answer token but the last is
    an input too), ``positions`` [1, seq], ``allowed`` [seq, seq] (may query attend to key), and per
    question the index predicting its first answer token with the answer's ids."""

    ids: torch.Tensor
    pixel_values: torch.Tensor | None
    positions: torch.Tensor
    allowed: torch.Tensor
    targets: list[tuple[int, torch.Tensor]]


def pack(prompts: list[torch.Tensor], answers: list[list[int]], image_id: int) -> Packed:
    """Pack prompts (1-D input ids) that differ only after a common prefix holding every image token."""
    first = prompts[0]
    prefix = min(len(p) for p in prompts) - 1  # every block holds at least its prompt's last token
    for p in prompts[1:]:
        same = (p[:prefix] == first[:prefix]).long()
        prefix = min(prefix, int(same.cumprod(0).sum()))
    for p in prompts:
        if (p[prefix:] == image_id).any():
            raise ValueError("packed prompts must share a prefix holding every image token")
    ids, positions, block, targets = [first[:prefix]], [torch.arange(prefix)], [torch.full((prefix,), -1)], []
    length = prefix
    for i, (p, answer) in enumerate(zip(prompts, answers, strict=True)):
        tail = torch.cat([p[prefix:], torch.tensor(answer[:-1], dtype=torch.long)])
        ids.append(tail)
        positions.append(torch.arange(prefix, prefix + len(tail)))
        block.append(torch.full((len(tail),), i))
        targets.append((length + len(p) - prefix - 1, torch.tensor(answer)))
        length += len(tail)
    block_of = torch.cat(block)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal & ((block_of[None, :] == -1) | (block_of[None, :] == block_of[:, None]))
    return Packed(torch.cat(ids)[None], None, torch.cat(positions)[None], allowed, targets)


def embed_inputs(decoder, parts, input_ids: torch.Tensor, pixel_values, image_id: int) -> torch.Tensor:
    """LLaVA's input embeddings: the token embeddings with the image tokens' rows replaced, in order, by the
    projected vision features (``LlavaModel``'s masked scatter)."""
    is_image = input_ids == image_id
    embeds = decoder.get_input_embeddings()(
        input_ids.masked_fill(is_image, 0)
    )  # the decoder has no image row
    if pixel_values is None:
        return embeds
    feats = parts(pixel_values).reshape(-1, embeds.shape[-1]).to(embeds.dtype)
    mask = is_image.unsqueeze(-1).expand_as(embeds)
    if int(mask[..., 0].sum()) != feats.shape[0]:
        raise ValueError("image tokens and vision features differ in number")
    return embeds.masked_scatter(mask, feats)


def run_layers(decoder, hidden: torch.Tensor, start: int, end: int, packed: Packed) -> torch.Tensor:
    """Decoder layers ``start..end-1`` of a ``LlamaForCausalLM`` over a packed sequence (no cache, batch 1),
    with ``packed``'s positions and an explicit additive mask (valid for every attention implementation)."""
    core = decoder.model
    rope = core.rotary_emb(hidden, position_ids=packed.positions)
    mask = torch.zeros(packed.allowed.shape, dtype=hidden.dtype)
    mask = mask.masked_fill(~packed.allowed, torch.finfo(hidden.dtype).min)[None, None]
    for layer in core.layers[start:end]:
        hidden = layer(hidden, attention_mask=mask, position_ids=packed.positions, position_embeddings=rope)
    return hidden


def answer_logits(decoder, hidden: torch.Tensor, packed: Packed) -> list[torch.Tensor]:
    """Per question, the logits predicting its answer tokens (from the last layer's ``hidden``)."""
    return [
        decoder.lm_head(decoder.model.norm(hidden[0, s : s + len(answer)])).float()
        for s, answer in packed.targets
    ]


def packed_loss(decoder, parts, packed: Packed, image_id: int, first: int) -> tuple[torch.Tensor, float]:
    """The mean answer-token loss of one packed scene (layers below ``first`` without gradient) and the
    fraction of its questions whose answer tokens are all the argmax."""
    with torch.no_grad():
        hidden = embed_inputs(decoder, parts, packed.ids, packed.pixel_values, image_id)
        hidden = run_layers(decoder, hidden, 0, first, packed)
    hidden = run_layers(decoder, hidden, first, decoder.config.num_hidden_layers, packed)
    logits = answer_logits(decoder, hidden, packed)
    answers = [a for _, a in packed.targets]
    loss = nn.functional.cross_entropy(torch.cat(logits), torch.cat(answers))
    right = sum(bool(lg.argmax(-1).eq(a).all()) for lg, a in zip(logits, answers, strict=True))
    return loss, right / len(answers)


def train_lora(
    decoder,
    parts,
    draw: Callable[[int], Packed],
    spec: LoraSpec,
    *,
    image_id: int,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    check: Callable[[nn.Module], float] | None = None,
    check_every: int = 0,
    log=print,
):
    """LoRA adapters on layers ``spec.first..`` trained for ``steps`` steps of ``batch`` scenes, scene ``k``
    of the run being ``draw(k)`` (each drawn once); ``check(decoder)`` is logged every ``check_every``
    steps. Returns the peft model (adapters live, not merged)."""
    from peft import LoraConfig, get_peft_model  # training only (the smollm2 extra): assembly never needs it

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=0.0,
        target_modules=list(TARGETS),
        layers_to_transform=list(range(spec.first, decoder.config.num_hidden_layers)),
    )
    torch.manual_seed(seed)
    model = get_peft_model(decoder, config)
    inner = model.base_model.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * (1 - step / steps))
        opt.zero_grad()
        total = fit = 0.0
        for j in range(batch):
            loss, right = packed_loss(inner, parts, draw(step * batch + j), image_id, spec.first)
            (loss / batch).backward()
            total += loss.item() / batch
            fit += right / batch
        opt.step()
        if (step + 1) % 5 == 0 or step + 1 == steps:
            log(f"lora step {step + 1}/{steps}: loss {total:.4f}, train argmax {fit:.2f}")
        if check is not None and check_every and ((step + 1) % check_every == 0 or step + 1 == steps):
            model.eval()
            log(f"lora step {step + 1}: validation argmax accuracy {check(inner):.3f}")
            model.train()
    model.eval()
    return model


def lora_state(model) -> dict[str, torch.Tensor]:
    """The adapters in peft's key names (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to(torch.float16).contiguous() for k, v in get_peft_model_state_dict(model).items()}


def _deltas(state: dict[str, torch.Tensor], scale: float):
    """``(decoder-relative module path, scale * B @ A)`` per adapted projection, path like
    ``layers.N.self_attn.q_proj``."""
    prefix = "base_model.model.model."
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        path = key[len(prefix) : -len(".lora_A.weight")]
        b = state[key.replace("lora_A", "lora_B")]
        yield path, scale * (b.float() @ a.float())


def merge_lora(language_model: nn.Module, state: dict[str, torch.Tensor], scale: float) -> float:
    """Add the adapters into ``language_model`` (a ``LlamaModel``: the LLaVA checkpoint's decoder, or a
    ``LlamaForCausalLM``'s ``.model``) in place; returns the relative weight change over the adapted
    matrices, ``||delta||_F / ||W||_F``."""
    num = den = 0.0
    with torch.no_grad():
        for path, delta in _deltas(state, scale):
            weight = language_model.get_submodule(path).weight
            den += weight.float().pow(2).sum().item()
            num += delta.pow(2).sum().item()
            weight.add_(delta.to(weight.dtype))
    if den == 0.0:
        raise ValueError("no LoRA adapters in the given state")
    return (num / den) ** 0.5
