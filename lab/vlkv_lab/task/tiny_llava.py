"""Offline builders for tiny LLaVA / LLaVA-NeXT models, tokenizers and processors.

Nothing here touches the network: the tokenizer is a word-level ``tokenizers`` model built from a word
list, the processors are the real transformers classes wired to PIL-backend CLIP-style image processors,
and the configs are a small CLIP vision tower plus a Mistral (GQA or MHA) decoder.
"""

from __future__ import annotations

from typing import Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CLIPVisionConfig,
    LlavaConfig,
    LlavaNextConfig,
    LlavaNextProcessor,
    LlavaProcessor,
    MistralConfig,
    PreTrainedTokenizerFast,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

Kind = Literal["llava", "llava_next"]

PAD, BOS, EOS, UNK, IMAGE = "<pad>", "<s>", "</s>", "<unk>", "<image>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, IMAGE]  # ids 0..4 in this order
FRAME_WORDS = ["USER", "ASSISTANT", "SYSTEM", ":", "?", ".", ","]

# Renders e.g. "<s> USER : <image> what colour is the square ? ASSISTANT :".
# Content is either a string or a list of {"type": "image"} / {"type": "text", "text": ...} parts.
# Completed assistant turns end with the eos token.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' %} USER :"
    "{%- elif message['role'] == 'assistant' %} ASSISTANT :"
    "{%- else %} SYSTEM :{%- endif -%}"
    "{%- if message['content'] is string %} {{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' %} <image>"
    "{%- elif part['type'] == 'text' %} {{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' %} {{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %} ASSISTANT :{%- endif -%}"
)


def chat_template(system_prompt: str | None = None) -> str:
    """``CHAT_TEMPLATE``, with ``system_prompt`` written first when the chat does not start with its own."""
    if not system_prompt:
        return CHAT_TEMPLATE
    if any(c in system_prompt for c in "{}%'\""):
        raise ValueError("the system prompt must not contain template syntax or quotes")
    head = "{{- bos_token -}}"
    default = f"{{%- if messages[0]['role'] != 'system' %}} SYSTEM : {system_prompt}{{%- endif -%}}"
    return head + default + CHAT_TEMPLATE[len(head) :]


def build_tokenizer(words: list[str], system_prompt: str | None = None) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over ``SPECIAL_TOKENS + FRAME_WORDS + words`` (duplicates dropped, order kept).

    Text is split on whitespace and punctuation; decoding joins words with single spaces. No BOS/EOS is
    added automatically: the chat template writes the BOS itself.
    """
    vocab: dict[str, int] = {}
    for w in [*SPECIAL_TOKENS, *FRAME_WORDS, *words]:
        if w not in vocab:
            vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    # WordPiece decoder without "##" continuations just joins tokens with spaces.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens={"image_token": IMAGE},
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template(system_prompt)
    return fast


def grid_pinpoints(image_size: int) -> list[list[int]]:
    """Small LLaVA-NeXT any-res grid: 1x2, 2x1 and 2x2 tiles of the base resolution."""
    s = image_size
    return [[s, 2 * s], [2 * s, s], [2 * s, 2 * s]]


def tokens_per_image(image_size: int, patch_size: int) -> int:
    """Image tokens a plain-LLaVA prompt gets per image (CLS dropped by the "default" strategy)."""
    return (image_size // patch_size) ** 2


def build_processor(
    tokenizer: PreTrainedTokenizerFast,
    image_size: int = 96,
    patch_size: int = 12,
    kind: Kind = "llava",
) -> LlavaProcessor | LlavaNextProcessor:
    """A real LlavaProcessor / LlavaNextProcessor for ``image_size`` square inputs, fully offline."""
    square = {"height": image_size, "width": image_size}
    steps = ("do_center_crop", "do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
    common = dict(size=square, crop_size=dict(square)) | dict.fromkeys(steps, True)
    proc_kwargs = dict(
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
        image_token=IMAGE,
    )
    if kind == "llava":
        return LlavaProcessor(image_processor=CLIPImageProcessorPil(**common), **proc_kwargs)
    if kind == "llava_next":
        pinpoints = grid_pinpoints(image_size)
        ip = LlavaNextImageProcessorPil(image_grid_pinpoints=pinpoints, do_pad=True, **common)
        return LlavaNextProcessor(image_processor=ip, **proc_kwargs)
    raise ValueError(f"unknown kind {kind!r}")


def tiny_llava_config(
    vocab_size: int,
    image_token_id: int,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    kind: Kind = "llava",
    num_kv_heads: int = 2,
    num_heads: int = 4,
    hidden: int = 128,
    layers: int = 4,
    image_size: int = 96,
    patch_size: int = 12,
    vision_hidden: int = 64,
    vision_layers: int = 2,
    vision_heads: int = 4,
    intermediate: int | None = None,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
) -> LlavaConfig | LlavaNextConfig:
    """CLIP vision tower + Mistral decoder (GQA if ``num_kv_heads < num_heads``, MHA if equal)."""
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
        projection_dim=vision_hidden,
    )
    text = MistralConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden // num_heads,
        max_position_embeddings=max_position_embeddings,
        sliding_window=None,
        rope_theta=rope_theta,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    common = dict(vision_config=vision, text_config=text, image_token_index=image_token_id)
    common |= dict(
        projector_hidden_act="gelu", vision_feature_select_strategy="default", vision_feature_layer=-1
    )
    common["tie_word_embeddings"] = False
    if kind == "llava":
        cfg = LlavaConfig(image_seq_length=tokens_per_image(image_size, patch_size), **common)
    elif kind == "llava_next":
        pinpoints = grid_pinpoints(image_size)
        cfg = LlavaNextConfig(image_grid_pinpoints=pinpoints, **common)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    cfg.pad_token_id = pad_token_id
    cfg.bos_token_id = bos_token_id
    cfg.eos_token_id = eos_token_id
    return cfg


def build_tiny(
    words: list[str],
    kind: Kind = "llava",
    image_size: int = 96,
    patch_size: int = 12,
    system_prompt: str | None = None,
    **cfg_kwargs,
):
    """Convenience: (tokenizer, processor, config) that agree on vocab and special-token ids."""
    tok = build_tokenizer(words, system_prompt)
    proc = build_processor(tok, image_size=image_size, patch_size=patch_size, kind=kind)
    cfg = tiny_llava_config(
        vocab_size=len(tok),
        image_token_id=tok.convert_tokens_to_ids(IMAGE),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        kind=kind,
        image_size=image_size,
        patch_size=patch_size,
        **cfg_kwargs,
    )
    return tok, proc, cfg
