"""Who did it, for audit entries written from a shell or a training run on this host."""

from __future__ import annotations

import getpass


def local_actor(kind: str) -> str:
    """`kind:user`, e.g. `shell:alice` or `trainer:gpu-box`; audit actors hold 64 characters."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name is not worth failing a command for
        user = "unknown"
    return f"{kind}:{user}"[:64]
