"""Loading a GGUF model for the reference engine: memory-map it, validate it, hand the C core pointers.

    >>> m = Model.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> m.arch, m.hparams.n_layer, m.n_vocab, m.tensors["blk.0.attn_q.weight"].type_name
    ('llama', 30, 49152, 'q4_1')

The file is mapped read-only and the weights are used where they lie: nothing is copied, so a
load costs the header scan (tens of milliseconds) plus page faults as the weights are first read.

A GGUF file is untrusted input. Before the C core sees a pointer, every tensor the architecture
uses is checked: present (every layer), of the expected shape, of a type the kernels support,
and with its bytes inside the file. Anything else raises BadModelFile (UnsupportedArchitecture
for an architecture, tensor type or feature the engine does not implement), naming the file and
the tensor. The C core checks shapes and types once more (engine.h).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from stdengine.reference import core
from stdengine.reference.core import SLOTS, HParams

from stdengine import gguf_file
from stdengine.errors import BadModelFile, EngineFailure, UnsupportedArchitecture, UnsupportedOption

# A layer's tensors: GGUF name suffix (blk.N.<suffix>.weight) -> C slot. Which of them an
# architecture's layers have is the C core's architecture table (core.arch_layer_slots).
_LAYER_TENSORS = {
    "attn_norm": "ATTN_NORM",
    "attn_q": "ATTN_Q",
    "attn_k": "ATTN_K",
    "attn_v": "ATTN_V",
    "attn_output": "ATTN_OUTPUT",
    "ffn_norm": "FFN_NORM",
    "ffn_gate": "FFN_GATE",
    "ffn_up": "FFN_UP",
    "ffn_down": "FFN_DOWN",
    "attn_q_norm": "ATTN_Q_NORM",  # gemma3: a per-head norm of q and k
    "attn_k_norm": "ATTN_K_NORM",
    "post_attention_norm": "ATTN_POST_NORM",  # gemma3: a norm of each block's output
    "post_ffw_norm": "FFN_POST_NORM",
}
_NORM_SLOTS = {
    "OUTPUT_NORM",
    "ATTN_NORM",
    "ATTN_Q_NORM",
    "ATTN_K_NORM",
    "ATTN_POST_NORM",
    "FFN_NORM",
    "FFN_POST_NORM",
}


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file. shape is in ggml order: shape[0] is the row length."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    type_name: str
    offset: int  # absolute byte offset in the file
    n_bytes: int


def _bad(path: Path, what: str) -> BadModelFile:
    return BadModelFile(
        f"{path}: {what}",
        hint="the file is damaged or was not written by a llama.cpp converter; re-download or re-convert it",
        path=str(path),
    )


def _unsupported(path: Path, what: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"{path}: {what}",
        hint="use an engine that supports it "
        "(e.g. llama.cpp), or a model of a supported architecture "
        f"({', '.join(core.architectures())})",
        path=str(path),
    )


class Model:
    """A GGUF model mapped into memory and described to the C core.

    Attributes: path, arch (general.architecture), metadata (every key/value of the file, as the
    scan read it: see load), hparams (core.HParams),
    tensors (name -> Tensor), n_vocab, n_ctx_train, file_size, tied_output (no output.weight:
    the token embedding doubles as the output head). Create with Model.load(path).
    A Model may back several Contexts; close() (or garbage collection) closes them too.
    """

    # set by load() (declared here so that type checkers know them)
    path: Path
    arch: str
    file_size: int
    metadata: dict[str, Any]
    tensors: dict[str, Tensor]
    hparams: HParams
    layers: list[tuple[float, int]]
    n_vocab: int
    n_ctx_train: int
    tied_output: bool

    def __init__(self) -> None:  # use Model.load
        self._handle: int | None = None
        self._map: mmap.mmap | None = None
        self._buf: np.ndarray | None = None
        self._contexts: weakref.WeakSet[Any] = weakref.WeakSet()
        self.device: core.Device | None = None  # set by offload()
        self.gpu_layers = 0  # layers on the device
        self.gpu_head = False  # the output norm and head on the device too

    @classmethod
    def load(cls, path: str | os.PathLike[str], header: gguf_file.GGUFHeader | None = None) -> Model:
        """Map and validate a GGUF file. Raises BadModelFile / UnsupportedArchitecture.

        header: the file's scan (gguf_file.scan_gguf) when the caller has one: the engine scans a
        file once for the model and the tokenizer. Without it the file is scanned here, with long
        arrays (the vocabulary) summarised as gguf_file.ArrayValue.
        """
        path = Path(path)
        if header is None:  # the container: magic, version, bounds of every tensor
            header = gguf_file.scan_gguf(path)
        self = cls()
        self.path = path
        self.file_size = header.file_size
        self.metadata = header.metadata
        if header.byte_order != "<":
            raise _unsupported(path, "big-endian GGUF files are not supported")
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise _bad(path, "general.architecture is missing")
        if arch not in core.architectures():  # the C core's table (model.c)
            raise _unsupported(
                path,
                f"architecture {arch!r} is not supported by the reference engine "
                f"(supported: {', '.join(core.architectures())})",
            )
        self.arch = arch
        self.tensors = {
            t.name: Tensor(t.name, tuple(t.shape), t.type_id, t.type_name, t.offset, t.n_bytes)
            for t in header.tensors
        }
        # per layer (rope base, sliding window; 0 = full attention): gemma3 mixes local and global layers
        self.hparams, self.layers = ARCH_HPARAMS[arch](path, self.metadata, self.tensors)
        self.n_vocab = self.hparams.n_vocab
        self.n_ctx_train = _get_int(
            path, self.metadata, f"{arch}.context_length", default=0, lo=0, hi=1 << 32
        )
        # no output.weight: the logits reuse the token embedding (a tied model; model.loaded says so)
        self.tied_output = "output.weight" not in self.tensors
        plan = _plan(path, self.hparams, self.tensors, self.file_size, arch)

        # Map the file and describe it to the C core.
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._map) != self.file_size:
            raise _bad(path, "the file changed size while it was being loaded")
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        base = self._buf.ctypes.data
        api = core.api()
        hp = core.hparams_struct(self.hparams)
        handle = api.se_model_new(ctypes.byref(hp))
        if not handle:
            raise _bad(path, f"the hyperparameters are out of the engine's range: {self.hparams}")
        self._handle = handle
        for t, layer, slot in plan:
            rc = api.se_model_set_tensor(
                handle,
                layer,
                SLOTS[slot],
                base + t.offset,
                t.type_id,
                t.shape[0],
                t.shape[1] if len(t.shape) > 1 else 1,
            )
            if rc != 0:
                self.close()
                raise _bad(
                    path,
                    f"tensor {t.name!r} ({t.type_name}, shape {list(t.shape)}) was refused by the engine",
                )
        for il, (rope_base, window) in enumerate(self.layers):
            if api.se_model_set_layer(handle, il, rope_base, window) != 0:
                self.close()
                raise _bad(path, f"layer {il}: rope base {rope_base} / sliding window {window} refused")
        bad_layer, bad_slot = ctypes.c_int32(-1), ctypes.c_int32(-1)
        rc = api.se_model_finalize(handle, ctypes.byref(bad_layer), ctypes.byref(bad_slot))
        if rc != 0:
            self.close()
            slot = {v: k for k, v in SLOTS.items()}.get(bad_slot.value, "?")
            raise _bad(path, f"tensor slot {slot} of layer {bad_layer.value} is missing or unusable")
        api.se_model_set_file_mapped(handle, 1)  # the tensors are views of the read-only mapping above
        return self

    def offload(self, device: core.Device, n_gpu_layers: int) -> None:
        """Uploads the first n_gpu_layers layers to the device (n_gpu_layers > n_layer or < 0:
        every layer and the output head, like llama.cpp's -ngl 99 / -1), before any Context is
        made; those layers then run there. Raises UnsupportedOption (a tensor type the device
        cannot multiply), EngineFailure (the device would not open, its kernels would not build
        (the compiler's log), out of device memory (the bytes asked for)); the model then stays
        on the CPU."""
        if n_gpu_layers == 0:
            return
        if self._contexts or self.device is not None:
            raise EngineFailure("a model is offloaded once, before its first context is created")
        rc = core.api().se_model_offload(self.handle, device.index, n_gpu_layers)
        if rc == core.ERR_INVALID:
            raise UnsupportedOption(
                f"engine 'reference' cannot offload {self.path} to {device}: {core.backend_error()}",
                hint="offload fewer layers (-ngl) or run on the CPU (-ngl 0)",
                options=["n_gpu_layers"],
            )
        if rc != core.OK:
            what = "out of device memory" if rc == core.ERR_NOMEM else "the device failed"
            raise EngineFailure(
                f"cannot offload {self.path} to {device}: {what}: {core.backend_error()}",
                hint="offload fewer layers (-ngl), choose another device (--device), or run on the CPU (-ngl 0)",
            )
        head = ctypes.c_int32(0)
        self.gpu_layers = int(core.api().se_model_gpu_layers(self.handle, ctypes.byref(head)))
        self.gpu_head = bool(head.value)
        self.device = device

    @property
    def handle(self) -> int:
        """The C se_model* (an int), for core.Context."""
        if not self._handle:
            raise BadModelFile("the model is closed", hint="load it again")
        return self._handle

    def set_batch_panels(self, on: bool) -> None:
        """Whether batched decoding may make and read packed panels of the weights (on by default;
        engine.h, se_model_set_batch_panels). Takes effect before the first batched step."""
        core.api().se_model_set_batch_panels(self.handle, int(on))

    @property
    def panels_bytes(self) -> int:
        """Bytes of the packed panels made for batched decoding (0: none yet, or none here)."""
        return int(core.api().se_model_panels_bytes(self.handle))

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor, a read-only view into the mapped file (for tests and tools)."""
        t = self.tensors[name]
        assert self._buf is not None
        return self._buf[t.offset : t.offset + t.n_bytes]

    def description(self) -> str:
        """llama.cpp's model_type line: '<arch> <size label> <file type>'."""
        size = self.metadata.get("general.size_label", "?")
        return f"{self.arch} {size} ftype {self.metadata.get('general.file_type', '?')}"

    def close(self) -> None:
        """Closes every context of this model, frees the C model and unmaps the file."""
        for ctx in list(self._contexts):
            ctx.close()
        if self._handle:
            core.api().se_model_free(self._handle)
            self._handle = None
        self._buf = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view (tensor_bytes) is still alive: unmapped when it goes
                pass
            self._map = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Model({str(getattr(self, 'path', '?'))!r}, arch={getattr(self, 'arch', '?')!r})"


def _get_int(
    path: Path, md: dict[str, Any], key: str, default: int | None = None, lo: int = 1, hi: int = 1 << 24
) -> int:
    v = md.get(key, default)
    if v is None:
        raise _bad(path, f"metadata key {key!r} is missing")
    if isinstance(v, list):
        raise _unsupported(path, f"{key!r} is a per-layer array; the reference engine needs one value")
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(path, f"metadata key {key!r} is {v!r}, not an integer")
    if not lo <= v <= hi:
        raise _bad(path, f"metadata key {key!r} is {v}, outside [{lo}, {hi}]")
    return v


def _get_float(path: Path, md: dict[str, Any], key: str, default: float | None = None) -> float:
    v = md.get(key, default)
    if v is None:
        raise _bad(path, f"metadata key {key!r} is missing")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(path, f"metadata key {key!r} is {v!r}, not a finite number")
    return float(v)


def _llama_hparams(path: Path, md: dict[str, Any], tensors: dict[str, Tensor], a: str = "llama") -> HParams:
    """llama's hyperparameters; the keys are read under the prefix a (gemma3 shares them)."""
    n_layer = _get_int(path, md, f"{a}.block_count", hi=1024)
    n_embd = _get_int(path, md, f"{a}.embedding_length", hi=1 << 16)
    n_ff = _get_int(path, md, f"{a}.feed_forward_length", hi=1 << 18)
    n_head = _get_int(path, md, f"{a}.attention.head_count", hi=1024)
    n_head_kv = _get_int(path, md, f"{a}.attention.head_count_kv", default=n_head, hi=1024)
    if n_head % n_head_kv:
        raise _bad(path, f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if f"{a}.attention.key_length" not in md and n_embd % n_head:
        raise _bad(path, f"embedding_length {n_embd} is not a multiple of head_count {n_head}")
    head_dim = _get_int(path, md, f"{a}.attention.key_length", default=n_embd // n_head, hi=1024)
    v_dim = _get_int(path, md, f"{a}.attention.value_length", default=head_dim, hi=1024)
    if v_dim != head_dim:
        raise _unsupported(path, f"key_length {head_dim} != value_length {v_dim}")
    n_rot = _get_int(path, md, f"{a}.rope.dimension_count", default=head_dim, lo=2, hi=head_dim)
    if n_rot % 2:
        raise _bad(path, f"rope.dimension_count {n_rot} is odd")
    eps = _get_float(path, md, f"{a}.attention.layer_norm_rms_epsilon")
    if not 0 <= eps < 1:
        raise _bad(path, f"layer_norm_rms_epsilon {eps} is out of range")
    base = _get_float(path, md, f"{a}.rope.freq_base", default=10000.0)
    if base <= 0:
        raise _bad(path, f"rope.freq_base {base} is not positive")
    scaling = md.get(f"{a}.rope.scaling.type", "none")
    freq_scale = 1.0
    if scaling == "linear":
        factor = _get_float(path, md, f"{a}.rope.scaling.factor", default=1.0)
        if factor <= 0:
            raise _bad(path, f"rope.scaling.factor {factor} is not positive")
        freq_scale = 1.0 / factor
    elif scaling != "none":
        raise _unsupported(path, f"rope scaling {scaling!r} is not supported (only none and linear)")
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise _bad(path, "tensor 'token_embd.weight' is missing")
    if len(emb.shape) != 2 or emb.shape[0] != n_embd or not 1 <= emb.shape[1] <= 1 << 24:
        raise _bad(
            path, f"tensor 'token_embd.weight' has shape {list(emb.shape)}, expected [{n_embd}, n_vocab]"
        )
    n_vocab = emb.shape[1]
    declared = md.get(f"{a}.vocab_size")
    if declared is not None and declared != n_vocab:
        raise _bad(path, f"{a}.vocab_size is {declared} but token_embd.weight has {n_vocab} rows")
    toks = md.get("tokenizer.ggml.tokens")
    if toks is not None and len(toks) != n_vocab:
        raise _bad(path, f"the vocabulary has {len(toks)} tokens but token_embd.weight has {n_vocab} rows")
    return HParams(
        arch=core.architectures()[a],
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        n_rot=n_rot,
        rope_type=core.ROPE_NORM,
        norm_eps=eps,
        rope_base=base,
        rope_freq_scale=freq_scale,
        attn_scale=1.0 / math.sqrt(head_dim),
        embd_scale=1.0,
    )


def _gemma3_hparams(
    path: Path, md: dict[str, Any], tensors: dict[str, Tensor]
) -> tuple[HParams, list[tuple[float, int]]]:
    """gemma3's hyperparameters and per-layer (rope base, sliding window), as llama.cpp decides them
    (spec/reference-engine.md): the keys it shares with llama, NEOX RoPE, embeddings times
    sqrt(n_embd), attention scale 1/sqrt(key_length), and every `pattern`-th layer global (full
    attention, rope.freq_base) while the others are local (window, rope.freq_base_swa)."""
    a = "gemma3"
    hp = _llama_hparams(path, md, tensors, a)
    for key in (f"{a}.final_logit_softcapping", f"{a}.attn_logit_softcapping"):
        if md.get(key):
            raise _unsupported(path, f"{key} is set; the reference engine does not implement soft-capping")
    if md.get(f"{a}.rope.scaling.type", "none") != "none":
        raise _unsupported(path, "rope scaling on a gemma3 model is not supported")
    window = _get_int(path, md, f"{a}.attention.sliding_window", default=0, lo=0)
    pattern = _get_int(path, md, f"{a}.attention.sliding_window_pattern", default=6, hi=1024)
    base_local = _get_float(path, md, f"{a}.rope.freq_base_swa", default=10000.0)
    if base_local <= 0:
        raise _bad(path, f"rope.freq_base_swa {base_local} is not positive")
    # llama.cpp scales queries by 1/sqrt(n_embd / n_head) for the 62-layer (27B) model only
    head_scale = hp.n_embd // hp.n_head if hp.n_layer == 62 else hp.head_dim
    hp = replace(
        hp,
        rope_type=core.ROPE_NEOX,
        attn_scale=1.0 / math.sqrt(head_scale),
        embd_scale=math.sqrt(hp.n_embd),
    )
    layers = []
    for il in range(hp.n_layer):
        local = window > 0 and il % pattern < pattern - 1
        layers.append((base_local, window) if local else (hp.rope_base, 0))
    return hp, layers


def _llama_layers(
    path: Path, md: dict[str, Any], tensors: dict[str, Tensor]
) -> tuple[HParams, list[tuple[float, int]]]:
    """llama's hyperparameters and per-layer (rope base, sliding window): every layer global."""
    hp = _llama_hparams(path, md, tensors)
    return hp, [(hp.rope_base, 0)] * hp.n_layer


# general.architecture -> how its hyperparameters and per-layer settings are read. The names are
# the C core's architecture table's (a test checks that both list the same ones).
ARCH_HPARAMS = {"llama": _llama_layers, "gemma3": _gemma3_hparams}


def _expected_shape(hp: HParams, slot: str) -> tuple[int, ...]:
    E, Dq, Dkv = hp.n_embd, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    return {
        "TOKEN_EMBD": (E, hp.n_vocab),
        "OUTPUT": (E, hp.n_vocab),
        "OUTPUT_NORM": (E,),
        "ATTN_NORM": (E,),
        "ATTN_Q": (E, Dq),
        "ATTN_K": (E, Dkv),
        "ATTN_V": (E, Dkv),
        "ATTN_OUTPUT": (Dq, E),
        "FFN_NORM": (E,),
        "FFN_GATE": (E, hp.n_ff),
        "FFN_UP": (E, hp.n_ff),
        "FFN_DOWN": (hp.n_ff, E),
        "ATTN_Q_NORM": (hp.head_dim,),
        "ATTN_K_NORM": (hp.head_dim,),
        "ATTN_POST_NORM": (E,),
        "FFN_POST_NORM": (E,),
    }[slot]


def _plan(
    path: Path, hp: HParams, tensors: dict[str, Tensor], file_size: int, arch: str
) -> list[tuple[Tensor, int, str]]:
    """(tensor, layer or -1, slot) for every tensor, after checking each one. Raises on the first
    problem; a tensor the forward pass would not use is refused too (it would be silently wrong)."""
    want: dict[str, tuple[int, str, bool]] = {  # name -> (layer, slot, required)
        "token_embd.weight": (-1, "TOKEN_EMBD", True),
        "output_norm.weight": (-1, "OUTPUT_NORM", True),
        "output.weight": (-1, "OUTPUT", False),
    }
    layer_slots = core.arch_layer_slots(arch)
    layer_map = {suffix: slot for suffix, slot in _LAYER_TENSORS.items() if slot in layer_slots}
    for il in range(hp.n_layer):
        for suffix, slot in layer_map.items():
            want[f"blk.{il}.{suffix}.weight"] = (il, slot, True)
    for name in tensors:
        if name not in want:
            raise _unsupported(
                path,
                f"tensor {name!r} is not used by the reference engine's {arch} "
                "forward pass (a feature it does not implement)",
            )
    plan = []
    for name, (layer, slot, required) in want.items():
        t = tensors.get(name)
        if t is None:
            if required:
                raise _bad(path, f"tensor {name!r} is missing")
            continue
        shape = _expected_shape(hp, slot)
        if t.shape != shape:
            raise _bad(path, f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if not core.type_supported(t.type_id):
            raise _unsupported(
                path,
                f"tensor {name!r} has type {t.type_name}, which the reference "
                f"engine does not support (supported: {', '.join(core.supported_types())})",
            )
        if slot in _NORM_SLOTS and t.type_id != 0:
            raise _unsupported(path, f"tensor {name!r} is {t.type_name}; norm weights must be f32")
        if slot == "OUTPUT" or (slot == "TOKEN_EMBD" and "output.weight" not in tensors):
            if not core.type_has_matmul(t.type_id):
                raise _unsupported(path, f"tensor {name!r} ({t.type_name}) cannot be used as the output head")
        elif slot not in _NORM_SLOTS and slot != "TOKEN_EMBD" and not core.type_has_matmul(t.type_id):
            raise _unsupported(path, f"tensor {name!r} has type {t.type_name}, which has no matmul kernel")
        n_bytes = core.row_size(t.type_id, shape[0]) * (shape[1] if len(shape) > 1 else 1)
        if t.n_bytes != n_bytes:
            raise _bad(path, f"tensor {name!r} should hold {n_bytes} bytes, the file says {t.n_bytes}")
        if t.offset < 0 or t.offset + n_bytes > file_size:
            raise _bad(
                path,
                f"tensor {name!r} (bytes {t.offset}..{t.offset + n_bytes}) runs past the "
                f"end of the file ({file_size} bytes): truncated or corrupt",
            )
        plan.append((t, layer, slot))
    return plan
