"""The hot path: rows through the servers, each answer judged, each row written once.

    work.py         one row's requests in order (all-turns regeneration, gate retries) -> its result row
    client.py       one chat completion over aiohttp, its answer read up to a size cap (parsed by fleet.answer)
    dispatch.py     one queue, every healthy server pulls from it: the feeder, the workers, each answer's fate
    rowqueue.py     the queue (retries first) and the books: each row written exactly once, charged for its own failures
    hedge.py        backup requests at the tail and on a stall suspicion; the first answer wins
    health.py       each server's health: admission, down / relaunch / readmit, the stall watchdog, the tail rule
    serverstate.py  what is known of one server: endpoint, state, counters, row times, timeline
    probes.py       the HTTP checks health makes (/health, /v1/models, /health_generate, server info, metrics)
    promtext.py     the Prometheus text an engine's /metrics answers, read into token counters
    tokens.py       tokens generated so far, rows in flight included: the rate and the ETA of any row length

May import: the core and generation.data; nothing of job or multinode (tests/test_layers.py).
"""
