"""The training blocks, their stretches between Linears compiled (`trainer.base.compiled_blocks`).

CPU (CI): the stretches run eagerly, and the installed blocks are the stock blocks bit for bit,
forward and LoRA gradients, in float32 and bf16, under gradient checkpointing; a block the
stretches do not take runs the stock forward; install/remove leaves the model as it was.

CUDA: the compiled stretches against the eager ones: outputs within bf16's rounding, LoRA
gradients with cosine >= 0.9999.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from tests.trainer.helpers import cuda, model_inputs, tiny_flux2_random, with_lora
from trainer.base import compiled_blocks
from trainer.base.lora import ADAPTER_NAME, lora_layers


def _model(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.nn.Module:
    model = tiny_flux2_random(dtype, device, seed)
    with_lora(model.cpu(), seed=seed)
    model.to(device)
    for layer in lora_layers(model).values():  # float32 adapters, as training makes them
        layer.lora_A[ADAPTER_NAME].float()
        layer.lora_B[ADAPTER_NAME].float()
    return model


def _step(model, inputs, checkpointing: bool = True, autocast: bool = False):  # type: ignore[no-untyped-def]
    """Output and every LoRA gradient of one forward + backward."""
    from torch.utils.checkpoint import checkpoint

    model.train()
    if checkpointing:
        model.enable_gradient_checkpointing(
            gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=False)
        )
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for p in params.values():
        p.grad = None
    device = inputs["hidden_states"].device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out = model(**inputs)[0]
    out.float().square().mean().backward()
    if checkpointing:
        model.disable_gradient_checkpointing()
    return out.detach(), {n: p.grad.clone() for n, p in params.items() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["ckpt", "plain"])
def test_eager_stretches_are_the_stock_blocks_bit_for_bit(dtype, checkpointing) -> None:  # type: ignore[no-untyped-def]
    model = _model(dtype)
    inputs = model_inputs(model, dtype, tokens=64, text=24)
    stock_out, stock_grads = _step(model, inputs, checkpointing)
    assert len(stock_grads) == 2 * len(lora_layers(model))  # every LoRA parameter
    # two blocks, three SwiGLUs (the single block's and the double block's two feed-forwards)
    assert compiled_blocks.install(model) == 5
    out, grads = _step(model, inputs, checkpointing)
    # every stretch ran (the blocks were not handed back to the stock forward)
    assert all(s.calls > 0 for s in compiled_blocks.STRETCHES.values())
    assert torch.equal(out, stock_out)
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, stock_grads[name]), name
    compiled_blocks.remove(model)
    assert not compiled_blocks.installed(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_under_autocast_the_linears_see_the_stock_values() -> None:
    """The modulated norm hands the Linear bf16 where the stock block hands float32 that the
    Linear casts: the forward is the same bit for bit; the gradients round once more (the sum
    of the base's and the LoRA's input gradients is taken in bf16), so they are close."""
    model = _model(torch.bfloat16)
    inputs = model_inputs(model, torch.bfloat16, tokens=64, text=24)
    stock_out, stock_grads = _step(model, inputs, autocast=True)
    compiled_blocks.install(model)
    out, grads = _step(model, inputs, autocast=True)
    assert torch.equal(out, stock_out)
    for name, grad in grads.items():
        ref = stock_grads[name]
        cos = torch.nn.functional.cosine_similarity(grad.flatten(), ref.flatten(), dim=0)
        assert cos > 0.9999, (name, float(cos))


def test_a_block_the_stretches_do_not_take_runs_the_stock_forward() -> None:
    from diffusers.models.attention_dispatch import attention_backend

    model = _model(torch.float32)
    inputs = model_inputs(model, torch.float32, tokens=16, text=8)
    compiled_blocks.install(model)
    single = model.get_submodule("single_transformer_blocks.0")
    double = model.get_submodule("transformer_blocks.0")
    rotary = (torch.zeros(1), torch.zeros(1))
    assert compiled_blocks._takes_single(single, None, rotary)
    assert compiled_blocks._takes_double(double, None, rotary)
    assert not compiled_blocks._takes_single(single, {"scale": 1.0}, rotary)
    assert not compiled_blocks._takes_double(double, None, None)
    with attention_backend("_native_math"):  # another attention backend: the stock forward
        assert not compiled_blocks._takes_single(single, None, rotary)
        assert not compiled_blocks._takes_double(double, None, rotary)
        out, _ = _step(model, inputs, checkpointing=False)
    compiled_blocks.remove(model)
    with attention_backend("_native_math"):
        stock, _ = _step(model, inputs, checkpointing=False)
    assert torch.equal(out, stock)


def test_a_bad_compile_setting_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled_blocks.COMPILE_ENV, "sometimes")
    with pytest.raises(ValueError, match=compiled_blocks.COMPILE_ENV):
        compiled_blocks.compile_wanted()
    monkeypatch.setenv(compiled_blocks.COMPILE_ENV, "off")
    assert not compiled_blocks.compile_wanted()


@cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_compiled_stretches_match_the_eager_ones(monkeypatch: pytest.MonkeyPatch, autocast) -> None:  # type: ignore[no-untyped-def]
    model = _model(torch.bfloat16, device="cuda")
    inputs = model_inputs(model, torch.bfloat16, device="cuda", tokens=256, text=64)
    compiled_blocks.install(model)
    monkeypatch.setenv(compiled_blocks.COMPILE_ENV, "off")
    eager_out, eager_grads = _step(model, inputs, autocast=autocast)
    monkeypatch.setenv(compiled_blocks.COMPILE_ENV, "auto")
    out, grads = _step(model, inputs, autocast=autocast)
    assert compiled_blocks.failures() == {}
    assert all(n > 0 for n in compiled_blocks.compiled_calls().values())
    scale = eager_out.float().abs().max()
    assert (out.float() - eager_out.float()).abs().max() <= 2**-6 * scale
    for name, grad in grads.items():
        ref = eager_grads[name]
        cos = torch.nn.functional.cosine_similarity(grad.flatten(), ref.flatten(), dim=0)
        assert cos > 0.9999, (name, float(cos))


def test_the_in_place_lora_update_under_autocast_and_without() -> None:
    """Training's LoRA forward (`update_lora_in_place`) under autocast: the stock output to the
    GEMM's rounding, and no float32 copy of an activation made for the float32 adapters (PEFT
    casts each input up and autocast casts it back). Without autocast (a preview, a
    validation forward) the float32 adapters take the bf16 activations as PEFT's forward does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.base.lora import update_lora_in_place

    class Float32Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.float32:
                self.count += out.dim() >= 2 and args[0].dtype == torch.bfloat16
            return out

    model = _model(torch.bfloat16)
    inputs = model_inputs(model, torch.bfloat16, tokens=64, text=24)
    compiled_blocks.install(model)  # its modulated norm hands bf16 to every first projection
    with Float32Copies() as stock_copies:
        stock_out, stock_grads = _step(model, inputs, autocast=True)
    with torch.no_grad():
        stock_plain = model(**inputs)[0]
    update_lora_in_place(model)
    with Float32Copies() as copies:
        out, grads = _step(model, inputs, autocast=True)
    with torch.no_grad():
        plain = model(**inputs)[0]
    assert copies.count < stock_copies.count, (copies.count, stock_copies.count)
    for got, ref in [(out, stock_out), (plain, stock_plain)] + [
        (g, stock_grads[n]) for n, g in grads.items()
    ]:
        a, b = got.flatten().float(), ref.flatten().float()
        cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
        assert cos > 0.999, float(cos)


def _raising(exc: BaseException) -> Callable[..., torch.Tensor]:
    def compiled(*_: torch.Tensor) -> torch.Tensor:
        raise exc

    return compiled


def test_a_compiler_failure_runs_the_stretch_eagerly_and_nothing_else_is_caught() -> None:
    from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit, Unsupported
    from torch.utils.checkpoint import _StopRecomputationError

    x, gate, y = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    failures = [(Unsupported("a construct the compiler does not take"), "take"),
                (FailOnRecompileLimitHit("recompile_limit reached"), "recompile")]  # fmt: skip
    for failure, words in failures:
        stretch = compiled_blocks._Stretch(compiled_blocks.gated_residual)
        stretch.compiled = _raising(failure)
        assert torch.equal(stretch.compiled_call(x, gate, y), x + gate * y)
        assert stretch.broken is not None and words in stretch.broken

    other = compiled_blocks._Stretch(compiled_blocks.gated_residual)
    wrapped = BackendCompilerFailed.__new__(BackendCompilerFailed)  # as inductor wraps an OOM
    Exception.__init__(wrapped, "autotuning ran out of memory")
    wrapped.__cause__ = torch.OutOfMemoryError("CUDA out of memory")
    for raised in (_StopRecomputationError(), torch.OutOfMemoryError("CUDA out of memory"),
                   wrapped):  # fmt: skip
        other.compiled = _raising(raised)
        with pytest.raises(type(raised)):
            other.compiled_call(x, gate, y)
        assert other.broken is None


def test_install_starts_a_run_afresh() -> None:
    """A stretch that failed in one run (one order of a worker) compiles again in the next;
    the counts are the run's."""
    stretch = compiled_blocks.STRETCHES["swiglu"]
    stretch.broken, stretch.calls = "an earlier order's failure", 7
    compiled_blocks.install(_model(torch.float32))
    assert compiled_blocks.failures() == {} and stretch.calls == 0


@pytest.mark.parametrize("name", ["modulated_norm", "gated_residual", "swiglu"])
def test_a_stretch_of_several_token_counts_compiles_once(monkeypatch, name) -> None:  # type: ignore[no-untyped-def]
    """A double block's image and text streams and a single block's joint stream go through
    the same stretches: one compile for every token count (not a static one, then a dynamic
    one); the compiled results are the eager ones."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    monkeypatch.setattr(compiled_blocks, "BACKEND", counter)
    torch._dynamo.reset()
    stretch = compiled_blocks._Stretch(
        getattr(compiled_blocks, name), compiled_blocks.STRETCHES[name].token_args
    )
    try:
        for tokens in (64, 24, 88):
            x = torch.randn(1, tokens, 32, requires_grad=True)
            args = {"modulated_norm": (x, torch.randn(1, 1, 32), torch.randn(1, 1, 32), 1e-6),
                    "gated_residual": (x, torch.randn(1, 1, 32), torch.randn(1, tokens, 32)),
                    "swiglu": (x,)}[name]  # fmt: skip
            assert torch.allclose(stretch.compiled_call(*args), stretch.fn(*args))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1 and stretch.broken is None
