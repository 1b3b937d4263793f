"""The embedded default task set: seeded arithmetic word problems at five difficulty levels.

No data files: problems are generated from templates, so a run works offline on a fresh install.
Levels are sized for a 135M model: level 1 (one sum of two small numbers) is often solved, levels 3-5
(several operations, larger numbers, exact division) rarely are, which leaves room for training to help.

    level 1  one step, a + b with a, b <= 20
    level 2  two steps with + and -, numbers <= 50
    level 3  three steps, one multiplication among additions/subtractions
    level 4  four steps with multiplication and exact division
    level 5  five steps, larger numbers, all four operations

Answers are non-negative integers as text. Train and eval sets come from different seeds and every eval
problem text is removed from the training set, so they are disjoint.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from mappa.errors import MappaError
from mappa.types import Task

LEVELS = (1, 2, 3, 4, 5)

_NAMES = (
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Ines",
    "Jamal",
    "Kira",
    "Leo",
    "Mia",
    "Noah",
)
_ITEMS = ("apples", "marbles", "stickers", "pencils", "books", "coins", "shells", "cards", "beads", "stamps")
_CONTAINERS = ("boxes", "bags", "packs", "jars", "crates")

Template = Callable[[random.Random], tuple[str, int]]


def _level1(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    text = rng.choice(
        (
            f"What is {a} + {b}?",
            f"{name} has {a} {item} and finds {b} more. How many {item} does {name} have now?",
            f"There are {a} {item} on a table and {b} {item} on a shelf. How many {item} are there in total?",
        )
    )
    return text, a + b


def _level2(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 50), rng.randint(2, 30)
    c = rng.randint(1, a + b - 1)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    text = rng.choice(
        (
            f"{name} has {a} {item}. {name} buys {b} more and then gives {c} away. How many {item} does {name} have now?",
            f"A jar holds {a} {item}. Someone adds {b} {item} and later takes out {c}. How many {item} are in the jar?",
        )
    )
    return text, a + b - c


def _level3(rng: random.Random) -> tuple[str, int]:
    per, n = rng.randint(3, 12), rng.randint(2, 9)
    loose = rng.randint(1, 15)
    total = per * n + loose
    give = rng.randint(1, total - 1)
    name, item, box = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    text = (
        f"{item.capitalize()} come in {box} of {per}. {name} buys {n} {box} and also has {loose} loose {item}. "
        f"{name} then gives {give} {item} to a friend. How many {item} does {name} have left?"
    )
    return text, total - give


def _level4(rng: random.Random) -> tuple[str, int]:
    # n is a multiple of kids / gcd(per, kids), so the total shares out exactly
    kids, per = rng.randint(2, 6), rng.randint(4, 15)
    step = kids // math.gcd(per, kids)
    n = step * rng.randint(max(1, 3 // step), max(1, 12 // step))
    extra, spent = rng.randint(2, 20), rng.randint(1, 10)
    share = per * n // kids
    name, item, box = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    text = (
        f"A teacher buys {n} {box} of {item} with {per} {item} in each and shares them equally among {kids} "
        f"children. {name}, one of the children, already had {extra} {item} and loses {spent} on the way home. "
        f"How many {item} does {name} have at home?"
    )
    return text, share + extra - spent


def _level5(rng: random.Random) -> tuple[str, int]:
    groups, price = rng.randint(2, 6), rng.randint(12, 95)
    step = groups // math.gcd(price, groups)
    qty = step * rng.randint(max(1, 6 // step), max(1, 40 // step))
    bonus, fee, weeks = rng.randint(15, 120), rng.randint(5, 60), rng.randint(2, 6)
    name = rng.choice(_NAMES)
    revenue = price * qty
    text = (
        f"{name} sells {qty} lamps at {price} dollars each and splits the money equally between {groups} savings "
        f"accounts. Each week for {weeks} weeks, {name} adds {bonus} dollars to the first account and pays a "
        f"{fee} dollar fee from it. How many dollars are in the first account at the end?"
    )
    return text, revenue // groups + weeks * (bonus - fee)


_TEMPLATES: dict[int, Template] = {1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}


def _generate(n: int, levels: Sequence[int], rng: random.Random, exclude: set[str], prefix: str) -> list[Task]:
    tasks: list[Task] = []
    seen = set(exclude)
    attempts = 0
    while len(tasks) < n:
        level = levels[len(tasks) % len(levels)]  # round-robin: every level equally represented
        text, answer = _TEMPLATES[level](rng)
        attempts += 1
        if attempts > 200 * n + 1000:
            raise MappaError(f"tasks.arithmetic: cannot generate {n} distinct problems at levels {list(levels)}")
        if text in seen or answer < 0:
            continue
        seen.add(text)
        tasks.append(
            Task(
                id=f"{prefix}-{len(tasks):05d}",
                problem=text,
                answer=str(answer),
                source="arithmetic",
                meta={"level": level},
            )
        )
    return tasks


def arithmetic_tasks(n: int, levels: Sequence[int], split: str, seed: int, eval_size: int) -> list[Task]:
    """`n` generated problems of `split` ("train" | "eval"); train never repeats an eval problem text.

    The eval set is always regenerated from its own seed (`eval_size` problems) so that the train set can
    exclude it whatever `n` is.
    """
    bad = [lv for lv in levels if lv not in _TEMPLATES]
    if not levels or bad:
        raise MappaError(f"tasks.arithmetic_levels: levels must be among {list(LEVELS)} (got {list(levels)})")
    levels = sorted(set(levels))
    eval_tasks = _generate(eval_size, levels, random.Random(f"arithmetic/eval/{seed}"), set(), "arithmetic-eval")
    if split == "eval":
        return eval_tasks[:n]
    exclude = {t.problem for t in eval_tasks}
    return _generate(n, levels, random.Random(f"arithmetic/train/{seed}"), exclude, "arithmetic-train")
