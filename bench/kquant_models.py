"""Q3_K and Q2_K test models made with llama.cpp's own quantizer, for the kernels' end-to-end checks.

    python -m stdengine.bench.kquant_models SRC.gguf OUTDIR [--types q3_K q2_K]

1. SRC (any type gguf.quants can decode) is dequantized to an F32 GGUF (OUTDIR/NAME.f32.gguf), its
   metadata copied. The catalogue models were quantized once already (SmolLM2 Q4_1, Gemma Q4_K_M),
   so this F32 copy holds those values, not the original weights.
2. llama.cpp (llama-cpp-python's `llama_model_quantize`) quantizes it with the type's ftype and
   `pure` set, so every matrix it can takes that one type. A K-quant needs rows of a multiple of 256
   elements: llama.cpp gives the others a fallback type (Q4_0 in llama-cpp-python 0.3.36; IQ4_NL in
   some versions). SmolLM2's n_embd is 576 and Gemma's 640, so on SmolLM2 only ffn_down is
   Q3_K/Q2_K, on Gemma ffn_down and attn_output.
3. A tensor of a type the reference engine cannot multiply (IQ4_NL) is rewritten as Q4_0 (the same
   4.5 bits per weight), quantized by gguf.quants from the F32 copy; every other tensor is kept
   byte for byte. The result (OUTDIR/NAME.TYPE.gguf) loads in both engines.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# llama_ftype of a model "mostly" of a type (llama.h); Q3_K_S is the plain Q3_K mix.
FTYPE = {"q2_K": 10, "q3_K": 11}
FALLBACK = Q.Q4_0  # for the rows llama.cpp cannot make K-quants of


def _copy_gguf(src: Path, dst: Path, tensor, file_type: int | None = None) -> None:
    """dst = src with each tensor replaced by tensor(reader_tensor) -> (data, raw type or None)."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val = file_type if key == "general.file_type" and file_type is not None else f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, val, f.types[0], sub_type=sub)
    for t in r.tensors:
        data, raw = tensor(t)
        w.add_tensor(t.name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _dequantized(t) -> np.ndarray:
    shape = tuple(int(n) for n in reversed(t.shape))  # numpy order: rows first
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)


def to_f32(src: Path, dst: Path) -> None:
    _copy_gguf(src, dst, lambda t: (_dequantized(t), None), file_type=0)  # ALL_F32


def llamacpp_quantize(src: Path, dst: Path, kind: str, threads: int = 2) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread, p.pure = FTYPE[kind], threads, True
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")


def without_unsupported(src: Path, f32: Path, dst: Path) -> dict[str, int]:
    """src with every tensor the reference engine cannot multiply requantized to FALLBACK from the
    F32 copy; returns how many tensors of each type dst has."""
    from stdengine.reference import core

    source = {t.name: t for t in gguf.GGUFReader(str(f32)).tensors}
    count: dict[str, int] = {}

    def pick(t):
        keep = t.tensor_type == Q.F32 or core.type_has_matmul(int(t.tensor_type))
        data, typ = (np.asarray(t.data), t.tensor_type) if keep else (None, FALLBACK)
        if data is None:
            data = gguf.quants.quantize(_dequantized(source[t.name]), FALLBACK)
        count[typ.name] = count.get(typ.name, 0) + 1
        return data, typ

    _copy_gguf(src, dst, pick)
    return count


def make(src: Path, outdir: Path, kinds: list[str]) -> dict[str, Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    stem = src.name.removesuffix(".gguf")
    f32 = outdir / f"{stem}.f32.gguf"
    if not f32.exists():
        to_f32(src, f32)
    made = {}
    for kind in kinds:
        raw, out = outdir / f"{stem}.{kind}.llamacpp.gguf", outdir / f"{stem}.{kind}.gguf"
        llamacpp_quantize(f32, raw, kind)
        print(out.name, without_unsupported(raw, f32, out))
        raw.unlink()
        made[kind] = out
    return made


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--types", nargs="+", default=list(FTYPE), choices=list(FTYPE))
    a = ap.parse_args(argv)
    make(a.src, a.outdir, a.types)


if __name__ == "__main__":
    main()
