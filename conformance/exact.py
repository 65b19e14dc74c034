"""The exact reference: what a GGUF model computes, in float64 numpy, independent of any engine.

This module defines the model's math for the conformance suite. It reads the GGUF's header and
tensor table with stdengine.gguf_file (the project's one GGUF reader: it only says where each
tensor's bytes lie, and checks the bounds), dequantizes every weight once with the `gguf` package's
`gguf.quants.dequantize` (the quantized values *are* the model; dequantizing them is exact) and
runs the forward pass over a whole token sequence in float64, with a causal mask instead of a KV
cache. The decoding of the quantized formats, where an engine's kernels could go wrong, stays the
gguf package's own: that keeps this judge independent of the engines it judges. Nothing here is fast and nothing needs to be:
it runs when golden data is made (`python -m stdengine.conformance.golden`), never in CI.

Precision: every weight is stored and every operation is done in float64. Gemma-3-270M's
262144 x 640 embedding is 1.3 GB in float64 and the rest of its weights about 0.8 GB, so the
largest model needs about 2.2 GB: under the 4 GB budget, so no float32 storage shortcut is taken.

Architectures (facts from the models' papers and from llama.cpp's converter and loader, which
fix how a GGUF stores them):

- llama (SmolLM2): x = embd[token]; per layer: h = x + Wo·attn(rope(Wq·n), rope(Wk·n), Wv·n) with
  n = rmsnorm(x)·attn_norm; x = h + Wdown·(silu(Wgate·m) * Wup·m) with m = rmsnorm(h)·ffn_norm;
  logits = output · (rmsnorm(x)·output_norm), `output` falling back to `token_embd` (tied).
  RoPE is the "normal" (GPT-J style) rotation of adjacent pairs (x[2i], x[2i+1]): llama.cpp's
  converter permutes the HF q/k rows so that GGUF llama files use adjacent pairs. GQA: query head
  h reads key/value head h // (n_head / n_head_kv).
- gemma3 (Gemma-3-270M): x = embd[token] * sqrt(n_embd); q and k get a per-head RMSNorm (weights
  attn_q_norm / attn_k_norm over head_dim) before RoPE; RoPE is the NEOX rotation of halves
  (x[i], x[i + d/2]); the attention output and the FFN output are each RMS-normalised again
  (post_attention_norm, post_ffw_norm) before their residual add; the FFN is
  Wdown·(gelu_tanh(Wgate·m) * Wup·m); attention scale 1/sqrt(head_dim) (query_pre_attn_scalar).
  Layers alternate sliding-window ("local") and full ("global") attention: layer il is global when
  il % pattern == pattern - 1. Local layers see keys at positions p with q - p < window and use
  the local RoPE base; global layers see every earlier key and use `gemma3.rope.freq_base`.
  The window is `gemma3.attention.sliding_window`. The pattern (6) and the local base (10000) are
  read from `gemma3.attention.sliding_window_pattern` / `gemma3.rope.freq_base_swa` when a file has
  them, else they are the values llama.cpp's loader fixes for every gemma3 file (Gemma 3's
  published config: 5 local layers then 1 global, local rope_theta 10000).
  Gemma's RMSNorm multiplies by (1 + w) in the original checkpoint; llama.cpp's converter adds
  the 1 when it writes the GGUF, so a GGUF norm weight is used as is: rmsnorm(x) * w.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Hparams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    eps: float
    rope_base: float
    rope_base_local: float
    window: int  # 0 = no sliding window
    pattern: int  # global every `pattern` layers (gemma3); 0 = all global
    n_vocab: int


class ExactModel:
    """A GGUF model's float64 forward pass. `logits(tokens)` returns (len(tokens), n_vocab)."""

    SUPPORTED = ("llama", "gemma3")

    def __init__(self, path: str | Path) -> None:
        from stdengine.gguf_file import scan_gguf

        self.path = Path(path)
        header = scan_gguf(self.path)
        md = header.metadata
        arch = str(md.get("general.architecture"))
        if arch not in self.SUPPORTED:
            raise ValueError(f"the exact reference implements {self.SUPPORTED}, not {arch!r}")
        self.metadata = md
        a = arch
        n_embd = int(md[f"{a}.embedding_length"])
        n_head = int(md[f"{a}.attention.head_count"])
        n_head_kv = int(md.get(f"{a}.attention.head_count_kv", n_head))
        head_dim = int(md.get(f"{a}.attention.key_length", n_embd // n_head))
        gemma = arch == "gemma3"
        base = float(md.get(f"{a}.rope.freq_base", 10000.0))
        self.hp = Hparams(
            arch=arch,
            n_layer=int(md[f"{a}.block_count"]),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_rot=int(md.get(f"{a}.rope.dimension_count", head_dim)),
            eps=float(md[f"{a}.attention.layer_norm_rms_epsilon"]),
            rope_base=base,
            rope_base_local=float(md.get(f"{a}.rope.freq_base_swa", 10000.0)) if gemma else base,
            window=int(md.get(f"{a}.attention.sliding_window", 0)) if gemma else 0,
            pattern=int(md.get(f"{a}.attention.sliding_window_pattern", 6)) if gemma else 0,
            n_vocab=0,
        )
        scaling = md.get(f"{a}.rope.scaling.type")
        if scaling not in (None, "none") and float(md.get(f"{a}.rope.scaling.factor", 1.0)) != 1.0:
            raise ValueError("the exact reference does not implement RoPE scaling")
        if md.get(f"{a}.final_logit_softcapping") or md.get(f"{a}.attn_logit_softcapping"):
            raise ValueError("the exact reference does not implement logit soft-capping")
        self._tensors = {t.name: t for t in header.tensors}
        self._file = np.memmap(self.path, dtype=np.uint8, mode="r")  # read-only, pages read on use
        self._cache: dict[str, np.ndarray] = {}
        self.hp.n_vocab = self.w("token_embd.weight").shape[0]

    # --- weights ------------------------------------------------------------------------------
    def w(self, name: str) -> np.ndarray:
        """A weight dequantized to float64, numpy shape (rows, row_length), cached for the session."""
        if name not in self._cache:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            t = self._tensors[name]
            raw = self._file[t.offset : t.offset + t.n_bytes]
            arr = dequantize(raw, GGMLQuantizationType(t.type_id))
            shape = tuple(reversed(t.shape))  # GGUF lists ne0 (the row) first
            self._cache[name] = np.asarray(arr, dtype=np.float64).reshape(shape)
        return self._cache[name]

    def has(self, name: str) -> bool:
        return name in self._tensors

    # --- building blocks ----------------------------------------------------------------------
    def rmsnorm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.hp.eps) * weight

    def rope(self, x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
        """Rotate the first n_rot dims of each head. x: (T, heads, head_dim)."""
        n_rot = self.hp.n_rot
        half = n_rot // 2
        inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)  # theta_i = base^(-2i/d)
        ang = positions.astype(np.float64)[:, None] * inv[None, :]  # (T, half)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = x.copy()
        if self.hp.arch == "gemma3":  # NEOX: pairs (i, i + n_rot/2)
            a, b = x[..., :half], x[..., half:n_rot]
            out[..., :half] = a * cos - b * sin
            out[..., half:n_rot] = a * sin + b * cos
        else:  # normal: adjacent pairs (2i, 2i+1)
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = a * cos - b * sin
            out[..., 1:n_rot:2] = a * sin + b * cos
        return out

    def is_local(self, il: int) -> bool:
        hp = self.hp
        return hp.window > 0 and hp.pattern > 0 and il % hp.pattern < hp.pattern - 1

    def attention(self, il: int, n: np.ndarray, positions: np.ndarray) -> np.ndarray:
        hp = self.hp
        T = n.shape[0]
        p = f"blk.{il}."
        q = (n @ self.w(p + "attn_q.weight").T).reshape(T, hp.n_head, hp.head_dim)
        k = (n @ self.w(p + "attn_k.weight").T).reshape(T, hp.n_head_kv, hp.head_dim)
        v = (n @ self.w(p + "attn_v.weight").T).reshape(T, hp.n_head_kv, -1)
        if self.has(p + "attn_q_norm.weight"):  # gemma3: per-head RMSNorm of q and k
            q = self.rmsnorm(q, self.w(p + "attn_q_norm.weight"))
            k = self.rmsnorm(k, self.w(p + "attn_k_norm.weight"))
        base = hp.rope_base_local if self.is_local(il) else hp.rope_base
        q = self.rope(q, positions, base)
        k = self.rope(k, positions, base)
        # causal mask, narrowed to the sliding window on local layers
        dist = positions[:, None] - positions[None, :]  # query pos - key pos
        allowed = dist >= 0
        if self.is_local(il):
            allowed &= dist < hp.window
        group = hp.n_head // hp.n_head_kv
        scale = 1.0 / math.sqrt(hp.head_dim)
        out = np.empty((T, hp.n_head, v.shape[-1]), dtype=np.float64)
        for h in range(hp.n_head):
            kv = h // group
            s = (q[:, h, :] @ k[:, kv, :].T) * scale
            s = np.where(allowed, s, -np.inf)
            s -= s.max(axis=1, keepdims=True)
            e = np.exp(s)
            out[:, h, :] = (e / e.sum(axis=1, keepdims=True)) @ v[:, kv, :]
        return out.reshape(T, -1) @ self.w(p + "attn_output.weight").T

    def ffn(self, il: int, m: np.ndarray) -> np.ndarray:
        p = f"blk.{il}."
        g = m @ self.w(p + "ffn_gate.weight").T
        u = m @ self.w(p + "ffn_up.weight").T
        if self.hp.arch == "gemma3":  # GELU, tanh approximation
            act = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
        else:  # SiLU
            act = g / (1.0 + np.exp(-g))
        return (act * u) @ self.w(p + "ffn_down.weight").T

    # --- the forward pass ---------------------------------------------------------------------
    def hidden(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """The final normalised hidden states, (T, n_embd)."""
        hp = self.hp
        ids = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(len(ids), dtype=np.int64)
        x = self.w("token_embd.weight")[ids].copy()
        gemma = hp.arch == "gemma3"
        if gemma:
            x *= math.sqrt(hp.n_embd)
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            a = self.attention(il, self.rmsnorm(x, self.w(p + "attn_norm.weight")), positions)
            if gemma:
                a = self.rmsnorm(a, self.w(p + "post_attention_norm.weight"))
            x = x + a
            f = self.ffn(il, self.rmsnorm(x, self.w(p + "ffn_norm.weight")))
            if gemma:
                f = self.rmsnorm(f, self.w(p + "post_ffw_norm.weight"))
            x = x + f
        return self.rmsnorm(x, self.w("output_norm.weight"))

    def logits(self, tokens: list[int] | np.ndarray, last: int | None = None) -> np.ndarray:
        """Next-token logits after every token, (T, n_vocab), float64; with `last`, only after the
        last `last` tokens (the output head over a long text's every position is the costly part)."""
        out_w = self.w("output.weight") if self.has("output.weight") else self.w("token_embd.weight")
        h = self.hidden(tokens)
        return (h if last is None else h[-last:]) @ out_w.T
