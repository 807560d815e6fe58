"""`--tp auto`, the default, on a real cluster: two workers started for real on 127.0.0.1
and a coordinator started without --tp. It measures each pair's link (its own to each
worker over their Echo, the workers' between them through ProbeLink) and every member's
memory reads, weighs TP = 2 and 3 against a pipeline for a tiny model, plans a pipeline,
and `wedlm status` shows the links and the reason; the cluster then answers."""

from __future__ import annotations

import re

import pytest

from common.generation_params import GenerationParams
from tests.support.cluster_harness import (
    cluster_name,
    engine_outputs,
    start_coordinator,
    start_worker,
)
from wedlm_client.client import WedlmClient
from wedlm_client.status_view import format_status

pytestmark = pytest.mark.e2e


def test_no_flag_measures_the_links_and_plans_a_pipeline(checkpoint_dir):
    # 4 heads, 2 KV heads: TP = 2 is weighed; 3 members, but 3 does not divide the heads
    model = checkpoint_dir("qwen3", seed=73, num_hidden_layers=6, max_position_embeddings=512)
    name = cluster_name()
    workers = [start_worker(model, name, "--no-bonjour") for _ in range(2)]
    (_, a1), (_, a2) = workers
    coord, address = start_coordinator(
        model, name, "--no-bonjour", "--worker", a1, "--worker", a2, "--expect", "2"
    )
    try:
        coord.expect("serving", timeout=180)
        with WedlmClient(address) as client:
            status = client.cluster_status()
            shown = format_status(client.status_dict())  # what `wedlm status` prints
            params = GenerationParams(mode="ar", max_tokens=12)
            got = client.generate(text="links first", params=params)
        note = status.plan_note
        assert note.startswith("tp auto: pipeline ("), note
        assert re.search(
            r"splitting every layer over 2 members would take [\d.]+ ms per token: [\d.]+ ms "
            r"of it exchanging \d+ partial results over the slowest link \(.*: \d+\.\d\d ms "
            r"round trip, [\d.e+-]+ GB/s\), [\d.e+-]+ ms reading the split weights",
            note,
        ), note
        pairs = {frozenset((lk.a, lk.b)) for lk in status.links}
        assert pairs == {frozenset(p) for p in (("coordinator", a1), ("coordinator", a2), (a1, a2))}
        for lk in status.links:
            assert not lk.error and 0 < lk.rtt_s < lk.large_s and lk.bandwidth > 0, lk
        assert status.read_bandwidth > 0
        serving = [w for w in status.workers if w.health == "serving"]
        assert len(serving) == 2 and all(w.info.read_bandwidth > 0 for w in serving)
        assert all(not w.group_leader and w.info.group_size == 0 for w in serving)  # no group
        assert f"plan: {note}" in shown, shown
        assert f"link coordinator↔{a1}: " in shown and f"link {a1}↔{a2}: " in shown, shown
        assert "(256 KiB " in shown and "memory reads: coordinator " in shown, shown
        want = engine_outputs(model, [("links first", params)])[0]
        assert got["tokens"] == want
    finally:
        coord.stop()
        for p, _ in workers:
            p.stop()
