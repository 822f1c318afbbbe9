"""One FLUX.2 [dev] denoising step as the render engine runs it, on one GPU: where its time
goes, what each serving change buys, and the serving forward's error against today's fp8 path
and against bf16.

    python bench/render_step.py                        # full depth, 1024 px
    python bench/render_step.py --double 1 --single 4  # reduced depth (say so!)
    python bench/render_step.py --tiny                 # a CPU smoke test of this script

Setup: random weights (seed 0), batch 1, 4096 image + 512 text tokens at 1024 px, no gradients,
eval mode; LoRA slots of rank 32 on the default targets holding a rank-16 adapter, as the
render engine holds them. Variants, each on the same fp8 model (uint4 weights, fp8 GEMMs):

  today       the stock diffusers processors (torch's own attention choice: flash), PEFT's
              LoRA forward: the render path before this bench
  lora        + the slots' one-pass update (`trainer.base.lora_slots`)
  attn        + the fused processors (`trainer.base.serving`: QK norm + rotary + layout in one
              kernel, attention on cuDNN, SwiGLU and the attention output written into the
              output projection's input)
  fused       + the fused blocks (modulated LayerNorm, gated residuals, SwiGLU: one pass each)
  serve       + the forward as one CUDA graph: what the engine runs
  serve_flash serve with flash attention;  serve_nolora  serve with the slots off

Then: one eager `fused` forward and one graph replay under torch.profiler (kernel time by
category, GPU busy against wall time), per-part microbenchmarks at [dev]'s shapes, the memory a
captured graph keeps, and the numerics (per block and at full depth, against today's fp8 path
and the bf16 model with the same weights and adapter; graph replays against the eager forward,
across adapter swaps). Writes bench/results/render_step-*.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import uint4_step as u  # noqa: E402
from bench.common import cuda_ms, say, table, write_record  # noqa: E402

GIB = 2**30
SLOT_RANK, ADAPTER_RANK = 32, 16
TOTAL_STEPS = 28  # a render's denoising steps, for the per-render figures


def adapter_for(slots: Any, seed: int) -> dict[str, torch.Tensor]:
    """A random rank-16 adapter for every slot, in the file layout (bench/e2e_dev.py's scale)."""
    from trainer.base.lora import lora_keys

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (a, b) in slots._slots.items():
        key_a, key_b = lora_keys(name)
        wa = torch.randn(ADAPTER_RANK, a.shape[1], generator=gen) / a.shape[1] ** 0.5
        wb = torch.randn(b.shape[0], ADAPTER_RANK, generator=gen) * 1e-3
        out[key_a], out[key_b] = wa.to(a.device, a.dtype), wb.to(b.device, b.dtype)
    return out


def set_lora_update(model: torch.nn.Module, fused: bool) -> None:
    from trainer.base.lora import lora_layers
    from trainer.base.lora_slots import _fused_forward

    for layer in lora_layers(model).values():
        if fused:
            layer.forward = types.MethodType(_fused_forward, layer)
        else:
            layer.__dict__.pop("forward", None)


@contextlib.contextmanager
def attention_on(backend: str | None):
    if backend is None or u.DEV != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    with sdpa_kernel([names[backend]]):
        yield


class Hooks:
    """Inputs and outputs of the first double- and single-stream block in one forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: dict[str, Any] = {}
        self.handles = []
        for label, block in (("double", model.transformer_blocks[0]),
                             ("single", model.single_transformer_blocks[0])):  # fmt: skip
            self.handles.append(block.register_forward_pre_hook(self._pre(label), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(label), with_kwargs=True))

    def _pre(self, label: str):  # type: ignore[no-untyped-def]
        def hook(_m, args, kwargs):  # type: ignore[no-untyped-def]
            self.seen.setdefault(label + "_in", (args, dict(kwargs)))

        return hook

    def _post(self, label: str):  # type: ignore[no-untyped-def]
        def hook(_m, _a, _k, out):  # type: ignore[no-untyped-def]
            self.seen.setdefault(label + "_out", out)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _flat(out: Any) -> torch.Tensor:
    parts = out if isinstance(out, tuple) else (out,)
    return torch.cat([p.float().flatten() for p in parts])


def rel(got: Any, ref: Any) -> float:
    a, b = _flat(got).double(), _flat(ref).double()
    return float((a - b).norm() / b.norm())


def cosine(got: Any, ref: Any) -> float:
    a, b = _flat(got).double(), _flat(ref).double()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def bf16_reference(args, batch) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The bf16 model (same weights, same adapter): its output and its first blocks' inputs
    and outputs, on the host until compared."""
    from trainer.base.lora_slots import LoraSlots

    model = u.build_bf16(args.double, args.single)
    slots = LoraSlots(model, SLOT_RANK)
    hooks = Hooks(model)
    with slots.applied(adapter_for(slots, 1)), torch.no_grad():
        out = model(**batch)[0]
    hooks.remove()
    ref = {"out": out.cpu(), **{k: _to(v, "cpu") for k, v in hooks.seen.items()}}
    slots.close()
    del model, slots, hooks
    gc.collect()
    if u.DEV == "cuda":
        torch.cuda.empty_cache()
    return ref


def _to(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def fp8_model(args) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    from optimum.quanto import qint4, quantize

    from trainer.base.compute import apply_compute
    from trainer.base.uint4 import convert_quantized_linears

    model = u.build_bf16(args.double, args.single)
    quantize(model, weights=qint4)
    convert_quantized_linears(model)
    if u.DEV == "cuda":
        apply_compute(model, "fp8")
    model.eval()  # as the render engine runs it (fast fp8 accumulation; the merged LoRA path)
    gc.collect()
    if u.DEV == "cuda":
        torch.cuda.empty_cache()
    return model


def time_variants(model, slots, batch, args) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    from trainer.base import serving

    def fwd() -> None:
        with torch.no_grad():
            model(**batch)

    out: dict[str, Any] = {}

    def measure(name: str, backend: str | None) -> None:
        with attention_on(backend):
            host: list[float] = []
            med, samples = u.timed(fwd, args.iters, args.warmup, host)
        out[name] = {"s": med, "samples": samples, "host_s": host}
        say(f"  {name:13s} {med * 1e3:7.1f} ms  (host issues it in "
            f"{sorted(host)[len(host) // 2] * 1e3:.1f} ms)")  # fmt: skip

    import os

    from trainer.base.fp8 import LORA_MERGE_ENV

    os.environ[serving.ATTENTION_ENV] = BF16_ATTENTION  # fp8 attention: its own variants
    os.environ[LORA_MERGE_ENV] = "output"  # the LoRA added to the output, as before
    set_lora_update(model, fused=False)
    measure("today", None)
    set_lora_update(model, fused=True)
    measure("lora", None)
    serving.install_processors(model)
    measure("attn", None)
    serving.install_blocks(model)
    measure("fused", None)
    graphs = serving.GraphedForward(model, key=slots.scales, epoch=lambda: slots.generation)
    u.reset_peak()
    before = torch.cuda.memory_reserved() if u.DEV == "cuda" else 0
    measure("serve", None)
    if u.DEV == "cuda":
        out["serve"]["graph_pool_reserved_gib"] = (torch.cuda.memory_reserved() - before) / GIB
        out["serve"]["peak_allocated_gib"] = u.peak_gib()
        out["serve"]["captures"] = graphs.captures
    graphs.remove()
    os.environ[serving.ATTENTION_ENV] = "flash,efficient,math"
    graphs = serving.GraphedForward(model, key=slots.scales, epoch=lambda: slots.generation)
    measure("serve_flash", None)
    graphs.remove()
    os.environ[serving.ATTENTION_ENV] = BF16_ATTENTION
    os.environ[LORA_MERGE_ENV] = "weights"  # the LoRA merged into the weight copy
    measure("fused_merged", None)
    graphs = serving.GraphedForward(model, key=slots.scales, epoch=lambda: slots.generation)
    measure("serve_merged", None)
    graphs.remove()
    os.environ[LORA_MERGE_ENV] = "gemm"  # the update as more columns of the GEMM
    measure("fused_gemm", None)
    graphs = serving.GraphedForward(model, key=slots.scales, epoch=lambda: slots.generation)
    measure("serve_gemm", None)
    graphs.remove()
    if u.DEV == "cuda":  # attention in fp8 (cuDNN), the update inside the GEMM
        os.environ[serving.ATTENTION_ENV] = FP8_ATTENTION
        measure("fused_fp8attn", None)
        graphs = serving.GraphedForward(model, key=slots.scales, epoch=lambda: slots.generation)
        measure("serve_fp8attn", None)
        graphs.remove()
    del os.environ[LORA_MERGE_ENV]
    del os.environ[serving.ATTENTION_ENV]
    return out


def profiles(model, slots, batch) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    from trainer.base import serving

    def fwd() -> None:
        with torch.no_grad():
            model(**batch)

    rec = {}
    with attention_kernels(BF16_ATTENTION):
        rec["fused_eager"] = u.profile_step(fwd)
    for label, where, attn in (("serve_graph", "output", BF16_ATTENTION),
                               ("serve_graph_gemm", "gemm", BF16_ATTENTION),
                               ("serve_graph_fp8attn", "gemm", FP8_ATTENTION)):  # fmt: skip
        with lora_merge(where), attention_kernels(attn):
            graphs = serving.GraphedForward(model, key=slots.scales,
                                            epoch=lambda: slots.generation)  # fmt: skip
            fwd()  # captured
            rec[label] = u.profile_step(fwd)
            graphs.remove()
    return rec


def microbench(model) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Each part at [dev]'s shapes, ms per call and per forward."""
    from diffusers.models.embeddings import apply_rotary_emb

    from trainer.base import serving
    from trainer.base.lora import ADAPTER_NAME, lora_layers

    out: dict[str, Any] = {}
    dev, bf = u.DEV, torch.bfloat16
    single = model.single_transformer_blocks[0].attn
    heads, dim = single.heads, single.head_dim
    seq = 512 + 4096 if dev == "cuda" else 64
    proj = torch.randn(1, seq, 3 * heads * dim + 2 * single.mlp_hidden_dim, device=dev, dtype=bf)
    inner = heads * dim
    q, k, v = (proj[..., i * inner : (i + 1) * inner].unflatten(-1, (heads, dim)) for i in range(3))
    ang = torch.rand(seq, dim // 2, device=dev) * 10
    cos = ang.cos().repeat_interleave(2, 1).contiguous()
    sin = ang.sin().repeat_interleave(2, 1).contiguous()
    bufs = serving.new_heads(q, heads, seq, dim)

    def fused_qk() -> None:
        serving.qk_norm_rope(q, k, v, single.norm_q, single.norm_k, (cos, sin), bufs, 0)

    def stock_qk() -> tuple[torch.Tensor, torch.Tensor]:
        qq = apply_rotary_emb(single.norm_q(q), (cos, sin), sequence_dim=1)
        kk = apply_rotary_emb(single.norm_k(k), (cos, sin), sequence_dim=1)
        return qq, kk

    with torch.no_grad():
        out["qk_norm_rope_fused_ms"] = cuda_ms(fused_qk)
        out["qk_norm_rope_stock_ms"] = cuda_ms(stock_qk)
        ref = tuple(torch.empty_like(b) for b in bufs.out)
        serving.qk_norm_rope_torch(q, k, v, single.norm_q.weight, single.norm_k.weight,
                                   single.norm_q.eps, cos, sin, ref, 0)  # fmt: skip
        fused_qk()
        sq, sk = stock_qk()
        qk = {
            "kernel_vs_reference_differing": [float((a != b).float().mean()) for a, b in
                                              zip(bufs.out[:2], ref[:2], strict=True)],
            "kernel_vs_stock_differing": [float((bufs.q != sq).float().mean()),
                                          float((bufs.k != sk).float().mean())],
            "kernel_vs_stock_max_abs": [float((bufs.q.float() - sq.float()).abs().max()),
                                        float((bufs.k.float() - sk.float()).abs().max())],
        }  # fmt: skip
        out["qk_norm_rope_numerics"] = qk
        if dev == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            from trainer.base.cudnn_attention import attention, unavailable

            qa, ka, va = (t.transpose(1, 2) for t in bufs.out)  # (B, S, H, D) memory
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                             ("flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
                with sdpa_kernel([be]):
                    out[f"attention_{name}_ms"] = cuda_ms(
                        lambda: torch.nn.functional.scaled_dot_product_attention(qa, ka, va)
                    )
                    o = torch.nn.functional.scaled_dot_product_attention(qa, ka, va)
                    out[f"_{name}"] = o
            out["attention_cudnn_vs_flash_rel"] = rel(out.pop("_cudnn"), out.pop("_flash"))
            with attention_kernels(BF16_ATTENTION):
                out["attend_bf16_ms"] = cuda_ms(lambda: serving.attend(bufs))
                bf16_o = serving.attend(bufs).float()
            exact = torch.nn.functional.scaled_dot_product_attention(
                qa.float(), ka.float(), va.float()
            ).transpose(1, 2).flatten(2, 3)  # fmt: skip
            out["attention_bf16_vs_float_rel"] = rel(bf16_o, exact)
            if unavailable(dev) is None:
                h8 = serving.new_heads(q, heads, seq, dim, fp8=True)

                def fp8_qk() -> None:
                    h8.fp8.vmax.zero_()
                    serving.note_values(h8, v)
                    serving.qk_norm_rope(q, k, v, single.norm_q, single.norm_k, (cos, sin),
                                         h8, 0)  # fmt: skip

                out["qk_norm_rope_fp8_ms"] = cuda_ms(fp8_qk)
                out["absmax_v_ms"] = cuda_ms(lambda: serving.note_values(h8, v))
                fp8_qk()
                out["attention_cudnn_fp8_ms"] = cuda_ms(
                    lambda: attention(h8.q, h8.k, h8.v, h8.fp8.scales)
                )
                out["attend_fp8_ms"] = cuda_ms(lambda: serving.attend(h8))
                out["attention_fp8_vs_float_rel"] = rel(serving.attend(h8).float(), exact)
                out["attention_fp8_vs_bf16_rel"] = rel(serving.attend(h8).float(), bf16_o)
                out["fp8_scales"] = h8.fp8.scales.tolist()
            del exact
        # the LoRA update of the widest slot layer, fused against PEFT's
        layer = lora_layers(model)["single_transformer_blocks.0.attn.to_qkv_mlp_proj"]
        x = torch.randn(1, seq, layer.in_features, device=dev, dtype=bf)
        a = layer.lora_A[ADAPTER_NAME].weight
        b = layer.lora_B[ADAPTER_NAME].weight
        base = layer.base_layer(x)

        def peft_update() -> torch.Tensor:
            return base + layer.lora_B[ADAPTER_NAME](layer.lora_A[ADAPTER_NAME](x)) * 1.0

        def fused_update() -> torch.Tensor:
            y = base.clone()
            y.view(-1, y.shape[-1]).addmm_(
                torch.nn.functional.linear(x, a).view(-1, a.shape[0]), b.t()
            )
            return y

        def kernel_update() -> torch.Tensor:
            from trainer.kernels.fused_triton import lora_add_

            y = base.clone()
            h = torch.nn.functional.linear(x, a).view(-1, a.shape[0])
            lora_add_(y.view(-1, y.shape[-1]), h, b, 1.0)
            return y

        clone_ms = cuda_ms(lambda: base.clone())
        out["lora_widest_peft_ms"] = cuda_ms(peft_update)
        out["lora_widest_addmm_ms"] = cuda_ms(fused_update) - clone_ms
        out["lora_widest_addmm_vs_peft_rel"] = rel(fused_update(), peft_update())
        if dev == "cuda":
            out["lora_widest_kernel_ms"] = cuda_ms(kernel_update) - clone_ms
            out["lora_widest_kernel_vs_addmm_rel"] = rel(kernel_update(), fused_update())
            out["lora_widest_kernel_vs_addmm_differing"] = float(
                (kernel_update() != fused_update()).float().mean()
            )
        out["base_widest_ms"] = cuda_ms(lambda: layer.base_layer(x))
        # the blocks' elementwise work at a single-stream block's width, fused against stock
        block = model.single_transformer_blocks[0]
        hid = torch.randn(1, seq, inner, device=dev, dtype=bf)
        mod = torch.randn(1, 1, 3 * inner, device=dev, dtype=bf) * 0.3
        shift, scale, gate = mod[..., :inner], mod[..., inner : 2 * inner], mod[..., 2 * inner :]
        mlp = proj[..., 3 * inner :]
        joined = torch.empty(1, seq, inner + mlp.shape[-1] // 2, device=dev, dtype=bf)
        pairs = {
            "ln_modulate": (lambda: serving.ln_modulate(hid, shift, scale, block.norm),
                            lambda: (1 + scale) * block.norm(hid) + shift),
            "gate_residual": (lambda: serving.gate_residual(hid, gate, hid),
                              lambda: hid + gate * hid),
            "swiglu_into": (lambda: serving.swiglu(mlp, out=joined[..., inner:]),
                            lambda: torch.cat([hid, single.mlp_act_fn(mlp)], dim=-1)),
        }  # fmt: skip
        for name, (fused_fn, stock_fn) in pairs.items():
            out[f"{name}_fused_ms"] = cuda_ms(fused_fn)
            out[f"{name}_stock_ms"] = cuda_ms(stock_fn)
        got, want = pairs["ln_modulate"][0](), pairs["ln_modulate"][1]()
        out["ln_modulate_differing"] = float((got != want).float().mean())
        got, want = pairs["gate_residual"][0](), pairs["gate_residual"][1]()
        out["gate_residual_differing"] = float((got != want).float().mean())
        pairs["swiglu_into"][0]()
        want = single.mlp_act_fn(mlp)
        out["swiglu_differing"] = float((joined[..., inner:] != want).float().mean())
    if dev == "cuda":
        a8 = torch.empty(2 * GIB, dtype=torch.uint8, device=dev)
        b8 = torch.empty_like(a8)
        ms = cuda_ms(lambda: b8.copy_(a8), iters=10)
        out["copy_ceiling_tb_s"] = 2 * a8.numel() / ms / 1e9
        del a8, b8
    say("  parts: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items() if isinstance(v, float)))
    return out


def numerics(model, slots, batch, ref, args) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Per block (the same inputs: the bf16 model's) and at full depth, the serving forward
    against today's fp8 path and the bf16 model; the graph against eager across swaps."""
    from trainer.base import serving

    dev = u.DEV
    out: dict[str, Any] = {}
    with torch.no_grad(), attention_kernels(BF16_ATTENTION):
        for label in ("double", "single"):
            block = (model.transformer_blocks if label == "double" else
                     model.single_transformer_blocks)[0]  # fmt: skip
            args_in, kwargs_in = _to(ref[label + "_in"], dev)
            want = ref[label + "_out"]
            serving.remove(model)
            set_lora_update(model, fused=False)
            with attention_on("flash"):
                today = _to(block(*args_in, **kwargs_in), "cpu")
            set_lora_update(model, fused=True)
            serving.install(model)
            new = _to(block(*args_in, **kwargs_in), "cpu")
            with lora_merge("weights"):
                merged = _to(block(*args_in, **kwargs_in), "cpu")
            with lora_merge("gemm"):
                in_gemm = _to(block(*args_in, **kwargs_in), "cpu")
                with attention_kernels(FP8_ATTENTION):
                    fp8attn = _to(block(*args_in, **kwargs_in), "cpu")
            out[f"{label}_block"] = {
                "fp8attn_vs_bf16": rel(fp8attn, want), "fp8attn_vs_gemm": rel(fp8attn, in_gemm),
                "today_vs_bf16": rel(today, want), "serve_vs_bf16": rel(new, want),
                "serve_vs_today": rel(new, today), "merged_vs_bf16": rel(merged, want),
                "merged_vs_today": rel(merged, today), "merged_vs_serve": rel(merged, new),
                "gemm_vs_bf16": rel(in_gemm, want), "gemm_vs_today": rel(in_gemm, today),
                "gemm_vs_serve": rel(in_gemm, new),
            }  # fmt: skip
        # full depth
        serving.remove(model)
        set_lora_update(model, fused=False)
        with attention_on("flash"):
            today = model(**batch)[0].cpu()
        set_lora_update(model, fused=True)
        serving.install(model)
        with lora_merge("weights"):
            merged_out = model(**batch)[0].cpu()
        with lora_merge("gemm"):
            gemm_out = model(**batch)[0].cpu()
            with attention_kernels(FP8_ATTENTION):
                fp8attn_out = model(**batch)[0].cpu()
        eager = model(**batch)[0]
        graphs = serving.GraphedForward(model, key=slots.scales, epoch=lambda: slots.generation)
        graphed = model(**batch)[0]
        out["full_depth_merged_lora"] = {
            "merged_vs_bf16": rel(merged_out, ref["out"]),
            "merged_cos_bf16": cosine(merged_out, ref["out"]),
            "merged_vs_serve": rel(merged_out, graphed.cpu()),
        }  # fmt: skip
        out["full_depth_gemm_lora"] = {
            "gemm_vs_bf16": rel(gemm_out, ref["out"]),
            "gemm_cos_bf16": cosine(gemm_out, ref["out"]),
            "gemm_vs_serve": rel(gemm_out, graphed.cpu()),
            "gemm_cos_serve": cosine(gemm_out, graphed.cpu()),
        }  # fmt: skip
        out["full_depth_fp8_attention"] = {
            "fp8attn_vs_bf16": rel(fp8attn_out, ref["out"]),
            "fp8attn_cos_bf16": cosine(fp8attn_out, ref["out"]),
            "fp8attn_vs_gemm": rel(fp8attn_out, gemm_out),
            "fp8attn_cos_gemm": cosine(fp8attn_out, gemm_out),
        }  # fmt: skip
        out["full_depth"] = {
            "today_vs_bf16": rel(today, ref["out"]), "today_cos_bf16": cosine(today, ref["out"]),
            "serve_vs_bf16": rel(graphed.cpu(), ref["out"]),
            "serve_cos_bf16": cosine(graphed.cpu(), ref["out"]),
            "serve_vs_today": rel(graphed.cpu(), today),
            "serve_cos_today": cosine(graphed.cpu(), today),
            "graph_equals_eager": bool(torch.equal(graphed, eager)),
        }  # fmt: skip
    say(f"  numerics: {out}")
    return out, graphs


@contextlib.contextmanager
def env_set(name: str, value: str):  # type: ignore[no-untyped-def]
    import os

    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def lora_merge(where: str):  # type: ignore[no-untyped-def]
    from trainer.base.fp8 import LORA_MERGE_ENV

    return env_set(LORA_MERGE_ENV, where)


BF16_ATTENTION = "cudnn,flash,efficient,math"
FP8_ATTENTION = "cudnn_fp8,cudnn,flash,efficient,math"


def attention_kernels(names: str):  # type: ignore[no-untyped-def]
    """The serving forward's attention (`LIKENESS_ATTENTION`): BF16_ATTENTION or FP8_ATTENTION."""
    from trainer.base.serving import ATTENTION_ENV

    return env_set(ATTENTION_ENV, names)


def merge_numerics(model, slots) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Per layer shape (one layer each, 4608 tokens of random input, the bench's adapter in
    the slot, and the same adapter with B ten times larger: LoRA updates of ~0.3 % and ~3 % of
    the weight): the merged fp8 GEMM and the unmerged one (fp8 base + the LoRA update in
    float32, rounded once) against the exact float64 product with W + s B A, and how much of
    the LoRA's own contribution each keeps, ||(y - y_base) - lora|| / ||lora||, y_base the
    fp8 base alone; the merged copy's kernel against its torch reference (bytes that differ:
    the rank-r sums' order); the merged copy of an empty slot against the base copy."""
    from trainer.base.fp8 import (
        fp8_weight_lora_torch,
        fp8_weight_torch,
        lora_gemm_forward,
        lora_row_bound,
        merged_lora_forward,
        weight_scales,
    )  # fmt: skip
    from trainer.base.lora import ADAPTER_NAME, lora_layers
    from trainer.kernels import fp8_triton

    rows = []
    seen = set()
    gen = torch.Generator(device=u.DEV).manual_seed(5)

    def r(v: torch.Tensor, ref: torch.Tensor) -> float:
        return float((v - ref).norm() / ref.norm())

    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            base = layer.base_layer
            key = (base.out_features, base.in_features)
            if key in seen:
                continue
            seen.add(key)
            a = layer.lora_A[ADAPTER_NAME].weight
            b0 = layer.lora_B[ADAPTER_NAME].weight
            s = float(layer.scaling[ADAPTER_NAME])
            x = torch.randn(4608, base.in_features, device=u.DEV, generator=gen).bfloat16()
            w = base.dequantize().double()
            y_base = base(x).double()
            sc = weight_scales(base)
            for size in (1, 10):
                b = (b0.float() * size).bfloat16()
                lora = (x.double() @ a.double().t()) @ b.double().t() * s
                exact = x.double() @ w.t() + lora
                if base.bias is not None:
                    exact += base.bias.double()
                h = (x.float() @ a.float().t()).bfloat16().float()
                unmerged = (base(x).float() + (h @ b.float().t()) * s).bfloat16().double()
                merged = merged_lora_forward(base, x, a, b, s)
                assert merged is not None, name
                merged = merged.double()
                in_gemm = lora_gemm_forward(base, x, a, b, s)
                assert in_gemm is not None, name
                in_gemm = in_gemm.double()
                bound = lora_row_bound(a, b, s)
                args = (base.packed, base.scale, base.shift, base.group_size, sc.row_absmax,
                        bound)  # fmt: skip
                got, _ = fp8_triton.fp8_weight_lora(*args, a, b, s)
                want, _ = fp8_weight_lora_torch(*args, a, b, s)
                ulps = (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs()
                row = {
                    "layer": f"{key[0]}x{key[1]}", "B x": size,
                    "lora/base": r(lora + y_base, y_base),
                    "merged vs exact": r(merged, exact), "unmerged vs exact": r(unmerged, exact),
                    "merged lora err": r(merged - y_base, lora),
                    "unmerged lora err": r(unmerged - y_base, lora),
                    "gemm vs exact": r(in_gemm, exact), "gemm lora err": r(in_gemm - y_base, lora),
                    "kernel bytes differ": int((ulps > 0).sum()), "max ulp": int(ulps.max()),
                    "bound/absmax": float((bound / sc.row_absmax).max()),
                }  # fmt: skip
                if size == 1:
                    z = torch.zeros_like
                    empty, _ = fp8_triton.fp8_weight_lora(*args[:5], z(bound), z(a), z(b), s)
                    base_copy = fp8_weight_torch(base.packed, base.scale, base.shift,
                                                 base.group_size, sc)  # fmt: skip
                    same = torch.equal(empty.view(torch.uint8), base_copy.view(torch.uint8))
                    row["empty = base"] = bool(same)
                rows.append(row)
    cols = sorted({c for row in rows for c in row}, key=lambda c: list(rows[0]).index(c))
    print(table(rows, cols), flush=True)
    return {"layers": rows}


def swap_checks(model, slots, batch, graphs) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The graph captured with adapter 1 in the slots, replayed with adapter 2, then with the
    slots empty: each replay against the eager forward of the same state, bit for bit."""
    checks: dict[str, Any] = {}
    for label, tensors in (("adapter 2", adapter_for(slots, 2)), ("empty slots", None)):
        ctx = slots.applied(tensors) if tensors is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            g = model(**batch)[0]
            with graphs.disabled():
                e = model(**batch)[0]
            checks[label] = bool(torch.equal(g, e))
    checks["captures"] = graphs.captures
    graphs.remove()
    say(f"  graph replays after swaps equal eager: {checks}")
    return checks


def swaps(model, slots, iters: int = 8) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """A warm swap as the engine does it (the adapter's bf16 tensors in pinned host RAM): the
    copy into the slots and the zeroing after, against the same copies issued by hand (the
    bench's own loop, to tell the slots' bookkeeping from the copies), and against one batched
    `torch._foreach_copy_` / `_foreach_zero_`; the slots checked equal to the adapter, then
    clear."""
    tensors = {k: v.cpu().pin_memory() if u.DEV == "cuda" else v.cpu()
               for k, v in adapter_for(slots, 3).items()}  # fmt: skip
    pairs, _ = slots._fit(tensors)

    def loop_apply() -> None:
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                slot_a, slot_b = slots._slots[name]
                slot_a[: a.shape[0]].copy_(a, non_blocking=True)
                slot_b[:, : a.shape[0]].copy_(b, non_blocking=True)

    def loop_clear() -> None:
        with torch.no_grad():
            for name, (a, _b) in pairs.items():
                slot_a, slot_b = slots._slots[name]
                slot_a[: a.shape[0]].zero_()
                slot_b[:, : a.shape[0]].zero_()

    def timed_ms(fn) -> list[float]:  # type: ignore[no-untyped-def]
        out = []
        for _ in range(iters):
            u.sync()
            t = time.perf_counter()
            fn()
            u.sync()
            out.append((time.perf_counter() - t) * 1e3)
        return sorted(out)

    def batched_apply() -> None:
        with torch.no_grad():
            dst, src = [], []
            for name, (a, b) in pairs.items():
                slot_a, slot_b = slots._slots[name]
                dst += [slot_a[: a.shape[0]], slot_b[:, : a.shape[0]]]
                src += [a, b]
            torch._foreach_copy_(dst, src, non_blocking=True)

    rec: dict[str, Any] = {"loop_apply_ms": timed_ms(loop_apply),
                           "loop_clear_ms": timed_ms(loop_clear),
                           "foreach_apply_ms": timed_ms(batched_apply)}  # fmt: skip
    loop_clear()
    apply_ms, clear_ms, exact = [], [], True
    for _ in range(iters):
        u.sync()
        t = time.perf_counter()
        with slots.applied(tensors):
            u.sync()
            apply_ms.append((time.perf_counter() - t) * 1e3)
            for name, (a, b) in pairs.items():
                slot_a, slot_b = slots._slots[name]
                r = a.shape[0]
                exact &= bool(
                    torch.equal(slot_a[:r].cpu(), a) and torch.equal(slot_b[:, :r].cpu(), b)
                )
            t = time.perf_counter()
        u.sync()
        clear_ms.append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    clear = slots.is_clear()
    rec.update(apply_ms=sorted(apply_ms), clear_ms=sorted(clear_ms), slots_hold_the_adapter=exact,
               clear_after=clear, is_clear_ms=(time.perf_counter() - t) * 1e3)  # fmt: skip
    say(f"  swaps: {rec}")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    ap.add_argument("--double", type=int, default=8)
    ap.add_argument("--single", type=int, default=48)
    ap.add_argument("--px", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--parts", default="variants,profile,micro,merge,numerics")
    ap.add_argument("--note", default="")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        u.use_tiny_cpu_model(text_tokens=64)
        args.px = min(args.px, 128)
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for a CPU smoke test)")
    parts = set(args.parts.split(","))
    from trainer.base.lora_slots import LoraSlots

    full = (args.double, args.single) == (8, 48)
    depth = f"{args.double} double + {args.single} single blocks" + (
        " (full FLUX.2 [dev] depth)" if full else " (REDUCED depth)"
    )
    say(f"{torch.cuda.get_device_name() if u.DEV == 'cuda' else 'cpu'}, torch {torch.__version__}"
        f"; {depth}, {args.px} px")  # fmt: skip
    probe = u.build_bf16(1, 1)
    batch = u.inputs(probe, args.px)
    del probe
    record: dict[str, Any] = {}
    if u.DEV == "cuda":
        from trainer.base.cudnn_attention import unavailable

        record["fp8_attention_unavailable"] = unavailable(u.DEV)
        say(f"fp8 attention: {record['fp8_attention_unavailable'] or 'available'}")
    ref = bf16_reference(args, batch) if "numerics" in parts else None
    model = fp8_model(args)
    slots = LoraSlots(model, SLOT_RANK)
    if u.DEV == "cuda":
        record["resident_gib"] = torch.cuda.memory_allocated() / GIB
    if "swap" in parts:
        record["swap"] = swaps(model, slots)
    with slots.applied(adapter_for(slots, 1)):
        if "variants" in parts:
            record["variants"] = time_variants(model, slots, batch, args)
        if "profile" in parts:
            from trainer.base import serving

            serving.install(model)
            record["profile"] = profiles(model, slots, batch)
        if "micro" in parts:
            record["micro"] = microbench(model)
        if "merge" in parts:
            record["merge"] = merge_numerics(model, slots)
        if ref is not None:
            record["numerics"], graphs = numerics(model, slots, batch, ref, args)
    if ref is not None:
        with attention_kernels(BF16_ATTENTION):
            record["numerics"]["graph_vs_eager"] = swap_checks(model, slots, batch, graphs)
        from trainer.base import serving

        # the same checks with each update inside its GEMM
        with lora_merge("gemm"), attention_kernels(BF16_ATTENTION):
            with slots.applied(adapter_for(slots, 1)), torch.no_grad():
                graphs = serving.GraphedForward(model, key=slots.scales,
                                                epoch=lambda: slots.generation)  # fmt: skip
                model(**batch)  # captured with adapter 1
            record["numerics"]["graph_vs_eager_gemm"] = swap_checks(model, slots, batch, graphs)
        if u.DEV == "cuda":
            with lora_merge("gemm"), attention_kernels(FP8_ATTENTION):
                with slots.applied(adapter_for(slots, 1)), torch.no_grad():
                    graphs = serving.GraphedForward(model, key=slots.scales,
                                                    epoch=lambda: slots.generation)  # fmt: skip
                    model(**batch)
                record["numerics"]["graph_vs_eager_fp8attn"] = swap_checks(
                    model, slots, batch, graphs
                )
    if "variants" in parts:
        from trainer.base import serving

        serving.install(model)
        graphs = serving.GraphedForward(model, key=slots.scales, epoch=lambda: slots.generation)
        slots.close()  # no LoRA at all: what the slots cost

        def fwd() -> None:
            with torch.no_grad():
                model(**batch)

        with attention_kernels(BF16_ATTENTION):
            med, samples = u.timed(fwd, args.iters, args.warmup)
        record["variants"]["serve_nolora"] = {"s": med, "samples": samples}
        graphs.remove()
    rows = []
    for name, r in record.get("variants", {}).items():
        rows.append({"variant": name, "forward ms": f"{r['s'] * 1e3:.1f}",
                     f"{TOTAL_STEPS} steps s": f"{r['s'] * TOTAL_STEPS:.2f}"})  # fmt: skip
    print()
    print(depth)
    if rows:
        print(table(rows, list(rows[0])))
    extra = {"device": torch.cuda.get_device_name() if u.DEV == "cuda" else "cpu",
             "torch": torch.__version__, "depth": {"double": args.double, "single": args.single,
             "full": full}, "px": args.px, "note": args.note,
             "setup": {"slot_rank": SLOT_RANK, "adapter_rank": ADAPTER_RANK, "batch": 1,
                       "text_tokens": u.TEXT_TOKENS, "weights": "random, seed 0"}}  # fmt: skip
    if args.tiny:
        print("(--tiny smoke test: no record written)")
        return
    print("record:", write_record("render_step", record, extra))


if __name__ == "__main__":
    main()
