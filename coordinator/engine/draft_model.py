"""A small draft model on the coordinator: proposes k tokens per speculative forward, which
the cluster then verifies (--draft-model). It runs in the engine's MLX thread with a KV of
its own per sequence and shares the main model's tokenizer (checked at load).

Each round feeds every sequence the committed tokens its draft KV lacks (chunked for a new
prompt), then k - 1 single-token steps, each fed from the last one's argmax on the device:
the host reads the k drafts once at the end. The draft KV remembers which tokens it holds;
the next round keeps the longest prefix that is still the committed text (accepted drafts
included) and overwrites the rest."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from common.errors import CheckpointError
from common.layer_runner import LayerRunner
from common.model_config import ModelConfig
from common.model_parts import ModelParts, load_model_parts
from common.rows_spec import RowsSpec
from common.tokenizer import Tokenizer
from coordinator.engine.forward_shapes import padded_width
from coordinator.engine.sequence import Sequence

log = logging.getLogger(__name__)

CATCH_UP_CHUNK = 512  # committed tokens fed to the draft model per forward (new prompts)


class DraftModel:
    def __init__(self, parts: ModelParts, target: ModelConfig) -> None:
        """A loaded model (all layers and both ends) drafting for `target`; `load` checks
        that the two share a tokenizer."""
        self.parts = parts
        self.config = parts.config
        # Ids past the served model's table (padding rows of a larger table) never draft.
        self.vocab_limit = min(self.config.vocab_size, target.vocab_size)
        self.runner = LayerRunner(parts)
        self.held: dict[int, list[int]] = {}  # tokens in each sequence's draft KV, in order
        self.forwards = 0
        self.propose_s = 0.0  # wall time of the rounds (benchmarks split a step with it)

    @classmethod
    def load(cls, path: str | Path, target: ModelConfig, target_tokenizer: Tokenizer) -> DraftModel:
        path = Path(path).expanduser()
        tokenizer = Tokenizer(path)
        mine, theirs = tokenizer.vocabulary(), target_tokenizer.vocabulary()
        if mine != theirs:
            raise CheckpointError(
                f"the draft model {path} has another tokenizer than the served model "
                f"({len(mine)} tokens against {len(theirs)}"
                f"{', the same count with other ids' if len(mine) == len(theirs) else ''}): "
                "drafts must use the served model's token ids"
            )
        log.info("draft model %s loaded", path)
        return cls(load_model_parts(path), target)

    def propose(self, seqs: list[Sequence], counts: list[int]) -> None:
        """Set seq.drafts to up to counts[i] greedy draft tokens for each sequence."""
        started = time.perf_counter()
        try:
            self._propose(seqs, counts)
        finally:
            self.propose_s += time.perf_counter() - started

    def _propose(self, seqs: list[Sequence], counts: list[int]) -> None:
        if not seqs or max(counts) <= 0:
            for seq in seqs:
                seq.drafts = np.zeros(0, np.int32)
            return
        histories = [seq.prompt + seq.output for seq in seqs]
        for seq, history in zip(seqs, histories, strict=True):
            self._sync(seq.seq_id, history)
        # New prompts first, in chunks, until each sequence lacks at most one chunk.
        while True:
            behind = [
                i for i, (s, h) in enumerate(zip(seqs, histories, strict=True))
                if len(h) - len(self.held[s.seq_id]) > CATCH_UP_CHUNK
            ]  # fmt: skip
            if not behind:
                break
            feeds = [
                histories[i][len(self.held[seqs[i].seq_id]) :][:CATCH_UP_CHUNK] for i in behind
            ]
            self._forward([seqs[i].seq_id for i in behind], feeds, heads=False)
        ids = [s.seq_id for s in seqs]
        feeds = [h[len(self.held[s.seq_id]) :] for s, h in zip(seqs, histories, strict=True)]
        token = self._forward(ids, feeds, heads=True)  # [B] the first drafts, on the device
        drafted = [token]
        for _ in range(max(counts) - 1):
            token = self._forward(ids, token[:, None], heads=True)
            drafted.append(token)
        drafts = np.array(mx.stack(drafted, axis=1))  # the one host sync of the round
        for seq, row, count in zip(seqs, drafts, counts, strict=True):
            seq.drafts = row[: max(count, 0)].astype(np.int32)
            # the draft KV now holds the history and every draft but the last
            self.held[seq.seq_id] += [int(t) for t in row[: len(drafted) - 1]]

    def _sync(self, seq_id: int, history: list[int]) -> None:
        """Keep the draft KV's longest prefix that is still committed text, leaving at least
        the last committed token to feed (its logits give the first draft)."""
        held = self.held.setdefault(seq_id, [])
        limit = min(len(held), len(history) - 1)
        same = 0
        while same < limit and held[same] == history[same]:
            same += 1
        if same < len(held):
            del held[same:]
            self.runner.store.truncate(seq_id, same)

    def _forward(self, seq_ids: list[int], feeds, heads: bool) -> mx.array | None:
        """Feed each row its tokens (all kept: committed text or drafts); with `heads`,
        return the argmax after each row's last token."""
        if isinstance(feeds, mx.array):  # [B, 1] device tokens of the previous step
            widths = np.ones(len(seq_ids), np.int64)  # `held` learns them once read
            tokens = feeds
        else:
            widths = np.array([len(f) for f in feeds], np.int64)
            width = padded_width(int(widths.max()))
            host = np.zeros((len(seq_ids), width), np.int32)
            for row, (sid, feed) in enumerate(zip(seq_ids, feeds, strict=True)):
                host[row, : len(feed)] = feed
                self.held[sid] += [int(t) for t in feed]
            tokens = mx.array(host)
        width = tokens.shape[1]
        spec = RowsSpec(
            seq_ids=list(seq_ids),
            starts=np.array([self.runner.store.length(s) for s in seq_ids], np.int64),
            widths=widths,
            filled=np.arange(width)[None, :] < widths[:, None],
            keeps=widths,
        )
        hidden = self.runner.forward(spec, self.parts.embed(tokens), validate=False)
        self.forwards += 1
        if not heads:
            mx.async_eval(hidden)
            return None
        last = mx.array(widths - 1, dtype=mx.int32)[:, None, None]
        final = mx.take_along_axis(hidden, last, axis=1)[:, 0]
        logits = self.parts.head(final)[:, : self.vocab_limit]
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def release(self, seq_ids: list[int]) -> None:
        gone = [s for s in seq_ids if s in self.held]
        for sid in gone:
            del self.held[sid]
        if gone:
            self.runner.release(gone)
