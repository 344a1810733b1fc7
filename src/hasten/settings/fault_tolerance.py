"""``FaultToleranceKwargs``: training through failures with torchft (PyTorch's fault-tolerance library).

The data-parallel replicas are split into *replica groups* (one ``hasten launch`` each); torchft's
lighthouse keeps them in a quorum. When a group dies the others keep stepping; when it comes back
it heals live from a peer. The handler names the lighthouse, this process's group and the
timeouts; it is translated once, by :mod:`hasten.strategies.fault_tolerance` (its only consumer),
into torchft's ``Manager``. Importing this module imports neither torch nor torchft.

Where a field is None its value comes from the launcher (``hasten launch --ft_replica_group G
--ft_num_replica_groups K --ft_lighthouse URL`` exports ``HASTEN_FT_*``) or, for the lighthouse,
torchft's own ``TORCHFT_LIGHTHOUSE``; code wins over both. Inside a Ray Train worker whose
``torch_config`` is Ray's ``TorchftConfig`` they come from Ray instead (:mod:`hasten.settings.ray_torchft`:
each worker its own replica group, Ray's lighthouse), and a field set in code that says otherwise is
refused; there fault tolerance is on without the handler too (:func:`implied_by_ray`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from hasten import _validate as v
from hasten.settings import environment as env
from hasten.settings import ray_torchft
from hasten.settings.handlers import KwargsHandler

SemiSync = Literal["local_sgd", "diloco"]
SEMI_SYNC_CHOICES: tuple[str, ...] = ("local_sgd", "diloco")
_O = "FaultToleranceKwargs"


@dataclass
class FaultToleranceKwargs(KwargsHandler):
    """Live fault tolerance across replica groups, on torchft.

    ``min_replicas``: the fewest replica groups that may commit a step (torchft's
    ``min_replica_size``). ``lighthouse``: the lighthouse's address (``http://host:port``), else
    ``HASTEN_FT_LIGHTHOUSE`` (``--ft_lighthouse``), else ``TORCHFT_LIGHTHOUSE``. ``replica_group``
    and ``num_replica_groups``: this launch's group (0 .. K-1) and the most groups the job runs
    (the data is sharded by both). ``timeout``: collectives, commits and healing;
    ``quorum_timeout``: waiting for a quorum; ``connect_timeout``: reaching the lighthouse and the
    group's manager. ``semi_sync``/``sync_every``: instead of all-reducing gradients each step,
    the groups train apart and meet every ``sync_every`` optimizer steps: "local_sgd" averages
    their weights (torchft's ``LocalSGD``), "diloco" averages the pseudo-gradients (the weights'
    change since the last sync) and steps an outer optimizer with them (torchft's ``DiLoCo``: SGD
    with ``outer_lr``, ``outer_momentum`` and Nesterov momentum where ``outer_nesterov``, the
    DiLoCo paper's 0.7 / 0.9 / True). ``fragments`` (DiLoCo only): Streaming DiLoCo, the model's
    parameters cut into that many contiguous fragments of about equal size, one synced every
    ``sync_every / fragments`` steps in turn (``sync_every`` a multiple of ``fragments``).
    ``fragment_sync_delay`` (DiLoCo only; torchft's, the Streaming DiLoCo paper's tau): a fragment's
    pseudo-gradient is taken and its all-reduce started that many inner steps before the sync,
    which waits for it, so the communication overlaps those steps (whose updates of the fragment
    the sync then replaces); below ``sync_every / fragments``. ``should_quantize`` (DiLoCo only):
    the pseudo-gradients all-reduced in fp8 (int8 before compute capability 9.0) by torchft's
    triton kernels: it needs a CUDA GPU and triton, and is refused without them (torchft would
    silently send them unquantized).
    ``init_sync``: at the first step every group takes one group's weights (torchft's
    ``init_sync``; the others' first batch is not counted); False where every group builds the
    same weights itself (the same seed), and then the first step counts every group's batch.
    """

    min_replicas: int = 1
    lighthouse: str | None = None
    replica_group: int | None = None
    num_replica_groups: int | None = None
    timeout: timedelta = timedelta(seconds=60)
    quorum_timeout: timedelta = timedelta(seconds=60)
    connect_timeout: timedelta = timedelta(seconds=30)
    semi_sync: SemiSync | None = None
    sync_every: int = 100
    init_sync: bool = True
    fragments: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    fragment_sync_delay: int = 0
    should_quantize: bool = False

    def __post_init__(self) -> None:
        v.check_number(_O, "min_replicas", self.min_replicas, integer=True, ge=1)
        if self.lighthouse is not None:
            self.lighthouse = check_lighthouse(f"{_O}.lighthouse", self.lighthouse)
        if self.num_replica_groups is not None:
            v.check_number(_O, "num_replica_groups", self.num_replica_groups, integer=True, ge=1)
            if self.min_replicas > self.num_replica_groups:
                raise ValueError(
                    f"{_O}.min_replicas={self.min_replicas} is more than num_replica_groups="
                    f"{self.num_replica_groups}: no quorum could ever commit a step"
                )
        if self.replica_group is not None:
            v.check_number(_O, "replica_group", self.replica_group, integer=True, ge=0)
            if self.num_replica_groups is not None and self.replica_group >= self.num_replica_groups:
                raise ValueError(
                    f"{_O}.replica_group={self.replica_group} must be below num_replica_groups="
                    f"{self.num_replica_groups} (groups are numbered 0 .. {self.num_replica_groups - 1})"
                )
        for name in ("timeout", "quorum_timeout", "connect_timeout"):
            _check_timeout(name, getattr(self, name))
        if self.semi_sync is not None:
            v.check_choice(_O, "semi_sync", self.semi_sync, SEMI_SYNC_CHOICES)
        v.check_number(_O, "sync_every", self.sync_every, integer=True, ge=1)
        v.check_bool(_O, "init_sync", self.init_sync)
        self._check_diloco()

    def _check_diloco(self) -> None:
        v.check_number(_O, "fragments", self.fragments, integer=True, ge=1)
        v.check_number(_O, "outer_lr", self.outer_lr, gt=0)
        v.check_number(_O, "outer_momentum", self.outer_momentum, ge=0, lt=1)
        v.check_bool(_O, "outer_nesterov", self.outer_nesterov)
        if self.fragments > 1 and self.semi_sync != "diloco":
            raise ValueError(
                f"{_O}.fragments={self.fragments} needs semi_sync='diloco' (Streaming DiLoCo), got "
                f"semi_sync={self.semi_sync!r}"
            )
        if self.semi_sync == "diloco" and self.sync_every % self.fragments:
            raise ValueError(
                f"{_O}.sync_every={self.sync_every} must be a multiple of fragments={self.fragments} "
                "(one fragment is synced every sync_every / fragments steps)"
            )
        if self.outer_nesterov and self.outer_momentum == 0:
            raise ValueError(f"{_O}.outer_nesterov=True needs outer_momentum > 0, got {self.outer_momentum!r}")
        v.check_number(_O, "fragment_sync_delay", self.fragment_sync_delay, integer=True, ge=0)
        if self.fragment_sync_delay and self.semi_sync != "diloco":
            raise ValueError(
                f"{_O}.fragment_sync_delay={self.fragment_sync_delay} needs semi_sync='diloco', got "
                f"semi_sync={self.semi_sync!r}"
            )
        if self.fragment_sync_delay and self.fragment_sync_delay >= self.sync_every // self.fragments:
            raise ValueError(
                f"{_O}.fragment_sync_delay={self.fragment_sync_delay} must be below sync_every / fragments = "
                f"{self.sync_every // self.fragments} (a fragment's sync must end before its next one starts)"
            )
        self._check_quantize()

    def _check_quantize(self) -> None:
        v.check_bool(_O, "should_quantize", self.should_quantize)
        if not self.should_quantize:
            return
        if self.semi_sync != "diloco":
            raise ValueError(f"{_O}.should_quantize=True needs semi_sync='diloco', got semi_sync={self.semi_sync!r}")
        import torch  # only here: a CPU-only torch cannot quantize

        missing = [
            what for what, ok in (("a CUDA GPU", torch.cuda.is_available()), ("triton", _has_triton())) if not ok
        ]
        if missing:
            raise ValueError(
                f"{_O}.should_quantize=True needs {' and '.join(missing)} (torchft quantizes the pseudo-gradients "
                "with triton kernels on the GPU; without them it would send them unquantized): drop should_quantize"
            )

    def resolved(self) -> FaultToleranceKwargs:
        """A copy with every None field filled from the launcher's environment (``HASTEN_FT_*``,
        ``TORCHFT_LIGHTHOUSE``), checked again as a whole. Code wins; where the launcher said
        otherwise a one-line warning says so. In a Ray Train worker under Ray's ``TorchftConfig``
        the replica group, the number of groups and the lighthouse are Ray's (:meth:`_from_ray`)."""
        ray = ray_torchft.replica_group()
        if ray is not None:
            return self._from_ray(ray)
        group = _from_env("replica_group", self.replica_group, env.HASTEN_FT_REPLICA_GROUP, 0)
        groups = _from_env("num_replica_groups", self.num_replica_groups, env.HASTEN_FT_NUM_REPLICA_GROUPS, 1)
        lighthouse = self.lighthouse
        if lighthouse is None:
            variable = next((n for n in (env.HASTEN_FT_LIGHTHOUSE, env.TORCHFT_LIGHTHOUSE) if env.get(n)), None)
            if variable is None:
                raise ValueError(
                    f"{_O}.lighthouse is not set: pass FaultToleranceKwargs(lighthouse='http://HOST:PORT'), "
                    f"hasten launch --ft_lighthouse URL, or set {env.TORCHFT_LIGHTHOUSE} (start one with "
                    "hasten lighthouse --min_replicas N --port P)"
                )
            lighthouse = check_lighthouse(f"environment variable {variable}", env.require(variable))
        return dataclasses.replace(self, lighthouse=lighthouse, replica_group=group, num_replica_groups=groups)

    def _from_ray(self, ray: ray_torchft.RayReplicaGroup) -> FaultToleranceKwargs:
        """A copy with Ray's replica group, number of groups and lighthouse; a field set in code
        that says otherwise is refused, naming both (Ray replaces a failed worker as that group)."""
        lighthouse = check_lighthouse(f"environment variable {env.TORCHFT_LIGHTHOUSE} (Ray's)", ray.lighthouse)
        for name, mine, theirs, how in (
            ("replica_group", self.replica_group, ray.group, "this worker's replica group, its world rank"),
            ("num_replica_groups", self.num_replica_groups, ray.groups, "the number of replica groups, its world size"),
            ("lighthouse", self.lighthouse, lighthouse, f"the lighthouse it started, {env.TORCHFT_LIGHTHOUSE}"),
        ):
            if mine is not None and mine != theirs:
                raise ValueError(
                    f"{_O}.{name}={mine!r} disagrees with Ray Train's TorchftConfig, which set {theirs!r} ({how}): "
                    f"leave {name} unset under TorchftConfig"
                )
        return dataclasses.replace(self, lighthouse=lighthouse, replica_group=ray.group, num_replica_groups=ray.groups)

    def manager_kwargs(self) -> dict[str, Any]:
        """torchft ``Manager`` arguments this handler sets (a resolved handler: see ``resolved``)."""
        return {
            "min_replica_size": self.min_replicas,
            "lighthouse_addr": self.lighthouse,
            "replica_id": f"hasten_ft_{self.replica_group}",
            "timeout": self.timeout,
            "quorum_timeout": self.quorum_timeout,
            "connect_timeout": self.connect_timeout,
            "init_sync": self.init_sync,
            "use_async_quorum": self.semi_sync != "diloco",  # torchft's DiLoCo needs the quorum synchronous
        }


def implied_by_ray() -> FaultToleranceKwargs | None:
    """The handler an Accelerator without one takes: inside a Ray Train worker under Ray's
    ``TorchftConfig`` the default ``FaultToleranceKwargs()`` (Ray made this worker a replica group
    of its own: without torchft's manager it would train alone), else None."""
    return FaultToleranceKwargs() if ray_torchft.replica_group() is not None else None


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_lighthouse(where: str, value: Any) -> str:
    """A lighthouse address ``http(s)://host:port``, stripped; ``where`` names the field in the error."""
    if not isinstance(value, str) or not value.strip():
        raise TypeError(f"{where} must be the lighthouse's address such as 'http://host:29510', got {value!r}")
    value = value.strip()
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("http", "https") or ":" not in rest.rstrip("/"):
        raise ValueError(
            f"{where} must be an address such as 'http://host:29510' (scheme, host and port), got {value!r}"
        )
    return value


def _check_timeout(name: str, value: Any) -> None:
    if not isinstance(value, timedelta):
        raise TypeError(
            f"{_O}.{name} must be a datetime.timedelta (e.g. timedelta(seconds=60)), got {value!r} "
            f"({type(value).__name__})"
        )
    if value < timedelta(seconds=1):
        raise ValueError(f"{_O}.{name} must be at least 1 second (torchft counts whole seconds), got {value!r}")


def _from_env(name: str, code: int | None, variable: str, default: int) -> int:
    raw = env.get(variable)
    launched = None if raw in (None, "") else v.parse_int_text(f"environment variable {variable}", raw)
    if code is None:
        return default if launched is None else launched
    if launched is not None and launched != code:
        warnings.warn(f"{_O}.{name}={code} in code overrides {variable}={launched} from the launcher", stacklevel=4)
    return code
