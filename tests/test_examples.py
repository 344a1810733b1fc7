"""Every example the README shows is a file under examples/ that runs here (short settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import torchrun
from launch_utils import launch_env

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_quickstart_one_process():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--epochs", "2", "--mixed_precision", "fp16"],
        capture_output=True,
        text=True,
        timeout=120,
        env=launch_env(),
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2 and "on 1 process(es)" in lines[0]
    first, last = (float(line.split("loss ")[1].split()[0]) for line in (lines[0], lines[-1]))
    assert last < first  # it learns


def test_quickstart_two_processes():
    proc = torchrun(EXAMPLES / "quickstart.py", "--epochs", "2", "--mixed_precision", "bf16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2 and "on 2 process(es)" in lines[0]  # printed by the main process only


@pytest.mark.slow  # FSDP2 on 2 processes is test_fsdp.py's; this is the example script's own run
def test_fsdp_example_two_processes(tmp_path):
    import json

    proc = torchrun(EXAMPLES / "fsdp.py", "--steps", "60", "--checkpoint", str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(lines) == 3 and "(FSDP, 2 process(es))" in lines[0]
    first, last = (float(line.split("loss ")[1].split()[0]) for line in (lines[0], lines[-1]))
    assert last < first  # it learns
    assert json.loads((tmp_path / "ck" / "hasten_checkpoint.json").read_text())["layout"] == "dcp"
    _readme_recipe_on_the_fsdp_example(tmp_path / "ck")


def _readme_recipe_on_the_fsdp_example(checkpoint):
    """The README's "Models bigger than one device" recipe on examples/fsdp.py's model (its
    nn.MultiheadAttention draws in `_reset_parameters`): built on meta it is initialised to the
    same weights as a real build, and the example's checkpoint (with its dataloader) loads."""
    import importlib.util

    from hasten import Accelerator, FullyShardedDataParallelPlugin

    spec = importlib.util.spec_from_file_location("fsdp_example", EXAMPLES / "fsdp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # defines the model; main() runs only as a script
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["TransformerBlock"], state_dict_type="SHARDED_STATE_DICT"
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    tokens = torch.randint(0, 16, (2048, 8))  # the example's data: its loader is in the checkpoint
    dataset = torch.utils.data.TensorDataset(tokens, tokens[:, 0])
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)
    torch.manual_seed(0)
    real = example.TinyTransformer()
    torch.manual_seed(0)  # the same seed: prepare draws the meta model's values as the real build did
    with torch.device("meta"):
        model = example.TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    initial = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    for name, value in real.state_dict().items():
        torch.testing.assert_close(initial[name], value, rtol=0, atol=0)
    accelerator.load_state(checkpoint)
    loaded = accelerator.get_state_dict(model)
    assert any(not torch.equal(loaded[k], v) for k, v in initial.items())  # the trained weights
    assert torch.isfinite(model(tokens[:4])).all()


@pytest.mark.slow  # > 20 s: make test-slow
def test_elastic_resume_example_stops_at_2_processes_and_resumes_at_3(tmp_path):
    """The README's resume-or-start loop: stopped after 3 steps at 2 processes, resumed at 3."""
    from launch_utils import launch

    script = EXAMPLES / "elastic_resume.py"
    first = launch("--cpu", "--num_processes", "2", script, "--project_dir", tmp_path, "--stop_after", "3", timeout=180)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "starting fresh" in first.stdout
    second = launch("--cpu", "--num_processes", "3", script, "--project_dir", tmp_path, timeout=180)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "checkpoint_2 at epoch 0" in second.stdout  # the newest of the saves after steps 1..3
    said = [line for line in second.stderr.splitlines() if "global batch size changes from 8 to 12" in line]
    assert len(said) == 1 and "elastic_resume.py" in said[0]  # once, pointing at the script's load_state line
    seen: dict[int, list[int]] = {0: [], 1: []}
    for path in tmp_path.glob("seen_rank*.txt"):
        for line in path.read_text().splitlines():
            epoch, *indices = map(int, line.split())
            seen[epoch] += indices
    # 12 batches of 4: 6 at 2 processes, then 6 (2 rounds) at 3, no padding; every sample once
    assert sorted(seen[0]) == list(range(48))
    assert sorted(seen[1]) == list(range(48))


def _readme_block(section: str) -> list[str]:
    """The command lines of the first ```bash block under the README heading ``section``."""
    text = (EXAMPLES.parent / "README.md").read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = body.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.slow  # the same script as test_quickstart_one_process/two_processes, through the README's lines
def test_readme_quick_start_commands_run_in_the_installed_environment():
    """The Quick start's lines, as written, in the virtual environment the tests run in (the one
    `make test` made, `.venv` in the README): `. .venv/bin/activate`, then `python` and `hasten`."""
    import os

    venv = Path(sys.prefix)
    if not (venv / "bin" / "activate").is_file() or not (venv / "bin" / "hasten").is_file():
        import pytest

        pytest.skip(f"the tests do not run in a virtual environment with hasten installed ({venv})")
    lines = _readme_block("Quick start")
    assert lines[0] == ". .venv/bin/activate" and any(line.startswith("hasten launch") for line in lines), lines
    script = "set -e\n" + "\n".join(line.replace(".venv/", f"{venv}/", 1) for line in lines)
    env = launch_env()
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(venv)))
    proc = subprocess.run(
        ["bash", "-c", script], cwd=EXAMPLES.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "on 1 process(es)" in proc.stdout and "on 2 process(es)" in proc.stdout, proc.stdout
