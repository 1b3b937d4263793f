"""mappa: finetune multiagent LLM systems with per-action process rewards from an AI coach."""

from mappa.errors import MappaError

__version__ = "0.1.0"
__all__ = ["MappaError", "__version__"]
