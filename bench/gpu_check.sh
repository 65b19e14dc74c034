#!/usr/bin/env bash
# The reference engine on a real GPU (issue 20): run from a checkout on a machine with an NVIDIA
# GPU (or any OpenCL GPU), with the project installed (`pip install -e .`; the catalogue models
# are pulled when missing).
#
#   bash bench/gpu_check.sh [OUT_DIR]        (default: bench/results/gpu-check-<UTC date>)
#
# 1. sets up OpenCL when needed: the ICD loader (ocl-icd-libopencl1, clinfo: apt, as root) and
#    NVIDIA's ICD file (/etc/OpenCL/vendors/nvidia.icd naming libnvidia-opencl.so.1, which the
#    NVIDIA driver ships);
# 2. runs the core conformance suite with every layer on the device (-ngl 99) on both catalogue
#    models;
# 3. benchmarks pp512 / tg128: the reference engine with -ngl 99 and on the CPU (-ngl 0), and
#    llama.cpp's CUDA build when one can be had: the installed llama-cpp-python if it offloads, else
#    one built with CMAKE_ARGS=-DGGML_CUDA=on in a separate venv ($GPU_CHECK_VENV, default
#    /tmp/gpu-check-venv; the project's own venv is never touched) when nvcc is on PATH;
# 4. prints the report and writes it to OUT_DIR/report.md (format: bench/results/README.md), next
#    to the conformance bundles (conformance-MODEL/) and the bench records (bench-*.jsonl).
#
# It never fails half-way: each step that cannot run says why in the report.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu-check-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"
REPORT="$OUT/report.md"
MODELS=(smollm2-135m-instruct gemma-3-270m)
note() { printf '%s\n' "$*" | tee -a "$REPORT"; }
: > "$REPORT"

note "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
note ""
note "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note "- cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') ($(nproc) threads)"
if command -v nvidia-smi > /dev/null; then
  note "- gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
else
  note "- gpu: nvidia-smi not found"
fi

# --- 1. OpenCL -----------------------------------------------------------------------------------
if ! ldconfig -p | grep -q 'libOpenCL.so.1' && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ocl-icd-libopencl1 clinfo > /dev/null
fi
if [ ! -e /etc/OpenCL/vendors/nvidia.icd ] && ldconfig -p | grep -q 'libnvidia-opencl.so.1'; then
  if [ "$(id -u)" = 0 ]; then
    mkdir -p /etc/OpenCL/vendors && echo libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
  else
    note "- opencl: /etc/OpenCL/vendors/nvidia.icd is missing and this is not root: create it with the line libnvidia-opencl.so.1"
  fi
fi
note "- opencl devices (infer engines):"
python - << 'EOF' | tee -a "$REPORT"
from stdengine.reference import core
devs = core.devices()
print("\n".join(f"  - {d}" for d in devs) if devs else f"  - none: {core.devices_missing()}")
EOF
note ""

# --- 2. conformance, every layer on the device ---------------------------------------------------
note "## Conformance (core), reference engine, -ngl 99"
note ""
note "| model | exit | summary |"
note "|---|---|---|"
for m in "${MODELS[@]}"; do
  infer models pull "$m" > /dev/null 2>&1
  infer conformance -e reference -m "$m" -ngl 99 --report "$OUT/conformance-$m" > "$OUT/conformance-$m.log" 2>&1
  rc=$?
  summary=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['summary'])" \
    "$OUT/conformance-$m/results.json" 2>/dev/null || tail -1 "$OUT/conformance-$m.log")
  note "| $m | $rc | $summary |"
done
note ""

# --- 3. benchmark ----------------------------------------------------------------------------------
note "## Benchmark: pp512 / tg128 (t/s, infer bench, 3 repetitions)"
note ""
bench() { # engine ngl python label
  for m in "${MODELS[@]}"; do
    "$3" -m stdengine.cli.bench -e "$1" -m "$m" -ngl "$2" -p 512 -n 128 -r 3 -o jsonl \
      >> "$OUT/bench-$4.jsonl" 2>> "$OUT/bench-$4.log" || note "- $4 on $m failed: $(tail -1 "$OUT/bench-$4.log")"
  done
}
bench reference 99 python reference-ngl99
bench reference 0 python reference-cpu
LLAMA_PY=""
if python -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" 2> /dev/null; then
  LLAMA_PY=python
elif command -v nvcc > /dev/null; then
  VENV=${GPU_CHECK_VENV:-/tmp/gpu-check-venv}
  if [ ! -x "$VENV/bin/python" ]; then
    python -m venv "$VENV" && "$VENV/bin/pip" install -q -e . \
      && CMAKE_ARGS="-DGGML_CUDA=on" "$VENV/bin/pip" install -q --no-cache-dir 'llama-cpp-python>=0.3' \
      > "$OUT/llamacpp-cuda-build.log" 2>&1
  fi
  "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" \
    2> /dev/null && LLAMA_PY="$VENV/bin/python"
fi
if [ -n "$LLAMA_PY" ]; then
  bench llamacpp 99 "$LLAMA_PY" llamacpp-cuda
else
  note "- llama.cpp CUDA: no llama-cpp-python with a GPU backend, and none could be built (nvcc missing or the build failed: $OUT/llamacpp-cuda-build.log)"
fi
note ""
note "| engine | ngl | model | test | t/s |"
note "|---|---|---|---|---|"
cat "$OUT"/bench-*.jsonl 2> /dev/null | python -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    test = f"pp{r[\"n_prompt\"]}" if r["n_prompt"] else f"tg{r[\"n_gen\"]}"
    name = r.get("model_filename", "?").rsplit("/", 1)[-1]
    print(f"| {r.get(\"engine\", \"?\")} ({r[\"backends\"]}) | {r[\"n_gpu_layers\"]} | {name} | {test} | {r[\"avg_ts\"]:.1f} |")
' | tee -a "$REPORT"
note ""
note "report: $REPORT"
