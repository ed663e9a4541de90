"""The simulated SGLang server: SGLang's endpoints and log lines, no GPU.

Modules, top to bottom: ``server`` (the entry point, ``main``; the package's overview),
``options`` (flags), ``startup`` (startup log lines), ``app`` (routes, probes, info,
metrics), ``generation`` (the generation endpoints), ``faults``, ``engine`` (slots, token
timing, the scheduler log), ``http_front`` (HTTP/1.1 on asyncio.Protocol), ``determinism``
(hashes and words), ``log``; ``bundle`` packs them into the one file a node runs.

Everything here imports only the standard library and ``fleet.sim`` itself: a node runs it
with a bare interpreter. Importing the package imports no module of it.
"""
