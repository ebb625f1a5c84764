"""Memory budgets written as text, like vLLM's KV cache space setting: an amount of bytes
("512MiB", "1G", "268435456") or a fraction of the memory available ("0.1"). `MemoryBudget`
is what such a text means; `bytes_of` turns it into bytes given what is available (pure).

    "512MiB" -> 536870912 bytes      "1.5G" -> 1610612736 bytes      "0.25" -> a quarter
    (K, M, G, T are powers of 1024, with or without "iB"/"B"; a number < 1 is a fraction)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tsukimi.errors import ConfigError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """A memory budget: `amount_bytes` when absolute, else `fraction` (0 < f < 1) of the
    memory available."""

    amount_bytes: int = 0
    fraction: float = 0.0

    @classmethod
    def parse(cls, text: str) -> MemoryBudget:
        """The budget `text` writes (see the module).

        Raises:
            ConfigError: not a size or a fraction, or zero.
        """
        match = _PATTERN.match(text)
        if match is None:
            raise ConfigError(f"not a memory budget: {text!r} (bytes as 512MiB or 1G, or a fraction as 0.1)")
        number, unit = float(match.group(1)), match.group(2).upper()
        if number <= 0:
            raise ConfigError(f"a memory budget must be > 0, got {text!r}")
        if not unit and number < 1:
            return cls(fraction=number)
        return cls(amount_bytes=int(number * _UNITS[unit]))

    def bytes_of(self, available_bytes: int) -> int:
        """The budget in bytes when `available_bytes` are available (pure)."""
        return self.amount_bytes or int(self.fraction * available_bytes)
