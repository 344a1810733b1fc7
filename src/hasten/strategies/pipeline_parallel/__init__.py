"""Pipeline parallelism (``ParallelismConfig(pp_size=...)``), one module a role:

* ``split.py``: the split plan (which blocks each stage runs) and each stage built from the model
  by deletion, keeping the whole model's names;
* ``schedule.py``: the split step of the parallelize pipeline, the prepared :class:`PipelineModule`
  and its step over torch's pipeline schedules (``Accelerator.pipeline_step``);
* ``strategy.py``: :class:`PipelineStrategy`, around the data dims' strategy, so that state dicts,
  checkpoints and clipping see the whole model.

``strategies/parallelize.py`` stays the one place that orders the steps. Importing this package
loads none of its modules.
"""
