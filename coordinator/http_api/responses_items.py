"""The output items of a Responses answer (`reasoning`, `message`, `function_call`), whole
and as their stream of typed events: an item is added when its first piece arrives, its
deltas follow (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`), and it is done before the next one opens."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from coordinator.http_api.reply_parsing import Reasoning

Event = Callable[..., str]  # event(kind, **fields) -> one SSE event


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [part]}  # fmt: skip


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """An OpenAI chat tool call as a function_call item (its call id kept)."""
    function = call["function"]
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"]}  # fmt: skip


def output_items(
    message_id: str, content: str, reasoning: str, calls: list, status: str
) -> list[dict[str, Any]]:
    """A whole answer's items: its reasoning, its text (also when it is empty and there
    are no calls), its calls."""
    items = [reasoning_item(_id("rs"), reasoning)] if reasoning else []
    if content or not calls:
        items.append(message_item(message_id, content, status))
    return items + [call_item(_id("fc"), c, "completed") for c in calls]


class ItemStream:
    """Pieces of a streamed answer (text, Reasoning, a call list) → events; `items`: the
    done items so far, in order."""

    def __init__(self, event: Event, message_id: str) -> None:
        self.event, self.message_id = event, message_id
        self.items: list[dict[str, Any]] = []
        self.kind, self.text = "", ""  # the open item's type and its text so far
        self.item_id = ""

    def where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.items), "content_index": 0}

    def add(self, pieces: list) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            if isinstance(piece, list):
                out += self.close()
                out += [e for call in piece for e in self._call(call)]
                continue
            kind = "reasoning" if isinstance(piece, Reasoning) else "message"
            if kind != self.kind:
                out += self.close()
                out += self._open(kind)
            self.text += piece
            delta = "response.reasoning_text.delta" if kind == "reasoning" else \
                "response.output_text.delta"  # fmt: skip
            extra = {} if kind == "reasoning" else {"logprobs": []}
            out.append(self.event(delta, **self.where(), delta=str(piece), **extra))
        return out

    def _open(self, kind: str) -> list[str]:
        self.kind, self.text = kind, ""
        if kind == "reasoning":
            self.item_id = _id("rs")
            item = {**reasoning_item(self.item_id, ""), "content": []}
            return [self.event("response.output_item.added", output_index=len(self.items),
                               item=item)]  # fmt: skip
        self.item_id = self.message_id
        empty = message_item(self.item_id, "", "in_progress")
        return [
            self.event("response.output_item.added", output_index=len(self.items),
                       item={**empty, "content": []}),
            self.event("response.content_part.added", **self.where(), part=empty["content"][0]),
        ]  # fmt: skip

    def close(self, status: str = "completed") -> list[str]:
        """Ends the open text or reasoning item, if any."""
        if not self.kind:
            return []
        kind, self.kind = self.kind, ""
        if kind == "reasoning":
            item = reasoning_item(self.item_id, self.text)
            out = [self.event("response.reasoning_text.done", **self.where(), text=self.text)]
        else:
            item = message_item(self.item_id, self.text, status)
            out = [self.event("response.output_text.done", **self.where(), text=self.text,
                              logprobs=[]),
                   self.event("response.content_part.done", **self.where(),
                              part=item["content"][0])]  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=len(self.items),
                              item=item))  # fmt: skip
        self.items.append(item)
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        self.item_id = _id("fc")
        item = call_item(self.item_id, call, "completed")
        where = {"item_id": self.item_id, "output_index": len(self.items)}
        arguments = item["arguments"]
        out = [
            self.event("response.output_item.added", output_index=len(self.items),
                       item={**item, "arguments": "", "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", **where, delta=arguments),
            self.event("response.function_call_arguments.done", **where, name=item["name"],
                       arguments=arguments),
            self.event("response.output_item.done", output_index=len(self.items), item=item),
        ]  # fmt: skip
        self.items.append(item)
        return out

    def finish(self, status: str) -> list[str]:
        """The end: an answer with no item at all is one empty message."""
        out = self.close(status)
        if not self.items:
            out += self._open("message") + self.close(status)
        return out
