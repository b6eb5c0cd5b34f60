"""Context parallelism's refusals (train_cp.py, train_hybrid.py --cp_size), one line each, before
anything is cut: the CP size against the processes, the model's Task against CP's contract, the
sequence against the chunks, and Ulysses' heads against cp; and the probe of what the model's
attention receives (attention_shapes: the checks', the chunks' and the start line's figures)."""

import torch
import torch.nn.functional as F

from .errors import UsageError


def check_cp_size(cp_size: int, n_processes: int) -> None:
    """--cp_size divides the processes (the rest is data parallel), or is -1 (all of them)."""
    if cp_size != -1 and (cp_size < 1 or n_processes % cp_size):
        divisors = ", ".join(str(d) for d in range(1, n_processes + 1) if n_processes % d == 0)
        raise UsageError(
            f"--cp_size {cp_size} does not divide the {n_processes} processes: use a --cp_size that divides "
            f"{n_processes} ({divisors}), or -1 for all of them"
        )


def check_cp(layout, model, task, args) -> dict | None:
    """One line each: the model's Task can replace its attention, 2 x cp divides the sequence, no
    dropout in the ring, nothing else that cuts the sequence; then a forward through the contract in
    training mode: an attention that drops weights, under any config name, is refused too. Returns
    what the attention receives (attention_shapes), None at cp 1."""
    cp = layout.cp
    if cp > 1:
        task.set_attention(model, None)  # a Task that cannot replace the model's attention says so here
        missing = [m for m in ("next_token_targets", "loss_at") if not callable(getattr(task, m, None))]
        if missing:  # the loss of a rank's tokens: a language model's Task (CausalLMTask) has both
            raise UsageError(
                f"--cp_size: the Task has no {' and no '.join(missing)}, which give the loss of this rank's "
                "tokens: subclass CausalLMTask (common/causal_lm.py), or implement them in the MODEL section "
                "(docs/cp.md)"
            )
    seq_len, impl = task.tokens_per_sample, getattr(args, "cp_impl", "ring")
    if cp > 1 and impl == "ulysses" and (not seq_len or seq_len % cp):
        raise UsageError(
            f"--cp_size {cp} --cp_impl ulysses cuts each {seq_len}-token sequence into {cp} chunks, "
            f"which does not divide it: use a --block_size divisible by {cp}"
        )
    if cp > 1 and impl == "ring" and (not seq_len or seq_len % (2 * cp)):
        raise UsageError(
            f"--cp_size {cp} cuts each {seq_len}-token sequence into 2 x cp = {2 * cp} chunks "
            f"(head-tail balancing), which does not divide it: use a --block_size divisible by {2 * cp}"
        )
    if cp > 1 and (getattr(args, "dropout", 0) or 0) > 0:  # a model of one's own has no --dropout
        raise UsageError("--dropout: CP's attention has no dropout: use --dropout 0, or train without --cp_size")
    sequence_parallel = getattr(args, "sequence_parallel", False)
    loss_parallel = getattr(args, "loss_parallel", False)
    if cp > 1 and (layout.pp > 1 or sequence_parallel or loss_parallel):
        flag = "--pp_size" if layout.pp > 1 else "--sequence_parallel" if sequence_parallel else "--loss_parallel"
        why = "is not supported yet (the ring cuts the sequence)"
        raise UsageError(f"{flag} beside --cp_size {why}: drop one of them")
    if cp == 1:
        return None
    shapes = attention_shapes(task, model, next(model.parameters()).device)
    if shapes["dropout"]:  # the ring and Ulysses take dropout_p and cannot apply it
        raise UsageError(
            f"--cp_size: the model drops attention weights in training (p {shapes['dropout']:g}), which "
            "CP's attention does not: set the model's attention dropout to 0 (attention_dropout or "
            "attn_pdrop in a 🤗 config), or train without --cp_size"
        )
    return shapes


def check_ulysses_heads(layout, shapes: dict) -> None:
    """Ulysses cuts the heads over the CP ranks: the query heads and the K/V heads (as the attention
    receives them, attention_shapes) must divide by cp, one line otherwise."""
    q_heads, kv_heads = shapes["q_heads"], shapes["kv_heads"]
    if q_heads % layout.cp or kv_heads % layout.cp:
        kv = f" and {kv_heads} K/V heads" if kv_heads != q_heads else ""
        raise UsageError(
            f"--cp_size {layout.cp} --cp_impl ulysses cuts the attention heads over {layout.cp} ranks, but "
            f"the model has {q_heads} query heads{kv}: use a --cp_size that divides the heads, or --cp_impl ring"
        )


def check_cp_model(layout, model, task, args, device) -> dict | None:
    """train_cp.py's checks of the model, in order: check_cp, then what the attention receives
    (attention_shapes: heads, widths, layers, windows; None without CP), then under --cp_impl
    ulysses the heads against cp. Returns the shapes (the bytes, the chunks, the start line)."""
    kv_shape = check_cp(layout, model, task, args)
    if layout.cp > 1 and args.cp_impl == "ulysses":
        check_ulysses_heads(layout, kv_shape)
    return kv_shape


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
