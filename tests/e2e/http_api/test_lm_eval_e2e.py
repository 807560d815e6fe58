"""lm-eval-harness against a real coordinator: its `local-completions` backend (echo with
prompt logprobs, several prompts per request) scores a local multiple-choice task with the
same accuracy and loglikelihoods as its `hf` backend (transformers) on the same float32
checkpoint."""

from __future__ import annotations

import json
import random

import pytest

from tests.support.cluster_harness import http_coordinator

lm_eval = pytest.importorskip("lm_eval")

WORDS = ["red", "blue", "cat", "dog", "tree", "river", "stone", "cloud", "seven", "light"]
TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return checkpoint_dir("qwen2", seed=9, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A task folder: 16 questions of 4 choices (words of a few tokens each)."""
    root = tmp_path_factory.mktemp("tasks")
    rng = random.Random(4)
    with open(root / "data.jsonl", "w") as f:
        for _ in range(16):
            question = " ".join(rng.choices(WORDS, k=rng.randint(3, 9)))
            choices = [" ".join(rng.choices(WORDS, k=rng.randint(1, 3))) for _ in range(4)]
            record = {"question": question, "choices": choices, "answer": rng.randrange(4)}
            f.write(json.dumps(record) + "\n")
    (root / "tiny_choice.yaml").write_text(TASK.format(data=root / "data.jsonl"))
    return root


def _evaluate(tasks, model_name: str, model_args: str) -> tuple[float, list[list[float]]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model_name,
        model_args=model_args,
        tasks=["tiny_choice"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    samples = sorted(out["samples"]["tiny_choice"], key=lambda s: s["doc_id"])
    lls = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return out["results"]["tiny_choice"]["acc,none"], lls


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:  # the task's data and the model are local
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield


@pytest.fixture(scope="module")
def hf(model, tasks, offline):
    return _evaluate(tasks, "hf", f"pretrained={model},dtype=float32,device=cpu")


@pytest.fixture(scope="module")
def server(model):
    with http_coordinator(model) as coord:
        yield coord.http


@pytest.mark.parametrize("batch", [1, 4])  # 4: four prompts per request
def test_local_completions_scores_as_hf(model, tasks, hf, server, batch):
    args = (
        f"base_url={server}/completions,model={model.name},tokenizer={model},"
        f"tokenized_requests=True,batch_size={batch},max_retries=1"
    )
    acc, lls = _evaluate(tasks, "local-completions", args)
    hf_acc, hf_lls = hf
    assert acc == hf_acc
    assert len(lls) == len(hf_lls) == 16
    for got, want in zip(lls, hf_lls, strict=True):
        assert all(-1e4 < v < 0 for v in got)  # real loglikelihoods, none a stand-in
        assert got == pytest.approx(want, abs=1e-3)
