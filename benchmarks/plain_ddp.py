#!/usr/bin/env python
"""The usual data-parallel recipe in plain PyTorch: no Accelerate.

torchrun starts the processes; init_process_group, DistributedSampler + set_epoch,
DistributedDataParallel, mean loss per batch, rank-0 printing. Same model
(scripts/common/model.py), optimizer and data (addition) as scripts/train_ddp.py, so
benchmarks/bench_ddp.py can compare their speed. A baseline, not a recipe to copy: its
per-batch mean loss is not the global-batch loss when target counts differ
(docs/troubleshooting.md, "Loss normalised per micro-batch").

    torchrun --nproc_per_node 2 benchmarks/plain_ddp.py --max_steps 300
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common.builtin_flags import DEFAULT_CACHE_DIR
from common.causal_lm import cross_entropy_sum
from common.data import build_addition, encode_addition
from common.model import GPT, GPTConfig


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_size", default="small")
    p.add_argument("--batch_size", type=int, default=64, help="per rank")
    p.add_argument("--max_steps", type=int, default=300)
    p.add_argument("--warmup_skip", type=int, default=20, help="steps left out of the timing")
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--output_file", help="write the figures here (rank 0)")
    args = p.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")

    files = build_addition(DEFAULT_CACHE_DIR, 3) if rank == 0 else None
    dist.barrier()
    files = build_addition(DEFAULT_CACHE_DIR, 3)
    texts = [json.loads(line)["text"] for line in open(files["train"])]
    encoded = encode_addition({"text": texts}, row_len=13)
    dataset = TensorDataset(torch.tensor(encoded["input_ids"]), torch.tensor(encoded["labels"]))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig.from_preset(args.model_size)).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)

    step, epoch, timed_tokens, timed_seconds = 0, 0, 0, 0.0
    last = time.perf_counter()  # a step's time runs from the end of the previous one: data loading included
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for input_ids, labels in loader:
            input_ids, labels = input_ids.to(device), labels.to(device)
            loss_sum, n_targets = cross_entropy_sum(model(input_ids), labels)
            loss = loss_sum / n_targets
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            now = time.perf_counter()
            if step > args.warmup_skip:
                timed_tokens += input_ids.numel() * world_size
                timed_seconds += now - last
            last = now
            if step == args.max_steps:
                break
        epoch += 1
    if rank == 0:
        figures = {
            "recipe": "plain_ddp",
            "world_size": world_size,
            "steps": step,
            "tokens_per_sec": round(timed_tokens / timed_seconds, 1),
            "last_loss": loss.item(),
        }
        print(json.dumps(figures))
        if args.output_file:
            Path(args.output_file).write_text(json.dumps(figures) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
