"""Incremental detokenization with stop strings.

Text that could still turn out to be the start of a stop string is held back until it cannot, so a
client never sees part of a stop string.
"""

from __future__ import annotations


class IncrementalText:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already sent
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

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
