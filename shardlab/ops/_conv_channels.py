"""A convolution of an unbatched input ``(C_in, *spatial)`` cut along its channels.

A convolution (``groups=1``) sums over the input channels: rank r, holding channels
``[a, b)``, convolves them with the weight's slice for those channels (``weight[:, a:b]``;
transposed: ``weight[a:b]``) and holds one term of the sum. The result is a
``Partial()`` (sum) over the mesh dims that cut the channels, of the global output's
shape (``(C_out, *spatial_out)``); it is summed by one all-reduce when it is read, or
taken on as it is by the ops that take Partial values. The bias is added on the first
rank along each such mesh dim (zeros elsewhere: the sum holds it once).

Messages: none forward. Backward: the output's gradient is whole on every rank (the
gradient of a sum); the input's is local (this rank's channels); the weight and bias
gradients (each rank's holds its own channels' slice, zeros elsewhere) are summed over
the cut mesh dims by one fused all-reduce (``<name>.params``), as the halo
convolution's.

A channel cut together with a spatial cut, or ``groups > 1``: NotImplementedError
(the call goes on to torch's own, a whole-tensor gather that says so).
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from shardlab.ops._cnn_common import cut_once, meta_call, meta_like, my_offset, summed_grads


def channel_cut(name, torch_op, transposed, input, weight, bias, args, kwargs, groups):
    """The ShardTensor ``torch_op(input, weight, bias, *args, **kwargs)``, a Partial sum
    over the mesh dims cutting ``input``'s dim 0 (its channels)."""
    from shardlab.tensor import ShardTensor

    input = cut_once(name, input)
    placements = input.placements
    if any(isinstance(p, Partial) or (isinstance(p, Shard) and p.dim != 0) for p in placements):
        raise NotImplementedError(f"{name}: channels cut with a spatial dim, or Partial")
    if groups != 1:
        raise NotImplementedError(f"{name}: an input cut along its channels with groups > 1")
    try:  # torch's checks, global shapes, before anything else
        meta = meta_call(torch_op, input, meta_like(weight), meta_like(bias), *args, **kwargs)
    except RuntimeError as e:
        raise RuntimeError(
            f"{name}: input of global shape {list(input.shape)}, weight {list(weight.shape)}: {e}"
        ) from None
    shape, mesh, x = meta.shape, input.device_mesh, input.to_local()
    cut = [m for m, p in enumerate(placements) if isinstance(p, Shard)]
    w, b = summed_grads([weight, bias], input, f"{name}.params")
    start, count = my_offset(input, 0), x.shape[0]
    w = w.narrow(0 if transposed else 1, start, count)  # this rank's channels' slice
    coord = mesh.get_coordinate()
    if b is not None and any(coord[m] != 0 for m in cut):
        b = b * 0  # the sum holds the bias once (tied: the same backward everywhere)
    if count == 0:  # no channel here: a zero term of the sum, tied to x, w, b
        tie = x.sum() * 0 + w.sum() * 0
        y = x.new_zeros(shape) + tie
        if b is not None:
            y = y + b.view(-1, *[1] * (len(shape) - 1))
    else:
        y = torch_op(x, w, b, *args, **kwargs)
    out = [Partial() if isinstance(p, Shard) else Replicate() for p in placements]
    sizes = [None] * len(out)  # (no shard sizes: nothing to ask the other ranks)
    return ShardTensor.from_local(y, mesh, out, sizes, shape=tuple(shape), validate=False)
