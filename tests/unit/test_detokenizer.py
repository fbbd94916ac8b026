"""The decode worker's detokenizer: the fast path decodes exactly as ``tokenizer.decode`` does."""

from __future__ import annotations

import random

from tiny_models import WORDS
from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.common.model.loading import load_processor
from vlkv.decode_worker.detokenizer import IncrementalText, text_decoder
from vlkv_lab.task.tiny_llava import build_tokenizer


def _tokenizers():
    return [load_processor(str(DEFAULT_MODEL_DIR)).tokenizer, build_tokenizer(WORDS)]


def test_fast_path_equals_tokenizer_decode_on_random_ids():
    rng = random.Random(0)
    for tok in _tokenizers():
        decode = text_decoder(tok)
        cases = [[rng.randrange(len(tok)) for _ in range(rng.randint(0, 30))] for _ in range(300)]
        expected = [tok.decode(ids, skip_special_tokens=True) for ids in cases]
        tok.decode = None  # the fast path never goes through transformers' decode
        assert [decode(ids) for ids in cases] == expected


def test_tokenizer_that_cleans_up_spaces_keeps_its_own_decode():
    tok = build_tokenizer(WORDS)
    tok.clean_up_tokenization_spaces = True
    calls = []
    original = tok.decode
    tok.decode = lambda ids, **kw: calls.append(ids) or original(ids, **kw)
    assert text_decoder(tok)([3, 4]) == original([3, 4], skip_special_tokens=True) and calls == [[3, 4]]


def test_incremental_text_streams_the_whole_text_and_holds_back_stop_prefixes():
    tok = build_tokenizer(WORDS)
    ids = tok.encode("what colour is the square red blue", add_special_tokens=False)
    text = IncrementalText(tok, stop=["the square red"])
    out = "".join(text.add(i) for i in ids)
    assert text.stopped and out == tok.decode(ids[:3], skip_special_tokens=True) + " "
    plain = IncrementalText(tok, stop=[])
    assert "".join(plain.add(i) for i in ids) + plain.flush() == tok.decode(ids, skip_special_tokens=True)
