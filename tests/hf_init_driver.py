"""A 🤗 model built on meta, sharded by FSDP over 2 ranks, then made by materialize_hf on each rank's shards
(test_hf_init.py): every parameter gathered back must equal the whole model one process makes.

    torchrun --nproc_per_node 2 tests/hf_init_driver.py CONFIG.json RESULT.json"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from common.hf import load_hf_model


def build(config: str, on_meta: bool):
    torch.manual_seed(0)
    args = SimpleNamespace(model_config=config, model_name_or_path=None, block_size=None)
    return load_hf_model(args, 16, "text", tokenizer=None, on_meta=on_meta)


def main(config: str, result: str) -> None:
    dist.init_process_group("gloo")
    whole, _ = build(config, on_meta=False)
    model, task = build(config, on_meta=True)
    for layer in task.units(model):
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    task.materialize(model)
    expected = whole.state_dict()
    gaps = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        gaps[name] = (full - expected[name]).abs().max().item() if torch.isfinite(full).all() else float("inf")
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps(gaps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
