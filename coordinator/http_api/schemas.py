"""The OpenAI request bodies the HTTP API accepts, as pydantic models (FastAPI validates
them; a failure becomes a 400 naming the field). WeDLM's controls ride along as extra
body fields, which the `openai` package sends with `extra_body`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.generation_params import MAX_TOP_LOGPROBS
from common.modes import MODES

MAX_CHOICES = 16  # n: choices per request (each its own sequence; one prompt prefill)
# completions: prompts in one request, times n (each choice a sequence, batched together)
MAX_PROMPT_CHOICES = 128


class _Body(BaseModel):
    # Unknown fields are ignored (clients send vendor fields freely); fields that ask for
    # something this server cannot do are refused by `unsupported()`.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result answers this call


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class GenerationFields(_Body):
    """What chat and text completions share: sampling, stopping, streaming, WeDLM."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = Field(default=None, allow_inf_nan=False)  # vLLM's
    # WeDLM and sampling extras (extra_body)
    mode: Literal[MODES] | None = None  # common/modes.py's words, in their order
    sampler: Literal["turbo", "faithful"] | None = None  # diffusion mode
    steps: int | None = None  # diffusion mode: denoising steps per canvas at most
    draft: Literal["auto", "mask", "lookup", "model"] | None = None
    window: int | None = None
    threshold: float | None = Field(default=None, allow_inf_nan=False)
    one_by_one: bool = False
    penalty: float | None = Field(default=None, allow_inf_nan=False)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    # streamed chunks say how many forwards committed their tokens ("wedlm": {"forwards": n,
    # "tokens": k}); waiting commits are then not merged into one chunk
    stream_commits: bool = False

    def limit(self) -> int | None:
        return self.max_tokens

    def limit_field(self) -> str:
        """The field that set the completion's limit, for error messages."""
        return "max_tokens"

    def prompt_field(self) -> str:
        return "prompt"

    def logprob_count(self) -> int | None:
        """Alternatives per token (params.logprobs), None when no logprobs are asked;
        completions' form: `logprobs: k`."""
        lp = self.logprobs
        if lp is None:
            return None
        if isinstance(lp, bool) or not isinstance(lp, int):
            raise ValueError(f"logprobs: an integer between 0 and {MAX_TOP_LOGPROBS}, got {lp!r}")
        if not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {lp}")
        return lp

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field that asks for what this server cannot do."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            return "n", f"n must be between 1 and {MAX_CHOICES}, got {self.n}"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options applies only when stream is true"
        return None


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def prompt_field(self) -> str:
        return "messages"

    def logprob_count(self) -> int | None:
        """Chat's form: `logprobs: true` and `top_logprobs: k`."""
        lp, top = self.logprobs, self.top_logprobs
        if lp is not None and not isinstance(lp, bool):
            raise ValueError(f"logprobs: true or false, got {lp!r}")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
        if top and not lp:
            raise ValueError("top_logprobs: needs logprobs true")
        return (top or 0) if lp else None

    echo: bool = False  # completions' field; refused here (unsupported)

    def tools_in_use(self) -> bool:
        """Tools are rendered into the prompt and calls parsed from the answer."""
        return bool(self.tools) and self.tool_choice != "none"

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", (
                "echo: is a /v1/completions field (the prompt and its logprobs); chat "
                "completions do not echo the messages"
            )
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            return "tool_choice", "tool_choice: names a tool call, but there are no tools"
        if self.response_format and self.tool_choice not in (None, "none", "auto"):
            return "response_format", (
                "response_format and a required tool call are exclusive (one grammar each)"
            )
        return super().unsupported()


class CompletionRequest(GenerationFields):
    # one prompt (text or token ids) or a list of them (one choice each, n each with n)
    prompt: str | list[int] | list[str] | list[list[int]]
    # the answer's text starts with the prompt, and with `logprobs` so do its logprobs (the
    # prompt's first token has none): how lm-eval scores loglikelihoods
    echo: bool = False
    max_tokens: int | None = Field(default=None, ge=0)  # 0: echo only, nothing generated
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """The request's prompts: a string or a token list is one."""
        p = self.prompt
        if isinstance(p, str) or not p or not isinstance(p[0], (str, list)):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]

    def echo_only(self) -> bool:
        """max_tokens 0: only the prompt (and its logprobs) is answered."""
        return self.max_tokens == 0

    def limit(self) -> int | None:
        return 1 if self.max_tokens == 0 else self.max_tokens  # echo only: one is dropped

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix (fill-in-the-middle) is not supported"
        if self.best_of not in (None, 1):
            return "best_of", f"best_of must be 1, got {self.best_of}"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 generates nothing; it needs echo true"
        n = self.n or 1
        if self.echo and self.stream and self.logprobs is not None and n > 1:
            return "n", (
                "n: a streamed echo with logprobs answers one choice per prompt (n 1); "
                "send stream false for n > 1"
            )
        count = len(self.prompts())
        if 1 <= n <= MAX_CHOICES and count * n > MAX_PROMPT_CHOICES:
            return "prompt", (
                f"prompt: {count} prompts times n = {n} make {count * n} choices; at most "
                f"{MAX_PROMPT_CHOICES} per request"
            )
        return super().unsupported()


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a completion prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True  # completions' way (the only one this server encodes)
    add_generation_prompt: bool = True  # chat's way (the only one this server renders)
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
