"""The locked environment (``locks/``, written by ``make lock``, installed by ``make install``)
covers the whole project: every requirement of pyproject.toml and of the extras the Makefile sets
up is pinned within its range, with the hashes pip checks; the packages that ship weights are
locked apart, without their declared runtimes; and every package this environment's installed
metadata says the project needs, directly or not, is locked at the version installed. Read from
the files and the installed metadata alone: nothing is fetched."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+, the lock's Python

ROOT = Path(__file__).resolve().parents[1]
LOCK, WEIGHTS_LOCK = ROOT / "locks" / "requirements.txt", ROOT / "locks" / "weights.txt"
EXTRAS = ("dev", "gguf", "docs")  # in LOCK; the minilm extra's package is a weight package
RUNTIMES = {"tensorflow", "llama-cpp-python", "llm", "sentence-transformers"}  # what the weight packages declare


def locked(path: Path) -> dict[str, tuple[str, list[str]]]:
    """``{name: (version, sha256 hashes)}`` of a lock file; anything but ``name==version`` with
    hashes fails."""
    entries: dict[str, tuple[str, list[str]]] = {}
    text = re.sub(r"\\\n", " ", path.read_text())  # continuation lines joined
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert match, f"{path.name}: not an exact pin with hashes: {line[:120]}"
        name = canonicalize_name(match.group(1))
        assert name not in entries, f"{path.name}: {name} twice"
        entries[name] = (match.group(2), re.findall(r"sha256:([0-9a-f]{64})", match.group(3)))
    return entries


def makefile_pins(variable: str) -> dict[str, str]:
    """``{name: version}`` of a ``VARIABLE := a==1 b==2`` line of the Makefile."""
    line = re.search(rf"^{variable}\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert line, variable
    return {canonicalize_name(name): version for name, version in (pin.split("==") for pin in line.group(1).split())}


def project_requirements() -> dict[str, list[Requirement]]:
    """pyproject.toml's requirements: ``""`` for the base dependencies, then per extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {"": [Requirement(r) for r in project["dependencies"]]}
    found.update({extra: [Requirement(r) for r in reqs] for extra, reqs in project["optional-dependencies"].items()})
    return found


def test_every_entry_is_an_exact_pin_with_its_hashes():
    main, weights = locked(LOCK), locked(WEIGHTS_LOCK)
    assert len(main) > 50 and all(hashes for _, hashes in [*main.values(), *weights.values()])
    assert not set(main) & set(weights)


def test_every_requirement_of_the_project_is_locked_within_its_range():
    main, weights = locked(LOCK), locked(WEIGHTS_LOCK)
    problems = []
    for extra, requirements in project_requirements().items():
        if extra not in ("", *EXTRAS, "minilm"):
            continue  # an extra make install leaves out (tensorboard)
        lock = weights if extra == "minilm" else main
        for req in requirements:
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            entry = lock.get(canonicalize_name(req.name))
            if entry is None or not req.specifier.contains(entry[0], prereleases=True):
                problems.append(f"[{extra or 'dependencies'}] {req}: locked {entry[0] if entry else 'nowhere'}")
    assert not problems, "run make lock:\n" + "\n".join(problems)


def test_the_makefile_pins_are_the_locked_versions():
    main, weights = locked(LOCK), locked(WEIGHTS_LOCK)
    torch_pin = makefile_pins("TORCH_PIN")
    assert set(torch_pin) == {"torch", "torchvision"}
    assert {name: main[name][0] for name in torch_pin} == torch_pin
    assert {name: version for name, (version, _) in weights.items()} == makefile_pins("WEIGHTS")
    assert not RUNTIMES & set(main), "a weight package's runtime was locked"


def _installed(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def test_every_installed_dependency_of_the_project_is_locked_at_its_installed_version():
    """From the project's requirements through the installed packages' own (their markers for this
    interpreter): each one reached is in the lock, at the version installed. The weight packages
    are not followed: their runtimes stay out."""
    main, weights = locked(LOCK), locked(WEIGHTS_LOCK)
    requirements = project_requirements()
    todo = [(req, extra) for extra in ("", *EXTRAS) for req in requirements[extra]]
    todo += [(req, "minilm") for req in requirements["minilm"]]
    seen: set[tuple[str, frozenset[str]]] = set()
    missing, differing = set(), set()
    while todo:
        req, extra = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (req.marker is not None and not req.marker.evaluate({"extra": extra})) or (name, extras) in seen:
            continue
        seen.add((name, extras))
        entry = main.get(name) or weights.get(name)
        dist = _installed(name)
        if entry is None:
            missing.add(name)
            continue
        if dist is None:
            continue  # locked but not installed here: nothing further to follow
        if dist.version != entry[0]:
            differing.add(f"{name}: installed {dist.version}, locked {entry[0]}")
        if name in weights:
            continue
        for text in dist.requires or []:
            todo += [(Requirement(text), wanted) for wanted in (extras or {""})]
    assert not missing, f"installed dependencies the lock leaves out (run make lock): {sorted(missing)}"
    assert not differing, "this environment is not the locked one (run make install):\n" + "\n".join(sorted(differing))
    reached = {name for name, _ in seen}
    assert {"torch", "lightning", "transformers", "numpy", "mkdocs", "gguf"} <= reached and not RUNTIMES & reached
