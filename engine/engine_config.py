"""Configuration of the serving engine, validated on construction.

:class:`EngineConfig` is the flat set of knobs users and the server pass (``EngineConfig(**settings.engine)``).
The components get their own slice, each a dataclass validated in ``__post_init__``:
:class:`CacheConfig` (block manager / KV pool) and :class:`SchedulerConfig` (scheduler); the model runner
reads the device and CUDA-graph fields of the ``EngineConfig`` itself.
"""

from __future__ import annotations

import dataclasses

# "fair": decodes first, then prefill budget shared across tenants (least served first, a quantum per
# prefill, leftovers back to capped prefills); "fcfs": the original policy (running first, whole budget
# to a running prefill, waiting in (priority, arrival) order) -- kept so benchmarks compare both in one run.
SCHEDULING_POLICIES = ("fair", "fcfs")

# Default step budgets. A CPU step is compute-bound: 512 rows already run the linears at their GEMM peak
# (docs/benchmarks.md), and a shorter step is what bounds a waiting request's time to first token
# (a 2,048-token step at 8k context takes ~15 s on one core).
DEFAULT_BATCHED_TOKENS = {"cuda": 2048, "cpu": 512}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The block manager's and KV pool's knobs (see :class:`EngineConfig` for their meaning)."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _positive(self, "block_size", "kv_cache_bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's knobs (see :class:`EngineConfig` for their meaning)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fair"
    prefill_quantum: int | None = None
    admission_delay_steps: int = 0

    def __post_init__(self) -> None:
        _positive(self, "max_num_seqs", "max_num_batched_tokens")
        _non_negative(self, "admission_delay_steps", "max_waiting")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.prefill_quantum is not None and self.prefill_quantum <= 0:
            raise ValueError(f"prefill_quantum must be positive, got {self.prefill_quantum}")

    @property
    def quantum(self) -> int:
        """A prefill's share of a step in the fair pass (``prefill_quantum``, default a quarter budget)."""
        return self.prefill_quantum or max(1, self.max_num_batched_tokens // 4)


SPECULATIVE_METHODS = ("ngram",)
CUDA_WEIGHT_FORMATS = ("bf16", "int4", "fp8")
# "auto": the pools hold the model dtype; "fp8_e4m3" ("fp8", as vLLM spells it too): float8_e4m3fn values
# with static per-(layer, KV head) scales for K and V (engine.kv_cache.calibrate_kv_scales)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding's knobs (see :class:`EngineConfig` for their meaning)."""

    method: str | None = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 4

    def __post_init__(self) -> None:
        from engine.sampling_params import MAX_SPECULATIVE_TOKENS

        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be None or one of {SPECULATIVE_METHODS}, "
                             f"got {self.method!r}")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 1 or None, "
                             f"got {self.disable_by_batch_size}")


def _positive(cfg: object, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(cfg, name)}")


def _non_negative(cfg: object, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")


@dataclasses.dataclass
class EngineConfig:
    """Knobs of :class:`engine.llm_engine.LLMEngine`.

    Attributes:
        device: "cuda", "cpu" or "auto" (CUDA when available).
        dtype: "auto" (bf16 on GPU, fp32 on CPU), "bfloat16", "float16" or "float32".
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of the GPU's total memory the engine may use (weights,
            activations of the warm-up pass and the KV pool together).
        kv_cache_bytes: on CPU, the byte budget of the KV pool (K and V, all layers).
        num_kv_blocks: force the pool size (tests); overrides the two above.
        max_model_len: longest prompt + output; defaults to the model's max_position_embeddings.
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes); None: 2048 on
            CUDA, 512 on CPU (``DEFAULT_BATCHED_TOKENS``; resolved on construction).
        max_waiting: requests allowed to wait for admission; more raise EngineOverloadedError.
        enable_prefix_caching: share full KV blocks between requests with the same prefix (and salt).
        enable_chunked_prefill: split long prompts over several steps (otherwise a prompt waits until
            it fits the budget whole).
        scheduling_policy: "fair" (default: decodes first, prefill budget shared fairly across tenants,
            see docs/engine.md "Scheduling") or "fcfs" (the original first-come-first-served policy).
        prefill_quantum: under "fair", the most tokens one prefill takes in a step's first pass, so
            that the other waiting prompts get into the same step; budget left over goes back to the
            capped prefills. None: ``max_num_batched_tokens // 4``.
        admission_delay_steps: while sequences are decoding, a new prompt waits up to this many steps so
            that the prompts arriving meanwhile join one step together (TGI's ``max_waiting_tokens``): fewer
            steps mix in a prefill, which run eagerly where the decode graphs do not take them
            (``cuda_graph_mixed_tokens``). Admission is immediate when nothing is decoding, when the step mixes
            in a running prefill anyway, or once ``max_num_seqs // 8`` prompts wait. The cost: up to that many
            steps of time to first token. Default 0 (admit at once; docs/engine.md "Scheduling").
        cuda_graphs: capture decode steps (and verify steps, below) in CUDA graphs (GPU only).
        cuda_graph_max_batch: largest decode batch captured.
        cuda_graph_mixed_tokens: prompt tokens a decode graph may carry. A step that mixes prompt chunks into
            its decodes (a server under a steady stream of arrivals: nearly every step) replays a decode graph
            with every prompt token as a row of its own, attending to its sequence up to itself, when the step
            holds at most ``cuda_graph_max_batch`` sequences, no drafts, and at most this many prompt tokens of
            short enough contexts (``model_runner.MIXED_MEAN_CONTEXT`` context tokens per prompt token on
            average); otherwise it runs eagerly, its prompts through the prefill kernel. The graphs then cover
            up to ``cuda_graph_max_batch`` + this many rows (``model_runner.graph_buckets``; only the first
            ``cuda_graph_max_batch`` rows' logits). Default 0 (mixed steps run eagerly): on an H100 at 256
            served users, 256 made serving 13-16 % slower, and 2048 (the whole token budget) served 1.32-1.48x
            the tokens/s of 0 but with a TTFT p99 of 2.9-4.9 s against 0.4-0.6 s, measured with the benchmark's
            old client and the server's old accept path, both since replaced (docs/engine.md "Mixed steps
            through the decode graphs"); the default waits for that run again.
        cuda_graph_spec_tokens: draft counts ``k`` whose speculative verify steps (each sequence's last
            token + up to ``k`` drafts) get CUDA graphs, for batch buckets up to the batch at which speculation
            is switched off (``speculative_disable_by_batch_size``, capped by ``cuda_graph_max_batch``); a
            step whose sequences carry at most ``k`` drafts replays the smallest such graph, padded. None:
            ``(num_speculative_tokens,)`` when that is positive, else none; ``()``: none (verify eagerly).
        num_threads: torch threads on CPU (None = leave torch's setting).
        cpu_packed_weights: on CPU, run the linears on oneDNN-packed weight copies (engine.cpu_linear;
            faster few-row products, one extra copy of the weights in memory).
        cpu_one_row_weights: with ``cpu_packed_weights``, every linear also keeps a transposed copy for
            one-row products (batch-1 decode: MKL's gemv streams it faster than the packed layout;
            one more copy of the fp32 weights, ~0.54 GB for SmolLM2-135M).
        cpu_native_gemv: with ``cpu_packed_weights``, one-row fp32 products (batch-1 decode) run the native
            kernel ``kernels.cpu.f32_mm`` over the weights as stored, and ``cpu_one_row_weights`` makes no
            copies; where the native kernels do not load (no AVX2/FMA, no compiler) it falls back to those.
        cpu_fused_projections: on CPU, run each layer's q/k/v and gate/up as one product each
            (engine.cpu_linear.fuse_projections; fp32 packed or 4-bit weights; no weight stored twice).
        cpu_fused_decode: on CPU, a step of one single-token query (batch-1 decode) runs every decoder
            layer in one native call (``engine.cpu_decode``: norms, RoPE, K/V store, attention, SiLU and
            residuals around the same one-row products); needs ``cpu_fused_projections`` and fp32 or Q4_1 /
            Q8_0-shaped weights, and where the native kernels do not load the step runs unfused.
        weight_format: what the linears hold when a model is loaded from a path (engine.quant, CPU
            only): "fp32" (default: everything dequantized), "native" (a GGUF's Q4_1/Q8_0/Q4_K blocks or
            a ``cipherlm model quantize`` folder run as stored), "int8" (group-wise RTN at load),
            "int8-channel" (per-channel RTN) or "int4" (group-wise RTN, the head at int8).
        weight_group_size: columns per scale of "int4" / "int8" (32, 64, 128 or 256).
        cuda_weight_format: what the layer GEMMs and the head read on CUDA: "bf16" (default), "int4"
            (group-wise RTN of ``weight_group_size`` at load, decode rows through ``kernels.gemv_int4_w32``)
            or "fp8" (e4m3 per output channel at load, ``engine.fp8``: up to 4 rows weight-only through
            ``kernels.gemv_fp8``, more rows with per-token e4m3 activations through ``torch._scaled_mm``;
            needs compute capability 8.9+).
        cuda_fused_rope_store: on CUDA, RoPE of q/k and the K/V store run as one kernel
            (``kernels.rope_store_kv``, issue 19.2; measured faster, docs/benchmarks.md); False: two kernels.
        cuda_gemv_prologues: on CUDA, fold the RMSNorms and SiLU·mul into the prologue of the GEMV kernels
            that run decode rows (``engine.fused``, issue 19.2). Off by default: on an H100 the prologue
            GEMVs at the default tunings cost more than the launches they save (docs/benchmarks.md).
        cuda_fused_decode_layers: on CUDA, GEMV-row decode steps (batch 1 in bf16, up to 4 rows in int4) run each
            layer as 4 fused GEMV launches + the attention (``kernels.decode_layer``, issue 19 item 2): RMSNorm
            + QKV + RoPE + K/V store, attention, O + residual add, RMSNorm + gate/up + SiLU·mul, down + residual
            add, instead of ~10 launches. Takes precedence over ``cuda_gemv_prologues`` on those steps; fp8
            weights and fp8 KV pools keep the unfused path. Off by default: on an H100 the step was slower on
            three rows of four (Qwen2.5-0.5B bf16 0.757 -> 0.870 ms; docs/benchmarks.md, "Session 23's device calls").
        cuda_one_pass_decode_tokens: on CUDA, decode batches of up to 8 sequences whose contexts all fit
            this many tokens replay a graph whose attention is one pass per (sequence, KV head), without
            the split-K reduce kernel (``engine.model_runner.ONE_PASS_MAX_BATCH``); 0 (default): off (split-K
            only; the one-pass graphs measured slower at 129-384-token contexts on an H100).
        cuda_pdl: on CUDA (compute capability 9.0+), launch the decode step's Triton kernels (GEMVs, norms,
            RoPE + store, attention, SiLU·mul) with programmatic dependent launch (``kernels._pdl``): each
            starts, and loads its weights, while the kernel before it finishes. Process-wide (the last
            engine built sets it). On by default: +12-28 % batch-1 tokens/s on an H200, both shapes, bf16 and
            int4 (docs/benchmarks.md, "PDL and int4 prefetch"); a no-op below compute capability 9.0.
        seed: seed of the generator used by requests without their own seed.
        speculative_method: "ngram" (prompt lookup, :mod:`engine.spec_decode`) or None (no request
            speculates; one that asks is refused).
        num_speculative_tokens: draft tokens per step for requests that do not say
            (``SamplingParams.num_speculative_tokens``); 0: only requests that ask speculate.
        prompt_lookup_min / prompt_lookup_max: n-gram lengths the proposer matches (longest first).
        speculative_disable_by_batch_size: no sequence speculates in a step that starts with more than
            this many running sequences (a batched step is compute-bound: verifying drafts there costs more
            than it saves, docs/benchmarks.md); None: never switched off by load.
        tensor_parallel_size: ranks the model is split over (``engine.distributed``: heads, MLP columns
            and vocabulary; gloo on CPU, NCCL on GPUs ``cuda:0 .. cuda:N-1``); 1: one process, as before.
        kv_cache_dtype: what the KV pools hold: "auto" (the model dtype) or "fp8_e4m3" (alias "fp8": one byte
            per value, per-(layer, KV head) scales for K and V calibrated at load; docs/engine.md "FP8 KV
            cache"). On CPU fp8 pools run the kernels' torch references (slower than the fp32 CPU path);
            not with tensor parallelism.
        async_scheduling: overlap the host with the device (``LLMEngine.step``, docs/engine.md "Overlapped
            steps"): a step of plain greedy requests is launched and the previous step's tokens are read
            back after it, so scheduling and input staging of step n + 1 run while step n runs. None
            (default): on for a GPU engine (whose host work per step is as long as the GPU's, docs/engine.md),
            off on the CPU (nothing runs beside the host there, and the placeholders cost a little host
            work); True / False force it.
        gc_freeze: after start-up (weights, KV pool, CUDA graphs), collect once and move every object alive
            into the collector's permanent generation (``gc.freeze``, as vLLM's engine core does), so the
            full collections that a long job triggers no longer walk the interpreter's and torch's heap
            (~0.1 s a pass, the run-to-run spread of a GPU job). Process-wide: objects alive then are never
            collected as cycles (plain reference counting still frees them). None (default): on for a GPU
            engine, off on the CPU (where tests build many engines in one process).
    """

    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fair"
    prefill_quantum: int | None = None
    admission_delay_steps: int = 0
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256
    cuda_graph_mixed_tokens: int = 0
    cuda_graph_spec_tokens: tuple[int, ...] | None = None
    num_threads: int | None = None
    cpu_packed_weights: bool = True
    cpu_one_row_weights: bool = True
    cpu_native_gemv: bool = True
    cpu_fused_projections: bool = True
    cpu_fused_decode: bool = True
    weight_format: str = "fp32"
    weight_group_size: int = 32
    cuda_weight_format: str = "bf16"
    cuda_fused_rope_store: bool = True
    cuda_gemv_prologues: bool = False
    cuda_fused_decode_layers: bool = False
    cuda_one_pass_decode_tokens: int = 0
    cuda_pdl: bool = True
    seed: int = 0
    speculative_method: str | None = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_disable_by_batch_size: int | None = 4
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    async_scheduling: bool | None = None
    gc_freeze: bool | None = None

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto/bfloat16/float16/float32, got {self.dtype!r}")
        _positive(self, "cuda_graph_max_batch")
        if self.max_num_batched_tokens is None:
            kind = "cuda" if self.resolved_device().startswith("cuda") else "cpu"
            self.max_num_batched_tokens = DEFAULT_BATCHED_TOKENS[kind]
        self.cache_config()       # validates the cache's fields
        self.scheduler_config()   # and the scheduler's
        self.spec_config()        # and speculative decoding's
        self._check_graph_spec_tokens()
        _non_negative(self, "cuda_graph_mixed_tokens", "cuda_one_pass_decode_tokens")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        self._check_weight_format()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        self._check_parallel()

    def _check_graph_spec_tokens(self) -> None:
        from engine.sampling_params import MAX_SPECULATIVE_TOKENS

        ks = self.cuda_graph_spec_tokens
        if ks is not None and not all(isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS for k in ks):
            raise ValueError(f"cuda_graph_spec_tokens must hold draft counts in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {ks!r}")

    def verify_graph_tokens(self) -> tuple[int, ...]:
        """The draft counts whose verify steps get CUDA graphs (sorted; empty without speculation)."""
        if self.speculative_method is None:
            return ()
        ks = self.cuda_graph_spec_tokens
        if ks is None:
            ks = (self.num_speculative_tokens,) if self.num_speculative_tokens > 0 else ()
        return tuple(sorted(set(ks)))

    def _check_parallel(self) -> None:
        from engine.errors import ParallelConfigError

        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ParallelConfigError(f"tensor_parallel_size must be an integer >= 1, "
                                      f"got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.weight_format != "fp32":
            raise ParallelConfigError("tensor parallelism shards fp32/bf16 weights: weight_format must be "
                                      f"'fp32', got {self.weight_format!r}")
        if self.tensor_parallel_size > 1 and self.kv_cache_dtype != "auto":
            raise ParallelConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported with tensor "
                                      "parallelism yet (each rank would calibrate its own heads' scales: untested)")
        # a quantized CUDA head would replace the vocabulary-parallel one and drop its gather of the ranks' logits
        if self.tensor_parallel_size > 1 and self.cuda_weight_format != "bf16":
            raise ParallelConfigError("tensor parallelism shards bf16 weights: cuda_weight_format must be "
                                      f"'bf16', got {self.cuda_weight_format!r}")

    def _check_weight_format(self) -> None:
        from engine.quant import WEIGHT_FORMATS

        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.weight_group_size not in (32, 64, 128, 256):
            raise ValueError(f"weight_group_size must be 32, 64, 128 or 256, got {self.weight_group_size}")
        if self.cuda_weight_format not in CUDA_WEIGHT_FORMATS:
            raise ValueError(f"cuda_weight_format must be one of {CUDA_WEIGHT_FORMATS}, "
                             f"got {self.cuda_weight_format!r}")
        if self.weight_format != "fp32" and self.resolved_device() != "cpu":
            raise ValueError(f"weight_format {self.weight_format!r} runs on the CPU only (device='cpu')")

    def cache_config(self) -> CacheConfig:
        """The block manager's / KV pool's slice of this config."""
        return CacheConfig(self.block_size, self.gpu_memory_utilization, self.kv_cache_bytes,
                           self.num_kv_blocks, self.enable_prefix_caching)

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's slice of this config."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_waiting,
                               self.enable_chunked_prefill, self.scheduling_policy, self.prefill_quantum,
                               self.admission_delay_steps)

    def spec_config(self) -> SpecConfig:
        """Speculative decoding's slice of this config."""
        return SpecConfig(self.speculative_method, self.num_speculative_tokens, self.prompt_lookup_min,
                          self.prompt_lookup_max, self.speculative_disable_by_batch_size)

    def resolved_device(self) -> str:
        """The torch device string this config runs on."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_gc_freeze(self) -> bool:
        """Whether the engine freezes the collector's heap after start-up (``gc_freeze``; None: GPU only)."""
        return self.resolved_device() != "cpu" if self.gc_freeze is None else self.gc_freeze

    def resolved_async_scheduling(self) -> bool:
        """Whether the engine overlaps steps: ``async_scheduling`` (None: on a GPU, see the field's docs)."""
        return self.resolved_device() != "cpu" if self.async_scheduling is None else self.async_scheduling

    def resolved_kv_cache_dtype(self):
        """The torch dtype of the KV pools: the model dtype, or float8_e4m3fn."""
        import torch

        return self.resolved_dtype() if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def resolved_dtype(self):
        """The torch dtype of the weights (and of the KV cache unless ``kv_cache_dtype`` says otherwise)."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)
