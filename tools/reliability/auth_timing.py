"""How long an API-key check takes for keys that share more or less of a real key.

The check hashes the presented key (SHA-256) and compares the digest with every stored
digest by hmac.compare_digest, so its time should not depend on how much of a real key
was guessed. This prints the median time per check for each kind of guess
(docs/RELIABILITY.md, "Auth timing").

    python -m tools.reliability.auth_timing [--rounds 200000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from serve_app.http.auth import APIKeyAuth

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


def median_ns(auth: APIKeyAuth, guesses: dict[str, str], rounds: int, batches: int = 40) -> dict[str, float]:
    """Median ns per check for each guess; batches of the guesses interleave, so a load
    change on the machine touches every guess alike."""
    per_batch: dict[str, list[float]] = {name: [] for name in guesses}
    size = rounds // batches
    for _ in range(batches):
        for name, key in guesses.items():
            start = time.perf_counter_ns()
            for _ in range(size):
                auth.matches(key)
            per_batch[name].append((time.perf_counter_ns() - start) / size)
    return {name: statistics.median(times) for name, times in per_batch.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200_000)
    args = parser.parse_args()
    auth = APIKeyAuth([KEY, "sk-another-key-of-the-server"])
    medians = median_ns(auth, GUESSES, args.rounds)
    for name, guess in GUESSES.items():
        print(f"{name:24s} {medians[name]:8.0f} ns  (matches: {auth.matches(guess)})")


if __name__ == "__main__":
    main()
