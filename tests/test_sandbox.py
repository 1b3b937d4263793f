"""The sandbox under hostile code: one adversarial property per test, in a cold run and in the warm pool, under
each confinement (bubblewrap and the fallback), each test asserting what that confinement promises.

Everything here is real: bubblewrap (or the fallback), real subprocesses, a real TCP server on 127.0.0.1.
Each adversarial test ends by checking that the test process itself is unharmed and that nothing the
snippet started is still running. The bubblewrap half skips, with the reason, where bubblewrap is present but
cannot start (e.g. no user namespaces) or is missing and cannot be installed; as root with apt a missing
bubblewrap fails it: the bootstrap installs it there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from mappa.config import SandboxConfig
from mappa.errors import MappaError
from mappa.sandbox import Sandbox, confine, new_workspace, remove_workspace, run_python, workspace_root
from mappa.sandbox.execute import BoundedStream, Limits, run_cold

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 1.5
LIMITS = dict(timeout_s=TIMEOUT, memory_mb=256, max_processes=32, max_file_mb=8, max_output_chars=2000)
IS_ROOT = os.geteuid() == 0


def confinement_or_skip(mode: str) -> confine.Confinement:
    if mode == "bwrap":
        problem = confine.bwrap_problem()
        if problem == "bubblewrap is not installed" and IS_ROOT and shutil.which("apt-get"):
            pytest.fail(
                "bubblewrap is not installed: as root with apt the bootstrap installs it (apt-get install bubblewrap)"
            )
        if problem is not None:
            pytest.skip(problem)
    return confine.detect_confinement(mode)


@pytest.fixture(scope="module", params=["bwrap", "fallback"])
def conf(request) -> confine.Confinement:
    return confinement_or_skip(request.param)


@pytest.fixture(scope="module")
def pool_sandbox(conf):
    cfg = SandboxConfig(pool=True, preload=["numpy"], concurrency=2, confinement=conf.kind, **LIMITS)
    with Sandbox(cfg) as sb:
        yield sb


@pytest.fixture(params=["cold", "pool"])
def run(request, conf, pool_sandbox):
    """run(code, ws) -> ExecResult, once through a fresh interpreter and once through the warm pool."""
    if request.param == "cold":
        return lambda code, ws, timeout_s=TIMEOUT: run_python(
            code, ws, **{**LIMITS, "timeout_s": timeout_s, "confinement": conf.kind}
        )
    return lambda code, ws, timeout_s=TIMEOUT: pool_sandbox.run(code, ws, timeout_s=timeout_s)


def sweeps_escaped(conf: confine.Confinement) -> None:
    """Skip unless this confinement kills processes that left the snippet's session (bwrap, or a uid of its own)."""
    if conf.kind == "fallback" and not conf.drop_uid:
        pytest.skip("the fallback without a uid of its own knows only the snippet's session")


@pytest.fixture
def ws():
    path = new_workspace()
    yield path
    remove_workspace(path)


def live_processes_of(uid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["uids", "status"]):
        if p.info["uids"] and p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def assert_host_unharmed(ws: Path) -> None:
    """The test process can still start processes, and the snippet's uid has nothing left running."""
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout == "42\n"
    if IS_ROOT:
        uid = ws.stat().st_uid
        assert uid >= confine.UID_BASE
        deadline = time.monotonic() + 2
        while live_processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_processes_of(uid) == []


# --- basic behaviour --------------------------------------------------------------------------------


def test_runs_code_and_reports_output_exit_code_and_files(run, ws):
    (ws / "old.txt").write_text("a")
    os.chmod(ws / "old.txt", 0o666)
    code = "import sys\nprint('out')\nprint('err', file=sys.stderr)\nopen('new.txt','w').write('n')\n"
    code += "open('old.txt','a').write('bb')\nsys.exit(3)\n"
    r = run(code, ws)
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("out\n", "err\n", 3, False)
    assert r.files_created == ("new.txt",) and r.files_changed == ("old.txt",)
    assert r.infra_error is None and not r.timed_out and not r.memory_exceeded
    r = run("print(sum(range(10)))", ws)
    assert r.ok and r.stdout == "45\n" and r.exit_code == 0 and r.files_created == ()


def test_workspace_persists_across_calls_and_holds_task_files(run):
    ws = new_workspace({"data/x.csv": b"a,b\n1,2\n3,4\n"})
    try:
        r1 = run("import pickle\nrows = open('data/x.csv').read().split()\npickle.dump(rows, open('m.pkl','wb'))", ws)
        assert r1.ok and r1.files_created == ("m.pkl",)
        r2 = run("import pickle\nprint(pickle.load(open('m.pkl','rb')))", ws)
        assert r2.ok and r2.stdout == "['a,b', '1,2', '3,4']\n"
    finally:
        remove_workspace(ws)
    assert not ws.exists()


def test_a_workspace_module_named_like_the_runners_package_imports_as_itself(run, ws):
    # The runner's own modules live in a package `inside` next to it; a snippet must not be handed those.
    (ws / "inside.py").write_text("WHO = 'the agent'\n")
    os.chmod(ws / "inside.py", 0o644)
    r = run(
        "import inside, sys\nprint(inside.WHO)\nprint(sorted(m for m in sys.modules if m.startswith('inside.')))", ws
    )
    assert r.ok, r.stderr
    assert r.stdout == "the agent\n[]\n"


def test_snippet_errors_are_not_infra_errors(run, ws):
    r = run("def f(:\n  pass", ws)
    assert r.exit_code == 1 and "SyntaxError" in r.stderr and r.infra_error is None
    r = run("x = 1\nraise ValueError('bad value')", ws)
    assert r.exit_code == 1 and r.stderr.rstrip().endswith("ValueError: bad value") and r.infra_error is None
    assert 'File "<snippet>", line 2' in r.stderr and "runner.py" not in r.stderr


# --- adversarial properties -------------------------------------------------------------------------


def test_infinite_loop_is_killed_at_the_timeout(run, ws):
    start = time.monotonic()
    r = run("print('started', flush=True)\nwhile True:\n    pass", ws)
    elapsed = time.monotonic() - start
    assert r.timed_out and not r.ok and r.killed_signal == 9 and r.infra_error is None
    assert r.stdout == "started\n"  # what it printed before the kill is kept
    assert TIMEOUT <= elapsed < TIMEOUT + 3
    assert_host_unharmed(ws)


BUSY_CHILD = """
import os, time
if os.fork() == 0:
    os.setsid()  # try to escape the process group
    while True:
        with open('beat', 'a') as f:
            f.write('x')
        time.sleep(0.02)
while True:
    pass
"""


def test_busy_child_in_its_own_session_dies_with_the_timeout(conf, run, ws):
    sweeps_escaped(conf)
    r = run(BUSY_CHILD, ws)
    assert r.timed_out
    size = (ws / "beat").stat().st_size
    assert size > 0
    time.sleep(0.4)
    assert (ws / "beat").stat().st_size == size, "the child kept running after the timeout"
    assert_host_unharmed(ws)


def test_background_process_left_behind_is_killed_and_does_not_hold_the_result(conf, run, ws):
    sweeps_escaped(conf)
    code = "import subprocess\nsubprocess.Popen(['sleep', '30'], start_new_session=True)\nprint('bye')"
    start = time.monotonic()
    r = run(code, ws)
    assert r.ok and r.stdout == "bye\n"
    assert time.monotonic() - start < TIMEOUT  # not held until the sleep or the timeout
    assert_host_unharmed(ws)


BOMB = "print('start', flush=True)\nchunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))"


def test_memory_bomb_is_stopped_by_the_watchdog_and_reported(run, ws):
    # A generous timeout: touching 256 MB takes a while on a busy machine, and it must fail on memory first.
    r = run(BOMB, ws, timeout_s=10)
    assert r.memory_exceeded and not r.ok and not r.timed_out and r.infra_error is None
    assert r.killed_signal == signal.SIGKILL and r.stdout == "start\n"
    # Far beyond what the machine could ever give: refused outright (or stopped by the watchdog on the way).
    r = run("import numpy as np\na = np.ones((2**22, 2**22))", ws, timeout_s=10)
    assert r.memory_exceeded and not r.ok
    assert_host_unharmed(ws)


def test_memory_of_every_process_of_the_snippet_counts(run, ws):
    # Four children of 100 MB each: each is under the 256 MB limit, together they are not.
    code = "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        x = bytearray(100 * 2**20)\n"
    code += "        time.sleep(30)\n        os._exit(0)\ntime.sleep(30)"
    r = run(code, ws, timeout_s=10)
    assert r.memory_exceeded and not r.timed_out and r.duration_s < 9
    assert_host_unharmed(ws)


def test_memory_of_an_escaped_process_counts_with_a_uid_per_workspace(conf, run, ws):
    if not conf.drop_uid:
        pytest.skip("without a uid per workspace the watchdog sees only the snippet's process tree")
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n" + "\n".join(
        "        " + line for line in BOMB.splitlines()[1:]
    )
    code += "\n    os._exit(0)\ntime.sleep(30)"
    r = run(code, ws, timeout_s=10)
    assert r.memory_exceeded and not r.timed_out
    assert_host_unharmed(ws)


def test_data_science_libraries_work_at_the_default_memory_limit(conf, ws):
    # An address-space limit broke these (pyarrow reserves far more than it uses); resident memory does not.
    code = "import pickle, pandas as pd, sklearn, pyarrow\n"
    code += "df = pd.DataFrame({'s': ['x', 'y'] * 500})\nprint(df.s.str.upper().value_counts().to_dict())"
    r = run_python(code, ws, timeout_s=120, confinement=conf.kind)
    assert r.ok, r.stderr
    assert r.stdout == "{'X': 500, 'Y': 500}\n"


def test_cpu_time_limit_kills_and_reports_a_timeout(conf, ws):
    # The CPU limit is normally above the wall clock; it matters for native code burning several cores.
    limits = Limits(timeout_s=30, memory_mb=256, cpu_s=1)
    start = time.monotonic()
    r = run_cold("while True:\n    pass", ws, limits, conf)
    assert r.timed_out and r.killed_signal == signal.SIGXCPU and not r.ok
    assert time.monotonic() - start < 15
    assert_host_unharmed(ws)


def test_fork_bomb_is_contained_by_the_process_limit(run, ws):
    r = run("import os\nwhile True:\n    os.fork()", ws)
    assert not r.ok and r.infra_error is None
    # fork() refused at the limit, or the copies' memory (each charged its inherited pages) stopped first
    assert "BlockingIOError" in r.stderr or r.timed_out or r.memory_exceeded
    assert_host_unharmed(ws)
    assert run("print('next')", ws).stdout == "next\n"


def test_file_size_limit(run, ws):
    r = run("open('big.bin', 'wb').write(b'x' * (9 * 2**20))", ws)
    assert not r.ok and "File too large" in r.stderr
    assert (ws / "big.bin").stat().st_size <= 8 * 2**20


def test_100mb_of_output_is_cut_and_costs_the_host_no_memory(run, ws):
    me = psutil.Process()
    before = me.memory_info().rss
    r = run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\nprint('END')", ws)
    grown = me.memory_info().rss - before
    assert r.ok
    assert len(r.stdout) < 2200 and r.stdout.startswith("xxx") and r.stdout.rstrip().endswith("END")
    cut = 100 * 2**20 + 4 - 2000
    assert f"[... {cut} bytes of output cut ...]" in r.stdout
    assert grown < 32 * 2**20


@pytest.mark.parametrize("target", ["/tmp/mappa-escape", "/etc/mappa-escape", str(REPO / "mappa-escape")])
def test_cannot_write_outside_the_workspace(conf, run, ws, target):
    if not conf.hides_host and (target.startswith("/tmp") or not conf.drop_uid):
        pytest.skip(
            "without the allowlisted root, writes to world-writable places (and yours, without a uid) stay open"
        )
    r = run(f"open({target!r}, 'w').write('pwned')", ws)
    refused = ("Read-only file system", "Permission denied", "No such file or directory")
    assert not r.ok and any(why in r.stderr for why in refused)
    assert not os.path.exists(target)
    r = run(f"import shutil\nshutil.rmtree({str(REPO / 'src')!r})", ws)
    assert not r.ok and (REPO / "src" / "mappa" / "sandbox" / "runner.py").is_file()


@pytest.mark.parametrize("target", ["/run/mappa/runner.py", "/run/mappa/inside/police.py", "/run/mappa/inside/x.py"])
def test_agent_code_cannot_change_the_runner_it_runs_under(conf, run, ws, target):
    # The runner and its package are bound into the jail: code that rewrote them would rewrite the limits and
    # the output capture of every later snippet (the allowlist binds them read-only).
    if conf.kind != "bwrap":
        pytest.skip("the runner is bound under /run/mappa by bubblewrap only")
    r = run(f"open({target!r}, 'a').write('raise SystemExit(0)')", ws)
    assert not r.ok and ("Read-only file system" in r.stderr or "Permission denied" in r.stderr)
    police = REPO / "src" / "mappa" / "sandbox" / "inside" / "police.py"
    assert "SystemExit(0)" not in police.read_text()
    assert run("print(1 + 1)", ws).stdout == "2\n"  # the next snippet still runs under an intact runner


@pytest.mark.skipif(not IS_ROOT, reason="the uid drop applies when started as root")
def test_cannot_read_root_only_files(run, ws):
    r = run("print(open('/etc/shadow').read())", ws)
    refused = ("Permission denied", "No such file or directory")  # the allowlisted root has no /etc/shadow
    assert not r.ok and any(why in r.stderr for why in refused) and r.stdout == ""


def test_bwrap_root_is_read_only_and_tmp_private(conf, run, ws):
    if conf.kind != "bwrap":
        pytest.skip("only bubblewrap gives a read-only root and a private /tmp")
    host_file = Path("/tmp") / f"mappa-host-{os.getpid()}.txt"
    host_file.write_text("host")
    os.chmod(host_file, 0o644)
    try:
        r = run(f"import os\nprint(os.path.exists({str(host_file)!r}), os.listdir('/tmp'))\nopen('/escape', 'w')", ws)
    finally:
        host_file.unlink()
    assert r.stdout == f"False [{workspace_root().name!r}]\n"  # only the workspaces are bound into /tmp
    assert ("Read-only file system" in r.stderr or "Permission denied" in r.stderr) and not os.path.exists("/escape")


def test_environment_is_scrubbed(run, ws, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-very-secret")
    monkeypatch.setenv("HF_TOKEN", "hf-test-very-secret")
    code = "import os\nprint(dict(os.environ))\nimport glob\nfor p in glob.glob('/proc/*/environ'):\n"
    code += "    try:\n        print(open(p, 'rb').read())\n    except OSError:\n        pass"
    r = run(code, ws)
    assert r.ok
    assert "very-secret" not in r.stdout
    assert "OPENAI_API_KEY" not in r.stdout


def test_printing_a_set_gives_the_same_order_in_every_run(conf, pool_sandbox, ws):
    """A seeded run reproduces only if agent programs do: string hashing is fixed in every interpreter."""
    code = "print({f'word{i}' for i in range(12)})"
    cold = [run_python(code, ws, **{**LIMITS, "confinement": conf.kind}).stdout for _ in range(2)]
    warm = pool_sandbox.run(code, ws).stdout
    assert cold[0] == cold[1] == warm and cold[0].startswith("{'word")  # 12! orders: chance alone never agrees


def test_no_network_access(conf, run, ws):
    if not conf.network_blocked:
        pytest.skip("`unshare -n` is not allowed here: the fallback leaves the network open (and says so)")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    try:
        code = f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
        r = run(code, ws)
    finally:
        t.join()
        server.close()
    assert not r.ok and "connected" not in r.stdout
    assert "unreachable" in r.stderr or "refused" in r.stderr
    assert accepted == []


def test_killing_its_parent_does_not_harm_the_host(run, ws):
    r = run(
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)\nprint('alive')", ws
    )
    assert r.infra_error is None
    assert_host_unharmed(ws)
    assert run("print('still works')", ws).stdout == "still works\n"


def test_closed_stdout_and_stderr(run, ws):
    r = run("import os\nos.close(1)\nos.close(2)\nprint('lost')\nraise SystemExit(5)", ws)
    assert r.infra_error is None and not r.timed_out
    assert r.stdout == "" and r.exit_code in (1, 5)
    assert_host_unharmed(ws)


@pytest.mark.skipif(not IS_ROOT, reason="workspaces get their own uids when started as root")
def test_workspaces_cannot_see_each_other(run, ws):
    other = new_workspace({"secret.txt": b"episode 2 data"})
    try:
        # Cold: the other workspace is not even mounted; pool: mounted, but owned by another uid, mode 0700.
        r = run(f"print(open({str(other / 'secret.txt')!r}).read())", ws)
        assert not r.ok and ("Permission denied" in r.stderr or "No such file" in r.stderr)
        assert "episode 2" not in r.stdout
        r = run(f"import os\nprint(os.listdir({str(workspace_root())!r}))", ws)
        assert other.name not in r.stdout
    finally:
        remove_workspace(other)


# --- the warm pool ----------------------------------------------------------------------------------


def test_pool_state_does_not_leak_between_snippets(pool_sandbox, ws):
    r = pool_sandbox.run(
        "import numpy, builtins, sys, os\nLEAK = 1\nnumpy.pi = 3\nbuiltins.leaked = True\n"
        "sys.modules['leaky'] = sys\nos.environ['LEAK'] = '1'\nprint(numpy.pi)",
        ws,
    )
    assert r.stdout == "3\n"
    r = pool_sandbox.run(
        "import numpy, builtins, sys, os\n"
        "print('LEAK' in globals(), numpy.pi == 3, hasattr(builtins, 'leaked'), 'leaky' in sys.modules, 'LEAK' in os.environ)",
        ws,
    )
    assert r.ok and r.stdout == "False False False False False\n"


def test_pool_children_start_with_the_modules_preloaded(pool_sandbox, ws):
    r = pool_sandbox.run("import sys\nprint('numpy' in sys.modules)", ws)
    assert r.stdout == "True\n"


def test_pool_server_death_is_an_infra_error_and_the_pool_recovers(conf, ws):
    cfg = SandboxConfig(pool=True, preload=[], confinement=conf.kind, **LIMITS)
    with Sandbox(cfg) as sb:
        assert sb.run("print(1)", ws).ok
        pid = sb.pool.pid
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        server = [p for p in tree if p.name() not in ("bwrap", "unshare") and "serve" in p.cmdline()]
        assert len(server) == 1
        threading.Timer(0.3, server[0].kill).start()  # the server crashes while a snippet runs
        r = sb.run("import time\ntime.sleep(1)", ws)
        assert r.infra_error is not None and "pool server" in r.infra_error and not r.ok
        r = sb.run("print('recovered')", ws)
        assert r.ok and r.stdout == "recovered\n" and sb.pool.pid != pid


def test_pool_outlives_the_thread_that_started_it(conf, ws):
    with Sandbox(SandboxConfig(pool=True, preload=[], confinement=conf.kind, **LIMITS)) as sb:
        t = threading.Thread(target=sb.run, args=("print(1)", ws))
        t.start()
        t.join()
        pid = sb.pool.pid
        time.sleep(0.2)
        r = sb.run("print(2)", ws)
        assert r.ok and r.stdout == "2\n" and sb.pool.pid == pid


def test_run_many_runs_concurrently_in_input_order(pool_sandbox):
    wss = [new_workspace() for _ in range(4)]
    try:
        items = [(f"import time\ntime.sleep(0.6)\nprint({i})", w) for i, w in enumerate(wss)]
        start = time.monotonic()
        results = pool_sandbox.run_many(items)
        elapsed = time.monotonic() - start
    finally:
        for w in wss:
            remove_workspace(w)
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert elapsed < 4 * 0.6  # two at a time: about 1.2 s


def test_run_many_reports_progress_and_serialises_one_workspace(pool_sandbox, ws):
    # Two snippets of one workspace share its uid: run together, the end of one would sweep the other.
    seen = []
    items = [("import time\ntime.sleep(0.3)\nprint(1)", ws), ("print(2)", ws)]
    results = pool_sandbox.run_many(items, progress=lambda done, total: seen.append((done, total)))
    assert [r.stdout for r in results] == ["1\n", "2\n"] and seen == [(1, 2), (2, 2)]


@pytest.fixture(scope="module")
def default_pool(conf):
    """The warm pool exactly as training gets it: default limits and preloads (numpy, pandas, scikit-learn)."""
    with Sandbox(SandboxConfig(confinement=conf.kind, timeout_s=60)) as sb:
        yield sb


def test_pool_runs_pandas_string_columns_at_the_defaults(default_pool, ws):
    code = "import pandas as pd\ndf = pd.DataFrame({'city': ['Oslo', 'Rome', 'Oslo'], 'n': [1, 2, 3]})\n"
    code += "df['upper'] = df.city.str.upper()\nprint(df.groupby('upper').n.sum().to_dict(), df.city.dtype)"
    r = default_pool.run(code, ws)
    assert r.ok, r.stderr
    assert r.stdout.startswith("{'OSLO': 4, 'ROME': 2} ")


def test_pool_fits_pickles_and_reloads_a_model_at_the_defaults(default_pool, ws):
    fit = (
        "import pickle, numpy as np, pandas as pd\nfrom sklearn.ensemble import RandomForestClassifier\n"
        "rng = np.random.default_rng(0)\nX = pd.DataFrame(rng.normal(size=(300, 4)), columns=list('abcd'))\n"
        "X['kind'] = np.where(X.a > 0, 'pos', 'neg')\ny = (X.kind == 'pos').astype(int)\n"
        "m = RandomForestClassifier(n_estimators=20, random_state=0).fit(X[list('abcd')], y)\n"
        "pickle.dump(m, open('model.pkl', 'wb'))\nX.to_csv('X.csv', index=False)\nprint(m.score(X[list('abcd')], y))"
    )
    r = default_pool.run(fit, ws)
    assert r.ok and r.stdout == "1.0\n", r.stderr
    assert set(r.files_created) == {"model.pkl", "X.csv"}
    load = (
        "import pickle, pandas as pd\nm = pickle.load(open('model.pkl', 'rb'))\nX = pd.read_csv('X.csv')\n"
        "print((m.predict(X[list('abcd')]) == (X.kind == 'pos')).mean())"
    )
    r = default_pool.run(load, ws)
    assert r.ok and r.stdout == "1.0\n", r.stderr


@pytest.mark.slow
def test_pool_trains_a_torch_model_at_the_defaults(conf, ws):
    # torch reserves far more address space than it touches: fine under a resident-memory limit. The agent
    # environment has no torch, so this runs an environment that has it (`sandbox.python`), at the defaults.
    code = "import torch\ntorch.manual_seed(0)\nm = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),"
    code += " torch.nn.Linear(256, 1))\nopt = torch.optim.Adam(m.parameters())\nx = torch.randn(512, 64)\n"
    code += "for _ in range(20):\n    loss = m(x).pow(2).mean()\n"
    code += "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
    code += "print(loss.item() < 1)"
    with Sandbox(SandboxConfig(pool=True, preload=["torch"], confinement=conf.kind, python=sys.executable)) as sb:
        r = sb.run(code, ws)
    assert r.ok and r.stdout == "True\n", r.stderr


def test_pool_stops_a_memory_bomb_at_the_defaults(default_pool, ws):
    start = time.monotonic()
    r = default_pool.run(BOMB, ws)
    assert r.memory_exceeded and not r.timed_out and not r.ok and r.infra_error is None
    assert time.monotonic() - start < 30
    assert default_pool.run("import pandas\nprint('next')", ws).stdout == "next\n"
    assert_host_unharmed(ws)


def test_workspace_outside_the_root_runs_cold(pool_sandbox):
    # In /tmp itself: without bwrap the sandbox uid must be able to pass through the workspace's parents.
    outside = Path(tempfile.mkdtemp(prefix="mappa-outside-"))
    try:
        r = pool_sandbox.run("print('here')", outside)
    finally:
        remove_workspace(outside)
    assert r.ok and r.stdout == "here\n", r.stderr


# --- infrastructure faults and user errors ----------------------------------------------------------


def test_sandbox_that_cannot_start_reports_infra_error(ws):
    conf = confine.detect_confinement("auto")
    gone = confine.Confinement(
        conf.kind, conf.drop_uid, conf.unshare, conf.allowlist, confine.AgentEnv("/nonexistent/python3", "/usr")
    )
    r = run_cold("print(1)", ws, Limits(**LIMITS), gone)
    assert r.infra_error is not None and not r.ok and r.exit_code is None


def test_missing_workspace_is_a_user_error(tmp_path):
    with pytest.raises(MappaError, match="not a directory"):
        run_python("print(1)", tmp_path / "missing")


def test_new_workspace_rejects_paths_that_escape_and_keeps_on_request():
    with pytest.raises(MappaError, match="relative path"):
        new_workspace({"../evil.txt": b"x"})
    kept = new_workspace({"a.txt": b"1"}, keep=True)
    remove_workspace(kept)
    assert (kept / "a.txt").read_bytes() == b"1"
    remove_workspace(kept, force=True)
    assert not kept.exists()


def test_bounded_stream_keeps_head_and_tail():
    s = BoundedStream(100)
    for i in range(1000):
        s.feed(f"{i:04d}".encode())
    text = s.text()
    assert text.startswith("00000001") and text.endswith("0999")
    assert "[... 3900 bytes of output cut ...]" in text
    small = BoundedStream(100)
    small.feed(b"hello")
    assert small.text() == "hello"


# --- detecting the confinement ----------------------------------------------------------------------


@pytest.fixture
def fresh_detection():
    confine.clear_detection()
    yield
    confine.clear_detection()


def path_with(tmp_path: Path, tools: dict[str, str | None]) -> str:
    """A PATH holding only `tools`: name -> a real tool to link to, or a shell script body."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, target in tools.items():
        if target is None or target.startswith("#!"):
            (bindir / name).write_text(target or "#!/bin/sh\nexit 1\n")
            os.chmod(bindir / name, 0o755)
        elif shutil.which(target):
            (bindir / name).symlink_to(shutil.which(target))
    return str(bindir)


def test_missing_bwrap_falls_back_with_a_one_time_warning(tmp_path, monkeypatch, fresh_detection):
    monkeypatch.setenv("PATH", path_with(tmp_path, {"unshare": "unshare", "setpriv": "setpriv"}))
    with pytest.warns(RuntimeWarning, match="bubblewrap is not installed; sandbox: fallback") as caught:
        c = confine.detect_confinement("auto")
        confine.detect_confinement("auto")
    # Only the sandbox's own warnings count: pytest.warns also records whatever an earlier test's leftover
    # objects raise while being garbage-collected here (a ResourceWarning, say).
    mine = [w for w in caught if "sandbox" in str(w.message)]
    assert c.kind == "fallback" and len(mine) == 1, [f"{w.category.__name__}: {w.message}" for w in caught]
    assert "\n" not in str(mine[0].message)
    with pytest.raises(MappaError, match="'bwrap': bubblewrap is not installed"):
        confine.detect_confinement("bwrap")


def test_unusable_bwrap_is_named_with_the_reason(tmp_path, monkeypatch, fresh_detection):
    script = "#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n"
    monkeypatch.setenv("PATH", path_with(tmp_path, {"bwrap": script, "unshare": "unshare"}))
    assert confine.bwrap_problem().endswith(
        "installed but cannot start here: bwrap: No permissions to create new namespace"
    )
    with pytest.warns(RuntimeWarning, match="cannot start here"):
        assert confine.detect_confinement("auto").kind == "fallback"


def test_describing_the_confinement_counts_as_its_announcement(tmp_path, monkeypatch, fresh_detection, recwarn):
    monkeypatch.setenv("PATH", path_with(tmp_path, {"unshare": "unshare"}))
    line = confine.describe_confinement("auto")
    allowlisted = confine.detect_confinement("auto").allowlist  # a mount namespace was allowed here
    assert line.startswith("sandbox: fallback") and "\n" not in line
    assert ("allowlisted root" in line) == allowlisted and ("NOT confined" in line) != allowlisted
    Sandbox(SandboxConfig(pool=False)).close()
    assert [w for w in recwarn if issubclass(w.category, RuntimeWarning)] == []
    with pytest.raises(MappaError, match="expected one of auto, bwrap, fallback"):
        confine.describe_confinement("docker")


def test_forced_fallback_imports_the_standard_library_and_the_environment(ws):
    conf = confine.detect_confinement("fallback")
    if IS_ROOT and shutil.which("unshare"):
        assert conf.drop_uid and conf.allowlist, "as root the fallback builds the allowlisted root"
    r = run_python("import pickle, decimal, pandas, sklearn\nprint('ok')", ws, timeout_s=120, confinement="fallback")
    assert r.ok and r.stdout == "ok\n", r.stderr


def test_fallback_command_carries_the_allowlisted_root(tmp_path):
    conf = confine.Confinement("fallback", drop_uid=True, unshare=("unshare", "-m"), allowlist=True)
    cmd = conf.command([tmp_path], tmp_path, conf.runner_argv("once", "3", "4", "{}"))
    at = cmd.index("--root")
    assert cmd[:2] == ["unshare", "-m"] and cmd[at - 1] == str(confine.RUNNER) and cmd[at + 2] == "once"
    root = json.loads(cmd[at + 1])
    ops = root["ops"]
    assert root["python"].startswith(confine.AGENT_ROOT + "/") or root["python"] == conf.env.python
    assert ["rw", str(tmp_path), str(tmp_path)] in ops and ["ro", "/usr", "/usr"] in ops
    assert not any(op[0] in ("ro", "rw") and op[-1] in ("/", "/root", str(REPO)) for op in ops)


# --- the command line ---------------------------------------------------------------------------------


def test_cli_prints_the_result_as_json(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text("import sys\nprint('hi')\nsys.exit(4)\n")
    mappa = [str(Path(sys.executable).with_name("mappa"))]
    done = subprocess.run([*mappa, "sandbox", "run", str(script), "--timeout", "5"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["stdout"] == "hi\n" and result["exit_code"] == 4 and result["ok"] is False
    assert done.stderr.splitlines()[0] == confine.describe_confinement("auto")
    work = Path(tempfile.mkdtemp(prefix="mappa-cli-")) / "work"
    os.chmod(work.parent, 0o711)  # without bwrap the sandbox uid must be able to pass through the parents
    script.write_text("open('made.txt', 'w').write('x')")
    done = subprocess.run(
        [*mappa, "sandbox", "run", str(script), "--workspace", str(work)], capture_output=True, text=True
    )
    assert done.returncode == 0 and json.loads(done.stdout)["files_created"] == ["made.txt"]
    assert (work / "made.txt").exists()
    remove_workspace(work.parent)
    done = subprocess.run([*mappa, "sandbox", "run", str(tmp_path / "nope.py")], capture_output=True, text=True)
    assert done.returncode == 2 and "nope.py" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_cli_forces_the_fallback_and_names_it_first(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text("import pickle, pandas\nprint('imported')")
    mappa = str(Path(sys.executable).with_name("mappa"))
    done = subprocess.run(
        [mappa, "sandbox", "run", str(script), "--confinement", "fallback", "--pool", "--timeout", "120"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0].startswith("sandbox: fallback without bubblewrap")
    assert json.loads(done.stdout)["stdout"] == "imported\n"


def test_agent_environment_under_tmp_is_bound_without_its_checkout(tmp_path: Path) -> None:
    # A checkout under /tmp (CI clones, throwaway venvs): its agent venv is bound at a fixed path, so the
    # sandbox's /tmp shows the workspaces alone and the checkout's name is not in sight.
    venv = tmp_path / "clone" / ".venv-agents"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    env = confine.AgentEnv(str(venv / "bin" / "python"), "/usr", str(venv))
    cmd = confine.Confinement("bwrap", drop_uid=False, env=env).command([tmp_path / "ws"], tmp_path, ["python"])
    binds = [(cmd[i + 1], cmd[i + 2]) for i, a in enumerate(cmd) if a == "--ro-bind"]
    assert (str(venv), confine.AGENT_ROOT) in binds
    assert not any(dst in ("/", "/tmp", str(tmp_path)) for _, dst in binds)
    assert ("/usr", "/usr") in binds
