"""PeakMemory counts each new storage once, ignores views, in-place ops and meta tensors."""

import torch

from torchfn.train import PeakMemory


def test_counts_allocations_and_frees():
    before = torch.ones(250)  # allocated outside: never counted
    with PeakMemory() as mem:
        x = torch.ones(1000)  # 4000 bytes
        v = x[:10]  # a view: no new memory
        x.add_(1)  # in place: no new memory
        y = x * 2  # 4000 more
        torch.empty(10, device="meta")  # no memory
        del x, v
        z = before + 1  # 1000
        w = torch.ones(2, dtype=torch.float64)  # 16
    assert (mem.peak, mem.current) == (8000, 5016)  # x and y alive together, then y, z, w
    mem.reset_peak()
    assert mem.peak == 5016
    assert y.numel() + z.numel() + w.numel() == 1252


def test_sees_autograd_backward():
    w = torch.ones(100, 100, requires_grad=True)
    with PeakMemory() as mem:
        loss = (w * 2).sin().sum()  # saves w * 2 (40 kB) for sin's backward
        (g,) = torch.autograd.grad(loss, w)
    assert mem.current >= g.numel() * 4  # the gradient is alive
    assert mem.peak >= 3 * g.numel() * 4  # saved input + cos + grad at the peak
