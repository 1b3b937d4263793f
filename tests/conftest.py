import os

# As in `mappa.cli`: sleeping OpenMP waiters, so that tests next to other busy processes do not crawl.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared, oversubscribed CPU those threads
    spin-wait and slow a test severalfold; the caller's setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the sandbox under attack (test_redteam_sandbox.py, test_redteam_episodes.py) ----------------------------------
# Each attack runs under both confinements, cold and through the warm pool; a confinement that does not promise the
# property skips, saying why.
SANDBOX_LIMITS = dict(timeout_s=20.0, memory_mb=256, max_processes=32, max_file_mb=8, max_output_chars=4000)


@pytest.fixture
def limits() -> dict:
    return dict(SANDBOX_LIMITS)


@pytest.fixture(scope="module", params=["bwrap", "fallback"])
def conf(request):
    from mappa.sandbox import confine

    if request.param == "bwrap" and confine.bwrap_problem() is not None:
        pytest.skip(confine.bwrap_problem())
    c = confine.detect_confinement(request.param)
    if not c.hides_host:
        pytest.skip("this fallback cannot hide the host (no mount namespace); runs with hidden answers are refused")
    return c


@pytest.fixture(scope="module")
def pool(conf):
    from mappa.config import SandboxConfig
    from mappa.sandbox import Sandbox

    cfg = SandboxConfig(pool=True, preload=["numpy"], concurrency=2, confinement=conf.kind, **SANDBOX_LIMITS)
    with Sandbox(cfg) as sb:
        yield sb


@pytest.fixture(params=["cold", "pool"])
def run(request, conf, pool):
    """run(code, workspace, timeout_s=None) -> ExecResult, cold or through the module's warm pool."""
    from mappa.sandbox import run_python

    if request.param == "cold":
        return lambda code, ws, **kw: run_python(code, ws, **{**SANDBOX_LIMITS, **kw}, confinement=conf.kind)
    return lambda code, ws, **kw: pool.run(code, ws, timeout_s=kw.get("timeout_s"))


@pytest.fixture
def ws():
    from mappa.sandbox import new_workspace, remove_workspace

    path = new_workspace()
    yield path
    remove_workspace(path)


# --- the data-science pipeline on a tiny benchmark (test_ds_pipeline.py, test_redteam_dsbench.py, ...) ---------------
@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory):
    """Two train tasks and one eval task in the mini-DSBench's layout, written once per module."""
    from helpers import write_bench

    return write_bench(tmp_path_factory.mktemp("dsbench"))


@pytest.fixture(scope="module")
def sandbox():
    """The warm pool, at the default memory limit, shared by a module's tests."""
    from mappa.config import SandboxConfig
    from mappa.sandbox import Sandbox

    box = Sandbox(SandboxConfig(timeout_s=60, concurrency=2))
    yield box
    box.close()
