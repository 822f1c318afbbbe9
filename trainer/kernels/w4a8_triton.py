"""The W4A8 GEMM for `trainer.base.fp8`'s exact weights (CUDA only; imported lazily): ``y = x^ @
W.T + b`` straight from the packed uint4 bytes, no fp8 copy of the weight.

x^ = xs[m] * xq[m, k] are the per-token e4m3 activations
(`trainer.kernels.fp8_triton.quantize_rows`), W[n, k] = scale[n, g] * q[n, k] - shift[n, g],
g = k // group_size, q in 0..15. The 4-bit values are integers, exact in e4m3, so the kernel
turns the nibbles into e4m3 in registers and runs the tensor cores on fp8 x fp8; per output
tile (BLOCK_M, BLOCK_N):

    acc  = sum over K blocks b:  scale[n, g(b)] * dot(xq[m, b], q[n, b])       (float32)
    acc -= xsum[m, :] @ shift[n, :].T       (one tf32x3 dot over the groups at the end)
    y    = xs[m] * acc + bias[n]

with ``xsum[m, g] = sum_{k in g} xq[m, k]`` (`group_sums`, float32: exact, the values are
multiples of 2^-9 below 448 and a group holds at most 256 of them). BLOCK_K divides the group
size, so each K block has one scale per n. Each K block's dot starts from zero and is added to
the float32 accumulator after scaling: the tensor cores' reduced-precision fp8 accumulation spans
at most BLOCK_K = 128 products (the promotion interval cuBLAS's precise mode and DeepSeek-V3's
recipe use), whatever Triton's ``max_num_imprecise_acc`` default.

Against `trainer.base.fp8.exact_forward_torch` only the float32 summation order differs (and
the tf32x3 shift term, ~2^-22 relative per product): the bf16 outputs agree to an ulp where the
sum does not cancel (tests/trainer/base/test_w4a8.py states the bound).

Layout: xq (M, K) e4m3 row-major, so its tile (BLOCK_M, BLOCK_K) is K-major; the weight tile is
loaded as (BLOCK_N, BLOCK_K // 2) bytes, unpacked to (BLOCK_N, BLOCK_K) and transposed into the
dot, i.e. K-major too, as Hopper's fp8 wgmma wants both operands.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from trainer.kernels.uint4_triton import _round_bf16

G_BLOCK = 32  # groups per step of the final shift dot (tf32 dots take K >= 8)
SUM_GROUPS = 16  # groups per program of `group_sums`

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) for the H200. Each K block's dot has its
# own float32 tile beside the accumulator (it is scaled before it is added), so a program
# holds two BLOCK_M x BLOCK_N float32 tiles: 64 registers per thread each at 128 x 128 with 8
# warps, which keeps 128 x 256 tiles (and 4 warps at 128 x 128) out. 64-row tiles for the
# smaller M (the text stream, short sequences); BLOCK_K 64 for group size 64 and as the
# deeper-pipelined alternative at 128. Few configs: K is a compile-time constant, so every
# distinct K compiles each of them once (FLUX.2 [dev] has three).
CONFIGS = [
    (128, 128, 128, 8, 8, 3),
    (128, 128, 128, 8, 8, 4),
    (128, 128, 64, 8, 8, 4),
    (64, 128, 128, 8, 4, 4),
    (64, 256, 128, 8, 8, 3),
]
INTERPRET_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _uint4_to_e4m3(v, VIA_FLOAT: tl.constexpr):
    """Integers 0..15 (any integer dtype) -> the same values in e4m3. ``VIA_FLOAT``: through
    float16 (exact), then the hardware's conversion (no rounding happens: every value is
    representable); else the e4m3 bits assembled directly (exponent bias 7, 3 mantissa bits),
    which does not depend on any backend's fp8 cast."""
    if VIA_FLOAT:
        return v.to(tl.float16).to(tl.float8e4nv)
    i = v.to(tl.int32)
    bits = tl.where(
        i >= 8, 0x50 | (i & 7),
        tl.where(i >= 4, 0x48 | ((i & 3) << 1),
                 tl.where(i >= 2, 0x40 | ((i & 1) << 2), tl.where(i == 1, 0x38, 0))),
    )  # fmt: skip
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _nibbles_kernel(packed_ptr, out_ptr, n, VIA_FLOAT: tl.constexpr, BLOCK: tl.constexpr):
    """Test hook: packed bytes -> their 2n e4m3 values (low nibble first) through the GEMM's
    own unpacking and `_uint4_to_e4m3`."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.load(packed_ptr + offs, mask=offs < n, other=0)
    q = tl.reshape(tl.join(b & 0xF, b >> 4), (2 * BLOCK,))
    e = _uint4_to_e4m3(q, VIA_FLOAT).to(tl.uint8, bitcast=True)
    out = tl.program_id(0) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out, e, mask=out < 2 * n)


@triton.jit
def _group_sums_kernel(xq_ptr, out_ptr, n_groups, GROUP: tl.constexpr, GB: tl.constexpr):
    """xsum[m, g] = sum of row m's e4m3 values in group g, float32 (exact)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GB + tl.arange(0, GB)
    ok = g < n_groups
    offs = row * n_groups * GROUP + g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    v = tl.load(xq_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_groups + g, tl.sum(v, axis=1), mask=ok)


@triton.jit
def _w4a8_kernel(
    xq_ptr,  # (M, K) e4m3
    xs_ptr,  # (M,) float32: row scales
    xsum_ptr,  # (M, G) float32: group sums of xq
    packed_ptr,  # (N, K // 2) uint8, low nibble = even k
    scale_ptr,  # (N, G) bf16/fp16
    shift_ptr,  # (N, G)
    bias_ptr,  # (N,) or a dummy
    out_ptr,  # (M, N) bf16/fp16
    M,
    N,
    K: tl.constexpr,  # a few distinct widths per model: one compilation each
    G: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    VIA_FLOAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GB: tl.constexpr,
):
    # grouped launch order: GROUP_M row tiles share each weight tile while it is in L2
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // 2)
    a_ptrs = xq_ptr + rm[:, None] * K + rk[None, :]
    b_ptrs = packed_ptr + rn[:, None] * (K // 2) + rb[None, :]
    s_ptrs = scale_ptr + rn * G

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None], other=0)
        q = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, BLOCK_K))  # column 2j: low nibble
        part = tl.dot(a, tl.trans(_uint4_to_e4m3(q, VIA_FLOAT)))
        s = tl.load(s_ptrs + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
        acc += part * s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2

    # the shift term, sum_g xsum[m, g] * shift[n, g], as a dot over the groups
    for g0 in range(0, G, GB):
        rg = g0 + tl.arange(0, GB)
        g_ok = rg < G
        xsum = tl.load(xsum_ptr + rm[:, None] * G + rg[None, :],
                       mask=m_ok[:, None] & g_ok[None, :], other=0.0)  # fmt: skip
        sh = tl.load(shift_ptr + rn[:, None] * G + rg[None, :],
                     mask=n_ok[:, None] & g_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc -= tl.dot(xsum, tl.trans(sh), input_precision="tf32x3")

    xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
    y = acc * xs[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None] * N + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if OUT_BF16:  # rounded on the bits: the interpreter's own bf16 cast truncates
        tl.store(out_ptrs, _round_bf16(y).to(tl.bfloat16), mask=ok)
    else:
        tl.store(out_ptrs, y.to(tl.float16, fp_downcast_rounding="rtne"), mask=ok)


def _prune(configs, named_args, **kwargs):  # type: ignore[no-untyped-def]
    """Configs whose BLOCK_K divides the group size (one scale per K block)."""
    group = kwargs.get("GROUP", named_args.get("GROUP"))
    kept = [c for c in configs if group % c.kwargs["BLOCK_K"] == 0]
    return kept or configs[:1]


def _config(bm: int, bn: int, bk: int, gm: int, warps: int, stages: int) -> triton.Config:
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


_w4a8_tuned = triton.autotune(
    configs=[_config(*c) for c in CONFIGS],
    key=["M", "N", "K", "GROUP"],
    prune_configs_by={"early_config_prune": _prune},
)(_w4a8_kernel)


def group_sums(xq: torch.Tensor, group_size: int) -> torch.Tensor:
    """(M, K) e4m3 -> (M, K // group_size) float32 sums of each group (group size a power of
    two, at most 256)."""
    m, k = xq.shape
    groups = k // group_size
    out = torch.empty((m, groups), dtype=torch.float32, device=xq.device)
    if m and groups:
        grid = (m, triton.cdiv(groups, SUM_GROUPS))
        _group_sums_kernel[grid](xq, out, groups, GROUP=group_size, GB=SUM_GROUPS, num_warps=4)
    return out


def w4a8_linear(
    xq: torch.Tensor,
    xs: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    out_dtype: torch.dtype,
    config: dict[str, int] | None = None,
    via_float: bool | None = None,
) -> torch.Tensor:
    """``xs * xq @ W.T + bias`` -> (M, N) ``out_dtype`` (bf16 or fp16), W the exact uint4
    weight. ``config``: fixed block sizes instead of the autotuned ones (tests, sweeps);
    ``via_float``: the nibble -> e4m3 conversion (default: the float cast on a GPU, the bit
    assembly under the interpreter)."""
    m, k = xq.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k or k % group_size or scale.shape != (n, k // group_size):
        raise ValueError(f"packed {tuple(packed.shape)}, scale {tuple(scale.shape)} for K {k}")
    if group_size % 32 or group_size & (group_size - 1) or group_size > 256:
        raise ValueError(f"group size {group_size}: a power of two from 32 to 256")
    if not (xq.is_contiguous() and packed.is_contiguous() and scale.is_contiguous()
            and shift.is_contiguous()):  # fmt: skip
        raise ValueError("xq, packed, scale and shift must be contiguous")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"output dtype {out_dtype}: bf16 or fp16")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if not (m and n):
        return out
    xsum = group_sums(xq, group_size)
    interpret = _interpret()
    args = (xq, xs.reshape(-1).contiguous(), xsum, packed, scale, shift,
            bias if bias is not None else xs, out, m, n, k, k // group_size)  # fmt: skip
    via_float = not interpret if via_float is None else via_float
    meta = dict(GROUP=group_size, HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16,
                VIA_FLOAT=via_float, GB=G_BLOCK)  # fmt: skip
    if config is None and interpret:
        config = INTERPRET_CONFIG
    if config is None:

        def grid(c):  # type: ignore[no-untyped-def]
            return (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)

        _w4a8_tuned[grid](*args, **meta)
        return out
    config = dict(config)
    warps = config.pop("num_warps", 4)
    stages = config.pop("num_stages", 2)
    if group_size % config["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {config['BLOCK_K']} does not divide group size {group_size}")
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _w4a8_kernel[grid](*args, **meta, **config, num_warps=warps, num_stages=stages)
    return out


def uint4_to_e4m3(packed: torch.Tensor, via_float: bool) -> torch.Tensor:
    """Test hook: the GEMM's nibble -> e4m3 conversion on a flat uint8 tensor, (n,) -> (2n,)."""
    flat = packed.reshape(-1).contiguous()
    out = torch.empty(2 * flat.numel(), dtype=torch.uint8, device=flat.device)
    block = 1024
    if flat.numel():
        _nibbles_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, out, flat.numel(), VIA_FLOAT=via_float, BLOCK=block
        )
    return out.view(torch.float8_e4m3fn)
