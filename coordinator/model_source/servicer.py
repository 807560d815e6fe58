"""The ModelSource gRPC service: the model's config and its layers, file by file, for
workers that fetch them. Reads happen on the gRPC handler threads (plain file reads, no
MLX), so several workers fetch at once while the engine keeps serving."""

from __future__ import annotations

import hashlib
import logging

import grpc

from common.model_config import ModelConfig
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.wire_frames import with_bytes
from coordinator.model_source.fetch_progress import FetchProgress
from coordinator.model_source.layer_files import LayerFiles

log = logging.getLogger(__name__)
MAX_LAYERS_PER_CALL = 4096


class ModelSourceServicer(pb_grpc.ModelSourceServicer):
    def __init__(
        self, config: ModelConfig, model_name: str, progress: FetchProgress
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.progress = progress
        self.config_json = (config.path / "config.json").read_bytes()
        self.files = LayerFiles(config.path, config.num_layers)

    def _check_layer(self, layer: int, context) -> None:
        if not 0 <= layer < self.config.num_layers:
            context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"layer {layer} is outside the model's {self.config.num_layers} layers "
                f"(0-{self.config.num_layers - 1})",
            )

    def LayerManifest(self, request: pb.LayerManifestRequest, context) -> pb.LayerManifestReply:
        if len(request.layers) > MAX_LAYERS_PER_CALL:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "too many layers in one call")
        for layer in [*request.layers, *request.with_sha256]:
            self._check_layer(layer, context)
        want_sha = set(request.with_sha256)
        reply = pb.LayerManifestReply(
            model_identity=self.config.identity,
            model_name=self.model_name,
            config_json=self.config_json,
        )
        for layer in dict.fromkeys(request.layers):
            lf = self.files[layer]
            sha = self.files.sha256(layer) if layer in want_sha else ""
            reply.files.add(layer=layer, name=lf.name, size=lf.size, sha256=sha)
        if request.fetch_bytes:
            self.progress.report(
                request.node_id, context.peer(), request.fetch_bytes, request.received_bytes
            )
            if not request.received_bytes:
                log.info(
                    "%s (%s) fetches %.1f MB of layers",
                    request.node_id or "a worker", context.peer(), request.fetch_bytes / 1e6,
                )  # fmt: skip
        return reply

    def FetchLayer(self, request: pb.FetchLayerRequest, context):
        self._check_layer(request.layer, context)
        size = self.files[request.layer].size
        if request.offset > size:
            context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"offset {request.offset} is past the end of layer {request.layer}'s file "
                f"({size} bytes)",
            )
        known = self.files.known_sha256(request.layer)
        if known is None and request.offset > 0:
            known = self.files.sha256(request.layer)  # a resumed fetch: hash the whole file
        digest = hashlib.sha256() if known is None else None
        for offset, data in self.files.chunks(request.layer, request.offset):
            if digest is not None:
                digest.update(data)
            self.progress.sent(len(data))
            yield with_bytes(pb.LayerChunk(offset=offset), "data", data)  # passed as is
        if digest is not None:
            known = digest.hexdigest()
            self.files.remember_sha256(request.layer, known)
        yield pb.LayerChunk(offset=size, sha256=known)
