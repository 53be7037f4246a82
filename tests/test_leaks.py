"""The leak scanner the end-to-end tests rely on (tests/leaks.py) finds what plain ``in`` finds."""

from __future__ import annotations

import random

from tests.leaks import found


def _brute(needles: dict[str, bytes], hay: bytes) -> list[str]:
    return [name for name, n in needles.items() if n in hay]


def test_planted_needles_are_found_at_every_alignment_and_at_both_ends():
    rng = random.Random(0)
    secret = rng.randbytes(4096)
    needles = {f"w{k}": secret[500 * k:500 * k + 32] for k in range(8)}
    needles["short"] = b"Paris"
    base = rng.randbytes(10_000) + bytes(10_000)        # random bytes, then zeros (residue-like structure)
    for p in [0, 1, 7, 8, 9, 15, 10_003, 19_968 - 32 + 5]:
        for name in ("w0", "w3"):
            n = needles[name]
            hay = base[:p] + n + base[p + len(n):]
            assert len(hay) == len(base)
            assert name in found(needles, hay), (p, name)
    end = base[:-32] + needles["w7"]                    # flush with the end, an unaligned length
    assert found(needles, end[:-3]) == _brute(needles, end[:-3]) == []
    assert "w7" in found(needles, end)
    assert found(needles, base) == []
    assert found(needles, base + b"..Paris..") == ["short"]


def test_agrees_with_plain_search_on_random_haystacks():
    rng = random.Random(1)
    alphabet = b"\x00\x01ab"                             # a small alphabet: many partial matches
    for trial in range(200):
        needles = {f"n{i}": bytes(rng.choice(alphabet) for _ in range(rng.choice([3, 14, 15, 16, 23])))
                   for i in range(6)}
        hay = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 400)))
        if trial % 3 == 0 and hay:                       # plant one
            n = needles["n0"]
            p = rng.randrange(0, len(hay) + 1)
            hay = hay[:p] + n + hay[p:]
        assert found(needles, hay) == _brute(needles, hay), (needles, hay)
    assert found({"m": b"x" * 20}, memoryview(b"y" + b"x" * 20)) == ["m"]
