"""The CPU peak-memory method sees every allocation, including Inductor-generated buffers."""
import torch

from effpass.testing.memory import live_tensor_bytes, peak_memory


def test_peak_of_known_allocations_is_exact():
    def step():
        a = torch.empty(1 << 20)            # 4 MiB
        b = torch.empty(1 << 19)            # 2 MiB  -> 6 MiB live
        del a
        c = torch.empty(3 << 19)            # 6 MiB  -> 8 MiB live: the peak
        return b.numel() + c.numel()
    _, peak = peak_memory(step)
    assert peak == 8 << 20


def test_peak_sees_a_buffer_never_written_and_nested_calls():
    _, peak = peak_memory(lambda: [torch.empty(1000, dtype=torch.float64) for _ in range(3)])
    assert peak == 3 * 8000


def test_live_tensor_bytes_counts_each_storage_once():
    w = torch.zeros(10, 10)
    assert live_tensor_bytes([w, w, w.view(100), w[0]]) == 400
    lin = torch.nn.Linear(4, 3)
    assert live_tensor_bytes(lin.parameters()) == (12 + 3) * 4
