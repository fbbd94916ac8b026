"""NVIDIA kvpress beside vlkv's policies, for ``vlkv bench all`` (optional: never a test dependency).

kvpress 0.5.5 (the release on PyPI) pins ``transformers<5.3`` while vlkv runs on transformers 5.x past
that, so ``pip install kvpress`` would downgrade the project's transformers. The bench therefore loads it
from a private directory (``pip install --no-deps --target``; its import-time dependencies ``cachetools``,
``fire`` and ``termcolor`` beside it; ``datasets``, which only DuoAttention's pattern download uses, is
stubbed when absent) and never touches the project's environment.

How the presses are applied: kvpress's own path is ``with press(model): model(...)``, a forward hook on
every attention layer that compresses the cache during prefill. On this transformers that hook fails (it
reads ``kwargs["cache_position"]``, which attention layers no longer receive); the bench records that
error and applies each press through its own ``compress(module, hidden_states, keys, values, attentions,
kwargs)`` method instead, on the inputs the hook would have seen (captured with a plain forward hook on
each LLaVA language-model attention layer, eager attention so the weights exist). The press's scoring and
selection code runs unmodified. The compressed cache is decoded by vlkv's paged decode path
(``evaluation.decode_batch``), the same one vlkv's own policies use, so accuracy differences come from
the kept tokens only.

On the real-text suite and SmolLM2 (a ``LlamaForCausalLM``, which kvpress supports), the presses run in
``vlkv bench kvpress --suite text`` (``lab/vlkv_lab/bench/kvpress_text.py``, ``lab/vlkv_lab/eval/kvpress_*.py``): the same
compress-on-the-hook's-inputs idea, applied inside one shared prefill for every press, budget and mode.
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
import types
from pathlib import Path

import torch
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.deploy.synthetic_task import MAX_NEW_TOKENS, is_correct, prompt_text

from vlkv_lab.eval.evaluation import compress, decode_batch

KVPRESS_VERSION = "0.5.5"
CACHE_DIR = Path.home() / ".cache" / "vlkv-bench" / f"kvpress-{KVPRESS_VERSION}"
EXTRA_PACKAGES = [f"kvpress=={KVPRESS_VERSION}", "cachetools>=5.5.2,<6", "fire>=0.6,<0.7", "termcolor"]


def load_kvpress(mode: str = "auto") -> tuple[object | None, str]:
    """Import kvpress (installing it into ``CACHE_DIR`` if ``mode == "auto"``); (module or None, note)."""
    notes = []
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        sys.modules["datasets"] = types.SimpleNamespace(load_dataset=None)  # DuoAttention only
        notes.append("`datasets` stubbed (only DuoAttentionPress uses it)")
    for attempt in range(2):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        before = dict(ALL_ATTENTION_FUNCTIONS.items())
        try:
            kvpress = importlib.import_module("kvpress")
            # kvpress wraps every registered attention function at import (for AdaKV-style head masks,
            # unused here); its wrapper breaks vlkv's own, so the registry is put back as it was
            for name, func in before.items():
                ALL_ATTENTION_FUNCTIONS[name] = func
            where = getattr(kvpress, "__file__", "?")
            return kvpress, "; ".join([f"kvpress imported from {where}", *notes])
        except ImportError as exc:
            if attempt or mode != "auto":
                return None, f"kvpress is not importable: {exc}"
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(CACHE_DIR)]
            proc = subprocess.run([*cmd, *EXTRA_PACKAGES], capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                return None, f"pip install --no-deps kvpress failed: {proc.stderr.strip()[-300:]}"
            notes.append(
                f"installed with `pip install --no-deps --target {CACHE_DIR} {' '.join(EXTRA_PACKAGES)}`"
            )
            sys.path.insert(0, str(CACHE_DIR))
            importlib.invalidate_caches()
    return None, "unreachable"


class _Capture:
    """Forward hooks on each attention layer: the inputs a kvpress hook receives."""

    def __init__(self, layers) -> None:
        self.data: dict[int, dict] = {}
        self.handles = [
            layer.self_attn.register_forward_hook(self._hook, with_kwargs=True) for layer in layers
        ]

    def _hook(self, module, args, kwargs, output) -> None:
        self.data[module.layer_idx] = {
            "module": module,
            "hidden_states": kwargs["hidden_states"],
            "kwargs": {"position_embeddings": kwargs["position_embeddings"]},
            "attentions": output[1],
        }

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _eager_model(model_dir: Path):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.inference_mode()
def _capture_prefill(model, processor, example) -> dict:
    from transformers import DynamicCache

    inputs = processor(images=example.images, text=prompt_text(processor, example), return_tensors="pt")
    lm = model.model.language_model
    cap = _Capture(lm.layers)
    cache = DynamicCache(config=model.config.text_config)
    try:
        logits = model(**inputs, **cache_arg(model, cache), use_cache=True, output_attentions=True).logits
    finally:
        cap.remove()
    layers = []
    for i in range(len(lm.layers)):
        d = cap.data[i]
        d["keys"] = cache.layers[i].keys
        d["values"] = cache.layers[i].values
        layers.append(d)
    return {"m": inputs["input_ids"].shape[1], "first": int(logits[0, -1].argmax()), "layers": layers}


def _kept_indices(orig: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    """Positions ``[H_kv, k]`` of the rows of ``comp`` ``[H_kv, k, D]`` in ``orig`` ``[H_kv, m, D]``."""
    eq = (orig.unsqueeze(1) == comp.unsqueeze(2)).all(-1)  # [H_kv, k, m]
    return eq.float().argmax(-1).sort(-1).values


@torch.inference_mode()
def apply_press(press, cap: dict) -> CompactKV:
    keys, values, kept = [], [], []
    for d in cap["layers"]:
        k, v = press.compress(
            d["module"], d["hidden_states"], d["keys"], d["values"], d["attentions"], d["kwargs"]
        )
        keys.append(k[0].contiguous())
        values.append(v[0].contiguous())
        kept.append(_kept_indices(d["keys"][0], k[0]))
    return CompactKV(keys, values, prompt_length=cap["m"], first_token=cap["first"], kept_indices=kept)


def _overlap(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """Mean Jaccard over (layer, kv head) and the share of (layer, head) keep-sets that are identical."""
    jac, same, n = 0.0, 0, 0
    for la, lb in zip(a, b, strict=True):
        for ha, hb in zip(la.tolist(), lb.tolist(), strict=True):
            sa, sb = set(ha), set(hb)
            jac += len(sa & sb) / max(1, len(sa | sb))
            same += sa == sb
            n += 1
    return jac / max(n, 1), same / max(n, 1)


def _hook_error(kvpress, model, processor, example) -> str:
    """Run kvpress's own hook path once and report how it fails (or that it works)."""
    from transformers import DynamicCache

    inputs = processor(images=example.images, text=prompt_text(processor, example), return_tensors="pt")
    try:
        with torch.inference_mode(), kvpress.StreamingLLMPress(compression_ratio=0.5)(model):
            model(**inputs, **cache_arg(model, DynamicCache(config=model.config.text_config)), use_cache=True)
    except Exception as exc:  # the point is to record it
        return f"{exc.__class__.__name__}: {exc}"
    return ""


def run_kvpress(model_dir: Path, model, processor, examples, prepared, budgets, mode: str = "auto") -> dict:
    kvpress, note = load_kvpress(mode)
    out: dict = {"available": kvpress is not None, "note": note, "version": KVPRESS_VERSION}
    if kvpress is None:
        return out
    eager = _eager_model(model_dir)
    out["hook_path_error"] = _hook_error(kvpress, eager, processor, examples[0])
    caps = [_capture_prefill(eager, processor, ex) for ex in examples]
    eos = {processor.tokenizer.eos_token_id}
    w = 8  # observation window: kvpress's default 64 exceeds these prompts (it asserts q_len > window)
    rows = []
    for b in budgets:
        ratio = 1.0 - b
        presses = {
            "SnapKVPress": kvpress.SnapKVPress(compression_ratio=ratio, window_size=w),
            "StreamingLLMPress": kvpress.StreamingLLMPress(compression_ratio=ratio),
            "PyramidKVPress": kvpress.PyramidKVPress(compression_ratio=ratio, window_size=w),
            "ObservedAttentionPress": kvpress.ObservedAttentionPress(compression_ratio=ratio),
        }
        for name, press in presses.items():
            try:
                caches = [apply_press(press, c) for c in caps]
            except Exception as exc:  # a press that does not apply is reported with its error
                rows.append({"press": name, "budget": b, "error": f"{exc.__class__.__name__}: {exc}"})
                continue
            outs = decode_batch(model, caches, MAX_NEW_TOKENS, eos)
            texts = [processor.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
            acc = sum(is_correct(t, ex) for t, ex in zip(texts, examples, strict=True)) / len(examples)
            rows.append(
                {
                    "press": name,
                    "budget": b,
                    "accuracy": acc,
                    "ratio": _mean(c.compression_ratio for c in caches),
                }
            )
    out["rows"] = rows
    out["keep_sets"] = keep_set_comparison(kvpress, caps, prepared, budgets[len(budgets) // 2])
    return out


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def keep_set_comparison(kvpress, caps, prepared, budget: float) -> list[dict]:
    """vlkv's snapkv / streamingllm (and neighbours) against kvpress presses on the same prompts."""
    rows = []

    def compare(label, vlkv_policy, vlkv_params, make_press, settings):
        jac = same = 0.0
        for cap, prep in zip(caps, prepared, strict=True):
            mine = compress(prep, vlkv_policy, budget, **vlkv_params(prep))
            k = mine.layer_lengths[0]
            press = make_press(prep.m, k)
            theirs = apply_press(press, cap)
            j, s = _overlap(mine.kept_indices, theirs.kept_indices)
            jac += j
            same += s
        n = max(len(caps), 1)
        rows.append({"comparison": label, "settings": settings, "jaccard": jac / n, "identical": same / n})

    def ratio_for(m: int, k: int) -> float:
        return 1.0 - (k + 0.5) / m  # int(m * (1 - ratio)) == k: the press keeps exactly vlkv's k

    def k_of(m: int) -> int:
        return min(max(math.ceil(budget * m), 1), m)  # vlkv's uniform budget

    def win(k: int) -> int:
        return max(1, k // 2)  # a window smaller than k, so kvpress's kept window has no score ties

    compare(
        "snapkv vs SnapKVPress, matched",
        "snapkv",
        lambda p: {
            "window": win(k_of(p.m)),
            "pool_kernel": 1,
            "recent_ratio": (win(k_of(p.m)) - 0.5) / k_of(p.m),
        },
        lambda m, k: kvpress.SnapKVPress(
            compression_ratio=ratio_for(m, k), window_size=win(k), kernel_size=1
        ),
        "window w = k // 2 (the whole window kept on both sides), no pooling, same k",
    )
    w = 8
    compare(
        "snapkv vs SnapKVPress, each default",
        "snapkv",
        lambda p: {},
        lambda m, k: kvpress.SnapKVPress(compression_ratio=1.0 - budget, window_size=w),
        f"vlkv: window 8, max-pool 7, recent 10% of k; kvpress: window {w}, avg-pool 5, ratio {1 - budget:.2f}",
    )
    compare(
        "streamingllm vs StreamingLLMPress, matched",
        "streamingllm",
        lambda p: {"sink_tokens": 4},
        lambda m, k: kvpress.StreamingLLMPress(compression_ratio=ratio_for(m, k), n_sink=4),
        "4 sinks, k = vlkv's k",
    )
    compare(
        "streamingllm vs StreamingLLMPress, each default",
        "streamingllm",
        lambda p: {},
        lambda m, k: kvpress.StreamingLLMPress(compression_ratio=1.0 - budget),
        f"4 sinks; vlkv k = ceil({budget} m), kvpress k = int(m (1 - {1 - budget:.2f}))",
    )
    compare(
        "zipcache vs ObservedAttentionPress, matched k",
        "zipcache",
        lambda p: {"recent_ratio": 0.0},
        lambda m, k: kvpress.ObservedAttentionPress(compression_ratio=ratio_for(m, k)),
        "no recent window, k = vlkv's k",
    )
    return rows
