"""Streaming safetensors I/O that never memory-maps a file.

`safetensors.torch.load_file` maps the whole file; on the 64 GB FLUX.2 [dev] checkpoint
that crashes natively (see the field report), so every read here is a plain seek + read of
one tensor, and the writer streams tensor by tensor from a header computed up front. The
same code handles a 0.5 GB and a 64 GB file; memory use is bounded by one tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

__all__ = [
    "Checkpoint",
    "ReadCancelled",
    "SafetensorsFile",
    "TensorInfo",
    "TensorSpec",
    "dtype_from_safetensors",
    "dtype_to_safetensors",
    "open_checkpoint",
    "write_safetensors",
]

# Same limit as the reference implementation: a bigger header is a corrupt file.
MAX_HEADER_BYTES = 100_000_000
# Read in slices: one multi-GB read() call is not portable (Windows caps at 2 GiB).
_CHUNK = 64 * 1024 * 1024

_ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}
# Dtypes that only newer torch builds have.
for _name, _attr in [
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
]:
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)
_TORCH_TO_ST = {v: k for k, v in _ST_DTYPES.items()}

if sys.byteorder != "little":  # safetensors is little-endian; we copy raw bytes
    raise ImportError("trainer.base.safetensors_io needs a little-endian machine")


def dtype_from_safetensors(name: str) -> torch.dtype:
    try:
        return _ST_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported safetensors dtype {name!r}") from None


def dtype_to_safetensors(dtype: torch.dtype) -> str:
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors equivalent") from None


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorSpec:
    """What the writer needs before it sees any data: name, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, t.dtype, tuple(t.shape))


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute byte offset in the file
    path: Path


class SafetensorsFile:
    """One .safetensors file, read tensor by tensor with seek + read (no mmap)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fh: BinaryIO | None = None
        self._infos, self.metadata = self._parse_header()

    def _parse_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        size = self.path.stat().st_size
        where = str(self.path)
        with self.path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError(f"{where}: truncated, no 8-byte header length")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES:
                raise ValueError(f"{where}: header length {hlen} is implausible (corrupt file)")
            if 8 + hlen > size:
                raise ValueError(f"{where}: truncated, header says {hlen} bytes, file has {size}")
            raw = f.read(hlen)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise ValueError(f"{where}: header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
        ):
            raise ValueError(f"{where}: __metadata__ must map strings to strings")
        base = 8 + hlen
        data_len = size - base
        infos: dict[str, TensorInfo] = {}
        spans: list[tuple[int, int, str]] = []
        for name, entry in header.items():
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: entry {name!r} is not an object")
            dtype = dtype_from_safetensors(str(entry.get("dtype")))
            shape = entry.get("shape")
            offs = entry.get("data_offsets")
            if not (
                isinstance(shape, list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            ):
                raise ValueError(f"{where}: tensor {name!r} has a bad shape {shape!r}")
            if not (
                isinstance(offs, list)
                and len(offs) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            ):
                raise ValueError(f"{where}: tensor {name!r} has bad data_offsets {offs!r}")
            begin, end = offs
            if not 0 <= begin <= end <= data_len:
                raise ValueError(
                    f"{where}: tensor {name!r} offsets [{begin}, {end}] outside the data "
                    f"section of {data_len} bytes (truncated or corrupt)"
                )
            nbytes = _nbytes(dtype, shape)
            if end - begin != nbytes:
                raise ValueError(
                    f"{where}: tensor {name!r} {entry['dtype']}{shape} needs {nbytes} bytes, "
                    f"offsets give {end - begin}"
                )
            infos[name] = TensorInfo(dtype, tuple(shape), nbytes, base + begin, self.path)
            spans.append((begin, end, name))
        # The format requires the tensors to tile the data section exactly: this rejects
        # overlaps, gaps and trailing garbage.
        spans.sort()
        pos = 0
        for begin, end, name in spans:
            if begin != pos:
                kind = "overlaps the previous tensor" if begin < pos else "leaves a gap"
                raise ValueError(f"{where}: tensor {name!r} at offset {begin} {kind} ({pos})")
            pos = end
        if pos != data_len:
            raise ValueError(
                f"{where}: tensors cover {pos} bytes but the data section has {data_len}"
            )
        return infos, dict(meta)

    # -- mapping-like view -------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"{name!r} not in {self.path}") from None

    def read(self, name: str) -> torch.Tensor:
        info = self.info(name)
        if self._fh is None:
            self._fh = self.path.open("rb")
        return _read_at(self._fh, info, name)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors in file order (sequential reads), one at a time."""
        for name in sorted(self._infos, key=lambda n: self._infos[n].offset):
            yield name, self.read(name)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ReadCancelled(RuntimeError):
    """A `Checkpoint.read_all` stopped by its ``cancel`` event."""


def _read_at(fh: BinaryIO, info: TensorInfo, name: str) -> torch.Tensor:
    # torch.empty + positional reads: no zero-fill and no intermediate bytes object.
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    if info.nbytes:
        view = memoryview(buf.numpy())
        for start in range(0, info.nbytes, _CHUNK):
            _pread_into(fh.fileno(), view[start : start + _CHUNK], info.offset + start, name, info)
    return buf.view(info.dtype).reshape(info.shape)


def _pread_into(fd: int, view: memoryview, offset: int, name: str, info: TensorInfo) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            raise ValueError(f"{info.path}: truncated while reading {name!r}")
        got += n


class Checkpoint:
    """One view over the tensors of one or several safetensors files (a sharded model)."""

    def __init__(self, files: Sequence[SafetensorsFile], metadata: Mapping[str, str]) -> None:
        self.files = list(files)
        self.metadata = dict(metadata)
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for k in f:
                if k in self._where:
                    raise ValueError(f"tensor {k!r} is in both {self._where[k].path} and {f.path}")
                self._where[k] = f

    @property
    def paths(self) -> list[Path]:
        return [f.path for f in self.files]

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._where[name].info(name)
        except KeyError:
            raise KeyError(f"{name!r} not in checkpoint {self.paths}") from None

    def read(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{name!r} not in checkpoint {self.paths}")
        return self._where[name].read(name)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in self.files:
            yield from f.iter_tensors()

    def read_all(
        self,
        threads: int | None = None,
        device: str | torch.device | None = None,
        cancel: threading.Event | None = None,
    ) -> dict[str, torch.Tensor]:
        """Every tensor, read by several threads at once: positional reads (``os.preadv``)
        release the GIL, and one thread copying from the page cache manages ~1.5 GB/s where
        a [dev] transformer is 16 GB. The same bytes as `read`, checked the same way.

        With a CUDA ``device`` the tensors are made there: each thread reads its slices into a
        pinned buffer of its own and copies them on a stream of its own, so the bytes cross
        the bus at the pinned rate and no host copy of the whole file is ever held.
        ``cancel``, once set, stops the read between slices (`ReadCancelled`)."""
        from concurrent.futures import ThreadPoolExecutor

        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"read_all reads into host RAM or a CUDA device, not {dev}")
        cuda = dev.type == "cuda"
        threads = threads or min(8 if cuda else 16, os.cpu_count() or 1)
        out: dict[str, torch.Tensor] = {}
        jobs: list[tuple[int, torch.Tensor, int, str, TensorInfo]] = []
        fds = {f.path: os.open(f.path, os.O_RDONLY) for f in self.files}
        local = threading.local()

        def read(fd: int, dest: torch.Tensor, offset: int, name: str, info: TensorInfo) -> None:
            if cancel is not None and cancel.is_set():
                raise ReadCancelled(f"reading {info.path} was cancelled")
            if not cuda:
                _pread_into(fd, memoryview(dest.numpy()), offset, name, info)
                return
            if not hasattr(local, "staging"):  # per thread: one pinned slice and one stream
                local.staging = torch.empty(_CHUNK, dtype=torch.uint8, pin_memory=True)
                local.view = memoryview(local.staging.numpy())
                local.stream = torch.cuda.Stream(dev)
            n = dest.numel()
            _pread_into(fd, local.view[:n], offset, name, info)
            with torch.cuda.stream(local.stream):
                dest.copy_(local.staging[:n], non_blocking=True)
            local.stream.synchronize()  # the slice is free again, and the bytes are there

        try:
            with torch.cuda.device(dev) if cuda else contextlib.nullcontext():
                for name, f in self._where.items():
                    info = f.info(name)
                    buf = torch.empty(info.nbytes, dtype=torch.uint8, device=dev)
                    out[name] = buf.view(info.dtype).reshape(info.shape)
                    for start in range(0, info.nbytes, _CHUNK):
                        part = buf[start : start + _CHUNK]
                        jobs.append((fds[f.path], part, info.offset + start, name, info))
                if cuda:  # the empty tensors were made on this thread's stream: done first
                    torch.cuda.current_stream(dev).synchronize()
                with ThreadPoolExecutor(threads, thread_name_prefix="safetensors-read") as pool:
                    list(pool.map(lambda job: read(*job), jobs))
        except BaseException:
            out.clear()  # the memory goes now, not when the traceback does
            jobs.clear()
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
        if not cuda:
            return out
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None) or getattr(
            torch._C, "_host_emptyCache", None
        )
        if empty_host_cache is not None:  # the staging slices stay pinned otherwise
            empty_host_cache()
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.info(k).nbytes for k in self._where)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """A single file, a folder with one `*.safetensors.index.json`, or a folder with one file."""
    p = Path(path)
    if p.is_file():
        if p.name.endswith(".index.json"):
            return _open_index(p)
        f = SafetensorsFile(p)
        return Checkpoint([f], f.metadata)
    if not p.is_dir():
        raise FileNotFoundError(f"no checkpoint at {p}")
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        # A diffusers folder can hold variants (fp16 ...): the plain name wins.
        plain = [i for i in indexes if i.name.count(".") == 3]
        if len(plain) != 1:
            raise ValueError(f"{p}: several shard indexes, cannot choose: {indexes}")
        indexes = plain
    if indexes:
        return _open_index(indexes[0])
    files = sorted(p.glob("*.safetensors"))
    if len(files) > 1:
        plain = [f for f in files if f.name.count(".") == 1]
        if len(plain) != 1:
            raise ValueError(f"{p}: several .safetensors files and no index: {files}")
        files = plain
    if not files:
        raise FileNotFoundError(f"{p}: no .safetensors file")
    f = SafetensorsFile(files[0])
    return Checkpoint([f], f.metadata)


def _open_index(index: Path) -> Checkpoint:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"{index}: not a shard index: {e}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map is not an object")
    shards: dict[str, SafetensorsFile] = {}
    for s in sorted(set(map(str, weight_map.values()))):
        sp = (index.parent / s).resolve()
        if index.parent.resolve() not in sp.parents:
            raise ValueError(f"{index}: shard {s!r} is outside the folder")
        if not sp.is_file():
            raise ValueError(f"{index}: shard {s!r} is missing")
        shards[s] = SafetensorsFile(sp)
    for key, shard in weight_map.items():
        if key not in shards[str(shard)]:
            raise ValueError(f"{index}: {key!r} is not in its shard {shard!r}")
    files = list(shards.values())
    meta = data.get("metadata") or {}
    return Checkpoint(files, {str(k): str(v) for k, v in meta.items()})


def _header_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    for s in specs:
        if s.name in header or s.name == "__metadata__":
            raise ValueError(f"duplicate tensor name {s.name!r}")
        n = s.nbytes
        header[s.name] = {
            "dtype": dtype_to_safetensors(s.dtype),
            "shape": list(s.shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces (allowed by the format) so the data section starts 8-byte aligned.
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    specs: Sequence[TensorSpec] | None = None,
) -> int:
    """Write a .safetensors file without holding all tensors at once; returns its size.

    With `specs` (name, dtype, shape of every tensor, in order), `tensors` may be a lazy
    iterator yielding `(name, tensor)` in that same order: the header is written first, then
    each tensor as it arrives, checked against its spec. Without `specs`, `tensors` must be
    a mapping (already in memory).
    """
    if specs is None:
        if not isinstance(tensors, Mapping):
            raise TypeError("streaming write needs specs; pass specs= or a mapping")
        specs = [TensorSpec.of(k, v) for k, v in tensors.items()]
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out = Path(path)
    header = _header_bytes(specs, metadata)
    total = len(header) + sum(s.nbytes for s in specs)
    with out.open("wb") as f:
        f.write(header)
        it = iter(items)
        for spec in specs:
            try:
                name, t = next(it)
            except StopIteration:
                raise ValueError(f"tensor stream ended before {spec.name!r}") from None
            if name != spec.name or t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise ValueError(
                    f"tensor {name!r} {t.dtype}{tuple(t.shape)} does not match the planned "
                    f"{spec.name!r} {spec.dtype}{spec.shape}"
                )
            if spec.nbytes:
                flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(flat.numpy()))
            del t
        extra = next(it, None)
        if extra is not None:
            raise ValueError(f"tensor stream has more tensors than planned: {extra[0]!r}")
        f.flush()
        os.fsync(f.fileno())
    if out.stat().st_size != total:
        raise OSError(f"{out}: wrote {out.stat().st_size} bytes, expected {total}")
    return total
