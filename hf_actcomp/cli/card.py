"""`hf-actcomp card DIR`: render a saved run's model card again and write DIR/README.md.

For a card written before its results were complete, or to name the Hub repo, base model and
data sets that the snippets and metadata should show.
"""

from __future__ import annotations

import argparse
import os

from ..hub.card import CARD_NAME, write_model_card


def add_parser(sub: argparse._SubParsersAction) -> None:  # argparse's only name for the type
    """Register `card` on the command's subparsers."""
    p = sub.add_parser("card", help="re-render README.md (the model card) from a run's saved results",
                       description="Render the model card of DIR again from actcomp_config.json, "
                                   "actcomp_results.json and the model's config, and write DIR/README.md.")
    p.add_argument("directory")
    p.add_argument("--repo-id", default=None, help="the Hub repo the card will live in (used in the snippets)")
    p.add_argument("--base-model", default=None, help="the Hub model it was fine-tuned from")
    p.add_argument("--dataset", action="append", default=None, help="a Hub dataset it was trained on (repeatable)")
    p.set_defaults(run=card_command)


def card_command(args: argparse.Namespace) -> int:
    """Re-render and write DIR/README.md, then say where and with which tags."""
    card = write_model_card(args.directory, repo_id=args.repo_id, base_model=args.base_model,
                            datasets=args.dataset)
    print(f"wrote {os.path.join(args.directory, CARD_NAME)} ({len(card.text.splitlines())} lines; tags: "
          f"{', '.join(card.data.tags or [])})")
    return 0
