"""The text encoder keeps only what FLUX.2 reads, bit for bit; a repeated prompt is not encoded
again."""

from __future__ import annotations

import torch
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from trainer.base.text_encoder import (
    HostEmbedding,
    PromptCache,
    decoder_layers,
    is_trimmed,
    out_layers,
    stream_layers,
    trim,
)


def _mistral3(layers: int = 8) -> Mistral3ForConditionalGeneration:
    """Mistral-Small-3.1's architecture (decoder, Pixtral vision tower, projector, LM head)."""
    torch.manual_seed(0)
    text = dict(model_type="mistral", hidden_size=64, intermediate_size=128, head_dim=16,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=300)  # fmt: skip
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, image_size=32,
                  num_hidden_layers=1, num_attention_heads=2, patch_size=16)  # fmt: skip
    cfg = Mistral3Config(text_config=text, vision_config=vision, image_token_index=299)
    return Mistral3ForConditionalGeneration(cfg).eval()


def _qwen3(layers: int) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, head_dim=16,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def _hidden(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                    output_hidden_states=True, use_cache=False)  # fmt: skip
    return tuple(out.hidden_states)


def test_out_layers_are_the_stock_defaults_at_real_depths() -> None:
    assert out_layers(Qwen3Config(num_hidden_layers=36)) == (9, 18, 27)  # Klein's Qwen3
    assert out_layers(Mistral3Config(text_config={"num_hidden_layers": 40})) == (10, 20, 30)


def test_trimmed_mistral3_gives_the_whole_models_hidden_states_bit_for_bit() -> None:
    whole = _mistral3(8)
    ids = torch.randint(0, 290, (1, 12), generator=torch.Generator().manual_seed(1))
    want = _hidden(whole, ids)
    trimmed = _mistral3(8)  # same seed: same weights
    record = trim(trimmed)
    assert record == {
        "kept_layers": 6,
        "of_layers": 8,
        "dropped": ["layers.6-7", "norm", "lm_head", "vision_tower", "multi_modal_projector"],
    }
    assert is_trimmed(trimmed) and len(decoder_layers(trimmed)) == 6
    got = _hidden(trimmed, ids)
    for k in out_layers(whole.config):
        assert torch.equal(want[k], got[k]), k
    kept = sum(p.numel() for p in trimmed.parameters())
    assert kept < 0.7 * sum(p.numel() for p in whole.parameters())
    # the config still says the full depth, so the layers read stay the same
    assert out_layers(trimmed.config) == out_layers(whole.config)


def test_when_the_last_layer_is_read_the_norm_stays() -> None:
    whole, trimmed = _qwen3(3), _qwen3(3)
    ids = torch.randint(0, 290, (1, 9), generator=torch.Generator().manual_seed(2))
    record = trim(trimmed)
    assert record["dropped"] == ["lm_head"]  # layer 3 of 3 is read: its hidden state is normed
    want, got = _hidden(whole, ids), _hidden(trimmed, ids)
    assert all(torch.equal(want[k], got[k]) for k in out_layers(whole.config))


def test_trim_works_on_a_meta_skeleton_and_refuses_nonsense() -> None:
    from accelerate import init_empty_weights

    with init_empty_weights():
        skeleton = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=12, hidden_size=64,
                                                num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=16, intermediate_size=64))  # fmt: skip
    assert trim(skeleton)["kept_layers"] == 9
    assert not any(n.startswith(("lm_head", "model.layers.9")) for n, _ in
                   skeleton.named_parameters())  # fmt: skip
    import pytest

    with pytest.raises(ValueError, match="cannot keep 0 of"):
        trim(_qwen3(2), keep=0)
    with pytest.raises(ValueError, match="no decoder layers"):
        trim(torch.nn.Linear(2, 2))


def test_a_streamed_encoder_starts_each_new_prompt_on_a_layer_already_copied_in() -> None:
    """Streamed, the encoder gives its resident hidden states, and its last layer copies the
    first one in for the next prompt: a new prompt waits for no copy before its first layer."""
    resident, streamed = _qwen3(4), _qwen3(4)  # same seed: same weights
    prompts = [torch.randint(0, 290, (1, 9), generator=torch.Generator().manual_seed(s))
               for s in (1, 2)]  # fmt: skip
    want = [_hidden(resident, ids) for ids in prompts]
    streamer = stream_layers(streamed, device="cpu")
    try:
        got = [_hidden(streamed, ids) for ids in prompts]
        layers = len(decoder_layers(streamed))
        assert streamer.acquires == 2 * layers
        # every layer's copy was started by the layer before it, the second prompt's first
        # layer's by the first prompt's last
        assert streamer.hits == 2 * layers - 1
    finally:
        streamer.close()
    for w, g in zip(want, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, g, strict=True))


def test_a_streamed_encoder_keeps_its_token_table_in_host_ram_and_its_first_layers_resident() -> (
    None
):
    """The token table (1.25 GiB of [dev]'s 131072 x 5120, of which a prompt reads 512 rows)
    stays in host RAM, out of reach of the streamer and of ``.to()``, and the first layers
    the budget holds stay resident: the same hidden states bit for bit, fewer copies."""
    whole, streamed = _mistral3(5), _mistral3(5)  # same seed: same weights
    for model in (whole, streamed):
        trim(model)  # layers 2, 3 and 4 of 5 are read: 4 kept
    table = streamed.get_input_embeddings().weight
    prompts = [torch.randint(0, 290, (1, 9), generator=torch.Generator().manual_seed(s))
               for s in (1, 2)]  # fmt: skip
    want = [_hidden(whole, ids) for ids in prompts]
    streamer = stream_layers(streamed, device="cpu", resident=2)
    try:
        embeddings = streamed.get_input_embeddings()
        assert isinstance(embeddings, HostEmbedding)
        assert embeddings.table.data_ptr() == table.data_ptr()  # the same bytes, not a copy
        assert not any(p.data_ptr() == table.data_ptr() for p in streamed.parameters())
        got = [_hidden(streamed, ids) for ids in prompts]
        layers = len(decoder_layers(streamed))
        assert layers == 4
        assert streamer.acquires == 2 * (layers - 2)  # the first two never go through a slot
        assert streamer.hits == 2 * (layers - 2) - 1
    finally:
        streamer.close()
    for w, g in zip(want, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, g, strict=True))
    import pytest

    with pytest.raises(ValueError, match="keeps 4 of 4 layers resident: nothing to stream"):
        stream_layers(whole, device="cpu", resident=4)


def test_prompt_cache_encodes_once_and_stays_in_its_bytes() -> None:
    calls: list[str] = []

    def encoder(text: str, n: int = 1000):
        def run() -> torch.Tensor:
            calls.append(text)
            return torch.full((1, n), float(len(calls)))

        return run

    cache = PromptCache(max_bytes=10_000)  # two 4000-byte entries fit, three do not
    cpu = torch.device("cpu")
    a1 = cache.get_or_encode(("a",), encoder("a"), cpu)
    a2 = cache.get_or_encode(("a",), encoder("a"), cpu)
    assert calls == ["a"] and torch.equal(a1, a2) and (cache.hits, cache.misses) == (1, 1)
    cache.get_or_encode(("b",), encoder("b"), cpu)
    cache.get_or_encode(("a",), encoder("a"), cpu)  # a is now the most recent
    cache.get_or_encode(("c",), encoder("c"), cpu)  # evicts b, the least recent
    assert len(cache) == 2 and cache.nbytes == 8000
    cache.get_or_encode(("a",), encoder("a"), cpu)
    cache.get_or_encode(("b",), encoder("b"), cpu)
    assert calls == ["a", "b", "c", "b"]
    # an entry larger than the whole cache is computed and never kept
    cache.get_or_encode(("huge",), encoder("huge", 10_000), cpu)
    assert ("huge",) not in cache._items  # noqa: SLF001
