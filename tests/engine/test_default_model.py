"""Concurrent pulls into one cache (issue 13, item 8): one lock, a staging folder per pull, atomic rename.

The real ``install_model`` runs in two processes; only the build step is a stand-in (the real one
downloads and dequantizes 93 MB, which proves nothing more about the race).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

from engine import default_model as dm


def _fake_build(staging: Path, tag: str, log: str) -> None:
    """Write a model folder slowly (the window in which the old code raced), manifest last."""
    with open(log, "a") as fh:
        fh.write(f"start {tag}\n")
    (staging / "model.safetensors").write_bytes(tag.encode() * 1000)
    time.sleep(1.0)
    (staging / "config.json").write_text(json.dumps({"tag": tag}))
    files = {p.name: dm.sha256_file(p) for p in staging.iterdir()}
    (staging / dm.MANIFEST).write_text(json.dumps({"files": files}))
    with open(log, "a") as fh:
        fh.write(f"end {tag}\n")


def _pull(folder: str, tag: str, log: str, force: bool, out) -> None:
    try:
        path = dm.install_model(Path(folder), lambda s: _fake_build(s, tag, log), force=force)
        out.put((tag, str(path), json.loads((path / "config.json").read_text())["tag"]))
    except BaseException as exc:  # report to the parent instead of dying silently
        out.put((tag, "error", repr(exc)))


def _run_two(folder: Path, log: Path, force: bool) -> list[tuple[str, str, str]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_pull, args=(str(folder), tag, str(log), force, out)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    return results


def test_two_concurrent_pulls_build_once(tmp_path):
    folder, log = tmp_path / "models" / "M", tmp_path / "log"
    results = _run_two(folder, log, force=False)
    assert all(r[1] == str(folder) for r in results), results
    lines = log.read_text().split()
    assert lines.count("start") == 1, lines  # the second pull waited for the lock and found the model
    assert dm.is_cached(folder) and all(dm.verify(folder).values())
    assert sorted(p.name for p in folder.parent.iterdir()) == [".M.lock", "M"]  # no staging left behind


def test_forced_pulls_never_interleave_and_leave_a_whole_folder(tmp_path):
    folder, log = tmp_path / "models" / "M", tmp_path / "log"
    _run_two(folder, log, force=False)
    log.write_text("")
    results = _run_two(folder, log, force=True)
    assert not any(r[1] == "error" for r in results), results
    lines = log.read_text().split("\n")[:-1]
    assert [x.split()[0] for x in lines] == ["start", "end", "start", "end"]  # one build at a time
    assert dm.is_cached(folder) and all(dm.verify(folder).values())
    assert sorted(p.name for p in folder.parent.iterdir()) == [".M.lock", "M"]


def test_failed_build_leaves_the_cache_alone(tmp_path):
    folder = tmp_path / "models" / "M"

    def broken(staging: Path) -> None:
        (staging / "half").write_bytes(b"x")
        raise RuntimeError("network down")

    try:
        dm.install_model(folder, broken)
    except RuntimeError:
        pass
    assert not folder.exists()
    assert [p.name for p in folder.parent.iterdir()] == [".M.lock"]
