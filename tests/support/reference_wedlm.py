"""An independent PyTorch reference of WeDLM streaming decoding (shared/docs/wedlm-decoding.md).

Deliberately simple and slow: every step recomputes the whole sequence without a KV cache, on the
transformers model in float32, greedy only. It imports nothing from the project, so that parity
tests compare two implementations written separately.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

DEFAULT_MASK_ID = 151665
_WEDLM_DROP = ("model_type", "architectures", "qk_norm", "auto_map", "transformers_version")


@dataclass
class Window:
    """Uncommitted slots after the committed text: slot i has logical position C + i.

    Masks are per-slot flags, never token comparisons: a prompt may contain the mask id itself.
    """

    tok: list[Any] = field(default_factory=list)
    is_mask: list[bool] = field(default_factory=list)

    @classmethod
    def of_masks(cls, width: int, mask_id: Any) -> Window:
        return cls([mask_id] * width, [True] * width)

    def leading_filled(self) -> int:
        return self.is_mask.index(True) if True in self.is_mask else len(self.is_mask)

    def refill(self, mask_id: Any) -> int:
        """Step 1: append one mask per leading filled slot; returns p, the count to commit."""
        p = self.leading_filled()
        self.tok += [mask_id] * p
        self.is_mask += [True] * p
        return p

    def physical_order(self) -> list[int]:
        """Step 2: filled slots in ascending slot order, then mask slots in ascending slot order."""
        filled = [i for i, m in enumerate(self.is_mask) if not m]
        masks = [i for i, m in enumerate(self.is_mask) if m]
        return filled + masks

    def rows(self, committed_len: int) -> tuple[list[Any], list[int], list[int]]:
        """(tokens, logical positions, slot) of every window row in physical order."""
        order = self.physical_order()
        return [self.tok[i] for i in order], [committed_len + i for i in order], order

    def pop_front(self, p: int) -> list[Any]:
        """Step 4: drop the first p (filled) slots and return their tokens."""
        assert not any(self.is_mask[:p]), "only filled slots can be committed"
        out = self.tok[:p]
        del self.tok[:p], self.is_mask[:p]
        return out

    def fill(self, slot: int, token: Any) -> None:
        assert self.is_mask[slot], "filled slots are never revised"
        self.tok[slot], self.is_mask[slot] = token, False


def causal_mask_4d(n_rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive (1, 1, n, n) mask, causal over the physical row order: row j sees rows 0..j.

    transformers 5 passes any 4-D tensor through untouched to the attention function; an additive
    float mask works for both the sdpa and the eager paths (eager adds it to the scores).
    """
    allowed = torch.ones(n_rows, n_rows, dtype=torch.bool).tril()
    mask = torch.zeros(n_rows, n_rows, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def adjusted_fills(
    mask_slots: list[int], entropy: list[float], penalty: float, threshold: float | None
) -> list[int]:
    """Step 5 selection: adj = H + penalty * d (d = slot index after the commit); fill every
    slot with adj < tau, else (or in one-by-one mode, tau None) only the first argmin."""
    adj = [h + penalty * d for d, h in zip(mask_slots, entropy, strict=True)]
    chosen = (
        []
        if threshold is None
        else [s for s, a in zip(mask_slots, adj, strict=True) if a < threshold]
    )
    if not chosen:
        chosen = [mask_slots[min(range(len(adj)), key=adj.__getitem__)]]
    return chosen


_MODELS: dict[tuple[str, int], PreTrainedModel] = {}


def load_model(ckpt_dir: Path) -> PreTrainedModel:
    """The float32 transformers model of a checkpoint; `wedlm` configs map to Qwen3 or Qwen2."""
    ckpt_dir = Path(ckpt_dir).resolve()
    cfg_path = ckpt_dir / "config.json"
    key = (str(ckpt_dir), cfg_path.stat().st_mtime_ns)
    if key in _MODELS:
        return _MODELS[key]
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") == "wedlm":
        fields = {k: v for k, v in cfg.items() if k not in _WEDLM_DROP and v is not None}
        if cfg.get("qk_norm", True):
            model = Qwen3ForCausalLM(Qwen3Config(**fields))
        else:
            model = Qwen2ForCausalLM(Qwen2Config(**fields))  # Qwen2 always has q/k/v bias
        state: dict[str, torch.Tensor] = {}
        for f in sorted(ckpt_dir.glob("*.safetensors")):
            state.update(load_file(f))
        if cfg.get("tie_word_embeddings") and "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True)  # strict: a missing tensor must not stay random
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32)
    model = model.to(torch.float32).eval()
    _MODELS[key] = model
    return model


def _forward(
    model: PreTrainedModel, ids: list[int], positions: list[int] | None = None
) -> torch.Tensor:
    """Float32 logits (rows, vocab) of one uncached forward; explicit causal mask with positions."""
    kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids]), "use_cache": False}
    if positions is not None:
        # explicit mask: without one, transformers reads non-monotonic positions as packed sequences
        kwargs["position_ids"] = torch.tensor([positions])
        kwargs["attention_mask"] = causal_mask_4d(len(ids))
    with torch.no_grad():
        return model(**kwargs).logits[0].float()


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(raw logits) over the full vocabulary, per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def _mask_id(ckpt_dir: Path, mask_token_id: int | None) -> int:
    if mask_token_id is not None:
        return mask_token_id
    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
    return DEFAULT_MASK_ID if cfg.get("mask_token_id") is None else int(cfg["mask_token_id"])


def reference_generate(
    ckpt_dir: Path,
    prompt_ids: list[int],
    *,
    mode: str = "wedlm",
    window: int = 16,
    threshold: float | None = 0.4,
    penalty: float = 0.02,
    max_tokens: int = 32,
    stop_ids: tuple[int, ...] = (),
    mask_token_id: int | None = None,
) -> dict[str, Any]:
    """Greedy decode. Returns tokens (the completion, a stop token included), forwards (decode
    forwards, prefill excluded), fills (slots filled per WeDLM step), entropies (every H seen)."""
    model = load_model(ckpt_dir)
    ctx = list(prompt_ids)  # prompt + committed tokens: C = len(ctx)
    out: list[int] = []
    stats: dict[str, Any] = {"tokens": out, "forwards": 0, "fills": [], "entropies": []}
    stops = set(stop_ids)

    def commit(token: int) -> bool:
        """Append one token; True once the sequence is finished."""
        out.append(token)
        ctx.append(token)
        return token in stops or len(out) >= max_tokens

    if max_tokens <= 0:
        return stats
    if mode == "ar":
        # the prefill forward yields the first token; every later token costs one decode forward
        while True:
            token = int(torch.argmax(_forward(model, ctx)[-1]))
            if commit(token):
                return stats
            stats["forwards"] += 1
    if mode != "wedlm":
        raise ValueError(f"unknown mode {mode!r}")

    # the prefill's logits are discarded and this reference keeps no cache, so it is not run at all
    mask_id = _mask_id(ckpt_dir, mask_token_id)
    win = Window.of_masks(window, mask_id)
    while True:
        p = win.refill(mask_id)
        toks, positions, slots = win.rows(len(ctx))
        # committing the first p rows needs no logits: when they end the sequence, skip the forward
        committed = win.pop_front(p)
        if any(commit(t) for t in committed):
            return stats
        # the first p physical rows are the committed slots, already at the end of ctx
        logits = _forward(model, ctx + toks[p:], list(range(len(ctx))) + positions[p:])
        stats["forwards"] += 1
        row_of_slot = {slot - p: len(ctx) + r for r, slot in enumerate(slots[p:])}
        mask_slots = [d for d, m in enumerate(win.is_mask) if m]
        rows = logits[[row_of_slot[d] for d in mask_slots]]  # mask row predicts its own slot
        entropy = _entropy(rows).tolist()
        stats["entropies"] += entropy
        chosen = adjusted_fills(mask_slots, entropy, penalty, threshold)
        for d in chosen:
            win.fill(d, int(torch.argmax(rows[mask_slots.index(d)])))
        stats["fills"].append(len(chosen))
