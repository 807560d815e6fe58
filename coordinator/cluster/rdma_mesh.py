"""A jaccl group's RDMA device matrix, from what each member reports of its Thunderbolt
ports (WorkerInfo.rdma_ports): the matching MLX's `mlx.distributed_config` does. Each port
names its own domain UUID and the one its cable reaches, so a cable is a port whose peer
UUID is a port of another member; jaccl needs one between every pair of members (a full
mesh), and as MLX does, every pair uses as many cables as the least-cabled pair has."""

from __future__ import annotations

from collections import defaultdict


def device_matrix(ports: list[list]) -> list[list[str]] | None:
    """matrix[i][j]: the RDMA device(s) member i reaches member j by ("" on the diagonal,
    several cables joined by ","), or None when some pair has no cable between them.
    `ports[i]` is member i's list of RdmaPort (device, domain_uuid, peer_uuid)."""
    size = len(ports)
    owner = {}  # a port's domain UUID -> (member, device)
    for i, member in enumerate(ports):
        for p in member:
            owner[p.domain_uuid] = (i, p.device)
    cables: dict[tuple[int, int], list[tuple[str, str]]] = defaultdict(list)
    for i, member in enumerate(ports):
        for p in sorted(member, key=lambda p: p.device):
            j, far = owner.get(p.peer_uuid, (i, ""))
            if j > i:  # each cable once, from its lower member's side
                cables[i, j].append((p.device, far))
    pairs = [(i, j) for i in range(size) for j in range(i + 1, size)]
    count = min((len(cables[pair]) for pair in pairs), default=0)
    if size < 2 or count == 0:
        return None
    matrix = [[""] * size for _ in range(size)]
    for i, j in pairs:
        used = cables[i, j][:count]  # the k-th cable is the k-th name on both sides
        matrix[i][j] = ",".join(near for near, _ in used)
        matrix[j][i] = ",".join(far for _, far in used)
    return matrix
