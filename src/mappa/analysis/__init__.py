"""Run files -> what the coach and the agents did: bias, blame, hacking, behaviour, comparisons, the HTML report.

Everything here reads a run directory's files (`runs.load_run`) and computes; nothing reruns a model. Training
never imports this package.
"""

from mappa.analysis.probe import ProbeRow, probe_run, read_probes  # noqa: F401  (`mappa probe`: loads checkpoints)
