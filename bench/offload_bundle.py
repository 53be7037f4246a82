"""Client bundle bytes of the offload plan (fp32 and lossless Q4_1/Q8_0) vs the older partial plan's.

    python bench/offload_bundle.py
"""

from __future__ import annotations

import datetime
import tempfile
from pathlib import Path

from engine.default_model import default_model_dir
from engine.loader import load_model
from fhe.bundle import write_bundle, write_offload_bundle
from fhe.offload import cost_report, offload_plan
from fhe.plan import load_default_plan


def main() -> None:
    folder = default_model_dir()
    model = load_model(folder)
    plan = offload_plan(model.config, "SmolLM2-135M-Instruct", softmax="client")
    old = load_default_plan()
    r = cost_report(plan)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        write_bundle(model, folder, old.layer_indices, old.content_hash, Path(tmp) / "old.safetensors")
        rows.append(("partial plan (attention 2-5 withheld), fp32", Path(tmp) / "old.safetensors", None))
        for q in (False, True):
            p = Path(tmp) / f"off{int(q)}.safetensors"
            info = write_offload_bundle(model, folder, plan, p, quantize=q)
            rows.append((f"offload plan (layers 2-29 withheld), {'Q4_1/Q8_0' if q else 'fp32'}", p, info))
        print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; client parameters "
              f"{r.client_params / 1e6:.2f} M of {(r.client_params + r.server_params) / 1e6:.2f} M "
              f"({100 * r.client_param_share:.1f} %)")
        print("| bundle | bytes | quantized tensors |")
        print("|---|---|---|")
        for label, p, info in rows:
            nq = "-" if info is None else f"{len(info['quantized'])} of {len(info['tensors'])}"
            print(f"| {label} | {p.stat().st_size / 1e6:.1f} MB | {nq} |")


if __name__ == "__main__":
    main()
