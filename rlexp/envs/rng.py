"""A tiny seeded PRNG in pure Python integer arithmetic.

Maze layouts and scripted policies must be identical on every machine and every Python / NumPy
version: the pinned evaluation set is defined by generator seeds. NumPy's ``Generator`` methods do
not promise stable streams across versions and ``random.Random`` is global-state prone, so the
environment draws all its randomness from SplitMix64 (Steele, Lea & Flood 2014), which is a few
lines of 64-bit arithmetic.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


class SplitMix64:
    """SplitMix64 generator; ``seed`` is any integer in ``[0, 2**64)``."""

    def __init__(self, seed: int):
        if not 0 <= seed <= _MASK64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        self._state = seed

    def next_u64(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """Uniform integer in ``[0, n)`` (rejection sampling, no modulo bias)."""
        if n <= 0:
            raise ValueError(f"n must be positive, got {n}")
        limit = (1 << 64) - (1 << 64) % n
        while True:
            x = self.next_u64()
            if x < limit:
                return x % n

    def random(self) -> float:
        """Uniform float in ``[0, 1)`` with 53 random bits."""
        return (self.next_u64() >> 11) / (1 << 53)
