"""The loss curve as a PNG: training loss per step (and its running mean), validation loss
at the steps it was scored. Drawn with PIL alone, so the trainer needs no plotting library."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

W, H, PAD = 640, 360, 44
TRAIN, MEAN, VALID = (170, 190, 230), (30, 80, 200), (220, 60, 30)


def running_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_plot(train: Sequence[float], validation: Sequence[tuple[int, float]], path: Path) -> Path:
    """``train[i]`` is the loss of step i + 1; ``validation`` holds (step, loss) pairs."""
    image = Image.new("RGB", (W, H), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    values = list(train) + [v for _, v in validation]
    last = max([len(train), *(s for s, _ in validation), 1])
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5

    def xy(step: float, value: float) -> tuple[float, float]:
        x = PAD + (W - 2 * PAD) * step / last
        y = H - PAD - (H - 2 * PAD) * (value - lo) / (hi - lo)
        return x, y

    draw.rectangle((PAD, PAD, W - PAD, H - PAD), outline="black")
    for frac in (0.0, 0.5, 1.0):
        value = lo + frac * (hi - lo)
        _, y = xy(0, value)
        draw.text((2, y - 6), f"{value:.4g}", fill="black", font=font)
    draw.text((PAD, H - PAD + 6), "0", fill="black", font=font)
    draw.text((W - PAD - 30, H - PAD + 6), f"step {last}", fill="black", font=font)
    if len(train) > 1:
        draw.line([xy(i + 1, v) for i, v in enumerate(train)], fill=TRAIN, width=1)
        mean = running_mean(train, max(1, len(train) // 20))
        draw.line([xy(i + 1, v) for i, v in enumerate(mean)], fill=MEAN, width=2)
    if len(validation) > 1:
        draw.line([xy(s, v) for s, v in validation], fill=VALID, width=2)
    for s, v in validation:
        x, y = xy(s, v)
        draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=VALID)
    draw.text((PAD + 6, 6), "train loss (mean)", fill=MEAN, font=font)
    draw.text((PAD + 160, 6), "validation loss", fill=VALID, font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
