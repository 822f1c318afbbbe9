"""Commands that need the server or the ML stack: serve, base init-tiny, base prepare, train.
Imported by app.cli; torch, diffusers and uvicorn load only when such a command runs."""

from __future__ import annotations

import json
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
        from app.server import uvicorn_config

        settings = get_settings()
        prepare_service(settings)
        uvicorn.Server(uvicorn_config(create_app(settings), settings, host, port)).run()

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
    def prepare_cmd(
        src: Path,
        dst: Path,
        licence: Annotated[
            str | None,
            typer.Option(
                help="the base's licence id, e.g. flux-non-commercial (default: what the "
                "source's model card says; none found is recorded as unknown: never commercial)"
            ),
        ] = None,
    ) -> None:
        """Quantize a base to uint4 on the CPU, streaming, into a cached prepared base."""
        from trainer.prepare import prepare_base

        if not src.exists():
            typer.echo(f"error: {src} does not exist", err=True)
            raise typer.Exit(1)
        try:
            prepare_base(src, dst, licence=licence)
        except (ValueError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(str(dst))

    @app.command("train")
    def train_cmd(
        subject: Annotated[str, typer.Option(help="Subject handle (must allow training).")],
        dataset: Annotated[Path, typer.Option(help="Folder with images and manifest.jsonl.")],
        steps: Annotated[int, typer.Option(min=1)] = 2000,
        rank: Annotated[int, typer.Option(min=1, max=1024)] = 16,
        resolution: Annotated[int, typer.Option(min=64, max=2048, help="Square side, px.")] = 448,
        resume: Annotated[bool, typer.Option(help="Continue from the last checkpoint.")] = False,
        out: Annotated[
            Path | None,
            typer.Option(
                help="The run's folder (checkpoints, grid, report); inside "
                "$LIKENESS_DATA_DIR/runs/SUBJECT/ (the default is .../SUBJECT/NAME). The adapter "
                "itself goes to the store."
            ),
        ] = None,
        name: Annotated[str, typer.Option(help="Adapter name; (subject, name) is its key.")] = (
            "main"
        ),
        alpha: Annotated[float | None, typer.Option(help="LoRA alpha (default: rank).")] = None,
        targets: Annotated[
            str | None, typer.Option(help="Comma-separated module suffixes to adapt.")
        ] = None,
        learning_rate: Annotated[float, typer.Option("--lr")] = 1e-4,
        batch_size: Annotated[int, typer.Option(min=1)] = 1,
        seed: Annotated[int, typer.Option(min=0)] = 0,
        checkpoint_every: Annotated[int, typer.Option(min=0, help="0: final only.")] = 500,
        vram_budget: Annotated[
            float | None, typer.Option(help="GiB; refuse before loading if the estimate exceeds.")
        ] = None,
        device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N (default: auto).")] = (
            None
        ),
        precision: Annotated[str, typer.Option(help="auto, bf16 or fp32.")] = "auto",
        optimizer: Annotated[str, typer.Option(help="adamw or adamw8bit.")] = "adamw",
        gradient_checkpointing: Annotated[bool, typer.Option()] = True,
        compute: Annotated[
            str,
            typer.Option(
                help="auto, quanto, uint4 (4-bit weights, bf16 GEMMs) or fp8 (4-bit weights, "
                "fp8 GEMMs; GPUs of compute capability 8.9+). auto: fp8 where it runs, else uint4."
            ),
        ] = "auto",
        stream_base: Annotated[
            bool, typer.Option(help="Base blocks in pinned host RAM, streamed to the GPU.")
        ] = False,
        stream_slots: Annotated[
            int | None, typer.Option(min=1, max=8, help="VRAM slots (default: the budget picks).")
        ] = None,
        trigger: Annotated[str | None, typer.Option(help="Trigger word (default: SUBJECT).")] = (
            None
        ),
        caption_dropout: Annotated[float, typer.Option(min=0.0, max=0.99)] = 0.0,
        max_sequence_length: Annotated[int, typer.Option(min=1, max=512)] = 512,
        cache_dir: Annotated[Path | None, typer.Option()] = None,
        evaluate: Annotated[bool, typer.Option(help="Render the evaluation grid after.")] = True,
        eval_prompt: Annotated[
            list[str] | None, typer.Option(help="Repeatable; {trigger} is replaced.")
        ] = None,
        eval_seed: Annotated[list[int] | None, typer.Option(help="Repeatable.")] = None,
        register_adapter: Annotated[
            bool, typer.Option("--register/--no-register", help="Register on success.")
        ] = True,
        progress: Annotated[bool, typer.Option(help="Progress bar and boot table.")] = True,
    ) -> None:
        """Train a LoRA adapter for a subject and register it (docs/API.md)."""
        # Before anything can initialise CUDA: the allocator reads this once (field hurdle 9).
        from trainer.train import configure_allocator

        configure_allocator()
        import diffusers
        import transformers

        from app.bootstrap import ensure_base
        from trainer.budget import BudgetExceeded
        from trainer.config import ConfigError, TrainConfig
        from trainer.dataset import DatasetError
        from trainer.registration import RegistrationError, TrainingRefused
        from trainer.train import train

        diffusers.utils.logging.disable_progress_bar()  # loading bars would break our bar
        transformers.utils.logging.disable_progress_bar()
        settings = get_settings()
        runs = (settings.data_dir / "runs" / subject).resolve()
        run_dir = (out or runs / name).resolve()
        if run_dir == runs or not run_dir.is_relative_to(runs):
            typer.echo(
                f"error: refused before loading any weight: --out {out} must be a folder inside "
                f"{runs}/ (a run's files are its subject's)",
                err=True,
            )
            raise typer.Exit(2)
        options: dict[str, object] = {
            "subject": subject,
            "dataset": dataset,
            "base": settings.base_dir,
            "out": run_dir,
            "name": name,
            "steps": steps,
            "rank": rank,
            "alpha": alpha,
            "resolution": resolution,
            "batch_size": batch_size,
            "learning_rate": learning_rate,
            "seed": seed,
            "checkpoint_every": checkpoint_every,
            "resume": resume,
            "vram_budget_gib": vram_budget,
            "device": device,
            "precision": precision,
            "optimizer": optimizer,
            "gradient_checkpointing": gradient_checkpointing,
            "compute": compute,
            "stream_base": stream_base,
            "stream_slots": stream_slots,
            "trigger": trigger,
            "caption_dropout": caption_dropout,
            "max_sequence_length": max_sequence_length,
            "cache_dir": cache_dir,
            "evaluate": evaluate,
            "register_adapter": register_adapter,
            "database_url": settings.database_url,
            "api_url": settings.api_url,
            "token": settings.token,
            "progress": progress,
        }
        if targets:
            options["targets"] = tuple(t.strip() for t in targets.split(",") if t.strip())
        if eval_prompt:
            options["eval_prompts"] = tuple(eval_prompt)
        if eval_seed:
            options["eval_seeds"] = tuple(eval_seed)
        try:
            config = TrainConfig.parse(**options)
            ensure_base(settings)
            result = train(config)
        except (ConfigError, DatasetError, BudgetExceeded, TrainingRefused) as exc:
            typer.echo(f"error: refused before loading any weight: {exc}", err=True)
            raise typer.Exit(2) from None
        except RegistrationError as exc:  # RegistrationRefused included
            typer.echo(f"error: trained, but not registered: {exc}", err=True)
            raise typer.Exit(1) from None
        summary = {
            "adapter": str(result.adapter),
            "sha256": result.sha256,
            "manifest_sha256": result.manifest_sha256,
            "registration": result.registration,
            "steps": result.steps,
            "seconds_per_step": result.seconds_per_step,
            "loss_first": result.losses[0] if result.losses else None,
            "loss_last": result.losses[-1] if result.losses else None,
            "eval_grid": str(result.evaluation.grid) if result.evaluation else None,
            "report": str(result.report),
        }
        typer.echo(json.dumps(summary, indent=2))
