#!/usr/bin/env python
"""LoRA against full fine-tuning (--lora_r), on the CPU (gloo), on a task the base never saw:

1. pretrain: a 🤗 Llama built from `--model_config llama` (4 layers x 128 wide, 0.85M parameters, the byte
   vocabulary) trained with every weight on `pystdlib` (Python sources, 128-token sequences), 2 processes
   (DDP), global batch 16; exported as a 🤗 folder (or reused: --base DIR);
2. adapt that base to `addition` (`042+317=953`, the answer least-significant digit first), starting from it
   with --model_name_or_path, 2 processes (DDP, train_ddp.py), the same steps, the same global batch (128)
   and the same data order, two ways: (a) full fine-tuning, every weight; (b) LoRA (rank 8, alpha 16, on the
   attention and MLP projections; the embeddings and the head frozen); a learning-rate sweep of 2 values for
   each (full fine-tuning lower, LoRA higher);
3. per rank, what each way holds: the same two again on train_fsdp.py (FSDP 2) for a few steps, whose summary
   measures the bytes of parameters, gradients and AdamW state on each rank.

For each fine-tuning run: the trainable parameters, the optimizer state per rank (DDP: AdamW's two fp32
moments, 8 bytes a trainable value; FSDP 2: measured), the peak memory per rank (resident memory on the CPU:
the interpreter, torch and the data included), the mean step time (after the first steps; on 2 cores the 2
ranks share them: indicative only), the training loss along the run (against steps and training seconds),
the validation loss and exact match (the whole answer right) along the run and at the end, and the bytes
the run saves (the whole model, or the adapter). The best LoRA run's OUTPUT/adapter is loaded with PEFT
(PeftModel.from_pretrained on the base) and must compute what the run's merged model (--merge_lora) does.

Prints the tables, writes benchmarks/results/lora.json and, where matplotlib is installed
(benchmarks/requirements.txt), benchmarks/results/lora.png (loss against steps and against seconds, exact
match against steps). About 11 minutes with the defaults on 2 cores (measured: the pretraining 2.5, each
of the 4 fine-tuning runs about 1.5 to 2, the FSDP runs 1).

    python benchmarks/bench_lora.py [--pretrain_steps 1200] [--steps 1000] [--full_lrs 3e-4 1e-3]
                                    [--lora_lrs 3e-3 1e-2] [--lora_r 8] [--fsdp_steps 20]
    python benchmarks/bench_lora.py --base /tmp/lora_base   # pretrain once into that folder, reuse it after
    python benchmarks/bench_lora.py --quick       # a check of this script: a few steps, one rate each, about
                                                  # 2 minutes; writes lora_quick.json / .png instead
    python benchmarks/bench_lora.py --report_only [--quick]
"""

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

from harness import REPO, accelerate_cmd, run_quiet

RESULTS = REPO / "benchmarks" / "results"
METHODS = ("full", "lora")
GLOBAL_BATCH = 128  # fine-tuning: 64 per rank x 2 ranks
PRETRAIN_BATCH = 8  # per rank: 2 x 8 sequences of 128 tokens
TASK = (
    "base: Llama (--model_config llama) pretrained on pystdlib; fine-tuned on addition (3 digits), "
    f"2 processes (DDP), global batch {GLOBAL_BATCH}"
)


def run(script: str, flags: list[str], out: Path) -> tuple[list[dict], float]:
    """One training run on 2 processes; its metrics.jsonl records and the wall-clock seconds of the command."""
    start = time.perf_counter()
    run_quiet(accelerate_cmd(script, [*flags, "--output_dir", str(out), "--overwrite_output_dir"], nproc=2))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, time.perf_counter() - start


def pretrain(args, folder: Path) -> dict:
    """Full training of a Llama from its config on pystdlib; its exported 🤗 folder ends up at `folder`."""
    flags = ["--model_config", "llama", "--dataset", "pystdlib", "--max_steps", str(args.pretrain_steps)]
    flags += ["--batch_size", str(PRETRAIN_BATCH), "--learning_rate", str(args.pretrain_lr)]
    flags += ["--warmup_steps", str(args.pretrain_steps // 10), "--log_every", "50", "--eval_every", "0"]
    out = folder.parent / f".{folder.name}_run"
    records, wall_s = run("scripts/train_ddp.py", flags, out)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.move(str(out / "model"), str(folder))
    shutil.copy(out / "metrics.jsonl", folder / "pretrain_metrics.jsonl")  # what --base reports when reused
    shutil.rmtree(out)
    return pretrain_figures(records, folder, wall_s)


def pretrain_figures(records: list[dict], folder: Path, wall_s: float | None) -> dict:
    summary = next(r for r in records if r["type"] == "summary")
    return {
        "base": str(folder),
        "steps": summary["final_step"],
        "n_params": summary["n_params"],
        "final_eval_loss": [r for r in records if r["type"] == "eval"][-1]["eval_loss"],
        "train_s": summary["train_time_s"],
        "wall_s": None if wall_s is None else round(wall_s, 1),
    }


def reused_base(base: Path) -> dict:
    """What --base DIR says of itself: its pretraining's figures where this benchmark wrote it."""
    file = base / "pretrain_metrics.jsonl"
    records = [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []
    return {**(pretrain_figures(records, base, None) if records else {"base": str(base)}), "reused": True}


def method_flags(method: str, args) -> list[str]:
    return ["--lora_r", str(args.lora_r), "--lora_alpha", str(args.lora_alpha)] if method == "lora" else []


def step_seconds(train: list[dict], skip: int) -> float | None:
    """Mean training seconds per step from the first record at or after step `skip` to the last (records keep
    10 ms: a mean of many steps); None with fewer than two such records."""
    later = [r for r in train if r["step"] >= skip]
    if len(later) < 2:
        return None
    return round((later[-1]["train_s"] - later[0]["train_s"]) / (later[-1]["step"] - later[0]["step"]), 5)


def count_values(safetensors_file: Path) -> int:
    """The values a safetensors file holds (its header only)."""
    from safetensors import safe_open

    with safe_open(str(safetensors_file), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def fine_tune(method: str, lr: float, base: Path, args, tmp: Path) -> dict:
    """Fine-tune `base` on addition, all weights or LoRA adapters, with train_ddp.py on 2 processes."""
    log_every = max(1, min(10, args.steps // 20))
    flags = ["--model_name_or_path", str(base), "--dataset", "addition", "--max_steps", str(args.steps)]
    flags += ["--batch_size", str(GLOBAL_BATCH // 2), "--learning_rate", str(lr)]
    flags += ["--warmup_steps", str(args.steps // 10), "--log_every", str(log_every)]
    flags += ["--eval_every", str(max(1, args.steps // 4)), *method_flags(method, args)]
    flags += ["--merge_lora"] if method == "lora" else []  # the merged model: what PEFT's load must compute
    out = tmp / f"{method}_{lr:g}"
    records, wall_s = run("scripts/train_ddp.py", flags, out)
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    summary = next(r for r in records if r["type"] == "summary")
    if method == "lora":
        saved = out / "adapter" / "adapter_model.safetensors"
        trainable = count_values(saved)  # the adapters: what trained
    else:
        saved = out / "model" / "model.safetensors"
        trainable = summary["n_params"]
    return {
        "method": method,
        "learning_rate": lr,
        "n_params": summary["n_params"],  # under LoRA: the base and the adapters
        "trainable_params": trainable,
        # DDP: every rank holds the whole model, fp32 gradients of what trains and AdamW's two moments of it
        "ddp_bytes_per_rank": {
            "param_bytes": 4 * summary["n_params"],
            "grad_bytes": 4 * trainable,
            "optimizer_bytes": 8 * trainable,
        },
        "peak_memory_mb_max_rank": summary["peak_memory_mb_max_rank"],
        "step_s": step_seconds(train, skip=min(10, args.steps // 2)),  # None: too few records
        "train_loss": [(r["step"], r["train_s"], r["loss"]) for r in train],
        "eval": [(r["step"], r["eval_loss"], r["exact_match"]) for r in evals],
        "final_eval_loss": evals[-1]["eval_loss"],
        "final_exact_match": evals[-1]["exact_match"],
        "saved": str(saved.relative_to(out)),
        "saved_bytes": saved.stat().st_size,
        "wall_s": round(wall_s, 1),
        "output_dir": out,  # for the PEFT check; not saved
    }


def check_adapter_loads(run: dict, base: Path) -> str:
    """The run's OUTPUT/adapter, loaded with PEFT on the base, computes what its merged model does."""
    import warnings

    import torch
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # no loading bars, no deprecation notes
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    out = run["output_dir"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    n_lora = sum(p.numel() for n, p in peft_model.named_parameters() if ".lora_" in n)
    x = torch.tensor([list(b"042+317=") + [0] * 5, list(b"999+001=") + [0] * 5])
    with torch.no_grad():
        got, want = peft_model(x).logits, merged(x).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base).eval()(x).logits
    assert n_lora == run["trainable_params"] and torch.allclose(got, want, atol=1e-4), "the adapter does not load"
    moved = (got - base_logits).abs().max().item()
    return (
        f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUTPUT/adapter): {n_lora:,} "
        f"adapter values, logits = the merged model's (max |diff| {(got - want).abs().max().item():.1e}), "
        f"{moved:.2f} from the base's"
    )


def fsdp_bytes(method: str, lr: float, base: Path, args, tmp: Path) -> dict:
    """A few steps of train_fsdp.py (FSDP 2): its summary measures what each rank holds after a step."""
    flags = ["--model_name_or_path", str(base), "--dataset", "addition", "--max_steps", str(args.fsdp_steps)]
    flags += ["--batch_size", str(GLOBAL_BATCH // 2), "--learning_rate", str(lr), "--warmup_steps", "1"]
    flags += ["--log_every", str(args.fsdp_steps), "--eval_every", "0", *method_flags(method, args)]
    records, _ = run("scripts/train_fsdp.py", flags, tmp / f"fsdp_{method}")
    summary = next(r for r in records if r["type"] == "summary")
    return {
        "method": method,
        "state_bytes_per_rank_max": {k: int(v) for k, v in summary["state_bytes_per_rank_max"].items()},
        "peak_memory_mb_max_rank": summary["peak_memory_mb_max_rank"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrain_steps", type=int, default=1200)
    p.add_argument("--pretrain_lr", type=float, default=3e-3)
    p.add_argument(
        "--base",
        type=Path,
        help="a pretrained 🤗 folder to start from; if it does not exist yet, the "
        "pretraining writes it there (for the next run)",
    )
    p.add_argument("--steps", type=int, default=1000, help="fine-tuning steps of each run")
    p.add_argument("--full_lrs", type=float, nargs="+", default=[3e-4, 1e-3])
    p.add_argument("--lora_lrs", type=float, nargs="+", default=[3e-3, 1e-2])
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--lora_alpha", type=float, default=16.0)
    p.add_argument("--fsdp_steps", type=int, default=20, help="steps of the FSDP 2 runs that measure bytes (0: none)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a check of the script: 20 + 10 steps, one rate each, written to lora_quick.json / .png",
    )
    p.add_argument("--report_only", action="store_true", help="redo the tables and plot from the last results file")
    args = p.parse_args()
    name = "lora_quick" if args.quick else "lora"
    if args.report_only:
        report(json.loads((RESULTS / f"{name}.json").read_text()), name)
        return
    if args.quick:
        args.pretrain_steps, args.steps, args.fsdp_steps = 20, 10, min(args.fsdp_steps, 3)
        args.full_lrs, args.lora_lrs = args.full_lrs[:1], args.lora_lrs[:1]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.base is not None and (args.base / "config.json").exists():
            base = args.base.resolve()
            pretrained = reused_base(base)
        else:
            base = (args.base or tmp / "base").resolve()
            pretrained = pretrain(args, base)
        lrs = {"full": args.full_lrs, "lora": args.lora_lrs}
        runs = [fine_tune(m, lr, base, args, tmp) for m in METHODS for lr in lrs[m]]
        best = {m: min((r for r in runs if r["method"] == m), key=lambda r: r["final_eval_loss"]) for m in METHODS}
        peft_check = check_adapter_loads(best["lora"], base)
        fsdp = [fsdp_bytes(m, best[m]["learning_rate"], base, args, tmp) for m in METHODS] if args.fsdp_steps else []
    for r in runs:
        r.pop("output_dir")
    saved = {
        "task": TASK,
        "quick": args.quick,
        "steps": args.steps,
        "lora": {"r": args.lora_r, "alpha": args.lora_alpha, "targets": "the attention and MLP projections"},
        "pretrain": pretrained,
        "fine_tune": runs,
        "best_learning_rate": {m: best[m]["learning_rate"] for m in METHODS},
        "peft_check": peft_check,
        "fsdp": fsdp,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(saved, indent=1) + "\n")
    report(saved, name)


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def report(saved: dict, name: str) -> None:
    pre = saved["pretrain"]
    how = "reused" if pre.get("reused") else f"{pre.get('wall_s', 0):.0f} s"
    print(f"{saved['task']}; {saved['steps']} fine-tuning steps{' (--quick)' if saved['quick'] else ''}")
    if "steps" in pre:
        print(
            f"base {pre['base']}: {pre['n_params']:,} parameters, {pre['steps']} pretraining steps ({how}), "
            f"pystdlib eval loss {pre['final_eval_loss']:.4f}"
        )
    print(
        "| run | lr | trainable params | optimizer state / rank (DDP) | peak MiB / rank | s/step | "
        "train loss at the end | eval loss | exact match | saved |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    best = saved["best_learning_rate"]
    for r in saved["fine_tune"]:
        mark = " *" if best[r["method"]] == r["learning_rate"] else ""
        share = 100 * r["trainable_params"] / r["n_params"]
        step_s = "-" if r["step_s"] is None else f"{r['step_s']:.4f}"
        what = f"{r['method']}{mark}" if r["method"] == "full" else f"LoRA r={saved['lora']['r']}{mark}"
        print(
            f"| {what} | {r['learning_rate']:g} | {r['trainable_params']:,} ({share:.1f}%) | "
            f"{mib(r['ddp_bytes_per_rank']['optimizer_bytes'])} MiB | {r['peak_memory_mb_max_rank']:.0f} | {step_s} | "
            f"{r['train_loss'][-1][2]:.4f} | {r['final_eval_loss']:.4f} | {r['final_exact_match']:.3f} | "
            f"{mib(r['saved_bytes'])} MiB ({r['saved'].split('/')[0]}) |"
        )
    print("*: the rate of the lower final eval loss, per method")
    if saved["fsdp"]:
        print("FSDP 2, measured per rank (largest rank) after a step, MiB:")
        print("| run | parameters | gradients | optimizer state | total | peak MiB / rank |")
        print("|---|---|---|---|---|---|")
        for f in saved["fsdp"]:
            b = f["state_bytes_per_rank_max"]
            print(
                f"| {f['method']} | {mib(b['param_bytes'])} | {mib(b['grad_bytes'])} | {mib(b['optimizer_bytes'])} | "
                f"{mib(b['total_bytes'])} | {f['peak_memory_mb_max_rank']:.0f} |"
            )
    print(saved["peft_check"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -r benchmarks/requirements.txt)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in saved["fine_tune"]:
        style = "-" if r["method"] == "lora" else "--"
        label = f"{'LoRA' if r['method'] == 'lora' else 'full'} lr {r['learning_rate']:g}"
        steps, seconds, losses = zip(*r["train_loss"], strict=True)
        axes[0].plot(steps, losses, style, label=label)
        axes[1].plot(seconds, losses, style, label=label)
        eval_steps, _, exact = zip(*r["eval"], strict=True)
        axes[2].plot(eval_steps, exact, style + "o", label=label)
    axes[0].set(xlabel="optimizer steps", ylabel="training loss", yscale="log", title="training loss")
    axes[1].set(xlabel="training seconds", ylabel="training loss", yscale="log", title="at equal wall-clock")
    axes[2].set(xlabel="optimizer steps", ylabel="exact match", ylim=(-0.02, 1.02), title="validation exact match")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(saved["task"], fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)
    print(f"written {RESULTS / f'{name}.json'} and {RESULTS / f'{name}.png'}")


if __name__ == "__main__":
    main()
