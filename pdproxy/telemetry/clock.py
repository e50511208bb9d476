"""One clock for every interval: monotonic nanoseconds, shifted once to wall time for span stamps.

Shifting by a constant keeps every difference exact, so stage spans that share a boundary
add up to the TTFT recorded on the root span to the nanosecond.
"""

import time

now = time.monotonic_ns
_OFFSET = time.time_ns() - time.monotonic_ns()


def to_unix_ns(monotonic_ns: int) -> int:
    return monotonic_ns + _OFFSET


def seconds(start_ns: int, end_ns: int) -> float:
    return (end_ns - start_ns) / 1e9
