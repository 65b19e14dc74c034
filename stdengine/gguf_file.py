"""Open and validate a GGUF container, with errors that say what is wrong instead of tracebacks.

`scan_gguf` walks the container with bounds checks (magic, version, key/values, tensor infos, the
data section) and returns what it read. Any problem becomes a BadModelFile naming the file. It is
the project's one GGUF reader: the reference engine's model and tokenizer, `infer models info`, the
model store's verification and the conformance suite's exact reference all read files through it.

The scan is ours rather than gguf.GGUFReader's because GGUFReader, given a damaged file, fails with
bare IndexError/ValueError (or reads short views without noticing); it is also much faster on large
vocabularies, since it skips over token arrays instead of building one numpy array per string.

`GGML_TYPES` is the project's one table of ggml tensor types (id, name, block size, block bytes).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stdengine.errors import BadModelFile

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# By default arrays longer than this are not materialised by the scan (token lists, scores,
# merges): only their item type and length are kept, which is all that `models info` needs.
MAX_ARRAY_ITEMS = 1024

# GGUF metadata value types (gguf.h): id -> (name, struct format or None for string/array)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("uint8", "B"),
    1: ("int8", "b"),
    2: ("uint16", "H"),
    3: ("int16", "h"),
    4: ("uint32", "I"),
    5: ("int32", "i"),
    6: ("float32", "f"),
    7: ("bool", "?"),
    8: ("string", None),
    9: ("array", None),
    10: ("uint64", "Q"),
    11: ("int64", "q"),
    12: ("float64", "d"),
}


@dataclass(frozen=True)
class GGMLType:
    """A ggml tensor type as GGUF files store it: a row is a whole number of blocks of `block`
    elements, each `size` bytes."""

    id: int
    name: str  # ggml's name (ggml.c's type_traits): the K of k-quants upper case, "q4_K"
    block: int
    size: int


# Every ggml tensor type (ggml.h's enum ggml_type; block sizes and bytes from ggml.c's type_traits).
# Facts of the format, checked against the gguf package and ggml itself by tests/test_gguf_types.py.
# Ids 4, 5, 31-33 and 36-38 were removed from ggml; a file using them is refused.
GGML_TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "f32", 1, 4),
        GGMLType(1, "f16", 1, 2),
        GGMLType(2, "q4_0", 32, 18),
        GGMLType(3, "q4_1", 32, 20),
        GGMLType(6, "q5_0", 32, 22),
        GGMLType(7, "q5_1", 32, 24),
        GGMLType(8, "q8_0", 32, 34),
        GGMLType(9, "q8_1", 32, 36),
        GGMLType(10, "q2_K", 256, 84),
        GGMLType(11, "q3_K", 256, 110),
        GGMLType(12, "q4_K", 256, 144),
        GGMLType(13, "q5_K", 256, 176),
        GGMLType(14, "q6_K", 256, 210),
        GGMLType(15, "q8_K", 256, 292),
        GGMLType(16, "iq2_xxs", 256, 66),
        GGMLType(17, "iq2_xs", 256, 74),
        GGMLType(18, "iq3_xxs", 256, 98),
        GGMLType(19, "iq1_s", 256, 50),
        GGMLType(20, "iq4_nl", 32, 18),
        GGMLType(21, "iq3_s", 256, 110),
        GGMLType(22, "iq2_s", 256, 82),
        GGMLType(23, "iq4_xs", 256, 136),
        GGMLType(24, "i8", 1, 1),
        GGMLType(25, "i16", 1, 2),
        GGMLType(26, "i32", 1, 4),
        GGMLType(27, "i64", 1, 8),
        GGMLType(28, "f64", 1, 8),
        GGMLType(29, "iq1_m", 256, 56),
        GGMLType(30, "bf16", 1, 2),
        GGMLType(34, "tq1_0", 256, 54),
        GGMLType(35, "tq2_0", 256, 66),
        GGMLType(39, "mxfp4", 32, 17),
        GGMLType(40, "nvfp4", 64, 36),
        GGMLType(41, "q1_0", 128, 18),
    )
}
_BY_NAME = {t.name.lower(): t for t in GGML_TYPES.values()}


def ggml_type(t: int | str) -> GGMLType:
    """A type by id (an int, or an IntEnum such as gguf.GGMLQuantizationType) or by name, in any
    case ("q4_K", "Q4_K", "q4_k"). KeyError for a type ggml does not have."""
    if isinstance(t, str):
        return _BY_NAME[t.lower()]
    return GGML_TYPES[int(t)]


def ggml_type_name(type_id: int) -> str:
    """ggml's name for a tensor type (f32, q4_1, q4_K, iq2_xxs, bf16), or "unknown type N"."""
    t = GGML_TYPES.get(type_id)
    return t.name if t else f"unknown type {type_id}"


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array too long to keep in the scan: its item type and length."""

    item_type: str
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (the contiguous row length) first
    type_id: int
    type_name: str
    offset: int  # absolute byte offset of the data in the file
    n_elements: int
    n_bytes: int


@dataclass
class GGUFHeader:
    path: Path
    file_size: int
    version: int
    byte_order: str  # "<" little-endian (normal) or ">" big-endian
    alignment: int
    data_offset: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)


class _Truncated(Exception):
    pass


class _Cursor:
    """Reads little/big-endian values from a buffer, raising _Truncated past its end."""

    def __init__(self, buf: Any, size: int, order: str, errors: str = "replace") -> None:
        self.buf, self.size, self.order, self.pos = buf, size, order, 0
        self.errors = errors  # how invalid UTF-8 in array strings is decoded

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, errors: str = "replace") -> str:
        n = self.unpack("Q")
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors=errors)

    def skip_string(self) -> None:
        n = self.unpack("Q")
        self.need(n)
        self.pos += n


MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


def _bad(path: Path, what: str, hint: str | None = None) -> BadModelFile:
    return BadModelFile(
        f"{path}: {what}",
        hint=hint or "re-download the model (for a catalogue model: infer models pull NAME --verify)",
        path=str(path),
    )


def scan_gguf(
    path: str | os.PathLike[str], *, load_arrays: bool = False, errors: str = "replace"
) -> GGUFHeader:
    """Read and check a GGUF file's header, key/values and tensor table; BadModelFile if damaged.

    Metadata arrays of up to MAX_ARRAY_ITEMS items are lists. Longer ones are ArrayValue (type
    and length only) unless load_arrays=True: then string arrays are lists of str and numeric
    arrays numpy arrays (a fast way to read a vocabulary: ~0.2 s for 262k tokens). errors: how
    invalid UTF-8 in the strings of arrays (token texts, merges) is decoded: "surrogateescape"
    keeps a token's bytes. A single string (a name, a chat template) is text: invalid UTF-8 in it
    is always U+FFFD, whatever the caller reads the arrays for.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise _bad(path, "not a regular file", hint="pass the path of a .gguf file")
        if size == 0:
            raise _bad(path, "the file is empty, not a GGUF model")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _scan(path, buf, size, load_arrays, errors)
    except OSError as e:
        raise BadModelFile(
            f"{path}: cannot read the file: {e.strerror or e}",
            hint="check the path and its permissions",
            path=str(path),
        ) from e


def _scan(path: Path, buf: Any, size: int, load_arrays: bool, errors: str) -> GGUFHeader:
    if size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        got = bytes(buf[:4])
        raise _bad(
            path,
            f"not a GGUF file (bad magic {got!r}, expected b'GGUF')",
            hint="pass a .gguf model file (llama.cpp's format), or a catalogue alias",
        )
    if size < 8:
        raise _bad(path, "truncated: the file ends inside the GGUF header (version)")
    # A file written on a big-endian machine has its version byte-swapped; read it that way.
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:
        order = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise _bad(
            path,
            f"unsupported GGUF version {version} (supported: 2, 3)",
            hint="convert the model again with a current llama.cpp (convert_hf_to_gguf.py)",
        )

    cur = _Cursor(buf, size, order, errors)
    cur.pos = 8
    where = "the GGUF header (tensor and key/value counts)"
    try:
        n_tensors = cur.unpack("q")
        n_kv = cur.unpack("q")
        if n_tensors < 0 or n_kv < 0:
            raise _bad(path, f"corrupt header: negative counts (tensors {n_tensors}, key/values {n_kv})")
        # A key/value takes at least 13 bytes and a tensor info 24: counts that cannot fit in the
        # rest of the file are refused before any loop (a crafted 2^31 would walk to the end).
        if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > size - cur.pos:
            raise _bad(
                path,
                f"truncated or corrupt: {n_tensors} tensors and {n_kv} key/values cannot fit in a file of {size} bytes",
            )
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            where = f"key/value #{i}"
            key = cur.string()
            where = f"key/value #{i} ({key!r})"
            vtype = cur.unpack("i")
            if key in metadata:
                raise _bad(path, f"duplicate metadata key {key!r}")
            metadata[key] = _read_value(path, cur, vtype, key, load_arrays)
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for i in range(n_tensors):
            where = f"tensor info #{i}"
            name = cur.string()
            where = f"tensor info #{i} ({name!r})"
            n_dims = cur.unpack("I")
            if n_dims > 4:  # GGML_MAX_DIMS
                raise _bad(path, f"tensor {name!r} has {n_dims} dimensions (at most 4)")
            shape = tuple(cur.unpack("q") for _ in range(n_dims))
            type_id = cur.unpack("i")
            offset = cur.unpack("Q")
            infos.append((name, shape, type_id, offset))
        tensor_info_end = cur.pos
    except _Truncated:
        raise _bad(path, f"truncated: the file ends (at byte {size}) inside {where}") from None

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        not isinstance(alignment, int)
        or isinstance(alignment, bool)
        or alignment <= 0
        or alignment & (alignment - 1)
        or alignment % 8
    ):
        # GGUF requires a multiple of 8: a smaller one misaligns every tensor's data
        raise _bad(path, f"general.alignment is {alignment!r}; it must be a power of two and a multiple of 8")
    data_offset = -(-tensor_info_end // alignment) * alignment

    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, shape, type_id, offset in infos:
        if name in seen:
            raise _bad(path, f"two tensors are named {name!r}")
        seen.add(name)
        gtype = GGML_TYPES.get(type_id)
        if gtype is None:
            raise _bad(
                path,
                f"tensor {name!r} has unknown tensor type id {type_id}",
                hint="the file needs a newer engine, or it is corrupt",
            )
        block, type_size = gtype.block, gtype.size
        if any(d < 0 for d in shape):
            raise _bad(path, f"tensor {name!r} has a negative dimension {list(shape)}")
        n_elements = 1
        for d in shape:
            n_elements *= d
        if shape and shape[0] % block:
            raise _bad(
                path,
                f"tensor {name!r} ({gtype.name}) has a row of {shape[0]} "
                f"elements, not a multiple of its block size {block}",
            )
        if offset % alignment:
            raise _bad(path, f"tensor {name!r} data offset {offset} is not aligned to {alignment}")
        n_bytes = n_elements // block * type_size
        start = data_offset + offset
        if start + n_bytes > size:
            raise _bad(
                path,
                f"truncated: tensor {name!r} data (bytes {start}..{start + n_bytes}) "
                f"runs past the end of the file ({size} bytes)",
            )
        tensors.append(TensorInfo(name, shape, type_id, gtype.name, start, n_elements, n_bytes))

    # Each tensor's bytes are its own: data that overlaps another tensor's (an offset rewritten to
    # 0, or a type changed to a larger one that still fits in the file) is corrupt, not shared.
    by_start = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(by_start, by_start[1:], strict=False):
        if a.offset + a.n_bytes > b.offset:
            raise _bad(
                path,
                f"tensor {a.name!r} ({a.type_name}, bytes {a.offset}..{a.offset + a.n_bytes}) overlaps "
                f"tensor {b.name!r} (from byte {b.offset}): the tensor table is corrupt",
            )

    return GGUFHeader(
        path=path,
        file_size=size,
        version=version,
        byte_order=order,
        alignment=alignment,
        data_offset=data_offset,
        metadata=metadata,
        tensors=tensors,
    )


def _read_value(path: Path, cur: _Cursor, vtype: int, key: str, load_arrays: bool) -> Any:
    if vtype not in VALUE_TYPES:
        raise _bad(path, f"metadata key {key!r} has unknown value type id {vtype}")
    name, fmt = VALUE_TYPES[vtype]
    if fmt is not None:
        return cur.unpack(fmt)
    if name == "string":
        return cur.string()
    item_type = cur.unpack("i")
    count = cur.unpack("Q")
    if item_type not in VALUE_TYPES or item_type == 9:
        raise _bad(path, f"metadata array {key!r} has unsupported item type id {item_type}")
    item_name, item_fmt = VALUE_TYPES[item_type]
    if (
        count * (8 if item_fmt is None else struct.calcsize(item_fmt)) > cur.size - cur.pos
    ):  # a string: 8 or more
        raise _bad(path, f"metadata array {key!r} of {count} items cannot fit in the rest of the file")
    small = count <= MAX_ARRAY_ITEMS
    if item_fmt is None:  # strings: walk them (each has its own length)
        if small or load_arrays:
            return [cur.string(cur.errors) for _ in range(count)]
        for _ in range(count):
            cur.skip_string()
        return ArrayValue(item_name, count)
    n = struct.calcsize(item_fmt) * count
    cur.need(n)
    start = cur.pos
    cur.pos += n
    if small:
        return list(struct.unpack_from(f"{cur.order}{count}{item_fmt}", cur.buf, start))
    if load_arrays:
        dtype = np.dtype(cur.order + item_fmt)  # cur.order is "<" or ">"
        return np.frombuffer(cur.buf, dtype=dtype, count=count, offset=start).copy()
    return ArrayValue(item_name, count)
