"""The learner's state between steps and iterations: the policy (LoRA adapters where set), AdamW, the
shuffling RNG and the frozen reference; built from checkpoint folders, saved to one, moved between devices."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from grpo.config import RunConfig
from grpo.devices import learner_device
from grpo.learner import sharding
from grpo.learner.batch import Batch
from grpo.learner.loss import loss_spec
from grpo.learner.model import PolicyLM, score
from grpo.learner.precision import autocast_precision
from grpo.record.checkpoint import checkpoint_dtype
from grpo.record.digests import hashed_writer
from grpo.record.layout import STATE_DCP
from grpo.record.weights import load_model, text_only

MASTER_WEIGHTS = "master.safetensors"  # float32 weights, written when the checkpoint's dtype is narrower


ADAPTER_DIR = "adapter"  # a LoRA learn's policy: peft's adapter files (the base is the run's base model)


def optimizer_steps(opt) -> int:
    """Optimizer steps taken over the whole run: AdamW's own count, carried in optimizer.pt."""
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return max(steps, default=0)


class Learner:
    """The policy being trained (float32 master weights, or frozen base + float32 LoRA adapters), its
    AdamW state, the shuffling RNG and the frozen reference (loaded only when learn.kl_coef > 0: nothing
    else reads it; with LoRA it is the base with the adapters switched off, no second copy; the base, or
    with learn.ref_update_every a snapshot, swapped by use_reference).

    Built from checkpoint folders (and the previous iteration's optimizer.pt or dcp/, rng.pt and master
    weights); a warm run keeps it in memory for the next iteration instead, which then trains exactly as
    one built from the committed files would. learn.sharding=fsdp2 shards it across processes
    (grpo.learner.sharding); the same code runs on every process.
    """

    def __init__(
        self,
        cfg: RunConfig,
        policy_dir: str,
        ref_dir: str,
        state_dir: str | None,
        shuffle_seed: int,
        adapter_dir: str | None = None,
    ):
        from accelerate import Accelerator

        self.cfg = cfg
        self.loss = loss_spec(cfg)  # the loss the math computes: names and floats, made once
        lcfg = cfg.learn
        # mixed precision by torch.autocast, not Accelerator(mixed_precision=...): Accelerate's state is one per
        # process and refuses a second setting, and a warm process may serve runs with either. Its device is one per
        # process too: an in-process learner goes to learn.device itself (Accelerate places nothing), a torchrun
        # rank to the GPU of its local rank (Accelerate's)
        self.acc = Accelerator(cpu=not torch.cuda.is_available(), device_placement=False)
        self.device = self.acc.device if self.acc.num_processes > 1 else learner_device(lcfg)
        self.precision = dict(zip(("autocast", "why"), autocast_precision(lcfg.mixed_precision, self.device)))
        self.save_dtype = checkpoint_dtype(ref_dir)  # checkpoints keep the base model's dtype
        self.sharded = lcfg.sharding == "fsdp2"
        self.lora = lcfg.lora is not None
        # LoRA: the base is frozen and stays in its own dtype; only the adapters (float32) train. A multimodal
        # checkpoint loads whole (its vision tower saved again with the policy) and trains its language model
        lm = load_model(policy_dir, self.save_dtype if self.lora else torch.float32)
        text_only(lm)
        if not self.lora and state_dir and Path(state_dir, MASTER_WEIGHTS).exists():  # the last update, unrounded
            import safetensors.torch

            safetensors.torch.load_model(lm, f"{state_dir}/{MASTER_WEIGHTS}")
        if lcfg.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            lm = with_adapter(lm, lcfg.lora, adapter_dir, seed=shuffle_seed)
        model = PolicyLM(
            lm,
            lcfg.logprob_chunk,
            full_sequences_in_training=lcfg.gradient_checkpointing,
            padding_free=lcfg.padding_free,
            logprob_kernel=lcfg.logprob_kernel,
        )
        world, device = self.acc.num_processes, self.device
        shard = self.sharded and world > 1
        self.ref, self.ref_dir = None, None
        self.use_reference(ref_dir)
        model.to(device)  # before AdamW's state loads: it follows its parameters' device
        if shard:
            sharding.fully_shard_policy(model, world, device)
        # fused: one kernel for all parameters (4x faster steps on CPU for small models)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=lcfg.lr, betas=lcfg.betas, weight_decay=lcfg.weight_decay, fused=True)
        self.shuffle = torch.Generator().manual_seed(shuffle_seed)
        if state_dir:  # continue exactly where the previous iteration ended
            if Path(state_dir, STATE_DCP).exists():  # sharded state, written at any world size
                sharding.load_state(model, opt, f"{state_dir}/{STATE_DCP}", trainable_only=self.lora)
            else:
                opt.load_state_dict(torch.load(f"{state_dir}/optimizer.pt", weights_only=True, map_location="cpu"))
            self.shuffle.set_state(torch.load(f"{state_dir}/rng.pt", weights_only=True)["shuffle"])
        if self.sharded:  # no DDP wrapper: FSDP2 (or, on one process, nothing) averages the gradients
            self.model, self.opt = model, opt
        else:
            self.model, self.opt = self.acc.prepare(model, opt)

    def use_reference(self, ref_dir: str) -> None:
        """Make the checkpoint in ref_dir the frozen reference, loading it unless it is the one held (a warm
        learner's moves with learn.ref_update_every). Only with kl_coef > 0 and no LoRA is there a model to
        load: LoRA's reference is the base with the adapters off."""
        lcfg, world, device = self.cfg.learn, self.acc.num_processes, self.device
        if lcfg.kl_coef == 0 or self.lora or ref_dir == self.ref_dir:
            return
        self.ref = None  # the old reference goes before the new one loads
        ref = load_model(ref_dir, torch.float32).requires_grad_(False)
        ref = PolicyLM(ref, lcfg.logprob_chunk, padding_free=lcfg.padding_free, logprob_kernel=lcfg.logprob_kernel)
        self.ref = ref.eval().to(device)
        if self.sharded and world > 1:
            sharding.fully_shard_policy(self.ref, world, device)
        self.ref_dir = ref_dir

    def autocast(self):
        """The forwards' precision: bf16 autocast where learn.mixed_precision resolves to bf16, else as the
        weights."""
        bf16 = self.precision["autocast"] == "bf16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)

    def reference_scores(self, batch: Batch, chunk_groups: int) -> Tensor | None:
        """The frozen reference's log-probs (N, T); None without a KL penalty."""
        if self.cfg.learn.kl_coef == 0:
            return None
        if self.ref is not None:
            return score(self.ref, batch, chunk_groups)
        policy = self.acc.unwrap_model(self.model)
        with policy.adapter_disabled():  # LoRA: the base model is the reference
            return score(policy, batch, chunk_groups)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients' global norm to max_norm; returns the norm before clipping."""
        if not self.sharded:
            return float(self.acc.clip_grad_norm_(self.model.parameters(), max_norm))
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return sharding.total_norm(torch.nn.utils.clip_grad_norm_(trainable, max_norm))

    def to(self, device) -> None:
        """Move the model, the reference and AdamW's state (off the GPU while a sampler uses it; back to
        `self.device`)."""
        for module in (self.acc.unwrap_model(self.model), self.ref):
            if module is not None:
                module.to(device)
        for state in self.opt.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    state[k] = v.to(device)
        if device == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def save(self, out_dir: str, state_dir: str | None = None, shards: bool = True) -> None:
        """Every process calls this. Into the local folder out_dir: policy/ (HF checkpoint in the base
        model's dtype) or, with LoRA, adapter/ (peft's adapter_model.safetensors + adapter_config.json).
        Into state_dir (out_dir where None): the optimizer state (optimizer.pt, or dcp/ with every process's
        shards under fsdp2, unless `shards` is False: save_shards writes them later); rng.pt; and, when the
        checkpoint's dtype is narrower than float32 and nothing else keeps them, the float32 master weights
        (master.safetensors)."""
        out, policy = Path(out_dir), self.acc.unwrap_model(self.model)
        held = Path(state_dir or out_dir)
        held.mkdir(parents=True, exist_ok=True)
        main = self.acc.is_main_process
        state = sharding.full_state_dict(policy, trainable_only=self.lora) if self.sharded else None
        if main and state is not None:  # gathered whole: a tied weight comes back once per name
            aliases = _aliases(policy)
            state = {k.removeprefix("lm."): v for k, v in state.items() if k not in aliases}
        if main:
            (self._save_adapter if self.lora else self._save_policy)(policy.lm, state, out, held)
        if self.sharded and shards:
            self.save_shards(held)
        elif main and not self.sharded:
            with hashed_writer(held / "optimizer.pt") as f:  # its commit lists it without reading it back
                torch.save(self.opt.state_dict(), f)
        if main:
            with hashed_writer(held / "rng.pt") as f:
                torch.save({"shuffle": self.shuffle.get_state(), "torch": torch.get_rng_state()}, f)

    def save_shards(self, state_dir: str | Path) -> None:
        """Every process (fsdp2) writes its shards of the float32 weights and AdamW state into state_dir/dcp/."""
        policy = self.acc.unwrap_model(self.model)
        sharding.save_state(policy, self.opt, Path(state_dir) / STATE_DCP, trainable_only=self.lora)

    @staticmethod
    def _save_adapter(lm, state: dict | None, out: Path, held: Path) -> None:
        """adapter/: the trained adapters alone (megabytes), loadable on the base with peft."""
        config = lm.peft_config["default"]
        config.base_model_name_or_path = None  # a local cache path: not part of the policy
        if isinstance(config.target_modules, set):  # peft's set: its order (and the file's bytes) varies by process
            config.target_modules = sorted(config.target_modules)
        lm.save_pretrained(out / ADAPTER_DIR, state_dict=state)
        (out / ADAPTER_DIR / "README.md").unlink(missing_ok=True)  # peft's model-card template

    def _save_policy(self, lm, state: dict | None, out: Path, held: Path) -> None:
        """policy/: every weight in the base model's dtype, tied weights saved once (and into `held` the float32
        master weights where that dtype is narrower)."""
        from safetensors.torch import save_model

        if self.save_dtype == torch.float32:
            lm.save_pretrained(out / "policy", safe_serialization=True, state_dict=state)
            return
        source = lm.state_dict() if state is None else state
        cast: dict[int, torch.Tensor] = {}  # one copy per storage: tied weights stay tied (saved once)
        narrow = {k: cast.setdefault(v.data_ptr(), v.to(self.save_dtype)) for k, v in source.items()}
        lm.save_pretrained(out / "policy", safe_serialization=True, state_dict=narrow)
        config = json.loads((out / "policy/config.json").read_text())
        config["dtype"] = str(self.save_dtype).removeprefix("torch.")
        (out / "policy/config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if state is None:  # sharded: dcp/ holds the float32 weights
            save_model(lm, str(held / MASTER_WEIGHTS))


def _aliases(module: torch.nn.Module) -> set[str]:
    """Names of parameters that are another name's parameter (tied weights), all but the first."""
    first: dict[int, str] = {}
    return {n for n, p in module.named_parameters(remove_duplicate=False) if first.setdefault(id(p), n) != n}


def with_adapter(lm, lora, adapter_dir: str | None, seed: int):
    """`lm` with LoRA adapters (peft): those of adapter_dir, trainable, or new ones (A drawn from `seed`,
    B zero: the policy starts as the base). lora: grpo.config.LoraConfig."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    if adapter_dir:
        return PeftModel.from_pretrained(lm, adapter_dir, is_trainable=True)
    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(lm, peft_config)
