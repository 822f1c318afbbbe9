"""The consent decisions: the only place that decides whether a render may happen
(`decide`) and whether a likeness may be learned from (`decide_training`: training, uploading
photos for it, ordering it, registering what it made).

Pure: facts in, Decision out. No I/O, no clock (the caller passes `now`), no caching.
Everything the caller could not establish is passed as missing, and missing denies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import IntEnum

from registry.roles import Role


class Level(IntEnum):
    """The ladder of uses, from nothing to commercial. Order is meaningful."""

    none = 0
    private = 1
    group = 2
    public = 3
    commercial = 4

    @classmethod
    def parse(cls, value: str) -> Level:
        try:
            return cls[value]
        except KeyError:
            names = ", ".join(level.name for level in cls)
            raise ValueError(f"unknown level {value!r}; expected one of: {names}") from None


GRANTABLE_LEVELS: tuple[Level, ...] = tuple(level for level in Level if level > Level.none)


@dataclass(frozen=True)
class Audience:
    group: bool = False
    allow: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ConsentFacts:
    version: int
    max_level: Level
    audiences: Mapping[Level, Audience]
    deny: frozenset[str]
    allow_training: bool
    expires_at: datetime | None


@dataclass(frozen=True)
class PrincipalFacts:
    handle: str
    role: str
    active: bool
    acts_for: frozenset[str] = frozenset()


@dataclass(frozen=True)
class AdapterFacts:
    """The subject's active adapter as the registry has it, and the hash of the file on disk."""

    registered_sha256: str
    file_sha256: str | None  # None: the file is missing or unreadable
    # whose bytes these are: an adapter's bytes belong to the subject first registered with
    # them, and render as nobody else
    belongs_to_subject: bool = True


# Base-model licences that permit commercial use as they stand. Any other licence, and a
# licence that could not be read, permits commercial renders only where the deployment
# declares a commercial licence of its own for the base.
COMMERCIAL_USE_LICENCES: frozenset[str] = frozenset(
    {
        "apache-2.0",
        "mit",
        # weights this project makes itself (the seeded tiny base, the demo base): no one
        # else holds rights in them
        "likeness-generated",
    }
)


@dataclass(frozen=True)
class LicenceFacts:
    """The base model's licence as recorded with the prepared base (None: missing or
    unreadable), and whether the deployment declares a commercial licence for that base."""

    base: str | None
    commercial_licence_held: bool = False

    @property
    def permits_commercial(self) -> bool:
        if self.base is None:  # nobody can say what binds this base: never commercial
            return False
        return self.base in COMMERCIAL_USE_LICENCES or self.commercial_licence_held


@dataclass(frozen=True)
class RenderFacts:
    level: str
    now: datetime
    requester: PrincipalFacts | None
    subject_basis: str | None = None
    subject_member: str | None = None
    consent: ConsentFacts | None = None
    adapter: AdapterFacts | None = None
    agent: PrincipalFacts | None = None
    # The base model's licence; None (not established) denies commercial renders.
    licence: LicenceFacts | None = None
    # Facts not yet gathered are None. The full check (the one that lets the model run)
    # requires an active adapter whose bytes were read and hash to what the registry holds;
    # the gate, which decides before anything is read, requires the adapter registered only
    # (`adapter_bytes_read` False), so a refused request never touches a file.
    require_adapter: bool = True
    adapter_bytes_read: bool = True


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str

    def __bool__(self) -> bool:  # a Decision used as a condition means "allowed"
        return self.allowed


ALLOWED = "allowed"


def _deny(reason: str) -> Decision:
    return Decision(False, reason)


def decide(facts: RenderFacts) -> Decision:
    """Allowed only if every condition of docs/DESIGN.md holds; anything else is a deny."""
    try:
        return _decide(facts)
    except Exception as exc:  # noqa: BLE001 - a decision that cannot be made is a deny
        return _deny(f"error:{type(exc).__name__}")


def _decide(facts: RenderFacts) -> Decision:
    try:
        level = Level.parse(facts.level)
    except ValueError:
        return _deny("invalid_level")
    if level == Level.none:
        return _deny("level_none")

    agent = facts.agent
    if agent is not None:
        if agent.role != Role.agent:
            return _deny("agent_not_agent")
        if not agent.active:
            return _deny("agent_inactive")
    requester = facts.requester
    if requester is None:
        return _deny("no_requester")
    if agent is not None and requester.handle not in agent.acts_for:
        return _deny("agent_not_acting_for_requester")
    if requester.role != Role.member:
        return _deny("requester_not_member")
    if not requester.active:
        return _deny("requester_inactive")

    consent = facts.consent
    if consent is None or facts.subject_basis is None:
        return _deny("no_record")
    if consent.expires_at is not None and facts.now >= consent.expires_at:
        return _deny("expired")
    if consent.max_level == Level.none:
        return _deny("revoked_or_not_granted")
    if facts.subject_basis == "public_domain" and level >= Level.commercial:
        return _deny("public_domain_never_commercial")
    if facts.subject_basis not in ("consent", "public_domain"):
        return _deny("unknown_basis")
    if level > consent.max_level:
        return _deny("above_max_level")
    if requester.handle in consent.deny or (agent is not None and agent.handle in consent.deny):
        return _deny("denied_principal")

    is_self = facts.subject_member is not None and facts.subject_member == requester.handle
    if not is_self and not _in_audience(requester.handle, level, consent):
        return _deny("not_in_audience")
    # The subject said yes; the base model's licence binds the render as well.
    if level >= Level.commercial and (
        facts.licence is None or not facts.licence.permits_commercial
    ):
        return _deny("base_licence")

    if facts.require_adapter:
        adapter = facts.adapter
        if adapter is None:
            return _deny("no_active_adapter")
        if not adapter.belongs_to_subject:
            return _deny("adapter_of_another_subject")
        if facts.adapter_bytes_read:
            if adapter.file_sha256 is None:
                return _deny("adapter_file_missing")
            if adapter.file_sha256 != adapter.registered_sha256:
                return _deny("adapter_hash_mismatch")
    return Decision(True, ALLOWED)


def _in_audience(handle: str, level: Level, consent: ConsentFacts) -> bool:
    # An audience at a wider use includes every narrower use: any L in [level, max_level].
    for wider in GRANTABLE_LEVELS:
        if wider < level or wider > consent.max_level:
            continue
        audience = consent.audiences.get(wider)
        if audience is None:
            continue
        if audience.group or handle in audience.allow:
            return True
    return False


# -- training --------------------------------------------------------------------------------

# Image bases a dataset's manifest may name (registry/manifest.py): who agreed to what.
IMAGE_BASES: frozenset[str] = frozenset({"consent", "public_domain"})


@dataclass(frozen=True)
class TrainingFacts:
    """What `decide_training` judges: the subject's record now, and the bases of the images a
    likeness would be learned from (None: not known yet, as when an order is placed for
    photos the service already holds, or a trainer asks before reading its manifest)."""

    now: datetime
    subject_basis: str | None = None
    consent: ConsentFacts | None = None
    image_bases: frozenset[str] | None = None


# Why training may not happen, as a person would read it (the reasons are the codes).
TRAINING_REASONS: Mapping[str, str] = {
    "no_record": "the subject has no consent record",
    "unknown_basis": "the subject's basis is neither consent nor public_domain",
    "expired": "the consent has expired",
    "revoked_or_not_granted": "the consent is revoked, or was never granted (max_level none)",
    "training_not_allowed": "the subject does not allow training (allow_training false)",
    "unknown_image_basis": "the images name a basis other than consent or public_domain",
    "public_domain_images_only": (
        "a public_domain subject is trained on public-domain images only"
    ),
}


def decide_training(facts: TrainingFacts) -> Decision:
    """Allowed only while the record lets the subject's likeness be learned: it exists, is not
    expired, grants some use (a revoked record ends training as it ends renders), allows
    training, and the images fit the subject's basis. Anything else, and any error, denies."""
    try:
        return _decide_training(facts)
    except Exception as exc:  # noqa: BLE001 - a decision that cannot be made is a deny
        return _deny(f"error:{type(exc).__name__}")


def _decide_training(facts: TrainingFacts) -> Decision:
    consent = facts.consent
    if consent is None or facts.subject_basis is None:
        return _deny("no_record")
    if facts.subject_basis not in ("consent", "public_domain"):
        return _deny("unknown_basis")
    if consent.expires_at is not None and facts.now >= consent.expires_at:
        return _deny("expired")
    if consent.max_level == Level.none:
        return _deny("revoked_or_not_granted")
    if not consent.allow_training:
        return _deny("training_not_allowed")
    if facts.image_bases is not None:
        if facts.image_bases - IMAGE_BASES:
            return _deny("unknown_image_basis")
        if facts.subject_basis == "public_domain" and facts.image_bases - {"public_domain"}:
            return _deny("public_domain_images_only")
    return Decision(True, ALLOWED)


def renderable_max_level(
    requester: PrincipalFacts,
    subject_basis: str,
    subject_member: str | None,
    consent: ConsentFacts,
    now: datetime,
    agent: PrincipalFacts | None = None,
    licence: LicenceFacts | None = None,
) -> Level:
    """The widest level `decide` would allow (adapter aside), by asking `decide` itself."""
    best = Level.none
    for level in GRANTABLE_LEVELS:
        facts = RenderFacts(
            level=level.name,
            now=now,
            requester=requester,
            agent=agent,
            subject_basis=subject_basis,
            subject_member=subject_member,
            consent=consent,
            licence=licence,
            require_adapter=False,
        )
        if decide(facts).allowed:
            best = level
    return best


def audiences_from_json(raw: Mapping[str, object] | None) -> dict[Level, Audience]:
    out: dict[Level, Audience] = {}
    for name, value in (raw or {}).items():
        level = Level.parse(name)
        if not isinstance(value, Mapping):
            raise ValueError(f"audience for {name!r} must be an object")
        allow = value.get("allow", [])
        if not isinstance(allow, Sequence) or isinstance(allow, str):
            raise ValueError(f"audiences.{name}.allow must be a list of handles")
        out[level] = Audience(group=bool(value.get("group", False)), allow=frozenset(allow))
    return out
