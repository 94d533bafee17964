"""What runs inside the jail: the REPL program (`repl.py`) and its protocol (`wire.py`).

Standard library only, never rao_jax: the host binds these two files read-only into each jail
(`/sandbox/`, see ../jail.py) and starts `repl.py` as a script; the host imports `wire` from
here. They ship inside the package so that an installed wheel runs cells like a checkout.
"""
