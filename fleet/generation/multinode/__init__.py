"""One job over several nodes: many single-node jobs (generation.job), one per chunk of the input.

    chunks.py      the chunk plan, the assignment state and the first-wins merge: the story, and its names re-exported
    planning.py    the plan: its sizes (factoring), plan.json, the input cut into chunks (files, or ranges in place)
    sizing.py      a node's next chunk from the measured rates; a slow node leaves a chunk to a faster one
    assignments.py which chunk is pending, running where, done (every change logged first); one controller a job
    merge.py       every chunk's output into one directory, first wins by id
    journal.py     the state on disk: a line per change (state.jsonl), a snapshot (state.json), a copy in the store
    controller.py  hands chunks to nodes, watches them, survives its own death (tasks/multinode.py wraps it)
    nodework.py    what the controller knows of each node: its counters, the rate view, its runner's liveness
    runchunk.py    one chunk attempt on one node: input put, runner started or re-attached, watched, collected
    jobend.py      the job's end: the merge of the counted attempts with its manifest and cost; `fleet fetch`
    cleanup.py     a finished object-storage job's working copies removed from its nodes (never a row not in the store)
    progress.py    the job's ETA (tokens, as a node's) and its console line, from the nodes' progress files
    nodecheck.py   each node's store check before a job (job/storecheck.py on the node), messages whole and masked
    quarantine.py  a node whose chunks fail is set aside, checked again, rejoins; the job fails when none is healthy
    fence.py       only a chunk's counted attempt adds to the output; a late node's runners stopped, its parts removed
    cost.py        the job's cost: each node's GPUs for the time the job held it

May import: the core and every other generation sub-package; nothing imports it but the CLI, tasks
and flows (tests/test_layers.py).
"""
