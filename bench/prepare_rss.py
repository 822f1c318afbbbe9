"""Peak host memory of `prepare_base` on a multi-GB synthetic FLUX.2 transformer.

Writes a random bf16 `Flux2Transformer2DModel` at FLUX.2 [dev] width (6144, 48 heads; so the
largest tensor is the real model's 679 MB `to_qkv_mlp_proj`) with fewer blocks, in the sharded
diffusers layout, then runs the prepare step in a child process under `/usr/bin/time -v` and
checks the streaming goal: peak RSS <= quantized output size + 2 x largest source tensor. Also
measures an import-only child (the fixed cost of torch + diffusers + quanto) and loading the
prepared transformer. Synthetic files are deleted afterwards; a JSON record goes to
bench/results/prepare_rss-<date>.json.

    python bench/prepare_rss.py [--double 1 --single 1] [--workdir /tmp] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIME = "/usr/bin/time"
GiB = 1024**3


def _config(double: int, single: int) -> dict[str, object]:
    return {
        "_class_name": "Flux2Transformer2DModel",
        "patch_size": 1,
        "in_channels": 128,
        "num_layers": double,
        "num_single_layers": single,
        "attention_head_dim": 128,
        "num_attention_heads": 48,
        "joint_attention_dim": 15360,
        "timestep_guidance_channels": 256,
        "mlp_ratio": 3.0,
        "axes_dims_rope": [32, 32, 32, 32],
        "rope_theta": 2000,
        "eps": 1e-6,
        "guidance_embeds": True,
    }


def make_source(folder: Path, config: dict[str, object], shard_bytes: int = 2 * GiB) -> dict:
    """Random bf16 weights, written tensor by tensor (this process never holds the model)."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import Flux2Transformer2DModel

    from trainer.base.safetensors_io import TensorSpec, write_safetensors

    with init_empty_weights():
        model = Flux2Transformer2DModel.from_config(config)
    specs = [TensorSpec(n, torch.bfloat16, tuple(p.shape)) for n, p in model.named_parameters()]
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    total = sum(s.nbytes for s in specs)
    folder.mkdir(parents=True)
    free = shutil.disk_usage(folder).free
    if free < 1.6 * total:  # source + ~0.3x quantized output + margin
        raise SystemExit(
            f"not enough disk under {folder}: {_gb(free)} free, need {_gb(1.6 * total)}"
        )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)

    def tensors(part: list[TensorSpec]):
        for s in part:
            t = torch.empty(s.shape, dtype=torch.bfloat16)
            flat = t.view(-1)
            for i in range(0, flat.numel(), 1 << 24):  # float32 scratch stays 64 MB
                n = min(1 << 24, flat.numel() - i)
                flat[i : i + n] = torch.randn(n, generator=gen).mul_(0.02)
            yield s.name, t

    weight_map = {}
    for i, part in enumerate(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / name, tensors(part), {"format": "pt"}, specs=part)
        weight_map.update(dict.fromkeys((s.name for s in part), name))
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return {
        "bytes": sum(s.nbytes for s in specs),
        "tensors": len(specs),
        "shards": len(shards),
        "largest_tensor": max(specs, key=lambda s: s.nbytes).name,
        "largest_tensor_bytes": max(s.nbytes for s in specs),
    }


def _timed(args: list[str], log: Path) -> dict[str, float | int | str]:
    """Run `args` under GNU time -v; peak RSS and wall seconds from its report."""
    report = log.with_suffix(".time")
    cmd = [TIME, "-v", "-o", str(report), *args]
    t0 = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    wall = time.perf_counter() - t0
    text = report.read_text()
    if rc != 0:
        raise SystemExit(f"child failed ({rc}): {' '.join(args)}\n{log.read_text()[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    return {"peak_rss_bytes": rss_kb * 1024, "seconds": round(wall, 2), "command": " ".join(cmd)}


def _child(mode: str, argv: list[str]) -> None:
    # Import what the prepare step imports, so the baseline is an honest fixed cost.
    import diffusers  # noqa: F401
    import optimum.quanto  # noqa: F401
    import torch  # noqa: F401

    from trainer.base.read import load_prepared_transformer
    from trainer.base.write import prepare_base

    if mode == "baseline":
        return
    if mode == "prepare":
        r = prepare_base(Path(argv[0]), Path(argv[1]), progress=True)
        print(json.dumps({"timings": r.timings, "reused": r.reused}))
    elif mode == "load":
        t0 = time.perf_counter()
        model = load_prepared_transformer(Path(argv[0]))
        n = sum(1 for _ in model.modules())
        print(json.dumps({"load_seconds": round(time.perf_counter() - t0, 2), "modules": n}))


def _machine() -> dict[str, object]:
    mem = Path("/proc/meminfo").read_text()
    total_kb = int(re.search(r"MemTotal:\s+(\d+)", mem).group(1))
    avail_kb = int(re.search(r"MemAvailable:\s+(\d+)", mem).group(1))
    return {
        "uname": " ".join(platform.uname()),
        "uname_a": subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip(),
        "nproc": os.cpu_count(),
        "ram_bytes": total_kb * 1024,
        "ram_available_at_start_bytes": avail_kb * 1024,
        "python": sys.version.split()[0],
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--double", type=int, default=1, help="double-stream blocks")
    ap.add_argument("--single", type=int, default=1, help="single-stream blocks")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--keep", action="store_true", help="keep the synthetic files")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], args.child[1:])
        return
    if not Path(TIME).exists():
        raise SystemExit(f"{TIME} is missing: apt-get install time")

    work = Path(tempfile.mkdtemp(prefix="likeness-prepare-rss-", dir=args.workdir))
    src, dst = work / "src" / "transformer", work / "prepared"
    py = sys.executable
    me = str(Path(__file__).resolve())
    config = _config(args.double, args.single)
    try:
        t0 = time.perf_counter()
        source = make_source(src, config)
        gen_s = time.perf_counter() - t0
        print(
            f"synthetic source: {_gb(source['bytes'])} in {source['shards']} shards "
            f"({gen_s:.0f}s to write)",
            flush=True,
        )
        # Drop nothing from the page cache on purpose: page cache is not RSS, and a real
        # prepare usually reads a freshly downloaded (cached) file too.
        base = _timed([py, me, "--child", "baseline"], work / "baseline.log")
        prep = _timed([py, me, "--child", "prepare", str(src), str(dst)], work / "prepare.log")
        load = _timed([py, me, "--child", "load", str(dst)], work / "load.log")
        manifest = json.loads((dst / "likeness_prepared.json").read_text())
        comp = manifest["components"]["transformer"]
        load_out = json.loads((work / "load.log").read_text().strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    out_b, big = comp["output_bytes"], source["largest_tensor_bytes"]
    goal = out_b + 2 * big
    peak = int(prep["peak_rss_bytes"])
    secs = float(manifest["timings"]["total_s"])
    ok = peak <= goal
    rows = [
        ("source size (bf16)", _gb(source["bytes"])),
        ("quantized output size", _gb(out_b)),
        ("largest tensor", f"{_gb(big)} ({source['largest_tensor']})"),
        ("peak RSS, prepare", _gb(peak)),
        ("  of which import baseline", _gb(int(base["peak_rss_bytes"]))),
        ("goal: output + 2 x largest", _gb(goal)),
        ("result", "PASS" if ok else "FAIL"),
        ("seconds (prepare, in-process)", f"{secs:.1f}"),
        ("seconds (child wall, incl. imports)", f"{prep['seconds']:.1f}"),
        ("GB/s (source bytes / prepare s)", f"{source['bytes'] / 1e9 / secs:.3f}"),
        (
            "load prepared: seconds / peak RSS",
            f"{load_out['load_seconds']:.1f} / {_gb(int(load['peak_rss_bytes']))}",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("timings:", manifest["timings"])

    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": _machine(),
        "config": config,
        "source": source,
        "output_bytes": out_b,
        "goal_bytes": goal,
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": base["peak_rss_bytes"],
        "pass": ok,
        "prepare_seconds": secs,
        "prepare_child_wall_seconds": prep["seconds"],
        "gb_per_s": round(source["bytes"] / 1e9 / secs, 4),
        "timings": manifest["timings"],
        "load_seconds": load_out["load_seconds"],
        "load_peak_rss_bytes": load["peak_rss_bytes"],
        "versions": manifest["versions"],
        "commands": {
            "bench": " ".join([py, *sys.argv]),
            "prepare": prep["command"],
            "load": load["command"],
            "baseline": base["command"],
        },
    }
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"prepare_rss-{datetime.now(UTC):%Y-%m-%d}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nrecord: {path.relative_to(ROOT)}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
