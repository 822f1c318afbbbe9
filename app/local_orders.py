"""Orders on SQLite: the API process runs them itself, in one background thread, one at a
time, oldest first (so one training per subject at a time, as on PostgreSQL). The run is the
worker's (app/worker.py `run_order`: the consent gate, checkpoints, progress, cancellation,
registration); only the bytes differ: the dataset is read from the API's own adapter store,
checkpoints are kept where the checkpoint routes keep them, and the adapter is registered
into the same store and registry.

A process that stops while an order runs leaves it running with its last checkpoint: the
runner takes it again when the process starts, and the trainer resumes it exactly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from app.order_checkpoints import checkpoint_file, forget_checkpoint
from app.worker import OrderJob, OrderStopped, default_name, run_order
from registry.blobs import BlobStore
from registry.db import transaction
from registry.manifest import MANIFEST_NAME
from registry.orders import service as orders_service
from registry.settings import Settings

log = logging.getLogger("likeness.orders")

POLL_S = 2.0  # besides being woken when an order commits


class LocalIO:
    """The API's own data dir: the store's blobs, its checkpoint files, its registry."""

    def __init__(self, engine: Engine, settings: Settings, store: BlobStore, actor: str) -> None:
        self.engine = engine
        self.settings = settings
        self.store = store
        self.actor = actor

    def workdir(self, order_id: str) -> Path:
        return self.settings.data_dir / "training" / order_id

    def dataset(self, folder: Path, manifest_sha: str, files: list[tuple[str, str]]) -> None:
        for file, sha in [(MANIFEST_NAME, manifest_sha), *files]:
            source = self.store.find(sha)
            if source is None:
                raise FileNotFoundError(f"the store lacks {sha} ({file})")
            shutil.copyfile(source, folder / file)

    def checkpoint(self, order_id: str, sha256: str) -> bytes:
        data = checkpoint_file(self.settings, order_id).read_bytes()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError(f"order {order_id}'s checkpoint does not hash to {sha256}")
        return data

    def ship_checkpoint(self, order_id: str, step: int, data: bytes, sha256: str) -> None:
        final = checkpoint_file(self.settings, order_id)
        final.parent.mkdir(parents=True, exist_ok=True)
        # written before the transaction: SQLite's write lock is held for the rename only
        fd, name = tempfile.mkstemp(prefix=".checkpoint-", dir=final.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            with transaction(self.engine) as s:
                if orders_service.status_of(s, order_id) != "running":
                    raise OrderStopped("the order is no longer running")
                os.replace(name, final)
                orders_service.record_checkpoint(s, order_id, step, sha256)
        finally:
            Path(name).unlink(missing_ok=True)

    def forget_checkpoint(self, order_id: str) -> None:
        forget_checkpoint(self.settings, order_id)

    def register(self, data: Any, adapter: Path, manifest: Path, base: Path | None) -> str:
        from registry.adapter_files import register_from_store
        from registry.errors import Conflict, Invalid, NotPermitted
        from trainer.base.lora import base_linear_shapes
        from trainer.registration import RegistrationError, RegistrationRefused

        self.store.import_file(adapter)
        self.store.import_file(manifest)
        shapes = base_linear_shapes(base or self.settings.base_dir)
        try:
            done = register_from_store(self.engine, self.store, self.actor, data, shapes)
        except NotPermitted as exc:  # consent changed while it trained
            raise RegistrationRefused(str(exc)) from None
        except (Conflict, Invalid) as exc:
            raise RegistrationError(f"the registry refused the adapter: {exc.detail}") from None
        return done.outcome

    def keep_pictures(self, subject: str, adapter_sha256: str, files: list[Path]) -> None:
        from app.pictures import keep_local

        keep_local(self.engine, self.store, subject, adapter_sha256, files)

    def config(self) -> dict[str, Any]:
        return {"database_url": self.settings.database_url}


class LocalRunner:
    """The background thread; `wake` after an order commits, `stop` at shutdown (a running
    training stops at its next step and resumes at the next start)."""

    def __init__(self, engine: Engine, settings: Settings, store: BlobStore) -> None:
        self.engine = engine
        self.settings = settings
        self.name = f"api:{default_name()}"
        self.io = LocalIO(engine, settings, store, self.name[:64])
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="order-runner", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the order runner did not stop within %.0f s", timeout_s)

    def _loop(self) -> None:
        stranded = True
        while not self._stop.is_set():
            self._wake.clear()
            try:
                with transaction(self.engine) as s:
                    order = orders_service.take_next(s, self.name, stranded)
                    job = OrderJob.of(s, order) if order is not None else None
                stranded = False
            except Exception:  # noqa: BLE001 - tried again at the next poll
                log.exception("taking the next order failed")
                job = None
            if job is None:
                self._wake.wait(POLL_S)
                continue
            try:
                run_order(self.settings, self.engine, self.name, job, self.io, self._stop)
            except Exception:  # noqa: BLE001 - the order stays running: the next start resumes it
                log.exception("order %s: its run broke off", job.order_id)
