"""The data layer of generation: rows in, results out, and the records of a job (no network, no orchestrator).

    inputs.py   stream JSONL / JSONL.gz / Parquet rows -> Request | Reject (ids, defaults, duplicates)
      rows.py       Request, Reject, InputStats; content ids and id digests
      rowshapes.py  the three row shapes -> messages and params; every check that rejects a row; defaults
      sources.py    JSONL (plain, gzip) and Parquet readers; the errors of a corrupt or truncated input
      resume.py     a planned resume: the lines still to run, from the ids alone
    store.py    ResultStore: exactly-once results keyed by id, atomic Parquet shards, resume
      schema.py     the result row's Arrow schema; a row's values to it and back
      idset.py      IdSet: the ids done, 8-10 bytes each
      results.py    reading an output directory: shards, errors, rejects, quality rejects
      jobrecord.py  DIR/job.json: one directory, one input, one set of parameters (and how two differ)
      dirlock.py    DIR/.lock: one runner per directory
      jsonl.py, durable.py  the JSON codec (orjson) and JSON lines, fsync and atomic replace
    manifest.py manifest.json: a run's Summary and a pure builder from one run's facts; read and write
    export.py   openai-batch / jsonl / sharegpt / specforge / speculators files from a job's output
      trainerfiles.py  SpecForge's file set: the input row handed back, DEST_error / DEST_skipped lines
      trainerrules.py  what a drafter trainer refuses in a conversation (at input and at export)
    checks.py   data checks for drafter training sets; quality counts; the exactly-once accounting
    gates.py    per-answer quality gates (empty, missing reasoning, <think> left, cut, loops)
    plan.py     wall time and $ per M tokens of a job, before it runs
    objstore.py the Store seam: a local directory or an fsspec URL (s3://, gs://, hf://), files visible whole
      ranges.py     a JSONL input on object storage cut into byte ranges, read in place
      pin.py        the input's version pinned at plan time (ETag, VersionId, generation, commit; a file's stat)
      storeerrors.py  a store's refusals as one line with its cause and remedy, secrets masked

May import: the core (fleet.config, fleet.errors, …) and itself; nothing of hotpath, job or multinode
(tests/test_layers.py).
"""
