"""Tensor parallelism: one engine process driving N ranks through the executor seam.

:class:`TensorParallelExecutor` is the :class:`~engine.executor.Executor` of an engine with
``tensor_parallel_size = N > 1``. The engine process is rank 0 (vLLM's "driver worker"): the scheduler,
block manager and sampler exist only there. Ranks 1..N-1 are processes started with
``torch.multiprocessing`` (spawn); each gets its shard of the weights (``engine.tp_linear.shard_state``,
handed over in shared memory, before any fusion) and builds its own :class:`~engine.model_runner.ModelRunner`
on a model of the local shape, whose paged KV pool therefore holds only that rank's KV heads. Block ids
are the same on every rank: one block manager (on rank 0) serves all the pools.

Per step rank 0 builds the flat batch once (``ModelRunner.prepare``) and broadcasts it — block copies,
token ids, positions, attention metadata, logits rows — over a gloo group (the control plane; on GPUs the
model's collectives use a separate NCCL group, as vLLM does); every rank then runs the same forward, with
two all-reduces per layer, one for the embedding and an all-gather of the head's logits. Rank 0 returns
the logits to the engine.

Limits (written down, not hidden): decode steps run eagerly under tensor parallelism (no CUDA graphs
per rank yet); one tensor-parallel engine per process (torch.distributed's default group is global);
a dead rank fails the next step with :class:`~engine.errors.EngineError` rather than hanging on it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import weakref

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.errors import EngineError, ParallelConfigError
from engine.kv_cache import AttentionMetadata, PagedAttention
from engine.loader import build_model
from engine.model import LlamaForCausalLM
from engine.model_runner import ModelRunner
from engine.scheduler import SchedulerOutput
from engine.tp_linear import Comm, full_state, local_config, parallelize, shard_state

log = logging.getLogger(__name__)

# a collective waits this long for a peer before failing (gloo/NCCL default: 30 minutes)
COLLECTIVE_TIMEOUT_S = 300


@dataclasses.dataclass
class RankSpec:
    """What a rank needs to build its part: who it is and where the group meets."""

    rank: int
    world: int
    init_method: str
    backend: str
    full_config: ModelConfig
    engine_config: EngineConfig
    max_model_len: int
    threads: int | None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of the group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(config: EngineConfig) -> str:
    """NCCL when the engine runs on CUDA, gloo on the CPU."""
    return "nccl" if config.resolved_device().startswith("cuda") else "gloo"


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The rank's engine config: its own GPU, eager decode (no CUDA graphs under TP yet), and no fused CPU
    decode step (a rank runs its shard's forward itself, not ``ModelRunner.execute``)."""
    device = f"cuda:{rank}" if config.resolved_device().startswith("cuda") else "cpu"
    return dataclasses.replace(config, device=device, cuda_graphs=False, cpu_fused_decode=False)


def threads_per_rank(config: EngineConfig, world: int) -> int:
    """CPU threads of one rank: the engine's threads (``num_threads``, else every core) shared out evenly."""
    return max(1, (config.num_threads or len(os.sched_getaffinity(0))) // world)


class RankContext:
    """A rank's process group, runner and collectives (rank 0's lives in the engine process)."""

    def __init__(self, spec: RankSpec, shard: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        if spec.threads and spec.engine_config.resolved_device() == "cpu":
            torch.set_num_threads(spec.threads)
        if spec.backend == "nccl":
            torch.cuda.set_device(spec.rank)
        dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.rank,
                                world_size=spec.world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # control plane: pickled step inputs on the CPU (a gloo group beside NCCL on GPUs)
        self.ctrl = dist.new_group(backend="gloo") if spec.backend == "nccl" else None
        self.comm = Comm(None, spec.world)
        cfg = spec.full_config
        model = build_model(local_config(cfg, spec.world), shard, f"tensor-parallel rank {spec.rank}")
        model = parallelize(model, cfg, spec.rank, self.comm)
        self.runner = ModelRunner(model, rank_config(spec.engine_config, spec.rank), spec.max_model_len)

    def broadcast(self, msg: object) -> object:
        """Rank 0's ``msg`` on every rank."""
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def init_kv_cache(self) -> int:
        """Allocate this rank's pool; every rank agrees on the smallest block count (GPUs may differ)."""
        n = torch.tensor([self.runner.init_kv_cache()], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.ctrl)
        return int(n)

    @torch.inference_mode()
    def forward(self, step: StepMessage) -> torch.Tensor:
        """Run one broadcast step on this rank's shard -> logits [R, V] (fp32, the same on every rank)."""
        runner = self.runner
        dev = runner.device
        runner.kv.copy_blocks(step.copies)
        meta = _meta_to(step.meta, dev)
        backend = PagedAttention(runner.kv, meta, runner.model_config.head_dim, cpu_decode=runner.cpu_attention)
        h = runner.model(step.input_ids.to(dev), step.positions.to(dev), backend)  # [T, hidden]
        return runner.model.logits(h[step.logits_rows.to(dev)])                  # [R, V]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclasses.dataclass
class StepMessage:
    """One step as rank 0 broadcasts it (host tensors: the control plane is gloo)."""

    copies: list[tuple[int, int]]
    input_ids: torch.Tensor    # [T] int64
    positions: torch.Tensor    # [T] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [R] int64


def _meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if meta.slot_mapping.device == device:
        return meta
    moved = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    return AttentionMetadata(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def _worker_main(spec: RankSpec, shard: dict[str, torch.Tensor], conn) -> None:
    """A rank > 0: build its part, then run what rank 0 broadcasts until told to stop.

    ``conn`` tells rank 0 how start-up went ("up" before the rendezvous, "ready" or the error after the
    build), so a rank that fails to start fails the engine's construction instead of hanging a collective.
    """
    conn.send("up")
    try:
        ctx = RankContext(spec, shard)
    except Exception as exc:
        conn.send(f"rank {spec.rank} failed to start: {type(exc).__name__}: {exc}")
        raise
    del shard
    conn.send("ready")
    try:
        while True:
            msg = ctx.broadcast(None)
            if msg == "init":
                ctx.init_kv_cache()
            elif isinstance(msg, StepMessage):
                ctx.forward(msg)
            elif msg == "timing":
                ctx.comm.timing = True
            else:  # "stop"
                break
    finally:
        ctx.close()


class TensorParallelExecutor:
    """The :class:`~engine.executor.Executor` of ``tensor_parallel_size`` ranks (module docstring)."""

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, max_model_len: int) -> None:
        world = config.tensor_parallel_size
        cfg = model.config
        local_config(cfg, world)  # ParallelConfigError before any process starts
        if dist.is_initialized():
            raise ParallelConfigError("this process already runs a tensor-parallel engine (one per process)")
        backend = backend_for(config)
        if backend == "nccl" and torch.cuda.device_count() < world:
            raise ParallelConfigError(f"tensor_parallel_size {world} needs {world} GPUs, "
                                      f"{torch.cuda.device_count()} visible")
        state = full_state(model)
        shards = [shard_state(state, cfg, r, world) for r in range(world)]
        del state
        init = f"tcp://127.0.0.1:{free_port()}"
        threads = threads_per_rank(config, world) if backend == "gloo" else None
        specs = [RankSpec(r, world, init, backend, cfg, config, max_model_len, threads) for r in range(world)]
        mp = torch.multiprocessing.get_context("spawn")
        pipes = [mp.Pipe(duplex=False) for _ in range(1, world)]
        self.procs = [mp.Process(target=_worker_main, args=(specs[r], shards[r], pipes[r - 1][1]), daemon=True,
                                 name=f"cipherlm-tp-rank{r}") for r in range(1, world)]
        _start(self.procs)
        conns = [recv for recv, _ in pipes]
        try:
            self._await(conns, "up")
            self.ctx = RankContext(specs[0], shards[0])
            del shards
            self._await(conns, "ready")
        except BaseException:  # rank 0 failed (or a peer did): no rank may outlive the engine
            for p in self.procs:
                p.terminate()
            raise
        self.runner = self.ctx.runner
        self.device = self.runner.device
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_ranks, self.ctx, self.procs)

    def _await(self, conns: list, word: str, timeout: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Wait until every rank process says ``word``; a rank that exits or reports an error first
        stops the others and raises :class:`EngineError`."""
        from multiprocessing.connection import wait

        for proc, conn in zip(self.procs, conns, strict=True):
            ready = wait([conn, proc.sentinel], timeout)
            said = conn.recv() if conn in ready and conn.poll() else None
            if said != word:
                why = said or (f"exit code {proc.exitcode}" if ready else f"no answer in {timeout:.0f} s")
                raise EngineError(f"tensor-parallel {proc.name} did not start: {why}")

    @property
    def comm(self) -> Comm:
        """Rank 0's collectives (``comm.timing = True`` adds up their time; see :meth:`enable_timing`)."""
        return self.ctx.comm

    def enable_timing(self) -> None:
        """Time every collective on every rank from now on (benchmarks)."""
        self._send("timing")
        self.ctx.comm.timing = True

    def init_kv_cache(self) -> int:
        self._send("init")
        return self.ctx.init_kv_cache()

    def execute(self, sched: SchedulerOutput):
        from engine.executor import ModelOutput

        inputs = self.runner.prepare(sched)
        cpu = torch.device("cpu")
        step = StepMessage(sched.copies, inputs.input_ids.to(cpu), inputs.positions.to(cpu),
                           _meta_to(inputs.meta, cpu), inputs.logits_rows.to(cpu))
        self._send(step)
        return ModelOutput(self.ctx.forward(step), inputs.sampling)

    def _send(self, msg: object) -> None:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead or self._closed:
            raise EngineError(f"tensor-parallel rank process(es) {dead or 'all'} stopped; restart the engine")
        self.ctx.broadcast(msg)

    def shutdown(self) -> None:
        """Stop the ranks and leave the process group (a new tensor-parallel engine may start after)."""
        if not self._closed:
            self._closed = True
            self._finalizer()


def _start(procs: list) -> None:
    """Start the rank processes, also from a daemonic process (the engine core of ``engine_process``).

    multiprocessing refuses children to a daemon so that none is orphaned when it is killed; the ranks are
    daemons of their own, stopped by :meth:`TensorParallelExecutor.shutdown`, and a rank whose engine died
    fails its next collective (``COLLECTIVE_TIMEOUT_S``) and exits, so the refusal is lifted while they start.
    """
    import multiprocessing

    config = multiprocessing.current_process()._config  # noqa: SLF001 - the flag start() checks
    daemonic = config.get("daemon", False)
    config["daemon"] = False
    try:
        for p in procs:
            p.start()
    finally:
        config["daemon"] = daemonic


def _stop_ranks(ctx: RankContext, procs: list) -> None:
    try:
        if all(p.is_alive() for p in procs):
            ctx.broadcast("stop")
    except RuntimeError as exc:  # a peer already gone: nothing left to tell
        log.warning("tensor-parallel shutdown: %s", exc)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
    ctx.close()
