"""Running mlx-lm families on real clusters for tests: mlx-lm's own greedy tokens for a
list of prompts, requests sent at once (batched into micro-batches in flight), streams
with a fault applied mid-generation, and a coordinator in front of a started worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from common.generation_params import GenerationParams
from common.tokenizer import Tokenizer
from tests.support.checkpoints import SLIDING_WINDOW, mlx_lm_greedy
from tests.support.cluster_harness import Proc, cluster_name, start_coordinator, start_worker
from wedlm_client.client import WedlmClient

# 46 tokens: longer than the window and than the prefix cache's blocks of 16
SYSTEM = "You are a careful robot that counts: one two three four five six seven eight nine ten. "
QUESTIONS = ["what comes after five", "the quick brown fox", "she sells"]
OTHERS = ["once upon a time there was a little robot", "def main(): return 1", "sea shore"]
MAX_TOKENS = 16


def encode_all(path: Path, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer(path)
    return [tok.encode(t) for t in texts]


def mlx_lm_tokens(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's generate_step for each prompt alone (greedy, float32)."""
    stop_ids = Tokenizer(path).stop_ids
    return [mlx_lm_greedy(path, ids, max_tokens, stop_ids) for ids in prompts]


def at_once(address: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """The prompts sent together in AR mode, one client each: their results in order
    (tokens, cached_tokens...)."""
    results: dict[int, dict] = {}
    params = GenerationParams(mode="ar", max_tokens=max_tokens)

    def one(i: int) -> None:
        with WedlmClient(address, timeout=180) as client:
            results[i] = client.generate(ids=prompts[i], params=params)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert len(results) == len(prompts), f"{len(prompts) - len(results)} requests did not end"
    return [results[i] for i in range(len(prompts))]


def streams_with_fault(
    address: str, prompts: list[list[int]], max_tokens: int, fault: Callable[[], None]
) -> list[list[int]]:
    """AR streams of the prompts at once; `fault` runs once every stream has a few tokens
    and none is near its end; each stream's finished tokens."""
    results: dict[int, dict] = {}
    progress = [0] * len(prompts)
    params = GenerationParams(mode="ar", max_tokens=max_tokens)

    def run(i: int) -> None:
        with WedlmClient(address, timeout=300) as client:
            for event in client.generate_stream(ids=prompts[i], params=params):
                if event[0] == "tokens":
                    progress[i] += len(event[1])
                else:
                    results[i] = event[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while min(progress) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert min(progress) >= 4 and max(progress) < max_tokens * 3 // 4, progress  # mid-stream
    fault()
    for t in threads:
        t.join(300)
    assert len(results) == len(prompts), f"{len(prompts) - len(results)} streams did not end"
    assert all(r["finish_reason"] in ("length", "stop") for r in results.values()), results
    return [results[i]["tokens"] for i in range(len(prompts))]


def coordinator_before(
    path: Path, name: str, address: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[Proc, str]:
    """A serving coordinator (no Bonjour) in front of the worker at `address`."""
    coord, grpc = start_coordinator(
        path, name, "--no-bonjour", "--expect", "1", "--worker", address, *extra, env=env
    )
    try:
        coord.expect("serving", timeout=240)
    except BaseException:
        coord.stop()
        raise
    return coord, grpc


def check_prefixes(grpc: str, path, cached: bool, forks_anywhere: bool = True) -> None:
    """The shared-prefix prompts (one twice, its conversation's next turn, then the rest
    at once with other prompts): each request's tokens are mlx-lm's for it alone.
    `cached`: the cluster's prefix cache served the repeated and shared prefixes (only
    whole entries, a conversation's earlier turn, where `forks_anywhere` is False: a
    recurrent state is held for its whole sequence), else none of it."""
    shared = encode_all(path, [SYSTEM + q for q in QUESTIONS])
    others = encode_all(path, OTHERS)
    want = mlx_lm_tokens(path, shared + others, MAX_TOKENS)
    prefix = len(encode_all(path, [SYSTEM])[0])
    assert prefix > SLIDING_WINDOW
    first, again = (at_once(grpc, shared[:1], MAX_TOKENS)[0] for _ in range(2))
    assert first["tokens"] == again["tokens"] == want[0]
    turn = shared[0] + first["tokens"] + encode_all(path, [" and then?"])[0]
    (next_turn,) = at_once(grpc, [turn], MAX_TOKENS)
    assert next_turn["tokens"] == mlx_lm_tokens(path, [turn], MAX_TOKENS)[0]
    batched = at_once(grpc, shared[1:] + others, MAX_TOKENS)  # a batch of 5 requests
    assert [r["tokens"] for r in batched] == want[1:]
    if not cached:
        assert all(r["cached_tokens"] == 0 for r in [first, again, next_turn, *batched])
        return
    assert next_turn["cached_tokens"] >= len(shared[0]), next_turn["cached_tokens"]
    if forks_anywhere:  # the blocks of 16 that the shared prefix fills, at least
        hits = [again["cached_tokens"]] + [r["cached_tokens"] for r in batched[:2]]
        assert all(h >= prefix // 16 * 16 for h in hits), hits


@contextmanager
def three_stages(path: Path) -> Iterator[tuple[list[tuple[Proc, str]], str]]:
    """The coordinator and two workers that take the layers they are given (3 stages, 2
    micro-batches in flight), serving: (the workers and their addresses, the gRPC address).
    Every process is stopped on the way out."""
    name = cluster_name()
    workers = [start_worker(path, name, "--no-bonjour") for _ in range(2)]
    procs = [w for w, _ in workers]
    try:
        listed = [a for _, addr in workers for a in ("--worker", addr)]
        coord, grpc = start_coordinator(
            path, name, "--no-bonjour", *listed, "--expect", "2", "--micro-batches", "2"
        )
        procs.append(coord)
        coord.expect("serving", timeout=240)
        yield workers, grpc
    finally:
        for p in procs:
            p.stop()
