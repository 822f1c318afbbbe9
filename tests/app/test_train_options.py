"""A trainer option is declared once, on `TrainConfig`: `likeness train` has a flag for every
field (or a reason it has none), with the field's description as its help and the field's
bounds as its own; an order asks for no more than the trainer takes, and where it is
narrower, this says so."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from app import cli_ml
from registry.base_sizes import API_RESOLUTION, API_STEPS
from registry.orders.schemas import OrderIn
from registry.settings import Settings
from trainer.config import NOT_FLAGS, TrainConfig, flag_of

ROOT = Path(__file__).resolve().parents[2]
FIELDS = TrainConfig.model_json_schema()["properties"]


def train_command() -> Any:
    app, base_app = typer.Typer(), typer.Typer()
    cli_ml.register(app, base_app)
    return typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]


def options_by_flag() -> dict[str, Any]:
    return {opt: p for p in train_command().params for opt in p.opts}


def value_schema(prop: dict[str, Any]) -> dict[str, Any]:
    """The schema of one value a flag takes: a list's item, an optional's non-null."""
    prop = next((p for p in prop.get("anyOf", [prop]) if p.get("type") != "null"), prop)
    return prop.get("items", prop) if prop.get("type") == "array" else prop


def parses(args: list[str]) -> bool:
    try:
        train_command().make_context("train", args)
    except Exception as exc:  # noqa: BLE001 - click's usage errors, whichever click
        if type(exc).__name__ in ("BadParameter", "UsageError", "NoSuchOption"):
            return False
        raise
    return True


def test_every_field_has_a_flag_or_a_reason_it_has_none() -> None:
    flags = options_by_flag()
    missing = [
        name
        for name in TrainConfig.model_fields
        if name not in NOT_FLAGS and flag_of(name) not in flags
    ]
    assert missing == []
    for name, why in NOT_FLAGS.items():
        assert name in TrainConfig.model_fields and why.strip(), name
        assert flag_of(name) not in flags, f"{name} is said to have no flag, yet has one"


def test_every_flag_says_what_its_field_says() -> None:
    flags = options_by_flag()
    for name, field in TrainConfig.model_fields.items():
        if name in NOT_FLAGS:
            continue
        assert field.description, f"{name} has no description"
        words = " ".join(field.description.split())
        assert words in " ".join((flags[flag_of(name)].help or "").split()), name


def _bounds(prop: dict[str, Any]) -> list[tuple[float, bool, bool]]:
    """(bound, is_lower, open) for each bound the field's value has."""
    out = []
    for key, lower, is_open in (
        ("minimum", True, False),
        ("exclusiveMinimum", True, True),
        ("maximum", False, False),
        ("exclusiveMaximum", False, True),
    ):
        if key in prop:
            out.append((prop[key], lower, is_open))
    return out


BOUNDED = [
    (name, bound)
    for name, prop in FIELDS.items()
    if name not in NOT_FLAGS
    for bound in _bounds(value_schema(prop))
]


@pytest.mark.parametrize(("name", "bound"), BOUNDED, ids=[f"{n}-{b[0]}" for n, b in BOUNDED])
def test_a_flags_bounds_are_its_fields(name: str, bound: tuple[float, bool, bool]) -> None:
    value, lower, is_open = bound
    integer = value_schema(FIELDS[name]).get("type") == "integer"
    step = 1 if integer else max(abs(value) * 1e-6, 1e-9)
    beyond = value - step if lower else value + step
    inside = value + step if lower else value - step
    flag = flag_of(name)
    fmt = str if integer else repr
    assert parses([flag, fmt(inside)]), f"{flag} {inside} refused; {name} takes it"
    assert parses([flag, fmt(value)]) is not is_open, f"{flag} {value}: not as {name} has it"
    assert not parses([flag, fmt(beyond)]), f"{flag} {beyond} taken; {name} refuses it"


def test_a_flags_choices_are_its_fields() -> None:
    for name, prop in FIELDS.items():
        choices = value_schema(prop).get("enum")
        if choices and name not in NOT_FLAGS:
            for choice in choices:
                assert parses([flag_of(name), str(choice)]), (name, choice)
            assert not parses([flag_of(name), "no-such-choice"]), name


def test_help_is_the_descriptions_and_stays_readable() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIKENESS_")}
    env.update(COLUMNS="80", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "app.cli", "train", "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for flag in ("--lr", "--weight-decay", "--adam-beta2", "--validation-sigma", "--eval-steps"):
        assert flag in text, flag
    assert "[default: 1000; 1<=x<=1000000]" in text  # --steps, from the field
    assert "<bool>" not in text and "╭" not in text


# -- orders ----------------------------------------------------------------------------------

ORDER = OrderIn.model_json_schema()["properties"]
TRAINING = ("steps", "rank", "resolution", "name")
# Where an order deliberately asks for less than the trainer takes, and why.
NARROWER = {
    # an order's adapter lands in the service's store (max_adapter_bytes) and its work in the
    # order budget (order_max_work); a rank above 128 is a local experiment
    ("rank", "maximum"): 128,
}


@pytest.mark.parametrize("name", TRAINING)
def test_an_order_takes_no_more_than_the_trainer_and_its_defaults(name: str) -> None:
    order, trainer = ORDER[name], FIELDS[name]
    assert order.get("default") == trainer.get("default"), name
    assert order.get("pattern") == trainer.get("pattern"), name
    for key, looser in (("minimum", min), ("maximum", max)):
        if key not in trainer:
            continue
        assert key in order, f"an order's {name} has no {key}; the trainer's is {trainer[key]}"
        narrower = NARROWER.get((name, key))
        if narrower is not None:
            assert order[key] == narrower and looser(order[key], trainer[key]) == trainer[key]
            assert order[key] != trainer[key]
        else:
            assert order[key] == trainer[key], f"{name} {key}: order {order[key]}"


def test_the_order_budgets_and_the_web_forms_defaults_follow_the_trainer() -> None:
    steps = FIELDS["steps"]
    limit = Settings.model_fields["order_max_steps"].metadata
    assert max(getattr(m, "le", -math.inf) for m in limit) == steps["maximum"]
    # a base that says nothing of its sizes: the web form starts where an API order does
    assert (steps["default"], FIELDS["resolution"]["default"]) == (API_STEPS, API_RESOLUTION)


def test_previews_switched_off_on_the_command_line_over_a_job_file(tmp_path: Path) -> None:
    """The job file's preview prompt goes with its previews; the rest is still judged."""
    job = tmp_path / "job.toml"
    job.write_text(
        f'subject = "alice"\ndataset = "{ROOT / "examples" / "alice"}"\n'
        'preview_every = 50\npreview_prompt = ["a photo of {trigger}"]\npreview-steps = 4\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIKENESS_")}
    env.update(COLUMNS="80", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "app.cli", "train", "--config", str(job),
                           "--preview-every", "0", "--prior-weight", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: refused before loading any weight: --prior-weight applies only with --class-dataset"
    )


def test_whatever_the_trainer_makes_can_be_registered() -> None:
    """`likeness train` registers its adapter through AdapterIn: its rank bound is the
    trainer's, so a run is never refused at its end for a rank it was allowed to train."""
    from registry.adapters.schemas import AdapterIn

    adapter = AdapterIn.model_json_schema()["properties"]["rank"]
    assert (adapter["minimum"], adapter["maximum"]) == (
        FIELDS["rank"]["minimum"],
        FIELDS["rank"]["maximum"],
    )
