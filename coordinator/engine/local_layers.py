"""The coordinator's own layer range: loaded, replaced or dropped when a plan changes, on
the thread that owns MLX (the planner before serving starts, the engine thread after)."""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx.utils import tree_flatten

from common import host_info
from common.kv_format import FULL, KVFormat
from common.layer_range import LayerRange
from common.layer_runner import LayerRunner
from common.model_config import ModelConfig
from common.model_parts import ModelParts, load_model_parts
from common.tensor_group.member import GroupMember
from coordinator.engine.group_stage import GroupStage


class LocalLayers:
    def __init__(
        self, config: ModelConfig, fixed: LayerRange | None = None, kv: KVFormat = FULL
    ) -> None:
        self.config = config
        self.fixed = fixed  # --layers: the only range this coordinator takes
        self.kv = kv  # how its KV is stored (--kv-bits)
        self.parts: ModelParts | None = None
        self.group: GroupStage | None = None  # its range held as rank 0 of a tensor group

    @property
    def layer_range(self) -> LayerRange | None:
        if self.group is not None:
            return self.group.layer_range
        return self.parts.layer_range if self.parts is not None else None

    def held_bytes(self) -> int:
        if self.parts is None:
            return 0
        return sum(p.nbytes for _, p in tree_flatten(self.parts.parameters()))

    def available_bytes(self) -> int:
        """Memory the coordinator could give to layers and KV: what is free now plus what
        its current layers occupy (a new plan replaces them)."""
        return host_info.memory()[1] + self.held_bytes()

    def hold(
        self, layer_range: LayerRange | None, member: GroupMember | None = None
    ) -> LayerRunner | GroupStage | None:
        """A runner over exactly `layer_range` with no KV (None: hold no layers), or the
        stage of the tensor group `member` formed over it (rank 0). The same range alone
        keeps its weights; another drops the old layers before loading the new."""
        if self.group is not None:  # every plan forms its groups anew
            self.group.close()
            self.group = None
        if member is not None:
            self.parts = None
            gc.collect()
            mx.clear_cache()
            self.group = GroupStage(member)
            return self.group
        if layer_range is not None and self.layer_range == layer_range:
            return LayerRunner(self.parts, self.kv)
        self.parts = None
        gc.collect()
        mx.clear_cache()
        if layer_range is None:
            return None
        self.parts = load_model_parts(
            self.config.path, layer_range, with_ends=False, config=self.config
        )
        return LayerRunner(self.parts, self.kv)
