"""The run record: everything a run commits to storage, and how it is written, found, checked and resumed.

One component a file, read in this order (each imports only those above it):
  counts.py      the `io` record of a stage attempt (bytes moved, by kind), this machine's cache folder
  digests.py     every file hashed once: as written, and by stamp in this process and across processes
  io.py          the counted filesystem every storage access goes through; many files up or down at once
  identity.py    what a stage's identity covers, each config field decided once
  storage.py     the facade over fsspec, a stage's attempts, their manifests, verifying what is read
  pins.py        the datasets a run is pinned to: each one's fingerprint at grpo init, checked on every read
  layout.py      where a run lives in storage, the order of its stages, the seeds they draw from
  liveness.py    heartbeats: whether an attempt's writer is alive (gc, placement, the state commit ask here)
  commit.py      StageWriter: a new attempt, its files, the manifest written last
  lineage.py     which attempt is current, what is stale, where a run resumes, which policy samples what
  reward_files.py  the reward files a run scores with: its base's copies, or a fork's own after a fix
  fork.py        runs that start from another's committed history, by reference
  weights.py     a checkpoint folder as a transformers model: its own architecture, weights in and out through
                 transformers (key conversions, the hub's layout), whether its files fit its config
  checkpoint.py  HF-format checkpoints in storage: upload a folder, get a local folder to load
  dispatches.py  when the orchestrating flow sent each placed stage off (`grpo timeline`'s start-up)
  resume.py      the learner's resume state, committed after its policy in the background

A stage's output is committed by a manifest written last; nothing here imports a stage, the learner or Prefect.
"""
