"""Context parallelism's refusals (train_cp.py, train_hybrid.py --cp_size), one line each, before
anything is cut: the CP size against the processes, the model's Task against CP's contract, the
sequence against the chunks, and Ulysses' heads against cp. And train_cp.py's flags' help."""

from .cp_costs import attention_shapes
from .errors import UsageError

CP_SIZE_HELP = "ranks that cut each sequence: all processes (-1); the other factor is data parallel"
CP_IMPL_HELP = (
    "ring: K/V travel around the ranks, any head count (sequence divisible by 2 x cp); ulysses: "
    "all-to-alls to head shards and back, fewer bytes, the heads and K/V heads divisible by cp"
)


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
    receives them, cp_costs.attention_shapes) must divide by cp, one line otherwise."""
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
