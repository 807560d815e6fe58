"""What a start costs and what it measures (issue 54), on this machine: a coordinator serving
a random checkpoint of Qwen3-8B's shape marked WeDLM-trained (so that mode auto has a
choice to make), started twice on one cache folder. Per start: seconds to readiness, what
mode auto chose and why, the draft break-even (measured while idle after the first start,
reused at the second), and one request's wall time. Prints JSON, saves it and a bar plot.

    python benchmarks/dev/startup.py --layers 12 --out /tmp/startup
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from devtools.random_checkpoints import QWEN3_8B, write_random_qwen3

READY = re.compile(r"wedlm-coordinator serving ")
HTTP = re.compile(r"HTTP API on (http://\S+)/v1")


def _wedlm_marked(path: Path) -> None:
    """A 'wedlm' training record and a mask token in config.json: mode auto may pick WeDLM."""
    config = json.loads((path / "config.json").read_text())
    config.update(wedlm={"note": "random weights, marked for the startup benchmark"},
                  mask_token_id=151665)  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=1))


class Server:
    def __init__(self, model: Path, cache: Path) -> None:
        env = {**os.environ, "WEDLM_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "coordinator.service.server_cli", "serve", "--model",
                str(model), "--port", "0", "--http-port", "0", "--no-bonjour",
                "--cluster", "startup", "--state-dir", "none"]  # fmt: skip
        self.model = model.name  # the served name: the folder's
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.url = ""
        self.ready_s: float | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.monotonic() - self.started
            self.lines.append((now, line.rstrip()))
            if m := HTTP.search(line):
                self.url = m.group(1)
            if READY.search(line) and self.ready_s is None:
                self.ready_s = now

    def wait(self, pattern: str, timeout: float) -> str | None:
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, line in list(self.lines):
                if regex.search(line):
                    return line
            if self.proc.poll() is not None:
                return None
            time.sleep(0.2)
        return None

    def complete(self, prompt: str, tokens: int) -> float:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": tokens}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            json.loads(r.read())
        return time.perf_counter() - start

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def longest_quiet(self) -> float:
        times = [0.0] + [t for t, _ in self.lines if self.ready_s is None or t <= self.ready_s]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def one_start(model: Path, cache: Path, idle_wait_s: float) -> dict:
    server = Server(model, cache)
    try:
        if server.wait(READY.pattern, 900) is None:
            return {"failed": [line for _, line in server.lines[-20:]]}
        auto = server.wait("mode auto decodes with", 0.5)
        request_s = server.complete("w1 w2 w3 w4", 32)
        measured = server.wait(r"draft break-even \(", idle_wait_s)
        reused = server.wait("reusing what this machine measured", 0.5)
        return {
            "ready_s": round(server.ready_s, 2),
            "longest_quiet_before_ready_s": round(server.longest_quiet(), 2),
            "mode_auto_line": auto,
            "first_request_s": round(request_s, 3),
            "break_even_line": measured,
            "reused_line": reused,
        }
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12, help="of Qwen3-8B's 36")
    p.add_argument("--hidden", type=int, default=QWEN3_8B["hidden"], help="smaller: a smoke test")
    p.add_argument("--ckpt-dir", type=Path, default=Path(tempfile.gettempdir()) / "rq8b-wedlm")
    p.add_argument("--idle-wait", type=float, default=120.0,
                   help="seconds to wait for the idle measurement after the request")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("startup-out"))
    args = p.parse_args()
    model = write_random_qwen3(args.ckpt_dir, args.layers, args.hidden)
    _wedlm_marked(model)
    cache = Path(tempfile.mkdtemp(prefix="wedlm-startup-cache-"))
    result = {"layers": args.layers, "first": one_start(model, cache, args.idle_wait)}
    result["second"] = one_start(model, cache, 10.0)
    kept = cache / "measured-step-costs.json"
    result["kept"] = json.loads(kept.read_text()) if kept.exists() else None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    starts = [s for s in ("first", "second") if "ready_s" in result[s]]
    if starts:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(starts, [result[s]["ready_s"] for s in starts])
        ax.set_ylabel("seconds to readiness")
        ax.set_title(f"random Qwen3-8B shape, {args.layers} layers")
        fig.tight_layout()
        fig.savefig(args.out / "startup.png", dpi=120)


if __name__ == "__main__":
    main()
