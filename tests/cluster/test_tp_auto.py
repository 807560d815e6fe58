"""`--tp auto` without a cluster: the per-token model's decision from figures (a fast link
and big layers group; a loopback-like link and a tiny model stay a pipeline; sizes that do
not divide are never weighed), the reason line, the flag and TOML values, and a link's
figures measured over a real worker's Echo and ProbeLink (real gRPC)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from common import link_probe
from common.errors import WedlmError
from common.model_config import load_model_config
from common.proto_gen import wedlm_pb2 as pb
from coordinator.cluster.cluster_setup import LOCAL, LocalMember, WorkerEntry, local_entry
from coordinator.cluster.link_survey import LinkSurvey
from coordinator.cluster.tp_auto import choose
from coordinator.cluster.tp_choice import Figures, Shape, best, project
from coordinator.cluster.worker_link import WorkerCallError, WorkerLink
from coordinator.service.serve_config import load_serve_config
from coordinator.service.server_cli import build_parser
from tests.support.cluster_harness import cluster_name, start_worker

GB = 1e9
# Qwen3-8B-like bf16 layers (36 of 0.4 GB, hidden 4096) on Macs reading at 800 GB/s
BIG = Shape(layers=36, layer_bytes=400_000_000, hidden_bytes=4096 * 2)
TINY = Shape(layers=4, layer_bytes=200_000, hidden_bytes=256 * 4)


def _link(a: str, b: str, rtt_s: float, bandwidth: float) -> pb.LinkFigures:
    return pb.LinkFigures(a=a, b=b, rtt_s=rtt_s, bandwidth=bandwidth)


def _figures(names: list[str], read: float, rtt_s: float, bandwidth: float) -> Figures:
    f = Figures(reads={n: read for n in names})
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            f.links[frozenset((a, b))] = _link(a, b, rtt_s, bandwidth)
    return f


def test_a_fast_link_and_big_layers_choose_tp():
    names = [LOCAL, "w1"]
    figures = _figures(names, 800 * GB, rtt_s=50e-6, bandwidth=10 * GB)  # TB5-class
    pipeline = project(BIG, [[LOCAL], ["w1"]], figures, 1)
    tp = project(BIG, [names], figures, 2)
    assert pipeline.token_s == pytest.approx(36 * 0.4 / 800 + 2 * (25e-6 + 8192 / 10e9))
    # half the reads + 2 x 36 ring all-reduces of 2 steps
    assert tp.token_s == pytest.approx(36 * 0.4 / 800 / 2 + 72 * 2 * (25e-6 + 8192 / 10e9))
    assert best([pipeline, tp]) is tp


def test_a_loopback_like_link_and_a_tiny_model_stay_a_pipeline():
    names = [LOCAL, "w1", "w2", "w3"]
    figures = _figures(names, 5 * GB, rtt_s=0.3e-3, bandwidth=1.2 * GB)
    options = [project(TINY, [[n] for n in names], figures, 1)]
    options += [project(TINY, [names[:2], names[2:]], figures, 2)]
    options += [project(TINY, [names], figures, 4)]
    assert best(options).size == 1


def test_a_link_that_could_not_be_measured_rules_its_group_out():
    figures = _figures([LOCAL, "w1"], 800 * GB, 50e-6, 10 * GB)
    figures.links[frozenset((LOCAL, "w1"))] = pb.LinkFigures(a=LOCAL, b="w1", error="refused")
    tp = project(BIG, [[LOCAL, "w1"]], figures, 2)
    assert tp.problem == f"the link {LOCAL}↔w1 could not be measured: refused"


# ---- the choice over probed candidates ----------------------------------------------------
@pytest.fixture(scope="module")
def config(checkpoint_dir):  # 4 heads, 2 KV heads, MLP 128: divides by 2 and 4, not by 3
    return load_model_config(checkpoint_dir("qwen3", seed=5, num_hidden_layers=4))


def _worker(address: str) -> WorkerEntry:
    port = int(address.rsplit(":", 1)[1])
    info = pb.WorkerInfo(group_port=7000 + port, group_backends=["ring"])
    return WorkerEntry(address, "static", "serving", info=info)


def _fixed(figures: Figures):
    """`measure` with known figures: records what it was asked to measure."""
    asked = []

    def measure(members, pairs):
        asked.append(([m.address for m in members], [(a.address, b.address) for a, b in pairs]))
        return figures

    return measure, asked


def test_choose_groups_over_a_fast_link(config):
    me = local_entry(LocalMember(1 << 30, None, 7100, ("ring",)))
    entries = [_worker("127.0.0.1:1")]
    names = [LOCAL, "127.0.0.1:1"]
    measure, asked = _fixed(_figures(names, 800 * GB, 50e-6, 10 * GB))
    choice = choose(entries, config, BIG, me, measure)
    assert choice.size == 2 and asked == [(names, [tuple(names)])]
    assert choice.note.startswith("tp auto: tp 2 (")
    assert "exchanging 72 partial results over the slowest link" in choice.note
    assert f"({LOCAL}↔127.0.0.1:1: 0.05 ms round trip, 10 GB/s)" in choice.note


def test_choose_stays_a_pipeline_over_a_slow_link_and_says_why(config):
    entries = [_worker(f"127.0.0.1:{p}") for p in (1, 2)]
    names = [e.address for e in entries]
    measure, _ = _fixed(_figures(names, 5 * GB, 0.31e-3, 1.2 * GB))
    choice = choose(entries, config, TINY, None, measure)
    assert choice.size == 1
    assert choice.note.startswith("tp auto: pipeline (")
    assert "splitting every layer over 2 members would take" in choice.note
    assert "exchanging 8 partial results over the slowest link (127.0.0.1:1↔127.0.0.1:2: " in (
        choice.note
    )
    assert "0.31 ms round trip, 1.2 GB/s)" in choice.note and "reading the split weights" in (
        choice.note
    )


def test_sizes_that_do_not_divide_are_not_weighed(config):
    """Three members: 3 does not divide the 4 heads, so only 2 is weighed (and 4 is more
    members than there are)."""
    entries = [_worker(f"127.0.0.1:{p}") for p in (1, 2, 3)]
    names = [e.address for e in entries]
    figures = _figures(names, 800 * GB, 50e-6, 10 * GB)
    sizes = []

    def measure(members, pairs):
        sizes.append(len(pairs))
        return figures

    choice = choose(entries, config, BIG, None, measure)
    assert choice.size == 2  # one group of 2 and a member alone beat a pipeline of 3
    assert sizes == [3]  # every pair of members that can join a group
    three = dataclasses.replace(config, raw={**config.raw, "num_key_value_heads": 1})
    nothing = choose(entries, three, BIG, None, measure)
    assert nothing.size == 1 and sizes == [3]  # nothing measured: no size divides
    assert nothing.note == "tp auto: pipeline — its 1 key/value heads do not divide by 2"


def test_one_member_measures_nothing(config):
    measure, asked = _fixed(Figures())
    choice = choose([_worker("127.0.0.1:1")], config, BIG, None, measure)
    assert choice.size == 1 and asked == [] and "one member" in choice.note


# ---- the setting --------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "tp"), [("auto", "auto"), ("AUTO", "auto"), ("1", 1), ("4", 4)])
def test_tp_flag_values(value, tp):
    args = build_parser().parse_args(["serve", "--model", "m", "--tp", value])
    assert args.tp == tp


def test_tp_defaults_to_auto():
    assert build_parser().parse_args(["serve", "--model", "m"]).tp == "auto"


@pytest.mark.parametrize(
    ("value", "message"),
    [("0", "a group has at least 1 member (1: a pipeline), got 0"),
     ("two", "expected auto or a whole number >= 1, got 'two'"),
     ("-2", "a group has at least 1 member")],
)  # fmt: skip
def test_bad_tp_flag(value, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--tp", value])
    assert f"--tp: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "tp"), [("tp = 'auto'", "auto"), ("tp = 2", 2)])
def test_tp_in_toml(tmp_path, text, tp):
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_serve_config(path) == {"tp": tp}


@pytest.mark.parametrize(
    ("text", "message"),
    [("tp = 0", "tp: a group has at least 1 member"),
     ("tp = 'many'", "tp: expected auto or a whole number >= 1, got 'many'"),
     ("tp = 1.5", "tp (tensor-parallel group size (auto or N >= 1)) must be a str")],
)  # fmt: skip
def test_bad_tp_in_toml(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(WedlmError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_serve_config(path)


# ---- real links ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_workers(checkpoint_dir):
    model = checkpoint_dir("qwen3", seed=5, num_hidden_layers=4)
    name = cluster_name()
    procs = [start_worker(model, name, "--no-bonjour") for _ in range(2)]
    yield load_model_config(model), [addr for _, addr in procs]
    for p, _ in procs:
        p.stop()


def test_links_measured_over_real_workers(two_workers):
    config, (a, b) = two_workers
    survey = LinkSurvey(local_read=lambda: 1e9)
    links = [WorkerLink(x, None, config.identity) for x in (a, b)]
    try:
        entries = [WorkerEntry(x, "static", "serving", info=pb.WorkerInfo(), link=lk)
                   for x, lk in zip((a, b), links, strict=True)]  # fmt: skip
        me = local_entry(LocalMember(1 << 30))
        figures = survey.measure([me, *entries], [(me, entries[0]), (entries[0], entries[1])])
        assert figures.reads[LOCAL] == 1e9 and all(figures.reads[x] > 0 for x in (a, b))
        for pair in ((LOCAL, a), (a, b)):
            lk = figures.link(*pair)
            assert not lk.error and (lk.a, lk.b) == pair, lk
            # an empty message and a 256 KiB one take about as long over loopback (a CI
            # run saw the empty one 4 % slower): only the 4 MiB one is surely slower
            assert 0 < lk.rtt_s < lk.large_s and 0 < lk.small_s < lk.large_s < 2.0
            assert lk.bandwidth > 1e6
        assert links[0].info().read_bandwidth == figures.reads[a]  # measured once, reported
        again = survey.measure([me, *entries], [(entries[0], entries[1])])
        assert again.link(a, b) is figures.link(a, b)  # a re-plan reuses recent figures
        with pytest.raises(WorkerCallError) as bad:
            links[0].probe_link("not an address", 1.0)
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "peer 'not an address' is not HOST:PORT" in str(bad.value)
        with pytest.raises(WorkerCallError) as slow:
            links[0].probe_link(b, 31.0)
        assert "timeout_s must be in (0, 30], not 31" in str(slow.value)
        with pytest.raises(WorkerCallError) as big:
            links[0].echo(bytes(link_probe.MAX_ECHO + 1), 5.0)
        assert big.value.code == grpc.StatusCode.INVALID_ARGUMENT
        gone = links[0].probe_link("127.0.0.1:1", 1.0).link  # nobody listens there
        assert gone.error and gone.b == "127.0.0.1:1"
        hurried = LinkSurvey(budget_s=0.0, local_read=lambda: 1e9)
        late = hurried.measure([me, *entries], [(entries[0], entries[1])]).link(a, b)
        assert late.error == "the survey's 0 s ran out"
    finally:
        for lk in links:
            lk.close()
