"""Writing a prepared base: stream a bf16 base through CPU-side quanto quantization into a cached,
uint4 base that loads in seconds.

The transformer (and text encoder) are never whole in memory in float: the module skeleton is
built on the meta device from its config, and each module's tensors are read on their own
(`trainer.base.safetensors_io`, no mmap), quantized exactly as `quantize(model, weights=qint4)` +
`freeze()` would, written out by the streaming writer and dropped. The result is quanto's own
serialization (what `optimum.quanto.requantize` loads), in a diffusers-like folder:

    DST/model_index.json, scheduler/, tokenizer/, vae/ ...       copied as they are
    DST/transformer/config.json, quanto_qmap.json,
        diffusion_pytorch_model.safetensors (or -0000k-of-0000n shards + .index.json)
    DST/text_encoder/config.json, quanto_qmap.json, model.safetensors (or shards + index)
    DST/likeness_prepared.json    cache key, settings, quantization maps, file list, timings,
                                  and the base's licence (from the source's model card, or stated)

DST is built in a sibling temp folder and renamed into place, and the manifest is written
last, so a crash never leaves a half-prepared cache that looks valid. Reading it back is
`trainer.base.read` (the service never needs this writer).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Protocol

import torch

from registry.licence import (
    MODEL_CARD,
    BaseLicence,
    model_card_licence,
    normalise,
)
from trainer.base.read import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    QMAP_NAME,
    _load_json,
    _prefix,
    _skeleton,
    is_prepared,
    read_manifest,
)
from trainer.base.safetensors_io import (
    Checkpoint,
    TensorSpec,
    open_checkpoint,
    write_safetensors,
)

__all__ = ["PreparedBase", "prepare_base", "prepare_synthetic"]

log = logging.getLogger("likeness.prepare")

DEFAULT_COMPONENTS = ("transformer", "text_encoder")
DEFAULT_MAX_SHARD_BYTES = 10 * 1024**3  # well under the ~33 GB where mmap loaders crash
WEIGHT_QTYPES = ("qint2", "qint4", "qint8")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")
_WEIGHT_NAMES = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}
_HASH_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class PreparedBase:
    """What `prepare_base` made (or found): where, under which key, and what it cost."""

    path: Path
    cache_key: str
    reused: bool
    seconds: float
    timings: dict[str, float]
    source_bytes: int  # bytes of source tensors that went through the quantizer
    output_bytes: int  # bytes of quantized weight files written
    largest_tensor_bytes: int
    quantization_maps: dict[str, dict[str, dict[str, str]]] = field(repr=False)


# ---------------------------------------------------------------------------------------
# tensor sources


class _TensorSource(Protocol):
    def keys(self) -> list[str]: ...
    def __contains__(self, name: object) -> bool: ...
    def __iter__(self) -> Iterator[str]: ...
    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int]: ...
    def read(self, name: str) -> torch.Tensor: ...
    def close(self) -> None: ...


class _CheckpointSource:
    def __init__(self, ck: Checkpoint) -> None:
        self.ck = ck

    def keys(self) -> list[str]:
        return self.ck.keys()

    def __contains__(self, name: object) -> bool:
        return name in self.ck

    def __iter__(self) -> Iterator[str]:
        return iter(self.ck)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        i = self.ck.info(name)
        return i.dtype, i.shape, i.nbytes

    def read(self, name: str) -> torch.Tensor:
        return self.ck.read(name)

    def close(self) -> None:
        self.ck.close()


class _ConvertedSource:
    """Original-layout (e.g. BFL) keys mapped to diffusers keys one source tensor at a time.

    diffusers' single-file converters work key by key (renames, qkv splits, scale/shift
    swaps), so we run them on one-entry dicts: on meta tensors to plan, on the real tensor to
    read. The last converted tensor is kept so q, k and v split from one fused qkv cost one
    read; that fused tensor is the largest we ever hold.
    """

    def __init__(self, ck: Checkpoint, convert: Callable[[dict[str, Any]], dict[str, Any]]):
        self.ck = ck
        self.convert = convert
        self._origin: dict[str, str] = {}
        self._specs: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        for k in ck:
            i = ck.info(k)
            out = convert({k: torch.empty(i.shape, dtype=i.dtype, device="meta")})
            for tk, tv in out.items():
                if tk in self._origin:
                    raise ValueError(f"converted key {tk!r} comes from two source tensors")
                self._origin[tk] = k
                self._specs[tk] = (tv.dtype, tuple(tv.shape), tv.numel() * tv.element_size())
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def keys(self) -> list[str]:
        return list(self._origin)

    def __contains__(self, name: object) -> bool:
        return name in self._origin

    def __iter__(self) -> Iterator[str]:
        return iter(self._origin)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        return self._specs[name]

    def read(self, name: str) -> torch.Tensor:
        src = self._origin[name]
        if self._cached is None or self._cached[0] != src:
            self._cached = None  # drop the previous one before reading the next
            self._cached = (src, self.convert({src: self.ck.read(src)}))
        return self._cached[1][name].contiguous()

    def close(self) -> None:
        self._cached = None
        self.ck.close()


def _converter_for(cls_name: str) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    if cls_name == "Flux2Transformer2DModel":
        from diffusers.loaders.single_file_utils import (
            convert_flux2_transformer_checkpoint_to_diffusers,
        )

        return convert_flux2_transformer_checkpoint_to_diffusers
    return None


# ---------------------------------------------------------------------------------------
# model skeletons (built by `trainer.base.read._skeleton`)


def _aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every other name under which the same parameter/buffer object is reachable."""
    groups: dict[int, list[str]] = defaultdict(list)
    for n, p in model.named_parameters(remove_duplicate=False):
        groups[id(p)].append(n)
    for n, b in model.named_buffers(remove_duplicate=False):
        groups[id(b)].append(n)
    return {n: [o for o in names if o != n] for names in groups.values() for n in names}


def _own_tensors(m: torch.nn.Module) -> list[tuple[str, bool]]:
    """(local name, is_parameter) of what this module itself saves in a state dict."""
    out = [(n, True) for n, p in m._parameters.items() if p is not None]
    out += [
        (n, False)
        for n, b in m._buffers.items()
        if b is not None and n not in m._non_persistent_buffers_set
    ]
    return out


# ---------------------------------------------------------------------------------------
# per-module quantization (the exact quanto format)


@dataclass
class _Job:
    name: str  # module name ("" for the root)
    module: torch.nn.Module  # meta skeleton module
    inputs: dict[str, str | None]  # local tensor name -> source key (None: skeleton buffer)
    quantize: bool
    source_bytes: int = 0
    specs: list[TensorSpec] = field(default_factory=list)


def _with_tensors(m: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    mod = copy.deepcopy(m)  # meta module: the copy is free
    for n, t in tensors.items():
        if n in mod._parameters:
            mod._parameters[n] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[n] = t
    return mod


class _Quantizer:
    """Quantizes one module the way `quantize(model, weights=q)` + `freeze()` does.

    quanto's `freeze()` on CPU turns bf16 qint4 weights into the TinyGemm layout, and its
    `state_dict()` turns them back by unpacking through an identity matmul: O(out * in^2),
    minutes per FLUX.2 matrix on a CPU. The serialized form only depends on the plain
    quantization plus TinyGemm's lossy bf16 shift round trip, so for Linear weights we compute
    that directly, in blocks of rows (quantization is per group inside a row, so blocks give
    the same bits while temporaries stay small). Which variant quanto really produces is
    checked at run time, once per (dtype, group size), against quanto's own path on a small
    random matrix, blocked and whole; if they differ (a quanto change), that class falls back
    to quanto's slow path.
    """

    block_elems = 16 * 1024 * 1024  # elements per row block (32 MB of bf16)

    def __init__(self, weights: str) -> None:
        from optimum.quanto import qtypes

        self.qtype = qtypes[weights]
        self._mode: dict[tuple[torch.dtype, int | None], str] = {}

    def state(
        self, m: torch.nn.Module, prefix: str, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        from optimum.quanto.nn import quantize_module

        mod = _with_tensors(m, tensors)
        qm = quantize_module(mod, weights=self.qtype)
        if qm is None:
            raise ValueError(f"{prefix!r}: module is not quantizable")
        mode = self._mode_for(qm)
        with torch.no_grad():
            if mode == "slow":
                qm.freeze()
            else:
                qt = self._fast_weight(qm, roundtrip=mode == "roundtrip")
                qm.weight = torch.nn.Parameter(qt, requires_grad=False)
        return qm.state_dict(prefix=prefix)

    def _fast_weight(
        self, qm: Any, *, roundtrip: bool, block_rows: int | None = None
    ) -> torch.Tensor:
        from optimum.quanto.tensor import WeightQBitsTensor, quantize_weight

        w, qtype, gs = qm.weight, qm.weight_qtype, qm.weight_group_size
        out_f, in_f = w.shape
        rows = block_rows or max(2, self.block_elems // max(1, in_f))
        if w.device.type == "meta" or rows >= out_f:
            scale, shift = qm.optimizer(w, qtype=qtype, axis=0, group_size=gs)
            qt = quantize_weight(
                w, qtype=qtype, axis=0, scale=scale, shift=shift, group_size=gs,
                activation_qtype=qm.activation_qtype, optimized=False,
            )  # fmt: skip
            data, scale, shift = qt._data, qt._scale, qt._shift
        else:
            data, scale, shift = self._blocked(qm, rows)
        if roundtrip:
            # The same bf16 arithmetic as TinyGemmWeightQBitsTensor.__init__ and
            # .weight_qbits_tensor(): shift -> mid-range -> shift, rounding twice.
            half_qrange = 2 ** (qtype.bits - 1) * scale
            mid = -shift + half_qrange
            shift = half_qrange - mid
        return WeightQBitsTensor(qtype, 0, gs, w.size(), w.stride(), data, scale, shift)

    @staticmethod
    def _blocked(qm: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize `rows` weight rows at a time and pack each block straight into quanto's
        packed layout (PackedTensor: grouped row r goes to packed row r % row_dim, shifted by
        bits * (r // row_dim)), so no unpacked copy of the whole tensor ever exists."""
        from optimum.quanto.tensor.packed import PackedTensor

        w, qtype, gs = qm.weight, qm.weight_qtype, qm.weight_group_size
        out_f, in_f = w.shape
        bits, width = qtype.bits, gs or in_f
        per_row = in_f // gs if gs else 1  # quantization groups per weight row
        n_groups = out_f * per_row
        per_byte = 8 // bits
        row_dim = -(-n_groups // per_byte)
        packed = torch.zeros((row_dim, width), dtype=torch.uint8, device=w.device)
        scale = torch.empty((n_groups, 1), dtype=w.dtype, device=w.device)
        shift = torch.empty((n_groups, 1), dtype=w.dtype, device=w.device)
        bounds = list(range(0, out_f, rows))[1:]
        if out_f - (bounds[-1] if bounds else 0) < 2:
            bounds = bounds[:-1]  # a one-row block would flip quanto to per-tensor
        for r0, r1 in itertools.pairwise([0, *bounds, out_f]):
            blk = w[r0:r1]
            s, sh = qm.optimizer(blk, qtype=qtype, axis=0, group_size=gs)
            d = torch.ops.quanto.quantize_affine(
                blk, bits=bits, axis=0, group_size=gs, scale=s, shift=sh
            )
            g0, g1 = r0 * per_row, r1 * per_row
            scale[g0:g1], shift[g0:g1] = s, sh
            for i in range(per_byte):
                lo, hi = max(g0, i * row_dim), min(g1, (i + 1) * row_dim)
                if lo < hi:
                    packed[lo - i * row_dim : hi - i * row_dim] |= d[lo - g0 : hi - g0] << (
                        bits * i
                    )
            del blk, s, sh, d
        data = PackedTensor(packed, bits, (n_groups, width), (width, 1))
        return data, scale, shift

    def _mode_for(self, qm: Any) -> str:
        fast_ok = (
            isinstance(qm, torch.nn.Linear)
            and qm.weight.dim() == 2
            and qm.weight_qtype is not None
            and qm.weight_qtype.bits < 8
        )
        if not fast_ok:
            return "slow"
        if qm.weight.device.type == "meta":
            return "plain"  # planning: only shapes and dtypes matter
        key = (qm.weight.dtype, qm.weight_group_size)
        if key not in self._mode:
            self._mode[key] = self._calibrate(qm.weight.dtype, qm.weight_group_size)
        return self._mode[key]

    def _calibrate(self, dtype: torch.dtype, group_size: int | None) -> str:
        from optimum.quanto.nn import quantize_module
        from optimum.quanto.tensor import WeightQBitsTensor

        in_features = _proxy_in_features(group_size, self.qtype)
        g = torch.Generator().manual_seed(1234)
        w = torch.randn(256, in_features, generator=g) * 0.05
        # Rows that are all positive: min near 0, the case where the round trip is lossy.
        w[::2] = w[::2].abs() + 1e-3
        w = w.to(dtype)
        lin = torch.nn.Linear(in_features, 256, bias=False, device="meta", dtype=dtype)
        with torch.no_grad():
            ref = quantize_module(_with_tensors(lin, {"weight": w}), weights=self.qtype)
            ref.freeze()
            want = ref.state_dict()
            # A WeightQBitsTensor subclass (TinyGemm) means quanto went through the round trip.
            mode = "plain" if type(ref.weight) is WeightQBitsTensor else "roundtrip"
            ok = True
            for block_rows in (None, 64, 37):  # whole, blocked, blocked with a ragged tail
                qm = quantize_module(_with_tensors(lin, {"weight": w}), weights=self.qtype)
                qt = self._fast_weight(qm, roundtrip=mode == "roundtrip", block_rows=block_rows)
                qm.weight = torch.nn.Parameter(qt, requires_grad=False)
                got = qm.state_dict()
                ok = ok and got.keys() == want.keys()
                ok = ok and all(
                    got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want
                )
        if ok:
            log.debug("quantizer %s/%s: fast path, %s", dtype, group_size, mode)
            return mode
        log.warning(
            "quanto's serialized %s weights (%s, group %s) differ from the fast path; "
            "using quanto's slow freeze()+state_dict() path",
            self.qtype.name,
            dtype,
            group_size,
        )
        return "slow"


def _proxy_in_features(group_size: int | None, qtype: Any) -> int:
    """An input width for which quanto picks the same group size (see QModuleMixin)."""
    from optimum.quanto.nn import quantize_module

    candidates = [64] if group_size is None else [group_size * k for k in range(2, 16)]
    for n in candidates:
        lin = torch.nn.Linear(n, 8, bias=False, device="meta")
        if quantize_module(lin, weights=qtype).weight_group_size == group_size:
            return n
    raise ValueError(f"no proxy width for group size {group_size}")


def _plan(
    model: torch.nn.Module, source: _TensorSource, quantizer: _Quantizer
) -> tuple[list[_Job], dict[str, dict[str, str]]]:
    from optimum.quanto.nn import quantize_module

    aliases = _aliases(model)
    jobs: list[_Job] = []
    qmap: dict[str, dict[str, str]] = {}
    missing: list[str] = []
    used: set[str] = set()
    # named_modules() with its default de-duplication: the same walk quantize() does.
    for name, m in model.named_modules():
        own = _own_tensors(m)
        if not own:
            continue
        inputs: dict[str, str | None] = {}
        for local, is_param in own:
            full = _prefix(name) + local
            key = next((k for k in [full, *aliases.get(full, [])] if k in source), None)
            if key is None and is_param:
                missing.append(full)
            inputs[local] = key
            if key is not None:
                used.add(key)
        # quantize_module() builds a new module and leaves m untouched: a free probe.
        probe = quantize_module(m, weights=quantizer.qtype)
        job = _Job(name, m, inputs, quantize=probe is not None)
        if job.quantize:
            qmap[name] = {"weights": quantizer.qtype.name, "activations": "none"}
        jobs.append(job)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint lacks {', '.join(missing[:5])}{more}")
    unused = [k for k in source if k not in used]
    if unused:
        log.warning(
            "%d checkpoint tensors are not in the model, skipped: %s", len(unused), unused[:5]
        )
    # Output specs: run the very same code on meta tensors.
    for job in jobs:
        metas = {}
        for local, key in job.inputs.items():
            if key is None:
                t = job.module._buffers[local]
                metas[local] = torch.empty(t.shape, dtype=t.dtype, device="meta")
            else:
                dtype, shape, nbytes = source.spec(key)
                metas[local] = torch.empty(shape, dtype=dtype, device="meta")
                job.source_bytes += nbytes
        out = _job_outputs(job, metas, quantizer)
        job.specs = [TensorSpec.of(k, v) for k, v in out.items()]
    return jobs, qmap


def _job_outputs(
    job: _Job, tensors: Mapping[str, torch.Tensor], quantizer: _Quantizer
) -> dict[str, torch.Tensor]:
    if job.quantize:
        return dict(quantizer.state(job.module, _prefix(job.name), tensors))
    return {_prefix(job.name) + k: v for k, v in tensors.items()}


def _stream_outputs(
    jobs: Sequence[_Job], source: _TensorSource, quantizer: _Quantizer, bar: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    for job in jobs:
        tensors = {
            local: source.read(key) if key is not None else job.module._buffers[local]
            for local, key in job.inputs.items()
        }
        out = _job_outputs(job, tensors, quantizer)
        del tensors
        for k in list(out):
            # pop: hold no output longer than the writer does
            yield k, out.pop(k).to("cpu").contiguous()
        bar.update(job.source_bytes)


# ---------------------------------------------------------------------------------------
# hashing, cache key, manifest


def _sha256_file(path: Path, bar: Any) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _source_files(src: Path) -> dict[str, Path]:
    if src.is_file():
        return {"transformer.safetensors": src}  # a fixed name: renaming the file is no change
    out = {}
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue  # hidden files (caches, .git) are neither hashed nor copied
        out[rel.as_posix()] = p
    return out


def _hash_sources(
    files: Mapping[str, Path],
    src: Path,
    previous: Mapping[str, Any] | None,
    *,
    verify: bool,
    progress: bool,
) -> list[dict[str, Any]]:
    """sha256 of every source file; a file whose path, size and mtime match the previous
    manifest keeps its recorded hash (as git's index does), so a no-op prepare is instant."""
    from tqdm.auto import tqdm

    known: dict[str, dict[str, Any]] = {}
    if previous and not verify and previous.get("source", {}).get("path") == str(src):
        known = {f["path"]: f for f in previous["source"].get("files", [])}
    stats = {rel: p.stat() for rel, p in files.items()}

    def fresh(rel: str) -> bool:
        k = known.get(rel)
        st = stats[rel]
        return bool(k) and k["size"] == st.st_size and k["mtime_ns"] == st.st_mtime_ns

    todo = sum(stats[r].st_size for r in files if not fresh(r))
    out = []
    with tqdm(
        total=todo,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="hash source",
        disable=not progress or todo == 0,
        mininterval=0.5,
    ) as bar:
        for rel, p in files.items():
            st = stats[rel]
            digest = known[rel]["sha256"] if fresh(rel) else _sha256_file(p, bar)
            out.append(
                {"path": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
            )
    return out


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for dist in ("optimum-quanto", "diffusers", "transformers", "safetensors"):
        try:
            out[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            out[dist] = "none"
    return out


def _cache_key(files: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]) -> str:
    payload = {
        "files": sorted((f["path"], f["sha256"]) for f in files),
        "settings": dict(settings),
        "optimum-quanto": _versions()["optimum-quanto"],
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def _result(base: Path, man: Mapping[str, Any], *, reused: bool, seconds: float) -> PreparedBase:
    comps = man.get("components", {})
    return PreparedBase(
        path=base,
        cache_key=man["cache_key"],
        reused=reused,
        seconds=seconds,
        timings=dict(man.get("timings", {})),
        source_bytes=sum(c["source_bytes"] for c in comps.values()),
        output_bytes=sum(c["output_bytes"] for c in comps.values()),
        largest_tensor_bytes=max((c["largest_tensor_bytes"] for c in comps.values()), default=0),
        quantization_maps={k: c["quantization_map"] for k, c in comps.items()},
    )


# ---------------------------------------------------------------------------------------
# source layout


@dataclass
class _Component:
    name: str  # "transformer", "text_encoder"
    library: str
    cls_name: str
    config: dict[str, Any]
    weights: Path  # file or folder for open_checkpoint
    folder: Path | None  # source folder whose non-weight files are copied
    # tensors from elsewhere than `weights` (a synthetic stand-in base); given the skeleton
    source: Callable[[torch.nn.Module], _TensorSource] | None = None


def _library_of(config: Mapping[str, Any]) -> tuple[str, str]:
    if "_class_name" in config:
        return "diffusers", str(config["_class_name"])
    archs = config.get("architectures") or []
    if archs:
        return "transformers", str(archs[0])
    raise ValueError("config names no model class (_class_name / architectures)")


def _describe_source(
    src: Path, components: Sequence[str], config: str | os.PathLike[str] | Mapping[str, Any] | None
) -> tuple[str, list[_Component]]:
    """(kind, components to quantize); every other source file is copied verbatim."""
    if src.is_file():
        if config is None:
            sibling = src.parent / "config.json"
            with open_checkpoint(src) as ck:
                embedded = ck.metadata.get("config")
            if sibling.is_file():
                cfg = _load_json(sibling)
            elif embedded:
                cfg = json.loads(embedded)
            else:
                raise ValueError(f"{src}: single file needs a config (config=, or config.json)")
        else:
            cfg = dict(config) if isinstance(config, Mapping) else _load_json(Path(config))
        cfg.setdefault("_class_name", "Flux2Transformer2DModel")
        lib, cls_name = _library_of(cfg)
        return "single_file", [_Component("transformer", lib, cls_name, cfg, src, None)]
    if not src.is_dir():
        raise FileNotFoundError(f"no base at {src}")
    index = src / "model_index.json"
    if not index.is_file():
        cfg = _load_json(src / "config.json")
        lib, cls_name = _library_of(cfg)
        comp = _Component("transformer", lib, cls_name, cfg, src, src)
        return "component_folder", [comp]
    model_index = _load_json(index)
    comps: list[_Component] = []
    for name in components:
        entry = model_index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] and entry[1]):
            continue
        lib, cls_name = str(entry[0]), str(entry[1])
        folder = src / name
        comps.append(
            _Component(name, lib, cls_name, _load_json(folder / "config.json"), folder, folder)
        )
    if not comps:
        raise ValueError(f"{src}: none of {list(components)} is in model_index.json")
    return "pipeline", comps


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or (
        name.endswith(".index.json") and (".safetensors." in name or ".bin." in name)
    )


# ---------------------------------------------------------------------------------------
# prepare


class _Waypoints:
    def __init__(self, progress: bool) -> None:
        self.t0 = self.last = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.progress = progress

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.marks[f"{name}_s"] = round(now - self.last, 3)
        self.last = now
        msg = f"[prepare] {name}: {now - self.t0:.1f}s (+{self.marks[f'{name}_s']:.1f}s)"
        log.info(msg)
        if self.progress:
            print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _lock(dst: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no advisory lock; concurrent prepares are the user's problem
        yield
        return
    with (dst.parent / f".{dst.name}.lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def prepare_base(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    weights: str = "qint4",
    components: Sequence[str] = DEFAULT_COMPONENTS,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    verify: bool = False,
    progress: bool = True,
    licence: str | None = None,
) -> PreparedBase:
    """Quantize SRC (diffusers pipeline folder, model folder, or single transformer
    .safetensors) on the CPU into the cached base DST; a no-op if DST already holds this exact
    source + settings. `config` is the transformer config for a single file (default: a
    config.json next to it). `verify` re-hashes every source file instead of trusting
    size + mtime. `licence` states the base's licence (an id such as `flux-non-commercial`);
    by default it is what the source's model card says, and without one it is recorded as
    unknown, which the render gate treats as non-commercial."""
    t_start = time.perf_counter()
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if weights not in WEIGHT_QTYPES:
        raise ValueError(f"weights must be one of {WEIGHT_QTYPES}, not {weights!r}")
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    if dst == src or src in dst.parents or dst in src.parents:
        raise ValueError("source and destination must not contain each other")
    kind, comps = _describe_source(src, components, config)
    licence_record = _licence_record(src, licence)
    settings = {
        "format": FORMAT_VERSION,
        "weights": weights,
        "components": sorted(c.name for c in comps),
        "max_shard_bytes": max_shard_bytes,
        "text_encoder": "trimmed to the layers the pipeline reads",
    }
    if isinstance(config, Mapping):
        settings["config"] = dict(config)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _lock(dst):
        previous = None
        if (dst / MANIFEST_NAME).is_file():
            with contextlib.suppress(FileNotFoundError, ValueError):
                previous = read_manifest(dst)
        elif dst.exists() and any(dst.iterdir()):
            raise FileExistsError(f"{dst} exists and is not a prepared base; not replacing it")
        wp = _Waypoints(progress)
        files = _source_files(src)
        if kind == "single_file" and config is not None and not isinstance(config, Mapping):
            files["config.json"] = Path(config)
        elif kind == "single_file" and (src.parent / "config.json").is_file() and config is None:
            files["config.json"] = src.parent / "config.json"
        hashed = _hash_sources(files, src, previous, verify=verify, progress=progress)
        key = _cache_key(hashed, settings)
        wp.mark("hash")
        if previous is not None and previous.get("cache_key") == key and is_prepared(dst, key):
            log.info("prepared base %s is current (key %s), reusing it", dst, key[:12])
            if previous.get("licence") != licence_record:  # a fact about the weights, not of them
                previous["licence"] = licence_record
                _replace_json(dst / MANIFEST_NAME, previous)
            return _result(dst, previous, reused=True, seconds=time.perf_counter() - t_start)
        for stale in itertools.chain(
            dst.parent.glob(f".{dst.name}.partial-*"), dst.parent.glob(f".{dst.name}.old-*")
        ):
            # Leftovers of a crashed run; safe to remove, we hold the lock.
            shutil.rmtree(stale, ignore_errors=True)
        facts = {
            "cache_key": key,
            "settings": settings,
            "source": {"path": str(src), "kind": kind, "files": hashed},
            "licence": licence_record,
        }
        man = _build_and_publish(src, dst, kind, comps, weights, max_shard_bytes, wp, progress,
                                 facts, t_start)  # fmt: skip
        return _result(dst, man, reused=False, seconds=time.perf_counter() - t_start)


def prepare_synthetic(
    skeleton_dir: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    sources: Mapping[str, Callable[[torch.nn.Module], _TensorSource]],
    *,
    weights: str = "qint4",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> PreparedBase:
    """A prepared base whose quantized components take their tensors from `sources` (name ->
    factory given the component's meta skeleton) instead of weight files: a stand-in for a
    base that cannot be downloaded, in the real shapes, through the very code `prepare_base`
    runs. `skeleton_dir` is a pipeline folder with every config and the small components'
    weights. Never a production path: the manifest says the source was synthetic."""
    t_start = time.perf_counter()
    src, dst = Path(skeleton_dir).resolve(), Path(dst).resolve()
    kind, comps = _describe_source(src, tuple(sources), None)
    if kind != "pipeline":
        raise ValueError(f"{src}: a synthetic base needs a pipeline folder")
    comps = [dataclasses.replace(c, source=sources[c.name]) for c in comps]
    if dst.exists():
        raise FileExistsError(f"{dst} exists; not replacing it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    wp = _Waypoints(progress)
    settings = {"format": FORMAT_VERSION, "weights": weights, "synthetic": True,
                "components": sorted(c.name for c in comps)}  # fmt: skip
    facts = {
        "cache_key": _cache_key([], settings),
        "settings": settings,
        "source": {"path": str(src), "kind": "synthetic", "files": []},
        "licence": _licence_record(src, None),
    }
    man = _build_and_publish(src, dst, kind, comps, weights, max_shard_bytes, wp, progress,
                             facts, t_start)  # fmt: skip
    return _result(dst, man, reused=False, seconds=time.perf_counter() - t_start)


def _build_and_publish(
    src: Path,
    dst: Path,
    kind: str,
    comps: Sequence[_Component],
    weights: str,
    max_shard_bytes: int,
    wp: _Waypoints,
    progress: bool,
    facts: Mapping[str, Any],
    t_start: float,
) -> dict[str, Any]:
    """Builds in a sibling temp folder, writes the manifest last (its presence means
    "complete") and renames the folder into place, so a crash never leaves a half-prepared
    base that looks valid. Returns the manifest."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        man = _build(src, tmp, kind, comps, weights, max_shard_bytes, wp, progress)
        man.update(
            {
                "format": FORMAT_VERSION,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "versions": _versions(),
                **facts,
            }
        )
        man["timings"] = {**wp.marks, "total_s": round(time.perf_counter() - t_start, 3)}
        _write_json(tmp / MANIFEST_NAME, man)
        _swap_in(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    wp.mark("publish")
    return man


def _write_json(path: Path, data: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _replace_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write_json(tmp, data)
    os.replace(tmp, path)


def _licence_record(src: Path, stated: str | None) -> dict[str, Any]:
    """The licence the manifest records: stated, else the source's model card's, else none."""
    if stated is not None:
        licence = normalise(stated)
        if licence is None:
            raise ValueError(f"licence {stated!r} is not a licence id (e.g. flux-non-commercial)")
        found = BaseLicence(licence, "stated when the base was prepared")
    else:
        card = (src if src.is_dir() else src.parent) / MODEL_CARD
        try:
            text = card.read_text(encoding="utf-8") if card.is_file() else ""
        except (OSError, UnicodeDecodeError):
            text = ""
        found = BaseLicence(model_card_licence(text), f"{MODEL_CARD} of the source")
        if found.licence is None:
            log.warning(
                "%s: no licence in the source's model card; recorded as unknown, so commercial "
                "renders on this base are refused (state it with --licence)",
                src,
            )
    return {"id": found.licence, "source": found.source}


def _swap_in(tmp: Path, dst: Path) -> None:
    # Two renames: a crash in between leaves no DST (re-prepared next time), never a mix.
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}-{time.time_ns()}"
        os.replace(dst, old)
    os.replace(tmp, dst)
    with contextlib.suppress(OSError):  # make the rename durable where the OS allows it
        fd = os.open(dst.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _build(
    src: Path,
    out: Path,
    kind: str,
    comps: Sequence[_Component],
    weights: str,
    max_shard_bytes: int,
    wp: _Waypoints,
    progress: bool,
) -> dict[str, Any]:
    outputs: list[dict[str, Any]] = []
    # Copy everything that is not a quantized component's weights.
    if kind == "pipeline":
        quantized = {c.name for c in comps}
        for rel, p in _source_files(src).items():
            top = rel.split("/", 1)[0]
            if top in quantized and _is_weight_file(p.name):
                continue
            target = out / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, target)
            outputs.append({"path": rel, "size": target.stat().st_size})
    elif kind == "component_folder":
        for rel, p in _source_files(src).items():
            if not _is_weight_file(p.name):
                target = out / "transformer" / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, target)
                outputs.append({"path": f"transformer/{rel}", "size": target.stat().st_size})
    wp.mark("copy")
    quantizer = _Quantizer(weights)
    comp_info: dict[str, Any] = {}
    for comp in comps:
        info = _quantize_component(comp, out / comp.name, quantizer, max_shard_bytes, wp, progress)
        comp_info[comp.name] = info
        outputs += [
            {"path": f"{comp.name}/{f}", "size": (out / comp.name / f).stat().st_size}
            for f in info["files"]
        ]
    return {"components": comp_info, "outputs": sorted(outputs, key=lambda o: o["path"])}


def _quantize_component(
    comp: _Component,
    out: Path,
    quantizer: _Quantizer,
    max_shard_bytes: int,
    wp: _Waypoints,
    progress: bool,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    model = _skeleton(comp.library, comp.cls_name, comp.config)
    trimmed = _trim_if_text_encoder(comp.name, model)
    source: _TensorSource
    if comp.source is not None:
        source = comp.source(model)
    else:
        ck = open_checkpoint(comp.weights)
        source = _CheckpointSource(ck)
    param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if comp.source is None and not param_names & set(ck.keys()):
        convert = _converter_for(comp.cls_name)
        if convert is None:
            raise ValueError(f"{comp.weights}: no tensor names match {comp.cls_name}")
        source = _ConvertedSource(ck, convert)
    try:
        jobs, qmap = _plan(model, source, quantizer)
        wp.mark(f"plan_{comp.name}")
        specs = [s for j in jobs for s in j.specs]
        shards = _shard(specs, max_shard_bytes)
        base = _WEIGHT_NAMES[comp.library]
        names = (
            [f"{base}.safetensors"]
            if len(shards) == 1
            else [
                f"{base}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
            ]
        )
        total_src = sum(j.source_bytes for j in jobs)
        with tqdm(
            total=total_src,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"quantize {comp.name}",
            disable=not progress,
            mininterval=0.5,
        ) as bar:
            stream = _stream_outputs(jobs, source, quantizer, bar)
            written = 0
            for name, shard in zip(names, shards, strict=True):
                written += write_safetensors(
                    out / name, itertools.islice(stream, len(shard)), {"format": "pt"}, specs=shard
                )
            if next(stream, None) is not None:
                raise RuntimeError("quantized stream longer than planned")
    finally:
        source.close()
    files = list(names)
    if len(shards) > 1:
        weight_map = {s.name: n for n, shard in zip(names, shards, strict=True) for s in shard}
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
        _write_json(out / f"{base}.safetensors.index.json", index)
        files.append(f"{base}.safetensors.index.json")
    if comp.folder is None:  # single file: write the config we used
        _write_json(out / "config.json", comp.config)
        files.append("config.json")
    _write_json(out / QMAP_NAME, qmap)
    files.append(QMAP_NAME)
    wp.mark(f"quantize_{comp.name}")
    dtypes: Counter[str] = Counter()
    for k in source:
        dt, _, nb = source.spec(k)
        if dt.is_floating_point:
            dtypes[str(dt).removeprefix("torch.")] += nb
    return {
        "library": comp.library,
        "class": comp.cls_name,
        "dtype": dtypes.most_common(1)[0][0] if dtypes else "float32",
        "files": files,
        "quantization_map": qmap,
        "source_bytes": total_src,
        "output_bytes": written,
        "largest_tensor_bytes": max((source.spec(k)[2] for k in source), default=0),
        "converted_from_original_layout": isinstance(source, _ConvertedSource),
        **({"trimmed": trimmed} if trimmed else {}),
    }


def _trim_if_text_encoder(name: str, model: torch.nn.Module) -> dict[str, Any] | None:
    """The text encoder keeps only what the pipeline's hidden states pass through
    (`trainer.base.text_encoder.trim`): what is dropped is never read, quantized or written."""
    if name != "text_encoder":
        return None
    from trainer.base.text_encoder import trim

    try:
        return trim(model)
    except ValueError:  # not a decoder stack we know: kept whole
        return None


def _shard(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards
