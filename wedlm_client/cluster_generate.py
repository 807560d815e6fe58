"""`wedlm generate --cluster`: the same flags as local generation, run on a coordinator."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from common.generation_params import GenerationParams
from wedlm_client.client import WedlmClient


def generate_on_cluster(
    client: WedlmClient, args: argparse.Namespace, params: GenerationParams, stream: TextIO | None
) -> dict[str, Any]:
    ids = list(args.prompt_ids) if args.prompt_ids else None
    final: dict[str, Any] = {}
    for event in client.generate_stream(args.prompt, ids, args.chat, params):
        if event[0] == "tokens" and stream is not None and event[2]:
            stream.write(event[2])
            stream.flush()
        elif event[0] == "final":
            final = event[1]
    return final
