"""Tensor parallelism: one model split by attention heads and MLP columns over N ranks
(Megatron-style).

The engine process keeps the scheduler, the block manager and sampling, and is rank 0; ranks
1..N-1 are worker processes (local, or Ray actors on other nodes). Each step the engine
sends every worker one packed int64 message (message.py) over ZeroMQ; every rank then runs
the one model graph (engine/models/llama.py) on its shard, whose row-parallel projections
all-reduce (layers.py, comm.py).

    executor.py  TPRunner: the runner the scheduler sees (execute(plan) -> StepOutput), starts
                 workers
    launch.py    starting workers: local processes (mp) or Ray actors in a placement group (ray)
    worker.py    a worker's process: load its shard, wait for steps, run them
    rank.py      what every rank runs: loading its shard (as one engine loads), one step's forward
    shard.py     which rows/columns of each checkpoint tensor a rank holds; reads them sliced
    layers.py    the row-parallel projection and the vocabulary split: all tensor parallelism adds
                 to the graph
    message.py   a step's inputs as one int64 tensor and back
    comm.py      the collectives (a process group of our own, no torch.distributed globals)
"""
