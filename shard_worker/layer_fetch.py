"""Fetch the layers a worker is assigned from the coordinator's ModelSource into its
LayerCache: cached files are checked against the coordinator's checksums, partial ones
resumed, new ones written as `.part` and renamed once their checksum matches. Runs on the
gRPC handler thread of the Assign call, never on the MLX thread."""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from common.call_auth import call_metadata
from common.errors import WedlmError
from common.grpc_services import CHANNEL_OPTIONS
from common.layer_range import LayerRange
from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.tls import TlsConfig, open_channel
from shard_worker.layer_cache import LayerCache, sha256_file
from shard_worker.worker_terminal import WorkerTerminal

log = logging.getLogger(__name__)
SERVICE = "/wedlm.v1.ModelSource/"
# Layers fetched at once: one stream is bound by its writer thread (write, then hash), so
# two keep a many-core machine's network and disk busier (measured in RESULTS.md).
STREAMS = 2
MANIFEST_DEADLINE_S = 600.0  # the coordinator may hash a range of cached layers first


class FetchError(WedlmError):
    """The coordinator could not be reached or refused the fetch; `code` is its status."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        super().__init__(message)
        self.code = code


def _progress_bar(total: int, what: str):
    from tqdm import tqdm

    # disable=None: drawn only when stderr is a terminal (logs and tests stay clean)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
                disable=None, leave=False)  # fmt: skip


class LayerFetcher:
    def __init__(
        self,
        cache: LayerCache,
        secret: str | None,
        tls: TlsConfig | None,
        node_id: str,
        max_bytes_per_s: float | None = None,
        terminal: WorkerTerminal | None = None,
    ) -> None:
        self.cache = cache
        self.secret = secret
        self.tls = tls
        self.node_id = node_id
        self.max_bytes_per_s = max_bytes_per_s  # --fetch-limit-mbps: leave the network room
        self.terminal = terminal  # where the fetch's start and end are said (None: nowhere)

    def fetch(
        self, source: str, identity: str, layers: LayerRange, ahead: bool = False
    ) -> ModelConfig:
        """Make `layers` of model `identity` complete in the cache; return its config.
        `ahead`: before the re-plan that takes this worker in (its terminal says so)."""
        channel = open_channel(source, self.tls, CHANNEL_OPTIONS)
        try:
            stub = pb_grpc.ModelSourceStub(channel)
            return self._fetch(stub, source, identity, layers, ahead)
        finally:
            channel.close()

    def _call(self, source: str, identity: str, method: str, call, request, **kw):
        md = call_metadata(self.secret, SERVICE + method, identity)
        try:
            return call(request, metadata=md, **kw)
        except grpc.RpcError as e:
            raise FetchError(
                f"fetching layers from {source}: {e.code().name}: {e.details()}", e.code()
            ) from None

    def _fetch(
        self, stub, source: str, identity: str, layers: LayerRange, ahead: bool
    ) -> ModelConfig:
        cache = self.cache
        present = cache.cached_layers(identity)
        wanted = list(layers)
        request = pb.LayerManifestRequest(
            layers=wanted, with_sha256=[i for i in wanted if i in present], node_id=self.node_id
        )
        manifest = self._call(source, identity, "LayerManifest", stub.LayerManifest, request,
                              timeout=MANIFEST_DEADLINE_S)  # fmt: skip
        if manifest.model_identity != identity:
            raise FetchError(
                f"{source} serves model {manifest.model_identity}, not {identity}",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        config = cache.store_config(identity, manifest.config_json, manifest.model_name)
        files = {f.layer: f for f in manifest.files}
        todo = []
        for layer in wanted:
            path = present.get(layer)
            if path is not None:
                if cache.matches(path, files[layer].sha256):
                    continue
                log.warning("cached %s does not match its checksum: fetching it again", path)
                cache.drop_file(path)
            todo.append(layer)
        cache.touch(identity)
        name = manifest.model_name or identity
        if not todo:
            if self.terminal is not None:
                self.terminal.cached(layers, name)
            return config
        sizes = {i: files[i].size for i in wanted}
        partial = {i: self._part_size(identity, i, sizes[i]) for i in todo}
        need = sum(sizes[i] - partial[i] for i in todo)
        cache.make_room(identity, layers, sum(sizes.values()), need)
        log.info("fetching layers %s from %s: %.1f MB", layers, source, need / 1e6)
        if self.terminal is not None:
            self.terminal.fetching(layers, name, source, need, len(todo), ahead)
        started = time.monotonic()
        pace = _Pace(self.max_bytes_per_s)  # one budget for all streams
        with (
            _progress_bar(need, f"layers {layers}") as bar,
            _Progress(bar, need, lambda r: self._report(stub, source, identity, need, r)) as got,
            ThreadPoolExecutor(STREAMS, thread_name_prefix="fetch") as pool,
        ):
            fetches = [
                pool.submit(self._fetch_layer, stub, source, identity, i, sizes[i], got, pace)
                for i in todo
            ]
            for done in fetches:
                done.result()  # the first failure is raised (the others finish or fail too)
        cache.touch(identity)
        if self.terminal is not None:
            self.terminal.fetched(layers, name, need, time.monotonic() - started)
        return config

    def _report(self, stub, source: str, identity: str, total: int, received: int) -> None:
        """Tell the coordinator how far the fetch is (its `wedlm status` shows it)."""
        report = pb.LayerManifestRequest(
            node_id=self.node_id, fetch_bytes=total, received_bytes=received
        )
        self._call(source, identity, "LayerManifest", stub.LayerManifest, report, timeout=10)

    def _part_size(self, identity: str, layer: int, size: int) -> int:
        part = self.cache.part_path(identity, layer)
        if not part.exists():
            return 0
        have = part.stat().st_size
        if have > size:  # not a prefix of this file: start over
            part.unlink()
            return 0
        return have

    def _fetch_layer(self, stub, source, identity, layer: int, size: int, got, pace) -> None:
        part = self.cache.part_path(identity, layer)
        for attempt in range(2):  # a resumed file that fails its checksum is fetched whole
            offset = part.stat().st_size if part.exists() else 0
            digest = hashlib.sha256()
            if offset:
                sha256_file(part, digest)  # the bytes already here count toward the checksum
            expected = self._stream(stub, source, identity, layer, offset, part, digest, got, pace)
            if part.stat().st_size != size:
                raise FetchError(
                    f"layer {layer} from {source}: got {part.stat().st_size} of {size} bytes"
                )
            if digest.hexdigest() == expected:
                final = self.cache.layer_path(identity, layer)
                part.replace(final)
                self.cache.remember(final, expected)
                return
            log.warning("layer %d from %s failed its checksum (attempt %d)", layer, source,
                        attempt + 1)  # fmt: skip
            part.unlink()
        raise FetchError(f"layer {layer} from {source} failed its checksum twice",
                         grpc.StatusCode.DATA_LOSS)  # fmt: skip

    def _stream(self, stub, source, identity, layer, offset, part: Path, digest, got, pace) -> str:
        request = pb.FetchLayerRequest(layer=layer, offset=offset, node_id=self.node_id)
        chunks = self._call(source, identity, "FetchLayer", stub.FetchLayer, request)
        expected = ""
        if offset:
            log.info("resuming layer %d at byte %d of its file", layer, offset)
        try:
            with _PartWriter(part, digest) as out:
                for chunk in chunks:
                    if chunk.sha256:
                        expected = chunk.sha256
                        break
                    if chunk.offset != offset:
                        raise FetchError(
                            f"layer {layer}: a chunk at {chunk.offset}, expected {offset}"
                        )
                    data = chunk.data  # (each read of the field copies it)
                    out.put(data)
                    offset += len(data)
                    got.add(len(data))
                    pace.wait(len(data))
        except grpc.RpcError as e:
            raise FetchError(
                f"fetching layer {layer} from {source}: {e.code().name}: {e.details()}", e.code()
            ) from None
        if not expected:
            raise FetchError(f"layer {layer} from {source}: the stream ended without a checksum")
        return expected


class _PartWriter:
    """Appends chunks to a `.part` file and hashes them on a thread of its own, so that
    writing and hashing overlap receiving (both release the GIL). Whatever was received
    before an interruption is on disk: the next fetch resumes after it."""

    def __init__(self, path: Path, digest, depth: int = 8) -> None:
        self._out = open(path, "ab")  # noqa: SIM115 (closed by __exit__)
        self._digest = digest
        self._queue: queue.Queue = queue.Queue(maxsize=depth)  # bounds the memory in flight
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="layer-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                self._out.write(data)
                self._digest.update(data)
            except BaseException as e:  # raised on the receiving thread at close
                self._error = e

    def put(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def __enter__(self) -> _PartWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._queue.put(None)
        self._thread.join()
        self._out.close()
        if self._error is not None and exc[0] is None:
            raise self._error


class _Progress:
    """Bytes received by every stream: drawn on the progress bar, and reported to the
    coordinator when the fetch starts, about every `period_s` and when it ends."""

    def __init__(self, bar, total: int, report, period_s: float = 1.0) -> None:
        self.bar, self.total, self._report = bar, total, report
        self.received = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._send(0)
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.received += nbytes
            self.bar.update(nbytes)

    def _run(self, period_s: float) -> None:
        while not self._done.wait(period_s):
            self._send(self.received)

    def _send(self, received: int) -> None:
        try:
            self._report(received)
        except FetchError as e:  # the fetch itself reports a lost coordinator
            log.debug("progress report failed: %s", e)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        # the end: all of it, or (after a failure) what arrived, for the status to age out
        self._send(self.total if exc[0] is None else self.received)


class _Pace:
    """Sleeps so that the bytes taken (by every stream) stay under a rate (None: no limit)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self.started = time.monotonic()
        self.taken = 0
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self._lock:
            self.taken += nbytes
            taken = self.taken
        ahead = taken / self.rate - (time.monotonic() - self.started)
        if ahead > 0:
            time.sleep(ahead)
