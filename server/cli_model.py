"""``cipherlm model pull|list|info|quantize`` and ``cipherlm generate``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from server.cli import DefaultsHelpFormatter, add_threads_option


def register(sub: argparse._SubParsersAction) -> None:
    """Add the model commands and ``generate``."""
    model = sub.add_parser("model", help="manage the cached models")
    msub = model.add_subparsers(dest="model_command", required=True)
    pull = msub.add_parser("pull", help="download and cache the default model (SmolLM2-135M-Instruct)")
    pull.add_argument("--force", action="store_true", help="pull again even if cached")
    pull.add_argument("--native", action="store_true",
                      help="cache the GGUF's Q4_1 blocks as they are (for weight_format='native') instead of fp32")
    pull.set_defaults(func=_pull)
    msub.add_parser("list", help="list cached models").set_defaults(func=_list)
    info = msub.add_parser("info", help="shapes and sizes of a model")
    info.add_argument("model", nargs="?", default="default", help="'default', a model folder or a .gguf")
    info.add_argument("--verify", action="store_true", help="re-hash cached files against the manifest")
    info.set_defaults(func=_info)

    quant = msub.add_parser("quantize", help="write a weight-quantized copy of a model (engine.quant)",
                            formatter_class=DefaultsHelpFormatter)
    quant.add_argument("model", help="'default', a model folder or a .gguf file")
    quant.add_argument("out", help="folder to write (config.json with quantization_config + safetensors)")
    quant.add_argument("--format", choices=("int4", "int8", "int8-channel", "native", "gptq", "awq"),
                       default="int4",
                       help="int4: group-wise RTN (head int8); int8: group-wise RTN; int8-channel: "
                            "per-channel RTN; native: a GGUF's blocks as stored; gptq / awq: those "
                            "safetensors layouts (decoder linears; embedding and head unquantized)")
    quant.add_argument("--group-size", type=int, choices=(32, 64, 128, 256), default=None,
                       help="columns per scale (default: 32 for int4/int8; gptq/awq: 128, or the largest "
                            "of 64/32 that divides the model's widths)")
    quant.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                       help="gptq/awq formats: round-to-nearest, or GPTQ calibrated on --calib-file")
    quant.add_argument("--bits", type=int, choices=(4, 8), default=4, help="gptq format: bits per weight")
    quant.add_argument("--asym", action="store_true",
                       help="gptq format: zero point per group (written as checkpoint_format gptq_v2)")
    quant.add_argument("--act-order", action="store_true",
                       help="--method gptq: columns by decreasing Hessian diagonal (static groups)")
    quant.add_argument("--calib-file", default=None,
                       help="--method gptq: calibration text (default: Python's pydoc reference topics)")
    quant.add_argument("--calib-samples", type=int, default=128, help="--method gptq: sequences")
    quant.add_argument("--calib-len", type=int, default=256, help="--method gptq: tokens per sequence")
    quant.add_argument("--calib-plain", action="store_true",
                       help="--method gptq: calibrate on the plain text, not wrapped in the chat template")
    quant.set_defaults(func=_quantize)

    gen = sub.add_parser("generate", help="generate text on the CPU (streams to the terminal)",
                         description="Generate text on the CPU with the engine and stream it to the terminal.",
                         formatter_class=DefaultsHelpFormatter)
    gen.add_argument("prompt", help="the user message (rendered with the model's chat template)")
    gen.add_argument("--model", default="default", help="'default', a model folder or a .gguf file")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as text")
    add_threads_option(gen)
    gen.set_defaults(func=_generate)


def resolve_model(spec: str) -> Path:
    """'default' -> the cached default model (pulled on first use); else the path itself."""
    from engine.default_model import default_model_dir
    from engine.errors import ModelLoadError

    if spec == "default":
        return default_model_dir()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model folder or file")
    return path


def _pull(args: argparse.Namespace) -> int:
    from engine.default_model import pull, pull_native

    print((pull_native if args.native else pull)(force=args.force))
    return 0


def _list(args: argparse.Namespace) -> int:
    from engine.default_model import MANIFEST, models_dir

    root = models_dir()
    folders = (sorted(p for p in root.glob("*") if not p.name.startswith(".") and (p / MANIFEST).exists())
               if root.exists() else [])  # hidden: a pull's staging folder
    if not folders:
        print(f"no models cached under {root} (run: cipherlm model pull)")
    for p in folders:
        size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
        print(f"{p.name}\t{size / 1e6:.1f} MB\t{p}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from engine.default_model import MANIFEST, verify
    from engine.loader import load_model

    path = resolve_model(args.model)
    model = load_model(path)
    cfg = model.config
    print(json.dumps({k: v for k, v in cfg.__dict__.items()}, indent=2, default=str))
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    print(f"parameters: {n_params:,}")
    state = model.state_dict()
    for name, t in list(state.items())[:12]:
        print(f"  {name:50s} {tuple(t.shape)} {t.dtype}")
    print(f"  ... {_tensor_count(state)}")
    if path.is_dir():
        for f in sorted(path.iterdir()):
            print(f"file {f.name:32s} {f.stat().st_size / 1e6:10.1f} MB")
    if args.verify and (path / MANIFEST).exists():
        bad = [n for n, ok in verify(path).items() if not ok]
        print("sha256: all files match the manifest" if not bad else f"sha256 MISMATCH: {bad}")
        return 1 if bad else 0
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from engine.loader import load_model, save_quantized_folder
    from engine.quant import weight_bytes
    from engine.tokenizer import Tokenizer

    path = resolve_model(args.model)
    out = Path(args.out).expanduser()
    tok = Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_folder(path)
    if args.format in ("gptq", "awq"):
        model = _quantize_layout(args, path, out, tok)
    else:
        model = load_model(path, weight_format=args.format, group_size=args.group_size or 32)
        save_quantized_folder(model, out)
    tok.save(out)
    print(f"{out}: {args.format} weights, {weight_bytes(model)['total'] / 1e6:.1f} MB resident "
          f"(run it with weight_format='native')")
    return 0


def _quantize_layout(args: argparse.Namespace, path: Path, out: Path, tok):
    """A GPTQ / AWQ folder (engine.gptq): the model loaded in fp32, its decoder linears quantized."""
    from engine.gptq import QuantSpec, quantize_to_folder
    from engine.loader import load_model

    model = load_model(path)
    dims = (model.config.hidden_size, model.config.intermediate_size)
    # 128 as GPTQ/AWQ default to, or the largest group that divides the model's widths (SmolLM2: 576 -> 64)
    group = args.group_size or max(g for g in (32, 64, 128) if all(d % g == 0 for d in dims))
    spec = QuantSpec(layout=args.format, method=args.method, bits=args.bits, group_size=group,
                     sym=args.format == "gptq" and not args.asym, act_order=args.act_order)
    text = Path(args.calib_file).expanduser().read_text() if args.calib_file else None
    quantize_to_folder(model, tok, spec, out, text, args.calib_samples, args.calib_len,
                       chat=not args.calib_plain, log=lambda m: print(m, file=sys.stderr))
    return model


def _tensor_count(state: dict) -> str:
    """Tensor count as loading reports it: a tied weight (lm_head = embedding) is one tensor."""
    unique = len({t.data_ptr() for t in state.values()})
    tied = len(state) - unique
    return f"{unique} tensors" + (f" ({tied} more name(s) tied to one of them)" if tied else "")


def _generate(args: argparse.Namespace) -> int:
    from engine.threads import configure

    configure(args.threads, verbose=True)  # before torch loads: OpenMP reads its environment once
    from engine.engine_config import EngineConfig
    from engine.errors import InvalidRequestError
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    if not args.prompt.strip():
        raise InvalidRequestError("prompt is empty")
    path = resolve_model(args.model)
    engine = LLMEngine.from_pretrained(path, EngineConfig(device="cpu", kv_cache_bytes=64 << 20))
    tok = engine.tokenizer
    prompt = args.prompt if args.raw else tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k if args.top_k > 0 else -1, seed=args.seed)
    engine.add_request("cli-0", prompt, params)
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            sys.stdout.write(completion.delta_text)
            sys.stdout.flush()
            n = len(completion.token_ids)
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0
