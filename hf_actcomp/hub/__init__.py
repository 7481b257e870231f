"""Everything a save writes next to a trained model (`save_run`), and pushing the folder to the Hub.

Every save of a trained model (pipeline `save_pretrained`, `ActCompTrainer.save_model` and its
checkpoints, the recipes) writes, beside the weights and `actcomp_config.json`:

    actcomp_results.json   what the run measured: bytes per boundary, errors, seconds, eval losses
    training_curves.png    training / eval loss and bytes per step per boundary (when logged)
    README.md              the model card, rendered from `model_cards/` with huggingface_hub

Each file has its own module (`run_results`, `curves`, `card`); this one joins them for a save
and is the public entry point (`hf_actcomp.hub.*` re-exports their names). `hf-actcomp card DIR`
re-renders the card from those files. Uploads go through `huggingface_hub.HfApi` (create_repo +
upload_folder): token, endpoint and offline mode come from the usual places (`HF_TOKEN`,
`huggingface-cli login`, `HF_ENDPOINT`, `HF_HUB_OFFLINE`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from huggingface_hub import HfApi
from huggingface_hub import constants as hub_constants

from ..plan import CONFIG_NAME
from ..state.run_results import RESULTS_NAME, load_results, save_results, update_results
from .card import CARD_NAME, TEMPLATE_NAME, model_card, write_model_card
from .curves import CURVES_NAME, plot_curves
from .methods import plan_compressions

__all__ = [
    "CARD_NAME",
    "CURVES_NAME",
    "RESULTS_NAME",
    "TEMPLATE_NAME",
    "hub_constants",
    "load_results",
    "model_card",
    "plan_compressions",
    "plot_curves",
    "push_to_hub",
    "save_results",
    "save_run",
    "update_results",
    "write_model_card",
]

logger = logging.getLogger(__name__)


def save_run(directory: str | os.PathLike, *, stats: dict | None = None, metrics: dict | None = None,
             log_history: list[dict] | None = None, **extra: Any) -> None:
    """Results, curves and card of a run whose model and plan are already in `directory`."""
    save_results(directory, stats=stats, metrics=metrics, log_history=log_history, **extra)
    if log_history:
        plot_curves(directory, log_history)
    write_model_card(directory)


def push_to_hub(directory: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                token: str | bool | None = None, commit_message: str = "Upload model trained with hf-actcomp",
                revision: str | None = None) -> Any:
    """Create `repo_id` if needed and upload `directory` (card re-rendered with the repo id).

    Fails at once, with the reason, when the Hub is switched off (`HF_HUB_OFFLINE=1`)."""
    if hub_constants.HF_HUB_OFFLINE:
        raise RuntimeError(
            f"Cannot push {directory!s} to {repo_id!r}: HF_HUB_OFFLINE is set. Unset it (and log in with "
            "`hf auth login` or HF_TOKEN) to upload; the folder is complete and can be pushed later with "
            "hf_actcomp.hub.push_to_hub(dir, repo_id)."
        )
    if os.path.isfile(os.path.join(directory, CONFIG_NAME)):
        write_model_card(directory, repo_id=repo_id)
    api = HfApi()
    url = api.create_repo(repo_id, token=token, private=private, exist_ok=True)
    return api.upload_folder(repo_id=url.repo_id, folder_path=os.fspath(directory), commit_message=commit_message,
                             token=token, revision=revision)

