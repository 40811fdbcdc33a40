"""Tensor parallelism: one model split by attention heads and MLP columns over N ranks (Megatron-style).

The engine process keeps the scheduler, the block manager and sampling, and is rank 0; ranks 1..N-1
are worker processes (local, or Ray actors on other nodes). Each step the engine sends every worker
one packed int64 message (message.py) over ZeroMQ; every rank then runs the same forward on its shard
(model.py), joined by one all-reduce after each row-parallel GEMM (comm.py, torch.distributed).

    executor.py  TPRunner: the runner the scheduler sees (execute(plan) -> StepOutput), starts workers
    launch.py    starting workers: local processes (mp) or Ray actors in a placement group (ray)
    worker.py    a worker's process: load its shard, wait for steps, run them
    shard.py     which rows/columns of each checkpoint tensor a rank holds; loads them sliced
    model.py     the forward of one shard, with its collectives
    message.py   a step's inputs as one int64 tensor and back
    comm.py      the collectives (a process group of our own, no torch.distributed globals)
"""
