"""The project's image set: 8 classes of synthetic 32x32 shapes, made from a seed. data/ holds its output.

    python -m {{ cookiecutter.package_name }}.data.shapes data    # data/train/<class>/*.png, data/val/<class>/*.png

Each image is one shape (circle, ring, square, ...) of random size, position and colour on a plain
background of another random colour. Every class looks the same mirrored left to right, so the
horizontal flip of the augmentation keeps its label. The same seed writes the same bytes on every machine
(`png_bytes`): tests/task/test_task.py checks that this reproduces the shipped files."""

from __future__ import annotations

import argparse
import struct
import zlib
from pathlib import Path

import numpy as np

CLASSES = ("circle", "cross", "diamond", "plus", "ring", "square", "stripes", "triangle")
IMAGES_PER_CLASS = {"train": 96, "val": 25}  # 768 training images (12 steps of 64), 200 for evaluation
SIZE = 32
SEED = 0


def draw(shape: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One image: where the shape is (SIZE x SIZE booleans) and the colours of background and shape."""
    radius = rng.uniform(6.0, 12.0)
    cx, cy = rng.uniform(radius, SIZE - radius, size=2)
    width = rng.uniform(1.5, 3.0)  # of lines, rings and stripes
    y, x = np.mgrid[0:SIZE, 0:SIZE] + 0.5  # pixel centres
    dx, dy = x - cx, y - cy
    box = np.maximum(abs(dx), abs(dy))
    if shape == "circle":
        mask = np.hypot(dx, dy) <= radius
    elif shape == "ring":
        mask = abs(np.hypot(dx, dy) - radius + width) <= width
    elif shape == "square":
        mask = box <= 0.8 * radius
    elif shape == "diamond":
        mask = abs(dx) + abs(dy) <= radius
    elif shape == "triangle":  # pointing up
        mask = (dy >= -radius) & (dy <= 0.8 * radius) & (abs(dx) <= 0.6 * (dy + radius))
    elif shape == "plus":
        mask = ((abs(dx) <= width) | (abs(dy) <= width)) & (box <= radius)
    elif shape == "cross":
        mask = ((abs(dx - dy) <= 1.4 * width) | (abs(dx + dy) <= 1.4 * width)) & (box <= 0.75 * radius)
    elif shape == "stripes":
        across = dy if rng.random() < 0.5 else dx
        mask = (box <= 0.8 * radius) & ((across + radius) // width % 2 == 0)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    background = rng.integers(0, 256, size=3)
    foreground = rng.integers(0, 256, size=3)
    while abs(foreground - background).sum() < 150:  # visible: redraw a colour too close to the background
        foreground = rng.integers(0, 256, size=3)
    return mask, np.stack([background, foreground]).astype(np.uint8)


def png_bytes(mask: np.ndarray, palette: np.ndarray) -> bytes:
    """A 1-bit palette PNG (pixels where `mask` is True have colour 1) with its pixel data stored, not
    compressed: zlib builds (zlib, zlib-ng, ...) compress alike data to different bytes; stored data is the
    same everywhere, so a regenerated file is byte for byte the shipped one. 246 bytes for 32x32."""
    height, width = mask.shape
    rows = np.packbits(mask, axis=1)  # 8 pixels a byte, leftmost first, as PNG stores them
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # each row starts with filter type 0
    blocks = [raw[start : start + 65535] for start in range(0, len(raw), 65535)]
    stream = b"\x78\x01"  # zlib header: deflate, no compression level claimed
    for number, block in enumerate(blocks):
        final = number == len(blocks) - 1
        stream += struct.pack("<BHH", final, len(block), len(block) ^ 0xFFFF) + block  # a stored block
    stream += struct.pack(">I", zlib.adler32(raw))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 3, 0, 0, 0)  # 1 bit, palette, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"PLTE", palette.tobytes())
        + chunk(b"IDAT", stream)
        + chunk(b"IEND", b"")
    )


def generate(folder: Path, seed: int = SEED) -> list[Path]:
    """Write `folder`/<split>/<class>/<nnn>.png for every split and class; the paths written, in order."""
    written = []
    for split_number, (split, count) in enumerate(IMAGES_PER_CLASS.items()):
        for class_number, shape in enumerate(CLASSES):
            (folder / split / shape).mkdir(parents=True, exist_ok=True)
            for index in range(count):
                # One generator per image: each image depends only on its own place in the set.
                rng = np.random.default_rng([seed, split_number, class_number, index])
                path = folder / split / shape / f"{index:03d}.png"
                path.write_bytes(png_bytes(*draw(shape, rng)))
                written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic shapes image set.")
    parser.add_argument("folder", type=Path, help="where train/ and val/ go (the project's: data)")
    parser.add_argument("--seed", type=int, default=SEED, help="default: %(default)s (the shipped set)")
    args = parser.parse_args(argv)
    written = generate(args.folder, args.seed)
    print(f"wrote {len(written)} images of {len(CLASSES)} classes under {args.folder}")


if __name__ == "__main__":
    main()
