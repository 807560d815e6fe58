"""n > 1: the choices of one request prefill their prompt once. The first choice (the
leader) prefills it; each other choice (`Sequence.share_from`) is admitted as usual but
waits until the leader's prompt is in every stage's KV, then starts as a fork of its
first P - 1 rows (the prefix cache's fork: RowsSpec.forks, copied in the gather that
brings the new row into its first batch) and prefills only the last prompt token, whose
logits start its own decoding (its own seed). Its tokens are then those of an
independent request: the same rows, the same first logits, the same sampling keys.

The leader's rows are kept (not reaped) until every fork that reads them has run; a
leader that can no longer give them (it failed, it was cancelled before its prompt was
in, its KV was lost) lets its siblings prefill on their own."""

from __future__ import annotations

from coordinator.engine.prefix_cache import PrefixHit
from coordinator.engine.sequence import Phase, Sequence


def can_share(seq: Sequence, leader: Sequence) -> bool:
    """Whether `seq` may start from `leader`'s prompt rows (the same prompt, at least
    one row to copy, and the leader still running)."""
    return len(seq.prompt) > 1 and seq.prompt == leader.prompt and not leader.finished


def prompt_in_kv(leader: Sequence) -> bool:
    """Every stage holds the leader's prompt rows (its prefill forward has completed)."""
    return (
        leader.phase not in (Phase.WAITING, Phase.PREFILL, Phase.ERROR)
        and not leader.rebuild_to
        and leader.prefilled == len(leader.prompt)
        and leader.kv_length >= len(leader.prompt) - 1
    )


def waits(seq: Sequence, running: set[int]) -> bool:
    """Whether `seq` must wait for its leader's prompt rows (`running`: the ids the
    scheduler still holds)."""
    leader = seq.share_from
    if leader is None or seq.prefix is not None:
        return False
    gone = leader.finished or leader.seq_id not in running
    return not gone and not prompt_in_kv(leader)


def start_shared(seq: Sequence, running: set[int]) -> None:
    """Before `seq`'s first prefill plan (it does not wait): fork the leader's rows, or,
    when the leader cannot give them any more, prefill alone."""
    leader = seq.share_from
    if leader is None or seq.prefix is not None:
        return
    if prompt_in_kv(leader) and leader.seq_id in running:
        length = len(seq.prompt) - 1
        seq.start_from(PrefixHit(leader.seq_id, length))
        seq.shared_tokens = length
    else:
        seq.share_from = None  # the leader's prompt never got in, or its rows are gone


def forked(seq: Sequence) -> None:
    """`seq`'s fork has run on every stage: the leader's rows are no longer needed."""
    if seq.share_from is not None and seq.prefix is not None and seq.prefix.sent:
        seq.share_from = None


def leaders_in_use(seqs: list[Sequence], in_flight: set[int]) -> set[int]:
    """The leaders whose rows a sibling still needs: one waiting to fork, or one whose
    forward with the fork is in flight."""
    return {
        s.share_from.seq_id
        for s in seqs
        if s.share_from is not None and (not s.finished or s.seq_id in in_flight)
    }
