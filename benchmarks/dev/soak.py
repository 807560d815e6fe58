"""Soak test: a real cluster (W workers found over Bonjour + a coordinator) under a closed
loop of C concurrent mixed WeDLM/AR requests for --minutes, with one worker killed (-9,
round robin) every --kill-every s and a new one started --restart-after s later. Records
failures, recovery times, RSS per process every 5 s and throughput. Prints one JSON object
(without the raw samples) and writes soak.json, soak.png and the process logs to --out.

  python benchmarks/dev/soak.py --tiny --minutes 4 --kill-every 60 --concurrency 8
  WEDLM_CACHE_DIR=/tmp/wedlm-cache python benchmarks/dev/soak.py --model default
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import psutil

from common.generation_params import GenerationParams
from wedlm_client.client import ClusterError, WedlmClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ is not installed
from devtools.cluster_harness import Proc, cluster_name, start_coordinator, start_worker

SAMPLE_S, POLL_S = 5.0, 0.2
WORDS = ("robot", "count", "fox", "dog", "shells", "sea", "window", "decode", "mask", "sum")
OK = ("length", "stop")
now = time.monotonic


def params_for(i: int, max_tokens: int) -> GenerationParams:
    """Even jobs WeDLM, odd AR; lengths in [max/2, max]; every third one sampled."""
    n, hot = max_tokens // 2 + (i * 7919) % (max_tokens - max_tokens // 2 + 1), i % 3 == 0
    mode, temp, top_p = ("ar" if i % 2 else "wedlm"), (0.8 if hot else 0.0), (0.95 if hot else 1)
    return GenerationParams(mode=mode, max_tokens=max(1, n), temperature=temp, top_p=top_p, seed=i)


# --tiny: a 6-layer Qwen3 of hidden 64 that decodes as WeDLM-trained (its <mask> in the vocabulary)
TINY_SPECIALS = {"<|endoftext|>": 316, "<|im_start|>": 317, "<|im_end|>": 318, "<mask>": 319}
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "mask_token_id": TINY_SPECIALS["<mask>"],
    "wedlm": {"note": "random weights: decoded as a WeDLM-trained checkpoint"},
}  # fmt: skip


def prompt_for(i: int) -> str:
    return " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 4 + i % 9)) + f" {i}"


def fit_mb_per_h(ts: list[float], mb: list[float]) -> float | None:
    if len(ts) < 3 or ts[-1] - ts[0] < 2 * SAMPLE_S:
        return None
    return round(float(np.polyfit(np.array(ts) / 3600.0, np.array(mb), 1)[0]), 2)


class Soak:
    def __init__(self, args: argparse.Namespace, model: Path) -> None:
        self.args, self.model, self.cluster = args, model, cluster_name()
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.completed = self.tokens = self.failed = 0
        self.failures: Counter[str] = Counter()
        self.failure_log: list[tuple[float, str]] = []
        self.samples: list[dict] = []
        self.faults: list[dict] = []
        self.procs: dict[str, Proc] = {}  # every process ever started, by name
        self.addr: dict[str, str] = {}  # worker name -> address
        self.slots: list[str] = []  # the worker name now in each slot

    def add_worker(self, name: str) -> None:
        self.procs[name], self.addr[name] = start_worker(self.model, self.cluster)

    def start(self) -> None:
        for k in range(self.args.workers):
            self.add_worker(f"w{k}")
            self.slots.append(f"w{k}")
        extra = ("--expect", str(self.args.workers), "--max-running", "16", "--metrics-port", "0",
                 "--keep-finished", str(self.args.keep_finished))  # fmt: skip
        coord, self.address = start_coordinator(self.model, self.cluster, *extra)
        self.procs["coordinator"] = coord
        self.metrics_url = coord.expect(r"metrics on (http://\S+)").group(1)
        coord.expect("wedlm-coordinator serving")

    def sample(self) -> dict:
        """RSS (MB) of every live process; `layers`: workers the coordinator gave layers to."""
        rss = {}
        for name, proc in list(self.procs.items()):
            if proc.popen.returncode is None:  # not reaped yet: skip it if it is a zombie
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(proc.popen.pid)
                    if p.status() != psutil.STATUS_ZOMBIE:
                        rss[name] = round(p.memory_info().rss / 2**20, 1)
        lines = self.procs["coordinator"].log
        given = {ln.rsplit(" to ", 1)[1].strip() for ln in lines if "assigning layers" in ln}
        layers = [n for n, a in self.addr.items() if a in given]
        t = round(now() - self.t0, 1)
        with self.lock:
            row = dict(t=t, completed=self.completed, failures=self.failed, tokens=self.tokens)
        return row | {"rss_mb": rss, "layers": layers}

    def fail(self, reason: str) -> None:
        with self.lock:
            self.failed += 1
            self.failures[reason[:160]] += 1
            self.failure_log.append((round(now() - self.t0, 1), reason[:300]))

    def client_loop(self, k: int) -> None:
        a = self.args
        with WedlmClient(self.address, timeout=900) as client:
            for i in range(k, 1 << 40, a.concurrency):
                if now() >= self.deadline:
                    return
                try:
                    out = client.generate(text=prompt_for(i), params=params_for(i, a.max_tokens))
                    bad = out.get("error") or out["finish_reason"] not in OK
                    reason = f"final {out['finish_reason']} {out.get('error', '')}" if bad else ""
                except ClusterError as e:
                    reason = str(e)
                if reason:
                    self.fail(reason)
                    continue
                with self.lock:
                    self.completed += 1
                    self.tokens += len(out["tokens"])

    def sampler(self) -> None:
        while True:
            self.samples.append(self.sample())
            if self.stop.wait(SAMPLE_S):
                return

    def measure_recovery(self, rec: dict, t_kill: float) -> None:
        """Recovered = ClusterStatus says "serving" and a fresh small request completed."""
        states: list[tuple[float, str]] = []  # (s after the kill, state) at each change
        done = threading.Event()

        def watch() -> None:
            with WedlmClient(self.address) as c:
                while not done.is_set():
                    try:
                        s = c.cluster_status().state
                    except ClusterError as e:
                        s = f"error {e.code.name}"
                    if not states or states[-1][1] != s:
                        states.append((round(now() - t_kill, 2), s))
                    done.wait(POLL_S)

        threading.Thread(target=watch, daemon=True).start()
        limit, probe = t_kill + self.args.kill_every, GenerationParams(mode="ar", max_tokens=4)
        serving = lambda: bool(states) and states[-1][1] == "serving"  # noqa: E731
        with WedlmClient(self.address, timeout=self.args.kill_every) as c:
            while now() < limit and "recovery_s" not in rec:
                if serving():
                    try:
                        out = c.generate(text="probe", params=probe)
                        if serving() and out["finish_reason"] in OK:
                            rec["recovery_s"] = round(now() - t_kill, 2)
                    except ClusterError as e:
                        self.fail(f"probe {e}")
                time.sleep(POLL_S)
        done.set()
        rec.setdefault("recovery_s", None)  # None: not recovered within --kill-every
        rec["states"] = states

    def fault_loop(self) -> None:
        a, n = self.args, 0
        while (t_next := self.t0 + a.kill_every * (n + 1)) < self.deadline - a.restart_after - 10:
            time.sleep(max(0.0, t_next - now()))
            slot, t_kill = n % a.workers, now()
            victim = self.slots[slot]
            os.kill(self.procs[victim].popen.pid, signal.SIGKILL)
            rec = {"t_s": round(t_kill - self.t0, 1), "worker": victim}
            self.faults.append(rec)
            watcher = threading.Thread(target=self.measure_recovery, args=(rec, t_kill))
            watcher.start()
            self.procs[victim].popen.wait(10)
            time.sleep(max(0.0, t_kill + a.restart_after - now()))
            self.slots[slot] = name = f"w{slot}.{n // a.workers + 1}"
            self.add_worker(name)
            rec |= {"restarted": name, "restart_listening_s": round(now() - t_kill, 2)}
            watcher.join()
            n += 1

    def run(self) -> float:
        self.t0 = now()
        self.deadline = self.t0 + self.args.minutes * 60
        sampler = threading.Thread(target=self.sampler, daemon=True)
        n = self.args.concurrency
        clients = [threading.Thread(target=self.client_loop, args=(k,)) for k in range(n)]
        for th in (sampler, *clients):
            th.start()
        self.fault_loop()
        for th in clients:
            th.join()
        elapsed = now() - self.t0
        self.stop.set()
        sampler.join()
        return elapsed

    def server_finished(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        rows = [ln for ln in text.splitlines() if ln.startswith("wedlm:request_success_total{")]
        return {ln.split('"')[1]: float(ln.split()[-1]) for ln in rows}


def memory_report(samples: list[dict], long_s: float) -> dict[str, dict]:
    """Per process: first/last/max RSS and linear-fit slopes. Workers are fitted from the
    first sample after the coordinator gave them layers (a spare holds no weights)."""
    out = {}
    for name in dict.fromkeys(n for r in samples for n in r["rss_mb"]):
        rows = [r for r in samples if name in r["rss_mb"]]
        fit = [r for r in rows if name == "coordinator" or name in r["layers"]]
        ts, mb = [r["t"] for r in fit], [r["rss_mb"][name] for r in fit]
        half = len(ts) // 2
        out[name] = {
            "from_s": rows[0]["t"],
            "lived_s": rows[-1]["t"] - rows[0]["t"],
            "served_s": ts[-1] - ts[0] if ts else 0.0,
            "first_mb": rows[0]["rss_mb"][name],
            "last_mb": rows[-1]["rss_mb"][name],
            "max_mb": max(r["rss_mb"][name] for r in rows),
            "slope_mb_per_h": fit_mb_per_h(ts, mb),
            "slope_2nd_half_mb_per_h": fit_mb_per_h(ts[half:], mb[half:]),
        }
        out[name]["long_lived"] = out[name]["served_s"] >= long_s
    return out


def plot(result: dict, samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for name in result["memory"]:
        pts = [(r["t"] / 60, r["rss_mb"][name]) for r in samples if name in r["rss_mb"]]
        style = {"lw": 2.5, "color": "black"} if name == "coordinator" else {"lw": 1.2}
        a.plot(*zip(*pts, strict=True), label=name, **style)
    for ax in (a, b):
        for f in result["faults"]:
            ax.axvline(f["t_s"] / 60, color="red", ls=":", alpha=0.7)
    a.set(ylabel="RSS (MB)", title="RSS per process (red: kill -9 of a worker)")
    a.legend(fontsize=7, ncol=4)
    ts = [r["t"] / 60 for r in samples]
    b.plot(ts, [r["completed"] for r in samples], label="completed jobs")
    b.plot(ts, [r["failures"] for r in samples], label="failed jobs", color="red")
    b.set(xlabel="minutes", ylabel="jobs (cumulative)")
    b.legend()
    fig.suptitle(result["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="PATH or default")
    ap.add_argument("--tiny", action="store_true", help="a tiny random 6-layer qwen3 instead")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=180.0, help="seconds")
    ap.add_argument("--restart-after", type=float, default=5.0, help="seconds")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--keep-finished", type=int, default=10_000, help="the coordinator's --keep-finished"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from devtools.random_checkpoints import write_random_checkpoint

        model = Path(tempfile.mkdtemp(prefix="soak-tiny-"))
        write_random_checkpoint(model, TINY_QWEN3, specials=TINY_SPECIALS, max_length=2048)
        model_name = "tiny random qwen3 (6 layers, hidden 64, bf16)"
    else:
        from coordinator.engine.local_engine import resolve_model

        model, model_name = Path(resolve_model(args.model)), args.model
    soak = Soak(args, model)
    try:
        soak.start()
        elapsed = soak.run()
        finished = soak.server_finished()
    finally:
        for name, proc in soak.procs.items():
            proc.stop()
            (args.out / f"soak-{name}.log").write_text("".join(proc.log))
    rec = [f["recovery_s"] for f in soak.faults if f["recovery_s"] is not None]
    memory = memory_report(soak.samples, 0.9 * min(2 * args.kill_every, args.minutes * 60))
    long = [
        m["slope_mb_per_h"] for n, m in memory.items() if n != "coordinator" and m["long_lived"]
    ]
    result = {
        "title": f"soak: {model_name}, {args.workers} workers, concurrency {args.concurrency}, "
        f"kill every {args.kill_every:g} s, {args.minutes:g} min",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "elapsed_s": round(elapsed, 1),
        "completed": soak.completed,
        "failed": soak.failed,
        "failures": soak.failures,
        "failure_log": soak.failure_log[:50],
        "server_finished": finished,  # the coordinator's count, probes included
        "completion_tokens": soak.tokens,
        "tokens_per_s": round(soak.tokens / elapsed, 2),
        "faults": soak.faults,
        "recovery_s": rec,
        "recovery_median_s": statistics.median(rec) if rec else None,
        "recovery_max_s": max(rec, default=None),
        "not_recovered": sum(f["recovery_s"] is None for f in soak.faults),
        "memory": memory,
        "coordinator_slope_mb_per_h": memory["coordinator"]["slope_mb_per_h"],
        "worker_slope_max_long_lived_mb_per_h": max(
            (x for x in long if x is not None), default=None
        ),
    }
    (args.out / "soak.json").write_text(json.dumps({**result, "samples": soak.samples}, indent=1))
    plot(result, soak.samples, args.out / "soak.png")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
