"""The `hf-actcomp` command: inspect a saved run, estimate a plan's traffic, re-render a card.

    hf-actcomp inspect DIR
    hf-actcomp estimate --model NAME_OR_CONFIG --plan plan.yaml --batch-size 8 --seq-len 1024 --link 100mbit
    hf-actcomp card DIR

Each subcommand is one module here that registers its own parser (`inspect.py`, `estimate.py`,
`card.py`); `formatting.py` prints byte counts the same way for all of them.
"""

from __future__ import annotations

import argparse
import sys

from . import card, estimate, inspect

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv); 2 on a missing file or a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"hf-actcomp {args.command}: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The command and its subcommands, each registered by the module that runs it."""
    parser = argparse.ArgumentParser(prog="hf-actcomp", description=__doc__.split("\n\nEach subcommand")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (inspect, estimate, card):
        command.add_parser(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
