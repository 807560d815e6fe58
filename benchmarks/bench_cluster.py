"""A benchmark cluster on this host: N `wedlm-worker` processes with fixed even layer
ranges (static list, no Bonjour), optionally one per GPU, and a coordinator that can be
restarted with other settings while the workers stay."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.model_config import load_model_config
from tests.cluster_harness import Proc, cluster_name, gpu_env, start_coordinator, start_worker

GPUS_HELP = "GPUs for the workers (GPU 0 stays with the coordinator when N > workers)"


def even_ranges(layers: int, n: int) -> list[str]:
    cuts = [round(i * layers / n) for i in range(n + 1)]
    return [f"{a}-{b - 1}" for a, b in itertools.pairwise(cuts)]


class Cluster:
    def __init__(self, model: Path, workers: int, max_running: int = 16, gpus: int = 0) -> None:
        self.model, self.max_running = model, max_running
        self.name = cluster_name()
        self.ranges = even_ranges(load_model_config(model).num_layers, workers)
        self.coordinator: Proc | None = None
        self.workers: list[tuple[Proc, str]] = []
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

    def start_coordinator(self, micro_batches: int | None = None) -> str:
        """(Re)start the coordinator over the workers; returns its address once serving."""
        self.stop_coordinator()
        extra = ["--no-bonjour", "--expect", str(len(self.workers))]
        for _, address in self.workers:
            extra += ["--worker", address]
        extra += ["--max-running", str(self.max_running), "--max-queued", str(4 * self.max_running)]
        if micro_batches:
            extra += ["--micro-batches", str(micro_batches)]
        self.coordinator, address = start_coordinator(self.model, self.name, *extra)
        self.coordinator.expect(r"wedlm-coordinator serving", timeout=600)
        return address

    def stop_coordinator(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator = None

    def stop(self) -> None:
        self.stop_coordinator()
        for proc, _ in self.workers:
            proc.stop()
