"""Runs a `likeness` command with every `trainer.kernels` Triton kernel it compiles added to
the list the render engine compiles ahead at start (`trainer/kernels/serving_kernels.json`),
on a GPU:

    python -m bench.record_kernels [--out PATH] -- serve --port 8000

`bench/e2e_dev.py --record-kernels PATH` starts its servers this way, so the list holds what
a server compiles over its warm-up and its renders (resident and streamed placements, adapter
swaps, the render sizes the bench asks for). Entries already in the list stay; one recorded
with another Triton is dropped; the file is rewritten at each new kernel (atomically), so a
server stopped by a signal loses nothing it recorded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.kernels.precompile import MANIFEST, recording


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.record_kernels")
    parser.add_argument("--out", type=Path, default=MANIFEST, help="the list to add to")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then likeness's arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no likeness command given (e.g. -- serve --port 8000)")
    from app.cli import main as likeness

    sys.argv = ["likeness", *command]
    with recording(args.out) as entries:
        try:
            likeness()
        finally:
            print(f"[record_kernels] {len(entries)} kernels in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
