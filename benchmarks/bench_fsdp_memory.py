#!/usr/bin/env python
"""Measures the host memory each rank of scripts/train_fsdp.py holds, for a 🤗 model of ~85M parameters
saved here (save_pretrained, safetensors, random init: nothing downloaded), at 1, 2 and 4 processes.
train_fsdp.py builds a 🤗 model on the meta device, shards it, and each rank reads only its slices of the
safetensors file (common/hf.py materialize_hf), so what a rank holds for the model (weights, gradients,
Adam's two moments: 16 bytes a parameter in fp32) should fall as 1/N. Beside it, train_ddp.py, which
loads the whole model on every rank, as every script did before.

Peak resident memory (RSS) of every rank process, sampled every 20 ms, minus the same run's figure with
a tiny model (the interpreter, torch, the data, gloo: what does not scale), is the model's part. One
training step (--max_steps 2 --stop_at_step 1: no export, which gathers the model on the main process).

Two allocator settings. With glibc's defaults, RSS is not what a rank holds: FSDP all-gathers each layer
into a new buffer and frees it, and glibc, having raised its mmap threshold after the first large free,
keeps the freed memory in its heap for reuse, so RSS climbs towards the whole model's size however few
bytes are live. MALLOC_MMAP_THRESHOLD_=1048576 fixes the threshold: every buffer of 1 MiB or more is its
own mapping, returned when freed, and RSS follows the live tensors. On GPUs the figure is
torch.cuda.max_memory_allocated, which has no such question.
Prints the figures and writes benchmarks/results/fsdp_memory.json. Takes ~6 minutes on 2 cores.

    python benchmarks/bench_fsdp_memory.py [--hidden 768 --layers 12]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from harness import ENV, REPO, accelerate_cmd

RESULTS = REPO / "benchmarks" / "results" / "fsdp_memory.json"
ALLOCATORS = {"glibc defaults": {}, "MALLOC_MMAP_THRESHOLD_=1048576": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}


def save_model(folder: Path, hidden: int, layers: int) -> int:
    """A random-init Llama with the byte vocabulary (no tokenizer), saved as a pretrained folder."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=128,
        vocab_size=256,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def peak_rss_per_rank(script: str, nproc: int, folder: Path, out: Path, env: dict) -> list[float]:
    """Launch `script` on `nproc` processes; the peak RSS (MiB) of each rank process, sampled every 20 ms."""
    args = ["--model_name_or_path", str(folder), "--block_size", "64", "--batch_size", "2", "--addition_digits", "4"]
    args += ["--max_steps", "2", "--stop_at_step", "1", "--eval_every", "0", "--output_dir", str(out)]
    args += ["--overwrite_output_dir", "--collective_timeout", "600"]
    cmd = accelerate_cmd(f"scripts/{script}", args, nproc)
    out_err = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True}
    proc = subprocess.Popen(cmd, cwd=REPO, env={**ENV, **env}, **out_err)
    launcher, peaks = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        try:
            for child in launcher.children(recursive=True):
                if any(part.endswith(f"scripts/{script}") for part in child.cmdline()):
                    peaks[child.pid] = max(peaks.get(child.pid, 0), child.memory_info().rss / 2**20)
        except psutil.Error:  # a process ended between listing and reading
            pass
        time.sleep(0.02)
    if proc.returncode != 0:
        raise SystemExit(f"{script} on {nproc} processes failed:\n{proc.stderr.read()[-3000:]}")
    ranks = sorted(peaks.values(), reverse=True)
    return [round(x, 1) for x in ranks]


def planned_mib(hidden: int, layers: int, nproc: int, folder: Path) -> dict:
    """plan_layout.py's figures for the same model and run on `nproc` FSDP ranks, MiB per rank: the state
    (weights, gradients, Adam) and the whole memory (plus FSDP's gathered units and the activations)."""
    config = folder / f"plan_{hidden}x{layers}.json"
    heads = max(1, hidden // 64)
    config.write_text(
        json.dumps(
            {"model_type": "llama", "hidden_size": hidden, "intermediate_size": hidden * 8 // 3 // 64 * 64}
            | {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads}
            | {"max_position_embeddings": 128}
        )
    )
    cmd = [sys.executable, "scripts/plan_layout.py", "--model_config", str(config), "--world_size", str(nproc)]
    cmd += ["--pp_size", "1", "--dp_replicate", "1", "--dp_shard", str(nproc), "--tp_size", "1", "--batch_size", "2"]
    cmd += ["--n_microbatches", "1", "--seq_len", "16", "--json"]
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, check=True).stdout
    record = json.loads(out.strip().splitlines()[-1])[0]
    return {
        "planned_state_mib_per_rank": round(record["state_bytes_per_rank_max"]["total_bytes"] / 2**20, 1),
        "planned_memory_mib_per_rank": round(record["memory_bytes_per_rank_max"] / 2**20, 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--plan_only", action="store_true", help="add the planner's figures to the results file")
    args = parser.parse_args()
    if args.plan_only:
        results = json.loads(RESULTS.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            add_plans(results, args, Path(tmp))
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        return
    results = {"runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        big, tiny = Path(tmp) / "big", Path(tmp) / "tiny"
        n_params = save_model(big, args.hidden, args.layers)
        save_model(tiny, 64, 1)
        results.update(n_params=n_params, model_state_mib_one_process=round(16 * n_params / 2**20, 1))
        print(f"model: {n_params / 1e6:.1f}M parameters; weights + grads + Adam = {16 * n_params / 2**20:.0f} MiB")
        cases = [("train_fsdp.py", n) for n in args.procs] + [("train_ddp.py", max(args.procs))]
        for allocator, env in ALLOCATORS.items():
            for script, nproc in cases:
                big_peaks = peak_rss_per_rank(script, nproc, big, Path(tmp) / "run", env)
                tiny_peaks = peak_rss_per_rank(script, nproc, tiny, Path(tmp) / "run", env)
                model_part = round(max(big_peaks) - max(tiny_peaks), 1)
                run = {"allocator": allocator, "script": script, "processes": nproc, "peak_rss_mib_per_rank": big_peaks}
                run.update(peak_rss_mib_per_rank_tiny_model=tiny_peaks, model_mib_per_rank=model_part)
                results["runs"].append(run)
                print(f"{allocator}: {script} x{nproc}: peak RSS per rank {max(big_peaks):.0f} MiB ", end="")
                print(f"(tiny model {max(tiny_peaks):.0f}), the model's part {model_part:.0f} MiB per rank")
    for allocator in ALLOCATORS:
        fsdp = [r for r in results["runs"] if r["script"] == "train_fsdp.py" and r["allocator"] == allocator]
        for r in fsdp:
            ratio = r["model_mib_per_rank"] * r["processes"] / fsdp[0]["model_mib_per_rank"]
            r["times_one_process_over_n"] = round(ratio, 2)
            print(f"{allocator}: train_fsdp.py x{r['processes']}: model part x N / one process's = ", end="")
            print(r["times_one_process_over_n"])
    with tempfile.TemporaryDirectory() as tmp:
        add_plans(results, args, Path(tmp))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written: {RESULTS.relative_to(REPO)}")


def add_plans(results: dict, args, folder: Path) -> None:
    """Beside each train_fsdp.py run, what plan_layout.py plans for it."""
    for r in results["runs"]:
        if r["script"] == "train_fsdp.py":
            r.update(planned_mib(args.hidden, args.layers, r["processes"], folder))
            print(
                f"{r['allocator']}: train_fsdp.py x{r['processes']}: measured {r['model_mib_per_rank']} MiB, planned ",
                end="",
            )
            print(f"state {r['planned_state_mib_per_rank']} MiB, memory {r['planned_memory_mib_per_rank']} MiB")


if __name__ == "__main__":
    sys.exit(main())
