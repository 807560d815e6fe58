"""The serving comparison over the OpenAI API, on servers it starts: our coordinator against
mlx-lm's server and vllm-mlx, each a real server process on 127.0.0.1 serving the same
checkpoint with its default flags (only what it needs to serve: model, host, port; ours
also `--port 0 --state-dir none --no-bonjour` and a cluster name of its own).

At each concurrency C and in each round, every server in turn (the order reversed every
round, ABAB) takes a closed loop: C clients, spread over `--client-processes` processes,
each send streaming `/v1/completions` requests one after another through the official
`openai` package (`stream_options={"include_usage": True}`, temperature 0, `--max-tokens`),
for `--warmup` unmeasured seconds and then `--duration` measured ones. Every prompt starts
with words of its own (wedlm_client.bench.clients.OpenAIRequest), so no two requests share a
prefix and no prefix cache makes the load trivial.

Per server, level and round: tok/s (the completion tokens of every request that ended
inside the measured window, those sent during the warm-up too, / its length: a request's
tokens are its usage's completion_tokens, or its chunks with text when the server sends no
usage), TTFT p50 / p90 (first chunk with text) and TPOT p50 of the requests sent after the
warm-up, requests done (ended in the window) and failed requests (any exception or non-200,
warm-up included). A request should take well under --duration, or few end in a window.
Then per level the medians over rounds, ours / the best competitor (the faster of mlx-lm
and vllm-mlx), and the targets: ours >= 1.2x the best competitor's tok/s and a lower TTFT
p50 at every C, and no failed request of ours.

Prints one JSON object and writes serve-openai.json, serve-openai.png and each server's
output (serve-openai-NAME.log) to --out. All servers stay up for the whole run (each loads
the model once) unless --one-at-a-time, which runs only one at a time (restarting it when
its turn comes) for a GPU that cannot hold them all.

vllm-mlx is run when its command is found: `vllm-mlx` on PATH, or --vllm-mlx-cmd;
otherwise the JSON says why it was left out. vllm-mlx 0.6.0 pins mlx-lm < 0.32, which this
project's mlx-lm >= 0.32.2 excludes, so it needs a place of its own. It installs and runs
on Linux once an MLX backend is there (its own venv: `pip install vllm-mlx mlx-cpu`, or
mlx-cuda-13), or over this project's environment with a few packages put first on its
PYTHONPATH: `pip install --no-deps --target /tmp/vsite vllm-mlx==0.6.0 mlx-lm==0.31.3
jsonschema jsonschema-specifications referencing rpds-py attrs`, then
`--vllm-mlx-cmd "env PYTHONPATH=/tmp/vsite:$PYTHONPATH python3 -m vllm_mlx.cli"` (on the
device machine, bring those as wheels). Its default engine is the "simple" one: one
request at a time, and by default a 503 for any request that comes while one runs;
`--vllm-mlx-flags=--continuous-batching` runs its batching engine.

GPU run (nvidia-h100-x1; both servers, or all three where vllm-mlx was brought along):
  python benchmarks/dev/serve_openai.py --model random-qwen3-8b --ckpt-dir /tmp/rq8b \\
      --concurrency 1 8 32 64 --duration 15 --warmup 5 --max-tokens 128 --out $OUT/d
Smoke test (CPU, a tiny checkpoint; short requests so that some end in a short window):
  python benchmarks/dev/serve_openai.py --model /tmp/tinyq --concurrency 1 8 --duration 4 \\
      --warmup 1 --rounds 1 --max-tokens 32 --out /tmp/so
"""

from __future__ import annotations

import argparse
import json
import secrets
import shlex
import shutil
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dev import bench_io
from benchmarks.dev.bench_io import device_name, prepare_model, ratio
from benchmarks.dev.serve_http import OpenAIRequest, level
from devtools.cluster_harness import Proc, free_port, spawn_command
from wedlm_client.bench.load import client_pool
from wedlm_client.bench.records import PROMPTS, now
from wedlm_client.bench.serve import abab, kept
from wedlm_client.bench.serve import medians as server_medians

SERVERS = ("ours", "mlx-lm", "vllm-mlx")
COMPETITORS = ("mlx-lm", "vllm-mlx")
TARGETS = {"ours_over_best_tok_s": 1.2, "ttft_p50": "ours lower at every C", "failed": 0}


# ---- the servers ---------------------------------------------------------------------------
@dataclass
class Server:
    """One OpenAI-compatible server process: its command line, readiness path and the model
    name its requests carry (None: the first id of its /v1/models)."""

    name: str
    argv: list[str]
    port: int
    health: str
    model_id: str | None = None
    proc: Proc | None = None
    group: bool = False  # a launcher (mlx.launch): stopped with all it started
    extra: dict | None = None  # extra body fields of its requests (ours: the WeDLM ones)
    info: dict = field(default_factory=dict)
    past_log: list[str] = field(default_factory=list)  # of its earlier processes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.popen.poll() is None

    def tail(self, lines: int = 25) -> str:
        return "".join(self.proc.log[-lines:]) if self.proc else ""

    def start(self, timeout: float) -> None:
        """Start it and wait until its readiness path answers 200 and one short streamed
        completion comes back; raises with the server's last lines otherwise."""
        t0 = now()
        if self.proc is not None:
            self.past_log += [*self.proc.log, "---- restarted ----\n"]
        self.proc = self.launch()
        deadline = t0 + timeout
        while not _get(f"http://127.0.0.1:{self.port}{self.health}"):
            if not self.alive:
                rc = self.proc.popen.wait(5)
                raise RuntimeError(f"{self.name} exited ({rc}) before it was ready:\n{self.tail()}")
            if now() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.5)
        if self.model_id is None:
            self.model_id = json.loads(_get(f"{self.url}/models"))["data"][0]["id"]
        self.info.update(probe(self))
        self.info.setdefault("ready_s", []).append(round(now() - t0, 1))

    def launch(self) -> Proc:
        """Start its process(es); the returned one serves HTTP (a subclass may start more)."""
        return spawn_command(self.argv, group=self.group)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read() if r.status == 200 else None
    except OSError:
        return None


def probe(server: Server) -> dict:
    """One streamed completion of a few tokens: the server answers, and whether its stream
    carries usage."""
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="bench", max_retries=0, timeout=300)
    text, usage = "", None
    try:
        stream = client.completions.create(model=server.model_id, prompt=PROMPTS[0], max_tokens=8,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text or ""
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
    except Exception as e:
        server.stop()
        raise RuntimeError(
            f"{server.name}: the first request failed: {e!r}\n{server.tail()}"
        ) from e
    finally:
        client.close()
    return {"probe_text": text, "usage_in_stream": usage is not None}


def make_servers(model: Path, args) -> tuple[dict[str, Server], dict[str, str]]:
    """The servers asked for, and why any of them is left out."""
    servers, skipped = {}, {}
    for name in args.servers:
        port = free_port()
        if name == "ours":
            argv = [sys.executable, "-m", "coordinator.service.server_cli", "serve",
                    "--model", str(model), "--http-port", str(port), "--port", "0",
                    "--state-dir", "none", "--no-bonjour",
                    "--cluster", f"bench-openai-{secrets.token_hex(4)}",
                    *shlex.split(args.ours_flags)]  # fmt: skip
            servers[name] = Server(name, argv, port, "/health/ready")
        elif name == "mlx-lm":  # `python -m mlx_lm.server` is the same server, deprecated
            argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
            # its /v1/models also lists the hub cache; "default_model" is the --model one
            servers[name] = Server(name, argv, port, "/health", model_id="default_model")
        elif name == "vllm-mlx":
            cmd = shlex.split(args.vllm_mlx_cmd or shutil.which("vllm-mlx") or "")
            if not cmd:
                skipped[name] = "not installed (no vllm-mlx on PATH; see --vllm-mlx-cmd)"
                continue
            argv = [*cmd, "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                    *shlex.split(args.vllm_mlx_flags)]  # fmt: skip
            servers[name] = Server(name, argv, port, "/health")
    for s in servers.values():
        s.info["command"] = shlex.join(s.argv)
    return servers, skipped


# ---- the runs ------------------------------------------------------------------------------
def run_all(servers: dict[str, Server], skipped: dict[str, str], args, result: dict) -> None:
    levels = result["levels"]
    names = list(servers)
    run_tag = 0
    with client_pool(args.client_processes) as pool:
        for c, r, order in abab(args.concurrency, args.rounds, names):
            if r == 0:
                rounds: list[dict] = []
            runs: dict = {"order": order}
            for name in order:
                if name in skipped:
                    continue
                server = servers[name]
                if args.one_at_a_time and not server.alive:
                    for other in servers.values():
                        other.stop()
                    try:
                        server.start(args.start_timeout)
                    except RuntimeError as e:
                        skipped[name] = str(e)
                        continue
                run_tag += 1
                req = OpenAIRequest(args.max_tokens, 0.0, extra=server.extra, tag=run_tag)
                stats = level(pool, args.client_processes, "openai", server.url,
                              server.model_id, c, req, args, label=name)  # fmt: skip
                runs[name] = kept(stats)
                print(f"C={c} {name}: {json.dumps(runs[name])}", file=sys.stderr, flush=True)
                if not server.alive:
                    rc = server.proc.popen.wait(5)
                    skipped[name] = f"exited ({rc}) during C={c}:\n{server.tail()}"
            rounds.append(runs)
            levels[str(c)] = {"rounds": rounds}
            bench_io.save_json(result, args.out, "serve-openai.partial.json")
            if r == args.rounds - 1:
                levels[str(c)].update(medians(rounds, names))


def medians(rounds: list[dict], names: list[str]) -> dict:
    """Per server: medians over rounds (failed: the sum); then ours / the best competitor."""
    out: dict = {"median": server_medians(rounds, names)}
    med = out["median"]
    rivals = [n for n in COMPETITORS if n in med and med[n]["tok_s"] is not None]
    if rivals and "ours" in med:
        best = max(rivals, key=lambda n: med[n]["tok_s"])
        out["best_competitor"] = best
        out["ours_over_best_tok_s"] = ratio(med["ours"]["tok_s"], med[best]["tok_s"])
        out["ours_over_best_ttft_p50"] = ratio(med["ours"]["ttft_ms_p50"],
                                                med[best]["ttft_ms_p50"])  # fmt: skip
    return out


def targets(levels: dict) -> dict:
    t: dict = {"required": TARGETS}
    ratios = {c: v.get("ours_over_best_tok_s") for c, v in levels.items()}
    ttft = {c: v.get("ours_over_best_ttft_p50") for c, v in levels.items()}
    failed = {c: v.get("median", {}).get("ours", {}).get("failed") for c, v in levels.items()}
    t["ours_over_best_tok_s"] = ratios
    t["ours_over_best_ttft_p50"] = ttft
    t["ours_failed"] = failed
    if any(v is None for v in (*ratios.values(), *ttft.values(), *failed.values())):
        t["met"] = None
        t["note"] = "a level lacks ours or every competitor: the targets cannot be judged"
        return t
    t["tok_s_met"] = all(r >= TARGETS["ours_over_best_tok_s"] for r in ratios.values())
    t["ttft_met"] = all(r < 1.0 for r in ttft.values())
    t["failed_met"] = all(f == 0 for f in failed.values())
    t["met"] = t["tok_s_met"] and t["ttft_met"] and t["failed_met"]
    return t


# ---- report --------------------------------------------------------------------------------
STYLE = {"ours": ("o-", "C0"), "mlx-lm": ("s--", "C1"), "vllm-mlx": ("^:", "C2")}


def plot(result: dict, path: Path) -> None:
    """tok/s and TTFT p50 against C per server: the medians as lines, each round a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    cs = sorted(int(c) for c in levels)
    for name, (style, color) in STYLE.items():
        for key, ax in (("tok_s", a), ("ttft_ms_p50", b)):
            xs = [c for c in cs if name in levels[str(c)].get("median", {})]
            if not xs:
                continue
            ys = [levels[str(c)]["median"][name][key] for c in xs]
            failed = sum(levels[str(c)]["median"][name]["failed"] for c in xs)
            label = f"{name} ({failed} failed requests)" if failed else name
            ys = [float("nan") if y is None else y for y in ys]
            ax.plot(xs, ys, style, color=color, label=label)
            dots = [(int(c), r[name][key]) for c, v in levels.items() for r in v["rounds"]
                    if name in r and r[name][key] is not None]  # fmt: skip
            if dots:
                ax.plot(*zip(*dots, strict=True), ".", color=color, alpha=0.35)
    for ax, ylabel in ((a, "aggregate output tok/s"), (b, "TTFT p50 (ms)")):
        xlabel = "concurrent streaming requests (OpenAI /v1/completions)"
        bench_io.finish_axes(ax, xlabel, ylabel, xs=cs)
    fig.suptitle(f"{result['model']}, {result['device']}, max_tokens {result['max_tokens']}, "
                 f"{result['duration_s']} s x {result['rounds']} rounds per level",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_io.add_random_model_flags(ap)
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of " +
                    ", ".join(SERVERS))  # fmt: skip
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    bench_io.add_loop_flags(ap, max_tokens=128, duration=15.0, warmup=5.0, rounds=2)
    ap.add_argument("--client-processes", type=int, default=4)
    ap.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="only one server up at a time (a GPU that cannot hold them all)",
    )
    ap.add_argument("--ours-flags", default="", help="extra flags for our server, one string")
    ap.add_argument("--vllm-mlx-cmd", help="the vllm-mlx command (default: vllm-mlx on PATH)")
    ap.add_argument("--vllm-mlx-flags", default="", help="extra flags for vllm-mlx serve")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="s for a server to be ready")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = ap.parse_args()
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := set(args.servers) - set(SERVERS):
        ap.error(f"unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    if args.rounds < 1 or args.duration <= 0:
        ap.error("--rounds must be at least 1 and --duration positive")
    args.requests = 0  # serve_http.level's Schedule: by duration
    args.concurrency = sorted(args.concurrency)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups on a kill
    t_start = now()
    model, name = prepare_model(args)
    import mlx.core as mx

    args.out.mkdir(parents=True, exist_ok=True)
    servers, skipped = make_servers(model, args)
    result: dict = {
        "model": name, "model_path": str(model), "device": device_name(),
        "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
        "max_tokens": args.max_tokens, "duration_s": args.duration, "warmup_s": args.warmup,
        "rounds": args.rounds, "client_processes": args.client_processes,
        "one_at_a_time": args.one_at_a_time, "ours_flags": args.ours_flags,
        "vllm_mlx_flags": args.vllm_mlx_flags,
        "tok_s": "completion tokens of requests ended in the window (warm-up ones too) / window",
        "servers": {n: s.info for n, s in servers.items()}, "levels": {},
    }  # fmt: skip
    try:
        if not args.one_at_a_time:
            for s in servers.values():  # one after another: loads do not compete
                try:
                    s.start(args.start_timeout)
                except RuntimeError as e:
                    skipped[s.name] = str(e)
        run_all(servers, skipped, args, result)
    finally:
        for s in servers.values():
            s.stop()
            if s.proc is not None:  # its whole output, for what the JSON cannot say
                log = args.out / f"serve-openai-{s.name}.log"
                log.write_text("".join([*s.past_log, *s.proc.log]))
    for n, why in skipped.items():
        result["servers"][n] = {**result["servers"].get(n, {}), "skipped": why}
    result["targets"] = targets(result["levels"])
    result["total_s"] = round(now() - t_start, 1)
    bench_io.finish(result, args.out, "serve-openai", {"serve-openai.png": plot})


if __name__ == "__main__":
    main()
