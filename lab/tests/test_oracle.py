"""The oracle ceiling (lab/vlkv_lab/eval/oracle.py) and the zoo tables' marks and intervals (lab/vlkv_lab/eval/zoo_report.py)."""

import math

import pytest
import torch
from vlkv.common.config import ModelConfig
from vlkv.common.model.inputs import prepare_inputs
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy import synthetic_task
from vlkv_lab.eval.evaluation import compress, decode_batch, prepare
from vlkv_lab.eval.oracle import answer_attention, mass_budgets, oracle_cache
from vlkv_lab.eval.zoo_report import finalize, model_bound, rank_configs, worst_member
from vlkv_lab.eval.zoo_scoring import FULL, ORACLE_DEFAULT, ORACLE_OWN, wilson


@pytest.fixture(scope="module")
def default_model():
    torch.set_num_threads(1)
    cfg = ModelConfig()
    return load_model(cfg), load_processor(cfg.path)


@pytest.fixture(scope="module")
def prepared(default_model):
    model, processor = default_model
    return prepare(model, processor, synthetic_task.make_examples(2, seed=3, split="heldout"), progress=False)


def test_answer_attention_is_the_answer_rows_attention_over_the_prompt(default_model, prepared):
    model, processor = default_model
    prep = prepared[0]
    (ids,) = decode_batch(model, [compress(prep, "full", 1.0)], 12, {processor.tokenizer.eos_token_id})
    att = answer_attention(model, prep, ids)
    assert len(att) == len(prep.keys) and att[0].shape == (prep.keys[0].shape[0], prep.m)
    # reference: one eager forward of prompt + answer with transformers' own attention probabilities
    eager = load_model(ModelConfig(), attn_implementation="eager")
    text = synthetic_task.prompt_text(processor, prep.example)
    inputs = prepare_inputs(processor, prep.example.images, text, model.config.image_token_index)
    tensors = {k: v for k, v in inputs.model_kwargs.items() if torch.is_tensor(v)}
    answer = torch.tensor([ids[:-1]])
    full_ids = torch.cat([inputs.input_ids.view(1, -1), answer], dim=1)
    with torch.no_grad():
        out = eager(input_ids=full_ids, output_attentions=True, **tensors)
    m, t = prep.m, answer.shape[1]
    for layer, probs in enumerate(out.attentions):
        rows = probs[0, :, m : m + t, :m].sum(1)  # [H, m]
        ref = rows.view(att[layer].shape[0], -1, m).sum(1)
        assert torch.allclose(att[layer], ref, atol=1e-4), (att[layer] - ref).abs().max()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mass_budgets_keep_exactly_the_total(seed):
    g = torch.Generator().manual_seed(seed)
    layers, kv_heads, m = 6, 2, 50
    att = [torch.rand(kv_heads, m, generator=g) ** (1 + 4 * i) for i in range(layers)]
    for total in (layers, layers + 1, 37, 150, layers * m - 1, layers * m):
        b = mass_budgets(att, total)
        assert sum(b) == total and all(1 <= k <= m for k in b)
    with pytest.raises(ValueError):
        mass_budgets(att, layers - 1)
    # a layer whose mass sits on one token needs fewer slots than a flat one
    peaked = [torch.zeros(1, m), torch.ones(1, m)]
    peaked[0][0, 7] = 1.0
    assert mass_budgets(peaked, 20) == [1, 19]


def test_oracle_keeps_exactly_the_budget_per_layer_and_head(prepared, default_model):
    model, processor = default_model
    prep = prepared[1]
    (ids,) = decode_batch(model, [compress(prep, "full", 1.0)], 12, {processor.tokenizer.eos_token_id})
    att = answer_attention(model, prep, ids)
    default = compress(prep, "vlcache", 0.05)
    for budgets in (default.layer_lengths, mass_budgets(att, sum(default.layer_lengths))):
        cache = oracle_cache(prep, att, budgets)
        assert cache.layer_lengths == list(budgets)
        assert sum(cache.layer_lengths) == sum(default.layer_lengths)
        for layer, idx in enumerate(cache.kept_indices):
            for h in range(idx.shape[0]):  # per KV head: its own top tokens of the answer's attention
                kept = set(idx[h].tolist())
                assert len(kept) == budgets[layer]
                assert min(att[layer][h, list(kept)]) >= att[layer][h].topk(budgets[layer]).values.min()
            gather = idx.unsqueeze(-1).expand(-1, -1, prep.keys[layer].shape[-1])
            assert torch.equal(cache.keys[layer], prep.keys[layer].gather(1, gather))
    heads_differ = any(
        not torch.equal(i[0], i[1]) for i in oracle_cache(prep, att, default.layer_lengths).kept_indices
    )
    assert heads_differ  # a selection per KV head, not one per layer


def test_wilson_interval():
    assert wilson(0, 4)[0] == 0.0 and wilson(0, 4)[1] == pytest.approx(0.49, abs=0.005)
    lo, hi = wilson(50, 50)
    assert hi == 1.0 and lo == pytest.approx(0.929, abs=0.001)
    lo, hi = wilson(45, 50)
    assert lo < 0.9 < hi and not math.isclose(lo, hi)


def _result(full, rows, eviction=False):
    hits = {FULL: {"1.0": [True] * round(10 * full) + [False] * (10 - round(10 * full))}}
    for label, by_b in rows.items():
        hits[label] = {b: [True] * round(10 * a) + [False] * (10 - round(10 * a)) for b, a in by_b.items()}
    return finalize({"hits": hits, "m": 100, "eviction_trained": eviction})


def test_model_bound_cells_and_eviction_trained_members_are_left_out_of_the_scores():
    oracle_ok = {ORACLE_DEFAULT: {"0.1": 1.0, "0.02": 0.5}, ORACLE_OWN: {"0.1": 1.0, "0.02": 0.6}}
    results = {
        "a": _result(1.0, {**oracle_ok, "p": {"0.1": 0.9, "0.02": 0.1}, "q": {"0.1": 0.8, "0.02": 0.5}}),
        "b": _result(
            1.0, {**oracle_ok, "p": {"0.1": 0.2, "0.02": 0.2}, "q": {"0.1": 0.7, "0.02": 0.5}}, True
        ),
    }
    assert results["a"]["n"] == 10 and results["a"]["rows"]["p"]["0.1"] == 0.9
    assert model_bound(results["a"], 0.02) and not model_bound(results["a"], 0.1)
    w = worst_member(results, "p", [0.1, 0.02])
    assert w["0.1"] == (pytest.approx(0.9), "a")  # b is eviction-trained
    assert math.isnan(w["0.02"][0])  # a's 2% cell is model-bound
    assert [label for label, _, _ in rank_configs(results, [0.1, 0.02])] == ["p", "q"]
