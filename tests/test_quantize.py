"""`infer quantize` and the C quantizers (spec/quantize.md).

Independent sources: gguf.quants decodes every block we write (bit for bit what the quantizer
says it meant), llama.cpp's own quantizer picks each tensor's type (our recipes must agree),
llama.cpp loads every output, and numpy gives the error of plain round-to-nearest quantizers
that ours must beat.
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import write_llama_gguf
from stdengine.reference import quantize as q

from stdengine.gguf_file import scan_gguf

TYPES = q.TYPES


def _blocks(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Gaussian rows with the blocks a quantizer can get wrong: all zero, constant, one outlier,
    all positive, all negative, tiny (fp16 subnormal scales), huge."""
    x = (rng.standard_normal((rows, n)) * 0.02).astype(np.float32)
    x[0] = 0
    x[1] = 0.5
    x[2, 5] = 3.0
    x[3] = np.abs(x[3])
    x[4] = -np.abs(x[4])
    x[5] *= 1e-6
    x[6] *= 1e3
    return x


@pytest.mark.parametrize("t", TYPES)
def test_blocks_decode_with_gguf_to_what_the_quantizer_meant(t: str) -> None:
    x = _blocks(np.random.default_rng(1), 8, 512)
    for im in (None, np.random.default_rng(2).uniform(0, 4, 512).astype(np.float32)):
        raw, dec = q.quantize(t, x, imatrix=im, decoded=True)
        got = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.upper()]).reshape(x.shape)
        assert np.array_equal(got.view(np.uint32), dec.view(np.uint32)), t
        assert np.all(got[0] == 0)  # a zero block stays zero


# Relative RMS error of plain round-to-nearest with the block's max-abs scale, by bits per weight
# (numpy, below): ours searches for better scales, so it must do at least as well.
def _naive_rel_rmse(x: np.ndarray, qmax: int, block: int) -> float:
    b = x.reshape(-1, block)
    d = np.abs(b).max(axis=1, keepdims=True) / qmax
    y = np.round(b / np.where(d > 0, d, 1)).clip(-qmax, qmax) * d
    return float(np.sqrt(np.mean((y - b) ** 2) / np.mean(b**2)))


@pytest.mark.parametrize(
    "t,qmax,block",
    [("q8_0", 127, 32), ("q5_0", 15, 32), ("q4_0", 7, 32), ("q6_K", 31, 16), ("q3_K", 3, 16)],
)
def test_error_beats_round_to_nearest(t: str, qmax: int, block: int) -> None:
    x = (np.random.default_rng(3).standard_normal((16, 1024)) * 0.02).astype(np.float32)
    _, dec = q.quantize(t, x, decoded=True)
    ours = float(np.sqrt(np.mean((dec - x) ** 2) / np.mean(x**2)))
    assert ours < _naive_rel_rmse(x, qmax, block)


def _best_weighted_fit(x: np.ndarray, w: np.ndarray, qmin: int, qmax: int) -> float:
    """The weighted squared error of the best of 1601 scales per 32-element block (numpy, float64):
    for each scale the integers rounded and clipped to [qmin, qmax], then the weighted
    least-squares scale for those integers. A dense brute force, independent of the quantizer's
    own candidates."""
    b = x.reshape(-1, 1, 32).astype(np.float64)
    wb = np.tile(w.reshape(-1, 32), (x.shape[0], 1))[:, None, :].astype(np.float64)
    amax = np.abs(b).max(axis=2, keepdims=True)
    t = np.concatenate([np.linspace(qmin * 1.5, qmin / 2, 801), np.linspace(qmax / 2, qmax * 1.5, 800)])
    d = amax / t.reshape(1, -1, 1)  # the largest |x| on, inside or beyond either end
    L = np.clip(np.round(b / d), qmin, qmax)
    ds = (wb * b * L).sum(2, keepdims=True) / np.maximum((wb * L * L).sum(2, keepdims=True), 1e-300)
    return float((wb * (b - ds * L) ** 2).sum(2).min(axis=1).sum())


@pytest.mark.parametrize("t,qmin,qmax", [("q4_0", -8, 7), ("q5_0", -16, 15)])
def test_imatrix_fit_is_as_good_as_a_dense_scale_search(t: str, qmin: int, qmax: int) -> None:
    # Real imatrices are skewed (Gemma-3's blk.13.attn_q: one column 2500x the median). A small
    # value in a heavy column must not round to 0 because the block's largest value, in a light
    # column, set the scale: the fit has to consider clipping that value.
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((8, 512)) * 0.02).astype(np.float32)
    im = np.exp(rng.standard_normal(512)).astype(np.float32)
    im[rng.choice(512, 8, replace=False)] *= 1000
    _, dec = q.quantize(t, x, imatrix=im, decoded=True)
    ours = float((im * (x.astype(np.float64) - dec) ** 2).sum())
    assert ours <= 1.02 * _best_weighted_fit(x, im, qmin, qmax)


def test_threads_do_not_change_the_bytes() -> None:
    x = _blocks(np.random.default_rng(4), 37, 256)
    for t in TYPES:
        assert np.array_equal(q.quantize(t, x, threads=1), q.quantize(t, x, threads=3)), t


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        q.quantize("q4_K", np.zeros((2, 96), np.float32))
    with pytest.raises(ValueError, match="cannot quantize"):
        q.quantize("iq2_xxs", np.zeros((2, 256), np.float32))
    with pytest.raises(ValueError, match="importance"):
        q.quantize("q4_0", np.zeros((2, 64), np.float32), imatrix=np.ones(32, np.float32))


# ---- whole models -----------------------------------------------------------------------------

LLAMA_FTYPES = {"Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q5_K_S": 16, "Q5_1": 9, "Q5_0": 8, "Q4_K_M": 15,
                "Q4_K_S": 14, "Q4_1": 3, "Q4_0": 2, "Q3_K_M": 12, "Q3_K_S": 11, "Q2_K": 10}  # fmt: skip


def _llama_quantize(src: Path, dst: Path, ftype: int) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.type_name for t in scan_gguf(path).tensors}


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("quantize")
    # rows of 256 (K-quants fit) with 16 layers (the _M mixes' layer rules show), and rows of 96
    # (every K type falls back to a 32-element type, as for SmolLM2 and Gemma-3)
    wide, narrow = d / "wide-f32.gguf", d / "narrow-f32.gguf"
    write_llama_gguf(wide, weight_type="F32", n_layer=16, n_embd=256, n_ff=256, n_head=4, n_head_kv=1)
    write_llama_gguf(narrow, weight_type="F32", n_layer=3, n_embd=96, n_ff=192, n_head=4, n_head_kv=2)
    return {"wide": wide, "narrow": narrow}


@pytest.mark.parametrize("ft", list(LLAMA_FTYPES))
def test_recipes_match_llamacpp(ft: str, f32_models: dict[str, Path], tmp_path: Path) -> None:
    for kind, src in f32_models.items():
        theirs = tmp_path / f"{kind}-llama.gguf"
        _llama_quantize(src, theirs, LLAMA_FTYPES[ft])
        h = scan_gguf(src)
        ours = q.plan([(t.name, t.shape, t.type_name) for t in h.tensors], ft, h.metadata)
        assert ours == _types(theirs), (kind, ft)


# Every type the tool writes appears in at least one of these files (mixes and row fallbacks).
END_TO_END = [("wide", "Q2_K"), ("wide", "Q4_K_M"), ("wide", "Q5_K_M"), ("narrow", "Q3_K_M"),
              ("narrow", "Q4_1"), ("narrow", "Q5_K_S"), ("narrow", "Q8_0")]  # fmt: skip


@pytest.mark.parametrize("kind,ft", END_TO_END)
def test_llamacpp_loads_the_output(kind: str, ft: str, f32_models: dict[str, Path], tmp_path: Path) -> None:
    import llama_cpp

    src, ours = f32_models[kind], tmp_path / "ours.gguf"
    q.quantize_model(src, ours, ft)
    h = scan_gguf(ours)
    assert h.metadata["general.file_type"] == LLAMA_FTYPES[ft]
    assert "infer quantize" in h.metadata["stdengine.quantize.tool"]
    assert h.metadata["tokenizer.ggml.model"] == scan_gguf(src).metadata["tokenizer.ggml.model"]
    llm = llama_cpp.Llama(str(ours), n_ctx=32, verbose=False, logits_all=True)
    llm.eval([1, 5, 9, 13])
    assert np.all(np.isfinite(np.asarray(llm.scores[:4])))
    llm.close()


def test_end_to_end_files_cover_every_type(f32_models: dict[str, Path]) -> None:
    seen = set()
    for kind, ft in END_TO_END:
        h = scan_gguf(f32_models[kind])
        seen |= set(q.plan([(t.name, t.shape, t.type_name) for t in h.tensors], ft, h.metadata).values())
    assert set(q.TYPES) <= seen


def test_every_tensor_decodes_close_to_the_source(f32_models: dict[str, Path], tmp_path: Path) -> None:
    src = f32_models["wide"]
    out = tmp_path / "q6k.gguf"
    q.quantize_model(src, out, "Q6_K", threads=1)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert ta.name == tb.name
        x = np.asarray(ta.data, dtype=np.float32).reshape(-1)
        y = gguf.quants.dequantize(tb.data, tb.tensor_type).reshape(-1)
        assert np.sqrt(np.mean((x - y) ** 2)) <= 0.02 * np.sqrt(np.mean(x**2)) + 1e-12, ta.name


# ---- imatrix files ------------------------------------------------------------------------------


def _dat(path: Path, entries: dict[str, tuple[int, np.ndarray]]) -> None:
    b = struct.pack("<i", len(entries))
    for name, (ncall, v) in entries.items():
        b += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, v.size)
        b += v.astype("<f4").tobytes()
    path.write_bytes(b + struct.pack("<i", 7) + struct.pack("<i", 4) + b"text")


def test_imatrix_dat_and_gguf(tmp_path: Path) -> None:
    v = np.arange(1, 9, dtype=np.float32)
    _dat(tmp_path / "m.dat", {"blk.0.attn_q.weight": (4, v)})
    assert np.allclose(q.read_imatrix(tmp_path / "m.dat")["blk.0.attn_q.weight"], v / 4)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "imatrix")
    w.add_array("imatrix.datasets", ["text"])
    w.add_uint32("imatrix.chunk_count", 2)
    w.add_uint32("imatrix.chunk_size", 512)
    w.add_tensor("blk.0.attn_q.weight.in_sum2", v.reshape(1, 8))
    w.add_tensor("blk.0.attn_q.weight.counts", np.array([[2.0]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert np.allclose(q.read_imatrix(tmp_path / "m.gguf")["blk.0.attn_q.weight"], v / 2)


# ---- the command ---------------------------------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", "quantize", *args],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=300,
    )


def test_cli_writes_the_file_and_reports(f32_models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "o.gguf"
    r = _run(str(f32_models["narrow"]), str(out), "--type", "q4_k_m", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout
    assert "about" in r.stderr and "wrote" in r.stderr
    assert _types(out)["blk.0.ffn_up.weight"] == "q5_0"  # the Q4_K fallback for rows of 96
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf"]  # no temporary file left


def test_cli_requantizing_warns(f32_models: dict[str, Path], tmp_path: Path) -> None:
    mid, out = tmp_path / "q8.gguf", tmp_path / "q4.gguf"
    assert _run(str(f32_models["narrow"]), str(mid), "--type", "Q8_0").returncode == 0
    r = _run(str(mid), str(out), "--type", "Q4_0")
    assert r.returncode == 0 and "already quantized (q8_0)" in r.stderr


def test_cli_errors_leave_no_output(f32_models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "o.gguf"
    assert _run(str(tmp_path / "missing.gguf"), str(out), "--type", "Q4_0").returncode == 4
    assert _run(str(f32_models["narrow"]), str(out), "--type", "Q9_9").returncode == 2
    assert _run(str(f32_models["narrow"]), str(f32_models["narrow"]), "--type", "Q4_0").returncode == 2
    (tmp_path / "bad.dat").write_bytes(b"\x05\x00")
    r = _run(str(f32_models["narrow"]), str(out), "--type", "Q4_0", "--imatrix", str(tmp_path / "bad.dat"))
    assert r.returncode == 4 and "imatrix" in r.stderr
    # an imatrix whose rows do not fit the model fails half way: nothing is left behind
    _dat(tmp_path / "wrong.dat", {"blk.0.attn_q.weight": (1, np.ones(5, np.float32))})
    r = _run(str(f32_models["narrow"]), str(out), "--type", "Q4_0", "--imatrix", str(tmp_path / "wrong.dat"))
    assert r.returncode == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.dat", "wrong.dat"]


def test_cli_refuses_a_bad_output_path_before_any_work(f32_models: dict[str, Path], tmp_path: Path) -> None:
    # a directory failed only at the final rename (internal error, exit 1), after the whole model
    # was quantized; a missing directory was quietly created
    src = str(f32_models["narrow"])
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"x")
    cases = {
        str(tmp_path / "d"): "names a directory",
        str(tmp_path / "new") + "/": "names a directory",
        "": "OUT is empty",
        str(tmp_path / "no" / "such" / "o.gguf"): "does not exist",
        str(tmp_path / "f" / "o.gguf"): "is not a directory",
    }
    for out, message in cases.items():
        r = _run(src, out, "--type", "Q8_0")
        assert r.returncode == 2, (out, r.stderr)
        assert message in r.stderr and "hint:" in r.stderr, (out, r.stderr)
        assert "about" not in r.stderr and "internal error" not in r.stderr  # refused before the plan
    r = _run(src, str(tmp_path / "o.gguf"), "--type", "Q8_0", "--imatrix-from", src,
             "--imatrix-out", str(tmp_path / "no" / "i.gguf"))  # fmt: skip
    assert r.returncode == 2 and "--imatrix-out" in r.stderr and "does not exist" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]  # nothing made, nothing written
    assert list((tmp_path / "d").iterdir()) == [] and (tmp_path / "f").read_bytes() == b"x"


def test_models_info_lists_each_tensors_type(f32_models: dict[str, Path], tmp_path: Path) -> None:
    import json

    out = tmp_path / "o.gguf"
    q.quantize_model(f32_models["wide"], out, "Q4_K_M")
    r = subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", "models", "info", "--json", "--tensors", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    listed = {t["name"]: t["type"] for t in json.loads(r.stdout)["tensors"]}
    assert listed == _types(out) and "q6_K" in listed.values() and "q4_K" in listed.values()


# ---- importance matrices made by the reference engine (--imatrix-from) ---------------------------


def _exact_act_sums(path: Path, chunks: list[list[int]]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Sums of squared matmul inputs per column, from the exact float64 reference's forward pass.

    ExactModel's attention() and ffn() end with their output projection; giving them an identity
    for it (only while recording) returns the projection's input."""
    from stdengine.conformance.exact import ExactModel

    class Recording(ExactModel):
        identity = False

        def w(self, name: str) -> np.ndarray:
            if self.identity and name.endswith(("attn_output.weight", "ffn_down.weight")):
                return np.eye(super().w(name).shape[1])
            return super().w(name)

    m = Recording(path)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}

    def add(p: str, names: tuple[str, ...], a: np.ndarray) -> None:
        for n in names:
            key = f"{p}{n}.weight"
            sums[key] = sums.get(key, 0) + (a * a).sum(axis=0)
            counts[key] = counts.get(key, 0) + len(a)

    for ids in chunks:
        pos = np.arange(len(ids))
        x = m.w("token_embd.weight")[ids].copy()
        for il in range(m.hp.n_layer):
            p = f"blk.{il}."
            h = m.rmsnorm(x, m.w(p + "attn_norm.weight"))
            add(p, ("attn_q", "attn_k", "attn_v"), h)
            m.identity = True
            o = m.attention(il, h, pos)
            m.identity = False
            add(p, ("attn_output",), o)
            x = x + o @ m.w(p + "attn_output.weight").T
            h = m.rmsnorm(x, m.w(p + "ffn_norm.weight"))
            add(p, ("ffn_gate", "ffn_up"), h)
            m.identity = True
            f = m.ffn(il, h)
            m.identity = False
            add(p, ("ffn_down",), f)
            x = x + f @ m.w(p + "ffn_down.weight").T
    return sums, counts


# chunks of 3 tokens take the small-batch path (each thread prepares every row itself), chunks
# of 12 the large-batch one (rows split over the threads, then a barrier)
@pytest.mark.parametrize("chunk", [3, 12])
def test_activation_statistics_match_the_exact_reference(f32_models: dict[str, Path], chunk: int) -> None:
    from stdengine.reference import imatrix as im

    path = f32_models["narrow"]
    ids = [int(i) for i in np.random.default_rng(5).integers(3, 64, size=26)]
    stats = im.collect(path, tokens=ids, chunk_size=chunk, threads=2)
    n_chunks = len(ids) // chunk  # the rest is dropped, as llama-imatrix drops it
    assert stats.chunks == n_chunks and stats.chunk_size == chunk
    sums, counts = _exact_act_sums(path, [ids[c * chunk : (c + 1) * chunk] for c in range(n_chunks)])
    assert sorted(stats.sums) == sorted(sums)  # 3 layers x 7 weights; not the output head
    for name, s in sums.items():
        assert stats.counts[name] == counts[name] == n_chunks * chunk
        np.testing.assert_allclose(stats.sums[name], s, rtol=2e-4, err_msg=name)


def test_imatrix_gguf_is_what_llamacpp_reads(tmp_path: Path) -> None:
    from stdengine.reference import imatrix as im

    rng = np.random.default_rng(1)
    stats = im.ActStats(
        sums={"blk.0.attn_q.weight": rng.random(64) * 9, "blk.0.ffn_down.weight": rng.random(128)},
        counts={"blk.0.attn_q.weight": 24, "blk.0.ffn_down.weight": 0},
        chunks=2,
        chunk_size=12,
        datasets=["calibration.txt"],
    )
    im.write_gguf(stats, tmp_path / "i.gguf")
    r = gguf.GGUFReader(tmp_path / "i.gguf")  # an independent reader: keys, types and tensors
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.datasets"].contents() == ["calibration.txt"]
    assert r.fields["imatrix.chunk_count"].contents() == 2 and r.fields["imatrix.chunk_size"].contents() == 12
    t = {x.name: x for x in r.tensors}
    assert list(t["blk.0.attn_q.weight.in_sum2"].shape) == [64, 1]
    assert t["blk.0.attn_q.weight.counts"].data.reshape(-1).tolist() == [24.0]
    got = q.read_imatrix(tmp_path / "i.gguf")  # llama.cpp's rule: sum / count, 1 where count is 0
    np.testing.assert_allclose(got["blk.0.attn_q.weight"], stats.sums["blk.0.attn_q.weight"] / 24, rtol=1e-6)
    assert np.all(got["blk.0.ffn_down.weight"] == 1.0)
    for name, v in stats.importance().items():
        np.testing.assert_allclose(got[name], v, rtol=1e-6)


def test_cli_imatrix_from_text(f32_models: dict[str, Path], tmp_path: Path) -> None:
    text, out, imx = tmp_path / "t.txt", tmp_path / "o.gguf", tmp_path / "i.gguf"
    src = tmp_path / "letters-f32.gguf"  # a vocabulary that spells any lower-case text
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = (
        ["<unk>", "<s>", "</s>", "\u2581"]
        + letters
        + ["\u2581" + c for c in letters]
        + [f"<x{i}>" for i in range(8)]
    )
    write_llama_gguf(src, weight_type="F32", n_layer=3, n_embd=96, n_ff=192, n_head=4, n_head_kv=2,
                     tokens=tokens[:64], tokenizer_model="llama")  # fmt: skip
    text.write_text("the quick brown fox jumps over the lazy dog " * 8)
    r = _run(str(src), str(out), "--type", "Q4_0", "--imatrix-from", str(text),
             "--imatrix-out", str(imx), "--imatrix-chunk", "16")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "imatrix: 21 weights" in r.stderr
    md = scan_gguf(out).metadata
    assert md["quantize.imatrix.file"] == "i.gguf" and md["quantize.imatrix.entries_count"] == 21
    assert len(q.read_imatrix(imx)) == 21
    # with an imatrix, llama.cpp's Q4_0 mix gives the first eighth of ffn_down q4_1 (n_layer 3: none)
    assert _types(out)["blk.0.ffn_down.weight"] == "q4_0"
    r = _run(str(src), str(out), "--type", "Q4_0", "--imatrix-from", str(text), "--imatrix", str(imx))
    assert r.returncode == 2 and "exclude" in r.stderr


def test_statistics_leave_the_logits_bit_identical(f32_models: dict[str, Path]) -> None:
    from stdengine.reference import imatrix as im
    from stdengine.reference.core import Context
    from stdengine.reference.model import Model

    ids = [int(i) for i in np.random.default_rng(9).integers(3, 64, size=20)]
    with Model.load(f32_models["narrow"]) as m:
        ctx = Context(m, n_ctx=64, n_threads=2)
        plain = ctx.decode(ids, all_logits=True).copy()
        sums, counts = np.zeros(3 * (2 * 96 + 96 + 192)), np.zeros(12, dtype=np.int64)
        assert im._set_stats()(ctx._h, sums.ctypes.data, counts.ctypes.data) == 0
        ctx.reset()
        counted = ctx.decode(ids, all_logits=True).copy()
        assert im._set_stats()(ctx._h, None, None) == 0
        ctx.close()
    assert plain.tobytes() == counted.tobytes()
    assert counts.tolist() == [20] * 12 and np.all(sums > 0)


# ---- the kernels on what the quantizer writes -------------------------------------------------


@pytest.mark.parametrize("t", ["q2_K", "q3_K"])
def test_every_isa_multiplies_our_kquants_to_float_rounding(t: str, smollm2_path: Path) -> None:
    """SmolLM2's ffn_down (the matrices its Q2_K and Q3_K files hold in these types), quantized by
    our quantizer, times Q8_K activations on every SIMD path and batch path (one row, tiles, GEMM):
    within float rounding (1e-6 of sum|w*a|, about 8 float32 epsilons) of float64 numpy on
    gguf.quants' decoding of the weights and numpy's of the path's own activations.

    The integer dot products are exact on every path, so a larger error is a kernel defect (a
    wrong scale, a wrong bit, a lost block), not rounding. Activations are Gaussian: with
    outliers, a path that adds the offset term of Q3_K in float separately (AVX2, as ggml does)
    loses a few more bits to cancellation (spec/quantize.md, "Across ISAs")."""
    from isa import using_isa
    from stdengine.reference import kernels as K

    gt = gguf.GGMLQuantizationType[t.upper()]
    src = {x.name: x for x in gguf.GGUFReader(str(smollm2_path)).tensors}
    rng = np.random.default_rng(23)
    before = K.isa()
    isas = [name for name in K.ISAS if K.set_isa(name)]  # the paths this CPU can run
    K.set_isa(before)
    for layer in (0, 29):
        w = src[f"blk.{layer}.ffn_down.weight"]
        k = int(w.shape[0])
        x = gguf.quants.dequantize(np.asarray(w.data), w.tensor_type).reshape(-1, k)[:96]
        raw = q.quantize(t, x)
        wd = gguf.quants.dequantize(raw, gt).astype(np.float64).reshape(-1, k)
        a = rng.standard_normal((K.gemm_min_tokens() + 20, k)).astype(np.float32)
        for name in isas:
            with using_isa(name):
                act = K.quantize(gguf.GGMLQuantizationType.Q8_K, a).reshape(len(a), k // 256, 292)
                ad = act[:, :, 0:4].copy().view(np.float32).astype(np.float64) * act[:, :, 4:260].view(
                    np.int8
                )
                ad = ad.reshape(len(a), k)
                want, mag = ad @ wd.T, np.abs(ad) @ np.abs(wd).T
                for n_tok in (1, 3, len(a)):  # generation, tiles, the GEMM
                    got = np.concatenate(
                        [K.matmul(gt, raw, k, a[i : i + n_tok]) for i in range(0, len(a), n_tok)]
                    )
                    err = float((np.abs(got - want) / mag).max())
                    assert err <= 1e-6, f"{t} blk.{layer} {name} batch {n_tok}: {err:.2e} of sum|w*a|"
