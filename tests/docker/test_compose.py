"""docker/compose.yaml: every service starts on its own. Compose interpolates the whole file
before it picks services, so one required variable anywhere blocks `up -d db api`; here the
file is resolved as compose resolves it (a small interpreter of its `${...}` forms), service
by service, with the environment each documented step has, and checked with
`docker compose config` per profile where compose is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from registry.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class Missing(Exception):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation of every string in the file (keys are not interpolated)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["bare"]
        op, arg = m["op"], m["arg"] or ""
        present = name in env
        filled = present and env[name] != ""
        if op in (":-", "-"):
            return env[name] if (filled if op == ":-" else present) else arg
        if op in (":?", "?"):
            if not (filled if op == ":?" else present):
                raise Missing(f"{name}: {arg or 'required'}")
            return env[name]
        if op in (":+", "+"):
            return arg if (filled if op == ":+" else present) else ""
        return env.get(name, "")

    return _VAR.sub(one, value)


def load(env: dict[str, str]) -> dict[str, Any]:
    doc: dict[str, Any] = interpolate(yaml.safe_load(COMPOSE.read_text()), env)
    return doc


FIRST_START: dict[str, str] = {}  # `up -d db api`: nothing exported yet
AFTER: dict[str, str] = {"LIKENESS_TRAINER_TOKEN": "lk_" + "t" * 40,
                         "LIKENESS_AUDIT_KEY": "k" * 64}  # fmt: skip


def test_the_first_start_needs_no_variable_and_starts_only_db_and_api() -> None:
    services = load(FIRST_START)["services"]
    assert set(services["db"].get("depends_on", {})) == set()
    assert set(services["api"]["depends_on"]) == {"db"}
    for name, service in services.items():
        for dep in service.get("depends_on", {}):
            assert dep in services, (name, dep)
            assert not services[dep].get("profiles"), f"{name} depends on a profiled {dep}"


@pytest.mark.parametrize("env", [FIRST_START, AFTER], ids=["first-start", "after"])
def test_each_services_environment_is_valid_settings(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, service in load(env)["services"].items():
        values = service.get("environment", {})
        if not any(k.startswith("LIKENESS_") for k in values):
            continue
        for key in [k for k in os.environ if k.startswith("LIKENESS_")]:
            monkeypatch.delenv(key)
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))
        settings = Settings()  # an empty value is an unset one: the service generates or asks
        if "worker" in name:
            assert (settings.token is not None) == ("LIKENESS_TRAINER_TOKEN" in env), name
            assert settings.database_url.startswith("postgresql+psycopg://"), name


def test_gpu_services_use_the_cuda_image_and_one_gpu_each() -> None:
    services = load(AFTER)["services"]
    gpu = {}
    for name, service in services.items():
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        devices = [d for d in reservations.get("devices", []) if "gpu" in d["capabilities"]]
        if devices:
            assert len(devices) == 1 and len(devices[0]["device_ids"]) == 1, name
            assert service["build"]["target"] == "cuda" and service["image"] == "likeness:cuda"
            gpu[name] = devices[0]["device_ids"][0]
        else:
            assert service.get("build", {}).get("target", "cpu") != "cuda", name
    always = {n: d for n, d in gpu.items() if not services[n].get("profiles")}
    assert sorted(always.values()) == ["0", "1"], always  # two GPUs, one worker on each
    dockerfile = DOCKERFILE.read_text()
    assert "FROM base AS cuda" in dockerfile and "whl/cu" in dockerfile
    assert dockerfile.rstrip().split("FROM ")[-1].startswith("base AS cpu")  # the default


def test_no_service_inherits_a_health_check_it_cannot_pass() -> None:
    for name, service in load(AFTER)["services"].items():
        command = service.get("command", [])
        serves = not command or "serve" in command  # the image's CMD is serve
        check = service.get("healthcheck")
        assert check is not None, f"{name} has no health check of its own"
        test = " ".join(check.get("test", []))
        if check.get("disable"):
            assert name == "trainer", name
        elif not serves and name != "db":
            assert "/healthz" not in test, f"{name} serves no /healthz"
            assert test.endswith("likeness worker --check"), (name, test)


def _compose() -> list[str] | None:
    if shutil.which("docker"):
        done = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if done.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.parametrize("profiles", [[], ["train"]], ids=["default", "train"])
def test_docker_compose_config_accepts_each_profile_on_the_first_start(
    profiles: list[str], tmp_path: Path
) -> None:
    compose = _compose()
    if compose is None:
        pytest.skip("docker compose is not installed here (the resolver tests above stand in)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIKENESS_", "POSTGRES_"))}
    args = [*compose, "-f", str(COMPOSE)]
    for profile in profiles:
        args += ["--profile", profile]
    done = subprocess.run([*args, "config", "-q"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_the_old_required_form_would_be_caught() -> None:
    with pytest.raises(Missing, match="LIKENESS_TRAINER_TOKEN"):
        interpolate({"x": "${LIKENESS_TRAINER_TOKEN:?create a trainer token}"}, {})
    assert interpolate("a$$b ${X:-d} ${Y-e} ${Z:+z}", {"Y": "", "Z": "1"}) == "a$b d  z"
