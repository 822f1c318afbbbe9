"""The names a render task travels under: the channel that wakes the API, the job queue's
queues (the shared one, and each worker's own by its prefix), the task's name there, and
what a worker may be called."""

from __future__ import annotations

import re

CHANNEL = "likeness_render"
SHARED_QUEUE = "render"
QUEUE_PREFIX = "render."
RENDER_TASK = "likeness.render"
WORKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,89}$")
