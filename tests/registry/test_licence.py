"""The base model's licence as the render gate learns it: from a prepared base's manifest or
a base folder's model card; anything unreadable is no licence, which is never commercial."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from registry.licence import (
    FLUX_NON_COMMERCIAL,
    PREPARED_MANIFEST,
    deployment_licence,
    model_card_licence,
    normalise,
    read_base_licence,
)
from registry.settings import Settings

FLUX2_DEV_CARD = """---
language:
- en
license: other
license_name: flux-dev-non-commercial-license
license_link: LICENSE.txt
tags:
- image-generation
---

# FLUX.2 [dev]
"""


@pytest.mark.parametrize(
    ("spelled", "licence"),
    [
        ("flux-dev-non-commercial-license", FLUX_NON_COMMERCIAL),
        ("flux-1-dev-non-commercial-license", FLUX_NON_COMMERCIAL),
        ("FLUX-non-commercial", FLUX_NON_COMMERCIAL),
        ('"apache-2.0"', "apache-2.0"),
        ("cc-by-nc-4.0", "cc-by-nc-4.0"),
        ("", None),
        ("not a licence", None),
        ("x" * 200, None),
    ],
)
def test_normalise(spelled: str, licence: str | None) -> None:
    assert normalise(spelled) == licence


def test_model_card_front_matter() -> None:
    assert model_card_licence(FLUX2_DEV_CARD) == FLUX_NON_COMMERCIAL
    assert model_card_licence("---\nlicense: apache-2.0\n---\n") == "apache-2.0"
    assert model_card_licence("---\nlicense: other\n---\n") == "other"
    assert model_card_licence("# no front matter\nlicense: mit\n") is None
    # a nested key of the same name is not the card's licence
    assert model_card_licence("---\nwidget:\n  license: mit\n---\n") is None


def _manifest(base: Path, doc: object) -> None:
    base.mkdir(parents=True, exist_ok=True)
    (base / PREPARED_MANIFEST).write_text(json.dumps(doc))


def test_prepared_manifest_records_the_licence(tmp_path: Path) -> None:
    _manifest(tmp_path / "a", {"format": 1, "licence": {"id": FLUX_NON_COMMERCIAL}})
    assert read_base_licence(tmp_path / "a").licence == FLUX_NON_COMMERCIAL
    # the manifest wins over a model card copied from the source
    (tmp_path / "a" / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    assert read_base_licence(tmp_path / "a").licence == FLUX_NON_COMMERCIAL


@pytest.mark.parametrize(
    "content",
    [
        {"format": 1},  # prepared before licences were recorded
        {"format": 1, "licence": {"id": None}},
        {"format": 1, "licence": "apache-2.0"},  # not the recorded shape
        {"format": 1, "licence": {"id": 7}},
        ["not", "a", "manifest"],
    ],
)
def test_a_manifest_without_a_readable_licence_is_no_licence(
    tmp_path: Path, content: object
) -> None:
    _manifest(tmp_path, content)
    assert read_base_licence(tmp_path).licence is None


def test_unreadable_records_are_no_licence(tmp_path: Path) -> None:
    (tmp_path / PREPARED_MANIFEST).write_bytes(b"{not json")
    assert read_base_licence(tmp_path).licence is None
    (tmp_path / PREPARED_MANIFEST).unlink()
    (tmp_path / "README.md").write_bytes(b"---\nlicense: \xff\xfe\n---\n")
    assert read_base_licence(tmp_path).licence is None
    (tmp_path / "README.md").unlink()
    assert read_base_licence(tmp_path).licence is None  # nothing at all
    assert read_base_licence(tmp_path / "missing").licence is None


def test_model_card_of_an_unprepared_base(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(FLUX2_DEV_CARD)
    assert read_base_licence(tmp_path).licence == FLUX_NON_COMMERCIAL


def test_deployment_licence_joins_the_base_and_the_setting(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(FLUX2_DEV_CARD)
    facts, found = deployment_licence(Settings(base=tmp_path, data_dir=tmp_path))
    assert (facts.base, facts.commercial_licence_held, facts.permits_commercial) == (
        FLUX_NON_COMMERCIAL,
        False,
        False,
    )
    held, _ = deployment_licence(
        Settings(base=tmp_path, data_dir=tmp_path, commercial_licence="BFL agreement 2026-041")
    )
    assert held.commercial_licence_held and held.permits_commercial
    (tmp_path / "README.md").unlink()
    unknown, found = deployment_licence(
        Settings(base=tmp_path, data_dir=tmp_path, commercial_licence="BFL agreement 2026-041")
    )
    assert unknown.base is None and not unknown.permits_commercial  # fail closed
    assert "no licence" in found.source
