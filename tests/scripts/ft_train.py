"""One replica group of a fault-tolerant run (tests/test_fault_tolerance.py).

Started by ``hasten launch --ft_replica_group G --ft_num_replica_groups K --ft_lighthouse URL``;
argv: OUT TOTAL_STEPS TAG [SLEEP_S]. Trains Linear(8, 4) with SGD on a fixed dataset, the loop
an ordinary one, until ``accelerator.step`` (the committed step) reaches TOTAL_STEPS (0: the
number the test writes into OUT/target when it wants the run to end; none yet, go on). Writes
OUT/progress{G}.txt (the committed step, after each step) and, at the end,
OUT/group{G}_{TAG}.json (rank r > 0 of the group: ..._rank{r}.json): the committed step after
each step, the weights after each step (``trace``) and at each committed step (``by_step``), the
weights at the end, the samples it read, two numbers drawn from torch's generator after each
optimizer step (``draws``, by committed step: a healed group's are its peer's), and with fp16
whether each step was skipped and the scale.

Environment (the test's): FT_TEST_INIT_SYNC (0/1), FT_TEST_SEMI_SYNC ("local_sgd", "diloco"),
FT_TEST_SYNC_EVERY, FT_TEST_FRAGMENTS; FT_TEST_FP16=1 (mixed_precision="fp16") with
FT_TEST_INF_STEP=k: group 1 feeds an inf at its k-th step (1-based); FT_TEST_SAVE_AT=k:
``save_state(OUT/ckpt{G})`` once the committed step is k, after ``zero_grad``
(FT_TEST_SAVE_EARLY=1: before it; FT_TEST_SHARED=1: ``OUT/ckpt``, one folder for every group; a
process whose group writes it touches OUT/wrote{G}_{rank}, from a save pre-hook);
FT_TEST_RESUME=1: ``load_state`` of it first; FT_TEST_OFFSET=1: group 1 (unless it resumes) skips
its first batch and draws one number first, so that its position and generator differ from
group 0's; FT_TEST_HEAL_PAUSE=s: a heal writes OUT/healing{G} and takes s seconds more.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from hasten import Accelerator, FaultToleranceKwargs

out, total, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
group = int(os.environ["HASTEN_FT_REPLICA_GROUP"])
getenv = os.environ.get

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
index = torch.arange(64)
# its own generator: a new epoch draws its base seed from it, not from the global one (``draws``)
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(x, y, index), batch_size=4, generator=torch.Generator().manual_seed(2)
)

handler = FaultToleranceKwargs(
    min_replicas=1,
    init_sync=getenv("FT_TEST_INIT_SYNC", "1") == "1",
    semi_sync=getenv("FT_TEST_SEMI_SYNC") or None,  # accelerator.step then counts the syncs
    sync_every=int(getenv("FT_TEST_SYNC_EVERY", "4")),
    fragments=int(getenv("FT_TEST_FRAGMENTS", "1")),
)
fp16 = getenv("FT_TEST_FP16") == "1"
accelerator = Accelerator(mixed_precision="fp16" if fp16 else "no", kwargs_handlers=[handler])
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
checkpoint = os.path.join(out, "ckpt" if getenv("FT_TEST_SHARED") == "1" else f"ckpt{group}")
resume = getenv("FT_TEST_RESUME") == "1"
if resume:
    accelerator.load_state(checkpoint)
skip = group == 1 and getenv("FT_TEST_OFFSET") == "1" and not resume
if skip:
    torch.rand(1)


def wrote(models, weights, folder) -> None:
    open(os.path.join(out, f"wrote{group}_{accelerator.process_index}"), "w").close()


accelerator.register_save_state_pre_hook(wrote)
save_at = int(getenv("FT_TEST_SAVE_AT", "-1"))
early = getenv("FT_TEST_SAVE_EARLY") == "1"
inf_step = int(getenv("FT_TEST_INF_STEP", "0")) if group == 1 else 0

if getenv("FT_TEST_HEAL_PAUSE"):  # torchft 0.2.0 keeps the load functions by key ("hasten": the prepared objects)
    fns = accelerator._fault_tolerance.manager._load_state_dict_fns
    heal = fns["hasten"]

    def slow_heal(state: dict, heal=heal) -> None:
        open(os.path.join(out, f"healing{group}"), "w").close()
        time.sleep(float(getenv("FT_TEST_HEAL_PAUSE")))
        heal(state)

    fns["hasten"] = slow_heal


def weights() -> list[float]:
    inner = accelerator.unwrap_model(model)
    return torch.cat([inner.weight.detach().flatten(), inner.bias.detach().flatten()]).tolist()


def target() -> float:
    if total:
        return total
    try:
        with open(os.path.join(out, "target")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return float("inf")


steps, by_step, trace, seen, skipped, scales, draws = [], {}, [], [], [], [], {}
start = time.time()
while accelerator.step < target():
    for xb, yb, ib in loader:
        if skip:
            skip = False
            continue
        if inf_step and len(steps) + 1 == inf_step:
            xb = xb * float("inf")
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        draws[accelerator.step] = torch.rand(2).tolist()  # before zero_grad, where the next quorum starts
        if early and accelerator.step == save_at:  # no quorum started since the step
            accelerator.save_state(checkpoint)
            save_at = -1
        optimizer.zero_grad()
        steps.append(accelerator.step)
        trace.append(weights())
        by_step[accelerator.step] = trace[-1]
        seen.extend(ib.tolist())
        if fp16:
            skipped.append(accelerator.optimizer_step_was_skipped)
            scales.append(accelerator.scaler.get_scale())
        if accelerator.step == save_at:
            accelerator.save_state(checkpoint)
            save_at = -1
        if accelerator.is_main_process:
            with open(os.path.join(out, f"progress{group}.tmp"), "w") as f:
                f.write(str(accelerator.step))
            os.replace(os.path.join(out, f"progress{group}.tmp"), os.path.join(out, f"progress{group}.txt"))
        if pause:
            time.sleep(pause)
        if accelerator.step >= target():
            break

result = {
    "steps": steps, "by_step": by_step, "trace": trace, "final": weights(), "seen": seen, "skipped": skipped,
    "scales": scales, "draws": draws, "seconds": time.time() - start,
}  # fmt: skip
rank = f"_rank{accelerator.process_index}" if accelerator.process_index else ""
with open(os.path.join(out, f"group{group}_{tag}{rank}.json"), "w") as f:
    json.dump(result, f)
