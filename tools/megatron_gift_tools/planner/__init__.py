"""``megatron-gift model``: the planner. An analytic step-time model of Megatron data-parallel
training that prices Megatron's FP32/BF16 rings and the plugin's FP8 exchanges as the plugin's
GPU execution model runs them, and says whether FP8 gradients (and the delta parameter gather)
pay on a given cluster, model and batch. docs/planner.md states the model and its sources.

Modules (torch-free unless noted): ``choices`` (the planner's own option enums), ``cluster``
(machines and their sources), ``workloads`` (models, batches, TP/PP), ``schemes`` (Megatron's
rings and the plugin's modes over each exchange; torch: ``config.Mode``), ``options`` (schedules,
gather, buckets, refresh; torch: ``config``), ``nccl`` (NCCL's own collective cost model),
``costs`` (GPU kernel costs from HBM traffic; torch: the wire format), ``metered`` (each GPU
stage's launches and moved bytes from the launch meter's JSON), ``buckets`` (Megatron's
buckets and bytes; torch), ``tasks`` (a task and where a bucket is reduced), ``stages`` (each
bucket's stage streams as tasks), ``refresh`` (a GIFT refresh's bytes and chain), ``simulate`` (the
eager and lagged schedules), ``model`` (step time, plan, break-even, sensitivity), ``output``
(Markdown), ``checks`` (bytes against ``bench comm``'s JSON), ``validation`` (step times against
CPU gloo runs), ``cli`` (the command's arguments), ``handler`` (the command's run). The training path
imports nothing here (``tests/docs/test_runtime_imports.py``); only ``validation`` imports the demo and its
corpus, inside the function that trains.
"""
