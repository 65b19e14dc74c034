"""`infer-bench`: llama-bench-compatible benchmarking through any engine (lands with its issue)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print("usage: infer-bench [options]\n\n"
              "llama-bench's flags and output formats (-m -p -n -pg -d -b -ub -t -r -o md|csv|json|jsonl|sql)\n"
              "for any stdengine engine (-e). Not built yet in this version: exits with status 9.")
        sys.exit(0)
    print("error: infer-bench is not built yet in this version of stdengine", file=sys.stderr)
    sys.exit(9)
