"""Per-request logits processors, applied to the logits before sampling on every path (greedy included).

A processor is what vLLM's ``SamplingParams.logits_processors`` takes: a callable
``(output_token_ids, logits) -> logits`` over one row (``logits`` is ``[V]``), or, when it takes three
arguments, ``(prompt_token_ids, output_token_ids, logits)``. It may modify ``logits`` in place and must
return the row to use.

Batched form: a processor that subclasses :class:`BatchLogitsProcessor` is called **once per step for all
the rows that share it** (``apply_batch`` over ``[R, V]``), so a processor shared by a whole batch — a
token ban, a grammar's bitmask — is one tensor operation, not R Python calls. Plain callables run row by
row (vLLM's behaviour).

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
    processors in different orders).
    """
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, row in enumerate(rows):
        for proc in row.processors:
            groups.setdefault(id(proc), (proc, []))[1].append(i)
    for proc, idx in groups.values():
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
    return logits


def _takes_prompt(proc: Callable[..., Any]) -> bool:
    """vLLM's convention: a processor with three parameters also gets the prompt's token ids."""
    try:
        params = inspect.signature(proc).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: the two-argument form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3
