"""The process a stage runs in: torch's CPU threads, the processes it starts and stops, the library logs it keeps
quiet, and the work it finishes before it exits.

  threads.py   torch's CPU threads in every grpo process (GRPO_THREADS)
  procs.py     process groups: starting children that can be reaped, stopping them
  quiet.py     third-party library logs kept quiet
  exits.py     work finished as the main thread ends, before the interpreter stops thread pools (the one shim over
               a private API)
"""
