import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy shared CPU the thread barrier
    makes every op ~100× slower. Restored after each module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
