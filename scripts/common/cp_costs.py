"""What context parallelism (train_cp.py) sends, and what the run says of it: the bytes of the ring and of
Ulysses' all-to-alls per step (the formulas), the run's first line about CP, and its summary's measured
traffic beside the formula. The chunks and the ring's steps they count come from context_parallel.py."""

from .context_parallel import cp_chunks, ring_steps
from .sharded_costs import ulysses_bytes_per_layer


# ---------------------------------------- bytes per step: formulas, the start line, the summary
def ring_bytes_per_step(layout, batch_size: int, seq_len: int, width: int, layers: int, accum: int, steps=None):
    """The ring's traffic per rank and optimizer step, fp32: per layer (cp-1) K/V blocks in forward;
    in backward (cp-1) K/V blocks again plus cp dK/dV blocks. A K/V block: 2 x b x s/cp x d.
    `steps`: the ring steps of each layer where a sliding window ends the ring early (ring_steps;
    default cp each): S steps send S-1 K/V blocks each way and S dK/dV blocks (none when S is 1)."""
    block = 2 * batch_size * (seq_len // layout.cp) * width * 4
    steps = steps or [layout.cp] * layers
    forward = sum(s - 1 for s in steps) * block * accum
    backward = sum((s - 1) + (s if s > 1 else 0) for s in steps) * block * accum
    return {"forward": forward, "backward": backward}


def ulysses_bytes_per_step(layout, batch_size: int, seq_len: int, shapes: dict, accum: int) -> dict:
    """Ulysses' all-to-all buffers per rank and optimizer step, fp32 (ulysses_bytes_per_layer): per
    layer q, k, v in and the output back in forward, the same four in backward, each b x s/cp x
    width."""
    per_layer = ulysses_bytes_per_layer(batch_size, seq_len, layout.cp, shapes["q_width"], shapes["width"], 4)
    return {k: per_layer[k] * shapes["layers"] * accum for k in ("forward", "backward")}


def cp_start_line(layout, args, seq_len: int, kv_shape, impl: str = "ring") -> tuple[str, dict | None]:
    """What the run's first lines say of CP, and its traffic per rank and optimizer step (the
    formula; None without CP). `kv_shape`: what the attention receives (cp_checks.attention_shapes)."""
    if layout.cp == 1:
        return "context parallel over 1 rank: nothing to cut, so the ring attention is not installed", None
    cp, dp, accum = layout.cp, layout.dp, args.gradient_accumulation_steps
    if impl == "ulysses":
        formula = ulysses_bytes_per_step(layout, args.batch_size, seq_len, kv_shape, accum)
        heads = kv_shape["q_heads"] // cp
        cp_line = (
            f"context parallel (Ulysses): {cp} ranks per group x {dp} data-parallel; each rank holds "
            f"{seq_len // cp} of the {seq_len} tokens (chunk r of {cp}) and attends over all of them "
            f"with {heads} of the {kv_shape['q_heads']} heads; all-to-all buffers per rank and step: "
            f"{formula['forward'] / 2**20:.3f} MiB forward, {formula['backward'] / 2**20:.3f} MiB backward "
            f"({cp - 1}/{cp} of it leaves the rank); FSDP over dp x cp = {dp * cp} ranks"
        )
        return cp_line, formula
    width, layers = kv_shape["width"], kv_shape["layers"]
    windows = kv_shape.get("windows") or [None] * layers
    chunks_of = cp_chunks(cp, impl, windows, seq_len)  # a window may choose contiguous chunks
    c = seq_len // sum(map(len, chunks_of))
    steps = [ring_steps(chunks_of, c, w) for w in windows]
    ring_formula = ring_bytes_per_step(layout, args.batch_size, seq_len, width, layers, accum, steps)
    full = ring_bytes_per_step(layout, args.batch_size, seq_len, width, layers, accum)
    not_sent = sum(full.values()) - sum(ring_formula.values())
    held = (
        f"chunks r and {2 * cp - 1}-r of {2 * cp}"
        if len(chunks_of[0]) == 2
        else f"chunk r of {cp}: the windows need only the neighbours' K/V"
    )
    windowed = sum(w is not None for w in windows)
    window_part = (
        f"; sliding windows in {windowed} of {layers} layers: the ring stops after {min(steps)} of {cp} "
        f"steps there, {not_sent / 2**20:.3f} MiB per step not sent"
        if not_sent
        else ""
    )
    cp_line = (
        f"context parallel (ring): {cp} ranks per ring x {dp} data-parallel; each rank "
        f"holds {seq_len // cp} of the {seq_len} tokens ({held}); ring traffic per rank and step: "
        f"{ring_formula['forward'] / 2**20:.3f} MiB forward, {ring_formula['backward'] / 2**20:.3f} MiB backward"
        f"{window_part}; FSDP over dp x cp = {dp * cp} ranks"
    )
    return cp_line, ring_formula | ({"not_sent": not_sent} if not_sent else {})


def cp_traffic(attention, formula: dict, steps: int) -> dict:
    """The summary's CP part: the implementation, the run's measured traffic per rank and step (the
    Ring's bytes, or Ulysses' all-to-all buffers, named "all_to_all") beside the formula's, and
    under sliding windows the ring's bytes not sent (per rank and step). `attention`: what
    apply_context_parallel installed (None at cp 1: nothing)."""
    if attention is None:
        return {}
    ulysses = getattr(attention, "ulysses", None)
    sender, impl, name = (ulysses, "ulysses", "all_to_all") if ulysses else (attention.ring, "ring", "ring")
    steps = max(steps, 1)
    traffic = {
        "cp_impl": impl,
        f"{name}_mib_per_step_rank": {k: round(v / steps / 2**20, 4) for k, v in sender.sent_bytes.items()},
        f"{name}_formula_mib_per_step_rank": {k: round(formula[k] / 2**20, 4) for k in ("forward", "backward")},
    }
    if "not_sent" in formula:
        traffic[f"{name}_not_sent_by_windows_mib_per_step_rank"] = round(formula["not_sent"] / 2**20, 4)
    return traffic


def reset_traffic(attention) -> None:
    """The cut check's probe step sent bytes too: the run's summary counts its own steps' from
    zero."""
    for sender in (getattr(attention, "ring", None), getattr(attention, "ulysses", None)):
        if sender is not None:
            sender.sent_bytes = dict.fromkeys(sender.sent_bytes, 0)
            sender.blocks_computed = sender.blocks_skipped = 0
