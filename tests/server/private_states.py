"""The real worker state of the encrypted service, plus one switch a test can flip (imported by name
inside spawned workers, like ``worker_states``)."""

from __future__ import annotations

from server.private.compute import PrivateCompute


class ArmableCompute(PrivateCompute):
    """:class:`PrivateCompute` unchanged, and ``arm_bug``: the next block evaluation raises the
    ``ValueError`` a bug deep inside the computation would (after the client's ciphertexts parsed)."""

    def arm_bug(self) -> None:
        for block in self.layers.values():
            def broken(*args, _block=block, _real=block.prefill, **kwargs):
                _block.prefill = _real  # once
                raise ValueError("operands could not be broadcast together")

            block.prefill = broken


def make_state(model_dir: str, plan_path: str, max_tokens: int, device: str = "cpu") -> ArmableCompute:
    return ArmableCompute(model_dir, plan_path, max_tokens, device)
