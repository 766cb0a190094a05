"""A one-line stderr progress bar for model loading and quantization (no tqdm dependency)."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressBar:
    """Redraws in place on a terminal; elsewhere (logs, CI) prints only the start and the end."""

    def __init__(
        self,
        total: int,
        description: str,
        *,
        stream: TextIO | None = None,
        width: int = 30,
        unit: str = "tensors",
    ) -> None:
        self.total = max(total, 1)
        self.description = description
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.count = 0
        self._interactive = self.stream.isatty()
        self._last_drawn = -1
        if not self._interactive:
            self.stream.write(f"{description}: {total} {unit}\n")
        self._draw()

    def update(self, n: int = 1) -> None:
        self.count = min(self.count + n, self.total)
        self._draw()

    def close(self) -> None:
        if self._interactive:
            self.stream.write("\n")
        else:
            self.stream.write(f"{self.description}: done\n")
        self.stream.flush()

    def _draw(self) -> None:
        if not self._interactive:
            return
        percent = 100 * self.count // self.total
        if percent == self._last_drawn:
            return
        self._last_drawn = percent
        filled = self.width * self.count // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.description} [{bar}] {percent:3d}% ({self.count}/{self.total})")
        self.stream.flush()
