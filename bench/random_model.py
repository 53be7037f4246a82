"""A random-weight model folder in another model's shape, with that model's tokenizer files.

GPU benchmarks use random weights in real shapes (no hub access there; speed does not depend on the
values). ``--like`` names a folder with ``config.json`` and the tokenizer files (the default model's
by default); the new folder gets N(0, 0.02) weights (norms 1) saved as safetensors.

    python bench/random_model.py --out /tmp/smol
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    src = args.like
    if src is None:
        from engine.default_model import default_model_dir

        src = default_model_dir()
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(ModelConfig.from_file(src / "config.json"))
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
