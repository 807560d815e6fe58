"""Accepted jobs and their results in an embedded SQLite database, so a coordinator restart
loses nothing it accepted: unfinished jobs run again, finished results stay retrievable.
Writes go through one writer thread, which commits whatever is pending in one transaction.
Accepting a job waits for its commit (a client holding a job id may rely on it); results
are written without waiting, so the engine never waits on disk.

Every job is kept with the identity of the model that accepted it (ModelConfig.identity):
coordinators of several models may share one store (same host, --state-dir and cluster),
and each reads and resumes only its own model's jobs, leaving the others' untouched."""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
from dataclasses import asdict, dataclass
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
    result TEXT,                -- JSON of the final record, once finished
    model TEXT,                 -- the identity of the model that accepted it
    model_name TEXT             -- that model's name in the APIs (for the logs)
)
"""
# A store written before jobs named their model lacks the last two columns.
MODEL_COLUMNS = ("model", "model_name")
INDEX = "CREATE INDEX IF NOT EXISTS jobs_by_model ON jobs (model, created_at)"
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


@dataclass(frozen=True)
class OtherModel:
    """Unfinished jobs in the store that another model accepted (left for its coordinator)."""

    identity: str
    name: str
    jobs: int


def decode_result(text: str) -> RequestResult:
    return RequestResult.from_dict(json.loads(text))


class JobStore:
    def __init__(self, path: Path, model: str = "", model_name: str = "") -> None:
        """`model`: the identity of the model this coordinator serves (its jobs are the
        ones it reads); `model_name`: its name, recorded for other coordinators' logs."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.model, self.model_name = model, model_name
        self.adopted = 0  # jobs of a store from before models were recorded, taken as ours
        with self._connect() as db:
            db.execute(SCHEMA)
            self.adopted = self._migrate(db)
            db.execute(INDEX)
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="job-store", daemon=True)
        self._writer.start()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def _migrate(self, db: sqlite3.Connection) -> int:
        """Add the model columns to a store of an older version. Its jobs named no model:
        the coordinator that opens it first takes them as its own (the older version
        resumed them on whatever model came next, and it was most often the same one).
        Returns how many jobs it took."""
        columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        for column in MODEL_COLUMNS:
            if column not in columns:
                db.execute(f"ALTER TABLE jobs ADD COLUMN {column} TEXT")
        taken = db.execute(
            "UPDATE jobs SET model = ?, model_name = ? WHERE model IS NULL",
            (self.model, self.model_name),
        ).rowcount
        if taken:
            log.warning(
                "job store %s: %d jobs from before the store recorded models are taken as "
                "jobs of this model (%s)", self.path, taken, self.model_name or self.model,
            )  # fmt: skip
        return taken

    def load(self) -> list[dict[str, Any]]:
        """This model's jobs, oldest first, as stored: "request" the msgpack blob,
        "result" the final record's JSON text or None (decode_request, decode_result)."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT job_id, created_at, state, request, result FROM jobs WHERE model = ? "
                "ORDER BY created_at",
                (self.model,),
            ).fetchall()
        return [
            {
                "job_id": r[0],
                "created_at": r[1],
                "state": r[2],
                "request": r[3],
                "result": r[4],
            }
            for r in rows
        ]

    def others(self) -> list[OtherModel]:
        """Unfinished jobs of other models, by model: kept for their own coordinators."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT model, MAX(model_name), COUNT(*) FROM jobs WHERE model != ? AND "
                "result IS NULL GROUP BY model ORDER BY MIN(created_at)",
                (self.model,),
            ).fetchall()
        return [OtherModel(identity, name or "", count) for identity, name, count in rows]

    def accepted(self, job_id: str, created_at: float, request: bytes) -> None:
        """Returns once the job is committed: a coordinator killed right after answering
        with the job's id finds the job when it starts again. Raises JobStoreError."""
        commit = _Commit()
        self._queue.put(
            (
                "INSERT OR REPLACE INTO jobs (job_id, created_at, state, request, result, "
                "model, model_name) VALUES (?, ?, 'queued', ?, NULL, ?, ?)",
                (job_id, created_at, request, self.model, self.model_name),
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
