"""Tensor-parallel groups over mlx.distributed (issue 31): what a group is and whether a
model splits (spec), the process that holds one member's share (process), its parent's
side of it (member) and the wire between the two (wire). Workers and the coordinator
(rank 0 of the first group) use them alike."""
