"""Sandboxed Python execution: the agents' code tool, safe under hostile code and fast under RL load.

    ws = new_workspace({"data.csv": b"a,b\\n1,2\\n"})
    result = run_python("import pandas as pd; print(pd.read_csv('data.csv').sum())", ws, timeout_s=5)
    with Sandbox(SandboxConfig()) as sb:                # warm pool + concurrency from the config
        results = sb.run_many([(code, ws) for code in snippets])
    remove_workspace(ws)
    print(describe_confinement(sb.confinement))        # one line: the confinement in use, what it leaves open

Each snippet runs in a forked child of a confined runner (see confine.py for the exact confinement):
- wall clock (`timeout_s`) and CPU time (RLIMIT_CPU): the snippet and everything it started is killed, also
  processes that started their own session (the snippet's own PID namespace dies with its init);
- memory: a watchdog sums what the snippet pins every 50 ms, the resident memory (anonymous + shared, not
  file-backed) of its processes and the kernel's buffers for it (its sockets, pipes and /dev/shm), and kills them
  all above `memory_mb`, reported as `memory_exceeded` (so is an allocation that fails outright). Not an
  address-space limit: that counts what numpy, pyarrow and torch reserve, not what they use. In the warm pool the
  preloaded modules count as in a cold run that imports them;
- processes: RLIMIT_NPROC (`max_processes`), exact per workspace when root (a uid per workspace),
  otherwise counted on top of the user's existing processes;
- file size: RLIMIT_FSIZE (`max_file_mb`); stdout/stderr are read incrementally and only `max_output_chars`
  are kept (head and tail, with a marker saying how much was cut), so 100 MB of output costs no memory;
- no network: a network namespace (bwrap, or `unshare -n` in the fallback). Where neither works the network
  stays open, and the confinement's one-line description says so;
- environment: scrubbed to PATH/HOME/LANG and thread settings; no inherited API keys or tokens; string hashing
  fixed (PYTHONHASHSEED=0), so an agent's program prints a set in the same order in every run;
- files: agent code sees an allowlist of the host (the system's /usr, a minimal /etc, the agent environment,
  its workspace, an empty /tmp, its own /dev/shm of at most `memory_mb`), nothing of the trainer's checkout,
  data, run directories or other workspaces, nor the files in that view found to hold a copy of a task's table
  (`guard_task_tables`); see confine.py and docs/sandbox.md for the threat model;
- memory outside processes: memfd_create, System V shared memory and message queues are refused (seccomp);
- episodes share nothing: each snippet has its own mount, IPC, network and PID namespaces (no abstract socket,
  port, process or /proc entry of another episode in sight); keyrings, file locks and inotify are refused; open
  files are limited (`max_open_files`);
- faults: `infra_error` comes only from the sandbox's own report channel, never from what the snippet prints or
  its exit status; every host walk of a workspace is iterative and bounded (`workspace_flooded`);
- the host survives snippets that close stdout, kill their parent or leave background processes.

What it does NOT protect against:
- kernel exploits and escapes from namespaces (it is not a VM; run untrusted code at scale in a VM too);
- CPU and disk-bandwidth hogging within the limits (no cgroups: a snippet may use its cores until timeout);
- memory peaks shorter than the watchdog's 50 ms period; pages that forked workers still share with their
  parent are counted once per process (fork-based multiprocessing is charged more than it uses);
- filling the disk with many small files under its workspace (no quota);
- where no mount namespace is allowed (the fallback as a plain user without user namespaces): reading what
  the snippet's uid may read, which is why runs on tasks with hidden answers are then refused
  (`guard_hidden_answers`) unless `sandbox.allow_unconfined`.
"""

from mappa.sandbox.confine import Confinement, ConfinementMode, describe_confinement, detect_confinement
from mappa.sandbox.guards import answers_reachable, guard_hidden_answers, guard_task_tables
from mappa.sandbox.sandbox import Sandbox, run_python
from mappa.sandbox.workspace import new_workspace, remove_workspace, workspace_root

__all__ = [
    "Confinement",
    "ConfinementMode",
    "Sandbox",
    "answers_reachable",
    "describe_confinement",
    "guard_hidden_answers",
    "guard_task_tables",
    "detect_confinement",
    "new_workspace",
    "remove_workspace",
    "run_python",
    "workspace_root",
]
