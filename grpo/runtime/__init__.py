"""The process a stage runs in: torch's CPU threads, the processes it starts and stops (among them the worker pool
user code runs in), the library logs it keeps quiet, and the work it finishes before it exits.

  threads.py   torch's CPU threads in every grpo process (GRPO_THREADS)
  procs.py     process groups: starting children that can be reaped, stopping them
  secrets.py   credentials kept from user code (rewards, tools, environments), their values redacted from its output
  pool.py      the worker pool user code runs in (reward functions and environments alike: deaths named, hung jobs
               killed, printed output captured) and the warm pools kept between stages
  quiet.py     third-party library logs kept quiet
  exits.py     work finished as the main thread ends, before the interpreter stops thread pools (the one shim over
               a private API)
"""
