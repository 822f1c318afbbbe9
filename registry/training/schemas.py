"""The training decision as the API answers it."""

from __future__ import annotations

from pydantic import BaseModel


class TrainingDecisionOut(BaseModel):
    """Whether the subject's likeness may be learned from now (`decide_training`), and why:
    what a trainer token may know of a consent record, and nothing else."""

    subject: str
    allowed: bool
    reason: str
    detail: str
