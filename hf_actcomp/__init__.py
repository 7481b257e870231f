"""hf-actcomp: communication-compressed pipeline training of Hugging Face decoder models."""

from typing import TYPE_CHECKING

from .boundary import NonFiniteError
from .codecs import available_codecs, make_codec, register_codec
from .data import add_sample_ids
from .inference import CompressedInference, compressed_inference
from .models import get_adapter, register_adapter, supported_model_types
from .pipeline import PeerTimeoutError, Pipeline, StepOutput, prepare
from .plan import Compression, MemoryConfig, Plan
from .simulate import SimulatedPipeline, simulate

if TYPE_CHECKING:
    from . import hub, trackers
    from .samples import LogSamplesCallback
    from .trainer.actcomp_trainer import ActCompTrainer
    from .trainer.dpo_trainer import ActCompDPOTrainer
    from .trainer.reward_trainer import ActCompRewardTrainer
    from .trainer.sft_trainer import ActCompSFTTrainer

from .version import __version__

__all__ = [
    "ActCompDPOTrainer",
    "ActCompRewardTrainer",
    "ActCompSFTTrainer",
    "ActCompTrainer",
    "CompressedInference",
    "LogSamplesCallback",
    "Compression",
    "MemoryConfig",
    "NonFiniteError",
    "PeerTimeoutError",
    "Pipeline",
    "Plan",
    "SimulatedPipeline",
    "StepOutput",
    "__version__",
    "add_sample_ids",
    "available_codecs",
    "compressed_inference",
    "get_adapter",
    "hub",
    "make_codec",
    "prepare",
    "register_adapter",
    "register_codec",
    "simulate",
    "supported_model_types",
    "trackers",
]


def __getattr__(name: str):
    """Import the Trainer integration and the Hub helpers on first use: worker processes that
    only run a pipeline do not pay for `transformers.Trainer`, `datasets` or the card renderer."""
    if name == "ActCompTrainer":
        from .trainer.actcomp_trainer import ActCompTrainer

        return ActCompTrainer
    if name == "ActCompSFTTrainer":  # needs TRL: `pip install 'hf-actcomp[trl]'`
        from .trainer.sft_trainer import ActCompSFTTrainer

        return ActCompSFTTrainer
    if name == "ActCompDPOTrainer":  # needs TRL too
        from .trainer.dpo_trainer import ActCompDPOTrainer

        return ActCompDPOTrainer
    if name == "ActCompRewardTrainer":  # needs TRL too
        from .trainer.reward_trainer import ActCompRewardTrainer

        return ActCompRewardTrainer
    if name == "LogSamplesCallback":
        from .samples import LogSamplesCallback

        return LogSamplesCallback
    if name in ("hub", "trackers"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
