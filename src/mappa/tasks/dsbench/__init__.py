"""The offline mini-DSBench: Kaggle-style tabular tasks built from tables that pip packages carry in their wheels.

- `metrics`: the ten metrics DSBench mixes, the trivial and perfect scores, the relative gap;
- `submission`: reading and scoring a `submission.csv` (a bad file is a failure with a reason, never a crash),
  and whether it is a success (strictly better than every prediction that ignores the features);
- `receipts`: whether the pickles the agents pass on hold what they claim, checked inside the sandbox by
  `receipt_check`'s source (a restricted unpickler; never loaded on the host);
- `catalogue`: the tasks (table, target, metric, preparation), read from the data file `catalogue.yaml`;
- `tables`: the sources (package, version, licence), loading their tables and the preparation recipes;
- `describe`: the Kaggle-page `description.txt` of a task;
- `reference`: the scripted reference team (Data Engineer -> Modeler -> Analyst snippets, no model);
- `build`: `build_dsbench(out, seed)`, which writes the benchmark directory and refuses tasks the reference
  team cannot solve through the sandbox.

The user-facing entry points live in `mappa.tasks.tabular`.
"""
