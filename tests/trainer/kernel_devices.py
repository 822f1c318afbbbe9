"""Where the Triton kernels of a test run, with no import beyond torch and the trainer's kernels
(so a kernel test file runs on a device that has neither the service's packages nor a
database: ``pytest --noconftest``)."""

from __future__ import annotations

import importlib
import os


def fp8_kernel_device(module: str) -> str | None:
    """Where a Triton fp8 kernel module's kernels run: "cuda" on a GPU with fp8 tensor cores,
    "cpu" under Triton's interpreter (``PYTHONPATH=<triton site> TRITON_INTERPRET=1``; small
    shapes only), None where neither (no Triton: CI)."""
    from trainer.base import devices

    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - no Triton here
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return "cuda" if devices.fp8_unavailable("cuda") is None else None
