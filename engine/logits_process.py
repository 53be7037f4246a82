"""Per-request logits processors, applied to the logits before sampling on every path (greedy included).

A processor is what vLLM's ``SamplingParams.logits_processors`` takes: a callable
``(output_token_ids, logits) -> logits`` over one row (``logits`` is ``[V]``), or, when it takes three
arguments, ``(prompt_token_ids, output_token_ids, logits)``. It may modify ``logits`` in place and must
return the row to use.

Batched form: a processor that subclasses :class:`BatchLogitsProcessor` is called **once per step for all
the rows that share it** (``apply_batch`` over ``[R, V]``), so a processor shared by a whole batch — a
token ban, a grammar's bitmask — is one tensor operation, not R Python calls. Plain callables run row by
row (vLLM's behaviour).

Token masks: a processor that subclasses :class:`BitmaskLogitsProcessor` (a grammar, see
:mod:`engine.structured`) only writes which tokens each of its rows may take, as bits of one
``[B, ceil(V/32)]`` int32 mask shared by **every** such processor of the step; the mask is applied in one
pass, after all other processors, so nothing that runs later can re-enable a token the grammar forbids.

Processors run on the raw model logits, before penalties and temperature; logprobs are computed after
them (a banned token has logprob ``-inf``), as in vLLM.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch


class ProcessorRow(Protocol):
    """What :func:`apply_logits_processors` reads from a sampling row."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def processors(self) -> list[Callable[..., Any]]: ...


class BatchLogitsProcessor:
    """Base of processors applied in one call to every row that shares them."""

    def apply_batch(self, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                    logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] of the R rows sharing this processor -> processed logits [R, V]."""
        raise NotImplementedError

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """vLLM's one-row form: logits [V] -> [V]."""
        return self.apply_batch([[]], [list(output_token_ids)], logits[None])[0]


class BitmaskLogitsProcessor(BatchLogitsProcessor):
    """Base of processors that allow a set of tokens per row, written as bits (bit ``t % 32`` of word
    ``t // 32`` set: token ``t`` allowed; xgrammar's layout)."""

    def fill_bitmask(self, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                     bitmask: torch.Tensor, rows: list[int]) -> None:
        """Write the allowed tokens of history ``i`` into ``bitmask[rows[i]]`` (bitmask [B, W] int32, CPU)."""
        raise NotImplementedError

    @classmethod
    def apply_bitmask(cls, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the logits of forbidden tokens to -inf in ``rows`` (logits [B, V], bitmask [B, W])."""
        sel = torch.tensor(rows, device=logits.device)
        words = bitmask.to(logits.device).index_select(0, sel)                 # [R, W]
        bits = (words[:, :, None] >> _SHIFTS.to(logits.device)) & 1            # [R, W, 32]
        allowed = bits.flatten(1)[:, : logits.shape[1]].bool()                 # [R, V]
        logits.index_copy_(0, sel, logits.index_select(0, sel).masked_fill(~allowed, float("-inf")))

    def apply_batch(self, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                    logits: torch.Tensor) -> torch.Tensor:
        rows = list(range(logits.shape[0]))
        bitmask = new_bitmask(logits.shape[0], logits.shape[1])
        self.fill_bitmask(prompt_token_ids, output_token_ids, bitmask, rows)
        self.apply_bitmask(logits, bitmask, rows)
        return logits


_SHIFTS = torch.arange(32, dtype=torch.int32)


def new_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed token bitmask [batch, ceil(vocab/32)] int32 (-1: every bit set)."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class BanTokens(BatchLogitsProcessor):
    """Never pick the given token ids (their logits become -inf)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = sorted(set(int(t) for t in token_ids))
        self._index: dict[torch.device, torch.Tensor] = {}

    def apply_batch(self, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                    logits: torch.Tensor) -> torch.Tensor:
        idx = self._index.get(logits.device)
        if idx is None:
            idx = self._index[logits.device] = torch.tensor(self.token_ids, device=logits.device)
        logits.index_fill_(-1, idx, float("-inf"))
        return logits


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[ProcessorRow]) -> torch.Tensor:
    """Run every row's processors on ``logits`` [B, V] (written in place); returns it.

    Rows sharing a :class:`BatchLogitsProcessor` object are processed in one ``apply_batch`` call, in the
    order the processors first appear in the batch (a row's list order, unless two rows list shared
    processors in different orders). :class:`BitmaskLogitsProcessor` s come last: they fill one shared
    bitmask, applied in one pass per processor class.
    """
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, row in enumerate(rows):
        for proc in row.processors:
            groups.setdefault(id(proc), (proc, []))[1].append(i)
    masks = [(p, idx) for p, idx in groups.values() if isinstance(p, BitmaskLogitsProcessor)]
    for proc, idx in groups.values():
        if isinstance(proc, BitmaskLogitsProcessor):
            continue
        if isinstance(proc, BatchLogitsProcessor):
            sel = torch.tensor(idx, device=logits.device)
            out = proc.apply_batch([rows[i].prompt_token_ids for i in idx],
                                   [rows[i].output_token_ids for i in idx], logits.index_select(0, sel))
            logits.index_copy_(0, sel, out.to(logits.dtype))
            continue
        three = _takes_prompt(proc)
        for i in idx:
            r = rows[i]
            row = logits[i]
            logits[i] = proc(r.prompt_token_ids, r.output_token_ids, row) if three \
                else proc(r.output_token_ids, row)
    if masks:
        _apply_bitmasks(logits, rows, masks)
    return logits


def _apply_bitmasks(logits: torch.Tensor, rows: Sequence[ProcessorRow],
                    masks: list[tuple[BitmaskLogitsProcessor, list[int]]]) -> None:
    """Every bitmask processor fills its rows of one mask; one masking pass per processor class."""
    bitmask = new_bitmask(logits.shape[0], logits.shape[1])
    by_class: dict[type, list[int]] = {}
    filled: set[int] = set()
    for proc, idx in masks:
        histories = ([rows[i].prompt_token_ids for i in idx], [rows[i].output_token_ids for i in idx])
        if filled.isdisjoint(idx):
            proc.fill_bitmask(*histories, bitmask, idx)
        else:  # a row with two masks allows what both allow
            own = new_bitmask(logits.shape[0], logits.shape[1])
            proc.fill_bitmask(*histories, own, idx)
            bitmask &= own
        filled.update(idx)
        by_class.setdefault(type(proc), []).extend(idx)
    for cls, idx in by_class.items():
        cls.apply_bitmask(logits, bitmask, sorted(set(idx)))


def _takes_prompt(proc: Callable[..., Any]) -> bool:
    """vLLM's convention: a processor with three parameters also gets the prompt's token ids."""
    try:
        params = inspect.signature(proc).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: the two-argument form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3
