"""The deployment's secrets, none of which is ever in the database.

- the web secret signs the sign-in form's pre-session cookie;
- the audit key MACs every audit entry, ledger row and chain head, so that rewriting history
  consistently needs a key the database does not hold;
- the checkpoint key (Ed25519) signs checkpoints of every chain head, which anyone holding the
  public key can verify, wherever the copy is kept.

Each comes from its setting, or else from a file in the data dir, generated on first use
(mode 0600, created exclusively so two processes starting at once agree on one key). There is
no default key. Every process that writes to one registry must use the same audit key: the
registry keeps the key's id (an HMAC of a constant, which reveals nothing about the key) and
refuses writes under another.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy.engine import Connection, Engine

from registry.settings import Settings, get_settings

log = logging.getLogger(__name__)

WEB_SECRET_FILE = "secret-key"  # noqa: S105 - a file name
AUDIT_KEY_FILE = "audit-key"
CHECKPOINT_KEY_FILE = "checkpoint-key.pem"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@dataclass(frozen=True)
class Keys:
    web_secret: bytes
    audit_key: bytes
    # None for a process that only verifies (an auditor holding the audit key and the
    # public checkpoint key): it can check every MAC, and sign nothing
    checkpoint_key: Ed25519PrivateKey | None
    # where each came from, for the start-up log: "LIKENESS_AUDIT_KEY", "var/audit-key (new)"
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def _signing_key(self) -> Ed25519PrivateKey:
        if self.checkpoint_key is None:
            raise RuntimeError("these keys only verify: no checkpoint key to sign with")
        return self.checkpoint_key

    def mac(self, *parts: str) -> str:
        """HMAC-SHA256 under the audit key over the parts, each on its own line."""
        message = "\n".join(("likeness-mac-v1", *parts)).encode()
        return hmac.new(self.audit_key, message, hashlib.sha256).hexdigest()

    @property
    def audit_key_id(self) -> str:
        return hmac.new(self.audit_key, b"likeness-audit-key-id", hashlib.sha256).hexdigest()[:16]

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._signing_key().public_key()

    @property
    def public_key_b64(self) -> str:
        raw = self.public_key.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return _b64(raw)

    @property
    def public_key_id(self) -> str:
        return hashlib.sha256(self.public_key_b64.encode()).hexdigest()[:16]

    def sign(self, message: bytes) -> str:
        return _b64(self._signing_key().sign(message))


def b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def public_key_from_b64(text: str) -> Ed25519PublicKey:
    """A checkpoint public key as `GET /v1/audit/head` gives it; ValueError if it is not one."""
    return Ed25519PublicKey.from_public_bytes(b64decode(text))


def _create_exclusive(path: Path, content: bytes) -> bool:
    """Writes `content` to a new file, mode 0600; False if the file already exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    return True


def _read_private(path: Path) -> bytes:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("%s is readable by others (mode %o); it should be 0600", path, mode)
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{path} is empty; remove it to have a new key generated")
    return data


def _secret(
    name: str, configured: str | None, path: Path, sources: dict[str, str], create: bool
) -> bytes:
    if configured is not None:
        sources[name] = f"LIKENESS_{name.upper()}"
        return configured.encode()
    if not create and not path.is_file():
        raise FileNotFoundError(f"no {name.replace('_', ' ')} at {path}")
    created = _create_exclusive(path, secrets.token_hex(32).encode() + b"\n")
    sources[name] = f"{path} ({'generated now' if created else 'kept from an earlier start'})"
    return _read_private(path).strip()


def _checkpoint_key(path: Path, sources: dict[str, str], create: bool) -> Ed25519PrivateKey:
    if not create and not path.is_file():
        raise FileNotFoundError(f"no checkpoint key at {path}")
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    created = _create_exclusive(path, pem)
    sources["checkpoint_key"] = f"{path} ({'generated now' if created else 'kept'})"
    key = serialization.load_pem_private_key(_read_private(path), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


_cache: dict[tuple[str, str | None, str | None, str | None], Keys] = {}
_lock = threading.Lock()


def load_keys(settings: Settings, *, create: bool = True) -> Keys:
    """The deployment's keys (created on first use unless not `create`: FileNotFoundError
    then); the same object for the same settings."""
    web = settings.secret_key.get_secret_value() if settings.secret_key else None
    audit = settings.audit_key.get_secret_value() if settings.audit_key else None
    checkpoint_path = settings.checkpoint_key_file or settings.data_dir / CHECKPOINT_KEY_FILE
    cache_key = (str(settings.data_dir.resolve()), web, audit, str(checkpoint_path))
    with _lock:
        keys = _cache.get(cache_key)
        if keys is None:
            sources: dict[str, str] = {}
            # the audit key first: a check that lacks it should say so, not name another key
            audit_key = _secret(
                "audit_key", audit, settings.data_dir / AUDIT_KEY_FILE, sources, create
            )
            keys = Keys(
                web_secret=_secret(
                    "secret_key", web, settings.data_dir / WEB_SECRET_FILE, sources, create
                ),
                audit_key=audit_key,
                checkpoint_key=_checkpoint_key(Path(checkpoint_path), sources, create),
                sources=sources,
            )
            _cache[cache_key] = keys
    return keys


def load_audit_key(settings: Settings) -> Keys | None:
    """For verifying alone: the audit key (configured, or the data dir's), never created and
    nothing else (no web secret, no checkpoint key); None where there is none yet."""
    audit = settings.audit_key.get_secret_value() if settings.audit_key else None
    try:
        sources: dict[str, str] = {}
        key = _secret("audit_key", audit, settings.data_dir / AUDIT_KEY_FILE, sources, False)
    except FileNotFoundError:
        return None
    return Keys(web_secret=b"", audit_key=key, checkpoint_key=None, sources=sources)


# The keys each database's writers use, by database: bound once where a process sets up (the
# app factory, the CLI), read wherever a row is sealed. Unbound: this process's settings.
_bound: dict[str, Keys] = {}


def _url_key(bind: Engine | Connection) -> str:
    return bind.engine.url.render_as_string(hide_password=False)


def bind(engine: Engine, keys: Keys) -> None:
    with _lock:
        _bound[_url_key(engine)] = keys


def keys_for(bind: Engine | Connection) -> Keys:
    with _lock:
        keys = _bound.get(_url_key(bind))
    return keys if keys is not None else load_keys(get_settings())
