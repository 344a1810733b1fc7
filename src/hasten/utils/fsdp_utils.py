"""Accelerate's FSDP checkpoint functions (``accelerate.utils.fsdp_utils``), on hasten's FSDP2.

``save_fsdp_model``/``load_fsdp_model`` and ``save_fsdp_optimizer``/``load_fsdp_optimizer``
write and read Accelerate's files and folders, so checkpoints move between the two libraries:

- ``state_dict_type="FULL_STATE_DICT"``: the model gathered into ``pytorch_model_fsdp.bin``
  (``pytorch_model_fsdp_{i}.bin`` for model ``i > 0``), the optimizer into ``optimizer.bin``
  (``optimizer_{i}.bin``), written by the main process;
- ``"SHARDED_STATE_DICT"``: ``torch.distributed.checkpoint`` folders ``pytorch_model_fsdp_{i}``
  (``{"model": state dict}``) and ``optimizer_{i}`` (``{"optimizer": ...}``), every process
  writing its shards; with ``use_dcp=False`` one file per process instead,
  ``pytorch_model_fsdp_{i}_rank{r}.bin`` and ``optimizer_{i}_rank{r}.bin`` (loadable only at the
  same number of processes).

The state dicts are the FSDP strategy's (``hasten.strategies.fsdp``: keyed by the model's own
parameter names; the optimizer's by parameter name, as torch's ``get_optimizer_state_dict``),
so the Accelerator must shard with FSDP (an ``fsdp_plugin``, or a ``ParallelismConfig`` that
shards). Reading goes through hasten's checkpoint reading: torch files with
``weights_only=True``, DCP folders through the allow-listed reader (nothing read is run).

``merge_fsdp_weights`` joins a sharded folder into one ``model.safetensors`` (or
``pytorch_model.bin``) in one process, as ``hasten merge-weights`` does
(``hasten.checkpoint.merge``, which it uses for a hasten ``save_state`` checkpoint).

Accelerate's FSDP2 helpers run on the same machinery: ``fsdp2_prepare_model`` is the FSDP
strategy's ``setup_module`` (``prepare``'s sharding), ``fsdp2_apply_ac`` its activation
checkpointing step, ``fsdp2_load_full_state_dict`` its broadcast from the main process
(``hasten.strategies.materialise``); ``fsdp2_switch_optimizer_parameters``,
``fsdp2_canonicalize_names``, ``get_fsdp2_grad_scaler``, ``ensure_weights_retied`` and
``enable``/``disable_fsdp_ram_efficient_loading`` are Accelerate's small helpers.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hasten.checkpoint import dcp_io, errors, files, unpickle, weights
from hasten.checkpoint.manifest import MANIFEST
from hasten.checkpoint.merge import SAFE_NAME, UNSAFE_NAME, merge_weights

if TYPE_CHECKING:  # pragma: no cover
    from hasten.accelerator import Accelerator
    from hasten.settings.plugins import FullyShardedDataParallelPlugin
    from hasten.strategies.base import Strategy

__all__ = [
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "ensure_weights_retied",
    "fsdp2_apply_ac",
    "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]

#: Accelerate's names (``accelerate.utils.constants``)
FSDP_MODEL_NAME = "pytorch_model_fsdp"
OPTIMIZER_NAME = "optimizer"
DCP_METADATA = ".metadata"


# --------------------------------------------------------------------------- checks and names
def _checked(what: str, fsdp_plugin: Any, accelerator: Any, index_field: str, index: Any, **flags: Any) -> Strategy:
    """The Accelerator's strategy, once the arguments are checked (nothing done before)."""
    from hasten.accelerator import Accelerator
    from hasten.settings.plugins import FullyShardedDataParallelPlugin

    if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
        raise TypeError(
            f"{what}: fsdp_plugin must be a FullyShardedDataParallelPlugin (e.g. accelerator.fsdp_plugin), "
            f"got {type(fsdp_plugin).__name__}"
        )
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"{what}: accelerator must be a hasten Accelerator, got {type(accelerator).__name__}")
    strategy = accelerator.strategy
    if getattr(strategy, "name", None) != "fsdp":
        raise ValueError(
            f"{what}: this Accelerator does not shard with FSDP (distributed_type="
            f"{accelerator.distributed_type!s}); give it fsdp_plugin=FullyShardedDataParallelPlugin(), or save "
            "with accelerator.save_state / accelerator.save_model"
        )
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{what}: {index_field} must be an integer >= 0, got {index!r}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{what}: {name} must be True or False, got {value!r}")
    return strategy


def _full(fsdp_plugin: FullyShardedDataParallelPlugin) -> bool:
    return fsdp_plugin.state_dict_type == "FULL_STATE_DICT"


def _numbered(stem: str, index: int) -> str:
    """``stem.bin`` for index 0, else ``stem_{index}.bin`` (Accelerate's full files)."""
    return f"{stem}.bin" if index == 0 else f"{stem}_{index}.bin"


def _dcp_folder(directory: str, name: str) -> str:
    """``directory/name``, or ``directory`` itself where it is that folder (as Accelerate looks)."""
    return directory if os.path.basename(directory) == name else os.path.join(directory, name)


def _is_peft_model(model: torch.nn.Module) -> bool:
    """A PEFT model (peft is only looked at where something imported it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, getattr(peft, "PeftModel", ()))


def _trainable_only(state_dict: dict[str, Any], inner: torch.nn.Module) -> dict[str, Any]:
    """``state_dict`` without the frozen parameters (a PEFT model's adapter: torch's
    ``ignore_frozen_params``)."""
    frozen = {name for name, p in inner.named_parameters() if not p.requires_grad}
    return {k: t for k, t in state_dict.items() if k not in frozen}


def _save_torch(path: str, obj: Any) -> None:
    files.replace_file(path, lambda f: torch.save(obj, f))


def _load_torch(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: no file {path!r} (written by the matching save with the same arguments)")
    return unpickle.torch_load(path, f"{what}: the file {path!r}")


def _require_dcp(folder: str, what: str) -> None:
    if not os.path.isfile(os.path.join(folder, DCP_METADATA)):
        raise FileNotFoundError(
            f"{what}: no torch.distributed.checkpoint folder at {folder!r} (it has no {DCP_METADATA} file)"
        )


def _dcp_save(state: dict[str, Any], folder: str, what: str) -> None:
    os.makedirs(folder, exist_ok=True)
    save = errors.explained(lambda: dcp_io.dcp().save(state, storage_writer=dcp_io.dcp_writer(folder)), what)
    save()


def _dcp_load(state: dict[str, Any], folder: str, where: str, no_dist: bool = False) -> dict[str, Any]:
    """Load ``folder`` into ``state`` in place (its tensors, or shards, filled) through hasten's
    allow-listed reader; a damaged or unreadable folder is one ``ValueError`` line."""
    reader = dcp_io.dcp_reader(folder, lambda name, regions: None, where)
    try:
        reader.read_metadata()
        if no_dist:
            _fill_from_metadata(state, reader)
        planner = unpickle.dcp_planner(reader, where)
        dcp_io.dcp().load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if not isinstance(e, Exception) and not errors.is_dcp_exception(e):
            raise  # KeyboardInterrupt, SystemExit
        refused = next((c for c in errors._causes(e) if isinstance(c, errors.DamagedCheckpoint)), None)
        if refused is not None:
            raise type(refused)(str(refused)) from None
        raise ValueError(f"{where}: cannot read {folder!r}: {errors.first_line(e)}") from None
    return state


def _fill_from_metadata(state: dict[str, Any], reader: Any) -> None:
    """Every item of the folder as ``state`` (empty): tensors at their full shapes, nested where
    they were saved nested (``{"model": {...}}``); non-tensor items are read by the planner."""
    from torch.distributed.checkpoint.default_planner import set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = reader.read_metadata()
    paths = metadata.planner_data or {}
    for key, entry in metadata.state_dict_metadata.items():
        value = (
            torch.empty(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else entry
        )
        if key in paths:
            set_element(state, paths[key], value)
        else:
            state[key] = value


# --------------------------------------------------------------------------- the model
def save_fsdp_model(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: Accelerator,
    model: torch.nn.Module,
    output_dir: str | os.PathLike,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Save a prepared FSDP model in Accelerate's layout for ``fsdp_plugin.state_dict_type`` (see
    the module's docstring); every process calls it. ``adapter_only`` with a PEFT model: only
    its trainable parameters (the adapter)."""
    what = "save_fsdp_model"
    strategy = _checked(
        what, fsdp_plugin, accelerator, "model_index", model_index, adapter_only=adapter_only, use_dcp=use_dcp
    )
    output_dir = files.check_path(what, "output_dir", output_dir)
    full = _full(fsdp_plugin)
    state_dict = strategy.model_state_dict(model, full=full)
    if adapter_only and _is_peft_model(strategy.unwrap(model)):
        state_dict = _trainable_only(state_dict, strategy.unwrap(model))
    _write(output_dir, FSDP_MODEL_NAME, "model", model_index, state_dict, full, use_dcp, accelerator, what)


def _write(
    output_dir: str,
    name: str,
    key: str,
    index: int,
    state: dict,
    full: bool,
    use_dcp: bool,
    accelerator: Any,
    what: str,
) -> None:
    """Accelerate's files for one state dict: a full one by the main process (``name[_index].bin``),
    a sharded one as a DCP folder (``name_index/``, under ``key``) or one file per process."""
    os.makedirs(output_dir, exist_ok=True)
    rank = accelerator.process_index
    if full:
        if rank == 0:
            _save_torch(os.path.join(output_dir, _numbered(name, index)), state)
    elif use_dcp:
        _dcp_save({key: state}, os.path.join(output_dir, f"{name}_{index}"), what)
    else:
        _save_torch(os.path.join(output_dir, f"{name}_{index}_rank{rank}.bin"), _local(state))


def load_fsdp_model(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: Accelerator,
    model: torch.nn.Module,
    input_dir: str | os.PathLike,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> Any:
    """Load what ``save_fsdp_model`` (hasten's or Accelerate's) wrote into a prepared FSDP model;
    every process calls it. Returns the load's missing and unexpected keys (torch's
    ``_IncompatibleKeys``). ``input_dir`` may also be the ``pytorch_model_fsdp_{i}`` folder itself."""
    what = "load_fsdp_model"
    strategy = _checked(
        what, fsdp_plugin, accelerator, "model_index", model_index, adapter_only=adapter_only, use_dcp=use_dcp
    )
    input_dir = files.check_path(what, "input_dir", input_dir)
    inner = strategy.unwrap(model)
    adapter = adapter_only and _is_peft_model(inner)
    accelerator.wait_for_everyone()
    rank = accelerator.process_index
    if _full(fsdp_plugin):
        state_dict = _load_torch(os.path.join(input_dir, _numbered(FSDP_MODEL_NAME, model_index)), what)
    elif use_dcp:
        folder = _dcp_folder(input_dir, f"{FSDP_MODEL_NAME}_{model_index}")
        _require_dcp(folder, what)
        template = strategy.model_state_dict(model, full=False, check_filled=False)
        if adapter:
            template = _trainable_only(template, inner)
        state_dict = _dcp_load({"model": template}, folder, f"{what}: the checkpoint {folder!r}")["model"]
    else:
        path = os.path.join(input_dir, f"{FSDP_MODEL_NAME}_{model_index}_rank{rank}.bin")
        local = _load_torch(path, what)
        state_dict = _as_shards(local, strategy.model_state_dict(model, full=False, check_filled=False), path)
    result = strategy.load_model_state_dict(model, state_dict, strict=not adapter)
    accelerator.wait_for_everyone()
    return result


def _local(state: Any) -> Any:
    """``state`` with each DTensor as this process's shard (a plain tensor: what a per-process
    file holds, and what ``torch.load(weights_only=True)`` reads back)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {k: _local(x) for k, x in state.items()}
    if isinstance(state, list):
        return [_local(x) for x in state]
    return state


def _as_shards(local: Any, template: Any, path: str) -> Any:
    """``local`` (a per-process file's plain shards) as DTensors laid out as ``template``'s."""
    from torch.distributed.tensor import DTensor

    if isinstance(template, DTensor):
        if not isinstance(local, torch.Tensor) or local.shape != template.to_local().shape:
            raise ValueError(
                f"the file {path!r} does not hold this process's shard of the model as it is sharded now (saved "
                "at another number of processes?); per-process files load only as they were written"
            )
        return DTensor.from_local(
            local.to(template.device),
            template.device_mesh,
            template.placements,
            shape=template.shape,
            stride=template.stride(),
        )
    if isinstance(template, dict) and isinstance(local, dict):
        return {k: _as_shards(x, template[k], path) if k in template else x for k, x in local.items()}
    return local


# --------------------------------------------------------------------------- the optimizer
def _check_owner(what: str, strategy: Strategy, optimizer: Any, model: torch.nn.Module) -> None:
    owner = strategy.model_of(optimizer)
    if owner is not None and owner is not strategy.unwrap(model):
        raise ValueError(f"{what}: the optimizer updates another prepared model's parameters than `model`'s")


def save_fsdp_optimizer(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: Accelerator,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    output_dir: str | os.PathLike,
    optimizer_index: int = 0,
    use_dcp: bool = True,
) -> None:
    """Save the optimizer of a prepared FSDP ``model`` in Accelerate's layout (see the module's
    docstring), its state keyed by parameter name; every process calls it."""
    what = "save_fsdp_optimizer"
    strategy = _checked(what, fsdp_plugin, accelerator, "optimizer_index", optimizer_index, use_dcp=use_dcp)
    output_dir = files.check_path(what, "output_dir", output_dir)
    _check_owner(what, strategy, optimizer, model)
    full = _full(fsdp_plugin)
    state = strategy.optimizer_state_dict(optimizer, full=full)
    _write(output_dir, OPTIMIZER_NAME, "optimizer", optimizer_index, state, full, use_dcp, accelerator, what)


def load_fsdp_optimizer(
    fsdp_plugin: FullyShardedDataParallelPlugin,
    accelerator: Accelerator,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    input_dir: str | os.PathLike,
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Load what ``save_fsdp_optimizer`` (hasten's or Accelerate's) wrote into the optimizer of a
    prepared FSDP ``model``; every process calls it. ``input_dir`` may also be the
    ``optimizer_{i}`` folder itself. (``adapter_only`` is Accelerate's argument; it changes nothing
    there either.)"""
    what = "load_fsdp_optimizer"
    strategy = _checked(
        what, fsdp_plugin, accelerator, "optimizer_index", optimizer_index, adapter_only=adapter_only, use_dcp=use_dcp
    )
    input_dir = files.check_path(what, "input_dir", input_dir)
    _check_owner(what, strategy, optimizer, model)
    accelerator.wait_for_everyone()
    rank = accelerator.process_index
    if _full(fsdp_plugin):
        state = _load_torch(os.path.join(input_dir, _numbered(OPTIMIZER_NAME, optimizer_index)), what)
    elif use_dcp:
        folder = _dcp_folder(input_dir, f"{OPTIMIZER_NAME}_{optimizer_index}")
        _require_dcp(folder, what)
        template = {"optimizer": strategy.optimizer_state_dict(optimizer, full=False)}
        state = _dcp_load(template, folder, f"{what}: the checkpoint {folder!r}")["optimizer"]
    else:
        path = os.path.join(input_dir, f"{OPTIMIZER_NAME}_{optimizer_index}_rank{rank}.bin")
        state = _as_shards(_load_torch(path, what), strategy.optimizer_state_dict(optimizer, full=False), path)
    strategy.load_optimizer_state_dict(optimizer, state)
    accelerator.wait_for_everyone()


# --------------------------------------------------------------------------- merging
def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike,
    output_path: str | os.PathLike,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> None:
    """Join a sharded checkpoint into one file, ``output_path/model.safetensors`` (with
    ``safe_serialization=False``: ``pytorch_model.bin``), on the main process, in that one
    process (CPU only), as Accelerate's. ``checkpoint_dir`` is a ``torch.distributed.checkpoint``
    folder (``pytorch_model_fsdp_0`` of ``save_fsdp_model`` or of Accelerate's ``save_state``;
    a saved ``{"model": ...}`` is unwrapped), or a hasten ``save_state`` checkpoint (its first
    model, as ``hasten merge-weights``). ``remove_checkpoint_dir`` deletes ``checkpoint_dir``
    once the output is written (an ``output_path`` inside it is refused first: a ValueError that
    names both, nothing written or deleted). Every process of a run may call it: the others wait."""
    what = "merge_fsdp_weights"
    checkpoint_dir = files.check_path(what, "checkpoint_dir", checkpoint_dir)
    output_path = files.check_path(what, "output_path", output_path)
    for name, value in (("safe_serialization", safe_serialization), ("remove_checkpoint_dir", remove_checkpoint_dir)):
        if not isinstance(value, bool):
            raise TypeError(f"{what}: {name} must be True or False, got {value!r}")
    hasten_checkpoint = _check_merge_source(checkpoint_dir, what)
    if remove_checkpoint_dir:
        _check_output_outside(checkpoint_dir, output_path, what)
    from hasten.distributed.state import ProcessState

    state = ProcessState()
    if state.is_main_process:
        if hasten_checkpoint:
            merge_weights(checkpoint_dir, output_path, safe_serialization=safe_serialization)
        else:
            _merge_dcp(checkpoint_dir, output_path, safe_serialization, what)
        if remove_checkpoint_dir:
            shutil.rmtree(checkpoint_dir)
    state.wait_for_everyone()


def _check_merge_source(checkpoint_dir: str, what: str) -> bool:
    """True for a hasten checkpoint, False for a DCP folder; else a ValueError that names the
    folders inside it to pass instead, as Accelerate's does."""
    if os.path.isfile(os.path.join(checkpoint_dir, DCP_METADATA)):
        return False
    if os.path.isfile(os.path.join(checkpoint_dir, MANIFEST)):
        return True
    inside = [
        os.path.join(checkpoint_dir, n)
        for n in (f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0")
        if os.path.isfile(os.path.join(checkpoint_dir, n, DCP_METADATA))
    ]
    hint = f"; pass {' or '.join(map(repr, inside))} instead" if inside else ""
    found = "is not a directory" if not os.path.isdir(checkpoint_dir) else f"has no {DCP_METADATA} (nor {MANIFEST})"
    raise ValueError(
        f"{what}: {checkpoint_dir!r} {found}: give a sharded checkpoint folder (torch.distributed.checkpoint's, "
        f"e.g. .../{FSDP_MODEL_NAME}_0) or a hasten save_state checkpoint{hint}"
    )


def _check_output_outside(checkpoint_dir: str, output_path: str, what: str) -> None:
    """With ``remove_checkpoint_dir``, an output folder that is (or lies in) the checkpoint
    folder, links resolved, is refused before anything is read or written: deleting the
    checkpoint would delete the merged file too."""
    checkpoint, output = os.path.realpath(checkpoint_dir), os.path.realpath(output_path)
    if os.path.commonpath([checkpoint, output]) == checkpoint:
        place = "is the checkpoint folder" if output == checkpoint else "lies inside the checkpoint folder"
        raise ValueError(
            f"{what}: the output folder {output_path!r} {place} {checkpoint_dir!r}, which remove_checkpoint_dir=True "
            "would delete with the merged file: give an output folder outside it (nothing was written or deleted)"
        )


def _merge_dcp(folder: str, output_path: str, safe: bool, what: str) -> str:
    if os.path.exists(output_path) and not os.path.isdir(output_path):
        raise ValueError(f"{what}: the output {output_path!r} is a file; give a folder (it is created if missing)")
    merged = _dcp_load({}, folder, f"{what}: the checkpoint {folder!r}", no_dist=True)
    if len(merged) == 1 and isinstance(next(iter(merged.values())), dict):
        merged = next(iter(merged.values()))  # {"model": {...}}: the model's own keys
    path = os.path.join(output_path, SAFE_NAME if safe else UNSAFE_NAME)
    payload = weights.safetensors_payload(*weights.flat_tensors(merged, what), what) if safe else None
    os.makedirs(output_path, exist_ok=True)
    if payload is not None:
        files.replace_file(path, payload)
    else:
        _save_torch(path, merged)
    return path


# --------------------------------------------------------------------------- FSDP2 helpers
def _fsdp_accelerator(what: str, accelerator: Any) -> Strategy:
    """The Accelerator's FSDP strategy, or an error naming what to give the Accelerator."""
    from hasten.accelerator import Accelerator

    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"{what}: accelerator must be a hasten Accelerator, got {type(accelerator).__name__}")
    strategy = accelerator.strategy
    strategy = getattr(strategy, "inner", None) or strategy  # a pipeline's stages are sharded by its inner one
    if getattr(strategy, "name", None) != "fsdp":
        raise ValueError(
            f"{what}: this Accelerator does not shard with FSDP (distributed_type={accelerator.distributed_type!s}); "
            "give it fsdp_plugin=FullyShardedDataParallelPlugin()"
        )
    return strategy


def fsdp2_prepare_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 in place, as the Accelerator's ``prepare`` does (its FSDP
    strategy's parallelize pipeline: activation checkpointing, compilation and ``fully_shard`` on
    each block of the plugin's wrap policy, then on the root; a model on the meta device
    materialised, only this process's shards allocated), and return it. A model sharded already
    comes back as it is. Unlike ``prepare`` the model is not added to the Accelerator's prepared
    models (as in Accelerate); with one process there is nothing to shard over."""
    strategy = _fsdp_accelerator("fsdp2_prepare_model", accelerator)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fsdp2_prepare_model: model must be a torch.nn.Module, got {type(model).__name__}")
    return strategy.setup_module(model)


def fsdp2_load_full_state_dict(
    accelerator: Accelerator, model: torch.nn.Module, full_sd: dict[str, Any], cpu_offload: bool = False
) -> torch.nn.Module:
    """Load ``full_sd`` (a full state dict, needed on the main process only) into the sharded
    ``model``: the main process sends each tensor, every process keeps its shards (cast to the
    model's dtypes), as Accelerate's. Tensors still on the meta device are allocated first (on
    the CPU with ``cpu_offload``). A name of the model missing from ``full_sd`` is a KeyError on
    every process (nothing changed). Returns ``model``."""
    from hasten.distributed.ops import agree
    from hasten.strategies.materialise import fill_broadcast, mark_filled, materialise

    _fsdp_accelerator("fsdp2_load_full_state_dict", accelerator)
    keys = list(model.state_dict())
    main = accelerator.is_main_process

    def check() -> None:
        missing = [k for k in keys if k not in full_sd] if main else []
        if missing:
            raise KeyError(
                f"Parameter '{missing[0]}' found in sharded model state dict but missing from full state dict. "
                f"Full state dict has {len(full_sd)} keys, sharded has {len(keys)} keys."
            )

    if accelerator.use_distributed:
        agree(accelerator.process_index, "fsdp2_load_full_state_dict", check)
    else:
        check()
    device = accelerator.device
    if any(t.is_meta for t in model.state_dict().values() if isinstance(t, torch.Tensor)):
        materialise(model, torch.device("cpu") if cpu_offload else device, device)
    if accelerator.use_distributed:
        fill_broadcast(model, full_sd if main else {}, device, main)
    else:
        model.load_state_dict({k: full_sd[k] for k in keys})
    mark_filled(model, keys)
    return model


def fsdp2_switch_optimizer_parameters(optimizer: torch.optim.Optimizer, mapping: dict[Any, Any]) -> None:
    """Point ``optimizer``'s parameters at new ones (e.g. their FSDP2 shards) in place:
    ``mapping`` is keyed as Accelerate's ``prepare`` keys it (each parameter's ``data_ptr``
    attribute), or by the parameter's ``data_ptr()``, or by the parameter itself. A parameter
    without a new one is a KeyError (training on would not update the model), nothing changed."""
    switched = []
    for group in optimizer.param_groups:
        new = []
        for p in group["params"]:
            keys = [p.data_ptr, p]
            if callable(p.data_ptr):
                keys.insert(1, p.data_ptr())
            found = next((mapping[k] for k in keys if _holds_key(mapping, k)), None)
            if found is None:
                raise KeyError(
                    "A parameter in the optimizer couldn't be switched to its sharded version. This breaks the "
                    f"training: mapping has no entry for a parameter of shape {tuple(p.shape)} (keyed by its "
                    "data_ptr, or the parameter itself)"
                )
            new.append(found)
        switched.append(new)
    for group, params in zip(optimizer.param_groups, switched):
        group["params"] = params


def _holds_key(mapping: dict[Any, Any], key: Any) -> bool:
    try:
        return key in mapping
    except (TypeError, RuntimeError):  # an unhashable key, or a tensor compared by value
        return False


def fsdp2_apply_ac(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """Activation checkpointing on ``model``'s blocks (those of the FSDP plugin's wrap policy, as
    ``prepare`` picks them: each top-level child where the policy picks none), in place, each
    block's inputs kept on the CPU with ``activation_checkpointing_offload``. Returns ``model``."""
    from hasten.strategies.parallelize import (
        BlockPolicy,
        CheckpointingPlan,
        apply_activation_checkpointing,
        select_blocks,
    )

    plugin = _fsdp_accelerator("fsdp2_apply_ac", accelerator).plugin
    policy = BlockPolicy(
        plugin.auto_wrap_policy, tuple(plugin.transformer_cls_names_to_wrap or ()), plugin.min_num_params
    )
    plan = CheckpointingPlan(plugin.checkpoint_wrapper(accelerator.device.type != "cpu"))
    apply_activation_checkpointing(model, select_blocks(model, policy), plan)
    return model


def fsdp2_canonicalize_names(named_params: dict[str, Any]) -> dict[str, Any]:
    """The names without what wrappers add (activation checkpointing's
    ``._checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod.``), as Accelerate's."""
    named_params = {k.replace("._checkpoint_wrapped_module", ""): p for k, p in named_params.items()}
    named_params = {k.removeprefix("_orig_mod."): p for k, p in named_params.items()}
    return {k.replace("._orig_mod", ""): p for k, p in named_params.items()}


def get_fsdp2_grad_scaler(**kwargs: Any) -> torch.amp.GradScaler:
    """torch's ``GradScaler(**kwargs)``, as Accelerate's (FSDP2's sharded gradients are DTensors,
    which torch's scaler handles). Without a ``device`` it is this machine's accelerator's, or the
    CPU's where there is none (torch's default, "cuda", would be a disabled scaler there)."""
    if "device" not in kwargs:
        found = torch.accelerator.current_accelerator()
        kwargs["device"] = found.type if found is not None else "cpu"
    return torch.amp.GradScaler(**kwargs)


def enable_fsdp_ram_efficient_loading() -> None:
    """Set ``FSDP_CPU_RAM_EFFICIENT_LOADING=True`` (and ``ACCELERATE_USE_FSDP=True`` unless set):
    transformers' ``from_pretrained`` then loads the weights on the main process only, and a
    ``FullyShardedDataParallelPlugin`` built after reads it as its ``cpu_ram_efficient_loading``."""
    from hasten.settings import environment as env

    env.export_default(env.ACCELERATE_USE_FSDP, "True")
    env.export({env.FSDP_CPU_RAM_EFFICIENT_LOADING: "True"})


def disable_fsdp_ram_efficient_loading() -> None:
    """Set ``FSDP_CPU_RAM_EFFICIENT_LOADING=False``."""
    from hasten.settings import environment as env

    env.export({env.FSDP_CPU_RAM_EFFICIENT_LOADING: "False"})


def ensure_weights_retied(
    param_init_fn: Callable[[torch.nn.Module], Any], model: torch.nn.Module, device: torch.device
) -> Callable[[torch.nn.Module], Any]:
    """``param_init_fn`` made to keep ``model``'s tied weights tied (those its
    ``_tied_weights_keys`` names): after it runs on a module, each tied parameter it replaced is
    the one first made for that tie. Without ``_tied_weights_keys``, ``param_init_fn`` itself."""
    names = getattr(model, "_tied_weights_keys", None)
    if not names:
        return param_init_fn
    tied: dict[int, torch.nn.Parameter | None] = {}
    for name in names:
        owner, _, attr = name.rpartition(".")
        tied[id(getattr(model.get_submodule(owner), attr))] = None

    def init_keeping_ties(module: torch.nn.Module) -> Any:
        to_tie: dict[int, list[str]] = defaultdict(list)
        for n, p in module.named_parameters(recurse=False):
            if id(p) in tied:
                to_tie[id(p)].append(n)
        module = param_init_fn(module)
        for key, attrs in to_tie.items():
            for attr in attrs:
                if tied[key] is None:
                    tied[key] = getattr(module, attr)
                else:
                    setattr(module, attr, tied[key])
        return module

    return init_keeping_ties


def get_parameters_from_modules(modules: Any, model: torch.nn.Module, device: Any) -> set[torch.nn.Parameter]:
    """The parameters of ``modules``: modules, or a regular expression that the full names (in
    ``model.named_modules()``) of the modules must match; each is first moved to ``device`` unless
    it is None. None gives an empty set (Accelerate's; TRL calls it)."""
    import re

    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [module for name, module in model.named_modules() if pattern.fullmatch(name)]
    parameters: list[torch.nn.Parameter] = []
    for module in modules:
        if device is not None:
            module.to(device)
        parameters.extend(module.parameters())
    return set(parameters)
