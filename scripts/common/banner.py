"""The run's first lines (RunMonitor.start prints them): who runs, on what, the model, the data, the global
batch, what the strategy costs, and where a resumed run starts."""

from __future__ import annotations


def start_lines(monitor, task, model_line: str, data, strategy_lines: list[str], resume_path=None) -> str:
    """The start lines of `monitor`'s run; `strategy_lines`: the lesson's own (None: a line that does not apply)."""
    acc, args, layout = monitor.accelerator, monitor.args, monitor.layout
    of_tokens = f" of {task.tokens_per_sample} tokens" if task.tokens_per_sample else ""
    dp = monitor.global_batch_size // (args.batch_size * args.gradient_accumulation_steps)
    lines = [
        f"{monitor.name}: {monitor.world_size} process(es) on {acc.device} ({acc.distributed_type}), "
        f"mixed precision {acc.mixed_precision}"
    ]
    if layout is not None:
        lines.append(layout.table())
    lines += [
        f"  {model_line}",
        f"  data {getattr(data, 'name', 'data')}: {len(data.train)} train / "
        f"{len(data.validation)} validation samples{of_tokens}",
        f"  global batch = {args.batch_size} per data-parallel rank x {dp} dp ranks "
        f"x {args.gradient_accumulation_steps} accumulation = {monitor.global_batch_size} samples",
        *(f"  {line}" for line in strategy_lines if line),
    ]
    if getattr(task, "lora", None):  # LoRA: what trains, and what this rank holds (common/lora.py)
        lines.append(f"  {task.lora['line'](task.lora['model'], args.optimizer)}")
    if resume_path:
        lines.append(f"  resuming from {resume_path} at step {monitor.start_step}")
    return "\n".join(lines)
