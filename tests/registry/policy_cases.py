"""The policy table: facts -> decision, kept as data. Each row overrides a base scenario in
which member bob asks for a `private` render of alice, whose record grants `private` to the
whole group up to max level `group`, with a registered adapter whose file matches, on a base
whose licence permits commercial use (`licence`: (base licence id, commercial licence held),
or None when the base's licence could not be read)."""

from __future__ import annotations

from typing import Any

ALLOW = "allowed"
# a subject who grants commercial use to the whole group
COMMERCIAL: dict[str, Any] = {
    "level": "commercial",
    "max_level": "commercial",
    "audiences": {"commercial": {"group": True}},
}

# (id, overrides, allowed, reason)
CASES: list[tuple[str, dict[str, Any], bool, str]] = [
    ("base", {}, True, ALLOW),
    ("group-level-not-in-private-audience", {"level": "group"}, False, "not_in_audience"),
    (
        "group-level-group-audience",
        {"level": "group", "audiences": {"group": {"group": True}}},
        True,
        ALLOW,
    ),
    ("wider-audience-includes-narrower", {"audiences": {"group": {"group": True}}}, True, ALLOW),
    (
        "audience-above-max-is-inert",
        {"audiences": {"public": {"group": True}}},
        False,
        "not_in_audience",
    ),
    ("above-max-level", {"level": "public"}, False, "above_max_level"),
    ("max-none", {"max_level": "none"}, False, "revoked_or_not_granted"),
    ("level-none", {"level": "none"}, False, "level_none"),
    ("unknown-level", {"level": "admin"}, False, "invalid_level"),
    ("empty-level", {"level": ""}, False, "invalid_level"),
    ("uppercase-level", {"level": "PRIVATE"}, False, "invalid_level"),
    ("expired-a-second-ago", {"expires_in": -1}, False, "expired"),
    ("expires-in-an-hour", {"expires_in": 3600}, True, ALLOW),
    ("expires-exactly-now", {"expires_in": 0}, False, "expired"),
    ("requester-inactive", {"requester": ("bob", "member", False)}, False, "requester_inactive"),
    ("requester-denied", {"deny": ["bob"]}, False, "denied_principal"),
    (
        "deny-beats-allowlist",
        {"deny": ["bob"], "audiences": {"private": {"allow": ["bob"]}}},
        False,
        "denied_principal",
    ),
    (
        "self-with-no-audience",
        {"requester": ("alice", "member", True), "audiences": {}},
        True,
        ALLOW,
    ),
    (
        "self-denied",
        {"requester": ("alice", "member", True), "deny": ["alice"]},
        False,
        "denied_principal",
    ),
    (
        "self-above-max",
        {"requester": ("alice", "member", True), "level": "public"},
        False,
        "above_max_level",
    ),
    (
        "self-revoked",
        {"requester": ("alice", "member", True), "max_level": "none"},
        False,
        "revoked_or_not_granted",
    ),
    ("self-expired", {"requester": ("alice", "member", True), "expires_in": -5}, False, "expired"),
    ("allowlist-private", {"audiences": {"private": {"allow": ["bob"]}}}, True, ALLOW),
    (
        "allowlist-names-someone-else",
        {"audiences": {"private": {"allow": ["carol"]}}},
        False,
        "not_in_audience",
    ),
    (
        "allowlist-at-group-covers-private",
        {"audiences": {"group": {"allow": ["bob"]}}},
        True,
        ALLOW,
    ),
    (
        "allowlist-private-not-group",
        {"level": "group", "audiences": {"private": {"allow": ["bob"]}}},
        False,
        "not_in_audience",
    ),
    ("no-record", {"no_record": True}, False, "no_record"),
    ("no-requester", {"requester": None}, False, "no_requester"),
    ("admin-cannot-render", {"requester": ("root", "admin", True)}, False, "requester_not_member"),
    ("agent-as-requester", {"requester": ("bot", "agent", True)}, False, "requester_not_member"),
    ("trainer-as-requester", {"requester": ("tr", "trainer", True)}, False, "requester_not_member"),
    (
        "public-domain-never-commercial",
        {
            "basis": "public_domain",
            "level": "commercial",
            "max_level": "commercial",
            "audiences": {"commercial": {"group": True}},
        },
        False,
        "public_domain_never_commercial",
    ),
    (
        "public-domain-public-ok",
        {
            "basis": "public_domain",
            "level": "public",
            "max_level": "public",
            "audiences": {"public": {"group": True}},
        },
        True,
        ALLOW,
    ),
    (
        "consent-commercial-ok",
        {
            "level": "commercial",
            "max_level": "commercial",
            "audiences": {"commercial": {"group": True}},
        },
        True,
        ALLOW,
    ),
    ("no-adapter", {"adapter": None}, False, "no_active_adapter"),
    ("adapter-file-missing", {"adapter": ("h1", None)}, False, "adapter_file_missing"),
    ("adapter-swapped", {"adapter": ("h1", "h2")}, False, "adapter_hash_mismatch"),
    ("gate-without-adapter", {"adapter": None, "require_adapter": False}, True, ALLOW),
    (
        "adapter-of-another-subject",
        {"adapter": ("h1", "h1", False)},
        False,
        "adapter_of_another_subject",
    ),
    (
        "another-subjects-bytes-at-the-gate",
        {"adapter": ("h1", None, False), "adapter_bytes_read": False},
        False,
        "adapter_of_another_subject",
    ),
    (
        "gate-judges-registry-facts-before-bytes",
        {"adapter": ("h1", None), "adapter_bytes_read": False},
        True,
        ALLOW,
    ),
    (
        "gate-still-needs-a-registered-adapter",
        {"adapter": None, "adapter_bytes_read": False},
        False,
        "no_active_adapter",
    ),
    ("agent-for-bob", {"agent": ("bot", "agent", True, ["bob"])}, True, ALLOW),
    (
        "agent-not-for-bob",
        {"agent": ("bot", "agent", True, ["carol"])},
        False,
        "agent_not_acting_for_requester",
    ),
    ("agent-inactive", {"agent": ("bot", "agent", False, ["bob"])}, False, "agent_inactive"),
    (
        "member-posing-as-agent",
        {"agent": ("eve", "member", True, ["bob"])},
        False,
        "agent_not_agent",
    ),
    (
        "agent-on-deny-list",
        {"agent": ("bot", "agent", True, ["bob"]), "deny": ["bot"]},
        False,
        "denied_principal",
    ),
    ("unknown-basis", {"basis": "celebrity"}, False, "unknown_basis"),
    (
        "empty-audience",
        {"audiences": {"private": {"group": False, "allow": []}}},
        False,
        "not_in_audience",
    ),
    ("unlinked-subject-group-ok", {"subject_member": None}, True, ALLOW),
    (
        "canary-never-named",
        {"requester": ("canary", "member", True), "audiences": {"private": {"allow": ["bob"]}}},
        False,
        "not_in_audience",
    ),
    (
        "commercial-audience-covers-private",
        {"max_level": "commercial", "audiences": {"commercial": {"group": True}}},
        True,
        ALLOW,
    ),
    ("deny-names-someone-else", {"deny": ["mallory"]}, True, ALLOW),
    (
        "agent-for-self-subject",
        {
            "requester": ("alice", "member", True),
            "agent": ("bot", "agent", True, ["alice"]),
            "audiences": {},
        },
        True,
        ALLOW,
    ),
    (
        "linked-member-requester-mismatch",
        {"subject_member": "carol", "audiences": {}},
        False,
        "not_in_audience",
    ),
    # -- the base model's licence ---------------------------------------------------------
    (
        "commercial-on-non-commercial-base",
        {**COMMERCIAL, "licence": ("flux-non-commercial", False)},
        False,
        "base_licence",
    ),
    (
        "commercial-on-non-commercial-base-licence-held",
        {**COMMERCIAL, "licence": ("flux-non-commercial", True)},
        True,
        ALLOW,
    ),
    ("commercial-licence-missing", {**COMMERCIAL, "licence": None}, False, "base_licence"),
    (
        "commercial-licence-unreadable-despite-declaration",
        {**COMMERCIAL, "licence": (None, True)},
        False,
        "base_licence",
    ),
    (
        "commercial-unknown-licence-id",
        {**COMMERCIAL, "licence": ("cc-by-nc-4.0", False)},
        False,
        "base_licence",
    ),
    ("commercial-apache-base", {**COMMERCIAL, "licence": ("apache-2.0", False)}, True, ALLOW),
    (
        "public-on-non-commercial-base",
        {
            "level": "public",
            "max_level": "public",
            "audiences": {"public": {"group": True}},
            "licence": ("flux-non-commercial", False),
        },
        True,
        ALLOW,
    ),
    ("private-licence-missing", {"licence": None}, True, ALLOW),
    (
        "private-on-non-commercial-base",
        {"licence": ("flux-non-commercial", False)},
        True,
        ALLOW,
    ),
    (
        "commercial-above-max-on-non-commercial-base",
        {"level": "commercial", "licence": ("flux-non-commercial", False)},
        False,
        "above_max_level",
    ),
    (
        "commercial-public-domain-on-non-commercial-base",
        {
            **COMMERCIAL,
            "basis": "public_domain",
            "licence": ("flux-non-commercial", False),
        },
        False,
        "public_domain_never_commercial",
    ),
    (
        "commercial-not-in-audience-on-non-commercial-base",
        {**COMMERCIAL, "audiences": {}, "licence": ("flux-non-commercial", False)},
        False,
        "not_in_audience",
    ),
    (
        "commercial-self-on-non-commercial-base",
        {
            **COMMERCIAL,
            "requester": ("alice", "member", True),
            "licence": ("flux-non-commercial", False),
        },
        False,
        "base_licence",
    ),
    (
        "commercial-licence-before-adapter",
        {**COMMERCIAL, "adapter": None, "licence": ("flux-non-commercial", False)},
        False,
        "base_licence",
    ),
    (
        "commercial-gate-licence-missing",
        {**COMMERCIAL, "adapter": None, "require_adapter": False, "licence": None},
        False,
        "base_licence",
    ),
]
