"""Generated tokens turned into text a piece at a time, cut at the first stop string."""
from __future__ import annotations

from engine.loading.tokenizer import Tokenizer


class TextStream:
    """The text of the tokens so far, handed out as it becomes final: an unfinished UTF-8
    character waits for its next byte, and (with stop strings) the last characters wait until
    they cannot be the start of a stop string, so no piece of a stop string ever goes out."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # all the text so far (up to the stop string, once one appeared)
        self.sent = 0  # characters of it handed out
        self.stopped = False  # a stop string appeared: generation must end

    def add(self, token: int) -> str:
        """Take one token; return the new text that is now final (may be empty)."""
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids)
        # a stop string may straddle the text already sent and the new tail
        start = max(0, self.sent - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = text[:min(hits)], True
            return self.flush()
        self.text = text
        final = len(text.rstrip("\ufffd")) - self.hold
        return self._take(final)

    def flush(self) -> str:
        """The rest of the text, at the end of the request."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece
