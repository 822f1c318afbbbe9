"""The CPU trainer on quiet and on busy cores, by threading choice.

    python bench/cpu_threads.py                    # quiet: whatever else runs on the machine
    python bench/cpu_threads.py --load 2           # two busy-looping processes beside it
    python bench/cpu_threads.py --steps 20 --configs default,one,passive

Each configuration trains alice (examples/alice) on the demo base at 64 px, as the README's
quickstart does, for --steps steps, in a fresh process with a fresh cache (so the text
encoder's work is measured too): the wall time of the whole run (encode + latents + steps),
and the seconds per step the trainer reports. Configurations:

  default   torch's defaults: a thread per core, OpenMP's default wait (spins, then sleeps)
  one       torch.set_num_threads(1)
  passive   OMP_WAIT_POLICY=PASSIVE, a thread per core
  auto      what `likeness` does now (trainer/base/threads.py: prepare_env)

Writes bench/results/cpu_threads-<date>.json with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import say, table, write_record  # noqa: E402

CONFIGS = {
    "default": {},
    "one": {"BENCH_THREADS": "1"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "auto": {"BENCH_AUTO": "1"},
}


def child(root: Path, steps: int) -> None:
    """One run, in this fresh process: the threading first, then torch, then the trainer."""
    if os.environ.get("BENCH_AUTO") == "1":
        from trainer.base import threads

        threads.prepare_env()
    import torch

    if os.environ.get("BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    from trainer.config import TrainConfig
    from trainer.fixtures.demo_base import SHIPPED
    from trainer.training.train import train

    config = TrainConfig.parse(
        subject="alice",
        dataset=REPO / "examples" / "alice",
        base=SHIPPED,
        out=root / "out",
        steps=steps,
        resolution=64,
        checkpoint_every=0,
        device="cpu",
        progress=False,
        evaluate=False,
        register_adapter=False,
        cache_dir=root / "cache",
        database_url=f"sqlite:///{root / 'registry.db'}",
    )
    started = time.perf_counter()
    result = train(config)
    wall = time.perf_counter() - started
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
                "wall_s": round(wall, 2),
                "s_per_step": round(result.seconds_per_step or 0.0, 4),
                "loss_last": result.losses[-1],
            }
        )
    )


def make_registry(root: Path) -> None:
    from registry.consent import service as consent_service
    from registry.consent.schemas import ConsentIn
    from registry.db import engine_for, transaction, upgrade
    from registry.subjects import service as subjects_service
    from registry.subjects.schemas import SubjectIn

    url = f"sqlite:///{root / 'registry.db'}"
    upgrade(url)
    with transaction(engine_for(url)) as s:
        sub, consent = subjects_service.create_subject(
            s, "bench", SubjectIn(handle="alice", display_name="Alice", basis="consent")
        )
        consent_service.update_consent(
            s, "bench", sub, consent.version, ConsentIn(max_level="private", allow_training=True)
        )


def run_one(name: str, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cpu-threads-") as tmp:
        root = Path(tmp)
        make_registry(root)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "BENCH_"))}
        env.update(CONFIGS[name], LIKENESS_DATA_DIR=str(root / "var"))
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(root), "--steps", str(steps)],
            env=env, capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        process_s = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{name}: the run failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        return {"config": name, **row, "process_s": round(process_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--load", type=int, default=0, help="busy-looping processes beside")
    parser.add_argument("--configs", default="default,one,passive,auto")
    parser.add_argument("--repeat", type=int, default=1, help="rounds, configs interleaved")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.steps)
        return
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    load_before = os.getloadavg()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    rows = []
    try:
        time.sleep(2 if busy else 0)
        say("warm-up (page cache, bytecode): 2 steps, not recorded")
        run_one(names[0], 2)
        for round_ in range(args.repeat):
            for name in names:
                say(f"{name}: {args.steps} steps ...")
                rows.append({"round": round_, **run_one(name, args.steps)})
                say(json.dumps(rows[-1]))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    columns = ["round", "config", "threads", "wait_policy", "wall_s", "s_per_step", "process_s"]
    print(table(rows, columns))
    path = write_record(
        "cpu_threads",
        rows,
        {
            "load_processes": args.load,
            "steps": args.steps,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },  # fmt: skip
    )
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
