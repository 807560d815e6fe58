"""Tensor-parallel groups (issue 31): which backends a process can join, whether a model's
layers can be split N ways, and the split itself, done by mlx-lm's own `Model.shard`
(`shard_linear` / `shard_inplace`: attention heads and MLP columns, their KV with them).
The coordinator asks `shard_problem` before it forms a group; a member's group process
(common/tensor_group/process.py) calls `shard_layers` on the layers it loaded."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from common.errors import WedlmError
from common.model_config import ModelConfig

BACKENDS = ("ring", "jaccl", "nccl")


@dataclass(frozen=True)
class GroupSpec:
    """One member's view of its group: its rank, the group's size and backend, and where
    every rank's group process listens ("host:port" each; nccl uses the leader's)."""

    rank: int
    size: int
    hosts: list[str] = field(default_factory=list)
    backend: str = "ring"
    epoch: int = 0
    # jaccl: rdma[i][j] is the RDMA device rank i reaches rank j by ("" on the diagonal;
    # several cables as "rdma_en2,rdma_en3"), MLX's MLX_IBV_DEVICES matrix
    rdma: list[list[str]] = field(default_factory=list)

    def check(self) -> None:
        if self.size < 2:
            raise ValueError(f"a tensor group has at least 2 members, not {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown group backend {self.backend!r} ({', '.join(BACKENDS)})")
        if len(self.hosts) != self.size:
            raise ValueError(f"{len(self.hosts)} hosts for a group of {self.size}: one per rank")
        for host in self.hosts:
            name, _, port = host.rpartition(":")
            if not name or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"group host {host!r} is not HOST:PORT")
        if self.backend == "jaccl":
            self._check_rdma()

    def _check_rdma(self) -> None:
        if len(self.rdma) != self.size or any(len(row) != self.size for row in self.rdma):
            n = self.size
            raise ValueError(f"a jaccl group of {n} needs an RDMA device matrix of {n} x {n}")
        for i, row in enumerate(self.rdma):
            for j, cell in enumerate(row):
                if i == j and cell:
                    raise ValueError(f"rank {i} names an RDMA device to itself ({cell})")
                if i != j and not cell:
                    raise ValueError(f"rank {i} has no RDMA device to rank {j}")

    def flat_rdma(self) -> list[str]:
        """The matrix row by row, as TensorGroup.rdma_devices carries it."""
        return [cell for row in self.rdma for cell in row]


def rdma_rows(flat: list[str], size: int) -> list[list[str]]:
    """TensorGroup.rdma_devices back into rows (empty stays empty: not a jaccl group; a
    count that is not size x size stays one row, which `check` refuses)."""
    if len(flat) != size * size:
        return [list(flat)] if flat else []
    return [list(flat[i * size : (i + 1) * size]) for i in range(size)]


def available_backends(rdma_ports: list | None = None) -> list[str]:
    """The backends this process can join: built into its MLX (ring runs anywhere; nccl
    needs CUDA), and jaccl only with RDMA ports to reach a peer by (`rdma_ports`, from
    common/tensor_group/rdma.py; none on Linux)."""
    import mlx.core as mx

    return [b for b in BACKENDS if mx.distributed.is_available(b) and (b != "jaccl" or rdma_ports)]


def _model_module(config: ModelConfig):
    try:
        return importlib.import_module(f"mlx_lm.models.{config.family}")
    except ImportError:
        return None


def no_shard_problem(config: ModelConfig) -> str | None:
    """Why mlx-lm cannot split this family at all (None: its Model has `shard`)."""
    if config.diffusion:
        return f"{config.model_type} (a diffusion model) has no tensor-parallel split"
    module = _model_module(config)
    if module is None or not hasattr(getattr(module, "Model", None), "shard"):
        return (
            f"{config.family} cannot be split across a tensor group: mlx-lm has no shard "
            "for it; use stages"
        )
    return None


def check_tp_flag(config: ModelConfig, tp: int | str) -> None:
    """`--tp N` (N > 1) for a family mlx-lm has no shard for: refused at start, in one
    line (`--tp auto` plans it as stages and says why)."""
    if isinstance(tp, int) and tp > 1 and not config.diffusion:
        problem = no_shard_problem(config)
        if problem is not None:
            raise WedlmError(f"--tp {tp}: {problem}")


def shard_problem(config: ModelConfig, size: int) -> str | None:
    """Why this model's layers cannot be split `size` ways (None: they can)."""
    problem = no_shard_problem(config)
    if problem is not None:
        return problem
    raw = config.raw
    heads = int(raw.get("num_attention_heads") or 0)
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    for name, value in (
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("MLP width (intermediate_size)", int(raw.get("intermediate_size") or 0)),
        ("expert MLP width", int(raw.get("moe_intermediate_size") or 0)),
    ):
        if value and value % size:
            return f"its {value} {name} do not divide by {size}"
    return None


def shard_layers(config: ModelConfig, layers: list, group) -> None:
    """Split `layers` (a process's loaded, contiguous range) in place over `group` with
    mlx-lm's own `Model.shard`: a fresh model of the family (lazy parameters, never
    evaluated) is given these layers in place of its own, wherever the family keeps its
    list (model.layers, language_model.model.layers...), so a shard that also reads the
    model's args or its `layers` property runs unchanged."""
    from common.model_families import find_layers

    arch = _model_module(config)
    model = arch.Model(arch.ModelArgs.from_dict(config.mlx_args()))
    found = find_layers(model, config.family)
    setattr(found.owner, found.attr, list(layers))
    model.shard(group)
    layers[:] = getattr(found.owner, found.attr)  # a shard may replace a layer whole
