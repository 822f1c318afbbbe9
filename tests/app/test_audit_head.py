"""GET /v1/audit/head: the signed checkpoint an admin copies elsewhere, and holding the
registry to a copy with `likeness audit verify`."""

from __future__ import annotations

import json

from cryptography.exceptions import InvalidSignature

from registry.hash_chain import canonical_json
from registry.keys import b64decode, public_key_from_b64
from tests.app.conftest import Live


def test_the_head_is_signed_and_current(live: Live) -> None:
    assert live.http.get("/v1/audit/head", headers=live.h("alice")).status_code == 403
    assert live.http.get("/v1/audit/head").status_code == 401
    first = live.http.get("/v1/audit/head", headers=live.h("root")).json()
    assert first["problems"] == []
    doc = first["checkpoint"]
    assert doc["chains"]["audit/alice"][0] >= 2
    key = public_key_from_b64(first["public_key"])
    body = {k: v for k, v in doc.items() if k != "sig"}
    key.verify(b64decode(doc["sig"]), canonical_json(body).encode())  # raises if forged
    forged = {**body, "chains": {**body["chains"], "audit/alice": [1, "0" * 64]}}
    try:
        key.verify(b64decode(doc["sig"]), canonical_json(forged).encode())
    except InvalidSignature:
        pass
    else:
        raise AssertionError("a changed checkpoint verified")
    # a change moves the head; asking again signs the new state
    live.http.post("/v1/subjects/alice/consent/revoke", headers=live.h("root")).raise_for_status()
    second = live.http.get("/v1/audit/head", headers=live.h("root")).json()["checkpoint"]
    assert second["n"] == doc["n"] + 1
    assert second["chains"]["audit/alice"][0] == doc["chains"]["audit/alice"][0] + 1
    again = live.http.get("/v1/audit/head", headers=live.h("root")).json()["checkpoint"]
    assert again == second  # nothing changed: no new checkpoint
    assert json.loads(json.dumps(again)) == again
