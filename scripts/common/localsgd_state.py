"""train_localsgd.py's bookkeeping, apart from its fusion: Streaming DiLoCo's fragments
(split_fragments), the record of the fusions and the final one, what a checkpoint keeps of them and
how a resume restores it (ReplicaSyncState, the base of the lesson's ReplicaSync), and
--save_rank_models."""

from __future__ import annotations

from pathlib import Path

import torch

from .batchnorm import average_running_stats
from .checkpoint import record_task
from .errors import UsageError
from .localsgd_checks import check_fragments_fit
from .training import unit_modules


def split_fragments(model, units, n_fragments: int) -> list[list[torch.nn.Parameter]]:
    """Streaming DiLoCo's fragments: the blocks (the model's repeated `units`) cut into n_fragments
    runs, or a one-line refusal if there are fewer blocks. The parameters outside the blocks join the
    nearest end: embeddings the first fragment, final norm and head the last."""
    units = unit_modules(units)
    check_fragments_fit(n_fragments, units)
    bounds = [round(f * len(units) / n_fragments) for f in range(n_fragments + 1)]
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters (the base stays as it is)
    fragments = [[p for u in units[a:b] for p in u.parameters() if p.requires_grad] for a, b in zip(bounds, bounds[1:])]
    in_units = {id(p) for fragment in fragments for p in fragment}
    before, after, seen_units = [], [], False
    for p in trained:
        if id(p) in in_units:
            seen_units = True
        else:
            (after if seen_units else before).append(p)
    fragments[0] = before + fragments[0]
    fragments[-1] = fragments[-1] + after
    return fragments


class ReplicaSyncState:
    """The record of the lesson's ReplicaSync's fusions (fused, and finish: the final fusion), and
    saving and restoring it, as an optimizer is saved and restored (state_dict, load_state_dict),
    and a resume (resume; continue_from_fusion on another number of replicas).

    A base class, so that the lesson's ReplicaSync shows the fusion alone while main() keeps
    PyTorch's protocol (replica_sync.state_dict(), as optimizer.state_dict()). It reads what
    ReplicaSync sets (model, fragments, dp_size, outer_optimizer, sync_every, overlap_steps,
    overlap_mix, last_fused, fusions, counter, in_flight; DiLoCo's last and outer) and fuses with
    ReplicaSync's fuse(), arrived() and land(). Every rank computes the same outer step from the
    same mean Δ, so θ_last and the outer momentum are the same everywhere: the state is saved once,
    by the main process."""

    def fused(self, fragment: int, step: int) -> None:
        """Records the fusion of `fragment` at `step` (fuse() and start() call it); with the last
        fragment, BatchNorm's running statistics are averaged too (a collective)."""
        if fragment == len(self.fragments) - 1 and self.dp_size > 1:
            with self.counter:  # BatchNorm's statistics: averaged with the last fragment, always
                average_running_stats(self.model)
        self.last_fused[fragment] = step
        self.fusions[fragment] += 1

    def finish(self, step: int) -> list[int]:
        """The final fusion: every fragment not fused at `step` (the last step) is fused now."""
        if self.dp_size == 1 and self.outer_optimizer == "average":
            return []
        if self.in_flight:  # started at this step: no inner step since, so no mix (one model)
            self.land(0.0 if self.in_flight["step"] == step else self.overlap_mix)
        rest = [f for f, last in enumerate(self.last_fused) if last != step]
        for f in rest:
            self.fuse(f, step)
        return rest

    @property
    def settings(self) -> dict:
        """The flags the fusion steps and the outer state depend on: a resume must repeat them."""
        return {
            "outer_optimizer": self.outer_optimizer,
            "sync_every": self.sync_every,
            "fragments": len(self.fragments),
            "overlap_steps": self.overlap_steps,
            "overlap_mix": self.overlap_mix if self.overlap_steps else None,  # α only mixes an overlapped fusion
        }

    def state_dict(self) -> dict:
        state = {"settings": self.settings, "last_fused": self.last_fused}
        if self.outer_optimizer == "nesterov":
            name_of = {id(p): name.removeprefix("module.") for name, p in self.model.named_parameters()}
            names = [[name_of[id(p)] for p in fragment] for fragment in self.fragments]  # saved with θ_last
            state |= {"names": names, "last": self.last, "outer": [opt.state_dict() for opt in self.outer]}
        if self.in_flight:  # DiLoCo: a fusion in flight is saved arrived, to land at the same step after a resume
            state["in_flight"] = {k: self.in_flight[k] for k in ("fragment", "step")} | {"mean": self.arrived().cpu()}
        return state

    def load_state_dict(self, state: dict | None, path) -> None:
        """Restores θ_last and the outer momentum; refuses a checkpoint of other fusion settings."""
        saved = (state or {}).get("settings", {"outer_optimizer": "average", "sync_every": None, "fragments": 1})
        saved = {"overlap_steps": 0, "overlap_mix": None, **saved}  # older checkpoints record no α
        settings = self.settings
        differ = [k for k in settings if saved[k] is not None and saved[k] != settings[k]]
        if differ:
            flags = ", ".join(f"--{k} {saved[k]}" for k in differ)
            raise UsageError(
                f"--resume_from_checkpoint {path}: saved with {flags}; resume with the same flags "
                "(the outer state and the fusion steps depend on them)"
            )
        if state is not None:
            self.last_fused = list(state["last_fused"])
        if self.outer_optimizer == "nesterov":
            for mine, saved_last in zip(self.last, state["last"]):
                for t, s in zip(mine, saved_last):
                    t.copy_(s)
            for opt, opt_state in zip(self.outer, state["outer"]):
                opt.load_state_dict(opt_state)
        if (state or {}).get("in_flight"):  # arrived already: land() divides nothing more
            flight = state["in_flight"]
            device = self.fragments[0][0].device
            self.in_flight = {**flight, "work": None, "delta": flight.pop("mean").to(device)}

    def resume(self, accelerator, resume_path, progress: dict) -> None:
        """After load_checkpoint: θ_last and the outer momentum as the checkpoint left them; on
        another number of replicas (an elastic restart on fewer, or more), every replica from the
        last fusion."""
        if resume_path:
            from .checkpoint_resume import load_extra_state  # only a resumed run reads a checkpoint

            self.load_state_dict(load_extra_state(resume_path), resume_path)
            if progress["world_size"] != self.dp_size:
                accelerator.print(self.continue_from_fusion(progress["step"], progress["world_size"], resume_path))

    @torch.no_grad()
    def continue_from_fusion(self, step: int, saved_replicas: int, path) -> str:
        """A resume on another number of replicas (an elastic restart after a node was lost, or came
        back): the saved replicas cannot map one to one, so every rank continues from θ at the last
        fusion (DiLoCo's θ_last, with its outer momentum); each keeps the inner optimizer state of
        saved replica r mod N. Returns the line that says what was dropped."""
        dropped = max(step - last for last in self.last_fused)  # local steps since a fragment's fusion
        local_steps = f"{dropped} local step{'s' if dropped != 1 else ''}"
        if self.outer_optimizer == "average" and dropped:  # θ at the last fusion is not kept: refuse
            raise UsageError(
                f"--resume_from_checkpoint {path}: saved by {saved_replicas} replicas at step "
                f"{step}, {local_steps} after a fusion, and --outer_optimizer average keeps no "
                f"copy of the fused model: resume on {saved_replicas} processes, or from a "
                "checkpoint taken at a fusion (--checkpoint_every a multiple of --sync_every)"
            )
        if self.in_flight:
            self.land(0.0)  # DiLoCo: the outer step of the fusion in flight (its mean was saved)
        if self.outer_optimizer == "nesterov":
            for fragment, last in zip(self.fragments, self.last):
                for p, t in zip(fragment, last):
                    p.copy_(t.to(p.device))  # DiLoCo: every replica from θ_last
        lost = f", dropping the {local_steps} since it" if dropped else " (the checkpoint is at a fusion)"
        return (
            f"{saved_replicas} replicas saved the checkpoint, {self.dp_size} resume it: every "
            f"replica continues from the model of the last fusion (step {step - dropped}){lost}; "
            f"replica r keeps saved replica r mod {saved_replicas}'s inner optimizer state"
        )


def save_rank_model(accelerator, model, task, output_dir, data_source: dict) -> None:
    """--save_rank_models: every rank writes its own replica, before the final fusion, for
    merge_checkpoints.py (model fusion after training)."""
    local_state = {k.removeprefix("module."): v.detach().cpu() for k, v in model.state_dict().items()}
    rank_dir = Path(output_dir) / "rank_models" / f"rank_{accelerator.process_index}"
    task.export(local_state, rank_dir, data_source)
    record_task(task, rank_dir)  # a Task of your own: merge_checkpoints.py and evaluate.py find it
    accelerator.print(
        f"each rank's model before the final fusion: {Path(output_dir) / 'rank_models'}/rank_<r> "
        "(fuse them with scripts/merge_checkpoints.py)"
    )
