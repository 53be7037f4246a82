"""Beam search for plaintext tenants: ``LLM.beam_search(prompts, BeamSearchParams(...))``.

The search is Hugging Face transformers' (``generate(num_beams=W, do_sample=False)``, its vectorised
form since 4.50), so the same checkpoint gives the same beams: at every step the ``K = max(2, 1 + #eos) * W``
best continuations of all running beams (by summed log-probability) are taken; those that end (an
end-of-sequence token, or ``max_tokens`` reached) and rank among the first ``W`` enter the finished set
with score ``sum_logprobs / generated_len ** length_penalty``; the ``W`` best that did not end run on.
The search stops when every candidate ended, or when ``W`` beams have finished and the best running beam,
normalised by its current length, cannot beat the worst finished one (transformers' default
``early_stopping=False`` heuristic).

KV blocks: beams are :class:`~engine.sequence.Sequence` objects of the engine's block manager. A child
beam is a :meth:`~engine.block_manager.BlockManager.fork` of its parent — it shares every block of the
common prefix, and the partly filled last block is copied on write when two children of one parent both
extend it — and the parent's references are dropped once its children exist. So W beams of a long prompt
hold the prompt's blocks once, plus one partial block each.

The search drives the engine's executor directly (one forward per step for every beam of every prompt),
so it runs on an idle engine: the offline :class:`~engine.llm.LLM`, not the server's stepping thread.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Request, Sequence

MAX_BEAM_WIDTH = 64
_NEG = -1.0e9  # transformers' "impossible" score


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``.

    Attributes:
        beam_width: beams kept per prompt (and sequences returned).
        max_tokens: generated tokens at most per beam.
        length_penalty: exponent of the length a finished beam's summed log-probability is divided by
            (> 0 favours longer outputs; transformers' default 1.0).
        ignore_eos: beams end only at ``max_tokens``.
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _require(_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
                 f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        lp = self.length_penalty
        _require(isinstance(lp, (int, float)) and not isinstance(lp, bool) and abs(lp) <= 100,
                 f"length_penalty must be a number in [-100, 100], got {lp!r}")


@dataclasses.dataclass
class BeamSearchSequence:
    """One returned beam: output tokens (the end-of-sequence token included), its summed log-probability,
    its score (length-normalised) and why it ended ("stop" or "length")."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    text: str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


class _Search:
    """The state of one prompt's search (transformers' per-batch-row tensors, as lists)."""

    def __init__(self, seq: Sequence, params: BeamSearchParams, num_eos: int) -> None:
        self.params = params
        self.prompt_ids = list(seq.token_ids)
        self.prompt_len = seq.num_tokens
        self.beams: list[tuple[Sequence, float]] = [(seq, 0.0)]      # running: (sequence, summed logprob)
        self.finished: list[tuple[float, float, list[int], bool]] = []  # (score, cum, output ids, eos)
        self.width = params.beam_width
        self.keep = max(2, 1 + num_eos) * self.width
        self.improvable = True
        self.done = False

    @property
    def generated(self) -> int:
        return self.beams[0][0].num_tokens - self.prompt_len


class BeamSearcher:
    """Runs :class:`BeamSearchParams` searches on an idle :class:`~engine.llm_engine.LLMEngine`."""

    def __init__(self, engine) -> None:
        if engine.has_unfinished_requests():
            raise InvalidRequestError("beam search needs an idle engine (finish the running requests first)")
        self.engine = engine
        self.bm = engine.block_manager
        self.eos = set(engine.output_processor.eos)

    @torch.inference_mode()
    def run(self, prompts: list[str] | list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Search every prompt (text or token ids); all beams of all prompts share each forward."""
        eos = set() if params.ignore_eos else self.eos
        searches = [_Search(self._prefill_seq(p, params), params, len(eos)) for p in prompts]
        try:
            logits = self._forward([s.beams[0][0] for s in searches], prefill=True)
            while True:
                live = [s for s in searches if not s.done]
                rows = 0
                for s in live:
                    n = len(s.beams)
                    self._advance(s, logits[rows:rows + n], eos)
                    rows += n
                live = [s for s in live if not s.done]
                if not live:
                    break
                logits = self._forward([seq for s in live for seq, _ in s.beams], prefill=False)
        finally:
            for s in searches:
                for seq, _ in s.beams:
                    self.bm.free(seq)
                s.beams = []
        return [self._output(s) for s in searches]

    # ---- one step of one search (transformers' _beam_search loop body) ----------------------------
    def _advance(self, s: _Search, logits: torch.Tensor, eos: set[int]) -> None:
        """logits [n_running, V] of the running beams -> new beams, finished beams, stop flags."""
        logprobs = logits.float().log_softmax(-1)                                # [n, V]
        scores = torch.tensor([c for _, c in s.beams], dtype=torch.float32)[:, None] + logprobs
        vocab = logprobs.shape[1]
        if len(s.beams) < s.width:  # transformers runs W copies of the prompt, all but one at -1e9
            pad = torch.full((s.width - len(s.beams), vocab), _NEG) + logprobs[:1]
            scores = torch.cat([scores, pad])
        top_scores, top_idx = scores.flatten().topk(s.keep)
        parents, tokens = (top_idx // vocab).tolist(), (top_idx % vocab).tolist()
        top = top_scores.tolist()
        gen_len = s.generated + 1                                               # with the new token
        ended = [t in eos or gen_len >= s.params.max_tokens for t in tokens]
        self._finish(s, top, parents, tokens, ended, gen_len)
        if all(ended):
            s.done = True
            return
        running = torch.tensor([v + (_NEG if e else 0.0) for v, e in zip(top, ended, strict=True)])
        picks = running.topk(s.width).indices.tolist()
        self._extend(s, [(parents[i], tokens[i], float(running[i])) for i in picks])
        best = float(running[picks[0]]) / (gen_len ** s.params.length_penalty)
        worst = min(f[0] for f in s.finished) if len(s.finished) == s.width else _NEG
        s.improvable = s.improvable and best > worst
        if not s.improvable:
            s.done = True

    def _finish(self, s: _Search, top: list[float], parents: list[int], tokens: list[int],
                ended: list[bool], gen_len: int) -> None:
        """Candidates among the first W that ended join the finished set (the W best are kept)."""
        if not s.improvable:
            return
        for i in range(s.width):
            if ended[i] and parents[i] < len(s.beams):
                seq = s.beams[parents[i]][0]
                out = seq.token_ids[s.prompt_len:] + [tokens[i]]
                s.finished.append((top[i] / gen_len ** s.params.length_penalty, top[i], out,
                                   tokens[i] in self.eos and not s.params.ignore_eos))
        s.finished.sort(key=lambda f: -f[0])
        del s.finished[s.width:]

    def _extend(self, s: _Search, picks: list[tuple[int, int, float]]) -> None:
        """The chosen (parent, token, score) become the running beams: forks first, then the parents go."""
        beams = []
        for parent_idx, token, score in picks:
            parent = s.beams[parent_idx][0]
            child = Sequence(next(self.engine._seq_ids), parent.request, len(beams), parent.token_ids, None)
            self.bm.fork(parent, child)
            child.append_token(token)
            beams.append((child, score))
        for parent, _ in s.beams:
            self.bm.free(parent)
        s.beams = beams

    # ---- the engine's blocks and forward ----------------------------------------------------------
    def _prefill_seq(self, prompt: str | list[int], params: BeamSearchParams) -> Sequence:
        """A validated prompt as the search's first sequence (the engine's checks, then the length)."""
        engine = self.engine
        ids = engine.validate(prompt, SamplingParams(max_tokens=params.max_tokens, num_speculative_tokens=0))
        if len(ids) + params.max_tokens > engine.max_model_len:
            raise InvalidRequestError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                      f"exceeds the maximum model length {engine.max_model_len}")
        request = Request(f"beam-{next(engine._seq_ids)}", ids, SamplingParams(max_tokens=params.max_tokens), 0.0)
        return Sequence(next(engine._seq_ids), request, 0, ids, None)

    def _forward(self, seqs: list[Sequence], prefill: bool) -> torch.Tensor:
        """One forward over the uncomputed tokens of ``seqs``; returns logits [len(seqs), V]."""
        scheduled = []
        for seq in seqs:
            if prefill:
                hits = self.bm.match_prefix(seq)
                ok = self.bm.admit(seq, hits, seq.num_tokens - len(hits) * self.bm.block_size)
            else:
                ok = self.bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
            if not ok:
                raise EngineOverloadedError("the KV cache cannot hold every beam; lower beam_width or max_tokens")
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens))
        result = self.engine.executor.execute(SchedulerOutput(scheduled, self.bm.take_copies(), []))
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.bm.cache_full_blocks(item.seq)
        assert result.logits.shape[0] == len(seqs), (result.logits.shape, len(seqs))
        return result.logits

    def _output(self, s: _Search) -> BeamSearchOutput:
        tok = self.engine.tokenizer
        seqs = [BeamSearchSequence(out, cum, score, "stop" if eos else "length",
                                   tok.decode(out) if tok is not None else None)
                for score, cum, out, eos in s.finished]
        return BeamSearchOutput(s.prompt_ids, seqs)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
