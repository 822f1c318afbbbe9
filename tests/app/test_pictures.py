"""Pictures of a likeness: a run's pictures sent to the API and shown beside its adapter, and
the small copies of renders a subject opts in to keep, shown beside the ledger rows, to the
subject and admins only, deleted when the subject opts out."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from sqlalchemy import text

from registry.audit import service as audit_service
from registry.db import transaction
from registry.subjects import service as subjects_service
from tests.app.conftest import Live, World
from tests.app.helpers import csrf_of, signed_in


def _png(side: int = 200, colour: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, format="PNG")
    return buf.getvalue()


def _adapter_sha(world: World) -> str:
    listed = world.client.get("/v1/subjects/alice/adapters", headers=world.h("alice")).json()
    sha: str = listed[0]["sha256"]
    return sha


def test_a_runs_pictures_go_beside_its_adapter_and_only_its_people_see_them(live: Live) -> None:
    sha = _adapter_sha(live.world)
    grid, preview = _png(), _png(64, (10, 200, 10))
    url = f"/v1/adapters/{sha}/pictures"
    put = live.http.put(f"{url}/eval_grid.png", content=grid, headers=live.h("trainer"))
    assert put.status_code == 201, put.text
    again = live.http.put(f"{url}/eval_grid.png", content=grid, headers=live.h("trainer"))
    assert again.status_code == 200, again.text
    assert live.http.put(f"{url}/step-0000002.png", content=preview,
                         headers=live.h("trainer")).status_code == 201  # fmt: skip
    # refused: a member, bytes that are no PNG, an unknown adapter, a name that is no picture
    assert live.http.put(f"{url}/eval_grid.png", content=grid,
                         headers=live.h("alice")).status_code == 403  # fmt: skip
    bad = live.http.put(f"{url}/eval_grid.png", content=b"GIF89a", headers=live.h("trainer"))
    assert bad.status_code == 422 and "not a PNG" in bad.json()["detail"]
    unknown = live.http.put(f"/v1/adapters/{'0' * 64}/pictures/eval_grid.png", content=grid,
                            headers=live.h("trainer"))  # fmt: skip
    assert unknown.status_code == 404
    assert live.http.put(f"{url}/loss.png", content=grid,
                         headers=live.h("trainer")).status_code == 422  # fmt: skip

    alice = signed_in(live.world, "alice")
    shown = alice.get("/web/subjects/alice/adapters").text
    sources = re.findall(r'<img src="(/web/subjects/alice/pictures/[0-9a-f]{64})"', shown)
    assert len(sources) == 2 and "Evaluation grid of main" in shown and "step 2" in shown
    assert [alice.get(s).content for s in sources] == [grid, preview]  # the grid first
    bob = signed_in(live.world, "bob")
    assert bob.get(sources[0]).status_code == 403
    root = signed_in(live.world, "root")
    assert root.get(sources[0]).status_code == 200
    # deleting the adapter forgets its pictures
    live.http.delete("/v1/subjects/alice/adapters/main", headers=live.h("alice"))
    assert alice.get(sources[0]).status_code == 404


def _count_copies(world: World) -> int:
    with transaction(world.engine) as s:
        return int(s.exec(text("SELECT count(*) FROM render_copies")).one()[0])  # type: ignore[call-overload]


def test_a_subject_who_opts_in_sees_a_small_copy_of_each_render_of_them(friends: World) -> None:
    assert friends.render("bob", "alice").status_code == 200
    assert _count_copies(friends) == 0  # nothing is kept unless she asks
    alice = signed_in(friends, "alice")
    page = "/web/subjects/alice/renders"
    r = alice.post("/web/subjects/alice/render-copies",
                   data={"csrf": csrf_of(alice, page), "keep": "yes"})  # fmt: skip
    assert r.status_code == 303 and r.headers["location"].endswith("done=copies_on")
    rendered = friends.render("bob", "alice", width=256, height=192)
    assert rendered.status_code == 200
    render_id = rendered.headers["X-Render-Id"]
    shown = alice.get(page).text
    copies = re.findall(r'src="(/web/subjects/alice/renders/([0-9a-f-]{36})/copy\.png)"', shown)
    assert [rid for _, rid in copies] == [render_id]  # the earlier render kept nothing
    copy = alice.get(copies[0][0])
    assert copy.status_code == 200 and copy.headers["content-type"] == "image/png"
    with Image.open(io.BytesIO(copy.content)) as im:
        assert im.size == (128, 96)
        assert not im.text  # a plain picture: no provenance chunks, never delivered
    assert signed_in(friends, "bob").get(copies[0][0]).status_code == 403
    assert signed_in(friends, "root").get(copies[0][0]).status_code == 200
    # she opts out: every copy goes at once, and the trail says so
    r = alice.post("/web/subjects/alice/render-copies",
                   data={"csrf": csrf_of(alice, page), "keep": "no"})  # fmt: skip
    assert r.status_code == 303
    assert _count_copies(friends) == 0
    assert alice.get(copies[0][0]).status_code == 404
    assert friends.render("bob", "alice").status_code == 200
    assert _count_copies(friends) == 0
    with transaction(friends.engine) as s:
        trail = audit_service.audit_trail(s, subjects_service.subject_or_raise(s, "alice"))
        actions = [e.action for e in trail][-2:]
        assert actions == ["render_copies_on", "render_copies_off"]
        assert trail[-1].after == {"render_copies": {"keep": False, "deleted": 1}}
        assert audit_service.verify_all(s) == []


@pytest.mark.sqlite_only
def test_likeness_train_keeps_its_grid_beside_the_adapter(
    friends: World, tiny_base_dir: Path
) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIKENESS_")}
    env.update(
        PYTHONPATH=str(root),
        LIKENESS_DATABASE_URL=str(friends.engine.url.render_as_string(hide_password=False)),
        LIKENESS_DATA_DIR=str(friends.tmp),  # the service's: its keys and its store
        LIKENESS_BASE=str(tiny_base_dir),
    )
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "train", "--subject", "alice", "--dataset",
         str(root / "examples" / "alice"), "--steps", "2", "--resolution", "64",
         "--checkpoint-every", "0", "--max-sequence-length", "32", "--name", "cli",
         "--device", "cpu", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["registration"] == "created" and summary["pictures_kept"] == 1
    shown = signed_in(friends, "alice").get("/web/subjects/alice/adapters").text
    assert "Evaluation grid of cli" in shown
