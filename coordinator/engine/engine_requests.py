"""What the engine takes in: a request's prompt and parameters, resolved (mode "auto", draft
source "auto"), validated against the model and its family, and added to the scheduler as a
Sequence. The causal engine's base (engine.py); the diffusion engine overrides the checks."""

from __future__ import annotations

import logging
from dataclasses import replace

from common.errors import InvalidRequest, PromptTooLong
from common.generation_params import GenerationParams
from common.model_config import ModelConfig
from common.model_parts import ModelParts
from common.modes import Mode
from coordinator.engine import constrained
from coordinator.engine.auto_mode import family_mode, refused_mode
from coordinator.engine.modes import mode_of, served
from coordinator.engine.prompt_sharing import can_share
from coordinator.engine.scheduler import Scheduler
from coordinator.engine.sequence import Sequence

log = logging.getLogger(__name__)


class EngineRequests:
    parts: ModelParts
    config: ModelConfig
    scheduler: Scheduler
    drafter: object | None
    text_tail: object
    model_stop_ids: tuple[int, ...]

    def _init_requests(self) -> None:
        self._warned: set[str] = set()  # modes whose mode_warning was logged
        self._auto_mode: str | None = None  # mode "auto" decodes with this (None: the model's)

    @property
    def grammars(self) -> constrained.Grammars | None:
        raise NotImplementedError

    @property
    def default_mode(self) -> str:
        """What requests in mode "auto" decode with: the checkpoint's own decoding, unless
        this machine's measured costs chose otherwise (auto_mode.py: `use_auto_mode`)."""
        recurrent = getattr(self.parts, "recurrent", False)
        return self._auto_mode or family_mode(self.config.default_mode, recurrent)

    def use_auto_mode(self, mode: str | None) -> None:
        """Mode "auto" decodes with `mode` from now on (None: the checkpoint's own)."""
        self._auto_mode = mode

    def resolve_mode(self, params: GenerationParams) -> GenerationParams:
        """Mode "auto" becomes this engine's own decoding."""
        return replace(params, mode=self.default_mode) if params.mode == Mode.AUTO else params

    def mode_warning(self, params: GenerationParams) -> str:
        """Why a request's (resolved) decoding may give degraded text on this checkpoint:
        mask slots (WeDLM windows, mask-slot drafts) on a model that never learned them."""
        if self.config.wedlm_trained or not served(params.mode):
            return ""
        if not mode_of(params.mode).uses_masks(params):
            return ""
        what = "mode wedlm" if params.mode == Mode.WEDLM else "mask-slot drafts"
        return (
            f"{what} on a checkpoint that is not WeDLM-trained ({self.config.model_type}, no "
            f"'wedlm' record in config.json): its mask slots were never trained, expect "
            f"degraded text (mode auto decodes it with {self.default_mode})"
        )

    def submit(
        self, prompt: list[int], params: GenerationParams, shares_with: Sequence | None = None
    ) -> Sequence:
        """`shares_with`: another choice of the same request (n > 1), whose prompt rows
        this one copies instead of prefilling them (prompt_sharing.py)."""
        params = constrained.sequential_params(self.resolve_mode(params))
        params = self.resolve_drafts(params)
        self.validate_prompt(prompt, params)
        params = replace(params, extra_stop_ids=self.model_stop_ids)
        seq = Sequence(next(self._ids), list(prompt), params, text_tail=self.text_tail)
        if params.grammar is not None:
            if self.grammars is None:
                raise InvalidRequest("structured output needs the tokenizer (use_grammars)")
            seq.matcher = self.grammars.matcher(params.grammar)
        # a recurrent state forks only at its own length, not at a choice's prompt - 1
        shares = self.scheduler.shares_prompts and not getattr(self.parts, "recurrent", False)
        if shares_with is not None and shares:
            seq.share_from = shares_with if can_share(seq, shares_with) else None
        seq.warning = self.mode_warning(params)
        if seq.warning and params.mode not in self._warned:
            self._warned.add(params.mode)  # once per mode: a busy server would repeat it
            log.warning("%s", seq.warning)
        self.scheduler.add(seq)
        return seq

    def resolve_drafts(self, params: GenerationParams) -> GenerationParams:
        """The mode's own resolution of the request (speculative's draft source "auto")."""
        if not served(params.mode):
            return params
        mode = mode_of(params.mode)
        return mode.resolve(params, self.drafter is not None, self.config.wedlm_trained)

    def validate_prompt(self, prompt: list[int], params: GenerationParams) -> None:
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if params.mode == Mode.DIFFUSION:
            raise InvalidRequest(
                f"mode diffusion needs a block-diffusion model (DiffusionGemma); this model "
                f"({self.config.model_type}) decodes with wedlm, ar or speculative"
            )
        mode = mode_of(self.resolve_mode(params).mode)  # refuses a mode it does not serve
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        refused = refused_mode(
            params.mode,
            self.config.family,
            getattr(self.parts, "recurrent", False),
            getattr(self.parts, "sliding", False),
        )
        if refused:
            raise InvalidRequest(refused)
        if mode.uses_masks(params) and not 0 <= self.config.mask_token_id < vocab:
            what = "WeDLM mode" if params.mode == Mode.WEDLM else "mask-slot drafts"
            raise InvalidRequest(
                f"{what} need a mask token, but mask_token_id "
                f"{self.config.mask_token_id} is outside this model's vocabulary of {vocab} "
                f"(set mask_token_id in config.json, or use --mode ar)"
            )
        if params.draft == "model" and self.drafter is None:
            raise InvalidRequest(
                "draft 'model' needs a draft model: start the coordinator with --draft-model"
            )
        room = params.forward_rows
        limit = self.config.max_position_embeddings
        if len(prompt) + room > limit:
            raise PromptTooLong(
                f"the prompt has {len(prompt)} tokens; with a window of {room} rows it "
                f"exceeds the model's context of {limit} positions"
            )
