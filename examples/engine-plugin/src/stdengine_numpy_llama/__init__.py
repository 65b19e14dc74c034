"""numpy-llama, an example stdengine engine plugin (spec/plugin-tutorial.md): tiny llama GGUF models in
numpy, float32 weights, llama's forward pass top to bottom, a longest-match tokenizer over the vocabulary."""

from typing import Any, Iterator, Sequence

import numpy as np
from gguf import GGUFReader, quants

from stdengine.adapter import DoneEvent, Engine, EngineInfo, GenerateRequest, Timings, TokenEvent, Usage, now_ms
from stdengine.errors import BadModelFile, ContextOverflow, InvalidRequest, UnsupportedArchitecture
from stdengine.generation import StopMatcher


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class NumpyLlamaEngine(Engine):
    name = "numpy-llama"
    description = "example plugin: tiny llama GGUF models in plain numpy (float32)"
    capabilities = frozenset({"stream", "logits", "tokenize", "seed"})
    option_map = {  # what each canonical option becomes here; the core refuses all others
        "model": "GGUF file, weights dequantized to float32", "ctx_size": "KV cache length (0 = the model's)",
        "seed": "numpy Generator seed", "temp": "softmax temperature (0 = greedy)", "top_k": "top-k",
        "top_p": "top-p", "min_p": "min-p", "n_predict": "generation limit", "stop": "core stop matcher",
    }
    accepted_values = {"n_gpu_layers": (0,)}  # CPU only: -ngl 0 is fine, anything else is refused

    @classmethod
    def version(cls) -> str:
        return "0.1.0"

    @classmethod
    def load(cls, options: Any, events: Any) -> "NumpyLlamaEngine":
        try:
            reader = GGUFReader(options.model)
        except Exception as e:  # not GGUF, truncated, ...
            raise BadModelFile(f"cannot read {options.model} as GGUF: {e}") from e
        meta = {f.name: f.contents() for f in reader.fields.values()}
        if meta.get("general.architecture") != "llama":
            raise UnsupportedArchitecture(f"numpy-llama runs llama models, not {meta.get('general.architecture')}")
        weights = {t.name: quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
        events.info("model.loaded", path=options.model, architecture="llama", n_tensors=len(weights))
        return cls(meta, weights, options)

    def __init__(self, meta: dict[str, Any], weights: dict[str, np.ndarray], options: Any) -> None:
        self.w, self.options = weights, options
        self.n_layer, self.n_head = meta["llama.block_count"], meta["llama.attention.head_count"]
        self.n_kv = meta.get("llama.attention.head_count_kv", self.n_head)
        self.eps = meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)
        self.rope_base = meta.get("llama.rope.freq_base", 10000.0)
        self.vocab = [t.replace("\u2581", " ") for t in meta["tokenizer.ggml.tokens"]]  # SentencePiece's space
        self.ids, self.longest = {t: i for i, t in enumerate(self.vocab)}, max(map(len, self.vocab))
        self.bos, self.eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
        self.ctx = options.ctx_size or meta["llama.context_length"]
        self.head_dim = meta["llama.embedding_length"] // self.n_head
        self.k, self.v = (np.zeros((self.n_layer, self.ctx, self.n_kv, self.head_dim), np.float32) for _ in "kv")
        self.n_past = 0  # tokens in the KV cache

    def info(self) -> EngineInfo:
        return EngineInfo(self.name, self.version(), f"numpy {np.__version__}", model={"path": self.options.model})

    def n_ctx(self) -> int:
        return int(self.ctx)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        out, i = ([self.bos] if add_special and self.bos is not None else []), 0
        while i < len(text):  # the longest vocabulary entry that matches at i
            n = next((n for n in range(min(self.longest, len(text) - i), 0, -1) if text[i : i + n] in self.ids), 0)
            if n == 0:
                raise InvalidRequest(f"numpy-llama cannot tokenize {text[i]!r}: it is in no vocabulary entry")
            out, i = out + [self.ids[text[i : i + n]]], i + n
        return out

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(self.vocab[t] for t in tokens)

    def reset(self) -> None:
        self.n_past = 0

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """llama.cpp's "normal" RoPE: each pair (x[2i], x[2i+1]) turns by pos * base^(-2i/head_dim)."""
        angle = pos[:, None] * self.rope_base ** (-np.arange(0, self.head_dim, 2) / self.head_dim)
        turned = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)[:, None, :]
        return np.stack([turned.real, turned.imag], axis=-1).reshape(x.shape).astype(np.float32)

    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        n, p0 = len(tokens), self.n_past
        if n == 0:
            raise InvalidRequest("decode needs at least one token")
        if p0 + n > self.ctx:
            raise ContextOverflow(f"{p0 + n} tokens do not fit the context of {self.ctx}", hint="raise -c")
        pos = np.arange(p0, p0 + n)
        h = self.w["token_embd.weight"][list(tokens)]
        for i in range(self.n_layer):
            w = {k.split(".")[2]: v for k, v in self.w.items() if k.startswith(f"blk.{i}.")}
            x = rms_norm(h, w["attn_norm"], self.eps)
            q = self._rope((x @ w["attn_q"].T).reshape(n, self.n_head, self.head_dim), pos)
            self.k[i, p0 : p0 + n] = self._rope((x @ w["attn_k"].T).reshape(n, self.n_kv, self.head_dim), pos)
            self.v[i, p0 : p0 + n] = (x @ w["attn_v"].T).reshape(n, self.n_kv, self.head_dim)
            group = self.n_head // self.n_kv  # grouped-query attention: head j reads key/value head j // group
            keys, values = (np.repeat(c[i, : p0 + n], group, axis=1) for c in (self.k, self.v))
            scores = np.einsum("nhd,thd->hnt", q, keys) / np.sqrt(self.head_dim)
            scores[:, np.arange(p0 + n)[None, :] > pos[:, None]] = -np.inf  # causal mask
            h = h + np.einsum("hnt,thd->nhd", softmax(scores), values).reshape(n, -1) @ w["attn_output"].T
            x = rms_norm(h, w["ffn_norm"], self.eps)
            gate = x @ w["ffn_gate"].T
            h = h + (gate / (1 + np.exp(-gate)) * (x @ w["ffn_up"].T)) @ w["ffn_down"].T
        self.n_past += n
        out = self.w.get("output.weight", self.w["token_embd.weight"])  # tied embeddings when absent
        logits = rms_norm(h, self.w["output_norm.weight"], self.eps) @ out.T
        return logits if all_logits else logits[-1]

    def _sample(self, logits: np.ndarray, s: Any, rng: np.random.Generator) -> int:
        if s.temp <= 0:
            return int(np.argmax(logits))
        order = np.argsort(-logits)[: s.top_k or None]  # top-k, then top-p and min-p, then temperature
        p = softmax(logits[order])
        order = order[(np.cumsum(p) - p < s.top_p) & (p >= s.min_p * p[0])]
        return int(rng.choice(order, p=softmax(logits[order] / s.temp)))

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent | DoneEvent]:
        if request.messages is not None or not request.prompt:
            raise InvalidRequest("numpy-llama completes a non-empty prompt; it has no chat template")
        s, t0, prompt = request.sampling, now_ms(), self.tokenize(request.prompt)
        self.reset()  # no prefix reuse: evaluate the whole prompt each time
        logits = self.decode(prompt)
        t1, n_gen, finish, stop = now_ms(), 0, "stop", None
        rng, stops = np.random.default_rng(None if s.seed < 0 else s.seed), StopMatcher(s.stop)
        while (s.n_predict < 0 or n_gen < s.n_predict) and self.n_past < self.ctx:
            tok = self._sample(logits, s, rng)
            if tok == self.eos:  # end of generation: not part of the text
                break
            n_gen += 1
            text, stop = stops.feed(self.vocab[tok])
            yield TokenEvent(tok, text)
            if stop is not None:
                break
            logits = self.decode([tok])
        else:  # the loop ran out (n_predict or a full context), not a break
            finish = "length"
        if stop is None and (tail := stops.flush()):
            yield TokenEvent(-1, tail)
        yield DoneEvent(finish, Usage(len(prompt), n_gen), Timings(len(prompt), t1 - t0, n_gen, now_ms() - t1), stop)
