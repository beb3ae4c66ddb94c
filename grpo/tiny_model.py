"""A tiny causal LM and word-level tokenizer, built from configs (no downloads).

The saved folder loads with `AutoModelForCausalLM` / `AutoTokenizer` and with
vLLM. Every prompt is tokenized as `<bos> w1 w2 ...` by both, thanks to a
post-processor in the tokenizer itself rather than in either library.
"""

import dataclasses
import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

from grpo.config import ModelConfig
from grpo.tasks import get_task

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>"]
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(4)
# no qwen2: for model_type "qwen2" transformers 5 (so AutoTokenizer and vllm)
# swaps any tokenizer.json for its byte-level BPE, which drops our words
CONFIGS = {"llama": LlamaConfig}
# head sizes vllm's cpu attention backend supports (cpu_attn.py, vllm 0.32)
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ids 0..3 are the special tokens, then `words` in order."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for w in words:
        if not w or w != w.strip() or len(w.split()) != 1:
            raise ValueError(f"words must be single whitespace-free words, got {w!r}")
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # no decoder: tokenizers then joins tokens with single spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        clean_up_tokenization_spaces=False,  # keep "1 ," from becoming "1,"
    )


def tiny_config(vocab_size: int, model: ModelConfig):
    """HF config of the tiny `model.arch` model `model` describes; checks the head size vllm's cpu
    backend needs."""
    if model.arch not in CONFIGS:
        raise ValueError(f"unknown arch {model.arch!r}; valid archs: {', '.join(CONFIGS)}")
    if model.hidden_size % model.num_heads or model.hidden_size // model.num_heads not in HEAD_DIMS:
        raise ValueError(
            f"num_heads={model.num_heads} gives head_dim {model.hidden_size / model.num_heads:g} for "
            f"hidden_size={model.hidden_size}; vllm on cpu needs head_dim in {HEAD_DIMS}"
        )
    return CONFIGS[model.arch](
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_heads,
        intermediate_size=model.intermediate_size,
        max_position_embeddings=model.max_position_embeddings,
        # tied: a prompt token's embedding copied by attention raises that token's logit,
        # a prior that makes "repeat the prompt's numbers" easy to find by sampling
        tie_word_embeddings=model.tie_embeddings,
        initializer_range=model.initializer_range,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def build_tiny_model(out_dir: str, words: list[str], model: ModelConfig | None = None, seed: int = 0, **fields) -> str:
    """Save a randomly initialised tiny model of shape `model` (grpo.config.ModelConfig, the defaults'
    one place; `fields` replace some of its fields) and its tokenizer to `out_dir`.

    The same seed gives byte-identical `model.safetensors`. Returns `out_dir`.
    """
    model = dataclasses.replace(model or ModelConfig(), **fields)
    tokenizer = build_tokenizer(words)
    config = tiny_config(len(tokenizer), model)
    with torch.random.fork_rng(devices=[]):  # seed the init, leave the caller's rng alone
        torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    os.makedirs(out_dir, exist_ok=True)
    lm.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_for_task(
    out_dir: str,
    task_name: str,
    task_params: dict | None = None,
    model: ModelConfig | None = None,
    seed: int = 0,
    **fields,
) -> str:
    """`build_tiny_model` with the vocabulary of task `task_name`."""
    words = get_task(task_name, **(task_params or {})).words()
    return build_tiny_model(out_dir, words, model, seed, **fields)


# ---------------------------------------------------------------- a small chat model (the real path's shape)

CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's chat template, without tools: a system message when given, each turn in
# <|im_start|>role ... <|im_end|>, and the assistant's header as the generation prompt
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# Qwen2.5-Instruct's own chat template, tools included: the tools' JSON schemas in the system message, each call as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> in the assistant's turn, tool results as <tool_response>
# blocks in a user turn (the episodes' tests: grpo/episodes)
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\'
    'n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    "\n"
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and'
    ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-nam'
    'e>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful"
    " assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (m'
    'essage.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }"
    "}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def qwen2_pre_tokenizer():
    """Qwen2's pre-tokenizer: its regex (every digit a piece of its own, `\\p{N}`), then bytes."""
    from tokenizers import Regex
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_chat_tokenizer(
    texts: list[str], vocab_size: int = 512, chat_template: str = CHAT_TEMPLATE, split_digits: bool = False
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`, with Qwen's special tokens and chat template:
    eos `<|im_end|>`, pad `<|endoftext|>` (distinct from eos, as in Qwen2.5-Instruct). `split_digits`: trained on
    Qwen2's pre-tokens (`qwen2_pre_tokenizer`, one digit a token) instead of GPT-2's (digit runs merged)."""
    from tokenizers import decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = qwen2_pre_tokenizer() if split_digits else pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHAT_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=CHAT_SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast


def build_chat_model(
    out_dir: str,
    texts: list[str],
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    seed: int = 0,
    dtype: str = "float32",
    model_vocab_size: int | None = None,
    chat_template: str = CHAT_TEMPLATE,
    split_digits: bool = False,
) -> str:
    """Save a randomly initialised Qwen2 model (grouped-query attention) with a BPE tokenizer trained
    on `texts`, a chat template, and generation_config.json listing two eos ids (`<|im_end|>`,
    `<|endoftext|>`, like Qwen2.5). What a user's own HF checkpoint looks like, at toy size (or, with
    Qwen2.5-0.5B's shape, at its size: `model_vocab_size` pads the embedding past the tokenizer's
    vocabulary as Qwen's does; `dtype` is the saved weights'; `chat_template` TOOLS_CHAT_TEMPLATE for tools).

    `split_digits` trains the BPE on Qwen2's own pre-tokens, every digit apart, so tokenizer.json is the
    tokenizer every reader applies. transformers 5 loads a qwen2 folder through its Qwen2Tokenizer, which puts
    Qwen2's pre-tokenizer over whatever tokenizer.json says: digits are split when loaded either way, but without
    `split_digits` the vocabulary holds merges of digit runs (GPT-2's pre-tokens) no loaded tokenizer uses, and
    `tokenizers` reading tokenizer.json alone merges them. Off by default: the test models' vocabularies and
    bytes stay as they were (the golden identities of their runs)."""
    from transformers import Qwen2Config

    tokenizer = build_chat_tokenizer(texts, vocab_size, chat_template, split_digits)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=model_vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        dtype=dtype,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
