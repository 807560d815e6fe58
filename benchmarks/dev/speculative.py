"""Speculative mode's benchmarks. Prints one JSON object and writes speculative.json and
speculative.png to --out (speculative.partial.json after every phase).

Phases (--phases):
  mask    The WeDLM-trained checkpoint (../shared/models/wedlm-smollm2-135m-r2): AR, WeDLM and
          speculative mode with mask-slot drafts, on a counting prompt set (text it is
          WeDLM-capable on) and a chat prompt set, at C = 1 and C = 8 (C requests submitted
          together), in one process and through 2 stages (the coordinator with the first
          half of the layers + 1 worker, real processes). Per setting: decode tok/s (tokens
          after the first / decode time, medians over requests at C = 1, aggregate at C = 8),
          tokens per forward, drafts accepted per forward, and whether every output equals
          AR's; the fraction of forwards that ran without drafts (one row, as AR), and of
          the decode micro-batches with a speculative row, the fraction that drafted (one
          drafting row makes the whole forward a drafting one; draft_policy.py; one
          process only). The settings run interleaved group by group, --repeats times;
          vs_ar_paired is the median of each group's tok/s over AR's on the same group
          moments before or after (the machines' speed drifts). Before them the
          draft break-even (a drafting forward's cost in AR forwards, step_timing.py) is
          measured at each C
          (--break-even fixes it instead), and reported with its online refinement. The
          2-stage coordinator measures its own through the worker (warmup.py), reported
          as two_stages_break_even from its log.
  lookup  The default model, rewrite / summarize / fix prompts (chat): AR against
          speculative mode with prompt-lookup drafts, one process, C = 1.
  draft   A random bf16 model of Qwen3-8B shape verifying drafts from a random model of
          Qwen3-0.6B-like shape with the same vocabulary (one process). Random drafts are
          never accepted, so this measures what a speculative step costs: the verifying
          forward (1 + k rows) and the k draft forwards, against an AR step, and the
          break-even accepted length a* = t_step / t_AR - 1 (a request gains when more than
          a* drafts per forward are accepted). --draft-layers / --draft-hidden shrink it.

  python benchmarks/dev/speculative.py --phases mask lookup draft --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx

from benchmarks.dev.bench_io import log, med, pyplot
from common.generation_params import GenerationParams
from coordinator.engine.local_engine import open_local_engine
from coordinator.engine.step_timing import measure_step_cost

WEDLM_MODEL = ROOT.parent / "shared" / "models" / "wedlm-smollm2-135m-r2"
COUNTING = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Count from one to forty: one, two, three, four, five,",
    "10, 20, 30, 40, 50, 60, 70,",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
    "a b c d e f g h i j k",
    "2, 4, 6, 8, 10, 12, 14, 16,",
    "January, February, March, April, May, June,",
    "100, 101, 102, 103, 104, 105,",
]
CHAT = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a computer network is in two sentences.",
    "Give me three tips for sleeping well.",
    "Why is the sky blue?",
    "Tell me a story about a cat who learns to swim.",
    "What are the main ingredients of bread?",
    "Describe a sunny day at the beach.",
]
PASSAGE = (
    "The library opened in 1902 with two rooms and four hundred books. Over the next "
    "century it grew into the largest public library in the region, with a reading room "
    "that seats three hundred people, a children's wing, and a collection of maps that "
    "scholars travel from abroad to study. In 2015 the city renovated the building, "
    "adding solar panels to the roof and a cafe on the ground floor."
)
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + "
    "item.price * item.quantity\n    return result\n"
)
EDITING = [
    f"Rewrite this paragraph in the past tense, keeping every fact:\n\n{PASSAGE}",
    f"Summarize this paragraph in two sentences:\n\n{PASSAGE}",
    f"Fix any grammar mistakes and repeat the text:\n\n{PASSAGE.replace('has', 'have')}",
    f"Rename the variable result to subtotal in this code and show the code:\n\n{CODE}",
    f"Copy this text exactly:\n\n{PASSAGE}",
    f"Add a docstring to this function and show the whole function:\n\n{CODE}",
]


def summarize(
    records: list[dict], wall_s: float, concurrency: int, batches: list[int] | None = None
) -> dict:
    """One setting's requests: decode tok/s (medians at C = 1, aggregate at C > 1);
    `batches`: decode micro-batches with a speculative row, and how many of them drafted."""
    tokens = sum(len(r["tokens"]) for r in records)
    forwards = sum(r["forwards"] for r in records)
    out = {
        "requests": len(records),
        "tokens": tokens,
        "tokens_per_forward": round(tokens / forwards, 3) if forwards else None,
        "accepted_per_forward": round(sum(r["accepted"] for r in records) / forwards, 3)
        if forwards
        else None,
        "drafted": sum(r["drafted"] for r in records),
        # forwards of one row (AR's, launched ahead when the batch allows): drafts off
        "ar_forward_fraction": round(1 - sum(r["draft_forwards"] for r in records) / forwards, 3)
        if forwards and all("draft_forwards" in r for r in records)
        else None,
        "accepted": sum(r["accepted"] for r in records),
    }
    if batches and batches[0]:
        out["drafting_batch_fraction"] = round(batches[1] / batches[0], 3)
    if concurrency == 1:
        out["decode_tok_s"] = med(
            (len(r["tokens"]) - 1) / r["decode_s"] for r in records if r["decode_s"]
        )
    else:
        out["decode_tok_s"] = round(tokens / wall_s, 2) if wall_s else None
    out["wall_s"] = round(wall_s, 3)
    return out


def local_run(local, prompts, params: GenerationParams, concurrency: int):
    """Records per request, the wall time, and [speculative, drafting] decode batches."""
    engine = local.engine
    before = engine.speculative_batches, engine.drafting_batches
    records, wall = [], 0.0
    for start in range(0, len(prompts), concurrency):
        t0 = time.perf_counter()
        seqs = [local.engine.submit(p, params) for p in prompts[start : start + concurrency]]
        for _ in local.engine.stream(seqs):
            pass
        wall += time.perf_counter() - t0
        records += [
            {"tokens": s.output, "forwards": s.forwards, "accepted": s.accepted,
             "drafted": s.drafted, "decode_s": s.decode_s}
            | ({"draft_forwards": s.draft_forwards} if params.mode == "speculative" else {})
            for s in seqs
        ]  # fmt: skip
    batches = [engine.speculative_batches - before[0], engine.drafting_batches - before[1]]
    return records, wall, batches


def cluster_run(address: str, prompts, params: GenerationParams, concurrency: int):
    from wedlm_client.client import WedlmClient

    records: list[dict] = [{}] * len(prompts)
    wall = 0.0
    for start in range(0, len(prompts), concurrency):
        idx = list(range(start, min(start + concurrency, len(prompts))))

        def one(i: int) -> None:
            with WedlmClient(address, timeout=600) as client:
                r = client.generate(ids=prompts[i], params=params)
            records[i] = {"tokens": r["tokens"], "forwards": r["forwards"],
                          "accepted": r["accepted_drafts"], "drafted": r["drafted_tokens"],
                          "decode_s": r["decode_s"]}  # fmt: skip

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in idx]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall += time.perf_counter() - t0
    return records, wall, None


def compare(runs: dict[str, tuple], concurrency: int, n_prompts: int) -> dict:
    """Summaries per setting; request i is compared with AR's output of prompt i."""
    ar_tokens = [r["tokens"] for r in runs["ar"][0][:n_prompts]]
    out = {}
    for name, (records, wall, batches) in runs.items():
        s = summarize(records, wall, concurrency, batches)
        s["equal_to_ar"] = sum(
            r["tokens"] == ar_tokens[i % n_prompts] for i, r in enumerate(records)
        )
        out[name] = s
    base = out["ar"]["decode_tok_s"]
    for s in out.values():
        s["vs_ar"] = round(s["decode_tok_s"] / base, 3) if base and s["decode_tok_s"] else None
    return out


def mask_settings(args) -> dict[str, GenerationParams]:
    n = args.max_tokens
    out = {"ar": GenerationParams(mode="ar", max_tokens=n)}
    if args.ar_control:  # AR again: its paired ratio is the noise floor of the others
        out["ar-control"] = GenerationParams(mode="ar", max_tokens=n)
    if args.wedlm:
        out["wedlm"] = GenerationParams(mode="wedlm", window=16, threshold=0.6, max_tokens=n)
    for tau in args.thresholds:
        out[f"speculative-mask-t{tau}"] = GenerationParams(
            mode="speculative", draft="mask", window=args.window, threshold=tau, max_tokens=n
        )
    return out


def run_settings(runner, prompts, settings, concurrency: int, repeats: int) -> dict:
    """Settings interleaved group by group (C prompts submitted together), `repeats`
    rounds, the order of the settings rotated each time; records and walls pooled over
    rounds. Every group's tok/s under each setting is also divided by AR's on the same
    group in the same round, moments apart: the GPU machines' speed drifts by tens of
    percent within seconds (RESULTS.md SC8), and these paired ratios cancel it."""
    pooled: dict[str, tuple] = {k: ([], 0.0, None) for k in settings}
    paired: dict[str, list[float]] = {k: [] for k in settings}
    names = list(settings)
    groups = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    turn = 0
    for _ in range(repeats):
        for group in groups:
            order = names[turn % len(names) :] + names[: turn % len(names)]
            turn += 1
            speed = {}
            for name in order:
                records, wall, batches = runner(group, settings[name], concurrency)
                old = pooled[name]
                if batches is not None and old[2] is not None:
                    batches = [a + b for a, b in zip(old[2], batches, strict=True)]
                pooled[name] = (old[0] + records, old[1] + wall, batches)
                speed[name] = summarize(records, wall, concurrency)["decode_tok_s"]
            for name in names:
                if speed[name] and speed.get("ar"):
                    paired[name].append(speed[name] / speed["ar"])
    out = compare(pooled, concurrency, len(prompts))
    for name, ratios in paired.items():
        out[name]["vs_ar_paired"] = med(ratios)
        out[name]["vs_ar_paired_quartiles"] = quartiles(ratios)
    return out


def quartiles(values: list[float]) -> list[float] | None:
    if len(values) < 4:
        return None
    q = statistics.quantiles(values, n=4)
    return [round(q[0], 3), round(q[2], 3)]


def phase_mask(args) -> dict:
    model = args.wedlm_model
    if not (model / "config.json").exists():
        return {"skipped": f"{model} is absent"}
    local = open_local_engine(model, num_rows=8)
    local.engine.speculative_ahead = args.speculative_ahead
    tok = local.tokenizer
    sets = {
        "counting": [tok.encode(t) for t in COUNTING[: args.prompts]],
        "chat": [tok.encode(t, chat=True) for t in CHAT[: args.prompts]],
    }
    sets = {k: v for k, v in sets.items() if k in args.sets}
    settings = mask_settings(args)
    result: dict = {"settings": {k: asdict(v) for k, v in settings.items()}}
    warm = GenerationParams(mode="speculative", draft="mask", max_tokens=8)
    first = next(iter(sets.values()))
    local_run(local, first, warm, 8)  # compile before timing
    if args.break_even is None:  # measured here, as the server's warm-up measures it
        ratios = measure_step_cost(local.engine, args.concurrency, args.window)
    else:  # fixed (1.0: drafts pay whenever one is accepted)
        ratios = {1: args.break_even}
        local.engine.step_cost.seed(ratios)
        local.engine.step_cost.online = False
    result["break_even_measured"] = {str(r): round(v, 3) for r, v in ratios.items()}
    log(f"mask: draft break-even by rows {result['break_even_measured']}")
    for c in args.concurrency:
        for name, prompts in sets.items():
            log(f"mask: one process, C={c}, {name}")
            result[f"one_process/C{c}/{name}"] = run_settings(
                lambda p, s, cc: local_run(local, p, s, cc), prompts, settings, c, args.repeats
            )
    # refined online from the runs' own forwards (step_cost.py)
    result["break_even_after"] = {str(r): v for r, v in local.engine.step_cost.describe().items()}
    result["speculative_chained"] = local.engine.speculative_chained  # speculative_ahead.py
    local = None  # one serving process at a time: free this one's memory first
    mx.clear_cache()
    if args.stages:
        from benchmarks.dev.bench_cluster import Cluster

        cluster = Cluster(model, workers=1, max_running=8, gpus=args.gpus, local=True)
        try:
            # warm-up auto: on GPUs the shapes and the break-even, on CPU the break-even
            # alone (a pipeline cannot refine it online: warmup.price_drafts)
            address = cluster.start_coordinator()
            result["two_stages_layout"] = cluster.layout()
            result["two_stages_break_even"] = cluster.break_even()
            cluster_run(address, first, warm, 8)
            for c in args.concurrency:
                for name, prompts in sets.items():
                    log(f"mask: 2 stages, C={c}, {name}")
                    result[f"two_stages/C{c}/{name}"] = run_settings(
                        lambda p, s, cc: cluster_run(address, p, s, cc),
                        prompts, settings, c, args.repeats,
                    )  # fmt: skip
        finally:
            cluster.stop()
    return result


def phase_lookup(args) -> dict:
    local = open_local_engine(args.lookup_model, num_rows=1)
    prompts = [local.tokenizer.encode(t, chat=True) for t in EDITING[: args.prompts]]
    n = args.lookup_max_tokens
    settings = {
        "ar": GenerationParams(mode="ar", max_tokens=n),
        "speculative-lookup": GenerationParams(
            mode="speculative", draft="lookup", window=args.window, max_tokens=n
        ),
    }
    local_run(local, prompts[:1], settings["speculative-lookup"], 1)  # compile
    out = run_settings(
        lambda p, s, c: local_run(local, p, s, c), prompts, settings, 1, args.repeats
    )
    return {"model": str(args.lookup_model), **out}


def phase_draft(args) -> dict:
    from benchmarks.dev.engine import random_qwen3
    from coordinator.engine.draft_model import DraftModel
    from coordinator.engine.engine import Engine
    from coordinator.engine.pipeline import LocalPipeline

    target, _ = random_qwen3(args.target_layers, args.target_hidden)
    small, _ = random_qwen3(args.draft_layers, args.draft_hidden)
    engine = Engine(target, LocalPipeline(target), 1)
    drafter = DraftModel(small, target.config)
    engine.use_drafter(drafter)
    prompt = list(range(1000, 1000 + 128))
    n = args.draft_tokens
    out: dict = {
        "target": f"random Qwen3 {args.target_layers} layers x {args.target_hidden}",
        "draft": f"random Qwen3 {args.draft_layers} layers x {args.draft_hidden}",
    }

    def decode(params: GenerationParams) -> dict:
        seq = engine.submit(prompt, params)
        drafter.propose_s = 0.0
        for _ in engine.stream([seq]):
            pass
        steps = max(seq.forwards - 1, 1)  # decode forwards (the first token is prefill's)
        return {"step_ms": 1000 * seq.decode_s / steps,
                "draft_ms": 1000 * drafter.propose_s / steps,
                "tokens_per_forward": len(seq.output) / seq.forwards}  # fmt: skip

    decode(GenerationParams(mode="ar", max_tokens=8))  # compile
    for k in args.draft_k:
        decode(GenerationParams(mode="speculative", draft="model", window=k, max_tokens=8))
    rows = []
    for _ in range(args.repeats):
        ar = decode(GenerationParams(mode="ar", max_tokens=n))
        for k in args.draft_k:
            params = GenerationParams(mode="speculative", draft="model", window=k, max_tokens=n)
            sp = decode(params)
            rows.append({"k": k, "ar_step_ms": ar["step_ms"], **sp})
    for k in args.draft_k:
        mine = [r for r in rows if r["k"] == k]
        ar_ms = med(r["ar_step_ms"] for r in mine)
        step = med(r["step_ms"] for r in mine)
        draft = med(r["draft_ms"] for r in mine)
        out[f"k{k}"] = {
            "ar_step_ms": ar_ms,
            "speculative_step_ms": step,
            "draft_ms": draft,
            "verify_forward_ms": round(step - draft, 3),
            "verify_over_ar": round((step - draft) / ar_ms, 3),
            "break_even_accepted": round(step / ar_ms - 1, 2),
            "accepted_per_forward": round(mine[0]["tokens_per_forward"] - 1, 3),
        }
    return out


def _ratio(setting: dict) -> float:
    return setting.get("vs_ar_paired") or setting["vs_ar"] or 0


def plot(result: dict, path: Path) -> None:
    if (plt := pyplot()) is None:
        return
    mask = result.get("mask", {})
    panels = [k for k in mask if "/" in k]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.2), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        d = mask[key]
        names = list(d)
        ax.bar(range(len(names)), [_ratio(d[n]) for n in names])
        for i, n in enumerate(names):
            ax.text(i, _ratio(d[n]) + 0.02, f"{d[n]['tokens_per_forward']}", ha="center",
                    fontsize=7)  # fmt: skip
        ax.axhline(1.0, color="gray", ls=":")
        ax.axhline(1.5, color="red", ls="--", lw=0.8)
        ax.set_xticks(range(len(names)), [n.replace("speculative-", "spec-") for n in names],
                      rotation=45, ha="right", fontsize=7)  # fmt: skip
        ax.set_title(key, fontsize=8)
        ax.set_ylabel("decode tok/s vs AR (labels: tokens/forward)", fontsize=7)
    fig.suptitle(f"speculative mode, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--phases", nargs="+", default=["mask", "lookup"],
                   choices=["mask", "lookup", "draft"])  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lookup-max-tokens", type=int, default=128)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.6, 1.5])
    p.add_argument(
        "--break-even",
        type=float,
        default=None,
        help="fixed draft break-even (default: measured at the start)",
    )
    p.add_argument("--sets", nargs="+", default=["counting", "chat"], choices=["counting", "chat"])
    p.add_argument("--no-stages", dest="stages", action="store_false")
    p.add_argument(
        "--no-wedlm", dest="wedlm", action="store_false", help="mask: AR and speculative only"
    )
    p.add_argument(
        "--speculative-ahead",
        action="store_true",
        help="one process: build a drafting spell's next forward on the device, before the "
        "read-back (the engine's speculative_ahead, off by default)",
    )
    p.add_argument(
        "--ar-control",
        action="store_true",
        help="mask: run AR a second time as its own setting; its vs_ar_paired shows how far "
        "two identical settings land apart on this machine",
    )
    p.add_argument("--gpus", type=int, default=0, help="GPUs for the 2-stage run (0: shared)")
    p.add_argument("--wedlm-model", type=Path, default=WEDLM_MODEL)
    p.add_argument("--lookup-model", default="default", help="model of the lookup phase")
    p.add_argument("--prompts", type=int, default=8, help="prompts per set (at most 8)")
    p.add_argument("--target-layers", type=int, default=36)
    p.add_argument("--target-hidden", type=int, default=4096)
    p.add_argument("--draft-layers", type=int, default=28)
    p.add_argument("--draft-hidden", type=int, default=1024)
    p.add_argument("--draft-k", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--draft-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": str(mx.default_device()), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv)}  # fmt: skip
    phases = {"mask": phase_mask, "lookup": phase_lookup, "draft": phase_draft}
    for name in args.phases:
        t0 = time.perf_counter()
        try:
            result[name] = phases[name](args)
        except Exception as e:  # record it; the next phase still runs
            result[name] = {"error": f"{type(e).__name__}: {e}",
                            "trace": traceback.format_exc()[-3000:]}  # fmt: skip
        result[f"{name}_s"] = round(time.perf_counter() - t0, 1)
        (args.out / "speculative.partial.json").write_text(json.dumps(result, indent=1))
    (args.out / "speculative.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "speculative.png")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
