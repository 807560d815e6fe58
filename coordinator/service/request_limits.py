"""How large one client request may be, in bytes: an HTTP body or a message to the
coordinator's gRPC port. The default follows from what a request can usefully hold, the
model's context in tokens, so that no request can take the machine's memory."""

from __future__ import annotations

# Generous: English averages about 4 bytes a token, JSON-escaped CJK text 6 to 12, a
# token id in a JSON list at most 7.
BYTES_PER_TOKEN = 32
# Besides the prompt: the fields, chat messages' envelopes, and tools or images later.
ROOM_BYTES = 1 << 20
# Below this even the workers' layer-fetch requests and health checks would not pass.
MIN_REQUEST_BYTES = 4096


def default_max_request_bytes(context: int) -> int:
    return context * BYTES_PER_TOKEN + ROOM_BYTES
