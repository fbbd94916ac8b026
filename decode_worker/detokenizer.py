"""Incremental detokenization with stop strings.

Text that could still turn out to be the start of a stop string is held back until it cannot, so a
client never sees part of a stop string.

This runs once per token per sequence, so it decodes through the fast tokenizer's Rust backend when
that gives the same text as ``tokenizer.decode`` (no clean-up of tokenization spaces configured):
``PreTrainedTokenizerBase.decode`` first walks the id list in Python (``to_py_obj``), which made
detokenization the largest per-token cost of a decode worker with many sequences.
"""

from __future__ import annotations

from collections.abc import Callable


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``ids -> text`` equal to ``tokenizer.decode(ids, skip_special_tokens=True)``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalText:
    def __init__(self, tokenizer, stop: list[str], decode: Callable[[list[int]], str] | None = None) -> None:
        self.decode = decode or text_decoder(tokenizer)
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already sent
        self.stopped = False

    def _text(self) -> str:
        return self.decode(self.ids)

    def add(self, token_id: int) -> str:
        """Add a token; returns the new text that is safe to send. Sets ``stopped`` on a stop string."""
        self.ids.append(token_id)
        text = self._text()
        for s in self.stop:
            idx = text.find(s)
            if idx != -1:
                self.stopped = True
                text = text[:idx]
        if not self.stopped and self.stop:
            hold = 0
            for s in self.stop:
                for n in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:n]):
                        hold = max(hold, n)
                        break
            text = text[: len(text) - hold]
        delta = text[self.emitted :] if len(text) > self.emitted else ""
        self.emitted = max(self.emitted, len(text))
        return delta

    def flush(self) -> str:
        """Text held back at the end of a sequence that never became a stop string."""
        if self.stopped:
            return ""
        text = self._text()
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta
