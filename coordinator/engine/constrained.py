"""Grammar-constrained decoding (structured output) with llguidance.

A request's params.grammar is an llguidance grammar (from a JSON schema, a Lark grammar or
a regex: coordinator/http_api/response_format.py). Its sequence gets a matcher when
submitted; before a forward's tokens are chosen, the matcher's allowed-token bitmask (32
tokens per int32, filled on the host) goes to the device, where it is expanded and added to
the row's logits as -inf for forbidden tokens; the tokens committed after the forward are
fed back to the matcher.

Every decoding mode keeps its parallel commits, and the output always matches the grammar:
- autoregressive: the one slot is chosen under the mask;
- speculative: the drafts are known before the forward, so the choice after each draft
  gets the mask of the state after the drafts before it (the matcher is advanced through
  them and rolled back); a draft the grammar forbids can never equal the masked choice at
  its slot, so verification cuts the run there, and the output is constrained AR's;
- WeDLM: only the first slot after the committing run has a known prefix; it is chosen
  under the mask. Later slots are filled from the raw logits, and before a window's
  leading filled run commits it is checked token by token against the grammar and cut at
  the first token it forbids, which becomes a mask again (chosen under the mask once it
  is the first slot). Every forward whose first slot fills makes progress. With the
  engine's constrained_ahead on, constrained rows are launched ahead too (wedlm_ahead.py),
  and a look-ahead forward launched from a window whose run is then cut is dropped and
  launched again from the cut window (engine._drop_ahead).

The masks are filled on the engine thread before selection and applied last, right
before sampling (apply_masks). With the engine's fill_ahead on, the fill (fill_masks) runs
on a thread of its own from the moment its matchers have taken the committed tokens,
overlapping the engine thread's other host work. Both switches are off by default: on an
H100 they cost more than they hid (RESULTS.md GC2)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from common.errors import InvalidRequest
from common.generation_params import GenerationParams
from common.modes import Mode
from common.tokenizer import Tokenizer
from coordinator.engine.row_plan import RowPlan
from coordinator.engine.sequence import Phase, Sequence


class Grammars:
    """The llguidance view of one tokenizer (built once, on first use: about a second for
    a large vocabulary) and the matchers made with it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
        self._tokenizer, self.vocab_size, self._stop_ids = tokenizer, vocab_size, stop_ids
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # llguidance's thread pool: a forward's constrained rows are filled together
        self.executor = llguidance.LLExecutor()
        # the engine starts a forward's fill here as soon as its matchers are advanced,
        # so the fill overlaps the engine thread's other host work (fill_masks)
        self.filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.hf.from_tokenizer(
                    self._tokenizer.hf_tokenizer,
                    n_vocab=self.vocab_size,
                    eos_token=list(self._stop_ids) or None,
                )
            return self._ll

    def check(self, grammar: str) -> None:
        """InvalidRequest with llguidance's words when the grammar cannot be used."""
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if problem:
            raise InvalidRequest(f"the grammar is not valid: {problem}")

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the grammar is not valid: {matcher.get_error()}")
        return matcher


def sequential_params(params: GenerationParams) -> GenerationParams:
    """A penalized request decodes autoregressively: its logits depend on every token
    before the choice (logit_bias.py). A constrained one keeps its mode (module docstring)."""
    if not params.penalized or params.mode == Mode.AR:
        return params
    return replace(params, mode=Mode.AR, draft="auto")


def _slot_prefixes(plan: RowPlan) -> list[list[int]]:
    """For head slots 0, 1, ... of a constrained row, the tokens between its committed
    output (what its matcher has consumed) and the slot; nested, each one longer. Slots
    past the list are not masked."""
    seq = plan.seq
    if seq.phase is not Phase.DECODE or plan.head_slots.size == 0:
        return [[]]  # a prompt's last row chooses the first token
    if seq.params.mode == Mode.WEDLM:  # slot 0 follows this forward's committing run
        return [plan.commits]
    if seq.params.mode == Mode.SPECULATIVE:  # choice j follows drafts 0..j-1
        drafts = [int(t) for t in plan.tokens[plan.keep : plan.keep + plan.drafts]]
        return [drafts[:j] for j in range(len(drafts) + 1)]
    return [[]]


def _fill_job(
    matcher: llguidance.LLMatcher, stops: frozenset[int], prefixes: list[list[int]], row: int
):
    """The fill of a constrained row's slots (`prefixes` nested, each one longer; `stops`
    its stop ids): its matcher advanced through the first prefix (rolled back after the
    fill), and the job (matcher, first table row, drafts) whose masks go to table rows
    row, row + 1, ...: the state after the first prefix, then after each further token
    the grammar allows (stopping at the first it forbids or a stop token: a slot after
    one is never committed). Returns (job or None, tokens consumed, slots filled)."""
    base, drafts = prefixes[0], prefixes[-1][len(prefixes[0]) :]
    if any(t in stops for t in base) or matcher.validate_tokens(base) < len(base):
        return None, 0, 0
    if base:
        matcher.consume_tokens(base)
    end = next((j for j, t in enumerate(drafts) if t in stops), len(drafts))
    allowed = drafts[: matcher.validate_tokens(drafts[:end])] if end else []
    return (matcher, row, allowed), len(base), 1 + len(allowed)


@dataclass
class Masks:
    """A forward's allowed-token bitmasks, filled on the host: `table` rows of 32 tokens
    per int32 (row 0 allows every token) and `index[i, j]`, the table row of slot j of
    row i."""

    table: np.ndarray
    index: np.ndarray


@dataclass
class MaskJob:
    """What a forward's mask fill needs, read from its plans on the engine thread (the
    fill itself may then run on another: it touches the matchers only)."""

    rows: list[tuple[int, llguidance.LLMatcher, frozenset[int], list[list[int]]]]
    n: int
    k: int
    v: int


def mask_job(plans: list[RowPlan], k: int, v: int) -> MaskJob | None:
    """The fill of `plans`' constrained slots for logits [len(plans), k, v], or None when
    no row is constrained."""
    rows = []
    for i, plan in enumerate(plans):
        seq = plan.seq
        if seq.matcher is not None and not seq.matcher.is_error():
            rows.append((i, seq.matcher, seq.params.all_stop_ids, _slot_prefixes(plan)[:k]))
    return MaskJob(rows, len(plans), k, v) if rows else None


def fill_masks(job: MaskJob, executor: llguidance.LLExecutor) -> Masks:
    """Every row's masks filled together, on `executor`'s threads (a C = 32 forward fills
    32); llguidance releases the GIL meanwhile."""
    table = llguidance.numpy.allocate_token_bitmask(1 + sum(len(r[3]) for r in job.rows), job.v)
    table[0] = -1
    index = np.zeros((job.n, job.k), dtype=np.int32)
    used, jobs, consumed = 1, [], []
    for i, matcher, stops, prefixes in job.rows:
        one, taken, count = _fill_job(matcher, stops, prefixes, used)
        if one is not None:
            jobs.append(one)
            consumed.append((matcher, taken))
        index[i, :count] = np.arange(used, used + count)
        used += count
    plain = [(matcher, row) for matcher, row, drafts in jobs if not drafts]
    if plain:
        llguidance.numpy.fill_next_token_bitmask_par(executor, plain, table)
    drafted = [one for one in jobs if one[2]]  # llguidance refuses empty drafts here
    if drafted:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(executor, drafted, table)
    for matcher, taken in consumed:
        if taken:
            matcher.rollback(taken)
    return Masks(table[:used], index)


def take_and_fill(
    taken: list[tuple[llguidance.LLMatcher, int]], job: MaskJob, executor: llguidance.LLExecutor
) -> Masks:
    """Each matcher takes its row's committed token, then `job`'s masks are filled: an
    autoregressive look-ahead's fill, started before postprocess (engine._fill_early)."""
    for matcher, token in taken:
        matcher.consume_tokens([token])
    return fill_masks(job, executor)


_BITS = mx.array([1 << b for b in range(32)], dtype=mx.uint32)


def apply_masks(masks: Masks, logits: mx.array) -> mx.array:
    """Logits [N, K, V] with the tokens `masks` forbid at -inf. Each slot's words are
    gathered first and only then expanded to bits: one [N, K, V] expansion."""
    n, k, v = logits.shape
    words = mx.array(masks.table.view(np.uint32))[mx.array(masks.index)]  # [N, K, V / 32]
    allowed = ((words[..., None] & _BITS) != 0).reshape(n, k, -1)
    if allowed.shape[-1] != v:
        allowed = allowed[..., :v]
    return mx.where(allowed, logits, mx.array(-float("inf"), logits.dtype))


def mask_logits(
    plans: list[RowPlan], logits: mx.array, executor: llguidance.LLExecutor
) -> mx.array:
    """Logits [N, K, V] with the forbidden tokens of every constrained slot at -inf: the
    first slot of each constrained row (its matcher's state after what commits before
    it), and a speculative row's choice after each draft the grammar allows. The serial
    form of mask_job, fill_masks and apply_masks (the engine may fill ahead, on a
    thread)."""
    _, k, v = logits.shape
    job = mask_job(plans, k, v)
    return logits if job is None else apply_masks(fill_masks(job, executor), logits)


def advance(
    plans: list[RowPlan], before: list[int], taken: frozenset[int] = frozenset()
) -> set[int]:
    """After postprocess: feed each constrained sequence's newly committed tokens to its
    matcher, then cut a WeDLM window's leading filled run (it commits with the next
    forward) at the first token the grammar forbids: that slot becomes a mask again, to
    be chosen under the mask. Returns the ids of the sequences whose run was cut (a
    look-ahead forward built from their uncut window is stale). Sequences in `taken`
    had their matcher take their tokens already (take_and_fill)."""
    cut = set()
    for plan, start in zip(plans, before, strict=True):
        seq: Sequence = plan.seq
        if seq.matcher is None or seq.finished or seq.seq_id in taken:
            continue
        new = seq.output[start:]
        if new:
            seq.matcher.consume_tokens(new)
        if seq.params.mode == Mode.WEDLM and seq.phase is Phase.DECODE:
            run = seq.window_tokens[: seq.leading_filled()].tolist()
            allowed = _allowed_run(seq.matcher, run, seq.params.extra_stop_ids)
            if allowed < len(run):
                seq.window_filled = seq.window_filled.copy()
                seq.window_filled[allowed] = False
                cut.add(seq.seq_id)
    return cut


def _allowed_run(matcher: llguidance.LLMatcher, run: list[int], eos: tuple[int, ...]) -> int:
    """How many leading tokens of `run` the grammar allows after what the matcher has
    consumed. An end-of-sequence token (the grammar's, the model's stop ids) is allowed
    where the grammar may end (validate_tokens refuses it alone at a stopped state)."""
    end = next((j for j, t in enumerate(run) if t in eos), len(run))
    allowed = matcher.validate_tokens(run[:end])
    if allowed < end or end == len(run):
        return allowed
    if end:
        matcher.consume_tokens(run[:end])
    accepting = matcher.is_accepting()
    if end:
        matcher.rollback(end)
    return end + accepting
