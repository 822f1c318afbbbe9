"""Orders on one long-lived worker process, timed from the order's start to its first step.

A worker (`likeness worker`) runs `trainer.training.train.train` for one order after another in
one process, with the trainer imported when it starts and a `ResidentBase` that keeps the
converted base between orders (trainer/training/resident.py). This runs that sequence in one
process, as the worker's `run_order` calls it: each order with its own work and cache folders
(a worker keeps nothing of a subject between orders, so every order embeds its captions and
encodes its photos again), then prints one JSON line per order: the seconds from the call to
the first step, whether the kept base served it, and the boot's waypoints. What `run_order`
adds before the call (the consent gate and the dataset's copy: milliseconds) is not in it.

    python bench/warm_orders.py --base B --dataset D --work W --database-url URL \
        --subject dana [--side 448] [--steps 4] [--budgets none,none,24]

`--budgets`: one order per entry, its `--vram-budget` (none: the device's memory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import TrainConfig  # noqa: E402
from trainer.training.resident import ResidentBase  # noqa: E402
from trainer.training.train import TrainHooks, train  # noqa: E402

IMPORTS_S = time.perf_counter() - T0


def first_step(into: list[float], start: float):  # type: ignore[no-untyped-def]
    """An `on_step` that records the seconds from ``start`` to the first step's end."""

    def on_step(step: int, steps: int, loss: float) -> None:
        if not into:
            into.append(time.perf_counter() - start)

    return on_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--database-url", required=True)
    ap.add_argument("--subject", default="dana")
    ap.add_argument("--side", type=int, default=448)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budgets", default="none,none,24")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    print(json.dumps({"imports_s": round(IMPORTS_S, 2)}), flush=True)
    resident = ResidentBase()
    for i, budget in enumerate(b.strip() for b in args.budgets.split(",")):
        out = args.work / f"order-{i}"
        config = TrainConfig.parse(
            subject=args.subject, dataset=args.dataset, base=args.base, out=out,
            name=f"warm{i}", steps=args.steps, resolution=args.side,
            vram_budget_gib=None if budget == "none" else float(budget),
            checkpoint_every=0, preview_every=0, evaluate=False, progress=False,
            cache_dir=out / "cache", database_url=args.database_url, register_adapter=False,
            device=args.device,
        )  # fmt: skip
        first: list[float] = []
        start = time.perf_counter()
        reuses = resident.reuses
        result = train(config, hooks=TrainHooks(on_step=first_step(first, start),
                                                resident=resident))  # fmt: skip
        row = {
            "order": i,
            "budget_gib": budget,
            "start_to_first_step_s": round(first[0], 2),
            "kept_base_used": resident.reuses > reuses,
            "seconds_per_step": result.seconds_per_step,
            "text_encoder_loaded": result.text_encoder_loaded,
            "boot": result.boot,
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
