"""One streamed gRPC request of a closed loop, recorded into a Rec: the time and token
count of each commit event, the final record, or the refusal's status."""

from __future__ import annotations

from benchmarks.serve_mlxlm import Rec, now
from common.generation_params import GenerationParams
from wedlm_client.client import ClusterError, WedlmClient


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
