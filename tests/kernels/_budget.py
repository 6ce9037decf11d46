"""How many hypothesis examples a Triton-interpreter property draws.

In the interpreter every program of a launch runs in Python: one drawn case of a kernel
property costs 0.5-4 s on 2 cores, and the CI run must stay within its time on a slow
2-core machine. So under the ``ci`` profile (derandomized: the same cases every run) an
interpreter property draws a quarter of its count, at least 4; the ``dev`` profile
(random cases each run) draws the full count, and ``HYPOTHESIS_PROFILE=stress`` at least
300, which is where edge cases are hunted before a release.

Example:
    >>> from hypothesis import settings
    >>> @settings(max_examples=interpreter_examples(25))
    ... def test_kernel_property(): ...
"""

import os


def interpreter_examples(n: int, ci: int | None = None) -> int:
    """``n`` examples in ``dev``; ``ci`` (default ``max(4, n // 4)``) in ``ci``; ``max(n,
    300)`` in ``stress``."""
    if os.environ.get("CI"):
        return max(4, n // 4) if ci is None else ci
    if os.environ.get("HYPOTHESIS_PROFILE") == "stress":
        return max(n, 300)
    return n
