"""Flags shared by the entry points: multi-host initialisation."""
from absl import flags
from absl import logging

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for multi-host runs.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (0-based).")


def init_distributed() -> None:
  """Calls jax.distributed.initialize when multi-host flags are given; a no-op otherwise."""
  given = [f.value is not None for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)]
  if not any(given):
    return
  if not all(given):
    raise flags.ValidationError(
        "Multi-host runs need all three of --coordinator_address, --num_processes and "
        f"--process_id (got coordinator_address={_COORDINATOR.value!r}, "
        f"num_processes={_NUM_PROCESSES.value!r}, process_id={_PROCESS_ID.value!r}).")
  import jax  # pylint: disable=g-import-not-at-top
  jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                             num_processes=_NUM_PROCESSES.value,
                             process_id=_PROCESS_ID.value)
  logging.info("jax.distributed initialised: process %d of %d, %d global devices",
               jax.process_index(), jax.process_count(), jax.device_count())
