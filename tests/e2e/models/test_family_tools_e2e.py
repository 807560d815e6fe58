"""Tool calls and reasoning of three new families, in their own formats, through every HTTP
API with the real clients (`openai` for chat completions and Responses, `anthropic` for
Messages, httpx for Ollama's plain HTTP), whole and streamed, against a real coordinator.

- GLM (glm4, GLM-4.7's template): its prompt opens `<think>`; the answer is reasoning,
  `</think>`, then `<tool_call>get_weather<arg_key>city</arg_key>...` (mlx-lm's glm47).
- gpt-oss (gpt_oss, harmony): the answer is a commentary message to functions.get_time
  (our harmony parser).
- MiniMax-M2 (minimax): reasoning after the prompt's `<think>`, then
  `<minimax:tool_call><invoke name="get_weather">...` (mlx-lm's minimax_m2).
Each checkpoint answers one fixed script (tests/support/family_tool_checkpoints.py), so the
parsed call (name and arguments) and the reasoning are asserted exactly; `tool_choice`
naming the function decodes the same call through the family's grammar."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.support.cluster_harness import http_coordinator
from tests.support.family_chat_templates import GLM47, GPT_OSS, MINIMAX_M2
from tests.support.family_tool_checkpoints import (
    GLM_PLAIN,
    GLM_REASONING,
    GLM_SCRIPT,
    GLM_SPECIAL,
    GLM_WORDS,
    HARMONY_SCRIPT,
    HARMONY_SPECIAL,
    HARMONY_WORDS,
    MINIMAX_PLAIN,
    MINIMAX_SCRIPT,
    MINIMAX_SPECIAL,
    MINIMAX_WORDS,
    scripted_checkpoint,
)

WEATHER = {"name": "get_weather", "description": "The weather in a city now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                          "enum": ["Paris"]}}, "required": ["city"]}}  # fmt: skip
TIME = {
    "name": "get_time",
    "description": "The time now",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}
# family -> (checkpoint recipe, its tool, the call's arguments, its reasoning)
FAMILIES = {
    "glm": (("glm4", GLM47, GLM_SPECIAL, GLM_PLAIN + GLM_WORDS, "<think>", GLM_SCRIPT),
            WEATHER, {"city": "Paris"}, GLM_REASONING),
    "gpt_oss": (("gpt_oss", GPT_OSS, HARMONY_SPECIAL, HARMONY_WORDS, "assistant",
                 HARMONY_SCRIPT), TIME, {}, ""),
    "minimax": (("minimax", MINIMAX_M2, MINIMAX_SPECIAL, MINIMAX_PLAIN + MINIMAX_WORDS,
                 "<think>\n", MINIMAX_SCRIPT), WEATHER, {"city": "Paris"}, GLM_REASONING),
}  # fmt: skip
ASK = [{"role": "user", "content": "what is the weather in Paris now?"}]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    recipe, tool, arguments, reasoning = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = scripted_checkpoint(folder, *recipe, max_position_embeddings=4096)
    with http_coordinator(model) as coord:
        base = coord.http.removesuffix("/v1")
        fmt = {"glm": "glm47", "gpt_oss": "harmony", "minimax": "minimax_m2"}[request.param]
        yield {"http": coord.http, "base": base, "model": model.name, "tool": tool,
               "arguments": arguments, "reasoning": reasoning, "format": fmt}  # fmt: skip


def _openai(served):
    return openai.OpenAI(base_url=served["http"], api_key="x", max_retries=0, timeout=120)


def _reasoning(obj) -> str:
    return (obj.model_extra or {}).get("reasoning_content") or ""


def test_chat_completions_whole_streamed_and_forced(served):
    tools = [{"type": "function", "function": served["tool"]}]
    name = served["tool"]["name"]
    with _openai(served) as client:
        whole = client.chat.completions.create(model=served["model"], messages=ASK,
                                               tools=tools, max_tokens=64)  # fmt: skip
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == name
        assert json.loads(call.function.arguments) == served["arguments"]
        assert _reasoning(choice.message) == served["reasoning"] and not choice.message.content
        reasoning, calls, finish = "", [], None
        args = {"model": served["model"], "messages": ASK, "tools": tools, "max_tokens": 64}
        for chunk in client.chat.completions.create(**args, stream=True):
            delta = chunk.choices[0].delta
            reasoning += _reasoning(delta)
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert reasoning == served["reasoning"] and finish == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (name, served["arguments"])
        ]
        # streamed logprobs: those of the whole answer, though the parser holds text back
        tokens = []
        for chunk in client.chat.completions.create(**args, stream=True, logprobs=True):
            for c in chunk.choices:
                tokens += [e.token for e in (c.logprobs.content or ())] if c.logprobs else []
        scored = client.chat.completions.create(**args, logprobs=True).choices[0].logprobs
        # (a stream carries no entry for the stop token, whose text is empty: generation.py)
        assert tokens == [e.token for e in scored.content][:-1] and len(tokens) >= 10
        # tool_choice naming the function: the family's grammar allows only its call
        forced = client.chat.completions.create(
            model=served["model"], messages=ASK, tools=tools, max_tokens=64,
            tool_choice={"type": "function", "function": {"name": name}})  # fmt: skip
        card = client.models.retrieve(served["model"]).model_extra
        assert card["tool_call_format"] == served["format"] and card["reasoning"]
        [call] = forced.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            name, served["arguments"])  # fmt: skip


def test_anthropic_messages_whole_and_streamed(served):
    tool = {"name": served["tool"]["name"], "description": served["tool"]["description"],
            "input_schema": served["tool"]["parameters"]}  # fmt: skip
    client = anthropic.Anthropic(base_url=served["base"], api_key="x", max_retries=0)
    args = {"model": served["model"], "max_tokens": 64, "tools": [tool], "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 32}}  # fmt: skip
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        kinds = [b.type for b in message.content]
        expected = (["thinking"] if served["reasoning"] else []) + ["tool_use"]
        assert kinds == expected, kinds
        if served["reasoning"]:
            assert message.content[0].thinking == served["reasoning"]
        use = message.content[-1]
        assert (use.name, use.input) == (tool["name"], served["arguments"])
    # the next turn sends the answer back (thinking block included) with the tool's result
    turn = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "sunny, 21 degrees"}]}]  # fmt: skip
    again = client.messages.create(**{**args, "messages": turn})
    assert again.usage.input_tokens > whole.usage.input_tokens + 4  # the result is in


def test_ollama_chat_whole_and_streamed(served):
    tools = [{"type": "function", "function": served["tool"]}]
    # think: this model writes its reasoning apart, so it is accepted
    body = {"model": served["model"], "messages": ASK, "tools": tools, "think": True,
            "options": {"num_predict": 64}}  # fmt: skip
    whole = httpx.post(f"{served['base']}/api/chat", json={**body, "stream": False},
                       timeout=120).json()  # fmt: skip
    message = whole["message"]
    assert message.get("thinking", "") == served["reasoning"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] \
        == [(served["tool"]["name"], served["arguments"])]  # fmt: skip
    thinking, calls = "", []
    with httpx.stream("POST", f"{served['base']}/api/chat", json={**body, "stream": True},
                      timeout=120) as lines:  # fmt: skip
        for line in lines.iter_lines():
            part = json.loads(line)["message"]
            thinking += part.get("thinking", "")
            calls += part.get("tool_calls") or []
    assert thinking == served["reasoning"]
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]


def test_responses_function_tools(served):
    tool = {"type": "function", **served["tool"]}
    name = served["tool"]["name"]
    with _openai(served) as client:
        whole = client.responses.create(model=served["model"], input=ASK, tools=[tool],
                                        max_output_tokens=64)  # fmt: skip
        kinds = [item.type for item in whole.output]
        assert kinds == (["reasoning"] if served["reasoning"] else []) + ["function_call"]
        call = whole.output[-1]
        assert (call.name, json.loads(call.arguments)) == (name, served["arguments"])
        if served["reasoning"]:
            assert whole.output[0].content[0].text == served["reasoning"]
        events = list(client.responses.create(model=served["model"], input=ASK, tools=[tool],
                                              max_output_tokens=64, stream=True))  # fmt: skip
        assert [e.sequence_number for e in events] == list(range(len(events)))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [json.loads(e.arguments) for e in done] == [served["arguments"]]
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == kinds
        assert [i.type for i in events[-1].response.output] == kinds
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning == served["reasoning"]
        # the next turn: the call and its output as input items, rendered by the template
        turn = [*ASK, {"type": "function_call", "call_id": call.call_id, "name": name,
                       "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id,
                 "output": "sunny, 21 degrees"}]  # fmt: skip
        second = client.responses.create(model=served["model"], input=turn, tools=[tool],
                                         max_output_tokens=64)  # fmt: skip
        assert second.status == "completed"
        assert second.usage.input_tokens > whole.usage.input_tokens + 4  # the result is in
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=served["model"], input=ASK,
                                    previous_response_id=whole.id)  # fmt: skip
        assert err.value.body["param"] == "previous_response_id"
        choice = {"type": "function", "name": name}
        forced = client.responses.create(model=served["model"], input=ASK, tools=[tool],
                                         max_output_tokens=64, tool_choice=choice)  # fmt: skip
        assert (forced.output[-1].name, json.loads(forced.output[-1].arguments)) == (
            name, served["arguments"])  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=served["model"], input=ASK,
                                    tools=[{"type": "web_search"}])  # fmt: skip
        assert err.value.body["param"] == "tools[0].type"
