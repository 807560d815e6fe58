"""`wedlm bench links`: what the cluster measures of its own links, shown to the user. The
coordinator keeps, per stage, the median round trip of a forward (send to reply) and the
worker's compute within it, over its last 256 forwards; the difference is what the link
and the transport cost. Optional load (--requests) makes the cluster forward first, so a
fresh cluster has something to report."""

from __future__ import annotations

from typing import Any

from common.generation_params import GenerationParams
from wedlm_client.bench import report
from wedlm_client.bench.clients import grpc_thread
from wedlm_client.bench.records import Schedule
from wedlm_client.client import WedlmClient

NOT_MEASURED = ("pairwise round trip and bandwidth at 256 KiB and 4 MiB: the cluster does not "
                "measure them (the planner plans by memory); the hops below are what it knows")


def hops(address: str) -> list[dict[str, Any]]:
    """Per worker, in layer order: the coordinator-observed median round trip and compute."""
    with WedlmClient(address, 10.0) as client:
        status = client.cluster_status()
    out = []
    for w in sorted(status.workers, key=lambda w: w.info.layer_start):
        if not w.info.has_layers:
            continue
        rt, comp = w.timing.roundtrip_s * 1e3, w.timing.compute_s * 1e3
        out.append({"from": "coordinator", "to": w.address, "node_id": w.info.node_id,
                    "device": w.info.device, "layers": f"{w.info.layer_start}-{w.info.layer_end}",
                    "next_stage": w.info.next_stage, "roundtrip_ms": round(rt, 3),
                    "compute_ms": round(comp, 3),
                    "link_ms": round(rt - comp, 3) if rt else None})  # fmt: skip
    return out


def run(args) -> dict[str, Any]:
    result = report.header("links", {"cluster": args.cluster, "requests": args.requests})
    result["cluster"] = report.cluster_label(args.cluster)
    progress = report.Progress(1 + bool(args.requests), "links")
    if args.requests:
        params = GenerationParams(mode="ar", max_tokens=args.max_tokens, temperature=0.0)
        recs: list = []
        grpc_thread(args.cluster, params, Schedule(0.0, args.requests, 0.0), recs, 0, 1)
        progress.step(f"load: {len(recs)} requests, {sum(1 for r in recs if r.error)} failed")
    result["hops"] = hops(args.cluster)
    result["not_measured"] = NOT_MEASURED
    progress.step(f"{len(result['hops'])} hops read")
    rows = [[h["to"], h["device"][:24], h["layers"], h["roundtrip_ms"], h["compute_ms"],
             h["link_ms"]] for h in result["hops"]]  # fmt: skip
    cols = ["coordinator to", "device", "layers", "round trip ms", "compute ms", "link ms"]
    text = report.table(cols, rows) if rows else "no worker holds layers: nothing crosses a link"
    text += f"\nnot shown: {NOT_MEASURED}"
    result["files"] = {}
    made = report.figure(1, f"wedlm bench links: {result['cluster'].get('cluster', args.cluster)}")
    if made is not None and rows:
        fig, (ax,) = made
        names = [r[0] for r in rows]
        ax.bar(names, [r[4] or 0 for r in rows], label="worker compute")
        ax.bar(names, [r[5] or 0 for r in rows], bottom=[r[4] or 0 for r in rows],
               label="link and transport")  # fmt: skip
        report.finish_axes(ax, "stage", "median forward round trip (ms)")
        result["files"]["png"] = report.save_figure(fig, args.out / "links.png")
    report.emit(result, text, args.out, "links", args.json)
    return result
