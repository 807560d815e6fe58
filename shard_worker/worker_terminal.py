"""The worker's state on its terminal: one line on stderr each time it changes (assigned
layers a-b of model X, fetching them, serving them under plan N, the coordinator lost and
back, re-assigned), never the same line twice. The fetch's progress bar (layer_fetch.py,
drawn on a terminal only) shares stderr: lines go through tqdm.write, which keeps the bar
below them. The listening line on stdout (cli.py) is the first state: unassigned, or the
range of --layers."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from common.layer_range import LayerRange

PROG = "wedlm-worker"
# the coordinator calls Info on every worker of its plan each second (its heartbeat): this
# long without any call means it is gone, or it left this worker out of its plan
LOST_AFTER_S = 10.0
WATCH_PERIOD_S = 1.0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class WorkerTerminal:
    def __init__(self, node_id: str, stream: TextIO | None = None,
                 lost_after_s: float = LOST_AFTER_S) -> None:  # fmt: skip
        self.prefix = f"{PROG} {node_id}: "
        self.stream = stream  # None: sys.stderr at the time of writing
        self.lost_after_s = lost_after_s
        self._lock = threading.Lock()
        self._last = ""
        self._held = ""  # "layers 2-3 of model X" once it holds a range
        self._source = ""  # the coordinator's address, as its Assign names it
        self._heard: float | None = None  # the coordinator's last call (None: none yet)
        self._lost = False
        self._watcher: threading.Thread | None = None

    def show(self, text: str) -> None:
        """One line, unless it is the line shown last."""
        with self._lock:
            if text == self._last:
                return
            self._last = text
        from tqdm import tqdm

        tqdm.write(self.prefix + text, file=self.stream or sys.stderr)
        (self.stream or sys.stderr).flush()

    # ---- what the servicer and the fetcher report -----------------------------------
    def heard(self) -> None:
        """A call from the coordinator: it is there (again)."""
        with self._lock:
            self._heard = time.monotonic()
            back, self._lost = self._lost, False
        if back:
            self.show(f"coordinator back{f' ({self._source})' if self._source else ''}")

    def assigned(self, layers: LayerRange, model: str, source: str,
                 before: LayerRange | None) -> None:  # fmt: skip
        """An Assign of `layers` (before: the range it held until now)."""
        self._source = source or self._source
        what = f"layers {layers}{f' of model {model}' if model else ''}"
        if before is not None and before != layers:
            self.show(f"re-assigned {what} (was {before})")
        else:
            by = f" by the coordinator at {source}" if source else ""
            self.show(f"assigned {what}{by}")

    def fetching(self, layers: LayerRange, model: str, source: str, need: int, files: int,
                 ahead: bool) -> None:  # fmt: skip
        when = " ahead of the re-plan that takes this worker in" if ahead else ""
        self.show(f"fetching layers {layers} of model {model} from {source}: {_mb(need)} "
                  f"in {files} file{'s' * (files > 1)}{when}")  # fmt: skip

    def fetched(self, layers: LayerRange, model: str, got: int, seconds: float) -> None:
        rate = f", {got / seconds / 1e6:.1f} MB/s" if seconds > 0 else ""
        self.show(f"fetched layers {layers} of model {model}: {_mb(got)} in {seconds:.1f} s{rate}")

    def cached(self, layers: LayerRange, model: str) -> None:
        self.show(f"layers {layers} of model {model}: in the cache already (checksums match)")

    def serving(self, layers: LayerRange, model: str, epoch: int, next_stage: str) -> None:
        self._held = f"layers {layers}{f' of model {model}' if model else ''}"
        after = f"next stage {next_stage}" if next_stage else "the last stage"
        self.show(f"serving {self._held} (plan {epoch}, {after})")
        self._watch()

    # ---- the coordinator's silence ----------------------------------------------------
    def _watch(self) -> None:
        """Start the thread that notices the coordinator's silence, once (a daemon: it only
        prints, and touches neither MLX nor gRPC)."""
        with self._lock:
            if self._watcher is not None:
                return
            self._watcher = threading.Thread(target=self._run, name="terminal", daemon=True)
        self._watcher.start()

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_PERIOD_S)
            self.check_silence()

    def check_silence(self, now: float | None = None) -> bool:
        """Say once that the coordinator went silent; True when it is (now) lost."""
        now = time.monotonic() if now is None else now
        with self._lock:
            silent = self._heard is not None and now - self._heard >= self.lost_after_s
            if not silent or self._lost:
                return self._lost
            self._lost = True
        self.show(
            f"coordinator lost: no call from it for {self.lost_after_s:.0f} s (it stopped, "
            f"or left this worker out of its plan); {self._held or 'its layers'} kept, "
            f"waiting for it"
        )
        return True
