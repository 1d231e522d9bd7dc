"""Side-by-side table of the CPU benchmark's JSON reports (tools/bench/cpu_compare.sh writes them).

    python tools/bench/summary.py bench-results

Prints, per concurrency level, the Serve path's output tok/s as a share of the engine
offline at the same load (target >= 90 %), and TTFT medians with the Serve path's
overhead over the engine alone (the target at concurrency 1 is < 5 ms).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIELDS = ("output_tok_s", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms")


def levels(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    return {level["concurrency"]: level for level in json.loads(path.read_text())["levels"]}


def row(name: str, c: int, level: dict) -> str:
    return f"| {name} | {c} | " + " | ".join(f"{level[f]:.1f}" for f in FIELDS) + " |"


def main(results: Path) -> None:
    systems = {"chatserve (Serve HTTP path)": levels(results / "chatserve.json"),
               "transformers serve --continuous-batching": levels(results / "transformers.json"),
               "chatserve engine offline (no Serve)": levels(results / "engine.json")}
    print("| system | conc. | output tok/s | TTFT median ms | TTFT p99 ms | TPOT median ms | TPOT p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, by_level in systems.items():
        for c, level in sorted(by_level.items()):
            print(row(name, c, level))
    serve, engine = systems["chatserve (Serve HTTP path)"], systems["chatserve engine offline (no Serve)"]
    print()
    for c in sorted(set(serve) & set(engine)):
        s, e = serve[c], engine[c]
        print(f"c={c:<3} Serve / engine offline throughput {s['output_tok_s'] / e['output_tok_s']:6.1%} (target >= 90%)"
              f"   TTFT median overhead {s['ttft_median_ms'] - e['ttft_median_ms']:7.1f} ms")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results"))
