"""Quality of `infer quantize` beside llama.cpp's own quantizer, on the same F32 input.

For each file type: quantize the F32 source with our tool and with llama.cpp's
(llama_cpp.llama_model_quantize with llama_model_quantize_default_params), then run the source
and both outputs through llama.cpp over one held-out text and report the mean KL divergence of
each output's next-token distribution from the source's, and the perplexity of the text.
llama.cpp evaluates all three, so the comparison measures the quantizers, not the engines. The
text is --windows consecutive windows of --tokens tokens (each from an empty context, starting
with BOS where the model has one), by default four of 384: nearly lossless types differ by less
than one window's noise.

The sources are the catalogue models dequantized to F32 by `infer quantize --type F32`; they were
quantized once already (SmolLM2 Q4_1, Gemma-3 Q4_K_M), so "the source" means that dequantized
model, not the original bf16 weights.

    python bench/quantize_quality.py [--models smollm2-135m-instruct gemma-3-270m] [--types Q4_K_M ...]
        [--tokens 384] [--windows 4] [--imatrix-text FILE [--imatrix-chunks N]]

With --imatrix-text, both quantizers get the same importance matrix: the reference engine's
activation statistics of the F32 source over that text (reference_engine/imatrix.py, written as
WORK/MODEL-imatrix.gguf and read back as llama-quantize reads it), passed to llama.cpp as
llama_model_quantize_params.imatrix (an array of {name, data, size}, ended by a NULL name); each
row then also has our quantizer's result without the imatrix ("ours_no_imatrix").

Writes bench/results/quantize-quality-<stamp>.jsonl (one line per model and type, as each is
done) and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

# file type -> llama.cpp's llama_ftype id (the same names, as in reference_engine/quantize.py)
TYPES = {
    "Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q5_K_S": 16, "Q5_1": 9, "Q5_0": 8, "Q4_K_M": 15,
    "Q4_K_S": 14, "Q4_1": 3, "Q4_0": 2, "Q3_K_M": 12, "Q3_K_S": 11, "Q2_K": 10,
}  # fmt: skip
MODELS = ("smollm2-135m-instruct", "gemma-3-270m")  # the catalogue models
HELD_OUT = Path("/usr/share/common-licenses/GPL-3")  # English prose no step of this bench tunes on


def llama_quantize(
    src: Path, dst: Path, ftype: int, threads: int, imatrix: dict[str, np.ndarray] | None = None
) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, threads
    if imatrix:  # llama.h: an array of {name, data, size} ended by a NULL name
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        keep = []  # the float arrays must outlive the call (the structure keeps the names)
        for e, (name, v) in zip(entries, sorted(imatrix.items()), strict=False):
            v = np.ascontiguousarray(v, dtype=np.float32)
            keep.append(v)
            e.name, e.size = name.encode(), v.size
            e.data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        p.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to ftype {ftype}")


def log_probs(path: Path, tokens: list[int]) -> np.ndarray:
    """(n-1, vocab) float64 log-softmax of the logits predicting tokens[1:], through llama.cpp."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=len(tokens), n_batch=len(tokens), logits_all=True, verbose=False)
    llm.eval(tokens)
    z = np.array(llm.scores[: len(tokens) - 1], dtype=np.float64)
    llm.close()
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def kl_nll(ref: np.ndarray, lp: np.ndarray, tokens: list[int]) -> tuple[float, float]:
    """Mean KL of lp's distributions from ref's, and mean negative log-likelihood of the text."""
    kl = (np.exp(ref) * (ref - lp)).sum(axis=1)
    return float(kl.mean()), float(-lp[np.arange(len(tokens) - 1), tokens[1:]].mean())


def compare(refs: list[np.ndarray], path: Path, windows: list[list[int]]) -> dict[str, Any]:
    """KL and perplexity of path's model over the windows (of equal length, so the means of their
    means), and each window's KL."""
    kls, nlls = [], []
    for ref, w in zip(refs, windows, strict=True):
        kl, nll = kl_nll(ref, log_probs(path, w), w)
        kls.append(kl)
        nlls.append(nll)
    return {"kl": float(np.mean(kls)), "ppl": float(np.exp(np.mean(nlls))), "kl_windows": kls}


def write_table(jsonl: Path) -> str:
    """The Markdown table of a results file (also of a run stopped part way), next to it."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    with_imatrix = any(r.get("imatrix") for r in rows)
    lines = [
        "| model | type | KL ours | KL llama.cpp | ratio | ppl ours | ppl llama.cpp | MiB ours | MiB llama.cpp |"
        + (" imatrix | KL ours without |" if with_imatrix else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if with_imatrix else ""),
    ]
    for r in rows:
        o, t = r["ours"], r["llama.cpp"]
        line = (
            f"| {r['model']} | {r['type']} | {o['kl']:.5f} | {t['kl']:.5f} | {r['kl_ratio']:.3f} | "
            f"{o['ppl']:.3f} | {t['ppl']:.3f} | {o['bytes'] / 2**20:.1f} | {t['bytes'] / 2**20:.1f} |"
        )
        if with_imatrix:
            plain = r.get("ours_no_imatrix")
            line += f" {r.get('imatrix') or '—'} | " + (f"{plain['kl']:.5f}" if plain else "—") + " |"
        lines.append(line)
    text = "\n".join(lines) + "\n"
    jsonl.with_suffix(".md").write_text(text)
    return text


def make_imatrix(
    src: Path, text_path: Path, max_chunks: int, args: argparse.Namespace
) -> tuple[dict[str, np.ndarray], str]:
    """The reference engine's imatrix of src over the text, written and read back as a file."""
    from stdengine.reference import imatrix as im
    from stdengine.reference.quantize import read_imatrix

    stats = im.collect(
        src, text_path.read_text(), threads=args.threads, dataset=text_path.name, max_chunks=max_chunks
    )
    path = src.with_name(src.name.replace("-f32.gguf", "-imatrix.gguf"))
    im.write_gguf(stats, path)
    note = f"{text_path.name}, {stats.chunks}x{stats.chunk_size} tokens"
    print(f"imatrix {path}: {len(stats.sums)} weights, {note}", flush=True)
    return read_imatrix(path), note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="catalogue aliases or GGUF paths")
    ap.add_argument(
        "--types", nargs="+", default=list(TYPES), help="file types to quantize to (default: all)"
    )
    ap.add_argument("--tokens", type=int, default=384, help="tokens of held-out text per window")
    ap.add_argument(
        "--windows", type=int, default=4, help="consecutive windows of the text, each from an empty context"
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/stdengine-quantize-quality"),
        help="where the files go (default %(default)s)",
    )
    ap.add_argument("--threads", type=int, default=2, help="compute threads (default %(default)s)")
    ap.add_argument("--text", type=Path, default=HELD_OUT, help="the held-out text (default %(default)s)")
    ap.add_argument("--table", type=Path, help="only write the Markdown table of this results .jsonl")
    ap.add_argument("--imatrix-text", type=Path, help="give both quantizers an imatrix made over this text")
    ap.add_argument(
        "--imatrix-chunks", type=int, default=0, help="at most this many 512-token chunks (0: all)"
    )
    args = ap.parse_args()
    if args.table:
        print(write_table(args.table))
        return

    import llama_cpp
    from stdengine.reference.quantize import quantize_model

    from stdengine.store import resolve_model

    args.work.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M")
    out = Path(__file__).parent / "results" / f"quantize-quality-{stamp}.jsonl"
    text = args.text.read_text()[4000:]  # past the preamble: running prose
    for model in args.models:
        src = args.work / f"{model}-f32.gguf"
        if not src.exists():
            quantize_model(resolve_model(model, pull=False), src, "F32")
        vocab = llama_cpp.Llama(str(src), vocab_only=True, verbose=False)
        stream = vocab.tokenize(text.encode(), add_bos=True)
        head = stream[:1] if stream[0] == vocab.token_bos() else []  # each window starts with BOS
        body, span = stream[len(head) :], args.tokens - len(head)
        windows = [head + body[i * span : (i + 1) * span] for i in range(args.windows)]
        if len(windows[-1]) < args.tokens:
            raise SystemExit(f"{args.text} has too few tokens for {args.windows} windows of {args.tokens}")
        refs = [log_probs(src, w) for w in windows]
        imatrix, imatrix_note = None, None
        if args.imatrix_text:
            imatrix, imatrix_note = make_imatrix(src, args.imatrix_text, args.imatrix_chunks, args)
        for ft in args.types:
            ours, theirs = args.work / f"{model}-{ft}-ours.gguf", args.work / f"{model}-{ft}-llama.gguf"
            t0 = time.perf_counter()
            quantize_model(src, ours, ft, threads=args.threads, imatrix=imatrix, imatrix_name=imatrix_note)
            t1 = time.perf_counter()
            llama_quantize(src, theirs, TYPES[ft], args.threads, imatrix)
            t2 = time.perf_counter()
            row = {
                "model": model,
                "type": ft,
                "tokens": args.tokens,
                "windows": args.windows,
                "imatrix": imatrix_note,
                "ours": compare(refs, ours, windows) | {"bytes": ours.stat().st_size, "s": t1 - t0},
                "llama.cpp": compare(refs, theirs, windows) | {"bytes": theirs.stat().st_size, "s": t2 - t1},
            }
            if imatrix is not None:
                quantize_model(src, ours, ft, threads=args.threads)
                row["ours_no_imatrix"] = compare(refs, ours, windows)
            row["kl_ratio"] = row["ours"]["kl"] / max(row["llama.cpp"]["kl"], 1e-12)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{model} {ft}: KL ours {row['ours']['kl']:.5f} llama.cpp {row['llama.cpp']['kl']:.5f} "
                f"(x{row['kl_ratio']:.3f}); ppl {row['ours']['ppl']:.3f} / {row['llama.cpp']['ppl']:.3f}",
                flush=True,
            )
            ours.unlink()
            theirs.unlink()
        nll = np.mean([kl_nll(ref, ref, w)[1] for ref, w in zip(refs, windows, strict=True)])
        print(f"{model}: source ppl {np.exp(nll):.3f}", flush=True)
    print(write_table(out))


if __name__ == "__main__":
    main()
