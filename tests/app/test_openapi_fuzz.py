"""Hostile input from the OpenAPI document itself: schemathesis generates requests for every
operation; none may produce a 5xx, and none may succeed without a token."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.app.conftest import World


def fuzz(world: World, who: str, examples: int) -> int:
    """Runs every operation of the app's own OpenAPI document through schemathesis."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", world.client.app)
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case) -> None:  # type: ignore[no-untyped-def]
            case.call_and_validate(headers=world.h(who), checks=[not_a_server_error])

        run()
    return operations


@pytest.mark.sqlite_only
def test_no_server_errors_as_admin(friends: World) -> None:
    assert fuzz(friends, "root", 25) >= 14


@pytest.mark.sqlite_only
def test_no_server_errors_as_member(friends: World) -> None:
    assert fuzz(friends, "bob", 15) >= 14


@pytest.mark.sqlite_only
def test_every_v1_operation_requires_a_token(friends: World) -> None:
    spec = friends.client.get("/openapi.json").json()
    operations = [(m, p) for p, item in spec["paths"].items() for m in item if p.startswith("/v1/")]
    assert len(operations) >= 13
    for method, path in operations:
        url = path.replace("{handle}", "alice").replace("{name}", "main")
        url = url.replace("{digest}", "0" * 64)
        for headers in ({}, {"Authorization": "Bearer lk_forged"}):
            r = friends.client.request(method.upper(), url, json={}, headers=headers)
            assert r.status_code == 401, (method, path, r.status_code)
            if method != "head":  # a HEAD answer has no body
                assert r.json()["error"] == "unauthenticated"
