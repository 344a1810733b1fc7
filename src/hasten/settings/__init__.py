"""What the run was asked to do: the kwargs handlers and Accelerate's plugin dataclasses, the
closed sets of choices, N-D parallelism, the environment variables (the one module that reads
them) and the resolution of the Accelerator's arguments (code, else launcher, else config file).

Importing this package loads none of its modules."""
