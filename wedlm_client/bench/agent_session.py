"""The synthetic agent session `wedlm bench agent` replays: a system prompt and tool list of
about N tokens, then turns that each add a user message, the assistant's tool call and a
tool result of a seeded length. Everything comes from one seed, so two runs with the same
flags send the same text; lengths are in the target server's tokens when its /tokenize
answers (our server's and vLLM's), else estimated from characters."""

from __future__ import annotations

import json
import random
import urllib.request
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4.0  # the usual estimate for English and code when nothing can count
MESSAGE_OVERHEAD = 8  # tokens a chat template adds around one message (role, markers)
_WORD_TEXT = (
    "the a of to in is for on with as by at from that this it be are was or and not "
    "function class method return value error file path line test module import config "
    "server client request response cache token prompt model layer batch stream buffer "
    "index table query update delete insert select parse render build deploy commit branch "
    "merge review check assert expect result output input default option flag setting "
    "handler router session user account payment order invoice report metric latency "
    "timeout retry queue worker thread process memory disk network socket header body "
    "json yaml schema field type string integer float list dict map set key hash length "
    "count total offset limit page cursor filter sort group join split format encode "
    "decode read write open close start stop run wait send receive load save fetch push"
)
WORDS = tuple(_WORD_TEXT.split())  # what the synthetic text is made of
TOOLS = (
    ("read_file", "Read a file of the repository and return its text with line numbers.",
     {"path": "string"}),
    ("write_file", "Replace a file's text with new text; creates folders as needed.",
     {"path": "string", "text": "string"}),
    ("run_command", "Run a shell command in the repository root and return its output.",
     {"command": "string", "timeout_s": "integer"}),
    ("search_code", "Search the repository for a regular expression; returns matching lines.",
     {"pattern": "string", "glob": "string"}),
    ("list_files", "List the files under a folder, recursively, with their sizes.",
     {"folder": "string"}),
    ("apply_patch", "Apply a unified diff to the working tree and report the hunks applied.",
     {"patch": "string"}),
)  # fmt: skip


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema

    def as_json(self) -> str:
        return json.dumps({"name": self.name, "description": self.description,
                           "parameters": self.parameters})  # fmt: skip


@dataclass(frozen=True)
class Turn:
    """What one turn adds: the user's message, the assistant's call, the tool's result."""

    user: str
    call_id: str
    tool: str
    arguments: dict
    result: str
    tokens: int  # what the three add, estimated (the server's usage says what it counted)


@dataclass
class Session:
    system: str
    tools: list[Tool]
    turns: list[Turn] = field(default_factory=list)
    system_tokens: int = 0  # system prompt and tools, estimated
    counted_by: str = "estimate"  # or the /tokenize URL that sized the text
    stopped_by_budget: bool = False


class TokenCounter:
    """Counts tokens with the server's /tokenize (our server's and vLLM's form) when it
    answers, else estimates them from the text's length."""

    def __init__(self, root_url: str | None, api_key: str | None, timeout: float = 30.0):
        self.url = f"{root_url}/tokenize" if root_url else None
        self.api_key, self.timeout = api_key, timeout
        if self.url is not None and self._tokenize("probe") is None:
            self.url = None  # not there, or not this form: estimate from here on

    def _tokenize(self, text: str) -> int | None:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = json.dumps({"prompt": text}).encode()
        request = urllib.request.Request(self.url, body, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                count = json.loads(r.read()).get("count")
        except (OSError, ValueError, AttributeError):
            return None
        return count if isinstance(count, int) and count > 0 else None

    def count(self, text: str) -> int:
        if self.url is not None and (n := self._tokenize(text)) is not None:
            return n
        return max(1, round(len(text) / CHARS_PER_TOKEN))


def _words(rng: random.Random, n: int, per_line: int = 0) -> str:
    words = [rng.choice(WORDS) for _ in range(max(n, 1))]
    if not per_line:
        return " ".join(words)
    lines = [" ".join(words[i : i + per_line]) for i in range(0, len(words), per_line)]
    return "\n".join(lines)


def _tools(counter: TokenCounter, most_tokens: int) -> tuple[list[Tool], int]:
    """The tools, in order, as many as fit in `most_tokens` (one at least), and their
    tokens: a small session still has room for its system prompt."""
    tools: list[Tool] = []
    tokens = 0
    for name, text, params in TOOLS:
        tool = Tool(name, text, {"type": "object",
                                 "properties": {k: {"type": v} for k, v in params.items()},
                                 "required": list(params)})  # fmt: skip
        more = counter.count("\n".join(t.as_json() for t in [*tools, tool]))
        if tools and more > most_tokens:
            break
        tools, tokens = [*tools, tool], more
    return tools, tokens


def _call(rng: random.Random, k: int, tools: list[Tool]) -> tuple[str, dict]:
    """A call of one of the tools with plausible JSON arguments."""
    path = f"src/{rng.choice(WORDS)}_{k}/{rng.choice(WORDS)}.py"
    name = tools[k % len(tools)].name
    arguments = {"read_file": {"path": path}, "write_file": {"path": path, "text": _words(rng, 6)},
                 "run_command": {"command": f"pytest -q {path}", "timeout_s": 120},
                 "search_code": {"pattern": f"def {rng.choice(WORDS)}_", "glob": "*.py"},
                 "list_files": {"folder": path.rsplit("/", 1)[0]},
                 "apply_patch": {"patch": f"--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n"}}
    return name, arguments[name]  # fmt: skip


def build_session(
    counter: TokenCounter,
    system_tokens: int,
    turns: int,
    result_tokens: tuple[int, int],
    budget_tokens: int,
    seed: int,
) -> Session:
    """The session: the tools (at most half of `system_tokens`) and a system prompt padded
    so that both come to `system_tokens`, then up to `turns` turns, as many as fit in
    `budget_tokens`."""
    rng = random.Random(seed)
    tools, tools_tokens = _tools(counter, system_tokens // 2)
    sample = _words(random.Random(seed + 1), 400)
    tokens_per_word = counter.count(sample) / 400
    # the seed first: sessions of two seeds share no more than the template's first tokens
    head = f"Session {seed}. You are a coding agent; work in the repository below.\n"
    pad = max(system_tokens - tools_tokens - counter.count(head), 0)
    system = head + _words(rng, round(pad / tokens_per_word), per_line=16)
    session = Session(system, tools, system_tokens=counter.count(system) + tools_tokens,
                      counted_by=counter.url or "estimate")  # fmt: skip
    total = session.system_tokens
    for k in range(1, turns + 1):
        user = (f"Step {k}: look at {rng.choice(WORDS)} {rng.choice(WORDS)} and then "
                + _words(rng, rng.randint(8, 30)))  # fmt: skip
        name, arguments = _call(rng, k, tools)
        length = rng.randint(*result_tokens)
        result = _words(rng, round(length / tokens_per_word), per_line=12)
        added = (round((len(user.split()) + len(result.split())) * tokens_per_word)
                 + counter.count(json.dumps(arguments)) + 3 * MESSAGE_OVERHEAD)  # fmt: skip
        if total + added > budget_tokens:
            session.stopped_by_budget = True
            break
        total += added
        session.turns.append(Turn(user, f"call_{seed}_{k}", name, arguments, result, added))
    return session
