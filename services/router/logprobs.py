"""Generated tokens' log-probabilities in OpenAI's two response shapes.

Chat: `logprobs.content`, one entry per token: its text, logprob, UTF-8 bytes and `top_logprobs` (the same
for each alternative). Text completions (the legacy shape): parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (a token → logprob object per position, the chosen token always among them, as OpenAI's
legacy API has it) and `text_offset` (where each token's text starts
in the completion). A token's text is its bytes (`Tokenizer.token_bytes`) as UTF-8, a piece of a character
written as `\\xNN` escapes, as OpenAI writes it; or, with vLLM's `return_tokens_as_token_ids`, `token_id:N`.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from common.protocol import TokenLogprobs
from common.text.tokenizer import Tokenizer

TokenChoice = tuple[int, TokenLogprobs]
"""A generated token's id and its log-probabilities."""
PromptToken = tuple[int, TokenLogprobs | None]
"""An echoed prompt token's id and its log-probabilities (None for the first, which has none)."""

FLOOR = -9999.0
"""What a log-probability of -inf is reported as (JSON has no infinities)."""


class LogprobText:
    """Renders one request's token choices, chunk after chunk (a text completion's offsets run on)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._chat = chat
        self._as_ids = as_ids
        self._offset = 0
        """Characters the rendered tokens spell so far (text completions): a character's offset is that of
        the token its first byte is in."""
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def render(self, choices: Sequence[TokenChoice]) -> dict[str, Any]:
        """The `logprobs` object of a response or chunk holding `choices`."""
        return self._chat_shape(choices) if self._chat else self._completion_shape(choices)

    def render_prompt(self, prompt_ids: Sequence[int], rows: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The `logprobs` object of an echoed prompt (text completions), before the completion's: its first
        token with none, the others with `rows` (prefill's, one each)."""
        return self._completion_shape([(prompt_ids[0], None), *zip(prompt_ids[1:], rows, strict=True)])

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        raw = self._tokenizer.token_bytes(token_id)
        text = f"token_id:{token_id}" if self._as_ids else raw.decode("utf-8", errors="backslashreplace")
        return text, raw

    def _chat_shape(self, choices: Sequence[TokenChoice]) -> dict[str, Any]:
        content = []
        for token_id, lp in choices:
            entry = self._chat_entry(token_id, lp.logprob)
            entry["top_logprobs"] = [
                self._chat_entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self._piece(token_id)
        return {"token": text, "logprob": max(logprob, FLOOR), "bytes": list(raw)}

    def _completion_shape(self, choices: Sequence[PromptToken]) -> dict[str, Any]:
        tokens: list[str] = []
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, lp in choices:
            text, raw = self._piece(token_id)
            tokens.append(text)
            if lp is None:  # an echoed prompt's first token
                logprobs.append(None)
                tops.append(None)
            else:
                logprob = max(lp.logprob, FLOOR)
                logprobs.append(logprob)
                pairs = zip(lp.top_ids, lp.top_logprobs, strict=True)
                tops.append({self._piece(i)[0]: max(v, FLOOR) for i, v in pairs} | {text: logprob})
            offsets.append(self._offset)
            self._offset += len(self._utf8.decode(raw))
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
