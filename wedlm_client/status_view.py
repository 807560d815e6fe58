"""A readable table of `ClusterStatus` for `wedlm status`."""

from __future__ import annotations

from typing import Any

COLUMNS = ("member", "layers", "health", "mem used/total GiB", "hop ms", "device")


def _gib(value: Any) -> str:
    return f"{int(value or 0) / 2**30:.1f}"


def _memory(info: dict[str, Any]) -> str:
    """Used/total GiB, as the web console shows it ("-" when the member said nothing)."""
    total = int(info.get("memory_total", 0))
    if not total:
        return "-"
    return f"{_gib(total - int(info.get('memory_available', 0)))}/{_gib(total)}"


def coordinator_row(status: dict[str, Any]) -> list[str]:
    """The coordinator is a member too: it holds the first layers (local_layers)."""
    me = status.get("coordinator", {})
    who = f"coordinator {me['address']}" if me.get("address") else "coordinator"
    return [who, status.get("local_layers") or "-", status.get("state", ""), _memory(me), "-",
            me.get("device", "")]  # fmt: skip


def worker_row(w: dict[str, Any]) -> list[str]:
    info = w.get("info", {})
    held = info.get("has_layers")
    layers = f"{info.get('layer_start', 0)}-{info.get('layer_end', 0)}" if held else "-"
    hop = w.get("timing", {}).get("roundtrip_s")
    return [w.get("address", ""), layers, w.get("health", ""), _memory(info),
            f"{hop * 1000:.2f}" if hop else "-", info.get("device", "")]  # fmt: skip


def member_table(rows: list[list[str]]) -> list[str]:
    """Columns as wide as their widest cell; the device last and whole (it may be long)."""
    widths = [max(len(r[i]) for r in [list(COLUMNS), *rows]) for i in range(len(COLUMNS) - 1)]

    def line(cells: list[str]) -> str:
        head = [c.rjust(w) if i in (3, 4) else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=False))]  # fmt: skip
        return "  ".join([*head, cells[-1]]).rstrip()

    return [line(list(COLUMNS)), *(line(r) for r in rows)]


def format_status(status: dict[str, Any]) -> str:
    lines = [
        f"cluster {status.get('cluster', '')}: {status.get('state', '')}, "
        f"{status.get('running', 0)} running, {status.get('queued', 0)} queued",
    ]
    if status.get("plan_note"):
        lines.append(f"plan: {status['plan_note']}")
    if status.get("waiting_for"):
        lines.append(f"waiting for: {status['waiting_for']}")
    if status.get("local_layers"):
        lines.append(f"plan {status.get('plan_epoch', 0)}: the coordinator holds layers "
                     f"{status['local_layers']}")  # fmt: skip
    if status.get("max_running"):
        budget = int(status.get("kv_budget_tokens", 0))
        why = status.get("max_running_reason") or status["max_running"]
        lines.append(f"decoding up to {why}; KV budget "
                     f"{f'{budget:,} tokens' if budget else 'not measured'}; "
                     f"mode auto = {status.get('default_mode', '?')}")  # fmt: skip
    rows, notes = [coordinator_row(status)], {}
    for w in status.get("workers", []):
        rows.append(worker_row(w))
        notes[len(rows) - 1] = worker_notes(w)
    for i, text in enumerate(member_table(rows)):
        lines.append(text)
        lines += notes.get(i - 1, [])  # the header is line 0
    lines += format_links(status)
    for f in status.get("fetches", []):
        lines.append(format_fetch(f))
    if "prefix_cache" in status:
        lines.append(format_prefix_cache(status["prefix_cache"]))
    if "limits" in status:
        lines.append(format_limits(status["limits"]))
    return "\n".join(lines)


def worker_notes(w: dict[str, Any]) -> list[str]:
    """The indented lines under a worker's row: why it was rejected, its tensor group."""
    info, out = w.get("info", {}), []
    if w.get("detail"):
        out.append(f"    {w['detail']}")
    if w.get("group_leader"):
        out.append("    " + format_member(w))
    elif info.get("group_error"):
        out.append(f"    tensor group did not form: {info['group_error']}")
    return out


def format_links(status: dict[str, Any]) -> list[str]:
    """What `--tp auto` measured: each link (`link coordinator↔127.0.0.1:5001: 0.31 ms RTT,
    1.2 GB/s (256 KiB 0.52 ms, 4 MiB 3.6 ms)`) and each member's memory reads."""
    lines = []
    for link in status.get("links", []):
        pair = f"link {link.get('a', '')}↔{link.get('b', '')}"
        if link.get("error"):
            lines.append(f"{pair}: not measured: {link['error']}")
            continue
        rtt, rate = float(link.get("rtt_s", 0)), float(link.get("bandwidth", 0))
        small, large = float(link.get("small_s", 0)), float(link.get("large_s", 0))
        lines.append(
            f"{pair}: {rtt * 1e3:.2f} ms RTT, {rate / 1e9:.2f} GB/s "
            f"(256 KiB {small * 1e3:.2f} ms, 4 MiB {large * 1e3:.2f} ms)"
        )
    reads = [("coordinator", status.get("read_bandwidth", 0))] + [
        (w.get("address", ""), w.get("info", {}).get("read_bandwidth", 0))
        for w in status.get("workers", [])
    ]
    known = [f"{who} {float(r) / 1e9:.1f} GB/s" for who, r in reads if r]
    if known:
        lines.append(f"memory reads: {', '.join(known)}")
    return lines


def format_member(worker: dict[str, Any]) -> str:
    """`rank 1 of 2 (ring), tensor group of 127.0.0.1:5001`: where a member stands."""
    info = worker.get("info", {})
    rank, size = int(info.get("group_rank", 0)), int(info.get("group_size", 0))
    role = "leader" if worker.get("group_leader") == worker.get("address") else "member"
    return (
        f"{role}: rank {rank} of {size} ({info.get('group_backend', '?')}), tensor group of "
        f"{worker.get('group_leader')}"
    )


def format_limits(limits: dict[str, Any]) -> str:
    """`limits: requests up to 1,310,720 bytes (HTTP body, gRPC message); prompts up to 8,192
    tokens (663,552 characters)`: the request limit, the context, and the longest text
    tokenized at all."""
    n = {k: int(limits.get(k, 0)) for k in (
        "max_request_bytes", "context_tokens", "max_prompt_chars"
    )}  # fmt: skip
    return (
        f"limits: requests up to {n['max_request_bytes']:,} bytes (HTTP body, gRPC message); "
        f"prompts up to {n['context_tokens']:,} tokens ({n['max_prompt_chars']:,} characters)"
    )


def format_prefix_cache(cache: dict[str, Any]) -> str:
    """`prefix cache: 3 entries, 2,048/65,536 tokens; 5 hits of 9 requests (1,900 tokens
    not prefilled), 1 eviction` (64-bit counts arrive as strings from MessageToDict)."""
    if not cache.get("enabled"):
        return "prefix cache: off"
    n = {k: int(cache.get(k, 0)) for k in (
        "entries", "tokens", "capacity_tokens", "lookups", "hits", "hit_tokens", "evictions"
    )}  # fmt: skip
    return (
        f"prefix cache: {n['entries']} entries, {n['tokens']:,}/{n['capacity_tokens']:,} "
        f"tokens; {n['hits']} hits of {n['lookups']} requests ({n['hit_tokens']:,} tokens "
        f"not prefilled), {n['evictions']} evictions"
    )


def format_fetch(fetch: dict[str, Any]) -> str:
    """One worker's layer fetch: `fetching layers: w1 (ipv4:…) 1.2/3.4 GB 35% 80 MB/s ETA 28 s`."""
    done, total = int(fetch.get("bytes_done", 0)), int(fetch.get("bytes_total", 0))
    share = f"{100 * done / total:.0f}%" if total else "-"
    eta = float(fetch.get("eta_s", -1))
    rate = float(fetch.get("bytes_per_s", 0))
    who = fetch.get("node_id") or fetch.get("peer", "")
    return (
        f"fetching layers: {who} {done / 1e9:.2f}/{total / 1e9:.2f} GB {share} "
        f"{rate / 1e6:.0f} MB/s ETA {f'{eta:.0f} s' if eta >= 0 else '-'}"
    )
