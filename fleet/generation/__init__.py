"""Batch generation across the fleet.

Data layer (no network, no orchestrator):

    inputs.py   stream JSONL / JSONL.gz / Parquet rows -> Request | Reject (ids, defaults, duplicates)
      rows.py       Request, Reject, InputStats; content ids and id digests
      rowshapes.py  the three row shapes -> messages and params; every check that rejects a row; defaults
      trainerrules.py  what SpecForge's conversation check refuses (input_rules = "specforge", the export)
      sources.py    JSONL (plain, gzip) and Parquet readers; the errors of a corrupt or truncated input
      resume.py     a planned resume: the lines still to run, from the ids alone
    store.py    ResultStore: exactly-once results keyed by id, atomic Parquet shards, resume
      schema.py     the result row's Arrow schema; a row's values to it and back
      idset.py      IdSet: the ids done, 8-10 bytes each
      results.py    reading an output directory: shards, errors, rejects, quality rejects
      jobrecord.py  DIR/job.json: one directory, one input, one set of parameters
      dirlock.py    DIR/.lock: one runner per directory
      jsonl.py, durable.py  the JSON codec (orjson) and JSON lines, fsync and atomic replace
    manifest.py manifest.json: a pure builder from one run's facts; read and write
    export.py   openai-batch / jsonl / sharegpt / specforge / speculators(-tokens) files from a job's output;
                flagged conversations left out of the trainer formats
      trainerfiles.py  the input row handed back (key order); SpecForge's _error / _skipped files
    checks.py   data checks for drafter training sets; quality counts; the exactly-once accounting
    gates.py    per-answer quality gates (empty, missing reasoning, <think> left, cut, loops)
    plan.py     wall time and $ per M tokens of a job, before it runs

Hot path (the data plane's runner):

    work.py     one row's requests in order (all-turns regeneration, gate retries) -> its result row
    client.py   one chat completion over aiohttp, its answer read up to a size cap
      answer.py   the strict chat-completion schema: any body -> a typed Answer, or the reason it is none
    dispatch.py one queue, every healthy server pulls from it: the feeder, the workers, each answer's fate
    rowqueue.py the queue (retries first) and the books: each row written exactly once, charged for its own failures
    health.py   each server's health: admission, down / relaunch / readmit, the stall watchdog, the tail rule
    serverstate.py  what is known of one server: endpoint, state, counters, row times, timeline
    probes.py   the HTTP checks health makes (/health, /v1/models, /health_generate, server info, metrics)
    runner.py   the detached process that ties input, dispatcher and store together (run_job's steps)
      jobspec.py    JOB.json: the job, its servers, its config with the secrets from the environment
      relaunch.py   the job's servers on the runner's node: alive?, relaunch, healthy again
      progress.py   progress.json and the console line
      failures.py   Failure (cause + remedy) from any exception, the disk reserve, exit.json

Nothing is imported here: `import fleet.generation.inputs` must not pay for pyarrow or aiohttp.
"""
