"""The servers of benchmarks/dev/tp_gpu.py's `servers` phase: `mlx_lm.server` as TP ranks
under mlx.launch, and our cluster started from command templates (--ours-cmd), both driven
by benchmarks/dev/serve_openai.py's loop (the `openai` package, one server up at a time).

Our cluster is a list of commands started in order; each but the last must print a line
matching --ours-ready before the next starts (a worker's "listening on"); the last serves
the HTTP API on {http_port} (ready at /health/ready). Each template is split like a shell
line (`env CUDA_VISIBLE_DEVICES=1 {python} -m ...` gives a process its GPU) after these
fields are filled in: {python} {model} {cluster} {http_port}, {port0} .. {port7} (free
ports, new at each start) and {range0} .. {rangeN-1} (the model's layers cut into
--ours-ranges even ranges, "A-B")."""

from __future__ import annotations

import secrets
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.dev.bench_cluster import even_ranges
from benchmarks.dev.serve_openai import Server
from benchmarks.dev.tp_launch import launched
from common.model_config import load_model_config
from devtools.cluster_harness import Proc, free_port, spawn_command

_WORKER = ("env CUDA_VISIBLE_DEVICES={gpu} {python} -m shard_worker.cli --model {model} "
           "--host 127.0.0.1 --port {port%d} --cluster {cluster} --no-bonjour")  # fmt: skip
_COORDINATOR = ("env CUDA_VISIBLE_DEVICES=0 {python} -m coordinator.service.server_cli serve "
                "--model {model} --port 0 --http-port {http_port} --state-dir none "
                "--no-bonjour --cluster {cluster} --no-local-layers --expect 2 "
                "--worker 127.0.0.1:{port0} --worker 127.0.0.1:{port1}")  # fmt: skip
# What exists today: 2 workers, one per GPU, each a pipeline stage of half the layers.
PIPELINE2 = [
    _WORKER.replace("{gpu}", "0").replace("{port%d}", "{port0}") + " --layers {range0}",
    _WORKER.replace("{gpu}", "1").replace("{port%d}", "{port1}") + " --layers {range1}",
    _COORDINATOR,
]
# Issue 31's TP = 2 stage of two workers (`--tp 2`; the workers hold every layer, split).
TP2 = [
    _WORKER.replace("{gpu}", "0").replace("{port%d}", "{port0}"),
    _WORKER.replace("{gpu}", "1").replace("{port%d}", "{port1}"),
    _COORDINATOR + " --tp 2",
]
# Two machines' layout: the coordinator leads the group (rank 0 on GPU 0), one worker rank 1.
TP2C = [
    _WORKER.replace("{gpu}", "1").replace("{port%d}", "{port0}"),
    _COORDINATOR.replace(" --no-local-layers --expect 2", " --expect 1").replace(
        " --worker 127.0.0.1:{port1}", ""
    )
    + " --tp 2",
]
# Ours on one GPU: the coordinator alone holds every layer.
ONE = [
    "env CUDA_VISIBLE_DEVICES=0 {python} -m coordinator.service.server_cli serve --model {model} "
    "--port 0 --http-port {http_port} --state-dir none --no-bonjour --cluster {cluster}"
]
PRESETS = {"pipeline2": PIPELINE2, "tp2": TP2, "tp2c": TP2C, "one": ONE}


@dataclass
class MlxLaunchServer(Server):
    """`inner` as `tp` ranks under mlx.launch (new ports at each start); rank 0 serves."""

    inner: list[str] = field(default_factory=list)
    tp: int = 2
    backend: str = "nccl"

    def launch(self) -> Proc:
        self.argv = launched(self.inner, self.tp, self.backend)
        self.info["command"] = shlex.join(self.argv)
        return spawn_command(self.argv, group=True)


@dataclass
class TemplateCluster(Server):
    """Our cluster from command templates (see the module's doc)."""

    templates: list[str] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    ready: str = "listening on"
    ready_timeout: float = 600.0
    others: list[Proc] = field(default_factory=list)

    def launch(self) -> Proc:
        self.others = []
        values = {**self.fields, "http_port": str(self.port),
                  "cluster": f"bench-tp-{secrets.token_hex(4)}",
                  **{f"port{i}": str(free_port()) for i in range(8)}}  # fmt: skip
        commands = [shlex.split(t.format(**values)) for t in self.templates]
        self.info["commands"] = [shlex.join(c) for c in commands]
        for argv in commands[:-1]:
            proc = spawn_command(argv, group=True)
            self.others.append(proc)
            try:
                proc.expect(self.ready, timeout=self.ready_timeout)
            except AssertionError as e:
                self.stop()
                raise RuntimeError(f"ours: {argv[:6]} did not print {self.ready!r}: {e}") from e
        return spawn_command(commands[-1], group=True)

    def stop(self) -> None:
        super().stop()
        for proc in reversed(self.others):
            proc.stop()

    def tail(self, lines: int = 25) -> str:
        parts = ["".join(p.log[-lines:]) for p in self.others]
        return "\n---- next process ----\n".join([*parts, super().tail(lines)])


def template_fields(model: Path, ranges: int) -> dict[str, str]:
    layers = load_model_config(model).num_layers
    cuts = even_ranges(layers, ranges)
    return {"python": sys.executable, "model": str(model),
            **{f"range{i}": r for i, r in enumerate(cuts)}}  # fmt: skip


def make_servers(model: Path, args) -> dict[str, Server]:
    """`ours` and `mlx-lm` (serve_openai's names: its ratios are ours / mlx-lm)."""
    servers: dict[str, Server] = {}
    for name in args.servers:
        port = free_port()
        if name == "mlx-lm":
            inner = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                     "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
            servers[name] = MlxLaunchServer(name, inner, port, "/health",
                                            model_id="default_model", inner=inner, tp=args.tp,
                                            backend=args.backend)  # fmt: skip
        else:
            templates = args.ours_cmd or PRESETS[args.ours]
            extra = None if args.ours_mode == "default" else {"mode": args.ours_mode}
            servers[name] = TemplateCluster(name, [], port, "/health/ready", extra=extra,
                                            templates=templates,
                                            fields=template_fields(model, args.ours_ranges),
                                            ready=args.ours_ready,
                                            ready_timeout=args.start_timeout)  # fmt: skip
            servers[name].info["templates"] = templates
    return servers
