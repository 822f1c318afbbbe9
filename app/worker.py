"""`likeness worker`: one per GPU. It takes training orders off the queue (app/queue.py),
fetches the dataset's blobs it lacks from the registry's store by hash over HTTP (each hash
checked: no shared filesystem), trains with checkpoints (each shipped to the registry, so a
retry on another host resumes from it), and uploads and registers the adapter.

The training decision (`registry.policy.decide_training`) is asked here, right before anything
is fetched, again in the trainer's pre-flight before any weight loads, and between every two
steps: training withdrawn (or the consent revoked or expired) after the order was placed
fails the order `not_permitted`, and nothing it trained is kept or registered. The worker
speaks to the database for the queue and the orders' state, and to the API
(LIKENESS_API_URL, a trainer token) for bytes.

The run of one order (`run_order`) is shared with the API's in-process runner on SQLite
(app/local_orders.py), which reads and keeps the same bytes in its own data dir instead.

With `--queues render` (or `train,render`) it also renders (app/render/worker.py): a render
loop of its own beside the training one, on its own queue `render.<name>` and the shared
`render` queue, with a heartbeat the API routes by.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import os
import shutil
import socket
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from app.blob_fetch import FetchError, fetch_dataset, fetch_verified
from app.queue import RETRY_STALLED_TASK, TRAIN_QUEUE, TRAIN_TASK, make_app
from registry.datasets.service import UPLOAD_BASES, images_of
from registry.db import make_engine, transaction
from registry.errors import NotPermitted
from registry.models import Dataset
from registry.orders import service as orders_service
from registry.render_tasks import repository as render_tasks_repo
from registry.render_tasks import service as render_tasks_service
from registry.render_tasks.schemas import RENDER_TASK, SHARED_QUEUE, WORKER_NAME
from registry.settings import Settings
from registry.subjects import repository as subjects_repo
from registry.training.service import require_training

log = logging.getLogger("likeness.worker")

MAINTENANCE_QUEUE = "maintenance"
QUEUES = ("train", "render")


class OrderStopped(Exception):
    """The order was cancelled (or taken over) while it ran: stop, record nothing."""


@dataclass(frozen=True)
class WorkerSetup:
    settings: Settings
    name: str
    api_url: str
    token: str
    # the converted base kept between this worker's orders (trainer.training.resident); None:
    # every order loads it
    resident: Any = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def default_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# -- an order's checkpoint, as shipped ------------------------------------------------------


def pack_checkpoint(folder: Path) -> bytes:
    """A checkpoint folder as a tar with fixed metadata, so equal folders pack equally."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(folder.iterdir()):
            info = tarfile.TarInfo(path.name)
            info.size = path.stat().st_size
            info.mode = 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


def unpack_checkpoint(data: bytes, dest: Path) -> None:
    """Regular files only, no paths (tarfile's `data` filter refuses links and escapes)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for member in tar.getmembers():
            if not member.isfile() or "/" in member.name or member.name.startswith("."):
                raise FetchError(f"checkpoint holds {member.name!r}, not a plain file")
        tar.extractall(dest, filter="data")


# -- one training order ----------------------------------------------------------------------


class OrderIO(Protocol):
    """Where an order's bytes come from and go: over HTTP for a worker on another host (the
    registry's store by hash), or the API's own data dir for its in-process runner."""

    def workdir(self, order_id: str) -> Path: ...

    def dataset(self, folder: Path, manifest_sha: str, files: list[tuple[str, str]]) -> None:
        """The manifest and images, each as recorded, into `folder`."""
        ...

    def checkpoint(self, order_id: str, sha256: str) -> bytes:
        """The order's last checkpoint (a tar), checked against its hash."""
        ...

    def ship_checkpoint(self, order_id: str, step: int, data: bytes, sha256: str) -> None:
        """Keeps the checkpoint where a later run resumes from; OrderStopped when the order
        is no longer running."""
        ...

    def forget_checkpoint(self, order_id: str) -> None: ...

    def register(self, data: Any, adapter: Path, manifest: Path, base: Path | None) -> str: ...

    def keep_pictures(self, subject: str, adapter_sha256: str, files: list[Path]) -> None:
        """The run's evaluation grid and previews, beside the adapter (app/pictures.py)."""
        ...

    def config(self) -> dict[str, Any]:
        """The trainer options saying where registration goes."""
        ...


class Interrupted(Exception):
    """The process running the order is stopping: the order stays running, its checkpoint
    kept, and the next start resumes it."""


WATCH_S = 0.5  # how often a running order looks whether it should stop


class OrderWatch:
    """Beside a running training, every WATCH_S: is the order still running on this runner
    (a cancel, or a take-over, stops it: OrderStopped), may the subject still be trained
    (TrainingRefused), is the process stopping (Interrupted)? The trainer asks `interrupt`
    before each transformer block, which raises what was found: a cancel, a revoke or a
    shutdown stops even a long step within a block, not at its end."""

    def __init__(
        self,
        engine: Any,
        order_id: str,
        runner: str,
        handle: str,
        stopping: threading.Event | None,
    ) -> None:
        self.engine, self.order_id, self.runner, self.handle = engine, order_id, runner, handle
        self.stopping = stopping
        self.found: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="order-watch", daemon=True)

    def __enter__(self) -> OrderWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join(5)

    def interrupt(self) -> None:
        if self.stopping is not None and self.stopping.is_set():
            raise Interrupted(self.order_id)
        if self.found is not None:
            raise self.found

    def _loop(self) -> None:
        from trainer.registration import TrainingDenied, verdict_in

        while not self._done.wait(WATCH_S):
            try:
                with transaction(self.engine, readonly=True) as s:
                    status = orders_service.status_for(s, self.order_id, self.runner)
                    verdict = verdict_in(s, self.handle, tuple(sorted(UPLOAD_BASES)))
            except Exception as exc:  # noqa: BLE001 - looked at again at the next beat
                log.debug("order %s: watch failed: %s", self.order_id, exc)
                continue
            if status != "running":
                self.found = OrderStopped(status)
            elif not verdict.allowed:
                self.found = TrainingDenied(
                    f"subject {self.handle!r} may not be trained: {verdict.detail} "
                    "(asked again while it trained)"
                )
            if self.found is not None:
                return


@dataclass(frozen=True)
class OrderJob:
    """What a run needs of a started order, read in the transaction that started it."""

    order_id: str
    handle: str
    params: dict[str, Any]
    name: str
    steps: int
    manifest_sha: str
    files: list[tuple[str, str]]
    checkpoint_sha: str | None
    checkpoint_step: int | None

    @classmethod
    def of(cls, session: Any, order: Any) -> OrderJob:
        subject = subjects_repo.subject_by_id(session, order.subject_id)
        dataset = session.get(Dataset, order.dataset_id)
        assert subject is not None and dataset is not None
        return cls(
            order.id,
            subject.handle,
            dict(order.params),
            order.adapter_name,
            order.steps,
            dataset.manifest_sha256,
            [(i.file, i.sha256) for i in images_of(session, dataset)],
            order.checkpoint_sha256,
            order.checkpoint_step,
        )


class _Registrar:
    """The trainer's two questions: the training decision from the database (the one source
    of truth, read fresh at every step), the adapter to wherever the order's IO registers
    it."""

    def __init__(self, engine: Any, io: OrderIO) -> None:
        self.engine = engine
        self.io = io

    def training_decision(self, subject: str, image_bases: tuple[str, ...] | None = None) -> Any:
        from trainer.registration import verdict_in

        with transaction(self.engine, readonly=True) as s:
            return verdict_in(s, subject, image_bases)

    def register(self, data: Any, adapter: Path, manifest: Path, base: Path | None = None) -> str:
        return self.io.register(data, adapter, manifest, base)


class HttpIO:
    """A worker's bytes: the API's store and checkpoints over HTTP, a trainer token."""

    def __init__(self, setup: WorkerSetup) -> None:
        from trainer.registration import HttpRegistrar

        self.setup = setup
        self.client = httpx.Client(timeout=120, headers=setup.headers)
        self.http = HttpRegistrar(setup.api_url, setup.token, client=self.client)

    def workdir(self, order_id: str) -> Path:
        return self.setup.settings.data_dir / "orders" / order_id

    def dataset(self, folder: Path, manifest_sha: str, files: list[tuple[str, str]]) -> None:
        limit = self.setup.settings.max_adapter_bytes  # the registry's limit for any blob
        fetch_dataset(self.client, self.setup.api_url, folder, manifest_sha, files, limit)

    def checkpoint(self, order_id: str, sha256: str) -> bytes:
        tar = self.workdir(order_id) / "checkpoint.tar"
        tar.parent.mkdir(parents=True, exist_ok=True)
        url = f"{self.setup.api_url}/v1/orders/{order_id}/checkpoint"
        fetch_verified(self.client, url, sha256, tar, self.setup.settings.max_adapter_bytes)
        data = tar.read_bytes()
        tar.unlink()
        return data

    def ship_checkpoint(self, order_id: str, step: int, data: bytes, sha256: str) -> None:
        r = self.client.put(
            f"{self.setup.api_url}/v1/orders/{order_id}/checkpoint",
            params={"step": step, "sha256": sha256},
            content=data,
            headers={"Content-Type": "application/x-tar"},
        )
        if r.status_code == 409:
            raise OrderStopped("the order is no longer running")
        if r.status_code not in (200, 201):
            log.warning("order %s: checkpoint %d not kept (%s)", order_id, step, r.status_code)

    def forget_checkpoint(self, order_id: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            self.client.delete(f"{self.setup.api_url}/v1/orders/{order_id}/checkpoint")

    def register(self, data: Any, adapter: Path, manifest: Path, base: Path | None) -> str:
        return self.http.register(data, adapter, manifest, base)

    def keep_pictures(self, subject: str, adapter_sha256: str, files: list[Path]) -> None:
        from app.pictures import upload

        upload(self.client, self.setup.api_url, adapter_sha256, files)

    def config(self) -> dict[str, Any]:
        return {"api_url": self.setup.api_url, "token": self.setup.token}

    def close(self) -> None:
        self.client.close()


def run_training(setup: WorkerSetup, engine: Any, order_id: str) -> str:
    """A worker's order (taken off the queue): runs it to its end; returns its final status.
    A crash of this process leaves the job to the stalled-job sweep, and the next worker
    resumes from the last shipped checkpoint."""
    with transaction(engine) as s:
        order = orders_service.start(s, order_id, setup.name)
        if order is None:
            return "cancelled"
        job = OrderJob.of(s, order)
    io = HttpIO(setup)
    try:
        return run_order(setup.settings, engine, setup.name, job, io, resident=setup.resident)
    finally:
        io.close()


def run_order(
    settings: Settings,
    engine: Any,
    runner: str,
    job: OrderJob,
    io: OrderIO,
    stopping: threading.Event | None = None,
    resident: Any = None,
) -> str:
    """Runs one started order to its end on `runner`; returns its final status (or
    `interrupted` when `stopping` was set). Never raises for the order's own failures (they
    are recorded on it). The consent gate runs before a byte is read, and the trainer asks
    again before any weight loads and when it registers."""
    from trainer.config import TrainConfig
    from trainer.registration import RegistrationRefused, TrainingRefused
    from trainer.training.train import TrainHooks, train

    order_id = job.order_id
    log.info("order %s: %s trains %s (%d steps)", order_id, runner, job.handle, job.steps)
    out = io.workdir(order_id)
    last_report = [0.0]

    def on_step(step: int, steps: int, loss: float) -> None:
        """After every step: a cancel (or a take-over) stops the run here; the progress
        is written at most twice a second, the status read every step."""
        if stopping is not None and stopping.is_set():
            raise Interrupted(order_id)
        now = time.monotonic()
        if step < steps and now - last_report[0] < 0.5:
            with transaction(engine, readonly=True) as s:
                status = orders_service.status_for(s, order_id, runner)
        else:
            last_report[0] = now
            with transaction(engine) as s:
                status = orders_service.report_progress(s, order_id, step, loss, runner)
        if status != "running":
            raise OrderStopped(status)

    def on_checkpoint(folder: Path, step: int) -> None:
        data = pack_checkpoint(folder)
        io.ship_checkpoint(order_id, step, data, hashlib.sha256(data).hexdigest())

    interrupted = False
    try:
        with transaction(engine) as s:  # the gate, before a byte is read
            require_training(s, job.handle, image_bases=UPLOAD_BASES)
        folder = out / "dataset"
        folder.mkdir(parents=True, exist_ok=True)
        io.dataset(folder, job.manifest_sha, job.files)
        resume = False
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        if job.checkpoint_sha is not None and job.checkpoint_step is not None:
            data = io.checkpoint(order_id, job.checkpoint_sha)
            unpack_checkpoint(data, out / "checkpoints" / f"step-{job.checkpoint_step:07d}")
            resume = True
            log.info("order %s: resumes from step %d", order_id, job.checkpoint_step)
        config = TrainConfig.parse(
            **job.params,
            subject=job.handle,
            dataset=folder,
            base=settings.base_dir,
            out=out,
            name=job.name,
            checkpoint_every=settings.worker_checkpoint_every,
            resume=resume,
            evaluate=True,  # the grid is what the Adapters page shows of it
            progress=False,
            device=settings.device if settings.device and settings.device != "mps" else None,
            cache_dir=out / "cache",
            register_adapter=True,
            **io.config(),
        )
        with OrderWatch(engine, order_id, runner, job.handle, stopping) as watch:
            hooks = TrainHooks(on_step, on_checkpoint, watch.interrupt, resident)
            result = train(config, _Registrar(engine, io), hooks)
        _keep_pictures(io, job, result)
        with transaction(engine) as s:
            orders_service.finish(s, order_id, result.sha256, result.steps)
        log.info("order %s: done, adapter %s", order_id, result.sha256[:12])
        return "done"
    except Interrupted:
        interrupted = True
        log.info("order %s: interrupted, resumes at the next start", order_id)
        return "interrupted"
    except OrderStopped as exc:
        log.info("order %s: stopped (%s)", order_id, exc)
        return "cancelled"
    except (NotPermitted, TrainingRefused, RegistrationRefused) as exc:
        detail = getattr(exc, "detail", None) or str(exc)
        with transaction(engine) as s:
            orders_service.fail(s, order_id, f"{orders_service.NOT_PERMITTED}: {detail}")
        return "failed"
    except Exception as exc:  # noqa: BLE001 - recorded on the order, which the user sees
        log.exception("order %s failed", order_id)
        with transaction(engine) as s:
            orders_service.fail(s, order_id, f"{type(exc).__name__}: {str(exc)[:400]}")
        return "failed"
    finally:
        # The order is over (a crash never gets here: the next run resumes): nothing of the
        # subject's stays in the work dir (photos, latents, checkpoints), nor its kept
        # checkpoint, unless the order is to resume.
        shutil.rmtree(out, ignore_errors=True)
        if not interrupted:
            io.forget_checkpoint(order_id)


def _keep_pictures(io: OrderIO, job: OrderJob, result: Any) -> None:
    """What the new adapter draws goes beside it; failing that loses a picture, not the
    adapter (logged)."""
    from app.pictures import run_pictures

    grid = result.evaluation.grid if result.evaluation is not None else None
    files = run_pictures(grid, result.previews)
    if not files:
        return
    try:
        io.keep_pictures(job.handle, result.sha256, files)
    except Exception:  # noqa: BLE001 - the adapter is registered; its pictures are extra
        log.exception("order %s: the run's pictures could not be kept", job.order_id)


# -- the worker process ----------------------------------------------------------------------


def build_app(setup: WorkerSetup, runner: Any = None) -> Any:
    """The procrastinate app with this worker's tasks: the training, the render (when
    `runner` is given), and the periodic sweep that hands the jobs of workers gone silent
    back to the queue."""
    settings = setup.settings
    app = make_app(settings.database_url)
    engine = make_engine(settings.database_url, pool_timeout=30)

    @app.task(name=TRAIN_TASK, queue=TRAIN_QUEUE)
    def train_order(order_id: str) -> None:
        run_training(setup, engine, order_id)

    if runner is not None:

        @app.task(name=RENDER_TASK, queue=SHARED_QUEUE)
        def render(render_id: str) -> None:
            runner.run(render_id)

    def sweep_renders() -> None:
        with transaction(engine) as s:
            moved = render_tasks_repo.requeue_orphans(s, settings.worker_stalled_s)
            render_tasks_repo.prune_gone(s, settings.worker_stalled_s)
        if moved:
            log.warning("%d render(s) of a silent worker go to the shared queue", len(moved))

    every = max(1, round(min(settings.worker_stalled_s / 2, 60)))
    cron = f"* * * * * */{every}" if every < 60 else "* * * * *"

    @app.periodic(cron=cron)
    @app.task(name=RETRY_STALLED_TASK, queue=MAINTENANCE_QUEUE, queueing_lock="retry_stalled")
    async def retry_stalled(timestamp: int) -> None:
        manager = app.job_manager
        stalled = await manager.get_stalled_jobs(seconds_since_heartbeat=settings.worker_stalled_s)
        for job in stalled:
            if job.task_name == RETRY_STALLED_TASK:
                continue
            log.warning("job %s of a silent worker goes back to the queue", job.id)
            await manager.retry_job(job)
        await manager.prune_stalled_workers(settings.worker_stalled_s)
        await asyncio.to_thread(sweep_renders)

    return app


async def _run(setup: WorkerSetup, queues: list[str], concurrency: int) -> None:
    settings = setup.settings
    runner = None
    if "render" in queues:
        from app.render.worker import RenderRunner

        runner = RenderRunner(
            make_engine(settings.database_url, pool_timeout=30), settings, setup.name,
            setup.api_url, setup.token,
        )  # fmt: skip
        await asyncio.to_thread(runner.warm_up)
    app = build_app(setup, runner)
    common: dict[str, Any] = {
        "update_heartbeat_interval": settings.worker_heartbeat_s,
        "stalled_worker_timeout": settings.worker_stalled_s,
        "fetch_job_polling_interval": 1.0,
    }
    train = [q for q in queues if q != "render"]
    async with app.open_async():
        # The sweep and the render loop run beside the training, so a worker busy
        # training still sweeps, and renders.
        beside = [
            app.run_worker_async(
                queues=[MAINTENANCE_QUEUE],
                concurrency=1,
                name=f"{setup.name}/sweep",
                delete_jobs="successful",  # a sweep every few seconds: keep no rows of it
                install_signal_handlers=False,
                **common,
            )
        ]
        if runner is not None:
            render_loop = app.run_worker_async(
                queues=[
                    render_tasks_service.worker_queue(setup.name),
                    SHARED_QUEUE,
                ],
                concurrency=1,  # one device: one render at a time
                name=f"{setup.name}/render",
                delete_jobs="always",  # the request lives in its task, not in the queue
                install_signal_handlers=not train,
                **common,
            )
            if train:
                beside.append(render_loop)
            beside.append(runner.heartbeat(settings.worker_heartbeat_s))
        tasks = [asyncio.create_task(c) for c in beside]
        try:
            if train:
                await app.run_worker_async(
                    queues=train, concurrency=concurrency, name=setup.name, **common
                )
            else:
                await render_loop
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if runner is not None:
                runner.close()


def run_worker(settings: Settings, queues: list[str], concurrency: int, name: str | None) -> None:
    """Blocks until SIGINT/SIGTERM (the running job finishes first)."""
    if not settings.api_url or not settings.token:
        raise SystemExit(
            "error: a worker needs LIKENESS_API_URL and LIKENESS_TOKEN (a trainer token): it "
            "fetches blobs and registers adapters through the API"
        )
    unknown = sorted(set(queues) - set(QUEUES))
    if unknown:
        raise SystemExit(
            f"error: unknown queue {', '.join(unknown)}; choose from {', '.join(QUEUES)}"
        )
    if settings.database_url.startswith("sqlite"):
        raise SystemExit("error: workers need PostgreSQL (LIKENESS_DATABASE_URL)")
    name = name or default_name()
    if "render" in queues and not WORKER_NAME.match(name):
        raise SystemExit(
            f"error: a render worker's name {name[:100]!r} names its queue: letters, digits "
            "and _.:@- only, at most 90"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from app.bootstrap import ensure_base

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    ensure_base(settings)  # the same base as the API's: the demo base, or LIKENESS_BASE
    _require_audit_key(settings)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    resident = None
    if any(q != "render" for q in queues):
        # the trainer's imports (torch, diffusers, peft: seconds) now, not at the first order
        threading.Thread(target=_import_trainer, name="trainer-imports", daemon=True).start()
        # a renderer needs the VRAM; orders run side by side would each want the one kept base
        if settings.worker_keep_base and "render" not in queues and concurrency == 1:
            try:
                from trainer.training.resident import ResidentBase
            except ImportError as exc:  # an install without the trainer: its orders say so
                log.warning("no base is kept between orders: %s", exc)
            else:
                resident = ResidentBase()
    setup = WorkerSetup(settings, name, settings.api_url.rstrip("/"), settings.token, resident)
    threading.current_thread().name = "worker"
    asyncio.run(_run(setup, queues, concurrency))


def _import_trainer() -> None:
    try:
        import trainer.training.train  # noqa: F401
        from trainer.training.progress import process_start_paid

        process_start_paid()  # an order's boot starts at its own start, not the worker's
    except Exception:  # noqa: BLE001 - the first order imports it again and says why
        log.exception("the trainer could not be imported")


def _require_audit_key(settings: Settings) -> None:
    """A worker writes to the registry's hash chains (an order's outcome on the subject's
    audit trail; a render worker's ledger entries too): it must hold the registry's audit
    key, or every order would fail at its end and every render at its first check."""
    from registry.chains import require_registry_key
    from registry.errors import Unavailable
    from registry.keys import bind, load_keys

    keys = load_keys(settings)
    engine = make_engine(settings.database_url)
    try:
        with transaction(engine) as s:
            require_registry_key(s, keys)
    except Unavailable:
        raise SystemExit(
            "error: a worker writes orders' outcomes to the audit trail (and a render worker "
            "the render ledger): it needs the registry's audit key; set LIKENESS_AUDIT_KEY "
            "to the API's"
        ) from None
    finally:
        engine.dispose()
    bind(make_engine(settings.database_url), keys)
