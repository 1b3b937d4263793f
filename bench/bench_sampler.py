"""Drawing one token per row: `torch.multinomial` (what transformers' generate does) vs mappa's inverse CDF
(`mappa.policy.decoding._sample`: one float64 uniform per row through the row's CDF), side by side.

For each batch size: (B, V) float32 logits at the embedded model's vocabulary (49,152) and the spread of a
135M model's next-token distribution, temperature 0.7, each row with its own seeded generator (as `generate`
samples with a seed) and, with `--shared`, one generator for the batch. The two ways alternate `--repeats` times
so a busy machine slows both alike; prints the median milliseconds per draw and the ratio. Then a check that
both draw the distribution they should: the total variation between each way's token frequencies over `--draws`
draws of one row and the exact softmax (both carry the same sampling noise).

    .venv/bin/python bench/bench_sampler.py [--batches 4 16 64] [--repeats 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mappa.policy import decoding

VOCAB = 49_152


def multinomial(logits: torch.Tensor, temperature: float, gens: list[torch.Generator]) -> torch.Tensor:
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.cat([torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(gens)])


def multinomial_shared(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen).squeeze(1)


def timed(fn, repeats: int) -> float:  # noqa: ANN001
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def speed(batch: int, repeats: int, shared: bool, temperature: float) -> tuple[float, float]:
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 4  # peaked, like an LM's
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    rows = [decoding.DecodeRow(i, [1], 1, generator=None if shared else gens[i]) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    naive = (
        (lambda: multinomial_shared(logits, temperature, g))
        if shared
        else (lambda: multinomial(logits, temperature, gens))
    )
    ours = lambda: decoding._sample(logits, temperature, 1.0, g, rows)  # noqa: E731
    a, b = [], []
    for _ in range(repeats):  # alternate, so a busy machine slows both alike
        a.append(timed(naive, 1))
        b.append(timed(ours, 1))
    return statistics.median(a), statistics.median(b)


def agreement(draws: int, temperature: float) -> tuple[float, float]:
    """Total variation between each way's token frequencies over `draws` draws and the exact distribution."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)) * 4
    exact = torch.softmax(logits.double() / temperature, -1)
    many = logits[None].expand(draws, -1)
    rows = [decoding.DecodeRow(i, [1], 1) for i in range(draws)]

    def tv(t: torch.Tensor) -> float:
        return 0.5 * float((torch.bincount(t, minlength=VOCAB).double() / draws - exact).abs().sum())

    ours = decoding._sample(many, temperature, 1.0, torch.Generator().manual_seed(3), rows)
    return tv(ours), tv(multinomial_shared(many, temperature, torch.Generator().manual_seed(1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--draws", type=int, default=20_000)
    ap.add_argument("--shared", action="store_true", help="one generator for the batch instead of one per row")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"V={VOCAB}, temperature {a.temperature}, {a.threads} threads, "
          f"{'one generator per batch' if a.shared else 'one generator per row'}, median of {a.repeats}")  # fmt: skip
    print(f"{'rows':>5} {'multinomial ms':>15} {'inverse CDF ms':>15} {'ratio':>7}")
    for b in a.batches:
        naive, ours = speed(b, a.repeats, a.shared, a.temperature)
        print(f"{b:5d} {naive:15.2f} {ours:15.2f} {naive / ours:6.2f}x")
    tv, floor = agreement(a.draws, a.temperature)
    print(f"distance to the exact distribution (total variation over {a.draws} draws; sampling noise alone gives "
          f"about this much): inverse CDF {tv:.4f}, multinomial {floor:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
