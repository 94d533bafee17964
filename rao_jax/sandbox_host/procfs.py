"""What the host reads of a sandbox's processes in /proc (Linux): thread states, pipe holders."""
from __future__ import annotations

import os


def threads_stopped(pid: int) -> bool:
  """Whether no thread of process `pid` can run (stopped, traced or dead; or it is gone)."""
  try:
    tids = os.listdir(f"/proc/{pid}/task")
  except OSError:
    return True  # gone: whoever reaps it reports how
  for tid in tids:
    try:
      with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
        stat = f.read()
    except OSError:
      continue  # this thread just exited
    # The state follows the command name, which may itself hold ') '.
    if stat[stat.rfind(b")") + 2:][:1] not in (b"T", b"t", b"Z", b"X"):
      return False
  return True


def state(pid: int) -> str:
  """The `State:` line of /proc/PID/status (e.g. "T (stopped)"), or "gone"."""
  try:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
      return next((line.split(":", 1)[1].strip() for line in f if line.startswith("State:")),
                  "unknown")
  except OSError:
    return "gone"


def pipe_holders(inode: int | None) -> list[int]:
  """Pids other than ours that hold the pipe `inode` open (a scan of every process's fds:
  slow path only)."""
  if inode is None:
    return []
  target = f"pipe:[{inode}]"
  mine = os.getpid()
  pids = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == mine:
      continue
    try:
      fds = os.listdir(f"/proc/{entry}/fd")
      if any(os.readlink(f"/proc/{entry}/fd/{fd}") == target for fd in fds):
        pids.append(int(entry))
    except OSError:
      continue
  return pids
