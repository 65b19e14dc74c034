"""CPU time per token of a llama.cpp build, for comparing builds on a loaded machine.

    python bench/llamacpp_cpu_time.py --llamacpp-path DIR MODEL [--reps 3]

At 1 thread, process CPU time does not count the time spent waiting for a core that other jobs
hold, nor barrier spinning, so two builds measured in turns on a busy machine compare fairly where
wall-clock t/s does not. Prints the CPU ms per token of a 512-token prompt (one decode call) and of
32 one-token decodes after it, for each repetition. DIR holds a `llama_cpp` package (pip install
--target DIR ...), put first on the module path; MODEL is a catalogue alias or a .gguf path.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="GGUF file")
    ap.add_argument(
        "--llamacpp-path", required=True, help="a llama-cpp-python installed with pip install --target DIR"
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default %(default)s)")
    args = ap.parse_args()
    sys.path.insert(0, args.llamacpp_path)

    from stdengine.engines.llamacpp import LlamaCppEngine
    from stdengine.events import Emitter
    from stdengine.options import Options
    from stdengine.store import resolve_model

    path = str(resolve_model(args.model, pull=False))
    engine = LlamaCppEngine.load(Options(model=path, threads=1, ctx_size=1024), Emitter(verbosity=0))
    tokens = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 100)[:512]
    prompt: list[float] = []
    gen: list[float] = []
    for _ in range(args.reps):
        engine.reset()
        start = time.process_time()
        engine.decode(tokens)
        prompt.append((time.process_time() - start) / len(tokens))
        start = time.process_time()
        for token in tokens[:32]:
            engine.decode([token])
        gen.append((time.process_time() - start) / 32)
    print(f"{args.llamacpp_path} {args.model} ({engine.build_info()})")
    print("pp512 CPU ms/token:", " ".join(f"{1e3 * t:.3f}" for t in prompt))
    print("tg CPU ms/token:   ", " ".join(f"{1e3 * t:.3f}" for t in gen))
    engine.close()


if __name__ == "__main__":
    main()
