"""How many MLX primitives one decode step launches, by mode and by kind (issue 35).

On MLX-CUDA a forward of a small model is bound by the host's per-op work (recording and
launching each kernel), so a mode's step costs roughly what its op count times the per-op
price comes to. This counts, for each decode step, the primitives of every graph the engine
hands to `mx.async_eval` / `mx.eval` (the forward, the head, selection and sampling), read
from `mx.export_to_dot`, and reports the median per mode and the difference per primitive
against AR. Counts do not depend on the machine; only the per-op price does.

On CUDA, --cuda-graphs DIR also counts what MLX commits per step: the CUDA graphs (one per
`MLX_MAX_OPS_PER_BUFFER` kernels or per launch, dumped through MLX_SAVE_CUDA_GRAPHS_DOT_FILE)
and their nodes (kernels, memsets, child graphs), with a few graphs kept in DIR to read.

  python benchmarks/dev/step_ops.py --model ../shared/models/wedlm-smollm2-135m-r2
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx

import common.model_parts as model_parts_module
import coordinator.engine.engine as engine_module
import coordinator.engine.pipeline as pipeline_module
from benchmarks.dev.bench_io import finish, run_info
from benchmarks.dev.speculative import COUNTING
from benchmarks.dev.step_profile import MODES
from coordinator.engine.local_engine import open_local_engine

LABEL = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


NODE = re.compile(r'^\s*"?[\w]+"?\s*\[.*label=', re.M)


class _CudaGraphs:
    """The CUDA graphs MLX committed since the last call (MLX numbers its dumps 1, 2, ...)."""

    def __init__(self, prefix: Path, keep: Path) -> None:
        self.prefix, self.keep, self.seen = prefix, keep, 0
        os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = str(prefix)  # read at the first commit

    def take(self, tag: str | None = None) -> tuple[int, int]:
        """(graphs, nodes) committed since the last take; keeps the first few under `tag`."""
        graphs = nodes = 0
        while (path := Path(f"{self.prefix}_{self.seen + 1}.dot")).exists():
            self.seen += 1
            graphs += 1
            nodes += len(NODE.findall(path.read_text()))
            if tag is not None and graphs <= 3:
                shutil.copy(path, self.keep / f"{tag}-{graphs}.dot")
            path.unlink()
        return graphs, nodes


class _CountingMx:
    """mlx.core for the engine's modules, counting the primitives of what is evaluated."""

    def __init__(self, dot: Path) -> None:
        self.dot = dot
        self.step: Counter = Counter()

    def _count(self, args) -> None:
        arrays = [a for a in args if isinstance(a, mx.array)]
        if arrays:
            mx.export_to_dot(str(self.dot), *arrays)
            self.step.update(LABEL.findall(self.dot.read_text()))

    def async_eval(self, *args):
        self._count(args)
        return mx.async_eval(*args)

    def eval(self, *args):
        self._count(args)
        return mx.eval(*args)

    def __getattr__(self, name):
        return getattr(mx, name)


def count_mode(
    local,
    prompts,
    params,
    concurrency: int,
    counter: _CountingMx,
    graphs: _CudaGraphs | None,
    tag: str,
) -> tuple[list[Counter], list[tuple[int, int]]]:
    """Primitive counts of each decode step (prefill steps left out), and on CUDA the graphs
    and graph nodes each committed."""
    engine = local.engine
    steps: list[Counter] = []
    committed: list[tuple[int, int]] = []
    for start in range(0, len(prompts), concurrency):
        seqs = [engine.submit(p, params) for p in prompts[start : start + concurrency]]
        while any(not s.finished for s in seqs):
            decoding = all(s.decode_started is not None or s.finished for s in seqs)
            counter.step = Counter()
            if graphs is not None:
                mx.synchronize()
                graphs.take()
            engine.step()
            if graphs is not None:
                mx.synchronize()
            if decoding:
                steps.append(counter.step)
                if graphs is not None:
                    committed.append(graphs.take(tag if len(committed) == 5 else None))
    return steps, committed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/wedlm-smollm2-135m-r2"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--modes", nargs="+", default=["ar", "wedlm", "speculative"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--cuda-graphs", type=Path, help="count MLX-CUDA's graphs; keep samples here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        graphs = None
        if args.cuda_graphs is not None:  # before MLX's first commit, which reads the setting
            args.cuda_graphs.mkdir(parents=True, exist_ok=True)
            graphs = _CudaGraphs(Path(tmp) / "graph", args.cuda_graphs)
        local = open_local_engine(args.model, num_rows=8)
        prompts = [local.tokenizer.encode(t) for t in COUNTING[: args.prompts]]
        counter = _CountingMx(Path(tmp) / "step.dot")
        # every module that hands graphs to MLX: the layers' chunks, the pipeline, the engine
        engine_module.mx = pipeline_module.mx = model_parts_module.mx = counter
        result = run_info(model=args.model, concurrency=args.concurrency, modes=args.modes)
        per_mode: dict[str, dict] = {}
        for c in args.concurrency:
            for mode in args.modes:
                params = replace(MODES[mode], max_tokens=args.max_tokens)
                tag = f"{mode}-C{c}"
                steps, committed = count_mode(local, prompts, params, c, counter, graphs, tag)
                totals = [sum(s.values()) for s in steps]
                # (a mode whose requests all finish in their opening has no decode step)
                mid = sorted(range(len(steps)), key=lambda i: totals[i])[len(steps) // 2:][:1]
                per_mode[f"{mode}/C{c}"] = {
                    "steps": len(steps),
                    "ops_median": statistics.median(totals) if totals else None,
                    "ops_min_max": [min(totals), max(totals)] if totals else None,
                    "median_step_by_primitive": dict(steps[mid[0]].most_common()) if mid else {},
                }
                if committed:
                    per_mode[tag.replace("-", "/")] |= {
                        "cuda_graphs_median": statistics.median(g for g, _ in committed),
                        "cuda_graph_nodes_median": statistics.median(n for _, n in committed),
                    }
        for c in args.concurrency:
            ar = per_mode.get(f"ar/C{c}")
            for mode in args.modes:
                other = per_mode[f"{mode}/C{c}"]
                if ar and mode != "ar":
                    a = Counter(ar["median_step_by_primitive"])
                    o = Counter(other["median_step_by_primitive"])
                    diff = {k: o[k] - a[k] for k in set(a) | set(o) if o[k] != a[k]}
                    other["more_than_ar"] = dict(sorted(diff.items(), key=lambda kv: -kv[1]))
    result["steps"] = per_mode
    finish(result, args.out, "step_ops", {})


if __name__ == "__main__":
    main()
