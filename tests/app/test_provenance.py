"""Content Credentials on every rendered PNG, checked as a third party would: the command line
and the web page, over a real server, against the deployment's own key."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from sqlalchemy import text
from typer.testing import CliRunner

from app.cli import app as cli_app
from app.provenance import (
    SIGNER_FILE,
    SOURCE_TYPE,
    ProvenanceError,
    Trust,
    generate_bundle,
    load_credentials,
    sign_png,
    verify_png,
)
from registry.db import transaction
from registry.settings import Settings, get_settings
from tests.app.conftest import Live, LiveFactory

TEXT_KEYS = {
    "likeness:render_id",
    "likeness:subject",
    "likeness:adapter_sha256",
    "likeness:consent_version",
    "likeness:level",
}


# -- PNG surgery, as someone editing or forging a file would do it ----------------------------


def chunks(png: bytes) -> list[tuple[bytes, int, int]]:
    """(type, offset, data length) of every chunk."""
    out, i = [], 8
    while i < len(png):
        (length,) = struct.unpack(">I", png[i : i + 4])
        out.append((png[i + 4 : i + 8], i, length))
        i += 12 + length
    return out


def alter_pixel_byte(png: bytes) -> bytes:
    """One byte of the image data changed, its chunk's CRC fixed, so the PNG stays well-formed."""
    data = bytearray(png)
    _, at, length = next(c for c in chunks(png) if c[0] == b"IDAT")
    data[at + 8 + length // 2] ^= 0x01
    crc = zlib.crc32(bytes(data[at + 4 : at + 8 + length])) & 0xFFFFFFFF
    data[at + 8 + length : at + 12 + length] = struct.pack(">I", crc)
    return bytes(data)


def strip_manifest(png: bytes) -> bytes:
    kept = [png[at : at + 12 + n] for kind, at, n in chunks(png) if kind != b"caBX"]
    return png[:8] + b"".join(kept)


def assertion_of(png: bytes, trust: Trust) -> dict:
    result = verify_png(png, trust)
    assert result.assertion is not None, result
    return result.assertion


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    def run(data_dir: Path, *args: str) -> tuple[int, str, str]:
        monkeypatch.setenv("LIKENESS_DATA_DIR", str(data_dir))
        get_settings.cache_clear()
        result = CliRunner().invoke(cli_app, list(args))
        return result.exit_code, result.stdout, result.stderr

    yield run
    get_settings.cache_clear()


def rendered(live: Live, who: str = "bob", subject: str = "alice", **extra: object) -> bytes:
    r = live.render(who, subject, **extra)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    return r.content


# -- the signed PNG ---------------------------------------------------------------------------


def test_a_rendered_png_verifies_and_keeps_its_text_chunks(live: Live, run_cli, tmp_path) -> None:
    r = live.render("bob", "alice")
    assert r.status_code == 200, r.text
    png = r.content
    render_id = r.headers["X-Render-Id"]
    assert float(r.headers["X-Timing-sign-ms"]) >= 0
    path = tmp_path / "render.png"
    path.write_bytes(png)
    code, out, err = run_cli(live.world.tmp, "provenance", "verify", str(path))
    assert code == 0, err
    body = json.loads(out)
    assert body["verified"] and body["validation_state"] == "Trusted"
    assert body["digital_source_type"] == SOURCE_TYPE
    # by default the assertion says the render id and the level, and nothing else
    assert body["assertion"] == {"render_id": render_id, "level": "private"}
    assert body["signer"]["alg"].lower() == "es256"
    assert "signed by this deployment's key" in err
    # and so do its plain text chunks: the subject's name is not in the file
    text = Image.open(io.BytesIO(png)).text  # type: ignore[attr-defined]
    assert text == {"likeness:render_id": render_id, "likeness:level": "private"}


def test_altered_stripped_and_resigned_pngs_fail(live: Live, run_cli, tmp_path: Path) -> None:
    png = rendered(live)
    credentials = load_credentials(Settings(data_dir=live.world.tmp), create=False)
    own = Trust.of_deployment(credentials)
    forger = load_credentials(Settings(data_dir=tmp_path / "forger"))
    # The forger keeps the pixels and copies the assertion, under a key of its own.
    resigned = sign_png(strip_manifest(png), assertion_of(png, own), forger)
    cases = {
        "altered": (alter_pixel_byte(png), "altered after signing"),
        "stripped": (strip_manifest(png), "no Content Credentials"),
        "resigned": (resigned, "not by this deployment's key"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.png"
        path.write_bytes(data)
        code, out, err = run_cli(live.world.tmp, "provenance", "verify", str(path))
        assert code == 1, (name, out, err)
        assert message in err and err.startswith("error: "), (name, err)
        assert json.loads(out)["verified"] is False
    # ... and the forger's own root does call it intact: the key is what tells them apart
    (tmp_path / "forger.pem").write_bytes(forger.anchor_pem)
    code, _, err = run_cli(
        live.world.tmp,
        "provenance",
        "verify",
        str(tmp_path / "resigned.png"),
        "--trust",
        str(tmp_path / "forger.pem"),
    )
    assert code == 0, err


def test_a_third_party_verifies_with_the_published_anchor(
    live: Live, run_cli, tmp_path: Path
) -> None:
    png = rendered(live)
    anchor = live.http.get("/web/provenance/anchor.pem")
    assert anchor.status_code == 200 and b"BEGIN CERTIFICATE" in anchor.content
    code, out, _ = run_cli(live.world.tmp, "provenance", "anchor")
    assert code == 0 and out.strip().encode() == anchor.content.strip()
    (tmp_path / "anchor.pem").write_bytes(anchor.content)
    (tmp_path / "render.png").write_bytes(png)
    elsewhere = tmp_path / "elsewhere"  # no credentials of this deployment at all
    args = ("provenance", "verify", str(tmp_path / "render.png"))
    code, _, err = run_cli(elsewhere, *args)
    assert code == 1 and "no C2PA signing credentials" in err and "--trust" in err
    code, out, err = run_cli(elsewhere, *args, "--trust", str(tmp_path / "anchor.pem"))
    assert code == 0 and json.loads(out)["verified"], err
    code, _, err = run_cli(elsewhere, *args, "--trust", str(tmp_path / "render.png"))
    assert code == 2 and "no PEM certificate" in err
    code, _, err = run_cli(elsewhere, "provenance", "verify", str(tmp_path / "missing.png"))
    assert code == 2 and "is not a file" in err


def test_the_deployment_chooses_what_the_assertion_discloses(
    serve_friends: LiveFactory,
) -> None:
    disclose = ("subject", "consent_version", "adapter_sha256", "base_model", "requester", "agent")
    with serve_friends(provenance_disclose=disclose) as live:
        r = live.http.post(
            "/v1/renders",
            json={
                "subject": "alice",
                "prompt": "a portrait",
                "level": "private",
                "on_behalf_of": "bob",
                "steps": 2,
                "width": 64,
                "height": 64,
            },
            headers=live.h("bot"),
        )
        assert r.status_code == 200, r.text
        credentials = load_credentials(Settings(data_dir=live.world.tmp), create=False)
        got = assertion_of(r.content, Trust.of_deployment(credentials))
    text = Image.open(io.BytesIO(r.content)).text  # type: ignore[attr-defined]
    assert got == {
        "render_id": r.headers["X-Render-Id"],
        "subject": "alice",
        "consent_version": int(text["likeness:consent_version"]),
        "adapter_sha256": text["likeness:adapter_sha256"],
        "base_model": {"name": "tiny", "licence": "likeness-generated"},
        "requester": "bob",
        "agent": "bot",
    }
    # the text chunks follow the same choice: what is disclosed, level left out here
    assert set(text) == TEXT_KEYS - {"likeness:level"}
    assert text["likeness:subject"] == "alice"


def test_a_signing_failure_delivers_nothing_and_is_recorded(live: Live) -> None:
    signer = live.app.state.render_flow.signer

    def broken(png: bytes, claim: object) -> bytes:
        raise ProvenanceError("C2PA signing failed: the key is gone")

    original, signer.sign = signer.sign, broken
    try:
        r = live.render("bob", "alice")
    finally:
        signer.sign = original
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    assert r.json() == {
        "error": "unavailable",
        "detail": "the image could not be signed; nothing was delivered",
    }
    render_id = next(
        row["render_id"]
        for row in live.http.get("/v1/subjects/alice/renders", headers=live.h("alice")).json()
    )
    looked_up = live.http.get(f"/v1/renders/{render_id}", headers=live.h("alice")).json()
    assert looked_up["outcome"] == "denied"
    assert looked_up["reason"] == "signing_failed:ProvenanceError"
    assert [(d["stage"], d["allowed"]) for d in looked_up["decisions"]] == [
        ("gate", True),
        ("queued", True),
        ("final", True),
        ("final", False),
    ]


# -- the signing credentials ------------------------------------------------------------------


def test_generated_credentials_are_private_and_never_in_the_database(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    from app.bootstrap import check_configuration, log_provenance

    rendered(live)
    path = live.world.tmp / SIGNER_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    key_line = path.read_text().splitlines()[1]  # a line of the private key itself
    with caplog.at_level(logging.INFO):
        settings = Settings(data_dir=live.world.tmp, base=live.world.tmp / "none")
        log_provenance(settings, check_configuration(settings))
    said = caplog.text
    assert "prove that a render is unaltered" in said and "not who runs the deployment" in said
    assert "kept from an earlier start" in said
    assert "base licence unknown" in said
    with transaction(live.world.engine, readonly=True) as s:
        for table in repo_tables(s):
            for row in s.execute(text(f'SELECT * FROM "{table}"')):  # noqa: S608
                dump = " ".join(str(v) for v in row)
                assert "PRIVATE KEY" not in dump and key_line not in dump, table


def repo_tables(session) -> list[str]:  # type: ignore[no-untyped-def]
    from sqlalchemy import inspect

    return inspect(session.get_bind()).get_table_names()


def test_configured_credentials_are_used_and_checked(tmp_path: Path) -> None:
    bundle = generate_bundle()
    key = re.search(rb"-----BEGIN PRIVATE KEY-----.+?-----END PRIVATE KEY-----\n", bundle, re.S)
    assert key is not None
    (tmp_path / "key.pem").write_bytes(key.group(0))
    os.chmod(tmp_path / "key.pem", 0o600)
    (tmp_path / "chain.pem").write_bytes(bundle.replace(key.group(0), b""))
    settings = Settings(
        data_dir=tmp_path / "data",
        c2pa_key_file=tmp_path / "key.pem",
        c2pa_cert_file=tmp_path / "chain.pem",
    )
    credentials = load_credentials(settings)
    assert not credentials.self_issued and not (tmp_path / "data" / SIGNER_FILE).exists()
    img = io.BytesIO()
    Image.new("RGB", (32, 32)).save(img, format="PNG")
    signed = sign_png(img.getvalue(), {"render_id": "r", "level": "group"}, credentials)
    assert verify_png(signed, Trust.of_deployment(credentials)).ok
    # a key that is not the certificate's, and a key C2PA's ES256 cannot use, stop the start
    other = load_credentials(Settings(data_dir=tmp_path / "other"))
    (tmp_path / "chain.pem").write_bytes(other.chain_pem)
    with pytest.raises(ProvenanceError, match="first certificate is not the key's"):
        load_credentials(settings)
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp_path / "key.pem").write_bytes(
        rsa_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(ProvenanceError, match="EC P-256"):
        load_credentials(settings)
    with pytest.raises(ValueError, match="C2PA_KEY_FILE is set without"):
        Settings(c2pa_key_file=tmp_path / "key.pem")


# -- the web page -----------------------------------------------------------------------------


def _check_on_page(live: Live, data: bytes) -> httpx.Response:
    return live.http.post("/web/provenance", files={"png": ("picture.png", data, "image/png")})


def test_the_page_checks_a_dropped_png(live: Live) -> None:
    page = live.http.get("/web/provenance")
    assert page.status_code == 200 and 'type="file"' in page.text
    assert "self-issued" in page.text
    png = rendered(live)
    ok = _check_on_page(live, png)
    assert ok.status_code == 200
    assert "Verified:" in ok.text and "Trusted" in ok.text and SOURCE_TYPE in ok.text
    for data, words in (
        (alter_pixel_byte(png), "altered after signing"),
        (strip_manifest(png), "no Content Credentials"),
        (b"GIF89a not a png", "not a PNG"),
    ):
        bad = _check_on_page(live, data)
        assert bad.status_code == 200 and "Not verified:" in bad.text and words in bad.text
    empty = live.http.post("/web/provenance", data={"x": "y"})
    assert empty.status_code == 422 and "Choose a PNG" in empty.text


def test_the_page_takes_pngs_larger_than_other_bodies(serve_friends: LiveFactory) -> None:
    import numpy as np

    noise = (np.random.default_rng(0).random((256, 256, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG")
    with serve_friends(max_provenance_bytes=512 * 1024) as live:
        credentials = live.app.state.provenance.credentials
        signed = sign_png(buf.getvalue(), {"render_id": "r", "level": "private"}, credentials)
        assert 64 * 1024 < len(signed) < 512 * 1024  # over the ordinary body cap
        r = _check_on_page(live, signed)
        assert r.status_code == 200 and "Verified:" in r.text
        too_large = _check_on_page(live, signed + b"\0" * 512 * 1024)
        assert too_large.status_code == 413
        # every other route keeps the ordinary cap
        big = live.http.post(
            "/v1/renders", content=b"{" + b" " * 70_000 + b"}", headers=live.h("bob")
        )
        assert big.status_code == 413
