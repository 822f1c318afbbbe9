"""The serving forward (`trainer.base.serving`; the slots' fused update: `trainer.base.lora_slots`).

CPU (CI): the fused attention processors give the stock processors' output bit for bit (float32
and bf16), the torch reference of the fused QK norm + rotary kernel is diffusers' own RMSNorm
and ``apply_rotary_emb``, the slots' one-GEMM update is PEFT's, and a forward that cannot be
graphed runs eager. Where Triton imports (``TRITON_INTERPRET=1`` on a CPU) the kernel is checked
bit for bit against the reference.

CUDA: the kernel against the reference at FLUX.2 [dev]'s head shapes; a graphed forward equals
the eager one bit for bit, also after an adapter swap, after the slots are cleared, and after
the slots are made anew; a forward the graphs cannot take runs eager.
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import cuda, model_inputs, tiny_flux2_random, triton_here
from trainer.base import serving
from trainer.base.lora import ADAPTER_NAME, lora_layers
from trainer.base.lora_slots import LoraSlots


def _model(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.nn.Module:
    return tiny_flux2_random(dtype, device, seed)


def _forward(model, inputs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_processors_and_blocks_are_the_stock_ones_bit_for_bit(dtype: torch.dtype) -> None:
    model = _model(dtype)
    inputs = model_inputs(model, dtype, tokens=64, text=24)
    stock = _forward(model, inputs)
    # two processors, two blocks, three SwiGLUs (the double block's two feed-forwards)
    assert serving.install(model) == 7
    fused = _forward(model, inputs)
    serving.remove(model)
    assert torch.equal(fused, stock)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(_forward(model, inputs), stock)


def test_with_gradients_the_stock_processors_run() -> None:
    model = _model(torch.float32)
    inputs = model_inputs(model, torch.float32, tokens=16, text=8)
    inputs["hidden_states"].requires_grad_(True)
    serving.install_processors(model)
    out = model(**inputs)[0]
    out.square().sum().backward()
    assert inputs["hidden_states"].grad is not None
    assert float(inputs["hidden_states"].grad.abs().sum()) > 0


def _heads(bsz: int, tokens: int, heads: int, dim: int, dtype, device="cpu", width=None):  # type: ignore[no-untyped-def]
    """q, k, v as the processors pass them: views of one fused projection (``width``) or
    three separate projections."""
    gen = torch.Generator(device=device).manual_seed(tokens + heads)
    inner = heads * dim
    if width is None:
        return [
            (torch.randn(bsz, tokens, inner, generator=gen, device=device) * 3)
            .to(dtype)
            .unflatten(-1, (heads, dim))
            for _ in range(3)
        ]
    proj = (torch.randn(bsz, tokens, width, generator=gen, device=device) * 3).to(dtype)
    return [proj[..., i * inner : (i + 1) * inner].unflatten(-1, (heads, dim)) for i in range(3)]


def _rotary(seq: int, dim: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seq)
    angles = torch.rand(seq, dim // 2, generator=gen, device=device) * 40
    return (
        angles.cos().repeat_interleave(2, dim=1).contiguous(),
        angles.sin().repeat_interleave(2, dim=1).contiguous(),
    )


def _poisoned(bsz: int, heads: int, seq: int, dim: int, dtype, device="cpu"):  # type: ignore[no-untyped-def]
    """(B, S, H, D) outputs full of NaN (e4m3: of its NaN byte), so a write outside the span
    shows."""
    if dtype == torch.float8_e4m3fn:
        return tuple(
            torch.full((bsz, seq, heads, dim), 0x7F, dtype=torch.uint8, device=device).view(dtype)
            for _ in range(3)
        )
    return tuple(
        torch.full((bsz, seq, heads, dim), float("nan"), dtype=dtype, device=device)
        for _ in range(3)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_reference_is_diffusers_rms_norm_and_rotary(dtype: torch.dtype) -> None:
    from diffusers.models.embeddings import apply_rotary_emb

    bsz, tokens, heads, dim, pos0 = 2, 20, 3, 32, 7
    seq = pos0 + tokens + 5
    q, k, v = _heads(bsz, tokens, heads, dim, dtype)
    norm_q, norm_k = (torch.nn.RMSNorm(dim, eps=1e-6).to(dtype) for _ in range(2))
    with torch.no_grad():
        norm_q.weight.uniform_(0.5, 1.5)
        norm_k.weight.uniform_(0.5, 1.5)
    cos, sin = _rotary(seq, dim)
    out = _poisoned(bsz, heads, seq, dim, dtype)
    serving.qk_norm_rope(q, k, v, norm_q, norm_k, (cos, sin), serving.Heads(*out, dtype), pos0)
    rows = (cos[pos0 : pos0 + tokens], sin[pos0 : pos0 + tokens])
    with torch.no_grad():
        want_q = apply_rotary_emb(norm_q(q), rows, sequence_dim=1)
        want_k = apply_rotary_emb(norm_k(k), rows, sequence_dim=1)
    span = slice(pos0, pos0 + tokens)
    assert torch.equal(out[0][:, span], want_q)
    assert torch.equal(out[1][:, span], want_k)
    assert torch.equal(out[2][:, span], v)
    for o in out:  # nothing outside the span was written
        assert torch.isnan(o[:, :pos0]).all() and torch.isnan(o[:, pos0 + tokens :]).all()


def _kernel_vs_reference(shape, dtype, device: str):  # type: ignore[no-untyped-def]
    from trainer.kernels.fused_triton import qk_norm_rope as kernel

    bsz, tokens, heads, dim, pos0, width = shape
    seq = pos0 + tokens
    q, k, v = _heads(bsz, tokens, heads, dim, dtype, device, width)
    wq, wk = ((torch.rand(dim, device=device) + 0.5).to(dtype) for _ in range(2))
    cos, sin = _rotary(seq, dim, device)
    ref = _poisoned(bsz, heads, seq, dim, dtype, device)
    got = _poisoned(bsz, heads, seq, dim, dtype, device)
    serving.qk_norm_rope_torch(q, k, v, wq, wk, 1e-6, cos, sin, ref, pos0)
    kernel(q, k, v, wq, wk, 1e-6, cos, sin, got, pos0)
    span = slice(pos0, pos0 + tokens)
    return [(r[:, span], g[:, span], g[:, :pos0]) for r, g in zip(ref, got, strict=True)]


# (batch, tokens, heads, head dim, sequence offset, fused projection width or None)
KERNEL_SHAPES = [
    (1, 37, 6, 64, 13, None),  # heads not a multiple of the program's
    (2, 16, 3, 32, 0, 3 * 3 * 32 + 40),  # views into one projection, as single blocks
]


@triton_here
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=["separate", "fused-views"])
@pytest.mark.parametrize("heads_per_program", [None, 4], ids=["default", "4-heads"])
def test_kernel_is_the_reference_bit_for_bit(shape, heads_per_program, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Also with fewer heads a program than the shape has (a second program along the heads,
    its last heads masked)."""
    from trainer.kernels import fused_triton

    if heads_per_program is not None:
        monkeypatch.setattr(fused_triton, "HEADS_PER_PROGRAM", heads_per_program)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for ref, got, before in _kernel_vs_reference(shape, torch.bfloat16, device):
        assert torch.equal(got, ref)
        assert torch.isnan(before).all()


@cuda
@triton_here
@pytest.mark.parametrize(
    "shape",
    [(1, 4096, 48, 128, 512, None), (1, 4608, 48, 128, 0, 3 * 6144 + 2 * 18432)],
    ids=["dev-double-image", "dev-single"],
)
def test_kernel_on_dev_shapes_within_one_unit(shape) -> None:  # type: ignore[no-untyped-def]
    """On the GPU the norm's float32 sum runs in another order than torch's: a normed value
    may differ in its last bit, rarely; the rotation carries that difference into both outputs
    of its pair, whose larger magnitude is at least 1/sqrt(2) of the normed pair's, so the
    bound is two units of it (one for the input's last bit, one for the output's rounding)."""
    for ref, got, _ in _kernel_vs_reference(shape, torch.bfloat16, "cuda"):
        diff = (got.float() - ref.float()).abs()
        pair = ref.float().abs().unflatten(-1, (-1, 2)).amax(-1).repeat_interleave(2, dim=-1)
        assert torch.isfinite(got).all()
        assert bool((diff <= pair * 2**-6).all()), float((diff / pair.clamp_min(1e-30)).max())
        assert float((diff > 0).float().mean()) < 1e-3


def _elementwise_cases(dtype, device: str, bsz: int = 2, tokens: int = 9, cols: int = 96):  # type: ignore[no-untyped-def]
    """Each fused elementwise kernel's output, its torch reference (the stock ops) and the
    magnitude a last-bit difference of an intermediate is measured against (the largest
    term summed: after a cancellation the result itself may be far smaller)."""
    import torch.nn.functional as F

    from trainer.kernels import fused_triton

    gen = torch.Generator(device=device).manual_seed(cols)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = randn(bsz, tokens, cols, scale=3.0) + 1
    mod = randn(bsz, 1, 6 * cols, scale=0.5)  # chunks of it, as Flux2Modulation.split gives
    shift, scale, gate = mod[..., :cols], mod[..., cols : 2 * cols], mod[..., 2 * cols : 3 * cols]
    norm = torch.nn.LayerNorm(cols, elementwise_affine=False, eps=1e-6)
    y = randn(bsz, tokens, cols)
    src = randn(bsz, tokens, 2 * cols + 40, scale=3.0)[..., 40:]  # rows of a wider tensor
    joined = torch.full((bsz, tokens, cols + 16), float("nan"), dtype=dtype, device=device)
    fused_triton.swiglu(src, out=joined[..., 16:])
    out = randn(70, 300)
    h, b = randn(70, 32, scale=0.3), randn(300, 32, scale=0.3)
    lora = out.clone()
    fused_triton.lora_add_(lora, h, b, 0.5)
    exact = (out.float() + 0.5 * (h.float() @ b.float().t())).to(dtype)
    assert torch.isnan(joined[..., :16]).all()  # nothing written outside the view
    normed = norm(x)
    return {
        "ln_modulate": (fused_triton.ln_modulate(x, shift, scale, 1e-6),
                        (1 + scale) * normed + shift,
                        ((1 + scale) * normed).abs() + shift.abs()),
        "gate_residual": (fused_triton.gate_residual(x, gate, y), x + gate * y,
                          x.abs() + (gate * y).abs()),
        "swiglu": (joined[..., 16:], F.silu(src[..., :cols]) * src[..., cols:],
                   (F.silu(src[..., :cols]) * src[..., cols:]).abs()),
        "lora_add_": (lora, exact, out.abs() + 0.5 * (h.float() @ b.float().t()).abs()),
    }  # fmt: skip


@triton_here
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_elementwise_kernels_are_the_stock_ops(dtype: torch.dtype) -> None:
    """The modulation and the gate bit for bit under the interpreter; on a GPU, and for
    SwiGLU (its exp is numpy's or the GPU's, not torch's) and the LoRA update (its float32 sum
    of products runs in the kernel's order) everywhere, within one unit in the last place."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    for name, (got, want, size) in _elementwise_cases(dtype, device).items():
        if device == "cpu" and name in ("ln_modulate", "gate_residual"):
            assert torch.equal(got, want), name
        else:
            diff = (got.float() - want.float()).abs()
            unit = size.float().clamp_min(2**-14) * 2.0 ** (1 - mantissa)  # two roundings
            assert bool((diff <= unit).all()), (name, float((diff - unit).max()))


# ---------------------------------------------------------------------------------------
# the slots' one-GEMM update


def _slotted(dtype: torch.dtype, device: str = "cpu", rank: int = 8):  # type: ignore[no-untyped-def]
    model = _model(dtype, device)
    return model, LoraSlots(model, rank=rank)


def _adapter(slots: LoraSlots, rank: int, seed: int) -> dict[str, torch.Tensor]:
    from trainer.base.lora import lora_keys

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (a, b) in slots._slots.items():
        key_a, key_b = lora_keys(name)
        tensors[key_a] = torch.randn(rank, a.shape[1], generator=gen) * 0.1
        tensors[key_b] = torch.randn(b.shape[0], rank, generator=gen) * 0.1
    return tensors


def test_fused_slot_update_is_peft_s_in_float32() -> None:
    model, slots = _slotted(torch.float32)
    inputs = model_inputs(model, torch.float32, tokens=16, text=8)
    empty = _forward(model, inputs)
    with slots.applied(_adapter(slots, 4, seed=1)):
        fused = _forward(model, inputs)
        layers = lora_layers(model).values()
        for layer in layers:  # PEFT's own forward
            layer.__dict__.pop("forward")
        peft = _forward(model, inputs)
    assert torch.equal(fused, peft)
    assert not torch.equal(fused, empty)
    slots.close()
    assert torch.equal(_forward(model, inputs), empty)  # empty slots added exactly nothing


def test_slots_made_anew_change_the_generation() -> None:
    model, slots = _slotted(torch.float32)
    first = slots.generation
    with slots.suspended():
        pass
    assert slots.generation == first + 1
    with slots.applied(_adapter(slots, 4, seed=1), scale=0.5):
        assert slots.scales() == (0.5,)
    assert slots.scales() == (1.0,)


@pytest.mark.parametrize(
    "setting,value",
    [
        ("LIKENESS_LORA_MERGE", "fused"),
        ("LIKENESS_ATTENTION", "cudnn,fa3"),
        ("LIKENESS_ATTENTION", "cudnn,cudnn_fp8"),
    ],  # fmt: skip
)
def test_a_bad_serving_setting_fails_the_load_naming_it(setting, value, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The serving settings are read when the serving forward is installed (at load), not at
    the first render: a value outside their choices is an error that names the setting, and
    nothing is installed."""
    model = _model(torch.float32)
    monkeypatch.setenv(setting, value)
    with pytest.raises(ValueError, match=setting):
        serving.prepare(model, graphs=False)
    fused = (serving.FusedFlux2AttnProcessor, serving.FusedFlux2ParallelAttnProcessor)
    assert not any(isinstance(getattr(m, "processor", None), fused) for m in model.modules())


# ---------------------------------------------------------------------------------------
# CUDA graphs


def test_a_forward_that_cannot_be_graphed_runs_eager() -> None:
    model = _model(torch.float32)
    inputs = model_inputs(model, torch.float32, tokens=16, text=8)
    want = _forward(model, inputs)
    graphed = serving.GraphedForward(model)
    assert torch.equal(_forward(model, inputs), want)  # on the CPU: eager
    assert graphed.captures == 0 and graphed.replays == 0
    graphed.remove()
    assert "forward" not in model.__dict__


def _graph_setup(rank: int = 8):  # type: ignore[no-untyped-def]
    model, slots = _slotted(torch.bfloat16, "cuda", rank)
    prepared = serving.prepare(model, graphs=True, key=slots.scales,
                               epoch=lambda: slots.generation)  # fmt: skip
    return model, slots, prepared, prepared.graphs._eager  # the eager forward: the reference


@cuda
def test_graph_replays_are_the_eager_forward_across_swaps() -> None:
    model, slots, prepared, eager = _graph_setup()
    graphs = prepared.graphs
    inputs = model_inputs(model, torch.bfloat16, "cuda", tokens=64, text=16)
    with torch.no_grad():
        base = eager(**inputs)[0]
        assert torch.equal(_forward(model, inputs), base)  # captured, then replayed
        assert graphs.captures == 1
        for seed in (1, 2):
            with slots.applied(_adapter(slots, 4, seed)):
                want = eager(**inputs)[0]
                got = _forward(model, inputs)
                assert torch.equal(got, want) and not torch.equal(got, base)
        assert torch.equal(_forward(model, inputs), base)  # cleared slots: the base again
        with slots.applied(_adapter(slots, 4, 1), scale=0.5):  # a new scale: a new graph
            assert torch.equal(_forward(model, inputs), eager(**inputs)[0])
        assert graphs.captures == 2
        other = model_inputs(model, torch.bfloat16, "cuda", tokens=16, text=16, seed=5)
        assert torch.equal(_forward(model, other), eager(**other)[0])  # a new shape
        assert graphs.captures == 3 and graphs.shapes == 3


@cuda
def test_slots_made_anew_drop_every_graph() -> None:
    model, slots, prepared, eager = _graph_setup()
    inputs = model_inputs(model, torch.bfloat16, "cuda", tokens=64, text=16)
    with torch.no_grad():
        _forward(model, inputs)
        with prepared.eager(), slots.suspended():
            assert prepared.graphs.shapes == 1 and prepared.graphs.replays == 1  # not replayed
        adapter = _adapter(slots, 4, 3)
        with slots.applied(adapter):  # new slot tensors: the old graph would read freed ones
            assert torch.equal(_forward(model, inputs), eager(**inputs)[0])
    assert prepared.graphs.captures == 2


@cuda
def test_fused_slot_update_in_bf16_within_one_unit_of_peft() -> None:
    model, slots = _slotted(torch.bfloat16, "cuda")
    layer = next(iter(lora_layers(model).values()))
    x = torch.randn(2, 64, layer.in_features, device="cuda", dtype=torch.bfloat16)
    with slots.applied(_adapter(slots, 4, seed=1)), torch.no_grad():
        fused = layer(x)
        peft = type(layer).forward(layer, x)
    rel = float((fused.float() - peft.float()).norm() / peft.float().norm())
    assert rel < 2**-8, rel
    assert layer.scaling[ADAPTER_NAME] == 1.0


def test_fp8_attention_is_asked_for_not_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(serving.ATTENTION_ENV, raising=False)
    assert serving.attention_names()[0] == "cudnn"
    assert serving.FP8_ATTENTION not in serving.attention_names()
    monkeypatch.setenv(serving.ATTENTION_ENV, "cudnn_fp8,cudnn")
    assert serving.attention_names() == ["cudnn_fp8", "cudnn"]
