"""What the developer experiments share: the run's header (device, MLX, date), timing,
the random hidden states a hop carries, the flags that pick a model, and the end of a run
(plots, then the JSON file and the JSON line). Plot styling is the tool's own
(wedlm_client/bench/report.py)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wedlm_client.bench.report import finish_axes

__all__ = ["finish_axes"]  # the tool's axis styling, for these scripts' plots
now = time.perf_counter


def run_info(**fields: Any) -> dict[str, Any]:
    """The header of a result: model and settings (`fields`), MLX's device and version, date."""
    import mlx.core as mx

    return {"model": fields.pop("model", None), "device": str(mx.default_device()),
            "mlx": mx.__version__, **fields,
            "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip


def log(text: str, tag: str = "") -> None:
    """A progress line on stderr, stamped with the time (and `tag`, where given)."""
    print(f"[{tag + ' ' if tag else ''}{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr,
          flush=True)  # fmt: skip


def med(values, digits: int = 4) -> float | None:
    """The median of the values that are not None, rounded; None when there are none."""
    values = [v for v in values if v is not None]
    return round(statistics.median(values), digits) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to 3 places; None when either is missing or zero."""
    return round(a / b, 3) if a and b else None


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of fn() in ms, after `warmup` unmeasured calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        times.append(now() - t0)
    return statistics.median(times) * 1e3


def build_then_wait(make: Callable[[], Any], runs: int, skip: int = 2) -> tuple[list, list]:
    """Seconds each of `runs` calls of `make` (which builds and returns a lazy MLX graph)
    spends building, then evaluating and waiting for it; the first `skip` are not kept."""
    import mlx.core as mx

    build, wait = [], []
    for i in range(runs + skip):
        t0 = time.perf_counter()
        out = make()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        if i >= skip:
            build.append(t1 - t0)
            wait.append(t2 - t1)
    return build, wait


def hidden_states(nbytes: int, hidden: int, shape: Callable[[int, int], tuple[int, int]],
                  seq_base: int):  # fmt: skip
    """bf16 hidden states of about `nbytes` in the (sequences, rows) `shape` gives, evaluated,
    and one sequence id per sequence from seq_base on."""
    import mlx.core as mx

    b, t = shape(nbytes, hidden)
    x = (mx.random.normal((b, t, hidden)) * 0.5).astype(mx.bfloat16)
    mx.eval(x)
    return b, t, x, [seq_base + i for i in range(b)]


def add_random_model_flags(ap: argparse.ArgumentParser, model: str = "default") -> None:
    """--model PATH|default|random-qwen3-8b and the random checkpoint's shape and place."""
    ap.add_argument("--model", default=model, help="PATH, default or random-qwen3-8b")
    ap.add_argument("--layers-override", type=int, help="random-qwen3-8b: layers (36)")
    ap.add_argument("--hidden-override", type=int, help="random-qwen3-8b: hidden size (4096)")
    ap.add_argument("--ckpt-dir", type=Path, help="random-qwen3-8b: where to write it")


def prepare_model(args: argparse.Namespace) -> tuple[Path, str]:
    """The checkpoint add_random_model_flags' flags name, and its name for the output:
    random-qwen3-8b is written once (devtools/random_checkpoints.py) and reused."""
    if args.model != "random-qwen3-8b":
        from coordinator.engine.local_engine import resolve_model

        return resolve_model(args.model), args.model
    from devtools.random_checkpoints import QWEN3_8B, write_random_qwen3

    layers = args.layers_override or QWEN3_8B["layers"]
    hidden = args.hidden_override or QWEN3_8B["hidden"]
    path = args.ckpt_dir or Path(f"/tmp/wedlm-random-qwen3-8b-L{layers}-H{hidden}")
    write_random_qwen3(path, layers, hidden)
    return path, f"random-qwen3-8b(layers={layers},hidden={hidden},bf16)"


def device_name() -> str:
    import mlx.core as mx

    try:  # not every backend names its device
        return f"{mx.default_device()} {mx.device_info().get('device_name', '')}".strip()
    except Exception:
        return str(mx.default_device())


def add_random_shape_flags(ap: argparse.ArgumentParser, model: str = "default") -> None:
    """--model and the in-process random Qwen3-8B's --layers / --hidden."""
    ap.add_argument("--model", default=model)
    ap.add_argument("--layers", type=int, default=36, help="random-qwen3-8b only")
    ap.add_argument("--hidden", type=int, default=4096, help="random-qwen3-8b only")


def add_loop_flags(ap: argparse.ArgumentParser, max_tokens: int, duration: float, warmup: float,
                   rounds: int) -> None:  # fmt: skip
    """A closed loop's flags: tokens per request, measured and unmeasured seconds per run,
    rounds (the order of what is compared alternates round by round)."""
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--duration", type=float, default=duration, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=warmup, help="unmeasured seconds per run")
    ap.add_argument("--rounds", type=int, default=rounds, help="rounds (ABAB)")


def suptitled(fig, result: dict, path: Path, dpi: int) -> None:
    """Title a figure with the model and device of `result` and write it to `path`."""
    fig.suptitle(f"{result['model']} on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said on stderr) when it is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing: no plot", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_json(result: dict, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(result, indent=1))
    return path


def finish(result: dict, out: Path, stem: str, plots: dict[str, Callable] | None = None) -> None:
    """Draw each plot (name → fn(result, path)), write `stem`.json, print the JSON line."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        for name, draw in (plots or {}).items():
            draw(result, out / name)
    except ImportError:
        result["plot"] = "matplotlib missing"
    save_json(result, out, f"{stem}.json")
    print(json.dumps(result))
