"""The console's snapshot of the cluster: one JSON-able dict built from what `wedlm status`
reads (the coordinator's ClusterStatusReply), what the status does not carry (the
coordinator's `console_extras`: this machine, stage timings, re-plans) and the metrics
registry, sampled once a second into a few minutes of history (tok/s, TTFT, load).

Members are remembered: a worker that leaves the plan (killed, unreachable) stays on the
page as "lost" until it answers again, so a loss is visible, not just a shorter list. Its
"since" is when the coordinator found it gone (`lost_at`), not when this page first asked.

gRPC errors ("worker A: UNAVAILABLE: failed to connect to all addresses; ...") reach the
page in words ("worker A stopped answering (connection refused)"), the raw text beside them
for a detail toggle."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import deque
from typing import Any

from google.protobuf.json_format import MessageToDict

from coordinator.http_api.api_backend import ApiBackend

HISTORY_S = 300  # the plots' time axis
SAMPLE_S = 1.0
LOST_KEPT_S = 1800.0  # a lost member leaves the page after this long
COORDINATOR = "coordinator"


# WorkerCallError's text: "worker HOST:PORT: CODE: message" (alone, or inside a longer text
# such as the planner's "listed workers not in the plan: A (unreachable: worker A: ...)":
# the message may hold "(...)" groups, and ends at a ")" it did not open)
_WORKER_ERROR = re.compile(
    r"worker (?P<address>[^\s:]+:\d+): (?P<code>[A-Z][A-Z_]+): "
    r"(?P<message>(?:[^()]|\([^()]*\))*)"
)
_CODES = {  # gRPC status -> what the worker did
    "UNAVAILABLE": "stopped answering",
    "DEADLINE_EXCEEDED": "did not answer in time",
    "UNAUTHENTICATED": "refused the cluster's credentials",
    "PERMISSION_DENIED": "refused the cluster's credentials",
    "RESOURCE_EXHAUSTED": "ran out of resources",
    "CANCELLED": "cancelled the call",
}
_CAUSES = (  # words in gRPC's message (lower-cased) -> the cause shown, first match wins
    ("connection refused", "connection refused"),
    ("connection reset", "connection reset"),
    ("broken pipe", "connection broken"),
    ("socket closed", "connection closed"),
    ("goaway", "connection closed"),
    ("keepalive", "no keepalive answer"),
    ("missed heartbeats", "missed heartbeats"),
    ("no route to host", "no route to host"),
    ("network is unreachable", "network unreachable"),
    ("dns resolution failed", "unknown host name"),
    ("out of memory", "out of memory"),
    ("timed out", "timed out"),
    ("deadline", "timed out"),
)


def _human_one(m: re.Match) -> str:
    code = m["code"]
    what = _CODES.get(code, f"failed ({code.lower().replace('_', ' ')})")
    lowered = m["message"].lower()
    cause = next((words for key, words in _CAUSES if key in lowered), None)
    if cause == "timed out" and code == "DEADLINE_EXCEEDED":
        cause = None  # "did not answer in time" says it
    return f"worker {m['address']} {what}" + (f" ({cause})" if cause else "")


def human_error(text: str) -> tuple[str, str]:
    """(the words a person reads, the raw text behind them: "" when nothing changed)."""
    human = _WORKER_ERROR.sub(_human_one, text)
    return human, (text if human != text else "")


def _layers(text: str) -> tuple[int, int] | None:
    """ "0-1" (a LayerRange's text) -> (0, 1)."""
    if not text:
        return None
    start, _, end = text.partition("-")
    return int(start), int(end or start)


class History:
    """tok/s, mean TTFT, running and queued requests, one sample a second, from the
    metrics registry (a daemon thread; it reads counters only)."""

    def __init__(self, backend: ApiBackend) -> None:
        self.registry = backend.metrics.registry
        self.samples: deque[tuple] = deque(maxlen=int(HISTORY_S / SAMPLE_S))
        self._last: tuple[float, float, float, float] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _value(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0

    def sample(self) -> None:
        now = time.time()
        tokens = self._value("wedlm:generation_tokens_total")
        ttft_sum = self._value("wedlm:time_to_first_token_seconds_sum")
        ttft_n = self._value("wedlm:time_to_first_token_seconds_count")
        running = self._value("wedlm:num_requests_running")
        queued = self._value("wedlm:num_requests_waiting")
        with self._lock:
            if self._last is not None:
                t0, tokens0, sum0, n0 = self._last
                rate = (tokens - tokens0) / max(now - t0, 1e-6)
                ttft = (ttft_sum - sum0) / (ttft_n - n0) * 1000 if ttft_n > n0 else None
                self.samples.append((round(now, 2), round(rate, 2),
                                     round(ttft, 1) if ttft is not None else None,
                                     int(running), int(queued)))  # fmt: skip
            self._last = (now, tokens, ttft_sum, ttft_n)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="console-history", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a metric missing: the plots skip a second
                self.sample()
            time.sleep(SAMPLE_S)

    def series(self) -> dict[str, list]:
        with self._lock:
            rows = list(self.samples)
        names = ("t", "tok_s", "ttft_ms", "running", "queued")
        return {name: [r[i] for r in rows] for i, name in enumerate(names)}


def _recovery(entry: dict[str, Any]) -> dict[str, Any]:
    reason, raw = human_error(str(entry.get("reason", "")))
    return {**entry, "reason": reason, "reason_raw": raw}


def _with_detail(card: dict[str, Any], detail: str) -> dict[str, Any]:
    card["detail"], card["detail_raw"] = human_error(detail)
    return card


class ConsoleState:
    """Builds snapshots; remembers members across them (for "lost")."""

    def __init__(self, backend: ApiBackend) -> None:
        self.backend = backend
        self.history = History(backend)
        self.known: dict[str, dict[str, Any]] = {}  # member id -> its last card
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, Any]:
        backend = self.backend
        self.history.start()
        if backend.cluster_status is None:
            raise RuntimeError("this server has no cluster status")
        status = MessageToDict(
            backend.cluster_status(),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
        extras = backend.cluster_extras()
        with self._lock:
            members = self._members(status, extras)
        stages = [m for m in members if m["layers"] is not None and m["state"] != "lost"]
        stages.sort(key=lambda m: m["layers"][0])
        for i, m in enumerate(stages):
            m["stage"] = i
        cache = status.get("prefix_cache", {})
        lookups, hits = int(cache.get("lookups", 0)), int(cache.get("hits", 0))
        waiting_for, waiting_for_raw = human_error(status.get("waiting_for", ""))
        return {
            "time": time.time(),
            "cluster": status.get("cluster", ""),
            "state": status.get("state", ""),
            "waiting_for": waiting_for,
            "waiting_for_raw": waiting_for_raw,
            "plan_epoch": int(status.get("plan_epoch", 0)),
            "model": backend.model_name,
            "num_layers": backend.num_layers,
            "default_mode": status.get("default_mode", ""),
            "modes": list(backend.modes),
            "running": int(status.get("running", 0)),
            "queued": int(status.get("queued", 0)),
            "max_running": int(status.get("max_running", 0)),
            "kv_budget_tokens": int(status.get("kv_budget_tokens", 0)),
            "members": members,
            "layers": [
                {"start": m["layers"][0], "end": m["layers"][1], "member": m["id"]} for m in stages
            ],
            "prefix_cache": {
                "enabled": bool(cache.get("enabled")),
                "lookups": lookups,
                "hits": hits,
                "hit_rate": hits / lookups if lookups else None,
                "hit_tokens": int(cache.get("hit_tokens", 0)),
                "entries": int(cache.get("entries", 0)),
            },
            "history": self.history.series(),
            "recoveries": [_recovery(r) for r in extras.get("recoveries", [])],
        }

    def _members(self, status: dict[str, Any], extras: dict[str, Any]) -> list[dict[str, Any]]:
        now = time.time()
        me = extras.get("self", {})
        cards = [{
            "id": COORDINATOR,
            "name": me.get("name", "coordinator"),
            "role": "coordinator",
            "address": me.get("address", ""),
            "device": me.get("device", ""),
            "memory_total": int(me.get("memory_total", 0)),
            "memory_used": int(me.get("memory_total", 0)) - int(me.get("memory_available", 0)),
            "layers": _layers(status.get("local_layers", "")),
            "state": status.get("state", ""),  # serving, recovering, waiting-for-workers…
            "detail": "",
            "detail_raw": "",
            "compute_ms": [],
            "hop_ms": [],
        }]  # fmt: skip
        fetches = {f.get("node_id", ""): f for f in status.get("fetches", [])}
        timings, memory = extras.get("timings", {}), extras.get("memory", {})
        lost_address = extras.get("lost", "")
        lost_at: dict[str, float] = extras.get("lost_at", {})
        seen = {COORDINATOR}
        for w in status.get("workers", []):
            info = w.get("info", {})
            address = w.get("address", "")
            member_id = info.get("node_id") or self._id_at(address)
            total, available = memory.get(address) or (
                int(info.get("memory_total", 0)),
                int(info.get("memory_available", 0)),
            )
            health = w.get("health", "")
            state = {"rejected": "refused", "unreachable": "lost"}.get(health, health)
            if address and address == lost_address:
                state = "lost"
            card = {
                "id": member_id,
                "name": info.get("node_id") or address,
                "role": "worker",
                "address": address,
                "device": info.get("device", ""),
                "memory_total": int(total),
                "memory_used": int(total) - int(available),
                "layers": (int(info.get("layer_start", 0)), int(info.get("layer_end", 0)))
                if info.get("has_layers") and health == "serving" else None,
                "state": state,
                "compute_ms": timings.get(address, {}).get("compute_ms", []),
                "hop_ms": timings.get(address, {}).get("hop_ms", []),
            }  # fmt: skip
            _with_detail(card, w.get("detail", ""))
            if (fetch := fetches.get(info.get("node_id", ""))) is not None:
                done, all_ = int(fetch.get("bytes_done", 0)), int(fetch.get("bytes_total", 0))
                card["state"] = "fetching"
                card["fetch"] = {"percent": 100 * done / all_ if all_ else 0.0,
                                 "eta_s": float(fetch.get("eta_s", -1))}  # fmt: skip
            if not info and member_id in self.known:  # unreachable: keep what we knew
                old = self.known[member_id]
                card.update({k: old[k] for k in ("name", "device", "memory_total")})
            if card["state"] == "lost":
                card["memory_used"] = None  # unknown now
            if member_id in seen:
                continue
            seen.add(member_id)
            self._remember(card, now, lost_at.get(address))
            cards.append(card)
        for member_id, old in list(self.known.items()):
            if member_id in seen or member_id == COORDINATOR:
                continue
            if old["state"] == "lost" and now - old.get("since", now) > LOST_KEPT_S:
                del self.known[member_id]
                continue
            card = {**old, "state": "lost", "layers": None, "compute_ms": [],
                    "memory_used": None, "hop_ms": []}  # fmt: skip
            if not old.get("detail"):
                _with_detail(card, "no longer answers (left the plan)")
            self._remember(card, now, lost_at.get(old["address"]))
            cards.append(self.known[member_id])
        return cards

    def _id_at(self, address: str) -> str:
        """The member last seen at this address (an unreachable worker has no info)."""
        for member_id, card in self.known.items():
            if card["address"] == address:
                return member_id
        return address

    def _remember(self, card: dict[str, Any], now: float, lost_at: float | None = None) -> None:
        """Keep `since` across snapshots while the state stays; a lost card's `since` is
        the coordinator's time of loss when that came after this console last saw it up
        (else an older loss: the console's first sight of this one)."""
        old = self.known.get(card["id"])
        card["since"] = old["since"] if old and old["state"] == card["state"] else now
        card["up_at"] = now if card["state"] != "lost" else (old or {}).get("up_at", 0.0)
        if card["state"] == "lost" and lost_at is not None and lost_at > card["up_at"]:
            card["since"] = lost_at
        if card["state"] != "refused":
            self.known[card["id"]] = card
