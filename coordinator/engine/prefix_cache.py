"""The prefix cache's index, on the coordinator. Finished sequences leave their KV rows on
the stages that computed them; this index remembers which tokens those rows hold, finds
the longest cached prefix of a new prompt, and says which rows the stages may drop.

Entries are whole finished sequences: the stages keep their rows under the sequence's id
and a hit copies the first n rows into the new sequence (ForwardRequest.forks). The index
is a hash chain over blocks of BLOCK tokens (each block's key hashes its parent's key and
its tokens, as vLLM's block hashes do), so a lookup walks the prompt once; the match is
then extended token by token against the entries holding the deepest block, since a fork
copies any number of rows (a prompt that diverges mid-block keeps the part of the block that
agrees). So a hit is the longest common token prefix with any entry, whole entries or not:
an agent's next turn, whose template re-renders the last answer differently from the tokens
that were generated (a dropped reasoning block, a tool call re-serialized), still reuses
every row before the first token that differs.

An entry whose tokens are a prefix of a newer one is dropped for it (a conversation's
turns keep one entry, not one per turn). Eviction is least recently used, never of an
entry a fork in flight still reads from (pinned).

A family with recurrent layers (linear attention, Mamba; `forks_anywhere=False`) cannot
fork a state at an arbitrary prefix: it holds the state of its whole sequence only. Its
hits are whole entries, an entry's tokens all a prefix of the prompt (a conversation's
next turn, which starts with the last turn's prompt and answer); any other prompt is
prefilled whole, so greedy tokens are the same with the cache on and off."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

BLOCK = 16  # tokens per index block; hits shorter than one block are not worth a copy
DEFAULT_SHARE = 0.5  # of the KV admission budget, when no --prefix-cache-tokens is given
DEFAULT_TOKENS = 32768  # when the budget is unknown


@dataclass
class Entry:
    entry_id: int  # the finished sequence's id: the stages keep its rows under it
    tokens: np.ndarray  # [n] int32: KV rows [0, n) of the stages hold these tokens
    keys: list[int]  # chained keys of its full blocks
    last_used: int
    pins: int = 0  # forks launched from it whose forward has not completed


@dataclass
class PrefixHit:
    source: int  # the entry's id
    length: int  # leading rows taken from it
    sent: bool = False  # the fork has gone out with a forward (the stages hold the rows)
    pinned: bool = False  # its entry is pinned for it (take, until unpin)


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    evictions: int = 0


def block_keys(tokens: np.ndarray, block: int = BLOCK) -> list[int]:
    """The chained key of each full block of `tokens`."""
    keys, parent = [], 0
    for start in range(0, len(tokens) - block + 1, block):
        parent = hash((parent, tokens[start : start + block].tobytes()))
        keys.append(parent)
    return keys


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class PrefixCache:
    """`capacity_tokens`: a fixed budget of cached KV rows; None: `share` of the KV
    admission budget (the stages' measured free memory), or DEFAULT_TOKENS when unknown."""

    capacity_tokens: int | None = None
    share: float = DEFAULT_SHARE
    block: int = BLOCK
    entries: dict[int, Entry] = field(default_factory=dict)
    stats: CacheStats = field(default_factory=CacheStats)
    tokens: int = 0  # KV rows the entries hold
    forks_anywhere: bool = True  # False: hits are whole entries (recurrent state)
    _by_key: dict[int, set[int]] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count)
    _dropped: list[int] = field(default_factory=list)  # ids whose rows the stages may drop

    def capacity(self, kv_tokens: int | None) -> int:
        if self.capacity_tokens is not None:
            return self.capacity_tokens
        return DEFAULT_TOKENS if kv_tokens is None else int(kv_tokens * self.share)

    # ---- lookups ------------------------------------------------------------------
    def find(self, prompt: list[int]) -> PrefixHit | None:
        """The longest cached prefix of `prompt` that leaves at least its last token to
        run (its logits start decoding), without taking it."""
        ids = np.asarray(prompt, dtype=np.int32)
        best: set[int] = set()
        seen: set[int] = set()  # every entry met on the walk (whole hits: any may fit)
        for key in block_keys(ids, self.block):
            holders = self._by_key.get(key)
            if not holders:
                break
            best = holders
            seen |= holders
        if not self.forks_anywhere:
            return self._whole_hit(ids, seen)
        if not best:
            return None
        # the holders of the deepest block agree up to it; past it the one agreeing longest
        # wins (a re-rendered turn diverges mid-block), the most recent among equals
        agree = {i: common_prefix(self.entries[i].tokens, ids) for i in best}
        source = max(best, key=lambda i: (agree[i], self.entries[i].last_used))
        length = min(agree[source], len(ids) - 1)
        return PrefixHit(source, length) if length >= self.block else None

    def _whole_hit(self, ids: np.ndarray, seen: set[int]) -> PrefixHit | None:
        """The longest entry whose tokens all begin `ids`, leaving its last token to run."""
        fits = [
            self.entries[i]
            for i in seen
            if len(self.entries[i].tokens) < len(ids)
            and common_prefix(self.entries[i].tokens, ids) == len(self.entries[i].tokens)
        ]
        if not fits:
            return None
        entry = max(fits, key=lambda e: (len(e.tokens), e.last_used))
        return PrefixHit(entry.entry_id, len(entry.tokens))

    def take(self, hit: PrefixHit) -> None:
        """A request starts from `hit`: pin its entry until the fork has run."""
        entry = self.entries[hit.source]
        entry.pins += 1
        hit.pinned = True
        entry.last_used = next(self._clock)
        self.stats.hits += 1
        self.stats.hit_tokens += hit.length

    def unpin(self, hit: PrefixHit) -> None:
        if hit.pinned:
            hit.pinned = False
            entry = self.entries.get(hit.source)
            if entry is not None:
                entry.pins -= 1

    # ---- entries ------------------------------------------------------------------
    def insert(self, seq_id: int, tokens: list[int], kv_tokens: int | None) -> None:
        """A finished sequence whose stages hold KV rows for `tokens`: keep them as an
        entry, or let them go (too short, already covered, or no room)."""
        ids = np.asarray(tokens, dtype=np.int32)
        keys = block_keys(ids, self.block)
        if not keys:
            self._dropped.append(seq_id)
            return
        for other in list(self._by_key.get(keys[-1], ())):
            entry = self.entries[other]
            # (whole hits: only an equal entry serves what this one would)
            longer = (
                len(entry.tokens) >= len(ids)
                if self.forks_anywhere
                else (len(entry.tokens) == len(ids))
            )
            if longer and common_prefix(entry.tokens, ids) == len(ids):
                entry.last_used = next(self._clock)  # covered: the older rows serve it
                self._dropped.append(seq_id)
                return
        for key in keys:  # entries the new one covers give way to it
            for other in list(self._by_key.get(key, ())):
                entry = self.entries[other]
                short = entry.pins == 0 and len(entry.tokens) <= len(ids)
                if short and common_prefix(entry.tokens, ids) == len(entry.tokens):
                    self._remove(entry)
        entry = Entry(seq_id, ids, keys, next(self._clock))
        self.entries[seq_id] = entry
        self.tokens += len(ids)
        for key in keys:
            self._by_key.setdefault(key, set()).add(seq_id)
        self.shrink(self.capacity(kv_tokens))

    def shrink(self, limit: int, spare: int | None = None) -> int:
        """Evict least recently used entries until at most `limit` tokens are cached;
        returns the tokens freed (pinned entries and `spare` stay)."""
        freed = 0
        if self.tokens <= limit:
            return 0
        for entry in sorted(self.entries.values(), key=lambda e: e.last_used):
            if self.tokens <= limit:
                break
            if entry.pins == 0 and entry.entry_id != spare:
                freed += len(entry.tokens)
                self._remove(entry)
                self.stats.evictions += 1
        return freed

    def _remove(self, entry: Entry) -> None:
        del self.entries[entry.entry_id]
        self.tokens -= len(entry.tokens)
        for key in entry.keys:
            holders = self._by_key.get(key)
            if holders is not None:
                holders.discard(entry.entry_id)
                if not holders:
                    del self._by_key[key]
        self._dropped.append(entry.entry_id)

    def clear(self) -> list[int]:
        """Forget every entry (after a fault: KV is rebuilt by use, never trusted stale);
        returns every id whose rows the stages may still hold."""
        ids = list(self.entries) + self.take_dropped()
        self.entries.clear()
        self._by_key.clear()
        self.tokens = 0
        return ids

    def take_dropped(self) -> list[int]:
        """Ids whose rows the stages may drop now (evicted, covered or not kept)."""
        dropped, self._dropped = self._dropped, []
        return dropped


def count_late_rows(plans) -> None:
    """Rows a forward ran for an AR sequence that had finished already (the look-ahead
    row after its stop token; a forward in flight when it was cancelled) became permanent
    on the stages: count them in its KV length, so that a recurrent family's cache entry
    names exactly the tokens its stages' states have run. Before postprocess, which skips
    finished sequences."""
    for plan in plans:
        seq = plan.seq
        if seq.finished and seq.params.mode == "ar":
            seq.kv_length += plan.keep
