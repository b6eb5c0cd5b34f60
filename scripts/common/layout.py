"""The parallel layout: how many ways each strategy splits the job, and the named DeviceMesh.

One object holds the four degrees, checks them once, builds the mesh and hands out the
sub-meshes and this rank's coordinates. No other code does rank arithmetic.

    world = pp x dp_replicate x dp_shard x tp      (one degree may be -1: inferred)

    mesh dims, outermost first:  pp  ->  dp_replicate  ->  dp_shard  ->  tp
    tp is innermost, so a TP group is consecutive ranks (one node, fast links);
    pp is outermost, so stages talk across the slowest links (only activations cross them).

    8 ranks, pp 2 x dp_shard 2 x tp 2:
                    dp_shard 0     dp_shard 1
        pp stage 0: [rank 0, 1]    [rank 2, 3]     <- [..] is one TP group
        pp stage 1: [rank 4, 5]    [rank 6, 7]

The data-parallel ranks (dp = dp_replicate x dp_shard) each get their own slice of the global
batch; the ranks of one TP group and of one pipeline see the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import UsageError
from .run_state import RELEASE_AT_END

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
FLAGS = {"pp": "--pp_size", "dp_replicate": "--dp_replicate", "dp_shard": "--dp_shard", "tp": "--tp_size"}
# Context parallelism (train_cp.py) cuts every sequence over `cp` ranks, between dp_shard and tp: the mesh's
# dims are MESH_DIMS; DIMS stays the four the planner searches. A CP group reads the same samples as one
# data-parallel rank, and FSDP shards over dp_shard x cp (torchtitan's dp_shard_cp): CP ranks hold the same weights.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLAGS["cp"] = "--cp_size"


@dataclass
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    world_size: int = 1
    cp: int = 1
    mesh: DeviceMesh | None = field(default=None, repr=False)
    dp_mesh: DeviceMesh | None = field(default=None, repr=False)
    sub_meshes: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_degrees(
        cls, world_size: int, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1, cp: int = 1
    ) -> "Layout":
        """Check the degrees against the world size (one may be -1: whatever is left)."""
        degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
        if cp != 1:  # context parallel (train_cp.py, train_hybrid.py --cp_size)
            degrees["cp"] = cp
        inferred = [d for d, v in degrees.items() if v == -1]
        if len(inferred) > 1:
            raise UsageError(
                f"only one of {', '.join(FLAGS[d] for d in inferred)} may be -1 (inferred from the world size)"
            )
        for dim, value in degrees.items():
            if value == 0 or value < -1:
                raise UsageError(f"{FLAGS[dim]} must be at least 1, or -1 to infer it (got {value})")
        known = 1
        for value in degrees.values():
            known *= value if value != -1 else 1
        if inferred:
            if world_size % known:
                raise UsageError(
                    f"{' x '.join(f'{FLAGS[d]} {v}' for d, v in degrees.items() if v != -1)} = {known}"
                    f" does not divide the {world_size} processes"
                    ": choose degrees whose product divides the world size"
                )
            degrees[inferred[0]] = world_size // known
        elif known != world_size:
            raise UsageError(
                f"{' x '.join(f'{FLAGS[d]} {v}' for d, v in degrees.items())} = {known}"
                f", but {world_size} processes were started"
                ": the degrees' product must equal the world size"
            )
        return cls(**degrees, world_size=world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def model_split(self) -> int:
        """Into how many different pieces the model state is cut (replicas hold copies)."""
        return self.pp * self.dp_shard * self.tp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Collective: every rank builds the same mesh (one process group per dimension)."""
        dims = MESH_DIMS if self.cp > 1 else DIMS  # without CP, the mesh and its groups are those of before
        self.mesh = init_device_mesh(device_type, tuple(getattr(self, d) for d in dims), mesh_dim_names=dims)
        self.dp_mesh = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")  # one group over all data-parallel ranks
        # slicing a mesh builds a new DeviceMesh object each time (~0.2 ms): slice once, here
        self.sub_meshes = {name: self.mesh[name] for name in dims} | {"dp": self.dp_mesh}
        if self.cp > 1:  # CP: FSDP shards over dp_shard x cp, the ranks that hold the same weights
            self.sub_meshes["dp_shard_cp"] = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        BUILT_MESHES.append(self.mesh)
        return self.mesh

    # --- sub-meshes and this rank's place (after build_mesh) ----------------------------
    def sub(self, name: str) -> DeviceMesh:
        return self.sub_meshes[name]

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """What fully_shard gets: 1-D = FSDP (shard over dp_shard); 2-D = HSDP (replicate over
        dp_replicate, shard inside each replica: docs/troubleshooting.md, "fully_shard on a 2-D
        mesh is HSDP"); None = no data parallelism."""
        if self.dp * self.cp == 1:
            return None
        if self.cp > 1:  # CP ranks hold the same weights: shard over dp_shard x cp (torchtitan's dp_shard_cp)
            return self.mesh["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else self.sub("dp_shard_cp")
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp_shard"]

    def rank_in(self, name: str) -> int:
        return self.sub(name).get_local_rank()

    def group(self, name: str):
        return self.sub(name).get_group()

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")

    @property
    def pp_rank(self) -> int:
        return self.rank_in("pp")

    @property
    def tp_rank(self) -> int:
        return self.rank_in("tp")

    @property
    def cp_rank(self) -> int:
        """This rank's place in its CP ring (0 without CP): which chunks of every sequence it holds."""
        return self.rank_in("cp") if self.cp > 1 else 0

    @property
    def holds_loss(self) -> bool:
        """One rank per data-parallel replica reports its loss: the last stage, TP rank 0."""
        return self.pp_rank == self.pp - 1 and self.tp_rank == 0

    @property
    def writes_stage(self) -> bool:
        """One rank per pipeline stage contributes that stage's weights to the exported model."""
        return self.dp_rank == 0 and self.tp_rank == 0 and self.cp_rank == 0

    def describe(self) -> dict:
        return {d: getattr(self, d) for d in (MESH_DIMS if self.cp > 1 else DIMS)}

    def table(self) -> str:
        """Which rank sits where: one line per rank (printed at start)."""
        if self.cp > 1:
            return self._table_with_cp()
        coords = self.mesh.mesh.reshape(self.pp, self.dp_replicate, self.dp_shard, self.tp)
        lines = [
            f"  layout: pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
            f"x tp {self.tp} = {self.world_size} ranks",
            "    rank   pp  dp_replicate  dp_shard  tp",
        ]
        for idx in torch.cartesian_prod(*(torch.arange(getattr(self, d)) for d in DIMS)).reshape(-1, 4).tolist():
            rank = int(coords[tuple(idx)])
            lines.append(f"    {rank:>4}  {idx[0]:>3}  {idx[1]:>12}  {idx[2]:>8}  {idx[3]:>2}")
        return "\n".join(lines)

    def _table_with_cp(self) -> str:
        sizes = [getattr(self, d) for d in MESH_DIMS]
        coords = self.mesh.mesh.reshape(*sizes)
        lines = [
            "  layout: " + " x ".join(f"{d} {getattr(self, d)}" for d in MESH_DIMS) + f" = {self.world_size} ranks",
            "    rank   pp  dp_replicate  dp_shard  cp  tp",
        ]
        for idx in torch.cartesian_prod(*(torch.arange(n) for n in sizes)).reshape(-1, 5).tolist():
            rank = int(coords[tuple(idx)])
            lines.append(f"    {rank:>4}  {idx[0]:>3}  {idx[1]:>12}  {idx[2]:>8}  {idx[3]:>2}  {idx[4]:>2}")
        return "\n".join(lines)


# Every DeviceMesh built in this process (Layout.build_mesh adds them), for release_process_groups().
BUILT_MESHES: list = []


def release_process_groups() -> None:
    """Free the process groups that the meshes hold, now, while Python is fully alive.

    destroy_process_group() shuts every group down and forgets it, but a DeviceMesh keeps its
    groups' ProcessGroup objects in its own registry (sub-meshes use their root's), and DTensor's
    module-level caches keep the meshes. Left alone, those objects are freed only while the
    interpreter shuts down, and gloo's C++ teardown then sometimes aborted the finished run
    ("terminate called without an active exception", docs/fault-tolerance.md, "Clean exits").
    Call it after destroy_process_group()."""
    for mesh in BUILT_MESHES:
        mesh._pg_registry.clear()  # sub-meshes, flattened ones included, register in their root's
    BUILT_MESHES.clear()  # end_process_groups then collects: the last references may sit in reference cycles


RELEASE_AT_END.append(release_process_groups)  # launch.end_process_groups calls it
