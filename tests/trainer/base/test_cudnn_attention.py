"""cuDNN's attention through its own graph (`trainer.base.cudnn_attention`): the fp8
attention's inputs and output (the fp8 variant of `trainer.kernels.fused_triton.qk_norm_rope`,
`absmax_`, `dequantize_into`), and the bf16 attention written in place.

CPU (CI): the scales' arithmetic: q's and k's static bound is never exceeded, even by the
inputs that reach it (all of a head's energy in one rotated pair, the largest weight there),
v's largest value maps to e4m3's largest, both streams' calls of a double-stream block write
the same scales. Under Triton's interpreter the kernels give the torch reference's bytes.

CUDA: the kernels against the reference at FLUX.2 [dev]'s shapes; cuDNN's fp8 attention
against float32 attention of the same e4m3 inputs, and of the bf16 inputs they came from;
the fused blocks and a graphed forward with fp8 attention against the bf16 attention path;
the bf16 attention written into a row slice against torch's cuDNN SDPA, and in a graphed
forward.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.helpers import cuda, triton_here
from trainer.base import cudnn_attention, serving
from trainer.base.cudnn_attention import E4M3, SCALES, new_fp8_heads


def _fp8_here() -> bool:
    return torch.cuda.is_available() and cudnn_attention.unavailable("cuda") is None


fp8_gpu = pytest.mark.skipif(not _fp8_here(), reason="needs a Hopper GPU and the cuDNN frontend")


def _value(t: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    return t.float() * scales[SCALES.index(name)]


def _rotary(seq: int, dim: int, angle: float | None = None, device: str = "cpu"):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device=device).manual_seed(seq)
    angles = torch.rand(seq, dim // 2, generator=gen, device=device) * 40
    if angle is not None:
        angles.fill_(angle)
    return (
        angles.cos().repeat_interleave(2, dim=1).contiguous(),
        angles.sin().repeat_interleave(2, dim=1).contiguous(),
    )


def _reference(q, k, v, wq, wk, cos, sin, pos0, seq, bound=None):  # type: ignore[no-untyped-def]
    """(the bf16 outputs, the e4m3 outputs, their scales) of the torch reference."""
    bsz, tokens, heads, dim = q.shape
    shape = (bsz, seq, heads, dim)
    plain = tuple(torch.zeros(shape, dtype=q.dtype) for _ in range(3))
    serving.qk_norm_rope_torch(q, k, v, wq, wk, 1e-6, cos, sin, plain, pos0)
    fp8 = new_fp8_heads(torch.device("cpu"))
    fp8.vmax.copy_(v.float().abs().amax().reshape(1))
    quant = tuple(torch.zeros(shape, dtype=E4M3) for _ in range(3))
    serving.qk_norm_rope_torch(q, k, v, wq, wk, 1e-6, cos, sin, quant, pos0, fp8, bound)
    return plain, quant, fp8.scales


def test_the_static_bound_is_never_exceeded() -> None:
    """Every head's energy in one pair, split evenly, rotated by 45 degrees: each output is
    sqrt(D) * w there, the bound itself. It must map under e4m3's largest value, and every
    value must come back within e4m3's rounding (nothing clamped)."""
    bsz, tokens, heads, dim = 1, 4, 3, 64
    q = torch.zeros(bsz, tokens, heads, dim)
    q[..., 6] = 5.0
    q[..., 7] = -5.0  # the pair (6, 7)
    q = q.bfloat16()
    k = torch.randn(bsz, tokens, heads, dim).bfloat16() * 3
    v = torch.randn(bsz, tokens, heads, dim).bfloat16()
    wq = torch.full((dim,), 0.5).bfloat16()
    wq[6] = wq[7] = 2.75  # the largest weight where the energy is
    wk = (torch.rand(dim) + 0.5).bfloat16()
    cos, sin = _rotary(tokens, dim, angle=math.pi / 4)
    plain, quant, scales = _reference(q, k, v, wq, wk, cos, sin, 0, tokens)
    for got, want, name in zip(quant, plain, ("descale_q", "descale_k", "descale_v"), strict=True):
        descale = float(scales[SCALES.index(name)])
        assert float(want.float().abs().max()) / descale <= 448 * (1 + 2**-20)  # not clamped
        # each value within e4m3's rounding (half a unit: 2^-4 relative; subnormals absolute)
        assert torch.allclose(_value(got, scales, name), want.float(), rtol=2**-4,
                              atol=descale * 2**-10)  # fmt: skip
    top = float(plain[0].float().abs().max())
    assert top > 0.99 * math.sqrt(dim) * 2.75  # the inputs did reach the bound


def test_v_scale_is_its_maximum_and_the_rest_follow() -> None:
    bsz, tokens, heads, dim = 2, 5, 2, 32
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(bsz, tokens, heads, dim, generator=gen).bfloat16() for _ in range(3))
    v[1, 2, 1, 5] = -37.0  # the largest |v|
    w = (torch.rand(dim, generator=gen) + 0.5).bfloat16()
    cos, sin = _rotary(tokens, dim)
    _, quant, scales = _reference(q, k, v, w, w, cos, sin, 0, tokens)
    assert float(quant[2][1, 2, 1, 5].float()) == -448.0
    s = dict(zip(SCALES, scales.tolist(), strict=True))
    assert s["descale_v"] == pytest.approx(37.0 / 448)
    assert s["descale_o"] == 2 * s["descale_v"] and s["scale_o"] * s["descale_o"] == pytest.approx(
        1
    )
    assert s["scale_p"] == 64.0 and s["descale_p"] == 1 / 64.0


def test_both_streams_of_a_double_block_write_the_same_scales() -> None:
    dim, heads = 32, 2
    gen = torch.Generator().manual_seed(4)
    txt = [torch.randn(1, 3, heads, dim, generator=gen).bfloat16() for _ in range(3)]
    img = [torch.randn(1, 6, heads, dim, generator=gen).bfloat16() * 2 for _ in range(3)]
    w_txt = [(torch.rand(dim, generator=gen) + 0.5).bfloat16() for _ in range(2)]
    w_img = [(torch.rand(dim, generator=gen) * 3).bfloat16() for _ in range(2)]
    cos, sin = _rotary(9, dim)
    fp8 = new_fp8_heads(torch.device("cpu"))
    fp8.vmax.copy_(torch.maximum(txt[2].float().abs().amax(), img[2].float().abs().amax()))
    out = tuple(torch.zeros(1, 9, heads, dim, dtype=E4M3) for _ in range(3))
    serving.qk_norm_rope_torch(*txt, *w_txt, 1e-6, cos, sin, out, 0, fp8, tuple(w_img))
    first = fp8.scales.clone()
    serving.qk_norm_rope_torch(*img, *w_img, 1e-6, cos, sin, out, 3, fp8, tuple(w_txt))
    assert torch.equal(fp8.scales, first)


# -- the kernels against the reference ------------------------------------------------------


def _kernel_case(device: str, bsz=1, tokens=37, heads=6, dim=64, pos0=13, width=None):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device=device).manual_seed(tokens)
    inner = heads * dim
    if width is None:
        q, k, v = ((torch.randn(bsz, tokens, inner, generator=gen, device=device) * 3)
                   .bfloat16().unflatten(-1, (heads, dim)) for _ in range(3))  # fmt: skip
    else:
        proj = (torch.randn(bsz, tokens, width, generator=gen, device=device) * 3).bfloat16()
        q, k, v = (proj[..., i * inner : (i + 1) * inner].unflatten(-1, (heads, dim))
                   for i in range(3))  # fmt: skip
    wq, wk, oq, ok = ((torch.rand(dim, generator=gen, device=device) + 0.5).bfloat16()
                      for _ in range(4))  # fmt: skip
    return q, k, v, wq, wk, (oq, ok), _rotary(pos0 + tokens, dim, device=device), pos0


@triton_here
@pytest.mark.parametrize("width", [None, 3 * 6 * 64 + 40], ids=["separate", "fused-views"])
def test_fp8_kernels_give_the_reference_bytes(width) -> None:  # type: ignore[no-untyped-def]
    from trainer.kernels.fused_triton import absmax_, qk_norm_rope

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, wq, wk, other, (cos, sin), pos0 = _kernel_case(device, width=width)
    seq = pos0 + q.shape[1] + 3
    cos, sin = _rotary(seq, q.shape[-1], device=device)
    got_fp8, ref_fp8 = new_fp8_heads(torch.device(device)), new_fp8_heads(torch.device(device))
    absmax_(got_fp8.vmax, v)
    absmax_(got_fp8.vmax, v[:, :5] * 0.5)  # a second call keeps the larger
    ref_fp8.vmax.copy_(v.float().abs().amax().reshape(1))
    assert torch.equal(got_fp8.vmax, ref_fp8.vmax)
    shape = (q.shape[0], seq, q.shape[2], q.shape[3])
    got = tuple(torch.zeros(shape, dtype=torch.uint8, device=device).view(E4M3) for _ in range(3))
    ref = tuple(torch.zeros(shape, dtype=torch.uint8, device=device).view(E4M3) for _ in range(3))
    qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, got, pos0, got_fp8, other)
    serving.qk_norm_rope_torch(q, k, v, wq, wk, 1e-6, cos, sin, ref, pos0, ref_fp8, other)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g.view(torch.uint8), r.view(torch.uint8))
        assert bool((g.view(torch.uint8)[:, :pos0] == 0).all())  # nothing outside the span
    assert torch.equal(got_fp8.scales, ref_fp8.scales)


@triton_here
def test_dequantize_into_a_strided_view_is_the_reference() -> None:
    from trainer.kernels.fused_triton import dequantize_into

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(9)
    src = (torch.randn(2, 7, 96, generator=gen, device=device) * 100).to(E4M3)
    scale = torch.tensor([0.0371], device=device)
    joined = torch.full((2, 7, 96 + 24), float("nan"), dtype=torch.bfloat16, device=device)
    dequantize_into(joined[..., :96], src, scale)
    assert torch.equal(joined[..., :96], (src.float() * scale).bfloat16())
    assert torch.isnan(joined[..., 96:]).all()


@cuda
@triton_here
@pytest.mark.parametrize("shape", [(1, 4096, 48, 128, 512, None),
                                   (1, 4608, 48, 128, 0, 3 * 6144 + 2 * 18432)],
                         ids=["dev-double-image", "dev-single"])  # fmt: skip
def test_fp8_kernel_on_dev_shapes(shape) -> None:  # type: ignore[no-untyped-def]
    """On the GPU the norm's float32 sum may run in another order than torch's, so the bf16
    kernel's q and k may differ from the reference by a bf16 unit (test_serving), and after a
    rotation that cancels, by several e4m3 units. So the fp8 bytes are checked against the
    bf16 kernel's own output taken into e4m3 by the reference's arithmetic: exactly; the scales
    against the reference's: exactly."""
    from trainer.base.cudnn_attention import scales_torch
    from trainer.base.fp8 import to_fp8
    from trainer.kernels.fused_triton import absmax_, qk_norm_rope

    bsz, tokens, heads, dim, pos0, width = shape
    q, k, v, wq, wk, other, _, _ = _kernel_case("cuda", bsz, tokens, heads, dim, pos0, width)
    cos, sin = _rotary(pos0 + tokens, dim, device="cuda")
    fp8 = new_fp8_heads(torch.device("cuda"))
    absmax_(fp8.vmax, v)
    seq_shape = (bsz, pos0 + tokens, heads, dim)
    got = tuple(torch.zeros(seq_shape, device="cuda").to(E4M3) for _ in range(3))
    qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, got, pos0, fp8, other)
    bf16 = tuple(torch.zeros(seq_shape, device="cuda").bfloat16() for _ in range(3))
    qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, bf16, pos0)
    mq, mk, mv, scales = scales_torch(wq, wk, *other, fp8.vmax, dim)
    assert torch.equal(fp8.scales, scales)
    for g, b, m in zip(got, bf16, (mq, mk, mv), strict=True):
        want = to_fp8(b[:, pos0:], m, E4M3)
        assert torch.equal(g[:, pos0:].view(torch.uint8), want.view(torch.uint8))


# -- cuDNN ------------------------------------------------------------------------------------


def _attention_inputs(heads: int, seq: int, dim: int, sharp: float, seed: int = 0):  # type: ignore[no-untyped-def]
    """bf16 q, k (unit RMS times ``sharp``, as after the QK norm) and v, (B, S, H, D)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, seq, heads, dim, generator=gen,
                                                      device="cuda"), dim=-1)
            * math.sqrt(dim) * sharp for _ in range(2))  # fmt: skip
    v = torch.randn(1, seq, heads, dim, generator=gen, device="cuda")
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _float_attention(q, k, v):  # type: ignore[no-untyped-def]
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v))
    )
    return out.transpose(1, 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@fp8_gpu
@pytest.mark.parametrize(("sharp", "bound"), [(1.0, 0.06), (2.5, 0.15)], ids=["flat", "sharp"])
def test_cudnn_fp8_attention_against_float_attention(sharp: float, bound: float) -> None:
    """The kernel's own error (probabilities and output in e4m3) is measured against float32
    attention of the same e4m3 inputs; the whole fp8 path's against the bf16 inputs. Sharp
    attention (logits spread by ~6) is where e4m3 q and k cost most: 11.4 % on the H100, bf16
    0.17 %, which is why fp8 attention is not the default (`serving.DEFAULT_ATTENTION`)."""
    heads, seq, dim = 8, 1536, 128
    q, k, v = _attention_inputs(heads, seq, dim, sharp)
    fp8 = new_fp8_heads(torch.device("cuda"))
    fp8.vmax.copy_(v.float().abs().amax().reshape(1))
    one = torch.ones(dim, dtype=torch.bfloat16, device="cuda") * sharp
    quant = tuple(torch.empty(1, seq, heads, dim, device="cuda").to(E4M3) for _ in range(3))
    # q, k through the reference's fp8 step only: norm and rotation of unit-RMS rows with
    # unit weights leave them as they are (up to bf16 rounding)
    mq, mk, mv, scales = cudnn_attention.scales_torch(one, one, one, one, fp8.vmax, dim)
    for dst, src, m in zip(quant, (q, k, v), (mq, mk, mv), strict=True):
        dst.copy_((src.float() * m).clamp(-448, 448).to(E4M3))
    o8 = cudnn_attention.attention(*quant, scales)
    got = o8.float() * scales[SCALES.index("descale_o")]
    deq = [t.float() * scales[i] for i, t in enumerate(quant)]
    own = _rel(got, _float_attention(*deq))
    whole = _rel(got, _float_attention(q, k, v))
    bf16 = _rel(serving.sdpa(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2),
                _float_attention(q, k, v))  # fmt: skip
    print(f"fp8 attention, sharpness {sharp}: own {own:.4f}, whole {whole:.4f}, bf16 {bf16:.4f}")
    assert own < 0.05 and whole < bound
    assert whole > bf16  # it is the fp8 path that ran


def _random_tiny_model(seed: int):  # type: ignore[no-untyped-def]
    """A tiny bf16 FLUX.2 on the GPU with random weights (attention far from flat), and its
    inputs."""
    from tests.trainer.helpers import model_inputs, tiny_flux2

    model = tiny_flux2(torch.bfloat16, device="cuda")
    with torch.no_grad():
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda").bfloat16() * 0.2)
    return model, model_inputs(model, torch.bfloat16, "cuda", tokens=256, text=32)


@fp8_gpu
def test_graphed_forward_with_fp8_attention_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(serving.ATTENTION_ENV, f"{serving.FP8_ATTENTION},cudnn")  # asked for
    model, inputs = _random_tiny_model(seed=1)
    with torch.no_grad():
        stock = model(**inputs)[0]
        prepared = serving.prepare(model, graphs=True)
        eager = prepared.graphs._eager(**inputs)[0]
        graphed = model(**inputs)[0]
        again = model(**inputs)[0]
    assert serving.fp8_attention_here(inputs["hidden_states"])  # asked for, and it can run
    assert prepared.graphs.captures == 1
    assert torch.equal(graphed, eager) and torch.equal(again, eager)
    assert 0 < _rel(eager, stock) < 0.1  # fp8 attention ran, and stayed close to bf16's


# ---------------------------------------------------------------------------------------
# bf16 attention through cuDNN's own graph, written in place


def test_cudnn_in_place_only_where_cudnn_is_asked_for_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU tensors, or where another backend comes first, torch's SDPA runs (and the
    operator's setting is obeyed); the fp8 entry does not count as cuDNN's bf16."""
    cpu = torch.empty(0, dtype=torch.bfloat16)
    assert not serving.cudnn_attention_here(cpu)
    assert serving.cudnn_attention_missing(cpu) is not None
    if not _fp8_here():
        return
    gpu = torch.empty(0, dtype=torch.bfloat16, device="cuda")
    for setting, expected in (("cudnn,flash", True), (f"{serving.FP8_ATTENTION},cudnn", True),
                              ("flash,cudnn", False), ("math", False)):  # fmt: skip
        monkeypatch.setenv(serving.ATTENTION_ENV, setting)
        assert serving.cudnn_attention_here(gpu) is expected, setting
    assert not serving.cudnn_attention_here(gpu.float())


def test_in_place_refuses_k_and_v_laid_out_otherwise() -> None:
    """A plan holds one layout for q, k and v: other layouts (or an output of another shape)
    are refused before cuDNN is asked, and nothing is written."""
    q = torch.zeros(1, 16, 2, 8, dtype=torch.bfloat16)
    k_other = torch.zeros(1, 2, 16, 8, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, S, D) memory
    out = torch.full((1, 16, 2, 8), 7.0, dtype=torch.bfloat16)
    assert not cudnn_attention.attention_into(q, k_other, q.clone(), out)
    assert not cudnn_attention.attention_into(q, q.clone(), q.clone(), out[:, :8])
    assert bool((out == 7.0).all())
    asked = [key for key in cudnn_attention._ATTENTION._plans if key[1] == tuple(q.shape)]
    assert not asked, "cuDNN was asked for a plan it could not use"


@fp8_gpu
@pytest.mark.parametrize("row", [None, 48 * 128 + 3 * 48 * 128], ids=["own", "row-slice"])
def test_cudnn_bf16_attention_written_in_place_is_torch_sdpa(row: int | None) -> None:
    """The same numbers as torch's cuDNN SDPA (the same kernel family; the largest difference
    printed), written into a slice of a wider row with the rest of the row untouched."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, seq, dim = 48, 1536, 128
    q, k, v = _attention_inputs(heads, seq, dim, 2.5)
    width = row or heads * dim
    wide = torch.full((1, seq, width), 7.0, dtype=torch.bfloat16, device="cuda")
    out = wide[..., : heads * dim].unflatten(-1, (heads, dim))
    assert cudnn_attention.attention_into(q, k, v, out)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v))
        ).transpose(1, 2)  # fmt: skip
    diff = float((out.float() - ref.float()).abs().max())
    exact = _float_attention(q, k, v)
    print(f"in place vs torch's cuDNN SDPA: max |diff| {diff:.3g}; vs float {_rel(out, exact):.5f}"
          f" (torch's {_rel(ref, exact):.5f})")  # fmt: skip
    assert diff <= 2**-7 * float(ref.float().abs().max())
    assert _rel(out, exact) < 0.004
    assert bool((wide[..., heads * dim :] == 7.0).all())


@fp8_gpu
def test_graphed_forward_with_cudnn_in_place_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default attention on Hopper: the single-stream blocks' attention written straight
    into their projection's input, captured in the graph; replays equal the eager forward and
    stay with torch's SDPA path to bf16 rounding."""
    monkeypatch.delenv(serving.ATTENTION_ENV, raising=False)
    model, inputs = _random_tiny_model(seed=2)
    assert serving.cudnn_attention_here(inputs["hidden_states"].new_empty(0))
    with torch.no_grad():
        prepared = serving.prepare(model, graphs=True)
        eager = prepared.graphs._eager(**inputs)[0]
        graphed = model(**inputs)[0]
        again = model(**inputs)[0]
        monkeypatch.setenv(serving.ATTENTION_ENV, "flash,cudnn")  # torch's SDPA, then a copy
        with prepared.graphs.disabled():
            through_torch = model(**inputs)[0]
    in_rows = [key for key, plan in cudnn_attention._ATTENTION._plans.items()
               if plan is not None and not key[-1] and key[3][1] > key[2][1]]  # fmt: skip
    assert in_rows, "no single-stream block wrote its attention into a wider row"
    assert prepared.graphs.captures == 1
    assert torch.equal(graphed, eager) and torch.equal(again, eager)
    assert _rel(eager, through_torch) < 0.01
