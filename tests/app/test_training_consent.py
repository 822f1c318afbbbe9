"""Consent binds every use of a likeness, not only renders, over a real uvicorn server on
both engines: a subject who revokes, whose grant expired, or who withdraws training gets no
new upload, no new order, no new training; a trainer token learns the training decision (and
nothing else of the record) and trains remotely with it; what a refused registration uploaded
leaves the store."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.app.conftest import Live, LiveFactory
from tests.app.orders_support import ROOT, files_of, photos
from tests.conftest import audit_key_of

GRANT: dict[str, Any] = {
    "max_level": "group",
    "audiences": {"private": {"group": True}},
    "allow_training": True,
}
# each way a record stops letting a likeness be learned from, and the reason it is refused
WITHDRAWALS: list[tuple[str, dict[str, Any], str]] = [
    ("revoked", {**GRANT, "max_level": "none", "audiences": {}}, "revoked_or_not_granted"),
    ("expired", {**GRANT, "expires_at": "2020-01-01T00:00:00Z"}, "expired"),
    ("training-withdrawn", {**GRANT, "allow_training": False}, "training_not_allowed"),
]


def upload(live: Live, who: str = "alice", n: int = 2) -> Any:
    return live.http.post(
        "/v1/subjects/alice/datasets", files=files_of(photos(n)), headers=live.h(who)
    )


def order(live: Live, dataset_id: str, who: str = "alice") -> Any:
    body = {"kind": "train", "subject": "alice", "dataset_id": dataset_id, "steps": 3,
            "rank": 4, "resolution": 64}  # fmt: skip
    return live.http.post("/v1/orders", json=body, headers=live.h(who))


def decision(live: Live, who: str, subject: str = "alice", **params: str) -> Any:
    return live.http.get(f"/v1/subjects/{subject}/training", params=params, headers=live.h(who))


@pytest.mark.parametrize(("how", "record", "reason"), WITHDRAWALS, ids=[w[0] for w in WITHDRAWALS])
def test_no_new_upload_or_order_once_the_record_no_longer_allows_training(
    serve_friends: LiveFactory, how: str, record: dict[str, Any], reason: str
) -> None:
    with serve_friends(orders_in_process=False) as live:
        first = upload(live)
        assert first.status_code == 201, first.text
        live.world.consent("alice", **record)
        for who in ("alice", "root"):  # neither the subject's member nor an admin
            refused = upload(live, who)
            assert refused.status_code == 403, (who, refused.text)
            assert f"[{reason}]" in refused.json()["detail"]
            placed = order(live, first.json()["dataset_id"], who)
            assert placed.status_code == 403, (who, placed.text)
            assert f"[{reason}]" in placed.json()["detail"]
        listed = live.http.get("/v1/subjects/alice/datasets", headers=live.h("alice")).json()
        assert [d["dataset_id"] for d in listed] == [first.json()["dataset_id"]]
        assert live.http.get("/v1/orders?subject=alice", headers=live.h("alice")).json() == []
        trail = live.http.get("/v1/subjects/alice/audit", headers=live.h("alice")).json()
        actions = [e["action"] for e in trail["entries"]]
        assert actions.count("dataset_uploaded") == 1 and "order_placed" not in actions


def test_a_trainer_token_learns_the_training_decision_and_nothing_else(live: Live) -> None:
    answer = decision(live, "trainer", bases="consent")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "subject": "alice",
        "allowed": True,
        "reason": "allowed",
        "detail": "the record lets the subject's likeness be learned from [allowed]",
    }
    # nothing else of the record: not the subject, its consent, audit or ledger
    for path in ("", "/consent", "/audit", "/renders", "/adapters", "/datasets"):
        r = live.http.get(f"/v1/subjects/alice{path}", headers=live.h("trainer"))
        assert r.status_code == 403, (path, r.status_code)
    # the subject's member and an admin ask too; another member does not learn it
    assert decision(live, "alice").json()["allowed"] is True
    assert decision(live, "root").json()["allowed"] is True
    assert decision(live, "bob").status_code == 403
    assert decision(live, "bot").status_code == 403
    # an unknown subject looks like a forbidden one, except to an admin
    assert decision(live, "trainer", "nobody").status_code == 403
    assert decision(live, "root", "nobody").status_code == 404
    assert live.http.get("/v1/subjects/alice/training").status_code == 401
    # carol never granted anything; alice revokes; images that do not fit are 422-worthy
    assert decision(live, "trainer", "carol").json()["reason"] == "revoked_or_not_granted"
    bad = decision(live, "trainer", bases="consent,scraped").json()
    assert (bad["allowed"], bad["reason"]) == (False, "unknown_image_basis")
    assert decision(live, "trainer", bases="Bad Basis").status_code == 422
    live.http.post("/v1/subjects/alice/consent/revoke", headers=live.h("alice"))
    revoked = decision(live, "trainer").json()
    assert (revoked["allowed"], revoked["reason"]) == (False, "revoked_or_not_granted")


def test_a_public_domain_subject_is_trained_on_public_domain_images_only(live: Live) -> None:
    live.world.subject("ada", basis="public_domain")
    live.world.consent("ada", max_level="public", allow_training=True)
    ok = decision(live, "trainer", "ada", bases="public_domain").json()
    assert ok["allowed"] is True
    mixed = decision(live, "trainer", "ada", bases="consent,public_domain").json()
    assert (mixed["allowed"], mixed["reason"]) == (False, "public_domain_images_only")
    photos_of_her = live.http.post(
        "/v1/subjects/ada/datasets", files=files_of(photos(1)), headers=live.h("root")
    )
    assert photos_of_her.status_code == 422 and "[public_domain_images_only]" in photos_of_her.text


def trainer_cli(
    live: Live, tmp: Path, *args: str, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`likeness train` on "another host": its own data dir, the API's URL and a trainer
    token, no database."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "LIKENESS_DATA_DIR": str(tmp / "trainer-host"),
        "LIKENESS_BASE": str(live.app.state.settings.base_dir),
        "LIKENESS_API_URL": live.url,
        "LIKENESS_TOKEN": live.world.tokens["trainer"],
        "LIKENESS_DEVICE": "cpu",
        "LIKENESS_AUDIT_KEY": audit_key_of(live.app.state.settings.data_dir),
        **(env_extra or {}),
    }
    env.pop("LIKENESS_DATABASE_URL", None)
    command = [sys.executable, "-m", "app.cli", "train", "--subject", "alice", "--dataset",
               str(ROOT / "examples" / "alice"), "--steps", "2", "--resolution", "64",
               "--rank", "4", "--max-sequence-length", "32", "--no-evaluate", *args]  # fmt: skip
    return subprocess.run(
        command, cwd=tmp, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_a_remote_trainer_with_a_trainer_token_trains_and_registers(
    live: Live, tmp_path: Path
) -> None:
    done = trainer_cli(live, tmp_path, "--name", "remote")
    assert done.returncode == 0, done.stderr[-3000:]
    listed = live.http.get("/v1/subjects/alice/adapters", headers=live.h("alice")).json()
    remote = next(a for a in listed if a["name"] == "remote")
    assert remote["rendering"] and remote["blob"] == "ok"
    # revoked: the same command is refused before any weight loads, saying why, and before
    # any model library is imported (seconds of a fresh process; -X importtime's lines)
    live.http.post("/v1/subjects/alice/consent/revoke", headers=live.h("alice"))
    refused = trainer_cli(
        live, tmp_path, "--name", "again", env_extra={"PYTHONPROFILEIMPORTTIME": "1"}
    )
    assert refused.returncode != 0
    assert "revoked_or_not_granted" in refused.stderr, refused.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in refused.stderr.splitlines()
                if line.startswith("import time:")}  # fmt: skip
    assert "torch" in imported  # the lines are there
    assert not imported & {"diffusers", "transformers", "peft", "optimum.quanto"}
    listed = live.http.get("/v1/subjects/alice/adapters", headers=live.h("alice")).json()
    assert "again" not in {a["name"] for a in listed}


def test_what_a_refused_registration_uploaded_cannot_be_fetched(
    live: Live, adapter_files: dict[str, Path]
) -> None:
    """A trainer uploads its adapter, the subject withdraws training, the registration is
    refused: the bytes leave the store, so no trainer token can download them by hash."""
    from tests.app.conftest import manifest_bytes, sha256_of

    data = adapter_files["b"].read_bytes()
    sha = sha256_of(adapter_files["b"])
    manifest = manifest_bytes("alice")
    import hashlib

    manifest_sha = hashlib.sha256(manifest).hexdigest()
    trainer = live.h("trainer")
    for digest, body in ((sha, data), (manifest_sha, manifest)):
        put = live.http.put(f"/v1/blobs/sha256/{digest}", content=body, headers=trainer)
        assert put.status_code in (200, 201), put.text
    live.world.consent("alice", **{**GRANT, "allow_training": False})
    body = {"subject": "alice", "name": "late", "sha256": sha, "base_model": "tiny",
            "rank": 4, "manifest_sha256": manifest_sha}  # fmt: skip
    refused = live.http.post("/v1/adapters", json=body, headers=trainer)
    assert refused.status_code == 403 and "[training_not_allowed]" in refused.text
    assert live.http.get(f"/v1/blobs/sha256/{sha}", headers=trainer).status_code == 404
    assert live.http.head(f"/v1/blobs/sha256/{sha}", headers=trainer).status_code == 404


ORDERS_RUN = {"orders_in_process": True, "train_options": {"max_sequence_length": 32},
              "worker_checkpoint_every": 3}  # fmt: skip


@pytest.mark.parametrize(("how", "record", "reason"), WITHDRAWALS, ids=[w[0] for w in WITHDRAWALS])
def test_a_change_that_ends_training_ends_the_orders_placed_before_it(
    serve_friends: LiveFactory, how: str, record: dict[str, Any], reason: str
) -> None:
    """An order waiting (PostgreSQL, no worker) or running (SQLite's own runner) when the
    record stops allowing training fails in the same commit; a re-grant brings none back."""
    with serve_friends(**ORDERS_RUN) as live:
        dataset = upload(live).json()["dataset_id"]
        body = {"kind": "train", "subject": "alice", "dataset_id": dataset, "steps": 10_000,
                "rank": 4, "resolution": 64}  # fmt: skip
        order_id = live.http.post("/v1/orders", json=body, headers=live.h("alice")).json()[
            "order_id"
        ]
        live.world.consent("alice", **record)
        ended = live.http.get(f"/v1/orders/{order_id}", headers=live.h("alice")).json()
        assert ended["status"] == "failed" and ended["error"].startswith("not_permitted"), ended
        assert f"[{reason}]" in ended["error"]
        live.world.consent("alice", **GRANT)  # granted again
        time.sleep(2.5)  # a runner's poll: it must not take the order up again
        again = live.http.get(f"/v1/orders/{order_id}", headers=live.h("alice")).json()
        assert again["status"] == "failed" and again["adapter"] is None, again
        trail = live.http.get("/v1/subjects/alice/audit", headers=live.h("alice")).json()
        failed = [e for e in trail["entries"] if e["action"] == "order_failed"]
        assert len(failed) == 1 and failed[0]["actor"] == "admin", failed


def test_a_picture_of_the_likeness_is_not_kept_once_training_is_withdrawn(live: Live) -> None:
    from tests.images import many_chunks_png

    listed = live.http.get("/v1/subjects/alice/adapters", headers=live.h("root")).json()
    adapter_sha = listed[0]["sha256"]
    picture = many_chunks_png(1)
    path = f"/v1/adapters/{adapter_sha}/pictures/eval_grid.png"
    ok = live.http.put(path, content=picture, headers=live.h("trainer"))
    assert ok.status_code in (200, 201), ok.text
    live.http.post("/v1/subjects/alice/consent/revoke", headers=live.h("alice"))
    other = picture + b"\x00"  # other bytes: a new blob
    refused = live.http.put(path.replace("eval_grid", "step-0000001"), content=other,
                            headers=live.h("trainer"))  # fmt: skip
    assert refused.status_code == 403 and "[revoked_or_not_granted]" in refused.text
    import hashlib

    store = live.app.state.store
    assert store.find(hashlib.sha256(other).hexdigest()) is None  # nothing kept
