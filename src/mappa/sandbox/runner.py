"""The process that runs inside the confinement: applies the limits, drops to the sandbox uid, runs snippets.

Standard library only, and started as a script (never imported by mappa), so that it starts in tens of
milliseconds and owns no state of the host. Three modes:

    runner.py [--root JSON] once STATUS_FD CODE_FD SPEC   one snippet; its wait status goes to STATUS_FD
    runner.py [--root JSON] serve SOCK_FD PRELOAD_JSON    fork server: pre-import once, fork per snippet
    runner.py [--root JSON] probe SPEC                    exit 0 when a snippet's set-up works here

`--root` (the fallback inside `unshare -m`): build the allowlisted root (allowlist.root_plan) on a tmpfs from
bind mounts, chroot into it and execute the runner again from there, as bubblewrap does from its options.

In every mode the snippet runs in a forked child of this runner. The steps live in the package `inside`
beside this file, which the allowlisted root binds beside it (allowlist.RUNNER_PACKAGE_INSIDE) and which
the script's folder, first on sys.path, makes importable: `jail` (mounts, namespaces, seccomp), `police`
(the resident-memory watchdog and the sweeps), `snippet` (the child and its relay), `serve` (the fork server).
"""

from __future__ import annotations

import json
import os
import sys

if __package__:  # imported as mappa.sandbox.runner (e.g. by a tool that imports every module): its package
    from .inside.jail import build_root, libc, restrict
    from .inside.police import wait_watching
    from .inside.serve import main_serve
    from .inside.snippet import PR_SET_DUMPABLE, RUNNER_TAG, child, enter_namespaces, read_fd, read_report
else:  # run as a script: its folder is first on sys.path, `inside` the package bound beside it (root_plan)
    from inside.jail import build_root, libc, restrict
    from inside.police import wait_watching
    from inside.serve import main_serve
    from inside.snippet import PR_SET_DUMPABLE, RUNNER_TAG, child, enter_namespaces, read_fd, read_report


def main_once(status_fd: int, code_fd: int, spec: dict) -> None:
    code = read_fd(code_fd)
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        child(spec, code, report_w)  # closes every other descriptor, the status pipe included
    os.close(report_w)
    os.set_blocking(report_r, False)
    os.write(status_fd, (json.dumps({"pid": pid}) + "\n").encode())
    status, exceeded = wait_watching(pid, spec)
    said = read_report(report_r)
    record = {
        "wait_status": said.get("wait_status", status),
        "memory_exceeded": exceeded or bool(said.get("memory_exceeded")),
    }
    record["setup_failed"] = said.get("setup_failed")
    os.write(status_fd, (json.dumps(record) + "\n").encode())
    os._exit(0)


def main_probe(spec: dict) -> None:
    """Exit 0 when a snippet's set-up works here: its namespaces (if asked), the uid drop, the restrictions,
    and importing standard-library modules the runner has not imported yet."""
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            enter_namespaces(spec, report_w)
            if spec["uid"] is not None:
                os.setgroups([])
                os.setgid(spec["uid"])
                os.setuid(spec["uid"])
            restrict(keep_uid=spec["uid"] is None)
            import csv  # noqa: F401
            import pickle  # noqa: F401
        except BaseException as e:
            os.write(2, f"{RUNNER_TAG} the sandbox's set-up failed: {e!r}\n".encode())
            os._exit(1)
        os._exit(0)
    os.close(report_w)
    status = os.waitpid(pid, 0)[1]
    os.set_blocking(report_r, False)
    os._exit(os.waitstatus_to_exitcode(read_report(report_r).get("wait_status", status)))


def main(argv: list[str]) -> None:
    # Not dumpable: a snippet that shares our uid (the fallback without namespaces) cannot open /proc/PID/fd of the
    # runner, whose status pipe carries the verdict on each snippet. The snippet itself is made dumpable again.
    libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    if argv[:1] == ["--root"]:
        root = json.loads(argv[1])
        build_root(root["ops"])
        # Start again from inside: the agent environment's paths are those of the new root from now on.
        os.execv(root["python"], [root["python"], "-s", "-B", root["runner"], *argv[2:]])  # flags: runner_argv's
    mode = argv[0]
    if mode == "once":
        main_once(int(argv[1]), int(argv[2]), json.loads(argv[3]))
    elif mode == "serve":
        main_serve(int(argv[1]), json.loads(argv[2]))
    elif mode == "probe":
        main_probe(json.loads(argv[1]))
    else:
        raise SystemExit(f"{RUNNER_TAG} unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
