"""Run as a plain user by test_redteam_sandbox.py: what one episode's snippet can do to another episode's snippet
and to the pool server when every snippet keeps the user's uid. Prints one JSON line of findings per confinement.

    python unprivileged_probe.py AGENT_PYTHON SOURCE_DIR
"""

import json
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

warnings.simplefilter("ignore")

from mappa.config import SandboxConfig  # noqa: E402
from mappa.sandbox import Sandbox, new_workspace, remove_workspace  # noqa: E402

LEFT_BEHIND = """
import os, time
print(os.listdir(os.path.dirname(os.getcwd())), os.path.exists(SRC))
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1.5)
        open('late.txt', 'w').write('x')
        os._exit(0)
    os._exit(0)
"""
VICTIM = "import time\nopen('secret.txt', 'w').write('42')\ntime.sleep(4)\nprint('alive', open('secret.txt').read())"
# Everything a plain user's snippet could try against another episode's snippet and the pool server.
ATTACKER = """
import ctypes, glob, os, signal, time
time.sleep(1)
libc = ctypes.CDLL(None, use_errno=True)
found = []
for p in [q for q in os.listdir("/proc") if q.isdigit() and int(q) != os.getpid()]:
    for what in ("cwd", "root", "fd"):
        try:
            found.append((p, what, os.listdir(f"/proc/{p}/{what}")))
        except OSError:
            pass
    for what in ("environ", "mem"):
        try:
            found.append((p, what, open(f"/proc/{p}/{what}", "rb").read(64)))
        except OSError:
            pass
    if libc.ptrace(16, int(p), 0, 0) == 0:  # PTRACE_ATTACH
        found.append((p, "ptrace", ""))
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(int(p), sig)
        except OSError:
            pass
for path in glob.glob("/tmp/mappa-sandbox-*/*/secret.txt") + glob.glob("/proc/*/root/tmp/mappa-sandbox-*/*/secret.txt"):
    found.append((path, "file", ""))
try:
    os.kill(-1, signal.SIGKILL)
except OSError:
    pass
print("SEEN" if any("secret" in str(f) for f in found) else "nothing", len(found))
"""
FORGED = """
import glob, json, os, sys
line = (json.dumps({"setup_failed": "forged"}) + "\\n").encode()
for path in glob.glob("/proc/*/fd/*"):
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, line)
    except OSError:
        pass
sys.stderr.write("mappa-runner: could not enter the sandbox: x\\n")
sys.exit(254)
"""
SOCKETS = """
import socket, time
pairs = []
for _ in range(60):
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
        s.setblocking(False)
        try:
            while True:
                s.send(b'x' * 65536)
        except BlockingIOError:
            pass
    pairs.append((a, b))
time.sleep(3)
print('HELD')
"""


def probe(mode: str, agent_python: str, src: str) -> dict:
    ws, other = new_workspace(), new_workspace({"secret.txt": b"42"})
    victim_ws, attacker_ws = new_workspace(), new_workspace()
    cfg = SandboxConfig(
        pool=True, preload=["numpy"], python=agent_python, confinement=mode, timeout_s=30, concurrency=2
    )
    with Sandbox(cfg) as sb:
        left = sb.run(f"SRC = {src!r}\n" + LEFT_BEHIND, ws)
        with ThreadPoolExecutor(2) as ex:
            victim = ex.submit(sb.run, VICTIM, victim_ws)
            time.sleep(0.3)
            attack = ex.submit(sb.run, ATTACKER, attacker_ws).result()
            victim = victim.result()
        forged = sb.run(FORGED, ws)
        after = sb.run("print('server alive')", ws)
    with Sandbox(SandboxConfig(pool=True, preload=[], python=agent_python, confinement=mode, memory_mb=64)) as sb:
        sockets = sb.run(SOCKETS, ws)
    time.sleep(2.5)
    found = {
        "ok": left.ok,
        "listing": left.stdout.strip(),
        "name": ws.name,
        "late": (ws / "late.txt").exists(),
        "victim": [victim.ok, victim.stdout.strip()],
        "attack": [attack.stdout.strip(), attack.stderr[-300:]],
        "forged_infra": forged.infra_error,
        "after": after.stdout.strip(),
        "sockets": [sockets.memory_exceeded, "HELD" in sockets.stdout],
    }
    for w in (ws, other, victim_ws, attacker_ws):
        remove_workspace(w)
    return found


if __name__ == "__main__":
    print(json.dumps({mode: probe(mode, sys.argv[1], sys.argv[2]) for mode in ("bwrap", "fallback")}))
