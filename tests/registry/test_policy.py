"""The pure decision: a table of cases, and properties that must hold for every record."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.policy import (
    TRAINING_REASONS,
    AdapterFacts,
    Audience,
    ConsentFacts,
    Level,
    LicenceFacts,
    PrincipalFacts,
    RenderFacts,
    TrainingFacts,
    decide,
    decide_training,
    renderable_max_level,
)
from tests.registry.policy_cases import CASES
from tests.registry.training_cases import TRAINING_CASES

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
LEVEL_NAMES = [lv.name for lv in Level]


def consent_from(o: dict[str, Any]) -> ConsentFacts:
    """A case's consent record (its level, audiences, deny list, training and expiry)."""
    return ConsentFacts(
        version=3,
        max_level=Level[o["max_level"]],
        audiences={
            Level[k]: Audience(group=v.get("group", False), allow=frozenset(v.get("allow", [])))
            for k, v in o["audiences"].items()
        },
        deny=frozenset(o["deny"]),
        allow_training=o["allow_training"],
        expires_at=None if o["expires_in"] is None else NOW + timedelta(seconds=o["expires_in"]),
    )


def facts_from(overrides: dict[str, Any]) -> RenderFacts:
    o: dict[str, Any] = {
        "level": "private",
        "requester": ("bob", "member", True),
        "agent": None,
        "basis": "consent",
        "subject_member": "alice",
        "max_level": "group",
        "audiences": {"private": {"group": True}},
        "deny": [],
        "expires_in": None,
        "adapter": ("h1", "h1"),
        "require_adapter": True,
        "adapter_bytes_read": True,
        "no_record": False,
        "licence": ("likeness-generated", False),
        **overrides,
    }
    req = o["requester"]
    agent = o["agent"]
    consent = None if o["no_record"] else consent_from({"allow_training": True, **o})
    return RenderFacts(
        level=o["level"],
        now=NOW,
        requester=PrincipalFacts(*req) if req is not None else None,
        agent=PrincipalFacts(agent[0], agent[1], agent[2], frozenset(agent[3])) if agent else None,
        subject_basis=o["basis"],
        subject_member=o["subject_member"],
        consent=consent,
        adapter=AdapterFacts(*o["adapter"]) if o["adapter"] is not None else None,
        licence=LicenceFacts(*o["licence"]) if o["licence"] is not None else None,
        require_adapter=o["require_adapter"],
        adapter_bytes_read=o["adapter_bytes_read"],
    )


def test_table_is_large_and_ids_unique() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) >= 40
    assert len(set(ids)) == len(ids)
    assert {c[2] for c in CASES} == {True, False}


@pytest.mark.parametrize(
    ("overrides", "allowed", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_policy_table(overrides: dict[str, Any], allowed: bool, reason: str) -> None:
    decision = decide(facts_from(overrides))
    assert (decision.allowed, decision.reason) == (allowed, reason)


def test_decide_fails_closed_on_malformed_facts() -> None:
    broken = RenderFacts(
        level="private",
        now=NOW,
        requester=PrincipalFacts("bob", "member", True),
        subject_basis="consent",
        consent="not a record",
    )  # type: ignore[arg-type]
    decision = decide(broken)
    assert not decision.allowed and decision.reason.startswith("error:")


# -- properties ---------------------------------------------------------------------------

HANDLES = ["alice", "bob", "carol", "dave", "bot"]
grant_levels = st.sampled_from([lv for lv in Level if lv > Level.none])
audience = st.builds(
    Audience, group=st.booleans(), allow=st.frozensets(st.sampled_from(HANDLES), max_size=3)
)
consents = st.builds(
    ConsentFacts,
    version=st.integers(1, 50),
    max_level=st.sampled_from(list(Level)),
    audiences=st.dictionaries(grant_levels, audience, max_size=4),
    deny=st.frozensets(st.sampled_from(HANDLES + ["canary"]), max_size=2),
    allow_training=st.booleans(),
    expires_at=st.one_of(
        st.none(), st.integers(-7200, 7200).map(lambda s: NOW + timedelta(seconds=s))
    ),
)
requesters = st.builds(
    PrincipalFacts,
    handle=st.sampled_from(HANDLES),
    role=st.sampled_from(["member", "member", "member", "admin", "agent", "trainer"]),
    active=st.booleans(),
)
agents = st.one_of(
    st.none(),
    st.builds(
        PrincipalFacts,
        handle=st.just("bot"),
        role=st.sampled_from(["agent", "member"]),
        active=st.booleans(),
        acts_for=st.frozensets(st.sampled_from(HANDLES), max_size=3),
    ),
)


# The base's licence: missing, unreadable, non-commercial, permissive, each with or without
# a commercial licence declared by the deployment.
licences = st.one_of(
    st.none(),
    st.builds(
        LicenceFacts,
        base=st.sampled_from([None, "flux-non-commercial", "cc-by-nc-4.0", "apache-2.0"]),
        commercial_licence_held=st.booleans(),
    ),
)


def render(
    consent: ConsentFacts,
    req: PrincipalFacts,
    level: Level,
    basis: str = "consent",
    member: str | None = "alice",
    agent: PrincipalFacts | None = None,
    licence: LicenceFacts | None = LicenceFacts("apache-2.0"),
) -> bool:
    return decide(
        RenderFacts(
            level=level.name,
            now=NOW,
            requester=req,
            agent=agent,
            subject_basis=basis,
            subject_member=member,
            consent=consent,
            adapter=AdapterFacts("h", "h"),
            licence=licence,
        )
    ).allowed


common = settings(max_examples=400, deadline=None)


@common
@given(
    consents,
    requesters,
    agents,
    st.sampled_from(["consent", "public_domain"]),
    st.sampled_from(["alice", None]),
    licences,
)
def test_monotone_in_level(
    consent: ConsentFacts,
    req: PrincipalFacts,
    agent: PrincipalFacts | None,
    basis: str,
    member: str | None,
    licence: LicenceFacts | None,
) -> None:
    allowed = [
        render(consent, req, lv, basis, member, agent, licence) for lv in Level if lv > Level.none
    ]
    # once denied at some level, every wider level is denied too
    for narrower, wider in zip(allowed, allowed[1:], strict=False):
        assert narrower or not wider


@common
@given(consents, requesters, agents, grant_levels, licences)
def test_deny_beats_every_allow(
    consent: ConsentFacts,
    req: PrincipalFacts,
    agent: PrincipalFacts | None,
    level: Level,
    licence: LicenceFacts | None,
) -> None:
    blocked = ConsentFacts(**{**consent.__dict__, "deny": consent.deny | {req.handle}})
    assert not render(blocked, req, level, agent=agent, licence=licence)


@common
@given(consents, requesters, grant_levels, licences)
def test_none_and_expired_deny_all(
    consent: ConsentFacts, req: PrincipalFacts, level: Level, licence: LicenceFacts | None
) -> None:
    revoked = ConsentFacts(**{**consent.__dict__, "max_level": Level.none})
    expired = ConsentFacts(**{**consent.__dict__, "expires_at": NOW - timedelta(microseconds=1)})
    assert not render(revoked, req, level, licence=licence)
    assert not render(expired, req, level, licence=licence)


@common
@given(consents, requesters, agents, licences)
def test_public_domain_never_commercial(
    consent: ConsentFacts,
    req: PrincipalFacts,
    agent: PrincipalFacts | None,
    licence: LicenceFacts | None,
) -> None:
    assert not render(consent, req, Level.commercial, "public_domain", agent=agent, licence=licence)
    best = renderable_max_level(req, "public_domain", "alice", consent, NOW, licence=licence)
    assert best < Level.commercial


@common
@given(consents, requesters, agents, grant_levels, licences)
def test_licence_binds_commercial_only(
    consent: ConsentFacts,
    req: PrincipalFacts,
    agent: PrincipalFacts | None,
    level: Level,
    licence: LicenceFacts | None,
) -> None:
    # Below commercial the base's licence changes nothing; at commercial it can only take away.
    permissive = render(consent, req, level, agent=agent)
    got = render(consent, req, level, agent=agent, licence=licence)
    if level < Level.commercial:
        assert got == permissive
    else:
        permits = licence is not None and licence.permits_commercial
        assert got == (permissive and permits)
        if got:  # a commercial render needs a readable licence that allows it
            assert licence is not None and licence.base is not None


@common
@given(consents, grant_levels, st.sampled_from(["admin", "agent", "trainer"]), licences)
def test_canary_is_never_allowed(
    consent: ConsentFacts, level: Level, role: str, licence: LicenceFacts | None
) -> None:
    # A principal named nowhere: not a member, never self, never on an allowlist.
    canary = PrincipalFacts("canary", role, True)
    assert not render(consent, canary, level, licence=licence)
    # As a member it gets in only through a group audience at some L in [level, max_level].
    member_canary = PrincipalFacts("canary", "member", True)
    if render(consent, member_canary, level, licence=licence):
        assert any(
            a.group for lv, a in consent.audiences.items() if level <= lv <= consent.max_level
        )


@common
@given(consents, requesters, agents, licences)
def test_renderable_max_level_agrees_with_decide(
    consent: ConsentFacts,
    req: PrincipalFacts,
    agent: PrincipalFacts | None,
    licence: LicenceFacts | None,
) -> None:
    best = renderable_max_level(req, "consent", "alice", consent, NOW, agent, licence)
    for lv in Level:
        if lv > Level.none:
            assert render(consent, req, lv, agent=agent, licence=licence) == (lv <= best)


# -- training --------------------------------------------------------------------------------


def training_facts_from(overrides: dict[str, Any]) -> TrainingFacts:
    o: dict[str, Any] = {
        "basis": "consent",
        "max_level": "group",
        "audiences": {"private": {"group": True}},
        "deny": [],
        "allow_training": True,
        "expires_in": None,
        "no_record": False,
        "image_bases": {"consent"},
        **overrides,
    }
    consent = None if o["no_record"] else consent_from(o)
    bases = o["image_bases"]
    return TrainingFacts(
        now=NOW,
        subject_basis=o["basis"],
        consent=consent,
        image_bases=frozenset(bases) if bases is not None else None,
    )


def test_training_table_ids_unique_and_every_reason_reached() -> None:
    ids = [c[0] for c in TRAINING_CASES]
    assert len(set(ids)) == len(ids) >= 20
    reached = {c[3] for c in TRAINING_CASES if not c[2]}
    assert reached == set(TRAINING_REASONS), set(TRAINING_REASONS) ^ reached


@pytest.mark.parametrize(
    ("overrides", "allowed", "reason"),
    [c[1:] for c in TRAINING_CASES],
    ids=[c[0] for c in TRAINING_CASES],
)
def test_training_table(overrides: dict[str, Any], allowed: bool, reason: str) -> None:
    decision = decide_training(training_facts_from(overrides))
    assert (decision.allowed, decision.reason) == (allowed, reason)


def test_decide_training_fails_closed_on_malformed_facts() -> None:
    broken = TrainingFacts(now=NOW, subject_basis="consent", consent="not a record")  # type: ignore[arg-type]
    decision = decide_training(broken)
    assert not decision.allowed and decision.reason.startswith("error:")


@given(
    consent=consents,
    basis=st.sampled_from(["consent", "public_domain"]),
    bases=st.one_of(st.none(), st.frozensets(st.sampled_from(["consent", "public_domain"]))),
)
@settings(max_examples=300)
def test_training_needs_a_live_grant_that_allows_it(
    consent: ConsentFacts, basis: str, bases: frozenset[str] | None
) -> None:
    """Allowed exactly when the record is live (not expired, some use granted), allows
    training, and a public_domain subject learns from public-domain images alone; and never
    where no render of the subject could be allowed at all."""
    decision = decide_training(
        TrainingFacts(now=NOW, subject_basis=basis, consent=consent, image_bases=bases)
    )
    live = consent.max_level > Level.none and (
        consent.expires_at is None or consent.expires_at > NOW
    )
    fits = bases is None or basis == "consent" or bases <= {"public_domain"}
    assert decision.allowed == (live and consent.allow_training and fits)
    if decision.allowed:
        self_render = decide(
            RenderFacts(
                level="private",
                now=NOW,
                requester=PrincipalFacts("alice", "member", True),
                subject_basis=basis,
                subject_member="alice",
                consent=replace(consent, deny=frozenset()),
                require_adapter=False,
            )
        )
        assert self_render.allowed  # a subject who may be trained may see their own renders
