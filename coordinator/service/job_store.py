"""Accepted jobs and their results in an embedded SQLite database, so a coordinator restart
loses nothing it accepted: unfinished jobs run again, finished results stay retrievable.
Writes go through one writer thread, which commits whatever is pending in one transaction.
Accepting a job waits for its commit (a client holding a job id may rely on it); results
are written without waiting, so the engine never waits on disk."""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgpack

from common.errors import WedlmError
from common.generation_params import GenerationParams
from coordinator.service.messages import RequestResult

log = logging.getLogger(__name__)
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    state TEXT NOT NULL,
    request BLOB NOT NULL,      -- msgpack: prompt ids, decoding parameters, deadline
    result TEXT                 -- JSON of the final record, once finished
)
"""
_STOP = object()
ACCEPT_TIMEOUT_S = 10.0


class JobStoreError(WedlmError):
    """An accepted job could not be written: it must not be acknowledged."""


class _Commit:
    """Signalled by the writer once the entry's transaction is committed (or failed)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: str | None = None


def encode_request(prompt: list[int], params: GenerationParams, deadline: float | None) -> bytes:
    fields = asdict(params)
    fields.pop("extra_stop_ids", None)  # the model's stop ids are re-added on submit
    return msgpack.packb({"prompt": prompt, "params": fields, "deadline": deadline})


def decode_request(blob: bytes) -> tuple[list[int], GenerationParams, float | None]:
    data = msgpack.unpackb(blob)
    fields = data["params"]
    for key in ("stop_ids", "stop_strings"):
        fields[key] = tuple(fields[key])
    fields["logit_bias"] = tuple(tuple(pair) for pair in fields.get("logit_bias", ()))
    return list(data["prompt"]), GenerationParams(**fields), data.get("deadline")


class JobStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        with self._connect() as db:
            db.execute(SCHEMA)
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="job-store", daemon=True)
        self._writer.start()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def load(self) -> list[dict[str, Any]]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT job_id, created_at, state, request, result FROM jobs ORDER BY created_at"
            ).fetchall()
        return [
            {
                "job_id": r[0],
                "created_at": r[1],
                "state": r[2],
                "request": r[3],
                "result": RequestResult.from_dict(json.loads(r[4])) if r[4] else None,
            }
            for r in rows
        ]

    def accepted(self, job_id: str, created_at: float, request: bytes) -> None:
        """Returns once the job is committed: a coordinator killed right after answering
        with the job's id finds the job when it starts again. Raises JobStoreError."""
        commit = _Commit()
        self._queue.put(
            (
                "INSERT OR REPLACE INTO jobs VALUES (?, ?, 'queued', ?, NULL)",
                (job_id, created_at, request),
                commit,
            )
        )
        if not commit.done.wait(ACCEPT_TIMEOUT_S):
            raise JobStoreError(
                f"the job store ({self.path}) did not commit within {ACCEPT_TIMEOUT_S:g} s"
            )
        if commit.error is not None:
            raise JobStoreError(f"the job store ({self.path}) cannot write: {commit.error}")

    def finished(self, job_id: str, state: str, result: RequestResult) -> None:
        self._queue.put(
            (
                "UPDATE jobs SET state = ?, result = ? WHERE job_id = ?",
                (state, json.dumps(result.to_dict()), job_id),
            )
        )

    def forget(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self._queue.put(("DELETE FROM jobs WHERE job_id = ?", (job_id,)))

    def _write_loop(self) -> None:
        db = self._connect()
        while True:
            item = self._queue.get()
            batch = [item]
            while not self._queue.empty():  # commit what is pending in one transaction
                batch.append(self._queue.get())
            entries = [e for e in batch if e is not _STOP]
            error = None
            try:
                with db:
                    for sql, args, *_ in entries:
                        db.execute(sql, args)
            except sqlite3.Error as e:
                error = str(e)
                log.error("job store write failed: %s", e)
            for _, _, *waiter in entries:
                if waiter:
                    waiter[0].error = error
                    waiter[0].done.set()
            if any(entry is _STOP for entry in batch):
                db.close()
                return

    def close(self) -> None:
        self._queue.put(_STOP)
        self._writer.join(10)
