"""Does the coordinator's memory level off? In one process: the engine loop and the job
registry (with `--keep-finished` K) over a tiny random model, C client threads running
short jobs back to back; every 500 jobs the Python-traced memory (tracemalloc) and the RSS.
Once the registry holds K finished jobs both should stay flat. Prints one JSON object.

  python benchmarks/dev/registry_memory.py --keep-finished 1000 --jobs 6000
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import tracemalloc
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common.generation_params import GenerationParams
from common.model_parts import load_model_parts
from common.tokenizer import Tokenizer
from coordinator.engine.engine import Engine
from coordinator.engine.pipeline import LocalPipeline
from coordinator.service.engine_loop import EngineLoop
from coordinator.service.jobs import JobRegistry
from tests.checkpoints import make_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep-finished", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=6000)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    model = make_checkpoint(Path(tempfile.mkdtemp(prefix="regmem-")), "qwen3", seed=0)
    parts, tok = load_model_parts(model), Tokenizer(model)
    engine = Engine(parts, LocalPipeline(parts), args.concurrency, text_tail=tok.decode,
                    stop_ids=tok.stop_ids)  # fmt: skip
    loop = EngineLoop(engine, tok)
    loop.start()
    registry = JobRegistry(keep_finished=args.keep_finished)
    prompt = tok.encode("Once upon a time there was")
    tracemalloc.start()
    samples, lock, count = [], threading.Lock(), [0]

    def client() -> None:
        while True:
            with lock:
                if count[0] >= args.jobs:
                    return
                count[0] += 1
                n = count[0]
            params = GenerationParams(mode="wedlm" if n % 2 else "ar", max_tokens=8 + n % 8)
            job = registry.create(prompt, params)
            loop.submit(job)
            job.wait(60)
            if n % 500 == 0:
                gc.collect()
                samples.append({
                    "jobs": n, "traced_mb": round(tracemalloc.get_traced_memory()[0] / 1e6, 2),
                    "rss_mb": round(psutil.Process().memory_info().rss / 1e6, 1),
                })  # fmt: skip
                print(samples[-1], file=sys.stderr, flush=True)

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loop.stop()
    loop.join(10)
    print(json.dumps({"keep_finished": args.keep_finished, "jobs": args.jobs, "samples": samples}))


if __name__ == "__main__":
    main()
