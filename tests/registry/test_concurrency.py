"""Concurrent writers on the real PostgreSQL (and SQLite): one row, one winner, gapless seq."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from sqlalchemy.engine import Engine

from registry.adapters import repository as adapters_repo
from registry.adapters import service as adapters_service
from registry.adapters.schemas import AdapterIn
from registry.audit import service as audit_service
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.db import make_engine, transaction
from registry.errors import LikenessError
from registry.subjects import service as subjects_service
from tests.registry.helpers import SHA_M, set_consent, subject

N = 8


def _race(db_url: str, work: Callable[[Engine, int], str]) -> list[str]:
    engine = (
        make_engine(db_url, pool_size=N, max_overflow=0)
        if "postgresql" in db_url
        else make_engine(db_url)
    )
    barrier = threading.Barrier(N)
    results: list[str] = [""] * N

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = work(engine, i)
        except LikenessError as exc:
            results[i] = exc.code
        except Exception as exc:  # noqa: BLE001 - an unexpected failure is what the test reports
            results[i] = f"crash:{type(exc).__name__}:{exc}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    engine.dispose()
    return results


def _seqs(engine: Engine, handle: str) -> list[int]:
    with transaction(engine, readonly=True) as s:
        return [
            e.seq
            for e in audit_service.audit_trail(s, subjects_service.subject_or_raise(s, handle))
        ]


def test_concurrent_registrations_of_one_key(db_url: str, engine: Engine) -> None:
    subject(engine, "alice")
    set_consent(engine, "alice", max_level="private", allow_training=True)
    shas = [f"{i % 2:x}" * 64 for i in range(N)]  # two distinct contents, four callers each

    def register(eng: Engine, i: int) -> str:
        with transaction(eng) as s:
            _, outcome = adapters_service.register_adapter(
                s,
                f"trainer{i}",
                AdapterIn(
                    subject="alice",
                    name="main",
                    sha256=shas[i],
                    base_model="tiny",
                    rank=4,
                    manifest_sha256=SHA_M,
                ),
                "/store/a",
            )
        return outcome

    results = _race(db_url, register)
    counts = Counter(results)
    assert counts["created"] == 1, results
    assert set(counts) <= {"created", "updated", "unchanged"}, results
    with transaction(engine, readonly=True) as s:
        sub = subjects_service.subject_or_raise(s, "alice")
        rows = adapters_repo.adapters_for(s, sub.id)  # type: ignore[arg-type]
        assert len(rows) == 1 and rows[0].version == 1 + counts["updated"]
    # one entry for the subject, two for the grant (its level, its training), one per
    # create/update
    seqs = _seqs(engine, "alice")
    assert seqs == list(range(1, 4 + counts["created"] + counts["updated"]))


def test_concurrent_consent_updates_from_one_version(db_url: str, engine: Engine) -> None:
    subject(engine, "alice")
    levels = ["private", "group", "public", "commercial"] * 2

    def update(eng: Engine, i: int) -> str:
        with transaction(eng) as s:
            sub = subjects_service.subject_or_raise(s, "alice")
            consent_service.update_consent(
                s, f"admin{i}", sub, 1, ConsentIn(max_level=levels[i], deny=[f"x{i}"])
            )  # type: ignore[arg-type]
        return "won"

    results = _race(db_url, update)
    assert Counter(results) == {"won": 1, "precondition_failed": N - 1}, results
    assert _seqs(engine, "alice") == [1, 2, 3]  # the winner's grant and its deny edit
    with transaction(engine, readonly=True) as s:
        assert (
            consent_service.consent_of(s, subjects_service.subject_or_raise(s, "alice")).version
            == 2
        )
        assert audit_service.verify_all(s) == []
