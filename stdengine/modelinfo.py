"""What `infer models info` reports about a GGUF model, and the memory a run of it needs.

Names follow llama.cpp: the file type is llama_model_ftype_name() of `general.file_type`, tensor
types are ggml's type names, and the hyperparameters use llama.cpp's print_info() names
(n_ctx_train, n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab).

Memory needed at a context size n_ctx:
  weights   the bytes of every tensor in the file
  KV cache  f16 K and V for every layer and position:
            2 * n_layer * n_ctx * n_head_kv * head_dim * 2 bytes
            (head_dim = {arch}.attention.key_length, else n_embd / n_head; when K and V head sizes
            differ, the two halves use their own sizes)
  compute   an estimate of the float32 scratch buffers while a prompt is evaluated in physical
            batches of n_ub = min(512, n_ctx) tokens, with logits for the last token only:
            4 * (n_vocab + n_ub * (n_head * n_ctx + 4 * n_embd + 2 * n_ff)) bytes
            (logits, one layer's attention scores, activations, the FFN hidden state)
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from stdengine.generation import choose_chat_template
from stdengine.gguf_file import GGUFHeader, scan_gguf

DEFAULT_CTX_SIZE = 4096
DEFAULT_UBATCH = 512  # llama.cpp's default physical batch (-ub)

KV_FORMULA = "2 * n_layer * n_ctx * n_head_kv * head_dim * 2 bytes (K and V, f16)"
COMPUTE_FORMULA = (
    "4 * (n_vocab + n_ub * (n_head * n_ctx + 4 * n_embd + 2 * n_ff)) bytes, n_ub = min(512, n_ctx)"
)

# llama_ftype -> llama_model_ftype_name() (llama.cpp include/llama.h, src/llama-model-loader.cpp)
FTYPE_NAMES: dict[int, str] = {
    0: "all F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K - Medium",
    11: "Q3_K - Small",
    12: "Q3_K - Medium",
    13: "Q3_K - Large",
    14: "Q4_K - Small",
    15: "Q4_K - Medium",
    16: "Q5_K - Small",
    17: "Q5_K - Medium",
    18: "Q6_K",
    19: "IQ2_XXS - 2.0625 bpw",
    20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small",
    22: "IQ3_XS - 3.3 bpw",
    23: "IQ3_XXS - 3.0625 bpw",
    24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw",
    26: "IQ3_S - 3.4375 bpw",
    27: "IQ3_S mix - 3.66 bpw",
    28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw",
    30: "IQ4_XS - 4.25 bpw",
    31: "IQ1_M - 1.75 bpw",
    32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary",
    37: "TQ2_0 - 2.06 bpw ternary",
    38: "MXFP4 MoE",
}
FTYPE_GUESSED = 1024


def ftype_name(ftype: int | None) -> str | None:
    """llama.cpp's name for a llama_ftype id, e.g. 3 -> 'Q4_1', 15 -> 'Q4_K - Medium'."""
    if ftype is None:
        return None
    guessed = bool(ftype & FTYPE_GUESSED)
    name = FTYPE_NAMES.get(ftype & ~FTYPE_GUESSED, "unknown, may not work")
    return name + " (guessed)" if guessed else name


@dataclass
class TensorTypeStats:
    type: str  # ggml's name: f32, q4_1, q4_K, ...
    type_id: int
    count: int
    bytes: int


@dataclass
class MemoryEstimate:
    ctx_size: int
    weights_bytes: int
    kv_cache_bytes: int | None
    compute_bytes: int | None
    total_bytes: int | None
    kv_formula: str = KV_FORMULA
    compute_formula: str = COMPUTE_FORMULA


@dataclass
class ModelInfo:
    path: str
    file_size: int
    gguf_version: int
    architecture: str | None
    name: str | None
    size_label: str | None
    n_params: int
    n_tensors: int
    file_type: int | None
    file_type_name: str | None
    tensor_types: list[TensorTypeStats]
    n_ctx_train: int | None
    n_embd: int | None
    n_layer: int | None
    n_head: int | None
    n_head_kv: int | None
    n_embd_head_k: int | None
    n_embd_head_v: int | None
    n_ff: int | None
    n_vocab: int | None
    tokenizer_model: str | None
    tokenizer_pre: str | None
    has_chat_template: bool  # the file carries tokenizer.chat_template
    # The template a run uses without --chat-template: "model file", the built-in fallback by name
    # ("built-in 'gemma' (the model file has none)"), or "none" (see choose_chat_template).
    chat_template: str
    memory: MemoryEstimate

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(value: Any) -> int | None:
    # Some converters store a per-layer array (e.g. head_count_kv for hybrid models); report the max.
    if isinstance(value, list) and value:
        value = max(value)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def model_info(path: str | os.PathLike[str], ctx_size: int = DEFAULT_CTX_SIZE) -> ModelInfo:
    """Read a GGUF file's header and describe the model; ctx_size 0 means the training context."""
    return info_from_header(scan_gguf(path), ctx_size)


def info_from_header(h: GGUFHeader, ctx_size: int = DEFAULT_CTX_SIZE) -> ModelInfo:
    md = h.metadata
    arch = md.get("general.architecture")
    arch = arch if isinstance(arch, str) else None

    def hp(key: str) -> int | None:
        return _int(md.get(f"{arch}.{key}")) if arch else None

    n_embd, n_head = hp("embedding_length"), hp("attention.head_count")
    n_head_kv = hp("attention.head_count_kv") or n_head  # absent means no grouped-query attention
    fallback_head = n_embd // n_head if n_embd and n_head else None
    head_k = hp("attention.key_length") or fallback_head
    head_v = hp("attention.value_length") or fallback_head
    n_layer, n_ff, n_ctx_train = hp("block_count"), hp("feed_forward_length"), hp("context_length")

    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if tokens is not None else hp("vocab_size")

    by_type: dict[int, TensorTypeStats] = {}
    for t in h.tensors:
        s = by_type.setdefault(t.type_id, TensorTypeStats(t.type_name, t.type_id, 0, 0))
        s.count += 1
        s.bytes += t.n_bytes
    weights = sum(t.n_bytes for t in h.tensors)

    n_ctx = ctx_size if ctx_size > 0 else (n_ctx_train or DEFAULT_CTX_SIZE)
    kv = None
    if n_layer and n_head_kv and head_k and head_v:
        kv = n_layer * n_ctx * n_head_kv * (head_k + head_v) * 2
    compute = None
    if n_vocab and n_head and n_embd:
        n_ub = min(DEFAULT_UBATCH, n_ctx)
        compute = 4 * (n_vocab + n_ub * (n_head * n_ctx + 4 * n_embd + 2 * (n_ff or 0)))
    total = weights + kv + compute if kv is not None and compute is not None else None

    ftype = _int(md.get("general.file_type"))
    tok_model, tok_pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre")
    return ModelInfo(
        path=str(h.path),
        file_size=h.file_size,
        gguf_version=h.version,
        architecture=arch,
        name=md.get("general.name") if isinstance(md.get("general.name"), str) else None,
        size_label=md.get("general.size_label") if isinstance(md.get("general.size_label"), str) else None,
        n_params=sum(t.n_elements for t in h.tensors),
        n_tensors=len(h.tensors),
        file_type=ftype,
        file_type_name=ftype_name(ftype),
        tensor_types=sorted(by_type.values(), key=lambda s: s.type_id),
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_ff=n_ff,
        n_vocab=n_vocab,
        tokenizer_model=tok_model if isinstance(tok_model, str) else None,
        tokenizer_pre=tok_pre if isinstance(tok_pre, str) else None,
        has_chat_template=isinstance(md.get("tokenizer.chat_template"), str),
        chat_template=choose_chat_template(None, md)[1],
        memory=MemoryEstimate(n_ctx, weights, kv, compute, total),
    )


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.2f} {unit}"
    return f"{value / 1024:.2f} TiB"


def human_count(n: int) -> str:
    """Parameter counts as llama.cpp prints them: 134.52 M, 268.10 M, 1.24 B."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    if n >= 1e3:
        return f"{n / 1e3:.2f} K"
    return str(n)
