"""One job over several nodes: the chunk plan, the assignment state and the merge (Prefect-free).

A multi-node job is many ordinary single-node jobs. The input is cut once, at the job's start,
into chunks of whole input lines (JSONL) or rows (Parquet); each chunk is a file of its own,
run by the usual detached runner on one node into its own output directory, so exactly-once
within a chunk, resume, crash recovery and server relaunch are the single-node machinery's.
What is new lives here:

- `plan_sizes`: chunk sizes by *factoring* (guided self-scheduling): each round of one chunk
  per node takes half of what is left, between a floor and a ceiling. Early chunks are big (few
  runner starts), the last ones smaller. These are the sizes before any node's rate is known;
  they depend only on the row count, the node count and `chunk_rows`, and are written to
  `plan.json`: a re-run reads them back, never re-derives different ones.
- `chunk_rows_for` / `finishes_first`: once nodes' rates are measured, a node's next chunk is a
  few minutes of its work but at most its share of half of what is left (so the last chunks end
  together), and a slow node leaves a chunk to a faster one that would end it sooner.
  `Assignments.claim` cuts a longer first-time chunk to that size (`split_chunk`: the rest is a
  new chunk at the end of the plan, recorded as a line of the state log before the head's file
  changes; plan.json is rewritten at the log's compaction, and `load_plan` replays the cuts since).
- `split_input`: writes the chunk files (JSONL lines copied byte for byte, Parquet row slices
  with the input's schema) and the plan, atomically. A JSONL or Parquet input on object storage is
  read in place instead: its chunks are byte ranges (JSONL) or row ranges (Parquet) of it
  (`ranges.py`), and only plan.json is written. Without a --limit a JSONL input's ranges are cut
  from its size (`approx` chunks: estimated lines, each runner aligning its range by the split rule).
- `Assignments`: which chunk is pending, running where, done; which node is lost. Pull: a node
  asks for work when it has none (`claim`), so a faster node takes more chunks. Every change is a
  line appended (fsync'd) to `state.jsonl` before it is acted on, compacted now and then into the
  snapshot `state.json` (journal.py: O(1) bytes per change), so a killed controller loses
  nothing: the next one reads them and re-attaches to the runners they name. A job on object
  storage keeps a copy of the plan and the state under `<output>/_control/`: a controller on
  another machine resumes from there.
- `merge`: every chunk's output into one directory `fleet export` reads unchanged.

The merge rule (first wins, keyed by id): merge.py's docstring.

The code lives in four modules, their public names re-exported here (every `from
fleet.generation.multinode.chunks import …` holds): planning.py (plan_sizes, Chunk, Plan,
split_input, split_chunk, grow_plan, load_plan), sizing.py (chunk_rows_for, finishes_first,
busy_seconds), assignments.py (Attempt, ChunkState, Assignments, read_state, ControllerLock) and
merge.py (Source, merge, write_manifest_to).
"""

from __future__ import annotations

from fleet.generation.multinode.assignments import (  # noqa: F401
    BOOT_ID, Assignments, Attempt, ChunkState, ControllerLock, attempt_spans, read_state)
from fleet.generation.multinode.merge import Source, merge, write_manifest_to  # noqa: F401
from fleet.generation.multinode.planning import (  # noqa: F401
    PLAN_FILE, PLAN_VERSION, STATE_FILE, Chunk, Plan, apply_cut, grow_plan, input_id, load_plan, plan_dir_for,
    plan_sizes, split_chunk, split_input)
from fleet.generation.multinode.sizing import (  # noqa: F401
    CHUNK_TARGET_S, MIN_CHUNK_S, busy_seconds, chunk_rows_for, chunks_before, finishes_first)

__all__ = ["Chunk", "Plan", "Assignments", "attempt_spans", "plan_sizes", "split_input", "load_plan", "merge",
           "plan_dir_for", "PLAN_FILE", "STATE_FILE", "ControllerLock", "busy_seconds", "chunk_rows_for", "chunks_before", "finishes_first",
           "split_chunk", "apply_cut", "grow_plan", "CHUNK_TARGET_S", "MIN_CHUNK_S", "write_manifest_to", "read_state",
           "Attempt", "ChunkState", "Source", "BOOT_ID", "PLAN_VERSION", "input_id"]
