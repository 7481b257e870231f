"""The multi-process pipeline: one stage per rank, compressed send/recv between stages."""

from .engine import Pipeline, StepOutput, prepare
from .schedule import stage_actions
from .transport import PeerTimeoutError

__all__ = ["PeerTimeoutError", "Pipeline", "StepOutput", "prepare", "stage_actions"]
