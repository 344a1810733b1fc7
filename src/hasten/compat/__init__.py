"""Accelerate's global-state emulation, for scripts that ask for "the" state.

Accelerate keeps its process facts and loop position in process-wide singletons:
``PartialState()``, ``AcceleratorState()`` and ``GradientState()`` return (or share) the
state of the most recent Accelerator, and ``_reset_state()`` empties them. hasten passes its
states explicitly, so only Accelerate's names need these: ``state`` has the three classes,
``data_loader`` Accelerate's data-loading constructors and free functions, which read them.
hasten's runtime never imports this package; the public names load from Accelerate's paths
(``hasten``, ``hasten.distributed.state``, ``hasten.data_loader``, ``hasten.utils``) on first use.
"""
