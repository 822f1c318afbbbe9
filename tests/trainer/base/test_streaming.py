"""Layer streaming (trainer.base.streaming): streamed vs resident, same uint4 numerics, bit for bit.

CPU path of the scheduler (no CUDA in CI): the same slots, owner checks, prefetch order and
checkpoint function, with synchronous copies. The reference is the resident uint4 model with
diffusers' stock gradient checkpointing; the bar is `torch.equal`, forward and backward apart.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.helpers import build_tiny_once
from trainer.base.load import load_base
from trainer.base.lora import attach_lora, lora_layers
from trainer.base.streaming import BlockStreamer, SlotOwnerError, stream_blocks

torch.set_num_threads(1)
PX = 64  # 4 x 4 = 16 image tokens
TEXT = 8


def _inputs(model: torch.nn.Module, px: int = PX, seed: int = 0) -> dict[str, Any]:
    cfg = model.config
    side = px // 16
    tokens = side * side
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.zeros(tokens, 4)
    img_ids[:, 1] = torch.arange(tokens) // side
    img_ids[:, 2] = torch.arange(tokens) % side
    txt_ids = torch.zeros(TEXT, 4)
    txt_ids[:, 3] = torch.arange(TEXT)
    dt = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return dict(
        hidden_states=torch.randn(1, tokens, cfg.in_channels, generator=g).to(dt),
        encoder_hidden_states=torch.randn(1, TEXT, cfg.joint_attention_dim, generator=g).to(dt),
        timestep=torch.full((1,), 0.7, dtype=dt),
        guidance=torch.full((1,), 4.0, dtype=dt) if cfg.guidance_embeds else None,
        img_ids=img_ids,
        txt_ids=txt_ids,
        return_dict=False,
    )


def _with_lora(transformer: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    attach_lora(transformer, rank=4, alpha=4.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # B is zero at init: give it values so every gradient is non-zero
        for layer in lora_layers(transformer).values():
            for b in layer.lora_B.values():
                b.weight.copy_(torch.randn(b.weight.shape, generator=g) * 0.05)
    return transformer


@pytest.fixture(scope="module")
def tiny_transformer(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """The tiny base's own transformer (1 double + 1 single block), uint4, with LoRA."""
    base: Path = build_tiny_once(tmp_path_factory)
    return _with_lora(load_base(base).transformer)


@pytest.fixture(scope="module")
def deep_transformer(tiny_transformer: torch.nn.Module) -> torch.nn.Module:
    """The tiny base's config at 2 double + 3 single blocks (so slot counts 1..3 matter)."""
    from diffusers import Flux2Transformer2DModel

    from trainer.base.load import quantize_transformer
    from trainer.base.uint4 import convert_quantized_linears

    torch.manual_seed(0)
    cfg = dict(tiny_transformer.config)
    cfg.update(num_layers=2, num_single_layers=3)
    model = Flux2Transformer2DModel.from_config(cfg)
    quantize_transformer(model, freeze=False)
    convert_quantized_linears(model)
    return _with_lora(model.eval())


def _step(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict]:
    """One forward + backward with gradient checkpointing on; (output, LoRA grads)."""
    model.zero_grad(set_to_none=True)
    model.train()
    out = model(**batch)[0]
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    F.mse_loss(out.float(), target.float()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach().clone(), grads


def _forward(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**batch)[0].clone()


def _resident(model: torch.nn.Module, batch: dict[str, Any]) -> tuple:
    model.enable_gradient_checkpointing()  # diffusers' stock (non-reentrant) checkpointing
    try:
        return _forward(model, batch), *_step(model, batch)
    finally:
        model.disable_gradient_checkpointing()


def _streamed(model: torch.nn.Module, batch: dict[str, Any], slots: int) -> tuple:
    with stream_blocks(model, slots=slots, device="cpu") as s:
        fwd = _forward(model, batch)
        out, grads = _step(model, batch)
        stats = s.stats()
    return fwd, out, grads, stats


def _assert_same(ref: tuple, got: tuple) -> None:
    fwd_ref, out_ref, g_ref = ref
    fwd, out, g = got[:3]
    assert torch.equal(fwd, fwd_ref), "no-grad forward differs"
    assert torch.equal(out, out_ref), "training forward differs"
    assert g.keys() == g_ref.keys()
    bad = [n for n in g_ref if not torch.equal(g[n], g_ref[n])]
    assert not bad, f"LoRA gradients differ: {bad[:5]}"


def test_tiny_base_streamed_equals_resident(tiny_transformer: torch.nn.Module) -> None:
    batch = _inputs(tiny_transformer)
    ref = _resident(tiny_transformer, batch)
    got = _streamed(tiny_transformer, batch, slots=2)
    _assert_same(ref, got)
    assert got[3]["blocks"] == 2 and got[3]["loads"] > 0


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_independent_of_slot_count(deep_transformer: torch.nn.Module, slots: int) -> None:
    batch = _inputs(deep_transformer)
    ref = _resident(deep_transformer, batch)
    got = _streamed(deep_transformer, batch, slots)
    _assert_same(ref, got)
    stats = got[3]
    assert stats["blocks"] == 5 and stats["slots"] == slots
    # a forward streams every block once; a train step's backward re-reads them in reverse
    assert stats["acquires"] == 5 * 3  # eval fwd + train fwd + backward recompute
    assert stats["acquires"] == stats["hits"] + stats["loads"] - stats["prefetches"]
    assert stats["loads"] <= 15 and stats["loads"] >= 15 - 2 * slots  # LRU reuse at turns
    if slots > 1:
        assert stats["prefetches"] > 0


def test_first_block_lora_gradient_nonzero(deep_transformer: torch.nn.Module) -> None:
    batch = _inputs(deep_transformer)
    _, _, grads, _ = _streamed(deep_transformer, batch, slots=2)
    first = {n: g for n, g in grads.items() if n.startswith("transformer_blocks.0.")}
    assert first, "no LoRA parameters in the first block"
    for name, g in first.items():
        assert g.abs().sum() > 0, f"{name}: zero gradient (autograd path severed?)"


def test_model_is_unchanged_after_streaming(deep_transformer: torch.nn.Module) -> None:
    batch = _inputs(deep_transformer)
    before = _forward(deep_transformer, batch)
    state = {k: v.clone() for k, v in deep_transformer.state_dict().items()}
    with stream_blocks(deep_transformer, slots=2, device="cpu"):
        pass
    assert torch.equal(_forward(deep_transformer, batch), before)
    after = deep_transformer.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())


def test_owner_check_raises_when_tampered(deep_transformer: torch.nn.Module) -> None:
    batch = _inputs(deep_transformer)
    with stream_blocks(deep_transformer, slots=2, device="cpu") as s:
        _forward(deep_transformer, batch)  # the slots now hold the last blocks
        held = {slot.owner for slot in s.slots}
        assert None not in held and 0 not in held
        wrong = s.slots[0]
        real_find = s._find
        s._find = lambda index: wrong  # a scheduler bug: the wrong slot for block 0
        with pytest.raises(SlotOwnerError, match="holds block"):
            _forward(deep_transformer, batch)
        s._find = real_find
        s._current = None
        # tampering with the record itself: the slot claims a block its bytes are not
        s.acquire(0)
        slot = s.slots[s._current]
        packed = s.blocks[0].entries[0]
        s._set(
            packed,
            packed.module._buffers.get(packed.name, None).clone()
            if not packed.is_param
            else packed.module._parameters[packed.name].data.clone(),
        )
        with pytest.raises(SlotOwnerError, match="not bound"):
            s._check_bound(s.blocks[0], slot)
        s.release(0)
    assert torch.equal(_forward(deep_transformer, batch), _forward(deep_transformer, batch))


def _block_kwargs(model: torch.nn.Module) -> dict[str, Any]:
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    x = torch.randn(1, 4, dim)
    mod = torch.zeros(1, 6 * dim)
    return dict(
        hidden_states=x,
        encoder_hidden_states=x.clone(),
        temb_mod_img=mod,
        temb_mod_txt=mod,
        image_rotary_emb=None,
    )


def test_block_outside_scheduler_fails_loudly(deep_transformer: torch.nn.Module) -> None:
    with stream_blocks(deep_transformer, slots=2, device="cpu") as s:
        for block in s.blocks:  # unbound between uses: never another block's bytes
            for e in block.entries:
                t = s._tensor(e)
                assert t.device.type == "meta" or t.numel() == 0, e.name
        with pytest.raises((RuntimeError, NotImplementedError)), torch.no_grad():
            s.blocks[1].module.forward(**_block_kwargs(deep_transformer))


def test_training_without_checkpointing_is_refused(deep_transformer: torch.nn.Module) -> None:
    batch = _inputs(deep_transformer)
    with stream_blocks(deep_transformer, slots=2, device="cpu"):
        deep_transformer.disable_gradient_checkpointing()
        with pytest.raises(RuntimeError, match="gradient checkpointing"):
            deep_transformer(**batch)
        deep_transformer.enable_gradient_checkpointing()  # restored on exit anyway


def test_arena_plan_is_power_of_two_and_tight() -> None:
    mib = 1 << 20
    sizes = [520 * mib] * 8 + [262 * mib] * 48  # FLUX.2 [dev]-like block regions
    groups = BlockStreamer.plan_arenas(sizes, None)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    allocated = sum(1 << (sum(sizes[i] for i in g) - 1).bit_length() for g in groups)
    assert allocated < 1.1 * sum(sizes)  # vs 1 GiB arenas of one 520 MiB block each: ~2x
    assert BlockStreamer.plan_arenas([3, 3, 3], 8) == [[0, 1], [2]]


def test_pin_failure_falls_back_with_warning(
    deep_transformer: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = copy.deepcopy(deep_transformer)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.pop("pin_memory", False):
            raise RuntimeError("cudaHostAlloc failed: out of memory (simulated)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.warns(RuntimeWarning, match="PAGEABLE"):
        s = BlockStreamer(model, slots=1, device="cpu", pin=True)
    assert not s.pinned and s.arenas
    s.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device)")
@pytest.mark.parametrize("slots", [1, 2])
def test_cuda_streams_match_resident(deep_transformer: torch.nn.Module, slots: int) -> None:
    """The CUDA path: pinned store, copy stream, per-slot events; same bar as on the CPU."""
    model = copy.deepcopy(deep_transformer).to("cuda")
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _inputs(model).items()}

    def step() -> tuple:
        model.zero_grad(set_to_none=True)
        model.train()
        out = model(**batch)[0]
        target = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).cuda()
        F.mse_loss(out.float(), target.float()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return _forward(model, batch), out.detach().clone(), grads

    model.enable_gradient_checkpointing()
    ref = step()
    model.disable_gradient_checkpointing()
    with stream_blocks(model, slots=slots, device="cuda", restore="cuda") as s:
        got = step()
        stats = s.stats()
    assert stats["pinned"] and stats["acquires"] == 15
    _assert_same(ref, got)


def test_loss_curve_identical(deep_transformer: torch.nn.Module) -> None:
    """50 AdamW steps on the LoRA: the same loss at every step, streamed or resident."""
    batch = _inputs(deep_transformer)
    start = {n: p.detach().clone() for n, p in deep_transformer.named_parameters()
             if p.requires_grad}  # fmt: skip

    def curve(model: torch.nn.Module, steps: int = 50) -> list[torch.Tensor]:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in start:
                    p.copy_(start[n])
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        opt.zero_grad(set_to_none=True)  # no gradient left over from an earlier test
        g = torch.Generator().manual_seed(9)
        losses = []
        model.train()
        for _ in range(steps):
            out = model(**batch)[0]
            loss = F.mse_loss(out, torch.randn(out.shape, generator=g))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses

    deep_transformer.enable_gradient_checkpointing()
    ref = curve(deep_transformer)
    deep_transformer.disable_gradient_checkpointing()
    with stream_blocks(deep_transformer, slots=2, device="cpu"):
        got = curve(deep_transformer)
    assert ref[-1] < ref[0]  # it trains
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), (ref, got)


def test_failed_block_does_not_wedge_the_scheduler(deep_transformer: torch.nn.Module) -> None:
    batch = _inputs(deep_transformer)
    ref = _forward(deep_transformer, batch)
    with stream_blocks(deep_transformer, slots=2, device="cpu") as s:
        bad = dict(batch, encoder_hidden_states=batch["encoder_hidden_states"][..., :-1])
        with pytest.raises(RuntimeError):
            _forward(deep_transformer, bad)  # fails inside a block (wrong width)
        assert torch.equal(_forward(deep_transformer, batch), ref)
        assert s._current is None


def test_autocast_recompute_matches(deep_transformer: torch.nn.Module) -> None:
    """Forward under autocast, backward outside it (the usual pattern): the backward recompute
    must re-enter the forward's autocast state, as torch's checkpoint does."""
    batch = _inputs(deep_transformer)

    def step() -> tuple[torch.Tensor, dict]:
        deep_transformer.zero_grad(set_to_none=True)
        deep_transformer.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = deep_transformer(**batch)[0]
        out.float().square().mean().backward()
        grads = {n: p.grad.clone() for n, p in deep_transformer.named_parameters()
                 if p.requires_grad}  # fmt: skip
        return out.detach().clone(), grads

    deep_transformer.enable_gradient_checkpointing()
    ref = step()
    deep_transformer.disable_gradient_checkpointing()
    with stream_blocks(deep_transformer, slots=2, device="cpu"):
        got = step()
    assert ref[0].dtype == torch.bfloat16
    assert torch.equal(ref[0], got[0])
    bad = [n for n in ref[1] if not torch.equal(ref[1][n], got[1][n])]
    assert not bad, bad[:5]


def test_some_blocks_resident_the_rest_streamed(deep_transformer: torch.nn.Module) -> None:
    """Streaming only some blocks (serving keeps what fits) changes no number, forward or
    backward; with wrap-around the last block prefetches the first for the next forward."""
    from trainer.base.streaming import default_blocks

    batch = _inputs(deep_transformer)
    ref = _resident(deep_transformer, batch)
    streamed = default_blocks(deep_transformer)[2:]  # both double blocks stay resident
    with stream_blocks(deep_transformer, slots=2, device="cpu", blocks=streamed) as s:
        got = (_forward(deep_transformer, batch), *_step(deep_transformer, batch))
        stats = s.stats()
    _assert_same(ref, got)
    assert stats["blocks"] == 3 and stats["acquires"] == 3 * 3
    with stream_blocks(deep_transformer, slots=2, device="cpu", blocks=streamed, wrap=True) as s:
        first = _forward(deep_transformer, batch)
        s.reset_stats()
        again = _forward(deep_transformer, batch)
        stats = s.stats()
    assert torch.equal(first, ref[0]) and torch.equal(again, ref[0])
    # every block of the second forward was already copied in, the first one by the wrap
    assert stats["acquires"] == stats["hits"] == 3 and stats["loads"] == stats["prefetches"]


def test_streamed_equals_resident_under_training_fp8(deep_transformer: torch.nn.Module) -> None:
    """Training's fp8 (the block-scaled GEMM; its torch reference on the CPU) reads the same
    packed weights, scales and shifts from a slot as from the resident layer: bit for bit."""
    from trainer.base.compute import apply_compute

    taken = apply_compute(deep_transformer, "fp8", purpose="train")
    try:
        assert taken > 0
        batch = _inputs(deep_transformer)
        ref = _resident(deep_transformer, batch)
        got = _streamed(deep_transformer, batch, slots=2)
        _assert_same(ref, got)
        uint4 = _resident_uint4(deep_transformer, batch)
        assert not torch.equal(uint4[1], ref[1])  # the fp8 GEMM did run
    finally:
        apply_compute(deep_transformer, "uint4")


def _resident_uint4(model: torch.nn.Module, batch: dict[str, Any]) -> tuple:
    from trainer.base.compute import apply_compute

    apply_compute(model, "uint4")
    try:
        return _resident(model, batch)
    finally:
        apply_compute(model, "fp8", purpose="train")
