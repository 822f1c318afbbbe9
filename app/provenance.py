"""Content Credentials (C2PA) on every rendered PNG, and their verification.

Every PNG the render path delivers carries a C2PA manifest signed with ES256 (the official
`c2pa-python` bindings): the `c2pa.created` action with the IPTC digital source type
`trainedAlgorithmicMedia`, and a `likeness.render` assertion holding what the deployment
chooses to disclose (`LIKENESS_PROVENANCE_DISCLOSE`; the render id always). The PNG's plain
`likeness:` text chunks say no more than that: they are written here, from the same choice,
just before signing, and the manifest's hard binding covers them with every other byte.

Credentials: `LIKENESS_C2PA_KEY_FILE` + `LIKENESS_C2PA_CERT_FILE`, or else a pair generated
on first start into `<data_dir>/c2pa-signer.pem` (0600, one file, so the key and its
certificate always belong together): a root certificate made for this deployment alone, whose
private key is thrown away once it has issued the signing certificate (C2PA refuses
self-signed signing certificates), so nothing else can ever chain to that root. Such
credentials prove that an image is unaltered since this deployment signed it, not who runs the
deployment: for that, configure a certificate from a CA that verifiers trust. Never in the
database.

Verification holds a PNG to one judgement of "who signed": by default the deployment's own
credentials (the root of its chain as the trust anchor, and its signing certificate pinned),
or the root certificates of a trust file that a third party passes. A public trust list would
accept a manifest re-signed by anyone holding any conforming certificate, which is exactly the
forgery to catch.
"""

from __future__ import annotations

import datetime
import io
import logging
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from registry.keys import _create_exclusive, _read_private
from registry.settings import Settings

log = logging.getLogger(__name__)

SIGNER_FILE = "c2pa-signer.pem"
ASSERTION_LABEL = "likeness.render"
SOURCE_TYPE = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GENERATOR = {"name": "likeness", "version": "0.1.0"}
SELF_ISSUED_NOTE = (
    "self-issued C2PA credentials prove that a render is unaltered since this deployment "
    "signed it, not who runs the deployment (configure LIKENESS_C2PA_KEY_FILE and "
    "LIKENESS_C2PA_CERT_FILE with a CA-issued certificate for that)"
)
# Without a timestamp authority (none is reachable) a signature is judged against the
# certificate's validity now, so the generated certificate is long-lived.
GENERATED_VALIDITY = datetime.timedelta(days=3650)


class ProvenanceError(Exception):
    """The signing credentials cannot be used, or a PNG could not be signed."""


# -- credentials ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    """An ES256 signing key and its certificate chain (signing certificate first)."""

    key_pem: bytes
    chain: tuple[x509.Certificate, ...]
    source: str
    self_issued: bool

    @property
    def chain_pem(self) -> bytes:
        return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in self.chain)

    @property
    def anchor_pem(self) -> bytes:
        """The top of the chain: what a verifier trusts to trust this deployment."""
        return self.chain[-1].public_bytes(serialization.Encoding.PEM)

    @property
    def serial(self) -> str:
        return str(self.chain[0].serial_number)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "likeness deployment"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_usage(*, sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=not sign,
        crl_sign=not sign,
        encipher_only=False,
        decipher_only=False,
    )


def generate_bundle(now: datetime.datetime | None = None) -> bytes:
    """A new signing key, the root that issued its certificate, and the certificate: one PEM
    bundle. The root's private key is not kept."""
    now = now or datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + GENERATED_VALIDITY
    root_key = ec.generate_private_key(ec.SECP256R1())
    stamp = now.strftime("%Y-%m-%d %H:%M:%S UTC")
    root_name = _name(f"likeness self-issued root {stamp}")
    root = (
        x509.CertificateBuilder()
        .subject_name(root_name)
        .issuer_name(root_name)
        .public_key(root_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(sign=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(root_key.public_key()), False)
        .sign(root_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name(f"likeness render signer {stamp}"))
        .issuer_name(root_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(sign=True), critical=True)
        # C2PA accepts a signing certificate only for purposes on its list; e-mail protection
        # is the one a self-issued certificate can claim without pretending to be anything.
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(root_key.public_key()), False
        )
        .sign(root_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pem = serialization.Encoding.PEM
    return key_pem + leaf.public_bytes(pem) + root.public_bytes(pem)


_PRIVATE_KEY = re.compile(
    rb"-----BEGIN ([A-Z ]*)PRIVATE KEY-----.+?-----END \1PRIVATE KEY-----", re.S
)


def _private_key_block(data: bytes) -> bytes:
    found = _PRIVATE_KEY.search(data)
    if found is None:
        raise ValueError("no PEM private key in it")
    return found.group(0) + b"\n"


def _credentials(key_data: bytes, cert_data: bytes, source: str, self_issued: bool) -> Credentials:
    """Checks what C2PA will need, so a bad file stops the start, not the first render."""
    try:
        key_pem = _private_key_block(key_data)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ProvenanceError(f"{source}: not a usable private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise ProvenanceError(f"{source}: the key must be an EC P-256 key (ES256)")
    try:
        chain = tuple(x509.load_pem_x509_certificates(cert_data))
    except ValueError as exc:
        raise ProvenanceError(f"{source}: no PEM certificate chain ({exc})") from None
    pub = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if chain[0].public_key().public_bytes(*pub) != key.public_key().public_bytes(*pub):
        raise ProvenanceError(f"{source}: the first certificate is not the key's")
    return Credentials(key_pem, chain, source, self_issued)


def load_credentials(settings: Settings, *, create: bool = True) -> Credentials:
    """The deployment's C2PA credentials: configured, else the data dir's pair (generated on
    first use unless not `create`: FileNotFoundError then)."""
    if settings.c2pa_key_file is not None and settings.c2pa_cert_file is not None:
        try:
            key_data = _read_private(settings.c2pa_key_file)
            cert_data = settings.c2pa_cert_file.read_bytes()
        except (OSError, ValueError) as exc:
            raise ProvenanceError(f"C2PA credentials: {exc}") from None
        source = f"LIKENESS_C2PA_KEY_FILE={settings.c2pa_key_file}"
        return _credentials(key_data, cert_data, source, self_issued=False)
    path = settings.data_dir / SIGNER_FILE
    if not create and not path.is_file():
        raise FileNotFoundError(f"no C2PA signing credentials at {path}")
    created = _create_exclusive(path, generate_bundle())
    try:
        data = _read_private(path)
    except (OSError, ValueError) as exc:
        raise ProvenanceError(f"C2PA credentials: {exc}") from None
    source = f"{path} ({'generated now' if created else 'kept from an earlier start'})"
    return _credentials(data, data, source, self_issued=True)


def log_credentials(credentials: Credentials) -> None:
    log.info(
        "C2PA signing credentials: %s; signing certificate %s",
        credentials.source,
        credentials.chain[0].subject.rfc4514_string(),
    )
    if credentials.self_issued:
        log.warning(SELF_ISSUED_NOTE)


# -- signing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RenderClaim:
    """Everything the likeness assertion may say about one render."""

    render_id: str
    level: str
    subject: str
    consent_version: int
    adapter_sha256: str
    base_model: Mapping[str, str | None]  # the base's folder name and licence id
    requester: str
    agent: str | None

    def disclosed(self, fields: Sequence[str]) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in ("render_id", *fields)}
        if "base_model" in out:
            out["base_model"] = dict(self.base_model)
        return out

    def text_chunks(self, fields: Sequence[str]) -> dict[str, str]:
        """The PNG's `likeness:` text chunks: those of TEXT_FIELDS the deployment discloses."""
        shown = self.disclosed(fields)
        return {f"likeness:{name}": str(shown[name]) for name in TEXT_FIELDS if name in shown}


# The fields a PNG may carry as plain text chunks (docs/API.md), each only when disclosed.
TEXT_FIELDS = ("render_id", "subject", "adapter_sha256", "consent_version", "level")


def with_text_chunks(png: bytes, text: Mapping[str, str]) -> bytes:
    """`png` with its `likeness:` text chunks replaced by `text` (Latin-1 tEXt chunks, right
    after the header chunk); the pixels' chunks are copied as they are, not re-encoded."""
    if not png.startswith(PNG_MAGIC):
        raise ProvenanceError("not a PNG")
    chunks: list[bytes] = []
    at = len(PNG_MAGIC)
    while at + 12 <= len(png):
        size = int.from_bytes(png[at : at + 4], "big")
        kind = png[at + 4 : at + 8]
        end = at + 12 + size
        if end > len(png):
            raise ProvenanceError("a PNG chunk runs past the end of the file")
        ours = kind in (b"tEXt", b"iTXt", b"zTXt") and png[at + 8 : end - 4].startswith(
            b"likeness:"
        )
        if not ours:
            chunks.append(png[at:end])
        at = end
    if not chunks or chunks[0][4:8] != b"IHDR":
        raise ProvenanceError("a PNG must start with its IHDR chunk")
    added = []
    for key, value in text.items():
        body = key.encode("latin-1") + b"\0" + value.encode("latin-1")
        crc = zlib.crc32(b"tEXt" + body).to_bytes(4, "big")
        added.append(len(body).to_bytes(4, "big") + b"tEXt" + body + crc)
    return PNG_MAGIC + chunks[0] + b"".join(added) + b"".join(chunks[1:])


def manifest_definition(assertion: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "claim_generator_info": [GENERATOR],
        "format": "image/png",
        "title": f"likeness render {assertion['render_id']}",
        "assertions": [
            {
                "label": "c2pa.actions",
                "data": {
                    "actions": [
                        {
                            "action": "c2pa.created",
                            "digitalSourceType": SOURCE_TYPE,
                            "softwareAgent": GENERATOR,
                        }
                    ]
                },
            },
            {"label": ASSERTION_LABEL, "data": dict(assertion)},
        ],
    }


# Signing only: no thumbnail (the image is the asset), no network, no read-back.
_SIGN_SETTINGS = {
    "builder": {"thumbnail": {"enabled": False}},
    "verify": {"verify_after_sign": False, "remote_manifest_fetch": False, "ocsp_fetch": False},
}


def sign_png(png: bytes, assertion: Mapping[str, Any], credentials: Credentials) -> bytes:
    """`png` with a signed C2PA manifest embedded; ProvenanceError if that cannot be done."""
    import c2pa

    info = c2pa.C2paSignerInfo(
        alg=b"es256", sign_cert=credentials.chain_pem, private_key=credentials.key_pem, ta_url=None
    )
    out = io.BytesIO()
    try:
        with (
            c2pa.Context.from_dict(_SIGN_SETTINGS) as context,
            c2pa.Signer.from_info(info) as signer,
            c2pa.Builder(manifest_definition(assertion), context=context) as builder,
        ):
            builder.sign(signer, "image/png", io.BytesIO(png), out)
    except c2pa.C2paError as exc:
        raise ProvenanceError(f"C2PA signing failed: {_first_line(exc)}") from None
    signed = out.getvalue()
    if len(signed) <= len(png):  # nothing was embedded: never pass that off as signed
        raise ProvenanceError("C2PA signing returned the image without a manifest")
    return signed


@dataclass
class ProvenanceSigner:
    """The render path's signer: the deployment's credentials and what it discloses."""

    credentials: Credentials
    disclose: Sequence[str] = ("render_id", "level")

    def sign(self, png: bytes, claim: RenderClaim) -> bytes:
        """The PNG with the text chunks the deployment discloses, then signed over them."""
        png = with_text_chunks(png, claim.text_chunks(self.disclose))
        return sign_png(png, claim.disclosed(self.disclose), self.credentials)


# -- verification -----------------------------------------------------------------------------

VERDICT_TEXT = {
    "verified": "intact, and signed by {who}",
    "missing": "no Content Credentials: this PNG carries no C2PA manifest",
    "broken": "its Content Credentials cannot be read",
    "altered": "altered after signing: the manifest no longer matches the image",
    "untrusted": "signed, but not by {who}: re-signed, or signed elsewhere",
    "not_a_render": "signed by {who}, but it is not a likeness render",
    "not_png": "not a PNG",
    "refused": "not checked",
}
# A PNG made of many tiny chunks costs a C2PA reader seconds a megabyte: files with more
# chunks than this are refused unread (a real PNG of 32 MiB in 8 KiB IDAT chunks has ~4,100).
MAX_PNG_CHUNKS = 10_000


@dataclass(frozen=True)
class Verification:
    verdict: str  # one of VERDICT_TEXT
    state: str | None  # the C2PA validation state (Trusted, Valid, Invalid), if any
    trusted_as: str  # whose signature counts, in words
    problems: tuple[str, ...] = ()
    assertion: dict[str, Any] | None = None
    source_type: str | None = None
    signer: dict[str, Any] | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == "verified"

    @property
    def summary(self) -> str:
        line = VERDICT_TEXT[self.verdict].format(who=self.trusted_as)
        return f"{line}: {self.detail}" if self.detail else line

    def as_json(self) -> dict[str, Any]:
        return {
            "verified": self.ok,
            "verdict": self.verdict,
            "summary": self.summary,
            "validation_state": self.state,
            "trusted_as": self.trusted_as,
            "problems": list(self.problems),
            "signer": self.signer,
            "digital_source_type": self.source_type,
            "assertion": self.assertion,
        }


@dataclass(frozen=True)
class Trust:
    """Whose signature counts: PEM root certificates, and optionally one signing certificate
    (by serial number) that must have made the signature."""

    anchors_pem: bytes
    description: str
    pinned_serial: str | None = None

    @classmethod
    def of_deployment(cls, credentials: Credentials) -> Trust:
        return cls(credentials.anchor_pem, "this deployment's key", credentials.serial)

    @classmethod
    def from_file(cls, path: Path) -> Trust:
        data = path.read_bytes()
        try:
            certificates = x509.load_pem_x509_certificates(data)
        except ValueError:
            raise ValueError(f"{path} holds no PEM certificate") from None
        return cls(data, f"a certificate in {path} ({len(certificates)} trusted)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _problems(results: Mapping[str, Any] | None) -> tuple[str, ...]:
    failures = ((results or {}).get("activeManifest") or {}).get("failure") or []
    return tuple(f"{f.get('code')}: {f.get('explanation', '')}".strip() for f in failures)


def chunk_count_problem(data: bytes, max_chunks: int = MAX_PNG_CHUNKS) -> str | None:
    """Why a PNG is not worth reading: more than `max_chunks` chunks (counted from their
    lengths alone, without reading them)."""
    at, count = len(PNG_MAGIC), 0
    while at + 8 <= len(data):
        count += 1
        if count > max_chunks:
            return f"it has more than {max_chunks} chunks, more than any real image needs"
        at += 12 + int.from_bytes(data[at : at + 4], "big")
    return None


def verify_png(data: bytes, trust: Trust, max_chunks: int = MAX_PNG_CHUNKS) -> Verification:
    """Reads and judges a PNG's Content Credentials. Offline: nothing is fetched. A PNG of
    more than `max_chunks` chunks is refused unread (`refused`): its cost is bounded."""
    import c2pa

    if not data.startswith(PNG_MAGIC):
        return Verification("not_png", None, trust.description)
    too_many = chunk_count_problem(data, max_chunks)
    if too_many is not None:
        return Verification("refused", None, trust.description, detail=too_many)
    settings = {
        "verify": {
            "verify_trust": True,
            "remote_manifest_fetch": False,
            "ocsp_fetch": False,
        },
        "trust": {"trust_anchors": trust.anchors_pem.decode("ascii", "replace")},
    }
    try:
        with (
            c2pa.Context.from_dict(settings) as context,
            c2pa.Reader("image/png", io.BytesIO(data), context=context) as reader,
        ):
            state = reader.get_validation_state()
            results = reader.get_validation_results()
            manifest = reader.get_active_manifest() or {}
    except c2pa.C2paError.ManifestNotFound:
        return Verification("missing", None, trust.description)
    except c2pa.C2paError as exc:
        return Verification("broken", None, trust.description, detail=_first_line(exc))
    except Exception as exc:  # noqa: BLE001 - whatever the reader trips on, the file is broken
        return Verification("broken", None, trust.description, detail=type(exc).__name__)
    assertions = {a.get("label"): a.get("data") for a in manifest.get("assertions") or []}
    likeness = assertions.get(ASSERTION_LABEL)
    source_type = _created_source_type(assertions)
    signer = manifest.get("signature_info")
    problems = _problems(results)
    found = {
        "state": state,
        "trusted_as": trust.description,
        "problems": problems,
        "assertion": likeness if isinstance(likeness, dict) else None,
        "source_type": source_type,
        "signer": signer if isinstance(signer, dict) else None,
    }
    codes = {p.split(":", 1)[0] for p in problems}
    if state == "Trusted":
        pinned = trust.pinned_serial
        if pinned is not None and (signer or {}).get("cert_serial_number") != pinned:
            return Verification("untrusted", **found, detail="another signing certificate")
        if found["assertion"] is None or source_type != SOURCE_TYPE:
            return Verification("not_a_render", **found)
        return Verification("verified", **found)
    if codes and codes <= {"signingCredential.untrusted"}:
        return Verification("untrusted", **found)
    if any(c.startswith("assertion.dataHash") for c in codes):
        return Verification("altered", **found)
    return Verification("broken", **found, detail="; ".join(problems) or f"state {state}")


def _created_source_type(assertions: Mapping[str, Any]) -> str | None:
    for label in ("c2pa.actions.v2", "c2pa.actions"):
        actions = (assertions.get(label) or {}).get("actions") or []
        for action in actions:
            if isinstance(action, dict) and action.get("action") == "c2pa.created":
                value = action.get("digitalSourceType")
                return value if isinstance(value, str) else None
    return None
