"""``cipherlm model pull|list|info`` and ``cipherlm generate``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the model commands and ``generate``."""
    model = sub.add_parser("model", help="manage the cached models")
    msub = model.add_subparsers(dest="model_command", required=True)
    pull = msub.add_parser("pull", help="download and cache the default model (SmolLM2-135M-Instruct)")
    pull.add_argument("--force", action="store_true", help="pull again even if cached")
    pull.set_defaults(func=_pull)
    msub.add_parser("list", help="list cached models").set_defaults(func=_list)
    info = msub.add_parser("info", help="shapes and sizes of a model")
    info.add_argument("model", nargs="?", default="default", help="'default', a model folder or a .gguf")
    info.add_argument("--verify", action="store_true", help="re-hash cached files against the manifest")
    info.set_defaults(func=_info)

    gen = sub.add_parser("generate", help="generate text on the CPU (streams to the terminal)")
    gen.add_argument("prompt", help="the user message (rendered with the model's chat template)")
    gen.add_argument("--model", default="default", help="'default', a model folder or a .gguf file")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as text")
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
    from engine.default_model import pull

    print(pull(force=args.force))
    return 0


def _list(args: argparse.Namespace) -> int:
    from engine.default_model import MANIFEST, models_dir

    root = models_dir()
    folders = sorted(p for p in root.glob("*") if (p / MANIFEST).exists()) if root.exists() else []
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
    for name, t in list(model.state_dict().items())[:12]:
        print(f"  {name:50s} {tuple(t.shape)} {t.dtype}")
    print(f"  ... {len(model.state_dict())} tensors")
    if path.is_dir():
        for f in sorted(path.iterdir()):
            print(f"file {f.name:32s} {f.stat().st_size / 1e6:10.1f} MB")
    if args.verify and (path / MANIFEST).exists():
        bad = [n for n, ok in verify(path).items() if not ok]
        print("sha256: all files match the manifest" if not bad else f"sha256 MISMATCH: {bad}")
        return 1 if bad else 0
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from engine.loader import load_model
    from engine.model import DenseKVCache
    from engine.tokenizer import Tokenizer

    path = resolve_model(args.model)
    model = load_model(path)
    tok = Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_folder(path)
    ids = tok.encode(args.prompt) if args.raw else tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    gen = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    stop = set(model.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    detok = tok.detokenizer(ids)
    cache = DenseKVCache(model.config, len(ids) + args.max_tokens)
    t0, n = time.perf_counter(), 0
    with torch.inference_mode():
        x, pos = torch.tensor(ids), torch.arange(len(ids))
        for n in range(1, args.max_tokens + 1):
            logits = model.logits(model(x, pos, cache)[-1:])[0]
            cache.advance()
            nxt = _sample(logits, args, gen)
            if nxt in stop:
                break
            sys.stdout.write(detok.step([nxt]))
            sys.stdout.flush()
            x, pos = torch.tensor([nxt]), torch.tensor([cache.length])
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def _sample(logits, args: argparse.Namespace, gen) -> int:
    """Greedy at temperature 0, else temperature + top-k + top-p sampling."""
    import torch

    if args.temperature <= 0:
        return int(logits.argmax())
    logits = logits / args.temperature
    if args.top_k > 0:
        kth = torch.topk(logits, min(args.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if args.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        drop = sp.cumsum(0) - sp > args.top_p
        probs = torch.zeros_like(probs).scatter(0, si, sp.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=gen))
