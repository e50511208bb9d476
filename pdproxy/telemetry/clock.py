"""One clock for every interval: monotonic nanoseconds, shifted once to wall time for span stamps.

Shifting by a constant keeps every difference exact, so stage spans that share a boundary
add up to the TTFT recorded on the root span to the nanosecond.
"""

import time
from typing import Final

now = time.monotonic_ns
_OFFSET: Final = time.time_ns() - time.monotonic_ns()  # Final: compiled, a static, not a module dict lookup


def to_unix_ns(monotonic_ns: int) -> int:
    return monotonic_ns + _OFFSET


def seconds(start_ns: int, end_ns: int) -> float:
    return (end_ns - start_ns) / 1e9
