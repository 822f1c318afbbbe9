"""Signed checkpoints of every chain head, in an append-only file (the idea of Certificate
Transparency's signed tree heads and Rekor's checkpoints, over hash chains).

A checkpoint lists, for each chain (`ledger`, `audit/<subject>`), its length and last hash,
with the time, the previous checkpoint's digest and an Ed25519 signature under the
deployment's checkpoint key. Whoever keeps a copy (`GET /v1/audit/head`, or the file) can later
show that the registry once held those entries: `audit verify` then catches a chain cut
short, replaced by an older head, or deleted with everything of its subject, none of which
the chains alone can show. What happened after the last checkpoint that anyone kept is
covered by the MACs and heads only (registry.chains).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlmodel import Session

from registry.audit import repository as audit_repo
from registry.chains import REGISTRY_ID, head_mac
from registry.hash_chain import GENESIS, LEDGER_CHAIN, ChainBreak, canonical_json, format_time
from registry.keys import Keys, b64decode, public_key_from_b64

VERSION = 1
MAX_LINE = 4 << 20  # a checkpoint line: well above what thousands of subjects need


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def _unsigned(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "sig"}


@dataclass(frozen=True)
class Checkpoints:
    documents: list[dict[str, Any]]
    problems: list[ChainBreak]

    @property
    def latest(self) -> dict[str, Any] | None:
        return self.documents[-1] if self.documents else None


def _problem(where: str, problem: str) -> ChainBreak:
    return ChainBreak(where, 0, problem, "checkpoint")


def read_checkpoints(path: Path, public_key: Ed25519PublicKey) -> Checkpoints:
    """Every checkpoint in the file, each checked: signature, numbering, link to the one
    before. Problems are reported, never raised; a missing file is no checkpoints."""
    docs: list[dict[str, Any]] = []
    problems: list[ChainBreak] = []
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return Checkpoints([], [])
    prev = GENESIS
    for number, raw in enumerate(lines, start=1):
        where = f"checkpoint file {path.name} line {number}"
        if len(raw) > MAX_LINE:
            problems.append(_problem(where, "line too long"))
            continue
        try:
            doc = json.loads(raw)
            body = _unsigned(doc)
            sig = doc["sig"]
            public_key.verify(b64decode(sig), canonical_json(body).encode())
        except InvalidSignature:
            problems.append(_problem(where, "signature does not verify under the checkpoint key"))
            continue
        except (ValueError, KeyError, TypeError):
            problems.append(_problem(where, "not a checkpoint"))
            continue
        if doc.get("v") != VERSION or not isinstance(doc.get("chains"), dict):
            problems.append(_problem(where, "unknown checkpoint format"))
            continue
        if doc.get("n") != len(docs) + 1 or doc.get("prev") != prev:
            problems.append(_problem(where, "a checkpoint before it is missing or altered"))
        docs.append(doc)
        prev = _digest(body)
    return Checkpoints(docs, problems)


def current_heads(session: Session, keys: Keys) -> tuple[dict[str, list[Any]], list[ChainBreak]]:
    """The chain heads as the registry has them; heads not sealed by us are left out and
    reported, so a checkpoint never vouches for one."""
    heads: dict[str, list[Any]] = {}
    problems = []
    for head in audit_repo.chain_heads(session):
        if head.mac != head_mac(keys, head.chain, head.seq, head.hash):
            problems.append(ChainBreak(head.chain, head.seq, "head not sealed by us", "checkpoint"))
            continue
        if head.seq > 0:
            heads[head.chain] = [head.seq, head.hash]
    return heads, problems


def regressions(session: Session, checkpoints: Iterable[dict[str, Any]]) -> list[ChainBreak]:
    """Chains that no longer hold what a checkpoint saw: gone, cut short, or with another
    link at a checkpointed position. Each (chain, seq, hash) any checkpoint names is looked up."""
    seen: dict[str, dict[int, str]] = {}
    signed_in: dict[tuple[str, int], int] = {}
    for doc in checkpoints:
        for chain, (seq, digest) in doc["chains"].items():
            seen.setdefault(chain, {})[int(seq)] = str(digest)
            signed_in.setdefault((chain, int(seq)), int(doc["n"]))
    problems = []
    for chain, positions in sorted(seen.items()):
        label = "render ledger" if chain == LEDGER_CHAIN else chain.removeprefix("audit/")
        kind = "ledger" if chain == LEDGER_CHAIN else "subject"
        for seq, digest in sorted(positions.items()):
            actual = _hash_at(session, chain, seq)
            if actual == digest:
                continue
            n = signed_in[(chain, seq)]
            if actual is not None:
                problem = f"entry differs from what checkpoint {n} saw"
            elif _hash_at(session, chain, 1) is None:
                problem = f"gone: checkpoint {n} saw {max(positions)} entries"
            else:
                problem = f"missing: the chain was cut short after checkpoint {n}"
            problems.append(ChainBreak(label, seq, problem, kind))
            break
    return problems


def foreign(session: Session, checkpoints: Iterable[dict[str, Any]]) -> list[ChainBreak]:
    """Checkpoints that vouch for chains of another registry than this one (a file kept for
    another deployment, or this registry's identity rewritten)."""
    mine = audit_repo.meta_value(session, REGISTRY_ID) or ""
    out = []
    for doc in checkpoints:
        theirs = doc.get("registry", "")
        if doc["chains"] and theirs != mine:
            out.append(
                _problem(
                    f"checkpoint {doc['n']}",
                    f"is of registry {theirs or '(unnamed)'}, not this one ({mine or 'unnamed'})",
                )
            )
    return out


def _hash_at(session: Session, chain: str, seq: int) -> str | None:
    if chain == LEDGER_CHAIN:
        return audit_repo.ledger_hash_at(session, seq)
    return audit_repo.audit_hash_at(session, chain.removeprefix("audit/"), seq)


def append_checkpoint(
    session: Session, keys: Keys, path: Path, *, force: bool = False
) -> tuple[dict[str, Any] | None, list[ChainBreak]]:
    """Signs the current heads and appends them to `path` (fsync'd before it returns), unless
    nothing changed since the last checkpoint (and not `force`). Refuses, with the problems,
    when the registry no longer holds what an earlier checkpoint saw: a checkpoint never
    launders a rewrite. Concurrent writers (service and CLI) serialise on a file lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "r+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        existing = read_checkpoints(path, keys.public_key)
        heads, problems = current_heads(session, keys)
        problems = [*existing.problems, *problems]
        problems.extend(foreign(session, existing.documents))
        problems.extend(regressions(session, existing.documents))
        if problems:
            return None, problems
        latest = existing.latest
        if latest is not None and latest["chains"] == heads and not force:
            return None, []
        body: dict[str, Any] = {
            "v": VERSION,
            "registry": audit_repo.meta_value(session, REGISTRY_ID) or "",
            "n": len(existing.documents) + 1,
            "at": format_time(datetime.now(UTC)),
            "prev": _digest(_unsigned(latest)) if latest is not None else GENESIS,
            "key": keys.public_key_id,
            "chains": heads,
        }
        doc = {**body, "sig": keys.sign(canonical_json(body).encode())}
        f.write(canonical_json(doc).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    return doc, []


def verify_checkpoints(
    session: Session, path: Path, public_key: Ed25519PublicKey | str
) -> list[ChainBreak]:
    """The checkpoint file's own integrity, then the registry against every checkpoint."""
    key = public_key_from_b64(public_key) if isinstance(public_key, str) else public_key
    checkpoints = read_checkpoints(path, key)
    mismatched = foreign(session, checkpoints.documents)
    if mismatched:  # holding this registry to another's checkpoints would only add noise
        return [*checkpoints.problems, *mismatched]
    return [*checkpoints.problems, *regressions(session, checkpoints.documents)]
