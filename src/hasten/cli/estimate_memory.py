"""``hasten estimate-memory MODEL``: how much memory a model needs to load and to train with Adam.

Accelerate's ``accelerate estimate-memory``, with its flags, columns and figures, for a model
given as a local folder holding a transformers ``config.json``, a ``module:Class`` path, or a
name on the Hugging Face Hub (only its ``config.json`` is fetched). The model is built on the
meta device: nothing is allocated and no weight is initialised, so a 70B model is counted in
seconds on a laptop. ``--num_processes N --fsdp`` gives what each process holds when FSDP
shards the model over N processes.

What is counted, per dtype (activations are not: they grow with the batch and the sequence):

- Total Size: the parameters and buffers in that dtype (integer buffers keep their own size).
- Largest Layer: the biggest module without children (or of a class the model lists in
  ``_no_split_modules``, a transformers decoder block), or a parameter held directly by a module.
- Training using Adam (float32, bfloat16, float16): weights, their gradients and Adam's two
  states, all held in that dtype: 4x the parameters (Accelerate's figure: 4x float32, 2x float32
  for 16 bits). With ``mixed_precision="bf16"``/``"fp16"`` (autocast) the weights stay float32:
  read the float32 row. int8 and int4 are for loading only ("N/A").
- With ``--fsdp``: each parameter is split along its first dim into N padded chunks, as
  ``fully_shard`` does, so weights, gradients and Adam's states are divided by N; buffers are
  not sharded; one layer at a time is gathered whole (its weights, and in training its
  gradients before they are reduce-scattered): the largest one is added. Without ``--fsdp``
  every process holds the whole model (DDP), so N changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hasten.cli._flags import Parser

__all__ = ["build_model", "estimate", "estimate_memory_command", "estimate_spec"]

DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16, "int8": 8, "int4": 4}
DEFAULT_DTYPES = ("float32", "float16", "int8", "int4")  # Accelerate's default rows
TRAINABLE_DTYPES = frozenset({"float32", "bfloat16", "float16"})
HEADERS = ("dtype", "Largest Layer", "Total Size", "Training using Adam")
#: a config's fields that give a stack's number of layers (at its top level or in a sub-config)
LAYER_FIELDS = frozenset(
    {
        "num_hidden_layers",
        "n_layer",
        "n_layers",
        "num_layers",
        "encoder_layers",
        "decoder_layers",
        "num_encoder_layers",
        "num_decoder_layers",
    }
)
#: a stack of more layers is not built one by one: it is counted from builds of SAMPLE_LAYERS
#: and SAMPLE_LAYERS + 1 layers, whose last half must be identical, the others counted as copies
FULL_BUILD_LAYERS = 1024
SAMPLE_LAYERS = 64

DESCRIPTION = (
    "How much memory MODEL needs to load and to train with Adam, per dtype, counted on a model built on the "
    "meta device (nothing is allocated). MODEL is a local folder holding a transformers config.json, a "
    "module:Class path (a class or function of an importable module, called with no arguments), or a model "
    "name on the Hugging Face Hub (only its config.json is fetched). Training using Adam counts the weights, "
    "their gradients and Adam's two states in that dtype (activations are not counted); with "
    "mixed_precision bf16/fp16 the weights stay float32: read the float32 row."
)


class ModelSpecError(ValueError):
    """MODEL (or a flag) names nothing that can be built: a usage error (exit status 2)."""


class TooManyLayers(ModelSpecError):
    """A transformers config with more layers than ``FULL_BUILD_LAYERS`` in a stack: ``build_model``
    refuses to build it; ``estimate_spec`` counts it from builds of ``SAMPLE_LAYERS`` layers."""

    def __init__(self, label: str, source: str, config: dict, big: dict[tuple[str, ...], int]) -> None:
        fields = ", ".join(f"{'.'.join(path)}={count:,}" for path, count in big.items())
        super().__init__(
            f"MODEL {label!r} has {fields} layers, more than the {FULL_BUILD_LAYERS:,} built one by one "
            "(estimate-memory counts repeated layers from a build of a few)"
        )
        self.label, self.source, self.config, self.big = label, source, config, big


# ----------------------------------------------------------------------------- the command


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hasten estimate-memory", description=DESCRIPTION)
    parser.add_argument("model_name", help="a folder with a config.json, module:Class, or a Hub model name")
    parser.add_argument(
        "--library_name",
        choices=["transformers", "timm"],
        help="the library that builds a Hub model (default: transformers, from its config.json)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=list(DEFAULT_DTYPES),
        metavar="DTYPE",
        help=f"the rows to show, any of {', '.join(DTYPE_BITS)} (default: {' '.join(DEFAULT_DTYPES)})",
    )
    parser.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="run the modelling code a Hub repository or folder ships (only for code you trust and have read)",
    )
    parser.add_argument(
        "--num_processes",
        type=int,
        default=1,
        help="per-process figures for N processes (with --fsdp the model is sharded over them; default: 1)",
    )
    parser.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and Adam's states (FSDP2)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (bytes) instead of a table")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a bad flag value before anything is built (parser.error: exit status 2)."""
    unknown = [d for d in args.dtypes if d not in DTYPE_BITS]
    if unknown:
        parser.error(f"--dtypes: unknown dtype {unknown[0]!r}; allowed: {', '.join(DTYPE_BITS)}")
    if args.num_processes < 1:
        parser.error(f"--num_processes must be at least 1, got {args.num_processes}")
    args.dtypes = list(dict.fromkeys(args.dtypes))  # each row once, in the order given


def estimate_memory_command(argv: Sequence[str]) -> int:
    """``hasten estimate-memory``: 0 when the figures are printed, 2 for bad input (argparse's
    usage error), 1 when the model cannot be built or fetched (offline, a constructor failing)."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    _check_args(parser, args)
    try:
        report = estimate_spec(
            args.model_name,
            args.library_name,
            trust_remote_code=args.trust_remote_code,
            dtypes=args.dtypes,
            num_processes=args.num_processes,
            fsdp=args.fsdp,
        )
    except ModelSpecError as e:
        parser.error(str(e))
    except (ImportError, OSError, RuntimeError, ValueError, TypeError, AttributeError, KeyError) as e:
        print(f"hasten estimate-memory: {e}", file=sys.stderr)
        return 1
    report["model"] = args.model_name
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


# ----------------------------------------------------------------------------- building on meta


def build_model(name: str, library_name: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """The ``nn.Module`` that ``name`` describes, built on the meta device (no memory allocated).

    ``name``: an existing folder (its ``config.json``, built with transformers), ``module:Class``
    (imported from the working directory or ``sys.path``, called with no arguments), or a Hub
    model name. Raises ModelSpecError when ``name`` names nothing that can be built."""
    if library_name not in (None, "transformers", "timm"):
        raise ModelSpecError(f"--library_name {library_name!r}: allowed: transformers, timm")
    if os.path.exists(name):
        if not os.path.isdir(name):
            raise ModelSpecError(f"MODEL {name!r} is a file; give the folder holding its config.json")
        config = os.path.join(name, "config.json")
        if not os.path.isfile(config):
            raise ModelSpecError(f"MODEL {name!r}: the folder has no config.json (a transformers model's config)")
        return _from_transformers_config(name, name, trust_remote_code)
    if ":" in name:
        return _from_import_path(name)
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep in name.replace("/", ""):
        raise ModelSpecError(f"MODEL {name!r}: no such folder")
    if library_name == "timm":
        return _from_timm(name)
    return _from_hub(name, trust_remote_code)


def _on_meta(build: Any) -> Any:
    """``build()`` with every parameter and buffer it creates on the meta device."""
    import torch

    with torch.device("meta"):
        return build()


def _from_import_path(spec: str) -> Any:
    """``module:Class`` (or ``module:Outer.factory``): imported, called with no arguments on meta."""
    import importlib
    import inspect

    from torch import nn

    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ModelSpecError(f"MODEL {spec!r}: expected module:Class (e.g. mypackage.models:Net)")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a module of the working directory
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ModelSpecError(f"MODEL {spec!r}: no module named {e.name!r}") from None
        raise
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ModelSpecError(f"MODEL {spec!r}: {getattr(target, '__name__', target)!r} has no attribute {part!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ModelSpecError(f"MODEL {spec!r} is a {type(target).__name__}, not a class or function")
    required = _required_parameters(target, inspect)
    if required:
        raise ModelSpecError(
            f"MODEL {spec!r} needs arguments ({', '.join(required)}); estimate-memory calls it with none: "
            "give a class or a function that builds the model without arguments"
        )
    model = _on_meta(target)
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"MODEL {spec!r} built a {type(model).__name__}, not a torch.nn.Module")
    return model


def _required_parameters(target: Any, inspect: Any) -> list[str]:
    """The names of ``target``'s parameters that have no default (none when it cannot tell)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in signature.parameters.values() if p.default is p.empty and p.kind not in kinds]


def _from_transformers_config(source: str, label: str, trust_remote_code: bool) -> Any:
    """The model a ``config.json`` (a folder, or a Hub name) describes, built with transformers on
    meta: the class its ``architectures`` names (the model one trains, head included), else the
    ``auto_map``'s ``AutoModelFor...`` (remote code), else ``AutoModel``. Its layer counts are
    checked first (whole numbers; a stack of more than ``FULL_BUILD_LAYERS``: ``TooManyLayers``)."""
    transformers = _transformers(label)
    config = _read_config(source, label)
    big = {path: n for path, n in _layer_fields(config) if isinstance(n, int) and n > FULL_BUILD_LAYERS}
    if big:
        raise TooManyLayers(label, source, config, big)
    return _build_from_config(transformers, source, label, trust_remote_code)


def _transformers(label: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            f"{label!r} is a transformers model: install transformers (pip install 'hasten[transformers]')"
        ) from None
    return transformers


def _build_from_config(transformers: Any, source: str, label: str, trust_remote_code: bool) -> Any:
    try:
        config = transformers.AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as e:
        if _is_strict_validation_error(e):  # a field of the wrong type: huggingface_hub's strict dataclasses
            raise ModelSpecError(f"MODEL {label!r}: config.json: {' '.join(str(e).split())}") from None
        raise
    auto_map = getattr(config, "auto_map", None) or {}
    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is not None and not auto_map:
        return _on_meta(lambda: cls(config))
    auto_name = next((key for key in auto_map if key.startswith("AutoModelFor")), "AutoModel")
    auto = getattr(transformers, auto_name, transformers.AutoModel)
    return _on_meta(lambda: auto.from_config(config, trust_remote_code=trust_remote_code))


def _is_strict_validation_error(error: Exception) -> bool:
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: no strict dataclasses
        return False
    return isinstance(error, StrictDataclassError)


def _read_config(source: str, label: str) -> dict:
    """``source/config.json`` as a dict, its layer counts checked (ints >= 0, or null)."""
    try:
        with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelSpecError(f"MODEL {label!r}: its config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelSpecError(f"MODEL {label!r}: its config.json holds a {type(config).__name__}, not a JSON object")
    for path, value in _layer_fields(config):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ModelSpecError(
                f"MODEL {label!r}: config.json: {'.'.join(path)} must be a number of layers (an integer >= 0), "
                f"got {value!r} ({type(value).__name__})"
            )
    return config


def _layer_fields(config: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """The layer counts of a config dict and of its sub-configs: (path of keys, value)."""
    found: list[tuple[tuple[str, ...], Any]] = []
    for key, value in config.items():
        if key in LAYER_FIELDS:
            found.append(((*prefix, key), value))
        elif isinstance(value, dict):
            found += _layer_fields(value, (*prefix, key))
    return found


def _from_hub(name: str, trust_remote_code: bool) -> Any:
    """A Hub model from its ``config.json`` alone (fetched with huggingface_hub, or its cached copy)."""
    try:
        from huggingface_hub import errors as hub_errors
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ModelSpecError(
            f"MODEL {name!r}: no such folder, and huggingface_hub (to fetch it from the Hub) is not installed"
        ) from None
    try:
        config = hf_hub_download(name, "config.json")
    except hub_errors.GatedRepoError:
        raise OSError(f"{name!r} is gated on the Hub: log in (hf auth login) with an account that has access") from None
    except (hub_errors.RepositoryNotFoundError, hub_errors.HFValidationError):
        raise ModelSpecError(
            f"MODEL {name!r}: no such folder, module:Class, or model on the Hugging Face Hub"
        ) from None
    except hub_errors.LocalEntryNotFoundError:
        raise OSError(
            f"MODEL {name!r}: no such folder, and its config.json cannot be fetched from the Hugging Face Hub: "
            "offline (HF_HUB_OFFLINE) or the Hub cannot be reached, and it is not in the local cache; give a local "
            "folder holding a config.json, or a module:Class"
        ) from None
    except hub_errors.EntryNotFoundError:
        raise ModelSpecError(
            f"MODEL {name!r}: the Hub repository has no config.json (a timm model: pass --library_name timm)"
        ) from None
    return _from_transformers_config(os.path.dirname(config), name, trust_remote_code)


def _from_timm(name: str) -> Any:
    """A timm model (an architecture name, or ``org/name`` on the Hub) without its weights."""
    try:
        import timm
    except ImportError:
        raise ImportError(f"{name!r} with --library_name timm: install timm (pip install timm)") from None
    source = name if ":" in name or "/" not in name else f"hf-hub:{name}"
    return _on_meta(lambda: timm.create_model(source, pretrained=False))


# ----------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class _Tensor:
    """What the figures need of one parameter or buffer (counted once, even when tied)."""

    name: str
    shape: tuple[int, ...]
    floating: bool
    own_bytes: int  # bytes per element in the dtype it was built with (for integer buffers)
    parameter: bool
    trainable: bool

    def nbytes(self, dtype: str, shards: int = 1) -> int:
        """Bytes in ``dtype`` (floating tensors; others keep theirs), for one of ``shards``
        padded dim-0 chunks (``fully_shard``'s split; a 0-dim tensor is not split)."""
        rows = self.shape[0] if self.shape else 1
        numel = _prod(self.shape)
        if shards > 1 and self.shape:
            numel = numel // rows * -(-rows // shards) if rows else 0
        if not self.floating:
            return numel * self.own_bytes
        return -(-numel * DTYPE_BITS[dtype] // 8)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _tensors(model: Any) -> list[_Tensor]:
    tensors = [
        _Tensor(n, tuple(p.shape), p.is_floating_point(), p.element_size(), True, p.requires_grad)
        for n, p in model.named_parameters()
    ]
    tensors += [
        _Tensor(n, tuple(b.shape), b.is_floating_point(), b.element_size(), False, False)
        for n, b in model.named_buffers()
    ]
    return tensors


def _layers(model: Any) -> list[str]:
    """The names of the model's layers: modules without children or of a ``_no_split_modules``
    class, and the parameters and buffers held directly by a module that has children."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    layers: list[str] = []
    pending = [("", model)]  # a stack, in the order the modules are listed
    while pending:
        prefix, module = pending.pop()
        children = list(module.named_children())
        if not children or (prefix and type(module).__name__ in no_split):  # "": a model of one layer
            layers.append(prefix)
            continue
        dot = f"{prefix}." if prefix else ""
        layers += [dot + n for n, _ in module.named_parameters(recurse=False)]
        layers += [dot + n for n, _ in module.named_buffers(recurse=False)]
        pending += [(dot + n, child) for n, child in reversed(children)]
    return layers or [""]


def _largest_layer(model: Any, tensors: list[_Tensor]) -> tuple[list[str], list[_Tensor]]:
    """The largest layers' names (ties: every one of them) and the tensors of the first. Each
    tensor is given to the layer its name lies in, in one pass (layers never hold each other)."""
    layers = _layers(model)
    members: dict[str, list[_Tensor]] = {layer: [] for layer in layers}
    for t in tensors:
        if "" in members:  # the whole model is one layer
            members[""].append(t)
            continue
        parts = t.name.split(".")
        owner = next((".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in members), None)
        if owner is not None:
            members[owner].append(t)
    sizes = {layer: sum(t.nbytes("float32") for t in members[layer]) for layer in layers}
    biggest = max(sizes.values())
    names = [layer for layer, size in sizes.items() if size == biggest]
    return names, members[names[0]]


def estimate(model: Any, dtypes: Sequence[str] = DEFAULT_DTYPES, *, num_processes: int = 1, fsdp: bool = False) -> dict:
    """The figures for ``model`` (a module, best on meta), per process, as a JSON-ready dict:
    ``parameters``, ``largest_layer`` (names, parameters) and one row per dtype with bytes:
    ``largest_layer``, ``total`` (to load), ``training_adam`` (None for int8/int4) and the
    ``training`` parts it sums. Raises ValueError for an unknown dtype or ``num_processes < 1``."""
    for dtype in dtypes:
        if dtype not in DTYPE_BITS:
            raise ValueError(f"dtypes: unknown dtype {dtype!r}; allowed: {', '.join(DTYPE_BITS)}")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int of at least 1, got {num_processes!r}")
    tensors = _tensors(model)
    names, layer = _largest_layer(model, tensors)
    shards = num_processes if fsdp else 1
    rows = [_row(dtype, tensors, layer, shards, fsdp) for dtype in dtypes]
    return {
        "model": type(model).__name__,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": sum(_prod(t.shape) for t in tensors if t.parameter),
        "largest_layer": {"names": names, "parameters": sum(_prod(t.shape) for t in layer if t.parameter)},
        "num_processes": num_processes,
        "fsdp": fsdp,
        "rows": rows,
    }


def _row(dtype: str, tensors: list[_Tensor], layer: list[_Tensor], shards: int, fsdp: bool) -> dict:
    """One dtype's figures per process (see the module's docstring for what each one counts)."""
    params = sum(t.nbytes(dtype, shards) for t in tensors if t.parameter)
    buffers = sum(t.nbytes(dtype) for t in tensors if not t.parameter)
    largest = sum(t.nbytes(dtype) for t in layer)
    gathered = largest if fsdp else 0
    row: dict[str, Any] = {"dtype": dtype, "largest_layer": largest, "total": params + buffers + gathered}
    if dtype not in TRAINABLE_DTYPES:
        row["training_adam"] = None
        return row
    trained = sum(t.nbytes(dtype, shards) for t in tensors if t.trainable)
    gathered_grads = sum(t.nbytes(dtype) for t in layer if t.trainable) if fsdp else 0
    parts = {
        "weights": params + buffers,
        "gradients": trained,
        "optimizer_states": 2 * trained,
        "gathered_layer": gathered + gathered_grads,
    }
    row["training_adam"] = sum(parts.values())
    row["training"] = parts
    return row


# ----------------------------------------------------------------------------- many layers


def estimate_spec(
    name: str,
    library_name: str | None = None,
    *,
    trust_remote_code: bool = False,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
    num_processes: int = 1,
    fsdp: bool = False,
) -> dict:
    """``estimate(build_model(name, ...), ...)``, and for a transformers config whose stacks
    hold more than ``FULL_BUILD_LAYERS`` layers, the same figures counted from builds of
    ``SAMPLE_LAYERS`` and ``SAMPLE_LAYERS + 1`` layers: every figure grows by the same amount per
    layer when the layers are identical (checked: the last half of each stack of the larger build
    must be the same, else ``ModelSpecError``). Then ``largest_layer`` has a ``count`` (its
    ``names`` are those of the sample) and ``repeated_layers`` says what was counted so."""
    try:
        model = build_model(name, library_name, trust_remote_code=trust_remote_code)
    except TooManyLayers as many:
        return _estimate_repeated(many, trust_remote_code, dtypes, num_processes, fsdp)
    return estimate(model, dtypes, num_processes=num_processes, fsdp=fsdp)


def _estimate_repeated(
    many: TooManyLayers, trust_remote_code: bool, dtypes: Sequence[str], num_processes: int, fsdp: bool
) -> dict:
    def report(counts: dict[tuple[str, ...], int], grown: tuple[str, ...] | None) -> dict:
        model = _sample_model(many, counts, trust_remote_code)
        if grown is not None:
            _check_identical(model, counts[grown], many.label, grown, many.big[grown])
        return estimate(model, dtypes, num_processes=num_processes, fsdp=fsdp)

    sample = dict.fromkeys(many.big, SAMPLE_LAYERS)
    base = report(sample, None)
    steps = [
        (report({**sample, path: SAMPLE_LAYERS + 1}, path), count - SAMPLE_LAYERS) for path, count in many.big.items()
    ]
    names = base["largest_layer"]["names"]
    count = len(names) + sum(n * (len(r["largest_layer"]["names"]) - len(names)) for r, n in steps)
    out = _grown(base, steps)
    out["largest_layer"]["count"] = count
    out["repeated_layers"] = [
        {
            "field": ".".join(path),
            "layers": n,
            "built": SAMPLE_LAYERS + 1,
            "identical": SAMPLE_LAYERS + 1 - SAMPLE_LAYERS // 2,
        }
        for path, n in many.big.items()
    ]
    return out


def _grown(base: Any, steps: list[tuple[Any, int]]) -> Any:
    """``base`` with every integer grown by ``n`` times its step in each ``(report, n)``."""
    if isinstance(base, dict):
        return {key: _grown(value, [(r[key], n) for r, n in steps]) for key, value in base.items()}
    if isinstance(base, list) and all(isinstance(item, dict) for item in base):
        return [_grown(item, [(r[i], n) for r, n in steps]) for i, item in enumerate(base)]
    if isinstance(base, int) and not isinstance(base, bool):
        return base + sum(n * (r - base) for r, n in steps)
    return base


def _sample_model(many: TooManyLayers, counts: dict[tuple[str, ...], int], trust_remote_code: bool) -> Any:
    """The model of ``many.config`` with these layer counts (lists as long as a count, such as
    ``layer_types``, cut to it), built from a copy of its folder's config and code."""
    import copy
    import shutil
    import tempfile

    config = copy.deepcopy(many.config)
    for path, count in counts.items():
        level = config
        for key in path[:-1]:
            level = level[key]
        before = level[path[-1]]
        level[path[-1]] = count
        for key, value in level.items():
            if isinstance(value, list) and len(value) == before:
                level[key] = value[:count]
    with tempfile.TemporaryDirectory(prefix="hasten-estimate-") as folder:
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        for entry in os.listdir(many.source):  # the modelling code a folder ships (remote code)
            if entry.endswith(".py") and os.path.isfile(os.path.join(many.source, entry)):
                shutil.copyfile(os.path.join(many.source, entry), os.path.join(folder, entry))
        return _build_from_config(_transformers(many.label), folder, many.label, trust_remote_code)


def _check_identical(model: Any, length: int, label: str, path: tuple[str, ...], layers: int) -> None:
    """Each stack of ``length`` blocks (a ModuleList or Sequential) has its last half identical
    (module types, tensor names, shapes, dtypes, trainable flags); else a ModelSpecError."""
    from torch import nn

    stacks = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) == length]
    field = f"{'.'.join(path)}={layers:,}"
    refuse = (
        f"MODEL {label!r}: {field} is more layers than estimate-memory builds one by one ({FULL_BUILD_LAYERS:,}), "
        f"and they cannot be counted from a build of {length}: "
    )
    if not stacks:
        raise ModelSpecError(refuse + f"it holds no stack of {length} modules; give a config with fewer layers")
    for stack in stacks:
        blocks = list(stack)[length // 2 :]
        first = _signature(blocks[0])
        odd = next((i for i, block in enumerate(blocks) if _signature(block) != first), None)
        if odd is not None:
            raise ModelSpecError(
                refuse + f"its layers {length // 2} and {length // 2 + odd} differ; give a config with fewer layers"
            )


def _signature(block: Any) -> tuple:
    modules = tuple((n, type(m).__name__) for n, m in block.named_modules())
    tensors = tuple(
        (n, tuple(t.shape), t.dtype, t.requires_grad)
        for n, t in [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]
    )
    return modules, tensors


# ----------------------------------------------------------------------------- the table


def format_report(report: dict) -> str:
    """The table ``hasten estimate-memory`` prints (Accelerate's columns), then a line with the
    parameter count and the largest layer's name."""
    from hasten.utils.other import convert_bytes  # Accelerate's units (loads torch: only once estimated)

    n = report["num_processes"]
    title = f"Memory Usage for loading `{report['model']}`"
    if report["fsdp"]:
        title += f", per process (FSDP over {n} process{'es' if n > 1 else ''})"
    elif n > 1:
        title += f", per process ({n} processes, each holding the whole model)"
    rows = [
        [
            row["dtype"],
            convert_bytes(row["largest_layer"]),
            convert_bytes(row["total"]),
            "N/A" if row["training_adam"] is None else convert_bytes(row["training_adam"]),
        ]
        for row in report["rows"]
    ]
    layer = report["largest_layer"]
    first = f"`{layer['names'][0]}`" if layer["names"][0] else "the whole model"
    more = layer.get("count", len(layer["names"])) - 1
    same = f" (and {more:,} more of the same size)" if more else ""
    footer = (
        f"{report['parameters']:,} parameters ({report['class'].rsplit('.', 1)[-1]}); largest layer: {first}{same}, "
        f"{layer['parameters']:,} parameters. Activations are not counted."
    )
    for repeated in report.get("repeated_layers", ()):
        footer += (
            f"\n{repeated['field']}={repeated['layers']:,}: counted from a build of {repeated['built']} layers "
            f"(the last {repeated['identical']} identical); the other {repeated['layers'] - repeated['built']:,} "
            "are counted as copies of the last."
        )
    return _box_table(list(HEADERS), rows, title) + "\n" + footer


def _box_table(headers: list[str], rows: list[list[str]], title: str) -> str:
    """A box-drawn table with a title row, every cell centred."""
    widths = [max(len(r[i]) for r in [headers, *rows]) + 2 for i in range(len(headers))]
    inner = sum(widths) + len(widths) - 1
    if len(title) + 2 > inner:
        widths[-1] += len(title) + 2 - inner
        inner = len(title) + 2

    def line(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * w for w in widths) + right

    def cells(values: list[str]) -> str:
        return "│" + "│".join(v.center(w) for v, w in zip(values, widths)) + "│"

    out = ["┌" + "─" * inner + "┐", "│" + title.center(inner) + "│", line("├", "┬", "┤"), cells(headers)]
    out += [line("├", "┼", "┤")] + [cells(r) for r in rows] + [line("└", "┴", "┘")]
    return "\n".join(out)
