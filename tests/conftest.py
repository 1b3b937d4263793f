import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared, oversubscribed CPU those threads
    spin-wait and slow a test severalfold; the caller's setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
