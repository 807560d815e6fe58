"""`wedlm bench serve`: a closed loop against one or more targets (a coordinator over gRPC,
or any OpenAI-compatible server over HTTP with the `openai` package). At each concurrency C
and in each round every target in turn (the order reversed every round: ABAB) takes C
clients that each send a streaming request, read it to the end and send the next. Per
target and level: tok/s, TTFT / TPOT percentiles, requests sent, done and failed (a closed
port or a refusal is a failed request, never a crash); with two targets, B / A."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.errors import WedlmError
from common.generation_params import GenerationParams
from wedlm_client.bench import report
from wedlm_client.bench.clients import OpenAIRequest
from wedlm_client.bench.load import client_pool, level
from wedlm_client.bench.records import median
from wedlm_client.bench.targets import Target, openai_model, parse_target

KEPT = ("tok_s", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90",
        "tpot_ms_p99", "tokens_per_forward_p50", "sent", "ok", "failed", "requests_ended",
        "failures", "error_sample")  # fmt: skip
MEDIANS = ("tok_s", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90")
SUMS = ("sent", "ok", "failed")


def prepare(targets: list[Target], args) -> None:
    """Each target's model and label: a gRPC target's cluster status; an HTTP one's
    /models (and --label-cluster's status, for our own HTTP API)."""
    for t in targets:
        if t.kind == "grpc":
            t.label = report.cluster_label(t.address)
            t.model = t.label.get("model")
        else:
            model, why = openai_model(t.address)
            t.model = args.model or model or "default"
            t.label = {"url": t.address, "model": t.model, **({"error": why} if why else {})}
            if args.label_cluster:
                t.label["cluster"] = report.cluster_label(args.label_cluster)


def run_target(pool, t: Target, c: int, run_no: int, args) -> dict[str, Any]:
    if t.kind == "grpc":
        params = GenerationParams(mode=args.mode, max_tokens=args.max_tokens, temperature=0.0)
        kind, payload = "grpc", params
    else:
        extra = None if args.mode == "auto" else {"mode": args.mode}
        kind, payload = "openai", OpenAIRequest(args.max_tokens, 0.0, extra=extra, tag=run_no)
    return kept(level(pool, args.client_processes, kind, t.address, t.model, c, payload,
                      args.duration, args.warmup, args.requests))  # fmt: skip


def kept(stats: dict) -> dict[str, Any]:
    """What a result keeps of a level's statistics."""
    return {k: stats[k] for k in KEPT if k in stats}


def abab(levels: list[int], rounds: int, items: list):
    """(C, round, order) of every run: each level `rounds` times, the order of `items`
    reversed every round (counted over all levels), so that drift hits every item alike."""
    turn = 0
    for c in levels:
        for r in range(rounds):
            yield c, r, items if turn % 2 == 0 else items[::-1]
            turn += 1


def medians(rounds: list[dict], names: list[str]) -> dict[str, dict]:
    """Per name that ran: medians over rounds, sums of the counts, rounds run."""
    out = {}
    for name in names:
        if not (mine := [r[name] for r in rounds if name in r]):
            continue
        m: dict[str, Any] = {k: median([r[k] for r in mine]) for k in MEDIANS}
        m.update({k: sum(r[k] for r in mine) for k in SUMS})
        m["rounds"] = len(mine)
        out[name] = m
    return out


def compare(med: dict[str, dict], names: list[str]) -> dict[str, Any] | None:
    """The second target against the first: tok/s and TTFT p50 ratios."""
    if len(names) < 2:
        return None
    a, b = med[names[0]], med[names[1]]

    def ratio(key: str) -> float | None:
        return round(b[key] / a[key], 3) if a[key] and b[key] else None

    return {"of": f"{names[1]} / {names[0]}", "tok_s": ratio("tok_s"),
            "ttft_ms_p50": ratio("ttft_ms_p50")}  # fmt: skip


def run(args) -> dict[str, Any]:
    targets = [parse_target(text, i) for i, text in enumerate(args.target)]
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise WedlmError(f"target names must differ, got {names}")
    result = report.header("serve", {k: (str(v) if isinstance(v, Path) else v)
                              for k, v in vars(args).items() if k != "func"})  # fmt: skip
    if any(t.kind == "openai" for t in targets):
        try:
            import openai  # noqa: F401
        except ImportError:
            raise WedlmError("HTTP targets need the openai package: "
                             "pip install 'wedlm-cluster[bench]'") from None  # fmt: skip
    prepare(targets, args)
    result["targets"] = {t.name: {"kind": t.kind, "address": t.address, "model": t.model,
                                  "label": t.label} for t in targets}  # fmt: skip
    result["tok_s_means"] = (
        "completion tokens of the requests done / (first submit to last end)" if args.requests
        else "completion tokens of the requests that ended in the measured window / window"
    )
    result["levels"] = {}
    progress = report.Progress(len(args.concurrency) * args.rounds * len(targets), "serve")
    run_no, rounds = 0, []
    with client_pool(args.client_processes) as pool:
        for c, r, order in abab(args.concurrency, args.rounds, targets):
            runs: dict[str, Any] = {"order": [t.name for t in order]}
            for t in order:
                run_no += 1
                runs[t.name] = s = run_target(pool, t, c, run_no, args)
                progress.step(f"C={c} {t.name} round {r + 1}: {s['tok_s']} tok/s, TTFT p50 "
                              f"{s['ttft_ms_p50']} ms, {s['ok']} ok, {s['failed']} failed")
            rounds.append(runs)
            if r == args.rounds - 1:
                med = medians(rounds, names)
                result["levels"][str(c)] = {"rounds": rounds, "median": med,
                                            "compare": compare(med, names)}  # fmt: skip
                rounds = []
    result["files"] = {}
    if (fig := plot(result, names)) is not None:
        result["files"]["png"] = report.save_figure(fig, args.out / "serve.png")
    else:
        result["plot"] = "matplotlib is not installed (pip install 'wedlm-cluster[bench]')"
    report.emit(result, text_table(result, names), args.out, "serve", args.json)
    return result


def text_table(result: dict, names: list[str]) -> str:
    rows = []
    for c, lv in result["levels"].items():
        for n in names:
            m = lv["median"][n]
            rows.append([c, n, m["tok_s"], m["ttft_ms_p50"], m["ttft_ms_p90"], m["ttft_ms_p99"],
                         m["tpot_ms_p50"], m["tpot_ms_p90"], m["ok"], m["failed"]])  # fmt: skip
        if lv["compare"]:
            cmp = lv["compare"]
            rows.append([c, cmp["of"], cmp["tok_s"], cmp["ttft_ms_p50"], *[None] * 6])
    labels = [f"{n}: {t['kind']} {t['address']} ({t['model']})"
              for n, t in result["targets"].items()]  # fmt: skip
    cols = ["C", "target", "tok/s", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "ok", "failed"]
    return "\n".join([*labels, "(medians over rounds; ms)", report.table(cols, rows)])


def plot(result: dict, names: list[str]):
    """tok/s and TTFT p50 against C per target: the medians as lines, each round a dot."""
    made = report.figure(2, f"wedlm bench serve, max_tokens {result['args']['max_tokens']}, "
                     f"{result['date']}")  # fmt: skip
    if made is None:
        return None
    fig, axes = made
    levels = result["levels"]
    cs = [int(c) for c in levels]
    for i, name in enumerate(names):
        for key, ax in zip(("tok_s", "ttft_ms_p50"), axes, strict=True):
            ys = [levels[str(c)]["median"][name][key] for c in cs]
            failed = sum(levels[str(c)]["median"][name]["failed"] for c in cs)
            ax.plot(cs, [float("nan") if y is None else y for y in ys], "o-", color=f"C{i}",
                    label=f"{name} ({failed} failed)" if failed else name)  # fmt: skip
            dots = [(int(c), r[name][key]) for c, v in levels.items() for r in v["rounds"]
                    if r[name][key] is not None]  # fmt: skip
            if dots:
                ax.plot(*zip(*dots, strict=True), ".", color=f"C{i}", alpha=0.35)
    for ax, ylabel in zip(axes, ("aggregate output tok/s", "TTFT p50 (ms)"), strict=True):
        report.finish_axes(ax, "concurrent streaming requests", ylabel, xs=cs)
    return fig
