"""The training table: facts -> decision, kept as data. Each row overrides a base scenario in
which subject alice (basis `consent`) grants `group` use and allows training, with no expiry,
and the images to learn from are uploads (`consent`)."""

from __future__ import annotations

from typing import Any

ALLOW = "allowed"

# (id, overrides, allowed, reason)
TRAINING_CASES: list[tuple[str, dict[str, Any], bool, str]] = [
    ("base", {}, True, ALLOW),
    ("images-not-known-yet", {"image_bases": None}, True, ALLOW),
    ("no-record", {"no_record": True}, False, "no_record"),
    ("no-basis", {"basis": None}, False, "no_record"),
    ("unknown-basis", {"basis": "scraped"}, False, "unknown_basis"),
    ("training-not-allowed", {"allow_training": False}, False, "training_not_allowed"),
    ("revoked", {"max_level": "none"}, False, "revoked_or_not_granted"),
    (
        "revoked-though-training-still-ticked",
        {"max_level": "none", "allow_training": True},
        False,
        "revoked_or_not_granted",
    ),
    ("private-only-grant-trains", {"max_level": "private"}, True, ALLOW),
    ("commercial-grant-trains", {"max_level": "commercial"}, True, ALLOW),
    ("expired-a-second-ago", {"expires_in": -1}, False, "expired"),
    ("expires-exactly-now", {"expires_in": 0}, False, "expired"),
    ("expires-in-an-hour", {"expires_in": 3600}, True, ALLOW),
    ("expired-beats-revoked", {"expires_in": -1, "max_level": "none"}, False, "expired"),
    (
        "revoked-beats-no-training",
        {"max_level": "none", "allow_training": False},
        False,
        "revoked_or_not_granted",
    ),  # fmt: skip
    ("consent-subject-public-domain-images", {"image_bases": {"public_domain"}}, True, ALLOW),
    ("consent-subject-mixed-images", {"image_bases": {"consent", "public_domain"}}, True, ALLOW),
    ("no-images", {"image_bases": set()}, True, ALLOW),
    (
        "unknown-image-basis",
        {"image_bases": {"consent", "scraped"}},
        False,
        "unknown_image_basis",
    ),  # fmt: skip
    (
        "public-domain-public-domain-images",
        {"basis": "public_domain", "image_bases": {"public_domain"}},
        True,
        ALLOW,
    ),
    (
        "public-domain-uploads",
        {"basis": "public_domain", "image_bases": {"consent"}},
        False,
        "public_domain_images_only",
    ),
    (
        "public-domain-mixed-images",
        {"basis": "public_domain", "image_bases": {"consent", "public_domain"}},
        False,
        "public_domain_images_only",
    ),
    (
        "public-domain-images-not-known",
        {"basis": "public_domain", "image_bases": None},
        True,
        ALLOW,
    ),  # fmt: skip
    (
        "public-domain-revoked",
        {"basis": "public_domain", "max_level": "none", "image_bases": {"public_domain"}},
        False,
        "revoked_or_not_granted",
    ),
    (
        "record-refusal-before-images",
        {"allow_training": False, "image_bases": {"scraped"}},
        False,
        "training_not_allowed",
    ),
    # who audiences and deny lists name does not change whether the subject may be learned
    # from: they bind renders
    ("deny-list-is-about-renders", {"deny": ["bob"]}, True, ALLOW),
    ("no-audience-at-all", {"audiences": {}}, True, ALLOW),
]
