"""Defaults and facts the docs state, checked against the code (issue 13, item 6; item 7)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def _text(name: str) -> str:
    return (ROOT / name).read_text()


def test_key_lifetime_default_matches_the_settings():
    from server.private.config import PrivateSettings

    days = PrivateSettings().key_lifetime_s / 86400
    compliance = _text("docs/compliance.md")
    stated = re.findall(r"[Dd]efault lifetime on a server: (\d+) days \(`\[private\] key_lifetime_s`", compliance)
    table = re.findall(r"`expires_at` \(default (\d+) days: `\[private\] key_lifetime_s`\)", compliance)
    assert stated and table, "compliance.md no longer states the key lifetime where this test looks"
    assert {float(d) for d in stated + table} == {days}
    # the one other lifetime it names is the library default, said to be one
    assert compliance.count("90 days") == 1 and "90 days (`RegistryConfig.default_lifetime_s`)" in compliance


def _private_toml_block() -> list[tuple[str, str, str]]:
    """(key, value, comment) of each line of the operator guide's ``[private]`` example."""
    guide = _text("docs/operator-guide.md")
    block = re.search(r"```toml\n\[private\]\n(.*?)```", guide, re.S)
    assert block, "operator-guide.md has no [private] example"
    rows = []
    for line in block.group(1).splitlines():
        m = re.match(r"(\w+) = (\S+)\s*(?:#\s*(.*))?$", line)
        if m:
            rows.append((m.group(1), m.group(2), m.group(3) or ""))
    return rows


def test_operator_guide_private_example_shows_the_defaults():
    """Every line of the example that does not say 'default: ...' shows the default itself."""
    from server.private.config import PrivateSettings

    defaults = PrivateSettings()
    rows = [r for r in _private_toml_block() if "default" not in r[2]]
    assert len(rows) >= 8
    for key, value, _ in rows:
        assert json.loads(value) == getattr(defaults, key), key  # the values are JSON-compatible TOML


def test_publish_key_is_always_shown_with_its_key_dir():
    """`cipherlm audit publish-key` requires --key-dir; a hint without it fails when copied."""
    from server.private import feature

    sources = [p.read_text() for p in DOCS] + [Path(feature.__file__).read_text()]
    for text in sources:
        for m in re.finditer(r"cipherlm audit publish-key[^`\n]*", text):
            assert "--key-dir" in m.group(0), m.group(0)


def test_sdk_doc_names_public_exceptions():
    import client_sdk

    sdk = _text("docs/sdk.md")
    for name in re.findall(r"\| `client_sdk\.([A-Za-z_.]+)` \|", sdk):
        assert name in client_sdk.__all__, f"docs/sdk.md points to a non-public {name}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_stand_alone(doc):
    """The repository carries its own design: no link or path outside it."""
    text = doc.read_text()
    assert "../shared" not in text and "/work/" not in text and "](../" not in text
    assert "DESIGN.md" not in text
