"""The Python client of a wedlm-cluster coordinator. It needs grpcio and protobuf only
(no MLX): `pip install "wedlm-cluster[client]"` on any machine that reaches the cluster.

    from wedlm_client import GenerationParams, WedlmClient

    with WedlmClient("mac-studio.local:50051", api_key="...") as client:
        for event in client.generate_stream(text="Hello", params=GenerationParams(mode="ar")):
            ...  # ("tokens", ids, text) as they commit, then ("final", result dict)
        job_id = client.submit(text="A long essay", chat=True)
        record = client.wait_job(job_id)  # a pb.Job; its result once finished
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from common.env_switches import API_KEY
from common.errors import WedlmError
from common.generation_params import GenerationParams
from common.proto_gen import wedlm_pb2 as pb
from common.proto_gen import wedlm_pb2_grpc as pb_grpc
from common.tls import TlsConfig, open_channel
from wedlm_client.port_hint import answered_http1, http_port_hint
from wedlm_client.request_building import request_from_params


class ClusterError(WedlmError):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


def final_dict(final: pb.Final) -> dict[str, Any]:
    stats = final.stats
    record = {
        "tokens": list(final.tokens),
        "text": final.text,
        "finish_reason": final.finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "forwards": stats.forwards,
        "tokens_per_forward": stats.tokens_per_forward,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "decode_tokens_per_s": (len(final.tokens) / stats.decode_s) if stats.decode_s else None,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_drafts": stats.accepted_drafts,
        "cached_tokens": stats.cached_tokens,
        "mode": stats.mode,
    }
    if stats.warning:
        record["warning"] = stats.warning
    if final.logprobs:  # the request asked for them: one per token
        record["logprobs"] = [
            {"id": e.id, "logprob": e.logprob, "top": [(t.id, t.logprob) for t in e.top]}
            for e in final.logprobs
        ]
    if final.error:
        record["error"] = final.error
        if final.error_kind:
            record["error_kind"] = final.error_kind
    return record


class WedlmClient:
    def __init__(
        self,
        address: str,
        timeout: float = 600.0,
        tls: TlsConfig | None = None,
        api_key: str | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.channel = open_channel(address, tls)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        key = api_key if api_key is not None else API_KEY.read()
        self.api_key = key
        self.metadata = (("authorization", f"Bearer {key}"),) if key else None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> WedlmClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, request, timeout: float | None = None):
        try:
            return getattr(self.stub, method)(
                request, timeout=timeout or self.timeout, metadata=self.metadata
            )
        except grpc.RpcError as e:
            raise self._error(e) from None

    def _error(self, e: grpc.RpcError) -> ClusterError:
        """The error of a failed call; every call's failures pass here, so that a gRPC
        call to an HTTP port says which port to use instead of gRPC's HTTP/2 parse error."""
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE and answered_http1(details):
            details = http_port_hint(self.address, self.api_key) or details
        return ClusterError(code, details)

    def generate_stream(
        self,
        text: str | None = None,
        ids: list[int] | None = None,
        chat: bool = False,
        params: GenerationParams | None = None,
        output_format: pb.OutputFormat | None = None,
    ) -> Iterator[tuple]:
        """("tokens", ids, text) events, then ("final", final_dict); `output_format`: what
        the output must match (pb.OutputFormat(json_schema=...), regex, lark)."""
        req = request_from_params(
            params or GenerationParams(), text, ids, chat, output_format=output_format
        )
        try:
            for event in self.stub.Generate(req, timeout=self.timeout, metadata=self.metadata):
                if event.WhichOneof("event") == "tokens":
                    yield ("tokens", list(event.tokens.ids), event.tokens.text)
                else:
                    yield ("final", final_dict(event.final))
        except grpc.RpcError as e:
            raise self._error(e) from None

    def generate(
        self, text=None, ids=None, chat=False, params=None, output_format=None
    ) -> dict[str, Any]:
        final = None
        for event in self.generate_stream(text, ids, chat, params, output_format):
            if event[0] == "final":
                final = event[1]
        if final is None:
            raise ClusterError(grpc.StatusCode.UNKNOWN, "the stream ended without a result")
        return final

    def submit(
        self, text=None, ids=None, chat=False, params=None, deadline_s=0.0, output_format=None
    ) -> str:
        """Queue a job and return its id at once; the cluster keeps its result."""
        req = request_from_params(
            params or GenerationParams(), text, ids, chat, deadline_s, output_format
        )
        return self._call("Submit", req).job_id

    def get_job(self, job_id: str) -> pb.Job:
        return self._call("GetJob", pb.JobRef(job_id=job_id))

    def wait_job(self, job_id: str, timeout_s: float = 0.0) -> pb.Job:
        limit = (timeout_s + 5.0) if timeout_s else self.timeout
        return self._call("WaitJob", pb.WaitJobRequest(job_id=job_id, timeout_s=timeout_s), limit)

    def cancel_job(self, job_id: str) -> pb.Job:
        return self._call("CancelJob", pb.JobRef(job_id=job_id))

    def cluster_status(self) -> pb.ClusterStatusReply:
        return self._call("ClusterStatus", pb.ClusterStatusRequest(), 10.0)

    def model_info(self) -> pb.ModelInfoReply:
        return self._call("ModelInfo", pb.ModelInfoRequest(), 10.0)

    def status_dict(self) -> dict[str, Any]:
        return MessageToDict(self.cluster_status(), preserving_proto_field_name=True)


def job_dict(job: pb.Job) -> dict[str, Any]:
    """A job as plain data (its result, once finished, as `final_dict` gives it)."""
    record: dict[str, Any] = {
        "job_id": job.job_id,
        "state": job.state,
        "committed_tokens": job.committed_tokens,
        "created_at": job.created_at,
    }
    if job.HasField("result"):
        record["result"] = final_dict(job.result)
    return record
