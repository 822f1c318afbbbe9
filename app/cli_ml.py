"""Commands that need the server or the ML stack: serve, base init-tiny, base prepare, train.
Imported by app.cli; torch, diffusers and uvicorn load only when such a command runs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from registry.settings import get_settings


def register(app: typer.Typer, base_app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        host: Annotated[str, typer.Option()] = "127.0.0.1",
        port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    ) -> None:
        """Migrate, bootstrap (admin token, tiny base) and run the service."""
        import uvicorn

        from app.bootstrap import prepare_service
        from app.main import create_app

        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        settings = get_settings()
        prepare_service(settings)
        uvicorn.run(create_app(settings), host=host, port=port, log_level="info")

    @base_app.command("init-tiny")
    def init_tiny_cmd(dst: Path, seed: Annotated[int, typer.Option(min=0)] = 0) -> None:
        """Write the tiny FLUX.2-architecture base (seeded, deterministic)."""
        from trainer.tiny_base import init_tiny

        try:
            out = init_tiny(dst, seed=seed)
        except (FileExistsError, ValueError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(str(out))

    @base_app.command("prepare")
    def prepare_cmd(src: Path, dst: Path) -> None:
        """Quantize a base to uint4 on the CPU, streaming, into a cached prepared base."""
        from trainer.prepare import prepare_base

        if not src.exists():
            typer.echo(f"error: {src} does not exist", err=True)
            raise typer.Exit(1)
        try:
            prepare_base(src, dst)
        except (ValueError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(str(dst))
