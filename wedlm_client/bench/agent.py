"""`wedlm bench agent`: an agent's session replayed against an OpenAI-compatible (chat
completions with tools) or Anthropic Messages URL. A synthetic, seeded session
(agent_session.py) is sent turn by turn, each turn the whole conversation so far, streamed
(agent_wire.py). Per turn: prompt and cached tokens (each API's own usage field), the share
of the prompt and of the previous turn's prompt served from cache, TTFT, decode tok/s and
the turn's time; then medians over the turns after the first (the first is the cold one).
A failed turn ends the replay: the turns before it are still reported."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Any

from common.errors import WedlmError
from wedlm_client.bench import report
from wedlm_client.bench.agent_session import Session, TokenCounter, build_session
from wedlm_client.bench.agent_wire import TurnTiming, anthropic_turn, openai_turn
from wedlm_client.bench.records import median

HIT_SHARE = 0.95  # issue #59's target: every turn after the first this much from cache
KEY_ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
TIMEOUT_S = 600.0


def root_url(url: str) -> str:
    """http(s)://HOST:PORT[/PREFIX][/v1] → the server's root (…/PREFIX): Anthropic's package
    adds /v1/messages, OpenAI's base is root + /v1, /tokenize sits at the root."""
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port is not None or parts.scheme in ("http", "https")
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise WedlmError(f"--url {url!r}: expected http(s)://HOST:PORT[/v1]")
    path = parts.path.rstrip("/").removesuffix("/v1")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def open_client(api: str, root: str, key: str):
    """The API's official client, or a one-line reason why there is none."""
    try:
        if api == "openai":
            import openai

            return openai.OpenAI(base_url=f"{root}/v1", api_key=key, max_retries=0,
                                 timeout=TIMEOUT_S)  # fmt: skip
        import anthropic

        return anthropic.Anthropic(base_url=root, api_key=key, max_retries=0, timeout=TIMEOUT_S)
    except ImportError:
        extra = "'wedlm-cluster[bench]'" if api == "openai" else "anthropic"
        raise WedlmError(f"--api {api} needs the {api} package: pip install {extra}") from None


def served_model(client, url: str) -> str:
    """The first model the server lists; a server that does not answer is said in one line."""
    try:
        models = list(client.models.list())
    except Exception as e:
        raise WedlmError(f"{url}: {failure(e)} (or give --model)") from None
    if not models:
        raise WedlmError(f"{url}: lists no model; give --model")
    return models[0].id


def failure(e: Exception) -> str:
    """One line for what went wrong in a call: no answer, a refusal (its status and the
    server's own message) or anything else."""
    status = getattr(e, "status_code", None)
    if status is not None:
        body = getattr(e, "body", None)
        error = body.get("error", body) if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        return f"refused: HTTP {status}: {message or getattr(e, 'message', e)}"
    if type(e).__name__ in ("APIConnectionError", "APITimeoutError"):
        return f"does not answer ({type(e).__name__}: {e.__cause__ or e})"
    return f"{type(e).__name__}: {e}"


def row(k: int, t: TurnTiming, previous_prompt: int | None) -> dict[str, Any]:
    prompt, cached, out = t.prompt_tokens, t.cached_tokens, t.completion_tokens
    decoded = (out if out is not None else t.content_events) - 1
    return {
        "turn": k, "prompt_tokens": prompt, "cached_tokens": cached,
        "cached_share": round(cached / prompt, 4) if prompt and cached is not None else None,
        # what could have come from cache: the previous turn's whole prompt
        "reused_share": (round(min(cached / previous_prompt, 1.0), 4)
                         if previous_prompt and cached is not None else None),
        "ttft_ms": None if t.ttft_s is None else round(1000 * t.ttft_s, 2),
        "decode_tok_s": round(decoded / t.decode_s, 2) if t.decode_s and decoded > 0 else None,
        "completion_tokens": out, "total_s": round(t.total_s, 3),
    }  # fmt: skip


def summary(rows: list[dict]) -> dict[str, Any]:
    """Medians over the turns after the first, and whether each of them met HIT_SHARE."""
    later = rows[1:]

    def every(key: str) -> bool | None:
        values = [r[key] for r in later]
        return None if not values or None in values else all(v >= HIT_SHARE for v in values)

    return {
        "turns": len(rows),
        "first_turn_ttft_ms": rows[0]["ttft_ms"] if rows else None,
        **{f"{key}_median": median([r[key] for r in later])
           for key in ("ttft_ms", "decode_tok_s", "cached_share", "reused_share")},
        f"every_later_turn_cached_{round(100 * HIT_SHARE)}": every("cached_share"),
        f"every_later_turn_reused_{round(100 * HIT_SHARE)}": every("reused_share"),
        "last_prompt_tokens": rows[-1]["prompt_tokens"] if rows else None,
    }  # fmt: skip


def replay(client, args, model: str, session: Session, result: dict) -> str | None:
    """The turns in order, each row into result["turns"]; the first failure, said in one
    line, ends it (and is returned)."""
    send = openai_turn if args.api == "openai" else anthropic_turn
    progress = report.Progress(len(session.turns), "agent")
    previous = None
    for k in range(1, len(session.turns) + 1):
        try:
            timing = send(client, model, session, k, args.max_tokens)
        except KeyboardInterrupt:  # Ctrl-C: the turns so far are still reported
            return f"turn {k}: interrupted"
        except Exception as e:
            return f"turn {k}: {args.url} {failure(e)}"
        result["turns"].append(r := row(k, timing, previous))
        previous = r["prompt_tokens"]
        progress.step(f"turn {k}: prompt {report.shown(r['prompt_tokens'])}, cached "
                      f"{report.shown(r['cached_tokens'])}, TTFT {report.shown(r['ttft_ms'])} ms")
    return None  # fmt: skip


def run(args) -> dict[str, Any]:
    root = root_url(args.url)
    low, high = args.tool_result_tokens
    if low > high:
        raise WedlmError(f"--tool-result-tokens {low} {high}: MIN must not exceed MAX")
    key = args.api_key or os.environ.get(KEY_ENV[args.api]) or "bench"
    result = report.header("agent", {k: (str(v) if isinstance(v, Path) else v)
                                     for k, v in vars(args).items()
                                     if k not in ("func", "api_key")})  # fmt: skip
    result["turns"] = []
    client = open_client(args.api, root, key)
    with client:
        model = args.model or served_model(client, args.url)
        counter = TokenCounter(root, key)
        session = build_session(counter, args.system_tokens, args.turns,
                                (low, high), args.budget_tokens,
                                args.seed)  # fmt: skip
        result["target"] = {"url": args.url, "api": args.api, "model": model}
        result["session"] = {"system_and_tools_tokens": session.system_tokens,
                             "turns": len(session.turns),
                             "tokens_estimated": session.system_tokens
                             + sum(t.tokens for t in session.turns),
                             "stopped_by_budget": session.stopped_by_budget,
                             "counted_by": session.counted_by}  # fmt: skip
        error = replay(client, args, model, session, result)
    result["summary"] = summary(result["turns"])
    if error:
        result["error"] = error
    save_plot(result, args.out / "agent.png")
    report.emit(result, text_table(result), args.out, "agent", args.json)
    if error:
        raise WedlmError(error)  # after the rows: the exit status says a turn failed
    return result


def text_table(result: dict) -> str:
    cols = ["turn", "prompt", "cached", "cached %", "reused %", "TTFT ms", "decode tok/s",
            "out", "total s"]  # fmt: skip
    rows = [[r["turn"], r["prompt_tokens"], r["cached_tokens"], _percent(r["cached_share"]),
             _percent(r["reused_share"]), r["ttft_ms"], r["decode_tok_s"], r["completion_tokens"],
             r["total_s"]] for r in result["turns"]]  # fmt: skip
    t, s, m = result["target"], result["session"], result["summary"]
    hit = round(100 * HIT_SHARE)
    lines = [f"{t['api']} {t['url']} ({t['model']}): {s['turns']} turns, system and tools "
             f"~{s['system_and_tools_tokens']} tokens, ~{s['tokens_estimated']} in all "
             f"(sized by {s['counted_by']})",
             "(cached %: of the turn's prompt; reused %: of the previous turn's prompt)",
             report.table(cols, rows) if rows else "no turn finished",
             f"turns after the first, medians: TTFT {report.shown(m['ttft_ms_median'])} ms, "
             f"decode {report.shown(m['decode_tok_s_median'])} tok/s; every one >= {hit} % "
             f"cached: {report.shown(m[f'every_later_turn_cached_{hit}'])}, >= {hit} % of "
             f"the previous prompt reused: {report.shown(m[f'every_later_turn_reused_{hit}'])}"]
    tail = [*([result["plot"]] if "plot" in result else []),
            *([result["error"]] if "error" in result else [])]
    return "\n".join([*lines, *tail])  # fmt: skip


def _percent(share: float | None) -> float | None:
    return None if share is None else round(100 * share, 1)


def save_plot(result: dict, path: Path) -> None:
    """TTFT and the cached shares per turn; or why there is no plot (an older run's
    agent.png is removed then, so that it does not pass for this one's)."""
    result["files"] = {}
    turns = result["turns"]
    made = report.figure(2, f"wedlm bench agent: {result['target']['api']} "
                         f"{result['target']['model']}, {result['date']}") if turns else None
    if made is None:
        path.unlink(missing_ok=True)
        result["plot"] = ("no plot: no turn finished" if not turns else
                          "no plot: matplotlib is not installed (pip install "
                          "'wedlm-cluster[bench]')")  # fmt: skip
        return
    fig, (ttft, share) = made
    ks = [r["turn"] for r in turns]
    nan = float("nan")
    ttft.plot(ks, [nan if r["ttft_ms"] is None else r["ttft_ms"] for r in turns], "o-")
    for key, label in (("cached_share", "of the prompt"), ("reused_share", "of the previous "
                       "prompt")):  # fmt: skip
        share.plot(ks, [nan if r[key] is None else r[key] for r in turns], "o-", label=label)
    share.axhline(HIT_SHARE, color="grey", linestyle=":", label=f"{round(100 * HIT_SHARE)} %")
    from matplotlib.ticker import MaxNLocator

    for ax, ylabel in ((ttft, "TTFT (ms)"), (share, "share served from cache")):
        report.finish_axes(ax, "turn", ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # turns are whole
    result["files"]["png"] = report.save_figure(fig, path)
