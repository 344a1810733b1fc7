"""The training step's pieces: mixed precision, compile, the optimizer and scheduler wrappers,
Local SGD, the record of prepared objects, seeding and RNG states, profiling and out-of-memory help.

Importing this package loads none of its modules."""
