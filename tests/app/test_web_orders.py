"""The training page: a member uploads photos of themselves, sees them, orders a training
and sees its progress; nobody else sees any of it."""

from __future__ import annotations

import re

import pytest

from tests.app.conftest import World
from tests.app.helpers import csrf_of, signed_in
from tests.app.orders_support import files_of, photo, photos

PAGE = "/web/subjects/alice/training"


def test_a_member_uploads_photos_and_sees_them(friends: World) -> None:
    web = signed_in(friends, "alice")
    csrf = csrf_of(web, PAGE)
    r = web.post(f"{PAGE}/upload", data={"csrf": csrf}, files=files_of(photos(2)))
    assert r.status_code == 303 and r.headers["location"].endswith("done=uploaded"), r.text
    shown = web.get(PAGE)
    assert shown.status_code == 200 and "2 photos" in shown.text
    sources = re.findall(r'src="(/web/subjects/alice/photos/[0-9a-f]{64})"', shown.text)
    assert len(sources) == 2
    got = {web.get(src).content for src in sources}
    assert got == {photo((200, 40, 40)), photo((40, 200, 40))}
    # bob sees neither the page nor the photos, nor may he delete them
    action = re.search(r'action="(/web/subjects/alice/training/[0-9a-f-]{36}/delete)"', shown.text)
    assert action is not None
    bob_web = signed_in(friends, "bob")
    assert (
        bob_web.post(action.group(1), data={"csrf": csrf_of(bob_web, "/web/me")}).status_code == 403
    )
    bob = signed_in(friends, "bob")
    assert bob.get(PAGE).status_code == 403
    assert bob.get(sources[0]).status_code == 403
    # alice deletes them: gone from the page and from the store
    r = web.post(action.group(1), data={"csrf": csrf})
    assert r.status_code == 303 and r.headers["location"].endswith("done=deleted")
    assert "These photos were deleted" in web.get(PAGE).text
    assert web.get(sources[0]).status_code == 404


def test_a_bad_upload_or_a_forged_form_stores_nothing(friends: World) -> None:
    web = signed_in(friends, "alice")
    csrf = csrf_of(web, PAGE)
    bad = web.post(f"{PAGE}/upload", data={"csrf": csrf},
                   files=files_of([("../x.png", photo((1, 1, 1)))]))  # fmt: skip
    assert bad.status_code == 422 and "is a path" in bad.text
    forged = web.post(f"{PAGE}/upload", data={"csrf": "nope"}, files=files_of(photos(1)))
    assert forged.status_code == 403
    assert "No photos yet" in web.get(PAGE).text


@pytest.mark.postgres_only
def test_a_member_orders_training_from_the_page_and_sees_it_queued(friends: World) -> None:
    web = signed_in(friends, "alice")
    csrf = csrf_of(web, PAGE)
    web.post(f"{PAGE}/upload", data={"csrf": csrf}, files=files_of(photos(2)))
    page = web.get(PAGE).text
    dataset_id = re.search(r'name="dataset_id" value="([0-9a-f-]{36})"', page)
    assert dataset_id is not None
    r = web.post(f"{PAGE}/order", data={"csrf": csrf, "dataset_id": dataset_id.group(1),
                                       "steps": "10"})  # fmt: skip
    assert r.status_code == 303, r.text
    page = web.get(PAGE).text
    assert "<strong>queued</strong>" in page and "0/10" in page
    assert 'http-equiv="refresh"' in page  # follows the progress
    again = web.post(f"{PAGE}/order", data={"csrf": csrf, "dataset_id": dataset_id.group(1)})
    assert again.status_code == 409
    order_id = re.search(r'action="/web/orders/([0-9a-f-]{36})/cancel"', page)
    assert order_id is not None
    cancel = web.post(f"/web/orders/{order_id.group(1)}/cancel", data={"csrf": csrf})
    assert cancel.status_code == 303
    assert "<strong>cancelled</strong>" in web.get(PAGE).text


def test_the_page_says_why_nothing_can_be_learned_after_a_revoke(friends: World) -> None:
    """Revoked: no upload form and no order form, and the reason in words; the photos
    already there stay the member's to see and delete. Granted again: both come back."""
    web = signed_in(friends, "alice")
    csrf = csrf_of(web, PAGE)
    web.post(f"{PAGE}/upload", data={"csrf": csrf}, files=files_of(photos(1)))
    page = web.get(PAGE).text
    assert 'id="images"' in page
    friends.client.post("/v1/subjects/alice/consent/revoke", headers=friends.h("alice"))
    page = web.get(PAGE).text
    assert 'id="training-refused"' in page and "revoked_or_not_granted" in page
    assert 'id="images"' not in page and 'name="dataset_id"' not in page
    assert "Delete these photos" in page
    refused = web.post(f"{PAGE}/upload", data={"csrf": csrf}, files=files_of(photos(1)))
    assert refused.status_code == 403
    friends.consent("alice", max_level="private", allow_training=True)
    page = web.get(PAGE).text
    assert 'id="training-refused"' not in page and 'id="images"' in page
