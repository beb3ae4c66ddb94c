"""The process a stage runs in: torch's CPU threads, the devices it trains and samples on, the processes it
starts and stops, and the library logs it keeps quiet.

  threads.py   torch's CPU threads in every grpo process (GRPO_THREADS)
  devices.py   which device the in-process learner and sampler use (learn.device, rollout.device)
  procs.py     process groups: starting children that can be reaped, stopping them
  quiet.py     third-party library logs kept quiet
"""
