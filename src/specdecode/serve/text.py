"""A row's tokens turned into text as they are committed, with stop strings honoured exactly.

Streaming text has three traps. A multi-byte character may be split over tokens, so a prefix of
the tokens decodes to a trailing U+FFFD that the next token turns into the real character: the
trailing replacement characters are held back until the row ends. A stop string may span tokens
or rounds: text that could still be the start of a stop string is held back until the next
tokens show whether it is one. And decoding the whole row every round, the simple way to get
both right, costs a round time in proportion to the answer so far (the square of its length in
all); so only a window of the last tokens is decoded, as vLLM's and TGI's detokenizers do, and
what is emitted is still exactly the text the finished row decodes to, cut at the stop string.
(Not where no stream can be: a byte-fallback tokenizer's bytes that never make a character turn
the characters fused with them into U+FFFD in the whole decode, after they were sent.)
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
# tokens beyond the settled ones a row may hold undecided while its text keeps ending in broken
# characters; past it they are given out as decoded (a row of nothing but invalid bytes), so the
# window, and a round's cost, stay bounded whatever the row produces
MAX_UNSETTLED_TOKENS = 64


def longest_partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class Detokenizer:
    """The text of a growing token list, decoding only a window of its last tokens.

    `ids` is the window: `ids[:read]` are settled tokens kept only as context, because a
    token's text can depend on the ones before it (a SentencePiece word's leading space is
    dropped at the start of a decode; byte tokens are joined into characters); their text,
    `prefix_text`, was given out before. The text of `ids[read:]` is what decoding the whole
    window adds to the context's text. It is given out, and the window settled, up to the last
    token at which that text ends on a whole character, never a trailing U+FFFD that the next
    token may turn into the real character; so the window spans about the last two rounds'
    tokens. Tokens that add no text to a context that has some (special tokens, skipped) are
    dropped rather than kept in the window.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.read = 0
        self.prefix_text = ""  # the text of ids[:read], decoded alone

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def extend(self, tokens: list[int]) -> None:
        self.ids.extend(tokens)

    def unread(self, drop: int = 0) -> str:
        """The text not given out yet: the unsettled tokens' but the last `drop` (a trailing
        U+FFFD included)."""
        return self._decode(self.ids[: len(self.ids) - drop])[len(self.prefix_text) :]

    def take(self, text: str, final: bool) -> str:
        """What of `text` (`unread()`) is safe to give out, the window settled after it: all of
        it if `final` or if it ends on a whole character, else up to the last token that does.
        """
        end = len(self.ids)
        force = end - self.read > MAX_UNSETTLED_TOKENS
        if final or force or not text.endswith(REPLACEMENT):
            self._settle(end, text, force)
            return text
        for drop in range(1, end - self.read):
            settled = self.unread(drop)
            if settled and not settled.endswith(REPLACEMENT):
                self._settle(end - drop, settled, force)
                return settled
        return ""

    def _settle(self, end: int, text: str, force: bool) -> None:
        """ids[read:end], whose text in context is `text`, are settled (given out)."""
        if not text:  # nothing to give the next window as context
            if self.prefix_text or force:
                del self.ids[self.read : end]
            return
        del self.ids[: self.read]
        self.read = end - self.read
        self.prefix_text = self._decode(self.ids[: self.read])


class RowText:
    """The text of one row, emitted piece by piece: `feed` the committed tokens, get the new text.

    `stopped` turns true once a stop string has appeared; the text then ends right before it and
    `tokens_used` is the number of tokens it took to produce the stop string (the usage count).
    A round costs the same whatever the length of the row so far: the tokens are decoded through
    a `Detokenizer`'s window, and stop strings are looked for only in the text held back (a
    possible stop string's start) and the new text.
    """

    def __init__(
        self, tokenizer: Any, stops: tuple[str, ...] = (), stop_ids: tuple[int, ...] = ()
    ) -> None:
        self.text = Detokenizer(tokenizer)
        self.stops = tuple(s for s in stops if s)
        self.stop_ids = frozenset(stop_ids)
        self.held = ""  # text decoded but not shown: it could begin a stop string
        self.pieces: list[str] = []
        self.stopped = False
        self.tokens_used = 0

    @property
    def emitted(self) -> str:
        """All the text shown so far."""
        return "".join(self.pieces)

    def _first_stop(self, text: str) -> int | None:
        found = [i for s in self.stops if (i := text.find(s)) >= 0]
        return min(found) if found else None

    def feed(self, tokens: list[int], final: bool = False) -> str:
        """The text that `tokens` (committed after the earlier ones) add and that is safe to show.

        `final`: the row has ended, so nothing more is held back except a stop string's start.
        Once stopped, further tokens are ignored.
        """
        if self.stopped:
            return ""
        before = self.tokens_used
        self.tokens_used += len(tokens)
        if tokens and tokens[-1] in self.stop_ids:  # the end id is not part of the text
            tokens = tokens[:-1]
        self.text.extend(tokens)
        unread = self.text.unread()
        # a stop string can only begin in the held text (longer shown text was no stop's start)
        cut = self._first_stop(self.held + unread) if self.stops else None
        if cut is not None:
            self.stopped = True
            self.tokens_used = before + self._tokens_to_stop(len(tokens))
            return self._emit((self.held + unread)[:cut])
        text = self.held + self.text.take(unread, final)
        keep = 0 if final else longest_partial_stop(text, self.stops)
        self.held = text[len(text) - keep :]
        return self._emit(text[: len(text) - keep])

    def _tokens_to_stop(self, new: int) -> int:
        """The fewest of the `new` tokens whose text completes a stop string (a round may commit
        several)."""
        for n in range(1, new):
            if self._first_stop(self.held + self.text.unread(drop=new - n)) is not None:
                return n
        return new

    def _emit(self, piece: str) -> str:
        if piece:
            self.pieces.append(piece)
        return piece
