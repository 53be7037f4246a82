"""The ``cipherlm`` command line.

Each command group lives in its own ``server/cli_<group>.py`` exposing ``register(subparsers)``;
this module only assembles them, so adding a group is one line in ``_GROUPS``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

_GROUPS = (
    "server.cli_model",     # model pull/list/info, generate
    "server.cli_serve",     # serve
    "server.cli_audit",     # audit verify/report/export, signing keys
    "server.cli_fhe",       # fhe calibrate, plan-info
    "server.cli_demo",      # demo: plaintext vs encrypted tenant side by side
)


def plain_help(doc: str | None) -> str:
    """A module docstring as terminal help: reStructuredText/markdown marks (``x``, **x**) removed."""
    text = re.sub(r"``([^`]+)``", r"\1", doc or "")
    return re.sub(r"\*\*([^*]+)\*\*", r"\1", text)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def threads_arg(value: str) -> int | None:
    """argparse type of ``--threads``: ``auto`` -> None (the policy of engine.threads), else N >= 1."""
    from engine.threads import parse_threads

    try:
        return parse_threads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("expected 'auto' or a positive integer") from exc


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads`` (same meaning on every command that runs the model)."""
    parser.add_argument("--threads", type=threads_arg, default="auto", metavar="N|auto",
                        help="CPU threads for torch; auto: the physical cores not busy with other work, "
                             "or $CIPHERLM_THREADS / $OMP_NUM_THREADS when set (default: %(default)s)")


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
