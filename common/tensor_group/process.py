"""One member's MLX part of a tensor-parallel group: a child process of the worker (or of
the coordinator), started for each new group (an mlx.distributed group cannot be formed
again inside a process, and its collectives hang when a peer dies, so a lost group is
ended with its processes).

It joins the group, loads the stage's layer range, splits it with mlx-lm's `Model.shard`
and serves its parent over stdin/stdout (common/tensor_group/wire.py). Only the leader's
parent sends work: the leader hands each message to every member with two all_sums (its
length, then its bytes; the others add zeros), so all ranks run the same forwards in the
same order and their KV stays alike. Only the leader answers.

    python -m common.tensor_group.process   # started by common/tensor_group/member.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from common import model_parts
from common.env_switches import GROUP_LAUNCH_EVERY
from common.errors import WedlmError
from common.kv_format import KVFormat
from common.layer_range import LayerRange
from common.layer_runner import LayerRunner, RowsError, select_slots
from common.layer_sizes import DTYPE_NAMES, kv_bytes_per_token, loaded_layer_bytes, parts_dtype
from common.model_config import load_model_config
from common.model_parts import load_model_parts
from common.tensor_codec import decode, wire_dtype, wire_form
from common.tensor_group.spec import GroupSpec, shard_layers
from common.tensor_group.wire import (
    PipeClosed,
    pack,
    read_body,
    read_frame,
    slots_of,
    spec_of,
    tensor_of,
    unpack,
    write_frame,
)

SHARE_BLOCK = 16384  # bytes handed to every rank in one all_sum (a decode step's message)
# Layers per launched chunk of a group's forward (common/model_parts.LAUNCH_EVERY); unset:
# the same as in one process.
LAUNCH_EVERY = GROUP_LAUNCH_EVERY.read()


def _group_file(name: str, content: Any) -> Path:
    path = Path(tempfile.mkdtemp(prefix="wedlm-group-")) / name
    path.write_text(json.dumps(content))
    return path


def ibv_devices(rdma: list[list[str]]) -> list[list[Any]]:
    """The matrix as MLX_IBV_DEVICES's file holds it: null for no device (the diagonal),
    a name for one cable, a list of names for several."""
    return [
        [None if not cell else cell.split(",") if "," in cell else cell for cell in row]
        for row in rdma
    ]


def group_env(spec: GroupSpec) -> dict[str, str]:
    """The environment `mlx.launch` sets for a rank of this backend (the files it names
    are written here)."""
    env = {"MLX_RANK": str(spec.rank), "MLX_WORLD_SIZE": str(spec.size)}
    if spec.backend == "nccl":
        host, _, port = spec.hosts[0].rpartition(":")
        env["NCCL_HOST_IP"], env["NCCL_PORT"] = host, port
    elif spec.backend == "jaccl":  # the leader's address, and the devices' matrix file
        env["MLX_JACCL_COORDINATOR"] = spec.hosts[0]
        env["MLX_IBV_DEVICES"] = str(_group_file("devices.json", ibv_devices(spec.rdma)))
    else:  # ring reads a hostfile: one list of addresses per rank
        env["MLX_HOSTFILE"] = str(_group_file("hosts.json", [[h] for h in spec.hosts]))
    return env


def join(spec: GroupSpec) -> mx.distributed.Group:
    """Form the group (blocks until every member has joined)."""
    os.environ.update(group_env(spec))
    group = mx.distributed.init(strict=True, backend=spec.backend)
    if group.size() != spec.size:
        raise WedlmError(f"the group formed with {group.size()} members, not {spec.size}")
    return group


class Member:
    def __init__(self, init: dict[str, Any], out) -> None:
        self.spec = GroupSpec(**init["group"])
        self.group = join(self.spec)
        write_frame(out, {"joined": True})  # the layers load next, which may take long
        config = load_model_config(init["path"])
        parts = load_model_parts(  # unfused: mlx-lm's shard splits q/k/v and gate/up by name
            config.path,
            LayerRange(init["start"], init["end"]),
            with_ends=False,
            config=config,
            fuse=False,
        )
        shard_layers(config, parts.layers, self.group)
        mx.eval(parts.parameters())
        # The whole range was read to cut this rank's share: hand the rest back now, or
        # MLX's buffer cache keeps it beside the share (on a GPU shared with the
        # coordinator, that is the difference between fitting and running out of memory).
        mx.clear_cache()
        self.dtype = parts_dtype(parts)
        kv = KVFormat(init.get("kv_bits") or None, init.get("kv_group_size") or 64)
        self.runner = LayerRunner(parts, kv)
        self.ready = {
            "ready": True,
            "dtype": DTYPE_NAMES.get(self.dtype, str(self.dtype)),
            "layer_bytes": loaded_layer_bytes(parts),
            "kv_bytes_per_token": kv_bytes_per_token(config, self.dtype, parts.layer_range, kv),
        }

    @property
    def leader(self) -> bool:
        return self.spec.rank == 0

    def share(self, body: bytes | None) -> bytes:
        """The leader's message on every rank, summed over the group (the others add
        zeros): a fixed block that holds its length and a decode step's whole message,
        then, for a longer one (a prompt chunk), the rest."""
        block = np.zeros(SHARE_BLOCK, dtype=np.uint8)
        if body is not None:
            block[:4] = np.frombuffer(len(body).to_bytes(4, "little"), dtype=np.uint8)
            head = np.frombuffer(body[: SHARE_BLOCK - 4], dtype=np.uint8)
            block[4 : 4 + head.size] = head
        got = np.array(mx.distributed.all_sum(mx.array(block), group=self.group))
        size = int.from_bytes(got[:4].tobytes(), "little")
        data = got[4 : 4 + min(size, SHARE_BLOCK - 4)].tobytes()
        rest = size - len(data)
        if rest > 0:
            tail = (
                mx.array(np.frombuffer(body[SHARE_BLOCK - 4 :], dtype=np.uint8))
                if body is not None
                else mx.zeros((rest,), dtype=mx.uint8)
            )
            data += bytes(np.array(mx.distributed.all_sum(tail, group=self.group)))
        return data

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message["op"]
        try:
            if op == "forward":
                return self.forward(message)
            if op == "release":
                held = [s for s in dict.fromkeys(message["ids"]) if s in self.runner.store]
                self.runner.release(held)
                return {"ok": True, "released": len(held), **self.kv_state()}
        except RowsError as e:  # every rank refuses alike: their state is the same
            return {"ok": False, "code": e.code, "message": str(e)}
        except Exception as e:
            return {"ok": False, "code": "INTERNAL", "message": f"{type(e).__name__}: {e}"}
        return {"ok": False, "code": "INVALID_ARGUMENT", "message": f"unknown op {op!r}"}

    def forward(self, message: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        spec = spec_of(message["spec"])
        x = self.hidden(message["hidden"], message.get("in_graph", False))
        self.runner.check(spec, x.shape)
        out = self.runner.forward(spec, x.astype(self.dtype), validate=False)
        slots = slots_of(message["slots"])
        if slots is not None:
            out = select_slots(out, slots)
        wire, raw = wire_form(out.astype(x.dtype))
        # Every member says it finished: a member lost in the middle of a collective
        # must not leave this rank with a partial sum that looks like a result.
        finished = mx.distributed.all_sum(mx.ones((1,), dtype=mx.int32), group=self.group)
        built = time.perf_counter()
        mx.eval(raw, finished)  # waits for the layers (and their all_sums)
        evaluated = time.perf_counter()
        if int(finished.item()) != self.spec.size:
            raise RowsError("UNAVAILABLE", "a member of the tensor group did not finish")
        data = np.array(raw)
        reply = {"ok": True, "hidden": [wire, list(data.shape), data.tobytes()]}
        done = time.perf_counter()
        # where the forward's time went (benchmarks/dev/tp_group_trace.py reads it)
        split = {"build_s": built - started, "eval_s": evaluated - built,
                 "readback_s": done - evaluated}  # fmt: skip
        return {**reply, "compute_s": done - started, "split": split, **self.kv_state()}

    def hidden(self, tensor: list, in_graph: bool) -> mx.array:
        """The forward's input on this rank. A decode step's travels inside the shared
        message; a longer one (a prompt chunk) comes from the leader with one all_sum in
        the forward's graph (the others add zeros): on the device, no host copies."""
        wire, shape, data = tensor
        if not in_graph:
            return decode(tensor_of(tensor))
        if data is not None:  # the leader's own copy
            x = decode(tensor_of(tensor))
        else:
            x = mx.zeros(tuple(shape), dtype=wire_dtype(wire))
        return mx.distributed.all_sum(x, group=self.group)

    def kv_state(self) -> dict[str, int]:
        return {"kv_sequences": len(self.runner.store), "kv_bytes": self.runner.kv_bytes()}

    def serve(self, src, out) -> None:
        while True:
            own = outgoing = None
            if self.leader:
                try:
                    outgoing = read_body(src)
                except PipeClosed:
                    outgoing = pack({"op": "stop"})  # the worker is gone: end the group
                if len(outgoing) > SHARE_BLOCK - 4:  # its hidden states go in the graph
                    own = {**unpack(outgoing), "in_graph": True}
                    outgoing = pack(_without_bytes(own))
            started = time.perf_counter()
            message = unpack(self.share(outgoing))
            if message["op"] == "stop":
                return
            message = own if own is not None else message
            shared = time.perf_counter() - started
            reply = self.handle(message)
            if self.leader:
                if "split" in reply:  # waiting for every rank to take the message
                    reply["split"]["share_s"] = shared
                write_frame(out, reply)


def _without_bytes(message: dict[str, Any]) -> dict[str, Any]:
    """A long message as the other ranks need it: the hidden states' dtype and shape, not
    their bytes (they come to every rank inside the forward, Member.hidden)."""
    if message.get("hidden") is None:
        return message
    wire, shape, _ = message["hidden"]
    return {**message, "hidden": [wire, shape, None]}


def _end_with_parent() -> None:
    """Exit when the worker that started this process is gone (killed with it, or not):
    a member blocked in a collective would otherwise outlive it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> int:
    _end_with_parent()
    if LAUNCH_EVERY is not None:
        model_parts.LAUNCH_EVERY = int(LAUNCH_EVERY)
    # Nothing but frames on the pipe: they go out on a descriptor of their own, and file
    # descriptor 1 becomes stderr, so what C++ code writes to stdout (MLX's backends,
    # NCCL) cannot corrupt a frame.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    src = sys.stdin.buffer
    try:
        init = read_frame(src)
        member = Member(init, out)
    except PipeClosed:
        return 0
    except Exception as e:
        write_frame(out, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    write_frame(out, member.ready)
    if member.leader:
        member.serve(src, out)
    else:  # a follower's parent only watches it; its work comes from the leader
        member.serve(None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
