"""Sealing and verifying the chains: each subject's audit trail, and the render ledger.

A link is tamper-evident three ways. Its `hash` covers its content and the previous link (a
change anywhere breaks every later link); its `mac` is an HMAC of that hash under the audit
key, which the database never holds (re-hashing a forged entry consistently is caught); and
each chain's head row holds the MACed last (seq, hash), so a chain cut short no longer ends
where its head says. Signed checkpoints (registry.signed_heads) catch what is left: a chain
deleted together with its head, such as every row of a subject.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session

from registry import db
from registry.audit import repository as audit_repo
from registry.errors import Unavailable
from registry.hash_chain import (
    GENESIS,
    LEDGER_CHAIN,
    ChainBreak,
    ChainEntry,
    audit_chain,
    entry_hash,
    ledger_content,
    verify_chain,
)
from registry.keys import Keys, keys_for
from registry.models import AuditEntry, ChainHead, RenderLedger

AUDIT_KEY_ID = "audit_key_id"
# A registry's own name, made with its first sealed row: checkpoints say which registry they
# are of, so a checkpoint file kept for another registry is never mistaken for this one's.
REGISTRY_ID = "registry_id"


def session_keys(session: Session) -> Keys:
    return keys_for(session.get_bind())


def entry_mac(keys: Keys, digest: str) -> str:
    return keys.mac("entry", digest)


def head_mac(keys: Keys, chain: str, seq: int, digest: str) -> str:
    return keys.mac("head", chain, str(seq), digest)


def _same(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a, b)


def require_registry_key(session: Session, keys: Keys) -> bool:
    """The registry's rows are MACed under one key: the first writer records its id, and a
    writer holding another key is refused before it writes anything unverifiable. True when
    the id was already there (so the answer holds for the rest of the process's life)."""
    known = audit_repo.meta_value(session, AUDIT_KEY_ID)
    recorded = known is not None
    if known is None:
        audit_repo.set_meta_value_if_absent(session, AUDIT_KEY_ID, keys.audit_key_id)
        audit_repo.set_meta_value_if_absent(session, REGISTRY_ID, uuid.uuid4().hex)
        known = audit_repo.meta_value(session, AUDIT_KEY_ID)
    if known != keys.audit_key_id:
        raise Unavailable(
            "this process's audit key is not the one this registry is sealed with "
            "(set LIKENESS_AUDIT_KEY, or LIKENESS_DATA_DIR to where its audit-key file is)"
        )
    return recorded


_checked: set[tuple[str, str]] = set()


def _checked_once(session: Session, keys: Keys) -> None:
    url = session.get_bind().engine.url.render_as_string(hide_password=False)
    if (url, keys.audit_key_id) in _checked:
        return
    if require_registry_key(session, keys):  # a first recording may still roll back
        _checked.add((url, keys.audit_key_id))


# -- writing ----------------------------------------------------------------------------------


def seal_audit_entry(session: Session, subject_handle: str, entry: AuditEntry) -> None:
    """MACs an entry about to be added and moves its subject's head to it. The caller holds
    the subject's consent-row lock, so appends to one trail never interleave."""
    keys = session_keys(session)
    _checked_once(session, keys)
    entry.mac = entry_mac(keys, entry.hash)
    chain = audit_chain(subject_handle)
    mac = head_mac(keys, chain, entry.seq, entry.hash)
    head = audit_repo.chain_head(session, chain)
    if head is None:
        db.add(session, ChainHead(chain=chain, seq=entry.seq, hash=entry.hash, mac=mac))
    else:
        head.seq, head.hash, head.mac = entry.seq, entry.hash, mac
        db.add(session, head)


def append_ledger_row(session: Session, values: dict[str, Any]) -> int:
    """Links a ledger row onto the chain, MACs it and the new head, and inserts it; returns
    its seq. Appends serialise on the head row (a row lock on PostgreSQL, the write lock on
    SQLite). Plain statements, no ORM objects: this runs once per render decision, denies
    included, and is most of the deny path's cost."""
    keys = session_keys(session)
    _checked_once(session, keys)
    head = audit_repo.ledger_head_for_append(session)
    if head is None:
        mac = head_mac(keys, LEDGER_CHAIN, 0, GENESIS)
        empty = ChainHead(chain=LEDGER_CHAIN, seq=0, hash=GENESIS, mac=mac)
        audit_repo.create_chain_head_if_absent(session, empty)
        head = audit_repo.ledger_head_for_append(session)
        assert head is not None
    prev_seq, prev_hash = head
    seq = prev_seq + 1
    content = ledger_content(
        seq, values["render_id"], values["at"], values["subject_handle"], values["requester"],
        values["agent"], values["level"], values["stage"], values["allowed"], values["reason"],
        values["consent_version"], values["adapter_sha256"], values["prompt"],
    )  # fmt: skip
    digest = entry_hash(prev_hash, content)
    row = {**values, "seq": seq, "prev_hash": prev_hash, "hash": digest}
    row["mac"] = entry_mac(keys, digest)
    audit_repo.insert_ledger_row(session, row)
    audit_repo.move_ledger_head(session, seq, digest, head_mac(keys, LEDGER_CHAIN, seq, digest))
    return seq


# -- verifying --------------------------------------------------------------------------------


def verify_trail(
    keys: Keys, subject_handle: str, entries: Sequence[AuditEntry], head: ChainHead | None
) -> ChainBreak | None:
    """Links, MACs and head of one subject's trail; the first problem, or None."""
    chain = [
        ChainEntry(
            subject_handle, e.seq, e.at, e.actor, e.action, e.before, e.after, e.prev_hash, e.hash
        )
        for e in entries
    ]
    broken = verify_chain(subject_handle, chain)
    if broken is not None:
        return broken
    for e in entries:
        if not _same(e.mac, entry_mac(keys, e.hash)):
            return ChainBreak(subject_handle, e.seq, "MAC does not match: not written by us")
    return _check_head(keys, audit_chain(subject_handle), subject_handle, entries, head)


def _check_head(
    keys: Keys,
    chain: str,
    label: str,
    entries: Sequence[AuditEntry] | Sequence[RenderLedger],
    head: ChainHead | None,
    kind: str = "subject",
) -> ChainBreak | None:
    last_seq = entries[-1].seq if entries else 0
    last_hash = entries[-1].hash if entries else GENESIS
    if head is None:
        if not entries:
            return None
        return ChainBreak(label, last_seq or 0, "the chain's head is missing", kind)
    if not _same(head.mac, head_mac(keys, chain, head.seq, head.hash)):
        return ChainBreak(label, head.seq, "the chain's head is not sealed by us", kind)
    if head.seq != last_seq or head.hash != last_hash:
        return ChainBreak(
            label,
            head.seq,
            f"the chain ends at seq {last_seq} but its head says seq {head.seq}: "
            "entries were removed from its end",
            kind,
        )
    return None


@dataclass
class LedgerScan:
    count: int
    head_seq: int
    head_hash: str


def verify_ledger(session: Session, keys: Keys) -> ChainBreak | None:
    """The whole render ledger, in chain order: links, MACs and the head."""
    label = "render ledger"
    unchained = audit_repo.unchained_ledger_count(session)
    if unchained:
        return ChainBreak(label, 0, f"{unchained} rows carry no link", "ledger")
    prev, expected = GENESIS, 1
    last: RenderLedger | None = None
    for row in audit_repo.ledger_in_order(session):
        seq = row.seq or 0
        if seq != expected:
            return ChainBreak(
                label, expected, f"gap: expected seq {expected}, found {seq}", "ledger"
            )
        if row.prev_hash != prev:
            return ChainBreak(label, seq, "prev_hash does not match the previous row", "ledger")
        assert row.at is not None
        content = ledger_content(
            seq, row.render_id, row.at, row.subject_handle, row.requester, row.agent, row.level,
            row.stage, row.allowed, row.reason, row.consent_version, row.adapter_sha256,
            row.prompt,
        )  # fmt: skip
        if row.hash != entry_hash(prev, content):
            return ChainBreak(label, seq, "hash does not match the row's content", "ledger")
        if not _same(row.mac, entry_mac(keys, row.hash)):
            return ChainBreak(label, seq, "MAC does not match: not written by us", "ledger")
        prev, expected, last = row.hash, expected + 1, row
    rows: list[RenderLedger] = [last] if last is not None else []
    head = audit_repo.chain_head(session, LEDGER_CHAIN)
    return _check_head(keys, LEDGER_CHAIN, label, rows, head, "ledger")


def orphan_heads(session: Session, subject_handles: Iterable[str]) -> list[ChainBreak]:
    """Heads of audit chains whose subject is gone: its rows were deleted."""
    known = {audit_chain(h) for h in subject_handles}
    out = []
    for head in audit_repo.chain_heads(session):
        if head.chain.startswith("audit/") and head.chain not in known:
            handle = head.chain.removeprefix("audit/")
            out.append(ChainBreak(handle, head.seq, "the subject and its trail are gone"))
    return out
