"""The `hf-actcomp` command: inspect a saved run, estimate a plan's traffic, re-render a card.

    hf-actcomp inspect DIR
    hf-actcomp estimate --model NAME_OR_CONFIG --plan plan.yaml --batch-size 8 --seq-len 1024 --link 100mbit
    hf-actcomp card DIR
"""

from __future__ import annotations

import argparse
import sys

from . import cli_card, cli_estimate, cli_inspect
from .cli_card import card_command
from .cli_estimate import (
    auto_estimate_command,
    estimate_command,
    load_config,
    load_plan_file,
    parse_link,
    per_boundary,
)
from .cli_inspect import describe_rank_state, inspect_command
from .plan_estimate import (
    auto_estimate,
    diloco_estimate,
    estimate,
    first_visit_label,
    stage_parameter_counts,
)

__all__ = [
    "auto_estimate",
    "auto_estimate_command",
    "build_parser",
    "card_command",
    "describe_rank_state",
    "diloco_estimate",
    "estimate",
    "estimate_command",
    "first_visit_label",
    "inspect_command",
    "load_config",
    "load_plan_file",
    "main",
    "parse_link",
    "per_boundary",
    "stage_parameter_counts",
]


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
    parser = argparse.ArgumentParser(prog="hf-actcomp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (cli_inspect, cli_estimate, cli_card):
        command.add_parser(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
