"""Per-request decoding parameters, validated once at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.errors import InvalidRequest
from common.modes import MODES, Mode, is_mode

# MODES (the modes as plain strings) and Mode are common/modes.py's, imported from here too
# Diffusion mode's samplers: mlx-vlm's reference sampler exactly ("faithful"), or the
# faster one (exact top-K, top-K self-conditioning, two-stage confidence schedule, repair
# pass, EOS tail-drop, repeat guard: coordinator/engine/diffusion/turbo.py).
DIFFUSION_SAMPLERS = ("faithful", "turbo")
MAX_DENOISING_STEPS = 1024
# Where speculative mode's drafts come from: the model's own mask-slot predictions of the
# previous forward (WeDLM-trained models), n-gram matches in the prompt and output so far,
# or a small draft model on the coordinator. "auto" picks the draft model when one is
# loaded, else mask slots on a WeDLM checkpoint, else prompt lookup.
DRAFT_SOURCES = ("auto", "mask", "lookup", "model")
MAX_WINDOW = 64
MAX_FORWARD_ROWS = 3 * MAX_WINDOW  # the widest decode forward of one sequence (forward_rows)
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class GenerationParams:
    # a Mode or its string; "auto" is resolved by the engine (engine.resolve_mode)
    mode: str = Mode.AUTO
    window: int = 16
    threshold: float | None = 0.4  # None: one-by-one mode (fill only the argmin slot)
    penalty: float = 0.02
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    draft: str = "auto"  # speculative mode's draft source (DRAFT_SOURCES)
    sampler: str = "turbo"  # diffusion mode's sampler (DIFFUSION_SAMPLERS)
    steps: int = 0  # diffusion mode: denoising steps per canvas at most (0: the model's)
    # None: no logprobs; k >= 0: each committed token's logprob and its k likeliest
    # alternatives (coordinator/engine/token_logprobs.py says under which forward)
    logprobs: int | None = None
    # the prompt's tokens' logprobs too (each from the prefill row before it; the first
    # has none), with `logprobs` alternatives each: OpenAI completions' echo
    prompt_logprobs: bool = False
    # an llguidance grammar the output must match (structured output); None: free text
    grammar: str | None = None
    # OpenAI's penalties on tokens already in the output, HF's on the prompt's and the
    # output's (1: none), and additive biases per token id (coordinator/engine/logit_bias.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    extra_stop_ids: tuple[int, ...] = field(default=(), compare=False)  # model's EOS ids

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(message: str) -> InvalidRequest:
            return InvalidRequest(message)

        if not is_mode(self.mode):
            raise bad(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.draft not in DRAFT_SOURCES:
            raise bad(f"draft must be one of {', '.join(DRAFT_SOURCES)}, got {self.draft!r}")
        if self.draft != "auto" and self.mode != Mode.SPECULATIVE:
            raise bad(
                f"draft {self.draft!r} applies to mode speculative only (mode is {self.mode!r})"
            )
        if self.sampler not in DIFFUSION_SAMPLERS:
            raise bad(
                f"sampler must be one of {', '.join(DIFFUSION_SAMPLERS)}, got {self.sampler!r}"
            )
        if not 0 <= self.steps <= MAX_DENOISING_STEPS:
            raise bad(
                f"steps must be between 1 and {MAX_DENOISING_STEPS} (0: the model's), "
                f"got {self.steps}"
            )
        if not 1 <= self.window <= MAX_WINDOW:
            raise bad(f"window must be between 1 and {MAX_WINDOW}, got {self.window}")
        if self.threshold is not None and not (
            math.isfinite(self.threshold) and self.threshold > 0
        ):
            raise bad(f"threshold must be a positive number or none, got {self.threshold}")
        if not (math.isfinite(self.penalty) and self.penalty >= 0):
            raise bad(f"penalty must be >= 0, got {self.penalty}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(i < 0 for i in self.stop_ids):
            raise bad(f"stop ids must be non-negative token ids, got {list(self.stop_ids)}")
        if any(not s for s in self.stop_strings):
            raise bad("stop strings must not be empty")
        if not 0 <= self.seed < 2**32:
            raise bad(f"seed must be in [0, 2^32), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise bad(f"{name} must be between -2 and 2, got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for token, value in self.logit_bias:
            if token < 0:
                raise bad(f"logit_bias: token ids are non-negative, got {token}")
            if not (math.isfinite(value) and -100 <= value <= 100):
                raise bad(f"logit_bias: values must be between -100 and 100, got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs and self.logprobs is None:
            raise bad("logprobs: prompt logprobs need logprobs (the alternatives' count)")

    @property
    def forward_rows(self) -> int:
        """The most rows one forward of this request writes past its committed KV: AR feeds
        its last token; WeDLM a window of W plus the p slots it commits; speculative mode
        up to W pending committed tokens, W - 1 drafts and W mask slots."""
        if self.mode == Mode.DIFFUSION:
            return 0  # canvases: the diffusion scheduler counts them (it knows their length)
        rows = {Mode.AR: 1, Mode.WEDLM: 2 * self.window, Mode.SPECULATIVE: 3 * self.window}
        return rows.get(self.mode, 2 * self.window)  # "auto": as wedlm until resolved

    @property
    def penalized(self) -> bool:
        """Whether its logits depend on the tokens before each choice (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def all_stop_ids(self) -> frozenset[int]:
        return frozenset(self.stop_ids) | frozenset(self.extra_stop_ids)
