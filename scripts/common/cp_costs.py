"""What context parallelism (train_cp.py) holds, computes and sends: which chunks of a sequence each
rank holds and how many steps of the ring a sliding window leaves needed (the lesson's rule, and the
planner's: plan_layout.py), the attention blocks each rank computes, the bytes of the ring and of
Ulysses' all-to-alls per step, the run's first line about CP and its summary's measured traffic."""

import torch
import torch.nn.functional as F

from .sharded_costs import ulysses_bytes_per_layer


# ---------------------------------------- which chunks each rank holds
def head_tail_chunks(cp: int) -> list[list[int]]:
    """Which chunks of a sequence cut into 2 x cp each rank holds: rank r holds r and 2cp-1-r."""
    return [[r, 2 * cp - 1 - r] for r in range(cp)]


def contiguous_chunks(cp: int) -> list[list[int]]:
    """Without balancing: rank r holds chunk r of cp (picotron's split). Under a causal mask rank r
    then computes r + 1 blocks, rank cp - 1 all cp of them."""
    return [[r] for r in range(cp)]


def block_in_window(q_chunk: int, kv_chunk: int, c: int, window: int | None) -> bool:
    """A causal mask within `window` tokens (None: the whole past) leaves something of the block q
    chunk x kv chunk (c tokens each): the kv chunk is not after the q chunk, nor wholly outside the
    window."""
    d = (q_chunk - kv_chunk) * c  # the offset of the block's row 0 from its col 0
    return d >= 0 and (window is None or d - (c - 1) < window)


def ring_steps(chunks_of: list[list[int]], c: int, window: int | None) -> int:
    """How many steps of the ring some rank computes something in: the ring stops after them (the
    K/V a window leaves unneeded are not sent). Every step without a window."""
    size = len(chunks_of)
    needed = [
        s
        for s in range(size)
        for r in range(size)
        if any(block_in_window(qc, kc, c, window) for qc in chunks_of[r] for kc in chunks_of[r - s])
    ]
    return max(needed) + 1


def cp_chunks(cp: int, impl: str = "ring", windows=None, seq_len: int = 0) -> list[list[int]]:
    """Which chunks each rank holds: the ring balances the causal work with head-tail chunks (2 x
    cp), unless the layers' sliding `windows` let contiguous chunks (rank r: chunk r of cp) end the
    ring in fewer steps (each rank then needs only its neighbours' K/V: fewer bytes, and the work is
    balanced by the window); Ulysses computes whole sequences on every rank, already balanced: chunk
    r of cp."""
    if impl != "ring":
        return contiguous_chunks(cp)
    if windows and all(windows):
        head_tail, contiguous = head_tail_chunks(cp), contiguous_chunks(cp)
        steps_of = {
            name: sum(ring_steps(chunks, seq_len // sum(map(len, chunks)), w) for w in windows)
            for name, chunks in (("head_tail", head_tail), ("contiguous", contiguous))
        }
        if steps_of["contiguous"] < steps_of["head_tail"]:
            return contiguous
    return head_tail_chunks(cp)


# ---------------------------------------- the blocks each rank computes
def causal_blocks(q_chunks: list[int], kv_chunks: list[int]) -> list[tuple[int, int, bool]]:
    """The (q chunk, kv chunk) pairs a causal mask leaves something to compute: a kv chunk after the
    q chunk is skipped, the same chunk is a causal (diagonal) block, an earlier one a full block.
    Returns (index of the q chunk in q_chunks, index of the kv chunk in kv_chunks, is_diagonal)."""
    return [(i, j, qc == kc) for i, qc in enumerate(q_chunks) for j, kc in enumerate(kv_chunks) if kc <= qc]


def blocks_per_rank(chunks_of: list[list[int]]) -> list[int]:
    """The attention blocks (q chunk x kv chunk, a diagonal one counted whole) each rank computes
    over a whole ring: what head-tail balancing evens out."""
    return [sum(len(causal_blocks(mine, theirs)) for theirs in chunks_of) for mine in chunks_of]


# ---------------------------------------- what the attention receives
def attention_shapes(task, model, device) -> dict:
    """What CP carries, measured on the model through the contract alone (Task.set_attention,
    Task.forward_at): one forward of 2 tokens with a recording attention in every layer gives the
    query and K/V heads and widths as the attention receives them (heads x head_dim; grouped KV
    heads may arrive repeated), the layers that call it and each one's sliding window (None: the
    whole past): the ring's and Ulysses' bytes, the ring's chunks, and Ulysses' head check. In
    training mode, the generator put back after: the largest dropout_p asked for (check_cp)."""
    seen, windows, dropouts = [], [], [0.0]

    def recording_attention(q, k, v, dropout_p=0.0, window=None, sinks=None, softcap=None, documents=None):
        kv_width = (k.shape[1] * k.shape[-1] + v.shape[1] * v.shape[-1]) / 2
        seen.append((q.shape[1], k.shape[1], q.shape[1] * q.shape[-1], kv_width))
        windows.append(window)
        dropouts.append(float(dropout_p or 0.0))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

    was_training = model.training
    model.train()  # a layer asks for its attention dropout only in training
    task.set_attention(model, recording_attention)
    try:  # fork_rng: the other dropouts' draws leave no trace on a resumed run's generator
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            ids, positions = torch.zeros(1, 2, dtype=torch.long, device=device), torch.arange(2, device=device)
            task.forward_at(model, ids, positions)
    finally:
        task.set_attention(model, None)
        model.train(was_training)
    q_heads, kv_heads, q_width, width = seen[0] if seen else (0, 0, 0, 0)
    shapes = {"q_heads": q_heads, "kv_heads": kv_heads, "q_width": q_width, "width": width, "layers": len(seen)}
    return shapes | {"windows": windows, "dropout": max(dropouts)}


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
    formula; None without CP). `kv_shape`: what the attention receives (attention_shapes)."""
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
