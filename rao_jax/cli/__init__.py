"""Console entry points, installed by the wheel (setup.py's console_scripts) as commands:

  rao-train     RL training                 (train.py;    python -m experiments.train)
  rao-evaluate  held-out evaluation         (evaluate.py; python -m experiments.evaluate)
  rao-sft       supervised warm start       (sft.py;      python -m experiments.sft)
  rao-serve     the SGLang-compatible server (rao_jax.rollout.serve)

`experiments/` of a checkout keeps `python -m experiments.<name>` as thin wrappers of these,
and holds the config files; the wheel installs no top-level `experiments` package. Config
files are given by path (`--config=PATH[:ARG]`), see common.py for how they import their
siblings.
"""
