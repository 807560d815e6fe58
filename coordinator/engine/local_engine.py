"""A single-process engine: all layers, the ends and the tokenizer in this process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common import host_info
from common.kv_format import FULL, KVFormat
from common.model_parts import load_model_parts
from common.tokenizer import Tokenizer
from coordinator.engine.constrained import Grammars
from coordinator.engine.engine import Engine
from coordinator.engine.engine_for import engine_for
from coordinator.engine.pipeline import LocalPipeline
from coordinator.engine.prefix_cache import PrefixCache
from coordinator.model_source.hub_model import download_model, looks_like_repo_id


def resolve_model(model: str) -> Path:
    """`default` is the built-in SmolLM2-135M-Instruct, fetched and converted once; an
    `org/name` that is not a folder here comes from the Hugging Face hub."""
    if model == "default":
        from common.default_model import default_model_path

        return default_model_path()
    if looks_like_repo_id(model):
        return download_model(model)
    return Path(model).expanduser()


@dataclass
class LocalEngine:
    engine: Engine
    tokenizer: Tokenizer


def open_local_engine(
    model: str | Path,
    num_rows: int = 1,
    kv: KVFormat = FULL,
    prefix_cache: PrefixCache | None = None,
) -> LocalEngine:
    path = resolve_model(str(model))
    host_info.wire_model_memory()
    parts = load_model_parts(path)
    tokenizer = Tokenizer(path)
    engine = engine_for(
        parts,
        LocalPipeline(parts, kv),
        num_rows,
        text_tail=tokenizer.decode,
        stop_ids=tokenizer.stop_ids,
        prefix_cache=prefix_cache,
    )
    engine.use_grammars(Grammars(tokenizer, parts.config.vocab_size, engine.model_stop_ids))
    return LocalEngine(engine, tokenizer)
