"""Read and validate a checkpoint's config.json; map model types onto mlx-lm model modules."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import CheckpointError
from common.model_families import family_name
from common.modes import Mode

DEFAULT_MASK_TOKEN_ID = 151665  # WeDLM's [MASK]; released configs leave mask_token_id null
# The families served before mlx-lm's registry decided (their configs are read as then);
# any other model_type is served when mlx-lm has it (common/model_families.py).
CLASSIC_MODEL_TYPES = ("wedlm", "qwen3", "qwen2", "llama", "qwen3_moe", "diffusion_gemma")
DIFFUSION_MODEL_TYPES = ("diffusion_gemma",)  # block-diffusion models: mlx-vlm's modules
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def mlx_model_type(config: dict[str, Any], where: Path | None = None) -> str:
    """The mlx-lm module that runs this checkpoint (WeDLM is Qwen3 with q/k norm, else
    Qwen2; other types as mlx-lm's own registry resolves them)."""
    model_type = config.get("model_type")
    if model_type == "wedlm":
        return "qwen3" if config.get("qk_norm", True) else "qwen2"
    if model_type in CLASSIC_MODEL_TYPES:
        return str(model_type)
    return family_name(config, where or Path("config.json"))


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    raw: dict[str, Any] = field(repr=False)
    model_type: str
    family: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    quantization: dict[str, Any] | None

    @property
    def identity(self) -> str:
        """A short fingerprint of the architecture, so workers and coordinator can agree."""
        keys = sorted(k for k in self.raw if k not in ("_name_or_path", "transformers_version"))
        blob = json.dumps({k: self.raw[k] for k in keys}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def diffusion(self) -> bool:
        """A block-diffusion model (DiffusionGemma): it decodes canvases, not windows."""
        return self.model_type in DIFFUSION_MODEL_TYPES

    @property
    def canvas_length(self) -> int:
        """Positions of one diffusion canvas (0 for other models)."""
        return int(self.raw.get("canvas_length") or 0) if self.diffusion else 0

    @property
    def wedlm_trained(self) -> bool:
        """A checkpoint trained for WeDLM decoding: model_type "wedlm" (the released WeDLM
        models), or a config with a "wedlm" training record (a model adapted with the WeDLM
        objective, as the project's own checkpoints are). Its mask slots predict their own
        positions, so it decodes in parallel and makes useful drafts. A mask_token_id alone
        is no evidence: the default model names one so that WeDLM can be tried on it."""
        return self.model_type == "wedlm" or isinstance(self.raw.get("wedlm"), dict)

    @property
    def default_mode(self) -> str:
        """The checkpoint's own decoding, what a request in mode "auto" gets."""
        if self.diffusion:
            return Mode.DIFFUSION
        return Mode.WEDLM if self.wedlm_trained else Mode.AR

    def mlx_args(self) -> dict[str, Any]:
        """The config as mlx-lm's ModelArgs expects it (other families: as written, so
        that mlx-lm's own defaults apply, a tied head included)."""
        args = copy.deepcopy(self.raw)  # ModelArgs may fill in nested dicts (text_config)
        if self.model_type in CLASSIC_MODEL_TYPES:
            args["model_type"] = self.family
            args["tie_word_embeddings"] = self.tie_word_embeddings
        return args


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must contain a JSON object")
    return data


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _flatten_text_config(path: Path, top: dict[str, Any]) -> dict[str, Any]:
    """A multimodal-layout config (DiffusionGemma: the text model's fields under
    `text_config`) as one flat dict: the text fields, then the top level's own."""
    text = top.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{path / 'config.json'}: text_config must be a JSON object")
    flat = {k: v for k, v in top.items() if k != "text_config"}
    flat.update({k: v for k, v in text.items() if k != "model_type"})
    flat["text_config"] = text
    canvas = top.get("canvas_length", 256)
    if not isinstance(canvas, int) or canvas <= 0:
        raise CheckpointError(
            f"{path / 'config.json'}: canvas_length must be a positive integer, got {canvas!r}"
        )
    flat["canvas_length"] = canvas
    if top.get("eos_token_id") is None:
        flat["eos_token_id"] = text.get("eos_token_id")
    return flat


def _with_text_fields(top: dict[str, Any]) -> dict[str, Any]:
    """The top level with the text model's fields beside it (its own win); mlx-lm's
    ModelArgs still reads `text_config` itself."""
    text = top["text_config"]
    return {**{k: v for k, v in text.items() if k != "model_type"}, **top}


def load_model_config(path: str | Path) -> ModelConfig:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist")
    top = _read_json(path / "config.json")
    model_type = top.get("model_type")
    if model_type in DIFFUSION_MODEL_TYPES:
        raw = _flatten_text_config(path, top)
    elif isinstance(top.get("text_config"), dict) and "hidden_size" not in top:
        raw = _with_text_fields(top)  # a multimodal layout: the sizes are the text model's
    else:
        raw = top
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{path / 'config.json'}: model_type must be a family name")
    family = mlx_model_type(raw, path / "config.json")  # refuses a type mlx-lm lacks
    for name in REQUIRED_FIELDS:
        value = raw.get(name)
        if not isinstance(value, int) or value <= 0:
            raise CheckpointError(
                f"{path / 'config.json'}: {name} must be a positive integer, got {value!r}"
            )
    eos = _int_list(raw.get("eos_token_id"))
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        eos += [i for i in _int_list(_read_json(gen_path).get("eos_token_id")) if i not in eos]
    mask_id = raw.get("mask_token_id")
    if model_type in DIFFUSION_MODEL_TYPES:
        mask_id = -1  # diffusion canvases start from random tokens, not a mask token
    quant = raw.get("quantization") or None
    tie_default = model_type in ("llama", "qwen2", "diffusion_gemma")
    return ModelConfig(
        path=path,
        raw=raw,
        model_type=model_type,
        family=family,
        num_layers=raw["num_hidden_layers"],
        hidden_size=raw["hidden_size"],
        vocab_size=raw["vocab_size"],
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        mask_token_id=DEFAULT_MASK_TOKEN_ID if mask_id is None else int(mask_id),
        eos_token_ids=tuple(eos),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", tie_default)),
        quantization=quant,
    )
