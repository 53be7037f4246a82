"""The ``cipherlm`` command line.

Each command group lives in its own ``server/cli_<group>.py`` exposing ``register(subparsers)``;
this module only assembles them, so adding a group is one line in ``_GROUPS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_GROUPS = (
    "server.cli_model",     # model pull/list/info, generate
    "server.cli_serve",     # serve
    "server.cli_audit",     # audit verify/report/export, signing keys
    "server.cli_fhe",       # fhe calibrate, plan-info
    "server.cli_demo",      # demo: plaintext vs encrypted tenant side by side
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every group registered)."""
    parser = argparse.ArgumentParser(prog="cipherlm", description="Privacy-preserving LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _GROUPS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    from engine.errors import EngineError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EngineError as exc:
        print(f"cipherlm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
