"""Training: the RL math, the per-action rewards, the update, and the loop that runs them over one Engine.

    rl.py          pure torch: token rewards, returns, whitening, REINFORCE++ advantages, PPO-clip loss
    rewards.py     per-action scores (coach or outcome-only) and which actions train, and why not
    update.py      REINFORCE++ / PPO-clip on one update group's batch: mini-batches, micro-batches, optimizer
    trainer.py     the loop: setup() -> train_step() -> train() (docstring: the algorithm and its departures)
    engine.py      LocalEngine: the Engine protocol in this process (`mappa.distributed` implements it over Ray)
    checkpoint.py  checkpoints (kill and resume exactly); tracking.py: the run directory, metrics.jsonl, trackers
    evaluate.py    rule-based evaluation -> JSONL; selftest.py: the checks before the first step

Nothing is imported here, so that `mappa.training.rl` stays a torch-only import. (The package is not named
`train`: `mappa.train` is the Python entry point, `mappa.api.train`.)
"""
