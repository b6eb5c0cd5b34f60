"""What a checkpoint folder holds (common/checkpoint.py's docstring draws it), shared by the modules that
write it (checkpoint_save.py), read it (checkpoint_resume.py) and check it (resume_checks.py): the files'
names, where the checkpoints are and which are complete, trainer_state.json's digest, the record of every
file's size and sha256, what the state dicts hold, and every rank's RNG."""

from __future__ import annotations

import hashlib
import json
import random
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import gather_object
from torch.distributed.checkpoint.state_dict import StateDictOptions

STATE_FILE = "trainer_state.json"
STATE_DIGEST_KEY = "state_sha256"  # in trainer_state.json: the sha256 of the rest of it (state_digest)
EXTRA_STATE_FILE = "extra_state.pt"  # a strategy's own state (save_checkpoint(extra_state=...))
# Optimizer state keyed by parameter name ("optim.state.blocks.3.mlp.up_proj.weight.exp_avg"),
# not by position in a param group: pipeline stages hold different parameters in "the same"
# groups, and another layout must find each parameter's state by its name.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# LoRA: a checkpoint holds the adapters and their optimizer state; the frozen base comes from its source again
ADAPTERS_ONLY = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def checkpoints_dir(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir) -> list[Path]:
    """Complete checkpoints, oldest first (a temp dir of an interrupted save is not one)."""
    root = checkpoints_dir(output_dir)
    found = [p for p in root.glob("step_*") if re.fullmatch(r"step_\d+", p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def options_for(model) -> StateDictOptions:
    """What a checkpoint of this model holds: every parameter, or under LoRA the adapters only."""
    return ADAPTERS_ONLY if any(".lora_A." in n for n, _ in model.named_parameters()) else OPTIONS


def unwrap_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the torch one


def state_digest(state: dict) -> str:
    """sha256 of trainer_state.json's content without its own digest, in one canonical form (keys sorted, after
    a JSON round trip: what was saved and what is read back give the same text)."""
    content = json.loads(json.dumps({k: v for k, v in state.items() if k != STATE_DIGEST_KEY}))
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def file_record(path: Path) -> dict:
    with open(path, "rb") as f:
        return {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def on_every_rank(mine: dict) -> dict:
    """Collective: the union of every rank's dict (each rank reads its share of the files: the work is spread)."""
    return {k: v for part in gather_object([mine]) for k, v in part.items()}  # Accelerate: all ranks' dicts


def my_share(names: list[str]) -> list[str]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return names
    return sorted(names)[torch.distributed.get_rank() :: torch.distributed.get_world_size()]


def record_checkpoint_files(tmp: Path) -> dict:
    """Collective: {relative path: {bytes, sha256}} of every file written (trainer_state.json keeps it)."""
    names = [p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p.name != STATE_FILE]
    return dict(sorted(on_every_rank({name: file_record(tmp / name) for name in my_share(names)}).items()))


def rng_state() -> dict:
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), **cuda}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def each_rank_alone(per_rank_state: bool):
    """Per-rank state (Local SGD) is saved without collectives (`no_dist=True`), on purpose: DCP's warning
    that it assumes "a single process" is wrong here, and only it is silenced."""
    with warnings.catch_warnings():
        if per_rank_state:
            warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninit")
        yield
