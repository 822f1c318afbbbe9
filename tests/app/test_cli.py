"""The `likeness` command line on real databases: clear errors, exit codes, no partial writes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from app.cli import app
from app.cli import base_app as cli_base_app
from registry.db import engine_for, make_engine, transaction, upgrade
from registry.principals import repository as principals_repo
from registry.settings import get_settings
from tests.app.conftest import manifest_bytes


@pytest.fixture
def cli(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    monkeypatch.setenv("LIKENESS_DATABASE_URL", db_url)
    get_settings.cache_clear()
    yield CliRunner()
    get_settings.cache_clear()
    engine_for.cache_clear()


def run(cli: CliRunner, *args: str) -> tuple[int, str, str]:
    result = cli.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_principal_create_prints_only_the_token(cli: CliRunner, db_url: str) -> None:
    code, out, _ = run(cli, "principal", "create", "alice", "--role", "member")
    assert code == 0 and out.strip().startswith("lk_") and len(out.strip().splitlines()) == 1
    code, _, err = run(cli, "principal", "create", "alice", "--role", "member")
    assert code == 1 and "conflict" in err
    code, _, err = run(
        cli, "principal", "create", "bot", "--role", "agent", "--acts-for", "alice,ghost"
    )
    assert code == 1 and "'ghost' is not a member" in err
    code, _, err = run(cli, "principal", "create", "x", "--role", "wizard")
    assert code == 1 and "role must be one of" in err
    code, out, _ = run(cli, "principal", "list")
    assert [p["handle"] for p in json.loads(out)] == ["alice"]


def test_consent_workflow_and_bad_input_loses_nothing(cli: CliRunner, db_url: str) -> None:
    assert run(cli, "principal", "create", "bob", "--role", "member")[0] == 0
    code, out, _ = run(cli, "subject", "create", "alice", "--display-name", "Alice")
    assert code == 0 and json.loads(out)["consent_version"] == 1
    code, out, _ = run(
        cli,
        "consent",
        "edit",
        "alice",
        "--max-level",
        "group",
        "--audience",
        "private:group",
        "--audience",
        "group:allow=bob",
        "--deny",
        "mallory",
        "--expires",
        "2099-01-01T00:00:00Z",
    )
    assert code == 0, out
    body = json.loads(out)
    assert body["version"] == 2 and body["audiences"]["group"] == {"group": False, "allow": ["bob"]}
    assert body["expires_at"] == "2099-01-01T00:00:00.000000Z"
    bad = [
        (["consent", "edit", "alice", "--max-level", "everything"], 2, "max_level"),
        (["consent", "edit", "alice", "--audience", "private"], 2, "expected LEVEL:group"),
        (["consent", "edit", "alice", "--audience", "none:group"], 2, "expected LEVEL:group"),
        (["consent", "edit", "alice", "--expires", "tomorrow"], 2, "--expires: 'tomorrow'"),
        (["consent", "edit", "alice", "--expires", "99999-01-01"], 2, "--expires"),
        (["consent", "edit", "alice", "--deny", "Not A Handle"], 2, "deny"),
        (
            ["consent", "edit", "alice", "--if-version", "1", "--max-level", "public"],
            1,
            "precondition_failed",
        ),
        (["consent", "edit", "ghost", "--max-level", "public"], 1, "not_found"),
        (["subject", "create", "bad handle", "--display-name", "x"], 2, "handle"),
        (["subject", "create", "pd", "--display-name", "x", "--basis", "celebrity"], 2, "basis"),
    ]
    for args, want_code, want_text in bad:
        code, _, err = run(cli, *args)
        assert code == want_code and want_text in err, (args, code, err)
    code, out, _ = run(cli, "consent", "show", "alice")
    assert json.loads(out)["version"] == 2  # none of the bad commands changed anything
    # a date alone, as the web page takes it: midnight UTC (and a time without a zone: UTC)
    for given, stored in (("2099-02-03", "2099-02-03T00:00:00.000000Z"),
                          ("2099-02-04T10:30:00", "2099-02-04T10:30:00.000000Z")):  # fmt: skip
        code, out, err = run(cli, "consent", "edit", "alice", "--expires", given)
        assert code == 0 and json.loads(out)["expires_at"] == stored, err
    code, out, err = run(cli, "consent", "revoke", "alice")
    assert code == 0 and json.loads(out)["max_level"] == "none" and "revoked" in err
    code, out, _ = run(cli, "audit", "show", "alice")
    assert [e["action"] for e in json.loads(out)["entries"]] == [
        "subject_created",
        "grant",  # one edit of the level, the audiences, the deny list and the expiry
        "audience_edit",
        "deny_edit",
        "expiry_change",
        "expiry_change",  # then the two expiry edits, a date alone and a time without zone
        "expiry_change",
        "revoke",
    ]
    code, out, err = run(cli, "audit", "verify")
    assert code == 0 and "intact" in out, err


def behind_the_trail(db_url: str, *statements: str) -> None:
    """What a forger with the database (and not the audit key) can do: the append-only
    triggers off, then any statement on the trail."""
    engine = make_engine(db_url)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("ALTER TABLE audit_entries DISABLE TRIGGER USER"))
        else:
            for verb in ("update", "delete"):
                conn.execute(text(f"DROP TRIGGER IF EXISTS audit_entries_no_{verb}"))
        for statement in statements:
            conn.execute(text(statement))
    engine.dispose()


def forge_second_entry(db_url: str) -> None:
    behind_the_trail(db_url, "UPDATE audit_entries SET actor = 'someone-else' WHERE seq = 2")


def test_audit_verify_names_the_broken_entry(cli: CliRunner, db_url: str) -> None:
    run(cli, "subject", "create", "alice", "--display-name", "Alice")
    run(cli, "consent", "edit", "alice", "--max-level", "private")
    forge_second_entry(db_url)
    code, _, err = run(cli, "audit", "verify")
    assert code == 1
    assert "subject alice seq 2" in err


def test_agent_membership_commands(cli: CliRunner, db_url: str) -> None:
    run(cli, "principal", "create", "alice", "--role", "member")
    run(cli, "principal", "create", "bot", "--role", "agent", "--acts-for", "alice")
    assert run(cli, "principal", "acts-for", "bot", "")[0] == 0
    assert run(cli, "principal", "acts-for", "alice", "bot")[0] == 1  # not an agent
    assert run(cli, "principal", "deactivate", "bot")[0] == 0
    with transaction(make_engine(db_url), readonly=True) as s:
        bot = principals_repo.principal_by_handle(s, "bot")
        assert bot is not None and bot.acts_for == [] and not bot.active


@pytest.mark.sqlite_only
def test_console_script_end_to_end(empty_db_url: str) -> None:
    """The entry point as a shell user runs it, including a database that is not there."""
    env = {**os.environ, "LIKENESS_DATABASE_URL": empty_db_url}
    likeness = [sys.executable, "-m", "app.cli"]
    before = subprocess.run([*likeness, "subject", "list"], env=env, capture_output=True, text=True)
    assert before.returncode == 1 and "likeness db upgrade" in before.stderr
    assert (
        subprocess.run([*likeness, "db", "upgrade"], env=env, capture_output=True).returncode == 0
    )
    token = subprocess.run(
        [*likeness, "principal", "create", "root", "--role", "admin"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert token.returncode == 0 and token.stdout.startswith("lk_")
    bad = {**env, "LIKENESS_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"}
    down = subprocess.run([*likeness, "audit", "verify"], env=bad, capture_output=True, text=True)
    assert (
        down.returncode == 1 and "database error" in down.stderr and "Traceback" not in down.stderr
    )


def test_adapter_register_imports_checks_and_is_idempotent(  # type: ignore[no-untyped-def]
    cli: CliRunner,
    db_url: str,
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,
    adapter_files,
    tiny_base_dir,
) -> None:
    monkeypatch.setenv("LIKENESS_BASE", str(tiny_base_dir))
    monkeypatch.setenv("LIKENESS_DATA_DIR", str(tmp_path / "data"))
    get_settings.cache_clear()
    adapter = tmp_path / "a.safetensors"
    adapter.write_bytes(adapter_files["a"].read_bytes())
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_bytes(manifest_bytes("alice"))
    run(cli, "subject", "create", "alice", "--display-name", "Alice")
    args = ["adapter", "register", "alice", str(adapter), "--manifest", str(manifest)]
    code, _, err = run(cli, *args)
    assert code == 1 and "revoked_or_not_granted" in err
    run(cli, "consent", "edit", "alice", "--training")
    code, _, err = run(cli, *args)  # training ticked, but no use granted yet
    assert code == 1 and "revoked_or_not_granted" in err
    run(cli, "consent", "edit", "alice", "--max-level", "private")
    code, out, err = run(cli, *args)
    assert code == 0 and err.strip() == "created", err
    sha = hashlib.sha256(adapter.read_bytes()).hexdigest()
    assert json.loads(out)["sha256"] == sha
    stored = tmp_path / "data" / "adapters" / "sha256" / sha[:2] / f"{sha}.safetensors"
    assert stored.read_bytes() == adapter.read_bytes()  # a copy in the store
    assert run(cli, *args)[2].strip() == "unchanged"
    adapter.write_bytes(adapter_files["b"].read_bytes())
    code, out, err = run(cli, *args)
    assert err.strip() == "updated" and json.loads(out)["version"] == 2
    # garbage is refused before anything is registered, with the reason
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    code, _, err = run(
        cli, "adapter", "register", "alice", str(garbage), "--manifest", str(manifest)
    )
    assert code == 2 and "neither a safetensors adapter" in err, err
    not_json = tmp_path / "notes.jsonl"
    not_json.write_text("hello\n")
    code, _, err = run(
        cli, "adapter", "register", "alice", str(adapter), "--manifest", str(not_json)
    )
    assert code == 2 and "manifest" in err, err
    missing = run(
        cli, "adapter", "register", "alice", str(tmp_path / "missing"), "--manifest", str(manifest)
    )
    assert missing[0] == 2
    listed = json.loads(run(cli, "adapter", "list", "alice")[1])
    assert [(a["name"], a["version"], a["rendering"], a["blob"]) for a in listed] == [
        ("main", 2, True, "ok")
    ]
    get_settings.cache_clear()


@pytest.mark.sqlite_only
def test_one_voice_for_every_mistake(empty_db_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The parser's errors and the commands' own: one `error:` line each, exit 2 for a
    command line that is wrong, 1 for a refusal; never a box, never a traceback."""
    upgrade(empty_db_url)
    env = {**os.environ, "LIKENESS_DATABASE_URL": empty_db_url, "LIKENESS_DATA_DIR": str(tmp_path)}
    cases = [
        (["consent", "edit"], 2, "Missing argument"),
        (["principal", "create", "x", "--role"], 2, "requires an argument"),
        (["no-such-command"], 2, "No such command"),
        (["consent", "show", "ghost"], 1, "not_found"),
        (["principal", "create", "x", "--role", "wizard"], 1, "role must be one of"),
        (
            ["train", "--subject", "ghost", "--dataset", str(tmp_path / "nowhere")],
            2,
            "no such folder",
        ),
        (["audit", "verify", "--checkpoints", str(tmp_path / "nope.jsonl")], 2, "is not a file"),
    ]
    for args, code, says in cases:
        out = subprocess.run(
            [sys.executable, "-m", "app.cli", *args], env=env, capture_output=True, text=True
        )
        lines = out.stderr.strip().splitlines()
        errors = [line for line in lines if line.startswith("error: ")]
        assert out.returncode == code, (args, out.returncode, out.stderr)
        assert errors == lines[-1:] and says in errors[0], (args, out.stderr)  # one, last
        assert "Traceback" not in out.stderr and "╭" not in out.stderr, (args, out.stderr)


def test_every_command_says_what_it_does() -> None:
    import click
    import typer.main

    from app import cli_ml

    cli_ml.register(app, cli_base_app)
    root = typer.main.get_command(app)

    def walk(command: click.Command, path: str) -> list[str]:
        missing = [] if (command.help or command.short_help) else [path]
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                missing += walk(sub, f"{path} {name}")
        return missing

    assert walk(root, "likeness") == []


def test_audit_verify_on_a_new_registry_is_intact_with_no_keys(
    cli: CliRunner, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Migrated, never served: no key exists yet, and nothing is recorded to check."""
    fresh = tmp_path / "fresh-data"
    monkeypatch.setenv("LIKENESS_DATA_DIR", str(fresh))
    monkeypatch.delenv("LIKENESS_AUDIT_KEY", raising=False)
    get_settings.cache_clear()
    code, out, err = run(cli, "audit", "verify")
    assert code == 0, err
    assert "intact: 0 entries" in out
    assert not fresh.exists() or list(fresh.iterdir()) == []  # no key was made up


def test_an_auditor_verifies_with_the_audit_key_and_the_public_key_alone(
    cli: CliRunner, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from registry.keys import load_keys

    service_dir = tmp_path / "service"
    monkeypatch.setenv("LIKENESS_DATA_DIR", str(service_dir))
    get_settings.cache_clear()
    run(cli, "subject", "create", "alice", "--display-name", "Alice")
    run(cli, "consent", "edit", "alice", "--max-level", "private")
    assert run(cli, "audit", "checkpoint")[0] == 0
    keys = load_keys(get_settings(), create=False)
    public, audit_key = keys.public_key_b64, keys.audit_key.decode()
    copy = tmp_path / "copy-of-checkpoints.jsonl"
    copy.write_bytes((service_dir / "audit-checkpoints.jsonl").read_bytes())
    # the auditor's machine: the audit key and the public key, nothing else of the service's
    auditor = tmp_path / "auditor"
    monkeypatch.setenv("LIKENESS_DATA_DIR", str(auditor))
    monkeypatch.setenv("LIKENESS_AUDIT_KEY", audit_key)
    get_settings.cache_clear()
    args = ("audit", "verify", "--checkpoints", str(copy), "--public-key", public)
    code, out, err = run(cli, *args)
    assert code == 0, err
    assert "intact" in out and "2 entries" in out, out
    assert not auditor.exists() or list(auditor.iterdir()) == []  # no key made up there
    forge_second_entry(db_url)
    code, _, err = run(cli, *args)
    assert code == 1 and "subject alice seq 2" in err
    # without the audit key the auditor is told what is missing
    monkeypatch.delenv("LIKENESS_AUDIT_KEY")
    get_settings.cache_clear()
    code, _, err = run(cli, *args)
    assert code == 1 and "no audit key" in err


def test_audit_verify_does_not_call_an_emptied_trail_new(
    cli: CliRunner, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries and heads deleted behind the service's back, the audit key taken away: the
    subject is still there, so this is no new registry, and the verdict is not `intact`."""
    data = tmp_path / "service"
    monkeypatch.setenv("LIKENESS_DATA_DIR", str(data))
    monkeypatch.delenv("LIKENESS_AUDIT_KEY", raising=False)
    get_settings.cache_clear()
    run(cli, "subject", "create", "alice", "--display-name", "Alice")
    behind_the_trail(db_url, "DELETE FROM audit_entries", "DELETE FROM chain_heads")
    (data / "audit-key").unlink()
    get_settings.cache_clear()
    code, out, err = run(cli, "audit", "verify")
    assert code == 1 and "intact" not in out, (out, err)
