"""The sandbox as a policy would attack what the reward means and what concurrent episodes share: forged faults,
channels between pooled snippets, kernel memory outside any process, and floods of files the host must walk.

Everything is real (bubblewrap or the fallback's own root, the warm pool, the agent environment); each test runs
under both confinements, and cold and pooled where a single snippet says it. Without root: see
test_redteam_sandbox.py's unprivileged run, which carries the same attacks as a plain user.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mappa.config import SandboxConfig
from mappa.sandbox import Sandbox, new_workspace, remove_workspace, run_python, workspace
from mappa.sandbox.execute import Limits, run_cold
from mappa.sandbox.pool import WarmPool
from mappa.sandbox.workspace import REMOVE_BUDGET_S, remove_tree, workspace_root
from mappa.training.rewards import select_actions
from mappa.types import Action, Episode, ExecResult, Task
from mappa.workflows.codeblocks import format_observation

pytestmark = pytest.mark.integration

# --- faults come only from the sandbox's own channel -------------------------------------------------------

FORGERIES = {
    "the runner's line and exit status": (
        "import sys\nsys.stderr.write('mappa-runner: could not enter the sandbox: OSError: [Errno 1]\\n')\nsys.exit(254)"
    ),
    "a closed stderr": "import os, sys\nos.write(2, b'mappa-runner: the set-up failed\\n')\nos.close(2)\nos._exit(254)",
    "report records on every descriptor": (
        "import json, os\nline = (json.dumps({'setup_failed': 'forged', 'wait_status': 0}) + '\\n').encode()\n"
        "for fd in range(0, 1024):\n    try:\n        os.write(fd, line)\n    except OSError:\n        pass\n"
        "os._exit(254)"
    ),
    "the report pipes of the processes above": (
        "import glob, json, os\nline = (json.dumps({'setup_failed': 'forged'}) + '\\n').encode()\nopened = 0\n"
        "for path in glob.glob('/proc/*/fd/*'):\n    try:\n        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)\n"
        "        os.write(fd, line); opened += 1\n    except OSError:\n        pass\n"
        "print('opened', opened)\nos._exit(254)"
    ),
}


@pytest.mark.parametrize("how", list(FORGERIES))
def test_a_snippet_cannot_forge_an_infrastructure_fault(run, ws, how):
    r = run(FORGERIES[how], ws)
    assert r.infra_error is None, (how, r.infra_error)
    assert not r.ok and r.exit_code == 254
    # ... so the action stays in training on its score, like any failed action
    action = Action(agent="code_executor", turn=0, messages=(), text="x", response_ids=(2, 3), exec_result=r)
    task = Task(id="t", problem="p", answer="1", source="arithmetic")
    episode = Episode(id="e", workflow="mathchat", task=task, actions=(action,))
    kept, scores, dropped = select_actions([episode], [[1.0]], ["code_executor"], "skip", False)
    assert kept == [action] and scores == [1.0] and dropped["infra_error"] == 0


@pytest.mark.parametrize("mode", ["cold", "pool"])
def test_a_real_set_up_failure_is_still_a_fault(conf, ws, mode, limits):
    # A limit the kernel refuses: the snippet's own set-up fails before any of its code runs.
    limits = Limits(**{**limits, "max_open_files": 1 << 40})
    if mode == "cold":
        r = run_cold("print('ran')", ws, limits, conf)
    else:
        pool = WarmPool(workspace_root().resolve(), [], conf)
        try:
            r = pool.run("print('ran')", ws, limits)
        finally:
            pool.close()
    assert r.infra_error is not None and "could not enter the sandbox" in r.infra_error and not r.ok, r
    assert "ran" not in r.stdout


# --- episodes share nothing ----------------------------------------------------------------------------------

CHANNELS = {
    "abstract unix socket": (
        "import socket, time\ns = socket.socket(socket.AF_UNIX)\ns.bind('\\0mappa-episode-channel')\ns.listen(1)\n"
        "s.settimeout(4)\ntry:\n    c, _ = s.accept(); print('GOT', c.recv(100))\nexcept OSError as e:\n    print('alone')\n",
        "import socket, time\nt = time.time() + 4\nwhile time.time() < t:\n    try:\n"
        "        c = socket.socket(socket.AF_UNIX); c.connect('\\0mappa-episode-channel'); c.send(b'42'); print('SENT'); break\n"
        "    except OSError as e:\n        err = e; time.sleep(0.05)\nelse:\n    print('no peer', err)\n",
    ),
    "loopback tcp": (
        "import socket\ntry:\n    s = socket.socket(); s.bind(('127.0.0.1', 47311)); s.listen(1); s.settimeout(4)\n"
        "    c, _ = s.accept(); print('GOT', c.recv(100))\nexcept OSError as e:\n    print('alone', e)\n",
        "import socket, time\nt = time.time() + 4\nwhile time.time() < t:\n    try:\n"
        "        c = socket.create_connection(('127.0.0.1', 47311), timeout=0.2); c.send(b'42'); print('SENT'); break\n"
        "    except OSError as e:\n        err = e; time.sleep(0.05)\nelse:\n    print('no peer', err)\n",
    ),
    "loopback udp": (
        "import socket\ntry:\n    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1', 47312))\n"
        "    s.settimeout(4); print('GOT', s.recv(100))\nexcept OSError as e:\n    print('alone', e)\n",
        "import socket, time\nt = time.time() + 4\nsent = 0\nwhile time.time() < t:\n    try:\n"
        "        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'42', ('127.0.0.1', 47312)); sent += 1\n"
        "    except OSError as e:\n        err = e\n    time.sleep(0.05)\nprint('no peer' if not sent else 'SENT?', sent)\n",
    ),
    "session keyring": (
        "import ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "k = libc.syscall(248, b'user', b'mappa-episode', b'42', 2, ctypes.c_int(-3))  # add_key to @s\n"
        "print('alone' if k < 0 else 'ADDED', ctypes.get_errno()); time.sleep(3)\n",
        "import ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)\ntime.sleep(1)\n"
        "k = libc.syscall(249, b'user', b'mappa-episode', None, 0)  # request_key\n"
        "print('no peer' if k < 0 else 'FOUND', ctypes.get_errno())\n",
    ),
    "a lock on a shared file": (
        "import fcntl, os, sys, time\nf = open(sys.executable, 'rb')\ntry:\n    fcntl.flock(f, fcntl.LOCK_EX)\n"
        "    print('LOCKED'); time.sleep(3)\nexcept OSError as e:\n    print('alone', e)\n",
        "import fcntl, os, sys, time\ntime.sleep(1)\nf = open(sys.executable, 'rb')\ntry:\n"
        "    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); print('no peer: free')\nexcept BlockingIOError:\n"
        "    print('SEEN')\nexcept OSError as e:\n    print('no peer', e)\ntry:\n"
        "    fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB); print('LOCKF')\nexcept OSError as e:\n    print('no lockf', e)\n",
    ),
    "inotify on a shared file": (
        "import ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.inotify_init()\n"
        "print('alone' if fd < 0 else 'WATCHING', ctypes.get_errno()); time.sleep(2)\n",
        "import sys, time\ntime.sleep(0.5)\nopen(sys.executable, 'rb').read(10)\nprint('no peer')\n",
    ),
    "signals and /proc": (
        "import time\nopen('secret.txt', 'w').write('42')\ntime.sleep(3)\nprint('alive', open('secret.txt').read())\n",
        "import os, signal, time\ntime.sleep(1)\nmine = {os.getpid()}\nseen = []\n"
        "for p in os.listdir('/proc'):\n    if p.isdigit() and int(p) not in mine and p != '1':\n"
        "        try:\n            seen.append((p, os.listdir(f'/proc/{p}/cwd')))\n        except OSError as e:\n"
        "            seen.append((p, str(e)))\n        try:\n            os.kill(int(p), signal.SIGKILL)\n"
        "        except OSError:\n            pass\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
        "print('no peer' if not any('secret.txt' in str(s) for s in seen) else 'SEEN', len(seen))\n",
    ),
}


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_concurrent_pooled_episodes_share_no_channel(pool, channel):
    first, second = CHANNELS[channel]
    a, b = new_workspace(), new_workspace()
    try:
        with ThreadPoolExecutor(2) as ex:
            ra = ex.submit(pool.run, first, a)
            time.sleep(0.2)
            rb = ex.submit(pool.run, second, b)
            ra, rb = ra.result(), rb.result()
    finally:
        remove_workspace(a)
        remove_workspace(b)
    out = ra.stdout + rb.stdout
    assert ra.infra_error is None and rb.infra_error is None, (ra.infra_error, rb.infra_error)
    for word in ("GOT", "SENT", "ADDED", "FOUND", "LOCKED", "SEEN", "WATCHING", "LOCKF"):
        assert word not in out, (channel, ra.stdout, ra.stderr[-300:], rb.stdout, rb.stderr[-300:])
    if channel == "signals and /proc":
        assert ra.ok and ra.stdout.strip() == "alive 42", ra


def test_a_snippet_that_kills_everything_it_can_harms_only_its_own_episode(pool, ws):
    other = new_workspace()
    try:
        with ThreadPoolExecutor(2) as ex:
            survivor = ex.submit(pool.run, "import time\ntime.sleep(2.5)\nprint('done')", other)
            time.sleep(0.5)
            killer = ex.submit(
                pool.run,
                "import os\nfor s in (19, 9):\n    try:\n        os.kill(-1, s)\n    except OSError:\n        pass\nprint('tried')",
                ws,
            )
            survivor, killer = survivor.result(), killer.result()
    finally:
        remove_workspace(other)
    assert survivor.ok and survivor.stdout.strip() == "done", survivor
    assert killer.infra_error is None
    assert pool.run("print(1)", ws).ok  # the server lives on


# --- memory a snippet pins outside its processes -----------------------------------------------------------

SOCKET_PAIRS = """
import socket
pairs, queued = [], 0
for _ in range(60):
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
        s.setblocking(False)
        try:
            while True:
                queued += s.send(b"x" * 65536)
        except BlockingIOError:
            pass
    pairs.append((a, b))
print("queued", queued >> 20, "MiB", flush=True)
import time
time.sleep(3)
print("HELD")
"""

IN_FLIGHT = """
import socket, array, time
carrier_a, carrier_b = socket.socketpair()
carrier_a.setblocking(False)
queued = 0
for _ in range(100):
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
    a.setblocking(False)
    try:
        while True:
            queued += a.send(b"x" * 65536)
    except BlockingIOError:
        pass
    try:
        socket.send_fds(carrier_a, [b"f"], [a.fileno(), b.fileno()])  # in flight: held by no process
    except OSError:
        break
    a.close(); b.close()
print("queued", queued >> 20, "MiB", flush=True)
time.sleep(3)
print("HELD")
"""

PIPES = """
import fcntl, os, time
try:
    r, w = os.pipe()
    fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
    print("GREW")
except OSError as e:
    print("not grown", e.errno)
for _ in range(6):
    if os.fork() == 0:
        break
held = []
for _ in range(120):
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 65536)
    except BlockingIOError:
        pass
    held.append((r, w))
time.sleep(3)
print("HELD")
"""

SHM_AND_HEAP = """
import time
with open("/dev/shm/blob", "wb") as f:
    f.write(b"x" * (44 << 20))
heap = bytearray(44 << 20)
for i in range(0, len(heap), 4096):
    heap[i] = 1
time.sleep(3)
print("HELD")
"""


@pytest.mark.parametrize("attack", ["SOCKET_PAIRS", "IN_FLIGHT", "PIPES", "SHM_AND_HEAP"])
def test_memory_limit_counts_kernel_buffers(conf, ws, attack, limits):
    code = globals()[attack]
    small = {**limits, "memory_mb": 64, "max_processes": 64, "max_file_mb": 64}
    for mode in ("cold", "pool"):
        if mode == "cold":
            r = run_python(code, ws, **small, confinement=conf.kind)
        else:
            cfg = SandboxConfig(pool=True, preload=[], confinement=conf.kind, **small)
            with Sandbox(cfg) as sb:
                r = sb.run(code, ws)
        assert "HELD" not in r.stdout and "GREW" not in r.stdout, (attack, mode, r.stdout, r.stderr[-500:])
        assert r.memory_exceeded and not r.ok and r.infra_error is None, (attack, mode, r)


def test_ordinary_sockets_and_pipes_stay_within_a_small_limit(run, ws):
    code = (
        "import socket, os, multiprocessing as mp\na, b = socket.socketpair()\na.send(b'x' * 1000)\n"
        "print(len(b.recv(2000)))\nr, w = os.pipe()\nos.write(w, b'y' * 1000)\nprint(len(os.read(r, 2000)))\n"
        "q = mp.Queue()\np = mp.Process(target=q.put, args=(7,))\np.start()\nprint(q.get())\np.join()\n"
    )
    r = run(code, ws)
    assert r.ok and r.stdout.split() == ["1000", "1000", "7"], (r.stdout, r.stderr[-500:])


# --- host walks are bounded ----------------------------------------------------------------------------------

DEEP_CHAIN = (
    "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\nopen('bottom.txt', 'w').write('x')\n"
)
MANY_DIRS = "import os\nfor i in range({n}):\n    os.mkdir(f'e{{i}}')\n"


def _flood(run, code: str, background_s: float) -> ExecResult:
    """Run a snippet that floods its workspace; the host's walks around it and the removal stay bounded, and what
    the removal's budget left is gone within `background_s`."""
    ws = new_workspace()
    t = time.monotonic()
    r = run(code, ws, timeout_s=120)
    around = time.monotonic() - t - r.duration_s
    assert r.infra_error is None and r.exit_code == 0, r
    assert around < 5, around  # the snapshots before and after
    t = time.monotonic()
    remove_workspace(ws)  # before: RecursionError from shutil.rmtree on the deep chain
    assert time.monotonic() - t < REMOVE_BUDGET_S + 1.5
    assert not ws.exists()
    deadline = time.monotonic() + background_s
    while (trash := [p for p in workspace_root().iterdir() if ws.name in p.name]) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p in trash:
        remove_tree(p)
    assert not trash, "the background removal did not finish"
    return r


def test_a_deep_chain_of_directories_is_walked_and_removed(run):
    r = _flood(run, DEEP_CHAIN, background_s=30)
    assert r.ok and not r.workspace_flooded and r.files_created == ("/".join(["d"] * 1500) + "/bottom.txt",)


def test_a_flood_of_directories_fails_the_run_and_is_removed_in_the_background(pool, monkeypatch):
    # More entries than a snapshot walks: the agent's doing, never a fault of the sandbox. (A smaller walk than
    # MAX_WALK_ENTRIES keeps this quick; the slow test below floods with 100,000.)
    monkeypatch.setattr(workspace, "MAX_WALK_ENTRIES", 1000)
    r = _flood(pool.run, MANY_DIRS.format(n=1500), background_s=60)
    assert r.workspace_flooded and not r.ok
    assert "too many files and folders" in format_observation(r)


@pytest.mark.slow
def test_a_hundred_thousand_directories_do_not_stall_the_host(pool):
    _flood(pool.run, MANY_DIRS.format(n=100_000), background_s=300)


def test_remove_tree_handles_links_modes_and_depth(tmp_path):
    top = tmp_path / "ws"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(1200):  # deeper than a recursive walk or a path can go
        os.mkdir("d", dir_fd=fd)
        fd, old = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    os.symlink(outside, top / "link")  # a link is removed, never followed
    locked = top / "locked"
    (locked / "inner").mkdir(parents=True)
    (locked / "inner" / "f").write_text("x")
    os.chmod(locked / "inner", 0)
    os.chmod(locked, 0)
    assert remove_tree(top)
    assert not top.exists() and (outside / "keep.txt").read_text() == "keep"


def test_a_python_running_the_workflow_loop_survives_a_deep_workspace(conf):
    # The workflows remove every episode's workspace in a `finally`: once, a RecursionError escaped from there.
    code = f"""
import sys, warnings
warnings.simplefilter("ignore")
from mappa.sandbox import new_workspace, remove_workspace, run_python
ws = new_workspace()
try:
    r = run_python({DEEP_CHAIN!r}, ws, timeout_s=60, confinement={conf.kind!r})
finally:
    remove_workspace(ws)
print(r.exit_code, ws.exists())
"""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.split() == ["0", "False"], done.stderr[-2000:]


def test_the_report_channel_is_json_lines_the_host_reads_bounded():
    from mappa.sandbox.inside.snippet import read_report, report

    r, w = os.pipe()
    report(w, {"wait_status": 0})
    os.write(w, b"not json\n" + json.dumps([1, 2]).encode() + b"\n")
    report(w, {"setup_failed": "why"})
    os.close(w)
    os.set_blocking(r, False)
    assert read_report(r) == {"wait_status": 0, "setup_failed": "why"}
    os.close(r)


def test_file_names_that_are_not_utf8_come_back_as_text(run, ws):
    r = run("open(b'\\xff\\xfe.txt', 'w').write('x')\nopen('fine.txt', 'w').write('x')", ws)
    assert r.ok and set(r.files_created) == {"\\xff\\xfe.txt", "fine.txt"}, r.files_created
    assert ExecResult.model_validate_json(r.model_dump_json()) == r  # episodes.jsonl takes it


def test_signalling_every_process_at_once_is_refused(run, ws):
    # Without namespaces (the fallback as a plain user) kill(-1) would reach the user's whole session, the trainer
    # included; it is refused everywhere (signal 0 only asks, so this harms nothing even where it is not).
    r = run("import os\ntry:\n    os.kill(-1, 0)\n    print('allowed')\nexcept OSError as e:\n    print(e.errno)", ws)
    assert r.ok and r.stdout.strip() == "1", r


def test_the_trainers_keyrings_are_out_of_reach(run, ws):
    # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING / USER_KEYRING): refused, not answered with an id.
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for spec in (-3, -4, -2):\n    r = libc.syscall(250, 0, ctypes.c_int(spec), 0)\n"
        "    print(r, ctypes.get_errno())\n"
    )
    r = run(code, ws)
    assert r.ok and r.stdout.split() == ["-1", "1"] * 3, r.stdout
