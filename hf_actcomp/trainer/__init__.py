"""The Trainer integration: `transformers.Trainer` and TRL's trainers with the model run as a plan's
compressed pipeline stages. `actcomp_trainer.py` is `ActCompTrainer`; each TRL trainer has its own
`<name>_trainer.py` beside it (`sft_trainer.py`: `ActCompSFTTrainer`, `reward_trainer.py`:
`ActCompRewardTrainer`, `dpo_trainer.py`: `ActCompDPOTrainer`; they need `pip install 'hf-actcomp[trl]'`). What they share: `backends.py` runs a batch through the stages (in
this process, or one stage per rank), `evaluation.py` feeds Trainer's own evaluation loop,
`checks.py` refuses what cannot work before any work starts, and `launch_env.py` reads what the
launcher started. Import the trainers from the top level: `hf_actcomp.ActCompTrainer`.
"""

from .actcomp_trainer import ActCompTrainer

__all__ = ["ActCompDPOTrainer", "ActCompRewardTrainer", "ActCompSFTTrainer", "ActCompTrainer"]


def __getattr__(name: str):
    """The TRL trainers on first use: they import TRL, an optional dependency."""
    if name == "ActCompSFTTrainer":
        from .sft_trainer import ActCompSFTTrainer

        return ActCompSFTTrainer
    if name == "ActCompRewardTrainer":
        from .reward_trainer import ActCompRewardTrainer

        return ActCompRewardTrainer
    if name == "ActCompDPOTrainer":
        from .dpo_trainer import ActCompDPOTrainer

        return ActCompDPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
