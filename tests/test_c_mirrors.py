"""The facts the Python side keeps about the C side and about the GGUF format, checked against
sources other than themselves (issue 17):

- stdengine.gguf_file.GGML_TYPES, the one table of ggml tensor types, against the gguf package's
  GGMLQuantizationType and GGML_QUANT_SIZES, and against ggml itself (llama-cpp-python's
  libggml-base: ggml_type_name, ggml_blck_size, ggml_type_size);
- the C core's trait table (se_traits) against GGML_TYPES;
- every ctypes mirror of a C struct in stdengine.reference.core (the classes naming their C type in
  `_c_struct_`) and every mirrored enum value, against the C headers: a small C program compiled
  with gcc against reference_engine/csrc/engine.h and kernels.h prints offsetof / sizeof of each
  field the ctypes `_fields_` name, and each enum's value.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import typing
from pathlib import Path

import gguf
import pytest
from stdengine.reference import core

from stdengine.gguf_file import GGML_TYPES, ggml_type, ggml_type_name
from stdengine.options import CacheType

CSRC = Path(__file__).resolve().parent.parent / "reference_engine" / "csrc"


# --- the ggml type table ----------------------------------------------------------------------------


def test_type_table_matches_the_gguf_package():
    theirs = {t.value: t for t in gguf.GGMLQuantizationType}
    assert set(GGML_TYPES) == set(theirs)
    for type_id, t in GGML_TYPES.items():
        assert t.id == type_id
        assert t.name.lower() == theirs[type_id].name.lower()
        block, size = gguf.GGML_QUANT_SIZES[theirs[type_id]]
        if type_id == gguf.GGMLQuantizationType.Q8_1:
            # gguf-py still gives Q8_1 its old layout (f32 d and s: 40 bytes); ggml's block_q8_1
            # has fp16 d and s (36 bytes: test below). Q8_1 is an activation type, never in files.
            assert (t.block, t.size, size) == (32, 36, 40)
        else:
            assert (t.block, t.size) == (block, size), t.name


@pytest.mark.llamacpp
def test_type_table_matches_ggml():
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("libggml.*"))
    assert candidates, f"no libggml in {lib_dir}"
    ggml = ctypes.CDLL(str(candidates[0]))
    ggml.ggml_type_name.argtypes, ggml.ggml_type_name.restype = [ctypes.c_int], ctypes.c_char_p
    ggml.ggml_blck_size.argtypes, ggml.ggml_blck_size.restype = [ctypes.c_int], ctypes.c_int64
    ggml.ggml_type_size.argtypes, ggml.ggml_type_size.restype = [ctypes.c_int], ctypes.c_size_t
    for type_id, t in GGML_TYPES.items():
        got = (
            ggml.ggml_type_name(type_id).decode(),
            ggml.ggml_blck_size(type_id),
            ggml.ggml_type_size(type_id),
        )
        assert got == (t.name, t.block, t.size)


def test_type_lookups():
    assert ggml_type("Q4_K") is ggml_type("q4_k") is ggml_type(12) is GGML_TYPES[12]
    assert ggml_type(gguf.GGMLQuantizationType.BF16).name == "bf16"
    assert ggml_type_name(12) == "q4_K" and ggml_type_name(4) == "unknown type 4"
    with pytest.raises(KeyError):
        ggml_type(4)  # removed from ggml
    # every KV cache type llama.cpp is given is a ggml type
    assert [ggml_type(name).name for name in typing.get_args(CacheType)] == list(typing.get_args(CacheType))


def test_c_trait_table_matches_the_type_table():
    """Block size, block bytes and name of every type the C kernels know (se_traits) are the
    format's; the C core knows no type outside the table."""
    known = []
    for type_id in range(256):
        tr = core.type_traits(type_id)
        if tr is None:
            continue
        assert type_id in GGML_TYPES, f"the C core has a type {type_id} that ggml does not"
        t = GGML_TYPES[type_id]
        assert (tr.name.decode(), tr.blck, tr.size) == (t.name, t.block, t.size)
        known.append(t.name)
    assert {"f32", "f16", "bf16", "q4_0", "q4_1", "q8_0", "q4_K", "q6_K"} <= set(known)


# --- ctypes mirrors of the C headers ----------------------------------------------------------------

# core's mirrored enum values -> their names in engine.h
ENUMS = {
    "OK": "SE_OK",
    "ERR_CONTEXT_OVERFLOW": "SE_ERR_CONTEXT_OVERFLOW",
    "ERR_BAD_TOKEN": "SE_ERR_BAD_TOKEN",
    "ERR_INVALID": "SE_ERR_INVALID",
    "ERR_NOMEM": "SE_ERR_NOMEM",
    "ERR_MISSING": "SE_ERR_MISSING",
    "ERR_DEVICE": "SE_ERR_DEVICE",
    "ROPE_NORM": "SE_ROPE_NORM",
    "ROPE_NEOX": "SE_ROPE_NEOX",
}


def _mirrors() -> list[type[ctypes.Structure]]:
    """Every ctypes struct of core.py; each must say which C struct it mirrors."""
    found = [v for v in vars(core).values() if isinstance(v, type) and issubclass(v, ctypes.Structure)]
    for cls in found:
        assert isinstance(getattr(cls, "_c_struct_", None), str), f"{cls.__name__} has no _c_struct_"
    return found


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict[str, int]:
    """name -> value printed by a C program built against the headers: "se_x.field.offset",
    "se_x.field.size", "se_x.size", and each enum's name."""
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed (the C core is built with it)"
    lines = []
    for cls in _mirrors():
        s = cls._c_struct_
        for name, *_ in cls._fields_:
            lines.append(f'printf("{s}.{name}.offset %zu\\n", offsetof({s}, {name}));')
            lines.append(f'printf("{s}.{name}.size %zu\\n", sizeof((({s} *)0)->{name}));')
        lines.append(f'printf("{s}.size %zu\\n", sizeof({s}));')
    for name in [*ENUMS.values(), *(f"SE_T_{slot}" for slot in core.SLOTS)]:
        lines.append(f'printf("{name} %d\\n", (int){name});')
    src = "\n".join(
        [
            "#include <stddef.h>",
            "#include <stdio.h>",
            '#include "engine.h"',
            '#include "kernels.h"',
            "int main(void) {",
            *lines,
            "return 0; }",
        ]
    )
    d = tmp_path_factory.mktemp("layout")
    (d / "layout.c").write_text(src)
    subprocess.run(
        [gcc, "-std=c11", "-Wall", "-Werror", "-I", str(CSRC), str(d / "layout.c"), "-o", str(d / "layout")],
        check=True,
        capture_output=True,
        text=True,
    )
    out = subprocess.run([str(d / "layout")], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_ctypes_structs_match_the_c_headers(c_layout):
    for cls in _mirrors():
        s = cls._c_struct_
        for name, *_ in cls._fields_:
            field = getattr(cls, name)
            assert (field.offset, field.size) == (
                c_layout[f"{s}.{name}.offset"],
                c_layout[f"{s}.{name}.size"],
            ), f"{cls.__name__}.{name} does not lie where {s}.{name} does"
        if cls is core.Traits:
            # read through a pointer from se_traits: the C table may append fields after the mirrored ones
            assert ctypes.sizeof(cls) <= c_layout[f"{s}.size"]
        else:
            # Python allocates these and C reads all of sizeof(struct): they must be the same size
            assert ctypes.sizeof(cls) == c_layout[f"{s}.size"], f"{cls.__name__} vs sizeof({s})"


def test_enum_values_match_the_c_headers(c_layout):
    for py, c in ENUMS.items():
        assert getattr(core, py) == c_layout[c], py
    assert core.SLOTS == {slot: c_layout[f"SE_T_{slot}"] for slot in core.SLOTS}


def test_python_and_c_know_the_same_architectures():
    """model.py reads each architecture's hyperparameters; the C core's table (model.c) says which
    architectures exist and which tensors their layers have: both must name the same ones, and
    every per-layer slot the C side requires must be one model.py can find in a file."""
    from stdengine.reference import model

    assert set(model.ARCH_HPARAMS) == set(core.architectures()) == {"llama", "gemma3"}
    for arch in core.architectures():
        assert core.arch_layer_slots(arch) <= set(model._LAYER_TENSORS.values()), arch
    assert core.arch_layer_slots("gemma3") - core.arch_layer_slots("llama") == {
        "ATTN_Q_NORM",
        "ATTN_K_NORM",
        "ATTN_POST_NORM",
        "FFN_POST_NORM",
    }
