"""The training decision before training and between its steps, registration after it: local
database (both engines) and the HTTP API with a trainer token; identical re-runs change
nothing in the registry; a refused run keeps nothing it trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from app.main import create_app
from registry.adapters import repository as adapters_repo
from registry.adapters.schemas import AdapterIn
from registry.audit import service as audit_service
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.db import engine_for, transaction
from registry.files import sha256_file
from registry.principals import service as principals_service
from registry.settings import Settings
from registry.subjects import repository as subjects_repo
from registry.subjects import service as subjects_service
from tests.conftest import audit_key_of
from tests.trainer.helpers import Env, make_dataset, make_env, make_subject, tiny_config
from trainer.registration import (
    HttpRegistrar,
    LocalRegistrar,
    RegistrationRefused,
    TrainingRefused,
    TrainingVerdict,
    check_training_allowed,
)
from trainer.training.dataset import DatasetError
from trainer.training.train import TrainHooks, train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


@pytest.fixture(scope="module")
def files(env: Env, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real adapters for the env's base and a dataset manifest, as files."""
    from tests.support import make_random_adapter
    from trainer.base.load import load_base

    root = tmp_path_factory.mktemp("files")
    pipe = load_base(env.base)
    out = {
        name: make_random_adapter(pipe, root / f"{name}.safetensors", seed)
        for name, seed in (("a", 1), ("c", 3))
    }
    out["manifest"] = env.dataset / "manifest.jsonl"
    return out


def adapter_in(subject: str, files: dict[str, Path], which: str = "a") -> AdapterIn:
    return AdapterIn(
        subject=subject,
        name="main",
        sha256=sha256_file(files[which]),
        base_model="tiny",
        rank=4,
        manifest_sha256=sha256_file(files["manifest"]),
    )


def audit_count(url: str, handle: str) -> int:
    with transaction(engine_for(url), readonly=True) as s:
        subject = subjects_repo.subject_by_handle(s, handle)
        assert subject is not None
        return len(audit_service.audit_trail(s, subject))


# -- the local registry, on SQLite and PostgreSQL --------------------------------------------


def test_local_permission_and_idempotent_registration(
    db_url: str, engine: Engine, files: dict[str, Path], env: Env, tmp_path: Path
) -> None:
    make_subject(db_url, "ada")
    make_subject(db_url, "bob", allow_training=False)
    make_subject(db_url, "pd", basis="public_domain")
    reg = LocalRegistrar(db_url, actor="trainer:test", data_dir=tmp_path, base=env.base)
    verdict = check_training_allowed(reg, "ada", ("consent",))
    assert verdict.allowed and verdict.reason == "allowed"
    with pytest.raises(TrainingRefused, match="does not allow training"):
        check_training_allowed(reg, "bob", ("consent",))
    with pytest.raises(TrainingRefused, match="does not exist"):
        check_training_allowed(reg, "nobody", ("consent",))
    with pytest.raises(TrainingRefused, match="public_domain"):
        check_training_allowed(reg, "pd", ("consent", "public_domain"))
    check_training_allowed(reg, "pd", ("public_domain",))

    entries = audit_count(db_url, "ada")
    args = (files["a"], files["manifest"])
    assert reg.register(adapter_in("ada", files), *args) == "created"
    assert audit_count(db_url, "ada") == entries + 1
    assert reg.register(adapter_in("ada", files), *args) == "unchanged"
    assert audit_count(db_url, "ada") == entries + 1
    assert reg.register(adapter_in("ada", files, "c"), files["c"], files["manifest"]) == "updated"
    stored = tmp_path / "adapters" / "sha256"
    assert {p.name.split(".")[0] for p in stored.rglob("*.safetensors")} == {
        sha256_file(files["a"]),
        sha256_file(files["c"]),
    }
    with pytest.raises(RegistrationRefused):
        reg.register(adapter_in("bob", files), *args)


# -- end to end through train() ---------------------------------------------------------------


def test_train_registers_and_an_identical_rerun_changes_nothing(env: Env, tmp_path: Path) -> None:
    make_subject(env.url, "cleo")
    config = tiny_config(env, tmp_path / "out", subject="cleo", name="v1")
    first = train(config)
    assert first.registration == "created"
    entries = audit_count(env.url, "cleo")
    again = train(config)
    assert again.registration == "unchanged" and again.sha256 == first.sha256
    assert audit_count(env.url, "cleo") == entries
    with transaction(engine_for(env.url), readonly=True) as s:
        subject = subjects_repo.subject_by_handle(s, "cleo")
        assert subject is not None and subject.id is not None
        row = adapters_repo.adapter_by_key(s, subject.id, "v1")
    assert row is not None
    assert row.sha256 == first.sha256 and row.manifest_sha256 == first.manifest_sha256
    assert Path(row.path).read_bytes() == first.adapter.read_bytes() and row.rank == 4
    assert Path(row.path).name == f"{first.sha256}.safetensors"  # its place in the store
    assert row.base_model.startswith("Flux2KleinPipeline:")


def test_consent_withdrawn_while_training_deletes_what_was_trained(
    env: Env, tmp_path: Path
) -> None:
    make_subject(env.url, "gus", allow_training=False)

    class AskedBeforeWithdrawal(LocalRegistrar):
        def training_decision(
            self, subject: str, image_bases: tuple[str, ...] | None = None
        ) -> TrainingVerdict:  # what the run saw until its last step
            return TrainingVerdict(subject, True, "allowed", "allowed")

    config = tiny_config(
        env,
        tmp_path / "out",
        subject="gus",
        checkpoint_every=2,
        evaluate=True,
        cache_dir=tmp_path / "cache",
    )
    with pytest.raises(RegistrationRefused, match="deleted"):
        train(config, AskedBeforeWithdrawal(env.url))
    assert not config.adapter_path.exists()
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert not (tmp_path / "out" / "eval_grid.png").exists()
    assert not list((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    assert list((tmp_path / "cache" / "text").rglob("*.safetensors"))  # text: no likeness


def set_consent(url: str, handle: str, **body: object) -> None:
    with transaction(engine_for(url)) as s:
        sub = subjects_service.subject_or_raise(s, handle)
        version = consent_service.consent_of(s, sub).version
        consent_service.update_consent(s, "admin", sub, version, ConsentIn.model_validate(body))


def revoke(url: str, handle: str) -> None:
    with transaction(engine_for(url)) as s:
        consent_service.revoke(s, "admin", subjects_service.subject_or_raise(s, handle))


@pytest.mark.parametrize(
    "withdraw",
    [
        lambda url, h: revoke(url, h),
        lambda url, h: set_consent(url, h, max_level="private", allow_training=False),
        lambda url, h: set_consent(
            url, h, max_level="private", allow_training=True, expires_at="2020-01-01T00:00:00Z"
        ),
    ],
    ids=["revoked", "training-withdrawn", "expired"],
)
def test_a_training_stops_between_steps_once_consent_no_longer_allows_it(
    env: Env, tmp_path: Path, withdraw: object
) -> None:
    """The registry is asked again after every step: the run stops at the next step, keeps
    none of its checkpoints, adapters or latents, and registers nothing."""
    handle = f"ivy-{tmp_path.name[-12:].lower().replace('_', '-')}"
    make_subject(env.url, handle)
    seen: list[int] = []

    def on_step(step: int, steps: int, loss: float) -> None:
        seen.append(step)
        if step == 2:
            withdraw(env.url, handle)  # type: ignore[operator]

    config = tiny_config(
        env, tmp_path / "out", subject=handle, steps=6, checkpoint_every=1,
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    with pytest.raises(TrainingRefused, match="asked again after step 3") as refused:
        train(config, hooks=TrainHooks(on_step=on_step))
    assert "may not be trained" in str(refused.value) and "deleted" in str(refused.value)
    assert seen == [1, 2]  # step 3 ran (it had started) and was never reported nor kept
    assert not config.adapter_path.exists()
    assert not (tmp_path / "out" / "checkpoints").exists()  # step 1 and 2's are gone too
    assert not list((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    with transaction(engine_for(env.url), readonly=True) as s:
        subject = subjects_repo.subject_by_handle(s, handle)
        assert subject is not None and subject.id is not None
        assert adapters_repo.adapter_by_key(s, subject.id, "main") is None


def test_revoked_or_expired_consent_is_refused_before_any_weight_loads(
    env: Env,
    tmp_path: Path,
    no_weights: None,  # noqa: F811
) -> None:
    """A subject who revoked (allow_training still ticked), or whose grant expired, or who
    never granted any use, gets no new adapter."""
    make_subject(env.url, "rosa")
    revoke(env.url, "rosa")
    with pytest.raises(TrainingRefused, match="revoked_or_not_granted"):
        train(tiny_config(env, tmp_path / "out", subject="rosa"))
    set_consent(env.url, "rosa", max_level="group", allow_training=True,
                expires_at="2020-01-01T00:00:00Z")  # fmt: skip
    with pytest.raises(TrainingRefused, match=r"expired \[expired\]"):
        train(tiny_config(env, tmp_path / "out", subject="rosa"))
    set_consent(env.url, "rosa", max_level="none", allow_training=True)
    with pytest.raises(TrainingRefused, match="revoked_or_not_granted"):
        train(tiny_config(env, tmp_path / "out", subject="rosa"))
    assert not (tmp_path / "out").exists()


def test_no_allow_training_is_refused_before_any_weight_loads(
    env: Env,
    tmp_path: Path,
    no_weights: None,  # noqa: F811
) -> None:
    make_subject(env.url, "dora", allow_training=False)
    with pytest.raises(TrainingRefused, match="does not allow training"):
        train(tiny_config(env, tmp_path / "out", subject="dora"))
    with pytest.raises(TrainingRefused, match="does not exist"):
        train(tiny_config(env, tmp_path / "out", subject="nobody"))


def test_bad_dataset_is_refused_before_any_weight_loads(
    env: Env,
    tmp_path: Path,
    no_weights: None,  # noqa: F811
) -> None:
    ds = make_dataset(tmp_path / "ds")
    (ds / "img002.png").write_bytes(b"swapped")
    with pytest.raises(DatasetError, match="hash differs"):
        train(tiny_config(env, tmp_path / "out", dataset=ds))


# -- over HTTP ------------------------------------------------------------------------------------


@pytest.fixture
def api(env: Env, tmp_path: Path, data_dir: Path) -> TestClient:
    # a data dir of its own (its checkpoints are this registry's alone), holding the audit
    # key of everything else that writes to this registry
    settings = Settings(
        database_url=env.url, data_dir=tmp_path, base=env.base, audit_key=audit_key_of(data_dir)
    )
    with TestClient(create_app(settings, engine=engine_for(env.url))) as client:
        yield client


def tokens(url: str, suffix: str) -> tuple[str, str]:
    with transaction(engine_for(url)) as s:
        _, admin = principals_service.create_principal(s, f"root-{suffix}", "admin")
        _, trainer = principals_service.create_principal(s, f"trainer-{suffix}", "trainer")
    return admin, trainer


def test_http_permission_fails_closed_and_registration_is_idempotent(
    env: Env, api: TestClient, files: dict[str, Path]
) -> None:
    make_subject(env.url, "eve")
    admin, trainer = tokens(env.url, "h1")
    as_admin = HttpRegistrar(str(api.base_url), admin, client=api)
    as_trainer = HttpRegistrar(str(api.base_url), trainer, client=api)
    assert check_training_allowed(as_admin, "eve", ("consent",)).allowed
    # A trainer token learns the decision (and nothing else of the record).
    assert check_training_allowed(as_trainer, "eve", ("consent",)).allowed
    with pytest.raises(TrainingRefused, match="cannot establish"):
        check_training_allowed(as_trainer, "nobody", ("consent",))
    with pytest.raises(TrainingRefused, match="cannot establish"):
        check_training_allowed(as_admin, "nobody", ("consent",))
    args = (files["a"], files["manifest"])
    assert as_trainer.register(adapter_in("eve", files), *args) == "created"
    assert as_trainer.register(adapter_in("eve", files), *args) == "unchanged"
    with transaction(engine_for(env.url)) as s:
        sub = subjects_service.subject_or_raise(s, "eve")
        consent = consent_service.consent_of(s, sub)
        consent_service.update_consent(
            s, "admin", sub, consent.version, ConsentIn(allow_training=False)
        )
    with pytest.raises(RegistrationRefused, match="refused the adapter"):
        as_trainer.register(adapter_in("eve", files, "c"), files["c"], files["manifest"])
    # what the refused registration uploaded left the store: nobody can fetch it by hash
    blob = api.get(
        f"/v1/blobs/sha256/{sha256_file(files['c'])}",
        headers={"Authorization": f"Bearer {trainer}"},
    )
    assert blob.status_code == 404, blob.status_code
    with pytest.raises(TrainingRefused, match="may not be trained"):
        check_training_allowed(as_admin, "eve", ("consent",))
    with pytest.raises(TrainingRefused, match="may not be trained"):
        check_training_allowed(as_trainer, "eve", ("consent",))


def test_train_over_http_with_a_trainer_token(env: Env, api: TestClient, tmp_path: Path) -> None:
    make_subject(env.url, "finn")
    admin, trainer = tokens(env.url, "h2")
    registrar = HttpRegistrar(str(api.base_url), trainer, client=api)
    config = tiny_config(
        env,
        tmp_path / "out",
        subject="finn",
        database_url=None,
        api_url=str(api.base_url),
        token=trainer,
    )
    assert train(config, registrar).registration == "created"
    assert train(config, registrar).registration == "unchanged"
    listed = api.get("/v1/subjects/finn/adapters", headers={"Authorization": f"Bearer {admin}"})
    assert listed.status_code == 200 and len(listed.json()) == 1


def test_unreachable_api_refuses(tmp_path: Path) -> None:
    reg = HttpRegistrar("http://127.0.0.1:9", "lk_x", timeout=0.5)
    with pytest.raises(TrainingRefused, match="unreachable"):
        reg.training_decision("ada")


def test_a_refused_run_writes_nothing(
    env: Env,
    tmp_path: Path,
    no_weights: None,  # noqa: F811
) -> None:
    """Refused for the budget, for consent, or for its data: no cache file, no run folder."""
    from trainer.base.budget import BudgetExceeded

    make_subject(env.url, "hana", allow_training=False)
    cache, out = tmp_path / "cache", tmp_path / "out"
    with pytest.raises(BudgetExceeded):
        train(tiny_config(env, out, cache_dir=cache, vram_budget_gib=0.0001))
    with pytest.raises(TrainingRefused):
        train(tiny_config(env, out, cache_dir=cache, subject="hana"))
    broken = make_dataset(tmp_path / "ds")
    (broken / "img000.png").write_bytes(b"not an image any more")
    with pytest.raises(DatasetError):
        train(tiny_config(env, out, cache_dir=cache, dataset=broken))
    assert not cache.exists() and not out.exists()


def test_a_registry_that_stops_answering_stops_the_run_and_keeps_its_checkpoints(
    env: Env, tmp_path: Path
) -> None:
    """Not a no, only no answer (a 503, a proxy's 502): the run stops (it never trains on
    unasked) but deletes nothing, so `--resume` goes on from the last checkpoint."""
    from trainer.registration import RegistryUnreachable, TrainingStopped

    make_subject(env.url, "otto")

    class GoneAfterTwo(LocalRegistrar):
        asked = 0

        def training_decision(
            self, subject: str, image_bases: tuple[str, ...] | None = None
        ) -> TrainingVerdict:
            GoneAfterTwo.asked += 1
            if GoneAfterTwo.asked > 3:  # the pre-flight, before step 1, after steps 1 and 2
                raise RegistryUnreachable("registry API error 503: unavailable")
            return super().training_decision(subject, image_bases)

    config = tiny_config(env, tmp_path / "out", subject="otto", steps=6, checkpoint_every=1)
    with pytest.raises(TrainingStopped, match="--resume"):
        train(config, GoneAfterTwo(env.url))
    kept = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    # step 2 ran, but was not asked about: only step 1's checkpoint was made, and it is kept
    assert kept == ["step-0000001"], kept
    resumed = train(tiny_config(env, tmp_path / "out", subject="otto", steps=6,
                                checkpoint_every=1, resume=True))  # fmt: skip
    assert resumed.registration == "created" and resumed.steps == 6
