"""The architecture stays visible: every module sits in a declared layer and imports nothing of a higher one,
no import cycles (imports inside functions included), short functions, the RL math imports nothing of the
package, the update knows nothing of generation, and the training path never imports the serving engine.

Read from the source with `ast`, so an import hidden in a function is found without running it.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_FUNCTION_LINES = 80
# Modules on the training path: `mappa train` must not pay for (or depend on) the inference server.
TRAINING_PATH = [
    "mappa.training.trainer", "mappa.policy.policy", "mappa.training.rl", "mappa.rollout", "mappa.training.evaluate",
    "mappa.workflows",
]  # fmt: skip

# The layers, lowest first: a module may import its own layer and those below, never one above. An entry names a
# module and everything inside it (`mappa.coach` holds `mappa.coach.judge`), or is a pattern (`mappa.training.*`);
# the longest entry that matches wins, so a submodule can sit above (or below) its package. "mappa" is the
# package's __init__ alone. The `policy` and `training` packages import nothing in their __init__, so their light
# modules (the RL math, the rewards, the autocast) sit in the base layer.
LAYERS: dict[str, list[str]] = {
    "base": [
        "mappa.errors", "mappa.types", "mappa.paths", "mappa.protocols", "mappa.plugins", "mappa.config",
        "mappa.config_rollout", "mappa.config_training", "mappa.metrics", "mappa.beneath", "mappa.progress",
        "mappa.training", "mappa.training.rl", "mappa.training.rewards", "mappa.policy.precision",
    ],
    # the sandbox runs code and knows no task: the tables scan takes the tasks' fingerprints as data handed in
    "sandbox": ["mappa.sandbox"],
    # tasks.dsbench and tasks.tabular run reference solutions in the sandbox and fingerprint with its scan's hashes
    "tasks": ["mappa.tasks"],
    "policy": ["mappa.policy"],
    "generation": ["mappa.generation"],
    "workflows": ["mappa.workflows"],
    # the coach scores what a workflow did: the rubric reads code with the workflows' fence rules, and replay
    # rebuilds the coach's contexts with the episode's workflow
    "coach": ["mappa.coach"],
    "update": ["mappa.training.update"],
    "rollout and evaluation": ["mappa.rollout", "mappa.training.evaluate", "mappa.training.selftest"],
    "trainer": [
        "mappa.training.trainer", "mappa.training.engine", "mappa.training.checkpoint", "mappa.training.tracking",
    ],
    "distributed": ["mappa.distributed"],
    "api": ["mappa", "mappa.api", "mappa.export"],
    "analysis": ["mappa.analysis", "mappa.trace"],
    "serving": ["mappa.serving"],
    "cli": ["mappa.cli"],
}  # fmt: skip

# Packages whose __init__ is a docstring and a re-export: the main classes live in modules named for what they hold,
# so a reader finds `CoachRunner` in coach/runner.py, not in a 300-line __init__.
RE_EXPORTING_PACKAGES = ["mappa.sandbox", "mappa.coach", "mappa.generation", "mappa.cli", "mappa.tasks"]


def _modules() -> dict[str, Path]:
    mods = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every mappa module `module` imports, at any depth of its code; `from pkg import name` counts pkg.name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            # `from pkg import sub` from inside pkg needs only pkg.sub: pkg/__init__ ran before the importer did
            inside = module.startswith(node.module + ".") and all(s in mods for s in subs)
            names = [*([] if inside else [node.module]), *subs]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n in mods and n != module)
    # Importing a.b.c runs a/__init__ and a/b/__init__ first, unless `module` lives inside that package.
    for name in list(found):
        parent = name.rpartition(".")[0]
        while parent in mods and not module.startswith(parent + "."):
            found.add(parent)
            parent = parent.rpartition(".")[0]
    found.discard(module)
    return found


@functools.cache  # the source does not change while the tests run
def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _layer(module: str, layers: dict[str, list[str]]) -> int | None:
    """The index of `module`'s layer (its longest matching entry), None when no entry holds it."""
    best, best_len = None, -1
    for i, entries in enumerate(layers.values()):
        for entry in entries:
            holds = module == entry or (entry != "mappa" and module.startswith(entry + "."))
            if (holds or ("*" in entry and fnmatchcase(module, entry))) and len(entry) > best_len:
                best, best_len = i, len(entry)
    return best


def _upward(graph: dict[str, set[str]], layers: dict[str, list[str]]) -> list[str]:
    """Every import of a module of a higher layer, as `importer -> imported (layer -> layer)`."""
    names = list(layers)
    out = []
    for module in sorted(graph):
        low = _layer(module, layers)
        for dep in sorted(graph[module]):
            high = _layer(dep, layers)
            if low is not None and high is not None and high > low:
                out.append(f"{module} -> {dep} ({names[low]} imports {names[high]})")
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for n in graph.get(m, ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_layer_check_sees_an_upward_import_and_a_module_out_of_every_layer():
    layers = {"low": ["p.a", "p.b*"], "high": ["p.c", "p.a.top"]}
    graph = {"p.a": {"p.b2"}, "p.a.x": {"p.c"}, "p.a.top": {"p.a"}, "p.c": {"p.a.x"}, "p.d": set()}
    assert _upward(graph, layers) == ["p.a.x -> p.c (low imports high)"]
    assert [m for m in graph if _layer(m, layers) is None] == ["p.d"]
    assert _layer("mappa", {"root": ["mappa"]}) == 0 and _layer("mappa.x", {"root": ["mappa"]}) is None


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _graph() if _layer(m, LAYERS) is None)
    assert unplaced == [], f"place {unplaced} in a layer of LAYERS in tests/test_layout.py"


def test_no_module_imports_a_higher_layer():
    upward = _upward(_graph(), LAYERS)
    assert upward == [], "imports of a higher layer (see LAYERS):\n" + "\n".join(upward)


def test_rl_imports_nothing_of_the_package():
    assert _graph()["mappa.training.rl"] == set()


def test_update_never_imports_generation():
    """The update is told what it needs (`UpdateSettings`); where the actions were generated is its caller's."""
    found = sorted(
        m for m in _reachable(_graph(), "mappa.training.update") if m.split(".")[:2] == ["mappa", "generation"]
    )
    assert found == [], f"mappa.training.update reaches {found}"


def test_no_import_cycles():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("module", TRAINING_PATH)
def test_training_path_does_not_import_serving(module):
    graph = _graph()
    assert module in graph, f"{module} moved: update TRAINING_PATH"
    served = sorted(m for m in _reachable(graph, module) if m == "mappa.serving" or m.startswith("mappa.serving."))
    assert served == [], f"{module} imports {served}"


def test_functions_are_short():
    long = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert long == []


@pytest.mark.parametrize("package", RE_EXPORTING_PACKAGES)
def test_package_init_only_re_exports(package):
    """The docstring, imports and `__all__`: no definition and no statement with an effect of its own."""
    tree = ast.parse(_modules()[package].read_text())
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body

    def re_export(node: ast.stmt) -> bool:
        if isinstance(node, ast.Assign):
            return [ast.unparse(t) for t in node.targets] == ["__all__"]
        return isinstance(node, ast.Import | ast.ImportFrom)

    extra = [f"line {node.lineno}: {type(node).__name__}" for node in body if not re_export(node)]
    assert extra == [], f"{package}/__init__.py holds more than a re-export: {extra}"


def test_the_command_line_imports_no_torch():
    """`import mappa`, the parser and `mappa sandbox run` start without torch; the rubric coach needs none either."""
    code = (
        "import sys, mappa, mappa.cli, mappa.cli.sandbox, mappa.coach; mappa.cli.build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SRC, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"torch imported: {proc.stdout.strip()}"
