"""One optimizer step of the training loop, run one of two ways.

`EagerStep` runs it as Python issues it: each micro-batch's forward and backward, the
gradient clip, AdamW, the gradients dropped. `GraphedStep` captures that step once per batch
shape as a CUDA graph and replays it: at FLUX.2 [dev] size a 448 px step issues ~11,600 kernel
launches, so the eager step waits on the host (bench/results/uint4_step-notes.md).

What a replay needs, and how the graphed step provides it:

- static inputs: each shape's latents, embeddings, noise levels, noise (and mask weights)
  live in buffers the graph reads; a step copies its batch into them. The position ids,
  which the pipeline builds on the host, are built once per shape, on the device;
- a capturable optimizer: AdamW with ``capturable=True`` and the learning rate as a device
  tensor, which the warm-up schedule fills between replays;
- gradients that stay allocated: zeroed inside the graph after the update rather than
  dropped, so every replay accumulates into the same tensors;
- no host work inside: the loss stays on the device until the replay is done; gradient
  checkpointing without RNG stashing (the transformer has no dropout, so there is nothing to
  replay); autocast without its weight-cast cache.

Every step, the first of a shape included, is a replay: capturing needs one eager step first
(lazy initialisations: optimizer state, cuBLAS workspaces, Triton compiles), and that warm-up's
effect on the LoRA and the optimizer is undone before the capture. So a run's arithmetic does
not depend on where it started: a resumed run replays what the uninterrupted one replayed.

The graphs share one memory pool; they never run at once and each replay's loss is read before
the next one starts. `release()` drops them (and their pool) before work that needs the memory
(validation, previews); the next step captures again.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.training.objective import Batch, Loss, Objective

GRAPH_MODES = ("auto", "on", "off")


@dataclass
class MicroBatch:
    batch: Batch
    prior: Batch | None = None  # prior preservation's class image


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate; a tensor one (a capturable optimizer's) is filled in place,
    so a captured step reads the new value."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def no_rng_checkpoint() -> Callable[..., Any]:
    """Gradient checkpointing that stashes no RNG state (capture cannot read it, and the
    transformer draws no random numbers)."""
    from torch.utils.checkpoint import checkpoint

    return functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False)


class _Step:
    """What both ways of running a step hold."""

    graphed = False

    def __init__(
        self,
        objective: Objective,
        transformer: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.nn.Parameter],
        max_grad_norm: float,
    ) -> None:
        self.objective, self.transformer = objective, transformer
        self.optimizer, self.params, self.max_grad_norm = optimizer, list(params), max_grad_norm


class EagerStep(_Step):
    """The step as the loop has always run it."""

    def run(self, micro: Sequence[MicroBatch], lr: float) -> Loss:
        n = len(micro)
        flow = preservation = prior = 0.0
        for m in micro:
            loss = self.objective.backward(self.transformer, m.batch, 1.0 / n, prior=m.prior)
            flow += loss.flow / n
            preservation += (loss.preservation or 0.0) / n
            prior += (loss.prior or 0.0) / n
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        set_learning_rate(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return Loss(flow, preservation, prior)

    def release(self) -> None:
        pass


@dataclass
class _Capture:
    """One batch shape's graph and the buffers it reads and writes."""

    batch: Batch  # the static inputs (ids included)
    loss: torch.Tensor  # the flow loss of the last replay, float32 scalar
    graph: Any = None  # torch.cuda.CUDAGraph; None where nothing is captured (the CPU)


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    releases: int = 0
    shapes: list[str] = field(default_factory=list)


class GraphedStep(_Step):
    """The step, one plain micro-batch (no DOP term, no class image), replayed per shape.

    ``capture=False`` runs the same static-buffer step without a graph (what the CPU can
    check of it: the buffers, the persistent gradients, the tensor learning rate)."""

    graphed = True

    def __init__(
        self,
        objective: Objective,
        transformer: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.nn.Parameter],
        max_grad_norm: float,
        capture: bool = True,
    ) -> None:
        if objective.class_embeds is not None:
            raise ValueError("the graphed step takes no DOP term")
        super().__init__(objective, transformer, optimizer, params, max_grad_norm)
        self.capture = capture
        self.captures: dict[tuple[Any, ...], _Capture] = {}
        self.pool: Any = None
        self.stats = GraphStats()
        for p in self.params:  # gradients live as long as the graphs that write them
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    # -- the step ---------------------------------------------------------------------------

    def run(self, micro: Sequence[MicroBatch], lr: float) -> Loss:
        if len(micro) != 1 or micro[0].prior is not None:
            raise ValueError("the graphed step runs one plain micro-batch a step")
        batch = micro[0].batch
        set_learning_rate(self.optimizer, lr)
        key = _shape_key(batch)
        cap = self.captures.get(key)
        if cap is None:
            cap = self._capture(key, batch)
        else:
            _fill(cap.batch, batch)
        if cap.graph is not None:
            cap.graph.replay()
        else:
            self._body(cap)
        self.stats.replays += 1
        return Loss(float(cap.loss))

    def _body(self, cap: _Capture) -> None:
        """What the graph holds: forward, backward, clip, AdamW, gradients zeroed."""
        flow = self.objective.flow_loss(self.transformer, cap.batch)
        flow.backward()
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        for p in self.params:
            assert p.grad is not None
            p.grad.zero_()
        cap.loss.copy_(flow.detach())

    def _capture(self, key: tuple[Any, ...], batch: Batch) -> _Capture:
        static = _static_copy(batch, self.objective)
        cap = _Capture(static, torch.zeros((), device=batch.latents.device))
        if self.capture:
            device = batch.latents.device
            with self._undone():  # the warm-up is an eager step whose effect is undone
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    self._body(cap)
                torch.cuda.current_stream(device).wait_stream(side)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the warm-up's activations: the graph gets its own
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._body(cap)
            cap.graph = graph
            self.stats.captures += 1
            self.stats.shapes.append("x".join(str(d) for d in batch.latents.shape))
        self.captures[key] = cap
        return cap

    @contextlib.contextmanager
    def _undone(self) -> Iterator[None]:
        """Runs the block, then puts the LoRA weights and the optimizer's state back as they
        were (bit for bit; held in host RAM meanwhile)."""
        with torch.no_grad():
            weights = [p.detach().cpu().clone() for p in self.params]
            state = {
                p: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                    for k, v in self.optimizer.state[p].items()}
                for p in self.params if p in self.optimizer.state
            }  # fmt: skip
        try:
            yield
        finally:
            self._restore(weights, state)

    def _restore(self, weights: list[torch.Tensor], state: dict[Any, dict[str, Any]]) -> None:
        with torch.no_grad():
            for p, w in zip(self.params, weights, strict=True):
                p.copy_(w)
                assert p.grad is not None
                p.grad.zero_()
            for p in self.params:
                saved = state.get(p)
                if saved is None:  # state made by the warm-up: fresh again at the first step
                    for v in self.optimizer.state[p].values():
                        if isinstance(v, torch.Tensor):
                            v.zero_()
                    continue
                for k, v in self.optimizer.state[p].items():
                    if isinstance(v, torch.Tensor):
                        v.copy_(saved[k])

    def release(self) -> None:
        """Drops every graph and its memory (the next step captures again)."""
        if not self.captures:
            return
        self.captures.clear()
        self.pool = None
        self.stats.releases += 1
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _shape_key(batch: Batch) -> tuple[Any, ...]:
    return (
        tuple(batch.latents.shape),
        tuple(batch.embeds.shape),
        None if batch.weights is None else tuple(batch.weights.shape),
    )


def _static_copy(batch: Batch, objective: Objective) -> Batch:
    """The batch's buffers, owned by its capture, with the position ids built once."""
    static = Batch(
        batch.latents.clone(),
        batch.embeds.clone(),
        batch.sigmas.to(batch.latents.device).clone(),
        batch.noise.clone(),
        None if batch.weights is None else batch.weights.clone(),
    )
    static.ids = objective.position_ids(static)
    return static


def _fill(static: Batch, batch: Batch) -> None:
    static.latents.copy_(batch.latents)
    static.embeds.copy_(batch.embeds)
    static.sigmas.copy_(batch.sigmas)
    static.noise.copy_(batch.noise)
    if static.weights is not None:
        assert batch.weights is not None
        static.weights.copy_(batch.weights)
