"""Big-model loading: models bigger than memory, placed by a device map over accelerators, the
CPU and the disk (Accelerate's ``accelerate.hooks``, ``accelerate.big_modeling``'s dispatchers,
``accelerate.utils.modeling``'s planners and loaders, ``accelerate.utils.offload``), one module by
concern, re-exported at Accelerate's paths (``hasten.hooks``, ``hasten.big_modeling``,
``hasten.utils.modeling``, ``hasten.utils.offload``):

- ``tensors``: a model's tensors and sizes (``set_module_tensor_to_device``, tied weights,
  ``compute_module_sizes``);
- ``planning`` and ``planner``: memory budgets and ``infer_auto_device_map``;
- ``hooks``: the hook mechanism (``ModelHook``, ``add_hook_to_module``, ``module._hf_hook``);
- ``align`` and ``blocks``: the hooks that move weights and inputs (``AlignDevicesHook``,
  ``CpuOffload``) and their attachment over a model by blocks;
- ``offload``: the offload folder (raw ``.dat`` files and ``index.json``; read without pickle);
- ``loading``: ``load_checkpoint_in_model`` with a device map and disk offload;
- ``dispatch``: ``dispatch_model``, ``cpu_offload``, ``disk_offload``, ``load_checkpoint_and_dispatch``.
"""
