"""Stop sequences applied to text as it streams.

Why it exists: ``stop_sequences`` end a message at the first occurrence of any
of them, the sequence itself is not part of the answer, and the answer names
the one that matched. The workers' token streams carry no stop strings, so the
front door finds them in the decoded text. While streaming, text that could be
the start of a stop sequence is held back until it is known not to be one, so
a client never receives part of a stop sequence.
"""

from __future__ import annotations


class StopMatcher:
    """Feed decoded text with ``push``; it returns what may be sent and sets ``matched`` on a hit."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """The part of ``pending + text`` that is final. After a match, nothing more is accepted."""
        if self.matched is not None:
            return ""
        buf = self.pending + text
        if not self.stops:
            self.pending = ""
            return buf
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.matched = best[1]
            self.pending = ""
            return buf[:best[0]]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end of the stream: held-back text that never became a stop sequence."""
        out, self.pending = self.pending, ""
        return "" if self.matched is not None else out
