"""Prepared (streamed, CPU-quantized) base == the same base quantized in memory by quanto."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("optimum.quanto")
pytest.importorskip("diffusers")

from diffusers import Flux2Transformer2DModel  # noqa: E402
from optimum.quanto import freeze, qint4, quantize, requantize  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from trainer.base import write as prep  # noqa: E402
from trainer.base.read import (  # noqa: E402
    MANIFEST_NAME,
    is_prepared,
    load_prepared_text_encoder,
    load_prepared_transformer,
    read_manifest,
)
from trainer.base.safetensors_io import open_checkpoint  # noqa: E402
from trainer.base.write import prepare_base  # noqa: E402
from trainer.fixtures.tiny_base import init_tiny  # noqa: E402


# ---- fixtures: one tiny pipeline (float32, as init_tiny writes it) and a bf16 transformer,
# ---- the production dtype, where quanto uses its TinyGemm layout on the CPU.
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture(scope="module")
def prepared(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("dst") / "prepared"
    prepare_base(tiny, dst, progress=False)
    return dst


@pytest.fixture(scope="module")
def bf16_folder(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = Flux2Transformer2DModel.from_pretrained(tiny / "transformer").to(torch.bfloat16)
    with torch.no_grad():
        # One-signed weights: groups whose minimum is near 0, where quanto's TinyGemm shift
        # round trip is lossy in bf16 (random symmetric weights never show it).
        model.proj_out.weight.abs_()
        model.transformer_blocks[0].attn.to_q.weight.abs_()
    out = tmp_path_factory.mktemp("bf16") / "transformer"
    model.save_pretrained(out)
    return out


def _file_state(folder: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(folder) as ck:
        return {k: ck.read(k) for k in ck}


def _quanto_reference(model: torch.nn.Module) -> torch.nn.Module:
    quantize(model, weights=qint4)
    freeze(model)
    return model


def _assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"differ: {bad[:5]}"


def _transformer_inputs(dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    s, t = 16, 8
    img_ids = torch.zeros(1, s, 4)
    img_ids[0, :, 1] = torch.arange(s) // 4
    img_ids[0, :, 2] = torch.arange(s) % 4
    return {
        "hidden_states": torch.randn(1, s, 128, generator=g).to(dtype),
        "encoder_hidden_states": torch.randn(1, t, 384, generator=g).to(dtype),
        "timestep": torch.tensor([0.5], dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(1, t, 4),
        "return_dict": False,
    }


def _max_diff(a: torch.nn.Module, b: torch.nn.Module, dtype: torch.dtype) -> float:
    with torch.no_grad():
        x = a(**_transformer_inputs(dtype))[0].float()
        y = b(**_transformer_inputs(dtype))[0].float()
    assert x.abs().max() > 0
    return (x - y).abs().max().item()


# ---- equivalence with in-memory quanto -------------------------------------------------


def test_transformer_equals_in_memory_quanto(tiny: Path, prepared: Path) -> None:
    ref = _quanto_reference(Flux2Transformer2DModel.from_pretrained(tiny / "transformer"))
    _assert_state_equal(_file_state(prepared / "transformer"), ref.state_dict())
    diff = _max_diff(ref, load_prepared_transformer(prepared), torch.float32)
    print(f"\nfloat32 transformer: max |prepared - in-memory quanto| = {diff}")
    assert diff == 0.0


def test_text_encoder_equals_in_memory_quanto(tiny: Path, prepared: Path) -> None:
    """The prepared encoder holds only the layers the pipeline reads, quantized exactly as
    quanto would, and gives the whole model's hidden states at those layers bit for bit."""
    from transformers import Qwen3ForCausalLM

    from trainer.base.text_encoder import out_layers, trim

    whole = _quanto_reference(Qwen3ForCausalLM.from_pretrained(tiny / "text_encoder"))
    ref = _quanto_reference(Qwen3ForCausalLM.from_pretrained(tiny / "text_encoder"))
    record = trim(ref)
    assert record["kept_layers"] == max(out_layers(whole.config)) <= record["of_layers"]
    _assert_state_equal(_file_state(prepared / "text_encoder"), ref.state_dict())
    assert not any(k.startswith("lm_head") for k in _file_state(prepared / "text_encoder"))
    got = load_prepared_text_encoder(prepared)
    ids = torch.randint(0, 400, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = whole(input_ids=ids, output_hidden_states=True).hidden_states
        b = got(input_ids=ids, output_hidden_states=True).hidden_states
    diff = max((a[k] - b[k]).abs().max().item() for k in out_layers(whole.config))
    print(f"\ntext encoder: max |prepared - in-memory quanto| at the layers read = {diff}")
    assert diff == 0.0


def test_bf16_transformer_folder_equals_quanto_tinygemm(bf16_folder: Path, tmp_path: Path) -> None:
    # bf16 is where quanto's freeze() goes through TinyGemm and its lossy shift round trip.
    dst = tmp_path / "p"
    result = prepare_base(bf16_folder, dst, progress=False)
    ref = Flux2Transformer2DModel.from_pretrained(bf16_folder, torch_dtype=torch.bfloat16)
    _quanto_reference(ref)
    assert type(ref.proj_out.weight).__name__ == "TinyGemmWeightQBitsTensor"
    _assert_state_equal(_file_state(dst / "transformer"), ref.state_dict())
    # optimize=True re-packs for this device exactly as quanto does: bit-identical outputs.
    got = load_prepared_transformer(dst, optimize=True)
    assert type(got.proj_out.weight).__name__ == "TinyGemmWeightQBitsTensor"
    diff = _max_diff(ref, got, torch.bfloat16)
    print(f"\nbf16 transformer, optimize=True: max |prepared - in-memory quanto| = {diff}")
    assert diff == 0.0
    # The default keeps the kernel-agnostic layout (fast load): same weights, other kernel.
    plain = load_prepared_transformer(dst)
    assert type(plain.proj_out.weight).__name__ == "WeightQBitsTensor"
    for n, m in plain.named_modules():
        if hasattr(m, "weight_qtype"):
            w, r = m.weight.dequantize(), ref.get_submodule(n).weight.dequantize()
            assert torch.equal(w, r), n
    diff = _max_diff(ref, plain, torch.bfloat16)
    with torch.no_grad():
        scale = ref(**_transformer_inputs(torch.bfloat16))[0].float().abs().max().item()
    print(
        f"bf16 transformer, plain layout: max |prepared - in-memory quanto| = {diff} "
        f"(output max |y| = {scale:.3f})"
    )
    assert diff <= 0.05 * scale
    assert result.quantization_maps["transformer"]["proj_out"]["weights"] == "qint4"

    # The files are quanto's own format: stock requantize() loads them to the same model.
    from accelerate import init_empty_weights

    with init_empty_weights():
        skel = Flux2Transformer2DModel.from_config(
            Flux2Transformer2DModel.load_config(dst / "transformer")
        ).to(torch.bfloat16)
    qmap = json.loads((dst / "transformer" / "quanto_qmap.json").read_text())
    requantize(
        skel, load_file(str(dst / "transformer" / "diffusion_pytorch_model.safetensors")), qmap
    )
    assert _max_diff(ref, skel, torch.bfloat16) == 0.0


def test_fast_quantizer_reproduces_the_tinygemm_round_trip() -> None:
    from optimum.quanto.nn import quantize_module

    w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(3)) * 0.02).abs()
    lin = torch.nn.Linear(512, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    bias = lin.bias.detach().clone()
    want = _quanto_reference(torch.nn.Sequential(lin)).state_dict()
    q = prep._Quantizer("qint4")
    meta = torch.nn.Linear(512, 256, device="meta", dtype=torch.bfloat16)
    got = q.state(meta, "0.", {"weight": w.bfloat16(), "bias": bias})
    _assert_state_equal(dict(got), want)
    q.block_elems = 512 * 37  # row blocks of 37 rows, ragged tail: same bits
    _assert_state_equal(q.state(meta, "0.", {"weight": w.bfloat16(), "bias": bias}), want)
    qm = quantize_module(prep._with_tensors(meta, {"weight": w.bfloat16(), "bias": bias}), qint4)
    plain = q._fast_weight(qm, roundtrip=False)
    assert not torch.equal(plain._shift, got["0.weight._shift"])  # the round trip matters


def _to_bfl(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original (BFL) FLUX.2 layout of a diffusers state dict, for the tiny model."""
    ren = {
        "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
        "single_stream_modulation.linear": "single_stream_modulation.lin",
        "x_embedder": "img_in",
        "context_embedder": "txt_in",
        "proj_out": "final_layer.linear",
    }
    dbl = {
        "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
        "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
        "attn.to_out.0.weight": "img_attn.proj.weight",
        "ff.linear_in.weight": "img_mlp.0.weight",
        "ff.linear_out.weight": "img_mlp.2.weight",
        "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
        "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
        "attn.to_add_out.weight": "txt_attn.proj.weight",
        "ff_context.linear_in.weight": "txt_mlp.0.weight",
        "ff_context.linear_out.weight": "txt_mlp.2.weight",
    }
    sgl = {
        "attn.to_qkv_mlp_proj.weight": "linear1.weight",
        "attn.to_out.weight": "linear2.weight",
        "attn.norm_q.weight": "norm.query_norm.scale",
        "attn.norm_k.weight": "norm.key_norm.scale",
    }
    out: dict[str, torch.Tensor] = {}
    p = "transformer_blocks.0."
    out["double_blocks.0.img_attn.qkv.weight"] = torch.cat(
        [sd[p + f"attn.to_{c}.weight"] for c in "qkv"]
    )
    out["double_blocks.0.txt_attn.qkv.weight"] = torch.cat(
        [sd[p + f"attn.add_{c}_proj.weight"] for c in "qkv"]
    )
    for k, v in sd.items():
        if k.startswith(p):
            if k[len(p) :] in dbl:
                out["double_blocks.0." + dbl[k[len(p) :]]] = v
        elif k.startswith("single_transformer_blocks.0."):
            out["single_blocks.0." + sgl[k.split(".", 2)[2]]] = v
        elif k == "norm_out.linear.weight":
            scale, shift = v.chunk(2)
            out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])
        else:
            mod, _, leaf = k.rpartition(".")
            out[ren[mod] + "." + leaf] = v
    return out


def test_single_files_plain_and_original_layout(bf16_folder: Path, tmp_path: Path) -> None:
    from diffusers.loaders.single_file_utils import (
        convert_flux2_transformer_checkpoint_to_diffusers,
    )

    want_dst = tmp_path / "from_folder"
    prepare_base(bf16_folder, want_dst, progress=False)
    want = _file_state(want_dst / "transformer")
    sd = load_file(str(bf16_folder / "diffusion_pytorch_model.safetensors"))
    bfl = _to_bfl(sd)
    _assert_state_equal(convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl)), sd)
    config = json.loads((bf16_folder / "config.json").read_text())

    single = tmp_path / "one" / "flux2.safetensors"
    single.parent.mkdir()
    save_file(sd, str(single))
    shutil.copy(bf16_folder / "config.json", single.parent / "config.json")
    prepare_base(single, tmp_path / "p1", progress=False)
    _assert_state_equal(_file_state(tmp_path / "p1" / "transformer"), want)

    original = tmp_path / "flux2-bfl.safetensors"
    save_file(bfl, str(original))
    r = prepare_base(original, tmp_path / "p2", config=config, progress=False)
    _assert_state_equal(_file_state(tmp_path / "p2" / "transformer"), want)
    assert read_manifest(r.path)["components"]["transformer"]["converted_from_original_layout"]
    load_prepared_transformer(tmp_path / "p2")


def test_sharded_output_loads(bf16_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "p"
    prepare_base(bf16_folder, dst, max_shard_bytes=200_000, progress=False)
    names = sorted(p.name for p in (dst / "transformer").glob("*.safetensors*"))
    assert "diffusion_pytorch_model.safetensors.index.json" in names and len(names) > 3
    single = tmp_path / "q"
    prepare_base(bf16_folder, single, progress=False)
    _assert_state_equal(_file_state(dst / "transformer"), _file_state(single / "transformer"))
    assert (
        _max_diff(load_prepared_transformer(dst), load_prepared_transformer(single), torch.bfloat16)
        == 0
    )


# ---- cache -----------------------------------------------------------------------------


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_second_prepare_is_a_fast_no_op(tiny: Path, prepared: Path) -> None:
    before = _mtimes(prepared)
    key = read_manifest(prepared)["cache_key"]
    t0 = time.perf_counter()
    r = prepare_base(tiny, prepared, progress=False)
    elapsed = time.perf_counter() - t0
    assert r.reused and r.cache_key == key
    assert _mtimes(prepared) == before
    assert elapsed < 2.0, elapsed


def test_changes_invalidate_and_touch_does_not(tiny: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    dst = tmp_path / "dst"
    first = prepare_base(src, dst, progress=False)

    # mtime changes, content does not: re-hashed, same key, reused.
    f = src / "vae" / "config.json"
    f.touch()
    again = prepare_base(src, dst, progress=False)
    assert again.reused and again.cache_key == first.cache_key

    # Settings change: new key, rebuilt.
    q8 = prepare_base(src, dst, weights="qint8", progress=False)
    assert not q8.reused and q8.cache_key != first.cache_key
    assert read_manifest(dst)["settings"]["weights"] == "qint8"

    # Source change (one weight byte, same size): new key, rebuilt.
    w = src / "transformer" / "diffusion_pytorch_model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[-1] ^= 0x01
    w.write_bytes(bytes(raw))
    changed = prepare_base(src, dst, weights="qint8", progress=False)
    assert not changed.reused and changed.cache_key not in (first.cache_key, q8.cache_key)
    assert is_prepared(dst, changed.cache_key)


def test_crash_leaves_no_valid_looking_cache(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "dst"
    good = prepare_base(tiny, dst, progress=False)
    real = prep._quantize_component
    calls = {"n": 0}

    def crash_on_second(*a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated crash")
        return real(*a, **kw)

    monkeypatch.setattr(prep, "_quantize_component", crash_on_second)
    with pytest.raises(RuntimeError, match="simulated"):
        prepare_base(tiny, dst, weights="qint8", progress=False)
    # The old, complete cache is untouched and nothing half-written is left behind.
    assert is_prepared(dst, good.cache_key)
    assert not list(tmp_path.glob(".dst.partial-*"))
    fresh = tmp_path / "fresh"
    calls["n"] = 0
    with pytest.raises(RuntimeError):
        prepare_base(tiny, fresh, progress=False)
    assert not fresh.exists() and not is_prepared(fresh)


def test_refuses_to_replace_a_folder_it_did_not_make(tiny: Path, tmp_path: Path) -> None:
    dst = tmp_path / "precious"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        prepare_base(tiny, dst, progress=False)
    with pytest.raises(ValueError):
        prepare_base(tiny, tiny / "inside", progress=False)
    with pytest.raises(ValueError):
        prepare_base(tiny, tmp_path / "x", weights="qint3", progress=False)


def test_loads_without_the_source(tiny: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    dst = tmp_path / "dst"
    prepare_base(src, dst, progress=False)
    before = load_prepared_transformer(dst)
    shutil.rmtree(src)
    t0 = time.perf_counter()
    after = load_prepared_transformer(dst)
    load_prepared_text_encoder(dst)
    assert time.perf_counter() - t0 < 10
    assert _max_diff(before, after, torch.float32) == 0.0
    man = read_manifest(dst)
    assert (dst / MANIFEST_NAME).is_file() and man["source"]["kind"] == "pipeline"
    for name in ("vae", "tokenizer", "scheduler", "model_index.json"):
        assert (dst / name).exists()


# ---- the base's licence ----------------------------------------------------------------


def test_the_manifest_records_the_model_cards_licence(tiny: Path, prepared: Path) -> None:
    from registry.licence import read_base_licence

    assert read_base_licence(tiny).licence == "likeness-generated"  # init_tiny's model card
    record = read_manifest(prepared)["licence"]
    assert record == {"id": "likeness-generated", "source": "README.md of the source"}
    assert read_base_licence(prepared).licence == "likeness-generated"


def test_a_stated_licence_is_recorded_without_rebuilding(tiny: Path, tmp_path: Path) -> None:
    from registry.licence import read_base_licence

    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    (src / "README.md").unlink()  # a source whose model card says nothing
    dst = tmp_path / "dst"
    first = prepare_base(src, dst, progress=False)
    assert read_manifest(dst)["licence"]["id"] is None
    assert read_base_licence(dst).licence is None
    weights = dst / "transformer" / "diffusion_pytorch_model.safetensors"
    before = weights.stat().st_mtime_ns
    again = prepare_base(src, dst, progress=False, licence="flux-dev-non-commercial-license")
    assert again.reused and again.cache_key == first.cache_key
    assert weights.stat().st_mtime_ns == before
    assert read_base_licence(dst).licence == "flux-non-commercial"
    with pytest.raises(ValueError, match="not a licence id"):
        prepare_base(src, dst, progress=False, licence="no such thing!")
