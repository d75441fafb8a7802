"""A row's tokens turned into text as they are committed, with stop strings honoured exactly.

Streaming text has two traps. A multi-byte character may be split over tokens, so a prefix of the
tokens decodes to a trailing U+FFFD that the next token turns into the real character: the
trailing replacement characters are held back until the row ends. And a stop string may span
tokens or rounds: text that could still be the start of a stop string is held back until the
next tokens show whether it is one. The whole row is decoded each time (not a window of tokens),
so what is emitted is exactly the text the finished row decodes to, cut at the stop string.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def longest_partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class RowText:
    """The text of one row, emitted piece by piece: `feed` the committed tokens, get the new text.

    `stopped` turns true once a stop string has appeared; the text then ends right before it and
    `tokens_used` is the number of tokens it took to produce the stop string (the usage count).
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), stop_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.stop_ids = frozenset(stop_ids)
        self.tokens: list[int] = []
        self.emitted = ""
        self.stopped = False
        self.tokens_used = 0

    def _decode(self, tokens: list[int]) -> str:
        if tokens and tokens[-1] in self.stop_ids:  # the end id is not part of the text
            tokens = tokens[:-1]
        return self.tokenizer.decode(
            tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _first_stop(self, text: str, start: int) -> int | None:
        found = [i for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def feed(self, tokens: list[int], final: bool = False) -> str:
        """The text that `tokens` (committed after the earlier ones) add and that is safe to show.

        `final`: the row has ended, so nothing more is held back except a stop string's start.
        Once stopped, further tokens are ignored.
        """
        if self.stopped:
            return ""
        before = len(self.tokens)
        self.tokens.extend(tokens)
        text = self._decode(self.tokens)
        # a stop string can only begin where the emitted text could not yet rule it out
        start = max(0, len(self.emitted) - max((len(s) for s in self.stops), default=0))
        cut = self._first_stop(text, start) if self.stops else None
        if cut is not None:
            self.stopped = True
            self.tokens_used = self._tokens_to_stop(before, start)
            return self._emit(text[:cut])
        self.tokens_used = len(self.tokens)
        if not final:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - longest_partial_stop(text, self.stops)]
        return self._emit(text)

    def _tokens_to_stop(self, before: int, start: int) -> int:
        """The fewest tokens whose text contains a stop string (a round may commit several)."""
        for n in range(before + 1, len(self.tokens)):
            if self._first_stop(self._decode(self.tokens[:n]), start) is not None:
                return n
        return len(self.tokens)

    def _emit(self, text: str) -> str:
        if not text.startswith(self.emitted):
            # a tokenizer whose text of a prefix is not a prefix of the text (rare
            # normalisation); the shown text cannot be taken back, so go on from its length
            piece = text[len(self.emitted) :]
            self.emitted = self.emitted + piece
            return piece
        piece = text[len(self.emitted) :]
        self.emitted = text
        return piece
