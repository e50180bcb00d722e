"""requirements.lock is what the tests run on: scripts/setup.sh installs it (hashes checked, --no-deps), so it must
name every dependency of finetune[test,bench,trackers,serve,eval] but torch's build, every pin must sit inside pyproject's ranges and
finetune.compat's tested ranges, and the environment running these tests must be the locked one. A lock refresh
(bash scripts/lock.sh --upgrade) that moves a package outside compat's ranges fails here, naming it."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from finetune import compat

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements.lock"
# Chosen per machine by scripts/setup.sh (a CPU or CUDA build), so not locked; nor are its CUDA libraries.
MACHINE_CHOSEN = re.compile(r"^(torch|triton|cuda-.*|nvidia-.*)$")
EXTRAS = ("test", "bench", "trackers", "serve", "ui", "eval")  # scripts/lock.sh's


def locked() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes)."""
    pins: dict[str, tuple[str, list[str]]] = {}
    name = None
    for line in LOCK.read_text().splitlines():
        head = re.match(r"^([A-Za-z0-9_.\-]+)==([^ \\]+)", line)
        if head:
            name = canonicalize_name(head[1])
            pins[name] = (head[2], [])
        elif name and (h := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            pins[name][1].append(h[1])
    return pins


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_every_pin_is_exact_and_hashed():
    pins = locked()
    assert len(pins) > 50, f"requirements.lock looks truncated: {len(pins)} packages"
    unhashed = [n for n, (_, hashes) in pins.items() if not hashes]
    assert not unhashed, f"no hash for {unhashed}: refresh with bash scripts/lock.sh"
    assert not [n for n in pins if MACHINE_CHOSEN.match(n)], "torch's build is setup.sh's choice, not the lock's"


def test_the_lock_is_complete():
    """Walk the requirements of finetune[test,bench,trackers,serve,eval] through the installed metadata: every one is locked, so
    `pip install --no-deps -r requirements.lock` leaves nothing out."""
    pins = locked()
    env = default_environment()
    todo = [Requirement(r) for r in project()["dependencies"]]
    for extra in EXTRAS:
        todo += [Requirement(r) for r in project()["optional-dependencies"][extra]]
    seen, missing = set(), []
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or MACHINE_CHOSEN.match(name):
            continue
        seen.add(name)
        if name not in pins:
            missing.append(name)
            continue
        for r in metadata.requires(req.name) or []:
            dep = Requirement(r)
            if dep.marker is None or dep.marker.evaluate({**env, "extra": ""}):
                todo.append(dep)
    assert not missing, f"not in requirements.lock: {sorted(missing)}; refresh with bash scripts/lock.sh"


def test_pins_sit_inside_pyproject_ranges():
    pins = locked()
    reqs = [Requirement(r) for r in project()["dependencies"]]
    for extra in EXTRAS:
        reqs += [Requirement(r) for r in project()["optional-dependencies"][extra]]
    outside = [f"{r.name}=={pins[canonicalize_name(r.name)][0]} (pyproject: {r.specifier})" for r in reqs
               if canonicalize_name(r.name) in pins
               and Version(pins[canonicalize_name(r.name)][0]) not in r.specifier]
    assert not outside, f"locked outside pyproject's ranges: {outside}"


def test_compat_tested_ranges_hold_the_locked_versions():
    pins = locked()
    outside = {p: (pins[p][0], t.spec) for p, t in compat.TESTED.items()
               if Version(pins[canonicalize_name(p)][0]) not in SpecifierSet(t.spec)}
    assert not outside, (f"the lock moved these outside finetune/compat.py's TESTED ranges: {outside}; check each "
                         "workaround named there on the new version, then widen its range")


def test_the_running_environment_is_the_locked_one():
    drift = {}
    for name, (version, _) in locked().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            drift[name] = (version, "not installed")
            continue
        if Version(installed) != Version(version):
            drift[name] = (version, installed)
    assert not drift, (f"installed versions differ from requirements.lock (locked, installed): {drift}; "
                       "bash scripts/setup.sh installs the lock, bash scripts/lock.sh records a deliberate change")
