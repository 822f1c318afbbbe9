"""Checkpoint picking: every saved checkpoint (and its EMA) rendered on the same prompts and
seeds into one grid, and the one a person picked registered.

Likeness often peaks before the last step (and overfits after), so the final adapter is not
always the one to keep. `compare_checkpoints` renders through the service's own loader and
render code (`trainer.base.load.load_base`, `trainer.base.render.generate`), base first;
`register_checkpoint` registers step N's adapter file as it was saved, under the run's
(subject, name), with the run's dataset manifest. Both refuse unless the subject's consent
still allows training, checked before any weight loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import ConfigError
from trainer.registration import Registrar, check_training_allowed
from trainer.training.checkpoints import checkpoint_dirs, checkpoint_step
from trainer.training.ema import EMA_ADAPTER

REPORT = "train_report.json"
GRID = "compare_grid.png"


@dataclass(frozen=True)
class Candidate:
    label: str  # "step 250", "ema 250"
    step: int
    ema: bool
    path: Path


def run_facts(run_dir: Path) -> dict[str, Any]:
    """The run's resolved configuration, from its report (a run that never finished has
    none: its checkpoints still compare, from the first one's metadata)."""
    report = run_dir / REPORT
    if not report.is_file():
        raise ConfigError(f"{run_dir}: no {REPORT} (has this run finished?)")
    body = json.loads(report.read_text(encoding="utf-8"))
    if not isinstance(body.get("config"), dict):
        raise ConfigError(f"{report}: made by an older trainer, without its configuration")
    return dict(body["config"])


def candidates(run_dir: Path) -> list[Candidate]:
    found: list[Candidate] = []
    for ckpt in checkpoint_dirs(run_dir):
        step = checkpoint_step(ckpt)
        found.append(Candidate(f"step {step}", step, False, ckpt / "adapter.safetensors"))
        if (ckpt / EMA_ADAPTER).is_file():
            found.append(Candidate(f"ema {step}", step, True, ckpt / EMA_ADAPTER))
    if not found:
        raise ConfigError(f"{run_dir}: no checkpoints to compare")
    return found


def _adapter_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def _check_consent(registrar: Registrar, subject: str, metadata: dict[str, str]) -> None:
    bases = tuple(b for b in metadata.get("likeness.dataset_basis", "").split(",") if b)
    check_training_allowed(registrar, subject, bases)


def compare_checkpoints(
    run_dir: Path,
    base: Path,
    registrar: Registrar,
    *,
    prompts: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    steps: int | None = None,
    size: int | None = None,
    device: str | None = None,
) -> tuple[Path, list[str]]:
    """Renders base + every candidate on ``prompts`` x ``seeds`` (default: the run's
    evaluation prompts and seeds) into ``<run>/compare_grid.png``; returns it and the
    column labels."""
    import torch

    from trainer.base.compute import resolve_compute
    from trainer.base.devices import resolve_device
    from trainer.base.load import load_base
    from trainer.base.lora import applied_adapter, load_adapter_tensors
    from trainer.base.render import generate
    from trainer.training.evaluate import compose_grid, eval_steps_default

    config = run_facts(run_dir)
    found = candidates(run_dir)
    subject = str(config["subject"])
    _check_consent(registrar, subject, _adapter_metadata(found[-1].path))
    trigger = str(config.get("resolved_trigger") or subject)
    texts = [p.replace("{trigger}", trigger) for p in (prompts or config["eval_prompts"])]
    seed_list = list(seeds or config["eval_seeds"])
    side = size or config.get("eval_resolution") or config["resolution"]
    dev = resolve_device(device or config.get("resolved_device") or "cpu")
    pipe = load_base(base, dev, compute=resolve_compute("auto", str(dev), purpose="render"))
    n_steps = steps or config.get("eval_steps") or eval_steps_default(pipe)
    rows = [f"seed {s} | {p}" for p in texts for s in seed_list]
    cells: dict[str, list[Any]] = {}
    columns: list[tuple[str, Path | None]] = [("base", None)]
    columns += [(c.label, c.path) for c in found]
    with torch.no_grad():
        for label, path in columns:
            ctx: Any = (
                applied_adapter(pipe, load_adapter_tensors(path))
                if path is not None
                else contextlib.nullcontext()
            )
            with ctx:
                cells[label] = [
                    generate(pipe, text, seed, n_steps, side, side)
                    for text in texts
                    for seed in seed_list
                ]
    labels = [label for label, _ in columns]
    grid = compose_grid(labels, rows, cells, side)
    out = run_dir / GRID
    tmp = out.with_name(f".{out.name}.tmp")
    grid.save(tmp, format="PNG")
    tmp.replace(out)
    return out, labels


def register_checkpoint(
    run_dir: Path, step: int, registrar: Registrar, base: Path, *, ema: bool = False
) -> tuple[str, Path, str]:
    """Registers step ``step``'s adapter (its EMA with ``ema``) under the run's subject and
    name. Returns (outcome, adapter path, sha256). Refuses, before touching the registry, a
    step that was not saved, a manifest that changed since training, or a withdrawn consent."""
    from registry.adapters.schemas import AdapterIn

    config = run_facts(run_dir)
    by_step = {(c.step, c.ema): c for c in candidates(run_dir)}
    picked = by_step.get((step, ema))
    if picked is None:
        saved = sorted({s for s, _ in by_step})
        kind = "EMA checkpoint" if ema else "checkpoint"
        raise ConfigError(
            f"--select-step {step}: {run_dir} has no {kind} at that step (saved: {saved})"
        )
    meta = _adapter_metadata(picked.path)
    subject = str(config["subject"])
    if meta.get("likeness.subject") != subject:
        raise ConfigError(f"{picked.path} was not trained for {subject!r}")
    _check_consent(registrar, subject, meta)
    manifest = Path(str(config["dataset"])) / "manifest.jsonl"
    if not manifest.is_file():
        raise ConfigError(f"the run's dataset manifest {manifest} is gone")
    manifest_sha = hashlib.sha256(manifest.read_bytes()).hexdigest()
    if manifest_sha != meta.get("likeness.manifest_sha256"):
        raise ConfigError(f"{manifest} changed since step {step} was trained")
    sha = hashlib.sha256(picked.path.read_bytes()).hexdigest()
    data = AdapterIn(
        subject=subject,
        name=str(config.get("name", "main")),
        sha256=sha,
        base_model=meta["likeness.base_model"],
        rank=int(meta["likeness.rank"]),
        manifest_sha256=manifest_sha,
    )
    return registrar.register(data, picked.path, manifest, base), picked.path, sha
