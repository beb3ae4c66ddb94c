"""The episode engine: multi-turn rollouts where the policy calls tools or acts in an environment; every response in
flight is an episode (a single-turn response: one without an environment, whose loop is the sampler's one call).

One component a file, read in this order:
  environment.py      the one interface the loop knows (an environment adapter: tools, reset, respond, final,
                      close) and what passes through it (ToolCall, Reply)
  adapters.py         which adapter a run's config names (Source: plain values a worker builds it from), the
                      registry of adapter kinds
  calls.py            running a tool call: its time limit, its result as the observation, its error
  tools.py            adapter: plain Python functions as tools (TRL's `tools=`), schemas from their hints
  trl_environment.py  adapter: a TRL `environment_factory` class, unchanged (reset(**row), public methods are tools)
  openenv.py          adapter: a gym-style reset/step server through OpenEnv's client
  parsing.py          tool calls parsed from an assistant turn (the tokenizer's response template, or Qwen's
                      `<tool_call>{json}</tool_call>`)
  templates.py        a prompt as the model sees it: the chat template's text (with the tools), or text as it is;
                      tokenized for the sampler (every rollout's and eval's prompt, an episode's or not)
  chat.py             the chat template's tokens: a prompt with its tools, an observation's ids rendered as a delta
  workers.py          where adapters live: one per episode in a worker process (time limits, memory cap,
                      no credentials, processes reaped), deaths named
  records.py          what an episode leaves: its tokens, loss mask, log-probs and versions, its turns, its end;
                      the rows of the rollouts, turns and episodes tables
  loop.py             the episode loop: a turn sampled for every live episode at once, answered, appended, until
                      each ends (or, with rollout.segment_tokens, has sampled B tokens); token in, token out, the
                      loss mask and the turns; a carried episode's environment re-created by replay
  carry.py            an episode carried across iterations: what the carried table's `episode` column holds
  transcripts.py      a written conversation (a warm start's) as an episode's tokens and loss mask, appended as the
                      loop appends them
"""
