"""What train_localsgd.py keeps of its replicas besides each rank's model and optimizer: the record of
the fusions (FusionRecord, held by the lesson's ReplicaSync) as a checkpoint saves and a resume restores
it, and each rank's replica at the end (save_rank_model, --save_rank_models)."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import record_task
from .collectives import CollectiveCounter
from .errors import UsageError


class FusionRecord:
    """The record of the fusions: the step of each fragment's last fusion (last_fused) and how many
    there were (fusions), the calls and bytes of their all-reduces (counter) and the time the steps
    waited for them (wait_s). A checkpoint keeps it as an optimizer's state is kept (state_dict,
    restore): the fusion flags, last_fused, DiLoCo's θ_last and outer momentum, and the fusion in flight.

    Its inputs are explicit: the fusion's flags, the model (for the parameters' names), the fragments,
    and DiLoCo's θ_last (`last`) and outer SGDs (`outer`), which the lesson builds and steps and this
    record saves and restores in place. Every rank computes the same outer step from the same mean Δ,
    so θ_last and the outer momentum are the same everywhere: the main process saves them once."""

    def __init__(self, args, model, fragments: list, last: list | None = None, outer: list | None = None):
        self.settings = {  # the flags the fusion steps and the outer state depend on: a resume repeats them
            "outer_optimizer": args.outer_optimizer,
            "sync_every": args.sync_every,
            "fragments": len(fragments),
            "overlap_steps": args.overlap_steps,
            "overlap_mix": args.overlap_mix if args.overlap_steps else None,  # α only mixes an overlapped fusion
        }
        self.last, self.outer, self.names = last, outer, None
        if outer is not None:  # DiLoCo: the parameters' names, saved with θ_last
            name_of = {id(p): name.removeprefix("module.") for name, p in model.named_parameters()}
            self.names = [[name_of[id(p)] for p in fragment] for fragment in fragments]
        self.last_fused = [0] * len(fragments)  # the step of each fragment's last fusion
        self.fusions, self.counter, self.wait_s = [0] * len(fragments), CollectiveCounter(), 0.0

    def fused(self, fragment: int, step: int) -> None:
        self.last_fused[fragment] = step
        self.fusions[fragment] += 1

    def state_dict(self, in_flight: dict | None = None) -> dict:
        """What a checkpoint keeps; `in_flight`, a fusion whose mean Δ has arrived, is saved with it."""
        state = {"settings": self.settings, "last_fused": self.last_fused}
        if self.outer is not None:  # DiLoCo
            state |= {"names": self.names, "last": self.last, "outer": [opt.state_dict() for opt in self.outer]}
        if in_flight:  # DiLoCo: saved arrived, to land at the same step after a resume
            state["in_flight"] = {"fragment": in_flight["fragment"], "step": in_flight["step"]}
            state["in_flight"]["mean"] = in_flight["delta"].cpu()
        return state

    def load_state_dict(self, state: dict | None, path, device) -> dict | None:
        """Restores last_fused, θ_last and the outer momentum; refuses a checkpoint of other fusion
        settings. Returns the fusion in flight, arrived (its mean Δ on `device`), or None."""
        saved = (state or {}).get("settings", {"outer_optimizer": "average", "sync_every": None, "fragments": 1})
        saved = {"overlap_steps": 0, "overlap_mix": None, **saved}  # older checkpoints record no α
        differ = [k for k in self.settings if saved[k] is not None and saved[k] != self.settings[k]]
        if differ:
            flags = ", ".join(f"--{k} {saved[k]}" for k in differ)
            raise UsageError(
                f"--resume_from_checkpoint {path}: saved with {flags}; resume with the same flags "
                "(the outer state and the fusion steps depend on them)"
            )
        if state is not None:
            self.last_fused = list(state["last_fused"])
        if self.outer is not None:
            with torch.no_grad():
                for mine, saved_last in zip(self.last, state["last"]):
                    for t, s in zip(mine, saved_last):
                        t.copy_(s)
            for opt, opt_state in zip(self.outer, state["outer"]):
                opt.load_state_dict(opt_state)
        flight = (state or {}).get("in_flight")
        if not flight:
            return None
        return {
            "fragment": flight["fragment"],
            "step": flight["step"],
            "work": None,
            "delta": flight["mean"].to(device),
        }

    def restore(self, resume_path, device) -> dict | None:
        """load_state_dict with what the checkpoint at `resume_path` saved (its extra_state.pt)."""
        from .checkpoint_resume import load_extra_state  # only a resumed run reads a checkpoint

        return self.load_state_dict(load_extra_state(resume_path), resume_path, device)

    def continue_line(self, step: int, saved_replicas: int, dp_size: int, path) -> str:
        """A resume on another number of replicas (an elastic restart after a node was lost, or came
        back) continues every replica from θ at the last fusion, each with the inner optimizer state of
        saved replica r mod N: the line that says what is dropped, or a one-line refusal where θ at the
        last fusion is not kept (average, between two fusions)."""
        dropped = max(step - last for last in self.last_fused)  # local steps since a fragment's fusion
        local_steps = f"{dropped} local step{'s' if dropped != 1 else ''}"
        if self.outer is None and dropped:
            raise UsageError(
                f"--resume_from_checkpoint {path}: saved by {saved_replicas} replicas at step "
                f"{step}, {local_steps} after a fusion, and --outer_optimizer average keeps no "
                f"copy of the fused model: resume on {saved_replicas} processes, or from a "
                "checkpoint taken at a fusion (--checkpoint_every a multiple of --sync_every)"
            )
        lost = f", dropping the {local_steps} since it" if dropped else " (the checkpoint is at a fusion)"
        return (
            f"{saved_replicas} replicas saved the checkpoint, {dp_size} resume it: every "
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
