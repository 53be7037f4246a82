"""The real worker state plus a pause a test can arm (imported by name inside Ray worker actors)."""

from __future__ import annotations

import time

from tests.server.private_states import ArmableCompute


class PausableCompute(ArmableCompute):
    """:class:`ArmableCompute`, and ``arm_pause``: the next block evaluation first sleeps (a step that is
    certainly running when the test kills its worker)."""

    def arm_pause(self, seconds: float) -> None:
        for block in self.layers.values():
            def paused(*args, _block=block, _real=block.prefill, **kwargs):
                _block.prefill = _real  # once
                time.sleep(seconds)
                return _real(*args, **kwargs)

            block.prefill = paused


def make_state(model_dir: str, plan_path: str, max_tokens: int, device: str = "cpu") -> PausableCompute:
    return PausableCompute(model_dir, plan_path, max_tokens, device)
