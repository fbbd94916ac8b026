"""The decoder side of the real-decoder members: SmolLM2-135M-Instruct adapted with LoRA on its top layers.

Stage 2 of ``smol_training``: the vision parts are frozen after their alignment, so every training prompt's
hidden state entering layer ``first`` is fixed; it is computed once (no gradient) and the LoRA adapters of
layers ``first..29`` (rank 8 on the attention and MLP projections, ``peft``) train on those cached states
for a few epochs, next-token loss on the answer tokens and the closing ``<|im_end|>`` only. On the lab's
shared 2 cores this is what makes a 30-layer decoder trainable in minutes: the lower layers run once per
prompt, forward only.

What ships is the adapters (``lora.safetensors``, float16, peft's key names); ``merge_lora`` adds
``scale * B @ A`` to the assembled checkpoint's decoder weights at set-up.
"""

from __future__ import annotations

import random
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
class Cached:
    """One training prompt: the hidden state entering layer ``first`` and its answer's token ids."""

    hidden: torch.Tensor  # [1, seq, hidden]
    answer: torch.Tensor  # [answer tokens] (the last prompt position predicts the first)
    prompt_len: int


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


def run_layers(decoder, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Decoder layers ``start..end-1`` of a ``LlamaForCausalLM`` over a whole causal sequence (no cache,
    batch 1, no padding), with an explicit additive causal mask (valid for every attention implementation)."""
    core = decoder.model
    n = hidden.shape[1]
    pos = torch.arange(n).unsqueeze(0)
    rope = core.rotary_emb(hidden, position_ids=pos)
    mask = torch.full((n, n), torch.finfo(hidden.dtype).min, dtype=hidden.dtype).triu(1)[None, None]
    for layer in core.layers[start:end]:
        hidden = layer(hidden, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    return hidden


@torch.no_grad()
def cache_prompt(decoder, parts, encoded, answer_ids: list[int], image_id: int, first: int) -> Cached:
    """The prompt + answer's hidden state entering layer ``first`` (teacher forcing: the answer's tokens are
    inputs too, all but the last)."""
    ids = torch.cat([encoded["input_ids"][0], torch.tensor(answer_ids[:-1], dtype=torch.long)]).unsqueeze(0)
    embeds = embed_inputs(decoder, parts, ids, encoded.get("pixel_values"), image_id)
    hidden = run_layers(decoder, embeds, 0, first)
    return Cached(hidden, torch.tensor(answer_ids), encoded["input_ids"].shape[1])


def answer_loss(decoder, item: Cached, first: int) -> torch.Tensor:
    hidden = run_layers(decoder, item.hidden, first, decoder.config.num_hidden_layers)
    start = item.prompt_len - 1
    out = decoder.model.norm(hidden[0, start : start + len(item.answer)])
    return nn.functional.cross_entropy(decoder.lm_head(out).float(), item.answer)


def train_lora(
    decoder, pool: list[Cached], spec: LoraSpec, *, epochs: int, batch: int, lr: float, seed: int, log=print
):
    """LoRA adapters on layers ``spec.first..`` trained on ``pool``; returns the peft model (adapters live,
    not merged)."""
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
    order = random.Random(f"vlkv-smol-lora/{seed}")
    steps = epochs * (len(pool) // batch)
    step = 0
    model.train()
    for epoch in range(epochs):
        idx = list(range(len(pool)))
        order.shuffle(idx)
        for b in range(len(pool) // batch):
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / 5) * (0.1 + 0.9 * (1 - step / steps))
            loss = (
                sum(answer_loss(inner, pool[i], spec.first) for i in idx[b * batch : (b + 1) * batch]) / batch
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 5 == 0 or step == steps:
                log(f"lora epoch {epoch} step {step}/{steps}: loss {loss.item():.4f}")
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
