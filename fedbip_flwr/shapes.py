"""The built-in miniature multi-domain dataset ("shapes"), generated in memory.

FedBiP's setting is *feature heterogeneity*: every client holds a few labelled images of the
same classes, but each client's images come from one visual domain (DomainNet's photo, clipart,
painting, sketch, quickdraw). This module is a small, download-free stand-in for that world:
6 geometric shape classes drawn in 5 visually distinct styles, 64x64 RGB by default, so the
whole pipeline (miniature LDM, clients, server, classifier) runs on a CPU.

Design choices, and why:

* **Deterministic per image.** Every image gets its own RNG derived from
  ``(seed, split, domain, client_index, class, i)`` via :class:`numpy.random.SeedSequence`, so an
  image never depends on how many other images were generated before it, client shards are
  reproducible on any machine, and client / test / pretraining splits never share an image.
* **Every domain is learnable.** Styles change colour, texture, line quality and background but
  never hide the silhouette: a ResNet-18 trained on one client's 16 shots per class must reach
  >= 80 % on that domain's test split (``tests/test_shapes.py`` checks it for every domain).
  A style made of random brush-stroke noise was measured to be unlearnable, so the painting
  strokes here are clipped to the shape and the canvas strokes are low-contrast.
* **Antialiased and fast.** Shapes are drawn with PIL at 4x resolution and box-downsampled;
  one 64x64 image costs a few milliseconds, so thousands of images take seconds, not minutes.
* **Tensor layout matches the VAE.** :class:`ImageSet` holds ``(N, 3, H, W)`` float32 in
  ``[-1, 1]``; :func:`fedbip_flwr.viz.to_uint8` undoes the scaling for saving PNGs.
"""

from __future__ import annotations

import colorsys
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageChops, ImageDraw, ImageFilter

from .viz import to_uint8

CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross", "heart")
# Shapes no task of this world uses: the miniature's "ImageNet", public classes a classifier may
# be pretrained on without ever seeing a task's labels (scripts/pretrain_backbone.py).
PUBLIC_CLASSES: tuple[str, ...] = (
    "pentagon",
    "hexagon",
    "arrow",
    "crescent",
    "trapezoid",
    "bolt",
    "ell",
    "house",
)
_ALL_CLASSES = CLASSES + PUBLIC_CLASSES
DOMAINS: tuple[str, ...] = ("photo", "clipart", "painting", "sketch", "quickdraw")
COMMON_DOMAINS: tuple[str, ...] = ("photo", "clipart", "painting")
RARE_DOMAINS: tuple[str, ...] = ("sketch", "quickdraw")
# The sentence the miniature LDM's pretraining captions use to name a domain and a class, with
# {S} and {V} where the words go. The shapes prompt template is this same sentence: learned
# concepts then sit where the model learned those words, and unlearned ones say exactly what
# the captions said (a template with a word the model never saw, such as "style", blurs the
# classes; BENCHMARKS.md measures it).
CAPTION_TEMPLATE = "a {S} of a {V}"

# Split codes enter the per-image seed, which keeps the splits disjoint.
_SPLITS: dict[str, int] = {"train": 0, "test": 1, "pretrain": 2, "public": 3}
_SUPERSAMPLE = 4  # draw at 4x, then box-downsample: cheap antialiasing

Point = tuple[float, float]
RGB = tuple[int, int, int]


@dataclass(frozen=True)
class ImageSet:
    """A labelled set of images from one domain, in the layout the VAE expects.

    ``images`` is ``(N, 3, H, W)`` float32 in ``[-1, 1]``; ``labels`` is ``(N,)`` int64 indexing
    ``classes`` (so a subset of :data:`CLASSES` is relabelled ``0..len(classes)-1``).
    """

    images: torch.Tensor
    labels: torch.Tensor
    classes: tuple[str, ...]
    domain: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _check_domain(domain: str) -> str:
    """Exact-match a domain name; a typo must fail loudly, not silently pick another domain."""
    if not isinstance(domain, str) or domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; valid domains: {', '.join(DOMAINS)}")
    return domain


def _check_names(kind: str, names: Sequence[str], valid: tuple[str, ...]) -> tuple[str, ...]:
    """Exact-match a non-empty sequence of ``kind`` ("class", "domain") names against ``valid``."""
    kinds = kind + ("es" if kind.endswith("s") else "s")
    if isinstance(names, str):
        raise ValueError(f"{kinds} must be a sequence of names, got the string {names!r}")  # noqa: TRY004
    out = tuple(names)
    if not out:
        raise ValueError(f"{kinds} must not be empty; valid {kinds}: {', '.join(valid)}")
    for name in out:
        if not isinstance(name, str) or name not in valid:
            raise ValueError(f"unknown {kind} {name!r}; valid {kinds}: {', '.join(valid)}")
    return out


def _check_classes(classes: Sequence[str], valid: tuple[str, ...] = CLASSES) -> tuple[str, ...]:
    """Exact-match class names (no duplicates, at least one)."""
    out = _check_names("class", classes, valid)
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate class names in {out}")
    return out


def _check_nonneg(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------------------------
# geometry: shapes as polygons in unit coordinates (y up, centred, radius ~1)
# --------------------------------------------------------------------------------------------
def _regular(n: int, radius: float, phase: float = math.pi / 2) -> list[Point]:
    return [
        (
            radius * math.cos(phase + 2 * math.pi * k / n),
            radius * math.sin(phase + 2 * math.pi * k / n),
        )
        for k in range(n)
    ]


def _unit_shape(cls: str) -> list[Point]:
    """Outline of a class in unit coordinates; sizes are balanced so areas look comparable."""
    if cls == "circle":
        return _regular(48, 0.85)
    if cls == "square":
        return _regular(4, 1.0, math.pi / 4)  # half-side ~0.71
    if cls == "triangle":
        pts = _regular(3, 1.1)
        return [(x, y - 0.12) for x, y in pts]  # centre the bounding box, not the centroid
    if cls == "star":
        return [
            (
                r * math.cos(math.pi / 2 + math.pi * k / 5),
                r * math.sin(math.pi / 2 + math.pi * k / 5),
            )
            for k in range(10)
            for r in ((1.05 if k % 2 == 0 else 0.45),)
        ]
    if cls == "cross":
        a, b = 0.3, 0.92  # arm half-width, arm length
        return [
            (a, b),
            (-a, b),
            (-a, a),
            (-b, a),
            (-b, -a),
            (-a, -a),
            (-a, -b),
            (a, -b),
            (a, -a),
            (b, -a),
            (b, a),
            (a, a),
        ]
    if cls == "heart":
        pts = []
        for k in range(48):
            t = 2 * math.pi * k / 48
            x = 16 * math.sin(t) ** 3
            y = 13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t) - math.cos(4 * t)
            pts.append((x / 16.5, (y + 2.5) / 15.5))
        return pts
    return _public_shape(cls)


def _public_shape(cls: str) -> list[Point]:
    """Outlines of :data:`PUBLIC_CLASSES`, in the unit coordinates of :func:`_unit_shape`."""
    if cls == "pentagon":
        return _regular(5, 1.0)
    if cls == "hexagon":
        return _regular(6, 0.95, 0.0)
    if cls == "arrow":
        return [
            (-0.95, 0.22),
            (0.2, 0.22),
            (0.2, 0.6),
            (0.95, 0.0),
            (0.2, -0.6),
            (0.2, -0.22),
            (-0.95, -0.22),
        ]
    if cls == "crescent":
        outer = [
            (0.9 * math.cos(t), 0.9 * math.sin(t))
            for t in np.linspace(math.pi / 2, 3 * math.pi / 2, 25)
        ]
        inner = [
            (0.25 + 0.6 * math.cos(t), 0.9 * math.sin(t))
            for t in np.linspace(3 * math.pi / 2, math.pi / 2, 25)
        ]
        return outer + inner
    if cls == "trapezoid":
        return [(-0.95, -0.55), (0.95, -0.55), (0.45, 0.55), (-0.45, 0.55)]
    if cls == "bolt":
        return [
            (0.15, 1.0),
            (-0.55, -0.05),
            (-0.05, -0.05),
            (-0.25, -1.0),
            (0.55, 0.15),
            (0.05, 0.15),
        ]
    if cls == "ell":
        return [
            (-0.7, 0.95),
            (-0.25, 0.95),
            (-0.25, -0.45),
            (0.7, -0.45),
            (0.7, -0.9),
            (-0.7, -0.9),
        ]
    if cls == "house":
        return [(-0.7, -0.85), (0.7, -0.85), (0.7, 0.15), (0.0, 0.95), (-0.7, 0.15)]
    raise ValueError(f"unknown class {cls!r}; valid classes: {', '.join(_ALL_CLASSES)}")


@dataclass(frozen=True)
class _Pose:
    """Where a shape sits in the (supersampled) canvas."""

    cx: float
    cy: float
    radius: float
    angle: float  # radians

    def place(self, pts: Sequence[Point]) -> list[Point]:
        c, s = math.cos(self.angle), math.sin(self.angle)
        return [
            (self.cx + self.radius * (c * x - s * y), self.cy - self.radius * (s * x + c * y))
            for x, y in pts
        ]


def _random_pose(rng: np.random.Generator, canvas: int) -> _Pose:
    """Random scale, rotation and position, keeping the whole shape inside the frame."""
    radius = canvas * rng.uniform(0.24, 0.38)
    margin = radius * 1.08 + canvas * 0.03
    cx = rng.uniform(margin, canvas - margin)
    cy = rng.uniform(margin, canvas - margin)
    angle = math.radians(rng.uniform(-45.0, 45.0))
    return _Pose(cx, cy, radius, angle)


def _densify(pts: Sequence[Point], spacing: float) -> list[Point]:
    """Closed outline resampled every ~``spacing`` units, keeping the corners (sharp stars)."""
    out: list[Point] = []
    n = len(pts)
    for k in range(n):
        (x0, y0), (x1, y1) = pts[k], pts[(k + 1) % n]
        steps = max(1, int(math.hypot(x1 - x0, y1 - y0) / spacing))
        out.extend((x0 + (x1 - x0) * j / steps, y0 + (y1 - y0) * j / steps) for j in range(steps))
    return out


def _wobble(
    pts: list[Point], rng: np.random.Generator, amplitude: float, jitter: float
) -> np.ndarray:
    """Hand-drawn line: a smooth low-frequency drift plus small per-point jitter."""
    arr = np.asarray(pts, dtype=np.float64)
    n = len(arr)
    t = np.linspace(0.0, 2 * math.pi, n, endpoint=False)
    drift = np.zeros_like(arr)
    for freq in (1, 2, 3):
        ph = rng.uniform(0, 2 * math.pi, size=2)
        amp = rng.normal(0, amplitude / freq, size=2)
        drift += amp * np.sin(freq * t[:, None] + ph)
    return arr + drift + rng.normal(0.0, jitter, size=arr.shape)


# --------------------------------------------------------------------------------------------
# colour and texture helpers
#
# Geometry (polygons, lines, strokes) is drawn at ``_SUPERSAMPLE`` x resolution and box-reduced
# with PIL (antialiasing, in C); smooth colour fields are computed at the output resolution,
# where they cost 16x less.
# --------------------------------------------------------------------------------------------
def _hsv(h: float, s: float, v: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v), dtype=np.float32) * 255.0


def _rgb(colour: np.ndarray) -> RGB:
    c = np.clip(np.rint(colour), 0, 255).astype(int)
    return int(c[0]), int(c[1]), int(c[2])


def _poly_layer(canvas: int, polys: Sequence[Sequence[Point]]) -> Image.Image:
    """Filled polygon(s) as a supersampled ``L`` image (255 inside)."""
    img = Image.new("L", (canvas, canvas), 0)
    draw = ImageDraw.Draw(img)
    for p in polys:
        draw.polygon([(float(x), float(y)) for x, y in p], fill=255)
    return img


def _down(img: Image.Image) -> np.ndarray:
    """Box-reduce a supersampled layer to the output size; ``L`` -> [0, 1], ``RGB`` -> 0..255."""
    arr = np.asarray(img.reduce(_SUPERSAMPLE), dtype=np.float32)
    return arr / 255.0 if img.mode == "L" else arr


def _smooth_noise(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """Low-frequency noise in roughly [-1, 1]: bicubic upsampling of a cells x cells grid."""
    grid = rng.standard_normal((cells, cells)).astype(np.float32)
    img = Image.fromarray(grid, mode="F").resize((size, size), Image.BICUBIC)
    return np.asarray(img, dtype=np.float32)


def _blend(base: np.ndarray, colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha[..., None]
    return base * (1.0 - a) + colour * a


def _coords(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Output-pixel centres in supersampled canvas units (where poses live)."""
    c = (np.arange(size, dtype=np.float32) + 0.5) * _SUPERSAMPLE
    return c[None, :].repeat(size, 0), c[:, None].repeat(size, 1)


# --------------------------------------------------------------------------------------------
# domains: each returns an (size, size, 3) float array in 0..255 (clipped later)
# --------------------------------------------------------------------------------------------
def _photo(outline: list[Point], pose: _Pose, rng: np.random.Generator, size: int) -> np.ndarray:
    """Shaded, lit object with a soft shadow on a gradient, lightly textured background."""
    canvas = size * _SUPERSAMPLE
    xs, ys = _coords(size)
    # a lit object in front of a darker, muted backdrop (one polarity: a few shots must suffice)
    h_obj = rng.random()
    h_bg = h_obj + rng.uniform(0.25, 0.75)
    v_obj, v_bg = rng.uniform(0.75, 1.0), rng.uniform(0.2, 0.5)
    c1 = _hsv(h_bg, rng.uniform(0.15, 0.5), v_bg)
    c2 = _hsv(h_bg + rng.uniform(-0.08, 0.08), rng.uniform(0.15, 0.5), v_bg * rng.uniform(0.6, 0.9))
    g_ang = rng.uniform(0, 2 * math.pi)
    g = (xs - canvas / 2) * math.cos(g_ang) + (ys - canvas / 2) * math.sin(g_ang)
    g = np.clip(g / (canvas * 0.71) * 0.5 + 0.5, 0.0, 1.0)[..., None]
    img = c1 * (1 - g) + c2 * g
    texture = 8.0 * _smooth_noise(rng, size, 12) + 3.0 * _smooth_noise(rng, size, 40)
    img = img + texture[..., None]

    # soft shadow, cast away from a light that comes from the upper half
    light = rng.uniform(math.radians(200), math.radians(340))  # image coords: y down
    off = pose.radius * rng.uniform(0.1, 0.18)
    shadow_pts = [(x - off * math.cos(light), y - off * math.sin(light)) for x, y in outline]
    sh = _poly_layer(canvas, [shadow_pts]).reduce(_SUPERSAMPLE)
    sh = sh.filter(ImageFilter.GaussianBlur(pose.radius * 0.12 / _SUPERSAMPLE))
    img = img * (1.0 - 0.45 * np.asarray(sh, dtype=np.float32)[..., None] / 255.0)

    # object: colour shaded linearly along the light direction, plus a radial highlight
    base = _hsv(h_obj, rng.uniform(0.45, 0.9), v_obj)
    d = ((xs - pose.cx) * math.cos(light) + (ys - pose.cy) * math.sin(light)) / pose.radius
    shade = np.clip(1.0 + 0.35 * d, 0.45, 1.5)[..., None]
    hx = pose.cx + 0.4 * pose.radius * math.cos(light)
    hy = pose.cy + 0.4 * pose.radius * math.sin(light)
    hl = np.exp(-(((xs - hx) ** 2 + (ys - hy) ** 2) / (2 * (0.35 * pose.radius) ** 2)))[..., None]
    obj = base * shade + 70.0 * hl
    return _blend(img, obj, _down(_poly_layer(canvas, [outline])))


def _clipart(outline: list[Point], pose: _Pose, rng: np.random.Generator, size: int) -> np.ndarray:
    """Flat design: a saturated fill and a flat offset shadow on a plain light background, no
    outline. No common domain draws a line: with clipart's dark outline in the common domains, a
    classifier trained on them read line drawings (sketch, quickdraw) at 50-98%; without it, at
    chance, as a photo-trained classifier fails on DomainNet's quickdraw (BENCHMARKS.md)."""
    canvas = size * _SUPERSAMPLE
    bg = _hsv(rng.random(), rng.uniform(0.0, 0.12), rng.uniform(0.94, 1.0))
    fill = _hsv(rng.random(), rng.uniform(0.8, 1.0), rng.uniform(0.75, 1.0))
    img = np.broadcast_to(bg, (size, size, 3))
    offset = pose.radius * rng.uniform(0.06, 0.12)
    shadow = [(x + offset, y + offset) for x, y in outline]
    img = _blend(img, bg * 0.82, _down(_poly_layer(canvas, [shadow])))
    return _blend(img, fill, _down(_poly_layer(canvas, [outline])))


def _painting(outline: list[Point], pose: _Pose, rng: np.random.Generator, size: int) -> np.ndarray:
    """Broad brush strokes on a light tinted canvas; a dark, saturated shape painted in strokes of
    nearby hues that never cross its edge, whose outline wobbles a little. Dark on light and a
    steady edge keep the silhouette readable from 16 shots (Central >= 95%, BENCHMARKS.md)."""
    canvas = size * _SUPERSAMPLE
    h_bg = rng.random()
    canvas_col = _hsv(h_bg, rng.uniform(0.1, 0.25), rng.uniform(0.85, 0.97))
    layer = Image.new("RGB", (canvas, canvas), _rgb(canvas_col))
    draw = ImageDraw.Draw(layer)
    # low-contrast background strokes: visible texture that does not compete with the shape
    stroke_ang = rng.uniform(0, math.pi)
    for _ in range(14):
        col = canvas_col + rng.normal(0, 7, size=3)
        _stroke(
            draw,
            rng,
            stroke_ang,
            canvas * rng.uniform(0.2, 0.45),
            int(canvas * rng.uniform(0.06, 0.12)),
            col,
            (0, 0, canvas, canvas),
        )
    bg = _down(layer)

    # the shape: a saturated base colour, then broad strokes of nearby colours inside it
    h_obj = h_bg + rng.uniform(0.3, 0.7)
    base = _hsv(h_obj, rng.uniform(0.7, 0.95), rng.uniform(0.35, 0.6))
    obj_layer = Image.new("RGB", (canvas, canvas), _rgb(base))
    draw = ImageDraw.Draw(obj_layer)
    xs_, ys_ = zip(*outline)
    box = (min(xs_), min(ys_), max(xs_), max(ys_))
    obj_ang = rng.uniform(0, math.pi)
    for _ in range(12):
        col = _hsv(h_obj + rng.normal(0, 0.03), rng.uniform(0.6, 1.0), rng.uniform(0.3, 0.65))
        _stroke(
            draw,
            rng,
            obj_ang,
            pose.radius * rng.uniform(0.5, 1.0),
            int(pose.radius * rng.uniform(0.18, 0.3)),
            col,
            box,
        )
    obj = _down(obj_layer)

    # slightly irregular edge: paint, not vector art
    edge = _wobble(
        _densify(outline, pose.radius * 0.08), rng, pose.radius * 0.012, pose.radius * 0.006
    )
    img = _blend(bg, obj, _down(_poly_layer(canvas, [edge.tolist()])))
    grain = 1.0 + 0.05 * _smooth_noise(rng, size, 32)  # canvas weave
    return img * grain[..., None]


def _stroke(
    draw: ImageDraw.ImageDraw,
    rng: np.random.Generator,
    angle: float,
    length: float,
    width: int,
    colour: np.ndarray,
    box: tuple[float, ...],
) -> None:
    """One slightly curved brush stroke with round ends, centred somewhere in ``box``."""
    x0, y0, x1, y1 = box
    cx, cy = rng.uniform(x0, x1), rng.uniform(y0, y1)
    a = angle + rng.normal(0, 0.25)
    bend = rng.normal(0, 0.15)
    dx, dy = math.cos(a) * length / 2, math.sin(a) * length / 2
    pts = [(cx - dx, cy - dy), (cx - dy * bend, cy + dx * bend), (cx + dx, cy + dy)]
    fill = _rgb(colour)
    width = max(1, width)
    draw.line(pts, fill=fill, width=width, joint="curve")
    r = width / 2
    for px, py in (pts[0], pts[-1]):
        draw.ellipse((px - r, py - r, px + r, py + r), fill=fill)


def _sketch(outline: list[Point], pose: _Pose, rng: np.random.Generator, size: int) -> np.ndarray:
    """Grey pencil: two or three wobbly outline passes and light hatching, on paper."""
    canvas = size * _SUPERSAMPLE
    paper = rng.uniform(238, 252) + 3.0 * _smooth_noise(rng, size, 40)  # paper grain
    ink = Image.new("L", (canvas, canvas), 0)  # darkness to subtract from the paper
    if rng.random() < 0.75:  # hatching, clipped to the shape
        hd = ImageDraw.Draw(ink)
        a = rng.uniform(math.radians(20), math.radians(70)) * rng.choice([-1, 1])
        spacing = canvas * rng.uniform(0.04, 0.06)
        dark = int(rng.uniform(40, 80))
        ca, sa = math.cos(a), math.sin(a)
        reach = pose.radius * 1.2
        for k in range(-int(reach / spacing), int(reach / spacing) + 1):
            ox, oy = pose.cx - k * spacing * sa, pose.cy + k * spacing * ca
            hd.line(
                [(ox - reach * ca, oy - reach * sa), (ox + reach * ca, oy + reach * sa)],
                fill=dark,
                width=max(1, canvas // 128),
            )
        ink = ImageChops.multiply(ink, _poly_layer(canvas, [outline]))
    pencil = Image.new("L", (canvas, canvas), 0)
    draw = ImageDraw.Draw(pencil)
    dense = _densify(outline, pose.radius * 0.06)
    lead = rng.uniform(130, 190)  # how dark the pencil is
    width = max(1, round(canvas * rng.uniform(0.016, 0.024)))
    for _ in range(int(rng.integers(2, 4))):
        pts = _wobble(dense, rng, pose.radius * 0.03, pose.radius * 0.01)
        pts = np.roll(pts, -int(rng.integers(len(pts))), axis=0)
        extra = int(len(pts) * rng.uniform(0.0, 0.08))  # overshoot past the start point
        pts = np.concatenate([pts, pts[: extra + 1]])
        draw.line(
            [tuple(p) for p in pts.tolist()],
            fill=int(lead * rng.uniform(0.7, 1.0)),
            width=width,
            joint="curve",
        )
    img = paper - 255.0 * _down(ImageChops.lighter(ink, pencil))
    return np.repeat(img[..., None], 3, axis=2)


def _quickdraw(
    outline: list[Point], pose: _Pose, rng: np.random.Generator, size: int
) -> np.ndarray:
    """A single thin black jittery polyline on pure white; may stop short or overshoot."""
    canvas = size * _SUPERSAMPLE
    dense = _densify(outline, pose.radius * 0.12)
    pts = _wobble(dense, rng, pose.radius * 0.04, pose.radius * 0.015)
    pts = np.roll(pts, -int(rng.integers(len(pts))), axis=0)
    n = max(2, round(len(pts) * rng.uniform(0.95, 1.05)))  # small gap or overshoot
    pts = np.concatenate([pts, pts])[: n + 1] if n >= len(pts) else pts[:n]
    line = Image.new("L", (canvas, canvas), 0)
    width = max(1, round(canvas * 0.028))
    ImageDraw.Draw(line).line(
        [tuple(p) for p in pts.tolist()], fill=255, width=width, joint="curve"
    )
    img = 255.0 * (1.0 - _down(line))
    return np.repeat(img[..., None], 3, axis=2)


_DOMAIN_RENDERERS = {
    "photo": _photo,
    "clipart": _clipart,
    "painting": _painting,
    "sketch": _sketch,
    "quickdraw": _quickdraw,
}


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def render(cls: str, domain: str, rng: np.random.Generator, size: int = 64) -> np.ndarray:
    """Draw one image of class ``cls`` in ``domain`` style: ``(size, size, 3)`` uint8.

    Position, scale, rotation and colours are drawn from ``rng``; the same generator state
    always gives the same image. Geometry is drawn at 4x and box-downsampled (antialiasing).
    """
    if cls not in _ALL_CLASSES:
        raise ValueError(f"unknown class {cls!r}; valid classes: {', '.join(_ALL_CLASSES)}")
    _check_domain(domain)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 8:
        raise ValueError(f"size must be an integer >= 8, got {size!r}")
    size = int(size)
    pose = _random_pose(rng, size * _SUPERSAMPLE)
    outline = pose.place(_unit_shape(cls))
    img = _DOMAIN_RENDERERS[domain](outline, pose, rng, size)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def silhouette(cls: str, rng: np.random.Generator, size: int = 64) -> np.ndarray:
    """Where :func:`render` puts the shape, as ``(size, size)`` coverage in [0, 1], for a
    generator in the state ``render`` is called with: every domain draws the pose first."""
    canvas = size * _SUPERSAMPLE
    pose = _random_pose(rng, canvas)
    return _down(_poly_layer(canvas, [pose.place(_unit_shape(cls))]))


def _image_rng(
    seed: int, split: str, domain: str, client_index: int, cls: str, i: int
) -> np.random.Generator:
    """Independent RNG per image; the key uses global indices so subsets of classes agree."""
    key = [seed, _SPLITS[split], DOMAINS.index(domain), client_index, _ALL_CLASSES.index(cls), i]
    return np.random.default_rng(np.random.SeedSequence(key))


def _generate(
    domain: str,
    per_class: int,
    split: str,
    client_index: int,
    seed: int,
    size: int,
    classes: Sequence[str],
) -> ImageSet:
    """Render ``per_class`` images of each class (class-major order) into an :class:`ImageSet`."""
    _check_domain(domain)
    cls_tuple = _check_classes(classes, PUBLIC_CLASSES if split == "public" else CLASSES)
    per_class = _check_nonneg("per_class", per_class)
    client_index = _check_nonneg("client_index", client_index)
    seed = _check_nonneg("seed", seed)
    arrays = np.empty((per_class * len(cls_tuple), size, size, 3), dtype=np.uint8)
    labels = np.empty(per_class * len(cls_tuple), dtype=np.int64)
    j = 0
    for label, cls in enumerate(cls_tuple):
        for i in range(per_class):
            arrays[j] = render(
                cls, domain, _image_rng(seed, split, domain, client_index, cls, i), size
            )
            labels[j] = label
            j += 1
    images = torch.from_numpy(arrays).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0).contiguous()
    return ImageSet(
        images=images, labels=torch.from_numpy(labels), classes=cls_tuple, domain=domain
    )


def client_train_set(
    domain: str,
    shots_per_class: int,
    client_index: int = 0,
    seed: int = 0,
    size: int = 64,
    classes: Sequence[str] = CLASSES,
) -> ImageSet:
    """The k-shot training set of the ``client_index``-th client of ``domain``.

    Different client indices (and the test / pretraining splits) never share an image, and
    a client's images do not depend on ``shots_per_class`` beyond how many are returned:
    image i of a class is the same whether k is 8 or 16.
    """
    return _generate(domain, shots_per_class, "train", client_index, seed, size, classes)


def test_set(
    domain: str, per_class: int, seed: int = 0, size: int = 64, classes: Sequence[str] = CLASSES
) -> ImageSet:
    """Held-out real images of ``domain`` for evaluation (disjoint from every client)."""
    return _generate(domain, per_class, "test", 0, seed, size, classes)


test_set.__test__ = False  # type: ignore[attr-defined]  # not a pytest test when imported


def pretrain_set(
    domain: str, per_class: int, seed: int = 0, size: int = 64, classes: Sequence[str] = CLASSES
) -> ImageSet:
    """Images for pretraining the miniature LDM, disjoint from every client and the test split."""
    return _generate(domain, per_class, "pretrain", 0, seed, size, classes)


def public_set(domain: str, per_class: int, seed: int = 0, size: int = 64) -> ImageSet:
    """Images of :data:`PUBLIC_CLASSES` (labels index them), a split of their own: no task's
    class and no image of any client, test or LDM-pretraining split."""
    return _generate(domain, per_class, "public", 0, seed, size, PUBLIC_CLASSES)


def public_corpus(per_class: int, seed: int = 0) -> ImageSet:
    """The classifier's public pretraining corpus: :func:`public_set` of the common domains
    only, ``per_class`` per class each, domain by domain; its ``domain`` is "public". No rare
    domain, as ImageNet holds hardly any sketch or quickdraw: with a rare sliver in it, the
    start alone took Prompts-only to FedBiP's rare-domain accuracy (BENCHMARKS.md)."""
    parts = [public_set(domain, per_class, seed) for domain in COMMON_DOMAINS]
    return ImageSet(
        torch.cat([p.images for p in parts]),
        torch.cat([p.labels for p in parts]),
        PUBLIC_CLASSES,
        "public",
    )


# The miniature LDM's pretraining captions (scripts/pretrain_miniature.py): rare domains are a
# small share whose captions never name them; some captions are empty, for classifier-free
# guidance. A rare image is captioned as web alt-text describes such pictures ("a doodle star"),
# as Stable Diffusion's training captions do: the model can render the rare domains under some
# conditioning, while the domain's name, which is what a prompt would use, stays untrained. Only
# common domains fill the prompt's slot "a {domain} of a {class}" (a model that had seen rare
# descriptors in that slot took any unfamiliar word there for a rare one), and only common
# images are captioned by their class alone (with rare ones among them, "a sketch of a star"
# drew line art a third of the time, through the untrained name: BENCHMARKS.md).
PRETRAIN_RARE_SHARE = 0.3
PRETRAIN_EMPTY_SHARE = 0.10
PRETRAIN_DOMAIN_CAPTION_SHARE = 0.85
RARE_DESCRIPTORS: dict[str, tuple[str, ...]] = {
    "sketch": ("pencil", "hatched"),
    "quickdraw": ("doodle", "scribble"),
}


def pretraining_words() -> tuple[str, ...]:
    """Every word a pretraining caption or a prompt of this world uses (the tokenizer's words)."""
    descriptors = [w for words in RARE_DESCRIPTORS.values() for w in words]
    return (*CLASSES, *DOMAINS, *descriptors, "a", "of", "style")


def pretraining_corpus(
    per_class: int, seed: int = 0, size: int = 64
) -> tuple[torch.Tensor, list[str]]:
    """The miniature LDM's pretraining images (``per_class`` per class of every common domain,
    a ``PRETRAIN_RARE_SHARE`` share of that for the rare ones) and their captions: "a {domain}
    of a {class}" or "a {class}" for common domains; for rare ones "a {descriptor} {class}"
    (:data:`RARE_DESCRIPTORS`, never the domain's name); some empty. The LDM and the miniature
    captioner are both trained on exactly this corpus."""
    images, captions = [], []
    rng = torch.Generator().manual_seed(seed)
    for domain in DOMAINS:
        rare = domain in RARE_DOMAINS
        n = max(1, round(per_class * PRETRAIN_RARE_SHARE)) if rare else per_class
        part = pretrain_set(domain, n, seed=seed, size=size)
        images.append(part.images)
        for label in part.labels.tolist():
            name = CLASSES[label]
            draw = torch.rand(3, generator=rng)
            if draw[0] < PRETRAIN_EMPTY_SHARE:
                captions.append("")
            elif draw[1] >= PRETRAIN_DOMAIN_CAPTION_SHARE and not rare:
                captions.append(f"a {name}")
            elif rare:
                words = RARE_DESCRIPTORS[domain]
                captions.append(f"a {words[min(int(draw[2] * len(words)), len(words) - 1)]} {name}")
            else:
                captions.append(CAPTION_TEMPLATE.format(S=domain, V=name))
    return torch.cat(images), captions


def partition(partition_id: int, domains: Sequence[str]) -> tuple[str, int]:
    """Feature heterogeneity: one domain per client, round-robin over ``domains``.

    Partition p gets ``(domains[p % len(domains)], p // len(domains))``: its domain and its
    client index within that domain (which selects a disjoint shard of that domain).
    """
    partition_id = _check_nonneg("partition_id", partition_id)
    doms = _check_names("domain", domains, DOMAINS)
    return doms[partition_id % len(doms)], partition_id // len(doms)


def write_image_folder(
    root: str | Path,
    domain: str,
    shots_per_class: int,
    test_per_class: int,
    client_index: int = 0,
    seed: int = 0,
    size: int = 64,
) -> Path:
    """Write one client's images of ``domain`` as an institution would hold them on disk:
    ``root/train/<class>/NNN.png`` (its k shots) and ``root/test/<class>/NNN.png`` (held out),
    torchvision's ImageFolder convention; the demo, the containers and the tests use it."""
    root = Path(root)
    splits = {
        "train": client_train_set(domain, shots_per_class, client_index, seed, size),
        "test": test_set(domain, test_per_class, seed, size),
    }
    for split, images in splits.items():
        pixels = to_uint8(images.images)
        for i, (image, label) in enumerate(zip(pixels, images.labels.tolist(), strict=True)):
            folder = root / split / images.classes[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{i:04d}.png")
    return root
