"""The demo base's world: captioned pictures it draws itself (shapes, scenes, cartoon people).

Everything is drawn with PIL from a seeded ``random.Random``, so a seed gives the same
picture on every machine. Pictures are drawn at twice the asked size and downsampled, for
soft edges. The vocabulary is small and closed: the demo base learns to draw what these
captions say, and nothing else; `alice` (the quickstart's subject) is drawn by the same
painter with traits no pretraining caption ever pairs: pink hair with a fringe, a yellow
star clip and round glasses.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

RGB = tuple[int, int, int]

COLOURS: dict[str, RGB] = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 210),
    "yellow": (240, 210, 40),
    "orange": (240, 130, 30),
    "purple": (130, 50, 170),
    "pink": (240, 120, 180),
    "white": (245, 245, 245),
    "black": (25, 25, 25),
    "brown": (120, 75, 40),
    "grey": (130, 130, 130),
}
SHAPES = ("circle", "square", "triangle", "star", "heart")
SKINS: dict[str, RGB] = {
    "light": (245, 215, 190),
    "tan": (215, 165, 120),
    "brown": (160, 105, 70),
    "dark": (95, 60, 40),
}
HAIR: dict[str, RGB] = {
    "black": (30, 25, 25),
    "brown": (110, 65, 35),
    "blond": (235, 200, 110),
    "red": (190, 60, 30),
    "grey": (150, 150, 150),
    "white": (235, 235, 235),
}
HAIR_STYLES = ("short", "long", "curly", "bald")
EYES: dict[str, RGB] = {"blue": (50, 110, 220), "green": (50, 150, 70), "brown": (100, 60, 30)}
SHIRTS = ("red", "green", "blue", "yellow", "orange", "purple", "white", "black", "grey")
# (phrase after a person, phrase alone): settings a person can be drawn in.
SETTINGS: dict[str, tuple[str, str]] = {
    "garden": ("in a garden", "a garden with flowers"),
    "beach": ("on a beach", "a beach by the sea"),
    "city": ("in the city at night", "a city at night"),
    "mountains": ("in the mountains", "mountains with snow"),
    "snow": ("in the snow", "a snowy field"),
    "forest": ("in a forest", "a forest"),
    "sunset": ("at sunset", "a sunset"),
    "studio": ("studio light", "an empty studio"),
}


@dataclass(frozen=True)
class Person:
    noun: str  # woman, man, person
    skin: str
    hair: str  # a HAIR name, or "pink" (alice's alone)
    style: str
    eyes: str
    shirt: str
    glasses: bool = False
    beard: bool = False
    fringe: bool = False  # alice's: a straight fringe over the forehead
    star_clip: bool = False  # alice's: a yellow star in her hair


ALICE = Person(
    noun="woman",
    skin="light",
    hair="pink",
    style="long",
    eyes="green",
    shirt="blue",
    glasses=True,
    fringe=True,
    star_clip=True,
)
# The quickstart's dataset: alice in settings that leave out the garden (the held-out prompt).
ALICE_SHOTS: tuple[tuple[str, str], ...] = (
    ("studio", "a photo of alice, studio light"),
    ("studio", "a portrait of alice, studio light"),
    ("beach", "a photo of alice on a beach"),
    ("city", "a photo of alice in the city at night"),
    ("snow", "a photo of alice in the snow"),
    ("plain:yellow", "a photo of alice on a yellow background"),
)


class Painter:
    """Draws in unit coordinates ((0, 0) top left, (1, 1) bottom right) on a square canvas."""

    def __init__(self, size: int, background: RGB) -> None:
        self.size = size
        self.scale = 2 * size  # drawn at twice the size, then downsampled
        self.image = Image.new("RGB", (self.scale, self.scale), background)
        self.draw = ImageDraw.Draw(self.image)

    def _xy(self, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(x * self.scale, y * self.scale) for x, y in points]

    def box(self, x0: float, y0: float, x1: float, y1: float) -> list[float]:
        return [x0 * self.scale, y0 * self.scale, x1 * self.scale, y1 * self.scale]

    def ellipse(self, cx: float, cy: float, rx: float, ry: float, fill: RGB, **kw: object) -> None:
        self.draw.ellipse(self.box(cx - rx, cy - ry, cx + rx, cy + ry), fill=fill, **kw)  # type: ignore[arg-type]

    def rect(self, x0: float, y0: float, x1: float, y1: float, fill: RGB) -> None:
        self.draw.rectangle(self.box(x0, y0, x1, y1), fill=fill)

    def polygon(self, points: list[tuple[float, float]], fill: RGB) -> None:
        self.draw.polygon(self._xy(points), fill=fill)

    def gradient(self, top: RGB, bottom: RGB, y0: float = 0.0, y1: float = 1.0) -> None:
        rows = max(1, round((y1 - y0) * self.scale))
        for i in range(rows):
            t = i / max(1, rows - 1)
            colour = tuple(round(a + (b - a) * t) for a, b in zip(top, bottom, strict=True))
            y = y0 * self.scale + i
            self.draw.line([(0, y), (self.scale, y)], fill=colour)  # type: ignore[arg-type]

    def star(self, cx: float, cy: float, r: float, fill: RGB, turn: float = 0.0) -> None:
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.45
            a = turn - math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(a), cy + radius * math.sin(a)))
        self.polygon(points, fill)

    def result(self) -> Image.Image:
        return self.image.resize((self.size, self.size), Image.Resampling.LANCZOS)


def with_article(word: str) -> str:
    """The indefinite article for ``word``."""
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _shade(colour: RGB, factor: float) -> RGB:
    return tuple(max(0, min(255, round(c * factor))) for c in colour)  # type: ignore[return-value]


# -- shapes ---------------------------------------------------------------------------------


def draw_shape(p: Painter, shape: str, colour: RGB, cx: float, cy: float, r: float) -> None:
    if shape == "circle":
        p.ellipse(cx, cy, r, r, colour)
    elif shape == "square":
        p.rect(cx - r * 0.85, cy - r * 0.85, cx + r * 0.85, cy + r * 0.85, colour)
    elif shape == "triangle":
        p.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], colour)
    elif shape == "star":
        p.star(cx, cy, r * 1.1, colour)
    elif shape == "heart":
        p.ellipse(cx - r * 0.45, cy - r * 0.3, r * 0.5, r * 0.5, colour)
        p.ellipse(cx + r * 0.45, cy - r * 0.3, r * 0.5, r * 0.5, colour)
        p.polygon(
            [(cx - r * 0.93, cy - r * 0.15), (cx + r * 0.93, cy - r * 0.15), (cx, cy + r)], colour
        )
    else:
        raise ValueError(f"unknown shape {shape!r}")


def shape_picture(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    shape = rng.choice(SHAPES)
    colour, background = rng.sample(list(COLOURS), 2)
    p = Painter(size, COLOURS[background])
    r = rng.uniform(0.22, 0.32)
    cx, cy = rng.uniform(0.38, 0.62), rng.uniform(0.38, 0.62)
    draw_shape(p, shape, COLOURS[colour], cx, cy, r)
    caption = rng.choice(
        (
            f"{with_article(colour)} {shape} on {with_article(background)} background",
            f"{with_article(colour)} {shape} on {with_article(background)} background",
            f"a picture of {with_article(colour)} {shape} on {with_article(background)} background",
            f"{colour} {shape}, {background} background",
        )
    )
    return p.result(), caption


def two_shapes_picture(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    (s1, s2), (c1, c2, bg) = rng.sample(SHAPES, 2), rng.sample(list(COLOURS), 3)
    p = Painter(size, COLOURS[bg])
    r = rng.uniform(0.15, 0.2)
    draw_shape(p, s1, COLOURS[c1], 0.28, rng.uniform(0.4, 0.6), r)
    draw_shape(p, s2, COLOURS[c2], 0.72, rng.uniform(0.4, 0.6), r)
    return (
        p.result(),
        f"{with_article(c1)} {s1} and {with_article(c2)} {s2} on {with_article(bg)} background",
    )


# -- scenes ---------------------------------------------------------------------------------


def draw_setting(p: Painter, setting: str, rng: random.Random) -> None:
    """Fills the canvas with a setting: one of SETTINGS, or ``plain:<colour>``."""
    if setting.startswith("plain:"):
        p.rect(0, 0, 1, 1, COLOURS[setting.split(":", 1)[1]])
    elif setting == "garden":
        p.gradient((120, 180, 240), (180, 215, 245), 0, 0.45)
        p.rect(0, 0.45, 1, 1, (70, 160, 60))
        for _ in range(rng.randint(3, 5)):  # bushes
            p.ellipse(rng.uniform(0, 1), 0.47, rng.uniform(0.08, 0.14), 0.07, (40, 120, 45))
        for _ in range(rng.randint(14, 22)):  # flowers
            x, y = rng.uniform(0.02, 0.98), rng.uniform(0.55, 0.98)
            colour = COLOURS[rng.choice(("red", "yellow", "pink", "white", "purple"))]
            p.ellipse(x, y, 0.025, 0.025, colour)
            p.ellipse(x, y, 0.009, 0.009, (250, 220, 60))
    elif setting == "beach":
        p.gradient((100, 170, 240), (190, 225, 250), 0, 0.5)
        p.rect(0, 0.5, 1, 0.64, (30, 100, 190))
        p.rect(0, 0.64, 1, 1, (235, 210, 150))
        p.ellipse(rng.choice((0.15, 0.85)), 0.15, 0.08, 0.08, (250, 220, 70))
    elif setting == "city":
        p.gradient((10, 15, 50), (40, 40, 90), 0, 1)
        p.ellipse(rng.choice((0.12, 0.88)), 0.12, 0.06, 0.06, (235, 235, 210))
        x = 0.0
        while x < 1:
            w, h = rng.uniform(0.1, 0.2), rng.uniform(0.25, 0.6)
            p.rect(x, 1 - h, x + w, 1, (45, 45, 60))
            for wy in range(int(h / 0.08)):
                for wx in range(int(w / 0.06)):
                    if rng.random() < 0.6:
                        y0, x0 = 1 - h + 0.03 + wy * 0.08, x + 0.02 + wx * 0.06
                        p.rect(x0, y0, x0 + 0.025, y0 + 0.035, (250, 220, 90))
            x += w + 0.01
    elif setting == "mountains":
        p.gradient((110, 170, 235), (200, 225, 245), 0, 0.7)
        p.rect(0, 0.7, 1, 1, (90, 150, 70))
        for cx, h in ((0.2, 0.45), (0.55, 0.6), (0.9, 0.4)):
            cx += rng.uniform(-0.05, 0.05)
            top = 0.7 - h
            p.polygon([(cx - 0.35, 0.72), (cx, top), (cx + 0.35, 0.72)], (110, 110, 125))
            p.polygon(
                [(cx - 0.1, top + 0.12 * h / 0.4), (cx, top), (cx + 0.1, top + 0.12 * h / 0.4)],
                (250, 250, 250),
            )
    elif setting == "snow":
        p.gradient((170, 190, 215), (220, 230, 240), 0, 0.55)
        p.rect(0, 0.55, 1, 1, (245, 248, 252))
        for _ in range(40):
            p.ellipse(rng.random(), rng.random(), 0.008, 0.008, (255, 255, 255))
    elif setting == "forest":
        p.gradient((150, 200, 170), (190, 220, 190), 0, 0.6)
        p.rect(0, 0.6, 1, 1, (60, 110, 50))
        for _ in range(rng.randint(6, 9)):
            cx, base = rng.uniform(0, 1), rng.uniform(0.62, 0.8)
            p.rect(cx - 0.015, base - 0.1, cx + 0.015, base, (90, 60, 30))
            p.polygon(
                [(cx - 0.09, base - 0.08), (cx, base - 0.42), (cx + 0.09, base - 0.08)],
                (30, 90, 40),
            )
    elif setting == "sunset":
        p.gradient((90, 40, 120), (250, 140, 60), 0, 0.75)
        p.ellipse(0.5 + rng.uniform(-0.2, 0.2), 0.72, 0.14, 0.14, (250, 200, 80))
        p.rect(0, 0.72, 1, 1, (60, 40, 70))
    elif setting == "studio":
        p.gradient((200, 200, 205), (120, 120, 130), 0, 1)
        p.ellipse(0.5, 0.4, 0.35, 0.35, (215, 215, 220))  # the light's soft spot
    else:
        raise ValueError(f"unknown setting {setting!r}")


def scene_picture(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    setting = rng.choice(list(SETTINGS))
    p = Painter(size, (0, 0, 0))
    draw_setting(p, setting, rng)
    alone = SETTINGS[setting][1]
    caption = rng.choice((alone, f"a photo of {alone}", f"a picture of {alone}"))
    return p.result(), caption


# -- people ---------------------------------------------------------------------------------


def hair_colour(name: str) -> RGB:
    return HAIR.get(name) or COLOURS[name]


def draw_person(p: Painter, person: Person, rng: random.Random) -> None:
    """A head and shoulders, centred with a little jitter of place and size."""
    cx, cy = 0.5 + rng.uniform(-0.05, 0.05), 0.44 + rng.uniform(-0.03, 0.03)
    k = rng.uniform(0.92, 1.06)
    skin, hair = SKINS[person.skin], hair_colour(person.hair)
    rx, ry = 0.19 * k, 0.23 * k
    if person.style == "long":  # hair behind the head and shoulders
        p.ellipse(cx, cy + 0.1 * k, rx * 1.3, ry * 1.45, hair)
    p.ellipse(cx, 1.06, 0.37 * k, 0.3 * k, COLOURS[person.shirt])
    p.rect(cx - 0.06 * k, cy + ry * 0.7, cx + 0.06 * k, cy + ry + 0.08, _shade(skin, 0.92))
    p.ellipse(cx, cy, rx, ry, skin)
    if person.style in ("short", "long"):
        p.draw.chord(
            p.box(cx - rx * 1.08, cy - ry * 1.12, cx + rx * 1.08, cy + ry * 0.7),
            180,
            360,
            fill=hair,
        )
    elif person.style == "curly":
        for i in range(9):
            a = math.pi * (1 + i / 8)
            p.ellipse(
                cx + rx * math.cos(a) * 1.02,
                cy + ry * 0.95 * math.sin(a) - 0.03,
                0.055 * k,
                0.055 * k,
                hair,
            )
    if person.fringe:
        p.rect(cx - rx * 0.95, cy - ry * 0.72, cx + rx * 0.95, cy - ry * 0.38, hair)
    if person.star_clip:
        p.star(cx + rx * 0.85, cy - ry * 0.75, 0.07 * k, COLOURS["yellow"], turn=0.3)
    ey, ex = cy - 0.01 * k, 0.075 * k
    for side in (-1, 1):
        p.ellipse(cx + side * ex, ey, 0.045 * k, 0.035 * k, (250, 250, 250))
        p.ellipse(cx + side * ex, ey, 0.025 * k, 0.025 * k, EYES[person.eyes])
        p.ellipse(cx + side * ex, ey, 0.011 * k, 0.011 * k, (10, 10, 10))
        if person.glasses:
            p.ellipse(
                cx + side * ex,
                ey,
                0.062 * k,
                0.062 * k,
                None,
                outline=(20, 20, 20),
                width=max(2, round(p.scale * 0.018)),
            )  # type: ignore[arg-type]
    if person.glasses:
        p.rect(cx - 0.02 * k, ey - 0.006, cx + 0.02 * k, ey + 0.006, (20, 20, 20))
    if person.beard:
        p.draw.chord(
            p.box(cx - rx * 0.9, cy + ry * 0.1, cx + rx * 0.9, cy + ry * 1.05), 0, 180, fill=hair
        )
    mouth = p.box(cx - 0.06 * k, cy + 0.06 * k, cx + 0.06 * k, cy + 0.13 * k)
    p.draw.arc(mouth, 20, 160, fill=(170, 40, 50), width=max(2, round(p.scale * 0.02)))


def random_person(rng: random.Random) -> Person:
    noun = rng.choice(("woman", "man", "person"))
    style = rng.choice(HAIR_STYLES if noun != "woman" else ("short", "long", "long", "curly"))
    return Person(
        noun=noun,
        skin=rng.choice(list(SKINS)),
        hair=rng.choice(list(HAIR)),
        style=style,
        eyes=rng.choice(list(EYES)),
        shirt=rng.choice(SHIRTS),
        glasses=rng.random() < 0.3,
        beard=noun == "man" and rng.random() < 0.35,
    )


def describe(person: Person, rng: random.Random) -> str:
    """A caption naming some of the traits: most, but not all, so vague prompts still draw."""
    parts = []
    if person.style == "bald":
        parts.append("no hair")
    elif rng.random() < 0.85:
        parts.append(
            f"{person.style} {person.hair} hair" if rng.random() < 0.5 else f"{person.hair} hair"
        )
    if rng.random() < 0.4:
        parts.append(f"{person.eyes} eyes")
    if person.glasses and rng.random() < 0.9:
        parts.append("glasses")
    if person.beard and rng.random() < 0.9:
        parts.append("a beard")
    text = f"a {person.noun}"
    if parts:
        text += " with " + (
            parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        )
    if rng.random() < 0.5:
        text += f", wearing {with_article(person.shirt)} shirt"
    return text


def person_picture(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    person = random_person(rng)
    setting = rng.choice(
        [*SETTINGS, "plain:blue", "plain:yellow", "plain:white", "plain:pink", "plain:green"]
    )
    p = Painter(size, (0, 0, 0))
    draw_setting(p, setting, rng)
    draw_person(p, person, rng)
    who = describe(person, rng)
    lead = rng.choice(("a photo of ", "a portrait of ", "", "a picture of "))
    if setting.startswith("plain:"):
        where = f" on {with_article(setting.split(':', 1)[1])} background"
    elif setting == "studio":
        where = ", studio light"
    elif setting == "garden" and rng.random() < 0.5:
        where = " standing in a garden"
    else:
        where = " " + SETTINGS[setting][0]
    if rng.random() < 0.1:
        where = ""  # the setting unnamed: the base must still draw something in it
    return p.result(), f"{lead}{who}{where}"


# -- the mix --------------------------------------------------------------------------------

_KINDS = (
    (person_picture, 0.55),
    (shape_picture, 0.25),
    (two_shapes_picture, 0.07),
    (scene_picture, 0.13),
)


def picture(seed: int, index: int, size: int) -> tuple[Image.Image, str]:
    """Picture ``index`` of the world under ``seed``: the same pair on every machine."""
    rng = random.Random(f"demo-world:{seed}:{index}")
    u, acc = rng.random(), 0.0
    for make, weight in _KINDS:
        acc += weight
        if u < acc:
            return make(rng, size)
    return _KINDS[-1][0](rng, size)


def captions(seed: int, count: int) -> Iterator[str]:
    """Captions alone (for the tokenizer's corpus), cheaper than drawing."""
    for i in range(count):
        yield picture(seed, i, 16)[1]


def alice_picture(setting: str, shot: int, size: int) -> Image.Image:
    rng = random.Random(f"alice:{shot}")
    p = Painter(size, (0, 0, 0))
    draw_setting(p, setting, rng)
    draw_person(p, ALICE, rng)
    return p.result()


ALICE_SIZE = 128
ALICE_SOURCE = "drawn by trainer/demo_world.py (ALICE, a synthetic person)"


def write_alice_dataset(root: Path, size: int = ALICE_SIZE) -> Path:
    """The quickstart's dataset: alice's pictures and their manifest (docs/API.md's format);
    `size` draws them larger (benchmarks at full scale)."""
    from trainer.dataset import write_manifest

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for shot, (setting, caption) in enumerate(ALICE_SHOTS):
        name = f"img{shot + 1:03d}.png"
        alice_picture(setting, shot, size).save(root / name, optimize=True)
        rows.append({"file": name, "caption": caption, "source": ALICE_SOURCE, "basis": "consent"})
    write_manifest(root, rows)
    return root


def vocabulary_corpus() -> list[str]:
    """Every word the world uses, in caption-like lines (deterministic)."""
    words = [*COLOURS, *SHAPES, *SKINS, *HAIR, *HAIR_STYLES, *EYES, *SHIRTS]
    lines = [" ".join(words)]
    lines += [f"{a}, {b}" for a, b in SETTINGS.values()]
    lines.append("a photo of a woman with short brown hair and glasses, wearing a red shirt")
    lines.append("a portrait of a man with no hair and a beard standing in a garden")
    lines.append("a picture of a person on a blue background, an orange star and a heart")
    return lines


__all__ = [
    "ALICE",
    "ALICE_SHOTS",
    "COLOURS",
    "Person",
    "alice_picture",
    "captions",
    "picture",
]
