"""Attention kernels for context parallelism (train_cp.py): one block of the ring, forward and
backward, returning the log-sum-exp the ring merges by; and causal attention over whole sequences
(Ulysses, after its all-to-all).

The kernel PyTorch's own ring attention calls, chosen by device: on CPUs the flash kernel for CPUs
(a cropped window block's mask given as an additive float mask); on CUDA flash (fp16/bf16) or
memory-efficient (fp32). Plain matmuls (a materialised score matrix) remain where no kernel takes
the scores: soft-capped ones (Gemma 2), and a cropped window block on CUDA.
"""

import torch
import torch.nn.functional as F


def _cuda_flash(q) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16)


def _plain(q, keep, softcap) -> bool:
    return softcap is not None or (q.is_cuda and keep is not None)


def _scores(q, k, scale: float, causal: bool, keep, softcap):
    """The block's scores in fp32 as the model computes them (soft-capped, masked), and the uncapped
    tanh."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if keep is not None:
        scores = scores.masked_fill(~keep.to(q.device), float("-inf"))
    return scores, capped


def _additive_mask(keep, dtype):
    """The CPU flash kernel takes a mask as a float to add: 0 kept, -inf dropped."""
    return None if keep is None else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))


def block_attention(q, k, v, causal: bool, scale: float, keep=None, softcap=None):
    """Attention of the query rows `q` over one K/V block: its output and the log-sum-exp of every
    row, (batch, heads, rows) fp32 contiguous. `causal`: a diagonal block (a chunk over its own
    keys); `keep`: the bool mask of a cropped window block ((rows, cols), or (batch, 1, rows, cols)
    with documents); `softcap`: scores soft-capped as softcap * tanh(s / softcap)."""
    aten = torch.ops.aten
    if _plain(q, keep, softcap):
        scores, _ = _scores(q, k, scale, causal, keep, softcap)
        lse = scores.logsumexp(-1)  # -inf on a row that sees no key here (another document): weights 0
        out = torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ v.float()
        return out.to(q.dtype), lse.contiguous()
    if not q.is_cuda:
        flash_for_cpu = aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash_for_cpu(q, k, v, 0.0, causal, attn_mask=_additive_mask(keep, q.dtype), scale=scale)
        if keep is not None and keep.dim() == 4:  # a row of another document than every key: lse 0 here
            lse = lse.masked_fill(~keep.any(-1), float("-inf"))
    elif _cuda_flash(q):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    else:
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., : q.shape[2]]  # its rows come padded to a multiple of 32
    return out, lse.float().contiguous()  # the CPU kernel's is laid out (batch, rows, heads)


def block_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep=None, softcap=None):
    """dq, dk, dv of one block, given the MERGED output and log-sum-exp of its rows (over every
    block they attend to, and the sink): the kernel's exp(S - lse) is then this block's share of the
    whole row's softmax, and its rowsum(dO * O) the whole row's, so the block's gradients are exact
    parts of the whole."""
    aten = torch.ops.aten
    if _plain(q, keep, softcap):  # flash attention's backward, written out
        scores, capped = _scores(q, k, scale, causal, keep, softcap)
        p = torch.exp(scores - lse[..., None])
        dv = p.transpose(-1, -2) @ dout.float()
        ds = p * (dout.float() @ v.float().transpose(-1, -2) - (dout.float() * out.float()).sum(-1, keepdim=True))
        if capped is not None:
            ds = ds * (1 - capped**2)  # through softcap * tanh(s / softcap)
        return (
            (ds @ k.float() * scale).to(q.dtype),
            (ds.transpose(-1, -2) @ q.float() * scale).to(k.dtype),
            dv.to(v.dtype),
        )
    if not q.is_cuda:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_additive_mask(keep, q.dtype), scale=scale
        )
    no_rng = torch.empty((), dtype=torch.long)  # dropout's seed and offset: what the kernels return without it
    if _cuda_flash(q):
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng, scale=scale
        )
    lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the efficient kernel's layout: rows padded to a multiple of 32
    grads = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale
    )
    return grads[:3]


def whole_sequence_attention(q, k, v, window=None, sinks=None, softcap=None, documents=None):
    """Causal attention over whole sequences, within `window` tokens and each token's document
    (`documents`, (batch, tokens) ids): fused SDPA (the mask as a bool mask); with sinks or
    soft-capping, the scores written out (the sink one more column, dropped after the softmax)."""
    T, gqa = q.shape[2], k.shape[1] != q.shape[1]
    offset = torch.arange(T, device=q.device)[:, None] - torch.arange(T, device=q.device)
    keep = (offset >= 0) & (offset < (window or T))
    if documents is not None:
        keep = keep & (documents[:, None, :, None] == documents[:, None, None, :])  # (batch, 1, T, T)
    if sinks is None and softcap is None:
        if documents is None and (window is None or window >= T):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=gqa)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], -1)
    return torch.softmax(scores, dim=-1)[..., :T].to(v.dtype) @ v
