"""Settings of the encrypted-session service (the ``[private]`` table of the settings file)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

#: Where a worker evaluates: SEAL on the CPU, our evaluator on a CUDA device, or our evaluator's torch-CPU
#: reference (slow: the CUDA path's code without a GPU, for tests).
_DEVICE = re.compile(r"^(cpu|cpu-reference|cuda(:[0-9]{1,2})?)$")


class RaySettings(BaseModel):
    """Where the Ray backend runs its workers, and the resource shape of one worker actor."""

    address: str | None = Field(None, description="an existing cluster (\"ray://host:10001\" or "
                                "\"host:6379\"); None: start a head on 127.0.0.1 inside the server")
    namespace: str = Field("cipherlm", description="Ray namespace of the worker actors")
    num_cpus: float = Field(1.0, ge=0, description="CPUs one worker actor reserves (the evaluator is "
                            "single-threaded)")
    num_gpus: float = Field(0.0, ge=0, description="GPU share one worker actor reserves (0: a CPU worker)")
    memory_gb: float | None = Field(None, gt=0, description="memory one worker actor reserves (its "
                                    "layers plus max_keys_per_worker key sets); None: no reservation")
    head_cpus: int | None = Field(None, ge=1, description="CPUs of the local head (address None); None: "
                                  "every core of this machine")


class PrivateSettings(BaseModel):
    """Knobs of ``/v1/private``: plan, workers, session bounds, size limits, key lifetime."""

    enabled: bool | None = Field(None, description="None: on when some tenant is in encrypted mode")
    plan: str | None = Field(None, description="plan file/folder; None: the plan shipped for the default model. "
                             "Not used (nor needed) with an offload_plan whose server layers are all linear steps")
    offload_plan: str | None = Field(None, description="an offload plan (fhe/offload.py) whose server attention "
                                     "layers are `plan`'s: the server also runs its MLP blocks (N = 8192, "
                                     "client-aided SiLU) and keeps their weights; None: attention blocks only")
    offload_chunk_layout: bool = Field(True, description="steps of several positions (prefill chunks, verify "
                                       "steps) of offload linear parts in the position-interleaved chunk "
                                       "layout (fast prefill and speculation; ~915 MB more worker memory per "
                                       "SmolLM2 server layer); false: one ciphertext per position")
    offload_warm_graphs: bool = Field(True, description="gpu workers capture every offload linear step's CUDA "
                                      "graphs when they start (part of the first key setup) instead of on a "
                                      "session's first tokens; no effect on 'cpu' / 'cpu-reference'")
    state_dir: str | None = Field(None, description="key store, audit log, bundle cache; None: $CIPHERLM_HOME/server")
    workers: int = Field(2, ge=1, le=64, description="most worker processes for ciphertext work; each is "
                         "started when an encrypted session (or key upload) first needs it")
    min_workers: int = Field(0, ge=0, le=64, description="workers started with the server and never stopped "
                             "when idle (0: an idle server runs none)")
    worker_idle_s: float | None = Field(300.0, gt=0, description="a worker with no open session and no task "
                                        "for this long is stopped, freeing its memory; None: never")
    session_ttl_s: float = Field(900.0, gt=0, description="idle sessions are closed after this")
    max_sessions_per_tenant: int = Field(8, ge=1)
    max_session_tokens: int = Field(512, ge=1, description="positions one session may hold (KV cache bound)")
    max_step_tokens: int = Field(64, ge=1, description="tokens in one step (prefill chunk)")
    max_blob_bytes: int = Field(16 << 20, ge=1024, description="one serialized ciphertext")
    max_step_bytes: int = Field(256 << 20, ge=1024, description="one step's body")
    max_key_bytes: int = Field(1 << 30, ge=1024, description="one evaluation-key upload (N=32768 keys: ~720 MB)")
    max_keys_per_worker: int = Field(2, ge=1, description="evaluation keys one worker keeps loaded "
                                     "(N=32768: ~6 GB each); the least recently used idle one is dropped")
    device: str = Field("cpu", description="where workers evaluate: 'cpu' (SEAL), 'cuda' or 'cuda:N' (the gpu "
                        "backend on that device), 'cpu-reference' (the gpu backend's torch-CPU reference: tests)")
    step_processes: int = Field(1, ge=1, le=2, description="processes one layer step runs on: 2 forks a "
                                "copy-on-write child per step for part of it (fhe.fork; local SEAL workers only: "
                                "ignored with device != 'cpu' or backend = 'ray'); give each worker two cores")
    batch_steps: int = Field(16, ge=1, le=256, description="gpu backend: most linear steps of one (layer, part), "
                             "of any sessions, queued on a worker when it takes its next task, that run as one "
                             "batched call (fhe.backends.gpu.batched); 1: one step at a time. Nothing waits for "
                             "a batch to fill. Ignored on SEAL (device = 'cpu') and with backend = 'ray'")
    packed_plain_cache_gb: float = Field(0.0, ge=0, description="gpu backend: device GB of encoded projection "
                                         "diagonals each attention layer keeps between packed prefill chunks of one "
                                         "public shape (fhe.packed.PLAIN_CACHE_BYTES: every prompt's first chunk "
                                         "then skips ~3,300 encodes; the shipped plan's first chunk takes 7.7 GB a "
                                         "layer); 0: none. Ignored on SEAL (device = 'cpu')")
    device_key_bytes: int | None = Field(None, ge=1, description="device bytes of evaluation keys one GPU worker "
                                         "may hold (N=32768 plan: 1.32 GB a key set); caps max_keys_per_worker; "
                                         "None: no byte cap")
    spill_sessions: int | None = Field(3, ge=1, description="open sessions on the workers holding a key "
                                       "past which a new session of that key goes to a worker with room "
                                       "(loading another copy) rather than queueing behind them; None: never")
    task_timeout_s: float = Field(600.0, gt=0, description="a worker task running longer is killed")
    worker_start_timeout_s: float = Field(120.0, gt=0, description="seconds a new worker may take to build its "
                                          "state (an offload plan of 28 server layers encodes ~10 s of "
                                          "weights per layer on one core)")
    key_lifetime_s: float | None = Field(30 * 86400.0, gt=0, description="expiry of a registered key")
    audit_checkpoint_every: int = Field(64, ge=1, description="records between signed checkpoints")
    backend: Literal["local", "ray"] = Field("local", description="where workers run: \"local\" "
                                             "processes of this server, or \"ray\" actors of a cluster")
    ray: RaySettings = Field(default_factory=RaySettings, description="the Ray backend (backend = \"ray\")")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'cpu-reference', got {value[:32]!r}")
        return value

    @property
    def gpu_backend(self) -> bool:
        """Whether workers run the gpu backend (on CUDA or on its CPU reference) instead of SEAL."""
        return self.device != "cpu"

    @model_validator(mode="after")
    def _min_workers_fit(self) -> PrivateSettings:
        if self.min_workers > self.workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds workers ({self.workers})")
        return self
