"""A ``CIPHERLM_HOME`` with a SmolLM2-shaped model of random weights, and the shipped plan re-stamped for it.

For the private end-to-end benchmark on the GPU machine (``bench/private_e2e.py --device cuda``): nothing
there reaches the package registry, so the default model cannot be pulled, and its 541 MB fp32 copy is over
what a device call carries. Speed does not depend on the weights' values (docs/design.md §2), so the server
and the SDK run on random weights in the real shapes, with the real tokenizer (a few MB, carried).

The shipped plan names the real weights by SHA-256 (``Plan.check_model``); the copy written here is the
same plan (layers, CKKS parameters, score maps) with the random model's fingerprint. Its calibration was
fitted to the real model, so the random model's texts mean nothing: only times and bytes are measured.
Weights are drawn as Hugging Face's Llama initialiser does (normal, std 0.02; norm gains 1), which keeps
the attention scores far inside the calibrated range the approximation assumes.

    python bench/gpu_e2e_home.py --tokenizer .carry/gpufhe/tok --home /tmp/home
    CIPHERLM_HOME=/tmp/home python bench/private_e2e.py --device cuda --plan /tmp/home/plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def random_model(config: Path, seed: int):
    """A LlamaForCausalLM of ``config``'s shape, weights N(0, 0.02) (norm gains stay 1)."""
    from engine.config import ModelConfig
    from engine.model import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_file(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.02)
    return model


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_home(tokenizer: Path, home: Path, seed: int) -> Path:
    """The default model's folder under ``home`` (config, random safetensors, tokenizer, manifest)."""
    from engine.default_model import DEFAULT_MODEL_NAME, MANIFEST
    from engine.loader import save_hf_folder

    folder = home / "models" / DEFAULT_MODEL_NAME
    files = save_hf_folder(random_model(tokenizer / "config.json", seed), folder)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            files.append(Path(shutil.copy(tokenizer / name, folder / name)))
    manifest = {"name": DEFAULT_MODEL_NAME, "source": f"random weights, seed {seed} (bench/gpu_e2e_home.py)",
                "files": {p.name: _sha256(p) for p in files}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))   # last: is_cached() looks for it
    return folder


def restamped_plan(folder: Path, out: Path) -> Path:
    """The shipped plan with the weights fingerprint of the model in ``folder``."""
    from engine.loader import load_model
    from fhe.plan import Plan, model_fingerprint
    from server.private.feature import default_plan_path

    plan = Plan.load(default_plan_path())
    stamped = dataclasses.replace(plan, weights_sha256=model_fingerprint(load_model(folder)),
                                  created_by=f"{plan.created_by}; re-stamped for random weights "
                                             "(bench/gpu_e2e_home.py)")
    return stamped.save(out)


def main(argv: list[str] | None = None) -> int:
    """Write the home and the plan; print their paths."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True,
                    help="folder with the default model's config.json and tokenizer files")
    ap.add_argument("--home", type=Path, required=True, help="the CIPHERLM_HOME to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    folder = write_home(args.tokenizer, args.home, args.seed)
    plan = restamped_plan(folder, args.home / "plan.json")
    print(json.dumps({"model": str(folder), "plan": str(plan)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
