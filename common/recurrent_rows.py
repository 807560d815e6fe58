"""A recurrent layer's state (linear attention, Mamba) for every row of a KVRows.

mlx-lm's linear-attention and state-space layers read and write their state through an
ArraysCache: `cache[i]` (a conv window, an SSM or delta-rule state, [rows, ...] each) and
`cache.advance(n)`. LayerState duck-types exactly that, for all rows of a batch; KVRows
keeps, gathers and forks its rows with the KV.

A forward's rows are right-padded to its width, and padding must never enter a state.
mlx-lm masks padding through `lengths` for some families only (its Mamba-2 SSM takes left
padding alone), so a recurrent layer here never sees padding: the rows of each width run
it together on exactly their slots (run_state_layer; one call when all rows are alike,
as in every decode step), and the padding's hidden states pass it unchanged.

A state summarises every token a row has run; it cannot forget the last few. So a row's
forward must keep every token it runs (AR, a prompt chunk): WeDLM windows and
speculative drafts, whose rows are written and then partly taken back, are refused for
these families (engine.validate_prompt), and a fork copies a state only at the length it
holds (kv_store.KVStore.fork_problem)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class LayerState:
    """One recurrent layer's state arrays for all rows; duck-types mlx-lm's ArraysCache."""

    def __init__(self, size: int) -> None:
        self.cache: list[mx.array | None] = [None] * size
        self.lengths: mx.array | None = None  # mlx-lm's padding lengths: never padded here
        self.left_padding: mx.array | None = None

    def __getitem__(self, index: int) -> mx.array | None:
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.cache[index] = value

    def advance(self, n: int) -> None:
        if self.lengths is not None:
            self.lengths = self.lengths - n

    def make_mask(self, n: int) -> None:
        return None  # no padding reaches the layer (run_state_layer)

    def empty(self) -> bool:
        return self.cache[0] is None

    @property
    def keys(self) -> mx.array | None:
        """Whether anything is stored (KVStore asks a layer's `keys`)."""
        return self.cache[0]

    def reset_rows(self, fresh: np.ndarray) -> None:
        """Zero the state of the rows marked in `fresh` (a row id reused from position 0)."""
        keep = mx.array(~fresh)
        self.cache = [
            None if a is None else mx.where(keep.reshape(-1, *([1] * (a.ndim - 1))), a, 0)
            for a in self.cache
        ]

    def keep_rows(self, rows: mx.array, capacity: int) -> None:
        del capacity  # a state has no positions
        self.cache = [None if a is None else a[rows] for a in self.cache]

    def parts(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.parts())


def gather_states(
    layers: list[tuple[int, LayerState]], sources: list[tuple[int, int] | None], size: int
) -> list[mx.array | None]:
    """The state arrays of a new batch: row r copies row sources[r][1] of the layer whose
    batch id is sources[r][0] (`layers`: (batch id, its LayerState) of every source batch),
    zeros for rows with no source (a new sequence: mlx-lm's empty cache is zeros)."""
    out: list[mx.array | None] = []
    for i in range(size):
        held = [(bid, layer[i]) for bid, layer in layers if layer[i] is not None]
        if not held:
            out.append(None)
            continue
        template = held[0][1]
        blocks, at, index = [], {}, 0
        for bid, array in held:
            blocks.append(array)
            at[bid] = index
            index += array.shape[0]
        zero = index
        rows = [zero if s is None or s[0] not in at else at[s[0]] + s[1] for s in sources]
        if zero in rows:
            blocks.append(mx.zeros((1, *template.shape[1:]), template.dtype))
        stacked = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0)
        out.append(stacked[mx.array(rows, dtype=mx.int32)])
    return out


Groups = list[tuple[np.ndarray, int]] | None  # (rows, their width) each; None: all rows full


def width_groups(widths: np.ndarray, t: int) -> Groups:
    """The rows of each width (None when every row fills the forward's width `t`)."""
    widths = np.minimum(widths, t)
    if (widths == t).all():
        return None
    return [(np.flatnonzero(widths == w), int(w)) for w in np.unique(widths) if w > 0]


def run_state_layer(layer, hidden: mx.array, state: LayerState | None, groups: Groups):
    """`layer(hidden, None, cache=state)` on each row's real slots only (see the module
    docstring); slots past a row's width keep their hidden states."""
    if groups is None:
        return layer(hidden, None, cache=state)
    if len(groups) == 1 and len(groups[0][0]) == hidden.shape[0]:  # one width, all rows
        width = groups[0][1]
        return mx.concatenate([layer(hidden[:, :width], None, cache=state), hidden[:, width:]], 1)
    out = hidden
    for rows, width in groups:
        idx = mx.array(rows, dtype=mx.int32)
        sub = None
        if state is not None:
            sub = LayerState(len(state.cache))
            sub.cache = [None if a is None else a[idx] for a in state.cache]
        out[idx, :width] = layer(hidden[idx, :width], None, cache=sub)
        if sub is not None:
            for i, part in enumerate(sub.cache):
                if part is None:
                    continue
                whole = state.cache[i]
                if whole is None:
                    whole = mx.zeros((hidden.shape[0], *part.shape[1:]), part.dtype)
                whole[idx] = part
                state.cache[i] = whole
    return out


def state_bytes(layers: list, caches: tuple, hidden_size: int, dtype: mx.Dtype) -> int:
    """Bytes one sequence's recurrent state takes in these layers, whatever its length
    (a KV layer's cost grows per token instead: kv_format.bytes_per_token). Each
    recurrent layer is called on one token; MLX only builds the graph, so the state's
    shapes are known and nothing is computed."""
    x = mx.zeros((1, 1, hidden_size), dtype)
    total = 0
    for layer, kind in zip(layers, caches, strict=True):
        if kind.recurrent:
            state = LayerState(kind.state)
            layer(x, None, cache=state)
            total += state.nbytes()
    return total


_MODEL_STATE: dict[tuple[str, str], int] = {}


def model_state_bytes(config, dtype: mx.Dtype) -> int:
    """state_bytes over every layer of the model `config` describes, from mlx-lm's model
    built without weights (its parameters stay lazy: nothing is allocated)."""
    key = (str(config.path), str(dtype))
    if key not in _MODEL_STATE:
        _MODEL_STATE[key] = _model_state_bytes(config, dtype)
    return _MODEL_STATE[key]


def _model_state_bytes(config, dtype: mx.Dtype) -> int:
    import importlib

    from common.model_families import find_layers, layer_caches

    if config.diffusion:
        return 0
    arch = importlib.import_module(f"mlx_lm.models.{config.family}")
    model = arch.Model(arch.ModelArgs.from_dict(config.mlx_args()))
    layers = find_layers(model, config.family).layers
    caches = layer_caches(model, config.family, len(layers))
    if not any(c.recurrent for c in caches):
        return 0
    model.set_dtype(dtype)
    return state_bytes(layers, caches, config.hidden_size, dtype)
