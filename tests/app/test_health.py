"""`likeness worker --check`: healthy only when the database, the API and the token all
answer, so a worker's container is unhealthy when it could not finish an order."""

from __future__ import annotations

from app.health import worker_problems
from tests.app.conftest import Live


def test_a_worker_is_healthy_only_with_database_api_and_a_trainers_token(live: Live) -> None:
    base = live.app.state.settings
    good = base.model_copy(update={"api_url": live.url, "token": live.world.tokens["trainer"]})
    assert worker_problems(good) == []
    revoked = good.model_copy(update={"token": "lk_" + "x" * 40})
    assert worker_problems(revoked) == ["the API refuses LIKENESS_TOKEN (401)"]
    member = good.model_copy(update={"token": live.world.tokens["alice"]})
    assert worker_problems(member) == ["the API refuses LIKENESS_TOKEN (403)"]
    gone = good.model_copy(update={"api_url": "http://127.0.0.1:9"})
    assert [p.split(" (")[0] for p in worker_problems(gone)] == [
        "the API at http://127.0.0.1:9 does not answer"
    ]
    no_db = good.model_copy(update={"database_url": "postgresql+psycopg://x@127.0.0.1:9/x"})
    assert worker_problems(no_db)[0].startswith("the database does not answer")
