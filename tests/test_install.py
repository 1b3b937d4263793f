"""`pip install .` from the declared ranges, beside a torch that is already there (as on a GPU box).

The fast tests read the source: every third-party import is declared, and requirements.lock pins every core
dependency. The slow ones build fresh virtual environments (pip's cache makes a rerun quick), once with the
newest releases the ranges admit and once with every lower bound, and run tests/install_smoke.py in them.
torch is not reinstalled: the environment sees this interpreter's torch through a .pth file, because PyPI's
torch is a multi-GB CUDA build and a box that runs vLLM or TRL has its own torch already.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import mappa

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "mappa"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
CORE = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
EXTRAS = {name: [Requirement(r) for r in reqs] for name, reqs in PYPROJECT["project"]["optional-dependencies"].items()}
# Installed on purpose outside the extras: `make` puts ISLP in with --no-deps (its own dependencies are torch,
# lightning, lifelines... none needed to read its tables), and mappa.tasks.dsbench names that line when it is missing.
NOT_AN_EXTRA = {"islp"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports() -> dict[str, list[str]]:
    """Top-level package -> the files that import it, for every absolute import in src/mappa."""
    found: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if (path.parent / top).is_dir() or (path.parent / f"{top}.py").is_file():
                    continue  # a module beside a file run as a script (the sandbox runner and its package)
                if top != "mappa" and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    return found


# Source that runs only inside the sandbox, with the agent environment's packages (requirements-agents.lock).
AGENT_SIDE = {"src/mappa/sandbox/tables_scan.py", "src/mappa/tasks/dsbench/receipt_check.py"}


def test_every_third_party_import_is_declared():
    installed = importlib.metadata.packages_distributions()
    declared = {_norm(r.name) for r in CORE} | {_norm(r.name) for reqs in EXTRAS.values() for r in reqs}
    agents = (ROOT / "requirements-agents.lock").read_text(encoding="utf-8").splitlines()
    in_agent_env = {_norm(line.split("==")[0]) for line in agents if "==" in line}
    missing = {}
    for package, files in _third_party_imports().items():
        dists = {_norm(d) for d in installed.get(package, [package])}
        if set(files) <= AGENT_SIDE:  # imported where only the agent environment runs it
            if not dists & in_agent_env:
                missing[package] = sorted(set(files))
            continue
        # a package this environment lacks (an optional tracker) is named by its import name
        dists = {_norm(d) for d in installed.get(package, [package])}
        if not dists & (declared | NOT_AN_EXTRA):
            missing[package] = sorted(set(files))
    assert not missing, f"imported but declared neither in [project].dependencies nor in an extra: {missing}"


def test_the_lock_pins_every_core_dependency_inside_its_range():
    lock = {}
    for line in (ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            lock[_norm(name)] = version
    for req in CORE + EXTRAS["ray"] + EXTRAS["dsbench"]:
        assert _norm(req.name) in lock, f"{req.name} is declared but not pinned in requirements.lock"
        pinned = lock[_norm(req.name)]
        assert req.specifier.contains(pinned, prereleases=True), (
            f"requirements.lock: {req.name}=={pinned} not in {req}"
        )


def test_core_dependencies_are_ranges_with_a_lower_bound():
    for req in CORE:
        ops = {s.operator for s in req.specifier}
        assert ">=" in ops and "==" not in ops, f"{req}: a range with a tested lower bound, not a pin"


def test_the_version_has_one_source():
    assert PYPROJECT["project"]["dynamic"] == ["version"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mappa.__version__"}
    assert importlib.metadata.version("mappa-rl") == mappa.__version__


# ------------------------------------------------------------------------------------------------------------------
# fresh environments


def _fresh_env(path: Path) -> Path:
    """A new virtual environment that sees this interpreter's torch (and nothing else of it) through a .pth file."""
    venv.EnvBuilder(with_pip=True).create(path)
    torch_dist = importlib.metadata.distribution("torch")
    site = Path(torch_dist.locate_file(""))
    layer = path / "torch-layer"
    layer.mkdir()
    info = next(site.glob(f"torch-{torch_dist.version}.dist-info"))
    for name in ("torch", "torchgen", "functorch", info.name):
        if (site / name).exists():
            (layer / name).symlink_to(site / name)
    purelib = Path(sysconfig.get_paths(vars={"base": str(path), "platbase": str(path)})["purelib"])
    (purelib / "_torch_layer.pth").write_text(f"{layer}\n", encoding="utf-8")
    return path / "bin"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)


def _project_copy(dest: Path) -> Path:
    """What a source distribution holds, copied: building in the checkout would leave build/ there, whose stale
    modules a later build installs, and two builds at once would share it."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest


def _install(bin_dir: Path, pins: list[str]) -> None:
    project = _project_copy(bin_dir.parent.parent / "project")
    # torch's own requirements come from the ranges too: the layer holds torch's files, not what it needs
    torch_needs = [r for r in importlib.metadata.requires("torch") or [] if "extra ==" not in r]
    cmd = [str(bin_dir / "python"), "-m", "pip", "install", "-q", str(project), *pins, *torch_needs]
    proc = _run(cmd, cwd=project)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check = _run([str(bin_dir / "python"), "-m", "pip", "check"])
    assert check.returncode == 0, check.stdout


def _smoke(bin_dir: Path, tmp: Path) -> dict:
    proc = _run([str(bin_dir / "python"), str(ROOT / "tests" / "install_smoke.py")], cwd=tmp, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    modules = {
        ".".join(("mappa", *p.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        for p in SRC.rglob("*.py")
        if p.name != "__main__.py"
    }
    assert report["skipped"] == {}, f"modules that need an extra at import time: {report['skipped']}"
    assert set(report["imported"]) == modules
    assert report["mappa"].startswith(str(bin_dir.parent)), report["mappa"]  # the installed copy, not src/
    print("installed:", report["versions"])  # shown with -s or -rP: what the ranges resolved to today
    return report


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_pip_install_from_the_ranges_imports_everything_and_runs(tmp_path):
    bin_dir = _fresh_env(tmp_path / "env")
    _install(bin_dir, [])
    version = _run([str(bin_dir / "mappa"), "--version"])
    assert version.returncode == 0 and version.stdout.strip() == f"mappa {mappa.__version__}", version
    shown = _run([str(bin_dir / "mappa"), "config", "show", "--set", "train.steps=3"])
    assert shown.returncode == 0 and "\n  steps: 3\n" in shown.stdout, shown.stderr
    report = _smoke(bin_dir, tmp_path)
    installed = report["versions"]
    for req in CORE:
        if req.name in installed:
            assert req.specifier.contains(installed[req.name], prereleases=True), (req, installed)


def _lower_bounds() -> list[str]:
    pins = []
    for req in CORE:
        if req.name == "torch":  # this interpreter's, through the layer
            continue
        (low,) = [s.version for s in req.specifier if s.operator == ">="]
        pins.append(f"{req.name}=={low}")
    return pins


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_lower_bounds_install_and_run_a_tiny_model(tmp_path):
    bin_dir = _fresh_env(tmp_path / "env")
    pins = _lower_bounds()
    _install(bin_dir, pins)
    report = _smoke(bin_dir, tmp_path)
    for pin in pins:
        name, low = pin.split("==")
        if name in report["versions"]:
            assert Version(report["versions"][name]) == Version(low), (name, report["versions"])
