"""Stop strings over streamed text: matched across token boundaries, never streamed in part.

Text arrives in pieces (one detokenized piece per token). The matcher holds
back the longest tail that could still grow into a stop string, so a client
never sees the start of a stop string that then completes; on a match, the
output ends just before the stop string.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add new text; return what is safe to emit now (sets ``stopped`` on a match)."""
        if self.stopped:
            return ""
        if not self.stop:
            return text
        pending = self._held + text
        hit = min((i for s in self.stop if (i := pending.find(s)) >= 0), default=-1)
        if hit >= 0:
            self.stopped = True
            self._held = ""
            return pending[:hit]
        keep = self._partial_tail(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """The held-back text, when generation ends for another reason."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
