"""Plaintext engine replicas as Ray actors behind the one OpenAI API (data parallel).

:class:`ReplicaSet` stands where the app's ``AsyncLLM`` stands (``generate``, ``abort``, ``tokenizer``,
``model_config``, ``stats``, ``start``, ``shutdown``), so the routers do not know how many engines serve
them. Each replica is an :class:`EngineReplica` actor holding its own ``AsyncLLM`` (its own KV cache and
prefix cache) on a node of the Ray cluster.

Routing keeps prefix-cache hits: a request goes to the replica that wins a rendezvous hash of (the
tenant's cache salt, its first ``prefix_tokens`` token ids) among the live replicas, so one tenant's
requests sharing a system prompt meet their cached blocks on one replica; when that replica has
``load_slack`` more requests in flight than the least loaded one, the least loaded takes it (load beats a
cache hit). A replica whose actor dies (``RayActorError``) is marked dead: a request that had not
received its first output is sent to the next replica (nothing reached the client yet), one that had is
ended with 503 ``replica_lost``; the others keep serving. Idle replicas are pinged every
``health_poll_s`` so a dead one is skipped before a request finds it.

``/metrics`` reads :meth:`ReplicaSet.stats`: the sum of the replicas' last reported ``EngineStats``
(refreshed by the health loop), so KV usage is the mean and the counters are fleet totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from server.errors import ServiceUnavailableError

log = logging.getLogger("cipherlm.replicas")


class EngineReplica:
    """One engine in a Ray actor (async actor: the ``AsyncLLM`` binds to the actor's event loop)."""

    def __init__(self, model: str, engine_config: dict) -> None:
        from engine.async_llm import AsyncLLM
        from engine.engine_config import EngineConfig

        self.llm = AsyncLLM(model, EngineConfig(**engine_config))

    async def start(self) -> dict:
        """Start the engine; returns what the server needs without loading the model itself."""
        await self.llm.start()
        return {"pid": os.getpid(), "tokenizer": self.llm.tokenizer, "model_config": self.llm.model_config,
                "max_model_len": self.llm.max_model_len}

    async def generate(self, prompt, params, request_id: str, cache_salt: str | None, priority: int):
        async for out in self.llm.generate(prompt, params, request_id, cache_salt=cache_salt, priority=priority):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def stats(self):
        return self.llm.stats()

    async def shutdown(self) -> None:
        await self.llm.shutdown()


@dataclasses.dataclass
class _Replica:
    actor: Any
    index: int
    alive: bool = True
    inflight: int = 0
    served: int = 0  # requests routed here (per-replica load, for operators and tests)
    pid: int = 0
    stats: Any = None


def route_key(cache_salt: str | None, prompt: Any, prefix_tokens: int) -> bytes:
    """What decides a request's preferred replica: the tenant's salt and the first prompt tokens."""
    head = prompt[:prefix_tokens] if isinstance(prompt, list) else str(prompt)[: prefix_tokens * 4]
    return f"{cache_salt or ''}\0{head!r}".encode()


def rendezvous(key: bytes, candidates: list[int]) -> int:
    """Highest-random-weight choice: stable per key, and a dead replica moves only its own keys."""
    return max(candidates, key=lambda i: hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=8).digest())


class ReplicaSet:
    """``count`` engine replicas on Ray, one ``AsyncLLM``-shaped front (see the module docstring)."""

    def __init__(self, model: str, engine_config: dict, count: int, *, address: str | None = None,
                 num_cpus: float = 1.0, num_gpus: float = 0.0, prefix_tokens: int = 32, load_slack: int = 4,
                 health_poll_s: float = 5.0) -> None:
        import ray

        self._ray = ray
        self.model, self.engine_config, self.count = model, engine_config, count
        self.address, self.num_cpus, self.num_gpus = address, num_cpus, num_gpus
        self.prefix_tokens, self.load_slack, self.health_poll_s = prefix_tokens, load_slack, health_poll_s
        self.replicas: list[_Replica] = []
        self._where: dict[str, _Replica] = {}
        self._owns_cluster = False
        self._health: asyncio.Task | None = None
        self.tokenizer = self.model_config = None
        self.max_model_len = 0

    async def start(self) -> None:
        ray = self._ray
        if not ray.is_initialized():
            kw = {"address": "local", "_node_ip_address": "127.0.0.1", "include_dashboard": False} \
                if self.address is None else {"address": self.address}
            await asyncio.to_thread(ray.init, namespace="cipherlm", log_to_driver=False, configure_logging=False,
                                    **kw)
            self._owns_cluster = True
        cls = ray.remote(max_restarts=0)(EngineReplica).options(num_cpus=self.num_cpus, num_gpus=self.num_gpus)
        actors = [cls.remote(self.model, self.engine_config) for _ in range(self.count)]
        infos = await asyncio.gather(*(a.start.remote() for a in actors))
        self.replicas = [_Replica(a, i, pid=info["pid"]) for i, (a, info) in enumerate(zip(actors, infos, strict=True))]
        info = infos[0]
        self.tokenizer, self.model_config, self.max_model_len = info["tokenizer"], info["model_config"], \
            info["max_model_len"]
        self._health = asyncio.create_task(self._watch())

    # -- routing ----------------------------------------------------------------------------------------------
    def pick(self, cache_salt: str | None, prompt: Any, exclude: set[int] = frozenset()) -> _Replica:
        """The replica for a request (see the module docstring); 503 when none is alive."""
        live = [r for r in self.replicas if r.alive and r.index not in exclude]
        if not live:
            raise ServiceUnavailableError("no engine replica is alive; retry", retry_after=1, code="replica_lost")
        preferred = self.replicas[rendezvous(route_key(cache_salt, prompt, self.prefix_tokens),
                                             [r.index for r in live])]
        least = min(live, key=lambda r: r.inflight)
        return least if preferred.inflight > least.inflight + self.load_slack else preferred

    def generate(self, prompt, params, request_id: str, *, cache_salt: str | None = None,
                 priority: int = 0) -> AsyncIterator:
        return self._generate(prompt, params, request_id, cache_salt, priority)

    async def _generate(self, prompt, params, request_id, cache_salt, priority):
        tried: set[int] = set()
        while True:
            replica = self.pick(cache_salt, prompt, tried)
            tried.add(replica.index)
            started = False
            replica.inflight += 1
            replica.served += 1
            self._where[request_id] = replica
            try:
                gen = replica.actor.generate.options(num_returns="streaming").remote(
                    prompt, params, request_id, cache_salt, priority)
                async for ref in gen:
                    out = await ref
                    started = True
                    yield out
                return
            except self._ray.exceptions.RayActorError as exc:
                self._dead(replica, type(exc).__name__)
                if started:
                    raise ServiceUnavailableError("the engine replica serving this request was lost; retry",
                                                  retry_after=1, code="replica_lost") from exc
            except self._ray.exceptions.RayTaskError as exc:  # the engine's own error (400, 429...)
                raise _cause(exc) from None
            finally:
                replica.inflight -= 1
                self._where.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        replica = self._where.get(request_id)
        if replica is not None and replica.alive:
            with contextlib.suppress(self._ray.exceptions.RayError):
                await replica.actor.abort.remote(request_id)

    # -- health and metrics ---------------------------------------------------------------------------------------
    def _dead(self, replica: _Replica, why: str) -> None:
        if replica.alive:
            replica.alive = False
            log.warning("engine replica %d lost (%s)", replica.index, why)

    async def _watch(self) -> None:
        while True:
            for r in [r for r in self.replicas if r.alive]:
                try:
                    r.stats = await asyncio.wait_for(r.actor.stats.remote(), self.health_poll_s * 2)
                except (TimeoutError, self._ray.exceptions.RayError) as exc:
                    self._dead(r, type(exc).__name__)
            await asyncio.sleep(self.health_poll_s)

    def stats(self):
        """The replicas' last ``EngineStats`` summed (KV usage averaged); None before the first report."""
        reports = [r.stats for r in self.replicas if r.alive and r.stats is not None]
        if not reports:
            return None
        total = {f.name: sum(getattr(s, f.name) for s in reports) for f in dataclasses.fields(reports[0])}
        total["kv_cache_usage"] /= len(reports)
        return type(reports[0])(**total)

    def kill_replica(self, index: int) -> None:
        """Kill one replica's actor (tests, operators draining a node)."""
        with contextlib.suppress(Exception):
            self._ray.kill(self.replicas[index].actor, no_restart=True)

    async def shutdown(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        for r in self.replicas:
            if r.alive:
                with contextlib.suppress(self._ray.exceptions.RayError):
                    await asyncio.wait_for(r.actor.shutdown.remote(), 30)
            self.kill_replica(r.index)
        if self._owns_cluster:
            await asyncio.to_thread(self._ray.shutdown)


def _cause(exc: Exception) -> BaseException:
    """The engine exception inside a Ray task error (so ``server.errors`` maps it as for one engine)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


__all__ = ["EngineReplica", "ReplicaSet", "rendezvous", "route_key"]
