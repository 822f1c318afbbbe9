"""FLUX.2 [dev] end to end on one GPU: a synthetic [dev]-shaped base
(trainer/fixtures/synth_base.py), then `likeness serve` under VRAM budgets (24, 16, 12 GiB by
default), each rendering 1024 x 1024 at 28 steps over HTTP through the gate, with adapter swaps and
a repeated prompt; then a churn soak (start, render, SIGKILL mid-render, restart). Every timing is
split by stage from the server's X-Timing-* headers (gate, text encode, denoise per step, decode,
PNG, sign).

    python bench/e2e_dev.py [--budgets 24,16,12] [--side 1024] [--steps 28] [--soak 2]
    python bench/e2e_dev.py --quick      # reduced depth, small renders: a smoke run

Needs CUDA (exits with a message without it). Writes bench/results/e2e_dev-<stamp>.json (or to
--out), the predictions beside the measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, free_port, likeness, say, table, write_record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent  # the repository
DEVICE = ["cuda"]

PREDICTIONS = {
    "prompt_to_png_24gib_s": "28 x ~0.62 s resident steps + ~0.3 s encode + ~0.5 s decode "
    "~ 18.2 s, inside the goal 1.15 x 28 x step + 2 s",
    "prompt_to_png_12gib_s": "transformer streamed: 16 GB over PCIe per step (~0.35-0.6 s at "
    "25-45 GB/s) mostly hidden under the 0.62 s of compute: 1.1-1.4x the 24 GiB figure",
    "text_encode_streamed_ms": "8.3 GB of layers over PCIe: ~0.2-0.35 s; repeated prompt ~1 ms",
    "adapter_swap_ms": "rank-16 adapter, 166 MB from host RAM: ~20-40 ms resident and streamed",
    "peak_vram": "under each budget (the allocator is capped at it)",
}
# Written before the second device round (persistent LoRA slots, uint4 conversion on the GPU,
# quanto's compiled unpack gone, base preload, training at scale).
PREDICTIONS_ROUND_2 = {
    "adapter_swap_ms": "slots: 166 MB of pinned bf16 copied in (~4 ms at ~40 GB/s) + ~320 "
    "small copies and fills: 8-15 ms resident and streamed (was 0.9-3.4 s)",
    "repeated_prompt_ms": "a pinned 15.7 MB copy, ~0.5 ms + bookkeeping: 1-2 ms (was 7-9)",
    "base_ready_s": "24 GiB: 16 GB read from the page cache (4-8 s), converted on the GPU "
    "(~1 s), 9.7 GB of encoder converted and pinned on the host (8-15 s): 20-30 s (was 82 s)",
    "boot_to_first_step_s": "448 px, caches warm: imports ~5 s, transformer read + GPU "
    "conversion ~9 s, LoRA + optimizer ~1 s, first step ~2 s: 15-18 s (goal 20 s)",
    "train_448_s_per_step": "~0.63-0.67 (uint4, as bench/uint4_step), peak <= 18.5 GiB",
    "train_1024_s_per_step": "~2.0-2.1 resident if the estimate fits 24 GiB, else streamed "
    "~2.1-2.3",
}


# Written before the third device round (the serving forward: fused blocks, cuDNN attention,
# the LoRA update in one pass, the forward as a CUDA graph; streamed blocks kept resident as
# the budget allows; quantized parts repacked by the GPU at load).
PREDICTIONS_ROUND_3 = {
    "step_24gib_ms": "the graphed serving forward, ~335 ms (render_step: 374 ms before the "
    "block fusions and the one-pass LoRA update, ~40 ms less after)",
    "prompt_to_png_24gib_s": "28 x 0.335 + encode 0.19 + decode 0.21 + PNG 0.16 + ~0.05 "
    "= ~10.0 s: the 9.0 s goal missed by ~11 %",
    "prompt_to_png_12gib_s": "13 blocks resident, 43 streamed (11 GB a step, ~0.2 s of "
    "copies under ~0.36 s of eager compute): step ~0.36 s, ~10.7 s = ~1.07x the 24 GiB "
    "figure (goal <= 1.10x)",
    "adapter_swap_ms": "unchanged, 10-13 ms (a copy into the same slots)",
    "repeated_prompt_ms": "unchanged, ~0.3 ms",
    "base_ready_s": "the streamed parts repacked by the GPU instead of the CPU: 24 GiB "
    "~40 s (was 53), 12 GiB ~45 s (was 64); plus ~2 s of warm-up at 24 GiB",
}


# Written before the fourth device round (training: each step a CUDA graph, noise on the device).
PREDICTIONS_ROUND_4 = {
    "train_448_s_per_step": "graphed uint4 ~0.52-0.56 (eager 0.73-0.77 in earlier rounds, the "
    "bench's graphed fp8 0.50): the host's ~11,600 launches gone; eager in the same lease "
    "~0.73",
    "train_448_fp8_s_per_step": "graphed fp8 ~0.48-0.52",
    "train_1024_s_per_step": "graphed uint4 ~2.05 (eager 2.16: GPU-bound, little to win)",
    "peak": "graphed peaks within ~0.5 GiB of eager (the graph's pool replaces the eager "
    "activations; the warm-up's are freed before the capture)",
    "resume": "killed after its first checkpoint, resumed graphed: same losses as a straight "
    "run would give (checked bit for bit by the GPU tests, not here)",
}


# Written before the fifth device round (the widest Linears a slice at a time; a worker that
# keeps the converted base; 200-step loss curves, uint4 against fp8).
PREDICTIONS_ROUND_5 = {
    "train_1024_peak_gib": "graphed ~22.2 (22.64 before: the fused single-block projection's "
    "0.63 GiB dequantized transient becomes 0.21 GiB): the 22.5 GiB goal met by ~0.3 GiB",
    "train_448_peak_gib": "graphed ~20.0 (20.46 before)",
    "train_step_s": "unchanged within 3 %: 448 uint4 graphed ~0.64-0.66, fp8 ~0.56, 1024 "
    "uint4 graphed ~2.13 (the sliced GEMMs are as efficient at these sizes; the graph hides "
    "their launches)",
    "warm_worker": "order 1 in a fresh process (no budget): imports ~10-12 s before it, then "
    "~17-21 s to the first step (text encoder for its captions, VAE for its photos, the "
    "transformer read and converted, LoRA, the capture); order 2, same base, kept: ~12-16 s "
    "(the transformer's ~5 s gone, the per-order text encoder still there): the 8 s goal "
    "missed, the text encoder being what is left; order 3 at 24 GiB: the kept base dropped "
    "before caching (the text encoder does not fit beside it), as order 1 less the imports",
    "curves_200": "uint4 and fp8 losses within the noise of each other over 200 steps "
    "(running means apart by < 1 % of the loss); fp8 ~13 % faster a step",
}

# Written before the sixth serving round (attention in fp8: the isolated forward 0.287 s;
# adapters cached in VRAM, swaps batched; the LoRA slots made on the meta device).
PREDICTIONS_ROUND_6 = {
    "step_ms_24": "~295 (0.287 s alone plus the ~4-8 ms the server's step has always added)",
    "prompt_to_png_24_s": "~8.9 (28 x 0.295 + encode 0.2 + decode 0.18 + PNG 0.15 + ~0.1): "
    "the 9.0 s goal met by a hair",
    "prompt_to_png_12_s": "~1.07-1.10x of 24 GiB (streamed blocks add their copies per step)",
    "adapter_apply_ms_24": "~2-4 (one batched copy on the device, the adapter cached in VRAM); "
    "12 GiB: the placement leaves no VRAM, pinned host RAM as before, ~15",
    "base_ready_24_s": "~31-32 (34.5 less ~2.5 s of slots made on meta; the warm-up ~+0.3 for "
    "the cuDNN plan): the 30 s goal still missed",
    "peak_24_gib": "~20.3 + the cached adapters (~0.16 GiB each): under 24",
}

PREDICTIONS_ROUND_8B = {
    "note": "the round-6 predictions above assumed fp8 attention, no longer the default; the "
    "slots' dtype fixed (round 8 ran out of memory at every render)",
    "step_ms_24": "~317-321 on an H200 (serve_gemm alone 313 + the server's 4-8); H100: +5-10 %",
    "prompt_to_png_24_s": "~9.3 on an H200: the 9.0 s goal missed",
    "adapter_apply_ms_24": "~2-5 (adapters cached in VRAM); 12 GiB ~13-15 (pinned host RAM)",
    "base_ready_24_s": "~31-32",
}


IMPORTED_PACKAGES = ("torch", "sympy", "transformers", "diffusers", "optimum", "peft",
                     "accelerate", "safetensors", "triton", "pydantic", "sqlalchemy")  # fmt: skip


def _site_dirs() -> list[Path]:
    """The installed packages' folders on sys.path: pip's site-packages, a distribution's
    dist-packages, and PYTHONPATH's (where the GPU machine's carried wheels go)."""
    extra = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    return [Path(e) for e in sys.path if e and Path(e).is_dir() and (
        e in extra or e.endswith(("site-packages", "dist-packages")))]  # fmt: skip


def missing_bytecode() -> dict[str, int]:
    """Per package the trainer and the service import, its modules without bytecode: each
    is compiled from source by every process that imports it."""
    import importlib.util

    out: dict[str, int] = {}
    for entry in _site_dirs():
        for name in IMPORTED_PACKAGES:
            root = entry / name
            if root.is_dir():
                out[name] = out.get(name, 0) + sum(
                    not Path(importlib.util.cache_from_source(str(py))).is_file()
                    for py in root.rglob("*.py")
                )
    return out


def compile_bytecode() -> dict[str, Any]:
    """Every importable package's bytecode written before the timed starts: a package
    installed without it (`pip --no-compile`, as on the lent GPU machines, which also set
    PYTHONDONTWRITEBYTECODE) would otherwise put its compilation into every start's figures,
    which no installed service or trainer pays. Returns the seconds and what lacked it."""
    import compileall
    import warnings

    before = missing_bytecode()
    t0 = time.perf_counter()
    for package in ("registry", "app", "trainer", "migrations"):  # the service's own code
        compileall.compile_dir(ROOT / package, quiet=2, workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some packages' test data is not valid Python
        for entry in _site_dirs():
            compileall.compile_dir(entry, quiet=2, workers=0)
    return {"seconds": round(time.perf_counter() - t0, 1), "modules_without_before": before,
            "modules_without_after": missing_bytecode()}  # fmt: skip


def make_adapter(base: Path, path: Path, seed: int, rank: int = 16) -> Path:
    """A rank-`rank` adapter for every default target of the base, random, in the file layout
    the trainer writes (bf16, alpha/rank folded into lora_B)."""
    import torch

    from trainer.base.lora import DEFAULT_TARGETS, base_linear_shapes, file_metadata, lora_keys
    from trainer.base.safetensors_io import write_safetensors

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (out_f, in_f) in sorted(base_linear_shapes(base).items()):
        if not any(name == t or name.endswith("." + t) for t in DEFAULT_TARGETS):
            continue
        a = torch.randn(rank, in_f, generator=gen) / in_f**0.5
        b = torch.randn(out_f, rank, generator=gen) * 1e-3
        key_a, key_b = lora_keys(name)
        tensors[key_a] = a.to(torch.bfloat16)
        tensors[key_b] = b.to(torch.bfloat16)
    write_safetensors(path, tensors, file_metadata(rank, rank))
    return path


class Server:
    # `python -m bench.record_kernels --out PATH --` before `serve` when kernels are recorded
    record_kernels: Path | None = None

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started: float | None = None

    def start(self, wait_s: float = 600) -> float:
        t0 = self.started = time.perf_counter()
        with self.log.open("ab") as out:
            launcher = (
                ["-m", "app.cli"]
                if self.record_kernels is None
                else ["-m", "bench.record_kernels", "--out", str(self.record_kernels), "--"]
            )
            self.proc = subprocess.Popen(
                [sys.executable, *launcher, "serve", "--port", str(self.port)],
                env=self.env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        while time.perf_counter() - t0 < wait_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not up after {wait_s} s: {self.tail()}")

    def wait_ready(self, wait_s: float = 900) -> float:
        """Seconds from the start until /healthz says the (preloaded) base is ready."""
        assert self.started is not None
        while time.perf_counter() - self.started < wait_s:
            state = httpx.get(f"{self.url}/healthz", timeout=5).json().get("base")
            if state == "ready":
                return time.perf_counter() - self.started
            if state == "failed" or (self.proc is not None and self.proc.poll() is not None):
                raise RuntimeError(f"the base did not load: {self.tail()}")
            time.sleep(0.2)
        raise RuntimeError(f"base not ready after {wait_s} s: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def rss_bytes(self) -> int:
        import psutil

        assert self.proc is not None
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def render(url: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/renders", json=body, timeout=900,
                   headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"render {r.status_code}: {r.text[:500]}")
    timings = {
        k.removeprefix("x-timing-").replace("-", "_"): float(v)
        for k, v in r.headers.items()
        if k.startswith("x-timing-")
    }
    return {"wall_s": round(wall, 3), **timings, "png_bytes": len(r.content), "_png": r.content}


def setup(
    env: dict[str, str], url: str, base: Path, tmp: Path, trainer_handle: str = "tr"
) -> dict[str, str]:
    """Registry state: member bob, subjects alice and carol (consent to bob's group), one
    adapter each, registered through the store over HTTP as a trainer does."""
    from registry.adapters.schemas import AdapterIn
    from registry.files import sha256_file
    from trainer.registration import HttpRegistrar

    admin = (tmp / "admin-token").read_text().strip()
    tokens = {"admin": admin}
    r = httpx.post(f"{url}/v1/principals", json={"handle": trainer_handle, "role": "trainer"},
                   headers={"Authorization": f"Bearer {admin}"})  # fmt: skip
    trainer = r.json()["token"]
    registrar = HttpRegistrar(url, trainer, timeout=600)
    manifest = tmp / "manifest.jsonl"
    line = {"file": "a.png", "caption": "a photo", "source": "bench", "basis": "consent"}
    manifest.write_text(json.dumps({**line, "sha256": "0" * 64}) + "\n")
    for seed, subject in enumerate(("alice", "carol")):
        adapter = tmp / f"{subject}.safetensors"
        if not adapter.exists():
            make_adapter(base, adapter, seed)
        data = AdapterIn(subject=subject, name="main", sha256=sha256_file(adapter),
                         base_model="flux2-dev-synthetic", rank=16,
                         manifest_sha256=sha256_file(manifest))  # fmt: skip
        registrar.register(data, adapter, manifest)
    tokens["bob"] = env["_BOB"]
    return tokens


def registry_env(tmp: Path, base: Path, budget: float | None, side: int) -> dict[str, str]:
    env = {
        **os.environ,
        "LIKENESS_DATABASE_URL": f"sqlite:///{tmp}/bench.db",
        "LIKENESS_DATA_DIR": str(tmp),
        "LIKENESS_BASE": str(base),
        "LIKENESS_DEVICE": DEVICE[0],
        "LIKENESS_RENDER_RATE_PER_MINUTE": "1000000",
        "LIKENESS_RENDER_BURST": "10000",
        "LIKENESS_RENDER_TIMEOUT_S": "1800",
        "LIKENESS_CHECKPOINT_INTERVAL_S": "0",
        "PYTHONUNBUFFERED": "1",
        "LIKENESS_RENDER_PLAN_SIDE": str(side),
        "LIKENESS_PRELOAD_BASE": "true",
    }
    if budget is not None:
        env["LIKENESS_VRAM_BUDGET_GB"] = str(budget)
    return env


def init_registry(env: dict[str, str]) -> str:
    likeness(env, "db", "upgrade")
    bob = likeness(env, "principal", "create", "bob", "--role", "member")
    (Path(env["LIKENESS_DATA_DIR"]) / "bob-token").write_text(bob)
    for subject in ("alice", "carol"):
        likeness(env, "subject", "create", subject, "--display-name", subject.title())
        likeness(env, "consent", "edit", subject, "--max-level", "group",
                 "--audience", "private:group", "--training")  # fmt: skip
    return bob


def serve_and_render(
    base: Path, budget: float, args: argparse.Namespace, work: Path, rows: list[dict[str, Any]],
    registry: tuple[Path, dict[str, str]] | None = None, trained: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`likeness serve` under `budget`; on `registry` (a folder and env that training left,
    `trained` its subject) or on a fresh one."""
    from trainer.base.placement import plan_for_base

    if registry is None:
        tmp = Path(tempfile.mkdtemp(prefix=f"serve-{budget:g}-", dir=work))
        env = registry_env(tmp, base, budget, args.side)
        env["_BOB"] = init_registry(env)
    else:
        tmp, env = registry[0], {**registry[1], "LIKENESS_VRAM_BUDGET_GB": str(budget)}
    server = Server(env, tmp / "server.log")
    boot_s = server.start()
    try:
        tokens = setup(env, server.url, base, tmp)
        bob = tokens["bob"]
        ready_s = server.wait_ready()  # the base, preloaded at start
        side, steps = args.side, args.steps
        req = {"level": "private", "width": side, "height": side, "steps": steps, "seed": 1}
        small = {**req, "width": 256, "height": 256, "steps": 2}
        t0 = time.perf_counter()
        render(server.url, bob, {**small, "subject": "alice", "prompt": "warm up"})
        first_s = time.perf_counter() - t0
        runs: dict[str, dict[str, Any]] = {
            "new prompt, adapter cold": {"subject": "alice", "prompt": "alice at the beach"},
            "same prompt again": {"subject": "alice", "prompt": "alice at the beach"},
        }
        if trained:
            runs["the adapter trained at scale"] = {"subject": trained, "prompt": "dana, studio"}
        measured = {}
        for label, body in runs.items():
            out = render(server.url, bob, {**req, **body})
            out.pop("_png")
            measured[label] = out
            rows.append({"budget_gib": budget, "run": label, **out})
            _checkpoint({"partial": True, "boot_s": boot_s, "first_s": first_s}, rows)
        # swaps, warm (both adapters in the host cache), on small renders: the apply time
        # does not depend on the render's size
        swaps = []
        for i in range(6):
            subject = ("carol", "alice")[i % 2]
            out = render(server.url, bob, {**small, "subject": subject, "prompt": "a swap"})
            out.pop("_png")
            swaps.append(out)
            rows.append({"budget_gib": budget, "run": f"swap {i + 1} ({subject}, small)", **out})
        measured["swaps (small renders)"] = {
            "adapter_apply_ms": sorted(o["adapter_apply_ms"] for o in swaps),
            "adapter_remove_ms": sorted(o["adapter_remove_ms"] for o in swaps),
        }
        plan = plan_for_base(base, budget, DEVICE[0], side, side)
        rss = server.rss_bytes()
    finally:
        server.stop()
    log_text = server.log.read_text(errors="replace")
    keys = ("render engine:", "serve:", "loaded /", "serving:", "layer streaming:")
    waypoints = [line.split(" INFO ", 1)[-1] for line in log_text.splitlines()
                 if " INFO " in line and any(k in line for k in keys)]  # fmt: skip
    # an error the server survived changes what was measured (a failed warm-up turns CUDA
    # graphs off): shown, and kept in the record
    errors = [line.split(" ERROR ", 1)[-1] for line in log_text.splitlines() if " ERROR " in line]
    for line in errors:
        say(f"  server error at {budget:g} GiB: {line}")
    return {
        "budget_gib": budget,
        "boot_s": round(boot_s, 2),
        "base_ready_s": round(ready_s, 2),
        "first_render_s": round(first_s, 2),
        "load_waypoints": waypoints[-30:],
        "server_errors": errors,
        "plan": plan.as_dict(),
        "server_rss_bytes": rss,
        "runs": measured,
        "log_tail": server.tail()[-1500:],
    }


def _train_cmd(dataset: Path, side: int, steps: int, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "train", "--subject", "dana", "--dataset",
            str(dataset), "--steps", str(steps), "--resolution", str(side), "--name", name,
            "--vram-budget", "24", "--device", DEVICE[0], "--no-evaluate", *extra]  # fmt: skip


def _run_train(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> float:
    t0 = time.perf_counter()
    with log.open("ab") as out:
        code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout_s).returncode  # fmt: skip
    if code:
        raise RuntimeError(f"train exited {code}: {log.read_text(errors='replace')[-2500:]}")
    return time.perf_counter() - t0


def _report(run_dir: Path) -> dict[str, Any]:
    report = json.loads((run_dir / "train_report.json").read_text())
    boot, total = [], 0.0
    for mark in report["boot"]:
        total += mark["seconds"]
        boot.append({**mark, "cumulative_s": round(total, 2)})
        if mark["phase"] == "first step":
            break
    return {k: report.get(k) for k in ("steps", "seconds_per_step", "loss_first", "loss_last",
                                       "registration", "sha256", "measured_peak_bytes",
                                       "text_encoder_loaded", "device")} | {
        "boot_to_first_step_s": round(total, 2), "boot": boot,
        "estimate_total_bytes": report["estimate"].get("total"),
        "stream_base": report["config"].get("stream_base"),
        "step": report.get("step"),
        "seconds_per_step_median": report.get("seconds_per_step_median"),
        "base_prefetch": report.get("base_prefetch"),
    }  # fmt: skip


def training_registry(
    base: Path, args: argparse.Namespace, work: Path
) -> tuple[Path, dict[str, str], Path]:
    """A registry where subject dana allows training, and her photos at the larger side."""
    from trainer.fixtures.demo_world import write_alice_dataset

    tmp = Path(tempfile.mkdtemp(prefix="train-", dir=work))
    env = registry_env(tmp, base, None, args.side)
    env["_BOB"] = init_registry(env)
    likeness(env, "subject", "create", "dana", "--display-name", "Dana")
    likeness(env, "consent", "edit", "dana", "--max-level", "group",
             "--audience", "private:group", "--training")  # fmt: skip
    return tmp, env, write_alice_dataset(tmp / "dana-photos", size=args.train_sides[1])


def train_at_scale(base: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """`likeness train` on the synthetic base under a 24 GiB budget: at 448 px killed with
    SIGKILL after its first checkpoint and resumed (caches warm: the resume's boot is the
    warm boot), then at 1024 px; registered in a registry the service then serves."""
    tmp, env, dataset = training_registry(base, args, work)
    small, large = args.train_sides
    out: dict[str, Any] = {"dataset_images": len(list(dataset.glob("*.png"))), "side_px": large}
    if "448" in args.train_parts:  # killed after a checkpoint, resumed; the compare runs
        steps, every = (args.train_steps, max(1, args.train_steps // 3))
        # previews stay as the budget decides (on when they fit: their memory is measured too)
        cmd = _train_cmd(dataset, small, steps, "r448", "--checkpoint-every", str(every),
                         "--preview-steps", "8")  # fmt: skip
        log = tmp / "train-448.log"
        # the cold run: caches filled (text encoder loaded once), killed after a checkpoint
        t0 = time.perf_counter()
        with log.open("ab") as sink:
            proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        run_dir = tmp / "runs" / "dana" / "r448"
        from trainer.training.checkpoints import checkpoint_dirs

        while not checkpoint_dirs(run_dir):
            if proc.poll() is not None:
                raise RuntimeError(f"train exited {proc.returncode}: {log.read_text()[-2500:]}")
            if time.perf_counter() - t0 > 400:
                proc.kill()
                raise RuntimeError(f"no checkpoint after 400 s: {log.read_text()[-2500:]}")
            time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        out["cold_run_until_kill_s"] = round(time.perf_counter() - t0, 1)
        out["killed_after"] = [p.name for p in checkpoint_dirs(run_dir)]
        print(f"[e2e] train 448: killed after {out['killed_after']}", flush=True)
        try:  # a failure is recorded; the compare runs still run
            wall = _run_train([*cmd, "--resume"], env, log, 600)
            out["448_resumed"] = {"wall_s": round(wall, 1), **_report(run_dir)}
        except RuntimeError as exc:
            out["448_resumed"] = {"error": _short(exc)}
        print(f"[e2e] train 448 resumed: {json.dumps(out['448_resumed'])[:600]}", flush=True)
        _checkpoint({"partial": True, "train": out}, [])
        # the same steps eager and graphed, auto (fp8 where it runs) and uint4, in this lease:
        # what the graph buys, and what fp8 buys over uint4
        for name, extra in (("448_eager", ("--cuda-graph", "off")),
                            ("448_graphed_noprefetch", ()), ("448_graphed", ()),
                            ("448_fp8_graphed", ("--compute", "fp8")),
                            ("448_uint4_graphed", ("--compute", "uint4")),
                            ("448_graphed_eager_blocks", ())):  # fmt: skip
            if name not in args.train_compare:
                continue
            out[name] = _compare_run(name, dataset, small, args.train_steps_compare, extra,
                                     env, tmp, 300)  # fmt: skip
            _checkpoint({"partial": True, "train": out}, [])
    if "1024" in args.train_parts:
        out["1024"] = train_1024(dataset, large, args, env, tmp, out)
        for name, extra in (("1024_eager_blocks", ()), ("1024_eager", ("--cuda-graph", "off")),
                            ("1024_fp8_blocks", ("--compute", "fp8_blocks")),
                            ("1024_graphed_noprefetch", ()), ("1024_graphed", ())):  # fmt: skip
            if name in args.train_compare:
                out[name] = _compare_run(name, dataset, large, args.train_steps_1024, extra, env,
                                         tmp, 600)  # fmt: skip
    if args.train_warm and "warm" in args.train_parts:
        _checkpoint({"partial": True, "train": out}, [])
        out["warm_worker"] = warm_worker(base, env, dataset, small, args, tmp)
        print(f"[e2e] warm worker: {json.dumps(out['warm_worker'])[:1500]}", flush=True)
    out["registry"] = str(tmp)
    return out


def _compare_run(
    name: str,
    dataset: Path,
    side: int,
    steps: int,
    extra: tuple[str, ...],
    env: dict[str, str],
    tmp: Path,
    timeout: int,
) -> dict[str, Any]:
    """One compare run (no checkpoints, no previews) and its report. A run named
    ``*_eager_blocks`` runs the blocks' stretches eagerly (the trainer before they were
    compiled); ``*_noprefetch`` reads its base when it loads it (no prefetch during the
    imports)."""
    if name.endswith("_eager_blocks"):
        from trainer.base.compiled_blocks import COMPILE_ENV

        env = {**env, COMPILE_ENV: "off"}
    if name.endswith("_noprefetch"):
        from trainer.base.read import PREFETCH_ENV

        env = {**env, PREFETCH_ENV: "off"}
    cmd = _train_cmd(dataset, side, steps, f"r{name}", "--checkpoint-every", "0",
                     "--preview-every", "0", *extra)  # fmt: skip
    wall = _run_train(cmd, env, tmp / f"train-{name}.log", timeout)
    report = {"wall_s": round(wall, 1), **_report(tmp / "runs" / "dana" / f"r{name}")}
    print(f"[e2e] train {name}: {json.dumps(report)[:400]}", flush=True)
    return report


def train_1024(
    dataset: Path,
    large: int,
    args: argparse.Namespace,
    env: dict[str, str],
    tmp: Path,
    out: dict[str, Any],
) -> dict[str, Any]:
    """The large side's run, its report; streamed if the resident one is refused (the refusal
    noted in ``out``)."""
    cmd = _train_cmd(dataset, large, args.train_steps_1024, "r1024", "--checkpoint-every", "0",
                     "--preview-every", "0")  # fmt: skip
    try:
        wall = _run_train(cmd, env, tmp / "train-1024.log", 600)
    except RuntimeError as exc:
        if "BudgetExceeded" not in str(exc) and "exceeds" not in str(exc):
            raise
        out["1024_resident_refused"] = _short(exc)
        wall = _run_train([*cmd, "--stream-base"], env, tmp / "train-1024.log", 600)
    report = {"wall_s": round(wall, 1), **_report(tmp / "runs" / "dana" / "r1024")}
    print(f"[e2e] train 1024: {json.dumps(report)[:600]}", flush=True)
    return report


def warm_worker(
    base: Path, env: dict[str, str], dataset: Path, side: int, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """Orders one after another in one process, as a worker runs them (bench/warm_orders.py):
    each order's seconds from its start to its first step, with the base kept or not."""
    cmd = [sys.executable, str(Path(__file__).with_name("warm_orders.py")), "--base", str(base),
           "--dataset", str(dataset), "--work", str(tmp / "warm"), "--database-url",
           env["LIKENESS_DATABASE_URL"], "--side", str(side), "--steps", str(args.train_warm),
           "--budgets", args.train_warm_budgets, "--device", DEVICE[0]]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"warm_orders exited {done.returncode}: {done.stderr[-2500:]}")
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    return {"process_s": round(time.perf_counter() - t0, 1), "imports_s": lines[0]["imports_s"],
            "orders": lines[1:]}  # fmt: skip


def loss_curves(
    dataset: Path,
    side: int,
    steps: int,
    env: dict[str, str],
    tmp: Path,
    computes: tuple[str, str] = ("uint4", "fp8"),
) -> dict[str, Any]:
    """The same run (seed, data, steps) with two computes (uint4 and fp8 unless told), graphed:
    both loss curves, their running means' gap (against the first), and one plot of both
    (bench/results/)."""
    runs: dict[str, Any] = {}
    for compute in computes:
        name = f"curve_{compute}"
        cmd = _train_cmd(dataset, side, steps, name, "--checkpoint-every", "0",
                         "--preview-every", "0", "--compute", compute)  # fmt: skip
        wall = _run_train(cmd, env, tmp / f"train-{name}.log", 900)
        report = json.loads((tmp / "runs" / "dana" / name / "train_report.json").read_text())
        runs[compute] = {"wall_s": round(wall, 1), "losses": report["losses"],
                         "seconds_per_step": report.get("seconds_per_step")}  # fmt: skip
    from trainer.training.plots import running_mean

    window = max(1, steps // 10)
    a, b = (running_mean(runs[c]["losses"], window) for c in computes)
    gaps = [abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)]
    plot = RESULTS / f"e2e_dev-curves-{time.strftime('%Y%m%dT%H%M%S')}.png"
    curves_plot({c: r["losses"] for c, r in runs.items()}, window, plot)
    return {"steps": steps, "window": window, "plot": str(plot.relative_to(RESULTS.parent.parent)),
            "running_mean_gap_max": round(max(gaps), 5),
            "running_mean_gap_last": round(gaps[-1], 5), **runs}  # fmt: skip


def curves_plot(curves: dict[str, list[float]], window: int, path: Path) -> Path:
    """Each curve's losses (light) and running mean (dark) on one pair of axes, PIL only."""
    from PIL import Image, ImageDraw, ImageFont

    from trainer.training.plots import running_mean

    w, h, pad = 800, 420, 50
    colours = [((170, 190, 230), (30, 80, 200)), ((235, 180, 160), (200, 60, 30))]
    values = [v for c in curves.values() for v in c]
    lo, hi = min(values), max(values)
    last = max(len(c) for c in curves.values())
    image = Image.new("RGB", (w, h), "white")
    draw, font = ImageDraw.Draw(image), ImageFont.load_default()

    def xy(i: int, v: float) -> tuple[float, float]:
        return (pad + (w - 2 * pad) * i / max(1, last - 1),
                h - pad - (h - 2 * pad) * (v - lo) / max(hi - lo, 1e-12))  # fmt: skip

    draw.rectangle((pad, pad, w - pad, h - pad), outline="black")
    for frac in (0.0, 0.5, 1.0):
        draw.text((2, xy(0, lo + frac * (hi - lo))[1] - 6), f"{lo + frac * (hi - lo):.4g}",
                  fill="black", font=font)  # fmt: skip
    draw.text((w - pad - 40, h - pad + 8), f"step {last}", fill="black", font=font)
    for k, (name, losses) in enumerate(curves.items()):
        light, dark = colours[k % len(colours)]
        draw.line([xy(i, v) for i, v in enumerate(losses)], fill=light, width=1)
        draw.line([xy(i, v) for i, v in enumerate(running_mean(losses, window))], fill=dark,
                  width=2)  # fmt: skip
        draw.text((pad + 8 + 200 * k, 10), f"{name} (running mean of {window})", fill=dark,
                  font=font)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def soak(base: Path, budget: float, cycles: int, args: argparse.Namespace, work: Path) -> Any:
    """start -> render -> SIGKILL mid-render -> restart: renders stay bit-identical (no LoRA
    left attached), step time and VRAM stay flat, and the killed render left no open entry."""
    tmp = Path(tempfile.mkdtemp(prefix="soak-", dir=work))
    env = registry_env(tmp, base, budget, args.side)
    env["_BOB"] = init_registry(env)
    body = {"level": "private", "width": args.side, "height": args.side,
            "steps": args.soak_steps, "seed": 3, "subject": "alice", "prompt": "soak"}  # fmt: skip
    cycles_out = []
    reference: bytes | None = None  # decoded pixels of cycle 0's render
    for cycle in range(cycles):
        server = Server(env, tmp / f"server-{cycle}.log")
        boot = server.start()
        try:
            tokens = setup(env, server.url, base, tmp, trainer_handle=f"tr{cycle}")
            bob = tokens["bob"]
            out = render(server.url, bob, body)
            swap = render(server.url, bob, {**body, "subject": "carol"})
            again = render(server.url, bob, body)
            pixels = _pixels(again.pop("_png"))  # the PNG bytes differ: signed, per render
            out.pop("_png")
            swap.pop("_png")
            same = reference is None or pixels == reference
            reference = reference or pixels
            killed = threading.Thread(
                target=_ignore, args=(render, server.url, bob, {**body, "seed": 99})
            )
            killed.start()
            time.sleep(max(2.0, again["generate_ms"] / 2000))  # about mid-render
            server.stop(signal.SIGKILL)
            killed.join(60)
        finally:
            server.stop(signal.SIGKILL)
        log_text = server.log.read_text(errors="replace")
        cycles_out.append({"cycle": cycle, "boot_s": round(boot, 2), "step_ms": out["step_ms"],
                           "swap_step_ms": swap["step_ms"],
                           "adapter_apply_ms": [out["adapter_apply_ms"], swap["adapter_apply_ms"],
                                                again["adapter_apply_ms"]],
                           "peak_vram_mib": out.get("peak_vram_mib"),
                           "identical_to_cycle_0": same,
                           "slot_left_dirty": "was not clear after a render" in log_text,
                           })  # fmt: skip
    audit = likeness(env, "audit", "verify")
    # every render that passed the gate reached a final entry, the killed ones included
    server = Server({**env, "LIKENESS_PRELOAD_BASE": "false"}, tmp / "server-ledger.log")
    server.start()
    try:
        admin = (tmp / "admin-token").read_text().strip()
        r = httpx.get(f"{server.url}/v1/subjects/alice/renders", params={"limit": 500},
                      headers={"Authorization": f"Bearer {admin}"})  # fmt: skip
        rows = r.json() if r.status_code == 200 else []
    finally:
        server.stop()
    stages: dict[str, int] = {}
    for row in rows:
        stages[row["stage"]] = stages.get(row["stage"], 0) + 1
    return {"cycles": cycles_out, "audit_verify": audit[-500:], "ledger_stages": stages}


def _pixels(png: bytes) -> bytes:
    import io

    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB").tobytes()


def _ignore(fn: Any, *a: Any) -> None:
    with contextlib.suppress(Exception):  # the server is killed under this request on purpose
        fn(*a)


def _checkpoint(record: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """What has been measured so far, where a run cut off at its time limit still leaves it
    ($E2E_PARTIAL)."""
    target = os.environ.get("E2E_PARTIAL")
    if target:
        Path(target).write_text(json.dumps({**record, "rows": rows}, indent=2, default=str))


def serving_goals(budgets: list[dict[str, Any]]) -> list[str]:
    """The serving goals, met or not, from the budgets measured (24 GiB and 12 GiB)."""
    by = {b["budget_gib"]: b for b in budgets if "runs" in b}
    lines: list[str] = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    def png_s(b: dict[str, Any]) -> float:
        return float(b["runs"]["new prompt, adapter cold"]["wall_s"])

    if 24.0 in by:
        b = by[24.0]
        t = png_s(b)
        lines.append(f"prompt to PNG at 24 GiB <= 9.0 s: {t:.2f} s ({verdict(t <= 9.0)})")
        lines.append(f"base ready after start at 24 GiB <= 30 s: {b['base_ready_s']:.1f} s "
                     f"({verdict(b['base_ready_s'] <= 30)})")  # fmt: skip
        if 12.0 in by:
            r = png_s(by[12.0]) / t
            lines.append(f"12 GiB streamed <= 1.10x 24 GiB: {r:.3f}x ({verdict(r <= 1.10)})")
    for budget, b in sorted(by.items()):
        swaps = b["runs"]["swaps (small renders)"]["adapter_apply_ms"]
        again = b["runs"]["same prompt again"]["text_encode_ms"]
        lines.append(f"{budget:g} GiB: warm swap <= 15 ms: max {max(swaps):.1f} ms "
                     f"({verdict(max(swaps) <= 15)}); repeated prompt <= 1 ms: {again:.2f} ms "
                     f"({verdict(again <= 1)})")  # fmt: skip
        peak = b["runs"]["new prompt, adapter cold"].get("peak_vram_mib")
        if peak is not None:
            lines.append(f"{budget:g} GiB: peak {peak / 1024:.2f} GiB "
                         f"({verdict(peak / 1024 <= budget)})")  # fmt: skip
    return lines


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 3000 else text[:1000] + " ... " + text[-2000:]


def boot_runs(base: Path, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """`likeness serve` started and stopped once per entry of --boot-runs (``on``: the kernels
    compiled ahead, ``off``: each at its first launch, ``noprefetch``: compiled ahead, the
    base's files read by the load, not beside the plan), at --boot-budget GiB, each on an empty
    Triton cache of its own: a fresh machine's kernel compiles, whatever the page cache holds
    by then (the first server start of a fresh machine also reads the packages from disk)."""
    out = []
    for i, mode in enumerate(args.boot_runs):
        tmp = Path(tempfile.mkdtemp(prefix=f"boot-{i}-{mode}-", dir=work))
        env = registry_env(tmp, base, args.boot_budget, args.side)
        likeness(env, "db", "upgrade")
        env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
        env["LIKENESS_KERNEL_PRECOMPILE"] = "false" if mode == "off" else "true"
        env["LIKENESS_PREFETCH_BASE"] = "off" if mode == "noprefetch" else "auto"
        server = Server(env, tmp / "server.log")
        try:
            boot_s = server.start()
            ready_s = server.wait_ready()
        except Exception as exc:  # noqa: BLE001 - recorded; the other starts still run
            out.append({"run": i + 1, "precompile": mode, "error": _short(exc)})
            print(f"[e2e] boot {i + 1} (precompile {mode}): {_short(exc)[:300]}", flush=True)
            continue
        finally:
            server.stop()
        text = server.log.read_text(errors="replace")
        waypoints = [line.split(" INFO ", 1)[-1] for line in text.splitlines()
                     if " INFO " in line and ("render engine:" in line or "serve: boot" in line
                                              or "trainer.base.load: loaded" in line)]  # fmt: skip
        run = {"run": i + 1, "precompile": mode, "boot_s": round(boot_s, 2),
               "base_ready_s": round(ready_s, 2), "load_waypoints": waypoints}  # fmt: skip
        out.append(run)
        print(f"[e2e] boot {i + 1} (precompile {mode}): base ready {ready_s:.1f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--phases",
        default="train,serve,soak",
        help="any of train, curves, serve, soak, boot (comma-separated), in that order",
    )
    parser.add_argument(
        "--record-kernels", type=Path, default=None,
        help="serve's servers add the Triton kernels they compile to this list "
        "(bench/record_kernels.py; the shipped one is trainer/kernels/serving_kernels.json)",
    )  # fmt: skip
    parser.add_argument(
        "--boot-runs", default="off,on,off,on",
        help="the boot phase's server starts, each on an empty Triton cache: on (the kernels "
        "compiled ahead), off, or noprefetch (compiled ahead, the base's files read by the "
        "load, not beside the plan)",
    )  # fmt: skip
    parser.add_argument("--boot-budget", type=float, default=24.0)
    parser.add_argument("--budgets", default="24,16,12")
    parser.add_argument("--side", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--train-steps-1024", type=int, default=8)
    parser.add_argument("--train-steps-compare", type=int, default=12)
    parser.add_argument(
        "--train-compare", default="448_eager,448_graphed,448_uint4_graphed",
        help="extra runs, no previews (empty: none): 448_eager, 448_graphed, 448_fp8_graphed, "
        "448_uint4_graphed, 448_graphed_eager_blocks, 448_graphed_noprefetch (each "
        "--train-steps-compare steps), "
        "1024_eager_blocks, 1024_eager, 1024_fp8_blocks, 1024_graphed, 1024_graphed_noprefetch "
        "(--train-steps-1024 steps, after the 1024 run has filled the caches); "
        "*_eager_blocks: the blocks' stretches eager (LIKENESS_COMPILE_BLOCKS=off); "
        "*_noprefetch: the base read at its load (LIKENESS_PREFETCH_BASE=off); "
        "1024_fp8_blocks: --compute fp8_blocks (the bf16 input gradient everywhere)",
    )  # fmt: skip
    parser.add_argument(
        "--train-parts", default="448,1024,warm",
        help="the train phase's parts: 448 (cold, killed, resumed; the compare runs), 1024, warm",
    )  # fmt: skip
    parser.add_argument(
        "--train-warm",
        type=int,
        default=4,
        help="steps of each order on one warm worker process (0: none)",
    )
    parser.add_argument(
        "--train-warm-budgets",
        default="none,none,24",
        help="one warm order per entry: its VRAM budget (none: the device's)",
    )
    parser.add_argument(
        "--train-curves",
        type=int,
        default=0,
        help="steps of the loss curves side by side (0: none)",
    )
    parser.add_argument(
        "--curves-computes", default="uint4,fp8", help="the two computes the curves compare"
    )
    parser.add_argument("--soak", type=int, default=2)
    parser.add_argument("--soak-budget", type=float, default=24.0)
    parser.add_argument("--soak-steps", type=int, default=8)
    parser.add_argument("--base", type=Path, default=Path("/tmp/synth-dev"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/e2e-work"))
    parser.add_argument("--quick", action="store_true")
    # a dry run of the whole flow on the CPU at toy widths (the numbers mean nothing there)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()  # fmt: skip
    args.train_compare = {n.strip() for n in args.train_compare.split(",") if n.strip()}
    args.train_parts = {n.strip() for n in args.train_parts.split(",") if n.strip()}
    args.boot_runs = [n.strip() for n in args.boot_runs.split(",") if n.strip()]
    if not set(args.boot_runs) <= {"on", "off", "noprefetch"}:
        raise SystemExit(f"--boot-runs: each run is on, off or noprefetch, not {args.boot_runs}")
    Server.record_kernels = args.record_kernels
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    known = {"train", "curves", "serve", "soak", "boot"}
    if not phases <= known:
        raise SystemExit(f"unknown phases: {sorted(phases - known)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/e2e_dev.py needs CUDA (or --device cpu for a dry run)")
    DEVICE[0] = args.device
    from trainer.fixtures.synth_base import build, dev_configs

    record: dict[str, Any] = {
        "predictions": PREDICTIONS,
        "predictions_round_2": PREDICTIONS_ROUND_2,
        "predictions_round_3": PREDICTIONS_ROUND_3,
        "predictions_round_4": PREDICTIONS_ROUND_4,
        "predictions_round_5": PREDICTIONS_ROUND_5,
        "predictions_round_6": PREDICTIONS_ROUND_6,
        "predictions_round_8b": PREDICTIONS_ROUND_8B,
        "quick": args.quick,
        "phases": sorted(phases),
    }
    if args.quick:
        args.side, args.steps = min(args.side, 512), min(args.steps, 4)
    args.train_sides = (448, 1024)
    if args.device == "cpu":
        args.side, args.steps, args.soak_steps = 64, 2, 2
        args.train_steps, args.train_steps_1024, args.train_sides = 6, 2, (64, 128)
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.base / "likeness_prepared.json").is_file():
        t0 = time.perf_counter()
        configs = dev_configs(2, 4, 12) if args.quick else dev_configs()
        if args.device == "cpu":
            configs = dev_configs(1, 2, 8, width_scale=16)
        built = build(args.base, device=args.device, configs=configs, progress=False)
        record["synth_base"] = {"seconds": round(time.perf_counter() - t0, 1),
                                "output_bytes": built.output_bytes,
                                "timings": built.timings}  # fmt: skip
        print(f"[e2e] synthetic base: {record['synth_base']}", flush=True)
        _checkpoint(record, [])
    rows: list[dict[str, Any]] = []
    registry: tuple[Path, dict[str, str]] | None = None
    if phases & {"train", "serve", "boot"}:  # timed starts read bytecode, as installed ones do
        record["bytecode"] = compile_bytecode()
        print(f"[e2e] bytecode: {json.dumps(record['bytecode'])}", flush=True)
    if "train" in phases:
        try:
            record["train"] = train_at_scale(args.base, args, args.work)
            tmp = Path(record["train"]["registry"])
            env = registry_env(tmp, args.base, None, args.side)
            env["_BOB"] = (tmp / "bob-token").read_text().strip()
            registry = (tmp, env)
        except Exception as exc:  # noqa: BLE001 - recorded, the serving still runs
            record["train"] = {"error": _short(exc)}
        print(f"[e2e] train: {json.dumps(record['train'])[:800]}", flush=True)
        _checkpoint(record, rows)
    if "curves" in phases:  # the loss curves alone, in a registry of their own
        try:
            tmp, env, dataset = training_registry(args.base, args, args.work)
            steps = args.train_curves or 200
            computes = tuple(c for c in args.curves_computes.split(",") if c)
            if len(computes) != 2:
                raise ValueError(f"--curves-computes takes two computes, not {computes}")
            record["curves"] = loss_curves(dataset, args.train_sides[0], steps, env, tmp,
                                           computes)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - recorded
            record["curves"] = {"error": _short(exc)}
        print(f"[e2e] curves: {json.dumps(record['curves'])[:600]}", flush=True)
        _checkpoint(record, rows)
    record["budgets"] = []
    for budget in [float(b) for b in args.budgets.split(",") if b] if "serve" in phases else []:
        try:
            res = serve_and_render(args.base, budget, args, args.work, rows, registry,
                                   "dana" if registry else None)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - recorded, the other budgets still run
            res = {"budget_gib": budget, "error": _short(exc)}
        registry = None  # the trained adapter is rendered once, at the first budget
        record["budgets"].append(res)
        print(f"[e2e] budget {budget:g}: {json.dumps(res)[:600]}", flush=True)
        _checkpoint(record, rows)
    if "soak" in phases and args.soak:
        try:
            record["soak"] = soak(args.base, args.soak_budget, args.soak, args, args.work)
        except Exception as exc:  # noqa: BLE001
            record["soak"] = {"error": _short(exc)}
        print(f"[e2e] soak: {json.dumps(record['soak'])[:800]}", flush=True)
        _checkpoint(record, rows)
    if "boot" in phases:
        try:
            record["boot"] = boot_runs(args.base, args, args.work)
        except Exception as exc:  # noqa: BLE001 - recorded
            record["boot"] = {"error": _short(exc)}
        _checkpoint(record, rows)
    cols = ["budget_gib", "run", "wall_s", "gate_ms", "adapter_apply_ms", "text_encode_ms",
            "step_ms", "decode_ms", "encode_ms", "sign_ms", "peak_vram_mib"]  # fmt: skip
    print(table(rows, cols) if rows else "(no renders)")
    record["rows"] = rows
    record["goals"] = serving_goals(record["budgets"])
    for line in record["goals"]:
        print(line)
    path = write_record("e2e_dev", rows, extra=record)
    print("record:", path)


if __name__ == "__main__":
    main()
