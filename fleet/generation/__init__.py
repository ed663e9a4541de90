"""Batch generation across the fleet, in four rooms; each arrow points down the list:

    data/       rows in, results out, a job's records: inputs, store, manifest, export, checks (no network)
    hotpath/    rows through the servers: dispatch, client, health, hedging, the work of one row
    job/        one job on one node: the detached runner, its checks before, its start and watch
    multinode/  one job over several nodes: the chunk plan and the controller

A room imports only the rooms above it in this list (and the core); tests/test_layers.py holds it.
Each room's `__init__` names its modules. The answer schema (`fleet.answer`) and the live jobs on a
node (`fleet.jobs`) are the core's: bring-up reads them too.

Nothing is imported here: `import fleet.generation.data.inputs` must not pay for pyarrow or aiohttp.
"""
