"""The prefix cache's benchmarks, on real processes (the coordinator alone, and the
coordinator holding the first half of the layers + 1 worker: 2 stages). Prints one JSON
object and writes prefix_cache.json and prefix_cache.png to --out.

Phases (--phases):
  multiturn  A conversation of --history tokens (random ids), one turn answered
             (--answer tokens), then the next turn adds --turn tokens: the TTFT of that
             next turn (a cache hit: only the new tokens and the answer's last ones are
             prefilled) against the TTFT of a prompt of the same length that shares
             nothing (a miss: prefilled whole, as with the cache off), in AR and WeDLM
             mode, interleaved, --repeats times (medians).
  shared     A system prompt of --system tokens, --concurrent different questions of
             --question tokens submitted together (after one request has put the system
             prompt in the cache), against the same number of questions each behind a
             system prompt of its own: TTFT p50/p90, prompt tokens served from the cache
             and the aggregate prefill avoided.

Hits and misses run on the same server, side by side: a miss is exactly what the cache-off
server does (a prompt the cache holds nothing of is prefilled from scratch).

  python benchmarks/dev/prefix_cache.py --model default --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np

from benchmarks.dev.bench_cluster import Cluster
from benchmarks.dev.bench_io import add_random_model_flags, pyplot
from benchmarks.dev.serve import prepare_model
from common.generation_params import GenerationParams
from common.model_config import load_model_config
from wedlm_client.client import WedlmClient

REQUEST_TIMEOUT_S = 180.0
LAYOUTS = {"alone": 0, "stages2": 1}  # workers beside the coordinator (which holds layers)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def pct(values, q: float) -> float | None:
    values = [v for v in values if v is not None]
    return round(float(np.percentile(values, q)), 2) if values else None


def stream(address: str, ids: list[int], params: GenerationParams) -> dict:
    """One request: TTFT (submit to first committed token) and its final stats."""
    with WedlmClient(address, timeout=REQUEST_TIMEOUT_S) as client:
        t0, first, final = time.perf_counter(), None, None
        for event in client.generate_stream(ids=ids, params=params):
            if event[0] == "tokens" and first is None and event[1]:
                first = time.perf_counter()
            elif event[0] == "final":
                final = event[1]
    return {
        "ttft_ms": (first - t0) * 1e3 if first else None,
        "prefill_ms": final["prefill_s"] * 1e3,  # first prefill launch to the prompt's end
        "cached_tokens": final["cached_tokens"],
        "prompt_tokens": final["prompt_tokens"],
        "tokens": final["tokens"],
        "error": final.get("error", ""),
    }


class Ids:
    """Random prompt ids, never repeated across calls (so nothing is shared by chance)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def __call__(self, n: int) -> list[int]:
        return self.rng.integers(100, self.vocab - 100, n).tolist()


MODES = {
    "ar": lambda n: GenerationParams(mode="ar", max_tokens=n),
    "wedlm": lambda n: GenerationParams(mode="wedlm", threshold=0.4, window=16, max_tokens=n),
}


def phase_multiturn(address: str, ids: Ids, args) -> dict:
    rows: dict[str, dict[str, list]] = {
        m: {"hit_ms": [], "miss_ms": [], "hit_prefill": [], "miss_prefill": [], "cached": [],
            "prompt": []}
        for m in args.modes
    }  # fmt: skip
    for rep in range(args.repeats + 1):  # the first round warms shapes: not counted
        for mode in args.modes:
            make = MODES[mode]
            history = ids(args.history)
            answer = stream(address, history, make(args.answer))
            turn = history + answer["tokens"] + ids(args.turn)
            hit = stream(address, turn, make(args.next_tokens))
            miss = stream(address, ids(len(turn)), make(args.next_tokens))
            log(
                f"multiturn {mode} rep {rep}: hit {hit['ttft_ms']:.1f} ms ("
                f"{hit['cached_tokens']} cached of {len(turn)}), miss {miss['ttft_ms']:.1f} ms"
            )
            if rep:
                r = rows[mode]
                r["hit_ms"].append(hit["ttft_ms"])
                r["miss_ms"].append(miss["ttft_ms"])
                r["hit_prefill"].append(hit["prefill_ms"])
                r["miss_prefill"].append(miss["prefill_ms"])
                r["cached"].append(hit["cached_tokens"])
                r["prompt"].append(len(turn))
    out = {}
    for mode, r in rows.items():
        hit, miss = med(r["hit_ms"]), med(r["miss_ms"])
        out[mode] = {
            "ttft_hit_ms": hit,
            "ttft_miss_ms": miss,
            "miss_over_hit": round(miss / hit, 2) if hit and miss else None,
            # the prompt's part of TTFT (WeDLM's first commit also waits for a confident
            # leftmost slot, which depends on the text, not on the cache)
            "prefill_hit_ms": med(r["hit_prefill"]),
            "prefill_miss_ms": med(r["miss_prefill"]),
            "cached_tokens": med(r["cached"]),
            "prompt_tokens": med(r["prompt"]),
            "hit_ms_all": [round(v, 2) for v in r["hit_ms"]],
            "miss_ms_all": [round(v, 2) for v in r["miss_ms"]],
        }
    return out


def burst(address: str, prompts: list[list[int]], params: GenerationParams) -> list[dict]:
    results: list[dict | None] = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = stream(address, prompts[i], params)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def phase_shared(address: str, ids: Ids, args) -> dict:
    params = MODES["ar"](args.next_tokens)
    rounds: dict[str, list] = {"shared": [], "distinct": []}
    for rep in range(args.repeats + 1):
        system = ids(args.system)
        stream(address, system + ids(args.question), params)  # puts the system prompt in
        shared = burst(address, [system + ids(args.question) for _ in range(args.concurrent)],
                       params)  # fmt: skip
        distinct = burst(
            address, [ids(args.system + args.question) for _ in range(args.concurrent)], params
        )
        log(f"shared rep {rep}: p50 TTFT shared {pct([r['ttft_ms'] for r in shared], 50)} ms, "
            f"distinct {pct([r['ttft_ms'] for r in distinct], 50)} ms")  # fmt: skip
        errors = {r["error"] for r in shared + distinct if r["error"]}
        if errors:
            log(f"shared rep {rep}: errors {sorted(errors)[:3]}")
        if rep:
            rounds["shared"].append(shared)
            rounds["distinct"].append(distinct)
    out = {}
    for name, reps in rounds.items():
        ttft = [r["ttft_ms"] for rep in reps for r in rep]
        prompt = sum(r["prompt_tokens"] for rep in reps for r in rep)
        cached = sum(r["cached_tokens"] for rep in reps for r in rep)
        out[name] = {
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p90_ms": pct(ttft, 90),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefill_avoided": round(cached / prompt, 3) if prompt else None,
        }
    a, b = out["shared"]["ttft_p50_ms"], out["distinct"]["ttft_p50_ms"]
    out["p50_distinct_over_shared"] = round(b / a, 2) if a and b else None
    return out


PHASES = {"multiturn": phase_multiturn, "shared": phase_shared}


def plot(result: dict, path: Path) -> None:
    if (plt := pyplot()) is None:
        return
    layouts = [k for k in LAYOUTS if k in result]
    if not layouts:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    bars, labels = [], []
    for layout in layouts:
        for mode, d in result[layout].get("multiturn", {}).items():
            if mode == "error":
                continue
            bars.append((d["ttft_hit_ms"] or 0, d["ttft_miss_ms"] or 0))
            labels.append(f"{layout}\n{mode}")
    x = np.arange(len(bars))
    axes[0].bar(x - 0.2, [b[0] for b in bars], 0.4, label="next turn (cache hit)")
    axes[0].bar(x + 0.2, [b[1] for b in bars], 0.4, label="same length, no shared prefix")
    axes[0].axhline(50, color="red", ls="--", lw=0.8, label="50 ms target")
    axes[0].set_xticks(x, labels, fontsize=8)
    axes[0].set_ylabel("TTFT ms (median)")
    axes[0].set_title(f"multi-turn: {result['args']['history']}-token history", fontsize=9)
    axes[0].legend(fontsize=7)
    shared = [
        (k, result[k]["shared"])
        for k in layouts
        if "shared" in result[k] and "error" not in result[k]["shared"]
    ]
    x = np.arange(len(shared))
    axes[1].bar(x - 0.2, [d["shared"]["ttft_p50_ms"] or 0 for _, d in shared], 0.4,
                label="shared system prompt")  # fmt: skip
    axes[1].bar(x + 0.2, [d["distinct"]["ttft_p50_ms"] or 0 for _, d in shared], 0.4,
                label="a system prompt each")  # fmt: skip
    axes[1].set_xticks(x, [k for k, _ in shared], fontsize=8)
    axes[1].set_ylabel("TTFT p50 ms")
    axes[1].set_title(f"{result['args']['concurrent']} concurrent questions", fontsize=9)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"prefix cache, {result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_random_model_flags(p)
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--history", type=int, default=2000)
    p.add_argument("--answer", type=int, default=32)
    p.add_argument("--turn", type=int, default=50)
    p.add_argument("--next-tokens", type=int, default=8, help="tokens asked of timed requests")
    p.add_argument("--system", type=int, default=1500)
    p.add_argument("--question", type=int, default=24)
    p.add_argument("--concurrent", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--flags", default="", help="extra coordinator flags")
    p.add_argument("--plot-only", type=Path, help="redraw the plot of a saved result")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_cache"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.out / "prefix_cache.png")
        return
    import mlx.core as mx

    model, name = prepare_model(args)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result: dict = {"device": str(mx.default_device()), "date": time.strftime("%Y-%m-%d"),
                    "command": " ".join(sys.argv), "model": name, "args": settings}  # fmt: skip
    ids = Ids(load_model_config(model).vocab_size)
    for layout in args.layouts:
        cluster = Cluster(model, LAYOUTS[layout], max_running=args.concurrent, local=True)
        try:
            address = cluster.start_coordinator(flags=tuple(args.flags.split()))
            result[layout] = {"layout": cluster.layout()}
            for phase in args.phases:
                log(f"{layout}: {phase}")
                try:
                    result[layout][phase] = PHASES[phase](address, ids, args)
                except Exception:
                    tail = "".join(cluster.coordinator.log[-40:]) if cluster.coordinator else ""
                    result[layout][phase] = {"error": traceback.format_exc(), "log": tail}
                    log(traceback.format_exc() + tail)
                (args.out / "prefix_cache.partial.json").write_text(json.dumps(result, indent=1))
            budget = [ln.strip() for ln in cluster.coordinator.log if "KV admission budget" in ln]
            result[layout]["kv_budget"] = budget[-1:] if budget else None
        finally:
            cluster.stop()
    (args.out / "prefix_cache.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "prefix_cache.png")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
