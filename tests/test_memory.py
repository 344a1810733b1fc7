"""find_executable_batch_size and release_memory (hasten.utils)."""

from __future__ import annotations

import pytest
import torch

from hasten.training.memory import is_out_of_memory
from hasten.utils import find_executable_batch_size, release_memory


def test_a_real_cpu_allocator_failure_shrinks_the_batch():
    tried = []

    @find_executable_batch_size(starting_batch_size=40)
    def train(batch_size, scale):
        tried.append(batch_size)
        # Above 20 rows ask the CPU allocator for a terabyte per row: it refuses.
        per_row = 2**40 if batch_size > 20 else 1024
        buffer = torch.empty(batch_size * per_row * scale, dtype=torch.uint8)
        return batch_size, buffer.numel()

    assert train(1) == (19, 19 * 1024)
    assert tried == [40, 36, 32, 28, 25, 22, 19]  # 90% each time, rounded down
    tried.clear()
    assert train(1) == (19, 19 * 1024) and tried == [19]  # a later call starts where the last one ran


def test_torchs_out_of_memory_error_counts_and_other_errors_do_not():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("CUDA out of memory."))

    calls = []

    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size):
        calls.append(batch_size)
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        broken()
    assert calls == [8]  # not retried


def test_reaching_zero_and_a_custom_reduction():
    sizes = []

    def halve():
        return sizes[-1] // 2

    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=halve)
    def never_fits(batch_size):
        sizes.append(batch_size)
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(RuntimeError, match=r"never_fits\(\) ran out of memory at every batch size down from 8"):
        never_fits()
    assert sizes == [8, 4, 2, 1]


def test_misuse_is_a_clear_error():
    @find_executable_batch_size
    def train(batch_size):
        return batch_size

    assert train() == 128
    with pytest.raises(TypeError, match=r"train\(\) got its batch size as its first argument \(train\(64\)\)"):
        train(64)
    with pytest.raises(ValueError, match="starting_batch_size must be >= 0, got -1"):
        find_executable_batch_size(lambda b: b, starting_batch_size=-1)
    zero = find_executable_batch_size(lambda b: b, starting_batch_size=0)  # as Accelerate: fails when called
    with pytest.raises(RuntimeError, match=r"No executable batch size found, reached zero\. \(starting_batch_size=0"):
        zero()

    @find_executable_batch_size(starting_batch_size=4, reduce_batch_size_fn=lambda: 4)
    def stuck(batch_size):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(ValueError, match="must return a smaller batch size than 4, got 4"):
        stuck()


def test_release_memory_returns_a_none_per_object():
    model, optimizer = torch.nn.Linear(2, 2), None
    model, optimizer = release_memory(model, optimizer)
    assert model is None and optimizer is None
    assert release_memory() == []
