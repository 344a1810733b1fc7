"""The processes: their facts and process group, the device mesh, collectives on nested
tensors, run-on helpers, and launching a function on several processes from Python.

Importing this package loads none of its modules."""
