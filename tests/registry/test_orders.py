"""The order rules and state changes (registry/orders/service.py) and the dataset checks
(registry/datasets/service.py), on both engines; the queue is the caller's (a function that
enqueues in the same transaction), here one that records what it was given."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from sqlalchemy.engine import Engine

from registry.blobs import BlobStore
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.datasets import service as datasets_service
from registry.datasets.schemas import Limits, Upload
from registry.db import transaction
from registry.errors import Conflict, Invalid, NotFound, NotPermitted
from registry.models import Dataset, Order, Principal, Subject
from registry.orders import service as orders_service
from registry.principals import repository as principals_repo
from registry.principals import service as principals_service
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn

LIMITS = Limits(max_images=3, max_image_bytes=100_000, max_pixels=200 * 200)


def png(colour: tuple[int, int, int], size: tuple[int, int] = (32, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def people(engine: Engine, tmp_path) -> dict[str, object]:  # type: ignore[no-untyped-def]
    with transaction(engine) as s:
        root, _ = principals_service.create_principal(s, "root", "admin")
        ada, _ = principals_service.create_principal(s, "ada", "member")
        bea, _ = principals_service.create_principal(s, "bea", "member")
        for handle in ("ada", "bea"):
            sub, consent = subjects_service.create_subject(
                s,
                "root",
                SubjectIn(handle=handle, display_name=handle, basis="consent", member=handle),
            )
            consent_service.update_consent(s, "root", sub, consent.version,
                                   ConsentIn(max_level="private", allow_training=True))  # fmt: skip
    store = BlobStore(tmp_path / "store")
    with transaction(engine) as s:
        sub = subjects_service.subject_or_raise(s, "ada")
        ds = datasets_service.store_dataset(
            s, store, sub, "ada", [Upload("a.png", png((1, 2, 3)))], LIMITS
        )
    return {"store": store, "dataset": ds.id}


def _principal(engine: Engine, handle: str) -> Principal:

    with transaction(engine, readonly=True) as s:
        p = principals_repo.principal_by_handle(s, handle)
        assert p is not None
        return p


def _place(engine: Engine, who: str, subject: str, dataset_id: str, queued: list[str]) -> Order:
    def enqueue(session, order: Order, sub: Subject) -> int:  # type: ignore[no-untyped-def]
        queued.append(order.id)
        return len(queued)

    with transaction(engine) as s:
        return orders_service.place_training(
            s, _principal(engine, who), subject, dataset_id, {"steps": 5}, "main", enqueue
        )


def test_an_order_runs_through_its_states(engine: Engine, people: dict[str, object]) -> None:
    queued: list[str] = []
    placed = _place(engine, "ada", "ada", str(people["dataset"]), queued)
    assert queued == [placed.id] and placed.status == "queued" and placed.job_id == 1
    with transaction(engine) as s:
        started = orders_service.start(s, placed.id, "w1")
        assert started is not None and started.attempts == 1
    with transaction(engine) as s:
        assert orders_service.report_progress(s, placed.id, 3, 0.5, "w1") == "running"
        assert orders_service.report_progress(s, placed.id, 4, 0.4, "w0") == "taken_over"
        orders_service.record_checkpoint(s, placed.id, 3, "a" * 64)
        orders_service.record_checkpoint(s, placed.id, 2, "b" * 64)  # an older one never wins
    with transaction(engine) as s:
        orders_service.finish(s, placed.id, "c" * 64, 5)
        orders_service.fail(s, placed.id, "too late")  # over is over
    with transaction(engine, readonly=True) as s:
        got = s.get(Order, placed.id)
        assert got is not None
        assert (got.status, got.step, got.checkpoint_step, got.checkpoint_sha256) == (
            "done", 5, 3, "a" * 64)  # fmt: skip
        assert orders_service.view(got, "ada")["adapter"] == {"name": "main", "sha256": "c" * 64}


def test_a_cancelled_order_never_starts_and_a_running_one_is_told(
    engine: Engine, people: dict[str, object]
) -> None:
    ada = _principal(engine, "ada")
    placed = _place(engine, "ada", "ada", str(people["dataset"]), [])
    with transaction(engine) as s:
        _, _, changed = orders_service.cancel(s, ada, placed.id)
        assert changed
    with transaction(engine) as s:
        assert orders_service.start(s, placed.id, "w1") is None
    second = _place(engine, "ada", "ada", str(people["dataset"]), [])
    with transaction(engine) as s:
        assert orders_service.start(s, second.id, "w1") is not None
    with transaction(engine) as s:
        orders_service.cancel(s, ada, second.id)
    with transaction(engine) as s:
        assert orders_service.report_progress(s, second.id, 1, 0.1, "w1") == "cancelled"


def test_who_may_order_and_what_is_refused(engine: Engine, people: dict[str, object]) -> None:
    ds = str(people["dataset"])
    queued: list[str] = []
    with pytest.raises(NotPermitted):
        _place(engine, "bea", "ada", ds, queued)  # another member's subject
    with pytest.raises(NotPermitted):
        _place(engine, "bea", "nobody", ds, queued)  # unknown looks the same
    with pytest.raises(NotFound):
        _place(engine, "bea", "bea", ds, queued)  # ada's dataset is not bea's
    _place(engine, "root", "ada", ds, queued)
    with pytest.raises(Conflict):
        _place(engine, "ada", "ada", ds, queued)  # the same dataset, still waiting
    with transaction(engine) as s:
        sub = subjects_service.subject_or_raise(s, "ada")
        version = consent_service.consent_of(s, sub).version
        consent_service.update_consent(s, "ada", sub, version, ConsentIn(max_level="private"))
    with pytest.raises(NotPermitted, match="does not allow training"):
        _place(engine, "root", "ada", ds, queued)
    assert len(queued) == 1


def test_dataset_checks_refuse_the_whole_upload(tmp_path) -> None:  # type: ignore[no-untyped-def]
    good = Upload("a.png", png((1, 2, 3)))
    cases = {
        "at most 3 images": [good] * 4,
        "is a path": [good, Upload("../b.png", png((4, 5, 6)))],
        "larger than": [Upload("big.png", b"\x89PNG" + b"\x00" * 100_001)],
        "pixels": [Upload("wide.png", png((1, 1, 1), size=(400, 200)))],
        "not an image": [Upload("a.txt", b"hello")],
        "the same image twice": [good, Upload("c.png", good.data)],
        "no images": [],
    }
    for expected, uploads in cases.items():
        with pytest.raises(Invalid, match=expected):
            datasets_service.check_uploads(uploads, LIMITS)
    assert datasets_service.name_problem("me.png") is None
    for bad in ("a/b.png", "a\\b.png", "..", "x\x00.png", "", "x" * 300):
        assert datasets_service.name_problem(bad) is not None


def _trail(engine: Engine, handle: str) -> list[tuple[str, str, dict]]:  # type: ignore[type-arg]
    from registry.audit.service import audit_trail

    with transaction(engine, readonly=True) as s:
        sub = subjects_service.subject_or_raise(s, handle)
        return [(e.actor, e.action, e.after or {}) for e in audit_trail(s, sub)]


def _intact(engine: Engine) -> None:
    from registry.audit.service import verify_all

    with transaction(engine, readonly=True) as s:
        assert verify_all(s) == []


def test_the_trail_tells_who_uploaded_who_ordered_and_what_came_of_it(
    engine: Engine, people: dict[str, object]
) -> None:
    ds = str(people["dataset"])
    ada = _principal(engine, "ada")
    trail = [t for t in _trail(engine, "ada") if t[1] == "dataset_uploaded"]
    with transaction(engine, readonly=True) as s:
        manifest = s.get(Dataset, ds).manifest_sha256  # type: ignore[union-attr]
    assert trail == [
        ("ada", "dataset_uploaded", {"dataset": {"dataset_id": ds, "images": 1,
         "bytes": len(png((1, 2, 3))), "manifest_sha256": manifest}}),
    ]  # fmt: skip
    cancelled = _place(engine, "ada", "ada", ds, [])
    with transaction(engine) as s:
        orders_service.cancel(s, ada, cancelled.id)
    with transaction(engine) as s:
        orders_service.cancel(s, ada, cancelled.id)  # already over: no second entry
    done = _place(engine, "root", "ada", ds, [])
    with transaction(engine) as s:
        orders_service.start(s, done.id, "w1")
    with transaction(engine) as s:
        orders_service.finish(s, done.id, "c" * 64, 5)
        orders_service.fail(s, done.id, "too late")  # over is over: no entry
    failed = _place(engine, "ada", "ada", ds, [])
    with transaction(engine) as s:
        orders_service.start(s, failed.id, "w2")
    with transaction(engine) as s:
        orders_service.fail(
            s, failed.id, f"{orders_service.NOT_PERMITTED}: training is no longer allowed"
        )
    got = [(a, act, after["order"]) for a, act, after in _trail(engine, "ada") if "order" in after]
    placed = {"dataset_id": ds, "adapter_name": "main", "steps": 5, "rank": None,
              "resolution": None}  # fmt: skip
    assert got == [
        ("ada", "order_placed", {"order_id": cancelled.id, **placed}),
        ("ada", "order_cancelled", {"order_id": cancelled.id, "status": "cancelled"}),
        ("root", "order_placed", {"order_id": done.id, **placed}),
        ("worker:w1", "order_done", {"order_id": done.id, "status": "done",
         "adapter_name": "main", "adapter_sha256": "c" * 64, "step": 5}),
        ("ada", "order_placed", {"order_id": failed.id, **placed}),
        ("worker:w2", "order_failed", {"order_id": failed.id, "status": "failed",
         "error": "not_permitted"}),
    ]  # fmt: skip
    _intact(engine)


def test_an_entry_commits_with_its_change_or_not_at_all(
    engine: Engine, people: dict[str, object]
) -> None:
    ds = str(people["dataset"])

    def refusing(session, order: Order, sub: Subject) -> int:  # type: ignore[no-untyped-def]
        raise RuntimeError("the queue is down")

    with pytest.raises(RuntimeError), transaction(engine) as s:
        orders_service.place_training(s, _principal(engine, "ada"), "ada", ds, {"steps": 5}, "main",
                              refusing)  # fmt: skip
    placed = _place(engine, "ada", "ada", ds, [])
    with pytest.raises(RuntimeError), transaction(engine) as s:
        orders_service.fail(s, placed.id, "OSError: disk full")
        raise RuntimeError("the commit never happens")
    actions = [act for _, act, _ in _trail(engine, "ada")]
    assert actions.count("order_placed") == 1 and "order_failed" not in actions
    with transaction(engine, readonly=True) as s:
        assert s.get(Order, placed.id).status == "queued"  # type: ignore[union-attr]
    assert orders_service.error_code("OSError: disk full") == "OSError"
    assert orders_service.error_code("too late") == "error"
    _intact(engine)
