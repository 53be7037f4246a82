"""Streaming detokenization per token: tokenizers' native DecodeStream vs the prefix/read window over
transformers' decode (engine.tokenizer.IncrementalDetokenizer's two paths), same tokens, same run.

The engine core detokenizes every sampled token of every request (engine.output_processor), so at tens of
thousands of tokens per second this is host time per step. Both paths must give the same pieces; the script
checks that before it times them.

    python bench/detok_cpu.py [--repeats 7] [--text README.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    args = ap.parse_args(argv)

    from engine.default_model import default_model_dir
    from engine.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = Tokenizer.from_folder(default_model_dir())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Summarize this file."}])
    gen = tok.encode(args.text.read_text(), add_special_tokens=False)

    def run(native: bool) -> tuple[list[str], float]:
        detok = IncrementalDetokenizer(tok, prompt, True, native=native)
        t = time.perf_counter()
        pieces = [detok.step([i]) for i in gen]
        return pieces, (time.perf_counter() - t) / len(gen) * 1e6

    assert run(True)[0] == run(False)[0], "the two paths streamed different pieces"
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):                 # interleaved, so both see the same state of the box
        for native in (False, True):
            times[native].append(run(native)[1])
    window, native = statistics.median(times[False]), statistics.median(times[True])
    print(f"{len(gen)} tokens of {args.text.name}, {args.repeats} interleaved repeats, median µs per token")
    print(f"window over transformers' decode: {window:.2f} (spread {min(times[False]):.2f}-{max(times[False]):.2f})")
    print(f"native DecodeStream:              {native:.2f} (spread {min(times[True]):.2f}-{max(times[True]):.2f})")
    print(f"ratio window / native:            {window / native:.1f}x (pieces identical)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
