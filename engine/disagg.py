"""Prefill/decode disaggregation on one machine: two engine processes and a router.

A request's prompt runs on the **prefill instance** (its own :class:`~engine.llm_engine.LLMEngine`,
``max_tokens = 1``: the prompt's K/V and the first token). Its full KV blocks then move to the **decode
instance** block by block through host memory: the prefill process copies block ``i`` (every layer,
K and V: ``[L, 2, block_size, Hkv, D]``) into a slot of a shared-memory staging ring and names the slot
and the block's prefix hash on a pipe; the decode process copies the slot into a block of its own pool,
registers it in its prefix cache under that hash (``BlockManager.adopt_cached``) and hands the slot back.
The transfer of a request overlaps the prefill of the next one (the prefill process serves its queue
between blocks) and the decode steps of the running ones (the decode process takes blocks between steps).

The :class:`Router` sends each prompt to the prefill instance and, once its blocks have moved, the
continuation (prompt + first token, ``max_tokens - 1``) to the decode instance, whose prefix cache then
holds every full block of the prompt: it computes only the partial last block (< ``block_size`` tokens)
and goes on decoding. ``Router(colocated=True)`` runs the same requests on one instance that does both,
for comparison in one run.

What this is not (yet): no NCCL/CUDA IPC transfer (host memory only), and a seeded sampled request's
later tokens differ from a colocated run (the decode instance's generator starts after the first token);
greedy output is the same (``tests/engine/test_disagg.py``).
"""

from __future__ import annotations

import dataclasses
import time
from multiprocessing.connection import Connection, wait

import torch

from engine.block_manager import chain_hash, root_hash
from engine.engine_config import EngineConfig
from engine.errors import EngineError
from engine.sampling_params import SamplingParams

STAGING_SLOTS = 16  # blocks in flight between the instances


@dataclasses.dataclass
class RequestTrace:
    """What the router saw of one request (times from ``time.perf_counter`` in the router)."""

    request_id: str
    arrival: float
    token_ids: list[int] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)  # when params ask for them
    kv_blocks: int = 0
    kv_transfer_s: float = 0.0   # prefill starts staging -> decode has taken the last block (one clock:
                                 # perf_counter is CLOCK_MONOTONIC, shared by the processes of a host)
    kv_copy_s: float = 0.0       # of which copying: pool -> ring on the prefill side, ring -> pool on decode
    finished: bool = False

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for a one-token answer)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def prompt_block_hashes(prompt: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """The prefix-cache hashes of the prompt's full blocks (the same chain the block manager builds)."""
    hashes, parent = [], root_hash(salt)
    for i in range(len(prompt) // block_size):
        parent = chain_hash(parent, prompt[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def staging_buffer(cfg, block_size: int, slots: int = STAGING_SLOTS, dtype=torch.float32) -> torch.Tensor:
    """The shared ring: [slots, L, 2, block_size, Hkv, D] in shared memory."""
    shape = (slots, cfg.num_hidden_layers, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype).share_memory_()


# ---- the instance processes -----------------------------------------------------------------------
class _Instance:
    """One engine process: its engine, its router pipe, and (prefill/decode) the pipe to its peer."""

    def __init__(self, role: str, model, engine_kw: dict, router: Connection, peer: Connection | None,
                 staging: torch.Tensor | None) -> None:
        from engine.llm_engine import LLMEngine
        from engine.loader import load_model

        torch.set_num_threads(engine_kw.pop("threads", 1))  # the instances share the machine's cores
        if not isinstance(model, torch.nn.Module):
            model = load_model(model)
        self.role, self.router, self.peer, self.staging = role, router, peer, staging
        self.engine = LLMEngine(model, None, EngineConfig(device="cpu", **engine_kw))
        self.kv = self.engine.executor.runner.kv
        self.bm = self.engine.block_manager
        self.free_slots = list(range(staging.shape[0])) if staging is not None else []
        self.blocks_seen: dict[str, tuple[int, float]] = {}  # decode: rid -> (blocks taken, copy seconds)
        self.arrived: set[str] = set()                  # decode: requests whose blocks all came
        self.parked: dict[str, tuple] = {}              # decode: continuations waiting for their blocks
        self.salts: dict[str, str | None] = {}
        self.prompts: dict[str, list[int]] = {}

    def serve(self) -> None:
        self.router.send(("ready", self.role))
        while True:
            busy = self.engine.has_unfinished_requests()
            conns = [c for c in (self.router, self.peer) if c is not None]
            for conn in wait(conns, timeout=0 if busy else None):
                while conn.poll():  # everything queued (all the blocks that came) before the next step
                    if not self._handle(conn, conn.recv()):
                        return
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle(self, conn: Connection, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "stop":
            return False
        if kind == "stats":
            self.router.send(("stats", self.role, self.bm.prefix_hits, self.bm.prefix_queries))
        if kind == "request":                        # colocated / prefill / decode continuation
            _, rid, prompt, params, salt = msg
            if self.role == "decode" and rid not in self.arrived:
                self.parked[rid] = msg
            else:
                self._add(rid, prompt, params, salt)
        elif kind == "block":                        # decode: a block of a request is in a slot
            self._take_block(*msg[1:])
        elif kind == "end":                          # decode: every block of rid has come
            self.arrived.add(msg[1])
            blocks, copy_s = self.blocks_seen.pop(msg[1], (0, 0.0))
            self.router.send(("kv", msg[1], blocks, time.perf_counter() - msg[2], copy_s + msg[3]))
            if msg[1] in self.parked:
                self._handle(conn, self.parked.pop(msg[1]))
        elif kind == "free":                         # prefill: the decode side is done with a slot
            self.free_slots.append(msg[1])
        return True

    def _add(self, rid: str, prompt: list[int], params: SamplingParams, salt: str | None) -> None:
        self.arrived.discard(rid)
        self.salts[rid], self.prompts[rid] = salt, prompt
        self.engine.add_request(rid, prompt, params, cache_salt=salt)

    def _step(self) -> None:
        for out in self.engine.step():
            comp = out.outputs[0]
            self.router.send(("tokens", out.request_id, comp.delta_token_ids, comp.finish_reason,
                              comp.logprobs or []))
            if out.finished and self.role == "prefill":
                self._send_blocks(out.request_id)

    def _send_blocks(self, rid: str) -> None:
        """Stage the finished prompt's full blocks one by one (they stay in the prefix cache until the
        next allocation, and nothing is allocated before this returns)."""
        prompt, salt = self.prompts.pop(rid), self.salts.pop(rid)
        t0 = time.perf_counter()
        copy_s = 0.0
        for i, h in enumerate(prompt_block_hashes(prompt, self.bm.block_size, salt)):
            bid = self.bm.cached_block(h)
            if bid is None:
                break
            slot = self._free_slot()
            c0 = time.perf_counter()
            for layer, (k, v) in enumerate(zip(self.kv.k, self.kv.v, strict=True)):
                self.staging[slot, layer, 0].copy_(k[bid])   # [block_size, Hkv, D]
                self.staging[slot, layer, 1].copy_(v[bid])
            copy_s += time.perf_counter() - c0
            self.peer.send(("block", rid, i, slot, h))
        self.peer.send(("end", rid, t0, copy_s))

    def _free_slot(self) -> int:
        while not self.free_slots:
            self._handle(self.peer, self.peer.recv())
        return self.free_slots.pop()

    def _take_block(self, rid: str, index: int, slot: int, block_hash: bytes) -> None:
        c0 = time.perf_counter()
        got = self.bm.adopt_cached(block_hash)
        if got is not None and got[1]:
            bid = got[0]
            for layer, (k, v) in enumerate(zip(self.kv.k, self.kv.v, strict=True)):
                k[bid].copy_(self.staging[slot, layer, 0])
                v[bid].copy_(self.staging[slot, layer, 1])
        blocks, copy_s = self.blocks_seen.get(rid, (0, 0.0))
        self.blocks_seen[rid] = (blocks + 1, copy_s + time.perf_counter() - c0)
        self.peer.send(("free", slot))


def _instance_main(role: str, model, engine_kw: dict, router: Connection, peer: Connection | None,
                   staging: torch.Tensor | None) -> None:
    _Instance(role, model, engine_kw, router, peer, staging).serve()


# ---- the router ----------------------------------------------------------------------------------
class Router:
    """Starts the instances and routes requests: prefill, then decode (or one colocated instance).

    Args:
        model: a model folder / .gguf path, or a model (sent to the instances in shared memory).
        engine_kw: ``EngineConfig`` fields of both instances (device is the CPU), plus ``threads``.
        colocated: one instance doing prefill and decode (the comparison), instead of two.
    """

    def __init__(self, model, engine_kw: dict | None = None, *, colocated: bool = False) -> None:
        from engine.config import ModelConfig
        from engine.loader import load_model

        self.engine_kw = dict(engine_kw or {})
        self.block_size = self.engine_kw.get("block_size", 16)
        mp = torch.multiprocessing.get_context("spawn")
        roles = ["colocated"] if colocated else ["prefill", "decode"]
        cfg: ModelConfig = model.config if isinstance(model, torch.nn.Module) else load_model(model).config
        staging = None if colocated else staging_buffer(cfg, self.block_size)
        peers = (None, None) if colocated else mp.Pipe()
        self.conns: dict[str, Connection] = {}
        self.procs = []
        for i, role in enumerate(roles):
            mine, theirs = mp.Pipe()
            p = mp.Process(target=_instance_main, daemon=True, name=f"cipherlm-{role}",
                           args=(role, model, dict(self.engine_kw), theirs, peers[i], staging))
            p.start()
            self.conns[role], self.procs = mine, self.procs + [p]
        for role, conn in self.conns.items():
            if conn.recv() != ("ready", role):
                raise EngineError(f"the {role} instance did not start")
        self.colocated = colocated

    def run(self, workload: list[tuple[float, str, list[int], SamplingParams]],
            salt: str | None = None) -> dict[str, RequestTrace]:
        """Submit each request at its arrival offset (seconds from now); return their traces when all end."""
        start = time.perf_counter()
        pending = sorted(workload, key=lambda w: w[0])
        traces: dict[str, RequestTrace] = {}
        params_of: dict[str, tuple[list[int], SamplingParams]] = {}
        while pending or not all(t.finished for t in traces.values()):
            now = time.perf_counter()
            while pending and start + pending[0][0] <= now:
                at, rid, prompt, params = pending.pop(0)
                traces[rid] = RequestTrace(rid, start + at)
                params_of[rid] = (prompt, params)
                first = params if self.colocated else dataclasses.replace(params, max_tokens=1)
                self.conns["colocated" if self.colocated else "prefill"].send(("request", rid, prompt, first, salt))
            timeout = max(0.0, start + pending[0][0] - now) if pending else None
            for conn in wait(list(self.conns.values()), timeout):
                self._on(conn.recv(), traces, params_of, salt)
        return traces

    def _on(self, msg: tuple, traces: dict[str, RequestTrace], params_of: dict, salt: str | None) -> None:
        kind, rid = msg[0], msg[1]
        tr = traces.get(rid)
        if tr is None:  # a late transfer report of an earlier run's one-token request
            return
        if kind == "kv":
            tr.kv_blocks, tr.kv_transfer_s, tr.kv_copy_s = msg[2:5]
            return
        _, _, tokens, finish, logprobs = msg
        now = time.perf_counter()
        tr.token_ids += tokens
        tr.logprobs += logprobs
        tr.token_times += [now] * len(tokens)
        if finish is None:
            return
        prompt, params = params_of[rid]
        handed_over = not self.colocated and len(tr.token_ids) == 1 and finish == "length" and params.max_tokens > 1
        if handed_over:  # the prefill leg is done: the continuation goes to the decode instance
            rest = dataclasses.replace(params, max_tokens=params.max_tokens - 1)
            self.conns["decode"].send(("request", rid, prompt + tr.token_ids, rest, salt))
        else:
            tr.finished = True

    def prefix_hits(self) -> dict[str, tuple[int, int]]:
        """Per instance: (prompt tokens found in its prefix cache, prompt tokens looked up)."""
        out = {}
        for role, conn in self.conns.items():
            conn.send(("stats",))
            while (msg := conn.recv())[0] != "stats":
                pass  # late "kv" reports
            out[role] = (msg[2], msg[3])
        return out

    def close(self) -> None:
        """Stop the instances."""
        for conn in self.conns.values():
            conn.send(("stop",))
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
