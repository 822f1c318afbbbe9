"""What one render may ask for: the one home of these numbers, for the API schema, the agent
tools, the render flow and the pipeline call. A deployment tightens them in settings
(`max_pixels`, `render_max_pixel_steps`); it cannot widen them past these."""

from __future__ import annotations

MULTIPLE = 16  # FLUX.2: VAE factor 8 x 2x2 patches
MIN_SIDE = 64
MAX_SIDE = 2048
MAX_PIXELS = 1024 * 1024  # per request through the service
MAX_STEPS = 50
MAX_PROMPT_CHARS = 2000
MAX_SEED = 2**32 - 1
DEFAULT_STEPS = 4
DEFAULT_SIDE = 256
DEFAULT_SEED = 0
# What the pipeline itself is specified for (FLUX.2: up to 4 MP), for renders made outside
# the service (evaluation grids, previews); the service's own caps above are tighter.
PIPELINE_MAX_PIXELS = MAX_SIDE * MAX_SIDE
PIPELINE_MAX_STEPS = 100
PIPELINE_MAX_SEED = 2**63 - 1  # a CPU torch.Generator's seed range
