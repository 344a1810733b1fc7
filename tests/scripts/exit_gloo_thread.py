"""The abort at exit, made certain: a gloo thread needs the GIL while the interpreter finalizes.

Each rank starts an all_reduce with a Python callback on its future (the callback runs on the
gloo worker thread when the collective completes, and needs the GIL), rank 1 joins it 2 s late,
and a global whose ``__del__`` sleeps keeps rank 0's interpreter in its teardown meanwhile.
Under a plain interpreter exit the callback's GIL request comes while the interpreter is
finalizing: Python ends the thread with ``pthread_exit``, the unwinding crosses a C++ frame
that may not throw, and the process dies with ``terminate called without an active exception``
(SIGABRT). hasten's worker ends in order and leaves with ``os._exit`` first.
"""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:
    time.sleep(2)
future = dist.all_reduce(torch.ones(1), async_op=True).get_future()
future.then(lambda _: None)


class SlowTeardown:
    def __del__(self) -> None:
        time.sleep(4)  # in the interpreter's teardown, with the GIL released


slow = SlowTeardown()
print(f"rank {rank} done", flush=True)
