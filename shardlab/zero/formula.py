"""What each ZeRO stage keeps per rank, by formula: :func:`predict`.

The ZeRO paper (Rajbhandari et al. 2020, table 1) counts a rank's *model states* for
Ψ parameters on N ranks, with p bytes per parameter, g per gradient and K bytes of
optimizer state per parameter:

=====  ==========  ==========  ==========  ==================  ===========================
stage  parameters  gradients   optimizer   per rank            what is cut over N ranks
=====  ==========  ==========  ==========  ==================  ===========================
  0    p Ψ         g Ψ         K Ψ         (p + g + K) Ψ       nothing (DDP)
  1    p Ψ         g Ψ         K Ψ / N     (p + g) Ψ + K Ψ/N   the optimizer state
  2    p Ψ         g Ψ / N     K Ψ / N     p Ψ + (g + K) Ψ/N   + the gradients
  3    p Ψ / N     g Ψ / N     K Ψ / N     (p + g + K) Ψ / N   + the parameters
=====  ==========  ==========  ==========  ==================  ===========================

Two conventions for Adam: the paper's mixed precision, p = g = 2 (fp16) and K = 12 (an
fp32 master copy of the parameters, and Adam's two moments, 4 + 4 + 4 bytes): 16 Ψ bytes
at stage 0; and plain float32 (what :func:`shardlab.zero.measure` runs), p = g = 4 and
K = 8 (the two moments): 16 Ψ bytes too, split differently.

Torch's stage 2 (FSDP2 without resharding after forward, what ``measure`` builds) keeps
1/N of the parameters *between* steps and all of them from the forward's all-gather to
the end of backward: :class:`Prediction` gives both what stays between steps
(``params``, ``grads``, ``optim``) and the paper's columns (``paper``).

The peak of a step adds what the table leaves out (:attr:`Prediction.peak`, bytes). It
comes at the start of backward, when every activation is still alive:

* ``activations``: what one forward and backward of the rank's batch keeps alive at its
  worst (not a model state; the same at every stage for the same local batch);
* stages 0 and 1: nothing else (DDP's gradient buckets are in the table already);
* stages 2 and 3, whose gradients ``zero_grad`` set to None: the parameters gathered whole
  (stage 2: all of them; stage 3: the root's own, the last block and the one gathered
  ahead of it), and the first gradients, whole until they are reduce-scattered (the
  root's, whose output layer comes first in backward, and the last block's).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ADAM_FP32", "ADAM_MIXED", "Prediction", "predict"]


class _Bytes(dict):
    """Bytes per parameter of a training setup, as :func:`predict` takes them
    (``predict(params, ranks, stage, **ADAM_FP32)``): ``ADAM_FP32`` is Adam in float32
    (4 per parameter, 4 per gradient, 8 of optimizer state: 16 per parameter at stage 0);
    ``ADAM_MIXED`` the ZeRO paper's mixed precision (2, 2 and 12: a float32 master copy,
    momentum and variance; 16 too)."""


ADAM_FP32 = _Bytes(param_bytes=4, grad_bytes=4, optim_bytes=8)
ADAM_MIXED = _Bytes(param_bytes=2, grad_bytes=2, optim_bytes=12)


@dataclass(frozen=True)
class Prediction:
    """Bytes per rank of ZeRO ``stage`` on ``ranks`` ranks (:func:`predict`).

    ``params``, ``grads``, ``optim``: what a rank keeps between steps, as torch's build of
    the stage does (:func:`measure`); ``paper``: the same three as the ZeRO
    paper's table counts them (stage 2: parameters whole); ``peak``: the most live bytes
    during a step (model states, gathered parameters, activations); ``messages``: the
    bytes the rank hands to each kind of collective in a step (``{"all_gather": ...}``,
    as :class:`shardlab.trace.Event` counts them: its shard into an all-gather, its whole
    input into a reduce-scatter or an all-reduce).
    """

    stage: int
    ranks: int
    params: float
    grads: float
    optim: float
    peak: float
    paper: tuple[float, float, float]
    messages: dict[str, float]

    @property
    def states(self) -> float:
        """params + grads + optim between steps."""
        return self.params + self.grads + self.optim


def _check(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def predict(
    params: int,
    ranks: int,
    stage: int,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optim_bytes: int = 8,
    units: list[int] | None = None,
    activations: int = 0,
) -> Prediction:
    """Per-rank bytes of ZeRO ``stage`` (0-3) for ``params`` (Ψ) parameters on ``ranks``
    (N) ranks.

    Args:
        params: Ψ, the model's number of parameters.
        ranks: N, the data-parallel ranks.
        stage: 0 (DDP), 1 (optimizer state cut), 2 (+ gradients), 3 (+ parameters).
        param_bytes, grad_bytes: bytes per parameter and per gradient (float32: 4).
        optim_bytes: K, bytes of optimizer state per parameter (Adam in float32: 8;
            the paper's mixed precision: 12, see :data:`ADAM_MIXED`).
        units: parameters in each FSDP unit, the blocks then the root's own (what
            :class:`~shardlab.zero.Measured` reports); None: one unit of Ψ. Only the peaks
            of stages 2 and 3 read it.
        activations: bytes a forward and backward of the rank's batch adds at its worst
            (:func:`~shardlab.zero.activation_bytes`); 0: model states only.
    """
    psi, n = _check("params", params, 1), _check("ranks", ranks, 1)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    units = [psi] if units is None else [_check("units[i]", u, 0) for u in units]
    if sum(units) != psi:
        raise ValueError(f"units must add up to params={psi}, got {sum(units)}")
    p = _check("param_bytes", param_bytes, 0)  # bytes per parameter,
    g = _check("grad_bytes", grad_bytes, 0)  # per gradient,
    k = _check("optim_bytes", optim_bytes, 0)  # of optimizer state per parameter (K)
    # 1. the paper's table: each stage cuts one more state over the N ranks
    paper = (
        p * psi / n if stage >= 3 else p * psi,
        g * psi / n if stage >= 2 else g * psi,
        k * psi / n if stage >= 1 else k * psi,
    )
    # 2. between steps torch's stage 2 keeps its parameters cut, as stage 3 does
    kept = (p * psi / n if stage >= 2 else paper[0], paper[1], paper[2])
    # 3. the peak of a step, at the start of backward: every activation still alive
    blocks, root = units[:-1], units[-1]
    biggest = max(blocks, default=0)
    if stage <= 1:  # nothing gathered; DDP's gradient buckets live all the time
        peak = sum(kept) + activations
    else:  # the gradients were set to None (zero_grad), none of them is back yet
        # whole: every unit (stage 2), or the root, the last block and the one gathered
        # ahead of it (stage 3); and the first gradients, whole until reduce-scattered:
        # the root's (the output layer's come first) and the last block's
        whole = psi if stage == 2 else root + sum(sorted(blocks, reverse=True)[:2])
        peak = kept[0] + kept[2] + p * whole + g * (root + biggest) + activations
    # 4. the messages of a step: bytes this rank hands to each kind of collective
    messages = {"all_reduce": float(g * psi)} if stage <= 1 else {}
    if stage == 1:  # ZeroRedundancyOptimizer: each owner broadcasts its updated parameters
        messages["broadcast"] = float(p * psi)
    if stage >= 2:  # its shard into every all-gather, its whole gradients to reduce-scatter
        messages["all_gather"] = p * psi / n * (2 if stage == 3 else 1)
        messages["reduce_scatter"] = float(g * psi)
    return Prediction(stage, n, *kept, peak=peak, paper=paper, messages=messages)
