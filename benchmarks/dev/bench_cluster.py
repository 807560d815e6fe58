"""A benchmark cluster on this host: N `wedlm-worker` processes with fixed even layer
ranges (static list, no Bonjour), optionally one per GPU, and a coordinator that can be
restarted with other settings while the workers stay.

Layouts:
- `local=False` (the default, as before issue 11): the workers hold every layer and the
  coordinator none (`--no-local-layers`);
- `local=True`: the coordinator holds the first range itself (`--layers 0-B`, next to the
  embedding) and the N workers the rest, so the model is cut into N + 1 even ranges;
- `workers=0`: the coordinator alone, holding every layer in-process.

With `gpus` > 0 the coordinator runs on GPU 0 and worker i on `gpu_env(i, gpus, N)`'s GPU."""

from __future__ import annotations

import itertools
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.model_config import load_model_config
from devtools.cluster_harness import Proc, cluster_name, gpu_env, spawn, start_worker

GPUS_HELP = "GPUs for the workers (GPU 0 stays with the coordinator when N > workers)"
SERVING = r"wedlm-coordinator serving"
# coordinator/engine/warmup.py's log line
BREAK_EVEN = re.compile(r"draft break-even \(.*by rows\): (.*), measured in")
WARM_UP = re.compile(r"warm-up: (\d+) forwards, (\d+) shapes \((\d+) new\) in ([\d.]+) s")


def even_ranges(layers: int, n: int) -> list[str]:
    cuts = [round(i * layers / n) for i in range(n + 1)]
    return [f"{a}-{b - 1}" for a, b in itertools.pairwise(cuts)]


class Cluster:
    def __init__(
        self,
        model: Path,
        workers: int,
        max_running: int = 16,
        gpus: int = 0,
        local: bool = False,
    ) -> None:
        self.model, self.max_running, self.gpus = model, max_running, gpus
        self.local = local or workers == 0
        self.name = cluster_name()
        num_layers = load_model_config(model).num_layers
        ranges = even_ranges(num_layers, workers + self.local) if workers or self.local else []
        self.coordinator_range = ranges[0] if self.local else None
        self.ranges = ranges[1:] if self.local else ranges  # the workers'
        self.coordinator: Proc | None = None
        self.flags: tuple[str, ...] = ()  # every coordinator's extra flags
        self.startup: dict = {}  # of the latest coordinator
        self.workers: list[tuple[Proc, str]] = []
        if not workers:
            return
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:  # they load in parallel
            starts = [pool.submit(start_worker, model, self.name, "--layers", r, "--no-bonjour",
                                  env=gpu_env(i, gpus, workers))
                      for i, r in enumerate(self.ranges)]  # fmt: skip
        try:
            self.workers = [f.result() for f in starts]
        except BaseException:
            for f in starts:
                if f.exception() is None:
                    f.result()[0].stop()
            raise
        self.workers_start_s = round(time.perf_counter() - t0, 2)

    def layout(self) -> str:
        parts = [f"coordinator {self.coordinator_range}"] if self.coordinator_range else []
        gpus = [gpu_env(i, self.gpus, len(self.ranges)) for i in range(len(self.ranges))]
        for r, env in zip(self.ranges, gpus, strict=True):
            parts.append(f"worker {r}" + (f" (GPU {env['CUDA_VISIBLE_DEVICES']})" if env else ""))
        return ", ".join(parts)

    def start_coordinator(
        self,
        micro_batches: int | None = None,
        env: dict[str, str] | None = None,
        flags: tuple[str, ...] = (),
        timeout: float = 600.0,
    ) -> str:
        """(Re)start the coordinator over the workers; returns its address once serving.
        `env`: extra environment (on top of GPU 0 when gpus > 0); `flags`: extra flags
        (after `self.flags`: the last of a repeated flag wins)."""
        self.stop_coordinator()
        extra = ["--no-bonjour", "--state-dir", "none", "--expect", str(len(self.workers))]
        for _, address in self.workers:
            extra += ["--worker", address]
        if self.coordinator_range:
            extra += ["--layers", self.coordinator_range]
        else:
            extra += ["--no-local-layers"]
        extra += ["--max-running", str(self.max_running), "--max-queued", str(4 * self.max_running)]
        if micro_batches:
            extra += ["--micro-batches", str(micro_batches)]
        full_env = {"CUDA_VISIBLE_DEVICES": "0"} if self.gpus > 0 else {}
        full_env.update(env or {})
        t0 = time.perf_counter()
        self.coordinator = spawn(
            "coordinator.service.server_cli", "serve", "--model", str(self.model), "--port", "0",
            "--cluster", self.name, *extra, *self.flags, *flags, env=full_env or None,
        )  # fmt: skip
        address = self.coordinator.expect(r"listening on (127\.0\.0\.1:\d+)").group(1)
        t1 = time.perf_counter()
        self.coordinator.expect(SERVING, timeout=timeout)
        t2 = time.perf_counter()
        self.startup = {"listening_s": round(t1 - t0, 2), "serving_s": round(t2 - t0, 2)}
        self.startup["warm_up"] = self.warm_up_report()
        return address

    def warm_up_report(self) -> dict | None:
        """What the coordinator's log says of its latest warm-up (None: it logged none)."""
        if self.coordinator is None:
            return None
        found = [m for line in self.coordinator.log if (m := WARM_UP.search(line))]
        if not found:
            return None
        forwards, shapes, new, seconds = found[-1].groups()
        return {"forwards": int(forwards), "shapes": int(shapes), "new_shapes": int(new),
                "seconds": float(seconds), "count": len(found)}  # fmt: skip

    def break_even(self) -> str | None:
        """The draft break-even the coordinator logged (step_timing.py; None: none)."""
        if self.coordinator is None:
            return None
        found = [m for line in self.coordinator.log if (m := BREAK_EVEN.search(line))]
        return found[-1].group(1) if found else None

    def stop_coordinator(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator = None

    def stop(self) -> None:
        self.stop_coordinator()
        for proc, _ in self.workers:
            proc.stop()
