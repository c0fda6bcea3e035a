"""Checks of the PNG files that ``--plot`` writes."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path


def png_size(path: str | Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; raises ValueError if the file is not a complete,
    valid PNG (signature, IHDR first, every chunk's CRC, image data, IEND last)."""
    data = Path(path).read_bytes()
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG file")
    pos, kinds = 8, []
    while pos + 12 <= len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        end = pos + 8 + length
        if (
            end + 4 > len(data)
            or zlib.crc32(data[pos + 4 : end]) != struct.unpack(">I", data[end : end + 4])[0]
        ):
            raise ValueError(
                f"{path} is not a valid PNG file (chunk {kind!r} is truncated or corrupt)"
            )
        kinds.append(kind)
        pos = end + 4
    if b"IDAT" not in kinds or kinds[-1] != b"IEND" or pos != len(data):
        raise ValueError(f"{path} is not a complete PNG file")
    return struct.unpack(">II", data[16:24])
