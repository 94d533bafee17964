"""Environments: tasks, tools, per-tree world state, child mapping and verifiers.

`base` defines the interface the agent runtime drives (`Environment`, `Task`, `Episode`,
`ChildSpec`, `NodeOutcome`, `Judge`). Implementations: `textcraft` (Minecraft recipes),
`textcraft_synth` (generated deep crafting worlds), `longcontext` (OOLONG-style aggregation),
`search` (DeepDive-style multi-hop search); `judge` is the LLM judge and `registry` builds an
environment by name. Submodules are imported on demand so that importing one environment
does not load the others' data.
"""
