"""Checkpoints: ``save_state``/``load_state`` (exact resume), ``save_model`` and ``save``.

A ``save_state`` directory holds::

    model_0.safetensors      unwrapped weights of each prepared model (model_0.bin with
                             safe_serialization=False)
    optimizer_0.pt           state_dict of each prepared optimizer
    scheduler_0.pt           state_dict of each prepared LR scheduler
    custom_0.pt              state_dict of each object given to register_for_checkpointing
    scaler.pt                the fp16 GradScaler (scale, growth tracker), when there is one
    loop_state.json          step counters: accelerator.step, accumulation micro-step, and
                             each optimizer's real/sync step counts
    rank_0.pt ... rank_N.pt  per process: RNG states (Python, NumPy, torch CPU, every CUDA
                             device) and the position of every prepared dataloader
    hasten_checkpoint.json   the manifest, written last: versions, world size, counts, the
                             model's tensor names and shapes, each file's size and SHA-256

Writing is atomic: every process writes its files into a temporary directory next to the
target (``.NAME.tmp-TOKEN``), each file is fsynced; after all processes report, the main
process checks the files, writes the manifest, fsyncs and renames the directory into
place. A crash leaves the previous checkpoint intact and at most a hidden temporary
directory without a manifest, which ``load_state`` refuses. The directory must be on a
filesystem that every process sees (the main process checks that it sees every file).

``load_state`` first reads and checks everything on every process (manifest, world size,
file sizes and checksums, object counts, tensor names and shapes, optimizer groups, scaler)
and only then restores anything, so a bad checkpoint is an error before any object changed.

Pre-hooks (``register_save_state_pre_hook``/``register_load_state_pre_hook``) run on every
process: ``hook(models, weights, output_dir)`` before anything is written, with the
temporary directory (what a hook writes there lands in the checkpoint atomically) and the
unwrapped state dicts, of which only those left in ``weights`` are saved;
``hook(models, input_dir)`` before anything is read, and only the models left in
``models`` are restored from the checkpoint's weights (a hook that loads a model itself
removes it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from . import _validate as v
from . import ops
from .rng import capture_rng_state, restore_rng_state

if TYPE_CHECKING:  # pragma: no cover
    from .accelerator import Accelerator
    from .state import PartialState

MANIFEST = "hasten_checkpoint.json"
FORMAT = "hasten-checkpoint"
FORMAT_VERSION = 1
LOOP_STATE = "loop_state.json"
SCALER = "scaler.pt"
CHECKPOINTS = "checkpoints"
_ITERATION = re.compile(r"checkpoint_(\d+)")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class CheckpointInfo:
    """The checkpoint last saved or loaded by an Accelerator (``accelerator.checkpoint_state``)."""

    directory: str
    iteration: int | None  # N of an automatically named checkpoint_N, else None


# ---------------------------------------------------------------------- small file helpers


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write(path: str, write: Callable[[Any], None]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: str, obj: Any) -> None:
    _write(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def _record(path: str, checksum: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"size": os.path.getsize(path)}
    if checksum:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        out["sha256"] = h.hexdigest()
    return out


def _replace_file(path: str, write: Callable[[Any], None]) -> None:
    """Write ``path`` atomically: a temporary file in the same directory, fsync, rename."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{secrets.token_hex(6)}")
    try:
        _write(tmp, write)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(directory or ".")


def _require_safetensors(what: str) -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            f"{what} writes/reads safetensors files, which needs the 'safetensors' package: "
            "pip install 'hasten[checkpoint]' (or pass safe_serialization=False for torch .bin files)"
        ) from None
    return safetensors.torch


def _check_path(owner: str, field: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{owner}.{field} must be a path (str or os.PathLike), got {value!r} ({type(value).__name__})")
    return os.path.abspath(os.fspath(value))


def parse_size(value: int | str, field: str = "max_shard_size") -> int:
    """Bytes from an int or a string such as ``"10GB"``, ``"500MB"`` or ``"2GiB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return v.check_number("save_model", field, value, integer=True, ge=1)
    match = _SIZE.match(value) if isinstance(value, str) else None
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"save_model.{field} must be a positive number of bytes or a string like '10GB', '500MB' or '2GiB', "
            f"got {value!r}"
        )
    return max(1, int(float(match.group(1)) * _UNITS[unit]))


# ---------------------------------------------------------------------- model tensors


def _flat_tensors(state_dict: dict[str, Any], where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors can store (contiguous, no shared storage) and the tied names.

    A name whose tensor is the very same view as an earlier one (tied weights) is stored
    once and listed in ``aliases`` (name -> stored name); other views of a shared storage
    are copied.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[tuple[int, str]] = set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{where}: state_dict entry {name!r} is a {type(t).__name__}, not a tensor; safetensors stores "
                "tensors only (pass safe_serialization=False)"
            )
        t = t.detach()
        if t.numel():
            ptr = (t.untyped_storage().data_ptr(), str(t.device))
            key = (*ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in views:
                aliases[name] = views[key]
                continue
            views[key] = name
            if ptr in storages or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
            storages.add(ptr)
        tensors[name] = t.cpu()
    return tensors, aliases


def _tensor_table(state_dict: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        k: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        for k, t in state_dict.items()
        if isinstance(t, torch.Tensor)
    }


def _write_weights(path: str, state_dict: dict[str, Any], safe: bool, where: str) -> None:
    if safe:
        st = _require_safetensors(where)
        tensors, aliases = _flat_tensors(state_dict, where)
        metadata = {"format": "pt", "hasten_aliases": json.dumps(aliases)}
        _write(path, lambda f: f.write(st.save(tensors, metadata=metadata)))
    else:
        _write(path, lambda f: torch.save(state_dict, f))


def _read_weights(path: str, weights_only: bool = True) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        st = _require_safetensors("loading model weights")
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = st.load_file(path, device="cpu")
        for name, target in json.loads(metadata.get("hasten_aliases", "{}")).items():
            tensors[name] = tensors[target]
        return tensors
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def _compare_tensors(expected: dict[str, dict[str, Any]], model_sd: dict[str, Any], where: str) -> None:
    """A clear error when the model's tensor names or shapes differ from the checkpoint's."""
    current = _tensor_table(model_sd)
    missing = [k for k in current if k not in expected]
    unexpected = [k for k in expected if k not in current]
    shapes = [
        f"{k}: checkpoint {expected[k]['shape']} vs model {current[k]['shape']}"
        for k in current
        if k in expected and expected[k]["shape"] != current[k]["shape"]
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"not in the model: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append(f"different shapes: {'; '.join(shapes[:5])}{' ...' if len(shapes) > 5 else ''}")
        raise ValueError(f"{where} does not fit the prepared model: " + " | ".join(parts))


# ---------------------------------------------------------------------- save_model / save


def save_model(
    accelerator: Accelerator,
    model: torch.nn.Module,
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[str]:
    """Write the unwrapped weights of ``model`` (main process only; with ``save_on_each_node`` each
    machine's local main process), sharded above ``max_shard_size``.

    One shard is ``model.safetensors``; more are ``model-00001-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (Hugging Face's layout; ``pytorch_model*.bin`` without
    safetensors). Each file is replaced atomically and the index is written last; shards of
    an earlier save in that layout that are no longer used are removed. Returns the paths.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"save_model.model must be a torch.nn.Module, got {type(model).__name__}")
    directory = _check_path("save_model", "save_directory", save_directory)
    limit = parse_size(max_shard_size)
    v.check_bool("save_model", "safe_serialization", safe_serialization)
    if os.path.isfile(directory):
        raise ValueError(f"save_model.save_directory must be a directory, got the file {directory!r}")
    if not _writes_here(accelerator):
        return []
    state_dict = accelerator.unwrap_model(model).state_dict()
    if safe_serialization:
        st = _require_safetensors("save_model")
        tensors, aliases = _flat_tensors(state_dict, "save_model")
    else:
        tensors, aliases = {k: t.detach().cpu() for k, t in state_dict.items()}, {}
    stem, ext = ("model", ".safetensors") if safe_serialization else ("pytorch_model", ".bin")

    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    count = len(shards)
    names = [f"{stem}{ext}"] if count == 1 else [f"{stem}-{i + 1:05d}-of-{count:05d}{ext}" for i in range(count)]

    os.makedirs(directory, exist_ok=True)
    paths = []
    for file_name, keys in zip(names, shards):
        part = {k: tensors[k] for k in keys}
        path = os.path.join(directory, file_name)
        if safe_serialization:
            metadata = {"format": "pt", "hasten_aliases": json.dumps({a: t for a, t in aliases.items() if t in part})}
            _replace_file(path, lambda f, part=part, metadata=metadata: f.write(st.save(part, metadata=metadata)))
        else:
            _replace_file(path, lambda f, part=part: torch.save(part, f))
        paths.append(path)
    index = os.path.join(directory, f"{stem}{ext}.index.json")
    if count > 1:
        weight_map = {k: names[i] for i, keys in enumerate(shards) for k in keys}
        weight_map.update({a: weight_map[t] for a, t in aliases.items()})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        body = {"metadata": {"total_size": total, "hasten_aliases": aliases}, "weight_map": weight_map}
        _replace_file(index, lambda f: f.write(json.dumps(body, indent=1, sort_keys=True).encode()))
        paths.append(index)
    # Remove what an earlier save in this layout left behind (old shard counts, a stale index).
    stale = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(ext)}(\.index\.json)?$")
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if stale.fullmatch(entry) and path not in paths:
            os.remove(path)
    return paths


def load_model(model: torch.nn.Module, directory: str | os.PathLike, weights_only: bool = True) -> None:
    """Load what ``save_model`` wrote into ``model`` (strict: names and shapes must match)."""
    directory = _check_path("load_model", "directory", directory)
    for stem, ext in (("model", ".safetensors"), ("pytorch_model", ".bin")):
        single = os.path.join(directory, f"{stem}{ext}")
        index = single + ".index.json"
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            state: dict[str, torch.Tensor] = {}
            for file_name in sorted(set(weight_map.values())):
                state.update(_read_weights(os.path.join(directory, file_name), weights_only))
            break
        if os.path.exists(single):
            state = _read_weights(single, weights_only)
            break
    else:
        raise FileNotFoundError(f"load_model: no model.safetensors, pytorch_model.bin or index in {directory!r}")
    target = model.module if hasattr(model, "module") and isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    _compare_tensors(_tensor_table(state), target.state_dict(), f"the weights in {directory!r}")
    target.load_state_dict(state)


def save(accelerator: Accelerator, obj: Any, f: Any, safe_serialization: bool = False) -> None:
    """``torch.save(obj, f)`` on the main process only (each machine's local main process with
    ``ProjectConfiguration(save_on_each_node=True)``); a path is replaced atomically.

    With ``safe_serialization`` ``obj`` must be a dict of tensors, written as safetensors.
    """
    v.check_bool("save", "safe_serialization", safe_serialization)
    if not _writes_here(accelerator):
        return
    if safe_serialization:
        st = _require_safetensors("save(safe_serialization=True)")
        if not isinstance(obj, dict):
            raise TypeError(f"save(safe_serialization=True) takes a dict of tensors, got {type(obj).__name__}")
        tensors, aliases = _flat_tensors(obj, "save")
        write: Callable[[Any], None] = lambda fh: fh.write(  # noqa: E731
            st.save(tensors, metadata={"format": "pt", "hasten_aliases": json.dumps(aliases)})
        )
    else:
        write = lambda fh: torch.save(obj, fh)  # noqa: E731
    if isinstance(f, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(f))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _replace_file(path, write)
    elif hasattr(f, "write"):
        write(f)
    else:
        raise TypeError(f"save.f must be a path or a writable file object, got {f!r} ({type(f).__name__})")


def check_registrable(objects: Iterable[Any]) -> list[Any]:
    """The objects, if each has ``state_dict`` and ``load_state_dict`` methods; else TypeError."""
    objects = list(objects)
    bad = [
        f"#{i} ({type(o).__name__})"
        for i, o in enumerate(objects)
        if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))
    ]
    if bad:
        raise TypeError(
            f"register_for_checkpointing() takes objects with state_dict() and load_state_dict() methods; "
            f"these have not: {', '.join(bad)}"
        )
    return objects


def register_hook(hooks: dict[int, Callable[..., None]], hook: Any, call: str) -> RemovableHandle:
    """Add ``hook`` to ``hooks`` (run in insertion order); ``handle.remove()`` takes it out."""
    v.check_callable(call, "hook", hook, optional=False)
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


# ---------------------------------------------------------------------- agreement across ranks


def _agree(state: PartialState, what: str, fn: Callable[[], Any], share: bool = False) -> Any:
    """Run ``fn`` on every process; if it failed anywhere, fail everywhere (no process hangs).

    Returns the local result, or every process's result with ``share``.
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported to every process below
        error = e
    message = None if error is None else f"{type(error).__name__}: {error}"
    reports = ops.gather_object([(state.process_index, message, result if share else None)])
    if error is not None:
        raise error
    failed = [(r, m) for r, m, _ in reports if m is not None]
    if failed:
        r, m = failed[0]
        raise RuntimeError(f"{what} failed on process {r}: {m}")
    return [res for _, _, res in reports] if share else result


def _from_main(state: PartialState, value: Any) -> Any:
    return ops.broadcast_object_list([value if state.is_main_process else None])[0]


# ---------------------------------------------------------------------- naming


def _checkpoints_root(accelerator: Accelerator, call: str) -> str:
    if accelerator.project_dir is None:
        raise ValueError(
            f"{call}() without a directory uses automatic naming under Accelerator(project_dir=...) "
            "(or ProjectConfiguration(project_dir=...)), but project_dir is None: pass a directory or set project_dir"
        )
    return os.path.join(os.path.abspath(accelerator.project_dir), CHECKPOINTS)


def _writes_here(accelerator: Accelerator) -> bool:
    """Whether this process writes the files of ``save``/``save_model`` (one per machine with save_on_each_node)."""
    if accelerator.project_configuration.save_on_each_node:
        return accelerator.is_local_main_process
    return accelerator.is_main_process


def _check_single_node(accelerator: Accelerator, call: str) -> None:
    state = accelerator.state
    if accelerator.project_configuration.save_on_each_node and state.num_processes > state.num_local_processes:
        raise ValueError(
            f"{call}() with ProjectConfiguration(save_on_each_node=True) on {state.num_processes // state.num_local_processes} "
            "machines is not supported: hasten's checkpoints are written atomically into one directory that every "
            "process sees (a shared filesystem); set save_on_each_node=False (save() and save_model() do honour it)"
        )


def _iterations(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    found = (_ITERATION.fullmatch(e) for e in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def _remove_tree(path: str) -> None:
    """Rename aside (so a crash never leaves a half-deleted checkpoint at its name), then delete."""
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f".{name}.del-{secrets.token_hex(6)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# ---------------------------------------------------------------------- save_state


def save_state(
    accelerator: Accelerator,
    output_dir: str | os.PathLike | None = None,
    *,
    total_limit: int | None = None,
    safe_serialization: bool = True,
) -> str:
    """Save everything needed to resume training exactly; returns the checkpoint directory.

    Without ``output_dir`` (or always, with ``ProjectConfiguration(automatic_checkpoint_naming=True)``)
    the checkpoint is ``project_dir/checkpoints/checkpoint_N`` with N the larger of one more than the
    largest existing and ``ProjectConfiguration.iteration``; ``total_limit`` (else the
    configuration's) then keeps only the newest N checkpoints there (the one just written is never
    deleted). ``iteration`` counts up after each save. Call it on every process.
    """
    state = accelerator.state
    main = state.is_main_process
    config = accelerator.project_configuration
    if total_limit is not None:
        v.check_number("save_state", "total_limit", total_limit, integer=True, ge=1)
    v.check_bool("save_state", "safe_serialization", safe_serialization)
    if safe_serialization:
        _require_safetensors("save_state(safe_serialization=True)")
    _check_single_node(accelerator, "save_state")
    if output_dir is not None and config.automatic_checkpoint_naming:
        warnings.warn(
            f"save_state(output_dir={output_dir!r}) is ignored: ProjectConfiguration(automatic_checkpoint_naming=True) "
            "names the checkpoint project_dir/checkpoints/checkpoint_N",
            stacklevel=3,
        )
        output_dir = None
    if output_dir is None:
        root = _checkpoints_root(accelerator, "save_state")
        next_free = (_iterations(root)[-1:] or [-1])[0] + 1 if main else None
        iteration = max(config.iteration, _from_main(state, next_free))
        target = os.path.join(root, f"checkpoint_{iteration}")
        total_limit = total_limit if total_limit is not None else config.total_limit
    else:
        if total_limit is not None:
            raise ValueError(
                "save_state.total_limit applies to automatically named checkpoints (output_dir=None), "
                f"got total_limit={total_limit} with output_dir={output_dir!r}"
            )
        target = _check_path("save_state", "output_dir", output_dir)
        iteration = None
    if accelerator.gradient_state.micro_step:
        warnings.warn(
            f"save_state() in the middle of a gradient accumulation cycle (micro-step "
            f"{accelerator.gradient_state.micro_step} of {accelerator.gradient_state.num_steps}): the gradients "
            "accumulated so far are not saved; save after a step where accelerator.sync_gradients is True",
            stacklevel=3,
        )
    parent, name = os.path.split(target)
    tmp = os.path.join(parent, f".{name}.tmp-{_from_main(state, secrets.token_hex(6))}")

    def make_tmp() -> None:
        if not main:
            return
        if os.path.exists(target) and not os.path.isdir(target):
            raise ValueError(f"save_state: {target!r} exists and is not a directory")
        if os.path.isdir(target) and os.listdir(target) and not os.path.exists(os.path.join(target, MANIFEST)):
            raise ValueError(
                f"save_state: {target!r} exists, is not empty and is not a hasten checkpoint; "
                "refusing to replace it (choose another directory)"
            )
        os.makedirs(parent, exist_ok=True)
        for entry in os.listdir(parent):  # temporary directories of crashed saves of this name
            if entry.startswith(f".{name}.tmp-"):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        os.mkdir(tmp)

    def write_files() -> tuple[dict[str, Any], dict[str, Any]]:
        written: dict[str, str] = {}
        info: dict[str, Any] = {}
        # Pre-hooks see the directory being written: what they put there is renamed into place with the rest.
        models = list(accelerator._models)
        weights = [accelerator.unwrap_model(m).state_dict() for m in models]
        for hook in accelerator._save_model_state_pre_hook.values():
            hook(models, weights, tmp)
        if main:
            written.update(_write_shared(accelerator, tmp, safe_serialization, info, weights))
        rank_file = f"rank_{state.process_index}.pt"
        _write(os.path.join(tmp, rank_file), lambda f: torch.save(_rank_state(accelerator), f))
        written[rank_file] = os.path.join(tmp, rank_file)
        return {k: _record(p) for k, p in written.items()}, info

    def finalise(reports: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        if not main:
            return
        files: dict[str, Any] = {}
        for records, _ in reports:
            files.update(records)
        for file_name, record in files.items():
            path = os.path.join(tmp, file_name)
            if not os.path.isfile(path) or os.path.getsize(path) != record["size"]:
                raise RuntimeError(
                    f"save_state: the main process does not see {file_name!r} as written by its process; "
                    f"the checkpoint directory must be on a filesystem shared by all processes ({parent!r})"
                )
        manifest = _manifest(accelerator, files, reports[0][1])
        _write_json(os.path.join(tmp, MANIFEST), manifest)
        _fsync_dir(tmp)
        if os.path.isdir(target):
            old = os.path.join(parent, f".{name}.old-{secrets.token_hex(6)}")
            os.rename(target, old)
            os.rename(tmp, target)
            _fsync_dir(parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        _fsync_dir(parent)
        if total_limit is not None:
            for n in _iterations(parent)[:-total_limit]:
                path = os.path.join(parent, f"checkpoint_{n}")
                if path != target:
                    _remove_tree(path)

    _agree(state, "save_state (creating the temporary directory)", make_tmp)
    try:
        reports = _agree(state, "save_state (writing)", write_files, share=True)
        _agree(state, "save_state (finalising)", lambda: finalise(reports))
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.checkpoint_state = CheckpointInfo(target, iteration)
    config.iteration = config.iteration + 1 if iteration is None else iteration + 1
    return target


def _model_file(i: int, safe: bool) -> str:
    return f"model_{i}.safetensors" if safe else f"model_{i}.bin"


def _write_shared(
    accelerator: Accelerator, tmp: str, safe: bool, info: dict[str, Any], weights: list[dict[str, Any]]
) -> dict[str, str]:
    """The files only the main process writes; fills ``info`` for the manifest."""
    written: dict[str, str] = {}

    def put(file_name: str, write: Callable[[Any], None]) -> None:
        path = os.path.join(tmp, file_name)
        _write(path, write)
        written[file_name] = path

    info["models"] = []
    for i, sd in enumerate(weights):
        file_name = _model_file(i, safe)
        path = os.path.join(tmp, file_name)
        _write_weights(path, sd, safe, "save_state")
        written[file_name] = path
        info["models"].append({"file": file_name, "tensors": _tensor_table(sd)})
    for i, opt in enumerate(accelerator._optimizers):
        put(f"optimizer_{i}.pt", lambda f, o=opt: torch.save(o.state_dict(), f))
    for i, sched in enumerate(accelerator._schedulers):
        put(f"scheduler_{i}.pt", lambda f, s=sched: torch.save(s.state_dict(), f))
    for i, obj in enumerate(accelerator._custom_objects):
        put(f"custom_{i}.pt", lambda f, o=obj: torch.save(o.state_dict(), f))
    if accelerator.precision.scaler is not None:
        put(SCALER, lambda f: torch.save(accelerator.precision.state_dict(), f))
    loop = {
        "step": accelerator.step,
        "micro_step": accelerator.gradient_state.micro_step,
        "optimizers": [{"real_steps": o.real_steps, "sync_steps": o.sync_steps} for o in accelerator._optimizers],
    }
    put(LOOP_STATE, lambda f: f.write(json.dumps(loop, indent=1, sort_keys=True).encode()))
    return written


def _rank_state(accelerator: Accelerator) -> dict[str, Any]:
    return {
        "rank": accelerator.process_index,
        "rng": capture_rng_state(),
        "dataloaders": [dl.state_dict() for dl in accelerator._dataloaders],
    }


def _counts(accelerator: Accelerator) -> dict[str, int]:
    return {
        "models": len(accelerator._models),
        "optimizers": len(accelerator._optimizers),
        "schedulers": len(accelerator._schedulers),
        "dataloaders": len(accelerator._dataloaders),
        "custom_objects": len(accelerator._custom_objects),
    }


def _manifest(accelerator: Accelerator, files: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    from . import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "hasten_version": __version__,
        "torch_version": torch.__version__,
        "world_size": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "scaler": accelerator.precision.scaler is not None,
        "step": accelerator.step,
        "counts": _counts(accelerator),
        "models": info["models"],
        "files": dict(sorted(files.items())),
    }


# ---------------------------------------------------------------------- load_state


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint; a clear error for anything else."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"load_state: no checkpoint directory at {directory!r}")
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(
            f"load_state: {directory!r} has no {MANIFEST}, so it is not a complete hasten checkpoint "
            "(a save that did not finish, or a directory written by something else)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"load_state: the manifest {path!r} cannot be read: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"load_state: {path!r} is not a hasten checkpoint manifest")
    if not isinstance(manifest.get("format_version"), int) or manifest["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"load_state: {path!r} has format_version {manifest.get('format_version')!r}; "
            f"this hasten reads versions up to {FORMAT_VERSION}"
        )
    for key in ("world_size", "counts", "models", "files", "scaler"):
        if key not in manifest:
            raise ValueError(f"load_state: the manifest {path!r} lacks {key!r}")
    return manifest


def _read_checkpoint(
    accelerator: Accelerator, directory: str, weights_only: bool, verify_checksums: bool, models: list[torch.nn.Module]
) -> dict[str, Any]:
    """Everything ``load_state`` restores, read and checked; nothing is changed yet."""
    manifest = read_manifest(directory)
    where = f"the checkpoint {directory!r}"
    if manifest["world_size"] != accelerator.num_processes:
        raise ValueError(
            f"{where} was saved by {manifest['world_size']} process(es) but this run has "
            f"{accelerator.num_processes}; hasten resumes with the same number of processes only "
            "(the dataloader position and per-process RNG states are per process)"
        )
    counts = _counts(accelerator)
    if manifest["counts"] != counts:
        diff = ", ".join(
            f"{k}: checkpoint {manifest['counts'].get(k)} vs prepared {n}"
            for k, n in counts.items()
            if manifest["counts"].get(k) != n
        )
        raise ValueError(f"{where} holds other objects than were prepared/registered ({diff})")
    has_scaler = accelerator.precision.scaler is not None
    if manifest["scaler"] != has_scaler:
        raise ValueError(
            f"{where} was saved with mixed_precision={manifest.get('mixed_precision')!r} "
            f"{'with' if manifest['scaler'] else 'without'} a GradScaler, but this Accelerator has "
            f"mixed_precision={accelerator.mixed_precision!r} {'with' if has_scaler else 'without'} one"
        )
    rank_file = f"rank_{accelerator.process_index}.pt"
    files = manifest["files"]
    for file_name, record in files.items():
        path = os.path.join(directory, file_name)
        if not os.path.isfile(path):
            raise ValueError(f"{where} is incomplete: {file_name!r} is missing")
        size = os.path.getsize(path)
        if size != record.get("size"):
            raise ValueError(f"{where} is damaged: {file_name!r} has {size} bytes, the manifest says {record.get('size')}")
    mine = [f for f in files if not f.startswith("rank_") or f == rank_file]
    if rank_file not in files:
        raise ValueError(f"{where} is incomplete: it has no {rank_file!r} for process {accelerator.process_index}")
    if verify_checksums:
        for file_name in mine:
            if "sha256" in files[file_name] and _record(os.path.join(directory, file_name))["sha256"] != files[file_name]["sha256"]:
                raise ValueError(f"{where} is damaged: {file_name!r} does not match its SHA-256 in the manifest")

    def load(file_name: str) -> Any:
        try:
            return torch.load(os.path.join(directory, file_name), map_location="cpu", weights_only=weights_only)
        except Exception as e:
            hint = " (objects other than tensors/containers need load_state(..., weights_only=False) for a trusted checkpoint)" if weights_only else ""
            raise ValueError(f"{where}: cannot read {file_name!r}: {type(e).__name__}: {e}{hint}") from e

    out: dict[str, Any] = {"models": [], "optimizers": [], "schedulers": [], "custom": []}
    if len(models) != len(manifest["models"]):
        raise ValueError(
            f"{where} holds the weights of {len(manifest['models'])} model(s), but {len(models)} are left to restore "
            "(the prepared models less those the load_state pre-hooks took out of the list)"
        )
    for i, (model, entry) in enumerate(zip(models, manifest["models"])):
        _compare_tensors(entry["tensors"], accelerator.unwrap_model(model).state_dict(), f"{where} (model {i})")
        out["models"].append(_read_weights(os.path.join(directory, entry["file"]), weights_only))
        _compare_tensors(_tensor_table(out["models"][-1]), accelerator.unwrap_model(model).state_dict(), f"{where} (model {i} file)")
    for i, opt in enumerate(accelerator._optimizers):
        sd = load(f"optimizer_{i}.pt")
        saved = [len(g["params"]) for g in sd.get("param_groups", [])]
        current = [len(g["params"]) for g in opt.param_groups]
        if saved != current:
            raise ValueError(
                f"{where}: optimizer {i} has parameter groups of sizes {saved}, the prepared one {current}"
            )
        out["optimizers"].append(sd)
    out["schedulers"] = [load(f"scheduler_{i}.pt") for i in range(counts["schedulers"])]
    out["custom"] = [load(f"custom_{i}.pt") for i in range(counts["custom_objects"])]
    out["scaler"] = load(SCALER) if has_scaler else None
    with open(os.path.join(directory, LOOP_STATE), encoding="utf-8") as f:
        out["loop"] = json.load(f)
    if len(out["loop"].get("optimizers", [])) != counts["optimizers"]:
        raise ValueError(f"{where}: {LOOP_STATE} does not match the number of optimizers")
    rank = load(rank_file)
    if not isinstance(rank, dict) or rank.get("rank") != accelerator.process_index:
        raise ValueError(f"{where}: {rank_file!r} does not hold process {accelerator.process_index}'s state")
    if len(rank.get("dataloaders", [])) != counts["dataloaders"] or "rng" not in rank:
        raise ValueError(f"{where}: {rank_file!r} does not match the prepared dataloaders")
    out["rank"] = rank
    return out


def load_state(
    accelerator: Accelerator,
    input_dir: str | os.PathLike | None = None,
    *,
    weights_only: bool = True,
    verify_checksums: bool = True,
) -> str:
    """Restore what ``save_state`` saved; returns the directory. Call it on every process.

    Without ``input_dir`` the newest ``project_dir/checkpoints/checkpoint_N`` is loaded.
    Every file is read and checked on every process before any object is changed.
    """
    state = accelerator.state
    _check_single_node(accelerator, "load_state")
    v.check_bool("load_state", "weights_only", weights_only)
    v.check_bool("load_state", "verify_checksums", verify_checksums)
    if input_dir is None:
        root = _checkpoints_root(accelerator, "load_state")
        found = _from_main(state, _iterations(root) if state.is_main_process else None)
        if not found:
            raise FileNotFoundError(f"load_state: no checkpoint_N directory in {root!r}")
        iteration: int | None = found[-1]
        directory = os.path.join(root, f"checkpoint_{iteration}")
    else:
        directory = _check_path("load_state", "input_dir", input_dir)
        match = _ITERATION.fullmatch(os.path.basename(directory))
        iteration = int(match.group(1)) if match else None

    models = list(accelerator._models)

    def read() -> dict[str, Any]:
        for hook in accelerator._load_model_state_pre_hook.values():
            hook(models, directory)
        return _read_checkpoint(accelerator, directory, weights_only, verify_checksums, models)

    data = _agree(state, "load_state (reading)", read)
    _agree(state, "load_state (restoring)", lambda: _restore(accelerator, data, directory, models))
    accelerator.checkpoint_state = CheckpointInfo(directory, iteration)
    return directory


def _restore(accelerator: Accelerator, data: dict[str, Any], directory: str, models: list[torch.nn.Module]) -> None:
    step = "models"
    try:
        for model, sd in zip(models, data["models"]):
            accelerator.unwrap_model(model).load_state_dict(sd)
        step = "optimizers"
        for opt, sd, counters in zip(accelerator._optimizers, data["optimizers"], data["loop"]["optimizers"]):
            opt.load_state_dict(sd)
            opt.real_steps = int(counters["real_steps"])
            opt.sync_steps = int(counters["sync_steps"])
        step = "schedulers"  # after the optimizers' counters: a scheduler counts their real steps
        for sched, sd in zip(accelerator._schedulers, data["schedulers"]):
            sched.load_state_dict(sd)
        step = "grad scaler"
        if data["scaler"] is not None:
            accelerator.precision.load_state_dict(data["scaler"])
        step = "registered objects"
        for obj, sd in zip(accelerator._custom_objects, data["custom"]):
            obj.load_state_dict(sd)
        step = "loop state"
        accelerator.gradient_state.micro_step = int(data["loop"].get("micro_step", 0))
        step = "dataloaders"
        for dl, sd in zip(accelerator._dataloaders, data["rank"]["dataloaders"]):
            dl.load_state_dict(sd)
        step = "RNG states"
        restore_rng_state(data["rank"]["rng"], f"the checkpoint {directory!r}")
    except Exception as e:
        raise RuntimeError(
            f"load_state: restoring the {step} from {directory!r} failed ({type(e).__name__}: {e}); "
            "the objects restored before it were changed, do not continue training from this state"
        ) from e
