"""What the run was asked to do: the kwargs handlers and Accelerate's plugin dataclasses, the
closed sets of choices, N-D parallelism, the environment variables (the one module that reads
them), the config file (hasten's and Accelerate's formats, the launch settings it holds) and the
resolution of the Accelerator's arguments (code, else launcher, else config file); with them, the
translations of handlers that need a piece of torch (``comm_hooks``, ``groups``: the run's timeout
on every group and mesh).

The ground floor: nothing here imports hasten above it (tests/test_import_cycles.py checks it).
Importing this package loads none of its modules."""
