"""One streamed gRPC request of a closed loop, recorded into a Rec: the time and token
count of each commit event, the final record, or the refusal's status."""

from __future__ import annotations

from benchmarks.serve_mlxlm import Rec, now
from common.generation_params import GenerationParams
from wedlm_client.client import ClusterError, WedlmClient, final_dict


def stream_request(client: WedlmClient, text: str, params: GenerationParams, rec: Rec) -> bool:
    """Fills `rec` (not its end time); False when the coordinator refused the request."""
    try:
        for event in client.generate_stream(text=text, params=params):
            if event[0] == "tokens":
                rec.events.append((now(), len(event[1])))
            else:
                rec.final = event[1]
                rec.error = "FINAL_ERROR" if event[1].get("error") else None
    except ClusterError as e:
        rec.error = e.code.name
        return False
    return True


def wait_request(client: WedlmClient, text: str, params: GenerationParams, rec: Rec) -> bool:
    """The same request without a stream: Submit, then WaitJob until it ends (the
    coordinator wakes no thread of this request per commit). Its tokens count as one
    event at the end."""
    try:
        job_id = client.submit(text=text, params=params)
        while True:
            job = client.wait_job(job_id, timeout_s=30.0)
            if job.HasField("result"):
                break
    except ClusterError as e:
        rec.error = e.code.name
        return False
    final = final_dict(job.result)
    rec.events.append((now(), len(final["tokens"])))
    rec.final = final
    rec.error = "FINAL_ERROR" if final.get("error") else None
    return True
