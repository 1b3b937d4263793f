"""Embedded model load: cold (read + dequantize the GGUF, write the safetensors cache) vs cached, side by side.

Both loads run in this process after the imports, into a fresh temporary MAPPA_CACHE, so the ratio
compares the loading work alone. Prints both times and their ratio (target: cached >= 30x faster).

    .venv/bin/python bench/bench_model_load.py [--cached-runs 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached-runs", type=int, default=3)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="mappa-bench-cache-")
    os.environ["MAPPA_CACHE"] = tmp
    from mappa.policy.models import EMBEDDED_NAME, load_base_model

    try:
        start = time.perf_counter()
        model, _ = load_base_model(EMBEDDED_NAME)
        cold = time.perf_counter() - start
        n_params = sum(p.numel() for p in model.parameters())
        del model
        cached = []
        for _ in range(args.cached_runs):
            start = time.perf_counter()
            model, _ = load_base_model(EMBEDDED_NAME)
            cached.append(time.perf_counter() - start)
            del model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    warm = statistics.median(cached)
    print(f"model: {EMBEDDED_NAME} ({n_params / 1e6:.1f}M parameters, fp32, cpu)")
    print(f"cold GGUF load (dequantize + write cache): {cold:.2f} s")
    print(f"cached load (median of {len(cached)}): {warm:.3f} s  [{', '.join(f'{t:.3f}' for t in cached)}]")
    print(f"ratio cold/cached: {cold / warm:.1f}x (target >= 30x)")


if __name__ == "__main__":
    main()
