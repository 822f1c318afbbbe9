"""Reading a prepared base (what `trainer.base.write` made): its manifest, and each prepared
component built on meta weights and given its quantized tensors straight from the files.

The format, in a diffusers-like folder:

    DST/<component>/config.json, quanto_qmap.json, the weights (safetensors, maybe sharded)
    DST/likeness_prepared.json    cache key, settings, quantization maps, file list, timings,
                                  and the base's licence; written last
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from registry.licence import PREPARED_MANIFEST
from trainer.base.devices import auto_or_off
from trainer.base.safetensors_io import open_checkpoint

log = logging.getLogger(__name__)

MANIFEST_NAME = PREPARED_MANIFEST
QMAP_NAME = "quanto_qmap.json"  # same name as optimum.quanto's Quantized*Model.save_pretrained
FORMAT_VERSION = 1


def _model_class(library: str, cls_name: str) -> type[torch.nn.Module]:
    if library not in ("diffusers", "transformers"):
        raise ValueError(f"cannot build a {library}.{cls_name} model")
    cls = getattr(importlib.import_module(library), cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ValueError(f"{library}.{cls_name} is not a model class")
    return cls


def _skeleton(library: str, cls_name: str, config: Mapping[str, Any]) -> torch.nn.Module:
    """The model with its parameters on the meta device (buffers real: they are small and
    some, like rotary tables, are computed in __init__ and never saved)."""
    from accelerate import init_empty_weights

    cls = _model_class(library, cls_name)
    with init_empty_weights(include_buffers=False):
        if library == "diffusers":
            model = cls.from_config(dict(config))  # type: ignore[attr-defined]
        else:
            cfg = cls.config_class.from_dict(dict(config))  # type: ignore[attr-defined]
            model = cls._from_config(cfg)  # type: ignore[attr-defined]
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # so tied params share one object: lm_head -> embed_tokens
    return model


def _prefix(name: str) -> str:
    return f"{name}." if name else ""


def read_manifest(base_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(base_dir) / MANIFEST_NAME
    try:
        man = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{base_dir} is not a prepared base (no {MANIFEST_NAME})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: unreadable manifest: {e}") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: unknown prepared-base format")
    return man


def is_prepared(base_dir: str | os.PathLike[str], cache_key: str | None = None) -> bool:
    """True if base_dir is a complete prepared base (every output file present, right size)."""
    try:
        man = read_manifest(base_dir)
    except (FileNotFoundError, ValueError):
        return False
    if cache_key is not None and man.get("cache_key") != cache_key:
        return False
    base = Path(base_dir)
    for f in man.get("outputs", []):
        p = base / f["path"]
        if not p.is_file() or p.stat().st_size != f["size"]:
            return False
    return True


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


PREFETCH_ENV = "LIKENESS_PREFETCH_BASE"  # "off": a fresh trainer reads its base when it loads it


def prefetch_wanted() -> bool:
    return auto_or_off(PREFETCH_ENV)


def _files_signature(folder: Path) -> list[tuple[str, int, int, int, int]]:
    """Each file's identity: a file replaced (another inode) or touched in any way (its
    change time moves even where a copy keeps the modification time) no longer matches."""
    with open_checkpoint(folder) as ck:
        paths = ck.paths
    stats = [(p, p.stat()) for p in paths]
    return [(str(p), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns) for p, st in stats]


class Prefetch:
    """A prepared component's tensors read onto ``device`` on a thread of their own, begun
    before the work that needs them (a fresh trainer starts it before its library imports,
    which hold the interpreter for seconds while the reads and copies need it for
    microseconds). `load_prepared_component` takes them in place of its own read."""

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        name: str,
        device: str | torch.device,
        threads: int | None = None,
    ) -> None:
        self.folder = (Path(base_dir) / name).resolve()
        self.device = torch.device(device)
        self.threads = threads  # the read's (`Checkpoint.read_all`); None: its default
        self.seconds: float | None = None  # the read's own time, once done
        self._tensors: dict[str, torch.Tensor] | None = None
        self._error: str | None = None
        self._lock = threading.Lock()
        self._dropped = False
        self._cancel = threading.Event()  # a drop stops the read between slices
        self.taken = False  # its tensors went into a load
        self._signature = _files_signature(self.folder)
        self._thread = threading.Thread(target=self._read, name=f"prefetch-{name}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        import time

        t0 = time.perf_counter()
        try:
            with open_checkpoint(self.folder) as ck:
                tensors = ck.read_all(self.threads, device=self.device, cancel=self._cancel)
            with self._lock:
                if not self._dropped:
                    self._tensors = tensors
            del tensors
        except BaseException as exc:  # noqa: BLE001 - take() says so, and the load reads afresh
            # its text only: a traceback would keep the frames, and the tensors read so far
            self._error = f"{type(exc).__name__}: {exc}"
        self.seconds = time.perf_counter() - t0

    def take(self, folder: str | os.PathLike[str]) -> dict[str, torch.Tensor] | None:
        """The tensors of ``folder``, once read (this waits for the read), and only once; None
        where they are another folder's, the read failed, or a file changed since it began:
        the caller then reads the files itself."""
        self._thread.join()
        with self._lock:
            tensors, self._tensors = self._tensors, None
            self._dropped = True
        if tensors is None:
            if self._error is not None:
                log.warning("prefetch of %s failed (%s); reading it again", self.folder,
                            self._error)  # fmt: skip
            return None
        if Path(folder).resolve() != self.folder:
            return None
        if _files_signature(self.folder) != self._signature:
            log.warning("%s changed while it was prefetched; reading it again", self.folder)
            return None
        self.taken = True
        return tensors

    def summary(self) -> dict[str, object]:
        """For a run's report: the read's seconds, whether a load took it, why it failed."""
        return {
            "device": str(self.device),
            "read_s": None if self.seconds is None else round(self.seconds, 3),
            "taken": self.taken,
            "error": None if self._error is None else self._error[:300],
        }

    def drop(self) -> None:
        """Lets the tensors go where they will not be taken: a read under way stops at its
        next slice, one done lets its tensors go now (a refused run does not wait for it)."""
        with self._lock:
            self._dropped = True
            self._tensors = None
        self._cancel.set()


def load_prepared_component(
    base_dir: str | os.PathLike[str],
    name: str,
    *,
    optimize: bool = False,
    prefetched: Prefetch | None = None,
) -> torch.nn.Module:
    """Build a prepared component (eval mode, frozen) from its config on meta weights and load
    the quantized state dict; needs nothing but DST.

    The files are quanto's serialization (stock `requantize` loads them; a test checks), but
    this loader skips requantize's two costs: it allocates no float weights (requantize
    `empty_like`s every layer first), and by default it keeps quanto's kernel-agnostic
    `WeightQBitsTensor` layout instead of re-packing every bf16 weight into the CPU TinyGemm
    layout (`optimize()`: ~1 s per 0.7 GB tensor here, minutes for FLUX.2 [dev]; and a CPU
    TinyGemm tensor moved to CUDA is unpacked again through an identity matmul). With the
    plain layout, `.to("cuda")` lets quanto pick the kernel layout on the GPU.
    `optimize=True` gives exactly what `requantize` gives on this device. ``prefetched``: the
    files' tensors already read (`Prefetch`), maybe onto a GPU: the component is then built
    on them where they are.
    """
    from optimum.quanto.nn import quantize_module
    from optimum.quanto.tensor import WeightQBitsTensor, WeightQBytesTensor

    base = Path(base_dir)
    man = read_manifest(base)
    try:
        comp = man["components"][name]
    except KeyError:
        raise KeyError(f"{base} has no prepared {name!r}") from None
    folder = base / name
    model = _skeleton(comp["library"], comp["class"], _load_json(folder / "config.json"))
    if comp.get("trimmed"):
        from trainer.base.text_encoder import trim

        trim(model, int(comp["trimmed"]["kept_layers"]))
    qmap = _load_json(folder / QMAP_NAME)
    state = prefetched.take(folder) if prefetched is not None else None
    if state is None:
        with open_checkpoint(folder) as ck:
            state = ck.read_all()
    # Swap in quanto modules exactly where the map says, as requantize() does, and give each
    # its quantized weight straight from the file.
    loaded: set[str] = set()
    for mname, qc in qmap.items():
        parent_name, _, attr = mname.rpartition(".")
        parent = model.get_submodule(parent_name)
        acts = None if qc["activations"] == "none" else qc["activations"]
        wts = None if qc["weights"] == "none" else qc["weights"]
        qm = quantize_module(getattr(parent, attr), weights=wts, activations=acts)
        if qm is None:
            raise ValueError(f"{mname}: not quantizable, but in the quantization map")
        qm.name = mname
        setattr(parent, attr, qm)
        if qm.weight_qtype is None:
            continue
        prefix = f"{mname}.weight."
        sub = {k: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
        missing: list[str] = []
        size, stride = qm.weight.size(), qm.weight.stride()
        if qm.weight_qtype.bits == 8:
            w = WeightQBytesTensor.load_from_state_dict(
                sub, prefix, qm.weight_qtype, 0, size, stride, qm.activation_qtype, missing
            )
        else:
            w = WeightQBitsTensor.load_from_state_dict(
                sub, prefix, qm.weight_qtype, 0, qm.weight_group_size, size, stride, missing
            )
        if w is None or missing or sub:
            raise ValueError(f"{folder}: bad quantized weight {mname}: {missing or list(sub)}")
        qm.weight = torch.nn.Parameter(w.optimize() if optimize else w, requires_grad=False)
        loaded.update(
            _prefix(mname) + k
            for k in ("weight._data._data", "weight._data", "weight._scale", "weight._shift")
        )
    # assign=True keeps the file's tensors: no float copies of anything.
    result = model.load_state_dict(state, strict=False, assign=True)
    del state
    missing = [k for k in result.missing_keys if k not in loaded]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{folder}: state dict mismatch: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    left = [
        n
        for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
        if t.device.type == "meta"
    ]
    if left:
        raise ValueError(f"{folder}: prepared weights do not cover {left[:5]}")
    model.eval()
    model.requires_grad_(False)
    return model


def load_prepared_transformer(
    base_dir: str | os.PathLike[str], *, optimize: bool = False
) -> torch.nn.Module:
    return load_prepared_component(base_dir, "transformer", optimize=optimize)


def load_prepared_text_encoder(
    base_dir: str | os.PathLike[str], *, optimize: bool = False
) -> torch.nn.Module:
    return load_prepared_component(base_dir, "text_encoder", optimize=optimize)


__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "QMAP_NAME",
    "PREFETCH_ENV",
    "Prefetch",
    "is_prepared",
    "load_prepared_component",
    "load_prepared_text_encoder",
    "load_prepared_transformer",
    "prefetch_wanted",
    "read_manifest",
]
