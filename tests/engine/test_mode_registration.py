"""A decoding mode is one module behind one interface (coordinator/engine/modes/base.py):
a mode written here, registered by name, decodes through the engine with no edit of it.
The toy mode commits the argmax of the last row as AR does, without AR's look-ahead, so
its tokens are greedy AR's and every step reads back before the next launch."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import InvalidRequest
from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.modes import DecodingMode, PlanContext, register
from coordinator.engine.modes.registry import unregister
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Sequence

TOY = "toy-argmax"


class ToyArgmax(DecodingMode):
    name = TOY

    def __init__(self) -> None:
        self.planned = 0
        self.committed = 0

    def plan(self, seq: Sequence, ctx: PlanContext, room: int | None) -> RowPlan:
        self.planned += 1
        return RowPlan(
            seq=seq,
            tokens=np.array([seq.output[-1]], dtype=np.int32),
            filled=np.ones(1, dtype=bool),
            keep=1,
            head_slots=np.zeros(1, dtype=np.int64),
            head_is_mask=np.ones(1, dtype=bool),
        )

    def commit(self, plan: RowPlan, fills, tokens, break_even: float) -> list[int]:
        self.committed += 1
        return [int(tokens[0])]


@pytest.fixture
def toy():
    mode = register(ToyArgmax())
    yield mode
    unregister(TOY)


def _run(local, prompts, mode: str, n: int) -> list[Sequence]:
    seqs = [local.engine.submit(p, GenerationParams(mode=mode, max_tokens=n)) for p in prompts]
    for _ in local.engine.stream(seqs):
        pass
    return seqs


def test_a_registered_mode_decodes_as_its_module_says(checkpoint_dir, toy):
    local = open_local_engine(checkpoint_dir("llama", seed=3), num_rows=4)
    prompts = [local.tokenizer.encode(t) for t in ("the cat sat", "count 1 2 3", "a b")]
    ar = _run(local, prompts, "ar", 12)
    mine = _run(local, prompts, TOY, 12)
    assert [s.output for s in mine] == [s.output for s in ar]
    assert all(s.finish_reason == "length" for s in mine)
    # the first token comes from the prompt's last row; each later one from a toy forward
    assert toy.committed == sum(len(s.output) for s in mine)
    assert toy.planned == toy.committed - len(prompts)


def test_an_unregistered_mode_is_refused_by_name():
    with pytest.raises(InvalidRequest, match=rf"mode must be one of .*got '{TOY}'"):
        GenerationParams(mode=TOY)
