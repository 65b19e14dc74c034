"""Conformance of SmolLM2 files made by `infer quantize` (issue 23's "done when").

    python -m stdengine.bench.quantize_conformance [--types Q3_K_M Q2_K Q2_K-pure Q2_K-imatrix]
        [--engines reference llamacpp] [--work DIR] [--report DIR]

For each type (a file type; `-pure` adds --pure, `-imatrix` adds `--imatrix-from` the GFDL-1.3
text, as bench/quantize_quality.py's imatrix runs):
1. `infer quantize` makes WORK/smollm2-135m-instruct.TYPE.gguf from the catalogue SmolLM2 (its
   Q4_1 file: requantizing, with the warning). The tool's output is deterministic (the same bytes
   for any thread count), so the file's SHA256 is the same on every run of the same version.
2. Golden data for the file, by the catalogue's golden command:
   `python -m stdengine.conformance.golden --model ALIAS --path FILE --out conformance/golden/ALIAS.json.gz`
   with ALIAS = smollm2-135m-instruct-TYPE (lower case), unless the golden file there already
   names this file's SHA256. `infer conformance -m FILE` finds it by that SHA256.
3. `infer conformance -e ENGINE -m FILE --report REPORT/ENGINE-ALIAS` for each engine (core level).
4. The table of the bundles, as `python -m stdengine.conformance.results_table REPORT` prints it.

Exits 1 when a conformance run failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

MODEL = "smollm2-135m-instruct"
IMATRIX_TEXT = "/usr/share/common-licenses/GFDL-1.3"


def _infer(*args: str) -> int:
    print("$ infer " + " ".join(args), flush=True)
    return subprocess.run([sys.executable, "-m", "stdengine.cli.main", *args]).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--types", nargs="+", default=["Q3_K_M", "Q2_K", "Q2_K-pure"], help="file types to quantize to"
    )
    ap.add_argument(
        "--engines", nargs="+", default=["reference", "llamacpp"], help="engines to run the suite with"
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/stdengine-quantize-conformance"),
        help="where the files go (default %(default)s)",
    )
    ap.add_argument("--report", type=Path, default=None, help="bundles (default WORK/reports)")
    args = ap.parse_args()
    from stdengine.conformance.golden import golden_path, load_golden, sha256_file

    from stdengine.gguf_file import scan_gguf
    from stdengine.store import resolve_model

    report = args.report or args.work / "reports"
    args.work.mkdir(parents=True, exist_ok=True)
    src = resolve_model(MODEL, pull=False)
    failed = []
    for spec in args.types:
        ft, *flags = spec.split("-")
        options = {"pure": ["--pure"], "imatrix": ["--imatrix-from", IMATRIX_TEXT]}
        if not set(flags) <= options.keys():
            raise SystemExit(f"{spec}: a type may end in -pure and/or -imatrix")
        alias = f"{MODEL}-{spec.lower()}"
        path = args.work / f"{MODEL}.{spec}.gguf"
        if _infer(
            "quantize", str(src), str(path), "--type", ft, *[o for f in flags for o in options[f]], "--quiet"
        ):
            raise SystemExit(f"infer quantize failed for {spec}")
        counts: dict[str, int] = {}
        for t in scan_gguf(path).tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        print(f"{path.name}: {', '.join(f'{n} {t}' for t, n in sorted(counts.items()))}", flush=True)
        golden = golden_path(alias)
        sha = sha256_file(path)
        if not golden.is_file() or load_golden(golden).get("sha256") != sha:
            t0 = time.time()
            cmd = ["-m", "stdengine.conformance.golden", "--model", alias, "--path", str(path)]
            print("$ python " + " ".join(cmd + ["--out", str(golden)]), flush=True)
            subprocess.run([sys.executable, *cmd, "--out", str(golden)], check=True)
            print(f"golden data for {alias}: {time.time() - t0:.0f} s", flush=True)
        for engine in args.engines:
            bundle = report / f"{engine}-{alias}"
            t0 = time.time()
            rc = _infer("conformance", "-e", engine, "-m", str(path), "--report", str(bundle))
            print(f"{engine} on {alias}: exit {rc}, {time.time() - t0:.0f} s", flush=True)
            if rc:
                failed.append(f"{engine} on {alias}")
    subprocess.run([sys.executable, "-m", "stdengine.conformance.results_table", str(report)])
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
