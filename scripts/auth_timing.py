"""How long an API-key check takes for keys that share more or less of a real key.

The check hashes the presented key (SHA-256) and compares the digest with every stored
digest by hmac.compare_digest, so its time should not depend on how much of a real key
was guessed. This prints the median time per check for each kind of guess
(docs/RELIABILITY.md, "Auth").

    python scripts/auth_timing.py [--rounds 200000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from serve_app.auth import APIKeyAuth

KEY = "sk-chatserve-" + "a1b2c3d4e5f6" * 4
GUESSES = {
    "the key": KEY,
    "last char wrong": KEY[:-1] + "X",
    "first char wrong": "X" + KEY[1:],
    "upper-cased": KEY.upper(),
    "prefix (one short)": KEY[:-1],
    "one longer": KEY + "0",
    "unrelated, same length": "z" * len(KEY),
    "unrelated, short": "sk",
}


def median_ns(auth: APIKeyAuth, key: str, rounds: int, batches: int = 20) -> float:
    per_batch = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(rounds // batches):
            auth.matches(key)
        per_batch.append((time.perf_counter_ns() - start) / (rounds // batches))
    return statistics.median(per_batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200_000)
    args = parser.parse_args()
    auth = APIKeyAuth([KEY, "sk-another-key-of-the-server"])
    for name, guess in GUESSES.items():
        print(f"{name:24s} {median_ns(auth, guess, args.rounds):8.0f} ns  (matches: {auth.matches(guess)})")


if __name__ == "__main__":
    main()
