"""Reading a screenshot's pixels without an imaging library: a PNG of 8-bit RGB or RGBA, not
interlaced (what Chromium writes), its first rows as a numpy array.

`png_size(path)` is (width, height); `png_rows(path, count)` the top `count` rows, shaped
(rows, width, channels).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {2: 3, 6: 4}  # colour type: RGB, RGBA


def png_size(path: Path) -> tuple[int, int]:
    """The image's width and height, from its header."""
    width, height, *_ = _header(_chunks(path)[b"IHDR"])
    return width, height


def png_rows(path: Path, count: int) -> np.ndarray:
    """The top `count` rows of pixels (all of them if there are fewer)."""
    chunks = _chunks(path)
    width, height, depth, colour, _, _, interlace = _header(chunks[b"IHDR"])
    if depth != 8 or colour not in _CHANNELS or interlace:
        raise ValueError(f"{path}: not an 8-bit RGB(A) PNG without interlacing")
    channels = _CHANNELS[colour]
    stride = 1 + width * channels  # a row: its filter type, then its bytes
    raw = zlib.decompressobj().decompress(chunks[b"IDAT"], stride * min(count, height))
    rows, previous = [], bytes(width * channels)
    for start in range(0, len(raw) - stride + 1, stride):
        row = _unfilter(raw[start], bytearray(raw[start + 1:start + stride]), previous,
                        channels)
        rows.append(row)
        previous = row
    return np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), width, channels)


def _chunks(path: Path) -> dict[bytes, bytes]:
    """Each chunk's data by type, the IDAT chunks joined."""
    data = Path(path).read_bytes()
    if not data.startswith(_SIGNATURE):
        raise ValueError(f"{path} is not a PNG")
    chunks: dict[bytes, bytes] = {}
    position = len(_SIGNATURE)
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        chunks[kind] = chunks.get(kind, b"") + data[position + 8:position + 8 + length]
        position += 12 + length  # length, type, data, CRC
    return chunks


def _header(ihdr: bytes) -> tuple[int, ...]:
    return struct.unpack(">IIBBBBB", ihdr)


def _unfilter(kind: int, row: bytearray, above: bytes, step: int) -> bytes:
    """A row's bytes as they were before PNG's filter `kind` (0 to 4) was applied."""
    if kind == 0:
        return bytes(row)
    if kind == 2:  # Up: vectorised, the common case
        return (np.frombuffer(row, np.uint8) + np.frombuffer(above, np.uint8)).tobytes()
    for i in range(len(row)):
        left = row[i - step] if i >= step else 0
        upper_left = above[i - step] if i >= step else 0
        if kind == 1:
            row[i] = (row[i] + left) & 0xFF
        elif kind == 3:
            row[i] = (row[i] + (left + above[i]) // 2) & 0xFF
        elif kind == 4:
            row[i] = (row[i] + _paeth(left, above[i], upper_left)) & 0xFF
    return bytes(row)


def _paeth(left: int, up: int, upper_left: int) -> int:
    guess = left + up - upper_left
    near_left, near_up, near_corner = (abs(guess - left), abs(guess - up),
                                       abs(guess - upper_left))
    if near_left <= near_up and near_left <= near_corner:
        return left
    return up if near_up <= near_corner else upper_left
