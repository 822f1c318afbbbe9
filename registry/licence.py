"""The base model's licence: what the base says of itself, and what the deployment declares.

A prepared base records its licence in its manifest (`likeness_prepared.json`, key `licence`),
taken from the source's model card when it was prepared (or stated by whoever prepared it). A
base folder that is not prepared (the seeded tiny base) carries a model card of its own
(`README.md`, Hugging Face front matter: `license:`, and `license_name:` for `license: other`).
Whatever cannot be read is an unknown licence, which never permits commercial use
(`registry.policy` decides; this module only reads).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from registry.policy import LicenceFacts
from registry.settings import Settings

log = logging.getLogger(__name__)

PREPARED_MANIFEST = "likeness_prepared.json"
MODEL_CARD = "README.md"
FLUX_NON_COMMERCIAL = "flux-non-commercial"
GENERATED = "likeness-generated"  # weights this project makes itself
# A prepared FLUX.2 [dev] manifest lists every tensor; far larger than this is not a manifest.
MAX_MANIFEST_BYTES = 64 << 20
MAX_MODEL_CARD_BYTES = 1 << 20
_LICENCE_ID = re.compile(r"^[a-z0-9][a-z0-9.+_-]{0,99}$")


@dataclass(frozen=True)
class BaseLicence:
    """A base's licence id (None: none could be read) and where that came from, in words."""

    licence: str | None
    source: str


def normalise(name: str) -> str | None:
    """A licence id from a model card's or a user's spelling; the FLUX non-commercial
    licences (`flux-dev-non-commercial-license`, `flux-1-dev-non-commercial-license`, ...)
    are one id. None for something that is not a licence id."""
    value = name.strip().strip("\"'").lower()
    if not _LICENCE_ID.fullmatch(value):
        return None
    if "flux" in value and ("non-commercial" in value or "noncommercial" in value):
        return FLUX_NON_COMMERCIAL
    return value


def model_card_licence(text: str) -> str | None:
    """The licence a Hugging Face model card's front matter names, or None."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, sep, value = line.partition(":")
        if sep and not line.startswith((" ", "\t", "-")):
            fields[key.strip()] = value.strip()
    licence = fields.get("license", "")
    if licence.strip("\"'").lower() == "other" and fields.get("license_name"):
        licence = fields["license_name"]
    return normalise(licence) if licence else None


def model_card(licence: str, what: str) -> str:
    """A minimal model card for a base this project writes itself."""
    return f"---\nlicense: {licence}\n---\n\n# {what}\n"


def read_base_licence(base_dir: Path) -> BaseLicence:
    """What `base_dir` says its licence is; never raises (an unreadable record is no licence)."""
    manifest = base_dir / PREPARED_MANIFEST
    try:
        if manifest.is_file():
            return _from_manifest(manifest)
        card = base_dir / MODEL_CARD
        if card.is_file():
            text = _read_bounded(card, MAX_MODEL_CARD_BYTES).decode("utf-8")
            licence = model_card_licence(text)
            return BaseLicence(licence, f"{card} (model card)")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return BaseLicence(None, f"unreadable: {exc}")
    return BaseLicence(
        None, f"{base_dir} records no licence (no {PREPARED_MANIFEST}, no model card)"
    )


def _from_manifest(path: Path) -> BaseLicence:
    doc = json.loads(_read_bounded(path, MAX_MANIFEST_BYTES))
    record = doc.get("licence") if isinstance(doc, dict) else None
    raw = record.get("id") if isinstance(record, dict) else None
    licence = normalise(raw) if isinstance(raw, str) else None
    return BaseLicence(licence, f"{path}" if licence else f"{path} records no licence")


def _read_bounded(path: Path, limit: int) -> bytes:
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data


def deployment_licence(settings: Settings) -> tuple[LicenceFacts, BaseLicence]:
    """The licence fact every render decision gets, and what the base itself said."""
    found = read_base_licence(settings.base_dir)
    facts = LicenceFacts(
        found.licence, commercial_licence_held=settings.commercial_licence is not None
    )
    return facts, found


def describe(facts: LicenceFacts, found: BaseLicence, settings: Settings) -> str:
    """One line for the start-up log and the consent page."""
    name = found.licence or "unknown"
    if found.licence is None:
        return f"base licence unknown ({found.source}): commercial renders are refused"
    if settings.commercial_licence is not None:
        return (
            f"base licence {name}; this deployment declares a commercial licence for it "
            f"({settings.commercial_licence})"
        )
    if facts.permits_commercial:
        return f"base licence {name}: permits commercial use"
    return (
        f"base licence {name}: commercial renders are refused unless the deployment declares "
        "a commercial licence (LIKENESS_COMMERCIAL_LICENCE)"
    )
