"""A dependency-free PNG line chart (used when matplotlib is not installed).

Draws up to a few series of (x, y) points on a shared x axis into an RGB raster and writes it with
zlib (PNG filter 0). Text uses a built-in 5x7 bitmap font (upper-case letters, digits, a few signs).
"""
from __future__ import annotations

import struct
import zlib

_FONT = {
    "0": ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    "3": ["11110", "00001", "00001", "01110", "00001", "00001", "11110"],
    "4": ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    "5": ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    "6": ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    "8": ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    "9": ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
    "A": ["01110", "10001", "10001", "11111", "10001", "10001", "10001"],
    "B": ["11110", "10001", "10001", "11110", "10001", "10001", "11110"],
    "C": ["01110", "10001", "10000", "10000", "10000", "10001", "01110"],
    "D": ["11110", "10001", "10001", "10001", "10001", "10001", "11110"],
    "E": ["11111", "10000", "10000", "11110", "10000", "10000", "11111"],
    "F": ["11111", "10000", "10000", "11110", "10000", "10000", "10000"],
    "G": ["01110", "10001", "10000", "10111", "10001", "10001", "01111"],
    "H": ["10001", "10001", "10001", "11111", "10001", "10001", "10001"],
    "I": ["01110", "00100", "00100", "00100", "00100", "00100", "01110"],
    "K": ["10001", "10010", "10100", "11000", "10100", "10010", "10001"],
    "L": ["10000", "10000", "10000", "10000", "10000", "10000", "11111"],
    "M": ["10001", "11011", "10101", "10101", "10001", "10001", "10001"],
    "N": ["10001", "11001", "10101", "10011", "10001", "10001", "10001"],
    "O": ["01110", "10001", "10001", "10001", "10001", "10001", "01110"],
    "P": ["11110", "10001", "10001", "11110", "10000", "10000", "10000"],
    "R": ["11110", "10001", "10001", "11110", "10100", "10010", "10001"],
    "S": ["01111", "10000", "10000", "01110", "00001", "00001", "11110"],
    "T": ["11111", "00100", "00100", "00100", "00100", "00100", "00100"],
    "U": ["10001", "10001", "10001", "10001", "10001", "10001", "01110"],
    "V": ["10001", "10001", "10001", "10001", "10001", "01010", "00100"],
    "W": ["10001", "10001", "10001", "10101", "10101", "11011", "10001"],
    "X": ["10001", "10001", "01010", "00100", "01010", "10001", "10001"],
    "Y": ["10001", "10001", "01010", "00100", "00100", "00100", "00100"],
    "%": ["11001", "11010", "00010", "00100", "01000", "01011", "10011"],
    "(": ["00010", "00100", "01000", "01000", "01000", "00100", "00010"],
    ")": ["01000", "00100", "00010", "00010", "00010", "00100", "01000"],
    "=": ["00000", "00000", "11111", "00000", "11111", "00000", "00000"],
    "-": ["00000", "00000", "00000", "11111", "00000", "00000", "00000"],
    ".": ["00000", "00000", "00000", "00000", "00000", "01100", "01100"],
    ",": ["00000", "00000", "00000", "00000", "01100", "00100", "01000"],
    "/": ["00001", "00010", "00010", "00100", "01000", "01000", "10000"],
    " ": ["00000"] * 7,
}


class Canvas:
    """RGB raster, origin top-left."""

    def __init__(self, w: int, h: int, bg=(255, 255, 255)):
        self.w, self.h = w, h
        self.px = bytearray(bytes(bg) * (w * h))

    def set(self, x: int, y: int, c) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i : i + 3] = bytes(c)

    def rect(self, x0: int, y0: int, x1: int, y1: int, c) -> None:
        for y in range(max(0, y0), min(self.h, y1 + 1)):
            for x in range(max(0, x0), min(self.w, x1 + 1)):
                self.set(x, y, c)

    def line(self, x0: int, y0: int, x1: int, y1: int, c, width: int = 1, dash: int = 0) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        r = width // 2
        for i in range(n + 1):
            if dash and (i // dash) % 2:
                continue
            x = round(x0 + (x1 - x0) * i / n)
            y = round(y0 + (y1 - y0) * i / n)
            self.rect(x - r, y - r, x + r, y + r, c)

    def text(self, x: int, y: int, s: str, c=(0, 0, 0), scale: int = 1) -> int:
        """Draw `s` (unknown characters are skipped); returns the width drawn."""
        cx = x
        for ch in s.upper():
            glyph = _FONT.get(ch)
            if glyph is None:
                continue
            for gy, row in enumerate(glyph):
                for gx, bit in enumerate(row):
                    if bit == "1":
                        self.rect(cx + gx * scale, y + gy * scale, cx + gx * scale + scale - 1,
                                  y + gy * scale + scale - 1, c)
            cx += 6 * scale
        return cx - x

    def write_png(self, path) -> None:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w : 3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
        png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
        with open(path, "wb") as f:
            f.write(png)


COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]


def line_chart(path, xs: list[float], series: list[tuple[str, list[float], float, float]], title: str,
               xlabel: str, xlog2: bool = True, w: int = 560, h: int = 340) -> None:
    """One panel per series (stacked), sharing the x positions `xs`.

    series: (label, ys, y_min, y_max) per panel.
    """
    import math

    c = Canvas(w, h)
    c.text(10, 6, title, scale=2)
    left, right = 70, w - 60
    top0, bottom_pad = 34, 36
    ph = (h - top0 - bottom_pad) // len(series)
    fx = [math.log2(x) if xlog2 else x for x in xs]
    lo, hi = min(fx), max(fx)
    span = (hi - lo) or 1.0

    def px(v: float) -> int:
        return round(left + (v - lo) / span * (right - left))

    for si, (label, ys, y0, y1) in enumerate(series):
        top, bot = top0 + si * ph + 8, top0 + (si + 1) * ph - 14
        col = COLORS[si % len(COLORS)]
        c.line(left, top, left, bot, (0, 0, 0))
        c.line(left, bot, right, bot, (0, 0, 0))
        c.text(right - 6 * len(label), top - 10, label, col)
        for frac in (0.0, 0.5, 1.0):
            yv = y0 + frac * (y1 - y0)
            yy = round(bot - frac * (bot - top))
            c.line(left - 4, yy, left, yy, (0, 0, 0))
            if frac:
                c.line(left + 1, yy, right, yy, (220, 220, 220), dash=3)
            c.text(4, yy - 3, f"{yv:.1f}" if (y1 - y0) < 10 else f"{yv:.0f}")

        def py(v: float) -> int:
            return round(bot - (v - y0) / ((y1 - y0) or 1.0) * (bot - top))

        pts = [(px(x), py(y)) for x, y in zip(fx, ys)]
        for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
            c.line(xa, ya, xb, yb, col, width=2)
        for (xa, ya), y in zip(pts, ys):
            c.rect(xa - 3, ya - 3, xa + 3, ya + 3, col)
            c.text(xa + 6, ya - 10, f"{y:.2f}" if (y1 - y0) < 10 else f"{y:.0f}", col)
        for x, f in zip(xs, fx):
            c.line(px(f), bot, px(f), bot + 3, (0, 0, 0))
            if si == len(series) - 1:
                c.text(px(f) - 3, bot + 6, f"{x:g}")
    c.text(left + (right - left) // 2 - 3 * len(xlabel), h - 14, xlabel)
    c.write_png(path)
