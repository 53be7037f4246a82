"""Programmatic dependent launch (PDL) for the decode step's kernels: the switch and the in-kernel wait.

A kernel launched with PDL (Triton's ``launch_pdl=True``: CUDA's programmatic stream serialization, Hopper and
later) may start while the kernel before it in the stream is still running, once every program of that one has
signalled ``griddepcontrol.launch_dependents`` (or exited). Its launch, its index arithmetic and the loads that
do not depend on the previous kernel (a GEMV's weights) then overlap the previous kernel's tail instead of
following it: at batch 1 a step is ~190-280 launches of 2-20 µs each with ~0.5 µs of gap between them
(docs/benchmarks.md, "Where a batch-1 step goes").

The contract every PDL kernel here keeps: it calls :func:`pdl_wait` (``griddepcontrol.wait``: the previous
grid has completed and its writes are visible) before it reads anything another kernel writes and before it
writes anything, on every program. That makes the chain safe transitively: a kernel that passed its wait can
only have been launched after its predecessor passed its own, so only the launch just before a PDL kernel
can still be running while it starts. What such a kernel reads before its wait (a GEMV's weights, a norm's
gain) must therefore not be written by the launch just before it — true of model weights, and the
caller's side of the contract when the launchers are used on other data with PDL switched on. A kernel
launched without PDL (torch ops, cuBLAS) waits for everything before it as usual, and a PDL kernel after one
of those starts when it ends.
CUDA graphs captured from such launches keep the programmatic edges (CUDA 12.3 and later).

The switch is process-wide (:func:`set_pdl`; the engine sets it from ``EngineConfig.cuda_pdl`` when it builds
its model runner, before it captures its graphs); launches that capture or run afterwards follow it. Off
until something sets it; the engine's default (``cuda_pdl = True``) does, measured +12-28 % batch-1 tokens/s on
an H200 (docs/benchmarks.md, "PDL and int4 prefetch").
"""

from __future__ import annotations

import functools

import torch

from ._common import HAS_TRITON, tl, triton

__all__ = ["pdl_enabled", "pdl_launch", "pdl_wait", "set_pdl"]

_ENABLED = False


def set_pdl(enabled: bool) -> None:
    """Launch the decode kernels that support it with PDL (True) or plainly (False, the default)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def pdl_enabled() -> bool:
    """Whether :func:`set_pdl` switched PDL on."""
    return _ENABLED


def pdl_launch(t: torch.Tensor) -> bool:
    """Whether a launch on ``t``'s device uses PDL: switched on and a CUDA device of compute capability 9.0 or
    more (``griddepcontrol`` is sm_90 PTX). Never on CPU tensors (Triton's interpreter has no grids to wait
    on; tests/kernels/test_pdl.py runs the PDL code paths there with the wait made a no-op)."""
    return _ENABLED and t.is_cuda and _sm90(t.device.index)


@functools.lru_cache(maxsize=16)
def _sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """The launch keyword that turns PDL on for one launch (none when off: older Tritons lack the option)."""
    return {"launch_pdl": True} if pdl else {}


if HAS_TRITON:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """With PDL: wait for the previous grid (its writes visible), then let the next grid launch; its
        programs start as this kernel's programs finish, and each waits in its turn before it reads."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
else:  # pragma: no cover - depends on the install
    pdl_wait = None
