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
