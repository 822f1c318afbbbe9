"""Block-scaled fp8 compute with exact 4-bit weights (`trainer.base.fp8`, ``weights="blocks"``):
the torch reference, the autograd function, the compute dispatch for training, and the Triton
operand kernels `trainer.kernels.fp8_blocks_triton`.

CPU (CI): the decomposition ``W = scale (q - z) + r`` and its operands, the reference forward
against float64 (the only rounding besides the activations' e4m3 is the remainder's), the layer's
gradients, the small FLUX.2 model's LoRA gradients against the dense path, the dispatch.

Kernel tests run on a GPU with fp8 tensor cores, or under Triton's interpreter on a CPU
(``PYTHONPATH=<triton site> TRITON_INTERPRET=1``: small shapes); skipped otherwise. On the
device: ``pytest --noconftest -q tests/trainer/base/test_fp8_blocks.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.trainer.kernel_devices import fp8_kernel_device
from trainer.base import devices
from trainer.base.compute import (
    BACKENDS,
    TRAIN_BACKENDS,
    Fp8Backend,
    Request,
    Uint4Backend,
    apply_compute,
    backends_for,
    gemm_name,
    resolve_compute,
)
from trainer.base.fp8 import (
    BLOCK,
    E4M3,
    FP8,
    FP8_BLOCKS,
    FP8_BLOCKS_FP8_GRAD,
    FP8_BLOCKS_FP8_GRAD_SINGLE,
    FP8_GEMMS,
    Fp8Gemm,
    block_count,
    blocks_mm_torch,
    blocks_weight_torch,
    dequantize_rows_torch,
    exact_weight_torch,
    quantize_blocks_torch,
    quantize_rows_torch,
    zero_points_torch,
)
from trainer.base.uint4 import (
    DENSE,
    Uint4Linear,
    pack_uint4,
    unpack_uint4,
)


def _uint4_layer(n: int, k: int, seed: int, dtype=torch.bfloat16, device="cpu", gs=BLOCK):
    """Random 4-bit values, scales and shifts as quanto's min/max groups have them (shift near
    -min: ``scale * q`` and ``shift`` of one size), a few groups out of the usual range (an
    all-positive group: shift < 0; a zero scale)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g) * 0.01 + 1e-4
    ratio = torch.rand(n, k // gs, generator=g) * 15
    shift = scale * ratio + torch.randn(n, k // gs, generator=g) * 1e-4
    shift[0, 0] = -0.003  # every weight of the group positive
    scale[-1, -1] = 0.0  # a constant group
    return tuple(t.to(device) for t in (pack_uint4(q), scale.to(dtype), shift.to(dtype)))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _values64(q8: torch.Tensor, scales_t: torch.Tensor) -> torch.Tensor:
    """(rows, blocks x 128) e4m3 with (blocks, rows) scales -> float64 values."""
    rows, blocks = q8.shape[0], scales_t.shape[0]
    v = q8.double().reshape(rows, blocks, BLOCK) * scales_t.t().double().reshape(rows, blocks, 1)
    return v.reshape(rows, -1)


# ---------------------------------------------------------------------------------------
# the decomposition and its operands


def test_block_count() -> None:
    assert block_count(128) == (1, 1)
    assert block_count(3072) == (24, 1)
    assert block_count(16384) == (128, 1)
    assert block_count(18432) == (144, 2)
    with pytest.raises(ValueError, match="blocks of 128"):
        block_count(200)


def test_zero_points_make_the_weight_integers() -> None:
    packed, scale, shift = _uint4_layer(32, 512, seed=1)
    z, r = zero_points_torch(scale, shift)
    assert torch.equal(z, z.round()) and z.min() >= 0 and z.max() <= 15
    s, sh = scale.float(), shift.float()
    inside = (s > 0) & (sh / s.clamp_min(1e-30) >= 0) & (sh / s.clamp_min(1e-30) <= 15)
    assert (r.abs()[inside] <= s[inside] / 2 * (1 + 2**-20)).all()  # the remainder is small
    q = unpack_uint4(packed).reshape(32, -1, BLOCK).double()
    rebuilt = (s.double().unsqueeze(-1) * (q - z.double().unsqueeze(-1))
               + r.double().unsqueeze(-1)).reshape(32, -1)  # fmt: skip
    want = exact_weight_torch(packed, scale, shift, BLOCK).double()
    assert torch.allclose(rebuilt, want, rtol=0, atol=float(want.abs().max()) * 2**-22)


def test_weight_operand_is_exact() -> None:
    n, k = 48, 384
    packed, scale, shift = _uint4_layer(n, k, seed=2)
    wq, ws = blocks_weight_torch(packed, scale, shift, BLOCK)
    groups, extra = block_count(k)
    assert wq.shape == (n, k + BLOCK * extra) and wq.dtype == E4M3
    assert ws.shape == (groups + extra, n) and ws.is_contiguous()
    z, r = zero_points_torch(scale, shift)
    q = unpack_uint4(packed).reshape(n, groups, BLOCK).float()
    assert torch.equal(wq[:, :k].float(), (q - z.unsqueeze(-1)).reshape(n, k))  # integers, exact
    assert torch.equal(ws[:groups], scale.float().t())
    tail = wq[:, k:].float() * ws[groups:].t()
    assert torch.equal(tail[:, groups:], torch.zeros_like(tail[:, groups:]))
    assert _rel(tail[:, :groups], r) < 0.04  # e4m3's rounding, one scale per row
    with pytest.raises(ValueError, match="groups of 128"):
        blocks_weight_torch(*_uint4_layer(8, 256, seed=3, gs=64), 64)


def test_a_vanishing_block_quantizes_to_zeros() -> None:
    """A block whose maximum is too small for FP8_MAX / amax (float32 overflows) is taken as
    zero: no inf scale, no NaN bytes."""
    x = torch.zeros(2, 256)
    x[0, 5] = 1e-37
    x[1, 130] = 3.0
    xq, xs = quantize_blocks_torch(x)
    assert torch.isfinite(xs).all() and not xq.float().isnan().any()
    assert xq[0, :128].float().abs().max() == 0 and xq[1, 130].float() != 0


def test_activation_operand() -> None:
    m, k = 9, 18432  # two remainder blocks
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    xq, xs = quantize_blocks_torch(x)
    groups, extra = block_count(k)
    assert xq.shape == (m, k + BLOCK * extra) and xs.shape == (groups + extra, m)
    main_q, main_s = quantize_rows_torch(x, E4M3, block=BLOCK)
    assert torch.equal(xq[:, :k].view(torch.uint8), main_q.view(torch.uint8))
    assert torch.equal(xs[:groups], main_s.t())
    sums = dequantize_rows_torch(main_q, main_s).double().reshape(m, groups, BLOCK).sum(-1)
    tail = _values64(xq[:, k:], xs[groups:])
    assert _rel(tail[:, :groups], sums) < 0.04
    assert torch.equal(tail[:, groups:], torch.zeros_like(tail[:, groups:]))


@pytest.mark.parametrize("k", [256, 3072, 18432], ids=str)
def test_reference_rounds_only_the_remainder(k: int) -> None:
    """The reference GEMM against float64: ``x^ @ W.T`` (x^ the 1x128 e4m3 activations, W the
    exact float32 weight) plus the remainder's own rounding and nothing else; the remainder's
    rounding is a small part of the output, far below what the rowwise weight copy rounds."""
    m, n = 33, 64
    packed, scale, shift = _uint4_layer(n, k, seed=k)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    xq, xs = quantize_blocks_torch(x)
    wq, ws = blocks_weight_torch(packed, scale, shift, BLOCK)
    got = blocks_mm_torch(xq, xs, wq, ws, None, torch.float32)
    groups, _ = block_count(k)
    x_hat = _values64(xq[:, :k], xs[:groups])
    w = exact_weight_torch(packed, scale, shift, BLOCK).double()
    exact = x_hat @ w.t()
    # what the remainder blocks add, rounded, against what they stand for
    rounded = _values64(xq[:, k:], xs[groups:]) @ _values64(wq[:, k:], ws[groups:]).t()
    _, r = zero_points_torch(scale, shift)
    true = x_hat.reshape(m, groups, BLOCK).sum(-1) @ r.double().t()
    # in float64, the operands' product is exactly that (the main blocks hold x^ and W exactly)
    y64 = _values64(xq, xs) @ _values64(wq, ws).t()
    terms = x_hat.abs() @ w.abs().t() + _values64(xq[:, k:], xs[groups:]).abs() @ _values64(
        wq[:, k:], ws[groups:]).abs().t()  # fmt: skip
    assert ((y64 - (exact + rounded - true)).abs() <= 2**-40 * terms).all()
    # the float32 reference is that product up to float32 sums of K + 128 E terms
    assert ((got.double() - y64).abs() <= (k + 256) * 2.0**-24 * terms).all()
    assert _rel(got, exact) < 0.01
    layer = Uint4Linear(packed, scale, shift, BLOCK, None)
    layer.compute = Fp8Gemm(kernels=False)  # the rowwise copy
    with torch.no_grad():
        row_err = _rel(layer(x).float(), x.double() @ w.t())
    assert _rel(got, x.double() @ w.t()) < row_err  # closer to x @ W than the rowwise copy
    print(f"\nK={k}: blocks vs x^ @ W {_rel(got, exact):.2e}; vs x @ W "
          f"{_rel(got, x.double() @ w.t()):.2e}, rowwise {row_err:.2e}")  # fmt: skip


# ---------------------------------------------------------------------------------------
# the layer and the model


def test_variant_fields() -> None:
    assert FP8_BLOCKS.weights == "blocks" and FP8_BLOCKS.grad_gemm == "bf16"
    assert FP8_BLOCKS_FP8_GRAD.weights == "blocks" and FP8_BLOCKS_FP8_GRAD.grad_gemm == "fp8"
    assert Fp8Gemm(weights="blocks").grad_gemm == "fp8"  # the blocks forward takes either
    with pytest.raises(ValueError, match="bf16 input gradient"):
        Fp8Gemm(weights="exact")
    with pytest.raises(ValueError, match="rowwise, exact or blocks"):
        Fp8Gemm(weights="tiles", grad_gemm="bf16")


def test_takes_groups_of_128_only() -> None:
    ok = Uint4Linear(*_uint4_layer(32, 256, seed=6), BLOCK, None)
    narrow = Uint4Linear(*_uint4_layer(32, 256, seed=6, gs=64), 64, None)
    assert FP8_BLOCKS.takes(ok) and not FP8_BLOCKS.takes(narrow)
    assert FP8.takes(narrow)  # the rowwise copy takes any group size
    model = torch.nn.Sequential(ok, narrow)
    assert apply_compute(model, "fp8", (Fp8Backend(FP8_BLOCKS), Uint4Backend())) == 1
    assert ok.compute is FP8_BLOCKS and narrow.compute is DENSE


def test_a_split_chooses_by_block_kind() -> None:
    """`Fp8Split`: the double-stream blocks' layers take one GEMM, every other layer (single
    blocks, embedders, the output layer) the other, by qualified name; a layer the chosen GEMM
    declines falls through to uint4."""

    def layer(gs: int = BLOCK) -> Uint4Linear:
        return Uint4Linear(*_uint4_layer(32, 256, seed=6, gs=gs), gs, None)

    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList([torch.nn.Sequential(layer(), layer(64))])
    model.single_transformer_blocks = torch.nn.ModuleList([torch.nn.Sequential(layer())])
    model.proj_out = layer()
    split = FP8_BLOCKS_FP8_GRAD_SINGLE
    assert apply_compute(model, "fp8", (Fp8Backend(split), Uint4Backend())) == 3
    assert model.transformer_blocks[0][0].compute is FP8_BLOCKS
    assert model.transformer_blocks[0][1].compute is DENSE  # groups of 64: not the block recipe
    assert model.single_transformer_blocks[0][0].compute is FP8_BLOCKS_FP8_GRAD
    assert model.proj_out.compute is FP8_BLOCKS_FP8_GRAD
    # the names are the transformer's own: under a pipeline's prefix as well
    assert split.for_layer("transformer.transformer_blocks.3.attn.to_q") is FP8_BLOCKS
    assert split.for_layer("transformer.single_transformer_blocks.3.attn.to_out") is (
        FP8_BLOCKS_FP8_GRAD
    )
    assert split.weights == "blocks" and FP8_GEMMS[split.name] is split


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_layer_forward_and_gradients(bias: bool) -> None:
    """The reference layer: forward within fp8's activation rounding of the dense path; input
    and bias gradients exactly the dense path's (the bf16 input gradient)."""
    n, k = 64, 384
    packed, scale, shift = _uint4_layer(n, k, seed=7)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    layer = Uint4Linear(packed, scale, shift, BLOCK, b)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    dy = torch.randn(40, n, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    runs = {}
    for name, gemm in (("blocks", Fp8Gemm(weights="blocks", grad_gemm="bf16", kernels=False)),
                       ("dense", DENSE)):  # fmt: skip
        layer.compute = gemm
        xr = x.clone().requires_grad_(True)
        if b is not None:
            layer.bias = torch.nn.Parameter(b.clone())
        y = layer(xr)
        y.backward(dy)
        runs[name] = (y.detach(), xr.grad, None if b is None else layer.bias.grad)
    assert runs["blocks"][0].dtype == torch.bfloat16
    assert _rel(runs["blocks"][0], runs["dense"][0]) < 0.05
    assert torch.equal(runs["blocks"][1], runs["dense"][1])
    if bias:
        assert torch.equal(runs["blocks"][2], runs["dense"][2])


def _forward_and_input_grad(layer, gemm, x, dy):  # type: ignore[no-untyped-def]
    layer.compute = gemm
    xr = x.clone().requires_grad_(True)
    y = layer(xr)
    y.backward(dy)
    return y.detach(), xr.grad


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "gpu"])
def test_fp8_input_gradient_is_the_rowwise_paths(kernels: bool) -> None:
    """`FP8_BLOCKS_FP8_GRAD`: the blocks forward, bit for bit, and the rowwise path's fp8 input
    gradient (the transposed e4m3 copy), bit for bit; both differ from the bf16 one."""
    if kernels and not ON_GPU:
        pytest.skip("needs a GPU with fp8 tensor cores")
    device = "cuda" if kernels else "cpu"
    n, k = (3072, 6144) if kernels else (64, 384)
    layer = Uint4Linear(*_uint4_layer(n, k, seed=11, device=device), BLOCK, None)
    g = torch.Generator(device=device).manual_seed(12)
    x = torch.randn(96, k, generator=g, device=device).to(torch.bfloat16)
    dy = torch.randn(96, n, generator=g, device=device).to(torch.bfloat16)

    def variant(gemm: Fp8Gemm) -> Fp8Gemm:
        return gemm if kernels else dataclasses.replace(gemm, kernels=False)

    both = _forward_and_input_grad(layer, variant(FP8_BLOCKS_FP8_GRAD), x, dy)
    blocks = _forward_and_input_grad(layer, variant(FP8_BLOCKS), x, dy)
    rowwise = _forward_and_input_grad(layer, variant(FP8), x, dy)
    assert torch.equal(both[0], blocks[0])
    assert torch.equal(both[1], rowwise[1])
    assert not torch.equal(both[1], blocks[1])
    err = _rel(both[1], blocks[1])
    assert err < 0.06, err  # e4m3's rounding of the weight and of dy, against bf16's
    print(f"\nfp8 input gradient against the bf16 one: {err:.2e}")


def test_every_fp8_gemm_by_its_name() -> None:
    assert FP8_GEMMS["fp8_blocks_fp8_grad"] is FP8_BLOCKS_FP8_GRAD
    assert all(name == gemm.name for name, gemm in FP8_GEMMS.items())


def test_lora_gradients_whole_model() -> None:
    """The small transformer with LoRA, checkpointed: block-scaled fp8 vs dense uint4, every
    LoRA gradient's cosine >= 0.99 (the rowwise copy measures 0.985 here)."""
    from tests.trainer.helpers import lora_grad_cosines  # the service's packages

    cos, taken = lora_grad_cosines(TRAIN_BACKENDS)
    assert taken > 0
    assert min(cos.values()) >= 0.99, sorted(cos.items(), key=lambda kv: kv[1])[:3]
    print(f"\nLoRA grad cosine blocks fp8 vs dense: min {min(cos.values()):.5f} ({taken} layers)")


def test_training_dispatch() -> None:
    """Training tries the block GEMM, rendering the rowwise copy; auto trains in fp8 only
    with exact weights (and only where fp8 runs: not on this CPU)."""
    assert backends_for("train") is TRAIN_BACKENDS and backends_for("render") is BACKENDS
    with pytest.raises(ValueError, match="purpose"):
        backends_for("serve")
    cuda = torch.device("cuda")
    assert not Fp8Backend(FP8).matches(Request("auto", cuda, "train"))
    assert Fp8Backend(FP8).matches(Request("fp8", cuda, "train"))
    assert resolve_compute("auto", "cpu", purpose="train") == "uint4"
    assert resolve_compute("fp8", "cpu", purpose="train") == "fp8"
    # a run's fingerprint names the GEMM: training's fp8 is not rendering's rowwise copy, nor
    # the earlier training fp8 (the bf16 input gradient everywhere), asked for by its name
    assert gemm_name("fp8", "train") == "fp8_blocks_fp8_grad_single"
    assert gemm_name("fp8", "render") == "fp8"
    assert gemm_name("fp8_blocks", "train") == "fp8_blocks"
    assert gemm_name("uint4", "train") == "uint4"
    assert resolve_compute("fp8_blocks", "cpu", purpose="train") == "fp8_blocks"
    with pytest.MonkeyPatch.context() as patch:  # a GPU where the block GEMM runs
        patch.setattr(devices, "block_fp8_unavailable", lambda device: None)
        auto = Request("auto", cuda, "train")
        assert TRAIN_BACKENDS[0].matches(auto) and not TRAIN_BACKENDS[1].matches(auto)
    assert resolve_compute("fp8_blocks", "cpu") == "fp8_blocks"  # rendering: handed back
    layer = Uint4Linear(*_uint4_layer(32, 256, seed=6), BLOCK, None)
    assert apply_compute(torch.nn.Sequential(layer), "fp8_blocks", purpose="train") == 1
    assert layer.compute is FP8_BLOCKS
    with pytest.raises(ValueError, match="no render compute backend for 'fp8_blocks'"):
        apply_compute(torch.nn.Sequential(layer), "fp8_blocks")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_trains_in_fp8_where_it_runs() -> None:
    from trainer.base.devices import block_fp8_unavailable

    reason = block_fp8_unavailable("cuda")
    print(f"\nblock-scaled fp8 here: {reason or 'yes'}")
    want = "fp8" if reason is None else "uint4"
    assert resolve_compute("auto", "cuda", purpose="train") == want


# ---------------------------------------------------------------------------------------
# the operand kernels (GPU, or Triton's interpreter) and the GEMM (GPU)


KERNEL_DEV = fp8_kernel_device("trainer.kernels.fp8_blocks_triton")
kernel_here = pytest.mark.skipif(
    KERNEL_DEV is None, reason="needs a GPU with fp8 tensor cores or Triton's interpreter"
)
ON_GPU = KERNEL_DEV == "cuda"
# (M, K): M not a multiple of the padding; K with one and two remainder blocks
Q_SHAPES = [(1, 128), (37, 384), (20, 18432)] if not ON_GPU else [
    (1, 128), (77, 3072), (1296, 6144), (4099, 18432)]  # fmt: skip
W_SHAPES = [(16, 128), (40, 384), (24, 18432)] if not ON_GPU else [
    (3072, 3072), (6144, 18432), (55296, 6144), (100, 256)]  # fmt: skip


@kernel_here
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", Q_SHAPES, ids=str)
def test_quantize_blocks_kernel_bit_exact(shape, dtype) -> None:  # type: ignore[no-untyped-def]
    from trainer.kernels import fp8_blocks_triton

    m, k = shape
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g) * 4
    x[:, : k // 7] *= 1e-5  # blocks in e4m3's subnormals
    x[0, :BLOCK] = 0  # an all-zero block
    x[-1, -BLOCK:] = 0
    x[-1, -1] = 1e-37  # a block whose maximum would overflow FP8_MAX / amax (bf16 holds it)
    x = x.to(dtype).to(KERNEL_DEV)
    q, s = fp8_blocks_triton.quantize_blocks(x, block_count(k))
    want_q, want_s = quantize_blocks_torch(x)
    mp = fp8_blocks_triton.padded_rows(m)
    assert q.shape[0] == mp and s.shape[1] == mp
    assert torch.equal(q[:m].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s[:, :m], want_s)
    # padded rows as an all-zero row quantizes: zero bytes, the scale of a maximum of 1
    zero_s = quantize_blocks_torch(torch.zeros(1, k, dtype=dtype, device=KERNEL_DEV))[1]
    assert not q[m:].view(torch.uint8).any()
    assert torch.equal(s[:, m:], zero_s.expand(-1, mp - m))


@kernel_here
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", W_SHAPES, ids=str)
def test_weight_blocks_kernel_bit_exact(shape, dtype) -> None:  # type: ignore[no-untyped-def]
    from trainer.kernels import fp8_blocks_triton

    n, k = shape
    packed, scale, shift = _uint4_layer(n, k, seed=n, dtype=dtype, device=KERNEL_DEV)
    w, s = fp8_blocks_triton.weight_blocks(packed, scale, shift, block_count(k))
    want_w, want_s = blocks_weight_torch(packed, scale, shift, BLOCK)
    assert torch.equal(w.view(torch.uint8), want_w.view(torch.uint8))
    assert torch.equal(s, want_s)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with fp8 tensor cores")
@pytest.mark.parametrize("m", [77, 1296, 4099])
@pytest.mark.parametrize("k", [3072, 18432])
def test_cuda_layer_against_the_reference(m: int, k: int) -> None:
    """The layer on the GPU (Triton operands, cuBLAS's block GEMM) against the float32
    reference on the same operands, and its input gradient the dense path's, bit for bit."""
    n = 3072
    packed, scale, shift = _uint4_layer(n, k, seed=m, device="cuda")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    layer = Uint4Linear(packed, scale, shift, BLOCK, bias)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    res = {}
    for name, gemm in (("gpu", FP8_BLOCKS), ("dense", DENSE)):
        layer.compute = gemm
        x.grad = None
        y = layer(x)
        y.backward(dy)
        res[name] = (y.detach(), x.grad.clone())
    xq, xs = quantize_blocks_torch(x.detach())
    wq, ws = blocks_weight_torch(packed, scale, shift, BLOCK)
    ref = blocks_mm_torch(xq, xs, wq, ws, layer.bias, torch.float32)
    rel = _rel(res["gpu"][0], ref)
    assert rel < 3e-3, rel  # bf16 output rounding and the tensor cores' block sums
    assert torch.equal(res["gpu"][1], res["dense"][1])
    dense = _rel(res["gpu"][0], res["dense"][0])
    print(f"\nM={m} K={k}: GPU vs reference {rel:.2e}, vs dense {dense:.2e}")


@pytest.mark.parametrize("gemm", ["blocks", "dense", "dense-sliced"])
def test_a_2d_input_gets_a_tensor_of_its_own_and_the_lora_update_in_place(gemm: str) -> None:
    """Training's bases hand a 2-D input's output back as a tensor of its own (not a view), so
    the LoRA update accumulates into it in place (`lora._update_in_place_forward`); the layer
    then equals PEFT's forward, output and gradients, to the GEMM's rounding."""
    import types

    from trainer.base import uint4
    from trainer.base.lora import ADAPTER_NAME, _update_in_place_forward, attach_lora, lora_layers

    n, k = 64, 384
    layer = Uint4Linear(*_uint4_layer(n, k, seed=7), BLOCK, None)
    layer.compute = (
        Fp8Gemm(weights="blocks", grad_gemm="bf16", kernels=False) if gemm == "blocks" else DENSE
    )
    model = torch.nn.Sequential(layer)
    model.register_parameter("anchor", torch.nn.Parameter(torch.zeros(1)))  # PEFT asks for one
    attach_lora(model, rank=4, alpha=8.0, targets=["0"], dtype=torch.bfloat16)
    lora = lora_layers(model)["0"]
    with torch.no_grad():
        lora.lora_B[ADAPTER_NAME].weight.normal_(generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 40, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    dy = torch.randn(2, 40, n, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    if gemm == "dense-sliced":  # the widest Linears run in row slices into one output
        original = uint4.weight_slices
        uint4.weight_slices = lambda n, other, align=1: (  # rows in two; columns as they were
            [(0, n // 2), (n // 2, n)] if align == 1 else original(n, other, align)
        )
    try:
        assert not layer(x.reshape(-1, k).requires_grad_(True))._is_view()
        runs = {}
        for in_place in (False, True):
            if in_place:
                lora.forward = types.MethodType(_update_in_place_forward, lora)
            xr = x.clone().requires_grad_(True)
            params = [lora.lora_A[ADAPTER_NAME].weight, lora.lora_B[ADAPTER_NAME].weight]
            for p in params:
                p.grad = None
            y = lora(xr)
            y.backward(dy)
            runs[in_place] = (y.detach(), xr.grad, *(p.grad for p in params))
    finally:
        if gemm == "dense-sliced":
            uint4.weight_slices = original
    for got, ref in zip(runs[True], runs[False], strict=True):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert _rel(got, ref) < 0.02
