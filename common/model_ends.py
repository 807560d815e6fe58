"""The ends of an mlx-lm model (embedding, final norm, head) run by mlx-lm's own code.

Families differ in what surrounds their layers: Gemma scales the embedding, some cap the
logits, tie the head to the embedding, scale the logits, norm before the head... Rather
than a table of such quirks, the ends keep mlx-lm's whole model object with its layer
list swapped for one relay: to embed, the model runs up to its first layer and the relay
hands back that layer's input; for the head, the relay stands for all layers and returns
the hidden states given, and mlx-lm's code does the rest. When a probe shows a family's
ends are the plain `embed_tokens` / `norm` + `lm_head` (or a tied head), those modules are
called directly: the same values, without building the model's masks each call."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from common.errors import CheckpointError
from common.layer_calls import returned_tuple
from common.model_families import LayerList


class _Captured(Exception):
    def __init__(self, hidden: mx.array) -> None:
        super().__init__("first layer input")
        self.hidden = hidden


class _Slot:
    """A plain holder: an mx.array set on an nn.Module would become a parameter."""

    hidden: mx.array | None = None


class _EndCache:
    """What a family's forward reads of its caches before and after its layers (the start
    offset, llama4's chunk trimming), for forwards that never reach a real layer: the
    relay stands in for them, so nothing is ever stored here."""

    offset = 0
    start_position = 0
    keys = values = None

    def maybe_trim_front(self) -> None:
        pass


class _Relay(nn.Module):
    """Stands in for the model's whole layer list. What the model's loop reads of a layer
    (llama's `use_sliding`, a layer type) is read from its first real layer."""

    def __init__(self, first: nn.Module) -> None:
        super().__init__()
        self.slot = _Slot()
        object.__setattr__(self, "_first", first)  # not a child: its weights are not ours

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_first"), name)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        if self.slot.hidden is None:
            raise _Captured(x)
        # as the real layer returns it (Gemma 4's loop unpacks a tuple, hidden first)
        size = returned_tuple(object.__getattribute__(self, "_first"))
        return (self.slot.hidden, *([None] * (size - 1))) if size else self.slot.hidden


class ModelEnds(nn.Module):
    """mlx-lm's model without its layers; parameter names are the checkpoint's own."""

    def __init__(self, model: nn.Module, layer_list: LayerList) -> None:
        super().__init__()
        self.model = model
        relay = _Relay(layer_list.layers[0])
        layer_list.owner[layer_list.attr] = [relay]
        # plain attributes, not children: the parameters stay the model's, named once
        object.__setattr__(self, "_relay", relay)
        object.__setattr__(self, "_inner", layer_list.owner)
        # families index cache[i] by layer number (gpt-oss, Gemma 3): one entry per layer
        object.__setattr__(self, "_caches", [None] * len(layer_list.layers))
        self._direct = False

    def embed_module(self) -> nn.Module | None:
        module = self._inner.get("embed_tokens")
        return module if isinstance(module, nn.Module) else None

    def embed(self, tokens: mx.array) -> mx.array:
        if self._direct:
            return self._inner.embed_tokens(tokens)
        flat = tokens.reshape(1, -1)
        try:
            self.model(flat, cache=self._caches)
        except _Captured as c:
            return c.hidden.reshape(*tokens.shape, -1)
        raise CheckpointError("the model never reached its first layer")

    def head(self, hidden: mx.array) -> mx.array:
        if self._direct:
            out = self._inner.norm(hidden)
            if "lm_head" in self.model:
                return self.model.lm_head(out)
            return self._inner.embed_tokens.as_linear(out)
        flat = hidden.reshape(1, -1, hidden.shape[-1])
        self._relay.slot.hidden = flat
        try:
            out = self.model(mx.zeros(flat.shape[:2], mx.int32), cache=self._caches)
        finally:
            self._relay.slot.hidden = None
        return out.reshape(*hidden.shape[:-1], -1)

    def _run_ends(self, tokens: mx.array, family: str | None = None):
        """Embed and head once, evaluated. With `family`, a failure is refused."""
        try:
            x = self.embed(tokens)
            logits = self.head(x)
            mx.eval(x, logits)
        except CheckpointError:
            raise
        except Exception as e:
            if family is None:
                raise
            self._refuse(family, e)
        return x, logits

    @staticmethod
    def _refuse(family: str, e: Exception) -> None:
        """A family's own code failing on the relay: refuse it in one line."""
        raise CheckpointError(
            f"mlx-lm's {family} model cannot be split at its layers by this engine: "
            f"{type(e).__name__}: {e}"
        ) from None

    def probe(self, family: str, hidden_size: int) -> None:
        """Run mlx-lm's ends once (a family whose code this cannot drive is refused at
        load, not at the first request); take the direct calls when they agree."""
        tokens = mx.array([[1, 2, 3]], dtype=mx.int32)
        try:
            x, logits = self._run_ends(tokens)
        except (AttributeError, TypeError):
            # a forward that reads its caches' offsets (ministral3, llama4): give it
            # caches that answer, as mlx-lm's own would before the first token
            object.__setattr__(self, "_caches", [_EndCache() for _ in self._caches])
            x, logits = self._run_ends(tokens, family)
        except CheckpointError:
            raise
        except Exception as e:
            self._refuse(family, e)
        if x.shape != (1, 3, hidden_size):
            raise CheckpointError(
                f"mlx-lm's {family} model feeds its layers {tuple(x.shape)}, expected "
                f"(1, 3, {hidden_size})"
            )
        embed, norm = self.embed_module(), self._inner.get("norm")
        if embed is None or not isinstance(norm, nn.Module):
            return
        tied = "lm_head" not in self.model
        if tied and not hasattr(embed, "as_linear"):
            return
        direct_x = embed(tokens)
        out = norm(x)
        direct = embed.as_linear(out) if tied else self.model.lm_head(out)
        if mx.array_equal(direct_x, x).item() and mx.array_equal(direct, logits).item():
            self._direct = True
