"""An agent's session turn after turn hits the prefix cache in each API and says so in that
API's own usage field: Anthropic Messages with tool_use / tool_result blocks through the
`anthropic` package (`cache_read_input_tokens`), Responses with function_call /
function_call_output items and chat completions with tools through the `openai` package
(`cached_tokens`). The assistant turns are given as history (as an agent replays them), so
each turn's prompt re-renders the last answer differently from the tokens generated; the
cache still serves every row before the first token that differs, and the greedy text of
every turn equals the same session on a coordinator started with `--no-prefix-cache`."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.support.checkpoints import TOOL_CHAT_TEMPLATE
from tests.support.cluster_harness import http_coordinator

pytestmark = pytest.mark.e2e

KEY = "agent-key"
SYSTEM = "{api}: you are a weather agent."  # each API's session starts cold
TAIL = 2  # tokens at the end of a turn's prompt a re-render may change (none seen so far)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
STEPS = [  # (what the assistant said last, the user's next turn), as plain data
    (None, "What is the weather in Paris?"),
    (("Checking.", "call_1", "Paris"), "sunny, 21 C"),
    (("Sunny in Paris.", None, None), "And in Rome?"),
    ((None, "call_2", "Rome"), "rain, 14 C"),
]


@pytest.fixture(scope="module")
def servers(checkpoint_dir) -> Iterator[dict[str, dict]]:
    model = checkpoint_dir("qwen2", seed=5, chat_template=TOOL_CHAT_TEMPLATE,
                           max_position_embeddings=2048)  # fmt: skip
    with (
        http_coordinator(model, "--api-key", KEY, "--metrics-port", "0") as on,
        http_coordinator(model, "--api-key", KEY, "--no-prefix-cache") as off,
    ):
        yield {name: {"http": c.http, "root": c.root, "model": model.name, "log": c.proc.log}
               for name, c in (("on", on), ("off", off))}  # fmt: skip


Turn = tuple[str, int, int]  # the answer's text, its prompt tokens, those read from cache


def _check_session(run: Callable[[dict], list[Turn]], servers: dict) -> list[Turn]:
    """The cache-on session's turns: the first reads nothing (its system prompt is its
    own), each later one at least the previous prompt (less TAIL) from the cache, and
    every text equals the cache-off session's, which reads nothing."""
    on, off = run(servers["on"]), run(servers["off"])
    assert on[0][2] == 0, on
    assert [t[0] for t in on] == [t[0] for t in off]
    assert [t[1] for t in on] == [t[1] for t in off]  # the same prompts
    assert all(t[2] == 0 for t in off), off
    for (_, prompt, cached), (_, next_prompt, next_cached) in itertools.pairwise(on):
        assert next_prompt > prompt and next_cached > cached, on
        assert prompt - TAIL <= next_cached < next_prompt, on
    return on


# ---------------------------------------------------------------- Anthropic Messages


def _anthropic_history(upto: int) -> list[dict]:
    messages: list[dict] = []
    for said, user in STEPS[: upto + 1]:
        if said is not None:
            text, call_id, city = said
            blocks = [{"type": "text", "text": text}] if text else []
            if call_id:
                blocks.append({"type": "tool_use", "id": call_id, "name": "get_weather",
                               "input": {"city": city}})  # fmt: skip
            messages.append({"role": "assistant", "content": blocks})
        if said is not None and said[1]:  # the user's turn answers the call
            content = [{"type": "tool_result", "tool_use_id": said[1], "content": user}]
        else:
            content = [{"type": "text", "text": user}]
        messages.append({"role": "user", "content": content})
    return messages


def _anthropic_session(server: dict) -> list[Turn]:
    tools = [{"name": "get_weather", "description": "The weather of a city",
              "input_schema": SCHEMA}]  # fmt: skip
    turns = []
    with anthropic.Anthropic(base_url=server["root"], api_key=KEY, max_retries=0,
                             timeout=120) as client:  # fmt: skip
        for k in range(len(STEPS)):
            args = {
                "model": server["model"],
                "system": SYSTEM.format(api="anthropic"),
                "tools": tools,
                "messages": _anthropic_history(k),
                "max_tokens": 6,
                "extra_body": {"temperature": 0},
            }  # not an argument in 2.x; fmt: skip
            if k == len(STEPS) - 1:  # the last turn streamed: message_delta's usage
                with client.messages.stream(**args) as stream:
                    answer = stream.get_final_message()
            else:
                answer = client.messages.create(**args)
            use = answer.usage
            assert use.cache_creation_input_tokens == 0
            text = "".join(b.text for b in answer.content if b.type == "text")
            prompt = use.input_tokens + use.cache_read_input_tokens
            turns.append((text, prompt, use.cache_read_input_tokens))
    return turns


def test_anthropic_tool_turns_read_the_cache(servers):
    on = _check_session(_anthropic_session, servers)
    assert on[-1][2] >= 0.5 * on[-1][1], on  # most of the last prompt came from the cache


# ---------------------------------------------------------------- OpenAI Responses / chat


def _responses_input(upto: int) -> list[dict]:
    items: list[dict] = []
    for said, user in STEPS[: upto + 1]:
        if said is not None:
            text, call_id, city = said
            if text:
                items.append({"role": "assistant",
                              "content": [{"type": "output_text", "text": text}]})  # fmt: skip
            if call_id:
                arguments = f'{{"city": "{city}"}}'
                items.append({"type": "function_call", "call_id": call_id,
                              "name": "get_weather", "arguments": arguments})  # fmt: skip
                items.append({"type": "function_call_output", "call_id": call_id,
                              "output": user})  # fmt: skip
                continue
        items.append({"role": "user", "content": user})
    return items


def _responses_session(server: dict) -> list[Turn]:
    tools = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
              "parameters": SCHEMA}]  # fmt: skip
    turns = []
    with openai.OpenAI(base_url=server["http"], api_key=KEY, max_retries=0,
                       timeout=120) as client:  # fmt: skip
        for k in range(len(STEPS)):
            answer = client.responses.create(
                model=server["model"], instructions=SYSTEM.format(api="responses"),
                tools=tools, temperature=0, input=_responses_input(k), max_output_tokens=6,
            )  # fmt: skip
            use = answer.usage
            turns.append((answer.output_text, use.input_tokens,
                          use.input_tokens_details.cached_tokens))  # fmt: skip
    return turns


def _chat_messages(upto: int, api: str = "chat") -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": SYSTEM.format(api=api)}]
    for said, user in STEPS[: upto + 1]:
        if said is not None:
            text, call_id, city = said
            message: dict = {"role": "assistant", "content": text}
            if call_id:
                message["tool_calls"] = [{"id": call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}]  # fmt: skip
            messages.append(message)
            if call_id:
                messages.append({"role": "tool", "tool_call_id": call_id, "content": user})
                continue
        messages.append({"role": "user", "content": user})
    return messages


CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather",
               "description": "The weather of a city", "parameters": SCHEMA}}]  # fmt: skip


def _chat_turn(client: openai.OpenAI, server: dict, messages: list[dict]) -> Turn:
    answer = client.chat.completions.create(
        model=server["model"], messages=messages, tools=CHAT_TOOLS, temperature=0, max_tokens=6
    )
    use = answer.usage
    return (answer.choices[0].message.content or "", use.prompt_tokens,
            use.prompt_tokens_details.cached_tokens)  # fmt: skip


def _chat_session(server: dict, api: str = "chat") -> list[Turn]:
    with openai.OpenAI(base_url=server["http"], api_key=KEY, max_retries=0,
                       timeout=120) as client:  # fmt: skip
        return [_chat_turn(client, server, _chat_messages(k, api)) for k in range(len(STEPS))]


@pytest.mark.parametrize("session", [_responses_session, _chat_session],
                         ids=["responses", "chat"])  # fmt: skip
def test_openai_tool_turns_read_the_cache(servers, session):
    on = _check_session(session, servers)
    assert on[-1][2] >= 0.5 * on[-1][1], on


# ---------------------------------------------------------------- Ollama /api/chat


def _hit_tokens(server: dict) -> int:
    """The coordinator's prefix_cache_hit_tokens counter; 0 where it serves no metrics."""
    found = [m for line in server["log"] if (m := re.search(r"metrics on (http://\S+)", line))]
    if not found:
        return 0
    text = httpx.get(found[0].group(1), timeout=30).text
    return int(float(re.search(r"^wedlm:prefix_cache_hit_tokens_total (\S+)$", text, re.M)[1]))


def _ollama_session(server: dict) -> list[Turn]:
    client = ollama.Client(host=server["root"], headers={"Authorization": f"Bearer {KEY}"},
                           timeout=120)  # fmt: skip
    turns = []
    for k in range(len(STEPS)):
        messages = _chat_messages(k)
        messages[0]["content"] = SYSTEM.format(api="ollama")
        for m in messages:  # Ollama's calls carry their arguments as an object, no ids
            for call in m.get("tool_calls", ()):
                del call["id"], call["type"]
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        before = _hit_tokens(server)
        options = {"temperature": 0, "num_predict": 6}
        answer = client.chat(model=server["model"], messages=messages, tools=CHAT_TOOLS,
                             stream=False, options=options)  # fmt: skip
        turns.append((answer.message.content, answer.prompt_eval_count,
                      _hit_tokens(server) - before))  # fmt: skip
    return turns


def test_ollama_tool_turns_read_the_cache(servers):
    on = _check_session(_ollama_session, servers)
    assert on[-1][2] >= 0.5 * on[-1][1], on


# ---------------------------------------------------------------- an earlier turn re-rendered


def _tokens(server: dict, messages: list[dict]) -> list[int]:
    body = {"model": server["model"], "messages": messages, "tools": CHAT_TOOLS}
    got = httpx.post(f"{server['root']}/tokenize", json=body, timeout=60,
                     headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert got.status_code == 200, got.text
    return got.json()["tokens"]


def test_a_changed_earlier_turn_still_reads_up_to_the_change(servers):
    """The client drops an early assistant text (as templates drop old reasoning): the next
    turn reads every row before the first differing token, not nothing."""
    on, off = servers["on"], servers["off"]
    _chat_session(on, api="rerender")
    last = _chat_messages(len(STEPS) - 1, api="rerender")
    changed = [dict(m) for m in last]
    changed[2]["content"] = ""  # "Checking." gone from the first assistant turn
    changed += [{"role": "assistant", "content": "Rain in Rome."},
                {"role": "user", "content": "Thanks."}]  # fmt: skip
    was, now = _tokens(on, last), _tokens(on, changed)
    agree = next(i for i, (a, b) in enumerate(zip(was, now, strict=False)) if a != b)
    assert 16 <= agree < len(was) - 50, (agree, len(was))  # the change is early
    with (
        openai.OpenAI(base_url=on["http"], api_key=KEY, max_retries=0, timeout=120) as a,
        openai.OpenAI(base_url=off["http"], api_key=KEY, max_retries=0, timeout=120) as b,
    ):
        hit, cold = _chat_turn(a, on, changed), _chat_turn(b, off, changed)
    assert hit[0] == cold[0] and hit[1] == cold[1] == len(now)
    # the first answer's generated tokens may agree a few more before differing
    assert agree <= hit[2] <= agree + 6, (agree, hit)
