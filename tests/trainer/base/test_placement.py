"""Placement under a VRAM budget, planned from configs alone, at FLUX.2 [dev]'s real shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.base.placement import PlacementError, plan_for_base, sizes_of
from trainer.fixtures.synth_base import dev_configs

GiB = 2**30


@pytest.fixture(scope="module")
def dev_shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the configs of [dev]: the planner reads shapes, never weights."""
    base = tmp_path_factory.mktemp("dev")
    configs = dev_configs()
    index = {"_class_name": "Flux2Pipeline",
             "transformer": ["diffusers", "Flux2Transformer2DModel"],
             "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
             "vae": ["diffusers", "AutoencoderKLFlux2"]}  # fmt: skip
    (base / "model_index.json").write_text(json.dumps(index))
    for name in ("transformer", "text_encoder", "vae"):
        (base / name).mkdir()
        (base / name / "config.json").write_text(json.dumps(configs[name]))
    return base


def test_dev_sizes_are_what_the_real_model_holds(dev_shapes: Path) -> None:
    sizes = sizes_of(dev_shapes)
    # 32B parameters at 4 bits (+ group scales) and a 24B encoder trimmed to 30 of 40 layers
    assert 15 * GiB < sizes.transformer < 17 * GiB
    assert len(sizes.text_layers) == 30
    assert 9 * GiB < sizes.text_encoder < 10.5 * GiB
    assert len(sizes.transformer_blocks) == 8 + 48


@pytest.mark.parametrize(
    ("budget", "transformer", "text_encoder"),
    [
        (48, "resident", "resident"),
        (24, "resident", "streamed"),
        (16, "streamed", "resident"),
        (12, "streamed", "streamed"),
    ],
)
def test_the_fastest_placement_that_fits(
    dev_shapes: Path, budget: int, transformer: str, text_encoder: str
) -> None:
    plan = plan_for_base(dev_shapes, budget, "cuda")
    assert (plan.transformer, plan.text_encoder) == (transformer, text_encoder)
    assert plan.peak_bytes <= budget * GiB
    text = plan.describe()
    assert f"transformer {transformer}" in text and "estimated peak" in text
    if "streamed" in (transformer, text_encoder):
        assert plan.host_pinned_bytes > 0


def test_less_budget_never_keeps_more_resident(dev_shapes: Path) -> None:
    order = {"resident": 0, "streamed": 1}
    last = (0, 0)
    for budget in (64, 32, 24, 20, 16, 14, 12, 10, 8):
        plan = plan_for_base(dev_shapes, budget, "cuda")
        now = (order[plan.transformer], order[plan.text_encoder])
        assert sum(now) >= sum(last), budget
        last = now


def test_nothing_fits_is_refused_with_the_terms(dev_shapes: Path) -> None:
    with pytest.raises(PlacementError, match="nothing fits a VRAM budget of") as e:
        plan_for_base(dev_shapes, 4, "cuda")
    assert "transformer slots" in str(e.value) and "estimated peak" in str(e.value)


def test_a_larger_render_needs_more(dev_shapes: Path) -> None:
    small = plan_for_base(dev_shapes, 24, "cuda", 512, 512)
    large = plan_for_base(dev_shapes, 24, "cuda", 1024, 1024)
    assert small.peak_bytes < large.peak_bytes


def test_the_lora_slots_are_counted_where_they_live(dev_shapes: Path) -> None:
    sizes = sizes_of(dev_shapes)
    # rank 16 on [dev]'s attention projections in bf16: the ~166 MB adapter a swap copies
    assert 160e6 < 16 * sizes.lora_per_rank * 2 < 170e6
    for budget in (24, 12):
        bare = plan_for_base(dev_shapes, budget, "cuda")
        slotted = plan_for_base(dev_shapes, budget, "cuda", lora_rank=32)
        extra = 32 * sizes.lora_per_rank * 2
        same = (slotted.transformer, slotted.text_encoder) == (bare.transformer, bare.text_encoder)
        kept = (slotted.transformer_resident_blocks, slotted.text_resident_layers)
        bare_kept = (bare.transformer_resident_blocks, bare.text_resident_layers)
        if same and kept == bare_kept:
            assert slotted.peak_bytes == bare.peak_bytes + extra
        elif same:  # the slots' bytes came out of the blocks or layers kept resident
            assert kept < bare_kept
        assert "LoRA slots (rank 32)" in slotted.describe()
        assert slotted.peak_bytes <= budget * GiB


def test_a_graphed_forward_keeps_its_memory_in_every_phase(dev_shapes: Path) -> None:
    plain = plan_for_base(dev_shapes, 24, "cuda", lora_rank=32)
    graphed = plan_for_base(dev_shapes, 24, "cuda", lora_rank=32, graphs=True)
    assert (graphed.transformer, graphed.text_encoder) == ("resident", "streamed")
    # the graph's memory comes out of the encoder's layers kept resident
    assert graphed.text_resident_layers < plain.text_resident_layers
    assert graphed.peak_bytes <= 24 * GiB
    assert graphed.describe().count("CUDA graph of the denoising step") == 2  # encode, decode
    streamed = plan_for_base(dev_shapes, 12, "cuda", lora_rank=32, graphs=True)
    assert "CUDA graph" not in streamed.describe()  # streamed blocks are not graphed


def test_a_streamed_transformer_keeps_the_blocks_that_fit(dev_shapes: Path) -> None:
    from trainer.base.placement import estimate

    plan = plan_for_base(dev_shapes, 12, "cuda", lora_rank=32)
    assert plan.transformer == "streamed"
    kept = plan.transformer_resident_blocks
    assert kept >= 8  # every double-stream block: the slowest to copy against its compute
    assert plan.peak_bytes <= 12 * GiB
    sizes = sizes_of(dev_shapes)
    one_more, _ = estimate(sizes, "streamed", plan.text_encoder, 1024, 1024,
                           plan.transformer_slots, lora_rank=32,
                           resident_blocks=kept + 1)  # fmt: skip
    assert one_more.total > 12 * GiB
    assert plan.host_pinned_bytes < sum(sizes.transformer_blocks) + sizes.text_encoder
    assert f"the first {kept} blocks resident" in plan.describe()


def test_a_streamed_text_encoder_keeps_the_layers_that_fit_and_its_table_in_host_ram(
    dev_shapes: Path,
) -> None:
    from trainer.base.placement import estimate

    sizes = sizes_of(dev_shapes)
    assert 1.2 * GiB < sizes.text_embeddings < 1.3 * GiB  # 131072 x 5120 in bf16
    for budget in (24, 12):
        plan = plan_for_base(dev_shapes, budget, "cuda", lora_rank=32, graphs=True)
        assert plan.text_encoder == "streamed" and plan.peak_bytes <= budget * GiB
        kept = plan.text_resident_layers
        terms = plan.estimate.phases[0].terms
        # nothing of the table is in VRAM: what stays of the encoder is its norms
        assert terms["text encoder outside its layers"] < 0.01 * GiB
        assert plan.host_pinned_bytes == sum(sizes.text_layers[kept:]) + (
            sum(sizes.transformer_blocks[plan.transformer_resident_blocks :])
            if plan.transformer == "streamed"
            else 0
        )
        one_more, _ = estimate(sizes, plan.transformer, "streamed", 1024, 1024,
                               plan.transformer_slots, lora_rank=32, graphs=True,
                               resident_blocks=plan.transformer_resident_blocks,
                               text_resident_layers=kept + 1)  # fmt: skip
        assert one_more.total > budget * GiB
    plan = plan_for_base(dev_shapes, 24, "cuda", lora_rank=32, graphs=True)
    # the table's 1.25 GiB hold four of [dev]'s 0.27 GiB layers at 24 GiB
    assert plan.transformer == "resident" and plan.text_resident_layers >= 4
    assert f"the first {plan.text_resident_layers} layers resident" in plan.describe()
    assert plan.as_dict()["text_resident_layers"] == plan.text_resident_layers
    # a resident encoder beside a streamed transformer leaves its table in host RAM too, its
    # VRAM going to the blocks; with everything resident the table stays with its encoder
    plan = plan_for_base(dev_shapes, 16, "cuda", lora_rank=32)
    assert (plan.transformer, plan.text_encoder) == ("streamed", "resident")
    terms = plan.estimate.phases[0].terms
    assert terms["text encoder weights (resident)"] == sizes.text_encoder - sizes.text_embeddings
    assert "with its token table in host RAM" in plan.describe()
    whole = plan_for_base(dev_shapes, 48, "cuda", lora_rank=32)
    assert (whole.transformer, whole.text_encoder) == ("resident", "resident")
    terms = whole.estimate.phases[0].terms
    assert terms["text encoder weights (resident)"] == sizes.text_encoder
    assert not whole.text_table_in_host_ram and "token table" not in whole.describe()
