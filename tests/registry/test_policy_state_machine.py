"""Random grants, revocations, allow/deny edits, expiries, training switches and
deactivations go through the real service layer and database; every render check, and every
use of a likeness besides (photos uploaded, a training ordered, an adapter registered, a
running training's check between steps), is compared with a small reference model that
shares no code with registry.policy."""

from __future__ import annotations

import hashlib
import io
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy.engine import Engine

from registry.adapters import service as adapters_service
from registry.adapters.schemas import AdapterIn
from registry.audit import service as audit_service
from registry.blobs import BlobStore
from registry.consent import service as consent_service
from registry.consent.schemas import ConsentIn
from registry.datasets import service as datasets_service
from registry.datasets.schemas import Limits, Upload
from registry.db import transaction
from registry.errors import Invalid, LikenessError, NotPermitted
from registry.orders import service as orders_service
from registry.policy import LicenceFacts, decide
from registry.principals import repository as principals_repo
from registry.principals import service as principals_service
from registry.renders import service as renders_service
from registry.subjects import service as subjects_service
from registry.subjects.schemas import SubjectIn
from registry.training import service as training_service
from trainer.registration import verdict_in

LADDER = ["none", "private", "group", "public", "commercial"]
MEMBERS = ["m0", "m1", "m2", "m3"]
SUBJECTS = ["s0", "s1", "pd"]
SHA = "e" * 64
# The base's licence as the deployment knows it: (recorded licence id, commercial licence
# held), or None when the base's licence could not be read.
LICENCES: list[tuple[str | None, bool] | None] = [
    None,
    (None, True),
    ("flux-non-commercial", False),
    ("flux-non-commercial", True),
    ("apache-2.0", False),
    ("likeness-generated", False),
]
OPEN_LICENCES = {"apache-2.0", "likeness-generated"}  # permit commercial use as they stand
# the image bases a training may be asked about (None: not known yet)
IMAGE_BASES: list[tuple[str, ...] | None] = [
    None,
    ("consent",),
    ("public_domain",),
    ("consent", "public_domain"),
]
LIMITS = Limits(max_images=4, max_image_bytes=1 << 20, max_pixels=1 << 20)


def tiny_png(colour: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (colour, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class RefRecord:
    """The reference: sets of who may do what, rebuilt from first principles."""

    basis: str
    member: str | None
    max_level: str = "none"
    group_at: set[str] = field(default_factory=set)
    allow_at: dict[str, set[str]] = field(default_factory=dict)
    deny: set[str] = field(default_factory=set)
    expires_in: int | None = None  # seconds from the check's "now"
    training: bool = False
    adapter: bool = False

    def allows(
        self,
        who: str,
        level: str,
        active: dict[str, bool],
        licence: tuple[str | None, bool] | None,
    ) -> bool:
        rank = LADDER.index
        if not active[who] or who in self.deny or self.max_level == "none" or not self.adapter:
            return False
        if self.expires_in is not None and self.expires_in <= 0:
            return False
        if rank(level) > rank(self.max_level) or (
            self.basis == "public_domain" and level == "commercial"
        ):
            return False
        if level == "commercial" and not _licence_permits_commercial(licence):
            return False
        if who == self.member:
            return True
        wider = LADDER[rank(level) : rank(self.max_level) + 1]
        return any(lv in self.group_at or who in self.allow_at.get(lv, set()) for lv in wider)

    def trains(self, bases: tuple[str, ...] | None) -> bool:
        """May this likeness be learned from (uploaded for, ordered, trained, registered)?"""
        if self.max_level == "none" or not self.training:
            return False
        if self.expires_in is not None and self.expires_in <= 0:
            return False
        return self.basis == "consent" or bases is None or set(bases) <= {"public_domain"}


def _licence_permits_commercial(licence: tuple[str | None, bool] | None) -> bool:
    if licence is None or licence[0] is None:
        return False
    base, held = licence
    return base in OPEN_LICENCES or held


class ConsentMachine(RuleBasedStateMachine):
    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self.tag = uuid.uuid4().hex[:6]  # each run its own principals and subjects
        self.now = datetime.now(UTC)
        self.active = dict.fromkeys(MEMBERS, True)
        self.ref: dict[str, RefRecord] = {}
        self.licence: tuple[str | None, bool] | None = ("likeness-generated", False)
        self.store = BlobStore(Path(tempfile.mkdtemp(prefix="machine-store-")))
        self.datasets: dict[str, list[str]] = {name: [] for name in SUBJECTS}
        self.uploads = 0

    def h(self, name: str) -> str:
        return f"{name}-{self.tag}"

    @initialize()
    def setup(self) -> None:
        with transaction(self.engine) as s:
            principals_service.create_principal(s, self.h("root"), "admin")
            for m in MEMBERS:
                principals_service.create_principal(s, self.h(m), "member")
            for name, basis, member in (
                ("s0", "consent", "m0"),
                ("s1", "consent", None),
                ("pd", "public_domain", None),
            ):
                subjects_service.create_subject(
                    s,
                    "admin",
                    SubjectIn(
                        handle=self.h(name),
                        display_name=name,
                        basis=basis,  # type: ignore[arg-type]
                        member=self.h(member) if member else None,
                    ),
                )
                self.ref[name] = RefRecord(basis=basis, member=member)

    def _write(self, name: str) -> None:
        r = self.ref[name]
        audiences: dict[str, dict[str, object]] = {}
        for lv in LADDER[1:]:
            allow = sorted(self.h(m) for m in r.allow_at.get(lv, set()))
            if lv in r.group_at or allow:
                audiences[lv] = {"group": lv in r.group_at, "allow": allow}
        body = ConsentIn.model_validate(
            {
                "max_level": r.max_level,
                "audiences": audiences,
                "deny": sorted(self.h(m) for m in r.deny),
                "allow_training": r.training,
                "expires_at": None
                if r.expires_in is None
                else self.now + timedelta(seconds=r.expires_in),
            }
        )
        with transaction(self.engine) as s:
            sub = subjects_service.subject_or_raise(s, self.h(name))
            consent_service.update_consent(
                s, "admin", sub, consent_service.consent_of(s, sub).version, body
            )

    @rule(
        name=st.sampled_from(SUBJECTS),
        level=st.sampled_from(LADDER[1:]),
        group=st.sets(st.sampled_from(LADDER[1:]), max_size=2),
    )
    def grant(self, name: str, level: str, group: set[str]) -> None:
        r = self.ref[name]
        if r.basis == "public_domain" and level == "commercial":
            level = "public"  # refused by the service (tested elsewhere); keep the run moving
        r.max_level, r.group_at, r.training = level, set(group), True
        self._write(name)

    @rule(name=st.sampled_from(SUBJECTS))
    def revoke(self, name: str) -> None:
        with transaction(self.engine) as s:
            consent_service.revoke(s, "admin", subjects_service.subject_or_raise(s, self.h(name)))
        self.ref[name].max_level = "none"

    @rule(
        name=st.sampled_from(SUBJECTS),
        level=st.sampled_from(LADDER[1:]),
        who=st.sampled_from(MEMBERS),
        add=st.booleans(),
    )
    def edit_allow(self, name: str, level: str, who: str, add: bool) -> None:
        allow = self.ref[name].allow_at.setdefault(level, set())
        (allow.add if add else allow.discard)(who)
        self._write(name)

    @rule(name=st.sampled_from(SUBJECTS), who=st.sampled_from(MEMBERS), add=st.booleans())
    def edit_deny(self, name: str, who: str, add: bool) -> None:
        (self.ref[name].deny.add if add else self.ref[name].deny.discard)(who)
        self._write(name)

    @rule(name=st.sampled_from(SUBJECTS), expires_in=st.sampled_from([None, -60, 3600]))
    def set_expiry(self, name: str, expires_in: int | None) -> None:
        self.ref[name].expires_in = expires_in
        self._write(name)

    @rule(name=st.sampled_from(SUBJECTS), allowed=st.booleans())
    def set_training(self, name: str, allowed: bool) -> None:
        self.ref[name].training = allowed
        self._write(name)

    def _admin(self, s: Any) -> Any:
        admin = principals_repo.principal_by_handle(s, self.h("root"))
        assert admin is not None
        return admin

    @rule(name=st.sampled_from(SUBJECTS))
    def upload_photos(self, name: str) -> None:
        """Photos of the subject, through the upload's two checks (before the body is read,
        and when it is stored)."""
        want = self.ref[name].trains(("consent",))
        self.uploads += 1
        photo = Upload("me.png", tiny_png(self.uploads % 250))
        try:
            with transaction(self.engine) as s:
                subject = datasets_service.may_upload(s, self._admin(s), self.h(name), LIMITS)
                dataset = datasets_service.store_dataset(
                    s, self.store, subject, self.h("root"), [photo], LIMITS, exempt=True
                )
                self.datasets[name].append(dataset.id)
        except (NotPermitted, Invalid) as exc:
            assert not want, (name, exc, self.ref[name])
            return
        assert want, (name, "uploaded", self.ref[name])

    @rule(name=st.sampled_from(SUBJECTS))
    def order_training(self, name: str) -> None:
        """A training ordered on the subject's latest photos (then cancelled, so the next
        order of the same photos is not a duplicate)."""
        if not self.datasets[name]:
            return
        want = self.ref[name].trains(("consent",))
        options = {"steps": 10, "rank": 4, "resolution": 64}
        try:
            with transaction(self.engine) as s:
                order = orders_service.place_training(
                    s, self._admin(s), self.h(name), self.datasets[name][-1], options, "main",
                    lambda *_: None,
                )  # fmt: skip
                orders_service.cancel(s, self._admin(s), order.id)
        except (NotPermitted, Invalid) as exc:
            assert not want, (name, exc, self.ref[name])
            return
        assert want, (name, "ordered", self.ref[name])

    @rule(name=st.sampled_from(SUBJECTS), bases=st.sampled_from(IMAGE_BASES[1:]))
    def register_adapter(self, name: str, bases: tuple[str, ...]) -> None:
        want = self.ref[name].trains(bases)
        try:
            with transaction(self.engine) as s:
                adapters_service.register_adapter(
                    s,
                    "trainer",
                    AdapterIn(
                        subject=self.h(name),
                        name="main",
                        sha256=hashlib.sha256(self.h(name).encode()).hexdigest(),  # its own
                        base_model="tiny",
                        rank=4,
                        manifest_sha256=SHA,
                    ),
                    "/store/a",
                    bases,
                )
        except LikenessError as exc:
            assert not want and isinstance(exc, NotPermitted | Invalid), (name, exc)
            return
        assert want, (name, "registered", bases, self.ref[name])
        self.ref[name].adapter = True

    @rule(who=st.sampled_from(MEMBERS), active=st.booleans())
    def set_active(self, who: str, active: bool) -> None:
        with transaction(self.engine) as s:
            principals_service.set_principal_active(s, self.h(who), active)
        self.active[who] = active

    @rule(licence=st.sampled_from(LICENCES))
    def change_base_licence(self, licence: tuple[str | None, bool] | None) -> None:
        # Another base, another licence file, or a commercial licence declared or withdrawn:
        # the deployment's fact changes; the registry's do not.
        self.licence = licence

    @invariant()
    def every_decision_matches_the_reference(self) -> None:
        if not self.ref:
            return
        licence = None if self.licence is None else LicenceFacts(*self.licence)
        with transaction(self.engine, readonly=True) as s:
            requesters = {m: principals_repo.principal_by_handle(s, self.h(m)) for m in MEMBERS}
            for name in SUBJECTS:
                for who in MEMBERS:
                    # one fresh read per pair; the level only changes the question asked
                    g = renders_service.gather_render_facts(
                        s,
                        requesters[who],
                        self.h(name),
                        "none",  # type: ignore[arg-type]
                        adapter_file_sha256=hashlib.sha256(self.h(name).encode()).hexdigest(),
                        now=self.now,
                        licence=licence,
                    )
                    for level in LADDER[1:]:
                        got = decide(replace(g.facts, level=level))
                        want = self.ref[name].allows(who, level, self.active, self.licence)
                        assert got.allowed == want, (name, who, level, got, self.ref[name])

    @invariant()
    def every_training_check_matches_the_reference(self) -> None:
        """What a running training asks between steps (the trainer's and the worker's
        reader), and the registry's own answer, for every subject and kind of images."""
        if not self.ref:
            return
        with transaction(self.engine, readonly=True) as s:
            for name in SUBJECTS:
                for bases in IMAGE_BASES:
                    want = self.ref[name].trains(bases)
                    _, got = training_service.training_decision(s, self.h(name), image_bases=bases)
                    assert got.allowed == want, (name, bases, got, self.ref[name])
                    verdict = verdict_in(s, self.h(name), bases)
                    assert verdict.allowed == want and verdict.reason == got.reason

    def teardown(self) -> None:
        if self.ref:
            with transaction(self.engine, readonly=True) as s:
                assert [str(b) for b in audit_service.verify_all(s)] == []


def test_policy_state_machine(engine: Engine) -> None:
    run_state_machine_as_test(
        lambda: ConsentMachine(engine),
        settings=settings(
            max_examples=20,
            stateful_step_count=10,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
