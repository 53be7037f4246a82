"""Turns sampled tokens into text and :class:`RequestOutput` deltas: detokenization, stop conditions.

Stop strings are searched in the detokenized text; the last ``len(longest stop) - 1`` characters are held
back until they can no longer begin a stop string, so a stream never shows text past a stop. A sequence
without stop strings needs its text only when an output takes it, so its tokens are detokenized then, in
one call for all the tokens since the last output (the engine core holds a streamed delta for several
steps under load: one detokenizer call per delta instead of one per token). The finishing output steps
its tokens one at a time, so a stream cut short inside a multi-byte character loses only that character's
bytes, as when every token is detokenized on its own.
"""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput
from engine.sequence import Request, Sequence
from engine.tokenizer import Tokenizer


class SeqText:
    """Incremental text of one sequence with stop-string detection."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stops: list[str],
                 skip_special_tokens: bool = True) -> None:
        # None: ids only
        self.detok = None if tokenizer is None else tokenizer.detokenizer(prompt_ids, skip_special_tokens)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.full = ""     # text so far (cut at a stop string once one is found)
        self.emitted = 0   # characters already streamed
        self.emitted_tokens = 0  # output token ids already streamed (the engine's cursor)
        self.undecoded: list[int] = []  # no stop strings: tokens added since the text was last taken

    def add(self, token_id: int) -> str | None:
        """Detokenize one more token; return the stop string it completed, if any (text is cut before it).
        Without stop strings the token waits for :meth:`take_delta`."""
        if self.detok is None:
            return None
        if not self.stops:
            self.undecoded.append(token_id)
            return None
        old = len(self.full)
        self.full += self.detok.step([token_id])
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = self.full.find(stop, max(0, old - len(stop) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        self.full = self.full[:best[0]]
        return best[1]

    def take_delta(self, finished: bool) -> str:
        """Text that is safe to stream now."""
        if self.undecoded:
            ids, self.undecoded = self.undecoded, []
            if finished:  # token by token: a last token that ends mid-character holds back only itself
                self.full += "".join(self.detok.step([i]) for i in ids)
            else:  # a batch ending mid-character is held whole and comes out with the next one
                self.full += self.detok.step(ids)
        end = len(self.full) if finished else max(self.emitted, len(self.full) - self.hold)
        delta = self.full[self.emitted:end]
        self.emitted = end
        return delta


class OutputProcessor:
    """Owns the per-sequence text state; appends tokens, decides finishes, builds outputs."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self._text: dict[int, SeqText] = {}
        # False: outputs carry deltas only (token_ids [], text ""): the engine core process, whose client
        # rebuilds the cumulative fields, skips copying them per request per step (engine/engine_core.py)
        self.cumulative = True

    def append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        """Add a sampled token to ``seq`` and set its finish reason if it is done (for callers outside the
        engine; the engine applies :meth:`check_finish`'s verdict itself)."""
        seq.append_token(token, logprobs)
        verdict = self.check_finish(seq, token)
        if verdict is not None:
            seq.finish(*verdict)

    def check_finish(self, seq: Sequence, token: int) -> tuple[str, str | int | None] | None:
        """Detokenize ``token`` (just appended to ``seq``); return ``(finish_reason, stop_reason)`` if it ends
        the sequence. Writes only this processor's text state, never the sequence."""
        params = seq.request.params
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop", token
        if token in self.eos and not params.ignore_eos:
            return "stop", None
        text = self._text.get(seq.seq_id) or self._text_of(seq)
        if text.detok is not None and (stop := text.add(token)) is not None:
            return "stop", stop
        resolved = len(seq.token_ids) - seq.num_pending
        if resolved - seq.num_prompt_tokens >= params.max_tokens or resolved >= self.max_model_len:
            return "length", None
        return None

    def build(self, request: Request) -> RequestOutput:
        """The request's output with the deltas since its previous output."""
        seqs = request.seqs
        outs = ([self._completion(seqs[0])] if len(seqs) == 1
                else [self._completion(s) for s in sorted(seqs, key=lambda s: s.index)])
        return RequestOutput(request.request_id, request.prompt_token_ids, outs, request.finished,
                             request.num_cached_tokens, request.metrics)

    def forget(self, seq: Sequence) -> None:
        self._text.pop(seq.seq_id, None)

    def _text_of(self, seq: Sequence) -> SeqText:
        st = self._text.get(seq.seq_id)
        if st is None:
            st = SeqText(self.tokenizer, seq.request.prompt_token_ids, seq.params.stop,
                         seq.params.skip_special_tokens)
            self._text[seq.seq_id] = st
        return st

    def delta(self, request: Request) -> tuple:
        """The request's progress since its previous output as the engine core's wire tuple
        (``engine.engine_core.RequestDelta``), built without :class:`RequestOutput` objects: the core
        process sends every streaming request's delta each step, and the objects cost it ~2-3 µs a row."""
        seqs = request.seqs
        if len(seqs) != 1:
            seqs = sorted(seqs, key=lambda s: s.index)
        comps = [(s.index, *self._advance(s), s.finish_reason, s.stop_reason) for s in seqs]
        return (request.request_id, request.finished, request.num_cached_tokens,
                request.metrics if request.finished else None, comps)

    def due(self, request: Request, min_tokens: int) -> bool:
        """Whether the request's next :meth:`delta` should go out now: its first output, or at least
        ``min_tokens`` new tokens (over its sequences) since the last one (the engine's ``delta_coalescing``)."""
        new = 0
        for seq in request.seqs:
            st = self._text.get(seq.seq_id)
            if st is None or not st.emitted_tokens:
                return True
            new += len(seq.token_ids) - seq.num_pending - seq.num_prompt_tokens - st.emitted_tokens
        return new >= min_tokens

    def _advance(self, seq: Sequence) -> tuple[str, list[int], list | None]:
        """(delta text, new token ids, their logprobs) since the sequence's last output; moves its cursors."""
        st = self._text.get(seq.seq_id) or self._text_of(seq)
        delta_text = st.take_delta(seq.finish_reason is not None)
        start, end = seq.num_prompt_tokens + st.emitted_tokens, len(seq.token_ids) - seq.num_pending
        new_ids = seq.token_ids[start:end]
        logprobs = seq.logprobs[st.emitted_tokens:] if seq.request.params.logprobs is not None else None
        st.emitted_tokens = end - seq.num_prompt_tokens
        return delta_text, new_ids, logprobs

    def _completion(self, seq: Sequence) -> CompletionOutput:
        delta_text, new_ids, logprobs = self._advance(seq)
        if not self.cumulative:
            return CompletionOutput(seq.index, [], "", delta_text, new_ids, logprobs, seq.finish_reason,
                                    seq.stop_reason)
        st = self._text[seq.seq_id]
        return CompletionOutput(seq.index, seq.output_token_ids, st.full[:st.emitted], delta_text, new_ids,
                                logprobs, seq.finish_reason, seq.stop_reason)
