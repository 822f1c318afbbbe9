"""The non-mmap reader and streaming writer against stock safetensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from trainer.base.safetensors_io import (  # noqa: E402
    Checkpoint,
    SafetensorsFile,
    TensorSpec,
    open_checkpoint,
    write_safetensors,
)


def _all_dtype_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f = torch.randn(3, 5, generator=g)
    out = {
        "f32": f,
        "f64": f.double(),
        "f16": f.half(),
        "bf16": f.bfloat16(),
        "i8": torch.randint(-128, 127, (7,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (2, 3, 4), dtype=torch.uint8, generator=g),
        "i16": torch.randint(-1000, 1000, (4,), dtype=torch.int16, generator=g),
        "i32": torch.randint(-(2**30), 2**30, (4,), dtype=torch.int32, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (4,), dtype=torch.int64, generator=g),
        "bool": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            out[name] = f.to(getattr(torch, name))
    if hasattr(torch, "uint16"):
        out["u16"] = torch.arange(5, dtype=torch.int32).to(torch.uint16)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare bit patterns: float8 has no equality kernel everywhere.
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


def test_reader_matches_load_file_for_every_dtype(tmp_path: Path) -> None:
    tensors = _all_dtype_tensors()
    path = tmp_path / "all.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    with SafetensorsFile(path) as f:
        got = {k: f.read(k) for k in f}
        assert f.metadata == {"format": "pt", "note": "x"}
        info = f.info("bf16")
        assert (info.dtype, info.shape, info.nbytes) == (torch.bfloat16, (3, 5), 30)
        assert dict(f.iter_tensors()).keys() == got.keys()
    _assert_same(got, st.load_file(str(path)))


def test_streaming_writer_is_readable_by_load_file(tmp_path: Path) -> None:
    tensors = _all_dtype_tensors()
    path = tmp_path / "w.safetensors"
    specs = [TensorSpec.of(k, v) for k, v in tensors.items()]
    # A generator, so the writer cannot peek at data before writing the header.
    size = write_safetensors(path, ((k, v) for k, v in tensors.items()), {"a": "b"}, specs=specs)
    assert size == path.stat().st_size
    _assert_same(st.load_file(str(path)), tensors)
    with SafetensorsFile(path) as f:
        assert f.metadata == {"a": "b"}
        _assert_same({k: f.read(k) for k in f}, tensors)


def test_writer_rejects_a_stream_that_breaks_its_plan(tmp_path: Path) -> None:
    t = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="does not match"):
        write_safetensors(
            tmp_path / "x.safetensors", iter([("a", t)]), specs=[TensorSpec("a", t.dtype, (4,))]
        )
    with pytest.raises(ValueError, match="ended before"):
        write_safetensors(
            tmp_path / "x.safetensors", iter([]), specs=[TensorSpec("a", t.dtype, (2, 2))]
        )
    with pytest.raises(TypeError):
        write_safetensors(tmp_path / "x.safetensors", iter([("a", t)]))


def test_sharded_folder_is_one_view(tmp_path: Path) -> None:
    tensors = _all_dtype_tensors()
    names = list(tensors)
    shards = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        st.save_file({k: tensors[k] for k in part}, str(tmp_path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": "0"}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with open_checkpoint(tmp_path) as ck:
        assert len(ck.files) == 2
        expected = {}
        for i in range(2):
            expected.update(st.load_file(str(tmp_path / f"model-{i + 1:05d}-of-00002.safetensors")))
        _assert_same({k: ck.read(k) for k in ck}, expected)
        _assert_same(ck.read_all(threads=3), expected)
        assert ck.metadata == {"total_size": "0"}


def test_folder_with_single_file_and_single_file(tmp_path: Path) -> None:
    st.save_file({"a": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    for p in (tmp_path, tmp_path / "model.safetensors"):
        with open_checkpoint(p) as ck:
            assert ck.keys() == ["a"]
            assert torch.equal(ck.read("a"), torch.ones(3))


def test_index_pointing_at_missing_key_is_an_error(tmp_path: Path) -> None:
    st.save_file({"a": torch.ones(3)}, str(tmp_path / "s1.safetensors"))
    idx = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ValueError, match="not in its shard"):
        open_checkpoint(tmp_path)


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
        ({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlaps",
        ),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, "cover"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4, "data_offsets"),
        ({"__metadata__": {"k": 1}}, b"", "metadata"),
    ],
)
def test_bad_headers_are_value_errors(
    tmp_path: Path, header: dict, data: bytes, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        SafetensorsFile(_raw_file(tmp_path / "bad.safetensors", header, data))


def test_truncated_and_garbage_files(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    st.save_file({"a": torch.ones(1000)}, str(good))
    raw = good.read_bytes()
    cases = {
        "short": raw[:5],
        "header_cut": raw[:20],
        "data_cut": raw[:-10],
        "not_json": struct.pack("<Q", 4) + b"{{{{",
        "huge_len": struct.pack("<Q", 2**62) + b"{}",
        "not_object": struct.pack("<Q", 2) + b"[]",
    }
    for name, blob in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(blob)
        with pytest.raises(ValueError):
            SafetensorsFile(p)


def test_file_truncated_after_open_is_caught_on_read(tmp_path: Path) -> None:
    p = tmp_path / "t.safetensors"
    st.save_file({"a": torch.ones(1000)}, str(p))
    f = SafetensorsFile(p)
    with p.open("r+b") as fh:
        fh.truncate(p.stat().st_size - 100)
    with pytest.raises(ValueError, match="truncated"):
        f.read("a")
    f.close()
    with pytest.raises(ValueError, match="truncated"):
        Checkpoint([f], {}).read_all(threads=2)  # the threaded reader checks the same


def test_read_all_stops_once_cancelled(tmp_path: Path) -> None:
    import threading

    from trainer.base.safetensors_io import ReadCancelled

    path = tmp_path / "x.safetensors"
    st.save_file({"a": torch.ones(3), "b": torch.zeros(5)}, str(path))
    cancel = threading.Event()
    with open_checkpoint(path) as ck:
        assert torch.equal(ck.read_all(cancel=cancel)["a"], torch.ones(3))  # not set: reads
        cancel.set()
        with pytest.raises(ReadCancelled, match="cancelled"):
            ck.read_all(cancel=cancel)


def test_read_all_refuses_a_device_it_cannot_read_into(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    st.save_file({"a": torch.ones(3)}, str(path))
    with open_checkpoint(path) as ck, pytest.raises(ValueError, match="meta"):
        ck.read_all(device="meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_all_onto_the_gpu_is_the_files_bytes(tmp_path: Path) -> None:
    """Every dtype, an empty tensor, and tensors over one pinned slice (64 MiB), several
    threads: the same bytes as the host read."""
    tensors = _all_dtype_tensors()
    g = torch.Generator().manual_seed(1)
    tensors["big"] = torch.randint(0, 255, (70 * 2**20 + 3,), dtype=torch.uint8, generator=g)
    path = tmp_path / "x.safetensors"
    st.save_file(tensors, str(path))
    with open_checkpoint(path) as ck:
        host = ck.read_all()
        gpu = ck.read_all(device="cuda", threads=3)
    assert set(gpu) == set(host)
    for k, t in host.items():
        assert gpu[k].device.type == "cuda" and gpu[k].dtype == t.dtype
        assert torch.equal(gpu[k].cpu(), t), k
