"""The docs' pictures, drawn with matplotlib: ``python docs/pictures/make_pictures.py [OUT_DIR]``.

``make docs`` runs it (into this folder); ``tests/test_docs_pictures.py`` runs it into a temporary
folder and checks that the mesh picture's groups are those of the mesh hasten builds.

- ``device_mesh.png``: which ranks form each group of N-D parallelism on 16 processes. The groups
  are computed from hasten's own layout (``hasten.settings.parallelism``: its dim order
  ``MESH_DIMS``, the sizes of a ``ParallelismConfig``, the flattened dim FSDP shards over, and
  expert parallelism's ``EP_DIMS`` carved out of ``dp_shard``), laid out as torch's
  ``init_device_mesh`` lays out ranks (row-major, the last dim innermost).
- ``pipeline_schedules.png``: GPipe and 1F1B for 4 stages x 8 microbatches, in the order torch's
  schedules run them (the test compares it with torch's own schedule order), timed with a
  backward twice as long as a forward: the bubble and the activations each stage holds.
- ``checkpoint_flow.png``: the steps of ``save_state`` on a local disk and at an object-store URL.

The output is deterministic: fixed sizes and resolution, no software name or date in the PNGs.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
DPI = 100
#: what every PNG is saved with: nothing that changes from one build to the next
PNG_METADATA = {"Software": None}
#: the two meshes drawn, 16 processes each: a dense model on four dims, an MoE model in a pipeline
MESH_EXAMPLES = (
    ("dense model: dp_replicate 2 x dp_shard 2 x sp 2 x tp 2", {"dp_replicate_size": 2, "dp_shard_size": 2,
                                                               "sp_size": 2, "tp_size": 2}),
    ("MoE model: pp 2 x dp_shard 4 (efsdp 2 x ep 2) x tp 2", {"pp_size": 2, "dp_shard_size": 4, "tp_size": 2,
                                                             "ep_size": 2}),
)  # fmt: skip
STAGES, MICROBATCHES = 4, 8
FORWARD_TIME, BACKWARD_TIME = 1, 2


# --------------------------------------------------------------------------- the device mesh
def parallelism_config(**sizes: int):
    """A ``ParallelismConfig`` with every size given (1 where not in ``sizes``), so that no
    ``PARALLELISM_CONFIG_*`` variable of the environment changes the picture."""
    from hasten.settings.parallelism import ParallelismConfig

    every = {f"{d}_size": 1 for d in ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp", "ep")}
    every.update(sizes)
    return ParallelismConfig(**every)


def mesh_groups(config) -> dict[str, list[list[int]]]:
    """``{dim: groups}``, each group the global ranks of one process group of that dim, in rank
    order, for every dim of ``config`` above 1: the mesh dims, ``dp_shard_cp`` (what FSDP shards
    over, where it is more than ``dp_shard``) and, with ``ep_size > 1``, ``efsdp`` and ``ep``."""
    import torch

    from hasten.settings.parallelism import EP_DIMS, MESH_DIMS

    sizes = config.sizes()
    shape = [sizes[d] for d in MESH_DIMS]
    ranks = torch.arange(math.prod(shape)).reshape(shape)  # init_device_mesh's layout
    found = {d: _groups(ranks, list(MESH_DIMS), [d]) for d in MESH_DIMS if sizes[d] > 1}
    shard = config.dp_shard_cp_dim_names
    if len(shard) > 1:
        found["dp_shard_cp"] = _groups(ranks, list(MESH_DIMS), shard)
    if config.ep_size > 1:  # dp_shard unflattened into (efsdp, ep), ep innermost (build_device_mesh)
        at = MESH_DIMS.index("dp_shard")
        names = [*MESH_DIMS[:at], *EP_DIMS, *MESH_DIMS[at + 1 :]]
        split = ranks.reshape(*shape[:at], config.dp_shard_size // config.ep_size, config.ep_size, *shape[at + 1 :])
        for dim in EP_DIMS:
            found[dim] = _groups(split, names, [dim])
    return found


def _groups(ranks, names: list[str], dims: list[str]) -> list[list[int]]:
    """The rank groups along ``dims`` (together, in their order) of the rank tensor ``ranks``."""
    at = [names.index(d) for d in dims]
    rest = [i for i in range(ranks.dim()) if i not in at]
    size = math.prod(ranks.shape[i] for i in at)
    rows = ranks.permute(*rest, *at).reshape(-1, size).tolist()
    return sorted(rows)


def draw_mesh(out: Path) -> Path:
    rows = [(title, mesh_groups(parallelism_config(**sizes))) for title, sizes in MESH_EXAMPLES]
    columns = max(len(groups) for _, groups in rows)
    fig = plt.figure(figsize=(3.0 * columns, 4.0 * len(rows)), dpi=DPI, layout="constrained")
    fig.suptitle("The device mesh on 16 processes: one colour per process group", fontsize=15)
    for sub, (title, groups) in zip(fig.subfigures(len(rows), 1), rows):
        sub.suptitle(title, fontsize=12.5, fontweight="bold")
        axes = sub.subplots(1, columns)
        for ax, (dim, members) in zip(axes, groups.items()):
            _draw_groups(ax, dim, members)
        for ax in axes[len(groups) :]:
            ax.axis("off")
    return _save(fig, out / "device_mesh.png")


def _draw_groups(ax, dim: str, members: list[list[int]]) -> None:
    """The ranks on a square grid, rank 0 top left, coloured by their group of ``dim``."""
    from matplotlib import colormaps

    colours = colormaps["tab20"].colors
    group_of = {rank: i for i, group in enumerate(members) for rank in group}
    world = len(group_of)
    side = math.ceil(math.sqrt(world))
    for rank in range(world):
        y, x = divmod(rank, side)
        g = group_of[rank]
        ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, facecolor=colours[(2 * g) % 20 + (g // 10) % 2],
                               edgecolor="black", linewidth=0.6))  # fmt: skip
        ax.text(x + 0.5, y + 0.5, str(rank), ha="center", va="center", fontsize=11, color="white", fontweight="bold")
    ax.set_xlim(0, side)
    ax.set_ylim(side, 0)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(f"{dim}: {len(members)} groups of {len(members[0])}", fontsize=11.5)
    ax.set_xlabel(f"rank 0's group: {members[0]}", fontsize=9.5)


# --------------------------------------------------------------------------- pipeline schedules
def schedule_order(schedule: str, stages: int = STAGES, microbatches: int = MICROBATCHES) -> list[list[str]]:
    """Each stage's actions in the order it runs them (``"F3"``: forward of microbatch 3,
    ``"B3"`` its backward), as torch's ``ScheduleGPipe`` and ``Schedule1F1B`` run them."""
    if schedule == "GPipe":
        return [[f"F{m}" for m in range(microbatches)] + [f"B{m}" for m in range(microbatches)] for _ in range(stages)]
    if schedule != "1F1B":
        raise ValueError(f"schedule_order: schedule must be 'GPipe' or '1F1B', got {schedule!r}")
    orders = []
    for stage in range(stages):
        warmup = min(stages - stage, microbatches)  # forwards before the first backward (1 on the last stage)
        actions = [f"F{m}" for m in range(warmup)]
        for m in range(microbatches - warmup):  # steady state: one backward, one forward
            actions += [f"B{m}", f"F{warmup + m}"]
        actions += [f"B{m}" for m in range(microbatches - warmup, microbatches)]
        orders.append(actions)
    return orders


def simulate(orders: list[list[str]]) -> list[list[tuple[str, int, int]]]:
    """``(action, start, end)`` per stage: each action starts when its stage is free and its
    input is there (a forward after the previous stage's, a backward after the next stage's and
    its own forward)."""
    done: dict[tuple[int, str], int] = {}
    timeline: list[list[tuple[str, int, int]]] = [[] for _ in orders]
    position, free = [0] * len(orders), [0] * len(orders)
    last = len(orders) - 1
    while any(p < len(o) for p, o in zip(position, orders)):
        moved = False
        for stage, order in enumerate(orders):
            if position[stage] == len(order):
                continue
            action = order[position[stage]]
            kind, mb = action[0], action[1:]
            needs = [(stage - 1, action)] if kind == "F" and stage else []
            if kind == "B":
                needs = [(stage, f"F{mb}")] + ([(stage + 1, action)] if stage < last else [])
            if all(n in done for n in needs):
                start = max([free[stage], *(done[n] for n in needs)])
                end = start + (FORWARD_TIME if kind == "F" else BACKWARD_TIME)
                timeline[stage].append((action, start, end))
                done[(stage, action)], free[stage] = end, end
                position[stage] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"simulate: the schedule deadlocks at {position}")
    return timeline


def held_activations(order: list[str]) -> int:
    """The most microbatches whose activations a stage holds at once (forward run, backward not)."""
    held = peak = 0
    for action in order:
        held += 1 if action[0] == "F" else -1
        peak = max(peak, held)
    return peak


def draw_pipeline(out: Path) -> Path:
    from matplotlib import colormaps

    shades = colormaps["tab10"].colors
    fig, axes = plt.subplots(2, 1, figsize=(13, 6.4), dpi=DPI)
    for ax, schedule in zip(axes, ("GPipe", "1F1B")):
        orders = schedule_order(schedule)
        timeline = simulate(orders)
        span = max(end for stage in timeline for _, _, end in stage)
        busy = sum(end - start for stage in timeline for _, start, end in stage)
        ax.add_patch(Rectangle((0, -0.5), span, STAGES, facecolor="#eeeeee", hatch="//", edgecolor="#cccccc"))
        for stage, actions in enumerate(timeline):
            for action, start, end in actions:
                colour = shades[0] if action[0] == "F" else shades[1]
                ax.add_patch(Rectangle((start, stage - 0.4), end - start, 0.8, facecolor=colour, edgecolor="white"))
                ax.text((start + end) / 2, stage, action, ha="center", va="center", fontsize=8, color="white")
            ax.text(span + 0.4, stage, f"holds {held_activations(orders[stage])}", va="center", fontsize=9)
        bubble = 1 - busy / (span * STAGES)
        ax.set_title(
            f"{schedule}: {STAGES} stages x {MICROBATCHES} microbatches, {span} time units, "
            f"bubble (hatched) {bubble:.0%} of the stages' time",
            fontsize=11,
            loc="left",
        )
        ax.set_xlim(0, span + 4)
        ax.set_ylim(STAGES - 0.5, -0.5)
        ax.set_yticks(range(STAGES), [f"stage {s}" for s in range(STAGES)])
        ax.set_xticks(range(0, span + 1, 3))
        ax.tick_params(labelsize=9)
    axes[1].set_xlabel(
        f"time (a forward F takes {FORWARD_TIME} unit, a backward B {BACKWARD_TIME}); "
        "'holds N': the most microbatches whose activations the stage keeps at once",
        fontsize=9,
    )
    fig.tight_layout()
    return _save(fig, out / "pipeline_schedules.png")


# --------------------------------------------------------------------------- the checkpoint flow
EVERY, MAIN = "#4c78a8", "#e45756"  # who runs a step: every process, the main process
DISK_STEPS = (
    (MAIN, "begin", "hold the folder;\nclean what crashed\nsaves left; make\n.NAME.tmp-TOKEN/"),
    (EVERY, "plan", "pre-hooks, state\ndicts: all that can\nfail, before a byte\nis written"),
    (EVERY, "write", "each process writes\nits files into the\ntemporary folder,\nfsync"),
    (EVERY, "checksums", "each reports its\nfiles' sizes and\nXXH3-128 checksums\n(hashed as written)"),
    (MAIN, "manifest", "check every file;\nwrite the manifest\nhasten_checkpoint.json;\nfsync the folder"),
    (MAIN, "commit", "rename into NAME\n(the previous copy\naside, then removed);\nrotate total_limit"),
)
URL_STEPS = (
    (MAIN, "begin", "remove what\ninterrupted saves left;\nmark the folder\n(no lock, no rename)"),
    (EVERY, "plan", "pre-hooks, state\ndicts; every process\nmust finish planning\nbefore anything goes"),
    (MAIN, "replace", "only now delete the\nprevious copy: its\nmanifest first, then\nits files"),
    (EVERY, "upload", "each process writes\nits files straight\ninto NAME/, hashing\nthem as it writes"),
    (MAIN, "manifest", "check every file in\none listing; write\nthe manifest last:\nnow it is a checkpoint"),
    (MAIN, "commit", "delete the mark;\nrotate total_limit"),
)


def _flow(ax, steps, y: float, lane: str, note: str) -> None:
    width, gap = 2.05, 0.45
    ax.text(-0.2, y + 1.55, lane, fontsize=12, fontweight="bold")
    for i, (colour, name, text) in enumerate(steps):
        x = i * (width + gap)
        ax.add_patch(FancyBboxPatch((x, y), width, 1.3, boxstyle="round,pad=0.04", facecolor="white",
                                    edgecolor=colour, linewidth=2))  # fmt: skip
        ax.text(x + width / 2, y + 1.17, f"{i + 1}. {name}", ha="center", va="center", fontsize=10,
                fontweight="bold", color=colour)  # fmt: skip
        ax.text(x + width / 2, y + 0.52, text, ha="center", va="center", fontsize=8.2, linespacing=1.25)
        if i:
            ax.add_patch(FancyArrowPatch((x - gap + 0.03, y + 0.65), (x - 0.03, y + 0.65), arrowstyle="-|>",
                                         mutation_scale=14, color="#444444"))  # fmt: skip
    ax.text(-0.2, y - 0.32, note, fontsize=8.6, va="center", style="italic")


def draw_checkpoint_flow(out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(15, 5.6), dpi=DPI)
    _flow(ax, DISK_STEPS, 2.75, "Local disk (or a shared filesystem): write aside, then rename",
          "A crash before step 6 leaves the previous checkpoint whole and a hidden temporary folder "
          "without a manifest, which load_state never reads (the next save removes it).")  # fmt: skip
    _flow(ax, URL_STEPS, 0.0, "Object store (s3://, gs://, az://: any fsspec URL): no rename, the manifest last",
          "A failure before step 3 keeps the previous copy; from step 3 on it is gone, and a folder "
          "without its manifest is never loaded (the next save removes it).")  # fmt: skip
    for colour, who, x in ((EVERY, "every process", 9.6), (MAIN, "the main process", 12.1)):
        ax.add_patch(Rectangle((x, 4.75), 0.3, 0.22, facecolor="white", edgecolor=colour, linewidth=2))
        ax.text(x + 0.4, 4.86, who, va="center", fontsize=9)
    ax.set_xlim(-0.3, 6 * 2.5 - 0.3)
    ax.set_ylim(-0.6, 5.1)
    ax.axis("off")
    ax.set_title("save_state, step by step", fontsize=14, loc="left")
    fig.tight_layout()
    return _save(fig, out / "checkpoint_flow.png")


# --------------------------------------------------------------------------- all three
def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, metadata=PNG_METADATA)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        raise SystemExit("usage: make_pictures.py [OUT_DIR]  (default: the folder of this script)")
    out = Path(args[0]) if args else HERE
    out.mkdir(parents=True, exist_ok=True)
    plt.rcParams.update({"font.family": "DejaVu Sans", "svg.hashsalt": "hasten", "path.simplify": True})
    made = [draw_mesh(out), draw_pipeline(out), draw_checkpoint_flow(out)]
    for path in made:
        print(f"wrote {path}")
    return made


if __name__ == "__main__":
    main()
