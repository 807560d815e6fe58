"""The layers this worker holds and their KV. Every method but `state` runs on the MLX
thread; `state` is an immutable snapshot that handler threads read without waiting."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from common.kv_format import FULL, KVFormat
from common.layer_range import LayerRange
from common.layer_runner import LayerRunner, RowsError, select_slots
from common.layer_sizes import (
    DTYPE_NAMES,
    compute_dtype,
    estimated_layer_bytes,
    kv_bytes_per_token,
    loaded_layer_bytes,
    parts_dtype,
)
from common.model_config import ModelConfig
from common.model_parts import load_model_parts
from common.rows_spec import RowsSpec
from common.tensor_codec import WireTensor, decode, frame, wire_form
from common.tensor_group.member import GroupFailed, GroupMember
from common.tensor_group.spec import GroupSpec
from common.wire_frames import TensorFrame


@dataclass
class LaunchedForward:
    wire: int  # wire dtype of the result
    raw: mx.array | None  # the result as its wire bytes will be read (lazy until finished)
    started: float  # None: the forward runs in the tensor group's process


@dataclass(frozen=True)
class LayerState:
    layer_range: LayerRange | None  # None while waiting for an assignment
    dtype: str
    layer_bytes: int
    kv_bytes_per_token: int
    kv_sequences: int = 0
    kv_bytes: int = 0
    kv: KVFormat = FULL  # how the KV is stored (the coordinator's Assign says)
    group: GroupSpec | None = None  # the tensor group it holds its range in (None: alone)
    group_error: str = ""  # why the last group it was given did not form


class HeldLayers:
    def __init__(self, config: ModelConfig | None, fixed: LayerRange | None) -> None:
        """`config` None: a worker that fetches its model and has none yet."""
        self.fixed = fixed
        self.runner: LayerRunner | None = None
        self.member: GroupMember | None = None  # the range held in a tensor group
        self.group_error = ""
        self.kv = FULL
        self.use_model(config)

    def use_model(self, config: ModelConfig | None) -> LayerState:
        """Hold nothing, of model `config` from now on (a fetching worker's model change)."""
        self._leave_group()
        self.runner = None
        self.config = config
        if config is not None:
            self._run_dtype = compute_dtype(config)
            self._estimate = estimated_layer_bytes(config, self._run_dtype)
        gc.collect()
        mx.clear_cache()
        self.state = self._describe()
        return self.state

    def load(
        self, layer_range: LayerRange, kv: KVFormat = FULL, group: GroupSpec | None = None
    ) -> LayerState:
        """Hold exactly `layer_range` with no KV, stored as `kv` says, alone or as one
        member of `group` (its 1/size share, in a group process formed anew). The same
        range alone keeps its weights; another range replaces them, the old layers going
        first so both are never held at once."""
        kv.check(self.config)
        self.kv = kv
        self._leave_group()
        if group is not None:
            return self._join_group(layer_range, kv, group)
        if self.runner is not None and self.runner.parts.layer_range == layer_range:
            self.runner = LayerRunner(self.runner.parts, kv)
            self.state = self._describe()
            return self.state
        self.runner = None
        self.state = self._describe()
        gc.collect()
        mx.clear_cache()
        parts = load_model_parts(self.config.path, layer_range, with_ends=False, config=self.config)
        self._run_dtype = parts_dtype(parts)
        self.runner = LayerRunner(parts, kv)
        self.state = self._describe()
        return self.state

    def _join_group(self, layer_range: LayerRange, kv: KVFormat, group: GroupSpec) -> LayerState:
        self.runner = None  # the group process holds the layers, not this one
        gc.collect()
        mx.clear_cache()
        try:
            self.member = GroupMember(self.config.path, layer_range, kv, group)
        except GroupFailed as e:
            self.group_error = str(e)
            self.state = self._describe()
            raise
        self.group_error = ""
        ready = self.member.ready
        self.state = LayerState(
            layer_range=layer_range,
            dtype=ready["dtype"],
            layer_bytes=ready["layer_bytes"],
            kv_bytes_per_token=ready["kv_bytes_per_token"],
            kv=kv,
            group=group,
        )
        return self.state

    def _leave_group(self) -> None:
        if self.member is not None:
            self.member.stop()
            self.member = None
            self.state = self._describe()

    def close(self) -> None:
        """End the group process, if any (the worker stops)."""
        self._leave_group()

    def launch(
        self, spec: RowsSpec, hidden: WireTensor, reply_slots: np.ndarray | None = None
    ) -> LaunchedForward:
        """Build this worker's layers over `hidden` (only `reply_slots` of each row kept
        when given) and start the device on them; `finish` reads the result."""
        if self.member is not None:  # the group process runs it; answers come in order
            started = time.perf_counter()
            self.member.launch(spec, hidden, reply_slots)
            return LaunchedForward(0, None, started)
        runner = self.runner
        if runner is None:
            raise RowsError(
                "FAILED_PRECONDITION",
                "this worker holds no layers yet: it waits for the coordinator's Assign",
            )
        started = time.perf_counter()
        x = decode(hidden)
        wire_dtype = x.dtype
        runner.check(spec, x.shape)
        out = runner.forward(spec, x.astype(self._run_dtype), validate=False)
        if reply_slots is not None:
            out = select_slots(out, reply_slots)
        wire, raw = wire_form(out.astype(wire_dtype))
        mx.async_eval(raw)  # the layers and the wire cast in one evaluation
        return LaunchedForward(wire, raw, started)

    def finish(self, launched: LaunchedForward) -> tuple[TensorFrame, float]:
        """The launched forward's hidden states, in the request's wire dtype, and the
        seconds from its launch to its result (waiting included for the one before it)."""
        if launched.raw is None:
            if self.member is None:  # an earlier forward found the group lost
                raise GroupFailed("the tensor group ended: the coordinator plans again")
            try:
                out, _ = self.member.finish()
            except GroupFailed:
                self._leave_group()  # the coordinator plans again; this range is gone
                raise
            self._refresh_kv()
            return TensorFrame(
                out.dtype, out.shape, out.data
            ), time.perf_counter() - launched.started
        out = frame(launched.wire, launched.raw)  # reading the buffer waits for the device
        compute_s = time.perf_counter() - launched.started
        self._refresh_kv()
        return out, compute_s

    def forward(
        self, spec: RowsSpec, hidden: WireTensor, reply_slots: np.ndarray | None = None
    ) -> tuple[TensorFrame, float]:
        """launch + finish, for one forward on its own."""
        return self.finish(self.launch(spec, hidden, reply_slots))

    def release(self, seq_ids: list[int]) -> int:
        if self.member is not None:
            if not self.member.leader:  # its KV follows the leader's releases
                return 0
            released = self.member.release(list(dict.fromkeys(seq_ids)))
            self._refresh_kv()
            return released
        runner = self.runner
        if runner is None:
            return 0
        held = [s for s in dict.fromkeys(seq_ids) if s in runner.store]
        runner.release(held)
        self._refresh_kv()
        return len(held)

    def _refresh_kv(self) -> None:
        if self.member is not None:
            self.state = replace(
                self.state, kv_sequences=self.member.kv_sequences, kv_bytes=self.member.kv_bytes
            )
            return
        runner = self.runner
        sequences = len(runner.store) if runner else 0
        nbytes = runner.kv_bytes() if runner else 0
        self.state = replace(self.state, kv_sequences=sequences, kv_bytes=nbytes)

    def _describe(self) -> LayerState:
        if self.config is None:
            return LayerState(
                layer_range=None,
                dtype="",
                layer_bytes=0,
                kv_bytes_per_token=0,
                group_error=self.group_error,
            )
        if self.runner is None:
            dtype = compute_dtype(self.config)
            return LayerState(
                layer_range=None,
                dtype=DTYPE_NAMES.get(dtype, str(dtype)),
                layer_bytes=self._estimate,
                kv_bytes_per_token=kv_bytes_per_token(self.config, dtype, 1, self.kv),
                kv=self.kv,
                group_error=self.group_error,
            )
        parts = self.runner.parts
        dtype = self._run_dtype
        return LayerState(
            layer_range=parts.layer_range,
            dtype=DTYPE_NAMES.get(dtype, str(dtype)),
            layer_bytes=loaded_layer_bytes(parts),
            kv_bytes_per_token=kv_bytes_per_token(self.config, dtype, parts.layer_range, self.kv),
            kv=self.kv,
        )
