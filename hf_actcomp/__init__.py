"""hf-actcomp: communication-compressed pipeline training of Hugging Face decoder models."""

from . import hub, trackers
from .codecs import available_codecs, make_codec
from .data import add_sample_ids
from .inference import CompressedInference, compressed_inference
from .models import get_adapter, register_adapter, supported_model_types
from .pipeline import PeerTimeoutError, Pipeline, StepOutput, prepare
from .plan import Compression, MemoryConfig, Plan
from .simulate import SimulatedPipeline, simulate
from .trainer import ActCompTrainer

__version__ = "0.1.0"

__all__ = [
    "ActCompTrainer",
    "CompressedInference",
    "Compression",
    "MemoryConfig",
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
    "simulate",
    "supported_model_types",
    "trackers",
]
