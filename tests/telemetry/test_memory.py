"""The probe's cached memory counts (telemetry.memory.ModelMemory) follow what changes between calls."""

import mmap
import os

import torch
from torch import nn

from workbench.telemetry import memory


def _page_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_parameter_bytes_follow_a_parameter_replaced_in_its_slot():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    counted = memory.ModelMemory([model], [], torch.device("cpu"))
    assert counted.parameter_bytes() == memory.parameter_bytes([model]) == (4 * 3 + 3 + 3 * 2 + 2) * 4
    model[0].weight = nn.Parameter(torch.zeros(30, 4))  # what FSDP2 does between sharded and gathered, in size
    assert counted.parameter_bytes() == memory.parameter_bytes([model]) == (30 * 4 + 3 + 3 * 2 + 2) * 4
    model[1].weight = model[0].weight  # tied: one object in two slots counts once
    assert counted.parameter_bytes() == memory.parameter_bytes([model]) == (30 * 4 + 3 + 2) * 4


def test_gradient_bytes_follow_gradients_as_they_appear_and_go():
    model = nn.Linear(4, 3)
    counted = memory.ModelMemory([model], [], torch.device("cpu"))
    assert counted.gradient_bytes() == 0
    model(torch.ones(2, 4)).sum().backward()
    assert counted.gradient_bytes() == memory.gradient_bytes([model]) == (4 * 3 + 3) * 4
    model.weight.grad = None
    assert counted.gradient_bytes() == memory.gradient_bytes([model]) == 3 * 4


def test_process_bytes_is_the_resident_set_now():
    before = memory.process_bytes(torch.device("cpu"))
    assert abs(before - _page_bytes()) < 1 << 20
    # 64 MiB of pages this process never had, touched: a fresh anonymous mapping, not the heap, where an earlier
    # test's freed memory may still be resident and be handed out again (a fresh-clone run saw RSS not move).
    block = mmap.mmap(-1, 64 << 20)
    block.write(b"\x01" * (64 << 20))
    assert memory.process_bytes(torch.device("cpu")) - before > 60 << 20
    block.close()
