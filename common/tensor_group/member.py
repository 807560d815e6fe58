"""A process's side of its group process (common/tensor_group/process.py): starts it for a
group, hands it forwards in order and reads their answers in the same order, and ends it
when the group ends. A collective that does not finish within the bound means a member is
lost (dead or frozen): the process is ended and the forward fails as UNAVAILABLE, which the
coordinator answers by planning again without the lost member."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
from collections import deque
from dataclasses import asdict
from typing import Any

import numpy as np

from common.env_switches import GROUP_BOUND_S
from common.errors import WedlmError
from common.kv_format import KVFormat
from common.layer_range import LayerRange
from common.layer_runner import RowsError
from common.rows_spec import RowsSpec
from common.tensor_group.spec import GroupSpec
from common.tensor_group.wire import (
    PipeClosed,
    read_frame,
    slots_message,
    spec_message,
    tensor_message,
    write_frame,
)
from common.wire_frames import WireTensor

JOIN_TIMEOUT_S = 30.0  # every member joining the group (a missing one: it did not form)
LOAD_TIMEOUT_S = 900.0  # loading the layers after that (from disk)
BOUND_S = GROUP_BOUND_S.number()  # one forward, collectives in it
# A long forward (a prompt chunk on a slow machine) may take longer than the bound without
# any member being lost: each forward also gets this many times the time per row of the
# largest forward its group has run so far (a small one's time is mostly fixed costs),
# for each of its rows.
ROW_MARGIN = 4.0


class GroupFailed(WedlmError):
    """The group did not form (`code` FAILED_PRECONDITION), or a member was lost
    (UNAVAILABLE); the message says which and why."""

    def __init__(self, message: str, code: str = "UNAVAILABLE") -> None:
        super().__init__(message)
        self.code = code


class GroupMember:
    def __init__(
        self,
        path: str,
        layer_range: LayerRange,
        kv: KVFormat,
        spec: GroupSpec,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start the group process (with `env`, else this process's environment) and wait
        until the group has formed and loaded (raises GroupFailed with the reason when it
        does not)."""
        self.spec = spec
        self.layer_range = layer_range
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._read_error = ""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "common.tensor_group.process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        threading.Thread(target=self._read, name="group-replies", daemon=True).start()
        init = {
            "path": str(path),
            "start": layer_range.start,
            "end": layer_range.end,
            "kv_bits": kv.bits,
            "kv_group_size": kv.group_size,
            "group": asdict(spec),
        }
        self._send(init)
        ready = self._reply(JOIN_TIMEOUT_S, "forming the group", "FAILED_PRECONDITION")
        if ready.get("joined"):
            ready = self._reply(LOAD_TIMEOUT_S, "loading the layers", "FAILED_PRECONDITION")
        if not ready.get("ready"):
            self.stop()
            raise GroupFailed(
                f"the tensor group did not form: {ready.get('error')}", "FAILED_PRECONDITION"
            )
        self.ready = ready
        self.kv_sequences = self.kv_bytes = 0
        self.last_split: dict[str, float] = {}  # the last forward's times in the process
        self._rows: deque[int] = deque()  # the launched forwards' rows, in order
        # Answers to launched forwards read while waiting for a later request's (a
        # release sent while forwards were in flight): finish() takes them first.
        self._early: deque[dict[str, Any]] = deque()
        self._per_row_s = 0.0  # compute time per row of the largest forward so far
        self._largest = 0

    @property
    def leader(self) -> bool:
        return self.spec.rank == 0

    def _read(self) -> None:
        try:
            while True:
                self._replies.put(read_frame(self._proc.stdout))
        except PipeClosed:
            self._replies.put(None)
        except (OSError, ValueError) as e:  # not a frame: said in the error
            self._read_error = f" (its answer could not be read: {type(e).__name__}: {e})"
            self._replies.put(None)

    def _send(self, message: dict[str, Any]) -> None:
        try:
            write_frame(self._proc.stdin, message)
        except (BrokenPipeError, OSError, ValueError):
            self.stop()
            raise GroupFailed(self._lost("its group process ended")) from None

    def _reply(self, timeout: float, doing: str, code: str = "UNAVAILABLE") -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            raise GroupFailed(
                self._lost(f"{doing} did not finish within {timeout:g} s"), code
            ) from None
        if reply is None:
            self.stop()
            ended = self._proc.returncode
            how = (f" (signal {-ended})" if ended < 0 else f" (exit code {ended})") if ended else ""
            raise GroupFailed(
                self._lost(f"its group process ended while {doing}{how}{self._read_error}"), code
            )
        return reply

    def _lost(self, what: str) -> str:
        return (
            f"tensor group (rank {self.spec.rank} of {self.spec.size}, {self.spec.backend}): {what}"
        )

    def launch(self, spec: RowsSpec, hidden: WireTensor, slots: np.ndarray | None) -> None:
        if not self.leader:
            raise RowsError(
                "FAILED_PRECONDITION",
                f"this worker is member {self.spec.rank} of a tensor group: its leader "
                "takes the forwards",
            )
        self._rows.append(spec.num_rows * spec.width)
        self._send(
            {
                "op": "forward",
                "spec": spec_message(spec),
                "hidden": tensor_message(hidden),
                "slots": slots_message(slots),
            }
        )

    def finish(self) -> tuple[WireTensor, float]:
        """The next launched forward's output (in launch order) and its compute seconds."""
        rows = self._rows.popleft() if self._rows else 1
        bound = BOUND_S + ROW_MARGIN * self._per_row_s * rows
        raw = (
            self._early.popleft()
            if self._early
            else self._reply(bound, "a forward (a member is lost or frozen)")
        )
        reply = self._checked(raw)
        if rows >= self._largest:
            per_row = float(reply["compute_s"]) / rows
            self._per_row_s = per_row if rows > self._largest else max(self._per_row_s, per_row)
            self._largest = rows
        dtype, shape, data = reply["hidden"]
        self.last_split = reply.get("split", {})
        return WireTensor(dtype, tuple(shape), data), float(reply["compute_s"])

    def release(self, seq_ids: list[int]) -> int:
        """Forget these sequences in the group (after the forwards launched before it)."""
        self._send({"op": "release", "ids": seq_ids})
        while len(self._early) < len(self._rows):  # answers come in the order asked
            self._early.append(self._reply(BOUND_S, "a forward (a member is lost or frozen)"))
        return int(self._checked(self._reply(BOUND_S, "a release"))["released"])

    def _checked(self, reply: dict[str, Any]) -> dict[str, Any]:
        if "kv_sequences" in reply:
            self.kv_sequences, self.kv_bytes = reply["kv_sequences"], reply["kv_bytes"]
        if not reply.get("ok"):
            raise RowsError(reply.get("code", "INTERNAL"), reply.get("message", "failed"))
        return reply

    def stop(self) -> None:
        """End the group process (a follower blocked in a collective included)."""
        if self._proc.poll() is None:
            if self.leader:
                try:
                    write_frame(self._proc.stdin, {"op": "stop"})
                    self._proc.wait(2.0)
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    pass
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
