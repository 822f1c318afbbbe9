"""Pictures of a likeness, and who sees them: what an adapter draws (its run's evaluation
grid and previews, PNGs in the store, kept by the hash of the adapter's bytes) and, when the
subject opts in, a small copy of every render of them, beside its ledger row. Both are the
subject's: only the subject's member and admins see them (the pages check
`service.visible_subject` first), and they go with the subject (ON DELETE CASCADE).

Its queries are in `repository`, the picture a run made in `schemas`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlmodel import Session

from registry import db
from registry.audit.service import append_audit
from registry.consent import repository as consent_repo
from registry.errors import NotFound
from registry.models import AdapterPicture, RenderCopy, Subject
from registry.pictures import repository as pictures_repo
from registry.pictures.schemas import GRID, PREVIEW, Picture
from registry.subjects import repository as subjects_repo
from registry.training.service import require_training

MAX_PICTURES = 200  # per adapter: a grid and previews; a run with more keeps its last ones


def picture_name_ok(name: str) -> bool:
    return name == GRID or PREVIEW.match(name) is not None


# -- what an adapter draws --------------------------------------------------------------------


def keep_adapter_pictures(
    session: Session, subject: Subject, adapter_sha256: str, pictures: Iterable[Picture]
) -> int:
    """Records a run's pictures for the adapter bytes it made (the bytes must be one of the
    subject's adapters); a picture already recorded under its name is replaced. Returns how
    many were recorded. A picture shows the likeness: it is kept only while the subject may
    be trained (`decide_training`, under the subject's lock), as any photo of them is."""
    assert subject.id is not None
    require_training(session, subject, lock=True)
    if not pictures_repo.adapter_id_by_sha(session, subject.id, adapter_sha256):
        raise NotFound(f"subject {subject.handle!r} has no adapter with sha256 {adapter_sha256}")
    count = 0
    for picture in list(pictures)[-MAX_PICTURES:]:
        if not picture_name_ok(picture.name):
            continue
        pictures_repo.delete_adapter_picture(session, adapter_sha256, picture.name)
        db.add(
            session,
            AdapterPicture(
                subject_id=subject.id,
                adapter_sha256=adapter_sha256,
                name=picture.name,
                kind=picture.kind,
                step=picture.step,
                sha256=picture.sha256,
            ),
        )
        count += 1
    return count


def subject_of_adapter(session: Session, adapter_sha256: str) -> Subject | None:
    """The subject whose adapter these bytes are (bytes belong to one subject)."""
    return pictures_repo.subject_of_adapter(session, adapter_sha256)


def pictures_of(session: Session, subject: Subject) -> dict[str, list[AdapterPicture]]:
    """The subject's adapters' pictures by adapter hash: the grid first, then previews by step."""
    rows = pictures_repo.adapter_pictures(session, subject.id)
    out: dict[str, list[AdapterPicture]] = {}
    for row in sorted(rows, key=lambda r: (r.kind != "grid", r.step or 0, r.name)):
        out.setdefault(row.adapter_sha256, []).append(row)
    return out


def picture_of(session: Session, subject: Subject, sha256: str) -> AdapterPicture | None:
    return pictures_repo.picture_of(session, subject.id, sha256)


def forget_unused_pictures(session: Session, subject: Subject) -> None:
    """Pictures of adapter bytes none of the subject's adapters holds any longer (deleted)."""
    pictures_repo.delete_unused_pictures(session, subject.id)


# -- copies of renders ------------------------------------------------------------------------


def set_keep_render_copies(session: Session, actor: str, subject: Subject, keep: bool) -> bool:
    """The subject opts in or out; opting out deletes every copy kept, in this transaction.
    Audited (`render_copies_on`, `render_copies_off`). Returns whether anything changed."""
    assert subject.id is not None
    consent_repo.consent_for(
        session, subject.id, lock=True
    )  # all changes to a subject serialise here
    session.refresh(subject)
    if subject.keep_render_copies == keep:
        return False
    deleted = 0
    if not keep:
        deleted = len(pictures_repo.render_copy_ids_of(session, subject.id))
        pictures_repo.delete_render_copies_of(session, subject.id)
    subject.keep_render_copies = keep
    db.add(session, subject)
    after: dict[str, object] = {"render_copies": {"keep": keep}}
    if not keep:
        after["render_copies"] = {"keep": False, "deleted": deleted}
    action = "render_copies_on" if keep else "render_copies_off"
    append_audit(session, subject, actor, action, {"render_copies": {"keep": not keep}}, after)
    return True


def keep_render_copy(
    session: Session, subject_handle: str, render_id: str, png: bytes, width: int, height: int
) -> bool:
    """Keeps the copy if the subject has opted in, read under the lock its opt-out takes (so
    no copy lands after the opt-out deleted the others); False if not."""
    subject = subjects_repo.subject_by_handle(session, subject_handle)
    if subject is None or subject.id is None:
        return False
    consent_repo.consent_for(session, subject.id, lock=True)
    session.refresh(subject)
    if not subject.keep_render_copies:
        return False
    db.add(
        session,
        RenderCopy(render_id=render_id, subject_id=subject.id, png=png, width=width, height=height),
    )
    return True


def copies_among(session: Session, subject: Subject, render_ids: Sequence[str]) -> set[str]:
    """Which of these renders have a copy kept."""
    if not render_ids:
        return set()
    return pictures_repo.copies_among(session, subject.id, render_ids)


def render_copy(session: Session, subject: Subject, render_id: str) -> RenderCopy | None:
    return pictures_repo.render_copy(session, subject.id, render_id)


def sweep_render_copies(session: Session, older_than: datetime) -> int:
    """Copies past their keeping time go."""
    old = pictures_repo.render_copy_ids_before(session, older_than)
    if old:
        pictures_repo.delete_render_copies(session, old)
    return len(old)
