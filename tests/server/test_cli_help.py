"""The command line's help (issue 13, item 10): fast (no torch), defaults shown, no raw markup."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors import safe_open

from server.cli import build_parser


def _help(*argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--help"])
    assert exc.value.code == 0
    return ""


def test_help_does_not_import_torch():
    """`cipherlm --help` took ~4 s because `import engine` imported torch; the CLI needs none of it."""
    code = ("import json, sys; from server.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(json.dumps([m for m in ('torch', 'transformers', 'fastapi', 'tenseal') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_generate_help_shows_defaults(capsys):
    _help("generate")
    text = capsys.readouterr().out
    for shown in ("(default: 128)", "(default: 0.0)", "(default: 1.0)", "(default: auto)"):
        assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_long_help_has_no_raw_markup(command, capsys):
    _help(command)
    text = capsys.readouterr().out
    assert "``" not in text and "**" not in text and "--threads" in text


def test_model_info_counts_tensors_as_loading_does(tmp_path):
    from engine.loader import load_model
    from server.cli_model import _tensor_count
    from tests.server.app_helpers import build_tiny_model_dir

    folder = build_tiny_model_dir(tmp_path / "tiny")
    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        stored = len(list(fh.keys()))
    model = load_model(folder)
    assert model.config.tie_word_embeddings
    assert _tensor_count(model.state_dict()).startswith(f"{stored} tensors")
