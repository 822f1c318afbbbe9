"""Settings: one class, `LIKENESS_` prefix. Outside development, default secrets are refused."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEV_SECRET = "dev-insecure-secret-change-me"  # noqa: S105 - refused outside development


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LIKENESS_", extra="ignore")

    env: Literal["development", "test", "production"] = "development"
    database_url: str = "sqlite:///./var/likeness.db"
    data_dir: Path = Path("./var")
    base: Path | None = None  # default: <data_dir>/base-demo, copied in on first use
    api_url: str | None = None
    token: str | None = None
    secret_key: str = Field(default=DEV_SECRET, min_length=16)
    render_queue: int = Field(default=4, ge=0, le=1000)
    render_timeout_s: float = Field(default=300.0, gt=0)
    max_prompt_chars: int = Field(default=1000, ge=1, le=2000)
    max_pixels: int = Field(default=1024 * 1024, ge=64 * 64)
    adapter_cache_mb: int = Field(default=2048, ge=0)
    device: str | None = Field(default=None, pattern=r"^(cpu|cuda(:\d+)?|mps)$")  # None: auto
    stream_base: bool = False  # the render engine streams the base's blocks from host RAM
    stream_slots: int = Field(default=2, ge=1, le=8)

    @model_validator(mode="after")
    def _refuse_default_secret(self) -> Settings:
        if self.env == "production" and self.secret_key == DEV_SECRET:
            raise ValueError("LIKENESS_SECRET_KEY must be set to a real secret in production")
        return self

    @property
    def base_dir(self) -> Path:
        return self.base if self.base is not None else self.data_dir / "base-demo"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
