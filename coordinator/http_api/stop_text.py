"""OpenAI leaves stop strings out of the text it returns. The engine stops on the token
that completes one; this trims the text there, and while streaming holds back the few
characters that might be the start of a stop string until the next piece decides."""

from __future__ import annotations


class StopText:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def add(self, text: str) -> str:
        """The text that is now safe to send."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        self.pending += text
        cut = min((i for s in self.stops if (i := self.pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        keep = min(self.hold, len(self.pending))
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out

    def finish(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


def trim_at_stop(text: str, stops: tuple[str, ...]) -> str:
    trimmer = StopText(stops)
    return trimmer.add(text) + trimmer.finish()
