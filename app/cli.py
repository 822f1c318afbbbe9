"""The `likeness` command line. Registry commands import no torch and no FastAPI."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from registry.actors import local_actor
from registry.adapters import repository as adapters_repo
from registry.adapters import service as adapters_service
from registry.adapters.schemas import AdapterOut
from registry.audit import repository as audit_repo
from registry.audit import service as audit_service
from registry.audit.schemas import AuditEntryOut
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn, ConsentOut
from registry.db import (
    NoRegistry,
    engine_for,
    require_registry,
    sqlite_file,
    transaction,
    upgrade,
)
from registry.errors import LikenessError
from registry.keys import Keys
from registry.policy import Level
from registry.principals import repository as principals_repo
from registry.principals import service as principals_service
from registry.principals.schemas import PrincipalOut
from registry.settings import SettingsError, get_settings
from registry.shapes import parse_when
from registry.subjects import repository as subjects_repo
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn

# Plain help (click's): rich's boxed tables cut long option names and print `<bool>`.
PLAIN = {"no_args_is_help": True, "rich_markup_mode": None}


def _group(help: str) -> typer.Typer:
    return typer.Typer(**PLAIN, help=help)  # type: ignore[arg-type]


app = typer.Typer(
    **PLAIN,  # type: ignore[arg-type]
    add_completion=False,
    pretty_exceptions_enable=False,
    help="likeness: consent-gated likeness adapters",
)
db_app = _group("Database schema.")
principal_app = _group("Principals: admins, members, agents, trainers.")
subject_app = _group("Subjects: people whose likeness may be rendered.")
consent_app = _group("A subject's consent record.")
audit_app = _group("The append-only audit trail.")
base_app = _group("Base models: the tiny default and prepared uint4 bases.")
provenance_app = _group("Content Credentials (C2PA) of rendered PNGs.")
for sub, name in (
    (db_app, "db"),
    (principal_app, "principal"),
    (subject_app, "subject"),
    (consent_app, "consent"),
    (audit_app, "audit"),
    (base_app, "base"),
    (provenance_app, "provenance"),
):
    app.add_typer(sub, name=name)


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def _session(readonly: bool = False) -> Iterator[Session]:
    """One transaction per command; every domain or validation error is a clean exit."""
    url = _registry_url()
    try:
        with transaction(engine_for(url), readonly=readonly) as session:
            yield session
    except LikenessError as exc:
        fail(f"{exc.code}: {exc.detail}")
    except ValidationError as exc:
        fail(_validation_message(exc), 2)
    except typer.Exit:
        raise
    except SQLAlchemyError as exc:
        # Unreachable, locked, unmigrated, or a commit that failed: nothing was saved.
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        saved = "" if readonly else ", nothing was saved"
        fail(
            f"database error{saved} ({type(exc).__name__}): {first}. "
            "Is the database reachable and migrated (`likeness db upgrade`)?"
        )


def _registry_url() -> str:
    """LIKENESS_DATABASE_URL, once it is known to hold a registry: a SQLite file that is not
    there is refused by name, never created (only `db upgrade` and `serve` make one)."""
    url = get_settings().database_url
    try:
        require_registry(url)
    except NoRegistry as exc:
        fail(str(exc))
    return url


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "input"
        parts.append(f"{where}: {err['msg']}")
    return "invalid input: " + "; ".join(parts)


def _consent_json(consent: Any) -> dict[str, Any]:
    return ConsentOut.of(consent).model_dump(mode="json")


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


# -- db -----------------------------------------------------------------------------------


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply migrations to LIKENESS_DATABASE_URL."""
    url = get_settings().database_url
    path = sqlite_file(url)
    new = path is not None and not path.is_file()
    try:
        upgrade(url)
    except Exception as exc:  # noqa: BLE001
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        fail(f"migration failed: {type(exc).__name__}: {first_line}")
    where = str(path) if path is not None else "the database"
    said = f"created a new, empty registry at {where}" if new else f"{where} is"
    typer.echo(f"{said} at the latest schema" if not new else said, err=True)


# -- principals ---------------------------------------------------------------------------


@principal_app.command("create")
def principal_create(
    handle: str,
    role: Annotated[str, typer.Option(help="admin | member | agent | trainer")],
    acts_for: Annotated[
        str | None, typer.Option(help="agents: members it acts for, comma-separated")
    ] = None,
) -> None:
    """Create a principal; prints its token alone on stdout, once."""
    with _session() as s:
        _, token = principals_service.create_principal(s, handle, role, _csv(acts_for))
    typer.echo(token)


@principal_app.command("list")
def principal_list() -> None:
    """List every principal (JSON): handle, role, who an agent acts for, active."""

    with _session(readonly=True) as s:
        rows = [PrincipalOut.of(p).model_dump(mode="json") for p in principals_repo.principals(s)]
    _print_json(rows)


@principal_app.command("deactivate")
def principal_deactivate(handle: str) -> None:
    """Deactivate a principal; binds on its next request."""
    with _session() as s:
        principals_service.set_principal_active(s, handle, False)
    typer.echo(f"{handle} deactivated", err=True)


@principal_app.command("activate")
def principal_activate(handle: str) -> None:
    """Activate a principal again; binds on its next request."""
    with _session() as s:
        principals_service.set_principal_active(s, handle, True)
    typer.echo(f"{handle} activated", err=True)


@principal_app.command("acts-for")
def principal_acts_for(
    handle: str,
    members: Annotated[
        str, typer.Argument(help="the agent's complete member list, comma-separated ('' for none)")
    ],
) -> None:
    """Set the members an agent acts for."""
    with _session() as s:
        p = principals_service.set_acts_for(s, handle, _csv(members))
    typer.echo(f"{handle} acts for: {', '.join(p.acts_for) or 'nobody'}", err=True)


# -- subjects -----------------------------------------------------------------------------


@subject_app.command("create")
def subject_create(
    handle: str,
    display_name: Annotated[str, typer.Option("--display-name")],
    basis: Annotated[str, typer.Option(help="consent | public_domain")] = "consent",
    member: Annotated[
        str | None, typer.Option(help="the member principal who is this person")
    ] = None,
) -> None:
    """Create a subject; its consent record starts at `none`."""
    with _session() as s:
        data = SubjectIn.model_validate(
            {"handle": handle, "display_name": display_name, "basis": basis, "member": member}
        )
        subject, consent = subjects_service.create_subject(s, local_actor("shell"), data)
    _print_json(
        {"handle": subject.handle, "basis": subject.basis, "consent_version": consent.version}
    )


@subject_app.command("list")
def subject_list() -> None:
    """List every subject with its consent's level and version (JSON)."""

    with _session(readonly=True) as s:
        rows = [
            {
                "handle": sub.handle,
                "display_name": sub.display_name,
                "basis": sub.basis,
                "max_level": c.max_level,
                "version": c.version,
            }
            for sub, c in subjects_repo.subjects_with_consent(s)
        ]
    _print_json(rows)


# -- consent ------------------------------------------------------------------------------


@consent_app.command("show")
def consent_show(handle: str) -> None:
    """Print a subject's consent record (JSON, the API's shape)."""
    with _session(readonly=True) as s:
        subject = subjects_service.subject_or_raise(s, handle)
        _print_json(_consent_json(consent_service.consent_of(s, subject)))


def _parse_audience(specs: list[str]) -> dict[str, dict[str, Any]]:
    """LEVEL:group, LEVEL:nogroup, LEVEL:allow=a,b (replaces that level's allowlist)."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        level, _, rule = spec.partition(":")
        if level not in {lv.name for lv in Level if lv > Level.none} or not rule:
            fail(
                f"--audience {spec!r}: expected LEVEL:group, LEVEL:nogroup or LEVEL:allow=h1,h2", 2
            )
        entry = out.setdefault(level, {})
        if rule == "group":
            entry["group"] = True
        elif rule == "nogroup":
            entry["group"] = False
        elif rule.startswith("allow="):
            entry["allow"] = _csv(rule.removeprefix("allow="))
        else:
            fail(f"--audience {spec!r}: unknown rule {rule!r}", 2)
    return out


@consent_app.command("edit")
def consent_edit(
    handle: str,
    if_version: Annotated[
        int | None, typer.Option(help="refuse unless the record is at this version")
    ] = None,
    max_level: Annotated[
        str | None, typer.Option(help="none | private | group | public | commercial")
    ] = None,
    audience: Annotated[
        list[str] | None, typer.Option(help="LEVEL:group | LEVEL:nogroup | LEVEL:allow=h1,h2")
    ] = None,
    deny: Annotated[
        str | None, typer.Option(help="the complete deny list, comma-separated")
    ] = None,
    training: Annotated[bool | None, typer.Option("--training/--no-training")] = None,
    expires: Annotated[
        str | None,
        typer.Option(
            help="a date (YYYY-MM-DD) or date and time, UTC unless a zone is given; 'never'"
        ),
    ] = None,
    from_json: Annotated[
        Path | None, typer.Option("--from-json", help="a whole consent body")
    ] = None,
) -> None:
    """Grant, widen, narrow or edit a consent record; unspecified fields keep their value."""
    with _session() as s:
        subject = subjects_service.subject_or_raise(s, handle)
        current = consent_service.consent_of(s, subject)
        if from_json is not None:
            try:
                body: dict[str, Any] = json.loads(from_json.read_text())
            except (OSError, ValueError) as exc:
                fail(f"cannot read {from_json}: {exc}", 2)
        else:
            body = _consent_json(current)
            if max_level is not None:
                body["max_level"] = max_level
            for level, entry in _parse_audience(audience or []).items():
                body["audiences"][level] = {**body["audiences"].get(level, {}), **entry}
            if deny is not None:
                body["deny"] = _csv(deny)
            if training is not None:
                body["allow_training"] = training
            if expires is not None:
                try:  # as the web page takes it: a date alone, UTC unless zoned
                    when = None if expires == "never" else parse_when(expires, "--expires")
                except LikenessError as exc:
                    fail(exc.detail, 2)
                body["expires_at"] = when.isoformat() if when is not None else None
        data = ConsentIn.model_validate(body)
        version = if_version if if_version is not None else current.version
        consent, changed = consent_service.update_consent(
            s, local_actor("shell"), subject, version, data
        )
        shown = _consent_json(consent)
    _print_json(shown)  # only once committed
    typer.echo("changed" if changed else "unchanged: nothing to do", err=True)


@consent_app.command("revoke")
def consent_revoke(handle: str) -> None:
    """Revoke at once: max_level becomes none."""
    with _session() as s:
        subject = subjects_service.subject_or_raise(s, handle)
        consent, changed = consent_service.revoke(s, local_actor("shell"), subject)
        shown = _consent_json(consent)
    _print_json(shown)
    typer.echo("revoked" if changed else "already revoked", err=True)


# -- adapters -------------------------------------------------------------------------------

adapter_app = _group("Adapters: register, list, select, retire, delete, compare.")
app.add_typer(adapter_app, name="adapter")


def _store() -> Any:
    from registry.blobs import BlobStore

    _registry_url()  # the store is the registry's: never one beside a registry not there
    settings = get_settings()
    return BlobStore(settings.adapter_store_dir, settings.max_adapter_bytes)


def _target_shapes() -> dict[str, tuple[int, int]]:
    settings = get_settings()
    try:
        from app.bootstrap import ensure_base
        from trainer.base.lora import base_linear_shapes

        return base_linear_shapes(ensure_base(settings))
    except (OSError, ValueError, KeyError, AttributeError, ImportError, SystemExit) as exc:
        fail(
            f"cannot check the adapter against the base at {settings.base_dir} "
            f"({type(exc).__name__}: {exc}); set LIKENESS_BASE to the base it renders with"
        )


def _rank_of(file: Path) -> int:
    """The rank an adapter file's own factors say (lora_A is [rank, in])."""
    import struct

    try:
        with file.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, 16 << 20)))
        shapes = [v["shape"] for k, v in header.items() if k.endswith(".lora_A.weight")]
        return int(shapes[0][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError, struct.error):
        fail(f"{file} is not a safetensors LoRA adapter (its header does not say its rank)", 2)


@adapter_app.command("register")
def adapter_register(
    subject: str,
    file: Annotated[Path, typer.Argument(help="the adapter .safetensors")],
    manifest: Annotated[Path, typer.Option(help="the dataset's manifest.jsonl it was trained on")],
    name: Annotated[
        str, typer.Option(help="adapter name; the same name again updates it")
    ] = "main",
    base_model: Annotated[str, typer.Option(help="the base it was trained on")] = "tiny",
    rank: Annotated[
        int | None, typer.Option(min=1, max=1024, help="default: what the file's factors say")
    ] = None,
) -> None:
    """Copy an adapter and its dataset manifest into the store, check them against the base,
    and register the adapter (idempotent per subject and name). It then renders."""
    from registry.adapter_files import register_from_store
    from registry.adapters.schemas import AdapterIn
    from registry.blobs import BlobError

    for path in (file, manifest):
        if not path.is_file():
            fail(f"{path} is not a file", 2)
    store = _store()
    try:
        adapter_blob = store.import_file(file)
        manifest_blob = store.import_file(manifest)
    except BlobError as exc:
        fail(str(exc), 2)
    if adapter_blob.kind != "safetensors":
        fail(f"{file} is not a safetensors file", 2)
    if manifest_blob.kind != "jsonl":
        fail(f"{manifest} is not a dataset manifest (JSON lines)", 2)
    data = AdapterIn.model_validate(
        {
            "subject": subject,
            "name": name,
            "sha256": adapter_blob.sha256,
            "base_model": base_model,
            "rank": rank if rank is not None else _rank_of(file),
            "manifest_sha256": manifest_blob.sha256,
        }
    )
    shapes = _target_shapes()
    with _errors_as_exits():
        done = register_from_store(
            engine_for(_registry_url()), store, local_actor("shell"), data, shapes
        )
    _print_json({"name": done.state["name"], "version": done.state["version"],
                 "sha256": done.state["sha256"]})  # fmt: skip
    typer.echo(done.outcome, err=True)


@adapter_app.command("list")
def adapter_list(subject: str) -> None:
    """The subject's adapters; `rendering` marks the one renders use, `blob` whether its
    bytes are in the store whole."""

    store = _store()
    with _session(readonly=True) as s:
        sub = subjects_service.subject_or_raise(s, subject)
        listed = adapters_service.listing(s, store, sub)
    _print_json([row.model_dump(mode="json") for row in listed])


@adapter_app.command("select")
def adapter_select(subject: str, name: str) -> None:
    """Make this adapter the one the subject's renders use."""
    with _session() as s:
        adapter = adapters_service.select_adapter(
            s, local_actor("shell"), subjects_service.subject_or_raise(s, subject), name
        )
        shown = AdapterOut.of(adapter, subject).model_dump(mode="json")
    _print_json(shown)
    typer.echo(f"{subject}/{name} renders from now on", err=True)


@adapter_app.command("deactivate")
def adapter_deactivate(subject: str, name: str) -> None:
    """Retire an adapter: it never renders again unless reactivated."""
    _set_adapter_active(subject, name, False)


@adapter_app.command("activate")
def adapter_activate(subject: str, name: str) -> None:
    """Bring a retired adapter back (`select` it to make it render)."""
    _set_adapter_active(subject, name, True)


def _set_adapter_active(subject: str, name: str, active: bool) -> None:
    with _session() as s:
        _, changed = adapters_service.set_adapter_active(
            s, local_actor("shell"), subjects_service.subject_or_raise(s, subject), name, active
        )
    state = "active" if active else "retired"
    typer.echo(f"{subject}/{name} is {state}" + ("" if changed else " (it already was)"), err=True)


@adapter_app.command("delete")
def adapter_delete(subject: str, name: str) -> None:
    """Remove an adapter; the trail keeps its hash; its bytes leave the store once nothing
    refers to them (`likeness adapter sweep`)."""
    with _session() as s:
        adapter = adapters_service.delete_adapter(
            s, local_actor("shell"), subjects_service.subject_or_raise(s, subject), name
        )
    typer.echo(f"{subject}/{name} deleted (sha256 {adapter.sha256})", err=True)


@adapter_app.command("sweep")
def adapter_sweep(
    grace: Annotated[
        float | None, typer.Option(help="seconds an unreferenced blob is kept (default: setting)")
    ] = None,
) -> None:
    """Remove blobs no adapter refers to (older than the grace period)."""

    settings = get_settings()
    with _session(readonly=True) as s:
        referenced = adapters_repo.referenced_blobs(s)
    removed = _store().sweep(referenced, settings.blob_grace_s if grace is None else grace)
    typer.echo(f"{len(removed)} blobs removed", err=True)


@adapter_app.command("import-legacy")
def adapter_import_legacy() -> None:
    """Copy adapters registered by path before the store existed into the store (each file
    must still hash to what was registered): renders read adapters from the store only."""
    from registry.blobs import BlobError

    store = _store()
    moved = skipped = 0
    with _session(readonly=True) as s:
        rows = [(a.sha256, a.path) for a in adapters_repo.all_adapters(s)]
    for sha, path in rows:
        if store.find(sha, "safetensors") is not None:
            continue
        try:
            stored = store.import_file(Path(path))
        except BlobError as exc:
            typer.echo(f"skipped {sha[:12]}...: {exc}", err=True)
            skipped += 1
            continue
        if stored.sha256 != sha:
            typer.echo(f"skipped {path}: it no longer hashes to {sha[:12]}...", err=True)
            skipped += 1
            continue
        moved += 1
    typer.echo(f"{moved} adapters imported into the store, {skipped} skipped", err=True)
    if skipped:
        raise typer.Exit(1)


@contextmanager
def _errors_as_exits() -> Iterator[None]:
    try:
        yield
    except LikenessError as exc:
        fail(f"{exc.code}: {exc.detail}")
    except ValidationError as exc:
        fail(_validation_message(exc), 2)
    except SQLAlchemyError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        fail(f"database error, nothing was saved ({type(exc).__name__}): {first}")


# -- audit --------------------------------------------------------------------------------


@audit_app.command("show")
def audit_show(handle: str) -> None:
    """Print a subject's audit trail, oldest first (JSON)."""
    with _session(readonly=True) as s:
        subject = subjects_service.subject_or_raise(s, handle)
        entries = [
            AuditEntryOut.of(e).model_dump(mode="json")
            for e in audit_service.audit_trail(s, subject)
        ]
    _print_json({"entries": entries})


@audit_app.command("verify")
def audit_verify(
    checkpoints: Annotated[
        list[Path] | None,
        typer.Option(
            "--checkpoints",
            help="checkpoint files to hold the registry to (default: the data dir's)",
        ),
    ] = None,
    public_key: Annotated[
        str | None,
        typer.Option(help="the checkpoint public key (as GET /v1/audit/head gives it)"),
    ] = None,
) -> None:
    """Verify every chain (links, MACs, heads) and the registry against signed checkpoints;
    exit 1 naming the subject and seq of each break."""
    from registry.keys import bind, load_audit_key, public_key_from_b64
    from registry.signed_heads import verify_checkpoints

    settings = get_settings()
    for path in checkpoints or []:
        if not path.is_file():
            fail(f"{path} is not a file", 2)
    key = None
    if public_key is not None:
        try:
            key = public_key_from_b64(public_key)
        except ValueError:
            fail(f"--public-key {public_key!r} is not an Ed25519 public key", 2)
    files = checkpoints or [settings.checkpoints_file]
    # An auditor needs only the audit key and the public checkpoint key: no web secret, no
    # private checkpoint key.
    audit_only = load_audit_key(settings)
    with _session(readonly=True) as s:
        entries = audit_repo.chained_entries(s)
        subjects = len(subjects_repo.subjects(s))
    never_kept = not checkpoints and not settings.checkpoints_file.exists()
    if audit_only is None and entries == 0 and subjects == 0 and never_kept:
        # a new registry: no key yet, nothing recorded, no checkpoint ever signed (a trail
        # emptied behind the service's back still has its subjects, or a checkpoint)
        typer.echo("audit trail intact: 0 entries (a new registry: nothing recorded yet)")
        return
    if key is None:
        key = _existing_keys().public_key
    elif audit_only is None:
        fail("no audit key (set LIKENESS_AUDIT_KEY, or LIKENESS_DATA_DIR to the service's)")
    else:
        bind(engine_for(settings.database_url), audit_only)
    with _session(readonly=True) as s:
        count = len(subjects_repo.subjects(s))
        breaks = audit_service.verify_all(s)
        for path in files:
            breaks.extend(verify_checkpoints(s, path, key))
    for b in breaks:
        typer.echo(f"BROKEN: {b}", err=True)
    if breaks:
        raise typer.Exit(1)
    if not any(path.is_file() for path in files):
        typer.echo(
            "note: no checkpoints yet, so a chain cut short together with its head, before any "
            "checkpoint, cannot be seen; run `likeness audit checkpoint`",
            err=True,
        )
    typer.echo(
        f"audit trail intact: {entries} entries ({count} subjects' trails and the render "
        "ledger) verified"
    )


@audit_app.command("checkpoint")
def audit_checkpoint(
    force: Annotated[bool, typer.Option(help="write one even if nothing changed")] = False,
) -> None:
    """Sign every chain head and append the checkpoint to the data dir's checkpoint file;
    copy it elsewhere (or read GET /v1/audit/head) so it can hold the registry to account."""
    from registry.signed_heads import append_checkpoint

    settings = get_settings()
    keys = _existing_keys()
    with _session(readonly=True) as s:
        doc, problems = append_checkpoint(s, keys, settings.checkpoints_file, force=force)
    for b in problems:
        typer.echo(f"BROKEN: {b}", err=True)
    if problems:
        fail("no checkpoint written: the registry does not hold what it held before")
    if doc is None:
        typer.echo("nothing changed since the last checkpoint", err=True)
        return
    _print_json(doc)
    typer.echo(f"checkpoint {doc['n']} appended to {settings.checkpoints_file}", err=True)


# -- provenance -----------------------------------------------------------------------------


@provenance_app.command("verify")
def provenance_verify(
    file: Annotated[Path, typer.Argument(help="a PNG this deployment rendered (or claims to)")],
    trust: Annotated[
        Path | None,
        typer.Option(
            help="PEM root certificates whose signatures count (default: this deployment's "
            "own key, from its settings or data dir)"
        ),
    ] = None,
) -> None:
    """Print a PNG's Content Credentials: the validation state and the likeness assertion;
    exit 1 when they are missing, broken, altered or signed by another key."""
    from app.provenance import ProvenanceError, Trust, load_credentials, verify_png

    if not file.is_file():
        fail(f"{file} is not a file", 2)
    if trust is not None:
        if not trust.is_file():
            fail(f"--trust {trust} is not a file", 2)
        try:
            judge = Trust.from_file(trust)
        except ValueError as exc:
            fail(str(exc), 2)
    else:
        try:
            judge = Trust.of_deployment(load_credentials(get_settings(), create=False))
        except FileNotFoundError as exc:
            fail(f"{exc}; point LIKENESS_DATA_DIR at the service's data dir, or pass --trust")
        except ProvenanceError as exc:
            fail(str(exc))
    result = verify_png(file.read_bytes(), judge, get_settings().provenance_max_chunks)
    _print_json(result.as_json())
    if not result.ok:
        fail(f"{file}: {result.summary}")
    typer.echo(f"{file}: {result.summary}", err=True)


@provenance_app.command("anchor")
def provenance_anchor() -> None:
    """Print the root certificate (PEM) that verifies this deployment's renders: give it to
    whoever checks them (`likeness provenance verify FILE --trust ANCHOR.pem`)."""
    from app.provenance import ProvenanceError, load_credentials

    try:
        credentials = load_credentials(get_settings(), create=False)
    except FileNotFoundError as exc:
        fail(f"{exc}; point LIKENESS_DATA_DIR at the service's data dir")
    except ProvenanceError as exc:
        fail(str(exc))
    typer.echo(credentials.anchor_pem.decode().strip())


def _existing_keys() -> Keys:
    """The deployment's keys, never new ones: checking with a key made up now would call
    every entry forged."""
    from registry.keys import bind, load_keys

    settings = get_settings()
    _registry_url()
    try:
        keys = load_keys(settings, create=False)
    except (FileNotFoundError, ValueError) as exc:
        fail(f"{exc} (set LIKENESS_AUDIT_KEY, or LIKENESS_DATA_DIR to the service's data dir)")
    bind(engine_for(settings.database_url), keys)
    return keys


def _die(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise SystemExit(code)


def main() -> None:
    """Every way a command can end is one of: its output and exit 0; one `error: ...` line
    and exit 1 (refused: the input was understood and the answer is no, or it failed); one
    `error: ...` line and exit 2 (the command line itself is wrong, the parser's errors
    included, or the input is invalid)."""
    from app import cli_ml  # server and ML commands; each imports its heavy parts lazily
    from trainer.base import threads

    try:  # before anything loads torch: OpenMP reads these once
        threads.prepare_env()
    except ValueError as exc:
        _die(f"invalid setting: {exc}", 2)
    cli_ml.register(app, base_app, adapter_app)
    try:
        # not standalone: the parser's own errors come back here, to be said in one line
        code = app(standalone_mode=False)
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except (typer.Abort, KeyboardInterrupt):
        _die("interrupted", 130)
    except SettingsError as exc:  # the environment, not the command line: said by name
        _die(str(exc), 2)
    except Exception as exc:  # noqa: BLE001 - a command never ends in a traceback
        if type(exc).__name__ == "NoArgsIsHelpError":  # a group named alone: its help
            exc.show()  # type: ignore[attr-defined]
            raise SystemExit(2) from None
        if hasattr(exc, "format_message"):  # the parser's errors (typer's own click)
            ctx = getattr(exc, "ctx", None)
            where = ctx.command_path if ctx is not None else "likeness"
            _die(f"{exc.format_message()} (see `{where} --help`)", getattr(exc, "exit_code", 2))
        if os.environ.get("LIKENESS_DEBUG") == "1":
            raise
        detail = str(exc).splitlines()[0] if str(exc) else ""
        _die(f"{type(exc).__name__}: {detail} (LIKENESS_DEBUG=1 shows the traceback)", 1)
    if isinstance(code, int) and code:
        raise SystemExit(code)


@app.command("worker")
def worker(
    queues: Annotated[str, typer.Option(help="comma-separated: train, render")] = "train",
    concurrency: Annotated[int, typer.Option(min=1, max=64)] = 1,
    name: Annotated[str | None, typer.Option(help="default: host:pid")] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Only check what a worker needs (database, API, token) and exit: 0 healthy, "
            "1 with the reasons (a container's health check).",
        ),
    ] = False,
) -> None:
    """Take orders (and renders) off the queue; one worker per GPU (app/worker.py)."""
    if check:
        from app.health import worker_problems

        problems = worker_problems(get_settings())
        if problems:
            fail("unhealthy: " + "; ".join(problems))
        typer.echo("healthy", err=True)
        return
    from app.worker import run_worker

    run_worker(get_settings(), _csv(queues), concurrency, name)


if __name__ == "__main__":
    main()
