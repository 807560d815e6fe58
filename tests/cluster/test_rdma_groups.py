"""jaccl groups (issue 31) without a Mac: reading RDMA devices and Thunderbolt cables from
the commands MLX's own `mlx.distributed_config` runs, the device matrix built from what the
members report, the backend preference (jaccl > nccl > ring), the environment a group
process joins with, and a real Linux worker that does not offer jaccl (over real gRPC).
jaccl itself cannot run here: it needs Macs cabled by Thunderbolt 5 with RDMA enabled."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import grpc
import pytest

from common.model_config import load_model_config
from common.proto_gen import wedlm_pb2 as pb
from common.tensor_group.process import group_env
from common.tensor_group.rdma import (
    RdmaPort,
    parse_hardware_ports,
    parse_ibv_devices,
    parse_thunderbolt,
    rdma_ports,
)
from common.tensor_group.spec import GroupSpec, available_backends, rdma_rows
from coordinator.cluster.cluster_setup import WorkerEntry
from coordinator.cluster.rdma_mesh import device_matrix
from coordinator.cluster.tensor_groups import form_groups
from coordinator.cluster.worker_link import WorkerCallError, WorkerLink
from tests.support.cluster_harness import cluster_name, start_worker

# `ibv_devices` on an M3 Ultra with RDMA enabled, as MLX's docs print it
# (ml-explore/mlx, docs/src/usage/distributed.rst, "Enabling RDMA").
IBV_DEVICES = """\
    device          	   node GUID
    ------          	----------------
    rdma_en2        	8096a9d9edbaac05
    rdma_en3        	8196a9d9edbaac05
    rdma_en5        	8396a9d9edbaac05
    rdma_en4        	8296a9d9edbaac05
    rdma_en6        	8496a9d9edbaac05
    rdma_en7        	8596a9d9edbaac05
"""

# `system_profiler SPThunderboltDataType -json` of a MacBook Pro with nothing plugged in,
# as captured on macOS 26.6.1 in SirsiMaster/sirsi-pantheon (internal/fabric tests): no
# bus has a domain UUID then, so no port is offered.
PROFILE_UNPLUGGED = """{"SPThunderboltDataType":[
 {"_name":"thunderboltusb4_bus_2","device_name_key":"MacBook Pro","receptacle_1_tag":{"current_speed_key":"Up to 120 Gb/s","link_status_key":"0x100","receptacle_id_key":"3","receptacle_status_key":"receptacle_no_devices_connected"}},
 {"_name":"thunderboltusb4_bus_1","device_name_key":"MacBook Pro","receptacle_1_tag":{"current_speed_key":"Up to 120 Gb/s","link_status_key":"0x100","receptacle_id_key":"2","receptacle_status_key":"receptacle_no_devices_connected"}},
 {"_name":"thunderboltusb4_bus_0","device_name_key":"MacBook Pro","receptacle_1_tag":{"current_speed_key":"Up to 120 Gb/s","link_status_key":"0x100","receptacle_id_key":"1","receptacle_status_key":"receptacle_no_devices_connected"}}]}"""  # noqa: E501

# `networksetup -listallhardwareports` in the layout MLX's parse_hardware_ports reads
# (mlx/_distributed_utils/config.py): "Hardware Port: ..." then "Device: enN".
HARDWARE_PORTS = """\

Hardware Port: Ethernet
Device: en0
Ethernet Address: 1c:f6:4c:00:00:01

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: 36:17:01:8c:7d:c0

Hardware Port: Thunderbolt 1
Device: en2
Ethernet Address: 36:17:01:8c:7d:c0

Hardware Port: Thunderbolt 2
Device: en3
Ethernet Address: 36:17:01:8c:7d:c4

Hardware Port: Wi-Fi
Device: en1
Ethernet Address: 1c:f6:4c:00:00:02
"""


def _bus(receptacle: str, uuid: str, peer: str | None, peer_has_uuid: bool = True) -> dict:
    """One bus of a cabled Mac, with the keys MLX's extract_connectivity reads: the bus's
    domain_uuid_key, its receptacle id, and the connected item's own domain_uuid_key (a
    Mac has one; a dock or an audio interface does not)."""
    bus = {
        "_name": f"thunderboltusb4_bus_{int(receptacle) - 1}",
        "device_name_key": "Mac Studio",
        "domain_uuid_key": uuid,
        "receptacle_1_tag": {
            "current_speed_key": "Up to 120 Gb/s",
            "receptacle_id_key": receptacle,
            "receptacle_status_key": "receptacle_connected",
        },
    }
    if peer is not None:
        item = {"_name": "Mac Studio", "device_name_key": "Mac16,9"}
        if peer_has_uuid:
            item["domain_uuid_key"] = peer
        bus["_items"] = [item]
    return bus


def test_ibv_devices_names_the_rdma_devices():
    assert parse_ibv_devices(IBV_DEVICES) == [
        "rdma_en2", "rdma_en3", "rdma_en5", "rdma_en4", "rdma_en6", "rdma_en7",
    ]  # fmt: skip
    assert parse_ibv_devices("") == []  # RDMA not enabled: the tool lists nothing


def test_hardware_ports_map_thunderbolt_ports_to_interfaces():
    ports = parse_hardware_ports(HARDWARE_PORTS)
    assert ports["Thunderbolt 1"] == "en2" and ports["Thunderbolt 2"] == "en3"
    assert ports["Thunderbolt Bridge"] == "bridge0" and ports["Wi-Fi"] == "en1"


def test_an_unplugged_mac_has_no_cabled_port():
    assert parse_thunderbolt(PROFILE_UNPLUGGED, parse_hardware_ports(HARDWARE_PORTS)) == []


def test_cables_are_read_with_their_peers():
    profile = {
        "SPThunderboltDataType": [
            _bus("2", "UUID-A2", "UUID-B1"),
            _bus("1", "UUID-A1", None),  # nothing plugged in
            _bus("3", "UUID-A3", "dock", peer_has_uuid=False),  # no network port for 3
        ]
    }
    ports = parse_thunderbolt(json.dumps(profile), parse_hardware_ports(HARDWARE_PORTS))
    assert ports == [
        RdmaPort("rdma_en2", "UUID-A1", ""),
        RdmaPort("rdma_en3", "UUID-A2", "UUID-B1"),
    ]


def test_linux_offers_no_jaccl():
    assert rdma_ports() == []  # no ibv_devices here
    assert "jaccl" not in available_backends([]) and "ring" in available_backends([])


def _mesh(n: int, cables: int = 1) -> list[list[RdmaPort]]:
    """n Macs cabled pairwise (`cables` per pair): member i's port toward j is
    rdma_en{2 + j}{k} with UUID "i-j-k", whose peer is "j-i-k"."""
    return [
        [
            RdmaPort(f"rdma_en{2 + j}{k}", f"{i}-{j}-{k}", f"{j}-{i}-{k}")
            for j in range(n)
            if j != i
            for k in range(cables)
        ]
        for i in range(n)
    ]


def test_a_full_mesh_gives_the_matrix_mlx_expects():
    assert device_matrix(_mesh(3)) == [
        ["", "rdma_en30", "rdma_en40"],
        ["rdma_en20", "", "rdma_en40"],
        ["rdma_en20", "rdma_en30", ""],
    ]
    two = device_matrix(_mesh(2, cables=2))
    assert two == [["", "rdma_en30,rdma_en31"], ["rdma_en20,rdma_en21", ""]]


def test_a_pair_without_a_cable_is_no_mesh():
    ports = _mesh(3)
    ports[0] = [p for p in ports[0] if not p.peer_uuid.startswith("2-")]  # 0 -- 2 unplugged
    ports[2] = [p for p in ports[2] if not p.peer_uuid.startswith("0-")]
    assert device_matrix(ports) is None
    assert device_matrix([[], []]) is None and device_matrix(_mesh(1)) is None


def test_pairs_use_as_many_cables_as_the_least_cabled_pair():
    ports = _mesh(3, cables=2)
    ports[0] = [p for p in ports[0] if p.domain_uuid != "0-1-1"]  # 0 -- 1: one cable
    matrix = device_matrix(ports)
    assert all(cell.count(",") == 0 for row in matrix for cell in row)


@pytest.fixture(scope="module")
def config(checkpoint_dir):
    return load_model_config(checkpoint_dir("qwen3", seed=5, num_hidden_layers=4))


def _member(address: str, backends: tuple[str, ...], ports: list[RdmaPort]):
    info = pb.WorkerInfo(
        group_port=7000 + int(address.rsplit(":", 1)[1]),
        group_backends=list(backends),
        memory_available=1 << 30,
        rdma_ports=[pb.RdmaPort(**asdict(p)) for p in ports],
    )
    return WorkerEntry(address, "static", "serving", info=info)


def test_jaccl_is_preferred_when_every_pair_is_cabled(config):
    ports = _mesh(2)
    all_three = ("ring", "jaccl", "nccl")
    entries = [_member(f"10.0.0.{i + 1}:{i + 1}", all_three, ports[i]) for i in range(2)]
    groups, note = form_groups(entries, config, 2)
    assert groups[0].backend == "jaccl" and "(tp=2, jaccl)" in note
    spec = groups[0].spec(1, epoch=3)
    spec.check()
    assert spec.rdma == [["", "rdma_en30"], ["rdma_en20", ""]]
    assert rdma_rows(spec.flat_rdma(), spec.size) == spec.rdma  # as TensorGroup carries it


def test_jaccl_is_passed_over_without_a_mesh(config):
    ports = _mesh(2)
    backends = ("ring", "jaccl", "nccl")
    uncabled = [_member("10.0.0.1:1", backends, ports[0]), _member("10.0.0.2:2", backends, [])]
    assert form_groups(uncabled, config, 2)[0][0].backend == "nccl"
    no_nccl = [_member("10.0.0.1:1", ("ring", "jaccl"), ports[0]),
               _member("10.0.0.2:2", ("ring", "jaccl"), [])]  # fmt: skip
    assert form_groups(no_nccl, config, 2)[0][0].backend == "ring"
    one_without = [
        _member("10.0.0.1:1", backends, ports[0]),
        _member("10.0.0.2:2", ("ring",), ports[1]),
    ]
    assert form_groups(one_without, config, 2)[0][0].backend == "ring"


@pytest.mark.parametrize(
    ("rdma", "problem"),
    [
        ([], "needs an RDMA device matrix of 2 x 2"),
        ([["", "rdma_en2"], ["", ""]], "rank 1 has no RDMA device to rank 0"),
        ([["rdma_en2", "rdma_en3"], ["rdma_en2", ""]], "rank 0 names an RDMA device to itself"),
    ],
)
def test_a_jaccl_spec_needs_a_whole_matrix(rdma, problem):
    with pytest.raises(ValueError, match=problem):
        GroupSpec(0, 2, ["10.0.0.1:7000", "10.0.0.2:7000"], "jaccl", 1, rdma).check()


def test_a_jaccl_member_joins_with_mlx_launchs_environment():
    rdma = [["", "rdma_en5", "rdma_en4,rdma_en6"], ["rdma_en5", "", "rdma_en3"],
            ["rdma_en4,rdma_en6", "rdma_en3", ""]]  # fmt: skip
    env = group_env(GroupSpec(2, 3, ["10.0.0.1:7100", "b:1", "c:1"], "jaccl", 1, rdma))
    assert env["MLX_RANK"] == "2" and env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:7100"
    assert json.loads(Path(env["MLX_IBV_DEVICES"]).read_text()) == [
        [None, "rdma_en5", ["rdma_en4", "rdma_en6"]],
        ["rdma_en5", None, "rdma_en3"],
        [["rdma_en4", "rdma_en6"], "rdma_en3", None],
    ]  # the file mlx.launch writes: null, a name, or a list of names per peer
    ring = group_env(GroupSpec(0, 2, ["127.0.0.1:1", "127.0.0.1:2"]))
    assert json.loads(Path(ring["MLX_HOSTFILE"]).read_text()) == [["127.0.0.1:1"], ["127.0.0.1:2"]]


def test_a_linux_worker_reports_no_rdma_and_refuses_jaccl(checkpoint_dir):
    model = checkpoint_dir("qwen3", seed=5, num_hidden_layers=4)
    worker, address = start_worker(model, cluster_name(), "--no-bonjour")
    link = WorkerLink(address, None, load_model_config(model).identity)
    try:
        info = link.info()
        assert list(info.rdma_ports) == [] and "jaccl" not in info.group_backends
        hosts = ["127.0.0.1:1", "127.0.0.1:2"]
        whole = GroupSpec(1, 2, hosts, "jaccl", 1, [["", "rdma_en2"], ["rdma_en3", ""]])
        with pytest.raises(WorkerCallError) as err:
            link.assign(0, 3, group=whole)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "no jaccl backend" in str(err.value)
        with pytest.raises(WorkerCallError) as err:
            link.assign(0, 3, group=GroupSpec(1, 2, hosts, "jaccl", 1))  # no matrix
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "RDMA device matrix" in str(err.value)
    finally:
        link.close()
        worker.stop()


def test_a_matrix_of_the_wrong_count_is_refused():
    rows = rdma_rows(["", "rdma_en2", "rdma_en3"], 2)  # 3 cells for a group of 2
    with pytest.raises(ValueError, match="needs an RDMA device matrix of 2 x 2"):
        GroupSpec(0, 2, ["a:1", "b:2"], "jaccl", 1, rows).check()
    assert rdma_rows([], 1 << 31) == []  # a huge fuzzed size costs nothing
