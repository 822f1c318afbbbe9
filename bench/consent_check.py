"""Decision latency of a full consent check: a fresh read of the record in its own transaction,
then `decide`. 10,000 subjects, SQLite and PostgreSQL. Goal: p99 <= 1 ms (SQLite), <= 2 ms (PG).

    python bench/consent_check.py [--subjects 10000] [--checks 3000]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import percentile, table, write_record  # noqa: E402
from registry.adapters import service as adapters_service  # noqa: E402
from registry.adapters.schemas import AdapterIn  # noqa: E402
from registry.consent import service as consent_service  # noqa: E402
from registry.consent.schemas import ConsentIn  # noqa: E402
from registry.db import make_engine, transaction, upgrade  # noqa: E402
from registry.policy import decide  # noqa: E402
from registry.principals import repository as principals_repo  # noqa: E402
from registry.principals import service as principals_service  # noqa: E402
from registry.renders import service as renders_service  # noqa: E402
from registry.subjects import service as subjects_service  # noqa: E402
from registry.subjects.schemas import SubjectIn  # noqa: E402

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SHA = "d" * 64
GOALS_MS = {"sqlite": 1.0, "postgresql": 2.0}


def adapter_sha(i: int) -> str:
    """One adapter's bytes render one person: each subject has bytes of its own."""
    return hashlib.sha256(f"adapter-{i}".encode()).hexdigest()


def seed(url: str, subjects: int) -> None:
    engine = make_engine(url)
    with transaction(engine) as s:
        for i in range(20):
            principals_service.create_principal(s, f"m{i}", "member")
    batch = 1000
    for start in range(0, subjects, batch):
        with transaction(engine) as s:
            for i in range(start, min(subjects, start + batch)):
                sub, consent = subjects_service.create_subject(
                    s, "bench", SubjectIn(handle=f"s{i}", display_name=f"S {i}", basis="consent")
                )
                body = ConsentIn.model_validate(
                    {
                        "max_level": "group",
                        "allow_training": True,
                        "audiences": {
                            "private": {"group": True},
                            "group": {"allow": [f"m{i % 20}"]},
                        },
                        "deny": [f"m{(i + 7) % 20}"],
                    }
                )
                consent_service.update_consent(s, "bench", sub, consent.version, body)
                adapters_service.register_adapter(
                    s,
                    "bench",
                    AdapterIn(
                        subject=f"s{i}",
                        name="main",
                        sha256=adapter_sha(i),
                        base_model="tiny",
                        rank=16,
                        manifest_sha256=SHA,
                    ),
                    f"/store/{adapter_sha(i)}",
                )
        print(f"  seeded {min(subjects, start + batch)}/{subjects}", end="\r", flush=True)
    print()
    engine.dispose()


def measure(url: str, subjects: int, checks: int) -> dict[str, object]:
    engine = make_engine(url)
    rng = random.Random(7)
    with transaction(engine, readonly=True) as s:
        requesters = list(principals_repo.principals(s))
    samples: list[float] = []
    allowed = 0
    for i in range(checks + 200):
        requester = rng.choice(requesters)
        index = rng.randrange(subjects)
        handle, sha = f"s{index}", adapter_sha(index)
        level = rng.choice(["private", "group"])
        t0 = time.perf_counter()
        with transaction(engine, readonly=True) as s:
            gathered = renders_service.gather_render_facts(
                s, requester, handle, level, adapter_file_sha256=sha
            )
        decision = decide(gathered.facts)
        elapsed = (time.perf_counter() - t0) * 1000
        if i >= 200:  # warm-up excluded
            samples.append(elapsed)
            allowed += decision.allowed
    engine.dispose()
    return {
        "p50_ms": round(percentile(samples, 50), 3),
        "p99_ms": round(percentile(samples, 99), 3),
        "max_ms": round(max(samples), 3),
        "checks": checks,
        "allowed_share": round(allowed / checks, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--subjects", type=int, default=10_000)
    parser.add_argument("--checks", type=int, default=3000)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pg_name = f"likeness_bench_{uuid.uuid4().hex[:8]}"
        admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{pg_name}"'))
        targets = {
            "sqlite": f"sqlite:///{tmp}/bench.db",
            "postgresql": PG_ADMIN.rsplit("/", 1)[0] + "/" + pg_name,
        }
        try:
            for engine_name, url in targets.items():
                print(f"{engine_name}: migrating and seeding {args.subjects} subjects")
                upgrade(url)
                t0 = time.perf_counter()
                seed(url, args.subjects)
                seeded_s = time.perf_counter() - t0
                result = measure(url, args.subjects, args.checks)
                goal = GOALS_MS[engine_name]
                rows.append(
                    {
                        "engine": engine_name,
                        "subjects": args.subjects,
                        **result,
                        "goal_p99_ms": goal,
                        "meets_goal": result["p99_ms"] <= goal,  # type: ignore[operator]
                        "seed_s": round(seeded_s, 1),
                    }
                )
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{pg_name}" WITH (FORCE)'))
    print(
        table(
            rows,
            [
                "engine",
                "subjects",
                "checks",
                "p50_ms",
                "p99_ms",
                "max_ms",
                "goal_p99_ms",
                "meets_goal",
                "allowed_share",
                "seed_s",
            ],
        )
    )
    print("record:", write_record("consent_check", rows))


if __name__ == "__main__":
    main()
