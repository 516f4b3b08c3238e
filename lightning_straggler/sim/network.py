"""Alpha-beta cost model of the collectives (Hockney): a message of n bytes costs alpha + n * beta.

``alpha`` is the per-message latency in seconds, ``beta`` the time per byte (1 / bandwidth). The
collective formulas are the usual bandwidth-optimal ones (Thakur, Rabenseifner and Gropp 2005;
Patarasuk and Yuan 2009), for k participants and a payload of ``nbytes`` per participant:

* ring all-reduce (reduce-scatter then all-gather, 2(k-1) steps of nbytes/k each):
  ``2(k-1) alpha + 2(k-1)/k * nbytes * beta``;
* broadcast, pipelined over a tree (latency of a binomial tree, bandwidth of a pipeline):
  ``ceil(log2 k) alpha + nbytes * beta``;
* ring all-gather (k-1 steps, each rank forwards one rank's nbytes):
  ``(k-1) alpha + (k-1) * nbytes * beta``.

k = 1 costs nothing (no message leaves the worker). No contention between concurrent groups is
modelled: groups of a partition (DS-Sync) or a subgroup all-reduce alongside a straggler are assumed
to use disjoint links, which holds on a non-blocking fat tree and overstates what an oversubscribed
network delivers. Computation and communication do not overlap in this model (Horovod's tensor fusion
overlaps part of the all-reduce with backward on real hardware, so real step times are somewhat lower).

``control_op_s`` is a fixed cost added to every infrequent ("control") collective call: the ones at
boundaries, merges and global averages, as opposed to the per-step gradient
exchange. Horovod negotiates such a call afresh through its coordinator (a name it has not seen
recently misses the response cache), and the Python around it (building the tensor, pickling,
deciding) runs once per call; on a small model that fixed cost, not alpha or beta, is what a
boundary costs. 0 in the presets (unknown for a real cluster); ``benchmarks/sim_validate.py``
calibrates it from measured no-straggler runs. See :meth:`Network.control_s`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Network:
    name: str
    alpha_s: float  # latency per message, seconds
    beta_s_per_byte: float  # seconds per byte (1 / bandwidth)
    control_op_s: float = 0.0  # fixed cost per infrequent collective call (boundaries, merges, joins)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError(f"alpha_s must be a finite number >= 0 (got {self.alpha_s!r})")
        if not (math.isfinite(self.beta_s_per_byte) and self.beta_s_per_byte >= 0):
            raise ValueError(f"beta_s_per_byte must be a finite number >= 0 (got {self.beta_s_per_byte!r})")
        if not (math.isfinite(self.control_op_s) and self.control_op_s >= 0):
            raise ValueError(f"control_op_s must be a finite number >= 0 (got {self.control_op_s!r})")

    def allreduce_s(self, k: int, nbytes: float) -> float:
        if k <= 1:
            return 0.0
        return 2 * (k - 1) * self.alpha_s + 2 * (k - 1) / k * nbytes * self.beta_s_per_byte

    def broadcast_s(self, k: int, nbytes: float) -> float:
        if k <= 1:
            return 0.0
        return math.ceil(math.log2(k)) * self.alpha_s + nbytes * self.beta_s_per_byte

    def group_alltoall_s(self, k: int, nbytes: float) -> float:
        """A group of k averaging inside one world all-to-all (dssync ``exchange="alltoall"``): every member
        sends its nbytes to the k - 1 others (full duplex) after a round that exchanges the counts. Equals
        allreduce_s(2, nbytes) for a pair."""
        if k <= 1:
            return 0.0
        return 2 * self.alpha_s + (k - 1) * nbytes * self.beta_s_per_byte

    def allgather_s(self, k: int, nbytes_per_rank: float) -> float:
        if k <= 1:
            return 0.0
        return (k - 1) * (self.alpha_s + nbytes_per_rank * self.beta_s_per_byte)

    def control_s(self, k: int, kind: str, nbytes: float = 0.0, calls: int = 1) -> float:
        """``calls`` infrequent collective calls of ``kind`` ("allreduce", "broadcast", "allgather";
        ``nbytes`` per call, per rank for allgather) over k ranks: alpha-beta plus ``control_op_s`` each."""
        if k <= 1 or calls <= 0:
            return 0.0
        cost = {"allreduce": self.allreduce_s, "broadcast": self.broadcast_s, "allgather": self.allgather_s}[kind]
        return calls * (cost(k, nbytes) + self.control_op_s)

    def broadcast_object_s(self, k: int, nbytes: float) -> float:
        """``hvd.broadcast_object``: the pickled object's length, then its bytes (two broadcasts)."""
        return self.control_s(k, "broadcast", 8.0) + self.control_s(k, "broadcast", nbytes)

    def describe(self) -> dict:
        return {"name": self.name, "alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                "control_op_s": self.control_op_s,
                "bandwidth_gbit_s": 8e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf}


def from_bandwidth(name: str, gbit_per_s: float, alpha_s: float, control_op_s: float = 0.0) -> Network:
    return Network(name, alpha_s, 8.0 / (gbit_per_s * 1e9), control_op_s)


#: 25 Gbit/s Ethernet with TCP (Gloo or NCCL sockets): 30 us per message is a typical kernel-stack latency.
ETHERNET_25G = from_bandwidth("ethernet-25g", 25.0, 30e-6)
#: 200 Gbit/s InfiniBand HDR with RDMA (NCCL): about 5 us per ring step including NCCL's own overhead.
INFINIBAND_200G = from_bandwidth("infiniband-200g", 200.0, 5e-6)
#: A network that costs nothing (for closed-form checks).
FREE = Network("free", 0.0, 0.0)

PRESETS = {n.name: n for n in (ETHERNET_25G, INFINIBAND_200G)}
