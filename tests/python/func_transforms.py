"""One check of torch.func's transforms and forward-mode AD for a posenc function against
the same transforms of a plain-PyTorch reference (float64): every differentiable op's tests
call ``check_transforms``.

``f`` and ``ref`` take the same positional float64 tensors (the differentiable inputs) and
return one tensor; the check compares, with rounding tolerances:
grad, vjp, jvp, jacrev, jacfwd, hessian (of a scalar reduction, against every input),
vmap of grad (per-sample gradients over a leading batch dimension of the first input) and
vmap of jvp, and torch.autograd.forward_ad (make_dual / unpack_dual)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.autograd import forward_ad
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap

TOL = dict(rtol=1e-9, atol=1e-9)


def _close(a, b, what):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{what}[{i}]")
        return
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _weights(out: torch.Tensor, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, dtype=out.dtype, generator=g)


def check_transforms(
    f: Callable[..., torch.Tensor],
    ref: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    hessian_check: bool = True,
    batched: bool = True,
    batch_inputs: Sequence[torch.Tensor] | None = None,
    randomness: str = "error",
) -> None:
    """``inputs``: float64 tensors (no grad). ``batch_inputs``: the same with a leading batch
    dimension on the first one, for vmap (default: inputs[0] stacked 3 times, shifted).
    ``randomness``: jacfwd's and the hessian's (their vmap of the forward; "same" for a
    function that draws random numbers, which "error" refuses as for torch's dropout)."""
    inputs = tuple(inputs)
    n = len(inputs)
    argnums = tuple(range(n))
    w = _weights(ref(*inputs))

    def scalar(fn):
        return lambda *xs: (fn(*xs) * w).sum()

    def scalar_sq(fn):  # nonlinear in the output, so hessians see the op's second derivative
        return lambda *xs: (fn(*xs) * w).square().sum()

    _close(f(*inputs), ref(*inputs), "value")
    _close(grad(scalar(f), argnums=argnums)(*inputs), grad(scalar(ref), argnums=argnums)(*inputs), "grad")
    out, pullback = vjp(f, *inputs)
    out_r, pullback_r = vjp(ref, *inputs)
    _close(out, out_r, "vjp value")
    _close(pullback(w), pullback_r(w), "vjp")
    g = torch.Generator().manual_seed(11)
    tangents = tuple(torch.randn(x.shape, dtype=x.dtype, generator=g) for x in inputs)
    _close(jvp(f, inputs, tangents), jvp(ref, inputs, tangents), "jvp")
    _close(jacrev(f, argnums=argnums)(*inputs), jacrev(ref, argnums=argnums)(*inputs), "jacrev")
    _close(jacfwd(f, argnums=argnums, randomness=randomness)(*inputs),
           jacfwd(ref, argnums=argnums, randomness=randomness)(*inputs), "jacfwd")
    if hessian_check:  # torch.func.hessian, with the randomness given
        def hess(fn):
            return jacfwd(jacrev(fn, argnums=argnums), argnums=argnums, randomness=randomness)

        _close(hess(scalar_sq(f))(*inputs), hess(scalar_sq(ref))(*inputs), "hessian")
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip(inputs, tangents)]
        primal, tangent = forward_ad.unpack_dual(f(*duals))
        primal_r, tangent_r = forward_ad.unpack_dual(ref(*duals))
    _close((primal, tangent), (primal_r, tangent_r), "forward_ad")
    if batched:
        if batch_inputs is None:
            batch_inputs = (torch.stack([inputs[0], inputs[0] * 0.5, inputs[0] + 1]),) + inputs[1:]
        in_dims = (0,) + (None,) * (n - 1)
        per_sample = vmap(grad(scalar(f), argnums=argnums), in_dims=in_dims)(*batch_inputs)
        per_sample_r = vmap(grad(scalar(ref), argnums=argnums), in_dims=in_dims)(*batch_inputs)
        _close(per_sample, per_sample_r, "vmap(grad)")
        t0 = torch.ones_like(batch_inputs[0])

        def jvp_first(x0, *rest):
            return jvp(lambda x: f(x, *rest), (x0,), (t0[0],))[1]

        def jvp_first_r(x0, *rest):
            return jvp(lambda x: ref(x, *rest), (x0,), (t0[0],))[1]

        _close(vmap(jvp_first, in_dims=in_dims)(*batch_inputs), vmap(jvp_first_r, in_dims=in_dims)(*batch_inputs),
               "vmap(jvp)")


def gradcheck_all(f: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], *, batched: bool = True) -> None:
    """gradcheck with forward AD and batched gradients, and gradgradcheck."""
    xs = tuple(x.detach().clone().requires_grad_(True) for x in inputs)
    assert torch.autograd.gradcheck(f, xs, check_forward_ad=True, check_backward_ad=True,
                                    check_batched_grad=batched, check_batched_forward_grad=batched,
                                    check_undefined_grad=True)
    assert torch.autograd.gradgradcheck(f, xs, check_fwd_over_rev=True, check_rev_over_rev=True,
                                        check_batched_grad=batched)
