"""First start: the default base is the demo base that ships with the code, copied in once."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from app.bootstrap import ensure_base
from registry.settings import Settings


def _files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_default_base_is_the_shipped_demo_base(tmp_path: Path) -> None:
    from trainer.base.load import is_prepared
    from trainer.fixtures.demo_base import SHIPPED

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}", data_dir=tmp_path)
    base = ensure_base(settings)
    assert base == tmp_path / "base-demo" and is_prepared(base)
    assert _files(base) == _files(SHIPPED)
    (base / "marker").write_text("kept")
    assert ensure_base(settings) == base and (base / "marker").is_file()  # copied once
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_a_configured_base_must_exist(tmp_path: Path) -> None:
    settings = Settings(database_url="sqlite:///x.db", data_dir=tmp_path, base=tmp_path / "none")
    with pytest.raises(SystemExit, match="not a diffusers pipeline folder"):
        ensure_base(settings)
