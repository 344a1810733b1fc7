"""The docs' pictures (docs/pictures/make_pictures.py, run by ``make docs``): the three PNGs are made,
the same bytes each time, and what they show is what hasten and torch do: the mesh picture's groups
are those of the DeviceMesh ``ParallelismConfig.build_device_mesh`` builds (on a fake process group
of 16 ranks, every rank), the pipeline picture's orders those of torch's schedules."""

from __future__ import annotations

import importlib.util
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

SCRIPT = Path(__file__).parent.parent / "docs" / "pictures" / "make_pictures.py"
PICTURES = ("device_mesh.png", "pipeline_schedules.png", "checkpoint_flow.png")


@pytest.fixture(scope="module")
def pictures():
    """The script as a module (imported without writing bytecode into docs/)."""
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("make_pictures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = before
    return module


def _chunks(data: bytes) -> list[tuple[str, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    found, i = [], 8
    while i < len(data):
        (length,) = struct.unpack(">I", data[i : i + 4])
        found.append((data[i + 4 : i + 8].decode("ascii"), data[i + 8 : i + 8 + length]))
        i += 12 + length
    return found


def test_the_three_pictures_are_made_without_metadata_that_changes(pictures, tmp_path):
    made = pictures.main([str(tmp_path / "a")])
    assert sorted(p.name for p in made) == sorted(PICTURES)
    for name in PICTURES:
        chunks = _chunks((tmp_path / "a" / name).read_bytes())
        kinds = [kind for kind, _ in chunks]
        assert kinds[0] == "IHDR" and kinds[-1] == "IEND" and "IDAT" in kinds
        assert not {"tEXt", "iTXt", "zTXt", "tIME"} & set(kinds), (name, kinds)  # no software name, no date
        width, height = struct.unpack(">II", chunks[0][1][:8])
        assert width >= 1000 and height >= 500, (name, width, height)


@pytest.mark.slow
def test_the_script_run_as_make_docs_runs_it_gives_the_same_bytes(pictures, tmp_path):
    pictures.main([str(tmp_path / "a")])
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "b")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    for name in PICTURES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


_FAKE = "hastenpicturesfake"


def _fake_backend() -> str:
    """torch's fake process group (no communication: one process stands for any rank) under a name
    of its own, taking whatever options a group is made with (hasten's groups carry the run's
    timeout; torch's own "fake" backend refuses generic options)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common: Any, options: Any) -> Any:
        if not isinstance(options, FakeProcessGroup.Options):
            options = FakeProcessGroup.Options()
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)

    if not hasattr(dist.Backend, _FAKE.upper()):
        dist.Backend.register_backend(_FAKE, create, extended_api=True, devices=["cpu"])
    return _FAKE


def _built_groups(pictures, sizes: dict[str, int], rank: int, world: int) -> dict[str, list[int]]:
    """``{dim: this rank's group}`` of the mesh hasten builds at ``rank`` of ``world`` (a fake group)."""
    dist.init_process_group(_fake_backend(), rank=rank, world_size=world, store=dist.HashStore())
    try:
        config = pictures.parallelism_config(**sizes)
        mesh = config.build_device_mesh("cpu")
        found = {d: mesh[d].mesh.flatten().tolist() for d in mesh.mesh_dim_names}
        found["dp_shard_cp"] = config.flattened["dp_shard_cp"].mesh.flatten().tolist()
        if "experts" in config.flattened:
            experts = config.flattened["experts"]
            found.update({d: experts[d].mesh.flatten().tolist() for d in ("efsdp", "ep")})
        return found
    finally:
        dist.destroy_process_group()


def test_the_mesh_picture_shows_the_groups_of_the_mesh_hasten_builds(pictures):
    from hasten.settings.parallelism import MESH_DIMS

    for _, sizes in pictures.MESH_EXAMPLES:
        config = pictures.parallelism_config(**sizes)
        drawn = pictures.mesh_groups(config)
        wanted = {d for d in MESH_DIMS if config.sizes()[d] > 1} | ({"efsdp", "ep"} if config.ep_size > 1 else set())
        assert wanted <= set(drawn), (sizes, sorted(drawn))
        world = config.total_size
        for dim, groups in drawn.items():  # each dim's groups split the ranks
            assert sorted(r for g in groups for r in g) == list(range(world)), dim
        for rank in range(world):
            built = _built_groups(pictures, sizes, rank, world)
            for dim, groups in drawn.items():
                mine = next(g for g in groups if rank in g)
                assert mine == built[dim], (sizes, rank, dim, mine, built[dim])


def _torch_orders(schedule: str, stages: int, microbatches: int) -> list[list[str]]:
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    cls = {"GPipe": schedules.ScheduleGPipe, "1F1B": schedules.Schedule1F1B}[schedule]
    if "_get_pipeline_order" not in vars(cls):
        pytest.skip(f"this torch's {cls.__name__} has no schedule order to compare with")
    ir = cls._get_pipeline_order(SimpleNamespace(_num_stages=stages, _n_microbatches=microbatches))
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}  # the others (REDUCE_GRAD) are no compute drawn
    drawn = [[a for a in ir[s] if a is not None and a.computation_type.name in kinds] for s in range(stages)]
    return [[f"{kinds[a.computation_type.name]}{a.microbatch_index}" for a in actions] for actions in drawn]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_the_pipeline_picture_runs_torch_s_schedule_orders(pictures, schedule):
    stages, microbatches = pictures.STAGES, pictures.MICROBATCHES
    orders = pictures.schedule_order(schedule)
    theirs = _torch_orders(schedule, stages, microbatches)
    # torch 2.13's order for the last stage (drawn only, never run) starts at F1 and ends at F8;
    # its 1F1B runs F0 B0 F1 B1 ... there (_step_microbatches: one warm-up forward), as drawn
    assert orders[:-1] == theirs[:-1]
    for order in orders:
        assert sorted(order) == sorted([f"F{m}" for m in range(microbatches)] + [f"B{m}" for m in range(microbatches)])
        assert all(order.index(f"F{m}") < order.index(f"B{m}") for m in range(microbatches))
    timeline = pictures.simulate(orders)
    span = max(end for stage in timeline for _, _, end in stage)
    step = pictures.FORWARD_TIME + pictures.BACKWARD_TIME
    assert span == (microbatches + stages - 1) * step  # the bubble: stages - 1 steps, for both
    held = [pictures.held_activations(order) for order in orders]
    assert held == ([microbatches] * stages if schedule == "GPipe" else [stages - s for s in range(stages)])


def test_a_schedule_the_picture_does_not_draw_is_refused(pictures):
    with pytest.raises(ValueError, match="'GPipe' or '1F1B', got 'ZBV'"):
        pictures.schedule_order("ZBV")
