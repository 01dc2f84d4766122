"""Incremental detokenization and stop strings for streamed generation.

Tokens arrive a few at a time, but text can only be sent once it can no longer change. Two things make the
text of a token sequence's tail unstable:

- Byte-level BPE splits a multi-byte UTF-8 character over several tokens; decoding a prefix that ends inside
  the character yields U+FFFD. `IncrementalDetokenizer` holds such a tail back until the character is
  complete (or the request ends).
- Decoders that depend on context (SentencePiece's leading-space rule, for instance) are handled by decoding
  a window that starts at the previous emission point and sending only what the window adds.

`StopStrings` then holds back any suffix that could be the start of a stop string, so that no part of a stop
string ever reaches the client, and cuts the text right before the first one that matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (common.text.tokenizer.Tokenizer has it)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas that never have to be taken back.

    The concatenation of every `push` result and the final `flush` equals `tokenizer.decode(all ids)`.
    Each `push` decodes only a window: the ids since the last emission point plus the ids before it that
    were emitted last time (context for decoders that look at neighbours), so streaming costs O(new tokens).
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        """Start of the decode window: the previous emission point (context, already sent)."""
        self._read = 0
        """Ids before this index have had their text sent."""

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far."""
        return list(self._ids)

    def push(self, ids: Iterable[int]) -> str:
        """Add `ids`; return the text that became final (possibly empty)."""
        self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD, as in a full decode)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        sent = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip_special)
        window = decode(self._ids[self._prefix :], skip_special_tokens=self._skip_special)
        # A trailing U+FFFD is (almost always) a character cut between tokens: wait for its other bytes.
        if not final and window.endswith(REPLACEMENT_CHAR):
            return ""
        new = window[len(sent) :]
        self._prefix, self._read = self._read, len(self._ids)
        return new


class StopStrings:
    """Finds the first stop string in streamed text; never lets any part of a stop string through.

    `push` returns the text that is safe to send: everything except a suffix that is a proper prefix of
    some stop string (it may still become one). Once a stop string matches, `push` returns the text before
    it and `matched` is set; nothing after it is ever returned. The result does not depend on how the text
    was split into pushes. A `kept` stop string ends the text the same way, but with itself in it.
    """

    def __init__(self, stops: Sequence[str], kept: Sequence[str] = ()) -> None:
        self._stops = tuple(s for s in dict.fromkeys((*stops, *kept)) if s)
        self._kept = frozenset(kept)
        self._held = ""
        self.matched: str | None = None
        """The stop string that ended the text, once one has."""

    @property
    def active(self) -> bool:
        """There are stop strings to look for."""
        return bool(self._stops)

    @property
    def held(self) -> str:
        """Text held back because it could be the start of a stop string."""
        return self._held

    def push(self, text: str) -> str:
        """Add `text`; return what can be sent now (nothing once a stop string has matched)."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        # The stop string that completes first wins (generation would have stopped there); of two ending
        # at the same place, the longer. Either way no complete stop string is left in the returned text.
        first: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = buffer.find(stop)
            if at >= 0 and (first is None or (at + len(stop), at) < first[:2]):
                first = (at + len(stop), at, stop)
        if first is not None:
            self.matched = first[2]
            self._held = ""
            return buffer[: first[0] if first[2] in self._kept else first[1]]
        keep = partial_suffix(buffer, self._stops)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation: the held-back text, which can no longer become a stop string."""
        out, self._held = ("" if self.matched is not None else self._held), ""
        return out


def partial_suffix(text: str, strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `strings` (text that may
    still become one of them)."""
    longest = 0
    for string in strings:
        for size in range(min(len(string) - 1, len(text)), longest, -1):
            if text.endswith(string[:size]):
                longest = size
                break
    return longest
