"""N-D parallelism: Accelerate's ``ParallelismConfig`` (``accelerate.parallelism_config``).

A run's processes form one torch ``DeviceMesh`` with six named dims, in torchtitan's order
(Accelerate's five, with hasten's ``pp`` outermost): ``pp`` (pipeline stages, see
``hasten.strategies.pipeline_parallel.split``), ``dp_replicate`` (replicas of the model, e.g. one per machine),
``dp_shard`` (FSDP shards inside a replica), ``cp`` (context parallel: the sequence split, ring
attention), ``sp`` (sequence parallel: the sequence split, Ulysses' all-to-all of heads, see
``hasten.strategies.sequence_parallel``) and ``tp`` (tensor parallel: each layer's matrices split).
Three flattened dims are made from them: ``dp`` (dp_replicate x dp_shard: the ranks that read
different data), ``dp_shard_cp`` (dp_shard x cp x sp: what FSDP shards over; the cp and sp ranks
hold different parts of the same batch, so their partial gradients are reduced there too, as in
Accelerate and torchtitan) and ``dp_cp`` (what a loss is averaged over).

The config is checked where it is written (sizes are integers >= 1) and against the
number of processes at ``Accelerator(parallelism_config=...)``; the mesh is built once
there (:func:`build_mesh`), and the strategies take sub-meshes of it. Importing this module
does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hasten import _validate as v
from hasten.settings import environment as env
from hasten.settings.expert_parallel import TorchExpertParallelConfig, check_expert_parallel
from hasten.settings.pipeline import TorchPipelineParallelConfig

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

#: mesh dims, outermost first (torchtitan's order: ranks next to each other share tp, then sp, then cp;
#: pp outermost). sp has a dim of its own (Accelerate's ``mesh["sp"]``), never above 1 with cp
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")
#: expert parallelism's dims, made from dp_shard (efsdp x ep): the experts split over ep, FSDP over efsdp
EP_DIMS = ("efsdp", "ep")
#: what a tensor-parallel plan may map a module to
TP_STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "rowwise_rep",
    "colwise_gather_output",
    "embedding_rowwise",
    "replicated_with_grad_allreduce",
)
CP_COMM_STRATEGIES = ("allgather", "alltoall")
#: context parallelism's implementations hasten runs (Accelerate's only one too)
CP_BACKENDS = ("torch",)
#: Accelerate's sequence-parallel backends: Ulysses on FSDP2 ("torch", hasten's), DeepSpeed's ALST/Ulysses
#: (which hasten does not run: refused with sp_size > 1)
SP_BACKENDS = ("torch", "deepspeed")
#: attention kernels Accelerate's sequence parallelism takes (besides a hub-hosted flash-attn kernel)
SP_ATTN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "sdpa")


@dataclass
class TorchTensorParallelConfig:
    """Accelerate's tensor-parallel handler. ``enable_async_tp`` (asynchronous TP, CUDA and
    torch.compile only) is accepted for compatibility; hasten runs TP synchronously."""

    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        v.check_bool("TorchTensorParallelConfig", "enable_async_tp", self.enable_async_tp)


@dataclass
class TorchContextParallelConfig:
    """Accelerate's context-parallel handler: how the key/value shards travel between the
    ``cp`` ranks (torch's ring attention rotate method)."""

    cp_comm_strategy: str = "allgather"

    def __post_init__(self) -> None:
        self.cp_comm_strategy = v.check_choice(
            "TorchContextParallelConfig", "cp_comm_strategy", self.cp_comm_strategy, CP_COMM_STRATEGIES
        )


@dataclass
class DeepSpeedSequenceParallelConfig:
    """Accelerate's sequence-parallel handler (``ParallelismConfig.sp_handler``; DeepSpeed's
    ALST/Ulysses). It is checked as Accelerate checks it, but hasten does not run DeepSpeed, so
    a ``ParallelismConfig`` that would use it (``sp_size > 1``) is refused. Unlike Accelerate's,
    it reads no ``PARALLELISM_CONFIG_SP_*`` variable: ``sp_seq_length_is_variable`` None is True,
    ``sp_allow_recurrent_layers`` (Accelerate 1.16: let models with linear-attention layers through)
    None is False, ``sp_disable_in_eval`` (1.16: every rank runs the whole sequence in eval mode)
    None is True."""

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None
    sp_allow_recurrent_layers: bool | None = None
    sp_disable_in_eval: bool | None = None

    def __post_init__(self) -> None:
        owner = "DeepSpeedSequenceParallelConfig"
        if self.sp_seq_length_is_variable is None:
            self.sp_seq_length_is_variable = True
        if self.sp_allow_recurrent_layers is None:
            self.sp_allow_recurrent_layers = False
        if self.sp_disable_in_eval is None:
            self.sp_disable_in_eval = True
        for name in ("sp_seq_length_is_variable", "sp_allow_recurrent_layers", "sp_disable_in_eval"):
            v.check_bool(owner, name, getattr(self, name))
        if self.sp_seq_length is not None:
            v.check_number(owner, "sp_seq_length", self.sp_seq_length, integer=True, ge=1)
        elif not self.sp_seq_length_is_variable:
            raise ValueError(
                f"{owner}(sp_seq_length_is_variable=False) needs sp_seq_length (the length of every batch's "
                "sequences), got None; give it, or leave sp_seq_length_is_variable True"
            )
        impl = self.sp_attn_implementation
        if impl is None:
            return
        if not isinstance(impl, str):
            raise TypeError(f"{owner}.sp_attn_implementation must be a str or None, got {impl!r}")
        if impl not in SP_ATTN_IMPLEMENTATIONS and not ("/" in impl and "flash-attn" in impl):
            raise ValueError(
                f"{owner}.sp_attn_implementation={impl!r} is not supported with sequence parallelism; allowed: "
                f"{', '.join(map(repr, SP_ATTN_IMPLEMENTATIONS))} or a hub-hosted flash attention kernel "
                "(e.g. 'kernels-community/flash-attn2')"
            )


def _env_size(name: str) -> int:
    return env.env_int(env.PARALLELISM_SIZES[name], 1)


def _pp_handler_from_env() -> TorchPipelineParallelConfig:
    """The pipeline settings ``hasten launch`` exported (``--parallelism_config_pp_schedule``,
    ``--parallelism_config_pp_microbatches``), else the defaults."""
    schedule = (env.get(env.PARALLELISM_CONFIG_PP_SCHEDULE) or "").strip() or "1F1B"
    microbatches = (env.get(env.PARALLELISM_CONFIG_PP_MICROBATCHES) or "").strip()
    return TorchPipelineParallelConfig(
        schedule=schedule,
        microbatches=env.env_int(env.PARALLELISM_CONFIG_PP_MICROBATCHES, 1) if microbatches else None,
    )


@dataclass
class ParallelismConfig:
    """How the processes split the work: ``pp_size x dp_replicate_size x dp_shard_size x cp_size x
    tp_size`` must equal the number of processes.

    - ``dp_shard_size > 1``: FSDP2 over those ranks; with ``dp_replicate_size > 1`` too, HSDP
      (shard inside a replica, all-reduce the gradients across replicas).
    - ``dp_replicate_size > 1`` alone: plain data parallelism, run as DDP.
    - ``tp_size > 1``: tensor parallelism on the ``tp`` dim with ``tp_plan`` (module-name
      patterns -> ``"colwise"``/``"rowwise"``; else the model's own ``_tp_plan`` or its config's
      ``base_model_tp_plan``), FSDP on the data dims.
    - ``cp_size > 1``: context parallelism (CUDA only), see ``Accelerator.maybe_context_parallel``.
    - ``sp_size > 1`` with ``sp_backend="torch"``: Ulysses sequence parallelism on FSDP2 (any
      device): inside ``Accelerator.maybe_context_parallel`` each process keeps a contiguous slice
      of each sequence and the attention exchanges heads for sequence (all-to-all), see
      ``hasten.strategies.sequence_parallel``. Not with ``cp_size > 1`` nor ``pp_size > 1``. Set in
      code, or ``hasten launch --parallelism_config_sp_size N`` (``PARALLELISM_CONFIG_SP_SIZE``); None is 1.
    - ``pp_size > 1`` (hasten's): pipeline parallelism, the outermost dim: the model is split into
      stages (``pp_handler``, a ``TorchPipelineParallelConfig``: schedule, microbatches, split
      points), each stage then parallelized on the other dims; the loop calls
      ``Accelerator.pipeline_step``.
    - ``ep_size > 1`` (hasten's): expert parallelism, carved out of ``dp_shard_size`` (which it must
      divide): each MoE layer's experts are split over ``ep_size`` of the FSDP ranks and sharded
      over the other ``dp_shard_size / ep_size``; ``ep_handler`` (a ``TorchExpertParallelConfig``)
      names the experts modules of a model that does not declare them. See
      ``hasten.strategies.expert_parallel``. Not with ``cp_size`` or ``sp_size > 1``.

    A size left as None comes from the launcher's ``PARALLELISM_CONFIG_*_SIZE`` variables, else 1.

    Accelerate's other fields, last (so positional use is unchanged), are taken so that code
    written for Accelerate runs; only what hasten runs is accepted, else a ``ValueError`` at
    construction names the field, the value and what is allowed:

    - ``cp_backend``: context parallelism's implementation, ``"torch"`` (torch's
      ``context_parallel``), the only one; None: the launcher's ``PARALLELISM_CONFIG_CP_BACKEND``,
      else ``"torch"``.
    - ``sp_size``, ``sp_backend``, ``sp_handler``: Accelerate's sequence parallelism.
      ``sp_backend`` is ``"torch"`` (Ulysses on FSDP2, the default) or ``"deepspeed"`` (DeepSpeed's
      ALST/Ulysses: hasten does not run DeepSpeed, so with it ``sp_size`` must be 1); ``sp_handler``
      is None or, for DeepSpeed's backend only, a ``DeepSpeedSequenceParallelConfig``.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    #: hasten's: the tensor-parallel plan, {module-name pattern: "colwise" | "rowwise" | ...}
    tp_plan: dict[str, str] | None = None
    #: hasten's: pipeline stages (the outermost mesh dim) and how the pipeline runs
    pp_size: int | None = None
    pp_handler: TorchPipelineParallelConfig | None = None
    #: the mesh, once an Accelerator built it (Accelerate's attribute), and its flattened dims
    device_mesh: Any = field(default=None, repr=False, compare=False)
    flattened: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: Accelerate's: context parallelism's implementation ("torch", the only one)
    cp_backend: str | None = None
    #: Accelerate's sequence parallelism: Ulysses on FSDP2 ("torch"), see the class docstring
    sp_size: int | None = None
    sp_backend: str | None = None
    sp_handler: DeepSpeedSequenceParallelConfig | None = None
    #: hasten's expert parallelism: the experts split over ep_size of the dp_shard ranks (carved out of
    #: dp_shard, torchtitan's arithmetic), and which modules are experts (``settings/expert_parallel.py``)
    ep_size: int | None = None
    ep_handler: TorchExpertParallelConfig | None = None

    def __post_init__(self) -> None:
        for name in env.PARALLELISM_SIZES:
            value = getattr(self, name)
            if value is None:
                value = _env_size(name)
            setattr(self, name, v.check_number("ParallelismConfig", name, value, integer=True, ge=1))
        if self.tp_handler is not None and not isinstance(self.tp_handler, TorchTensorParallelConfig):
            raise TypeError(
                f"ParallelismConfig.tp_handler must be a TorchTensorParallelConfig or None, got {self.tp_handler!r}"
            )
        if self.cp_handler is not None and not isinstance(self.cp_handler, TorchContextParallelConfig):
            raise TypeError(
                f"ParallelismConfig.cp_handler must be a TorchContextParallelConfig or None, got {self.cp_handler!r}"
            )
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_size > 1 and self.cp_handler is None:
            strategy = (env.get(env.PARALLELISM_CONFIG_CP_COMM_STRATEGY) or "").strip() or "allgather"
            self.cp_handler = TorchContextParallelConfig(cp_comm_strategy=strategy)
        if self.tp_plan is not None:
            check_tp_plan(self.tp_plan, "ParallelismConfig.tp_plan")
        if self.pp_handler is not None and not isinstance(self.pp_handler, TorchPipelineParallelConfig):
            raise TypeError(
                f"ParallelismConfig.pp_handler must be a TorchPipelineParallelConfig or None, got {self.pp_handler!r}"
            )
        if self.pp_size > 1:
            if self.pp_handler is None:
                self.pp_handler = _pp_handler_from_env()
            self.pp_handler.stages(self.pp_size)  # split points that do not share out over pp_size: refused here
        self._check_accelerate_fields()
        check_expert_parallel(self)  # ep_size (read with the sizes above) against dp_shard_size

    def _check_accelerate_fields(self) -> None:
        """Accelerate's ``cp_backend`` and sequence-parallel fields: their defaults filled in, and
        what hasten cannot run (a backend other than torch's, ``sp_size > 1``) refused."""
        owner = "ParallelismConfig"
        if self.cp_backend is None:
            self.cp_backend = (env.get(env.PARALLELISM_CONFIG_CP_BACKEND) or "").strip() or "torch"
        if self.cp_backend not in CP_BACKENDS:
            raise ValueError(
                f"{owner}.cp_backend={v.shown(self.cp_backend)} is not supported: hasten's context parallelism is "
                f"torch's context_parallel; allowed: {', '.join(map(repr, CP_BACKENDS))}"
            )
        self.sp_size = v.check_number(owner, "sp_size", 1 if self.sp_size is None else self.sp_size, integer=True, ge=1)
        if self.sp_backend is None:
            given = (env.get(env.PARALLELISM_CONFIG_SP_BACKEND) or "").strip() or None  # hasten launch's
            deepspeed = isinstance(self.sp_handler, DeepSpeedSequenceParallelConfig)
            self.sp_backend = given or ("deepspeed" if deepspeed else "torch")
        if self.sp_backend not in SP_BACKENDS:
            raise ValueError(
                f"{owner}.sp_backend={v.shown(self.sp_backend)} is not a sequence-parallel backend; allowed: "
                f"{', '.join(map(repr, SP_BACKENDS))} ('torch': Ulysses on FSDP2)"
            )
        if self.sp_handler is not None and not isinstance(self.sp_handler, DeepSpeedSequenceParallelConfig):
            raise TypeError(
                f"{owner}.sp_handler must be a DeepSpeedSequenceParallelConfig or None, got {v.shown(self.sp_handler)}"
            )
        if self.sp_size > 1:
            self._check_sequence_parallel(owner)

    def _check_sequence_parallel(self, owner: str) -> None:
        """``sp_size > 1``: Ulysses on torch's backend only, not with context parallelism."""
        if self.sp_backend == "deepspeed":
            raise ValueError(
                f"{owner}(sp_size={self.sp_size}, sp_backend='deepspeed') asks for DeepSpeed's ALST/Ulysses; hasten "
                "does not run DeepSpeed. Use sp_backend='torch' (Ulysses on FSDP2, the same all-to-all of heads)"
            )
        if self.sp_handler is not None:
            raise ValueError(
                f"{owner}.sp_handler is a DeepSpeedSequenceParallelConfig, DeepSpeed's settings; with "
                "sp_backend='torch' leave it None (the attention implementation is the model's own)"
            )
        if self.cp_size > 1:
            raise ValueError(
                f"{owner}(sp_size={self.sp_size}, cp_size={self.cp_size}) is not supported: sequence parallelism "
                "runs with FSDP/HSDP, TP and PP, not with context parallelism (both split the sequence); set "
                "cp_size=1 (or sp_size=1)"
            )

    # ------------------------------------------------------------------ Accelerate's views
    @property
    def total_size(self) -> int:
        return self.pp_size * self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different batches (dp_replicate x dp_shard)."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that read the same batch (pp x tp x cp x sp)."""
        return self.pp_size * self.tp_size * self.cp_size * self.sp_size

    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    pp_enabled = property(lambda self: self.pp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)

    @property
    def dp_dim_names(self) -> list[str]:
        return [n for n, on in (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.dp_shard_enabled)) if on]

    @property
    def non_dp_dim_names(self) -> list[str]:
        dims = (("pp", self.pp_enabled), ("tp", self.tp_enabled), ("cp", self.cp_enabled), ("sp", self.sp_enabled))
        return [n for n, on in dims if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The dims FSDP shards over: the cp and sp ranks hold parts of the same batch, so FSDP's
        reduce-scatter over them gathers their partial gradients."""
        dims = (("dp_shard", self.dp_shard_enabled), ("cp", self.cp_enabled), ("sp", self.sp_enabled))
        return [n for n, on in dims if on]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        return self.dp_dim_names + [n for n, on in (("cp", self.cp_enabled), ("sp", self.sp_enabled)) if on]

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dims ``fully_shard`` gets: (dp_replicate, dp_shard_cp) for HSDP, else dp_shard_cp."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def replicate_only(self) -> bool:
        """Plain data parallelism (run as DDP): only ``dp_replicate`` (and ``pp``: DDP on each stage)
        is above 1."""
        return self.dp_shard_size == self.tp_size == self.cp_size == self.sp_size == 1

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Accelerate's: the names and sizes of the dims above 1, in mesh order (hasten's mesh
        keeps every dim; this is what Accelerate's would hold)."""
        active = [(d, self.sizes()[d]) for d in MESH_DIMS if self.sizes()[d] > 1]
        return tuple(n for n, _ in active), tuple(s for _, s in active)

    def sizes(self) -> dict[str, int]:
        return {
            "pp": self.pp_size,
            "dp_replicate": self.dp_replicate_size,
            "dp_shard": self.dp_shard_size,
            "cp": self.cp_size,
            "sp": self.sp_size,
            "tp": self.tp_size,
        }

    # ------------------------------------------------------------------ checks and the mesh
    def check_num_processes(self, num_processes: int) -> None:
        """The product of the sizes must be the number of processes (hasten launch checks it first)."""
        if self.total_size != num_processes:
            sp = f", sp_size={self.sp_size}" if self.sp_size > 1 else ""
            raise ValueError(
                f"ParallelismConfig(pp_size={self.pp_size}, dp_replicate_size={self.dp_replicate_size}, "
                f"dp_shard_size={self.dp_shard_size}, tp_size={self.tp_size}, cp_size={self.cp_size}"
                f"{sp}) multiplies to {self.total_size}, but there are {num_processes} process(es): the product "
                f"pp_size x dp_replicate_size x dp_shard_size x tp_size x cp_size{' x sp_size' if sp else ''} must "
                "equal the number of processes"
            )

    def check_device(self, device_type: str) -> None:
        """Context parallelism needs CUDA: refused elsewhere, naming why."""
        if self.cp_size > 1 and device_type != "cuda":
            raise ValueError(
                f"ParallelismConfig(cp_size={self.cp_size}) needs CUDA GPUs, but this run is on {device_type!r}: "
                "torch's context_parallel splits the sequence of scaled_dot_product_attention and runs ring attention "
                "on the flash/efficient CUDA kernels only. Use cp_size=1 on this device"
            )

    def build_device_mesh(self, device_type: str) -> DeviceMesh:
        """Accelerate's method: the mesh over every process with all six named dims (a dim of
        size 1 is kept, so ``mesh["tp"]`` always exists), plus the flattened ``dp``,
        ``dp_shard_cp`` and ``dp_cp`` dims. Every group of them has the run's timeout
        (``InitProcessGroupKwargs.timeout``, see ``hasten.settings.groups.init_mesh``)."""
        from hasten.settings.groups import flatten_mesh, init_mesh, unflatten_mesh

        sizes = self.sizes()
        mesh = init_mesh(device_type, tuple(sizes[d] for d in MESH_DIMS), MESH_DIMS)
        # kept here too: torch asks callers to hold flattened meshes themselves rather than slice them
        self.flattened = {
            "dp": flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp"),
            "dp_shard_cp": flatten_mesh(mesh["dp_shard", "cp", "sp"], "dp_shard_cp"),
            "dp_cp": flatten_mesh(mesh["dp_replicate", "dp_shard", "cp", "sp"], "dp_cp"),
        }
        if self.ep_size > 1:  # expert parallelism: (dp_replicate, efsdp, ep), dp_shard split with ep innermost
            sizes = (self.dp_shard_size // self.ep_size, self.ep_size)
            self.flattened["experts"] = unflatten_mesh(mesh["dp_replicate", "dp_shard"], "dp_shard", sizes, EP_DIMS)
        self.device_mesh = mesh
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError(
                    "ParallelismConfig.get_device_mesh needs a device_type (e.g. 'cuda' or 'cpu') to build the mesh"
                )
            return self.build_device_mesh(device_type)
        if device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"ParallelismConfig.get_device_mesh: the mesh was built for {self.device_mesh.device_type!r}, "
                f"not {device_type!r}"
            )
        return self.device_mesh

    @classmethod
    def from_env(cls) -> ParallelismConfig | None:
        """The config ``hasten launch --use_parallelism_config`` asked for, else None."""
        raw = (env.get(env.ACCELERATE_USE_PARALLELISM_CONFIG) or "").strip()
        if not raw or not v.parse_bool_text(env.ACCELERATE_USE_PARALLELISM_CONFIG, raw):
            return None
        return cls()


def export_parallelism_switch(settings: dict[str, tuple[Any, str]]) -> None:
    """``hasten launch``: export Accelerate's switch (read by ``from_env``) when
    ``--use_parallelism_config`` or any ``--parallelism_config_*`` setting was given (sizes alone ask
    for it too); ``settings`` maps each launch setting to (value, where it came from)."""
    use, source = settings["use_parallelism_config"]
    sizes_given = any(s != "default" for n, (_, s) in settings.items() if n.startswith("parallelism_config_"))
    if source != "default" or sizes_given:
        switch = "true" if (use if source != "default" else True) else "false"
        env.export({env.ACCELERATE_USE_PARALLELISM_CONFIG: switch})


def check_launch(num_processes: int, cpu: bool) -> ParallelismConfig | None:
    """``hasten launch``: what each worker's ``Accelerator()`` will refuse, refused before they start
    (the config from the exported environment against the number of processes; cp on ``--cpu``).
    All sizes 1 is DDP over every process, as in the Accelerator."""
    config = ParallelismConfig.from_env()
    if config is not None and config.total_size > 1:
        if cpu:
            config.check_device("cpu")
        config.check_num_processes(num_processes)
    return config


def check_tp_plan(plan: Any, where: str) -> dict[str, str]:
    """A plan is a dict of module-name patterns (``*`` matches one name) to a style in TP_STYLES."""
    if not isinstance(plan, dict) or not plan:
        raise TypeError(
            f"{where} must be a non-empty dict of module-name patterns to 'colwise'/'rowwise', got {plan!r}"
        )
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{where} keys must be module names or patterns such as 'layers.*.attn.q', got {key!r}")
        if style not in TP_STYLES:
            raise ValueError(f"{where}[{key!r}] is {style!r}; allowed: {', '.join(TP_STYLES)}")
    return plan


def build_mesh(config: ParallelismConfig | None, num_processes: int, device_type: str) -> DeviceMesh | None:
    """The run's mesh, built once (None without a config, or with one process and nothing to split).

    A config whose sizes are all 1 on several processes is plain data parallelism over all of
    them (``dp_replicate_size`` = the processes), as in Accelerate.
    """
    if config is None:
        return None
    if config.total_size == 1 and num_processes > 1:
        config.dp_replicate_size = num_processes
    config.check_device(device_type)
    config.check_num_processes(num_processes)
    if num_processes == 1:
        return None
    return config.get_device_mesh(device_type)


class DataParallelView:
    """A process state as the data pipeline sees it with a mesh: ``num_processes`` and
    ``process_index`` are those of the data-parallel dims (``dp``), so the tensor- and
    context-parallel ranks of one data group read the same batches. Everything else is the
    process state's."""

    #: several processes read each batch: they must draw the same order and worker seeds
    shares_batches = True

    def __init__(self, state: Any, num_processes: int, process_index: int) -> None:
        self._state = state
        self.num_processes = num_processes
        self.process_index = process_index

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


def data_view(state: Any, config: ParallelismConfig | None) -> Any:
    """``state`` itself without tensor/context parallelism, else its data-parallel view."""
    dp = config.flattened.get("dp") if config is not None else None
    if dp is None or dp.size() == state.num_processes:
        return state
    return DataParallelView(state, dp.size(), dp.get_local_rank())


def mesh_rank(config: ParallelismConfig | None, mesh: DeviceMesh | None, dim: str, what: str) -> int:
    """This process's index on mesh dim ``dim`` (0 where the dim has size 1), as Accelerate's
    ``Accelerator.*_rank`` properties; without a ParallelismConfig a RuntimeError, as there."""
    if config is None:
        raise RuntimeError(
            f"{what} is not configured: pass Accelerator(parallelism_config=ParallelismConfig(...)) first"
        )
    if mesh is None or mesh[dim].size() == 1:
        return 0
    return mesh[dim].get_local_rank()


def context_parallel(
    config: ParallelismConfig | None,
    mesh: DeviceMesh | None,
    buffers: list[Any] | None,
    buffer_seq_dims: list[int] | None,
    no_restore_buffers: set[Any] | None,
) -> Any:
    """torch's ``context_parallel`` on the ``cp`` dim (the buffers split along their sequence
    dims inside the block), or a context that does nothing when ``cp_size`` is 1."""
    import contextlib

    if config is None or mesh is None or not config.cp_enabled:
        return contextlib.nullcontext()
    if buffers is not None and buffer_seq_dims is not None and len(buffers) != len(buffer_seq_dims):
        raise ValueError(
            f"maybe_context_parallel got {len(buffers)} buffers and {len(buffer_seq_dims)} buffer_seq_dims: "
            "give one sequence dim per buffer"
        )
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(config.cp_handler.cp_comm_strategy if config.cp_handler else "allgather")
    return torch_context_parallel(
        mesh["cp"], buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers
    )


def data_representatives(config: ParallelismConfig | None, data_state: Any) -> list[int] | None:
    """The global ranks that stand for each data-parallel rank (pp, cp, sp and tp coordinates 0), in
    data-parallel order, where several processes read the same batches (pipeline, tensor, context
    or sequence parallelism); None where every process reads its own."""
    if not isinstance(data_state, DataParallelView) or config is None or config.device_mesh is None:
        return None
    mesh = config.device_mesh.mesh  # (pp, dp_replicate, dp_shard, cp, sp, tp)
    return mesh[0, :, :, 0, 0, 0].flatten().tolist()


def keep_data_ranks(gathered: Any, ranks: list[int], world: int, objects: bool) -> Any:
    """What every process gathered (tensors concatenated along dim 0 in rank order, or one list
    per rank with ``objects``) with only ``ranks``' parts, in their order: the metrics of each
    data-parallel rank once."""
    import torch

    if objects:
        return [x for r in ranks for x in (gathered[r] if isinstance(gathered[r], list) else [gathered[r]])]

    def keep(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.reshape(world, t.shape[0] // world, *t.shape[1:])[ranks].reshape(-1, *t.shape[1:])

    if isinstance(gathered, dict):
        return type(gathered)({k: keep_data_ranks(v, ranks, world, False) for k, v in gathered.items()})
    if isinstance(gathered, (list, tuple)):
        return type(gathered)(keep_data_ranks(v, ranks, world, False) for v in gathered)
    return keep(gathered)


def dispatch_setting(
    data_state: Any, dispatch_batches: bool | None, config: ParallelismConfig | None = None
) -> bool | None:
    """``dispatch_batches`` for the data pipeline: where several processes share each batch
    (pipeline, tensor or context parallelism) the main process cannot send each process its part
    (the ranks of one data group need the same part), so an iterable dataset is read by each data
    group itself (None resolves to False); True is refused, naming the sizes that share batches."""
    if not isinstance(data_state, DataParallelView):
        return dispatch_batches
    if dispatch_batches:
        sizes = {k: getattr(config, f"{k}_size", 1) for k in ("pp", "tp", "cp", "sp")} if config is not None else {}
        shared = ", ".join(f"{k}_size={n}" for k, n in sizes.items() if isinstance(n, int) and n > 1)
        raise ValueError(
            f"DataLoaderConfiguration(dispatch_batches=True) is not supported with ParallelismConfig("
            f"{shared or 'pp/tp/cp sizes > 1'}): the processes of one data group (pipeline stages, tensor or "
            "context-parallel ranks) read the same batches; leave dispatch_batches None or False (each "
            "data-parallel rank then reads its share of an iterable dataset)"
        )
    return False
