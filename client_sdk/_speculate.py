"""Speculative decoding in encrypted mode: drafts from the client's own text, one verify step per layer.

Per step, with the sequence's last token ``x`` not yet run (``docs/protocol.md``, "Speculative decoding"):

1. the engine's n-gram proposer (:class:`engine.spec_decode.NgramProposer`, prompt lookup over the
   prompt and the output so far — plaintext that never leaves this process) proposes up to ``k`` drafts;
   none: an ordinary decode step;
2. ``x`` and the drafts run through the client's model as one forward of ``k + 1`` positions; each
   encrypted layer is one ``verify`` step (``k + 1`` ciphertexts, one round trip per layer instead of
   ``k + 1``) and its answer gives the ``k + 1`` rows of logits;
3. the engine's own verifier (:meth:`engine.spec_decode.SpecDecoder.verify`: greedy while the draft is the
   argmax; sampled by rejection against the one-hot draft, so the output keeps the target distribution)
   accepts ``a`` drafts plus one token of the model;
4. the client's dense cache and, with one ``rollback`` message per encrypted layer, the server's
   encrypted caches go back to the accepted length (nothing is sent when every draft was accepted).

A lost session during a verify step or a rollback is replayed as usual (every token so far from position
0), and decoding goes on from the replay's logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from client_sdk import _protocol as proto
from client_sdk._runtime import EncryptedBackend, PrivateRuntime, PrivateToken, StepStats
from client_sdk._threads import threads_of

__all__ = ["Speculation"]


class Speculation:
    """One request's speculative decoding: the engine's proposer and verifier for one sequence.

    Args:
        runtime: the private runtime (manifest, session, model).
        k: draft tokens per step (at most ``max_step_tokens - 1``: a verify step is one server step).
    """

    def __init__(self, runtime: PrivateRuntime, k: int) -> None:
        from engine.engine_config import SpecConfig
        from engine.spec_decode import SpecDecoder

        self.rt = runtime
        self.k = min(k, runtime.manifest.max_step_tokens - 1)
        self.decoder = SpecDecoder(SpecConfig("ngram", self.k, disable_by_batch_size=None), runtime.max_len())

    @classmethod
    def for_request(cls, runtime: PrivateRuntime, params: Any) -> Speculation | None:
        """The request's speculation (``num_speculative_tokens``, else the runtime's default), or None when
        it is off, or the server takes no verify steps (an older server: plain decoding, same output)."""
        k = params.num_speculative_tokens
        k = runtime.num_speculative_tokens if k is None else k
        if not k or not runtime.manifest.verify_steps or runtime.manifest.max_step_tokens < 2:
            return None
        return cls(runtime, k)

    # -- the generation loop --------------------------------------------------------------------------
    def tokens(self, gen: Any) -> Iterator[PrivateToken]:
        """``gen``'s tokens (a ``client_sdk._runtime._Generation``), drafting and verifying where it can."""
        stats = StepStats()
        backend, logits = gen._replay(stats)
        while True:
            if logits is not None:      # the next token's logits are in hand: sample it
                tok = gen.sample(logits, stats)
                yield tok
                if tok.finish_reason is not None:
                    return
            stats = StepStats()
            drafts = self.decoder.propose(gen.seq, 1, self.k)
            if not drafts:
                logits = gen._step(backend, stats)
                continue
            verdict, logits = self._verify(gen, backend, drafts, stats)
            if verdict is None:         # the session was lost and replayed: continue from its logits
                continue
            for i, (tok_id, lp) in enumerate(zip(verdict.token_ids, verdict.logprobs, strict=True)):
                tok = gen.emit(tok_id, lp, stats if i == 0 else StepStats())
                yield tok
                if tok.finish_reason is not None:
                    return
            logits = self._rollback(gen, backend, verdict.num_accepted, len(drafts), stats)

    def _verify(self, gen: Any, backend: EncryptedBackend, drafts: list[int],
                stats: StepStats) -> tuple[Any, torch.Tensor | None]:
        """(verdict, None) after one verify step over the last token and ``drafts``; (None, logits) when
        the session was lost and replayed instead."""
        from engine.scheduler import ScheduledSeq

        seq = gen.seq
        ids = seq.token_ids
        backend.stats = stats
        try:
            rows = self.verify_forward(backend, [ids[-1], *drafts], len(ids) - 1)
        except Exception as exc:
            if not proto.Session.lost(exc):
                raise
            return None, self._replay(gen, backend, stats)
        step = ScheduledSeq(seq, len(ids) - 1, 1, list(drafts))
        return self.decoder.verify(gen.sampler, rows, [step])[0], None

    def _rollback(self, gen: Any, backend: EncryptedBackend, accepted: int, proposed: int,
                  stats: StepStats) -> torch.Tensor | None:
        """Both caches back to the accepted length (the newest token stays pending); None, or the
        replay's logits when the session was lost on the way."""
        keep = gen.seq.num_tokens - 1
        try:
            self.rollback(backend, keep, proposed - accepted)
        except Exception as exc:
            if not proto.Session.lost(exc):
                raise
            return self._replay(gen, backend, stats)
        return None

    @staticmethod
    def _replay(gen: Any, backend: EncryptedBackend, stats: StepStats) -> torch.Tensor:
        new_backend, logits = gen._replay(stats)
        backend.cache = new_backend.cache
        return logits

    # -- the two exchanges ----------------------------------------------------------------------------
    @torch.inference_mode()
    def verify_forward(self, backend: EncryptedBackend, ids: list[int], start: int) -> torch.Tensor:
        """Positions ``start ..`` of ``ids`` through the model as one verify step per encrypted layer;
        logits [len(ids), vocab], row i for the token after position ``start + i``."""
        rt = self.rt
        chunk = torch.tensor(ids)
        pos = torch.arange(start, start + len(ids))
        if getattr(rt, "offload", None) is not None:   # its linear steps: this step's positions, stats
            rt.offload.start, rt.current_stats = start, backend.stats
        rt.verifying = True
        try:
            with threads_of(rt, len(ids)):   # several rows: the caller's thread count (client_sdk._threads)
                h = rt.model(chunk, pos, backend)
        finally:
            rt.verifying = False
        backend.cache.advance()
        with threads_of(rt, len(ids)):
            return rt.model.logits(h)

    def rollback(self, backend: EncryptedBackend, keep: int, dropped: int) -> None:
        """The local cache and every encrypted layer's cache back to ``keep`` positions."""
        backend.cache.truncate(keep)
        if dropped == 0:
            return      # every draft accepted: the caches already hold exactly the kept positions
        session = self.rt.session
        for layer in self.rt.layers:
            reply = self.rt.exchange(session.rollback_call(layer, keep, dropped))
            session.rollback_done(reply, layer, keep, dropped)
