"""What a request's sampling parameters do to its logits before it samples: `logit_bias`, `min_tokens`, the
repetition, frequency and presence penalties, and a structured output's grammar
(common/sampling/structured.py); common/sampling/sampler.py samples what they leave.

The penalties read the tokens a request has generated, and in a pipelined decode its newest token is on the
device only (common/engine/decode_pipeline.py). So a penalized request keeps a row of token counts on the
device,
the row of its state slot: `admit` fills it from what the host knows (the prompt, the tokens so far), and
`count` adds each sampled token there, on the device, in stream order, without a host round trip. A
grammar's matcher, on the other hand, reads each token on the host (`accept`) before it can mask the next
step: a structured request takes no step ahead of the host. A batch whose requests use none of these leaves
its logits as they are, untouched and uncopied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from common.ipc.hostmem import host_list_to, host_tensor_to
from common.sampling.structured import Grammars, Unavailable

if TYPE_CHECKING:
    from common.engine.runner import ModelRunner
    from common.protocol import SamplingParams
    from common.sampling.request import Request
    from common.text.tokenizer import Tokenizer


def table_bytes(rows: int, vocab: int) -> int:
    """Device bytes of the penalties' tables: int32 counts and a prompt mask, [rows, V] each."""
    return rows * vocab * 5


class LogitProcessors:
    """Applies the requests' biases, min_tokens and penalties to a batch's logits; keeps the penalties'
    counts. Rows are state slots (`SequenceState.slot`, below `rows`)."""

    def __init__(
        self,
        rows: int,
        vocab: int,
        device: torch.device,
        end_ids: Sequence[int],
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """`tokenizer`: the vocabulary's bytes, for structured requests' grammars (None: none served)."""
        self.rows, self.vocab, self.device = rows, vocab, device
        self.end_ids = tuple(end_ids)
        """The end-of-sequence tokens that `min_tokens` holds back (with each request's stop tokens)."""
        self._tokenizer = tokenizer
        self._grammars: Grammars | None = None
        self._waiting: set[int] = set()
        """Rows of structured requests whose grammar has not started (`SamplingParams.structure_after`)."""
        self._matchers: dict[int, Any] = {}
        """Each structured request's grammar matcher (xgrammar), by its row (a row's next request's
        replaces it)."""
        self._counts: torch.Tensor | None = None
        """[rows, V] int32: how often each token has been generated; made at the first penalized request."""
        self._prompt: torch.Tensor | None = None
        """[rows, V] bool: the tokens of the prompt (the repetition penalty's)."""

    @classmethod
    def for_runner(
        cls, runner: ModelRunner, end_ids: Sequence[int], tokenizer: Tokenizer | None = None
    ) -> LogitProcessors:
        """A row for each of the runner's state slots, as wide as its model's logits."""
        return cls(runner.pool.max_seqs, runner.model.config.vocab_size, runner.device, end_ids, tokenizer)

    def start_grammars(self) -> None:
        """Build the vocabulary's grammar table now, on the grammars' thread (a worker, at its start), where
        xgrammar is installed: a first structured request then waits for its own form's compile only."""
        if self._tokenizer is not None:
            with contextlib.suppress(Unavailable):
                self._grammar_set()

    def prepare(self, params: SamplingParams) -> Future | None:
        """Start compiling the grammar of a request with `params`, if it has one, on the grammars' thread:
        its compile, for `admit` (which waits for it), or None where there is none to wait for (no grammar,
        or none can be made: `admit` raises why)."""
        if not params.structure:
            return None
        try:
            return self._grammar_set().prepare(params.structure)
        except Unavailable:
            return None

    def give_up(self, form: Future) -> None:
        """Nobody waits for the grammar compile `form` (`prepare`'s) any more: later ones do not queue behind
        it."""
        if self._grammars is not None:
            self._grammars.give_up(form)

    def admit(self, req: Request, form: Future | None = None) -> None:
        """Start `req`'s row: its prompt and the tokens it has so far (its counts, its grammar's state).
        Waits for its grammar's compile (`form`, `prepare`'s; default: looked up)."""
        if req.params.structure:
            row = req.state.slot
            self._matchers[row] = self._grammar_set().matcher(req.params.structure, form)
            self._waiting.discard(row)
            if req.params.structure_after >= 0:
                self._waiting.add(row)
            for token in req.token_ids:
                self.accept(req, token)
        if not req.params.penalized:
            return
        if self._counts is None:
            self._counts = torch.zeros(self.rows, self.vocab, dtype=torch.int32, device=self.device)
            self._prompt = torch.zeros(self.rows, self.vocab, dtype=torch.bool, device=self.device)
        assert self._prompt is not None
        row = req.state.slot
        self._counts[row].zero_()
        self._prompt[row].zero_()
        if req.token_ids:
            ids = host_list_to(req.token_ids, self.device)
            self._counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        if req.params.repetition_penalty != 1.0 and req.prompt_ids:
            self._prompt[row, host_list_to(req.prompt_ids, self.device)] = True

    def apply(self, logits: torch.Tensor, reqs: Sequence[Request], ahead: Sequence[int]) -> torch.Tensor:
        """The logits [B, V] each request samples from (fp32, a copy), or `logits` itself when no request
        has a bias, a min_tokens still to reach or a penalty. `ahead[b]`: request b's tokens sampled on the
        device and not yet on the host."""
        biased = [b for b, r in enumerate(reqs) if r.params.logit_bias]
        held = [b for b, r in enumerate(reqs) if len(r.token_ids) + ahead[b] < r.params.min_tokens]
        penalized = [b for b, r in enumerate(reqs) if r.params.penalized]
        structured = [
            b for b, r in enumerate(reqs) if r.params.structure and r.state.slot not in self._waiting
        ]
        if not (biased or held or penalized or structured):
            return logits
        out = logits.to(torch.float32, copy=True)
        if penalized:
            self._penalize(out, [reqs[b] for b in penalized], penalized)
        if biased:
            pairs = [(b, token, bias) for b in biased for token, bias in reqs[b].params.logit_bias]
            self._put(out, pairs, accumulate=True)
        if held:
            pairs = [(b, token, float("-inf")) for b in held for token in self._ends(reqs[b])]
            self._put(out, pairs, accumulate=False)
        if structured:
            self._mask(out, reqs, structured, ahead)
        return out

    def accept(self, req: Request, token: int) -> None:
        """`req` has sampled `token` (on the host now): its grammar reads it (or, before the grammar starts,
        looks for the token it starts after)."""
        if not req.params.structure:
            return
        row = req.state.slot
        if row in self._waiting:
            if token == req.params.structure_after:
                self._waiting.discard(row)
            return
        if not self._matchers[row].accept_token(token):
            raise RuntimeError(f"token {token} breaks the grammar it was sampled under")

    def _mask(
        self, out: torch.Tensor, reqs: Sequence[Request], rows: list[int], ahead: Sequence[int]
    ) -> None:
        """Mask, in `out`'s `rows`, every token their grammars cannot take next."""
        assert not any(ahead[b] for b in rows), "a structured request ran ahead of its grammar"
        grammars = self._grammar_set()
        bitmask = grammars.bitmask(len(reqs))
        for b in rows:
            self._matchers[reqs[b].state.slot].fill_next_token_bitmask(bitmask, b)
        grammars.apply(out, host_tensor_to(bitmask, out.device), rows)  # [B, V / 32] int32: small

    def _grammar_set(self) -> Grammars:
        if self._grammars is None:
            assert self._tokenizer is not None, "structured requests need the processors' tokenizer"
            self._grammars = Grammars(self._tokenizer, self.vocab, self.end_ids)
        return self._grammars

    def count(self, reqs: Sequence[Request], tokens: torch.Tensor) -> None:
        """Count each penalized request's sampled token (tokens [B], on the device) in its row."""
        penalized = [b for b, r in enumerate(reqs) if r.params.penalized]
        if not penalized:
            return
        assert self._counts is not None, "a penalized request counted before its admission"
        rows = host_list_to([reqs[b].state.slot for b in penalized], self.device)
        sampled = tokens[host_list_to(penalized, tokens.device)]
        self._counts.index_put_((rows, sampled), torch.ones_like(rows, dtype=torch.int32), accumulate=True)

    def _penalize(self, out: torch.Tensor, reqs: list[Request], batch_rows: list[int]) -> None:
        """Repetition (over the prompt and the generated tokens), then frequency and presence (over the
        generated), in place on those rows of `out`, as vLLM orders them."""
        assert self._counts is not None and self._prompt is not None, "a penalized request not admitted"
        rows = host_list_to([r.state.slot for r in reqs], self.device)
        idx = host_list_to(batch_rows, self.device)

        def column(name: str) -> torch.Tensor:  # [P, 1] fp32
            return host_list_to([getattr(r.params, name) for r in reqs], self.device, torch.float32)[:, None]

        counts = self._counts[rows].float()  # [P, V]
        logits = out[idx]  # [P, V]
        seen = (counts > 0) | self._prompt[rows]
        repetition = column("repetition_penalty")
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        logits -= column("frequency_penalty") * counts + column("presence_penalty") * (counts > 0)
        out[idx] = logits

    def _ends(self, req: Request) -> list[int]:
        """The tokens that would end `req`: its stop tokens, and end-of-sequence unless it ignores them."""
        ends = () if req.params.ignore_eos else self.end_ids
        return list(dict.fromkeys([*ends, *req.params.stop_token_ids]))

    def _put(self, out: torch.Tensor, pairs: list[tuple[int, int, float]], accumulate: bool) -> None:
        """out[b, token] += value (or = value) for each (b, token, value)."""
        if not pairs:
            return
        rows, cols, values = zip(*pairs, strict=True)
        index = (host_list_to(list(rows), out.device), host_list_to(list(cols), out.device))
        out.index_put_(index, host_list_to(list(values), out.device, torch.float32), accumulate=accumulate)
