"""One grain's file: a fixed header, the layer layout, then the payload (every layer's KV bytes of the grain).

Header (little-endian): magic ``DSKV``, format version, the model fingerprint (16 bytes), token count, layout
length, payload length, TTL in seconds (from the last use: the file's mtime), and a CRC-32 of everything else
(header fields, layout, payload). Reading checks each against what the reader expects; any mismatch is an
``EntryError`` naming why (``foreign``: another model's; ``truncated``; ``corrupt``: a bad magic, version,
layout, length or checksum), which the tiers treat as a miss.
"""

from __future__ import annotations

import struct
import zlib
from typing import BinaryIO

import numpy as np

MAGIC = b"DSKV"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sH2x16sIIQd")  # magic, version, fingerprint, tokens, layout len, payload len, ttl_s
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _CRC.size


class EntryError(ValueError):
    """A file that is not a valid entry for this reader; ``reason``: foreign | truncated | corrupt."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def header_bytes(fingerprint: bytes, layout: str, num_tokens: int, ttl_s: float, payload: np.ndarray) -> bytes:
    """The bytes before the payload (header, checksum, layout) of an entry holding ``payload`` (uint8)."""
    lay = layout.encode()
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, fingerprint, num_tokens, len(lay), payload.nbytes, float(ttl_s))
    crc = zlib.crc32(payload, zlib.crc32(lay, zlib.crc32(head)))
    return head + _CRC.pack(crc) + lay


def write_entry(f: BinaryIO, fingerprint: bytes, layout: str, num_tokens: int, ttl_s: float,
                payload: np.ndarray) -> int:
    """Write one entry; -> bytes written."""
    head = header_bytes(fingerprint, layout, num_tokens, ttl_s, payload)
    f.write(head)
    f.write(memoryview(payload))
    return len(head) + payload.nbytes


def read_meta(f: BinaryIO, fingerprint: bytes | None) -> float:
    """The TTL of the entry at ``f``'s start (its header only); EntryError if it is not an entry, or not one of
    this model's (``fingerprint``; None: any model's)."""
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise EntryError("truncated", f"{len(raw)} header bytes of {HEADER_BYTES}")
    magic, version, fp, _, _, _, ttl_s = _HEAD.unpack_from(raw)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise EntryError("corrupt", f"magic {magic!r} version {version}, expected {MAGIC!r} {FORMAT_VERSION}")
    if fingerprint is not None and fp != fingerprint:
        raise EntryError("foreign", f"model fingerprint {fp.hex()}, expected {fingerprint.hex()}")
    return ttl_s


def read_entry(f: BinaryIO, fingerprint: bytes, layout: str, num_tokens: int) -> tuple[np.ndarray, float]:
    """(payload as uint8, TTL) of the entry at ``f``'s start, every field and the checksum verified."""
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise EntryError("truncated", f"{len(raw)} header bytes of {HEADER_BYTES}")
    magic, version, fp, tokens, lay_len, pay_len, ttl_s = _HEAD.unpack_from(raw)
    (crc,) = _CRC.unpack_from(raw, _HEAD.size)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise EntryError("corrupt", f"magic {magic!r} version {version}, expected {MAGIC!r} {FORMAT_VERSION}")
    if fp != fingerprint:
        raise EntryError("foreign", f"model fingerprint {fp.hex()}, expected {fingerprint.hex()}")
    lay = f.read(lay_len)
    if len(lay) < lay_len:
        raise EntryError("truncated", f"{len(lay)} layout bytes of {lay_len}")
    if lay != layout.encode() or tokens != num_tokens:
        raise EntryError("corrupt", f"layout {lay[:80]!r} of {tokens} tokens, expected {layout[:80]!r} of "
                                    f"{num_tokens}")
    payload = np.empty(pay_len, np.uint8)
    got = f.readinto(memoryview(payload))
    if got < pay_len:
        raise EntryError("truncated", f"{got} payload bytes of {pay_len}")
    if f.read(1):
        raise EntryError("corrupt", "bytes after the payload")
    if zlib.crc32(payload, zlib.crc32(lay, zlib.crc32(raw[:_HEAD.size]))) != crc:
        raise EntryError("corrupt", "checksum mismatch")
    return payload, ttl_s
