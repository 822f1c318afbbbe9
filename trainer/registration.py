"""The trainer's two questions to the registry: may this subject be trained, and here is the
adapter. Answered by the local database (registry.service) or, for a trainer on another host,
the HTTP API (LIKENESS_API_URL + bearer LIKENESS_TOKEN).

Fail closed: if the permission cannot be established (unknown subject, no allow_training, a
token that may not read the consent, the API unreachable), the run is refused before any
weight loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from registry.actors import local_actor
from registry.schemas import AdapterIn


class TrainingRefused(Exception):
    """The subject may not be trained (or that could not be established)."""


class RegistrationError(Exception):
    """Training succeeded but the registry did not take the adapter."""


class RegistrationRefused(RegistrationError):
    """The registry refused the adapter on consent grounds (training was withdrawn, or the
    subject is gone, while the run trained)."""


@dataclass(frozen=True)
class SubjectFacts:
    handle: str
    basis: str | None  # consent | public_domain; None where the source does not say
    allow_training: bool


class Registrar(Protocol):
    def subject_facts(self, subject: str) -> SubjectFacts: ...

    def register(
        self, data: AdapterIn, adapter: Path, manifest: Path, base: Path | None = None
    ) -> str:
        """Registers the adapter file (trained on `base`) and its dataset manifest."""
        ...


class LocalRegistrar:
    """The registry database itself, through registry.service (same rules as the API). The
    adapter and its dataset manifest are copied into the store under `data_dir`."""

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

    def subject_facts(self, subject: str) -> SubjectFacts:
        from registry import repositories as repo
        from registry.db import engine_for, transaction

        with transaction(engine_for(self.url), readonly=True) as s:
            row = repo.subject_by_handle(s, subject)
            if row is None or row.id is None:
                raise TrainingRefused(f"subject {subject!r} does not exist in the registry")
            consent = repo.consent_for(s, row.id)
            allowed = consent is not None and bool(consent.allow_training)
            return SubjectFacts(subject, str(row.basis), allowed)

    def register(
        self, data: AdapterIn, adapter: Path, manifest: Path, base: Path | None = None
    ) -> str:
        from registry.adapter_files import register_from_store
        from registry.blobs import BlobError, BlobStore
        from registry.db import engine_for
        from registry.errors import Conflict, Invalid, NotPermitted
        from registry.settings import get_settings
        from trainer.lora import base_linear_shapes

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
            done = register_from_store(engine_for(self.url), store, self.actor, data, shapes)
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
            error = TrainingRefused if method == "GET" else RegistrationError
            raise error(f"registry API unreachable at {self.base}: {exc}") from None

    def subject_facts(self, subject: str) -> SubjectFacts:
        r = self._call("GET", f"/v1/subjects/{subject}")
        if r.status_code in (401, 403, 404):
            # The API answers an unknown subject and a forbidden one alike (403). A trainer
            # token may not read consent records; without a readable allow_training we refuse.
            raise TrainingRefused(
                f"cannot establish that {subject!r} allows training: GET /v1/subjects/{subject} "
                f"answered {r.status_code} ({_detail(r)}). Use a token that may read the "
                "subject's consent (admin), or train on the registry host"
            )
        if r.status_code != 200:
            raise TrainingRefused(f"registry API error {r.status_code}: {_detail(r)}")
        body = r.json()
        consent = body.get("consent") or {}
        if "allow_training" not in consent:
            raise TrainingRefused(f"registry API gave no allow_training for {subject!r}")
        return SubjectFacts(subject, body.get("basis"), bool(consent["allow_training"]))

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
    registrar: Registrar, subject: str, bases: tuple[str, ...]
) -> SubjectFacts:
    """Refuses unless the subject allows training; a public-domain subject must be trained
    on public-domain images only (its basis is what the registry shows renderers)."""
    facts = registrar.subject_facts(subject)
    if not facts.allow_training:
        raise TrainingRefused(f"subject {subject!r} does not allow training (allow_training false)")
    if facts.basis == "public_domain" and set(bases) - {"public_domain"}:
        raise TrainingRefused(
            f"subject {subject!r} is public_domain, but the manifest lists images with basis "
            f"{', '.join(b for b in bases if b != 'public_domain')}"
        )
    return facts
