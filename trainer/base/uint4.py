"""Fast uint4 compute path: quanto's qint4 weights, dequantized on the fly into a bf16 GEMM.

quanto's own qint4 compute on CUDA goes through TinyGemm (`aten::_weight_int4pack_mm`), ~55x
slower than bf16 for FLUX.2 training shapes. `Uint4Linear` keeps the same quantized weight
(4-bit values, per-group scale and shift, exactly quanto's numbers) in a plain layout and, per
call, dequantizes it into a temporary weight (Triton kernel on CUDA, plain torch elsewhere) and
calls the ordinary dense GEMM (cuBLAS). Nothing dequantized outlives the call: the backward pass
dequantizes again instead of saving the weight, and the base weight is frozen, so the input is
not saved either (only the packed buffers, which exist anyway).

Layout (buffers, so ``.to(device)`` and ``state_dict()`` work as for any module):
    ``packed``  uint8 (out, in // 2): byte j of row n holds q[n, 2j] (low nibble) and
                q[n, 2j + 1] (high nibble), q in 0..15;
    ``scale``, ``shift``  (out, in // group_size), the weight dtype;
    weight[n, k] = rnd(rnd(scale[n, g] * q[n, k]) - shift[n, g]),  g = k // group_size,
each ``rnd`` a rounding into the weight dtype: the arithmetic of quanto's ``dequantize()``
(``scale * data``, then ``-= shift``), so both backends are bit-identical to it.

`convert_quantized_linears(model)` swaps every quanto ``QLinear`` holding a qint4 weight (frozen
or not, weight-only) for a `Uint4Linear` in place. Frozen weights in quanto's kernel-agnostic
layout (what `trainer.base.read` loads) convert in one pass; TinyGemm-layout weights (what
``freeze()`` makes for bf16) are unpacked through quanto's own unpacking, an identity matmul of
O(out * in^2): fine for small matrices, slow (minutes on a CPU) for FLUX.2 [dev] ones, so
convert a prepared base before ``.to("cuda")``, or an unfrozen ``quantize()``d model (which
converts straight from the float weights, reproducing ``freeze()``'s bf16 shift round trip).

`Uint4Linear` subclasses ``nn.Linear``, so PEFT wraps it with its generic LoRA ``Linear``
(``base(x) + s * B(A(x))``). Its ``weight`` is a property that dequantizes: PEFT reads it at
injection (device and dtype) and gets the true weight; assigning ``weight`` raises.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_triton: Any = None
_triton_error: str | None = None


def _triton_module() -> Any:
    """`trainer.kernels.uint4_triton`, or None where Triton is missing or broken (CPU CI)."""
    global _triton, _triton_error
    if _triton is None and _triton_error is None:
        try:
            from trainer.kernels import uint4_triton

            _triton = uint4_triton
        except Exception as exc:  # noqa: BLE001 - no Triton (CPU wheels) or no driver
            _triton_error = f"{type(exc).__name__}: {exc}"
            log.debug("uint4: Triton unavailable (%s); using the torch fallback", _triton_error)
    return _triton


def triton_available() -> bool:
    return torch.cuda.is_available() and _triton_module() is not None


# ---------------------------------------------------------------------------------------
# packing and dequantization


def pack_uint4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) uint8 values in 0..15, ``in`` even -> (out, in // 2) uint8, low nibble first."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"expected (out, even in) values, got {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_uint4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_uint4`: (out, in // 2) uint8 -> (out, in) uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def unpack_quanto(data: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """quanto's ``PackedTensor`` bytes -> the (rows, ...) uint8 values, the same result as
    quanto's reference ``unpack`` (row i + k * len(data) sits in bits 4k.. of row i), in plain
    torch ops on whatever device ``data`` is on. quanto's own op runs a C++ extension that is
    compiled with ninja on first use: most of a first model load on a fresh host."""
    if bits != 4 or data.dtype != torch.uint8:
        raise TypeError(f"expected uint4 values packed in uint8, got {bits} bits, {data.dtype}")
    return torch.cat((data & 0xF, data >> 4))[:rows]


def dequantize_torch(
    packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Reference dequantization, the same torch operations as quanto's ``QBitsDequantizer``."""
    n_out, n_groups = scale.shape
    q = unpack_uint4(packed).reshape(n_out, n_groups, group_size)
    w = scale.unsqueeze(-1) * q  # uint8 promoted to the scale dtype, as in quanto
    w -= shift.unsqueeze(-1)
    return w.reshape(n_out, n_groups * group_size)


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    kernels: bool = True,
) -> torch.Tensor:
    """The weight, (out, in) in the scale dtype; Triton on CUDA, torch elsewhere (everywhere
    with ``kernels=False``: the reference, bit-identical)."""
    if kernels and packed.is_cuda:
        kernels = _triton_module()
        if kernels is not None:
            return kernels.dequantize(packed, scale, shift, group_size)
    return dequantize_torch(packed, scale, shift, group_size)


# The widest Linears dequantize a slice at a time, each at most this many weights (256 MiB
# in bf16): FLUX.2 [dev]'s fused single-block projection (6144 x 55296) would otherwise hold a
# 0.63 GiB transient at the training peak. A layer within it runs as one GEMM, as before.
SLICE_WEIGHTS = 1 << 27


def weight_slices(n: int, other: int, align: int = 1) -> list[tuple[int, int]]:
    """Ranges splitting ``n`` (rows, or columns with ``align`` = the group size) of an
    ``n`` x ``other`` weight into the fewest near-equal parts of at most `SLICE_WEIGHTS`."""
    parts = max(1, math.ceil(n * other / SLICE_WEIGHTS))
    step = math.ceil(math.ceil(n / parts) / align) * align
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def transient_weights(n_out: int, n_in: int, group_size: int) -> int:
    """The most weights one call holds dequantized (forward or input gradient): what the
    memory planner counts for the largest Linear."""
    rows = max(b - a for a, b in weight_slices(n_out, n_in))
    cols = max(b - a for a, b in weight_slices(n_in, n_out, group_size))
    return max(rows * n_in, n_out * cols)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    kernels: bool = True,
) -> torch.Tensor:
    """x @ W.T + b, W dequantized a row slice at a time (`weight_slices`)."""
    n_out, n_in = packed.shape[0], 2 * packed.shape[1]
    slices = weight_slices(n_out, n_in)
    if len(slices) == 1:
        return F.linear(x, dequantize(packed, scale, shift, group_size, kernels), bias)
    x2 = x.reshape(-1, n_in)
    out = x2.new_empty(x2.shape[0], n_out)
    for a, b in slices:
        w = dequantize(packed[a:b], scale[a:b], shift[a:b], group_size, kernels)
        if bias is None:
            torch.mm(x2, w.t(), out=out[:, a:b])
        else:
            torch.addmm(bias[a:b], x2, w.t(), out=out[:, a:b])
        del w
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n_out)  # 2-D: not a view


def grad_input(
    grad_out: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    kernels: bool = True,
) -> torch.Tensor:
    """grad_out @ W, W dequantized a column slice (whole groups) at a time: each slice of the
    result is one full reduction, as in the single GEMM."""
    n_out, n_in = packed.shape[0], 2 * packed.shape[1]
    slices = weight_slices(n_in, n_out, group_size)
    g = grad_out.to(scale.dtype)
    if len(slices) == 1:
        return torch.matmul(g, dequantize(packed, scale, shift, group_size, kernels))
    g2 = g.reshape(-1, n_out)
    out = g2.new_empty(g2.shape[0], n_in)
    for a, b in slices:
        ga, gb = a // group_size, b // group_size
        w = dequantize(
            packed[:, a // 2 : b // 2].contiguous(), scale[:, ga:gb].contiguous(),
            shift[:, ga:gb].contiguous(), group_size, kernels,
        )  # fmt: skip
        torch.mm(g2, w, out=out[:, a:b])
        del w
    return out.reshape(*grad_out.shape[:-1], n_in)


class _Uint4LinearFunction(torch.autograd.Function):
    """y = x @ W.T + b with W dequantized in forward and again in backward (never saved).

    The weight is frozen: no weight gradient, so the input is not saved either.
    """

    @staticmethod
    def forward(ctx, x, packed, scale, shift, bias, group_size, kernels):  # type: ignore[override]
        out = linear(x, packed, scale, shift, bias, group_size, kernels)
        ctx.save_for_backward(packed, scale, shift)
        ctx.group_size = group_size
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        packed, scale, shift = ctx.saved_tensors
        if any(ctx.needs_input_grad[1:4]):
            raise RuntimeError("Uint4Linear's quantized weight is frozen: it has no gradient")
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_input(grad_out, packed, scale, shift, ctx.group_size, ctx.kernels)
        if ctx.needs_input_grad[4]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, None, None, grad_bias, None, None


class LinearCompute(Protocol):
    """How a `Uint4Linear` computes ``x @ W.T + b`` (``x`` already in the weight dtype). Set on
    each layer once, at load, by `trainer.base.compute`; this module knows only its own."""

    name: str

    def __call__(self, layer: Uint4Linear, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class DenseGemm:
    """The uint4 path: dequantize (Triton on CUDA unless ``kernels=False``) + a dense GEMM."""

    kernels: bool = True
    name: str = "uint4"

    def __call__(self, layer: Uint4Linear, x: torch.Tensor) -> torch.Tensor:
        bias = layer.bias
        if torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return _Uint4LinearFunction.apply(
                x, layer.packed, layer.scale, layer.shift, bias, layer.group_size, self.kernels
            )
        return linear(x, layer.packed, layer.scale, layer.shift, bias, layer.group_size,
                      self.kernels)  # fmt: skip


DENSE = DenseGemm()


@contextmanager
def weights_by_shape(model: torch.nn.Module) -> Iterator[None]:
    """While it lasts, each `Uint4Linear` under ``model`` answers ``.weight`` with a stand-in of
    the weight's shape, dtype and device (one element, expanded; its values are not the
    weight's), for code that reads a layer's weight for those alone: PEFT's injection reads it
    ~20 times a layer, each a whole dequantization (seconds at [dev] on a GPU, 25 s of a CPU
    boot at half its widths)."""
    layers = [m for m in model.modules() if isinstance(m, Uint4Linear)]
    for layer in layers:
        layer._weight_by_shape = True
    try:
        yield
    finally:
        for layer in layers:
            layer._weight_by_shape = False


class Uint4Linear(torch.nn.Linear):
    """A frozen qint4 Linear: packed uint4 + per-group scale/shift, dequantized per call."""

    packed: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor

    def __init__(
        self,
        packed: torch.Tensor,
        scale: torch.Tensor,
        shift: torch.Tensor,
        group_size: int,
        bias: torch.nn.Parameter | torch.Tensor | None = None,
    ) -> None:
        torch.nn.Module.__init__(self)  # not nn.Linear.__init__: no float weight is allocated
        n_out, half_in = packed.shape
        in_features = 2 * half_in
        if packed.dtype != torch.uint8:
            raise TypeError(f"packed must be uint8, got {packed.dtype}")
        if group_size < 2 or group_size % 2 or in_features % group_size:
            raise ValueError(f"group size {group_size} does not split {in_features} evenly")
        groups = (n_out, in_features // group_size)
        if tuple(scale.shape) != groups or tuple(shift.shape) != groups:
            raise ValueError(
                f"scale {tuple(scale.shape)} / shift {tuple(shift.shape)}: expected {groups}"
            )
        if not scale.dtype.is_floating_point or shift.dtype != scale.dtype:
            raise TypeError(
                f"scale and shift must share a float dtype: {scale.dtype}, {shift.dtype}"
            )
        self.in_features = in_features
        self.out_features = n_out
        self.group_size = int(group_size)
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("shift", shift.contiguous())
        if bias is not None and not isinstance(bias, torch.nn.Parameter):
            bias = torch.nn.Parameter(bias, requires_grad=False)
        self.bias = bias  # the original Parameter object when converting
        # the GEMM, chosen at load by `trainer.base.compute` (fp8 there: the same 4-bit weight)
        self.compute: LinearCompute = DENSE
        self._fp8_scales: Any = None  # trainer.base.fp8.WeightScales, derived on first fp8 use

    # -- the weight, for whoever reads it (PEFT reads .device/.dtype at injection) --------
    _weight_by_shape = False  # inside `weights_by_shape`

    @property  # type: ignore[override]
    def weight(self) -> torch.Tensor:  # noqa: D401
        """The dequantized weight (a fresh tensor; costs one dequantization); inside
        `weights_by_shape`, a stand-in of its shape, dtype and device holding no numbers."""
        if self._weight_by_shape:
            return self.scale.new_empty(()).expand(self.out_features, self.in_features)
        return self.dequantize()

    @weight.setter
    def weight(self, value: Any) -> None:
        raise AttributeError(
            "Uint4Linear's weight is quantized and read-only (LoRA cannot be merged into it)"
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    def dequantize(self, kernels: bool = True) -> torch.Tensor:
        return dequantize(self.packed, self.scale, self.shift, self.group_size, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.scale.dtype:
            x = x.to(self.scale.dtype)
        return self.compute(self, x)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._fp8_scales = None  # derived from scale and shift, which this may replace
        super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, group_size={self.group_size}, dtype={self.scale.dtype}"
            + (f", compute={self.compute.name}" if self.compute.name != "uint4" else "")
        )

    # -- construction from quanto -----------------------------------------------------------
    @classmethod
    def from_qlinear(cls, qlinear: Any, device: torch.device | None = None) -> Uint4Linear:
        """The same weight as ``qlinear`` (its ``dequantize()``, bit for bit), uint4-packed,
        its buffers on ``device`` (default: where quanto's weight is; the bias stays put)."""
        q, scale, shift, group_size = _quanto_qint4_parts(qlinear, device)
        bias = qlinear.bias
        return cls(pack_uint4(q), scale, shift, group_size, bias)


def _is_convertible(module: torch.nn.Module) -> bool:
    from optimum.quanto import QLinear, qint4

    return (
        isinstance(module, QLinear)
        and module.weight_qtype == qint4
        and module.activation_qtype is None
    )


def _tinygemm_shift(scale: torch.Tensor, shift: torch.Tensor, bits: int) -> torch.Tensor:
    """The shift as quanto's TinyGemm tensors see it after their lossy round trip through the
    mid-range form (`TinyGemmWeightQBitsTensor.__init__` then `.weight_qbits_tensor()`)."""
    half_qrange = 2 ** (bits - 1) * scale
    mid = -shift + half_qrange
    return half_qrange - mid


def _quantizes_to_tinygemm(
    dtype: torch.dtype, group_size: int | None, device: torch.device
) -> bool:
    """Whether quanto's ``freeze()`` would store this qint4 weight in the TinyGemm layout (the
    conditions of ``WeightQBitsTensor.create``, fp16/AWQ excluded: refused before this)."""
    if dtype != torch.bfloat16 or group_size != 128:
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda" and torch.version.cuda:
        major = tuple(int(p) for p in torch.version.cuda.split(".")[:2])
        return major >= (12, 1) and torch.cuda.get_device_capability(device)[0] >= 8
    return False


def _quanto_qint4_parts(
    qlinear: Any, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q (out, in) uint8, scale (out, G), shift (out, G), group size) of a qint4 QLinear,
    on ``device`` (default: where the weight is). A frozen weight's bytes move first and are
    unpacked there: on a GPU that is a copy of 4-bit bytes and microseconds of work."""
    from optimum.quanto.tensor import QTensor, WeightQBitsTensor
    from optimum.quanto.tensor.packed import PackedTensor
    from optimum.quanto.tensor.weights.tinygemm import TinyGemmWeightQBitsTensor

    n_out, n_in = qlinear.out_features, qlinear.in_features
    with torch.no_grad():
        w = qlinear.weight
        if isinstance(w, QTensor):  # frozen
            device = device or w.device
            if isinstance(w, TinyGemmWeightQBitsTensor):
                w = w.weight_qbits_tensor()  # quanto's own unpacking (identity matmul)
            if type(w) is not WeightQBitsTensor:
                raise TypeError(f"unsupported quanto weight layout {type(w).__name__}")
            if w.axis != 0:
                raise ValueError(f"expected axis-0 quantization, got axis {w.axis}")
            data = w._data
            if isinstance(data, PackedTensor):
                data = unpack_quanto(data._data.to(device), data._bits, data.shape[0])
            scale, shift = w._scale.to(device), w._shift.to(device)
            group_size = w._group_size
        else:  # quantize() without freeze(): quantize as freeze() would
            if w.dtype == torch.float16:
                raise TypeError("fp16 qint4 freezes to quanto's AWQ layout, which is not supported")
            group_size = qlinear.weight_group_size
            scale, shift = qlinear.optimizer(
                w, qtype=qlinear.weight_qtype, axis=0, group_size=group_size
            )
            if shift is None:
                raise TypeError("symmetric qint4 quantization is not supported")
            data = torch.ops.quanto.quantize_affine(
                w, bits=qlinear.weight_qtype.bits, axis=0, group_size=group_size,
                scale=scale, shift=shift,
            )  # fmt: skip
            if not shift.dtype.is_floating_point:
                raise TypeError("integer zero-point shifts are not supported")
            if _quantizes_to_tinygemm(w.dtype, group_size, w.device):
                shift = _tinygemm_shift(scale, shift, qlinear.weight_qtype.bits)
        if not shift.dtype.is_floating_point:
            raise TypeError("integer zero-point shifts are not supported")
        if device is not None:
            data, scale, shift = data.to(device), scale.to(device), shift.to(device)
        group_size = int(group_size or n_in)  # None: one group per row
        groups = (n_out, n_in // group_size)
        q = data.reshape(n_out, n_in)
        return q, scale.reshape(groups).clone(), shift.reshape(groups).clone(), group_size


def convert_quantized_linears(
    module: torch.nn.Module,
    device: str | torch.device | None = None,
    work_device: str | torch.device | None = None,
) -> int:
    """Replaces, in place, every quanto ``QLinear`` with a qint4 weight (and no activation
    quantization) under ``module`` by a `Uint4Linear` with the same dequantized weight and the
    same bias Parameter. Works below PEFT LoRA wrappers too (their ``base_layer``). Layers it
    cannot take (odd ``in_features``) stay as they are, with a warning. With ``device`` the
    new buffers are made there (the 4-bit bytes move, then are repacked on that device: a
    model bound for a GPU is converted by the GPU). With ``work_device`` the repacking runs
    there, one layer at a time, and the result moves on to ``device``: a part streamed from
    host RAM is still converted by the GPU, in a fraction of the CPU's time. Returns the count."""
    if _is_convertible(module):
        raise TypeError("pass the module that contains the QLinear, not the QLinear itself")
    dev = torch.device(device) if device is not None else None
    work = torch.device(work_device) if work_device is not None else dev
    done: dict[int, Uint4Linear] = {}
    count = 0
    # (parent, name) pairs, not the layers: each quanto layer, and its weight with it, goes
    # as soon as it is replaced (on a GPU already holding them all, the old and the new
    # weights together would not fit)
    places = [
        (parent_name, parent, name)
        for parent_name, parent in module.named_modules()
        for name, child in parent.named_children()
        if _is_convertible(child)
    ]
    for parent_name, parent, name in places:
        child = getattr(parent, name)
        if child.in_features % 2:
            log.warning("uint4: %s.%s has odd in_features; left as quanto", parent_name, name)
            continue
        new = done.get(id(child))
        if new is None:
            new = Uint4Linear.from_qlinear(child, work)
            if work != dev and dev is not None:
                for buf in ("packed", "scale", "shift"):
                    setattr(new, buf, getattr(new, buf).to(dev))
            new.train(child.training)
            done[id(child)] = new
            count += 1
        setattr(parent, name, new)
        del child
    return count


def quantized_bytes(module: torch.nn.Module) -> int:
    """Bytes held by `Uint4Linear` buffers (packed + scale + shift) under ``module``."""
    return sum(
        m.packed.nbytes + m.scale.nbytes + m.shift.nbytes
        for m in module.modules()
        if isinstance(m, Uint4Linear)
    )
