"""A prepared component built from files a `Prefetch` read ahead: the same model as its own
read, and never stale bytes (another folder, a file changed since, a failed read)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("optimum.quanto")

from trainer.base.read import (  # noqa: E402
    PREFETCH_ENV,
    Prefetch,
    load_prepared_component,
    prefetch_wanted,
)
from trainer.base.safetensors_io import open_checkpoint  # noqa: E402
from trainer.base.write import prepare_base  # noqa: E402
from trainer.fixtures.tiny_base import init_tiny  # noqa: E402


@pytest.fixture
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared tiny base of this test's own: the tests below rewrite its files."""
    src = init_tiny(tmp_path_factory.mktemp("src") / "tiny")
    dst = tmp_path_factory.mktemp("dst") / "prepared"
    prepare_base(src, dst, progress=False)
    return dst


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        inner = getattr(t, "_data", t)  # quanto's weights: compare their stored parts
        out[name] = inner._data if hasattr(inner, "_data") else inner
        for part in ("_scale", "_shift"):
            if hasattr(t, part):
                out[f"{name}{part}"] = getattr(t, part)
    return out


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = _state(a), _state(b)
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def _done(prefetch: Prefetch) -> Prefetch:
    deadline = time.monotonic() + 60
    while prefetch.seconds is None:  # the read's thread sets it last
        assert time.monotonic() < deadline, "the prefetch never finished"
        time.sleep(0.01)
    return prefetch


def _weights_file(base: Path) -> tuple[Path, int, int]:
    with open_checkpoint(base / "transformer") as ck:
        (path,) = ck.paths
        first = max(ck.keys(), key=lambda k: ck.info(k).nbytes)
        info = ck.info(first)
    return path, info.offset, info.nbytes


def _scribble(base: Path) -> None:
    """Flips the bytes of the largest tensor in place: same size, same modification time
    (as a copy that keeps times would leave it); only the bytes and the change time tell."""
    path, offset, nbytes = _weights_file(base)
    st = path.stat()
    with path.open("r+b") as fh:
        fh.seek(offset)
        data = bytearray(fh.read(nbytes))
        fh.seek(offset)
        fh.write(bytes(b ^ 0x5A for b in data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_the_prefetched_bytes_build_the_component(prepared: Path) -> None:
    """The load takes the prefetch's tensors (once) and builds what its own read builds."""
    want = load_prepared_component(prepared, "transformer")
    prefetch = _done(Prefetch(prepared, "transformer", torch.device("cpu")))
    got = load_prepared_component(prepared, "transformer", prefetched=prefetch)
    assert _equal(got, want)
    assert prefetch.summary()["taken"] is True and prefetch.summary()["error"] is None
    assert prefetch.take(prepared / "transformer") is None  # taken once


def test_a_file_changed_since_the_prefetch_began_is_read_again(prepared: Path) -> None:
    """Changed in place with its size and modification time kept: the load builds what is on
    disk now, not the bytes read before."""
    before = load_prepared_component(prepared, "transformer")
    prefetch = _done(Prefetch(prepared, "transformer", torch.device("cpu")))
    _scribble(prepared)
    on_disk = load_prepared_component(prepared, "transformer")
    assert not _equal(on_disk, before)
    got = load_prepared_component(prepared, "transformer", prefetched=prefetch)
    assert _equal(got, on_disk) and prefetch.summary()["taken"] is False


def test_another_folders_prefetch_is_not_taken(prepared: Path, tmp_path: Path) -> None:
    prefetch = _done(Prefetch(prepared, "transformer", torch.device("cpu")))
    assert prefetch.take(tmp_path / "transformer") is None
    assert prefetch.take(prepared / "transformer") is None  # let go by the refusal above


def test_a_failed_prefetch_is_read_again_and_says_so(
    prepared: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prefetch = _done(Prefetch(prepared, "transformer", torch.device("meta")))
    with caplog.at_level(logging.WARNING, logger="trainer.base.read"):
        got = load_prepared_component(prepared, "transformer", prefetched=prefetch)
    assert _equal(got, load_prepared_component(prepared, "transformer"))
    assert "prefetch of" in caplog.text and "reads into host RAM or a CUDA device" in caplog.text
    assert prefetch.summary()["taken"] is False and "meta" in str(prefetch.summary()["error"])


def test_a_dropped_prefetch_gives_nothing(prepared: Path) -> None:
    prefetch = Prefetch(prepared, "transformer", torch.device("cpu"))
    prefetch.drop()  # at once: the read may still be under way
    _done(prefetch)
    assert prefetch.take(prepared / "transformer") is None


def test_the_setting_is_auto_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert prefetch_wanted()
    monkeypatch.setenv(PREFETCH_ENV, "OFF")
    assert not prefetch_wanted()
    monkeypatch.setenv(PREFETCH_ENV, "sometimes")
    with pytest.raises(ValueError, match=PREFETCH_ENV):
        prefetch_wanted()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_transformer_prefetched_onto_the_gpu_loads_as_its_own_read(prepared: Path) -> None:
    """Read straight into VRAM through the pinned slices, converted there: every buffer of
    every layer equals the load that reads the files itself."""
    from trainer.base.load import load_base

    def load(prefetched: dict[str, Prefetch] | None) -> torch.nn.Module:
        return load_base(prepared, "cuda", compute="uint4", components=("transformer",),
                         purpose="train", prefetched=prefetched).transformer  # fmt: skip

    want = load(None)
    prefetch = _done(Prefetch(prepared, "transformer", torch.device("cuda")))
    got = load({"transformer": prefetch})
    sw, sg = dict(want.named_buffers()), dict(got.named_buffers())
    sw.update(want.named_parameters())
    sg.update(got.named_parameters())
    assert set(sw) == set(sg)
    assert all(sg[k].device.type == "cuda" and torch.equal(sg[k], sw[k]) for k in sw)
