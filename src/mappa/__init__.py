"""mappa: finetune multiagent LLM systems with per-action process rewards from an AI coach.

    import mappa
    result = mappa.train(cfg, workflow=..., coach=..., train_tasks=..., eval_tasks=...)   # see mappa.api

`mappa.train` is loaded on first use, so that `import mappa` (and the CLI's start) does not import torch.
"""

from typing import Any

from mappa.errors import MappaError

__version__ = "0.1.0"
__all__ = ["MappaError", "__version__", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from mappa.api import train

        return train
    raise AttributeError(f"module 'mappa' has no attribute {name!r}")
