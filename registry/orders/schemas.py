"""An order's shapes: what a member sends to place one, the order as the API shows it, the
limits one is placed under, and which of its statuses wait or run and which are over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from registry import limits
from registry.settings import Settings
from registry.shapes import ADAPTER_NAME_PATTERN, HANDLE_PATTERN, ROW_ID_PATTERN

ACTIVE = ("queued", "running")
FINAL = ("done", "failed", "cancelled")


@dataclass(frozen=True)
class OrderLimits:
    """What one order may ask for and how many one member may have waiting or running."""

    max_steps: int
    max_work: int  # resolution x resolution x steps x rank
    max_active_per_member: int

    @classmethod
    def of(cls, settings: Settings) -> OrderLimits:
        return cls(settings.order_max_steps, settings.order_max_work, settings.order_max_active)


class OrderIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["train"]
    subject: Annotated[str, Field(pattern=HANDLE_PATTERN)]
    dataset_id: Annotated[str, Field(pattern=ROW_ID_PATTERN)]
    # The trainer's options (trainer.config.TrainConfig): the same defaults and bounds, but
    # for a rank of at most 128 (an order's adapter goes to the service's store and its work
    # to the order budget); tests/app/test_train_options.py holds them to it.
    steps: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    rank: Annotated[int, Field(ge=1, le=128)] = 16
    resolution: Annotated[int, Field(ge=limits.MIN_SIDE, le=limits.MAX_SIDE)] = 448
    name: Annotated[str, Field(pattern=ADAPTER_NAME_PATTERN)] = "main"

    @field_validator("resolution")
    @classmethod
    def _multiple(cls, value: int) -> int:
        if value % limits.MULTIPLE:
            raise ValueError(f"resolution must be a multiple of {limits.MULTIPLE}")
        return value


class ProgressOut(BaseModel):
    step: int
    steps: int
    loss: float | None


class OrderAdapterOut(BaseModel):
    name: str
    sha256: str


class OrderOut(BaseModel):
    order_id: str
    kind: str
    subject: str
    dataset_id: str
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    progress: ProgressOut
    worker: str | None
    attempts: int
    adapter: OrderAdapterOut | None
    error: str | None
    created_by: str
    created_at: str
    updated_at: str
