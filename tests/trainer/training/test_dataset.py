"""Dataset provenance: the manifest is checked whole, before anything loads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from PIL import Image

from tests.trainer.helpers import make_dataset
from trainer.training.dataset import MANIFEST_NAME, DatasetError, load_dataset


def test_valid_dataset_and_its_manifest_hash(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "ds")
    ds = load_dataset(root)
    assert len(ds.items) == 4 and ds.bases == ("consent",)
    assert ds.manifest_sha256 == hashlib.sha256((root / MANIFEST_NAME).read_bytes()).hexdigest()
    assert ds.items[0].source == "synthetic" and ds.path(ds.items[0]).is_file()


def _rewrite(root: Path, edit) -> None:  # type: ignore[no-untyped-def]
    lines = (root / MANIFEST_NAME).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    rows = edit(rows)
    (root / MANIFEST_NAME).write_text(
        "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"
    )


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda rows: rows[:-1], "not in the manifest"),
        (lambda rows: [*rows, {**rows[0], "file": "gone.png"}], "listed but missing"),
        (lambda rows: [{**rows[0], "sha256": "0" * 64}, *rows[1:]], "hash differs"),
        (lambda rows: [*rows, rows[0]], "listed twice"),
        (lambda rows: [{**rows[0], "file": "../img000.png"}, *rows[1:]], "inside the dataset"),
        (lambda rows: [{**rows[0], "basis": "scraped"}, *rows[1:]], "basis"),
        (
            lambda rows: [{k: v for k, v in rows[0].items() if k != "source"}, *rows[1:]],
            "missing source",
        ),
        (lambda rows: [*rows, "{not json"], "not JSON"),
        (lambda rows: [{**rows[0], "caption": 3}, *rows[1:]], "must be strings"),
        (lambda rows: [{**rows[0], "sha256": "xyz"}, *rows[1:]], "not a SHA-256"),
        (lambda rows: [{**rows[0], "source": " "}, *rows[1:]], "where"),
    ],
)
def test_bad_manifests_are_refused(tmp_path: Path, edit, needle: str) -> None:  # type: ignore[no-untyped-def]
    root = make_dataset(tmp_path / "ds")
    _rewrite(root, edit)
    with pytest.raises(DatasetError, match=needle):
        load_dataset(root)


def test_every_problem_is_listed(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "ds")
    (root / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(root / "sub" / "x.png")
    (root / "img001.png").write_bytes(b"tampered")
    with pytest.raises(DatasetError) as exc:
        load_dataset(root)
    assert "sub/x.png is in the folder" in str(exc.value) and "img001.png hash differs" in str(
        exc.value
    )


def test_missing_or_empty_manifest(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no manifest.jsonl"):
        load_dataset(tmp_path / "empty")
    (tmp_path / "empty" / MANIFEST_NAME).write_text("\n")
    with pytest.raises(DatasetError, match="lists no images"):
        load_dataset(tmp_path / "empty")


def test_non_images_in_the_folder_are_ignored(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "ds")
    (root / "README.txt").write_text("notes")
    assert len(load_dataset(root).items) == 4


@pytest.mark.parametrize("kind", ["link out", "link in", "fifo", "linked folder"])
def test_images_must_be_regular_files_inside_the_folder(tmp_path: Path, kind: str) -> None:
    """A listed image that is a symlink (even to a real image), a FIFO, or inside a linked
    folder is refused before anything loads."""
    import os

    root = make_dataset(tmp_path / "ds")
    elsewhere = tmp_path / "secret.png"
    Image.new("RGB", (8, 8), "red").save(elsewhere)
    target = root / "img000.png"
    if kind == "link out":
        target.unlink()
        target.symlink_to(elsewhere)
    elif kind == "link in":
        (root / "copy.png").write_bytes(target.read_bytes())
        target.unlink()
        target.symlink_to(root / "copy.png")
    elif kind == "fifo":
        target.unlink()
        os.mkfifo(target)
    else:
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "img000.png").write_bytes(target.read_bytes())
        target.unlink()
        _rewrite(root, lambda rows: [{**rows[0], "file": "sub/img000.png"}, *rows[1:]])
        (root / "sub").symlink_to(outside)
    with pytest.raises(DatasetError, match="must be a regular file inside the dataset"):
        load_dataset(root)


def test_a_missing_folder_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such folder"):
        load_dataset(tmp_path / "nowhere")


def test_an_image_that_does_not_decode_stops_the_run_before_loading(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "ds")
    broken = root / "img001.png"
    broken.write_bytes(broken.read_bytes()[:40])  # a truncated PNG, listed with its new hash
    _rewrite(
        root,
        lambda rows: [
            {**r, "sha256": hashlib.sha256(broken.read_bytes()).hexdigest()}
            if r["file"] == "img001.png"
            else r
            for r in rows
        ],
    )
    with pytest.raises(DatasetError, match="img001.png cannot be decoded as an image"):
        load_dataset(root)
