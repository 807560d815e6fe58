"""`wedlm bench latency`: one request at a time on a cluster, per decoding mode (ar, wedlm,
speculative, diffusion): TTFT, time per output token, decode tok/s and tokens per forward
(the coordinator's own count, from each request's final stats). A mode the model cannot
decode in shows as failed requests."""

from __future__ import annotations

from typing import Any

from common.generation_params import GenerationParams
from wedlm_client.bench import report
from wedlm_client.bench.clients import grpc_thread
from wedlm_client.bench.records import Rec, Schedule, median, summarize


def one_mode(address: str, mode: str, args) -> dict[str, Any]:
    params = GenerationParams(mode=mode, max_tokens=args.max_tokens, temperature=0.0)
    recs: list[Rec] = []
    if args.warmup:  # unmeasured: kernels for new shapes compile on first use
        grpc_thread(address, params, Schedule(0.0, args.warmup, 0.0), [], 0, 1)
    grpc_thread(address, params, Schedule(0.0, args.requests, 0.0), recs, 0, 1)
    stats = summarize(recs, None)
    finals = [r.final for r in recs if r.error is None and r.final]
    keep = ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90", "itl_ms_p50",
            "tokens_per_forward_p50", "failures")  # fmt: skip
    out = {k: stats[k] for k in keep}
    out["decode_tok_s_p50"] = median([f.get("decode_tokens_per_s") for f in finals])
    out["tokens_p50"] = median([len(f["tokens"]) for f in finals])
    out["mode_run"] = sorted({f.get("mode", "") for f in finals})  # what "auto" resolved to
    out["sent"], out["failed"] = len(recs), sum(1 for r in recs if r.error)
    if failed := [r for r in recs if r.error]:
        out["error_sample"] = f"{failed[0].error}: {failed[0].detail or ''}".strip(": ")
    return out


def run(args) -> dict[str, Any]:
    result = report.header("latency", {"cluster": args.cluster, "modes": args.modes,
                                "requests": args.requests, "max_tokens": args.max_tokens})
    result["cluster"] = report.cluster_label(args.cluster)
    progress = report.Progress(len(args.modes), "latency")
    result["modes"] = {}
    for mode in args.modes:
        result["modes"][mode] = m = one_mode(args.cluster, mode, args)
        progress.step(f"{mode}: TTFT p50 {m['ttft_ms_p50']} ms, TPOT p50 {m['tpot_ms_p50']} ms, "
                      f"{m['failed']} failed")  # fmt: skip
    rows = [[mode, m["ttft_ms_p50"], m["tpot_ms_p50"], m["decode_tok_s_p50"],
             m["tokens_per_forward_p50"], m["sent"] - m["failed"], m["failed"]]
            for mode, m in result["modes"].items()]  # fmt: skip
    cols = ["mode", "TTFT p50 ms", "TPOT p50 ms", "decode tok/s", "tok/forward", "ok", "failed"]
    model = result["cluster"].get("model", args.cluster)
    text = f"{model}: single stream\n" + report.table(cols, rows)
    result["files"] = {}
    made = report.figure(2, f"wedlm bench latency: {model}")
    if made is not None:
        fig, (a, b) = made
        names = [r[0] for r in rows]
        a.bar(names, [r[1] or 0 for r in rows])
        b.bar(names, [r[2] or 0 for r in rows])
        report.finish_axes(a, "mode", "TTFT p50 (ms)")
        report.finish_axes(b, "mode", "time per output token p50 (ms)")
        result["files"]["png"] = report.save_figure(fig, args.out / "latency.png")
    report.emit(result, text, args.out, "latency", args.json)
    return result
