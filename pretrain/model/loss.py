"""The training loss: LM head and cross entropy in chunks of tokens, never the whole logits.

For N tokens and a vocabulary of V, the logits are N x V floats: 6.6 GB in bf16 at 64K
tokens and V = 50304, plus an fp32 copy for the softmax. Here the head matmul and the
cross entropy run over `chunk_tokens` rows at a time. Each chunk's softmax gives, while its
logits are at hand, the gradients of the mean loss with respect to the chunk's hidden rows
(dL/dh = G W) and to the head weight (dL/dW += G^T h), with G = (softmax - onehot) / N; the
backward only scales the two by the incoming gradient. So the forward keeps dh (N x H, h's
dtype) and dW (V / TP x H, fp32) instead of any logits (the approach of Liger-Kernel's fused
linear cross entropy, written here in plain torch).

Tensor parallelism: W holds rows [rank * V / TP, (rank + 1) * V / TP) of the padded
vocabulary. A chunk's max and sum of exponentials, and its target logit, are all-reduced
over the TP group (as megatron-core's vocab-parallel cross entropy does); the padded rows
(ids >= vocab_size) are masked out. h reaches the head through megatron-core's
`copy_to_tensor_model_parallel_region` (identity forward, dh summed over TP in backward), or
under sequence parallelism `gather_from_sequence_parallel_region` (the sequence gathered,
dh reduce-scattered back), so the partial dh computed here from this rank's vocabulary
shard is reduced by megatron's own autograd functions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of (h W^T) against targets; gradients computed in the forward.

    Written for few dispatched ops (one chunk at small shapes is one matmul and a handful of
    elementwise ops, as F.cross_entropy): no dtype conversion where the dtypes agree, the
    target masks only under tensor parallelism."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size, tp_group, chunk_tokens, compute_dtype,
                with_grads):
        n_tokens = h.shape[0]
        tp = 1 if tp_group is None else tp_group.size()
        shard = weight.shape[0]
        start = (0 if tp_group is None else tp_group.rank()) * shard
        real = max(0, min(shard, vocab_size - start))  # rows of this shard that are no padding
        w = _as(weight, compute_dtype)
        losses, dh_chunks, dw = [], [], None
        for lo in range(0, n_tokens, chunk_tokens):
            one = chunk_tokens >= n_tokens
            h_chunk = _as(h if one else h[lo:lo + chunk_tokens], compute_dtype)
            y = (targets if one else targets[lo:lo + chunk_tokens]).unsqueeze(-1)
            logits = _as(torch.mm(h_chunk, w.t()), torch.float32)
            if real < shard:  # padded vocabulary rows are never predicted
                logits[:, real:].fill_(float("-inf"))
            top = logits.amax(dim=-1, keepdim=True)
            if tp > 1:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
                y = y - start
                mine = (y >= 0) & (y < shard)  # the target is in this shard
                y = y.clamp(0, shard - 1)
            logits.sub_(top)
            target_logit = logits.gather(-1, y)
            if tp > 1:
                target_logit = target_logit * mine
            probs = logits.exp_()  # in place: the shifted logits are not needed again
            sum_exp = probs.sum(dim=-1, keepdim=True)
            if tp > 1:
                both = torch.cat([sum_exp, target_logit], dim=-1)
                dist.all_reduce(both, group=tp_group)
                sum_exp, target_logit = both[:, :1], both[:, 1:]
            losses.append((sum_exp.log() - target_logit).sum())
            if not with_grads:
                continue
            # G = (softmax - onehot) / N, in place of the probabilities
            grad = probs.div_(sum_exp)
            if tp > 1:
                grad.scatter_add_(-1, y, -mine.to(grad.dtype))
            else:
                grad.scatter_(-1, y, -1.0, reduce="add")
            grad = _as(grad.div_(n_tokens), compute_dtype)
            dh_chunks.append(torch.mm(grad, w))
            dw_chunk = torch.mm(grad.t(), h_chunk)
            # summed over chunks in fp32, whatever the compute dtype
            dw = _as(dw_chunk, torch.float32) if dw is None else dw.add_(dw_chunk)
        total = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        if with_grads:
            dh = dh_chunks[0] if len(dh_chunks) == 1 else torch.cat(dh_chunks)
            ctx.save_for_backward(_as(dh, h.dtype), _as(dw, weight.dtype))
        return total / n_tokens

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        return dh * grad_loss, dw * grad_loss, *([None] * 6)


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`, without dispatching anything when it already is."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         vocab_size: int, tp_group=None, sequence_parallel: bool = False,
                         chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean next-token cross entropy of the logits h W^T (fp32 softmax) against `targets`.

    h: the final norm's output, (B, S, H), or this rank's (S / TP, B, H) under sequence
    parallelism; weight: this TP rank's (V / TP, H) rows of the padded vocabulary; targets:
    (B, S) token ids < vocab_size. Under autocast the matmuls run in its dtype, as F.linear's
    would. The logits exist `chunk_tokens` rows at a time."""
    tp = 1 if tp_group is None else tp_group.size()
    if tp > 1 and sequence_parallel:
        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True,
                                                 group=tp_group)
        targets = targets.t()  # the gathered h is (S, B, H)
    elif tp > 1:
        h = copy_to_tensor_model_parallel_region(h, group=tp_group)
    device = h.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
        else h.dtype
    with_grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    with torch.autocast(device, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            h.flatten(0, -2), weight, targets.reshape(-1), vocab_size,
            tp_group if tp > 1 else None, chunk_tokens, compute_dtype, with_grads)
