"""A random-weight model folder in another model's shape, with that model's tokenizer files.

GPU benchmarks use random weights in real shapes (no hub access there; speed does not depend on the
values). ``--like`` names a folder with ``config.json`` and the tokenizer files (the default model's
by default); the new folder gets N(0, 0.02) weights (norms 1) saved as safetensors. ``--set key=value``
overrides config fields (a tiny model of the same architecture and tokenizer, so that a CPU engine steps
fast enough for the API process's own per-token cost to show, as in ``bench/serve_bench.py`` on the CPU).

    python bench/random_model.py --out /tmp/smol
    python bench/random_model.py --out /tmp/smol-tiny --set num_hidden_layers=1 hidden_size=64 \
        intermediate_size=128 num_attention_heads=2 num_key_value_heads=1 head_dim=32
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loader import save_hf_folder
from engine.model import LlamaForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", type=Path, help="folder with config.json + tokenizer files (default: the default model)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config fields to override (ints)")
    args = ap.parse_args()
    src = args.like
    if src is None:
        from engine.default_model import default_model_dir

        src = default_model_dir()
    torch.manual_seed(args.seed)
    config = ModelConfig.from_file(src / "config.json")
    config = dataclasses.replace(config, **{k: int(v) for k, v in (kv.split("=", 1) for kv in args.set)})
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    save_hf_folder(model, args.out)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, args.out / name)
    print(args.out)


if __name__ == "__main__":
    main()
