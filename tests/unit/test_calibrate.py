"""``vlkv calibrate`` end to end on the default model: its profile chosen per budget by agreement with the full
cache, the grid and the screening, teacher forcing, the prompts file, and a bad profile refused at start-up.
(Served through the public API: tests/integration/test_calibrate_served.py; the lab's held-out check:
lab/tests/test_calibrate_check.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from default_calibration import BUDGETS
from vlkv.common.compression.profile import read_profile
from vlkv.common.compression.registry import get_policy
from vlkv.common.config import DEFAULT_MODEL_DIR, ConfigError, ModelConfig, ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy import synthetic_task
from vlkv.deploy.calibrate.measure import CANDIDATES, best_per_budget, calibrate, survivors
from vlkv.deploy.calibrate.prompts import read_prompts, write_prompts
from vlkv.deploy.cli.main import main
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.deploy.servers import load_compression_profile


def test_calibrate_chooses_the_best_agreement_per_budget(calibrated_profile):
    profile = read_profile(calibrated_profile)
    assert profile.budgets == list(BUDGETS) and profile.prompts["count"] == 2
    assert len(profile.table) == len(CANDIDATES) * len(BUDGETS)
    for entry in profile.entries:
        rows = [r for r in profile.table if r["budget"] == entry.budget]
        best = max(r["agreement"] for r in rows)
        mine = next(r for r in rows if r["candidate"] == entry.candidate)
        assert mine["agreement"] == best
        assert mine["kl"] == min(r["kl"] for r in rows if r["agreement"] == best)
        assert entry.policy.to_dict() == mine["policy"]
        assert all(0.0 <= r["agreement"] <= 1.0 and r["kl"] >= -1e-6 for r in rows)
        assert all(0.0 <= r["exact"] <= r["agreement"] for r in rows)  # an exact prompt agrees at 1.0


def test_the_grid_changes_one_or_two_options_of_the_default_and_keeps_its_draft():
    """Every vlcache candidate is the default with at most two options changed, the 16-token draft included
    unless it names the draft's options; the draft's own rows are there (off, 8 tokens, weight 1.0)."""
    from vlkv.common.compression.registry import policy_from_dict

    def image_dict(d: dict) -> dict:  # the options an image prompt is compressed with, and its text route
        policy = policy_from_dict(d)
        text = getattr(policy, "text", None)
        return getattr(policy, "image", policy).to_dict() | {"text_preset": text and text.to_dict()}

    default = image_dict(CANDIDATES[0][1])
    labels = [label for label, _ in CANDIDATES]
    assert CANDIDATES[0][0] == "default" and len(set(labels)) == len(labels)
    assert default["lookahead"] == 16 and default["lookahead_weight"] == 0.5
    drafts = set()
    for label, d in CANDIDATES[1:]:
        if d.get("policy") != "vlcache" or label == "paper (vlcache_paper)":  # the baselines
            continue
        own = image_dict(d)
        changed = {k for k in default if own[k] != default[k]}
        assert 1 <= len(changed) <= 2 and changed <= set(d), label
        if not {"lookahead", "lookahead_weight"} & set(d):
            assert own["lookahead"] == 16 and own["lookahead_weight"] == 0.5, label
        drafts.add((own["lookahead"], own["lookahead_weight"], own["post_vision_window"]))
    assert {(0, 0.5, False), (8, 0.5, False), (16, 1.0, False), (16, 1.0, True)} <= drafts


def test_screening_keeps_the_best_and_the_default_and_chooses_among_rows_measured_on_every_prompt():
    labels = [label for label, _ in CANDIDATES]
    rows = [
        {"candidate": c, "budget": 0.1, "agreement": a, "kl": kl, "prompts": n, "policy": dict(CANDIDATES)[c]}
        for c, a, kl, n in (
            (labels[0], 0.5, 1.0, 10),
            (labels[1], 0.9, 0.5, 10),
            (labels[2], 0.9, 0.4, 10),
            (labels[3], 0.8, 0.1, 10),
            (labels[4], 0.95, 0.1, 4),  # best on the screening prompts only: cut before the rest
        )
    ]
    assert survivors(rows, [0.1], 2) == {0.1: {labels[4], labels[2], labels[0]}}
    assert survivors(rows, [0.1], 1) == {0.1: {labels[4], labels[0]}}
    (entry,) = best_per_budget(rows, [0.1])
    assert entry.candidate == labels[2]  # ties to the lower KL among the rows measured on all 10 prompts


def test_a_screened_calibration_measures_the_survivors_on_every_prompt(tmp_path):
    processor = load_processor(str(DEFAULT_MODEL_DIR))
    examples = synthetic_task.make_examples(3, seed=4, split="train")
    prompts = write_prompts(tmp_path / "prompts.jsonl", processor, examples, synthetic_task)
    trace = tmp_path / "trace.jsonl"
    path, profile, _ = calibrate(
        str(DEFAULT_MODEL_DIR),
        str(prompts),
        (0.05,),
        4,
        str(tmp_path / "p.json"),
        screen=1,
        keep=2,
        trace=str(trace),
        rerank=0,
    )
    assert read_profile(path).measure["screen"] == 1
    by_prompts = {}
    for r in profile.table:
        by_prompts.setdefault(r["prompts"], set()).add(r["candidate"])
    assert len(by_prompts[3]) <= 3 and "default" in by_prompts[3] and len(profile.table) == len(CANDIDATES)
    assert profile.entries[0].candidate in by_prompts[3]
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [len(x) for x in lines] == [len(CANDIDATES), len(by_prompts[3]), len(by_prompts[3])]


def test_the_shared_draft_gives_the_drafts_own_column_sums_once():
    from vlkv.deploy.calibrate.measure import _share_draft
    from vlkv_lab.eval.evaluation import prepare

    model = load_model(ModelConfig(path=str(DEFAULT_MODEL_DIR)))
    processor = load_processor(str(DEFAULT_MODEL_DIR))
    examples = synthetic_task.make_examples(1, seed=9, split="train")
    shared, plain = (
        prepare(model, processor, examples, progress=False, next_attention=False)[0] for _ in "ab"
    )
    policies = [get_policy("vlcache"), get_policy("vlcache", lookahead=8)]
    _share_draft(shared, policies, (0.05, 0.1))
    assert shared._draft.rows >= 1
    for steps in (8, 16):
        got, rows = shared.draft_col_sums(steps, 0.01)
        assert got is shared.draft_col_sums(steps, 0.01)[0]  # computed once
        assert rows == min(steps, shared._draft.rows)
        want = plain.draft(steps).col_sums(steps)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_teacher_forcing_the_full_cache_reproduces_its_greedy_decode():
    from vlkv_lab.eval.evaluation import decode_batch, prepare

    model = load_model(ModelConfig(path=str(DEFAULT_MODEL_DIR)))
    processor = load_processor(str(DEFAULT_MODEL_DIR))
    p = prepare(model, processor, synthetic_task.make_examples(1, seed=9, split="train"), progress=False)[0]
    full = get_policy("full").compress(
        None, p.keys, p.values, alpha=1.0, m=p.m, tau=p.tau, first_token=p.first_token
    )
    greedy = decode_batch(model, [full], 6, set())[0]
    seen = []
    engine = InProcessEngine(model, pool_bytes=8 << 20, block_size=16)
    own = engine.teacher_force(
        [full], 6, observe=lambda rows, logits: seen.append(logits.argmax(-1).tolist())
    )
    forced = engine.teacher_force([full], 6, tokens=[greedy])
    assert own == forced == [greedy] and len(seen) == len(greedy) - 1
    assert [s[0] for s in seen] == greedy[1:]


def test_one_forward_teacher_forcing_matches_the_decode_core():
    """``teacher_force`` (every forced token in one forward) gives the decode core's step-by-step
    next-token distributions over the same compressed caches, padded to different lengths in one batch."""
    from vlkv.prefill_worker.teacher_force import forced_logprobs
    from vlkv_lab.eval.evaluation import compress, decode_batch, prepare

    model = load_model(ModelConfig(path=str(DEFAULT_MODEL_DIR)))
    processor = load_processor(str(DEFAULT_MODEL_DIR))
    p = prepare(model, processor, synthetic_task.make_examples(1, seed=5, split="train"), progress=False)[0]
    caches = [compress(p, "snapkv", 0.1), compress(p, "vlcache", 0.05), compress(p, "pyramidkv", 0.02)]
    assert len({tuple(c.layer_lengths) for c in caches}) == 3
    ref = decode_batch(model, [compress(p, "full", 1.0)], 6, {processor.tokenizer.eos_token_id})[0]
    steps: dict[int, list] = {i: [] for i in range(len(caches))}

    def keep(rows, logits):
        for r, i in enumerate(rows):
            steps[i].append(torch.log_softmax(logits[r].float(), -1))

    engine = InProcessEngine(model, pool_bytes=16 << 20, block_size=16)
    engine.teacher_force(caches, len(ref), tokens=[ref] * len(caches), observe=keep)
    got = dict(forced_logprobs(model, caches, [ref[:-1]] * len(caches)))
    for i in range(len(caches)):
        core = torch.stack(steps[i])
        assert core.shape == got[i].shape == (len(ref) - 1, core.shape[1])
        assert torch.equal(core.argmax(-1), got[i].argmax(-1))
        torch.testing.assert_close(got[i], core, atol=2e-4, rtol=1e-4)
    # every cache in one group of one length (the padding masked) or each in its own: the same distributions
    for groups in (1, 2):
        other = dict(forced_logprobs(model, caches, [ref[:-1]] * len(caches), groups=groups))
        for i in range(len(caches)):
            assert torch.equal(other[i].argmax(-1), got[i].argmax(-1))
            torch.testing.assert_close(other[i], got[i], atol=2e-5, rtol=1e-5)


def test_prompts_file_is_checked(tmp_path):
    bad = tmp_path / "bad.jsonl"
    for line, message in (
        ({"question": "what ?", "answer": "blue"}, "unknown key"),
        ({"question": "a", "prompt": "b"}, "exactly one of"),
        ({"question": "a", "images": ["not-a-file-or-base64!"]}, "neither a file nor base64"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "a part is"),
    ):
        bad.write_text(json.dumps(line) + "\n")
        with pytest.raises(ValueError, match=message):
            read_prompts(bad)
    (tmp_path / "img.png").write_bytes(b"\x89PNG fake")
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}
                ],
                "images": ["img.png"],
            }
        )
        + "\n\n"
        + json.dumps({"prompt": "plain text"})
        + "\n"
    )
    requests, digest = read_prompts(good)
    assert [r.WhichOneof("prompt") for r in requests] == ["chat", "text"] and len(digest) == 64
    assert requests[0].images == [b"\x89PNG fake"]


def test_a_bad_profile_is_refused_at_start_up(calibrated_profile, tmp_path, capsys):
    good = json.loads(calibrated_profile.read_text())
    cases = {
        "not json": ("{ nope", "not valid JSON"),
        "version": (json.dumps({**good, "version": 99}), "version 99 is not supported"),
        "option": (
            json.dumps(
                {**good, "entries": [{**good["entries"][0], "policy": {"policy": "vlcache", "beta": 2}}]}
            ),
            r"entries\[0\].policy: .*unknown option.*'beta'",
        ),
        "key": (json.dumps({**good, "extra": 1}), "unknown option.*'extra'"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        cfg = ServerConfig(model=ModelConfig(path=str(DEFAULT_MODEL_DIR)), compression_profile=str(path))
        with pytest.raises(ConfigError, match=message):
            load_compression_profile(cfg)
    assert main(["serve", "--compression-profile", str(tmp_path / "version.json")]) == 2
    assert "refusing to start" in capsys.readouterr().err
