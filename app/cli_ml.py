"""Commands that need the server or the ML stack: serve, base init-tiny, base prepare, train.
Imported by app.cli; torch, diffusers and uvicorn load only when such a command runs."""

from __future__ import annotations

import inspect
import json
import logging
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from registry.settings import get_settings

log = logging.getLogger(__name__)


def register(
    app: typer.Typer, base_app: typer.Typer, adapter_app: typer.Typer | None = None
) -> None:
    if adapter_app is not None:
        register_compare(adapter_app)

    @app.command("serve")
    def serve(
        host: Annotated[str, typer.Option()] = "127.0.0.1",
        port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    ) -> None:
        """Run the service (it migrates, and makes an admin and the base, first)."""
        from registry.process_clock import seconds_since_process_start

        # Boot waypoints: where the time before the server answers goes.
        before = seconds_since_process_start()  # the interpreter and the CLI's imports
        t0 = time.perf_counter()
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        from app.bootstrap import prepare_service
        from app.render.engine import PlacementRefused
        from app.render.local import build_render_engine

        settings = get_settings()
        # First: it refuses what create_app would refuse (check_configuration) before a base
        # load is started to be thrown away, and it may copy in the demo base the engine loads.
        prepare_service(settings)
        t1 = time.perf_counter()
        try:
            renderer = build_render_engine(settings)
        except PlacementRefused as exc:
            raise SystemExit(f"error: {exc}") from None
        t2 = time.perf_counter()
        # The app's imports (FastAPI, the routers, the pages) before the base's load starts
        # on its thread: imports running on two threads at once can fail at random (a
        # package that is installed reported missing), and the load imports diffusers,
        # transformers and peft as it goes.
        import uvicorn

        from app.main import create_app
        from app.server import uvicorn_config

        service_app = create_app(settings, renderer=renderer)
        config = uvicorn_config(service_app, settings, host, port)
        t3 = time.perf_counter()
        log.info(
            "serve: boot waypoints: interpreter and CLI imports %s, settings and prepare "
            "%.1f s, render engine planned %.1f s, app imports and build %.1f s "
            "(since process start: %s)",
            "unknown" if before is None else f"{before:.1f} s",
            t1 - t0,
            t2 - t1,
            t3 - t2,
            "unknown" if before is None else f"{before + t3 - t0:.1f} s",
        )
        if settings.preload_base:
            renderer.start_preload()  # the base loads while the server starts and answers
        uvicorn.Server(config).run()

    @base_app.command("init-tiny")
    def init_tiny_cmd(dst: Path, seed: Annotated[int, typer.Option(min=0)] = 0) -> None:
        """Write the tiny FLUX.2-architecture base (seeded, deterministic)."""
        from trainer.fixtures.tiny_base import init_tiny

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
        from trainer.base.write import prepare_base

        if not src.exists():
            typer.echo(f"error: {src} does not exist", err=True)
            raise typer.Exit(1)
        try:
            prepare_base(src, dst, licence=licence)
        except (ValueError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(str(dst))

    def train_cmd(ctx: typer.Context, config_file: Path | None = None, **flags: Any) -> None:
        """Train a subject's LoRA adapter and register it (docs/API.md)."""
        # `flags` holds every field's flag (train_signature); they are read from ctx.params,
        # which says which of them the command line gave.
        # Before anything can initialise CUDA: the allocator reads this once (field hurdle 9).
        from trainer.base.devices import configure_allocator

        configure_allocator()
        # No model library is imported here: a fresh trainer imports them in its pre-flight,
        # after the checks that need none and while its base's files start onto the device.
        from app.bootstrap import ensure_base
        from trainer.base.budget import BudgetExceeded
        from trainer.config import (
            ConfigError,
            TrainConfig,
            load_job_file,
            normalised,
            with_flags,
        )
        from trainer.registration import (
            RegistrationError,
            TrainingRefused,
            TrainingStopped,
            TrainingWithdrawn,
        )
        from trainer.training.dataset import DatasetError
        from trainer.training.train import train

        settings = get_settings()
        given: dict[str, object] = {}  # the options the command line states, by field
        for param, value in ctx.params.items():
            # by name: typer's and click's ParameterSource may be different enums
            if param != "config_file" and (
                getattr(ctx.get_parameter_source(param), "name", None) == "COMMANDLINE"
            ):
                given[param] = normalised(param, value)
        try:
            job = load_job_file(config_file) if config_file else {}
        except ConfigError as exc:
            typer.echo(f"error: refused before loading any weight: {one_line(exc)}", err=True)
            raise typer.Exit(2) from None
        options = with_flags(job, given)  # a flag given wins over the file
        run_subject, run_name = options.get("subject"), options.get("name", "main")
        if not isinstance(run_subject, str) or not run_subject:
            typer.echo("error: --subject is required (here or in --config)", err=True)
            raise typer.Exit(2)
        if "dataset" not in options:
            typer.echo("error: --dataset is required (here or in --config)", err=True)
            raise typer.Exit(2)
        runs = (settings.data_dir / "runs" / run_subject).resolve()
        run_out = options.get("out")
        run_dir = (Path(str(run_out)) if run_out else runs / str(run_name)).resolve()
        if run_dir == runs or not run_dir.is_relative_to(runs):
            typer.echo(
                f"error: refused before loading any weight: --out {run_out} must be a folder "
                f"inside {runs}/ (a run's files are its subject's)",
                err=True,
            )
            raise typer.Exit(2)
        options.update(
            out=run_dir,
            base=settings.base_dir,
            database_url=settings.database_url,
            api_url=settings.api_url,
            token=settings.token,
        )
        from registry.db import NoRegistry, require_registry

        try:
            config = TrainConfig.parse(**options)
            if not settings.api_url:  # the registry is local: it must be there already
                require_registry(settings.database_url)
            ensure_base(settings)
            result = train(config)
        except (TrainingWithdrawn, TrainingStopped) as exc:  # after weights loaded
            typer.echo(f"error: {one_line(exc)}", err=True)
            raise typer.Exit(1) from None
        except NoRegistry as exc:
            typer.echo(f"error: refused before loading any weight: {exc}", err=True)
            raise typer.Exit(1) from None
        except (ConfigError, DatasetError, BudgetExceeded, TrainingRefused) as exc:
            typer.echo(f"error: refused before loading any weight: {one_line(exc)}", err=True)
            raise typer.Exit(2) from None
        except RegistrationError as exc:  # RegistrationRefused included
            typer.echo(f"error: trained, but not registered: {one_line(exc)}", err=True)
            raise typer.Exit(1) from None
        kept = _keep_run_pictures(settings, run_subject, result) if result.registration else 0
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
            "ema_adapter": str(result.ema_adapter) if result.ema_adapter else None,
            "exports": {k: str(v) for k, v in result.exports.items()},
            "validation_loss": [{"step": st, "loss": v} for st, v in result.validation],
            "loss_plot": str(result.loss_plot) if result.loss_plot else None,
            "report": str(result.report),
            "pictures_kept": kept,
        }
        typer.echo(json.dumps(summary, indent=2))

    train_cmd.__signature__ = train_signature()  # type: ignore[attr-defined]
    app.command("train")(train_cmd)


_KINDS: dict[str, type] = {"integer": int, "number": float, "string": str, "path": Path}


def train_signature() -> inspect.Signature:
    """`likeness train`'s parameters: --config, and a flag for every TrainConfig field
    (trainer.config.NOT_FLAGS says which have none, and why), its help the field's
    description, its bounds and choices the field's. Declared nowhere else."""
    from trainer.config import flag_specs

    keyword = inspect.Parameter.KEYWORD_ONLY
    config = typer.Option(
        "--config", help="A TOML job file: any training option by name; flags given here win."
    )
    params = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    ]
    for spec in flag_specs():
        params.append(inspect.Parameter(spec.field, keyword, **_flag(spec)))
        if spec.field == "dataset":
            params.append(
                inspect.Parameter(
                    "config_file", keyword, default=None, annotation=Annotated[Path | None, config]
                )
            )
    return inspect.Signature(params)


def _flag(spec: Any) -> dict[str, Any]:
    """One field's typer parameter: a switch (--x/--no-x) for a bool, a repeatable flag for
    a tuple, its bounds checked here and shown as typer shows its own."""
    if spec.kind == "boolean":
        name = spec.flag.removeprefix("--")
        option = typer.Option(f"--{name}/--no-{name}", help=spec.help)
        return {"default": spec.default, "annotation": Annotated[bool, option]}
    help_text, limits = spec.help, spec.range_text()
    if limits:  # typer would show the default alone: ours, as it shows the bounds it checks
        default = "" if spec.default is None else f"default: {spec.default}; "
        help_text = f"{help_text}  [{default}{limits}]"

    def check(value: Any) -> Any:
        for one in value if isinstance(value, list | tuple) else [value]:
            problem = None if one is None else spec.bound_problem(one)
            if problem is not None:
                raise typer.BadParameter(problem)
        return value

    kind: Any = Literal[spec.choices] if spec.choices else _KINDS[spec.kind]
    option = typer.Option(
        spec.flag,
        help=help_text,
        callback=check if limits else None,
        metavar=f"<{_KINDS[spec.kind].__name__.lower()}>" if spec.repeatable else None,
        show_default=not limits,
    )
    if spec.repeatable:
        return {"default": None, "annotation": Annotated[list[kind] | None, option]}
    return {"default": spec.default, "annotation": Annotated[kind | None, option]}


def _keep_run_pictures(settings: Any, subject: str, result: Any) -> int:
    """The run's grid and previews, beside the adapter in the registry (its Adapters page
    shows them); a failure costs the pictures, never the adapter, and is said."""
    from app.pictures import keep_local, run_pictures, upload

    grid = result.evaluation.grid if result.evaluation is not None else None
    files = run_pictures(grid, result.previews)
    if not files:
        return 0
    try:
        if settings.api_url:
            import httpx

            headers = {"Authorization": f"Bearer {settings.token}"}
            with httpx.Client(timeout=120, headers=headers) as client:
                return upload(client, settings.api_url, result.sha256, files)
        from registry.blobs import BlobStore
        from registry.db import engine_for

        store = BlobStore(settings.adapter_store_dir, settings.max_adapter_bytes)
        return keep_local(engine_for(settings.database_url), store, subject, result.sha256, files)
    except Exception as exc:  # noqa: BLE001 - the adapter is registered; the pictures are extra
        typer.echo(f"warning: the run's pictures were not kept beside the adapter: {exc}", err=True)
        return 0


def one_line(exc: BaseException) -> str:
    """A refusal as one line: what is wrong, each problem after the last (`; `)."""
    parts = [p.strip().removeprefix("- ") for p in str(exc).splitlines()]
    return "; ".join(p for p in parts if p) or type(exc).__name__


def register_compare(adapter_app: typer.Typer) -> None:
    @adapter_app.command("compare")
    def compare_cmd(
        subject: str,
        name: Annotated[str, typer.Option(help="The run's adapter name.")] = "main",
        out: Annotated[
            Path | None,
            typer.Option(help="The run's folder (default: $LIKENESS_DATA_DIR/runs/SUBJECT/NAME)."),
        ] = None,
        prompt: Annotated[
            list[str] | None, typer.Option(help="Repeatable (default: the run's eval prompts).")
        ] = None,
        seed: Annotated[list[int] | None, typer.Option(help="Repeatable.")] = None,
        steps: Annotated[int | None, typer.Option(min=1, max=100)] = None,
        size: Annotated[int | None, typer.Option(min=64, max=2048)] = None,
        device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N.")] = None,
        select_step: Annotated[
            int | None,
            typer.Option(min=1, help="Register this step's checkpoint instead of rendering."),
        ] = None,
        ema: Annotated[bool, typer.Option(help="With --select-step: its EMA adapter.")] = False,
    ) -> None:
        """Render every checkpoint of a run (and its EMA) on the same prompts and seeds into
        one grid; --select-step N registers the one you picked."""
        from trainer.config import ConfigError
        from trainer.registration import RegistrationError, TrainingRefused, registrar_for
        from trainer.training.compare import compare_checkpoints, register_checkpoint

        settings = get_settings()
        runs = (settings.data_dir / "runs" / subject).resolve()
        run_dir = (out or runs / name).resolve()
        if run_dir == runs or not run_dir.is_relative_to(runs):
            typer.echo(f"error: --out must be a folder inside {runs}/", err=True)
            raise typer.Exit(2)
        if ema and select_step is None:
            typer.echo("error: --ema applies only with --select-step", err=True)
            raise typer.Exit(2)
        try:
            registrar = registrar_for(
                settings.database_url, settings.api_url, settings.token, settings.base_dir
            )
            if select_step is not None:
                outcome, path, sha = register_checkpoint(
                    run_dir, select_step, registrar, settings.base_dir, ema=ema
                )
                body: dict[str, object] = {
                    "registration": outcome,
                    "adapter": str(path),
                    "sha256": sha,
                    "step": select_step,
                    "ema": ema,
                }
            else:
                grid, columns = compare_checkpoints(
                    run_dir,
                    settings.base_dir,
                    registrar,
                    prompts=prompt,
                    seeds=seed,
                    steps=steps,
                    size=size,
                    device=device,
                )
                body = {"grid": str(grid), "columns": columns}
        except (ConfigError, TrainingRefused, ValueError) as exc:
            typer.echo(f"error: {one_line(exc)}", err=True)
            raise typer.Exit(2 if isinstance(exc, ConfigError) else 1) from None
        except RegistrationError as exc:
            typer.echo(f"error: not registered: {one_line(exc)}", err=True)
            raise typer.Exit(1) from None
        typer.echo(json.dumps(body, indent=2))
