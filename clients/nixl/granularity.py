"""Adaptive granularity of progressive push: whether what a transfer computed since its last part pays for a part.

A part costs the writer a fixed amount (placing its cells, the post's own overhead, its notification, polling and
releasing its WRITE: what grouping parts saves) plus an amount per byte (on shared memory the post copies the
bytes; NIXL's work per descriptor: what grouping does not save). `PartCost` fits

    seconds per part = fixed + per_byte * bytes per part

online over the recent parts (least squares, exponentially weighted), from the writer thread's CPU time, so that
waiting for the GIL or for a core does not count. Parts of one size cannot tell the two apart: then the last
per-byte cost fitted is kept (none yet: all of it counts as fixed, which groups parts, whose sizes then differ).
`TransferWriter` posts a transfer's new cells as a part only once the engine computed for at least
`WriterConfig.part_compute_ratio` times the fixed cost since the last part it posted (`PartCost.pays`); else they go
with the next part or the final, which is never held.
"""

from __future__ import annotations

__all__ = ["PartCost"]


class PartCost:
    """The writer's cost of a part, fixed + per byte, fitted over the parts observed (weights decay by `decay`
    per observation: ~1 / (1 - decay) recent observations count)."""

    MIN_SPREAD = 0.1
    """Sizes must spread by this share of their mean (standard deviation) to fit the per-byte cost."""

    def __init__(self, decay: float = 0.95) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self._decay = decay
        self._sums = [0.0] * 5  # weight, x, y, x*x, x*y; x = bytes, y = seconds, per part
        self._per_byte = 0.0

    def observe(self, seconds: float, parts: int, num_bytes: int) -> None:
        """`parts` parts of `num_bytes` bytes together cost the writer `seconds`."""
        if parts <= 0:
            return
        x, y = num_bytes / parts, seconds / parts
        self._sums = [
            s * self._decay + v
            for s, v in zip(self._sums, (parts, parts * x, parts * y, parts * x * x, parts * x * y), strict=True)
        ]
        n, sx, sy, sxx, sxy = self._sums
        mean_x, mean_y = sx / n, sy / n
        var_x = max(0.0, sxx / n - mean_x * mean_x)
        if var_x > 0.0 and var_x >= (self.MIN_SPREAD * mean_x) ** 2:
            self._per_byte = max(0.0, (sxy / n - mean_x * mean_y) / var_x)

    @property
    def fixed(self) -> float:
        """Seconds a part costs whatever its size (0.0 before any was observed)."""
        n, sx, sy = self._sums[:3]
        if not n:
            return 0.0
        mean_x, mean_y = sx / n, sy / n
        return min(mean_y, max(0.0, mean_y - self._per_byte * mean_x))

    @property
    def per_byte(self) -> float:
        """Seconds a part costs per byte it carries (the last fitted; 0.0 before)."""
        return self._per_byte

    def pays(self, computed_s: float, ratio: float) -> bool:
        """Whether `computed_s` seconds of compute carry a part: at least `ratio` times its fixed cost."""
        return computed_s >= ratio * self.fixed
