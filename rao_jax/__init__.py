"""rao_jax: Recursive Agent Optimization (RAO) in JAX.

One policy, instantiated at every node of an execution tree that it grows itself through
``await launch_subagent(...)``, trained with a depth-weighted leave-one-out policy gradient
(see RAO_SPEC in the project docs).

Package map (dependencies point downwards only):

    trainer          the RL loop: tasks -> trees -> rewards -> learner step -> sync -> eval -> ckpt
    experiment       a config -> the typed parts of a run, once (``assemble``, for the trainer)
    run_parts        those parts: RunParts, RLConfig, engine and judge specs, initial weights
    collection       a step's rollouts: K trees per task under the fault rules, progress, the
                     exchange of trees between processes
    agent/           tree runner, node loop, prompts, code extraction, tree records, HTML view
    envs/            TextCraft, TextCraft-Synth, long-context aggregation, multi-hop search, judge
    learner/         rewards + LOO + depth weights, packing, losses, jitted sharded step, checkpoints
    rollout/         engine interface, embedded JAX engine, SGLang client and server
    sandbox_host/    host side of the isolated REPL (pool, fd protocol, tool forwarding)
    model/           Llama-family NNX model, weights (GGUF, HF), tokenizer, sharding rules

Dimension legend, used in array names (``logits_BxTxV``) and einsum strings everywhere:

    B  batch (rows)               T  time / sequence positions    S  KV-cache length
    D  model width                F  MLP hidden width             V  vocabulary
    H  query heads                K  key/value heads              h  head dim
    L  layers                     G  group size (trees per task)  N  tree nodes in a batch
"""

__version__ = "0.1.0"

# Importing the package changes nothing in the process. Where XLA:CPU computes, entry points
# call rao_jax.host_memory.keep_freed_memory() before JAX starts its threads (malloc keeps
# freed blocks for the next step instead of re-faulting them from the OS).
