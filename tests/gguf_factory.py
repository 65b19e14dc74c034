"""Tiny synthetic GGUF models for tests, written with gguf.GGUFWriter.

`write_llama_gguf(path, ...)` writes a llama-architecture model (metadata, a small vocabulary,
random weights) and returns what it wrote, so a test can check a reader against the writer's own
values. Weight matrices get `weight_type` unless `tensor_types` names another type for a tensor;
norms are always F32 (as llama.cpp writes them).

Types with a quantizer in gguf.quants (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, ...) are
quantized from random floats. The k-quants (Q2_K..Q6_K) have no quantizer there, so their blocks
are random bytes with sane f16 scales: they decode to bounded values with gguf.quants.dequantize,
which is what a kernel test compares against. Their rows must be multiples of 256 elements
(use n_embd=256, n_ff=512).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

Q = GGMLQuantizationType

# Byte offsets of the f16 scale fields (d, dmin) in each k-quant block (ggml-common.h).
_K_SCALE_OFFSETS: dict[Q, tuple[int, ...]] = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}

# The llama_ftype a converter would record for a model whose weights are mostly of this type.
FILE_TYPE_FOR: dict[Q, int] = {
    Q.F32: 0,
    Q.F16: 1,
    Q.Q4_0: 2,
    Q.Q4_1: 3,
    Q.Q8_0: 7,
    Q.Q5_0: 8,
    Q.Q5_1: 9,
    Q.Q2_K: 10,
    Q.Q3_K: 12,
    Q.Q4_K: 15,
    Q.Q5_K: 17,
    Q.Q6_K: 18,
    Q.BF16: 32,
}


@dataclass
class WrittenTensor:
    name: str
    type: Q
    shape: tuple[int, ...]  # numpy order (rows, columns); GGUF's ne is the reverse
    values: np.ndarray  # float32 values before quantization (k-quants: the decoded values)
    data: np.ndarray  # what was written: float32/float16 elements or quantized bytes


@dataclass
class WrittenModel:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, WrittenTensor] = field(default_factory=dict)


def _as_type(t: Q | str | int) -> Q:
    if isinstance(t, Q):
        return t
    if isinstance(t, str):
        return Q[t.upper()]
    return Q(t)


def random_tensor(
    shape: Sequence[int], qtype: Q | str, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(float32 values, the array to write) for a random tensor of this shape and type."""
    qtype = _as_type(qtype)
    shape = tuple(shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"a {qtype.name} row needs a multiple of {block} elements, got {shape[-1]}")
    if qtype in _K_SCALE_OFFSETS:
        n_blocks = int(np.prod(shape)) // block
        blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        for off in _K_SCALE_OFFSETS[qtype]:
            scales = rng.uniform(1e-4, 1e-3, size=n_blocks).astype(np.float16)
            blocks[:, off : off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
        data = blocks.reshape(*shape[:-1], shape[-1] // block * type_size)
        return quants.dequantize(data, qtype).astype(np.float32), data
    values = rng.standard_normal(shape).astype(np.float32) * 0.05
    if qtype == Q.F32:
        return values, values
    data = quants.quantize(values, qtype)
    return values, data


def llama_tensor_shapes(
    n_layer: int, n_embd: int, n_ff: int, n_vocab: int, n_head: int, n_head_kv: int
) -> dict[str, tuple[int, ...]]:
    """llama's tensors and their numpy shapes (rows, columns), in llama.cpp's names."""
    n_embd_kv = n_embd // n_head * n_head_kv
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, n_embd)}
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (n_embd,),
            p + "attn_q.weight": (n_embd, n_embd),
            p + "attn_k.weight": (n_embd_kv, n_embd),
            p + "attn_v.weight": (n_embd_kv, n_embd),
            p + "attn_output.weight": (n_embd, n_embd),
            p + "ffn_norm.weight": (n_embd,),
            p + "ffn_gate.weight": (n_ff, n_embd),
            p + "ffn_up.weight": (n_ff, n_embd),
            p + "ffn_down.weight": (n_embd, n_ff),
        }
    shapes |= {"output_norm.weight": (n_embd,), "output.weight": (n_vocab, n_embd)}
    return shapes


def _value_type(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    raise TypeError(f"cannot infer a GGUF type for {value!r}; pass (value, GGUFValueType)")


def write_llama_gguf(
    path: str | Path,
    *,
    weight_type: Q | str = Q.F32,
    tensor_types: Mapping[str, Q | str] | None = None,
    n_layer: int = 2,
    n_embd: int = 64,
    n_ff: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ctx_train: int = 256,
    tokens: Sequence[str] | None = None,
    tokenizer_model: str = "llama",
    tokenizer_pre: str | None = "default",
    merges: Sequence[str] | None = None,
    chat_template: str | None = None,
    token_types: Sequence[int] | None = None,
    file_type: int | None = None,
    extra_kv: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> WrittenModel:
    """Write a small llama model. tokens default to 3 specials + 61 plain tokens (n_vocab 64).

    extra_kv values are str/int/float/bool, a list (written as an array), or (value, GGUFValueType).
    file_type defaults to the llama_ftype of weight_type.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    weight_type = _as_type(weight_type)
    overrides = {k: _as_type(v) for k, v in (tensor_types or {}).items()}
    if tokens is None:
        tokens = ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(61)]
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    if file_type is None:
        file_type = FILE_TYPE_FOR.get(weight_type)

    w = GGUFWriter(str(path), "llama")
    w.add_name("synthetic llama")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_tokenizer_model(tokenizer_model)
    if tokenizer_pre is not None:
        w.add_tokenizer_pre(tokenizer_pre)
    w.add_token_list(list(tokens))
    w.add_token_scores([0.0] * n_vocab)
    if token_types is None:  # BYTE for <0xXX>, CONTROL for other <...>, NORMAL for the rest
        token_types = [
            6 if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else 3 if t.startswith("<") and t.endswith(">") else 1
            for t in tokens
        ]
    w.add_token_types(list(token_types))
    if merges is not None:
        w.add_token_merges(list(merges))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, tuple):
            w.add_key_value(key, value[0], value[1])
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, _value_type(value))

    model = WrittenModel(path=path, metadata={})
    shapes = llama_tensor_shapes(n_layer, n_embd, n_ff, n_vocab, n_head, n_head_kv)
    for name, shape in shapes.items():
        qtype = overrides.get(name, Q.F32 if len(shape) == 1 else weight_type)
        values, data = random_tensor(shape, qtype, rng)
        w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        model.tensors[name] = WrittenTensor(name, qtype, shape, values, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.metadata = {
        "general.architecture": "llama",
        "llama.block_count": n_layer,
        "llama.embedding_length": n_embd,
        "llama.feed_forward_length": n_ff,
        "llama.attention.head_count": n_head,
        "llama.attention.head_count_kv": n_head_kv,
        "llama.context_length": n_ctx_train,
        "general.file_type": file_type,
        "n_vocab": n_vocab,
    }
    return model
