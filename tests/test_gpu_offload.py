"""Layers offloaded to a device (issue 20; spec/reference-engine.md, "Backends"): -ngl N on both
catalogue models.

The tests run on two kinds of device:
- `opencl`: the first OpenCL device (a GPU, or PoCL on CI's CPU), on both models; skipped with the
  reason when this machine has no OpenCL runtime or device;
- `host`: the C core's plain-C test backend (backend_host.c, enabled by SE_HOST_BACKEND=1), which
  runs the same device layer (uploads, per-context device caches, partial offload, the head on the
  device) with obviously-right arithmetic, so that the layering is tested on every machine; on
  SmolLM2 only (it is slow: one thread, float64 sums).

What is asserted, against the exact float64 reference (stdengine.conformance.exact: gguf's own
dequantization, numpy; independent of the engine):
- `-ngl 99`: a device multiplies the dequantized weights by f32 activations (the CPU quantizes the
  activations per token, kernels.h), so its logits are the exact reference's up to f32 rounding:
  mean KL(exact || device) under KL_ALL and the same top token on every row. Measured on a
  12-token prompt (PoCL and the host backend alike): see spec/reference-engine.md, "Backends";
- `-ngl 10` (the rest and the head on the CPU): no further from the exact reference than the CPU
  path is;
- greedy answers of 8 tokens equal to the exact reference's, but for a parting at a near tie of
  its logits (top-2 margin under NEAR_TIE: the same allowance the CPU path's forward tests make
  against llama.cpp), after which the answers may differ;
- the device's own determinism (backend.h): bit-identical logits whether a prompt is decoded in
  one call or in pieces, and in a se_decode_batch with another context or alone;
- errors: a --device that names nothing, out of device memory (the bytes), an offload after a
  context; -ngl 0 changes nothing.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from stdengine.reference import core
from stdengine.reference.core import Context, decode_batch
from stdengine.reference.model import Model

from stdengine.errors import EngineFailure, UnsupportedOption

pytestmark = pytest.mark.models

os.environ["SE_HOST_BACKEND"] = "1"  # the C core reads it at each device count

KL_ALL = 1e-6  # mean KL(exact || device) with every layer on the device
NEAR_TIE = 0.5  # a greedy answer may part from the exact reference's where its top-2 margin is below this
PROMPT = "The capital of France is Paris. The capital of Italy is"


def _device(kind: str) -> core.Device:
    found = [d for d in core.devices() if d.backend == kind]
    if not found:
        pytest.skip(f"no {kind} device here: {core.devices_missing() or 'none listed'}")
    return found[0]


@pytest.fixture(scope="module", params=["opencl-smollm2", "opencl-gemma3", "host-smollm2"])
def on(request, smollm2_path, gemma3_path):
    """(device, model path) of one test setting."""
    kind, model = request.param.split("-")
    return _device(kind), smollm2_path if model == "smollm2" else gemma3_path


@pytest.fixture(scope="module")
def device(on) -> core.Device:
    return on[0]


@pytest.fixture(scope="module")
def model_path(on):
    return on[1]


def _tokens(path) -> list[int]:
    from stdengine.reference.tokenizer import Tokenizer

    return list(Tokenizer.from_gguf(path).encode(PROMPT))[:12]


def _load(path, device: core.Device | None = None, ngl: int = 0) -> Model:
    m = Model.load(path)
    if device is not None:
        m.offload(device, ngl)
    return m


def _all_logits(model: Model, tokens: list[int], pieces: list[int] | None = None) -> np.ndarray:
    with Context(model, n_ctx=256, n_threads=2, n_ubatch=64) as ctx:
        rows, i = [], 0
        for n in pieces or [len(tokens)]:
            rows.append(ctx.decode(tokens[i : i + n], all_logits=True))
            i += n
        return np.concatenate(rows)


def _greedy(model: Model, tokens: list[int], n: int = 8) -> list[int]:
    with Context(model, n_ctx=256, n_threads=2, n_ubatch=64) as ctx:
        ctx.decode(tokens)
        out = []
        for _ in range(n):
            out.append(ctx.sample())
            ctx.decode([out[-1]])
        return out


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over rows of KL(softmax(p) || softmax(q)), in float64."""

    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(axis=1).mean())


def _same_answer(got: list[int], exact: list[tuple[int, float]]) -> None:
    """got is the exact reference's greedy answer ((token, top-2 margin) per step) up to where they
    part, and they part only at a near tie."""
    for i, (tok, (want, margin)) in enumerate(zip(got, exact, strict=True)):
        if tok != want:
            assert margin < NEAR_TIE, f"token {i}: {tok} where the exact reference has {want} by {margin:.3f}"
            return


@pytest.fixture(scope="module")
def cpu_ref(model_path):
    return _reference(model_path)


@functools.cache  # once per model for the module (the OpenCL and host settings share SmolLM2's)
def _reference(model_path):
    """The prompt's tokens; the exact reference's logits and greedy answer (token, top-2 margin);
    the CPU path's logits."""
    from stdengine.conformance.exact import ExactModel

    tokens = _tokens(model_path)
    ex = ExactModel(model_path)
    answer: list[tuple[int, float]] = []
    for _ in range(8):
        row = ex.logits(tokens + [t for t, _ in answer], last=1)[0]
        top2 = np.sort(row)[-2:]
        answer.append((int(row.argmax()), float(top2[1] - top2[0])))
    with _load(model_path) as m:
        return tokens, ex.logits(tokens), answer, _all_logits(m, tokens)


@pytest.mark.parametrize("ngl", [99, 10])
def test_offload_against_the_exact_reference(device, model_path, cpu_ref, ngl):
    tokens, exact, answer, cpu_logits = cpu_ref
    with _load(model_path, device, ngl) as m:
        assert m.gpu_layers == min(ngl, m.hparams.n_layer) and m.gpu_head == (ngl > m.hparams.n_layer)
        got = _all_logits(m, tokens)
        kl = _kl(exact, got)
        print(
            f"\nKL(exact || -ngl {ngl} on {device}) = {kl:.3g}; the CPU path's: {_kl(exact, cpu_logits):.3g}"
        )
        if ngl > m.hparams.n_layer:
            assert kl < KL_ALL
            assert (got.argmax(axis=1) == exact.argmax(axis=1)).all()
        else:
            assert kl <= _kl(exact, cpu_logits) * 1.05 + 1e-9
        _same_answer(_greedy(m, tokens), answer)


def test_ngl_0_changes_nothing(model_path, cpu_ref):
    tokens, _, _, cpu_logits = cpu_ref
    with _load(model_path, _device("host"), 0) as m:
        assert m.gpu_layers == 0 and m.device is None
        assert _all_logits(m, tokens).tobytes() == cpu_logits.tobytes()


def test_device_results_do_not_depend_on_the_split(device, model_path):
    tokens = _tokens(model_path)
    with _load(model_path, device, 99) as m:
        whole = _all_logits(m, tokens)
        assert whole.tobytes() == _all_logits(m, tokens, pieces=[1] * len(tokens)).tobytes()
        assert whole.tobytes() == _all_logits(m, tokens, pieces=[5, 7]).tobytes()


def test_device_decode_batch_is_each_context_alone(device, model_path):
    tokens = _tokens(model_path)
    other = tokens[::-1][:7]
    with _load(model_path, device, 99) as m:
        with Context(m, n_ctx=128, n_threads=2) as a, Context(m, n_ctx=128, n_threads=2) as b:
            a.decode(tokens[:4])
            got = [x.copy() for x in decode_batch([a, b], [tokens[4:], other])]
        with Context(m, n_ctx=128, n_threads=2) as a, Context(m, n_ctx=128, n_threads=2) as b:
            a.decode(tokens[:4])
            want = [a.decode(tokens[4:]).copy(), b.decode(other).copy()]
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]


def test_device_errors(smollm2_path):
    with pytest.raises(UnsupportedOption, match="no device matches"):
        core.choose_device("no such device anywhere")
    assert core.choose_device("host").backend == "host"
    # out of device memory (SE_HOST_BACKEND_MEM caps the host device, read when it opens): the
    # bytes asked for and what they were for, at the upload and at a context's caches
    os.environ["SE_HOST_BACKEND_MEM"] = str(16 << 20)
    try:
        with Model.load(smollm2_path) as m:
            with pytest.raises(EngineFailure, match=r"out of device memory: \d+ bytes asked for blk\.\d+"):
                m.offload(_device("host"), 99)
            assert m.device is None and m.gpu_layers == 0  # still on the CPU
            m.offload(_device("host"), 2)
            with pytest.raises(EngineFailure, match=r"\d+ bytes asked for the K cache of layer 0"):
                Context(m, n_ctx=1 << 20)
            with Context(m, n_ctx=64) as ctx:
                ctx.decode([1, 2, 3])
    finally:
        del os.environ["SE_HOST_BACKEND_MEM"]
    with Model.load(smollm2_path) as m, Context(m, n_ctx=64):
        with pytest.raises(EngineFailure, match="before its first context"):
            m.offload(_device("host"), 2)


def test_cli_run_names_the_device(smollm2_path):
    """`infer run -ngl 99` on a device: model.loaded names it and the offloaded layers."""
    env = dict(os.environ, SE_HOST_BACKEND="1", INFER_RECIPE="none")
    out = subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", "run", "-m", str(smollm2_path), "-ngl", "99",
         "--device", "host", "-p", "hi", "-n", "2", "--temp", "0", "--log-format", "json"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    loaded = [e for e in map(json.loads, out.stderr.splitlines()) if e.get("event") == "model.loaded"]
    assert loaded and "host" in loaded[0]["device"] and loaded[0]["n_gpu_layers"] == 31
