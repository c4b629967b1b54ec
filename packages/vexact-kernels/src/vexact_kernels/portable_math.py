"""Elementary functions of the CPU reference whose bits depend on their inputs alone (design.md rule 9).

torch sends float32 (and float64) ``exp``, ``log``, ``sqrt``, ``sin``, ``cos``, ``pow`` on CPU to a vector math
library (MKL's VML, or SLEEF) that is accurate to about 1 ulp but not correctly rounded, and that takes another code
branch on another CPU vendor or instruction set: the same input gives other bits on an AMD machine than on an Intel
one (torch 2.13 on an AMD EPYC: ``torch.sqrt`` float32 1 ulp off the correctly rounded result on 15.5% of random
inputs, ``log`` 6.7%, ``exp`` 1%). The CPU reference therefore computes these functions here, from operations that
IEEE 754 rounds correctly on every machine and in every vector width: elementwise add, subtract, multiply, divide,
comparisons, rounding to an integer, integer and bit operations, and the conversion of float64 to float32.

How each function is built (``x`` float32, everything below in float64 and rounded to float32 once at the end):

* ``sqrt``: float64 ``sqrt`` rounded to float32. The float64 result may differ between machines in its last bit,
  but not its float32 rounding: the exact square root of a float32 is never within ``2**-49`` (relative) of a
  float32 rounding boundary, and a float64 ``sqrt`` accurate to 1 ulp (``2**-52``) is always on the right side, so
  the result is the correctly rounded float32 square root on every machine.
* ``exp``: ``k = round(x / ln 2)``, ``r = x - k ln2_hi - k ln2_lo`` (Cody-Waite: ``ln2_hi`` has 32 significant
  bits, so ``k ln2_hi`` is exact for ``|k| < 2**21``), ``exp(r)`` by its Taylor polynomial to degree 10 on
  ``|r| <= 0.35`` (Horner), times ``2**k`` built from the exponent bits (an exact scaling in float64).
* ``log``: ``x = m 2**e`` from the bits with ``m`` in ``[sqrt(1/2), sqrt(2))``, ``log m = 2 atanh(s)`` with
  ``s = (m - 1) / (m + 1)`` (``|s| < 0.172``) by its series to ``s**17``, plus ``e ln2_hi + e ln2_lo``.
* ``sincos``: ``k = round(x / (pi/2))``, ``r = x - k p1 - k p2 - k p3`` with pi/2 cut in three pieces of 33 bits
  (``k p1`` exact for ``|k| < 2**20``), the Taylor polynomials of sin (to ``r**19``) and cos (to ``r**20``) on
  ``|r| <= pi/4``, and the quadrant ``k mod 4`` picking and signing them.
* ``pow_of``: ``exp(y log(base))`` with the float64 ``exp`` and ``log`` above.

The float64 results are accurate to about 3e-13 (exp, its Taylor remainder) and 1e-15 (log, sin, cos) relative,
far below float32's 6e-8, so the float32 results equal the correctly rounded ones nearly always (every one of the
canary's hard inputs); what matters for the reference is that they are the same on every machine, which the construction
guarantees (``tests/test_portable_math.py`` holds them to stored bits on hard inputs). The ln 2 and pi/2 pieces are
fdlibm's.

Each function takes a tensor on any device; on a CPU tensor it runs the construction above, on another device it
calls torch's own op (the GPU targets keep their kernels' bits; a GPU's elementwise functions do not depend on the
host CPU). ``exp``, ``log`` and ``sqrt`` are differentiable (backward ``g * y``, ``g / x``, ``g / (2 y)``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ._reduce import tree_sum

# fdlibm's ln 2 in two pieces: LN2_HI has 32 significant bits (k * LN2_HI exact for |k| < 2**21), LN2_HI + LN2_LO is
# ln 2 to about 2**-85.
LN2_HI = float.fromhex("0x1.62e42feep-1")
LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
INV_LN2 = float.fromhex("0x1.71547652b82fep+0")  # 1 / ln 2, correctly rounded
# fdlibm's pi/2 in three pieces of 33 bits each (k * PIO2_1 exact for |k| < 2**20)
PIO2_1 = float.fromhex("0x1.921fb544p+0")
PIO2_2 = float.fromhex("0x1.0b4611a6p-34")
PIO2_3 = float.fromhex("0x1.3198a2ep-69")
INV_PIO2 = float.fromhex("0x1.45f306dc9c883p-1")  # 2 / pi, correctly rounded
SQRT2 = float.fromhex("0x1.6a09e667f3bcdp+0")
# The reduction k * PIO2_1 is exact while |k| < 2**20: |x| below this (about 1.6e6).
SINCOS_MAX = float(2**20) * PIO2_1

_EXP_COEFFS = [1.0 / math.factorial(n) for n in range(11)]  # exp(r) = sum r^n / n!, n = 0..10
_SIN_COEFFS = [(-1.0) ** j / math.factorial(2 * j + 1) for j in range(10)]  # sin r = r * sum c_j z^j, z = r^2
_COS_COEFFS = [(-1.0) ** j / math.factorial(2 * j) for j in range(11)]  # cos r = sum c_j z^j
_ATANH_COEFFS = [1.0 / (2 * j + 1) for j in range(9)]  # atanh(s) = s * sum z^j / (2j + 1), z = s^2

_F32 = torch.float32
_F64 = torch.float64
_MANTISSA = (1 << 52) - 1
_ONE_BITS = 1023 << 52


def _horner(z: torch.Tensor, coeffs: list[float]) -> torch.Tensor:
    """``sum coeffs[j] z^j`` by Horner's rule (multiplies and adds, each rounded once: no fused multiply-add)."""
    p = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p.mul_(z).add_(c)
    return p


def _exp64(x: torch.Tensor) -> torch.Tensor:
    """float64 ``exp`` of a float64 tensor whose values are inside float32's range of interest (clamped to +-200:
    enough for any float32 result, 0 and inf included)."""
    x = x.clamp(-200.0, 200.0)  # NaN stays NaN
    k = torch.round(x * INV_LN2)
    r = (x - k * LN2_HI) - k * LN2_LO
    scale = ((torch.nan_to_num(k).to(torch.int64) + 1023) << 52).view(_F64)  # 2**k, |k| <= 289
    return _horner(r, _EXP_COEFFS).mul_(scale)


def _log64(x: torch.Tensor) -> torch.Tensor:
    """float64 ``log`` of a float64 tensor of positive normal values (callers handle 0, negatives, inf, NaN)."""
    bits = x.view(torch.int64)
    e = (bits >> 52) - 1023
    m = ((bits & _MANTISSA) | _ONE_BITS).view(_F64)  # [1, 2)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)  # [sqrt(1/2), sqrt(2))
    e = (e + big.to(torch.int64)).to(_F64)
    s = (m - 1.0) / (m + 1.0)
    log_m = _horner(s * s, _ATANH_COEFFS).mul_(s).mul_(2.0)
    return e * LN2_HI + (e * LN2_LO + log_m)


def _on_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


def _check_float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in (_F32, _F64):
        raise TypeError(f"portable_math.{name}: expects a float32 or float64 tensor, got {x.dtype}")


def _exp_impl(x: torch.Tensor) -> torch.Tensor:
    return _exp64(x.to(_F64)).to(x.dtype)


def _log_impl(x: torch.Tensor) -> torch.Tensor:
    x64 = x.to(_F64)
    ok = x64 > 0
    out = _log64(torch.where(ok, x64, 1.0))
    out = torch.where(x64 == math.inf, math.inf, out)
    out = torch.where(x64 == 0, -math.inf, out)
    out = torch.where(ok | (x64 == 0), out, math.nan)  # negatives and NaN
    return out.to(x.dtype)


def _sqrt_impl(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == _F64:
        raise TypeError("portable_math.sqrt: float64 sqrt has no portable construction here; pass float32")
    return torch.sqrt(x.to(_F64)).to(_F32)


def _function(name: str, impl, grad, save_output: bool) -> type[torch.autograd.Function]:
    """The autograd Function ``name`` of ``y = impl(x)``, backward ``grad(g, saved)`` with ``saved`` the output ``y``
    (``save_output``) or the input ``x``."""

    def forward(ctx, x):
        y = impl(x)
        ctx.save_for_backward(y if save_output else x)
        return y

    def backward(ctx, g):
        (saved,) = ctx.saved_tensors
        return grad(g, saved)

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


_Exp = _function("_Exp", _exp_impl, lambda g, y: g * y, save_output=True)
_Log = _function("_Log", _log_impl, lambda g, x: g / x, save_output=False)
_Sqrt = _function("_Sqrt", _sqrt_impl, lambda g, y: g / (2.0 * y), save_output=True)


def _apply(fn, impl, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return fn.apply(x)
    return impl(x)


def exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)``, float32 or float64 in and out (float64: accurate to about 3e-13 relative)."""
    if not _on_cpu(x):
        return torch.exp(x)
    _check_float("exp", x)
    return _apply(_Exp, _exp_impl, x)


def log(x: torch.Tensor) -> torch.Tensor:
    """``log(x)`` (``-inf`` at 0, NaN below), float32 or float64 in and out."""
    if not _on_cpu(x):
        return torch.log(x)
    _check_float("log", x)
    return _apply(_Log, _log_impl, x)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` of a float32 tensor, correctly rounded on every machine (see the module's docstring)."""
    if not _on_cpu(x):
        return torch.sqrt(x)
    if x.dtype != _F32:
        raise TypeError(f"portable_math.sqrt: expects a float32 tensor, got {x.dtype}")
    return _apply(_Sqrt, _sqrt_impl, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` with :func:`exp` and an IEEE division (no autograd Function of its own: the callers
    that train through it define their backward from the output)."""
    return 1.0 / (1.0 + exp(-x))


def softmax(x: torch.Tensor) -> torch.Tensor:
    """``softmax`` over the last dim of a float32 tensor: :func:`exp` of ``x - max`` (the max is exact in any order)
    over a fixed-order sum of each row (``_reduce.tree_sum``); off the CPU, torch's own ``softmax``."""
    if not _on_cpu(x):
        return torch.softmax(x, dim=-1)
    e = exp(x - x.amax(dim=-1, keepdim=True))
    return e / tree_sum(e, dim=-1).unsqueeze(-1)


def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sin(x), cos(x))`` of a float32 tensor (a rotary table's angles), float32, with one shared reduction.
    ``|x|`` must stay below :data:`SINCOS_MAX` (about 1.6e6 radians), where the reduction is exact."""
    if not _on_cpu(x):
        return torch.sin(x), torch.cos(x)
    if x.dtype != _F32:
        raise TypeError(f"portable_math.sincos: expects a float32 tensor, got {x.dtype}")
    if x.numel() and float(x.abs().max()) >= SINCOS_MAX:
        raise ValueError(f"portable_math.sincos: |x| up to {float(x.abs().max())} >= {SINCOS_MAX:.6g} is out of range")
    x64 = x.to(_F64)
    k = torch.round(x64 * INV_PIO2)
    r = ((x64 - k * PIO2_1) - k * PIO2_2) - k * PIO2_3  # |r| <= pi/4 (plus rounding)
    z = r * r
    s = _horner(z, _SIN_COEFFS).mul_(r)
    c = _horner(z, _COS_COEFFS)
    q = k.to(torch.int64) & 3  # quadrant: x = r + q pi/2 (mod 2 pi)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin.to(_F32), cos.to(_F32)


def pow_of(base: float, y: torch.Tensor) -> torch.Tensor:
    """``base ** y`` for a positive float ``base`` and a float32 tensor ``y`` (a rotary frequency's
    ``theta ** (i / d)``): ``exp(y log base)`` in float64, rounded to float32 once."""
    if not (isinstance(base, int | float) and base > 0 and math.isfinite(base)):
        raise ValueError(f"portable_math.pow_of: base must be a positive finite number, got {base!r}")
    if y.dtype != _F32:
        raise TypeError(f"portable_math.pow_of: expects a float32 exponent tensor, got {y.dtype}")
    if y.is_meta:  # a model built on the meta device: shapes only
        return torch.empty_like(y)
    y64 = y.to(device="cpu", dtype=_F64)
    return _exp64(y64 * log_scalar(float(base))).to(_F32).to(y.device)


def log_scalar(v: float) -> float:
    """``log(v)`` of a positive Python float in float64 by :func:`log`'s construction (not the C library's, whose
    code path depends on the CPU's instruction set)."""
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"portable_math.log_scalar: expects a positive finite number, got {v!r}")
    return float(_log64(torch.tensor([v], dtype=_F64, device="cpu"))[0])


CANARY = Path(__file__).parent / "assets" / "portable_math_canary.safetensors"


def _first_difference(name: str, x: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> str | None:
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    if bool(same.all()):
        return None
    i = int((~same).nonzero()[0])
    n = int((~same).sum())
    xv = float(x[i])
    return (
        f"{name} differs on this CPU at x={xv!r} ({xv.hex()}): got {float(got[i])!r}, expected {float(want[i])!r} "
        f"({n} of {x.numel()} canary inputs differ)"
    )


def canary_mismatches() -> list[str]:
    """Recompute each primitive on the stored hard inputs (``assets/portable_math_canary.safetensors``, written by
    ``scripts/fixtures/make_portable_math_canary.py``) and return one line per primitive whose bits differ from the
    stored ones, naming the first input that differs: empty on a machine where the CPU reference gives its bits."""
    from safetensors.torch import load_file

    stored = load_file(str(CANARY))
    fns = {
        "exp": exp,
        "log": log,
        "sqrt": sqrt,
        "sin": lambda t: sincos(t)[0],
        "cos": lambda t: sincos(t)[1],
    }
    out = []
    for name, fn in fns.items():
        x = stored[f"{name}.x"]
        msg = _first_difference(name, x, fn(x), stored[f"{name}.y"])
        if msg:
            out.append(msg)
    for key in sorted(k for k in stored if k.startswith("pow_of.") and k.endswith(".y")):
        base = key[len("pow_of.") : -len(".y")]
        y = stored[key]
        msg = _first_difference(f"pow_of({base}, y)", y, pow_of(float(base), y), stored[f"pow_of.{base}.out"])
        if msg:
            out.append(msg)
    return out
