"""One job on one node: the detached runner and what starts, checks and watches it.

    runner.py     the detached process that ties input, dispatcher and store together (run_job's steps)
    nopandas.py   the runner process refuses pandas (pyarrow would import it for nothing)
    jobspec.py    JOB.json: the job, its servers, its config with the secrets from the environment
    relaunch.py   the job's servers on the runner's node: alive?, relaunch, healthy again
    progress.py   progress.json and the console line
    failures.py   Failure (cause + remedy) from any exception, the disk reserve, exit.json
    validate.py   the checks before anything starts: input, output, the job already there (plan_job)
    remote.py     start, watch, re-attach to and fetch a job on a node (the runner's zip and venv)
    follow.py     follow a runner to its end and record it (the generate task's and the quick re-attach's)
    endpoints.py  servers fleet did not start (`[[endpoints]]`) as the runner's entries, their keys
    publish.py    a runner whose job lives on object storage: its input staged, its commits put to the store
    storecheck.py a node proving, with its runner's environment, that it can read the input and write the output

Where a job's files live and which jobs are alive on a node is the core's (fleet/jobs.py), since
bring-up asks it too. May import: the core, generation.data and generation.hotpath; nothing of
multinode (tests/test_layers.py).
"""
