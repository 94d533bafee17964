"""Defaults shared by every experiment config. Each field says its unit or meaning.

Experiment files (`textcraft_synth.py`, ...) call `base_config()` and change what differs, so
tests that derive their configs from these files exercise what users run.
"""
from ml_collections import config_dict


def parse_arg(arg: str | None) -> dict[str, str]:
  """Parses a config argument such as "recursive,ctx=8192,smoke" into a dict.

  Bare words become {word: "1"}; `key=value` pairs are kept as strings.
  """
  out = {}
  for part in (arg or "").split(","):
    part = part.strip()
    if not part:
      continue
    key, _, value = part.partition("=")
    out[key.strip()] = value.strip() if value else "1"
  return out


def base_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.seed = 0                         # root seed: task sampling, sampling RNG, init
  c.compile_cache = "auto"           # persistent XLA compilation cache: "auto" (the user cache
                                     # folder, ~/.cache/rao_jax/xla), a folder, or "" (off)
  c.warmup = True                    # compile the engine's and learner's shapes before step 1
  c.total_steps = 100                # RL steps (one learner update per step)

  c.model = config_dict.ConfigDict()
  c.model.name = "smollm2-135m"      # registry name, GGUF file, or HF checkpoint folder
  c.model.dtype = "auto"             # "auto": float32 on CPU, bfloat16 on GPU/TPU
  c.model.remat = "auto"             # learner activation checkpointing: auto (the least
                                     # recompute the memory plan fits) | none | dots | full
  c.model.kernels = "auto"           # CPU products and attention: auto (MKL on Intel CPUs) |
                                     # mkl (any x86 CPU) | xla (ModelConfig.kernels)
  # LoRA adapters (rao_jax.model.lora): rank 0 trains every parameter (full fine-tuning); rank
  # r > 0 trains an adapter of rank r on the targets and freezes the base model.
  c.model.lora = config_dict.ConfigDict()
  c.model.lora.rank = 0
  c.model.lora.alpha = 32.0          # the update is alpha / rank * A B
  c.model.lora.targets = "q,k,v,o,gate,up,down"
  c.model.lora.dropout = 0.0

  c.env = config_dict.ConfigDict()
  c.env.name = "textcraft_synth"     # textcraft | textcraft_synth | longcontext | search
  c.env.train_difficulty = "medium"  # difficulty of training tasks
  c.env.eval_difficulties = ("medium", "hard")   # held-out evaluation sets
  c.env.train_seed = 1               # task generator seed for training tasks
  c.env.val_tasks = 0                # the last N train tasks: a validation split that RL and
                                     # demonstrations never draw (what a recipe is chosen on)
  c.env.val_difficulty = ""          # the validation tasks' difficulty ("": train_difficulty)
  c.env.eval_seed = 2                # sampling seed of held-out evaluation (when
                                     # agent.eval_temperature > 0); held-out tasks are the
                                     # environment's fixed test split
  c.env.kwargs = config_dict.ConfigDict()        # environment-specific options
  # A JSONL task file per split (the RAO authors' format for TextCraft); "" = the environment's
  # own tasks. The held-out split of every environment is "test".
  c.env.task_files = config_dict.ConfigDict({"train": "", "test": ""})

  c.agent = config_dict.ConfigDict()
  c.agent.mode = "recursive"         # "recursive" (launch_subagent) | "single" (baseline)
  c.agent.context_window = 8192      # tokens per agent (prompt + generated + observations)
  c.agent.max_depth = 4              # recursion depth limit (root = 0)
  c.agent.max_steps_per_agent = 10   # REPL turns per agent
  c.agent.tree_step_budget = 200     # REPL turns per tree (caps each task's own budget),
                                     # children reserve from it; 0 = the task's budget only
  c.agent.max_live_agents = 16       # concurrent agents per tree
  c.agent.max_new_tokens = 512       # tokens per generated turn
  c.agent.stop_at_cell_close = True  # a turn ends where its code cell closes (stop strings)
  c.agent.temperature = 1.0          # rollout sampling temperature (learner uses the same)
  c.agent.top_p = 1.0
  c.agent.eval_temperature = 0.0     # greedy evaluation

  c.rl = config_dict.ConfigDict()
  c.rl.group_size = 8                # K trees per task (leave-one-out baseline needs K >= 2)
  c.rl.tasks_per_step = 4            # root tasks per RL step
  c.rl.lam = 0.5                     # delegation bonus lambda of RAO_SPEC
  # The paper's credit-assignment ablations (RAO is the default of each):
  c.rl.advantage = "node"            # "node": A(v) = R(v) - b_k | "tree": root's A for all
  c.rl.train_nodes = "all"           # "all" nodes in the loss | "root": roots only
  c.rl.depth_weights = True          # inverse-frequency depth weights | False: w = 1
  c.rl.bonus = "rate"                # delegation bonus on the "rate" | "count" of good children
  # The baseline b_k (RAO_SPEC): "loo_success": leave-one-out mean of the other roots' success
  # s(r_j), on a leaf's scale (default) | "loo": of their R, the paper's (with lam > 0 it charges
  # every successful leaf of an all-success group -lam) | "group_mean": mean of all K roots' R
  c.rl.baseline = "loo_success"
  c.rl.drop_equal_groups = True      # groups whose roots got equal rewards contribute nothing
  c.rl.update_without_signal = False # True: step even when no node has an advantage (KL alone)
  c.rl.node_rewards = "dense"        # "dense": s(v) per node | "root": s(root) for every node
  c.rl.pass_through_gate = False     # True: R = 0 for a node that only forwards its own goal
  c.rl.child_keep_prob = 1.0         # children kept in the learner batch (roots always)
  c.rl.loss = "rao"                  # rao | token_sum | ppo_clip | cispo
  c.rl.clip_eps = 0.2                # ppo_clip epsilon
  c.rl.cispo_ratio_max = 5.0         # cispo: the importance ratio is clipped to [0, this]
  c.rl.tis_cap = 0.0                 # rollout correction (rao/token_sum): token weights
                                     # min(pi_learner/pi_rollout, this); 0 = off, e.g. 2.0
  c.rl.kl_coef = 0.0                 # KL penalty to the initial policy (0 = off)
  c.rl.overlap = False               # overlap next step's rollouts with this update (1 off-policy)
  c.rl.max_staleness = 1             # with overlap: max weight versions a sample may lag
  c.rl.max_nonfinite_steps = 3       # non-finite updates in a row (each skipped) that stop the run
  c.rl.infra_retries = 1             # re-runs of a tree whose engine / sandbox failed; then it
                                     # is left out of its group's baseline and the loss
  c.rl.rollout_deadline_s = 0.0      # seconds per step's rollouts, then trees are cut; 0 = none
  c.rl.deadline_rule = "unfinished"  # cut trees: "unfinished" (scored as they stand) |
                                     # "drop_group" (their groups leave the batch)
  c.rl.task_weights = ""             # "FIELD:VALUE=WEIGHT,...": draw matching train tasks
                                     # WEIGHT times as often ("": uniform)

  c.judge = config_dict.ConfigDict()  # success of nodes no verifier covers (else the proxy)
  c.judge.train = "none"             # none | rule (finished with an answer) | model (LLM judge)
  c.judge.eval = "none"              # the same choice for in-loop evaluation
  c.judge.url = ""                   # model judge endpoint; "" = the policy's own engine
  c.judge.api = "openai"             # endpoint API: openai | sglang

  c.optim = config_dict.ConfigDict()
  c.optim.lr = 1e-5                  # peak AdamW learning rate
  c.optim.warmup_steps = 5           # linear warm-up steps
  c.optim.weight_decay = 0.0
  c.optim.grad_clip = 1.0            # global-norm clip
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95

  c.learner = config_dict.ConfigDict()
  c.learner.row_len = 0              # tokens per packed row; 0 = the agent's context window
                                     # (a node never exceeds it, so every node fits a row)
  c.learner.micro_batch_rows = 4     # rows per micro-batch (gradient accumulation over them)
  c.learner.bucket_rows = ()         # row counts a batch is padded to (each compiles once);
                                     # () = micro x (1, 4, 16, 64)
  c.learner.mesh = "auto"            # "auto" (all devices on data) or e.g. "data=2,fsdp=4,tensor=1"
  c.learner.share_prefix_min = -1    # nodes of a row sharing >= this many prompt tokens compute
                                     # them once; -1 = 64 on CPU, off on GPU/TPU; 0 = off

  c.rollout = config_dict.ConfigDict()
  c.rollout.engine = "embedded"      # embedded | sglang
  c.rollout.urls = ()                # SGLang worker URLs (engine=sglang)
  c.rollout.api_key_env = "RAO_JAX_API_KEY"  # environment variable holding the servers'
                                     # --api-key (engine=sglang; unset = none); the key itself
                                     # never enters the config
  c.rollout.retry_timeout = 120.0    # engine=sglang: seconds a request retries after a failure;
                                     # every server down this long stops the run (checkpoint)
  c.rollout.health_interval = 1.0    # engine=sglang: seconds between health checks of a server
                                     # marked down (it gets work again once re-synced)
  c.rollout.num_slots = 32           # embedded engine: concurrent sequences
  c.rollout.max_cache_len = 8192     # embedded engine: longest KV cache (tokens)
  c.rollout.share_prefix_min = 32    # embedded engine: copy another slot's KV for a common
                                     # prompt prefix this long (the system prompt); 0 = off
  # Any other field of the embedded engine's EngineConfig (rao_jax/rollout/engine/config.py:
  # page_size, num_pages, chunk_sizes, prefill_rows, decode_rows, cache_lens, decode_steps, ...);
  # unset fields keep EngineConfig's defaults, the one set of engine defaults.
  c.rollout.embedded = config_dict.ConfigDict()

  c.sandbox = config_dict.ConfigDict()
  c.sandbox.isolation = "bwrap"      # bwrap | process (weaker, only when asked for)
  c.sandbox.pool_size = 16           # pre-started sandboxes
  c.sandbox.cell_timeout_s = 30.0    # wall-clock per REPL cell

  c.ckpt = config_dict.ConfigDict()
  c.ckpt.every = 10                  # save every N steps (and at the end, and on SIGTERM)
  c.ckpt.keep = 3                    # checkpoints kept
  c.ckpt.init_from = ""              # a checkpoint dir to start from (e.g. an SFT run)

  c.eval = config_dict.ConfigDict()
  c.eval.every = 25                  # evaluate every N steps (and at the end); 0 = never
  c.eval.num_tasks = 16              # held-out tasks per difficulty
  c.eval.split = "test"              # "test": held-out tasks | "val": the validation split
  c.eval.num_html_trees = 4          # trees rendered to HTML at each evaluation
  # Stop training once an in-loop evaluation reaches this success on every evaluated set
  # (0 = never). At 1.0 with the checkpoint chosen as the earliest best evaluation (a
  # validation split), no later step could be chosen: the steps after it would be spent for
  # nothing. A resumed run whose metrics already show it trains no further.
  c.eval.stop_at_success = 0.0

  c.log = config_dict.ConfigDict()
  c.log.tensorboard = True
  c.log.progress = True              # progress bar on stderr

  c.sft = config_dict.ConfigDict()
  c.sft.steps = 100                  # supervised steps
  c.sft.num_demos = 256              # demonstration trees (scripted policy / gold trajectories)
  c.sft.lr = 5e-5
  c.sft.trees_per_step = 8           # demonstration trees per supervised step
  c.sft.warmup_steps = 0             # linear LR warm-up of the supervised run
  c.sft.scripted_style = "plan"      # TextCraft demonstrations: plan | program (agent/policies.py)
  return c


# Subtrees whose keys belong to the environment or to a split, not to the code reading them.
FREE_FORM = ("env.kwargs", "env.task_files", "rollout.embedded")


def check_keys(config) -> None:
  """Rejects a key `base_config()` does not know (a typo would otherwise be silently ignored).

  Raises:
    ValueError: naming the unknown key and the valid keys of its section.
  """
  def walk(cfg, ref, prefix):
    for key in cfg.keys():
      path = f"{prefix}{key}"
      if path in FREE_FORM:
        continue
      if key not in ref:
        valid = sorted(ref.keys())
        raise ValueError(f"config.{path} is not a known setting; valid keys of "
                         f"{'config.' + prefix.rstrip('.') if prefix else 'config'}: {valid}.")
      sub, sub_ref = cfg[key], ref[key]
      if isinstance(sub_ref, config_dict.ConfigDict):
        if not hasattr(sub, "keys"):
          raise ValueError(f"config.{path} must be a section with keys {sorted(sub_ref.keys())}, "
                           f"got {sub!r}.")
        walk(sub, sub_ref, path + ".")
  walk(config, base_config(), "")


def env_config(env_name: str, args: dict[str, str], default_ctx: int):
  """The base config for an environment without difficulty levels (one "all" split).

  Reads the common arguments: `single` | `recursive`, `ctx=N`, and `smoke` (the CPU variant).
  """
  c = base_config()
  c.env.name = env_name
  c.agent.mode = "single" if "single" in args else "recursive"
  c.agent.context_window = int(args.get("ctx", default_ctx))
  c.rollout.max_cache_len = c.agent.context_window
  if "smoke" in args:
    smoke(c)
  c.env.train_difficulty = "all"
  c.env.eval_difficulties = ("all",)
  return c


def smoke(c) -> None:
  """A laptop-CPU variant that exercises every stage in about a minute."""
  c.total_steps = 2
  c.env.train_difficulty = "easy"
  c.env.eval_difficulties = ("easy",)
  c.agent.context_window = min(c.agent.context_window, 2048)
  c.rollout.max_cache_len = c.agent.context_window
  c.agent.max_new_tokens = 384          # the scripted demonstrations' longest turn fits
  c.agent.max_steps_per_agent = 6
  c.agent.max_depth = 2
  c.rl.group_size = 2
  c.rl.tasks_per_step = 2
  c.learner.micro_batch_rows = 1        # CPU: one row per micro-batch keeps memory small
  c.rollout.num_slots = 8
  c.sandbox.pool_size = 4
  c.ckpt.every = 1
  c.eval.every = 2
  c.eval.num_tasks = 2
  c.eval.num_html_trees = 2
