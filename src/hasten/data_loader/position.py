"""The position of a prepared dataloader in its epoch, as a checkpoint holds it: checked before
anything is loaded, and carried to another number of processes or another batch size.

``core.PreparedDataLoader.load_state_dict`` and the checkpoint layouts ask these functions; they
read the loader through its small private interface (``_num_processes``, ``_batch_size``,
``_generators``, ``shard_sampler``, ``split_batches``, ``_main_process_reads``).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler


def _needs_global_resume(loader: Any, state: dict[str, Any]) -> bool:
    """Whether ``state`` must be resumed from its global position: it was saved at another number
    of processes, or its epoch already started at a global offset (an earlier resize)."""
    if "global_batches" not in state:
        return False
    saved_n = state.get("num_processes")
    if saved_n != loader._num_processes():
        return True
    if not state.get("in_epoch"):
        return False
    # another batch size (or batch kind) at the same number of processes: counted in samples
    other_batches = state.get("batch_size") != loader._batch_size() or bool(state.get("split_batches")) != bool(
        loader.split_batches
    )
    return other_batches or bool(state.get("global_offset"))


def check_global_resume(loader: Any, state: dict[str, Any], where: str) -> None:
    """Raise unless ``loader`` can continue ``state``'s epoch from its global position; change nothing."""
    saved_n = state.get("num_processes")
    if "global_batches" not in state:
        if state.get("batches_yielded"):
            raise ValueError(
                f"{where}: this dataloader position was saved by a hasten without global positions; it can "
                "resume in the middle of an epoch with the same number of processes only"
            )
        return
    if not state.get("in_epoch"):
        return
    if loader.shard_sampler is None and not loader._main_process_reads:
        raise ValueError(
            f"{where}: the position of a dataloader over an iterable dataset, saved by {saved_n} process(es) in "
            f"the middle of epoch {state['epoch']}, cannot be carried to {loader._num_processes()} process(es) "
            f"with batch_size={loader._batch_size()} (saved with {state.get('batch_size')}; each process read its "
            "own share of the stream); resume with the same number of processes and batch_size, save at "
            "the end of an epoch, or prepare the loader with dispatch_batches=True (one process reads the stream)"
        )
    done = global_position(loader, state, where)
    if loader.shard_sampler is None:
        return  # a stream: its length is not known before it is read
    total = len(loader.shard_sampler.batch_sampler)
    if not 0 <= done <= total:
        raise ValueError(
            f"{where}: the dataloader position's 'global_batches' must be in [0, {total}] (the batches of the "
            f"epoch), got {done}"
        )


def global_position(loader: Any, state: dict[str, Any], where: str) -> int:
    """The saved position in batches of ``loader``'s original batch sampler (or stream).

    The same batch size: the saved count. Another one (a job resized keeping its global batch, e.g.
    2 processes x 2 saved, 1 x 4 loaded, or another ``split_batches``): the position in samples,
    ``global_batches x batch_size``, in this loader's batches. Both group one order of samples into
    consecutive batches (torch's ``BatchSampler``, a stream's automatic batching), so the rest of the
    epoch is exactly what this loader yields after that many samples. Refused, saying why, where a
    batch is not a count of samples (a batch sampler without ``batch_size``, or one whose batches
    are not consecutive runs of its sampler's order) or the position falls inside a batch."""
    done, saved = int(state["global_batches"]), state.get("batch_size")
    size = loader._batch_size()
    if saved == size:
        return done
    cut = (
        f"{where}: the dataloader's batch_size was {saved} when saved "
        f"(split_batches={bool(state.get('split_batches'))}, {state.get('num_processes')} process(es)) and is {size} "
        f"now (split_batches={loader.split_batches}); its position in the middle of epoch {state['epoch']}"
    )
    if saved is None or size is None:
        raise ValueError(
            f"{cut} cannot be counted in samples (a batch sampler without batch_size): resume with the same "
            "batch sampler, or save at the end of an epoch"
        )
    original = getattr(loader.shard_sampler, "batch_sampler", None)
    if loader.shard_sampler is not None and type(original) is not BatchSampler:
        raise ValueError(
            f"{cut} cannot be counted in samples: the batch sampler {type(original).__name__} may group its "
            "sampler's order otherwise at another batch_size (only torch's BatchSampler is known to cut it in "
            "consecutive batches); resume with the same batch_size, or save at the end of an epoch"
        )
    samples = done * saved
    if samples % size:
        raise ValueError(
            f"{cut}, after {samples} samples, falls inside a batch of {size}: resume with a batch_size that "
            f"divides {samples} (keeping the global batch), or save at the end of an epoch"
        )
    return samples // size


def check_loader_state(loader: Any, state: Any, where: str, resized: bool = False) -> None:
    """Raise unless ``loader.load_state_dict(state)`` would take ``state``; change nothing.

    ``resized``: saved at another number of processes (the generators may then differ in number)."""
    if not isinstance(state, dict):
        raise ValueError(f"{where}: a dataloader position must be a dict, got {type(state).__name__}")
    for key in ("epoch", "batches_yielded", "next_epoch"):
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: the dataloader position's {key!r} must be an integer >= 0, got {value!r}")
    seed = state.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError(f"{where}: the dataloader position's 'seed' must be an integer or None, got {seed!r}")
    rng = state.get("rng") or {}
    if not isinstance(rng, dict):
        raise ValueError(f"{where}: the dataloader position's 'rng' must be a dict, got {type(rng).__name__}")
    for key in ("global_batches", "global_offset", "num_processes"):
        value = state.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: the dataloader position's {key!r} must be an integer >= 0, got {value!r}")
    if resized or _needs_global_resume(loader, state):
        check_global_resume(loader, state, where)
        return
    generators = rng.get("generators")
    if generators is not None and len(generators) != len(loader._generators()):
        raise ValueError(
            f"{where}: the saved dataloader state holds {len(generators)} generator state(s) but this dataloader "
            f"has {len(loader._generators())} generator(s) of its own (DataLoader(generator=...), its sampler's "
            "generator): prepare the same dataloader as the run that saved it"
        )
