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
from wedlm_client.bench.clients import UNWIND_S, OpenAIRequest
from wedlm_client.bench.load import START_DELAY_S, client_pool, level
from wedlm_client.bench.records import grace_s, median
from wedlm_client.bench.targets import Target, openai_model, parse_target

KEPT = ("tok_s", "tok_s_events", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50",
        "tpot_ms_p90", "tpot_ms_p99", "tokens_per_forward_p50", "sent", "ok", "failed",
        "requests_ended", "unfinished", "unfinished_s_p50", "unfinished_s_max",
        "unfinished_tokens", "unfinished_no_token", "failures", "error_sample")  # fmt: skip
MEDIANS = ("tok_s", "tok_s_events", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50",
           "tpot_ms_p90")  # fmt: skip
SUMS = ("sent", "ok", "failed", "requests_ended", "unfinished")


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
        m: dict[str, Any] = {k: median([r.get(k) for r in mine]) for k in MEDIANS}
        m.update({k: sum(r.get(k, 0) for r in mine) for k in SUMS})
        if ran := [r["unfinished_s_max"] for r in mine if "unfinished_s_max" in r]:
            m["unfinished_s_max"] = max(ran)
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
    runs_total = len(args.concurrency) * args.rounds * len(targets)
    progress = report.Progress(runs_total, "serve")
    if not args.requests:
        progress.note(timing_note(args, runs_total))
    run_no, rounds = 0, []
    with client_pool(args.client_processes) as pool:
        for c, r, order in abab(args.concurrency, args.rounds, targets):
            runs: dict[str, Any] = {"order": [t.name for t in order]}
            for t in order:
                run_no += 1
                runs[t.name] = s = run_target(pool, t, c, run_no, args)
                progress.step(f"C={c} {t.name} round {r + 1}: {run_line(s, args)}")
            rounds.append(runs)
            if r == args.rounds - 1:
                med = medians(rounds, names)
                result["levels"][str(c)] = {"rounds": rounds, "median": med,
                                            "compare": compare(med, names)}  # fmt: skip
                rounds = []
    result["notes"] = notes(result, names, args)
    save_plot(result, names, args.out / "serve.png")
    report.emit(result, text_table(result, names), args.out, "serve", args.json)
    return result


def timing_note(args, runs: int) -> str:
    """What a run by duration takes, said before it starts."""
    grace = grace_s(args.duration)
    start = START_DELAY_S if args.client_processes > 1 else 0.0
    each = start + args.warmup + args.duration + grace + UNWIND_S
    return (f"each run: {args.warmup:g} s warm-up + {args.duration:g} s measured; requests "
            f"still running {grace:g} s after that are cut (reported as unfinished); "
            f"{runs} run{'s' * (runs > 1)}, at most about {runs * each:.0f} s")  # fmt: skip


def run_line(s: dict, args) -> str:
    """One run's progress line: nothing measured reads 'n/a', and what was cut is said."""
    line = (f"{report.shown(s['tok_s'])} tok/s, TTFT p50 {ms(s['ttft_ms_p50'])}, "
            f"{s['ok']} ok, {s['failed']} failed")  # fmt: skip
    if s.get("unfinished"):
        line += f", {s['unfinished']} unfinished (cut after {s['unfinished_s_max']:g} s)"
    if not args.requests and not s["requests_ended"]:
        line += f"; none finished inside the {args.duration:g} s window"
    return line


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{report.shown(v)} ms"


def notes(result: dict, names: list[str], args) -> list[str]:
    """What the table alone would hide: levels where no request finished inside the window
    or where requests were cut, and what to do about it."""
    out, slow = [], False
    for c, lv in result["levels"].items():
        for n in names:
            m = lv["median"][n]
            if args.requests or not (m["unfinished"] or not m["requests_ended"]):
                continue
            what = f"C={c} {n}: "
            if not m["requests_ended"] and m["sent"] > m["failed"]:
                slow = True
                what += (f"no request finished inside the {args.duration:g} s window "
                         f"(in {m['rounds']} round{'s' * (m['rounds'] > 1)})")  # fmt: skip
            elif m["unfinished"]:
                what += f"{m['ok']} requests finished, {m['requests_ended']} inside the window"
            else:
                continue  # every request failed: the failed column says so
            if m["unfinished"]:
                grace = grace_s(args.duration)
                what += (f"; {m['unfinished']} still running {grace:g} s after it were cut, "
                         f"having run {m['unfinished_s_max']:g} s at most (counted neither "
                         f"done nor failed)")  # fmt: skip
            out.append(what)
    if slow:
        out.append(
            f"the server answers more slowly than the window: --requests N measures N "
            f"requests per run, each to its end (e.g. --requests {2 * max(args.concurrency)}), "
            f"or raise --duration (now {args.duration:g} s)"
        )
    return out


def save_plot(result: dict, names: list[str], path: Path) -> None:
    """The PNG, or why there is none: no matplotlib, or nothing measured to draw (then an
    older run's serve.png is removed, so that it does not pass for this one's)."""
    result["files"] = {}
    if not has_points(result, names):
        path.unlink(missing_ok=True)
        result["plot"] = "no plot: no request finished, so there is nothing to draw"
    elif (fig := plot(result, names)) is None:
        result["plot"] = "no plot: matplotlib is not installed (pip install 'wedlm-cluster[bench]')"
    else:
        result["files"]["png"] = report.save_figure(fig, path)


def has_points(result: dict, names: list[str]) -> bool:
    return any(
        r[n].get(key) is not None
        for lv in result["levels"].values()
        for r in lv["rounds"]
        for n in names
        for key in ("tok_s", "ttft_ms_p50")
    )


def text_table(result: dict, names: list[str]) -> str:
    rows = []
    for c, lv in result["levels"].items():
        for n in names:
            m = lv["median"][n]
            rows.append([c, n, m["tok_s"], m["ttft_ms_p50"], m["ttft_ms_p90"], m["ttft_ms_p99"],
                         m["tpot_ms_p50"], m["tpot_ms_p90"], m["ok"], m["failed"],
                         m["unfinished"]])  # fmt: skip
        if lv["compare"]:
            cmp = lv["compare"]
            rows.append([c, cmp["of"], cmp["tok_s"], cmp["ttft_ms_p50"], *[""] * 7])
    labels = [f"{n}: {t['kind']} {t['address']} ({t['model']})"
              for n, t in result["targets"].items()]  # fmt: skip
    cols = ["C", "target", "tok/s", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "ok", "failed",
            "unfinished"]  # fmt: skip
    tail = [*result.get("notes", []), *([result["plot"]] if "plot" in result else [])]
    return "\n".join([*labels, "(medians over rounds; ms; n/a: nothing measured)",
                      report.table(cols, rows), *(["", *tail] if tail else [])])  # fmt: skip


# each panel: its value, its axis label, and why it may have nothing to show
PANELS = (("tok_s", "aggregate output tok/s", "no request finished inside the window"),
          ("ttft_ms_p50", "TTFT p50 (ms)", "no request had its first token"))  # fmt: skip


def plot(result: dict, names: list[str]):
    """tok/s and TTFT p50 against C per target: the medians as lines, each round a dot."""
    made = report.figure(2, f"wedlm bench serve, max_tokens {result['args']['max_tokens']}, "
                     f"{result['date']}")  # fmt: skip
    if made is None:
        return None
    fig, axes = made
    levels = result["levels"]
    cs = [int(c) for c in levels]
    drawn = set()
    for i, name in enumerate(names):
        for (key, _, _), ax in zip(PANELS, axes, strict=True):
            ys = [levels[str(c)]["median"][name][key] for c in cs]
            if any(y is not None for y in ys):
                drawn.add(key)
            failed = sum(levels[str(c)]["median"][name]["failed"] for c in cs)
            ax.plot(cs, [float("nan") if y is None else y for y in ys], "o-", color=f"C{i}",
                    label=f"{name} ({failed} failed)" if failed else name)  # fmt: skip
            dots = [(int(c), r[name][key]) for c, v in levels.items() for r in v["rounds"]
                    if r[name][key] is not None]  # fmt: skip
            if dots:
                ax.plot(*zip(*dots, strict=True), ".", color=f"C{i}", alpha=0.35)
    for (key, ylabel, empty), ax in zip(PANELS, axes, strict=True):
        report.finish_axes(ax, "concurrent streaming requests", ylabel, xs=cs)
        if key not in drawn:  # say so, rather than an empty panel
            ax.text(0.5, 0.5, f"nothing measured:\n{empty}", transform=ax.transAxes,
                    ha="center", va="center")  # fmt: skip
    return fig
