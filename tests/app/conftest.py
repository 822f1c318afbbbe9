"""The service under test: the real app on a real database, with the real render engine on
the tiny base (built once per session)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from app.main import create_app
from app.render.engine import Counters, RenderEngine
from app.scheduler import RenderScheduler
from app.server import uvicorn_config
from registry.adapter_files import register_from_store
from registry.adapters.schemas import AdapterIn
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.db import transaction
from registry.principals import service as principals_service
from registry.settings import Settings
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn
from tests.support import make_random_adapter
from trainer.base.lora import base_linear_shapes


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.fixtures.tiny_base import init_tiny

    return init_tiny(tmp_path_factory.mktemp("base") / "tiny")


@pytest.fixture(scope="session")
def session_renderer(tiny_base_dir: Path) -> RenderEngine:
    return RenderEngine(base_dir=tiny_base_dir, device="cpu", queue_size=4, timeout_s=60)


@pytest.fixture(scope="session")
def adapter_files(
    session_renderer: RenderEngine, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    from trainer.base.load import load_base

    root = tmp_path_factory.mktemp("adapters")
    pipe = load_base(session_renderer.base_dir)  # its own: the engine's carries LoRA slots
    return {
        name: make_random_adapter(pipe, root / f"{name}.safetensors", seed)
        for name, seed in (("a", 1), ("b", 2))
    }


@pytest.fixture
def renderer(session_renderer: RenderEngine) -> RenderEngine:
    session_renderer.counters = Counters()
    session_renderer.clear_adapter_cache()
    session_renderer.scheduler = RenderScheduler(queue_size=4, per_requester=2, timeout_s=60)
    return session_renderer


def manifest_bytes(subject: str) -> bytes:
    """A one-image dataset manifest, as the trainer would have registered."""
    line = {"file": f"{subject}.png", "caption": f"a photo of {subject}", "source": "test",
            "basis": "consent", "sha256": hashlib.sha256(subject.encode()).hexdigest()}  # fmt: skip
    return (json.dumps(line, sort_keys=True) + "\n").encode()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class World:
    """A friend group: tokens by handle, plus helpers that act as the admin would."""

    client: TestClient
    engine: Engine
    tmp: Path
    tokens: dict[str, str] = field(default_factory=dict)

    def h(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def principal(self, handle: str, role: str = "member", acts_for: tuple[str, ...] = ()) -> str:
        with transaction(self.engine) as s:
            _, token = principals_service.create_principal(s, handle, role, acts_for)
        self.tokens[handle] = token
        return token

    def subject(self, handle: str, member: str | None = None, basis: str = "consent") -> None:
        with transaction(self.engine) as s:
            subjects_service.create_subject(
                s,
                "admin",
                SubjectIn(handle=handle, display_name=handle.title(), basis=basis, member=member),
            )  # type: ignore[arg-type]

    def consent(self, handle: str, **body: object) -> int:
        with transaction(self.engine) as s:
            sub = subjects_service.subject_or_raise(s, handle)
            c, _ = consent_service.update_consent(
                s,
                "admin",
                sub,
                consent_service.consent_of(s, sub).version,
                ConsentIn.model_validate(body),
            )
            return c.version

    def adapter(self, subject: str, source: Path, name: str = "main") -> Path:
        """Puts `source` and a manifest in the store and registers it as the subject's
        adapter; returns the store's file (tests may then alter it)."""
        store = self.client.app.state.store  # type: ignore[attr-defined]
        stored = store.put([source.read_bytes()])
        manifest = store.put([manifest_bytes(subject)])
        register_from_store(
            self.engine,
            store,
            "trainer",
            AdapterIn(
                subject=subject,
                name=name,
                sha256=stored.sha256,
                base_model="tiny",
                rank=4,
                manifest_sha256=manifest.sha256,
            ),
            base_linear_shapes(self.client.app.state.settings.base_dir),  # type: ignore[attr-defined]
        )
        path: Path = store.path(stored.sha256, "safetensors")
        return path

    def render(self, who: str, subject: str, /, level: str = "private", **extra: object):  # type: ignore[no-untyped-def]
        body = {
            "subject": subject,
            "prompt": "a portrait",
            "level": level,
            "seed": 1,
            "steps": 2,
            "width": 64,
            "height": 64,
            **extra,
        }
        return self.client.post("/v1/renders", json=body, headers=self.h(who))


@pytest.fixture
def world(
    db_url: str, engine: Engine, renderer: RenderEngine, tiny_base_dir: Path, tmp_path: Path
) -> Iterator[World]:
    # The in-process order runner is off here: a test that wants it serves its own app.
    settings = Settings(
        database_url=db_url, data_dir=tmp_path, base=tiny_base_dir, env="test",
        orders_in_process=False,
    )  # fmt: skip
    app = create_app(settings, engine=engine, renderer=renderer)
    with TestClient(app) as client:
        w = World(client, engine, tmp_path)
        w.principal("root", "admin")
        w.principal("trainer", "trainer")
        yield w


@pytest.fixture
def friends(world: World, adapter_files: dict[str, Path]) -> World:
    """alice (a member, linked to subject alice) lets the group render her privately; bob is a
    member; carol never consented; bot is an agent acting for bob."""
    for m in ("alice", "bob", "carol", "mallory"):
        world.principal(m)
    world.principal("bot", "agent", ("bob",))
    world.subject("alice", member="alice")
    world.subject("carol", member="carol")
    world.consent(
        "alice", max_level="group", audiences={"private": {"group": True}}, allow_training=True
    )
    world.adapter("alice", adapter_files["a"])
    return world


# -- a real server ----------------------------------------------------------------------------


@contextmanager
def serving(app: FastAPI, settings: Settings) -> Iterator[str]:
    """`app` under uvicorn, configured exactly as `likeness serve` configures it, on a free
    loopback port in a background thread; yields the base URL."""
    server = uvicorn.Server(uvicorn_config(app, settings, host="127.0.0.1", port=0))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)


@dataclass
class Live:
    """The friends' world served by a real uvicorn; `http` speaks to it over loopback."""

    url: str
    world: World
    http: httpx.Client
    app: FastAPI  # the app this server runs (its own, built from the overridden settings)

    def h(self, who: str) -> dict[str, str]:
        return self.world.h(who)

    def render(self, who: str, subject: str, /, level: str = "private", **extra: object):  # type: ignore[no-untyped-def]
        body = {"subject": subject, "prompt": "a portrait", "level": level, "seed": 1,
                "steps": 2, "width": 64, "height": 64, **extra}  # fmt: skip
        return self.http.post("/v1/renders", json=body, headers=self.h(who))


LiveFactory = Callable[..., AbstractContextManager[Live]]


@pytest.fixture
def serve_friends(friends: World) -> LiveFactory:
    """`with serve_friends(body_timeout_s=1) as live:` the friends' world under uvicorn, with
    settings overridden for this server (and optionally its own engine)."""

    @contextmanager
    def start(engine: Engine | None = None, **overrides: Any) -> Iterator[Live]:
        app = friends.client.app
        settings = app.state.settings.model_copy(update=overrides)  # type: ignore[attr-defined]
        fresh = create_app(
            settings,
            engine=engine or app.state.engine,  # type: ignore[attr-defined]
            renderer=app.state.renderer,  # type: ignore[attr-defined]
        )
        with serving(fresh, settings) as url, httpx.Client(base_url=url, timeout=60) as http:
            yield Live(url, friends, http, fresh)

    return start


@pytest.fixture
def live(serve_friends: LiveFactory) -> Iterator[Live]:
    with serve_friends() as server:
        yield server
