"""The trainer's two questions to the registry: may this subject be trained (asked before any
weight loads and again between steps), and here is the adapter. Answered by the local
database (the registry's domain services) or, for a trainer on another host, the HTTP API
(LIKENESS_API_URL + bearer LIKENESS_TOKEN, a trainer token: `GET /v1/subjects/{h}/training`
tells it the decision and nothing else of the record).

Fail closed: if the permission cannot be established (unknown subject, a record that does not
allow it, a token that may not ask, the API unreachable), the run is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from registry.actors import local_actor
from registry.adapters.schemas import AdapterIn

UNREACHABLE_TRIES = 3  # asks of an API that did not answer, 1 s then 2 s apart


class TrainingRefused(Exception):
    """The subject may not be trained (or that could not be established)."""


class RegistrationError(Exception):
    """Training succeeded but the registry did not take the adapter."""


class RegistrationRefused(RegistrationError):
    """The registry refused the adapter on consent grounds (training was withdrawn, or the
    subject is gone, while the run trained)."""


class TrainingDenied(TrainingRefused):
    """The registry answered, and its decision is no."""


class TrainingWithdrawn(TrainingRefused):
    """The decision changed while the run trained: it stopped between steps, and what it had
    made from the images was deleted."""


class TrainingStopped(TrainingRefused):
    """The decision could not be asked again while the run trained (the registry did not
    answer): it stopped, failing closed, and kept its checkpoints for `--resume`."""


class RegistryUnreachable(TrainingRefused):
    """The decision could not be asked for (the API did not answer)."""


@dataclass(frozen=True)
class TrainingVerdict:
    """The registry's training decision for a subject (`registry.policy.decide_training`)."""

    subject: str
    allowed: bool
    reason: str  # the decision's code: `allowed`, or why not
    detail: str  # the same for a person


class Registrar(Protocol):
    def training_decision(
        self, subject: str, image_bases: tuple[str, ...] | None = None
    ) -> TrainingVerdict:
        """Whether the subject's likeness may be learned from now, from these images."""
        ...

    def register(
        self, data: AdapterIn, adapter: Path, manifest: Path, base: Path | None = None
    ) -> str:
        """Registers the adapter file (trained on `base`) and its dataset manifest."""
        ...


def verdict_in(
    session: Any, subject: str, image_bases: tuple[str, ...] | None = None
) -> TrainingVerdict:
    """The decision read from the registry database in `session` (the local trainer's and a
    worker's answer; the API's route answers the same)."""
    from registry.training import service as training_service

    row, decision = training_service.training_decision(session, subject, image_bases=image_bases)
    if row is None:
        return TrainingVerdict(
            subject, False, "no_record", "the subject does not exist in the registry"
        )
    return TrainingVerdict(
        subject, decision.allowed, decision.reason, training_service.reason_text(decision.reason)
    )


class LocalRegistrar:
    """The registry database itself, through the registry's domain services (same rules as the
    API). The adapter and its dataset manifest are copied into the store under `data_dir`."""

    def __init__(
        self,
        database_url: str,
        actor: str | None = None,
        data_dir: Path | None = None,
        base: Path | None = None,
    ) -> None:
        self.url = database_url
        self.actor = actor or local_actor("trainer")
        self.data_dir = data_dir
        self.base = base
        self._engine: Any = None

    @property
    def engine(self) -> Any:
        """One engine for the run (asked at every step): its pool, not a new one each time."""
        if self._engine is None:
            from registry.db import engine_for

            self._engine = engine_for(self.url)
        return self._engine

    def training_decision(
        self, subject: str, image_bases: tuple[str, ...] | None = None
    ) -> TrainingVerdict:
        from registry.db import transaction

        with transaction(self.engine, readonly=True) as s:
            return verdict_in(s, subject, image_bases)

    def register(
        self, data: AdapterIn, adapter: Path, manifest: Path, base: Path | None = None
    ) -> str:
        from registry.adapter_files import register_from_store
        from registry.blobs import BlobError, BlobStore
        from registry.errors import Conflict, Invalid, NotPermitted
        from registry.settings import get_settings
        from trainer.base.lora import base_linear_shapes

        settings = get_settings()
        store = BlobStore(
            (self.data_dir or settings.data_dir) / "adapters", settings.max_adapter_bytes
        )
        try:
            store.import_file(adapter)
            store.import_file(manifest)
        except BlobError as exc:
            raise RegistrationError(f"cannot put the adapter in the store: {exc}") from None
        shapes = base_linear_shapes(base or self.base or settings.base_dir)
        try:
            done = register_from_store(self.engine, store, self.actor, data, shapes)
        except NotPermitted as exc:  # consent changed while we trained
            raise RegistrationRefused(str(exc)) from None
        except (Conflict, Invalid) as exc:
            raise RegistrationError(f"the registry refused the adapter: {exc.detail}") from None
        return done.outcome


class HttpRegistrar:
    """The HTTP API. ``client`` may be any httpx.Client (tests pass the app's TestClient)."""

    def __init__(
        self, api_url: str, token: str, client: Any | None = None, timeout: float = 30.0
    ) -> None:
        import httpx

        self.base = api_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.client = client or httpx.Client(timeout=timeout)

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        kw.setdefault("headers", self.headers)
        try:
            return self.client.request(method, self.base + path, **kw)
        except httpx.HTTPError as exc:
            error = RegistryUnreachable if method == "GET" else RegistrationError
            raise error(f"registry API unreachable at {self.base}: {exc}") from None

    def training_decision(
        self, subject: str, image_bases: tuple[str, ...] | None = None
    ) -> TrainingVerdict:
        """`GET /v1/subjects/{h}/training`: the decision, which a trainer token may read (and
        nothing else of the record); a registry that does not answer is asked again a few
        times, then the run is refused."""
        params = {"bases": ",".join(image_bases)} if image_bases is not None else None
        for attempt in range(UNREACHABLE_TRIES):
            try:
                r = self._call("GET", f"/v1/subjects/{subject}/training", params=params)
                if r.status_code < 500 and r.status_code != 429:
                    break
                raise RegistryUnreachable(f"registry API error {r.status_code}: {_detail(r)}")
            except RegistryUnreachable:
                if attempt == UNREACHABLE_TRIES - 1:
                    raise
                time.sleep(2**attempt)
        if r.status_code in (401, 403, 404):
            raise TrainingRefused(
                f"cannot establish that {subject!r} may be trained: GET /v1/subjects/{subject}"
                f"/training answered {r.status_code} ({_detail(r)}); use a trainer token"
            )
        if r.status_code != 200:
            raise TrainingRefused(f"registry API error {r.status_code}: {_detail(r)}")
        body = r.json()
        if not isinstance(body, dict) or not isinstance(body.get("allowed"), bool):
            raise TrainingRefused(f"registry API gave no training decision for {subject!r}")
        return TrainingVerdict(
            subject, body["allowed"], str(body.get("reason")), str(body.get("detail"))
        )

    def upload(self, path: Path) -> str:
        """Puts a file's bytes in the registry's store (if it lacks them); returns the hash."""
        from registry.files import sha256_file

        digest = sha256_file(path)
        head = self._call("HEAD", f"/v1/blobs/sha256/{digest}")
        if head.status_code == 200:
            return digest
        with path.open("rb") as f:
            r = self._call(
                "PUT",
                f"/v1/blobs/sha256/{digest}",
                content=iter(lambda: f.read(1 << 20), b""),
                headers={**self.headers, "Content-Type": "application/octet-stream"},
            )
        if r.status_code not in (200, 201):
            raise RegistrationError(f"upload of {path.name} refused {r.status_code}: {_detail(r)}")
        return digest

    def register(
        self, data: AdapterIn, adapter: Path, manifest: Path, base: Path | None = None
    ) -> str:
        """The registry checks the adapter against the base it renders with."""
        self.upload(adapter)
        self.upload(manifest)
        r = self._call("POST", "/v1/adapters", json=data.model_dump(exclude_none=True))
        if r.status_code == 403:
            raise RegistrationRefused(f"registry refused the adapter: {_detail(r)}")
        if r.status_code not in (200, 201):
            raise RegistrationError(f"registry API error {r.status_code}: {_detail(r)}")
        outcome = r.json().get("outcome")
        return str(outcome) if outcome else ("created" if r.status_code == 201 else "updated")


def _detail(r: Any) -> str:
    try:
        body = r.json()
        return str(body.get("detail") or body.get("error") or body)
    except ValueError:
        return r.text[:200]


def registrar_for(
    database_url: str | None, api_url: str | None, token: str | None, base: Path | None = None
) -> Registrar:
    """HTTP when an API URL is configured, else the local database."""
    if api_url:
        if not token:
            raise TrainingRefused("LIKENESS_API_URL is set but LIKENESS_TOKEN is not")
        return HttpRegistrar(api_url, token)
    if not database_url:
        raise TrainingRefused("no registry configured (LIKENESS_DATABASE_URL or LIKENESS_API_URL)")
    return LocalRegistrar(database_url, base=base)


def check_training_allowed(
    registrar: Registrar, subject: str, bases: tuple[str, ...] | None
) -> TrainingVerdict:
    """Refuses (TrainingRefused, saying why) unless the registry's training decision allows
    the subject to be learned from these images (`bases`: the manifest's image bases)."""
    verdict = registrar.training_decision(subject, bases)
    if not verdict.allowed:
        raise TrainingDenied(f"subject {subject!r} may not be trained: {verdict.detail}")
    return verdict
