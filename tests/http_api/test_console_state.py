"""The console's snapshot (coordinator/console/console_state.py) from a ClusterStatusReply
made by hand: members, the layer bar, a worker remembered as lost (and since when), gRPC
errors put in words; and the stream's commit chunks."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from common.proto_gen import wedlm_pb2 as pb
from coordinator.console.console_state import ConsoleState, human_error
from coordinator.http_api.openai_reply import ChoiceReply
from coordinator.service.metrics import Metrics

GIB = 2**30


def worker(address: str, node: str, start: int, end: int) -> pb.WorkerStatus:
    info = pb.WorkerInfo(node_id=node, device="gpu: Apple M2 Max", memory_total=32 * GIB,
                         memory_available=20 * GIB, has_layers=True, layer_start=start,
                         layer_end=end)  # fmt: skip
    return pb.WorkerStatus(address=address, source="static", health="serving", info=info)


def backend(reply: dict, extras: dict) -> SimpleNamespace:
    return SimpleNamespace(
        cluster_status=lambda: reply["status"], cluster_extras=lambda: extras, metrics=Metrics(),
        model_name="m", num_layers=6, modes=("auto", "wedlm", "ar", "speculative"),
    )  # fmt: skip


def test_members_layers_and_a_lost_worker():
    status = pb.ClusterStatusReply(cluster="c", state="serving", local_layers="0-1", running=1)
    status.workers.append(worker("10.0.0.2:5000", "mini", 2, 3))
    status.workers.append(worker("10.0.0.3:5000", "studio", 4, 5))
    reply = {"status": status}
    extras = {
        "self": {
            "name": "air",
            "address": "10.0.0.1:50051",
            "device": "gpu: Apple M3",
            "memory_total": 16 * GIB,
            "memory_available": 12 * GIB,
        },
        "timings": {"10.0.0.3:5000": {"compute_ms": [1.5, 2.0], "hop_ms": [3.0, 3.5]}},
        "memory": {"10.0.0.3:5000": (32 * GIB, 8 * GIB)},
        "lost": "",
        "recoveries": [],
    }
    state = ConsoleState(backend(reply, extras))
    snap = state.snapshot()
    json.dumps(snap)  # what the events send
    assert [(s["start"], s["end"], s["member"]) for s in snap["layers"]] == [
        (0, 1, "coordinator"), (2, 3, "mini"), (4, 5, "studio")]  # fmt: skip
    cards = {m["id"]: m for m in snap["members"]}
    assert cards["coordinator"]["memory_used"] == 4 * GIB and cards["coordinator"]["stage"] == 0
    assert cards["studio"]["memory_used"] == 24 * GIB  # the heartbeat's reading, not the plan's
    assert cards["studio"]["hop_ms"] == [3.0, 3.5] and cards["mini"]["stage"] == 1

    extras["lost"] = "10.0.0.3:5000"  # the heartbeat broke the pipeline: lost at once
    snap = state.snapshot()
    assert {m["id"]: m["state"] for m in snap["members"]}["studio"] == "lost"
    assert [s["member"] for s in snap["layers"]] == ["coordinator", "mini"]

    # re-planned without it: it is probed as unreachable (no info), then left out
    status = pb.ClusterStatusReply(cluster="c", state="serving", local_layers="0-1")
    status.workers.append(worker("10.0.0.2:5000", "mini", 2, 5))
    status.workers.add(address="10.0.0.3:5000", source="static", health="unreachable")
    reply["status"], extras["lost"] = status, ""
    snap = state.snapshot()
    states = {m["id"]: m["state"] for m in snap["members"]}
    assert states == {"coordinator": "serving", "mini": "serving", "studio": "lost"}
    assert {m["id"]: m["device"] for m in snap["members"]}["studio"] == "gpu: Apple M2 Max"
    del status.workers[1]
    snap = state.snapshot()
    assert {m["id"]: m["state"] for m in snap["members"]}["studio"] == "lost"


def test_commit_chunks_carry_the_forward_count():
    for chat in (True, False):
        chunk = ChoiceReply(chat, "m").commit_chunk("a b", 1, 3)
        assert chunk.startswith("data: ") and chunk.endswith("\n\n")
        body = json.loads(chunk.removeprefix("data: "))
        assert body["wedlm"] == {"forwards": 1, "tokens": 3}
        text = body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]
        assert text == "a b"


REFUSED = (
    "worker 127.0.0.1:50061: UNAVAILABLE: failed to connect to all addresses; last error: "
    "UNKNOWN: ipv4:127.0.0.1:50061: Failed to connect to remote host: Connection refused"
)  # what a probe of a killed worker says


def test_grpc_errors_in_words_with_the_raw_text_kept():
    assert human_error(REFUSED) == (
        "worker 127.0.0.1:50061 stopped answering (connection refused)",
        REFUSED,
    )
    heartbeat = "worker 10.0.0.3:5000: UNAVAILABLE: missed heartbeats"
    assert human_error(heartbeat)[0] == "worker 10.0.0.3:5000 stopped answering (missed heartbeats)"
    late = "worker 10.0.0.3:5000: DEADLINE_EXCEEDED: Deadline Exceeded"
    assert human_error(late)[0] == "worker 10.0.0.3:5000 did not answer in time"
    closed = "worker 10.0.0.3:5000: UNAVAILABLE: (Socket closed)"
    assert human_error(closed)[0] == "worker 10.0.0.3:5000 stopped answering (connection closed)"
    odd = "worker 10.0.0.3:5000: DATA_LOSS: something"
    assert human_error(odd)[0] == "worker 10.0.0.3:5000 failed (data loss)"
    # inside the planner's text: the error in words, the rest as it was
    listed = f"listed workers not in the plan: 127.0.0.1:50061 (unreachable: {REFUSED})"
    assert human_error(listed) == (
        "listed workers not in the plan: 127.0.0.1:50061 (unreachable: worker 127.0.0.1:50061"
        " stopped answering (connection refused))",
        listed,
    )
    # words already: nothing behind them
    assert human_error("belongs to cluster 'a', not 'b'") == ("belongs to cluster 'a', not 'b'", "")


def test_a_lost_worker_counts_from_when_the_coordinator_found_it_gone():
    # lost 12 s ago, before any page asked: the first snapshot says so, not "0 s ago"
    status = pb.ClusterStatusReply(cluster="c", state="serving", local_layers="0-1")
    status.workers.add(address="10.0.0.2:5000", source="static", health="unreachable",
                       detail=REFUSED.replace("127.0.0.1:50061", "10.0.0.2:5000"))  # fmt: skip
    reply = {"status": status}
    lost_at = time.time() - 12
    heartbeat = "worker 10.0.0.2:5000: UNAVAILABLE: missed heartbeats"
    extras = {"self": {}, "timings": {}, "memory": {}, "lost": "",
              "lost_at": {"10.0.0.2:5000": lost_at},
              "recoveries": [{"at": lost_at + 0.5, "seconds": 0.5, "lost": True,
                              "reason": heartbeat}]}  # fmt: skip
    state = ConsoleState(backend(reply, extras))
    snap = state.snapshot()
    card = {m["id"]: m for m in snap["members"]}["10.0.0.2:5000"]  # never seen up: no name
    assert card["state"] == "lost" and card["since"] == lost_at
    assert card["detail"] == "worker 10.0.0.2:5000 stopped answering (connection refused)"
    assert card["detail_raw"].startswith("worker 10.0.0.2:5000: UNAVAILABLE: failed to connect")
    assert snap["recoveries"][0]["reason"] == (
        "worker 10.0.0.2:5000 stopped answering (missed heartbeats)"
    )
    assert snap["recoveries"][0]["reason_raw"].endswith("UNAVAILABLE: missed heartbeats")
    assert state.snapshot()["members"][1]["since"] == lost_at  # it stays

    # seen up since that loss, then lost again: the old loss time is not this loss's
    up = pb.ClusterStatusReply(cluster="c", state="serving", local_layers="0-1")
    up.workers.append(worker("10.0.0.2:5000", "mini", 2, 5))
    reply["status"] = up
    state = ConsoleState(backend(reply, extras))
    state.snapshot()
    reply["status"] = status
    before = time.time()
    card = {m["id"]: m for m in state.snapshot()["members"]}["mini"]
    assert card["state"] == "lost" and card["since"] >= before  # not the old loss's time
