"""`models info` and GGUF validation: synthetic files whose contents the test knows, the real
SmolLM2 and Gemma-3 files, and damaged files (truncated, not GGUF) that must give BadModelFile."""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf_factory import write_llama_gguf

from stdengine.cli.models import models
from stdengine.errors import BadModelFile
from stdengine.gguf_file import scan_gguf
from stdengine.modelinfo import ftype_name, model_info

# ggml block sizes and bytes per block (llama.cpp ggml-common.h, anchors §5.2), and ggml's names.
BLOCK = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
GGML_NAME = {
    "F32": "f32",
    "F16": "f16",
    "BF16": "bf16",
    "Q4_0": "q4_0",
    "Q4_1": "q4_1",
    "Q5_0": "q5_0",
    "Q5_1": "q5_1",
    "Q8_0": "q8_0",
    "Q2_K": "q2_K",
    "Q3_K": "q3_K",
    "Q4_K": "q4_K",
    "Q5_K": "q5_K",
    "Q6_K": "q6_K",
}


def expected_types(written) -> dict[str, tuple[int, int]]:
    """ggml type name -> (count, bytes), from the shapes and types the factory wrote."""
    out: dict[str, list[int]] = {}
    for t in written.tensors.values():
        block, size = BLOCK[t.type.name]
        c = out.setdefault(GGML_NAME[t.type.name], [0, 0])
        c[0] += 1
        c[1] += int(np.prod(t.shape)) // block * size
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_ftype_names_are_llama_cpps():
    assert ftype_name(3) == "Q4_1"
    assert ftype_name(15) == "Q4_K - Medium"
    assert ftype_name(7) == "Q8_0"  # ftype 7 is Q8_0, although ggml type 7 is Q5_1
    assert ftype_name(8) == "Q5_0"
    assert ftype_name(0) == "all F32"
    assert ftype_name(32) == "BF16"
    assert ftype_name(1024 | 18) == "Q6_K (guessed)"
    assert ftype_name(5) == "unknown, may not work"  # removed id
    assert ftype_name(None) is None


@pytest.mark.parametrize(
    "weight_type,overrides,dims",
    [
        (
            "Q4_1",
            {
                "token_embd.weight": "Q8_0",
                "output.weight": "F16",
                "blk.0.attn_q.weight": "BF16",
                "blk.1.ffn_up.weight": "Q5_0",
                "blk.1.ffn_down.weight": "Q4_0",
                "blk.0.ffn_up.weight": "Q5_1",
            },
            dict(n_embd=64, n_ff=128, n_head=4, n_head_kv=2),
        ),
        (
            "Q4_K",
            {
                "blk.0.ffn_down.weight": "Q6_K",
                "blk.1.ffn_down.weight": "Q2_K",
                "blk.0.attn_q.weight": "Q3_K",
                "blk.0.attn_k.weight": "Q5_K",
                "output.weight": "F32",
            },
            dict(n_embd=256, n_ff=512, n_head=8, n_head_kv=2),
        ),
    ],
)
def test_info_on_synthetic_model(tmp_path, weight_type, overrides, dims):
    path = tmp_path / "m.gguf"
    written = write_llama_gguf(
        path,
        weight_type=weight_type,
        tensor_types=overrides,
        n_layer=2,
        chat_template="{{ messages }}",
        **dims,
    )
    info = model_info(path, ctx_size=1000)

    got = {t.type: (t.count, t.bytes) for t in info.tensor_types}
    assert got == expected_types(written)
    assert info.n_tensors == len(written.tensors) == 2 * 9 + 3
    assert info.n_params == sum(int(np.prod(t.shape)) for t in written.tensors.values())
    assert info.architecture == "llama"
    assert info.file_type_name == {"Q4_1": "Q4_1", "Q4_K": "Q4_K - Medium"}[weight_type]
    assert (info.n_layer, info.n_embd, info.n_ff) == (2, dims["n_embd"], dims["n_ff"])
    assert (info.n_head, info.n_head_kv) == (dims["n_head"], dims["n_head_kv"])
    assert info.n_vocab == 64 and info.n_ctx_train == 256
    assert info.tokenizer_model == "llama" and info.tokenizer_pre == "default"
    assert info.has_chat_template
    head_dim = dims["n_embd"] // dims["n_head"]
    assert info.memory.ctx_size == 1000
    assert info.memory.kv_cache_bytes == 2 * 2 * 1000 * dims["n_head_kv"] * head_dim * 2
    assert info.memory.weights_bytes == sum(b for _, b in got.values())
    assert (
        info.memory.total_bytes
        == info.memory.weights_bytes + info.memory.kv_cache_bytes + info.memory.compute_bytes
    )


def test_ctx_size_zero_uses_training_context(tmp_path):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, n_ctx_train=512, n_head=4, n_head_kv=4, n_embd=64)
    info = model_info(path, ctx_size=0)
    assert info.memory.ctx_size == 512
    assert info.memory.kv_cache_bytes == 2 * 2 * 512 * 4 * 16 * 2
    assert not info.has_chat_template


def test_scan_agrees_with_gguf_reader(tmp_path):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, weight_type="Q8_0", tensor_types={"output.weight": "F16"})
    ours = scan_gguf(path)
    theirs = gguf.GGUFReader(path)
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.offset, t.n_bytes, t.n_elements) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes, t.n_elements) for t in theirs.tensors
    ]
    assert (ours.version, ours.alignment) == (theirs.fields["GGUF.version"].contents(), theirs.alignment)


def test_scan_metadata_matches_gguf_reader(tmp_path):
    path = tmp_path / "m.gguf"
    tokens = ["<unk>", "<s>", "</s>"] + [f"tök{i}" for i in range(2000)]  # longer than MAX_ARRAY_ITEMS
    write_llama_gguf(
        path,
        tokens=tokens,
        merges=["t ö", "tö k"],
        chat_template="{{ x }}",
        extra_kv={
            "test.ints": list(range(1500)),
            "test.small": [1.5, 2.5],
            "test.flag": True,
            "test.neg": -7,
            "test.f": 0.25,
        },
    )
    theirs = gguf.GGUFReader(path)
    lazy = scan_gguf(path).metadata
    assert len(lazy["tokenizer.ggml.tokens"]) == len(tokens)  # summarised, not loaded
    full = scan_gguf(path, load_arrays=True).metadata
    assert full["tokenizer.ggml.tokens"] == tokens
    assert list(full["test.ints"]) == list(range(1500))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        ours = full[key]
        ours = ours.tolist() if isinstance(ours, np.ndarray) else ours
        assert ours == field.contents(), key
    assert (full["test.flag"], full["test.neg"], full["test.f"], full["test.small"]) == (
        True,
        -7,
        0.25,
        [1.5, 2.5],
    )


# --- the real models ------------------------------------------------------------------------------


@pytest.mark.models
def test_info_on_smollm2(smollm2_path):
    info = model_info(smollm2_path)
    assert info.architecture == "llama"
    assert info.n_layer == 30
    assert info.n_embd == 576
    assert info.n_vocab == 49152
    assert info.file_type == 3 and info.file_type_name == "Q4_1"
    counts = {t.type: t.count for t in info.tensor_types}
    assert counts["q4_1"] == 210
    assert info.tokenizer_model == "gpt2" and info.tokenizer_pre == "smollm"
    assert info.has_chat_template
    # SmolLM2-135M: 9 heads, 3 KV heads of 64 -> KV f16 at 4096 = 2*30*4096*3*64*2 bytes
    assert info.memory.kv_cache_bytes == 2 * 30 * 4096 * 3 * 64 * 2


@pytest.mark.models
def test_info_on_gemma3(gemma3_path):
    info = model_info(gemma3_path)
    assert info.architecture == "gemma3"
    assert info.file_type_name == "Q4_K - Medium"
    assert info.n_vocab == 262144
    assert info.tokenizer_model == "llama"


@pytest.mark.models
def test_cli_info_json_on_smollm2(smollm2_path):
    result = CliRunner().invoke(models, ["info", str(smollm2_path), "--json", "-c", "2048"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["architecture"] == "llama"
    assert data["file_type_name"] == "Q4_1"
    assert {t["type"]: t["count"] for t in data["tensor_types"]}["q4_1"] == 210
    assert data["memory"]["ctx_size"] == 2048


def test_cli_info_text(tmp_path):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, weight_type="Q4_1")
    result = CliRunner().invoke(models, ["info", str(path)])
    assert result.exit_code == 0, result.output
    for text in ("llama", "Q4_1", "q4_1", "f32", "KV cache", "memory at ctx_size 4096"):
        assert text in result.output


def test_cli_help_states_the_kv_formula():
    result = CliRunner().invoke(models, ["info", "--help"])
    assert "2 * n_layer * n_ctx * n_head_kv * head_dim * 2" in result.output


# --- damaged files --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    write_llama_gguf(path, weight_type="Q4_1")
    return path


def cut(src: Path, dst: Path, n: int) -> Path:
    dst.write_bytes(src.read_bytes()[:n])
    return dst


def assert_bad(path: Path, *phrases: str) -> BadModelFile:
    with pytest.raises(BadModelFile) as err:
        scan_gguf(path)
    assert str(path) in err.value.message
    for p in phrases:
        assert p in err.value.message, err.value.message
    # model_info and resolve take the same road
    with pytest.raises(BadModelFile):
        model_info(path)
    return err.value


def test_truncated_inside_header(good_file, tmp_path):
    assert_bad(cut(good_file, tmp_path / "h2.gguf", 2), "not a GGUF file")
    for n in (6, 12, 20):
        assert_bad(cut(good_file, tmp_path / f"h{n}.gguf", n), "truncated", "header")


def test_truncated_inside_metadata_and_tensor_infos(good_file, tmp_path):
    reader = gguf.GGUFReader(good_file)
    kv_offsets = [f.offset for k, f in reader.fields.items() if not k.startswith("GGUF.")]
    info_offsets = [t.field.offset for t in reader.tensors]
    for n in (kv_offsets[3] + 5, kv_offsets[-1] + 3):
        assert_bad(cut(good_file, tmp_path / f"kv{n}.gguf", n), "truncated", "key/value")
    for n in (info_offsets[0] + 3, info_offsets[5] + 12, info_offsets[-1] + 20):
        assert_bad(cut(good_file, tmp_path / f"ti{n}.gguf", n), "truncated", "tensor info")


def test_truncated_inside_tensor_data_names_the_tensor(good_file, tmp_path):
    reader = gguf.GGUFReader(good_file)
    tensors = sorted(reader.tensors, key=lambda t: t.data_offset)
    for t in (tensors[0], tensors[len(tensors) // 2], tensors[-1]):
        n = t.data_offset + t.n_bytes // 2
        assert_bad(cut(good_file, tmp_path / "d.gguf", n), "truncated", repr(t.name))


def test_not_gguf(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a model\n")
    assert_bad(text, "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert_bad(empty, "empty")


def test_unsupported_version(good_file, tmp_path):
    data = bytearray(good_file.read_bytes())
    data[4:8] = struct.pack("<I", 99)
    bad = tmp_path / "v99.gguf"
    bad.write_bytes(bytes(data))
    assert_bad(bad, "unsupported GGUF version 99")


def test_unknown_tensor_type(good_file, tmp_path):
    reader = gguf.GGUFReader(good_file)
    t = reader.tensors[1]
    # tensor info: u64 name length, name, u32 n_dims, i64 x n_dims, then the i32 type id
    pos = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
    data = bytearray(good_file.read_bytes())
    assert struct.unpack_from("<i", data, pos)[0] == int(t.tensor_type)
    struct.pack_into("<i", data, pos, 250)
    bad = tmp_path / "type250.gguf"
    bad.write_bytes(bytes(data))
    assert_bad(bad, "unknown tensor type id 250", repr(t.name))


def test_cli_bad_file_is_one_clear_line(tmp_path, capsys):
    from stdengine.cli.main import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(SystemExit) as ex:
        main(["models", "info", str(bad)])
    assert ex.value.code == BadModelFile.exit_status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"error: {bad}: truncated" in err


@pytest.mark.models
def test_tensor_type_counts_match_reader_on_real_file(smollm2_path):
    """Cross-check our scan against the gguf package on a real file (independent reader)."""
    theirs = Counter(t.tensor_type.name for t in gguf.GGUFReader(smollm2_path).tensors)
    ours = {t.type: t.count for t in model_info(smollm2_path).tensor_types}
    assert ours == {GGML_NAME[k]: v for k, v in theirs.items()}


def test_info_says_which_chat_template_a_run_uses(tmp_path):
    with_template, without = tmp_path / "t.gguf", tmp_path / "n.gguf"
    write_llama_gguf(with_template, chat_template="{{ messages[0].content }}")
    write_llama_gguf(without)
    assert model_info(with_template).chat_template == "model file"
    assert model_info(without).chat_template == "none"  # llama has no built-in fallback
    r = CliRunner().invoke(models, ["info", str(without)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if "chat template" in x)
    assert "none: runs complete the prompt as given" in line


@pytest.mark.models
def test_info_on_gemma3_names_the_builtin_template_runs_fall_back_to(gemma3_path):
    # The catalogue's Gemma-3-270M is a base model whose GGUF has no chat template; a run (without
    # --raw) renders the built-in gemma turn format, and `models info` must say so, not just "no".
    info = model_info(gemma3_path)
    assert not info.has_chat_template
    assert info.chat_template == "built-in 'gemma' (the model file has none)"
    r = CliRunner().invoke(models, ["info", str(gemma3_path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if "chat template" in x)
    assert "built-in 'gemma' template" in line and "--raw" in line
    r = CliRunner().invoke(models, ["info", "--json", str(gemma3_path)])
    assert json.loads(r.output)["chat_template"] == "built-in 'gemma' (the model file has none)"


@pytest.mark.parametrize("alignment", [1, 2, 4])
def test_alignment_must_be_a_power_of_two_multiple_of_8(tmp_path, alignment):
    """GGUF's general.alignment is a multiple of 8: 1, 2 or 4 would misalign every tensor's data
    and UBSan reports misaligned loads in the kernels); 16 is fine."""
    for value, ok in ((alignment, False), (16, True)):
        path = tmp_path / f"a{value}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_custom_alignment(value)
        w.add_tensor("t", np.zeros(8, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if ok:
            assert scan_gguf(path).alignment == 16
        else:
            with pytest.raises(BadModelFile, match="general.alignment is"):
                scan_gguf(path)


def test_huge_counts_are_refused_before_reading(tmp_path):
    """Counts that cannot fit in the file (a crafted 2^31 tensors over zeros, an array of 2^40
    items) are refused at once, not walked entry by entry to the end of the file."""
    zeros = bytes(1 << 20)
    many_tensors = tmp_path / "tensors.gguf"
    many_tensors.write_bytes(b"GGUF" + struct.pack("<Iqq", 3, 1 << 31, 0) + zeros)
    assert_bad(many_tensors, "cannot fit", "2147483648 tensors")
    key = b"general.architecture"
    big_array = tmp_path / "array.gguf"
    big_array.write_bytes(
        b"GGUF"
        + struct.pack("<Iqq", 3, 0, 1)
        + struct.pack("<Q", len(key))
        + key
        + struct.pack("<iiQ", 9, 4, 1 << 40)
        + zeros
    )
    assert_bad(big_array, "cannot fit", repr(key.decode()))
