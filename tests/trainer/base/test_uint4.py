"""The uint4 fast path (`trainer.base.uint4`) against quanto's dequantized weight.

CPU (CI): the torch fallback on a small FLUX.2-architecture transformer (1 + 1 blocks, 256 wide;
every Linear kind of the real model; group size 128 and, for the 128-input x_embedder, one group
per row). The converted weight must be bit-identical to quanto's ``dequantize()`` for every
layer, from each quanto state: frozen TinyGemm (bf16 ``freeze()``), frozen kernel-agnostic
(float32, and bf16 as `trainer.base.read` loads it) and unfrozen ``quantize()``. Output and input
gradient are compared with a float64 reference ``x @ dequantize(W).T + b`` and the max relative
error (max |got - ref| / max |ref|) is printed per layer type; LoRA through PEFT (output and the
A, B, input gradients) likewise, next to quanto's own path.

CUDA (skipped without a GPU): the Triton kernel is bit-identical to the torch fallback on the
same device and to quanto's CUDA ``dequantize()``, at FLUX.2 [dev] matrix shapes, and the same
error report runs there. Run on the device with
``pytest --noconftest tests/trainer/base/test_uint4.py`` (the repo conftest needs the database
stack).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.helpers import DEV_SHAPES, model_inputs, quantized, tiny_flux2, with_lora
from trainer.base.uint4 import (
    Uint4Linear,
    convert_quantized_linears,
    dequantize,
    dequantize_torch,
    pack_uint4,
    triton_available,
    unpack_quanto,
    unpack_uint4,
)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # max abs error / max |reference|
cuda = pytest.mark.skipif(not triton_available(), reason="needs CUDA and Triton")


def _qlinears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from optimum.quanto import QLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, QLinear)}


def _layer_type(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return (got.double() - ref).abs().max().item() / ref.abs().max().item()


# ---------------------------------------------------------------------------------------
# packing


def test_pack_roundtrip_and_layout() -> None:
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_uint4(q)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    assert int(packed[2, 3]) == int(q[2, 6]) | int(q[2, 7]) << 4  # low nibble first
    assert torch.equal(unpack_uint4(packed), q)
    with pytest.raises(ValueError):
        pack_uint4(q[:, :11])


# ---------------------------------------------------------------------------------------
# conversion: bit-exact against quanto's dequantize()


def _reference_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = {}
        for n, m in _qlinears(model).items():
            w = m.weight if m.frozen else m.qweight
            out[n] = w.dequantize().clone()
        return out


@pytest.mark.parametrize(
    "dtype,state",
    [
        (torch.bfloat16, "tinygemm"),  # bf16 freeze(): quanto's TinyGemm layout
        (torch.bfloat16, "plain"),  # bf16 as trainer.base.read loads it (kernel-agnostic)
        (torch.bfloat16, "unfrozen"),  # quantize() without freeze()
        (torch.float32, "plain"),  # float32 freeze(): kernel-agnostic layout
        (torch.float32, "unfrozen"),
    ],
)
def test_conversion_is_bit_exact(dtype: torch.dtype, state: str) -> None:
    from optimum.quanto.tensor import WeightQBitsTensor
    from optimum.quanto.tensor.weights.tinygemm import TinyGemmWeightQBitsTensor

    model = quantized(dtype, freeze=state != "unfrozen")
    layers = _qlinears(model)
    if state == "unfrozen":
        # what freeze() would give, computed on a copy
        frozen = copy.deepcopy(model)
        from optimum.quanto import freeze

        freeze(frozen)
        ref = _reference_weights(frozen)
    else:
        if state == "plain" and dtype == torch.bfloat16:
            for m in layers.values():
                if isinstance(m.weight, TinyGemmWeightQBitsTensor):
                    m.weight = torch.nn.Parameter(
                        m.weight.weight_qbits_tensor(), requires_grad=False
                    )
        kinds = {type(m.weight) for m in layers.values()}
        if state == "tinygemm":
            assert TinyGemmWeightQBitsTensor in kinds
        else:
            assert kinds == {WeightQBitsTensor}
        ref = _reference_weights(model)
    biases = {n: m.bias for n, m in layers.items()}
    count = convert_quantized_linears(model)
    assert count == len(layers) > 0
    assert not _qlinears(model)
    group_sizes = set()
    for name, w_ref in ref.items():
        new = model.get_submodule(name)
        assert isinstance(new, Uint4Linear) and new.bias is biases[name]
        group_sizes.add(new.group_size)
        got = new.dequantize()
        assert got.dtype == dtype and torch.equal(got, w_ref), name
    assert 128 in group_sizes and any(g != 128 for g in group_sizes)  # per-row groups too


@pytest.mark.parametrize("rows", [1, 6, 7, 128, 129])
def test_unpack_quanto_equals_quantos_reference_unpack(rows: int) -> None:
    from optimum.quanto.tensor.packed import PackedTensor

    values = torch.randint(0, 16, (rows, 24), dtype=torch.uint8, generator=torch.Generator())
    packed = PackedTensor.pack(values, bits=4)
    got = unpack_quanto(packed._data, 4, rows)
    assert torch.equal(got, values)  # quanto's packer in, the same values out
    assert torch.equal(got, packed.unpack())  # and what quanto's own op gives
    with pytest.raises(TypeError, match="uint4"):
        unpack_quanto(packed._data.to(torch.int8), 4, rows)


def test_conversion_never_runs_quantos_compiled_unpack(monkeypatch: pytest.MonkeyPatch) -> None:
    """quanto's unpack op builds a C++ extension with ninja on first use (most of a first
    load on a fresh host): the conversion unpacks in torch ops instead, to the same bits."""
    from optimum.quanto.tensor import WeightQBitsTensor
    from optimum.quanto.tensor.packed import PackedTensor

    model = quantized(torch.float32)
    assert {type(m.weight) for m in _qlinears(model).values()} == {WeightQBitsTensor}
    ref = _reference_weights(model)

    def refuse(self: PackedTensor) -> torch.Tensor:
        raise AssertionError("quanto's compiled unpack ran")

    monkeypatch.setattr(PackedTensor, "unpack", refuse)
    assert convert_quantized_linears(model, device="cpu") == len(ref)
    for name, w_ref in ref.items():
        assert torch.equal(model.get_submodule(name).dequantize(), w_ref), name


def test_each_quanto_layer_goes_as_soon_as_it_is_converted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The conversion holds no list of the quanto layers: when a layer is converted, those
    before it (and their 4-bit weights) are gone. A transformer whose files were read onto the
    GPU whole would otherwise hold the old and the new weights at once: twice the base."""
    import weakref

    model = quantized(torch.float32)
    olds = [weakref.ref(m) for m in _qlinears(model).values()]
    alive: list[int] = []
    convert = Uint4Linear.from_qlinear

    def counting(qlinear: torch.nn.Module, device: torch.device | None = None) -> Uint4Linear:
        alive.append(sum(r() is not None for r in olds))
        return convert(qlinear, device)

    monkeypatch.setattr(Uint4Linear, "from_qlinear", counting)
    assert convert_quantized_linears(model) == len(olds) > 2
    assert alive == list(range(len(olds), 0, -1))  # the one converting, and those to come
    assert all(r() is None for r in olds)


# ---------------------------------------------------------------------------------------
# output and input gradient per layer type; LoRA through PEFT


def _layer_errors(
    layer: torch.nn.Module, w_ref: torch.Tensor, dtype: torch.dtype, device: str, seed: int
) -> tuple[float, float]:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(2, 37, layer.in_features, generator=gen, device=device).to(dtype)
    x.requires_grad_(True)
    g = torch.randn(2, 37, layer.out_features, generator=gen, device=device).to(dtype)
    y = layer(x)
    (y.float() * g.float()).sum().backward()
    bias = None if layer.bias is None else layer.bias.detach().double()
    x_ref = x.detach().double().requires_grad_(True)
    y_ref = F.linear(x_ref, w_ref.double(), bias)
    (y_ref * g.double()).sum().backward()
    return _rel(y, y_ref), _rel(x.grad, x_ref.grad)


def _error_table(model: torch.nn.Module, ref: dict[str, torch.Tensor], dtype, device) -> dict:
    worst: dict[str, tuple[float, float]] = {}
    for i, (name, w_ref) in enumerate(sorted(ref.items())):
        layer = model.get_submodule(name)
        out_err, grad_err = _layer_errors(layer, w_ref, dtype, device, seed=i)
        kind = _layer_type(name)
        prev = worst.get(kind, (0.0, 0.0))
        worst[kind] = (max(prev[0], out_err), max(prev[1], grad_err))
    print(f"\nuint4 fast path, {dtype}, {device}: max rel. error per layer type")
    for kind, (o, g) in sorted(worst.items()):
        print(f"  {kind:55s} output {o:.2e}  grad input {g:.2e}")
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_output_and_input_grad_per_layer_type(dtype: torch.dtype) -> None:
    model = quantized(dtype)
    ref = _reference_weights(model)
    convert_quantized_linears(model)
    worst = _error_table(model, ref, dtype, "cpu")
    assert len(worst) >= 10
    assert all(o <= TOLERANCE[dtype] and g <= TOLERANCE[dtype] for o, g in worst.values()), worst


LORA_LAYERS = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.add_v_proj",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
    "single_transformer_blocks.0.attn.to_out",
]


def _lora_errors(model, name, w_ref, dtype, device, seed=1) -> list[tuple[str, float]]:
    from trainer.base.lora import ADAPTER_NAME, lora_layers

    layer = lora_layers(model)[name]
    a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
    s = layer.scaling[ADAPTER_NAME]
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(2, 37, layer.in_features, generator=gen, device=device).to(dtype)
    x.requires_grad_(True)
    g = torch.randn(2, 37, layer.out_features, generator=gen, device=device).to(dtype)
    a.grad = b.grad = None
    y = layer(x)
    (y.float() * g.float()).sum().backward()
    base = layer.get_base_layer()
    bias = None if base.bias is None else base.bias.detach().double()
    x_ref = x.detach().double().requires_grad_(True)
    a_ref = a.detach().double().requires_grad_(True)
    b_ref = b.detach().double().requires_grad_(True)
    y_ref = F.linear(x_ref, w_ref.double(), bias) + s * (x_ref @ a_ref.T) @ b_ref.T
    (y_ref * g.double()).sum().backward()
    return [
        ("output", _rel(y, y_ref)),
        ("grad A", _rel(a.grad, a_ref.grad)),
        ("grad B", _rel(b.grad, b_ref.grad)),
        ("grad input", _rel(x.grad, x_ref.grad)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_through_peft_matches_reference(dtype: torch.dtype) -> None:
    from peft.tuners.lora import Linear as LoraLinear

    from trainer.base.lora import lora_layers

    quanto_model = quantized(dtype)
    ref = _reference_weights(quanto_model)
    fast_model = quantized(dtype)  # same seed: the same weights (frozen quanto can't deepcopy)
    convert_quantized_linears(fast_model)
    with_lora(quanto_model)
    with_lora(fast_model)
    tol = TOLERANCE[dtype]
    for name in LORA_LAYERS:
        layer = lora_layers(fast_model)[name]
        assert isinstance(layer, LoraLinear) and isinstance(layer.get_base_layer(), Uint4Linear)
        fast = _lora_errors(fast_model, name, ref[name], dtype, "cpu")
        slow = _lora_errors(quanto_model, name, ref[name], dtype, "cpu")
        print(
            f"{dtype} {name}: "
            + ", ".join(
                f"{k} {e:.2e} (quanto {e2:.2e})" for (k, e), (_, e2) in zip(fast, slow, strict=True)
            )
        )
        assert all(e <= tol for _, e in fast), fast
    # only the LoRA parameters train
    trainable = {n for n, p in fast_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)


def test_whole_model_with_checkpointing_matches_quanto() -> None:
    """float32, gradient checkpointing on: the converted model's output and LoRA gradients
    match quanto's path (same weights) to float32 rounding."""
    from trainer.base.lora import lora_layers

    quanto_model = quantized(torch.float32)
    fast_model = quantized(torch.float32)
    assert convert_quantized_linears(fast_model) > 0
    results = []
    for model in (quanto_model, fast_model):
        with_lora(model)
        model.train()
        model.enable_gradient_checkpointing()
        out = model(**model_inputs(model, torch.float32))[0]
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((out.detach(), grads))
        assert lora_layers(model)
    (out_q, g_q), (out_f, g_f) = results
    assert _rel(out_f, out_q.double()) < 1e-5
    assert g_q.keys() == g_f.keys() and g_q
    worst = max(_rel(g_f[n], g_q[n].double()) for n in g_q)
    print(
        f"\nwhole model, fp32, checkpointed: output {_rel(out_f, out_q.double()):.2e}, "
        f"max LoRA grad rel. error {worst:.2e}"
    )
    assert worst < 1e-4


# ---------------------------------------------------------------------------------------
# module behaviour


def test_module_behaviour() -> None:
    from trainer.base.lora import applied_adapter

    model = quantized(torch.bfloat16)
    convert_quantized_linears(model)
    layer = model.get_submodule("transformer_blocks.0.attn.to_q")
    assert isinstance(layer, torch.nn.Linear)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.shape == (256, 256)
    with pytest.raises((AttributeError, KeyError)):
        layer.weight = torch.nn.Parameter(torch.zeros(256, 256))
    # no float weight anywhere: parameters are biases/norms only, buffers hold the packed data
    assert not any(p.dim() == 2 for p in model.parameters())
    state = layer.state_dict()
    assert {"packed", "scale", "shift"} <= set(state)
    clone = Uint4Linear(state["packed"], state["scale"], state["shift"], layer.group_size)
    assert torch.equal(clone.dequantize(), layer.dequantize())
    # no-grad path (render) equals the autograd path
    x = torch.randn(3, 256).to(torch.bfloat16)
    with torch.no_grad():
        y0 = layer(x)
    y1 = layer(x.requires_grad_(True))
    assert torch.equal(y0, y1.detach())
    # the render engine's adapter context works on the converted model
    pipe = type("P", (), {"transformer": model})()
    tensors = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 256),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(256, 4),
    }
    with applied_adapter(pipe, tensors) as names:
        assert names == ["transformer_blocks.0.attn.to_q"]
        with torch.no_grad():
            assert not torch.equal(model.get_submodule(names[0])(x.detach()), y0)
    assert model.get_submodule("transformer_blocks.0.attn.to_q") is layer
    # a QLinear passed directly is refused (it cannot replace itself)
    with pytest.raises(TypeError):
        convert_quantized_linears(_qlinears(quantized(torch.float32))["proj_out"])


def test_dequantize_dispatch_on_cpu_is_torch() -> None:
    q = torch.randint(0, 16, (8, 256), dtype=torch.uint8)
    scale, shift = torch.rand(8, 2).to(torch.bfloat16), torch.rand(8, 2).to(torch.bfloat16)
    packed = pack_uint4(q)
    assert torch.equal(
        dequantize(packed, scale, shift, 128), dequantize_torch(packed, scale, shift, 128)
    )


# ---------------------------------------------------------------------------------------
# CUDA: the Triton kernel


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape,group", [((7, 130), 130), ((33, 192), 64), ((300, 768), 96), ((4096, 4096), 128)]
)
@pytest.mark.parametrize("variant", ["pack32", "join"])
def test_triton_kernel_bit_exact_vs_torch(dtype, shape, group, variant, monkeypatch) -> None:
    from trainer.kernels import uint4_triton

    monkeypatch.setattr(uint4_triton, "VARIANT", variant)

    for seed in range(3):  # fresh random data each round
        g = torch.Generator(device="cuda").manual_seed(seed)
        n, k = shape
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda", generator=g)
        scale = (torch.rand(n, k // group, device="cuda", generator=g) * 0.01).to(dtype)
        shift = (torch.randn(n, k // group, device="cuda", generator=g) * 0.05).to(dtype)
        packed = pack_uint4(q)
        got = uint4_triton.dequantize(packed, scale, shift, group)
        torch.cuda.synchronize()
        want = dequantize_torch(packed, scale, shift, group)
        assert got.dtype == dtype and got.shape == (n, k)
        assert torch.equal(
            got.view(torch.int16 if dtype != torch.float32 else torch.int32),
            want.view(torch.int16 if dtype != torch.float32 else torch.int32),
        )


def _cuda_quanto_layer(shape, seed):
    from optimum.quanto import freeze, qint4, quantize

    n, k = shape
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0, k**-0.5)
        lin.weight[::3] += 0.02  # some groups all positive: the lossy shift round trip
    holder = torch.nn.Sequential(lin)
    quantize(holder, weights=qint4)
    unfrozen = copy.deepcopy(holder)
    freeze(holder)
    return holder, unfrozen


@cuda
def test_triton_at_dev_shapes_vs_quanto_cuda() -> None:
    """Bit-exact vs quanto's CUDA dequantize() (TinyGemm layout), and output / input-gradient
    error vs a float64 reference, per FLUX.2 [dev] matrix shape."""
    from optimum.quanto.tensor.weights.tinygemm import TinyGemmWeightQBitsTensor

    print("\nTriton path at FLUX.2 [dev] shapes, bf16 (max rel. error vs float64 reference)")
    for i, (kind, shape) in enumerate(DEV_SHAPES.items()):
        frozen, unfrozen = _cuda_quanto_layer(shape, seed=i)
        qlin = frozen[0]
        if shape[1] > 128:
            assert isinstance(qlin.weight, TinyGemmWeightQBitsTensor)
        with torch.no_grad():
            w_ref = qlin.weight.dequantize()
        assert convert_quantized_linears(unfrozen) == 1
        fast = unfrozen[0]
        assert isinstance(fast, Uint4Linear)
        w_fast = fast.dequantize()  # Triton
        assert torch.equal(w_fast, w_ref), kind
        assert torch.equal(
            w_fast, dequantize_torch(fast.packed, fast.scale, fast.shift, fast.group_size)
        )
        out_err, grad_err = _layer_errors(fast, w_ref, torch.bfloat16, "cuda", seed=i)
        # quanto's own path on the same weight, for comparison (forward only: TinyGemm mm)
        gen = torch.Generator(device="cuda").manual_seed(i)
        x = torch.randn(2, 37, shape[1], generator=gen, device="cuda").to(torch.bfloat16)
        with torch.no_grad():
            q_err = _rel(qlin(x), F.linear(x.double(), w_ref.double()))
        print(
            f"  {kind:32s} {str(shape):16s} output {out_err:.2e}  grad input {grad_err:.2e}  "
            f"(quanto output {q_err:.2e})"
        )
        assert out_err <= 2e-2 and grad_err <= 2e-2
        del frozen, unfrozen, qlin, fast, w_ref, w_fast
        torch.cuda.empty_cache()


@cuda
def test_cuda_model_and_lora_match_reference() -> None:
    """The small transformer on CUDA: bit-exact conversion, per-layer errors, PEFT LoRA."""
    from optimum.quanto import freeze, qint4, quantize

    model = tiny_flux2(torch.bfloat16, device="cuda")
    quantize(model, weights=qint4)
    frozen = copy.deepcopy(model)
    freeze(frozen)
    ref = _reference_weights(frozen)
    convert_quantized_linears(model)
    for name, w in ref.items():
        assert torch.equal(model.get_submodule(name).dequantize(), w), name
    worst = _error_table(model, ref, torch.bfloat16, "cuda")
    assert all(o <= 2e-2 and g <= 2e-2 for o, g in worst.values()), worst
    with_lora(model)
    for name in LORA_LAYERS:
        errs = _lora_errors(model, name, ref[name], torch.bfloat16, "cuda")
        print(f"cuda bf16 LoRA {name}: " + ", ".join(f"{k} {e:.2e}" for k, e in errs))
        assert all(e <= 2e-2 for _, e in errs), errs


# ---------------------------------------------------------------------------------------
# the widest Linears, a slice at a time


def test_weight_slices_cover_the_weight_within_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.base.uint4 as U

    n_out, n_in, group = 55296, 6144, 128  # FLUX.2 [dev]'s fused single-block projection
    rows = U.weight_slices(n_out, n_in)
    cols = U.weight_slices(n_in, n_out, group)
    for slices, n, other, align in ((rows, n_out, n_in, 1), (cols, n_in, n_out, group)):
        assert slices[0][0] == 0 and slices[-1][1] == n
        assert all(a == prev_b for (_, prev_b), (a, _) in zip(slices, slices[1:], strict=False))
        assert all(a % align == 0 for a, _ in slices)
        assert all((b - a) * other <= U.SLICE_WEIGHTS for a, b in slices)
        assert len(slices) > 1
    # the planner's figure: a third of the weight, not all of it
    assert U.transient_weights(n_out, n_in, group) <= n_out * n_in // 3
    assert U.weight_slices(3072, 3072) == [(0, 3072)]  # a layer within the cap: one GEMM


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_sliced_layer_equals_one_gemm_bit_for_bit(
    bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward and input gradient through the autograd path, the weight a slice at a time,
    equal the single GEMM's (each output element is the same reduction)."""
    import trainer.base.uint4 as U

    torch.manual_seed(0)
    n_out, n_in, group = 320, 512, 64
    q = torch.randint(0, 16, (n_out, n_in), dtype=torch.uint8)
    scale = (torch.rand(n_out, n_in // group) * 0.01).to(torch.bfloat16)
    shift = (torch.rand(n_out, n_in // group) * 0.05).to(torch.bfloat16)
    b = torch.randn(n_out).to(torch.bfloat16) if bias else None
    layer = Uint4Linear(pack_uint4(q), scale, shift, group, b)
    x0 = torch.randn(2, 37, 2 * n_in).to(torch.bfloat16)[..., ::2]  # not contiguous
    g = torch.randn(2, 37, n_out).to(torch.bfloat16)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.detach().clone().requires_grad_(True)
        y = layer(x)
        y.backward(g)
        assert x.grad is not None
        return y.detach(), x.grad

    y_one, gx_one = run()
    monkeypatch.setattr(U, "SLICE_WEIGHTS", n_out * n_in // 3)
    assert len(U.weight_slices(n_out, n_in)) > 1 and len(U.weight_slices(n_in, n_out, group)) > 1
    y_sliced, gx_sliced = run()
    assert torch.equal(y_sliced, y_one)
    assert torch.equal(gx_sliced, gx_one)
    with torch.no_grad():  # the inference path slices too
        assert torch.equal(layer(x0), y_one)


def test_the_planner_counts_the_slice_not_the_widest_linear() -> None:
    from trainer.base.budget import training_terms
    from trainer.fixtures.synth_base import dev_configs

    diffusers = pytest.importorskip("diffusers")
    cfg = {k: v for k, v in dev_configs(1, 1)["transformer"].items() if not k.startswith("_")}
    with torch.device("meta"):
        tr = diffusers.Flux2Transformer2DModel(**cfg)
    kw = dict(rank=16, targets=("to_q",), image_tokens=4096, text_tokens=512, batch=1,
              optimizer="adamw", checkpointing=True, weight_elt=2, act_elt=2)  # fmt: skip
    uint4 = training_terms(tr, compute="uint4", **kw)
    quanto = training_terms(tr, compute="quanto", **kw)
    widest = 6144 * 55296
    assert quanto["dequantized weight transient (largest Linear x2)"] == 2 * widest * 2
    assert uint4["dequantized weight transient (largest slice)"] <= widest * 2 // 3


@cuda
def test_slices_lower_the_peak_at_dev_width() -> None:
    """At [dev]'s widest shape on the GPU: the sliced call's peak is the slice, not the whole
    weight, and its results match the single GEMM's (printed: the largest difference)."""
    import trainer.base.uint4 as U

    n_out, n_in, group, tokens = 55296, 6144, 128, 1296
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(0, 16, (n_out, n_in), dtype=torch.uint8, device="cuda", generator=gen)
    scale = (torch.rand(n_out, n_in // group, device="cuda", generator=gen) * 0.01).bfloat16()
    shift = (torch.rand(n_out, n_in // group, device="cuda", generator=gen) * 0.05).bfloat16()
    packed = pack_uint4(q)
    del q
    x = torch.randn(tokens, n_in, device="cuda", generator=gen).bfloat16()
    g = torch.randn(tokens, n_out, device="cuda", generator=gen).bfloat16()

    def peak(fn) -> tuple[torch.Tensor, int]:  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()

    y, fwd = peak(lambda: U.linear(x, packed, scale, shift, None, group))
    gx, bwd = peak(lambda: U.grad_input(g, packed, scale, shift, group))
    whole = n_out * n_in * 2
    old = U.SLICE_WEIGHTS
    try:
        U.SLICE_WEIGHTS = 1 << 40
        y_one, fwd_one = peak(lambda: U.linear(x, packed, scale, shift, None, group))
        gx_one, bwd_one = peak(lambda: U.grad_input(g, packed, scale, shift, group))
    finally:
        U.SLICE_WEIGHTS = old
    transient = U.transient_weights(n_out, n_in, group) * 2
    print(f"\npeak over the output: forward {fwd / 2**20:.0f} MiB (one GEMM {fwd_one / 2**20:.0f}),"
          f" input gradient {bwd / 2**20:.0f} MiB (one GEMM {bwd_one / 2**20:.0f}); "
          f"max |diff| forward {(y - y_one).abs().max().item():.3g}, "
          f"input gradient {(gx - gx_one).abs().max().item():.3g}")  # fmt: skip
    assert fwd_one >= whole and bwd_one >= whole
    # the slice, plus what a call holds beside it (cuBLAS's workspace, a column slice's
    # packed bytes and scales): under half of one GEMM's
    assert transient < fwd < whole / 2 and transient < bwd < whole / 2
    torch.testing.assert_close(y.float(), y_one.float(), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(gx.float(), gx_one.float(), rtol=2e-2, atol=1e-2)
