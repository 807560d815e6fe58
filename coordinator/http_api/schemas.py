"""The OpenAI request bodies the HTTP API accepts, as pydantic models (FastAPI validates
them; a failure becomes a 400 naming the field). WeDLM's controls ride along as extra
body fields, which the `openai` package sends with `extra_body`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.generation_params import MAX_TOP_LOGPROBS

MAX_CHOICES = 16  # n: choices per request (each its own sequence; one prompt prefill)


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
    mode: Literal["auto", "wedlm", "ar", "speculative", "diffusion"] | None = None
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

    def tools_in_use(self) -> bool:
        """Tools are rendered into the prompt and calls parsed from the answer."""
        return bool(self.tools) and self.tool_choice != "none"

    def unsupported(self) -> tuple[str, str] | None:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            return "tool_choice", "tool_choice: names a tool call, but there are no tools"
        if self.response_format and self.tool_choice not in (None, "none", "auto"):
            return "response_format", (
                "response_format and a required tool call are exclusive (one grammar each)"
            )
        return super().unsupported()


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix (fill-in-the-middle) is not supported"
        if self.best_of not in (None, 1):
            return "best_of", f"best_of must be 1, got {self.best_of}"
        return super().unsupported()
