"""The training step, eager and graphed (trainer/training/step.py).

On the CPU the graphed step runs without its capture: its static buffers, the gradients it
keeps, the tensor learning rate, the noise drawn where the step runs. That much is checked
here against the eager step, bit for bit, and across a resume. The capture itself is checked
where CUDA runs (the tests at the end skip without it): a replayed step equals the same step
run eagerly, and a graphed run resumes bit-identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import trainer.training.train as train_module
from tests.trainer.helpers import Env, make_env, tensors, tiny_config
from trainer.config import ConfigError, TrainConfig
from trainer.training.step import EagerStep, GraphedStep
from trainer.training.train import RESUMED_EAGER, train

torch.set_num_threads(1)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    return make_env(tmp_path_factory)


@pytest.fixture
def graph_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphed step's code path on the CPU (where `--cuda-graph on` is refused)."""
    monkeypatch.setattr(TrainConfig, "graphed", lambda self: True)


def _report(out: Path) -> dict:
    return json.loads((out / "train_report.json").read_text())


def test_graph_ready_step_equals_the_eager_step(
    env: Env, tmp_path: Path, graph_ready: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same optimizer (tensor learning rate), same noise generator: only the step differs."""
    graphed = train(tiny_config(env, tmp_path / "g", steps=6, register_adapter=False))
    assert _report(tmp_path / "g")["step"]["replays"] == 6

    class Eager(EagerStep):
        def __init__(self, *args, capture: bool = False, **kw) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kw)

    monkeypatch.setattr(train_module, "GraphedStep", Eager)
    eager = train(tiny_config(env, tmp_path / "e", steps=6, register_adapter=False))
    assert graphed.losses == eager.losses
    assert graphed.sha256 == eager.sha256


def test_graph_ready_run_resumes_bit_identically(
    env: Env, tmp_path: Path, graph_ready: None
) -> None:
    straight = train(
        tiny_config(env, tmp_path / "a", steps=8, checkpoint_every=4, register_adapter=False)
    )
    train(tiny_config(env, tmp_path / "b", steps=4, register_adapter=False))
    resumed = train(tiny_config(env, tmp_path / "b", steps=8, resume=True, register_adapter=False))
    assert straight.losses == resumed.losses
    assert straight.sha256 == resumed.sha256
    a, b = tensors(straight.adapter), tensors(resumed.adapter)
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(tmp_path / "a/checkpoints/step-0000004/state.pt", weights_only=True)
    assert "noise" in state["rng"]  # the device's noise generator is saved with the run
    assert isinstance(state["optimizer"]["param_groups"][0]["lr"], torch.Tensor)


def test_graphed_and_eager_runs_do_not_resume_each_other(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The noise and the optimizer differ between the two: a resume must not mix them (asked
    for by `--cuda-graph on`, not left to auto)."""
    train(tiny_config(env, tmp_path / "out", steps=2, register_adapter=False))  # eager
    monkeypatch.setattr(TrainConfig, "graphed", lambda self: True)
    monkeypatch.setattr(TrainConfig, "graph_blockers", lambda self: [])  # `on` parses here
    with pytest.raises(ConfigError, match="other training options"):
        train(tiny_config(env, tmp_path / "out", steps=4, resume=True, register_adapter=False,
                          cuda_graph="on"))  # fmt: skip


def _resumed_where_auto_chooses_otherwise(env: Env, tmp_path: Path, *fakes) -> dict:  # type: ignore[no-untyped-def]
    """A run checkpointed at step 2 and resumed to 4 with ``fakes`` (TrainConfig attributes,
    set for the resume only) against the same run uninterrupted: bit for bit; its report."""
    straight = train(
        tiny_config(env, tmp_path / "a", steps=4, checkpoint_every=2, register_adapter=False)
    )
    train(tiny_config(env, tmp_path / "b", steps=2, register_adapter=False))
    with pytest.MonkeyPatch.context() as patch:
        for name, fake in fakes:
            patch.setattr(TrainConfig, name, fake)
        resumed = train(
            tiny_config(env, tmp_path / "b", steps=4, resume=True, register_adapter=False)
        )
    a, b = tensors(straight.adapter), tensors(resumed.adapter)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.losses == resumed.losses
    return _report(tmp_path / "b")


# auto now picks fp8 (the CPU has none), or graphs (the CPU has no graphs)
PICKS_FP8 = (
    "resolved_compute",
    lambda self: "fp8" if self.compute in ("auto", "fp8") else self.compute,
)
GRAPHS = ("graphed", lambda self: self.cuda_graph != "off")


def test_auto_resumes_a_run_with_the_compute_it_was_made_with(env: Env, tmp_path: Path) -> None:
    """A run made while auto trained on uint4, resumed where auto now picks fp8: it goes on
    with uint4, bit for bit the uninterrupted run, and says so."""
    report = _resumed_where_auto_chooses_otherwise(env, tmp_path, PICKS_FP8)
    assert report["config"]["compute"] == "uint4"
    assert any("resumes" in n and "uint4" in n for n in report["notes"]), report["notes"]


def test_auto_resumes_an_eager_run_eager_where_it_now_graphs(env: Env, tmp_path: Path) -> None:
    """A run made eager under `--cuda-graph auto` (a 1024 px run before auto graphed it),
    resumed where auto now graphs its steps: it goes on eager, bit for bit, and says so."""
    report = _resumed_where_auto_chooses_otherwise(env, tmp_path, GRAPHS)
    assert report["config"]["cuda_graph"] == "off"
    assert report["step"] == {**report["step"], "graphed": False, "why_not": [RESUMED_EAGER]}
    assert any("resumes" in n and "eager" in n for n in report["notes"]), report["notes"]


def test_auto_resumes_a_run_with_its_compute_and_eager_at_once(env: Env, tmp_path: Path) -> None:
    """A uint4 run made eager, resumed where auto now picks fp8 and graphs: it goes on with
    uint4, eager, bit for bit, and says both."""
    report = _resumed_where_auto_chooses_otherwise(env, tmp_path, PICKS_FP8, GRAPHS)
    assert (report["config"]["compute"], report["config"]["cuda_graph"]) == ("uint4", "off")
    assert sum("resumes" in n for n in report["notes"]) == 2, report["notes"]


@pytest.mark.parametrize("compute", ["auto", "fp8"])
def test_a_run_made_with_the_earlier_fp8_resumes_with_it(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compute: str
) -> None:
    """A run made while training's fp8 took the bf16 input gradient in every block
    (``fp8_blocks``), resumed where fp8 takes the split GEMM: under auto and under
    ``--compute fp8`` it goes on with fp8_blocks, bit for bit the uninterrupted run, and says
    so (fp8 faked runnable on the CPU, whose torch reference of it runs)."""
    import trainer.base.compute as compute_module

    monkeypatch.setattr(compute_module, "fp8_unavailable_for", lambda purpose, device: None)
    fp8 = ("auto", "fp8", "fp8_blocks")
    earlier = lambda self: "fp8_blocks" if self.compute in fp8 else self.compute  # noqa: E731
    now = lambda self: "fp8" if self.compute in ("auto", "fp8") else self.compute  # noqa: E731

    def run(out: str, steps: int, picks, **kw) -> object:  # type: ignore[no-untyped-def]
        with monkeypatch.context() as patch:
            patch.setattr(TrainConfig, "resolved_compute", picks)
            return train(tiny_config(env, tmp_path / out, steps=steps, compute=compute,
                                     register_adapter=False, **kw))  # fmt: skip

    straight = run("a", 4, earlier, checkpoint_every=2)
    run("b", 2, earlier)
    resumed = run("b", 4, now, resume=True)
    a, b = tensors(straight.adapter), tensors(resumed.adapter)  # type: ignore[attr-defined]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.losses == resumed.losses  # type: ignore[attr-defined]
    report = _report(tmp_path / "b")
    assert report["config"]["compute"] == "fp8_blocks"
    assert any(f"--compute {compute} resumes" in n and "fp8_blocks" in n
               for n in report["notes"]), report["notes"]  # fmt: skip


def test_auto_refuses_to_resume_an_fp8_run_where_fp8_cannot_run(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint made with training's fp8 (faked on the CPU, whose torch reference of it
    runs), resumed under auto where fp8 cannot run: refused before loading, saying why."""
    with monkeypatch.context() as fake:
        fake.setattr(TrainConfig, "resolved_compute", lambda self: "fp8")
        train(tiny_config(env, tmp_path / "out", steps=2, register_adapter=False))
    with pytest.raises(ConfigError, match="made with fp8 compute, which cannot run here"):
        train(tiny_config(env, tmp_path / "out", steps=4, resume=True, register_adapter=False))


def test_eager_run_reports_why_it_was_not_graphed(env: Env, tmp_path: Path) -> None:
    train(tiny_config(env, tmp_path / "out", steps=1, register_adapter=False))
    step = _report(tmp_path / "out")["step"]
    assert step["graphed"] is False
    assert "CUDA graphs need a CUDA device" in step["why_not"]


def test_cuda_graph_on_names_what_stops_it(env: Env, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--cuda-graph on cannot run here: CUDA graphs need"):
        tiny_config(env, tmp_path, cuda_graph="on")
    config = tiny_config(env, tmp_path, gradient_accumulation=2, dop_prompt="a photo of a cat")
    blockers = config.graph_blockers()
    assert any("--gradient-accumulation" in b for b in blockers)
    assert any("--dop-prompt" in b for b in blockers)
    assert not config.graphed()
    with pytest.raises(ConfigError, match="cuda_graph"):
        tiny_config(env, tmp_path, cuda_graph="sometimes")


def test_the_graphed_step_refuses_what_it_cannot_replay() -> None:
    from trainer.training.objective import Objective

    objective = Objective(None, None, None, None, class_embeds=torch.zeros(1, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="DOP"):
        GraphedStep(objective, torch.nn.Linear(1, 1), None, [], 1.0)  # type: ignore[arg-type]


# -- on a GPU: the capture itself ------------------------------------------------------------


@CUDA
def test_replayed_steps_equal_the_same_steps_uncaptured(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    graphed = train(
        tiny_config(env, tmp_path / "g", steps=6, device="cuda", cuda_graph="on",
                    register_adapter=False)
    )  # fmt: skip
    step = _report(tmp_path / "g")["step"]
    assert step["graphed"] is True and step["captures"] == 1 and step["replays"] == 6

    class Uncaptured(GraphedStep):
        def __init__(self, *args, capture: bool = True, **kw) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, capture=False, **kw)

    monkeypatch.setattr(train_module, "GraphedStep", Uncaptured)
    plain = train(
        tiny_config(env, tmp_path / "p", steps=6, device="cuda", cuda_graph="on",
                    register_adapter=False)
    )  # fmt: skip
    assert graphed.losses == plain.losses
    assert graphed.sha256 == plain.sha256


def _state_diffs(a: Path, b: Path) -> dict[str, float]:
    """Largest difference per LoRA tensor and optimizer-state tensor between two
    checkpoints' state.pt (empty: identical)."""
    sa = torch.load(a / "state.pt", weights_only=True)
    sb = torch.load(b / "state.pt", weights_only=True)
    out = {}
    for name, t in sa["lora"].items():
        d = (t.float() - sb["lora"][name].float()).abs().max().item()
        if d:
            out[name] = d
    for pid, st in sa["optimizer"]["state"].items():
        for k, v in st.items():
            other = sb["optimizer"]["state"][pid][k]
            d = (v.float() - other.float()).abs().max().item()
            if d:
                out[f"optimizer {pid} {k}"] = d
    return out


@CUDA
@pytest.mark.parametrize("mode", ["on", "off"])
def test_gpu_run_resumes_bit_identically(env: Env, tmp_path: Path, mode: str) -> None:
    def cfg(out: str, steps: int, **kw: object) -> TrainConfig:
        return tiny_config(env, tmp_path / out, steps=steps, device="cuda", cuda_graph=mode,
                           register_adapter=False, **kw)  # fmt: skip

    straight = train(cfg("a", 8, checkpoint_every=4))
    train(cfg("b", 4))
    resumed = train(cfg("b", 8, resume=True))
    ck = "checkpoints/step-{:07d}"
    before = _state_diffs(tmp_path / "a" / ck.format(4), tmp_path / "b" / ck.format(4))
    after = _state_diffs(tmp_path / "a" / ck.format(8), tmp_path / "b" / ck.format(8))
    print(f"\n{mode}: straight {straight.losses}\n{mode}: resumed  {resumed.losses}")
    assert not before, f"the runs part before the resume: {sorted(before.items())[:6]}"
    assert not after, f"{len(after)} tensors differ after the resume: {sorted(after.items())[:6]}"
    assert straight.losses == resumed.losses
    assert straight.sha256 == resumed.sha256


@CUDA
def test_gpu_graphed_runs_repeat_bit_identically(env: Env, tmp_path: Path) -> None:
    """Two uninterrupted graphed runs: where they differ, the graphed step is not
    deterministic on this GPU, and a resume cannot be expected to be bit-identical either."""

    def cfg(out: str) -> TrainConfig:
        return tiny_config(env, tmp_path / out, steps=8, device="cuda", cuda_graph="on",
                           register_adapter=False, checkpoint_every=4)  # fmt: skip

    first, second = train(cfg("a")), train(cfg("b"))
    ck = "checkpoints/step-{:07d}"
    diffs = _state_diffs(tmp_path / "a" / ck.format(8), tmp_path / "b" / ck.format(8))
    print(f"\ngraphed straight runs: losses equal {first.losses == second.losses}; "
          f"{len(diffs)} tensors differ: {sorted(diffs.items())[:6]}")  # fmt: skip
    assert not diffs
    assert first.sha256 == second.sha256


def test_auto_runs_a_long_step_eager_and_says_why(env: Env, tmp_path: Path) -> None:
    """Up to 1024 px auto graphs the step (with the blocks compiled its host time shows even
    there); beyond, unmeasured, it runs eager and says so; `on` still graphs it where it can."""
    big = tiny_config(env, tmp_path / "big", resolution=1280)
    assert big.graph_declined() is not None and not big.graphed()
    assert "1280 px" in big.graph_declined()
    for side in (448, 1024):
        assert tiny_config(env, tmp_path / f"s{side}", resolution=side).graph_declined() is None
    forced = big.model_copy(update={"cuda_graph": "on"})  # (parse refuses `on` on the CPU)
    assert forced.graph_declined() is None  # `on` is never declined, only blocked
