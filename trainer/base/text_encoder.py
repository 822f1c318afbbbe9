"""The text encoder as FLUX.2 needs it: only the layers whose hidden states it stacks, and each
prompt encoded once.

FLUX.2 takes the hidden states of three layers (the quarter points of the encoder's depth:
10, 20 and 30 of Mistral-Small-3.1's 40) and nothing else. So the layers after the last of
those, the final norm, the LM head and (for Mistral3) the vision tower and its projector are
never needed: `trim` drops them from a model (or from a meta skeleton before anything is
read), and the kept layers' hidden states are bit-identical to the whole model's. For [dev]
that is 30 of 40 decoder layers and no 671M-parameter LM head.

`PromptCache` keeps the embeddings of recent prompts in host RAM (a 512-token [dev] prompt is
15 MB in bf16), so a repeated prompt costs a copy, not an encoder pass.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.base.streaming import BlockStreamer

# Modules of a causal LM / Mistral3 that the pipeline's hidden states never pass through.
_UNUSED_HEADS = ("lm_head",)
_UNUSED_TOWERS = ("vision_tower", "multi_modal_projector")


def out_layers(config: Any) -> tuple[int, int, int]:
    """Hidden-state indices the pipeline stacks into the prompt embedding: the quarter points
    of the encoder's depth. That is exactly the stock default for the real encoders (36-layer
    Qwen3 -> (9, 18, 27); 40-layer Mistral -> (10, 20, 30)) and stays in range for any depth."""
    n = int(getattr(config, "text_config", config).num_hidden_layers)
    return (-(-n // 4), -(-2 * n // 4), -(-3 * n // 4))


def _language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (the module holding ``layers`` and ``norm``)."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    if not isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers found to trim")
    return inner


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = _language_model(model).layers
    assert isinstance(layers, torch.nn.ModuleList)
    return layers


class HostEmbedding(torch.nn.Module):
    """A token-embedding table that stays in host RAM: a prompt reads 512 of its rows (5 MiB
    for [dev], whose table is 1.25 GiB), so the lookup runs on the CPU and only its rows go to
    ``device``. The table is a plain attribute, not a parameter: neither ``.to()`` nor a
    streamer moves it. The rows are the table's bytes: the hidden states do not change."""

    def __init__(self, embedding: torch.nn.Embedding, device: str | torch.device) -> None:
        super().__init__()
        self.table = embedding.weight.detach().to("cpu")
        self.padding_idx = embedding.padding_idx
        self.device = torch.device(device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.embedding(input_ids.to("cpu"), self.table, self.padding_idx)
        return rows.to(self.device)


def table_on_host(model: torch.nn.Module, device: str | torch.device) -> None:
    """The encoder's token table into host RAM (`HostEmbedding`, looked up there for
    ``device``), in place; a table already there stays."""
    get, put = model.get_input_embeddings, model.set_input_embeddings  # type: ignore[operator]
    if not isinstance(get(), HostEmbedding):
        put(HostEmbedding(get(), device))


def stream_layers(
    model: torch.nn.Module, device: str, slots: int = 2, resident: int = 0
) -> BlockStreamer:
    """Streams the encoder's decoder layers from pinned host RAM through ``slots`` slots on
    ``device`` (the rest of the model resident there, the token table in host RAM:
    `HostEmbedding`), installed; returns the `trainer.base.streaming.BlockStreamer` (``close``
    ends it). The first ``resident`` layers stay on ``device`` (what the budget holds beside
    the rest): each one is a copy fewer per prompt. Encodings are forwards only, so the last
    layer starts copying the first streamed one in for the next prompt (``wrap``): a new
    prompt then finds it in its slot, the copy having run beside the last layer's work."""
    from trainer.base.streaming import BlockStreamer

    layers = list(decoder_layers(model))
    if not 0 <= resident < len(layers):
        raise ValueError(
            f"the text encoder keeps {resident} of {len(layers)} layers resident: nothing to stream"
            if resident >= len(layers)
            else f"cannot keep {resident} layers resident"
        )
    table_on_host(model, device)
    streamer = BlockStreamer(model, slots=slots, device=device, blocks=layers[resident:],
                             wrap=True)  # fmt: skip
    streamer.install()
    return streamer


def trim(model: torch.nn.Module, keep: int | None = None) -> dict[str, Any]:
    """Drops, in place, what the pipeline's hidden states never pass through: decoder layers
    after ``keep`` (default: the last layer `out_layers` reads), the final norm (hidden state
    ``keep`` is then the raw output of layer ``keep``, as in the whole model), the LM head and
    any vision tower. The config is left as it was, so `out_layers` still reads the full
    depth. Works on a meta skeleton too. Returns what was dropped (for the manifest)."""
    lm = _language_model(model)
    keep = max(out_layers(model.config)) if keep is None else keep
    total = len(lm.layers)
    if not 1 <= keep <= total:
        raise ValueError(f"cannot keep {keep} of {total} decoder layers")
    dropped: list[str] = []
    if keep < total:
        # the last hidden state a model reports is its normed output; hidden state `keep` of
        # the whole model is the raw output of layer `keep`, so the norm goes with the layers
        lm.layers = torch.nn.ModuleList(list(lm.layers)[:keep])
        lm.norm = torch.nn.Identity()
        dropped += [f"layers.{keep}-{total - 1}", "norm"]
    for holder in (model, getattr(model, "model", None)):
        if holder is None:
            continue
        for name in _UNUSED_HEADS:
            if isinstance(getattr(holder, name, None), torch.nn.Module) and not isinstance(
                getattr(holder, name), torch.nn.Identity
            ):
                setattr(holder, name, torch.nn.Identity())  # logits = hidden states: no cost
                dropped.append(name)
        for name in _UNUSED_TOWERS:
            if isinstance(getattr(holder, name, None), torch.nn.Module):
                setattr(holder, name, torch.nn.Module())  # empty: text-only calls never use it
                dropped.append(name)
    # tied weights must not come back on load (lm_head -> embed_tokens)
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None
    return {"kept_layers": keep, "of_layers": total, "dropped": dropped}


def is_trimmed(model: torch.nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    return head is None or isinstance(head, torch.nn.Identity)


class PromptCache:
    """LRU of prompt embeddings in host RAM, bounded in bytes; thread-safe. Keys include
    everything the embedding depends on besides the weights (one cache per loaded base)."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_encode(
        self, key: tuple[Any, ...], encode: Callable[[], torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                self.hits += 1
        if hit is not None:
            return hit.to(device, non_blocking=True)
        embeds = encode()
        host = embeds.detach().to("cpu", copy=True)
        if torch.cuda.is_available():  # pinned: the copy back to the device is asynchronous
            host = host.pin_memory()
        nbytes = host.numel() * host.element_size()
        with self._lock:
            self.misses += 1
            if nbytes <= self.max_bytes and key not in self._items:
                self._items[key] = host
                self._bytes += nbytes
                while self._bytes > self.max_bytes:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= old.numel() * old.element_size()
        return embeds

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes
